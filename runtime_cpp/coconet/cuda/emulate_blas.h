// coconet host emulation: cuBLAS and cuBLASLt: the CPU backend's GEMM (emulate.h includes every part, in order).
#pragma once

#include "emulate_nccl.h"

// ---- cuBLAS: the CPU backend's GEMM ---------------------------------------------------------------

COCONET_EMU const char* cublasGetStatusString(cublasStatus_t s) { return s == CUBLAS_STATUS_SUCCESS ? "ok" : "not supported"; }
COCONET_EMU cublasStatus_t cublasCreate(cublasHandle_t* h) { *h = new coconet::cuda::emu::Blas(); return CUBLAS_STATUS_SUCCESS; }
COCONET_EMU cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s) { h->stream = s; return CUBLAS_STATUS_SUCCESS; }

namespace coconet {
namespace cuda {
namespace emu {
// cuBLAS is column-major: C (m x n, ldc) = op(A) (m x k, lda) op(B) (k x n, ldb) is, row-major,
// C^T (n x m) = op(B)^T (n x k) op(A)^T (k x m): the CPU GEMM with the operands swapped, each
// with its own transpose flag (a transposed operand is stored the other way round). accumulate:
// beta = 1, C += the product (gemm_trans's accumulate).
template <class T>
void gemm_colmajor(cudaStream_t s, bool ta, bool tb, int m, int n, int k, const void* A, int lda, const void* B,
                   int ldb, void* C, int ldc, bool accumulate) {
  std::vector<Span> spans;
  strided(spans, B, tb ? k : n, tb ? n : k, ldb, sizeof(T), false);
  strided(spans, A, ta ? m : k, ta ? k : m, lda, sizeof(T), false);
  strided(spans, C, n, m, ldc, sizeof(T), true);
  op(s, std::move(spans), "cublasGemmEx", [=] {
    if (!ta && !tb && !accumulate)
      coconet::gemm<T>(n, m, k, static_cast<const T*>(B), ldb, static_cast<const T*>(A), lda, static_cast<T*>(C), ldc);
    else
      coconet::gemm_trans<T>(tb, ta, n, m, k, static_cast<const T*>(B), ldb, static_cast<const T*>(A), lda,
                             static_cast<T*>(C), ldc, accumulate);
  });
}
}  // namespace emu
}  // namespace cuda
}  // namespace coconet

COCONET_EMU cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                                   const void* alpha, const void* A, cudaDataType_t at, int lda, const void* B,
                                   cudaDataType_t, int ldb, const void* beta, void* C, cudaDataType_t, int ldc,
                                   cublasComputeType_t ct, cublasGemmAlgo_t) {
  namespace emu = coconet::cuda::emu;
  const auto tr = [](cublasOperation_t o) { return o == CUBLAS_OP_T; };
  const bool f64 = ct == CUBLAS_COMPUTE_64F;
  const double a1 = f64 ? *static_cast<const double*>(alpha) : *static_cast<const float*>(alpha);
  const double b1 = f64 ? *static_cast<const double*>(beta) : *static_cast<const float*>(beta);
  if (a1 != 1 || (b1 != 0 && b1 != 1)) return CUBLAS_STATUS_NOT_SUPPORTED;  // (what the runtime asks)
  const bool acc = b1 == 1;
  switch (at) {
    case CUDA_R_32F: emu::gemm_colmajor<float>(h->stream, tr(ta), tr(tb), m, n, k, A, lda, B, ldb, C, ldc, acc); break;
    case CUDA_R_64F: emu::gemm_colmajor<double>(h->stream, tr(ta), tr(tb), m, n, k, A, lda, B, ldb, C, ldc, acc); break;
    case CUDA_R_16F:
      emu::gemm_colmajor<coconet::half>(h->stream, tr(ta), tr(tb), m, n, k, A, lda, B, ldb, C, ldc, acc);
      break;
    case CUDA_R_16BF:
      emu::gemm_colmajor<coconet::bfloat16>(h->stream, tr(ta), tr(tb), m, n, k, A, lda, B, ldb, C, ldc, acc);
      break;
    default: return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  return CUBLAS_STATUS_SUCCESS;
}

// Strided-batched: batch GEMMs as cublasGemmEx's, operand i at its pointer + i * its stride (a stride
// of 0: the same matrix for every batch), each one of cublasGemmEx's operations on the handle's stream.
COCONET_EMU cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
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

// ---- cuBLASLt: the CPU backend's GEMM, then the epilogue (blas.cuh matmul_epilogue, grad.cuh) -------
// What coconet uses: a descriptor with CUBLAS_COMPUTE_32F and f32 scales, either operand transposed,
// the DEFAULT, BIAS or BGRADA epilogue; A, B, C and D of one type (f32, f16, bf16), C's layout D's.
// D = alpha * op(A) op(B) + beta * C (+ bias[i] on row i of the column-major D; BGRADA: bias[i] =
// the sum of row i of op(A) over k, D not biased), computed as the CPU GEMM into D, then each
// element once in f32: f16/bf16 round the GEMM's result to their type before the epilogue
// (cuBLASLt keeps it in f32), so there they may differ from a GPU in the last bit.
COCONET_EMU cublasStatus_t cublasLtCreate(cublasLtHandle_t* h) { *h = new coconet::cuda::emu::Lt(); return CUBLAS_STATUS_SUCCESS; }
COCONET_EMU cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* d, cublasComputeType_t ct, cudaDataType_t st) {
  *d = new coconet::cuda::emu::LtDesc();
  (*d)->compute = ct;
  (*d)->scale = st;
  return CUBLAS_STATUS_SUCCESS;
}
COCONET_EMU cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) { delete d; return CUBLAS_STATUS_SUCCESS; }
COCONET_EMU cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t a,
                                                     const void* v, size_t n) {
  switch (a) {
    case CUBLASLT_MATMUL_DESC_TRANSA:
      if (n != sizeof(cublasOperation_t)) return CUBLAS_STATUS_NOT_SUPPORTED;
      std::memcpy(&d->ta, v, n);
      break;
    case CUBLASLT_MATMUL_DESC_TRANSB:
      if (n != sizeof(cublasOperation_t)) return CUBLAS_STATUS_NOT_SUPPORTED;
      std::memcpy(&d->tb, v, n);
      break;
    case CUBLASLT_MATMUL_DESC_EPILOGUE:
      if (n != sizeof(cublasLtEpilogue_t)) return CUBLAS_STATUS_NOT_SUPPORTED;
      std::memcpy(&d->epilogue, v, n);
      break;
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
      if (n != sizeof(void*)) return CUBLAS_STATUS_NOT_SUPPORTED;
      std::memcpy(&d->bias, v, n);
      break;
    default: return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  return CUBLAS_STATUS_SUCCESS;
}
COCONET_EMU cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* l, cudaDataType_t t, uint64_t rows,
                                                 uint64_t cols, int64_t ld) {
  if (ld < int64_t(rows) || ld < 1) return CUBLAS_STATUS_NOT_SUPPORTED;
  *l = new coconet::cuda::emu::LtLayout{t, rows, cols, ld};
  return CUBLAS_STATUS_SUCCESS;
}
COCONET_EMU cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) { delete l; return CUBLAS_STATUS_SUCCESS; }

namespace coconet {
namespace cuda {
namespace emu {
// Column-major D (m x n, ldd) = alpha * op(A) (m x k, lda) op(B) (k x n, ldb) + beta * C (ldc) + bias[row];
// bgrad: bias[i] = the sum over k of op(A)[i, :] instead.
template <class T>
void lt_matmul(cudaStream_t s, bool ta, bool tb, int m, int n, int k, float alpha, const void* A, int lda,
               const void* B, int ldb, float beta, const void* C, int ldc, void* D, int ldd, void* bias, bool bgrad) {
  std::vector<Span> spans;
  strided(spans, B, tb ? k : n, tb ? n : k, ldb, sizeof(T), false);
  strided(spans, A, ta ? m : k, ta ? k : m, lda, sizeof(T), false);
  if (beta != 0 && C != D) strided(spans, C, n, m, ldc, sizeof(T), false);
  if (bias) spans.push_back(bytes(bias, size_t(m) * sizeof(T), bgrad));
  strided(spans, D, n, m, ldd, sizeof(T), true);
  op(s, std::move(spans), "cublasLtMatmul", [=] {
    const T* a = static_cast<const T*>(A);
    const T* c = static_cast<const T*>(C);
    T* b = static_cast<T*>(bias);
    T* d = static_cast<T*>(D);
    if (bgrad)
      for (int i = 0; i < m; ++i) {
        float acc = 0.0f;
        for (int kk = 0; kk < k; ++kk) acc += float(to_compute(ta ? a[int64_t(i) * lda + kk] : a[int64_t(kk) * lda + i]));
        b[i] = from_compute<T>(acc);
      }
    std::vector<float> keep;  // C before the GEMM writes D (C may be D)
    if (beta != 0) {
      keep.resize(size_t(n) * size_t(m));
      for (int j = 0; j < n; ++j)
        for (int i = 0; i < m; ++i) keep[size_t(j) * m + i] = float(to_compute(c[int64_t(j) * ldc + i]));
    }
    if (k > 0 && !ta && !tb)
      coconet::gemm<T>(n, m, k, static_cast<const T*>(B), ldb, a, lda, d, ldd);
    else if (k > 0)
      coconet::gemm_trans<T>(tb, ta, n, m, k, static_cast<const T*>(B), ldb, a, lda, d, ldd);
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < m; ++i) {
        T& x = d[int64_t(j) * ldd + i];
        float v = k > 0 ? alpha * float(to_compute(x)) : 0.0f;
        if (beta != 0) v += beta * keep[size_t(j) * m + i];
        if (b && !bgrad) v += float(to_compute(b[i]));
        x = from_compute<T>(v);
      }
  });
}
}  // namespace emu
}  // namespace cuda
}  // namespace coconet

COCONET_EMU cublasStatus_t cublasLtMatmul(cublasLtHandle_t, cublasLtMatmulDesc_t d, const void* alpha, const void* A,
                                     cublasLtMatrixLayout_t la, const void* B, cublasLtMatrixLayout_t lb,
                                     const void* beta, const void* C, cublasLtMatrixLayout_t lc, void* D,
                                     cublasLtMatrixLayout_t ld, const cublasLtMatmulAlgo_t*, void*, size_t,
                                     cudaStream_t s) {
  namespace emu = coconet::cuda::emu;
  // COCONET_EMULATE_NO_CUBLASLT=1: every GEMM refused, as a GPU's cuBLASLt refuses one it has no
  // algorithm for (so that the callers' unfused paths run under the emulation too)
  const char* no = std::getenv("COCONET_EMULATE_NO_CUBLASLT");
  if (no && *no && std::strcmp(no, "0") != 0) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (d->compute != CUBLAS_COMPUTE_32F || d->scale != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
  const cublasLtEpilogue_t e = d->epilogue;
  if (e != CUBLASLT_EPILOGUE_DEFAULT && e != CUBLASLT_EPILOGUE_BIAS && e != CUBLASLT_EPILOGUE_BGRADA)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  const bool ta = d->ta == CUBLAS_OP_T, tb = d->tb == CUBLAS_OP_T;
  const uint64_t m = ta ? la->cols : la->rows, k = ta ? la->rows : la->cols, n = tb ? lb->rows : lb->cols;
  if ((tb ? lb->cols : lb->rows) != k || lc->rows != m || lc->cols != n || ld->rows != m || ld->cols != n ||
      lc->ld != ld->ld || la->type != lb->type || la->type != lc->type || la->type != ld->type)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  void* bias = e == CUBLASLT_EPILOGUE_DEFAULT ? nullptr : const_cast<void*>(d->bias);
  if (e != CUBLASLT_EPILOGUE_DEFAULT && !bias) return CUBLAS_STATUS_NOT_SUPPORTED;
  const bool bgrad = e == CUBLASLT_EPILOGUE_BGRADA;
  const float a = *static_cast<const float*>(alpha), b = *static_cast<const float*>(beta);
  const int M = int(m), N = int(n), K = int(k), lda = int(la->ld), ldb = int(lb->ld), ldc = int(lc->ld), ldd = int(ld->ld);
  switch (la->type) {
    case CUDA_R_32F: emu::lt_matmul<float>(s, ta, tb, M, N, K, a, A, lda, B, ldb, b, C, ldc, D, ldd, bias, bgrad); break;
    case CUDA_R_16F: emu::lt_matmul<coconet::half>(s, ta, tb, M, N, K, a, A, lda, B, ldb, b, C, ldc, D, ldd, bias, bgrad); break;
    case CUDA_R_16BF: emu::lt_matmul<coconet::bfloat16>(s, ta, tb, M, N, K, a, A, lda, B, ldb, b, C, ldc, D, ldd, bias, bgrad); break;
    default: return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  return CUBLAS_STATUS_SUCCESS;
}
