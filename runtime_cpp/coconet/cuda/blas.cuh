// coconet CUDA runtime: cuBLAS: matmul (cublasGemmEx, strided-batched) and the GEMMs of derived programs (runtime.cuh includes every part, in order).
#pragma once

#include "reductions.cuh"

namespace coconet {
namespace cuda {

// ---- cuBLAS --------------------------------------------------------------------------------------

COCONET_EMU cublasHandle_t blas() {
  static std::mutex mu;
  static std::map<int, cublasHandle_t> hs;
  std::lock_guard<std::mutex> lock(mu);
  return per_device(hs, [](int) {
    cublasHandle_t h;
    COCONET_CUDA(cublasCreate(&h));
    return h;
  });
}

template <class T> struct BlasType;
template <> struct BlasType<float> { static constexpr cudaDataType_t t = CUDA_R_32F; };
template <> struct BlasType<double> { static constexpr cudaDataType_t t = CUDA_R_64F; };
template <> struct BlasType<half> { static constexpr cudaDataType_t t = CUDA_R_16F; };
template <> struct BlasType<bfloat16> { static constexpr cudaDataType_t t = CUDA_R_16BF; };

// Row-major C[M, N] = op(A) x op(B), ldc: op(A) is A[M, K] (lda), or A[K, M]^T when ta; op(B) is
// B[K, N] (ldb), or B[N, K]^T when tb (grad.cuh: matmul_nt, matmul_tn). cuBLAS is column-major,
// so it computes C^T = op(B)^T op(A)^T: the same pointers with the same transpose flags, swapped.
// f16/bf16 accumulate in f32, f64 in f64, f32 in f32 (no TF32). accumulate: C += op(A) x op(B)
// (beta = 1: an overlap's producer that is a sum of GEMMs, plan/units.py Overlap.terms).
template <class T>
void gemm_trans(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb,
                T* C, int64_t ldc, cudaStream_t s, bool accumulate = false) {
  if (M <= 0 || N <= 0) return;
  cublasHandle_t h = blas();
  COCONET_CUDA(cublasSetStream(h, s));
  if (K <= 0) {
    if (!accumulate) COCONET_CUDA(cudaMemset2DAsync(C, ldc * sizeof(T), 0, N * sizeof(T), M, s));
    return;
  }
  const cublasOperation_t opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (std::is_same<T, double>::value) {
    const double alpha = 1, beta = accumulate ? 1 : 0;
    COCONET_CUDA(cublasGemmEx(h, opb, opa, int(N), int(M), int(K), &alpha, B, BlasType<T>::t, int(ldb), A,
                              BlasType<T>::t, int(lda), &beta, C, BlasType<T>::t, int(ldc), CUBLAS_COMPUTE_64F,
                              CUBLAS_GEMM_DEFAULT));
  } else {
    const float alpha = 1, beta = accumulate ? 1 : 0;
    COCONET_CUDA(cublasGemmEx(h, opb, opa, int(N), int(M), int(K), &alpha, B, BlasType<T>::t, int(ldb), A,
                              BlasType<T>::t, int(lda), &beta, C, BlasType<T>::t, int(ldc), CUBLAS_COMPUTE_32F,
                              CUBLAS_GEMM_DEFAULT));
  }
}

// Row-major C[M, N] = A[M, K] (lda) x B[K, N] (ldb), ldc.
template <class T>
void gemm(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc,
          cudaStream_t s) {
  gemm_trans<T>(false, false, M, N, K, A, lda, B, ldb, C, ldc, s);
}
template <class T>
void matmul(const T* A, const T* B, T* C, int64_t M, int64_t K, int64_t N, cudaStream_t s) {
  gemm<T>(M, N, K, A, K, B, N, C, N, s);
}
// C[M, N] += A[M, K] x B[K, N] (a term of an overlap's sum of GEMMs after its first).
template <class T>
void matmul_acc(const T* A, const T* B, T* C, int64_t M, int64_t K, int64_t N, cudaStream_t s) {
  gemm_trans<T>(false, false, M, N, K, A, K, B, N, C, N, s, true);
}

// Batched: C[i] = A[i] x B[i] for i < batch (A[i] at A + i * stride_a, stride_a = 0: one A for every
// batch; B[i] at B + i * stride_b; C dense [batch, M, N]), one cublasGemmStridedBatchedEx (row-major
// as gemm_trans: C^T = B^T A^T), accumulating as gemm_trans does.
template <class T>
void matmul(const T* A, const T* B, T* C, int64_t batch, int64_t M, int64_t K, int64_t N, int64_t stride_a,
            int64_t stride_b, cudaStream_t s) {
  if (batch <= 0 || M <= 0 || N <= 0) return;
  if (K <= 0) {
    COCONET_CUDA(cudaMemsetAsync(C, 0, size_t(batch * M * N) * sizeof(T), s));
    return;
  }
  cublasHandle_t h = blas();
  COCONET_CUDA(cublasSetStream(h, s));
  const bool f64 = std::is_same<T, double>::value;
  const double alpha64 = 1, beta64 = 0;
  const float alpha32 = 1, beta32 = 0;
  const void* alpha = f64 ? static_cast<const void*>(&alpha64) : static_cast<const void*>(&alpha32);
  const void* beta = f64 ? static_cast<const void*>(&beta64) : static_cast<const void*>(&beta32);
  COCONET_CUDA(cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, int(N), int(M), int(K), alpha, B, BlasType<T>::t,
                                          int(N), static_cast<long long>(stride_b), A, BlasType<T>::t, int(K),
                                          static_cast<long long>(stride_a), beta, C, BlasType<T>::t, int(N),
                                          static_cast<long long>(M * N), int(batch),
                                          f64 ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// ---- cuBLASLt: a GEMM with its epilogue (plan/epilogue.py: Library.fused) ----------------------------

COCONET_EMU cublasLtHandle_t blas_lt() {
  static std::mutex mu;
  static std::map<int, cublasLtHandle_t> hs;
  std::lock_guard<std::mutex> lock(mu);
  return per_device(hs, [](int) {
    cublasLtHandle_t h;
    COCONET_CUDA(cublasLtCreate(&h));
    return h;
  });
}

// This device's cuBLASLt workspace (32 MiB, made on first use; one stream at a time uses it as
// every GEMM of a call is on the call's stream).
constexpr size_t kLtWorkspace = size_t(32) << 20;
COCONET_EMU void* lt_workspace() {
  static std::mutex mu;
  static std::map<int, void*> ws;
  std::lock_guard<std::mutex> lock(mu);
  return per_device(ws, [](int) {
    void* p = nullptr;
    COCONET_CUDA(cudaMalloc(&p, kLtWorkspace));
    return p;
  });
}

// At least n zero bytes on this device, for matmul_epilogue's K = 0: made (and zeroed, the host
// waiting) on first use and grown by doubling; a smaller one is kept, as queued work may read it.
COCONET_EMU const void* lt_zeros(size_t n, cudaStream_t s) {
  static std::mutex mu;
  static std::map<int, std::pair<void*, size_t>> zs;
  std::lock_guard<std::mutex> lock(mu);
  int dev = 0;
  COCONET_CUDA(cudaGetDevice(&dev));
  std::pair<void*, size_t>& z = zs[dev];
  if (z.second < n) {
    const size_t bytes = std::max(n, 2 * z.second);
    void* p = nullptr;
    COCONET_CUDA(cudaMalloc(&p, bytes));
    COCONET_CUDA(cudaMemsetAsync(p, 0, bytes, s));
    COCONET_CUDA(cudaStreamSynchronize(s));
    z = {p, bytes};
  }
  return z.first;
}

// Row-major D[M, N] = alpha * A[M, K] x B[K, N] (+ C[M, N] when C) (+ bias[N] on every row when
// bias), one cublasLtMatmul: column-major it is D^T (N x M) = B^T (N x K) A^T (K x M), so cuBLASLt's
// m is N, its A is B and its B is A, and the bias (CUBLASLT_EPILOGUE_BIAS: one value per row of
// cuBLASLt's D, m of them) is along N as the row-major bias is; the residual is C with beta = 1
// (C may be D). f16/bf16 accumulate in f32, f32 in f32 (no TF32), alpha and beta f32. K = 0 (a
// layout of no columns is not one cuBLASLt takes): the same call with k = 1 over zeros (lt_zeros),
// so that D = C + bias still. False (nothing done) where cuBLASLt has no such GEMM (a status other
// than success): the generated code then runs the GEMM and the loop, unfused.
template <class T>
bool matmul_epilogue(const T* A, const T* B, T* D, int64_t M, int64_t K, int64_t N, const T* bias, const T* C,
                     float alpha, cudaStream_t s) {
  static_assert(!std::is_same<T, double>::value, "matmul_epilogue: f32, f16 or bf16 (plan/epilogue.py)");
  if (M <= 0 || N <= 0) return true;
  const cudaDataType_t t = BlasType<T>::t;
  cublasLtMatmulDesc_t op;
  COCONET_CUDA(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasLtEpilogue_t e = bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  COCONET_CUDA(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof(e)));
  if (bias) COCONET_CUDA(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  if (K <= 0) {  // zeros: N of them as cuBLASLt's A (N x 1), M as its B (1 x M)
    A = B = static_cast<const T*>(lt_zeros(size_t(std::max(M, N)) * sizeof(T), s));
    K = 1;
  }
  cublasLtMatrixLayout_t la, lb, ld;  // cuBLASLt's A = B^T (N x K), B = A^T (K x M), C = D = D^T (N x M)
  COCONET_CUDA(cublasLtMatrixLayoutCreate(&la, t, uint64_t(N), uint64_t(K), int64_t(N)));
  COCONET_CUDA(cublasLtMatrixLayoutCreate(&lb, t, uint64_t(K), uint64_t(M), int64_t(K)));
  COCONET_CUDA(cublasLtMatrixLayoutCreate(&ld, t, uint64_t(N), uint64_t(M), int64_t(N)));
  const float beta = C ? 1.0f : 0.0f;
  const cublasStatus_t st = cublasLtMatmul(blas_lt(), op, &alpha, B, la, A, lb, &beta, C ? C : D, ld, D, ld, nullptr,
                                           lt_workspace(), kLtWorkspace, s);
  COCONET_CUDA(cublasLtMatrixLayoutDestroy(ld));
  COCONET_CUDA(cublasLtMatrixLayoutDestroy(lb));
  COCONET_CUDA(cublasLtMatrixLayoutDestroy(la));
  COCONET_CUDA(cublasLtMatmulDescDestroy(op));
  return st == CUBLAS_STATUS_SUCCESS;
}

}  // namespace cuda
}  // namespace coconet
