// Counter-based dropout RNG: Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy
// as 1, 2, 3", SC'11 / Random123). Bit-identical to coconetc/interp/rng.py, on the host and on
// CUDA devices.
//
// A dropout decision is a pure function of (seed, site_key, idx, p):
//   counter   = (idx & 0xffffffff, idx >> 32, site_key, 0)   idx: global flat element index
//   key       = (seed & 0xffffffff, seed >> 32)                seed: int64 viewed as uint64
//   threshold = dropout_threshold(p)                           in [0, 2^24]
//   keep      = (philox4x32(counter, key).v[0] >> 8) >= threshold
#ifndef COCONET_RNG_H_
#define COCONET_RNG_H_

#include <cstddef>
#include <cstdint>

#ifndef COCONET_HD
#if defined(__CUDACC__)
#define COCONET_HD __host__ __device__
#else
#define COCONET_HD
#endif
#endif

namespace coconet {

struct Philox4 {
  uint32_t v[4];
};

constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;
constexpr int kPhiloxRounds = 10;

constexpr uint32_t kFnv1aOffset = 0x811C9DC5u;
constexpr uint32_t kFnv1aPrime = 0x01000193u;

// p >= 1 maps here; (out >> 8) < 2^24 always, so nothing is kept.
constexpr uint32_t kDropAll = 1u << 24;

namespace detail {

COCONET_HD inline void philox_mulhilo(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
#if defined(__CUDA_ARCH__)
  *hi = __umulhi(a, b);
  *lo = a * b;
#else
  const uint64_t p = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  *hi = static_cast<uint32_t>(p >> 32);
  *lo = static_cast<uint32_t>(p);
#endif
}

}  // namespace detail

// Philox4x32-10 of counter (c0, c1, c2, c3) under key (k0, k1).
COCONET_HD inline Philox4 philox4x32(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                     uint32_t k0, uint32_t k1) {
  for (int r = 0; r < kPhiloxRounds; ++r) {
    if (r > 0) {
      k0 += kPhiloxW0;  // unsigned: wraps mod 2^32
      k1 += kPhiloxW1;
    }
    uint32_t hi0, lo0, hi1, lo1;
    detail::philox_mulhilo(kPhiloxM0, c0, &hi0, &lo0);
    detail::philox_mulhilo(kPhiloxM1, c2, &hi1, &lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0;
    const uint32_t n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  Philox4 out;
  out.v[0] = c0;
  out.v[1] = c1;
  out.v[2] = c2;
  out.v[3] = c3;
  return out;
}

// 32-bit FNV-1a of the bytes of a NUL-terminated (UTF-8) string; usable in constant expressions.
COCONET_HD constexpr uint32_t site_key(const char* name) {
  uint32_t h = kFnv1aOffset;
  for (; *name != '\0'; ++name) {
    h ^= static_cast<uint32_t>(static_cast<unsigned char>(*name));
    h *= kFnv1aPrime;
  }
  return h;
}

// Same, for a byte range (need not be NUL-terminated).
COCONET_HD constexpr uint32_t site_key(const char* name, size_t len) {
  uint32_t h = kFnv1aOffset;
  for (size_t i = 0; i < len; ++i) {
    h ^= static_cast<uint32_t>(static_cast<unsigned char>(name[i]));
    h *= kFnv1aPrime;
  }
  return h;
}

// floor(p * 2^24) in double, clamped to [0, 2^24]. NaN maps to 0 (keep everything); the Python
// reference rejects NaN instead, since device code cannot report an error. Without branches (a
// value selected, the conversion always in range), so a dropout loop vectorizes (pointwise.h).
COCONET_HD inline uint32_t dropout_threshold(double p) {
  const double q = p > 0.0 && p < 1.0 ? p : 0.0;                     // NaN: 0
  const uint32_t below = static_cast<uint32_t>(q * 16777216.0);  // in [0, 2^24): truncation == floor
  return p >= 1.0 ? kDropAll : below;
}

// Word 0 of philox4x32(c0, c1, c2, c3, k0, k1), the word dropout uses, for the host's
// auto-vectorized loops: the same rounds with every 32-bit value held in a 64-bit lane, so a
// vectorized loop keeps 8 elements' state per 512-bit register and needs no packing of the
// products' high and low halves between rounds (on the CI machine's AVX-512 this takes a dropout
// loop from 2.8 to 1.9 ns an element); the last round computes only word 0.
inline uint32_t philox4x32_word0_host(uint32_t c0_, uint32_t c1_, uint32_t c2_, uint32_t c3_, uint32_t k0_,
                                      uint32_t k1_) {
  constexpr uint64_t kLow = 0xffffffffull;
  uint64_t c0 = c0_, c1 = c1_, c2 = c2_, c3 = c3_, k0 = k0_, k1 = k1_;
  for (int r = 0; r < kPhiloxRounds - 1; ++r) {
    const uint64_t p0 = c0 * kPhiloxM0, p1 = c2 * kPhiloxM1;  // < 2^64: both factors < 2^32
    const uint64_t n0 = (p1 >> 32) ^ c1 ^ k0, n2 = (p0 >> 32) ^ c3 ^ k1;
    c0 = n0;
    c1 = p1 & kLow;
    c2 = n2;
    c3 = p0 & kLow;
    k0 = (k0 + kPhiloxW0) & kLow;
    k1 = (k1 + kPhiloxW1) & kLow;
  }
  return static_cast<uint32_t>(((c2 * kPhiloxM1) >> 32) ^ c1 ^ k0);
}

// True iff element `idx` of the dropout site with key `site` (see site_key) survives under
// `seed` (the int64 seed reinterpreted as uint64); `threshold` comes from dropout_threshold.
COCONET_HD inline bool dropout_keep(uint64_t seed, uint32_t site, uint64_t idx,
                                    uint32_t threshold) {
#if defined(__CUDA_ARCH__)
  const uint32_t w = philox4x32(static_cast<uint32_t>(idx), static_cast<uint32_t>(idx >> 32), site, 0u,
                                static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)).v[0];
#else
  const uint32_t w = philox4x32_word0_host(static_cast<uint32_t>(idx), static_cast<uint32_t>(idx >> 32), site,
                                           0u, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
#endif
  return (w >> 8) >= threshold;
}

}  // namespace coconet

#endif  // COCONET_RNG_H_
