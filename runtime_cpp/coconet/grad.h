// coconet runtime: the tensor operations a derived (vector-Jacobian) program adds, on the CPU
// (coconetc/autodiff/ops.py has their typing rules and NumPy references; cuda/grad.cuh mirrors
// this file).  Every size is this rank's: the operands are its local parts.
//
//   matmul_nt  C[M, K] = A[M, N] x B[K, N]^T    (matmul's input gradient)   gemm_trans (gemm.h)
//   matmul_tn  C[K, N] = A[M, K]^T x B[M, N]    (matmul's weight gradient)  gemm_trans (gemm.h)
//   sum_lead   out[inner] = the sum of x[outer, inner] over outer
//   sum_keep   out[outer, 1, inner] = the sum of x[outer, mid, inner] over mid
//   unindex    out[L, n] = zeros, g[n] at row i  (index's gradient)
//   mean_last  out[rows, 1] = the mean of x[rows, h] over h
//   layernorm_dx      dx[rows, h] from x, gamma[h] and the cotangent g[rows, h]  (a row at a time)
//   layernorm_dgamma  dgamma[h] = the sum over rows of g * xhat                  (a row at a time)
//   conv2d_dx  dx[N, C, H, W] from g[N, O, HO, WO] and w[O, C, KH, KW] (the transposed conv2d)
//   conv2d_dw  dw[O, C, KH, KW] from x[N, C, H, W] and g[N, O, HO, WO]
//
// Sums accumulate in the compute type (float for f16 / bf16), as conv2d (kernels.h) does.
#pragma once

#include <cstdint>
#include <vector>

#include "dtypes.h"
#include "gemm.h"
#include "pointwise.h"

namespace coconet {

// C[M, K] = A[M, N] x B[K, N]^T, all dense row-major.
template <class T>
void matmul_nt(const T* A, const T* B, T* C, int64_t M, int64_t N, int64_t K) {
  gemm_trans(false, true, M, K, N, A, N, B, N, C, K);
}
// C[M, K] += A[M, N] x B[K, N]^T (a term of an overlap's sum of GEMMs after its first).
template <class T>
void matmul_nt_acc(const T* A, const T* B, T* C, int64_t M, int64_t N, int64_t K) {
  gemm_trans(false, true, M, K, N, A, N, B, N, C, K, true);
}

// C[K, N] = A[M, K]^T x B[M, N] (M: the product of the leading dims), all dense row-major.
template <class T>
void matmul_tn(const T* A, const T* B, T* C, int64_t M, int64_t K, int64_t N) {
  gemm_trans(true, false, K, N, M, A, K, B, N, C, N);
}
// C[K, N] += A[M, K]^T x B[M, N]: a weight's gradient added into its accumulator in place
// (`update(acc, acc + d_w)`, an accumulating backward: autodiff/saved.py, plan/epilogue.py).
template <class T>
void matmul_tn_acc(const T* A, const T* B, T* C, int64_t M, int64_t K, int64_t N) {
  gemm_trans(true, false, K, N, M, A, K, B, N, C, N, true);
}

// out[j] = sum over i of x[i, j] (x: outer x inner).
template <class T>
void unindex(const T* g, T* out, int64_t n, int64_t i, int64_t L) {
  std::fill_n(out, L * n, T(0));
  std::copy_n(g, n, out + i * n);
}

template <class T>
void sum_lead(const T* x, T* out, int64_t outer, int64_t inner) {
  using A = compute_t<T>;
  std::vector<A> acc(static_cast<size_t>(inner > 0 ? inner : 0), A(0));
  for (int64_t i = 0; i < outer; ++i)
    for (int64_t j = 0; j < inner; ++j) acc[static_cast<size_t>(j)] += to_compute(x[i * inner + j]);
  for (int64_t j = 0; j < inner; ++j) out[j] = from_compute<T>(acc[static_cast<size_t>(j)]);
}

// out[o, j] = sum over m of x[o, m, j] (x: outer x mid x inner; out: outer x 1 x inner).
template <class T>
void sum_keep(const T* x, T* out, int64_t outer, int64_t mid, int64_t inner) {
  using A = compute_t<T>;
  std::vector<A> acc(static_cast<size_t>(inner > 0 ? inner : 0));
  for (int64_t o = 0; o < outer; ++o) {
    std::fill(acc.begin(), acc.end(), A(0));
    for (int64_t m = 0; m < mid; ++m)
      for (int64_t j = 0; j < inner; ++j)
        acc[static_cast<size_t>(j)] += to_compute(x[(o * mid + m) * inner + j]);
    for (int64_t j = 0; j < inner; ++j) out[o * inner + j] = from_compute<T>(acc[static_cast<size_t>(j)]);
  }
}

// out[r] = the mean of x[r, 0:h] (h = 0: NaN, as NumPy's mean of nothing).
template <class T>
void mean_last(const T* x, T* out, int64_t rows, int64_t h) {
  using A = compute_t<T>;
  for (int64_t r = 0; r < rows; ++r) {
    A acc = 0;
    for (int64_t j = 0; j < h; ++j) acc += to_compute(x[r * h + j]);
    out[r] = from_compute<T>(static_cast<A>(acc / static_cast<A>(h)));
  }
}

// layernorm's input gradient of one row of h elements by one thread (pointwise.h layernorm_dx_of,
// its sums in RowLoop's lanes): x(j) and dy(j) read element j in C, out(j, v) takes its value v in
// C. A CPU fused collective's row-wise phase (codegen/cpu/fused.py); the library call,
// layernorm_dx_grads below, computes each row with the same sums and formula (layernorm_dx_sums).
template <class C, class X, class G, class D, class Out>
inline void layernorm_dx_row_by(X x, const G* gamma, D dy, C eps, int64_t h, Out out) {
  const RowLoop<C> row{h};
  const auto sum = [&](auto f) { return row.sum(f); };
  const auto each = [&](auto f) { row.each(f); };
  layernorm_dx_of(x, gamma, dy, eps, h, sum, each, out);
}

// dx[r, :] = layernorm's input gradient of row r (pointwise.h layernorm_dx_sums: the row's
// statistics as the forward's, then dx in one more pass) from x[rows, h], gamma[h] and g[rows, h].
// add (the plan's residual epilogue, plan/epilogue.py): dx = add + that gradient, the gradient
// rounded to T first, so the sum is the separate loop's bit for bit (add may be dx itself, not x
// or g). Where dgamma / dbeta are not nullptr, the same pass also computes layernorm_dgamma's and
// the bias's sum_lead(g) (the plan's layernorm gradients, plan/lngrads.py): dgamma[j] += g * xhat
// and dbeta[j] += g in the compute type, row by row in row order with the row's statistics as
// layernorm_dgamma's, so each is the separate call's bit for bit; a row of x and g is read from
// memory once instead of three times.
template <class T>
void layernorm_dx_grads(const T* x, const T* gamma, const T* g, T* dx, T* dgamma, T* dbeta, double eps,
                        int64_t rows, int64_t h, const T* add = nullptr) {
  using C = compute_t<T>;
  std::vector<C> ag(static_cast<size_t>(dgamma && h > 0 ? h : 0), C(0));
  std::vector<C> ab(static_cast<size_t>(dbeta && h > 0 ? h : 0), C(0));
  const RowLoop<C> row{h};
  const auto sum = [&](auto f) { return row.sum(f); };
  const C e = static_cast<C>(eps);
  for (int64_t r = 0; r < rows; ++r) {
    const T *xr = x + r * h, *gr = g + r * h;
    T* dr = dx + r * h;
    const auto xj = [&](int64_t j) { return C(to_compute(xr[j])); };
    const auto gj = [&](int64_t j) { return C(to_compute(gr[j])); };
    // layernorm_dx_of's sums, their statistics layernorm_dgamma's (the same layernorm_stats)
    const LayernormDxRow<C> s = layernorm_dx_sums(xj, gamma, gj, e, h, sum);
    const T* ar = add ? add + r * h : nullptr;
    C* pg = ag.data();
    C* pb = ab.data();
    for (int64_t j = 0; j < h; ++j) {
      const C gv = gj(j), xv = xj(j);
      const C v = s.dx(xv, gv * C(to_compute(gamma[j])));
      dr[j] = ar ? from_compute<T>(to_compute(ar[j]) + to_compute(from_compute<T>(v))) : from_compute<T>(v);
      if (dgamma) pg[j] += gv * s.xhat(xv);
      if (dbeta) pb[j] += gv;
    }
  }
  for (int64_t j = 0; j < h; ++j) {
    if (dgamma) dgamma[j] = from_compute<T>(ag[static_cast<size_t>(j)]);
    if (dbeta) dbeta[j] = from_compute<T>(ab[static_cast<size_t>(j)]);
  }
}

// layernorm_dx_grads' dx alone: layernorm's input gradient (add: its residual epilogue).
template <class T>
void layernorm_dx(const T* x, const T* gamma, const T* g, T* dx, double eps, int64_t rows, int64_t h,
                  const T* add = nullptr) {
  layernorm_dx_grads<T>(x, gamma, g, dx, nullptr, nullptr, eps, rows, h, add);
}

// dgamma[j] = the sum over rows r of g[r, j] * xhat[r, j], xhat the row's normalized x (the row's
// statistics as the forward's, layernorm_stats), accumulated in the compute type.
template <class T>
void layernorm_dgamma(const T* x, const T* g, T* dgamma, double eps, int64_t rows, int64_t h) {
  using C = compute_t<T>;
  std::vector<C> acc(static_cast<size_t>(h > 0 ? h : 0), C(0));
  const RowLoop<C> row{h};
  const auto sum = [&](auto f) { return row.sum(f); };
  for (int64_t r = 0; r < rows; ++r) {
    const T *xr = x + r * h, *gr = g + r * h;
    const auto xj = [&](int64_t j) { return C(to_compute(xr[j])); };
    C mean, rstd;
    layernorm_stats(xj, static_cast<C>(eps), h, sum, mean, rstd);
    for (int64_t j = 0; j < h; ++j) acc[static_cast<size_t>(j)] += C(to_compute(gr[j])) * ((xj(j) - mean) * rstd);
  }
  for (int64_t j = 0; j < h; ++j) dgamma[j] = from_compute<T>(acc[static_cast<size_t>(j)]);
}

// dx[n, c, y, z] = sum over o, p, q of g[n, o, i, j] w[o, c, p, q] where y = i * stride + p - pad
// and z = j * stride + q - pad (conv2d's input gradient: each input element gathers the outputs
// whose window covered it).
template <class T>
void conv2d_dx(const T* g, const T* w, T* dx, int64_t N, int64_t C, int64_t H, int64_t W, int64_t O,
               int64_t KH, int64_t KW, int64_t HO, int64_t WO, int64_t stride, int64_t pad) {
  using A = compute_t<T>;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t y = 0; y < H; ++y)
        for (int64_t z = 0; z < W; ++z) {
          A acc = 0;
          for (int64_t p = 0; p < KH; ++p) {
            const int64_t ty = y + pad - p;
            if (ty < 0 || ty % stride != 0 || ty / stride >= HO) continue;
            const int64_t i = ty / stride;
            for (int64_t q = 0; q < KW; ++q) {
              const int64_t tz = z + pad - q;
              if (tz < 0 || tz % stride != 0 || tz / stride >= WO) continue;
              const int64_t j = tz / stride;
              for (int64_t o = 0; o < O; ++o)
                acc += to_compute(g[((n * O + o) * HO + i) * WO + j]) *
                       to_compute(w[((o * C + c) * KH + p) * KW + q]);
            }
          }
          dx[((n * C + c) * H + y) * W + z] = from_compute<T>(acc);
        }
}

// dw[o, c, p, q] = sum over n, i, j of x[n, c, i * stride + p - pad, j * stride + q - pad]
// g[n, o, i, j] (conv2d's weight gradient; zero padding).
template <class T>
void conv2d_dw(const T* x, const T* g, T* dw, int64_t N, int64_t C, int64_t H, int64_t W, int64_t O,
               int64_t KH, int64_t KW, int64_t HO, int64_t WO, int64_t stride, int64_t pad) {
  using A = compute_t<T>;
  for (int64_t o = 0; o < O; ++o)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t p = 0; p < KH; ++p)
        for (int64_t q = 0; q < KW; ++q) {
          A acc = 0;
          for (int64_t n = 0; n < N; ++n)
            for (int64_t i = 0; i < HO; ++i) {
              const int64_t y = i * stride + p - pad;
              if (y < 0 || y >= H) continue;
              for (int64_t j = 0; j < WO; ++j) {
                const int64_t z = j * stride + q - pad;
                if (z < 0 || z >= W) continue;
                acc += to_compute(x[((n * C + c) * H + y) * W + z]) *
                       to_compute(g[((n * O + o) * HO + i) * WO + j]);
              }
            }
          dw[((o * C + c) * KH + p) * KW + q] = from_compute<T>(acc);
        }
}

}  // namespace coconet
