// coconet runtime: the element types of the language (f16, bf16, f32, f64, i32, i64).
//
// `half` (IEEE binary16) and `bfloat16` are 16-bit storage types; arithmetic happens in their
// compute type (float).  Conversions are exact: float -> 16 bit rounds to nearest, ties to even,
// handles subnormals, overflow to infinity and NaN (payload kept, made quiet only if it would
// vanish); 16 bit -> float is exact.  Integer-only code, so it runs the same on the host and in
// CUDA kernels (COCONET_HD) and does not depend on the FPU's rounding or flush-to-zero modes.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#ifndef COCONET_HD
#ifdef __CUDACC__
#define COCONET_HD __host__ __device__
#else
#define COCONET_HD
#endif
#endif

#ifndef COCONET_NO_MPI
#include <mpi.h>
#endif

namespace coconet {

// ---- bit casts -------------------------------------------------------------------------------

// The bits of a float.
COCONET_HD inline uint32_t float_to_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

// The float with these bits.
COCONET_HD inline float bits_to_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// c ? a : b by masks (GCC turns a chain of ?: back into branches, which stops vectorization).
COCONET_HD inline uint32_t select_bits(bool c, uint32_t a, uint32_t b) {
  const uint32_t m = 0u - static_cast<uint32_t>(c);
  return (a & m) | (b & ~m);
}

// ---- binary16 --------------------------------------------------------------------------------

// Rounds a subnormal-half magnitude (float bits ax, 2^-25 <= value < 2^-14) to its 10-bit count
// of 2^-24 units, ties to even.  A result of 0x400 is the smallest normal half, as it should be.
COCONET_HD inline uint32_t half_subnormal_bits(uint32_t ax) {
  uint32_t mant = (ax & 0x7fffffu) | 0x800000u;  // value = mant * 2^(exp - 150)
  uint32_t shift = 126u - (ax >> 23);           // value * 2^24 = mant >> shift, 14..24
  uint32_t q = mant >> shift;
  uint32_t rem = mant & ((1u << shift) - 1u);
  uint32_t halfway = 1u << (shift - 1u);
  const uint32_t up = rem > halfway ? 1u : 0u;  // selects, not branches: loops vectorize
  const uint32_t tie = rem == halfway ? (q & 1u) : 0u;
  return q + (up | tie);
}

// float -> binary16 bits, round to nearest even.  Every case is computed and one selected (no
// branch, so loops that convert vectorize); the subnormal rounding sees the magnitude clamped
// into its own range, so its shifts stay defined for every input.
COCONET_HD inline uint16_t float_to_half_bits(float f) {
  const uint32_t x = float_to_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  // NaN: keep the top payload bits, never turn it into infinity
  const uint32_t payload = (ax >> 13) & 0x3ffu;
  const uint32_t nan = 0x7c00u | (payload ? payload : 0x200u);
  // normal half (>= 2^-14): rebias, round on the 13 dropped bits
  uint32_t r = ax - 0x38000000u;
  r += 0xfffu + ((r >> 13) & 1u);
  const uint32_t normal = r >> 13;
  uint32_t sub_in = ax < 0x33000000u ? 0x33000000u : ax;
  sub_in = sub_in > 0x387fffffu ? 0x387fffffu : sub_in;
  const uint32_t sub = half_subnormal_bits(sub_in);
  uint32_t mag = select_bits(ax < 0x33000000u, 0u, sub);  // < 2^-25: rounds to zero
  mag = select_bits(ax >= 0x38800000u, normal, mag);
  mag = select_bits(ax >= 0x477ff000u, 0x7c00u, mag);  // >= 65520: inf
  mag = select_bits(ax > 0x7f800000u, nan, mag);
  return static_cast<uint16_t>(sign | mag);
}

// binary16 bits -> float (exact).
COCONET_HD inline float half_bits_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  // zero or subnormal: mant * 2^-24, normalized by its leading zeros (integer only, no loop
  // and no branch, so conversions vectorize)
#if defined(__CUDA_ARCH__)
  const uint32_t lz = static_cast<uint32_t>(__clz(static_cast<int>(mant | 1u)));
#else
  const uint32_t lz = static_cast<uint32_t>(__builtin_clz(mant | 1u));
#endif
  const uint32_t sub = mant ? (((134u - lz) << 23) | ((mant << (lz - 8u)) & 0x7fffffu)) : 0u;
  const uint32_t mag = exp == 0x1fu ? 0x7f800000u | (mant << 13)
                       : exp != 0   ? ((exp + 112u) << 23) | (mant << 13)
                                    : sub;
  return bits_to_float(sign | mag);
}

// ---- bfloat16 --------------------------------------------------------------------------------

// float -> bfloat16 bits, round to nearest even (overflow carries into infinity by itself).
COCONET_HD inline uint16_t float_to_bf16_bits(float f) {
  uint32_t x = float_to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep the top payload bits
    uint32_t top = x >> 16;
    return static_cast<uint16_t>((top & 0x7fu) ? top : (top | 0x40u));
  }
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

// bfloat16 bits -> float (exact).
COCONET_HD inline float bf16_bits_to_float(uint16_t b) {
  return bits_to_float(static_cast<uint32_t>(b) << 16);
}

// ---- storage structs -------------------------------------------------------------------------

// IEEE binary16 storage.  Trivially copyable, 2 bytes; converts to float implicitly.
struct half {
  uint16_t bits;
  half() = default;
  COCONET_HD explicit half(float f) : bits(float_to_half_bits(f)) {}
  COCONET_HD static half from_bits(uint16_t b) {
    half h;
    h.bits = b;
    return h;
  }
  COCONET_HD operator float() const { return half_bits_to_float(bits); }
};

// bfloat16 storage (the top half of a float).  Trivially copyable, 2 bytes.
struct bfloat16 {
  uint16_t bits;
  bfloat16() = default;
  COCONET_HD explicit bfloat16(float f) : bits(float_to_bf16_bits(f)) {}
  COCONET_HD static bfloat16 from_bits(uint16_t b) {
    bfloat16 h;
    h.bits = b;
    return h;
  }
  COCONET_HD operator float() const { return bf16_bits_to_float(bits); }
};

static_assert(sizeof(half) == 2 && std::is_trivially_copyable<half>::value, "half layout");
static_assert(sizeof(bfloat16) == 2 && std::is_trivially_copyable<bfloat16>::value, "bf16 layout");

// ---- compute type ----------------------------------------------------------------------------

// True for the 16-bit float storage types.
template <class T>
struct is_half_like : std::integral_constant<bool, std::is_same<T, half>::value ||
                                                       std::is_same<T, bfloat16>::value> {};

// The type arithmetic on T happens in: float for half/bfloat16, T itself otherwise.
template <class T>
struct compute_type {
  using type = T;
};
template <>
struct compute_type<half> {
  using type = float;
};
template <>
struct compute_type<bfloat16> {
  using type = float;
};
template <class T>
using compute_t = typename compute_type<T>::type;

// Storage -> compute type.
template <class T>
COCONET_HD inline compute_t<T> to_compute(T x) {
  return static_cast<compute_t<T>>(x);
}

// Compute type -> storage (rounds to nearest even for half/bfloat16).
template <class T>
COCONET_HD inline T from_compute(compute_t<T> x) {
  return static_cast<T>(x);
}

// Rounds a compute-type value to T's precision and back (identity unless T is 16-bit).
template <class T>
COCONET_HD inline compute_t<T> round_to(compute_t<T> x) {
  return to_compute<T>(from_compute<T>(x));
}

// The language's name of the type ("f16", ...), for error messages.
template <class T>
inline const char* dtype_name() {
  if (std::is_same<T, half>::value) return "f16";
  if (std::is_same<T, bfloat16>::value) return "bf16";
  if (std::is_same<T, float>::value) return "f32";
  if (std::is_same<T, double>::value) return "f64";
  if (std::is_same<T, int32_t>::value) return "i32";
  if (std::is_same<T, int64_t>::value) return "i64";
  return "?";
}

#ifndef COCONET_NO_MPI
// The MPI datatype that carries T (half/bfloat16 travel as MPI_UINT16_T storage; reductions on
// them use the custom MPI_Ops of reduce_ops.h).
template <class T>
inline MPI_Datatype mpi_type();
template <>
inline MPI_Datatype mpi_type<half>() { return MPI_UINT16_T; }
template <>
inline MPI_Datatype mpi_type<bfloat16>() { return MPI_UINT16_T; }
template <>
inline MPI_Datatype mpi_type<float>() { return MPI_FLOAT; }
template <>
inline MPI_Datatype mpi_type<double>() { return MPI_DOUBLE; }
template <>
inline MPI_Datatype mpi_type<int32_t>() { return MPI_INT32_T; }
template <>
inline MPI_Datatype mpi_type<int64_t>() { return MPI_INT64_T; }
#endif

}  // namespace coconet
