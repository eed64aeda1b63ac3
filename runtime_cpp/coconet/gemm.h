// coconet runtime: matmul on the CPU.
//
// C[M, N] = A[M, K] x B[K, N], row-major, with leading dimensions (elements between rows).
// A batched `[..., M, K] x [K, N]` is the same call with M = product of the leading dims.
//   f32, f64      -> the BLAS's sgemm / dgemm (MKL or OpenBLAS, below);
//   f16, bf16     -> B widened to f32 once (per-thread scratch), A widened and C rounded back
//                    (to nearest even) in blocks of rows around one sgemm each;
//   i32, i64      -> a plain i-k-j loop (wrapping arithmetic as in C++ on two's complement).
// With COCONET_NO_BLAS defined, every type uses the loop (accumulating in the compute type),
// so the header compiles and links without BLAS.  With BLAS, link the library (no header is
// needed): OpenBLAS by default; with COCONET_BLAS_MKL, MKL (link libmkl_intel_lp64,
// libmkl_gnu_thread, libmkl_core and libgomp); another CBLAS by defining COCONET_CBLAS(name)
// and COCONET_BLAS_SET_THREADS.
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
#include "state.h"

#if defined(__F16C__) && !defined(__CUDACC__)
#include <immintrin.h>
#endif

#ifndef COCONET_NO_BLAS
#if defined(COCONET_BLAS_MKL) && !defined(COCONET_CBLAS)
#define COCONET_CBLAS(name) cblas_##name
#define COCONET_BLAS_SET_THREADS MKL_Set_Num_Threads
#endif
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

// Row blocks of one GEMM start at multiples of this many rows: BLAS tiles rows in multiples of
// its kernel's unroll (at most 64 here), so the blocks' tiles are the whole call's tiles and
// every element gets the same sums in the same order, bit for bit.
constexpr int64_t kGemmRowAlign = 64;

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
COCONET_LIBRARY void require_blas_dims(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb,
                                       int64_t ldc) COCONET_LIBRARY_BODY({
  for (int64_t d : {M, N, K, lda, ldb, ldc})
    if (d > INT_MAX) throw std::invalid_argument("matmul: dimension " + std::to_string(d) +
                                                 " exceeds BLAS's 32-bit int");
})

// The BLAS's threads per process (set 1 when several MPI ranks share the cores).
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

// Widens rows x cols of X (leading dim ld) into the dense float matrix out.
template <class T>
void widen_into(const T* X, int64_t rows, int64_t cols, int64_t ld, float* out) {
  for (int64_t i = 0; i < rows; ++i) {
    const T* x = X + i * ld;
    float* o = out + i * cols;
    int64_t j = 0;
#if defined(__F16C__) && !defined(__CUDACC__)
    if constexpr (std::is_same<T, half>::value)  // exact, 8 at a time (vcvtph2ps)
      for (; j + 8 <= cols; j += 8)
        _mm256_storeu_ps(o + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + j))));
#endif
    for (; j < cols; ++j) o[j] = float(x[j]);
  }
}

// Rounds n floats to T (to nearest even) into dst.
template <class T>
void narrow_into(const float* src, int64_t n, T* dst) {
  int64_t j = 0;
#if defined(__F16C__) && !defined(__CUDACC__)
  if constexpr (std::is_same<T, half>::value)  // vcvtps2ph, round to nearest even
    for (; j + 8 <= n; j += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j),
                       _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; j < n; ++j) dst[j] = T(src[j]);
}

// A float buffer of at least n elements, kept per thread and per Site across calls (no
// allocation, no page faults after the first call of a size).
template <int Site>
float* gemm_scratch(int64_t n) {
  static thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(static_cast<size_t>(n));
  return buf.data();
}

// f16/bf16 with B already widened to f32 (B32[K, N], leading dim ldb): A is widened and C
// rounded back block by block of rows (sized so the f32 blocks of A and C stay about 4 MiB),
// each block one sgemm straight from the widened block into an f32 block.
template <class T>
void gemm_widened_a(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const float* B32,
                    int64_t ldb, T* C, int64_t ldc) {
  const int64_t block =
      std::min<int64_t>(M, std::max<int64_t>(kGemmRowAlign, (int64_t(1) << 20) / (K + N) /
                                                                kGemmRowAlign * kGemmRowAlign));
  float* a = gemm_scratch<1>(block * K);
  float* c = gemm_scratch<2>(block * N);
  for (int64_t i0 = 0; i0 < M; i0 += block) {
    const int64_t m = std::min(block, M - i0);
    widen_into(A + i0 * lda, m, K, lda, a);
    gemm_blas(m, N, K, a, K, B32, ldb, c, N);
    for (int64_t i = 0; i < m; ++i) narrow_into(c + i * N, N, C + (i0 + i) * ldc);
  }
}

// f16/bf16: widen B once (per-thread scratch), then A block by block (gemm_widened_a); the
// same products and sums as one sgemm of whole widened copies, without allocating them.
template <class T>
void gemm_widened(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B,
                  int64_t ldb, T* C, int64_t ldc) {
  float* b = gemm_scratch<0>(K * N);
  widen_into(B, K, N, ldb, b);
  gemm_widened_a(M, N, K, A, lda, b, N, C, ldc);
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

// Batched: C[i] = A[i] x B[i] for i < batch, A[i] at A + i * stride_a (stride_a = 0: one A for
// every batch, a 2-d operand broadcast), B[i] at B + i * stride_b, C dense [batch, M, N]: one
// GEMM a batch (BLAS has no strided-batched call; cuBLAS's is cuda/runtime.cuh's).
template <class T>
void matmul(const T* A, const T* B, T* C, int64_t batch, int64_t M, int64_t K, int64_t N, int64_t stride_a,
            int64_t stride_b) {
  for (int64_t i = 0; i < batch; ++i) gemm(M, N, K, A + i * stride_a, K, B + i * stride_b, N, C + i * M * N, N);
}

// ---- GEMM with transposed operands (grad.h: matmul_nt, matmul_tn) ------------------------------

// C[M, N] = op(A) x op(B), row-major: op(A) is A[M, K] (leading dim lda), or A[K, M]^T when ta;
// op(B) is B[K, N] (ldb), or B[N, K]^T when tb.  The same paths as gemm(): sgemm / dgemm with
// the transpose flags for f32 / f64, f16 / bf16 widened to f32 around one sgemm, the loop
// (accumulating in the compute type) for the others and without BLAS. accumulate: C += op(A) x
// op(B) (beta = 1: an overlap's producer that is a sum of GEMMs, plan/units.py Overlap.terms),
// f16 / bf16 adding the product, in f32, to C's value.

// The reference loop of gemm_trans.
template <class T>
void gemm_trans_loop(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const T* A, int64_t lda,
                     const T* B, int64_t ldb, T* C, int64_t ldc, bool accumulate = false) {
  using Acc = compute_t<T>;
  std::vector<Acc> row(static_cast<size_t>(N));
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) row[static_cast<size_t>(j)] = accumulate ? to_compute(C[i * ldc + j]) : Acc(0);
    for (int64_t k = 0; k < K; ++k) {
      const Acc a = to_compute(ta ? A[k * lda + i] : A[i * lda + k]);
      if (tb)
        for (int64_t j = 0; j < N; ++j) row[static_cast<size_t>(j)] += a * to_compute(B[j * ldb + k]);
      else
        for (int64_t j = 0; j < N; ++j) row[static_cast<size_t>(j)] += a * to_compute(B[k * ldb + j]);
    }
    for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = from_compute<T>(row[static_cast<size_t>(j)]);
  }
}

#ifndef COCONET_NO_BLAS
constexpr int kTrans = 112;  // CblasTrans

inline void gemm_trans_blas(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float* A,
                            int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate = false) {
  COCONET_CBLAS(sgemm)(kRowMajor, ta ? kTrans : kNoTrans, tb ? kTrans : kNoTrans, int(M), int(N),
                       int(K), 1.0f, A, int(lda), B, int(ldb), accumulate ? 1.0f : 0.0f, C, int(ldc));
}
inline void gemm_trans_blas(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const double* A,
                            int64_t lda, const double* B, int64_t ldb, double* C, int64_t ldc, bool accumulate = false) {
  COCONET_CBLAS(dgemm)(kRowMajor, ta ? kTrans : kNoTrans, tb ? kTrans : kNoTrans, int(M), int(N),
                       int(K), 1.0, A, int(lda), B, int(ldb), accumulate ? 1.0 : 0.0, C, int(ldc));
}
#endif  // COCONET_NO_BLAS

// C[M, N] = op(A) x op(B) (see above; C must not overlap A or B).
template <class T>
void gemm_trans(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const T* A, int64_t lda,
                const T* B, int64_t ldb, T* C, int64_t ldc, bool accumulate = false) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {  // empty sum: zeros, or C as it is (BLAS rejects a zero leading dim)
    if (accumulate) return;
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = from_compute<T>(compute_t<T>(0));
    return;
  }
#ifndef COCONET_NO_BLAS
  if constexpr (std::is_same<T, float>::value || std::is_same<T, double>::value) {
    require_blas_dims(M, N, K, lda, ldb, ldc);
    return gemm_trans_blas(ta, tb, M, N, K, A, lda, B, ldb, C, ldc, accumulate);
  } else if constexpr (is_half_like<T>::value) {
    require_blas_dims(M, N, K, lda, ldb, ldc);
    const int64_t ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
    float* a = gemm_scratch<4>(ar * ac);  // the operands as they are stored, widened (dense)
    float* b = gemm_scratch<5>(br * bc);
    float* c = gemm_scratch<6>(M * N);
    widen_into(A, ar, ac, lda, a);
    widen_into(B, br, bc, ldb, b);
    gemm_trans_blas(ta, tb, M, N, K, a, ac, b, bc, c, N);
    if (accumulate)
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) c[i * N + j] += to_compute(C[i * ldc + j]);
    for (int64_t i = 0; i < M; ++i) narrow_into(c + i * N, N, C + i * ldc);
    return;
  }
#endif
  gemm_trans_loop(ta, tb, M, N, K, A, lda, B, ldb, C, ldc, accumulate);
}

// C[M, N] += A[M, K] x B[K, N], all dense row-major (a term of an overlap's sum of GEMMs after its
// first; grad.h matmul_nt_acc is the matmul_nt one).
template <class T>
void matmul_acc(const T* A, const T* B, T* C, int64_t M, int64_t K, int64_t N) {
  gemm_trans(false, false, M, N, K, A, K, B, N, C, N, true);
}

// ---- a matmul in steps (overlap.h): B prepared once, rows of C in blocks ------------------------

// What a GEMM of T takes as its B operand once prepared: f32 for f16/bf16 (widened once per
// overlap, not once per chunk), T itself otherwise.
#ifndef COCONET_NO_BLAS
template <class T>
using gemm_b_t = std::conditional_t<is_half_like<T>::value, float, T>;
#else
template <class T>
using gemm_b_t = T;
#endif

// B[K, N] (leading dim ldb) as gemm_steps takes it: f16/bf16 widened into a per-thread dense
// f32 copy (leading dim N: pass gemm_b_ld), other types as they are.
template <class T>
const gemm_b_t<T>* gemm_prepare_b(const T* B, int64_t K, int64_t N, int64_t ldb) {
#ifndef COCONET_NO_BLAS
  if constexpr (is_half_like<T>::value) {
    float* b = gemm_scratch<3>(K * N);
    widen_into(B, K, N, ldb, b);
    return b;
  } else
#endif
  {
    (void)K;
    (void)N;
    (void)ldb;
    return B;
  }
}

// The leading dim of gemm_prepare_b's result.
template <class T>
int64_t gemm_b_ld(int64_t N, int64_t ldb) {
#ifndef COCONET_NO_BLAS
  if constexpr (is_half_like<T>::value) return N;
#endif
  return ldb;
}

// Rows of C per step of gemm_steps: few enough GEMM calls that B's packing stays cheap.
constexpr int64_t kGemmStepRows = 256;

// C[M, N] = A[M, K] x Bp (prepared by gemm_prepare_b) in up to max_steps row blocks of about
// kGemmStepRows rows or more (starting at multiples of kGemmRowAlign), calling between() after
// every block but the last (overlap.h drives the communication in flight there).  Each element gets the products and sums of gemm().
template <class T, class Between>
void gemm_steps(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const gemm_b_t<T>* Bp,
                int64_t ldbp, T* C, int64_t ldc, int max_steps, Between between) {
  const int64_t steps =
      std::max<int64_t>(1, std::min<int64_t>(max_steps, M / kGemmStepRows));
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t lo = M * s / steps / kGemmRowAlign * kGemmRowAlign;
    const int64_t hi = s + 1 == steps ? M : M * (s + 1) / steps / kGemmRowAlign * kGemmRowAlign;
    const T* a = A + lo * lda;
    T* c = C + lo * ldc;
#ifndef COCONET_NO_BLAS
    if constexpr (is_half_like<T>::value) {
      if (hi > lo && N > 0 && K > 0) {
        require_blas_dims(hi - lo, N, K, lda, ldbp, ldc);
        gemm_widened_a(hi - lo, N, K, a, lda, Bp, ldbp, c, ldc);
      } else {
        gemm(hi - lo, N, K, a, lda, static_cast<const T*>(nullptr), ldbp, c, ldc);
      }
    } else
#endif
    {
      gemm(hi - lo, N, K, a, lda, Bp, ldbp, c, ldc);
    }
    if (s + 1 < steps) between();
  }
}

}  // namespace coconet
