// coconet runtime: matmul on the CPU.
//
// C[M, N] = A[M, K] x B[K, N], row-major, with leading dimensions (elements between rows).
// A batched `[..., M, K] x [K, N]` is the same call with M = product of the leading dims.
//   f32, f64      -> OpenBLAS sgemm / dgemm (scipy-openblas32 wheel: symbols scipy_cblas_*);
//   f16, bf16     -> converted to f32, sgemm, rounded back (to nearest even);
//   i32, i64      -> a plain i-k-j loop (wrapping arithmetic as in C++ on two's complement).
// With COCONET_NO_BLAS defined, every type uses the loop (accumulating in the compute type),
// so the header compiles and links without BLAS.  With BLAS, link the library (no header is
// needed); another CBLAS can be used by defining COCONET_CBLAS(name) (default:
// scipy_cblas_##name) and COCONET_BLAS_SET_THREADS.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "dtypes.h"

#ifndef COCONET_NO_BLAS
#ifndef COCONET_CBLAS
#define COCONET_CBLAS(name) scipy_cblas_##name
#endif
#ifndef COCONET_BLAS_SET_THREADS
#define COCONET_BLAS_SET_THREADS scipy_openblas_set_num_threads
#endif
// The three BLAS entry points, declared here rather than through <cblas.h>: OpenBLAS's header
// defines a global `typedef uint16_t bfloat16`, which would clash with coconet::bfloat16 in any
// file that says `using namespace coconet`.  CBLAS enums are ints (RowMajor = 101,
// NoTrans = 111), so these prototypes are ABI-identical to the header's.
extern "C" {
void COCONET_CBLAS(sgemm)(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                          const float* a, int lda, const float* b, int ldb, float beta, float* c,
                          int ldc);
void COCONET_CBLAS(dgemm)(int order, int trans_a, int trans_b, int m, int n, int k, double alpha,
                          const double* a, int lda, const double* b, int ldb, double beta,
                          double* c, int ldc);
void COCONET_BLAS_SET_THREADS(int num_threads);
}
#endif

namespace coconet {

// The reference loop: C = A x B, accumulating each row of C in the compute type.
template <class T>
void gemm_loop(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B,
               int64_t ldb, T* C, int64_t ldc) {
  using Acc = compute_t<T>;
  std::vector<Acc> row(static_cast<size_t>(N));
  for (int64_t i = 0; i < M; ++i) {
    std::fill(row.begin(), row.end(), Acc(0));
    for (int64_t k = 0; k < K; ++k) {
      const Acc a = to_compute(A[i * lda + k]);
      const T* b = B + k * ldb;
      for (int64_t j = 0; j < N; ++j) row[static_cast<size_t>(j)] += a * to_compute(b[j]);
    }
    for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = from_compute<T>(row[static_cast<size_t>(j)]);
  }
}

#ifndef COCONET_NO_BLAS

constexpr int kRowMajor = 101, kNoTrans = 111;  // CBLAS_ORDER / CBLAS_TRANSPOSE values

// Checks that BLAS's int dimensions can hold the sizes (the same on every rank).
inline void require_blas_dims(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb,
                              int64_t ldc) {
  for (int64_t d : {M, N, K, lda, ldb, ldc})
    if (d > INT_MAX) throw std::invalid_argument("matmul: dimension " + std::to_string(d) +
                                                 " exceeds BLAS's 32-bit int");
}

// OpenBLAS's threads per process (set 1 when several MPI ranks share the cores).
inline void set_blas_threads(int n) { COCONET_BLAS_SET_THREADS(n); }

// f32 through sgemm.
inline void gemm_blas(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                      const float* B, int64_t ldb, float* C, int64_t ldc) {
  COCONET_CBLAS(sgemm)(kRowMajor, kNoTrans, kNoTrans, int(M), int(N), int(K), 1.0f,
                       A, int(lda), B, int(ldb), 0.0f, C, int(ldc));
}

// f64 through dgemm.
inline void gemm_blas(int64_t M, int64_t N, int64_t K, const double* A, int64_t lda,
                      const double* B, int64_t ldb, double* C, int64_t ldc) {
  COCONET_CBLAS(dgemm)(kRowMajor, kNoTrans, kNoTrans, int(M), int(N), int(K), 1.0,
                       A, int(lda), B, int(ldb), 0.0, C, int(ldc));
}

// Copies a [rows, cols] matrix with leading dim ld into a dense float matrix.
template <class T>
std::vector<float> to_f32(const T* X, int64_t rows, int64_t cols, int64_t ld) {
  std::vector<float> out(static_cast<size_t>(rows * cols));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) out[static_cast<size_t>(i * cols + j)] = X[i * ld + j];
  return out;
}

// f16/bf16: widen to f32, sgemm, round back.
template <class T>
void gemm_widened(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B,
                  int64_t ldb, T* C, int64_t ldc) {
  std::vector<float> a = to_f32(A, M, K, lda), b = to_f32(B, K, N, ldb);
  std::vector<float> c(static_cast<size_t>(M * N));
  gemm_blas(M, N, K, a.data(), K, b.data(), N, c.data(), N);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = T(c[static_cast<size_t>(i * N + j)]);
}

#endif  // COCONET_NO_BLAS

// C[M, N] = A[M, K] x B[K, N] with leading dims (row-major; C must not overlap A or B).
template <class T>
void gemm(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb,
          T* C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {  // empty sum: zeros (BLAS rejects lda = 0)
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = from_compute<T>(compute_t<T>(0));
    return;
  }
#ifndef COCONET_NO_BLAS
  if constexpr (std::is_same<T, float>::value || std::is_same<T, double>::value) {
    require_blas_dims(M, N, K, lda, ldb, ldc);
    return gemm_blas(M, N, K, A, lda, B, ldb, C, ldc);
  } else if constexpr (is_half_like<T>::value) {
    require_blas_dims(M, N, K, lda, ldb, ldc);
    return gemm_widened(M, N, K, A, lda, B, ldb, C, ldc);
  }
#endif
  gemm_loop(M, N, K, A, lda, B, ldb, C, ldc);
}

// C[M, N] = A[M, K] x B[K, N], all dense row-major.
template <class T>
void matmul(const T* A, const T* B, T* C, int64_t M, int64_t K, int64_t N) {
  gemm(M, N, K, A, K, B, N, C, N);
}

}  // namespace coconet
