// coconet host emulation: cuBLAS: the CPU backend's GEMM (emulate.h includes every part, in order).
#pragma once

#include "emulate_nccl.h"

// ---- cuBLAS: the CPU backend's GEMM ---------------------------------------------------------------

inline const char* cublasGetStatusString(cublasStatus_t s) { return s == CUBLAS_STATUS_SUCCESS ? "ok" : "not supported"; }
inline cublasStatus_t cublasCreate(cublasHandle_t* h) { *h = new coconet::cuda::emu::Blas(); return CUBLAS_STATUS_SUCCESS; }
inline cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s) { h->stream = s; return CUBLAS_STATUS_SUCCESS; }

namespace coconet {
namespace cuda {
namespace emu {
// cuBLAS is column-major: C (m x n, ldc) = op(A) (m x k, lda) op(B) (k x n, ldb) is, row-major,
// C^T (n x m) = op(B)^T (n x k) op(A)^T (k x m): the CPU GEMM with the operands swapped, each
// with its own transpose flag (a transposed operand is stored the other way round).
template <class T>
void gemm_colmajor(cudaStream_t s, bool ta, bool tb, int m, int n, int k, const void* A, int lda, const void* B,
                   int ldb, void* C, int ldc) {
  std::vector<Span> spans;
  strided(spans, B, tb ? k : n, tb ? n : k, ldb, sizeof(T), false);
  strided(spans, A, ta ? m : k, ta ? k : m, lda, sizeof(T), false);
  strided(spans, C, n, m, ldc, sizeof(T), true);
  op(s, std::move(spans), "cublasGemmEx", [=] {
    if (!ta && !tb)
      coconet::gemm<T>(n, m, k, static_cast<const T*>(B), ldb, static_cast<const T*>(A), lda, static_cast<T*>(C), ldc);
    else
      coconet::gemm_trans<T>(tb, ta, n, m, k, static_cast<const T*>(B), ldb, static_cast<const T*>(A), lda,
                             static_cast<T*>(C), ldc);
  });
}
}  // namespace emu
}  // namespace cuda
}  // namespace coconet

inline cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                                   const void* alpha, const void* A, cudaDataType_t at, int lda, const void* B,
                                   cudaDataType_t, int ldb, const void* beta, void* C, cudaDataType_t, int ldc,
                                   cublasComputeType_t ct, cublasGemmAlgo_t) {
  namespace emu = coconet::cuda::emu;
  const auto tr = [](cublasOperation_t o) { return o == CUBLAS_OP_T; };
  const bool one = ct == CUBLAS_COMPUTE_64F ? *static_cast<const double*>(alpha) == 1 && *static_cast<const double*>(beta) == 0
                                            : *static_cast<const float*>(alpha) == 1 && *static_cast<const float*>(beta) == 0;
  if (!one) return CUBLAS_STATUS_NOT_SUPPORTED;
  switch (at) {
    case CUDA_R_32F: emu::gemm_colmajor<float>(h->stream, tr(ta), tr(tb), m, n, k, A, lda, B, ldb, C, ldc); break;
    case CUDA_R_64F: emu::gemm_colmajor<double>(h->stream, tr(ta), tr(tb), m, n, k, A, lda, B, ldb, C, ldc); break;
    case CUDA_R_16F: emu::gemm_colmajor<coconet::half>(h->stream, tr(ta), tr(tb), m, n, k, A, lda, B, ldb, C, ldc); break;
    case CUDA_R_16BF: emu::gemm_colmajor<coconet::bfloat16>(h->stream, tr(ta), tr(tb), m, n, k, A, lda, B, ldb, C, ldc); break;
    default: return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  return CUBLAS_STATUS_SUCCESS;
}

// Strided-batched: batch GEMMs as cublasGemmEx's, operand i at its pointer + i * its stride (a stride
// of 0: the same matrix for every batch), each one of cublasGemmEx's operations on the handle's stream.
inline cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                                                 int n, int k, const void* alpha, const void* A, cudaDataType_t at,
                                                 int lda, long long sa, const void* B, cudaDataType_t bt, int ldb,
                                                 long long sb, const void* beta, void* C, cudaDataType_t ctp, int ldc,
                                                 long long sc, int batch, cublasComputeType_t ct, cublasGemmAlgo_t algo) {
  size_t bytes = 0;
  switch (at) {
    case CUDA_R_32F: bytes = 4; break;
    case CUDA_R_64F: bytes = 8; break;
    case CUDA_R_16F: case CUDA_R_16BF: bytes = 2; break;
    default: return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  for (int i = 0; i < batch; ++i) {
    const cublasStatus_t st = cublasGemmEx(
        h, ta, tb, m, n, k, alpha, static_cast<const char*>(A) + size_t(i) * size_t(sa) * bytes, at, lda,
        static_cast<const char*>(B) + size_t(i) * size_t(sb) * bytes, bt, ldb, beta,
        static_cast<char*>(C) + size_t(i) * size_t(sc) * bytes, ctp, ldc, ct, algo);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
  }
  return CUBLAS_STATUS_SUCCESS;
}
