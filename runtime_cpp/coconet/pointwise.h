// coconet runtime: the pointwise helpers the generated element math calls (codegen/emit.py and
// the operation registry's C++ templates). Shared by the CPU loops and the CUDA kernels, so it
// includes nothing that needs MPI or the host runtime.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "dtypes.h"
#include "rng.h"

namespace coconet {

template <class C> COCONET_HD inline C minimum(C a, C b) { return b < a ? b : a; }
template <class C> COCONET_HD inline C maximum(C a, C b) { return a < b ? b : a; }
template <class C> COCONET_HD inline C power(C a, C b) { return static_cast<C>(std::pow(a, b)); }
template <class C> COCONET_HD inline C rsqrt(C x) { return C(1) / std::sqrt(x); }
template <class C> COCONET_HD inline C sigmoid(C x) { return C(1) / (C(1) + std::exp(-x)); }
template <class C> COCONET_HD inline C relu(C x) { return x < C(0) ? C(0) : x; }
// erf in float without a library call, so that a loop of it vectorizes: a rational function of
// x clamped to [-4, 4] (odd numerator of degree 13 over an even denominator of degree 8, Eigen's
// and XLA's fast float erf), within 4.5e-7 of erf everywhere; past 4 erf is +-1 in float.
COCONET_HD inline float erf_float(float a) {
  const float x = a < -4.f ? -4.f : (a > 4.f ? 4.f : a);
  const float x2 = x * x;
  float p = x2 * -2.72614225801306e-10f + 2.77068142495902e-08f;
  p = x2 * p + -2.10102402082508e-06f;
  p = x2 * p + -5.69250639462346e-05f;
  p = x2 * p + -7.34990630326855e-04f;
  p = x2 * p + -2.95459980854025e-03f;
  p = x2 * p + -1.60960333262415e-02f;
  p = x * p;
  float q = x2 * -1.45660718464996e-05f + -2.13374055278905e-04f;
  q = x2 * q + -1.68282697438203e-03f;
  q = x2 * q + -7.37332916720468e-03f;
  q = x2 * q + -1.42647390514189e-02f;
  return p / q;
}

// Exact GELU: x * Phi(x) (PyTorch's default, not the tanh approximation). In double (f64
// programs) with the library's erf, as the interpreter computes it; in float (f32, f16, bf16
// programs, whose compute type is float) with erf_float, which vectorizes: within 1e-6 of the
// double value for every float x (a scalar std::erf per element cost a GEMM's epilogue more than
// the GEMM at the GPT block's sizes). With AVX2 (no masked vector operations) the loop vectorizes
// only with -fno-trapping-math (codegen/cpu CXX_FLAGS): GCC otherwise keeps the clamp's branches,
// since it will not compute the division on a path that did not ask for it.
template <class C> COCONET_HD inline C gelu(C x) {
  double d = static_cast<double>(x);
  return static_cast<C>(0.5 * d * (1.0 + std::erf(d * 0.70710678118654752440)));
}
template <> COCONET_HD inline float gelu<float>(float x) {
  return 0.5f * x * (1.f + erf_float(x * 0.70710678118654752440f));
}

// cast(x, T): round to T's storage, continue in T's compute type.
template <class T, class C> COCONET_HD inline compute_t<T> cast_to(C x) {
  return to_compute<T>(static_cast<T>(static_cast<compute_t<T>>(x)));
}
template <> COCONET_HD inline float cast_to<half, float>(float x) { return round_to<half>(x); }
template <> COCONET_HD inline float cast_to<bfloat16, float>(float x) { return round_to<bfloat16>(x); }

// dropout: keep with probability 1-p (Philox, rng.h), scale survivors by 1/(1-p); p >= 1 (or NaN):
// 0. Every value is computed whatever p and then selected, with no branch and no division that
// only some p reach (which GCC will not if-convert: a loop of it then did not vectorize).
template <class C>
COCONET_HD inline C dropout(C x, double p, int64_t seed, uint32_t site, uint64_t gidx) {
  const bool keep = dropout_keep(static_cast<uint64_t>(seed), site, gidx, dropout_threshold(p));
  const C scale = static_cast<C>(1.0 / (1.0 - (p >= 1.0 ? 0.0 : p)));
  return keep && p < 1.0 ? x * scale : C(0);
}

// The layernorm of one row over the last dim (H elements), in the compute type C, as the
// interpreter: the mean, then the mean squared deviation (two passes), then each element
// normalized, scaled by g and shifted by b. The one home of the row's math: x(j) reads element j
// in C; sum(f) is f summed over the row (a loop, or a CUDA block's threads striding the row and
// block_sum: runtime.cuh layernorm_row_block); each(f) calls f(j) for the row's elements (the
// loop, or the block's threads); out(j, v) takes element j's value v in C. layernorm_stats: the
// row's mean and 1 / sqrt(var + eps), which the backward (layernorm_dx_of, grad.h) shares.
template <class C, class X, class Sum>
COCONET_HD inline void layernorm_stats(X x, C eps, int64_t H, Sum sum, C& mean, C& inv) {
  mean = sum([&](int64_t j) { return C(x(j)); }) / static_cast<C>(H);
  const C var = sum([&](int64_t j) {
    const C d = x(j) - mean;
    return d * d;
  }) / static_cast<C>(H);
  inv = C(1) / std::sqrt(var + eps);
}

template <class C, class X, class G, class B, class Sum, class Each, class Out>
COCONET_HD inline void layernorm_of(X x, const G* g, const B* b, C eps, int64_t H, Sum sum, Each each, Out out) {
  C mean, inv;
  layernorm_stats(x, eps, H, sum, mean, inv);
  each([&](int64_t j) { out(j, (x(j) - mean) * inv * to_compute(g[j]) + to_compute(b[j])); });
}

// One row's sums for its input gradient (layernorm_dx_sums) and the formulas over them: an
// element's xhat, and its dx from x and dxhat = dy * gamma. layernorm_dx_of and grad.h's
// layernorm_dx_grads (which adds dgamma's g * xhat as it goes) share them.
template <class C>
struct LayernormDxRow {
  C mean, rstd, md, mp;  // the row's statistics (layernorm_stats), mean(dxhat), mean(dxhat * xhat)
  COCONET_HD C xhat(C x) const { return (x - mean) * rstd; }
  COCONET_HD C dx(C x, C dxhat) const { return rstd * (dxhat - md - (x - mean) * rstd * mp); }
};

template <class C, class X, class G, class D, class Sum>
COCONET_HD inline LayernormDxRow<C> layernorm_dx_sums(X x, const G* gamma, D dy, C eps, int64_t H, Sum sum) {
  LayernormDxRow<C> r;
  layernorm_stats(x, eps, H, sum, r.mean, r.rstd);
  r.md = sum([&](int64_t j) { return C(dy(j) * C(to_compute(gamma[j]))); }) / static_cast<C>(H);
  r.mp = sum([&](int64_t j) { return C(dy(j) * C(to_compute(gamma[j])) * r.xhat(x(j))); }) / static_cast<C>(H);
  return r;
}

// layernorm's input gradient of one row (grad.h layernorm_dx_row_by, cuda/grad.cuh): with the row's
// statistics as layernorm_of computes them (layernorm_stats), xhat = (x - mean) * rstd and
// dxhat = dy * gamma, dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), as
// coconetc/autodiff/ops.py's reference. dy(j) reads the cotangent's element j in C; sum, each
// and out as layernorm_of's.
template <class C, class X, class G, class D, class Sum, class Each, class Out>
COCONET_HD inline void layernorm_dx_of(X x, const G* gamma, D dy, C eps, int64_t H, Sum sum, Each each, Out out) {
  const LayernormDxRow<C> r = layernorm_dx_sums(x, gamma, dy, eps, H, sum);
  each([&](int64_t j) { out(j, r.dx(x(j), dy(j) * C(to_compute(gamma[j])))); });
}

// The sum of f(j) over j in [0, h) (in C) and f(j) for each j: one thread's row (layernorm_of,
// layernorm_dx_of, softmax_of's sum).
// The sum runs in kLanes lanes (j mod kLanes), added pairwise at the end, so that the compiler
// vectorizes it (one accumulator is a chain of dependent adds: layernorm's derived program took
// 24 ms instead of 5 ms at 4096 rows of 1024, f32, one rank; layernorm's forward 0.65 ms instead
// of 0.2 at 1024 rows of 256); its rounding differs from one loop's by the order.
template <class C>
struct RowLoop {
  static constexpr int kLanes = 16;
  int64_t h;
  template <class F>
  COCONET_HD C sum(F f) const {
    C lane[kLanes] = {};
    int64_t j = 0;
    for (; j + kLanes <= h; j += kLanes)
      for (int k = 0; k < kLanes; ++k) lane[k] += f(j + k);
    for (int k = 0; j < h; ++j, ++k) lane[k] += f(j);
    for (int w = kLanes / 2; w > 0; w /= 2)
      for (int k = 0; k < w; ++k) lane[k] += lane[k + w];
    return lane[0];
  }
  template <class F>
  COCONET_HD void each(F f) const {
    for (int64_t j = 0; j < h; ++j) f(j);
  }
};

// layernorm_of by one thread, its sums in RowLoop's lanes: the CPU runtime's layernorm (kernels.h)
// and a CPU fused collective's row-wise phase (codegen/cpu/fused.py).
template <class C, class X, class G, class B, class Out>
COCONET_HD inline void layernorm_row_by(X x, const G* g, const B* b, C eps, int64_t H, Out out) {
  const RowLoop<C> row{H};
  const auto sum = [&](auto f) { return row.sum(f); };
  const auto each = [&](auto f) { row.each(f); };
  layernorm_of(x, g, b, eps, H, sum, each, out);
}

// One row of layernorm over the last dim (H elements at xr into yr): the CPU runtime's layernorm.
template <class T>
COCONET_HD inline void layernorm_row(const T* xr, const T* g, const T* b, compute_t<T> eps, int64_t H, T* yr) {
  using C = compute_t<T>;
  layernorm_row_by(
      [&](int64_t j) { return to_compute(xr[j]); }, g, b, eps, H,
      [&](int64_t j, C v) { yr[j] = from_compute<T>(v); });
}

// The value a softmax row's max becomes before it is subtracted: a fully masked row's max (-inf)
// is 0, so that every exp(-inf - 0) is 0 and the row sums to 0 (the row is then zeros).
template <class C>
COCONET_HD inline C softmax_shift(C m) { return m == -std::numeric_limits<C>::infinity() ? C(0) : m; }

// An element of a softmax row: e / s, 0 where the row's sum is 0 (a fully masked row; a NaN
// stays NaN).
template <class C>
COCONET_HD inline C softmax_value(C e, C s) { return s == C(0) ? C(0) : e / s; }

// The larger of a row's running max m and v, NaN propagating (as np.max).
template <class C>
COCONET_HD inline C max_step(C m, C v) { return (v > m || v != v) ? v : m; }

// The softmax of one row over the last dim, in the compute type C, as the interpreter: the max
// (softmax_shift), the sum of exp(x - max), then each exp(x - max) / sum (softmax_value). The one
// home of the row's math: x(j) reads element j in C; largest(f) and total(f) are f's largest (max_step
// from -inf) and sum over the row (a loop, or a CUDA block's threads striding the row and
// block_max/block_sum: runtime.cuh softmax); each(f) calls f(j) for the row's elements; out(j, v)
// takes element j's value v in C.
template <class C, class X, class Largest, class Total, class Each, class Out>
COCONET_HD inline void softmax_of(X x, Largest largest, Total total, Each each, Out out) {
  const C m = softmax_shift(largest([&](int64_t j) { return C(x(j)); }));
  const C s = total([&](int64_t j) { return C(std::exp(x(j) - m)); });
  each([&](int64_t j) { out(j, softmax_value(C(std::exp(x(j) - m)), s)); });
}

// One row of softmax over the last dim (H elements at xr into yr), by one thread, element after
// element: the CPU runtime's softmax (kernels.h).
template <class T>
COCONET_HD inline void softmax_row(const T* xr, int64_t H, T* yr) {
  using C = compute_t<T>;
  const auto largest = [&](auto f) {
    C m = -std::numeric_limits<C>::infinity();
    for (int64_t j = 0; j < H; ++j) m = max_step(m, f(j));
    return m;
  };
  const RowLoop<C> row{H};
  const auto total = [&](auto f) { return row.sum(f); };
  const auto each = [&](auto f) { row.each(f); };
  softmax_of<C>([&](int64_t j) { return to_compute(xr[j]); }, largest, total, each,
                [&](int64_t j, C v) { yr[j] = from_compute<T>(v); });
}

}  // namespace coconet
