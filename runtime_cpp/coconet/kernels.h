// coconet runtime: the math the generated code calls inside and around its loops.
//
// Pointwise helpers take and return compute types (float for half/bfloat16) and must give the
// interpreter's results (coconetc/interp/ops.py); reductions accumulate in double.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "collectives.h"
#include "comm.h"
#include "dtypes.h"
#include "pointwise.h"
#include "rng.h"
#include "segments.h"
#include "state.h"

namespace coconet {

// dst[0, n) = src (a reduced chunk, in the compute type) rounded to T: the reduced value a fused
// collective keeps for its phase B. f32 goes with non-temporal stores where the target has them:
// the chunk is written once and read again only after every chunk, so its lines are not read in
// first (a write-allocate) nor kept in cache in place of the chunks still to come.
template <class T, class C>
inline void keep_chunk(T* dst, const C* src, int64_t n) {
  int64_t i = 0;
#if defined(__AVX__)
  if constexpr (std::is_same_v<T, float> && std::is_same_v<C, float>) {
    for (; i < n && (reinterpret_cast<uintptr_t>(dst + i) & 31) != 0; ++i) dst[i] = src[i];
    for (; i + 8 <= n; i += 8) _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
    _mm_sfence();
  }
#endif
  for (; i < n; ++i) dst[i] = from_compute<T>(src[i]);
}

// Loops of more elements than this may run on several threads (loop_pool.h).
constexpr int64_t kParallelMin = 65536;

// ---- reductions ------------------------------------------------------------------------------

// Sums f(x[i]) in double over kLanes interleaved accumulators (element i into lane i % kLanes,
// the tail into lane 0), added in a fixed order: the same elements give the same result on
// every path, and the loop vectorizes. One accumulator is bound by the add's latency (about 4
// cycles an element: 11 ms for the norm of 2^23 floats on this machine's cores).
constexpr int kLanes = 8;
template <class T, class F>
double lane_sum(const T* x, int64_t n, F&& f) {
  double a[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int k = 0; k < kLanes; ++k) a[k] += f(static_cast<double>(to_compute(x[i + k])));
  for (; i < n; ++i) a[0] += f(static_cast<double>(to_compute(x[i])));
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}
template <class T>
double sum_of(const T* x, int64_t n) {
  return lane_sum(x, n, [](double v) { return v; });
}
template <class T>
double sumsq_of(const T* x, int64_t n) {
  return lane_sum(x, n, [](double v) { return v * v; });
}
template <class T>
double sum_of(const Segments<T>& x, int64_t) {
  double acc = 0;
  for (size_t s = 0; s < x.ptrs.size(); ++s) acc += sum_of(x.ptrs[s], x.sizes[s]);
  return acc;
}
template <class T>
double sumsq_of(const Segments<T>& x, int64_t) {
  double acc = 0;
  for (size_t s = 0; s < x.ptrs.size(); ++s) acc += sumsq_of(x.ptrs[s], x.sizes[s]);
  return acc;
}

// max(x), min(x): the largest (smallest) element in double, NaN if any element is NaN (as
// torch.amax); -inf (+inf) for no elements, the identity (NumPy's `initial`).
template <bool MAX>
inline double extreme_step(double acc, double v) {
  if (acc != acc || v != v) return acc != acc ? acc : v;
  return MAX ? (v > acc ? v : acc) : (v < acc ? v : acc);
}
template <bool MAX>
constexpr double extreme_identity() {
  return MAX ? -HUGE_VAL : HUGE_VAL;
}
template <bool MAX, class T>
double extreme_of(const T* x, int64_t n) {
  double acc = extreme_identity<MAX>();
  for (int64_t i = 0; i < n; ++i) acc = extreme_step<MAX>(acc, static_cast<double>(to_compute(x[i])));
  return acc;
}
template <bool MAX, class T>
double extreme_of(const Segments<T>& x, int64_t) {
  double acc = extreme_identity<MAX>();
  for (size_t s = 0; s < x.ptrs.size(); ++s) acc = extreme_step<MAX>(acc, extreme_of<MAX>(x.ptrs[s], x.sizes[s]));
  return acc;
}
template <class X>
double max_of(const X& x, int64_t n) {
  return extreme_of<true>(x, n);
}
template <class X>
double min_of(const X& x, int64_t n) {
  return extreme_of<false>(x, n);
}

// The largest of each xs[i] over the group, in place, NaN if any rank's is NaN (MPI_MAX alone
// does not say what a NaN gives): one all-reduce of the values without NaN and of NaN flags.
// A min is the max of the negated values (batch.h: reduce_extreme).
COCONET_LIBRARY void allreduce_max(double* xs, int64_t n, Comm& comm) COCONET_LIBRARY_BODY({
  std::vector<double> buf(static_cast<size_t>(2 * n));
  for (int64_t i = 0; i < n; ++i) {
    const bool nan = xs[i] != xs[i];
    buf[static_cast<size_t>(i)] = nan ? -HUGE_VAL : xs[i];
    buf[static_cast<size_t>(n + i)] = nan ? 1.0 : 0.0;
  }
  COCONET_MPI(MPI_Allreduce(MPI_IN_PLACE, buf.data(), static_cast<int>(2 * n), MPI_DOUBLE, MPI_MAX,
                            comm.group));
  for (int64_t i = 0; i < n; ++i)
    xs[i] = buf[static_cast<size_t>(n + i)] > 0 ? std::numeric_limits<double>::quiet_NaN()
                                                 : buf[static_cast<size_t>(i)];
})

// segment_norm: out[i] = the L2 norm of the segment holding global element off + i.  x holds
// n local elements starting at global index off; for a sliced x the per-segment sums of
// squares are summed over the group.
template <class X, class T>
void segment_norm_impl(X load, T* out, int64_t n, int64_t off, const std::vector<int64_t>& starts,
                       bool sliced, Comm& comm) {
  size_t nseg = starts.size() - 1;
  std::vector<double> sq(nseg, 0.0);
  for_each_piece(starts, off, off + n, [&](size_t s, int64_t a, int64_t b, int64_t len) {
    for (int64_t j = 0; j < len; ++j) {
      double v = static_cast<double>(load(s, a + j, b + j));
      sq[s] += v * v;
    }
  });
  if (sliced) allreduce_sum(sq.data(), static_cast<int64_t>(nseg), comm);
  for_each_piece(starts, off, off + n, [&](size_t s, int64_t, int64_t b, int64_t len) {
    T v = from_compute<T>(static_cast<compute_t<T>>(std::sqrt(sq[s])));
    for (int64_t j = 0; j < len; ++j) out[b + j] = v;
  });
}
// The per-segment sums of squares sq (already summed over the group: a fused collective's
// partial results) as segment norms: out[i] = the norm of the segment holding global element
// off + i, for this rank's n elements.
template <class T>
void segment_norm_finish(const double* sq, T* out, int64_t n, int64_t off,
                         const std::vector<int64_t>& starts) {
  for_each_piece(starts, off, off + n, [&](size_t s, int64_t, int64_t b, int64_t len) {
    T v = from_compute<T>(static_cast<compute_t<T>>(std::sqrt(sq[s])));
    for (int64_t j = 0; j < len; ++j) out[b + j] = v;
  });
}
template <class T>
void segment_norm(const T* x, T* out, int64_t n, int64_t off, const std::vector<int64_t>& starts,
                  bool sliced, Comm& comm) {
  segment_norm_impl([&](size_t, int64_t, int64_t i) { return to_compute(x[i]); }, out, n, off,
                    starts, sliced, comm);
}
template <class T>
void segment_norm(const Segments<T>& x, T* out, int64_t n, int64_t off,
                  const std::vector<int64_t>& starts, bool sliced, Comm& comm) {
  segment_norm_impl([&](size_t s, int64_t a, int64_t) { return to_compute(x.ptrs[s][a]); }, out,
                    n, off, starts, sliced, comm);
}

// ---- tensor operations -------------------------------------------------------------------------

// layernorm over the last dim (h) of rows x h, in the compute type, as the interpreter.
template <class T>
void layernorm(const T* x, const T* gamma, const T* beta, double eps, int64_t rows, int64_t h,
               T* out) {
  for (int64_t r = 0; r < rows; ++r)
    layernorm_row(x + r * h, gamma, beta, static_cast<compute_t<T>>(eps), h, out + r * h);
}

// softmax over the last dim (h) of rows x h, in the compute type, as the interpreter
// (coconetc/ir/reference.py): the row's max subtracted; a fully masked row (all -inf) is zeros.
template <class T>
void softmax(const T* x, T* out, int64_t rows, int64_t h) {
  for (int64_t r = 0; r < rows; ++r) softmax_row(x + r * h, h, out + r * h);
}

// transpose: y[o, j, m, i, k] = x[o, i, m, j, k], x seen as [outer, a, mid, b, inner] (the two
// swapped dims a and b, the dims between them mid, those after them inner).
template <class T>
void transpose(const T* x, T* y, int64_t outer, int64_t a, int64_t mid, int64_t b, int64_t inner) {
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t j = 0; j < b; ++j)
      for (int64_t m = 0; m < mid; ++m)
        for (int64_t i = 0; i < a; ++i) {
          const T* src = x + (((o * a + i) * mid + m) * b + j) * inner;
          std::copy_n(src, inner, y + (((o * b + j) * mid + m) * a + i) * inner);
        }
}

// reshape: this rank's n elements as they are (row-major order is kept), after the check that
// the sizes agree and the slices line up (slices.h: reshape_problem; the same on every rank).
template <class T>
void reshape(const T* x, T* y, int64_t n, int64_t n_in, int64_t n_out, int64_t whole, int64_t part, int64_t rest,
             int64_t ranks, const char* what) {
  const std::string why = reshape_problem(n_in, n_out, whole, part, rest, ranks, what);
  if (!why.empty()) throw std::invalid_argument(why);
  if (x != y) std::copy_n(x, n, y);  // y == x: the plan holds the result in x's memory (Buffer.same_as)
}

// index: x[i] along dim 0, this rank's n elements of it (x's part seen as [L, n]; dim 0 is never
// sliced); nothing to copy when the plan holds the result in x's memory at row i (Buffer.same_as).
template <class T>
void index(const T* x, T* y, int64_t n, int64_t i) {
  if (x + i * n != y) std::copy_n(x + i * n, n, y);
}

// conv2d NCHW x OIHW -> NOHW (cross-correlation, zero padding), accumulating in compute type.
template <class T>
void conv2d(const T* x, const T* w, T* out, int64_t N, int64_t C, int64_t H, int64_t W,
            int64_t O, int64_t KH, int64_t KW, int64_t stride, int64_t pad) {
  using A = compute_t<T>;
  const int64_t HO = (H + 2 * pad - KH) / stride + 1, WO = (W + 2 * pad - KW) / stride + 1;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < O; ++o)
      for (int64_t i = 0; i < HO; ++i)
        for (int64_t j = 0; j < WO; ++j) {
          A acc = 0;
          for (int64_t c = 0; c < C; ++c)
            for (int64_t p = 0; p < KH; ++p) {
              int64_t y = i * stride + p - pad;
              if (y < 0 || y >= H) continue;
              for (int64_t q = 0; q < KW; ++q) {
                int64_t z = j * stride + q - pad;
                if (z < 0 || z >= W) continue;
                acc += to_compute(x[((n * C + c) * H + y) * W + z]) *
                       to_compute(w[((o * C + c) * KH + p) * KW + q]);
              }
            }
          out[((n * O + o) * HO + i) * WO + j] = from_compute<T>(acc);
        }
}

}  // namespace coconet
