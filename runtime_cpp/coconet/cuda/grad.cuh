// coconet CUDA runtime: the tensor operations a derived (vector-Jacobian) program adds, the mirror
// of ../grad.h (the same functions, sizes and meaning; coconetc/autodiff/ops.py has their typing
// rules and NumPy references). Every size is this rank's: the operands are its local parts.
// Included at the end of runtime.cuh.
//
//   matmul_nt, matmul_tn   cuBLAS with a transposed operand (gemm_trans, runtime.cuh)
//   sum_lead, sum_keep, mean_last, conv2d_dx, conv2d_dw
//                          one thread per result element, accumulating in the compute type
#pragma once

namespace coconet {
namespace cuda {

// C[M, K] = A[M, N] x B[K, N]^T, all dense row-major.
template <class T>
void matmul_nt(const T* A, const T* B, T* C, int64_t M, int64_t N, int64_t K, cudaStream_t s) {
  gemm_trans<T>(false, true, M, K, N, A, N, B, N, C, K, s);
}

// C[K, N] = A[M, K]^T x B[M, N] (M: the product of the leading dims), all dense row-major.
template <class T>
void matmul_tn(const T* A, const T* B, T* C, int64_t M, int64_t K, int64_t N, cudaStream_t s) {
  gemm_trans<T>(true, false, K, N, M, A, K, B, N, C, N, s);
}

// out[j] = sum over i of x[i, j] (x: outer x inner).
template <class T>
void sum_lead(const T* x, T* out, int64_t outer, int64_t inner, const Ctx& c) {
  COCONET_ACCESS(COCONET_R(x, 0, outer * inner), COCONET_W(out, 0, inner));
  launch(inner, c.stream, [=] __device__(int64_t j) {
    compute_t<T> acc = 0;
    for (int64_t i = 0; i < outer; ++i) acc += to_compute(x[i * inner + j]);
    out[j] = from_compute<T>(acc);
  });
}

// out[o, j] = sum over m of x[o, m, j] (x: outer x mid x inner; out: outer x 1 x inner).
template <class T>
void sum_keep(const T* x, T* out, int64_t outer, int64_t mid, int64_t inner, const Ctx& c) {
  COCONET_ACCESS(COCONET_R(x, 0, outer * mid * inner), COCONET_W(out, 0, outer * inner));
  launch(outer * inner, c.stream, [=] __device__(int64_t i) {
    const int64_t o = i / inner, j = i % inner;
    compute_t<T> acc = 0;
    for (int64_t m = 0; m < mid; ++m) acc += to_compute(x[(o * mid + m) * inner + j]);
    out[i] = from_compute<T>(acc);
  });
}

// out[r] = the mean of x[r, 0:h] (h = 0: NaN, as NumPy's mean of nothing).
template <class T>
void mean_last(const T* x, T* out, int64_t rows, int64_t h, const Ctx& c) {
  COCONET_ACCESS(COCONET_R(x, 0, rows * h), COCONET_W(out, 0, rows));
  launch(rows, c.stream, [=] __device__(int64_t r) {
    using A = compute_t<T>;
    A acc = 0;
    for (int64_t j = 0; j < h; ++j) acc += to_compute(x[r * h + j]);
    out[r] = from_compute<T>(static_cast<A>(acc / static_cast<A>(h)));
  });
}

// dx[n, c, y, z] = sum over o, p, q of g[n, o, i, j] w[o, c, p, q] where y = i * stride + p - pad
// and z = j * stride + q - pad: one thread per element of dx.
template <class T>
void conv2d_dx(const T* g, const T* w, T* dx, int64_t N, int64_t C, int64_t H, int64_t W, int64_t O, int64_t KH,
               int64_t KW, int64_t HO, int64_t WO, int64_t stride, int64_t pad, const Ctx& c) {
  COCONET_ACCESS(COCONET_R(g, 0, N * O * HO * WO), COCONET_R(w, 0, O * C * KH * KW), COCONET_W(dx, 0, N * C * H * W));
  launch(N * C * H * W, c.stream, [=] __device__(int64_t e) {
    const int64_t z = e % W, y = (e / W) % H, ch = (e / (W * H)) % C, n = e / (W * H * C);
    compute_t<T> acc = 0;
    for (int64_t p = 0; p < KH; ++p) {
      const int64_t ty = y + pad - p;
      if (ty < 0 || ty % stride != 0 || ty / stride >= HO) continue;
      const int64_t i = ty / stride;
      for (int64_t q = 0; q < KW; ++q) {
        const int64_t tz = z + pad - q;
        if (tz < 0 || tz % stride != 0 || tz / stride >= WO) continue;
        const int64_t j = tz / stride;
        for (int64_t o = 0; o < O; ++o)
          acc += to_compute(g[((n * O + o) * HO + i) * WO + j]) * to_compute(w[((o * C + ch) * KH + p) * KW + q]);
      }
    }
    dx[e] = from_compute<T>(acc);
  });
}

// dw[o, c, p, q] = sum over n, i, j of x[n, c, i * stride + p - pad, j * stride + q - pad] g[n, o, i, j]
// (zero padding): one thread per element of dw.
template <class T>
void conv2d_dw(const T* x, const T* g, T* dw, int64_t N, int64_t C, int64_t H, int64_t W, int64_t O, int64_t KH,
               int64_t KW, int64_t HO, int64_t WO, int64_t stride, int64_t pad, const Ctx& c) {
  COCONET_ACCESS(COCONET_R(x, 0, N * C * H * W), COCONET_R(g, 0, N * O * HO * WO), COCONET_W(dw, 0, O * C * KH * KW));
  launch(O * C * KH * KW, c.stream, [=] __device__(int64_t e) {
    const int64_t q = e % KW, p = (e / KW) % KH, ch = (e / (KW * KH)) % C, o = e / (KW * KH * C);
    compute_t<T> acc = 0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < HO; ++i) {
        const int64_t y = i * stride + p - pad;
        if (y < 0 || y >= H) continue;
        for (int64_t j = 0; j < WO; ++j) {
          const int64_t z = j * stride + q - pad;
          if (z < 0 || z >= W) continue;
          acc += to_compute(x[((n * C + ch) * H + y) * W + z]) * to_compute(g[((n * O + o) * HO + i) * WO + j]);
        }
      }
    dw[e] = from_compute<T>(acc);
  });
}

}  // namespace cuda
}  // namespace coconet
