// gemm.h: matmul (and gemm_trans, with transposed operands) for every dtype against a naive
// loop in double, with empty dims and leading dimensions larger than the rows.
#include <limits>

#include <cstring>

#include "coconet/gemm.h"
#include "coconet/grad.h"
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

// gemm_trans (grad.h's matmul_nt and matmul_tn): C[M, N] = op(A) op(B) with every pair of
// transpose flags, each operand stored as it is read (A[K, M] when transposed), padded rows.
template <class T>
void gemm_trans_case(bool ta, bool tb, int64_t M, int64_t K, int64_t N, int64_t pad) {
  const int64_t ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
  const int64_t lda = ac + pad, ldb = bc + pad, ldc = N + pad;
  auto val = [](uint64_t seed, int64_t i) {
    return std::is_integral<T>::value ? double(small_int(seed, 0, i)) : uniform(seed, 0, i);
  };
  std::vector<T> A(size_t(ar * lda + 1)), B(size_t(br * ldb + 1)), C(size_t(M * ldc + 1), make<T>(77));
  for (size_t i = 0; i < A.size(); ++i) A[i] = make<T>(val(3, int64_t(i)));
  for (size_t i = 0; i < B.size(); ++i) B[i] = make<T>(val(4, int64_t(i)));
  coconet::gemm_trans(ta, tb, M, N, K, A.data(), lda, B.data(), ldb, C.data(), ldc);
  std::vector<T> got, want;
  bool untouched = true;  // padding columns of C are not written
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k)
        acc += as_double(A[size_t(ta ? k * lda + i : i * lda + k)]) * as_double(B[size_t(tb ? j * ldb + k : k * ldb + j)]);
      want.push_back(make<T>(acc));
      got.push_back(C[size_t(i * ldc + j)]);
    }
    for (int64_t j = N; j < ldc; ++j) untouched = untouched && as_double(C[size_t(i * ldc + j)]) == 77.0;
  }
  double rtol = std::is_integral<T>::value ? 0.0 : std::max(tol<T>(), 1e-6) * double(K + 1);
  same(got, want, rtol, label("gemm_trans ta tb M K N", int(ta), int(tb), M, K, N, "pad", pad));
  check(untouched, label("gemm_trans leaves C's padding alone", int(ta), int(tb), M, K, N));
}

template <class T>
void gemm_suite() {
  const int64_t dims[][3] = {{0, 3, 4}, {3, 0, 4}, {3, 4, 0}, {1, 1, 1}, {5, 7, 3}, {17, 33, 9}, {64, 64, 64}};
  for (auto& d : dims)
    for (int64_t pad : {0, 3}) {
      gemm_case<T>(d[0], d[1], d[2], pad);
      for (bool ta : {false, true})
        for (bool tb : {false, true}) gemm_trans_case<T>(ta, tb, d[0], d[1], d[2], pad);
    }
  std::vector<T> A = {make<T>(1), make<T>(2), make<T>(3), make<T>(4)}, C(4);
  matmul(A.data(), A.data(), C.data(), 2, 2, 2);  // [[1,2],[3,4]]^2 = [[7,10],[15,22]]
  same(C, std::vector<T>{make<T>(7), make<T>(10), make<T>(15), make<T>(22)}, 0.0, "matmul 2x2");
}

// gemm_steps (B prepared once, rows of C in blocks, a callback between blocks) and the blocked
// f16/bf16 path give what one GEMM call of the whole does (for f16/bf16: one sgemm of whole
// widened copies, rounded back): exactly for integers; for floats within the rounding of a GEMM
// of K products, since OpenBLAS picks its kernel and blocking by the matrix sizes, so a block
// of rows may round differently in the last bit than the whole (seen on AVX-512 machines).
template <class T>
void gemm_steps_case(int64_t M, int64_t K, int64_t N, int max_steps) {
  auto val = [](uint64_t seed, int64_t i) {
    return std::is_integral<T>::value ? double(small_int(seed, 0, i)) : uniform(seed, 0, i);
  };
  std::vector<T> A(size_t(M * K)), B(size_t(K * N)), C(size_t(M * N)), want(size_t(M * N));
  for (size_t i = 0; i < A.size(); ++i) A[i] = make<T>(val(3, int64_t(i)));
  for (size_t i = 0; i < B.size(); ++i) B[i] = make<T>(val(4, int64_t(i)));
#ifndef COCONET_NO_BLAS
  if constexpr (coconet::is_half_like<T>::value) {
    std::vector<float> a(A.begin(), A.end()), b(B.begin(), B.end()), c(size_t(M * N));
    coconet::gemm_blas(M, N, K, a.data(), K, b.data(), N, c.data(), N);
    for (size_t i = 0; i < c.size(); ++i) want[i] = T(c[i]);
  } else
#endif
  {
    gemm(M, N, K, A.data(), K, B.data(), N, want.data(), N);
  }
  int calls = 0;
  const auto* bp = coconet::gemm_prepare_b<T>(B.data(), K, N, N);
  coconet::gemm_steps<T>(M, N, K, A.data(), K, bp, coconet::gemm_b_ld<T>(N, N), C.data(), N,
                         max_steps, [&] { ++calls; });
  // f32/f64: a few roundings per product and sum; f16/bf16: the f32 sums round to the same
  // value but for one at a rounding boundary, a few units in the last place of the output
  double rtol = 0.0;
  if constexpr (coconet::is_half_like<T>::value) rtol = tol<T>();
  else if constexpr (std::is_floating_point<T>::value) rtol = 4.0 * std::numeric_limits<T>::epsilon() * double(K + 1);
  same(C, want, rtol, label("gemm_steps M K N", M, K, N));
  const int64_t steps = std::max<int64_t>(1, std::min<int64_t>(max_steps, M / coconet::kGemmStepRows));
  check(calls == steps - 1, label("gemm_steps calls between blocks", calls, steps));
  std::vector<T> C2(size_t(M * N));
  gemm(M, N, K, A.data(), K, B.data(), N, C2.data(), N);
  same(C2, want, rtol, label("gemm (blocked widening) M K N", M, K, N));
}

// grad.h layernorm_dx_grads (plan/lngrads.py): dx, dgamma and dbeta of one pass are the three
// separate calls' (layernorm_dx, layernorm_dgamma, sum_lead) bit for bit, with and without the
// residual, and with either gradient left out (nullptr: nothing written there).
template <class T>
void layernorm_grads_case(int64_t rows, int64_t h, bool with_add) {
  const size_t n = static_cast<size_t>(rows * h), hn = static_cast<size_t>(h);
  std::vector<T> x(n), g(n), add(n), gam(hn);
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = make<T>(uniform(11, 0, int64_t(i)) * 3.0);
    g[i] = make<T>(uniform(12, 0, int64_t(i)));
    add[i] = make<T>(uniform(13, 0, int64_t(i)));
  }
  for (int64_t j = 0; j < h; ++j) gam[size_t(j)] = make<T>(1.0 + uniform(14, 0, j));
  const T* a = with_add ? add.data() : nullptr;
  std::vector<T> dx(n), dgam(hn), dbet(hn);
  layernorm_dx<T>(x.data(), gam.data(), g.data(), dx.data(), 1e-5, rows, h, a);
  layernorm_dgamma<T>(x.data(), g.data(), dgam.data(), 1e-5, rows, h);
  sum_lead<T>(g.data(), dbet.data(), rows, h);
  const auto bits = [](const std::vector<T>& u, const std::vector<T>& v) {
    return u.size() == v.size() && std::memcmp(u.data(), v.data(), u.size() * sizeof(T)) == 0;
  };
  for (int which = 0; which < 3; ++which) {  // both, dgamma only, dbeta only
    std::vector<T> dx2(n), dg2(hn, make<T>(77)), db2(hn, make<T>(77));
    layernorm_dx_grads<T>(x.data(), gam.data(), g.data(), dx2.data(), which != 2 ? dg2.data() : nullptr,
                          which != 1 ? db2.data() : nullptr, 1e-5, rows, h, a);
    const std::string what = label("layernorm_dx_grads rows h add which", rows, h, int(with_add), which);
    check(bits(dx2, dx), what + ": dx");
    check(which == 2 ? bits(dg2, std::vector<T>(hn, make<T>(77))) : bits(dg2, dgam), what + ": dgamma");
    check(which == 1 ? bits(db2, std::vector<T>(hn, make<T>(77))) : bits(db2, dbet), what + ": dbeta");
  }
}

}  // namespace

void test_gemm() {
  set_blas_threads(1);
  for_each_dtype([&](auto tag) { gemm_suite<decltype(tag)>(); });
  for_each_dtype([&](auto tag) {
    gemm_steps_case<decltype(tag)>(1030, 17, 9, 4);
    gemm_steps_case<decltype(tag)>(3000, 300, 100, 3);  // f16/bf16: two widening blocks
    gemm_steps_case<decltype(tag)>(100, 5, 7, 4);       // fewer rows than one step
  });
  for_each_dtype([&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_integral<T>::value) {
      for (bool with_add : {false, true}) {
        layernorm_grads_case<T>(37, 100, with_add);  // h not a multiple of the row loop's lanes
        layernorm_grads_case<T>(5, 1024, with_add);
        layernorm_grads_case<T>(0, 16, with_add);
      }
    }
  });
}

}  // namespace t
