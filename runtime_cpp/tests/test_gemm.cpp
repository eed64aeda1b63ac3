// gemm.h: matmul for every dtype against a naive loop in double, with empty dims and leading
// dimensions larger than the rows.
#include "coconet/gemm.h"
#include "test_util.h"

namespace t {
namespace {

template <class T>
void gemm_case(int64_t M, int64_t K, int64_t N, int64_t pad) {
  int64_t lda = K + pad, ldb = N + pad, ldc = N + pad;
  auto val = [](uint64_t seed, int64_t i) {
    return std::is_integral<T>::value ? double(small_int(seed, 0, i)) : uniform(seed, 0, i);
  };
  std::vector<T> A(size_t(M * lda + 1)), B(size_t(K * ldb + 1)), C(size_t(M * ldc + 1), make<T>(77));
  for (size_t i = 0; i < A.size(); ++i) A[i] = make<T>(val(1, int64_t(i)));
  for (size_t i = 0; i < B.size(); ++i) B[i] = make<T>(val(2, int64_t(i)));
  gemm(M, N, K, A.data(), lda, B.data(), ldb, C.data(), ldc);
  std::vector<T> got, want;
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += as_double(A[size_t(i * lda + k)]) * as_double(B[size_t(k * ldb + j)]);
      want.push_back(make<T>(acc));
      got.push_back(C[size_t(i * ldc + j)]);
    }
  }
  double rtol = std::is_integral<T>::value ? 0.0 : std::max(tol<T>(), 1e-6) * double(K + 1);
  same(got, want, rtol, label("gemm M K N", M, K, N, "pad", pad));
  bool untouched = true;  // padding columns of C are not written
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = N; j < ldc; ++j) untouched = untouched && as_double(C[size_t(i * ldc + j)]) == 77.0;
  check(untouched, label("gemm leaves C's padding alone", M, K, N));
}

template <class T>
void gemm_suite() {
  const int64_t dims[][3] = {{0, 3, 4}, {3, 0, 4}, {3, 4, 0}, {1, 1, 1}, {5, 7, 3}, {17, 33, 9}, {64, 64, 64}};
  for (auto& d : dims)
    for (int64_t pad : {0, 3}) gemm_case<T>(d[0], d[1], d[2], pad);
  std::vector<T> A = {make<T>(1), make<T>(2), make<T>(3), make<T>(4)}, C(4);
  matmul(A.data(), A.data(), C.data(), 2, 2, 2);  // [[1,2],[3,4]]^2 = [[7,10],[15,22]]
  same(C, std::vector<T>{make<T>(7), make<T>(10), make<T>(15), make<T>(22)}, 0.0, "matmul 2x2");
}

}  // namespace

void test_gemm() {
  set_blas_threads(1);
  for_each_dtype([&](auto tag) { gemm_suite<decltype(tag)>(); });
}

}  // namespace t
