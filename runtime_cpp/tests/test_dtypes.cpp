// dtypes.h: every half/bfloat16 bit pattern converts exactly to float and back; float -> 16 bit
// rounding matches independent references (a table search in double, and GCC's _Float16).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "test_util.h"

namespace t {
namespace {

// The value of a finite half bit pattern, from the definition of binary16.
double half_value(uint16_t bits) {
  int e = (bits >> 10) & 0x1f, m = bits & 0x3ff;
  double v = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return (bits & 0x8000) ? -v : v;
}

// Non-negative finite halves in increasing order, then 65536 standing for infinity (so values
// past the largest half round to infinity exactly when IEEE says so).
const std::vector<double>& half_table() {
  static std::vector<double> table = [] {
    std::vector<double> v;
    for (uint32_t b = 0; b <= 0x7bff; ++b) v.push_back(half_value(static_cast<uint16_t>(b)));
    v.push_back(65536.0);
    return v;
  }();
  return table;
}

// Reference float -> half bits: nearest table entry, ties to the even bit pattern.
uint16_t ref_half(float f) {
  if (std::isnan(f)) return 0x7e00;
  uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  double a = std::fabs(static_cast<double>(f));
  const auto& tab = half_table();
  if (a >= 65536.0) return sign | 0x7c00;
  size_t hi = static_cast<size_t>(std::upper_bound(tab.begin(), tab.end(), a) - tab.begin());
  size_t lo = hi - 1;
  double dlo = a - tab[lo], dhi = tab[hi] - a;
  size_t pick = dlo < dhi ? lo : dhi < dlo ? hi : (lo % 2 == 0 ? lo : hi);
  return static_cast<uint16_t>(sign | pick);  // table index == bit pattern (0x7c00 for inf)
}

// Reference float -> bfloat16 bits: the nearer of the two neighbours, ties to even.
uint16_t ref_bf16(float f) {
  if (std::isnan(f)) return 0x7fc0;
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t lo = x & 0xffff0000u;
  double a = std::fabs(static_cast<double>(f)), vlo = std::fabs(double(bits_to_float(lo)));
  bool top = (lo & 0x7fffffffu) == 0x7f7f0000u;  // the next pattern up is infinity
  double vhi = top ? std::ldexp(1.0, 128) : std::fabs(double(bits_to_float(lo + 0x10000u)));
  if ((x & 0x7fffffffu) == 0x7f800000u) return static_cast<uint16_t>(x >> 16);
  double dlo = a - vlo, dhi = vhi - a;
  bool up = dhi < dlo || (dhi == dlo && ((lo >> 16) & 1u));
  return static_cast<uint16_t>((up ? lo + 0x10000u : lo) >> 16);
}

// Compares conversions of one float; NaN must stay NaN.
void check_float(float f, long& bad_half, long& bad_bf16) {
  uint16_t h = float_to_half_bits(f), b = float_to_bf16_bits(f);
  if (std::isnan(f)) {
    bad_half += !std::isnan(half_bits_to_float(h));
    bad_bf16 += !std::isnan(bf16_bits_to_float(b));
    return;
  }
  bad_half += h != ref_half(f);
  bad_bf16 += b != ref_bf16(f);
#ifdef __FLT16_MAX__
  _Float16 g = static_cast<_Float16>(f);
  uint16_t gb;
  std::memcpy(&gb, &g, 2);
  bad_half += gb != h;
#endif
}

// All 65536 patterns: 16 bit -> float is exact, and back gives the same bits.
void test_round_trips() {
  long bad_h = 0, bad_b = 0, bad_val = 0;
  for (uint32_t u = 0; u <= 0xffff; ++u) {
    uint16_t bits = static_cast<uint16_t>(u);
    float hf = half_bits_to_float(bits), bf = bf16_bits_to_float(bits);
    bad_h += float_to_half_bits(hf) != bits;
    bad_b += float_to_bf16_bits(bf) != bits;
    bool finite = ((bits >> 10) & 0x1f) != 0x1f;
    if (finite) bad_val += static_cast<double>(hf) != half_value(bits);
    else bad_val += (bits & 0x3ff) ? !std::isnan(hf) : !std::isinf(hf);
  }
  check(bad_h == 0, label("half round trips failing:", bad_h));
  check(bad_b == 0, label("bf16 round trips failing:", bad_b));
  check(bad_val == 0, label("half -> float values wrong:", bad_val));
}

// float -> 16 bit rounding on a sweep of all float bit patterns plus every tie and its
// neighbours (the halfway points between consecutive halves and bfloat16s).
void test_rounding() {
  long bad_h = 0, bad_b = 0;
  for (uint64_t u = 0; u <= 0xffffffffull; u += 4093) check_float(bits_to_float(uint32_t(u)), bad_h, bad_b);
  for (uint32_t b = 0; b < 0x7c00; ++b) {
    for (uint32_t sign : {0u, 0x8000u}) {
      double lo = half_value(uint16_t(b | sign)), hi = b + 1 < 0x7c00 ? half_value(uint16_t((b + 1) | sign)) : (sign ? -65536.0 : 65536.0);
      float mid = static_cast<float>((lo + hi) / 2);  // exact: 12 significant bits
      for (float f : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f), std::nextafter(mid, -1e30f)})
        check_float(f, bad_h, bad_b);
    }
  }
  for (uint32_t b = 0; b < 0x7f80; b += 3) {  // bfloat16 ties: low 16 bits 0x8000
    float mid = bits_to_float((b << 16) | 0x8000u);
    for (float f : {mid, -mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e38f)}) check_float(f, bad_h, bad_b);
  }
  const float inf = std::numeric_limits<float>::infinity();
  for (float f : {0.0f, -0.0f, inf, -inf, std::nanf(""), -std::nanf(""), 65504.0f, 65519.99f, 65520.0f,
                  3.0e38f, 1e-8f, 5.96e-8f, 2.98e-8f, 2.9802322e-8f, 6.1e-5f})
    check_float(f, bad_h, bad_b);
  check(bad_h == 0, label("float -> half mismatches:", bad_h));
  check(bad_b == 0, label("float -> bf16 mismatches:", bad_b));
}

// The traits: compute types, conversions, MPI datatypes.
void test_traits() {
  static_assert(std::is_same<compute_t<half>, float>::value, "");
  static_assert(std::is_same<compute_t<bfloat16>, float>::value, "");
  static_assert(std::is_same<compute_t<int64_t>, int64_t>::value, "");
  check(to_compute(from_compute<half>(1.5f)) == 1.5f, "half 1.5");
  check(to_compute(from_compute<bfloat16>(-2.0f)) == -2.0f, "bf16 -2");
  check(float(half(0.1f)) == 0.0999755859375f, "half(0.1)");
  check(mpi_type<half>() == MPI_UINT16_T && mpi_type<bfloat16>() == MPI_UINT16_T, "mpi 16");
  check(mpi_type<float>() == MPI_FLOAT && mpi_type<int64_t>() == MPI_INT64_T, "mpi types");
  int sz = 0;
  MPI_Type_size(mpi_type<int32_t>(), &sz);
  check(sz == 4, "int32 size");
}

}  // namespace

void test_dtypes() {
  test_round_trips();
  test_rounding();
  test_traits();
}

}  // namespace t
