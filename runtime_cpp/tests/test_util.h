// Shared helpers of the runtime's C++ tests: check counting, deterministic data, comparisons.
#pragma once

#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "coconet/comm.h"
#include "coconet/dtypes.h"
#include "coconet/reduce_ops.h"

namespace t {

using namespace coconet;

// Pass/fail counters of this rank; failures are printed (the first few) with the rank.
struct Counters {
  long passed = 0, failed = 0;
  std::string where;  // the running test, for messages
};
inline Counters& counters() {
  static Counters c;
  return c;
}

inline int world_rank() {
  int r;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

// Records one check.
inline bool check(bool ok, const std::string& what) {
  Counters& c = counters();
  if (ok) {
    ++c.passed;
    return true;
  }
  if (++c.failed <= 30)
    std::fprintf(stderr, "FAIL rank %d [%s]: %s\n", world_rank(), c.where.c_str(), what.c_str());
  return false;
}

// splitmix64: the hash behind the test data.
inline uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A small integer in [-3, 3] for (seed, rank, index): sums and products over <= 4 ranks stay
// exact in every dtype, so reductions can be compared exactly whatever the order.
inline int small_int(uint64_t seed, int rank, int64_t i) {
  return static_cast<int>(mix(seed * 1000003u + static_cast<uint64_t>(rank) * 7919u +
                              static_cast<uint64_t>(i) * 104729u) % 7) - 3;
}

// A uniform double in [-1, 1) for (seed, rank, index).
inline double uniform(uint64_t seed, int rank, int64_t i) {
  uint64_t h = mix(seed * 2654435761u ^ mix(static_cast<uint64_t>(rank) * 31u + 7u) ^
                   mix(static_cast<uint64_t>(i) + 0x1234u));
  return static_cast<double>(h >> 11) / 4503599627370496.0 - 1.0;
}

// Values of dtype T from integers / doubles.
template <class T>
T make(double v) {
  return from_compute<T>(static_cast<compute_t<T>>(v));
}
template <class T>
double as_double(T v) {
  return static_cast<double>(to_compute(v));
}

// A rank's small-integer test tensor.
template <class T>
std::vector<T> int_data(uint64_t seed, int rank, int64_t n) {
  std::vector<T> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = make<T>(small_int(seed, rank, i));
  return v;
}

// A rank's uniform test tensor.
template <class T>
std::vector<T> real_data(uint64_t seed, int rank, int64_t n) {
  std::vector<T> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = make<T>(uniform(seed, rank, i));
  return v;
}

// Relative tolerance per dtype for results that went through different reduction orders.
template <class T>
double tol() {
  if (std::is_same<T, half>::value) return 4e-3;
  if (std::is_same<T, bfloat16>::value) return 3e-2;
  if (std::is_same<T, float>::value) return 1e-5;
  if (std::is_same<T, double>::value) return 1e-12;
  return 0.0;
}

// Compares two arrays elementwise (|a-b| <= rtol * (1 + |b|)); reports the first mismatch.
template <class T>
bool same(const T* got, const T* want, int64_t n, double rtol, const std::string& what) {
  for (int64_t i = 0; i < n; ++i) {
    double g = as_double(got[i]), w = as_double(want[i]);
    bool ok = (std::isnan(g) && std::isnan(w)) || std::fabs(g - w) <= rtol * (1.0 + std::fabs(w));
    if (!ok) {
      std::ostringstream os;
      os << what << " [" << dtype_name<T>() << "]: index " << i << " of " << n << " got " << g
         << " want " << w;
      return check(false, os.str());
    }
  }
  return check(true, what);
}

template <class T>
bool same(const std::vector<T>& got, const std::vector<T>& want, double rtol,
          const std::string& what) {
  if (!check(got.size() == want.size(), what + ": sizes differ")) return false;
  return same(got.data(), want.data(), static_cast<int64_t>(got.size()), rtol, what);
}

// Reference reduction of every rank's tensor (compute type, rank order), rounded to T.
template <class T>
std::vector<T> reference_reduce(Op op, int R, std::function<std::vector<T>(int)> data) {
  std::vector<T> acc = data(0);
  for (int r = 1; r < R; ++r) combine_into(op, data(r).data(), acc.data(), acc.size());
  finish_avg(op, acc.data(), static_cast<int64_t>(acc.size()), R);
  return acc;
}

// A label like "allreduce sum n=7".
template <class... A>
std::string label(const A&... parts) {
  std::ostringstream os;
  ((os << parts << ' '), ...);
  std::string s = os.str();
  if (!s.empty()) s.pop_back();
  return s;
}

// Calls f.template operator()<T>() for the six dtypes of the language.
template <class F>
void for_each_dtype(F&& f) {
  f(half{});
  f(bfloat16{});
  f(float{});
  f(double{});
  f(int32_t{});
  f(int64_t{});
}

constexpr Op kOps[] = {Op::sum, Op::avg, Op::prod, Op::max, Op::min};

// Sizes that R does not divide, smaller than R, and empty.
inline std::vector<int64_t> test_sizes(int R) {
  return {0, 1, R - 1 > 0 ? R - 1 : 2, R, R + 1, 7, 13, 100, 1003};
}

// Test suites (one per file).
void test_dtypes();
void test_slices_and_comm();
void test_collectives();
void test_scattered();
void test_fused();
void test_overlap();
void test_gemm();
void test_attention();

}  // namespace t
