// Compiles gemm.h, grad.h and dtypes.h without BLAS and without MPI (COCONET_NO_BLAS,
// COCONET_NO_MPI) and checks the loop matmul, matmul_nt and matmul_tn of every dtype.  Prints
// "N passed, M failed" (one per dtype).
#include <cmath>
#include <cstdio>
#include <vector>

#include "coconet/gemm.h"
#include "coconet/grad.h"

using namespace coconet;

template <class T>
int check_type() {
  const int64_t M = 5, K = 6, N = 4;
  std::vector<T> A(M * K), B(K * N), C(M * N);
  for (int64_t i = 0; i < M * K; ++i) A[i] = from_compute<T>(compute_t<T>(i % 5 - 2));
  for (int64_t i = 0; i < K * N; ++i) B[i] = from_compute<T>(compute_t<T>(i % 3 - 1));
  matmul(A.data(), B.data(), C.data(), M, K, N);
  int bad = 0;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += double(to_compute(A[i * K + k])) * double(to_compute(B[k * N + j]));
      bad += std::fabs(double(to_compute(C[i * N + j])) - acc) > 0;
    }
  // matmul_nt: D[M, K] = C[M, N] x B[K, N]^T
  std::vector<T> D(M * K), E(K * N);
  matmul_nt(C.data(), B.data(), D.data(), M, N, K);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t k = 0; k < K; ++k) {
      double acc = 0;
      for (int64_t j = 0; j < N; ++j) acc += double(to_compute(C[i * N + j])) * double(to_compute(B[k * N + j]));
      bad += std::fabs(double(to_compute(D[i * K + k])) - acc) > 0;
    }
  // matmul_tn: E[K, N] = A[M, K]^T x C[M, N]
  matmul_tn(A.data(), C.data(), E.data(), M, K, N);
  for (int64_t k = 0; k < K; ++k)
    for (int64_t j = 0; j < N; ++j) {
      double acc = 0;
      for (int64_t i = 0; i < M; ++i) acc += double(to_compute(A[i * K + k])) * double(to_compute(C[i * N + j]));
      bad += std::fabs(double(to_compute(E[k * N + j])) - acc) > 0;
    }
  return bad == 0;
}

int main() {
  int ok = check_type<half>() + check_type<bfloat16>() + check_type<float>() +
           check_type<double>() + check_type<int32_t>() + check_type<int64_t>();
  std::printf("%d passed, %d failed\n", ok, 6 - ok);
  return ok == 6 ? 0 : 1;
}
