// Compiles gemm.h, grad.h and dtypes.h without BLAS and without MPI (COCONET_NO_BLAS,
// COCONET_NO_MPI) and checks the loop matmul, matmul_nt and matmul_tn of every dtype; and the
// generated loops' thread pool (loop_pool.h).  Prints "N passed, M failed" (one per dtype, one
// for the pool).
#include <atomic>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <thread>
#include <vector>

#include "coconet/gemm.h"
#include "coconet/grad.h"
#include "coconet/loop_pool.h"

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

// LoopPool::run: every block exactly once on 1 to 4 threads; an exception thrown by a block is
// rethrown by run once every thread has stopped, and the pool runs the next loop; loops started
// from two threads at once (one of them then runs alone) each run every block once.
int check_loop_pool() {
  LoopPool& pool = loop_pool();
  int bad = 0;
  for (int threads = 1; threads <= 4; ++threads)
    for (int64_t nb : {0, 1, 3, 100, 1000}) {
      std::vector<std::atomic<int>> seen(static_cast<size_t>(nb));
      for (auto& s : seen) s = 0;
      pool.run(nb, threads, [&](int64_t b) { seen[static_cast<size_t>(b)]++; });
      for (auto& s : seen) bad += s != 1;
    }
  bool thrown = false;
  try {
    pool.run(100, 3, [](int64_t b) {
      if (b == 5) throw std::runtime_error("block 5");
    });
  } catch (const std::runtime_error& e) {
    thrown = std::string(e.what()) == "block 5";
  }
  bad += !thrown;
  std::atomic<int64_t> sums[2] = {{0}, {0}};
  std::vector<std::thread> callers;
  for (int c = 0; c < 2; ++c)
    callers.emplace_back([&, c] {
      for (int rep = 0; rep < 50; ++rep) pool.run(64, 2, [&](int64_t b) { sums[c] += b + 1; });
    });
  for (auto& t : callers) t.join();
  for (auto& s : sums) bad += s != 50 * 64 * 65 / 2;
  return bad == 0;
}

int main() {
  int ok = check_type<half>() + check_type<bfloat16>() + check_type<float>() +
           check_type<double>() + check_type<int32_t>() + check_type<int64_t>() + check_loop_pool();
  std::printf("%d passed, %d failed\n", ok, 7 - ok);
  return ok == 7 ? 0 : 1;
}
