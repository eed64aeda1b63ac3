// attention.h: the fused causal attention (forward and backward) against a naive reference in
// double written here with plain loops: M = N and M != N, diagonals -1 / 0 / 2, dropout off and
// at 0.3, every optional output given or not, the backward from s_in or p_in with a_in given or
// not, p_in read whole (p_whole) from the forward or not, a sliced batch index, empty sizes, float
// and double.  The cases are shared out over the ranks (each rank checks its own), so more ranks
// do not cost more time.
#include <limits>
#include <stdexcept>

#include "coconet/attention.h"
#include "test_util.h"

namespace t {
namespace {

struct Shape {
  int64_t outer, mid_local, mid_global, mid_offset, inner, M, N, D, E;
};

// The reference, every array [batch, ...] in double.
struct Ref {
  std::vector<double> s, w, p, a, o, dq, dk, dv;
};

Ref reference(const Shape& sh, const std::vector<double>& q, const std::vector<double>& k,
              const std::vector<double>& v, const std::vector<double>& g, int64_t diagonal, double scale,
              double drop_p, int64_t seed, uint32_t site) {
  const int64_t M = sh.M, N = sh.N, D = sh.D, E = sh.E;
  const int64_t batch = sh.outer * sh.mid_local * sh.inner;
  const double inf = std::numeric_limits<double>::infinity();
  Ref r;
  r.s.assign(size_t(batch * M * N), 0.0);
  r.w = r.p = r.a = r.s;
  r.o.assign(size_t(batch * M * E), 0.0);
  r.dq.assign(size_t(batch * M * D), 0.0);
  r.dk.assign(size_t(batch * N * D), 0.0);
  r.dv.assign(size_t(batch * N * E), 0.0);
  const uint32_t threshold = dropout_threshold(drop_p);
  for (int64_t o = 0; o < sh.outer; ++o)
    for (int64_t m = 0; m < sh.mid_local; ++m)
      for (int64_t ri = 0; ri < sh.inner; ++ri) {
        const int64_t b = (o * sh.mid_local + m) * sh.inner + ri;
        const int64_t global_b = (o * sh.mid_global + sh.mid_offset + m) * sh.inner + ri;
        std::vector<double> keepf(size_t(M * N), 1.0);  // the dropout factor of each element
        for (int64_t i = 0; i < M; ++i) {
          const size_t row = size_t((b * M + i) * N);
          double mx = -inf;
          for (int64_t j = 0; j < N; ++j) {
            double acc = 0;
            for (int64_t d = 0; d < D; ++d) acc += q[size_t((b * M + i) * D + d)] * k[size_t((b * N + j) * D + d)];
            r.s[row + size_t(j)] = scale * acc;
            r.w[row + size_t(j)] = j - i <= diagonal ? scale * acc : -inf;
            mx = std::max(mx, r.w[row + size_t(j)]);
          }
          double sum = 0;
          for (int64_t j = 0; j < N; ++j)
            sum += r.w[row + size_t(j)] == -inf ? 0.0 : std::exp(r.w[row + size_t(j)] - mx);
          for (int64_t j = 0; j < N; ++j) {
            const double e = r.w[row + size_t(j)] == -inf ? 0.0 : std::exp(r.w[row + size_t(j)] - mx);
            r.p[row + size_t(j)] = sum > 0 ? e / sum : 0.0;
            if (drop_p > 0) {
              const uint64_t gidx = uint64_t((global_b * M + i) * N + j);
              keepf[size_t(i * N + j)] = dropout_keep(uint64_t(seed), site, gidx, threshold) ? 1.0 / (1.0 - drop_p) : 0.0;
            }
            r.a[row + size_t(j)] = r.p[row + size_t(j)] * keepf[size_t(i * N + j)];
          }
          for (int64_t e = 0; e < E; ++e) {
            double acc = 0;
            for (int64_t j = 0; j < N; ++j) acc += r.a[row + size_t(j)] * v[size_t((b * N + j) * E + e)];
            r.o[size_t((b * M + i) * E + e)] = acc;
          }
        }
        // backward
        for (int64_t i = 0; i < M; ++i) {
          const size_t row = size_t((b * M + i) * N);
          std::vector<double> dP(static_cast<size_t>(N));
          double rr = 0;
          for (int64_t j = 0; j < N; ++j) {
            double dA = 0;
            for (int64_t e = 0; e < E; ++e) dA += g[size_t((b * M + i) * E + e)] * v[size_t((b * N + j) * E + e)];
            dP[size_t(j)] = dA * keepf[size_t(i * N + j)];
            rr += dP[size_t(j)] * r.p[row + size_t(j)];
          }
          for (int64_t j = 0; j < N; ++j) {
            const double dS = j - i <= diagonal ? r.p[row + size_t(j)] * (dP[size_t(j)] - rr) * scale : 0.0;
            for (int64_t d = 0; d < D; ++d) {
              r.dq[size_t((b * M + i) * D + d)] += dS * k[size_t((b * N + j) * D + d)];
              r.dk[size_t((b * N + j) * D + d)] += dS * q[size_t((b * M + i) * D + d)];
            }
            for (int64_t e = 0; e < E; ++e)
              r.dv[size_t((b * N + j) * E + e)] += r.a[row + size_t(j)] * g[size_t((b * M + i) * E + e)];
          }
        }
      }
  return r;
}

// The pieces' backward from a given P (every entry read, as sum_keep(dP * P) reads them) with
// A = dropout(P) masked (a_every_entry: dropout(P) at every entry): dq, dk, dv.
Ref pieces_backward(const Shape& sh, const std::vector<double>& P, const std::vector<double>& q,
                    const std::vector<double>& k, const std::vector<double>& v, const std::vector<double>& g,
                    int64_t diagonal, double scale, double drop_p, int64_t seed, uint32_t site,
                    bool a_every_entry = false) {
  const int64_t M = sh.M, N = sh.N, D = sh.D, E = sh.E;
  const int64_t batch = sh.outer * sh.mid_local * sh.inner;
  Ref r;
  r.dq.assign(size_t(batch * M * D), 0.0);
  r.dk.assign(size_t(batch * N * D), 0.0);
  r.dv.assign(size_t(batch * N * E), 0.0);
  const uint32_t threshold = dropout_threshold(drop_p);
  for (int64_t o = 0; o < sh.outer; ++o)
    for (int64_t m = 0; m < sh.mid_local; ++m)
      for (int64_t ri = 0; ri < sh.inner; ++ri) {
        const int64_t b = (o * sh.mid_local + m) * sh.inner + ri;
        const int64_t global_b = (o * sh.mid_global + sh.mid_offset + m) * sh.inner + ri;
        for (int64_t i = 0; i < M; ++i) {
          const size_t row = size_t((b * M + i) * N);
          std::vector<double> dP(static_cast<size_t>(N)), keepf(static_cast<size_t>(N), 1.0);
          double rr = 0;
          for (int64_t j = 0; j < N; ++j) {
            if (drop_p > 0)
              keepf[size_t(j)] = dropout_keep(uint64_t(seed), site, uint64_t((global_b * M + i) * N + j), threshold)
                                     ? 1.0 / (1.0 - drop_p) : 0.0;
            double dA = 0;
            for (int64_t e = 0; e < E; ++e) dA += g[size_t((b * M + i) * E + e)] * v[size_t((b * N + j) * E + e)];
            dP[size_t(j)] = dA * keepf[size_t(j)];
            rr += dP[size_t(j)] * P[row + size_t(j)];
          }
          for (int64_t j = 0; j < N; ++j) {
            const bool kept = j - i <= diagonal;
            const double dS = kept ? P[row + size_t(j)] * (dP[size_t(j)] - rr) * scale : 0.0;
            const double A = kept || a_every_entry ? P[row + size_t(j)] * keepf[size_t(j)] : 0.0;
            for (int64_t d = 0; d < D; ++d) {
              r.dq[size_t((b * M + i) * D + d)] += dS * k[size_t((b * N + j) * D + d)];
              r.dk[size_t((b * N + j) * D + d)] += dS * q[size_t((b * M + i) * D + d)];
            }
            for (int64_t e = 0; e < E; ++e) r.dv[size_t((b * N + j) * E + e)] += A * g[size_t((b * M + i) * E + e)];
          }
        }
      }
  return r;
}

template <class T>
std::vector<T> to_t(const std::vector<double>& x) {
  std::vector<T> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = T(x[i]);
  return y;
}

template <class T>
bool close(const std::vector<T>& got, const std::vector<double>& want, double rtol, const std::string& what) {
  if (!check(got.size() == want.size(), what + ": sizes differ")) return false;
  for (size_t i = 0; i < got.size(); ++i) {
    const double gv = double(got[i]), wv = want[i];
    const bool ok = gv == wv || std::fabs(gv - wv) <= rtol * (1.0 + std::fabs(wv));  // gv == wv: -inf
    if (!ok) {
      std::ostringstream os;
      os << what << " [" << dtype_name<T>() << "]: index " << i << " of " << got.size() << " got " << gv
         << " want " << wv;
      return check(false, os.str());
    }
  }
  return check(true, what);
}

template <class T>
void attention_case(const Shape& sh, int64_t diagonal, double drop_p) {
  const int64_t M = sh.M, N = sh.N, D = sh.D, E = sh.E;
  const int64_t batch = sh.outer * sh.mid_local * sh.inner;
  const AttentionIndex at{sh.mid_local, sh.mid_global, sh.mid_offset, sh.inner};
  const double scale = D > 0 ? 1.0 / std::sqrt(double(D)) : 0.5;
  const int64_t seed = -1234567890123ll;
  const uint32_t site = site_key("attn.drop");
  // inputs exactly representable in T, so the reference sees the same values
  const auto data = [](uint64_t sd, int64_t n) {
    std::vector<double> x(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) x[size_t(i)] = double(T(2.0 * uniform(sd, 0, i)));
    return x;
  };
  const std::vector<double> q = data(11, batch * M * D), k = data(12, batch * N * D), v = data(13, batch * N * E),
                            g = data(14, batch * M * E);
  const Ref ref = reference(sh, q, k, v, g, diagonal, scale, drop_p, seed, site);
  const std::vector<T> qt = to_t<T>(q), kt = to_t<T>(k), vt = to_t<T>(v), gt = to_t<T>(g);
  const double rtol = std::is_same<T, float>::value ? 1e-4 : 1e-10;
  const T nan = std::numeric_limits<T>::quiet_NaN();
  const std::string what = label("attention M N D E", M, N, D, E, "batch", batch, "diag", diagonal, "p", drop_p,
                                 "mid", sh.mid_local, sh.mid_global, sh.mid_offset);

  // forward, every output given (prefilled with NaN: each must be written whole)
  const size_t ns = size_t(batch * M * N);
  std::vector<T> o(size_t(batch * M * E), nan), s(ns, nan), w(ns, nan), p(ns, nan), a(ns, nan);
  attention_fwd<T>(qt.data(), kt.data(), vt.data(), o.data(), s.data(), w.data(), p.data(), a.data(), batch, M, N,
                   D, E, diagonal, scale, drop_p, seed, site, at);
  close(o, ref.o, rtol, what + " fwd o (all outputs)");
  close(s, ref.s, rtol, what + " fwd s");
  close(w, ref.w, rtol, what + " fwd w");
  close(p, ref.p, rtol, what + " fwd p");
  close(a, ref.a, rtol, what + " fwd a");
  // forward, o only; then p and a alone
  std::vector<T> o2(o.size(), nan);
  attention_fwd<T>(qt.data(), kt.data(), vt.data(), o2.data(), nullptr, nullptr, nullptr, nullptr, batch, M, N, D,
                   E, diagonal, scale, drop_p, seed, site, at);
  close(o2, ref.o, rtol, what + " fwd o (no outputs)");
  std::vector<T> o3(o.size(), nan), p3(ns, nan), a3(ns, nan);
  attention_fwd<T>(qt.data(), kt.data(), vt.data(), o3.data(), nullptr, nullptr, p3.data(), a3.data(), batch, M, N,
                   D, E, diagonal, scale, drop_p, seed, site, at);
  close(o3, ref.o, rtol, what + " fwd o (p, a)");
  close(p3, ref.p, rtol, what + " fwd p (p, a)");
  close(a3, ref.a, rtol, what + " fwd a (p, a)");

  // backward: s_in or p_in, a_in or not, each with its masked entries NaN (only the kept ones may
  // be read)
  std::vector<T> s_kept = s, p_kept = p, a_kept = a;  // the masked entries NaN
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j)
        if (j - i > diagonal) s_kept[size_t((b * M + i) * N + j)] = p_kept[size_t((b * M + i) * N + j)] =
                                  a_kept[size_t((b * M + i) * N + j)] = nan;
  for (int variant = 0; variant < 4; ++variant) {
    const bool from_p = variant & 1, with_a = variant & 2;
    std::vector<T> dq(size_t(batch * M * D), nan), dk(size_t(batch * N * D), nan), dv(size_t(batch * N * E), nan);
    attention_bwd<T>(qt.data(), kt.data(), vt.data(), from_p ? nullptr : s_kept.data(), from_p ? p_kept.data() : nullptr,
                     with_a ? a_kept.data() : nullptr, gt.data(), dq.data(), dk.data(), dv.data(), batch, M, N, D, E,
                     diagonal, scale, drop_p, seed, site, at);
    const std::string how = what + (from_p ? " bwd from p_in" : " bwd from s_in") + (with_a ? " a_in" : "");
    close(dq, ref.dq, rtol, how + " dq");
    close(dk, ref.dk, rtol, how + " dk");
    close(dv, ref.dv, rtol, how + " dv");
  }
  // a_in that is not the forward's a (a backward program's input): dq and dk still take the
  // mask from Philox, dv = a_in^T g over the kept entries
  std::vector<T> a_rand(ns, nan);
  std::vector<double> dv_want(size_t(batch * N * E), 0.0);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N && j - i <= diagonal; ++j) {
        const T x = T(uniform(15, 0, (b * M + i) * N + j));
        a_rand[size_t((b * M + i) * N + j)] = x;
        for (int64_t e = 0; e < E; ++e) dv_want[size_t((b * N + j) * E + e)] += double(x) * g[size_t((b * M + i) * E + e)];
      }
  std::vector<T> dq(size_t(batch * M * D), nan), dk(size_t(batch * N * D), nan), dv(size_t(batch * N * E), nan);
  attention_bwd<T>(qt.data(), kt.data(), vt.data(), nullptr, p_kept.data(), a_rand.data(), gt.data(), dq.data(),
                   dk.data(), dv.data(), batch, M, N, D, E, diagonal, scale, drop_p, seed, site, at);
  close(dq, ref.dq, rtol, what + " bwd other a_in dq");
  close(dk, ref.dk, rtol, what + " bwd other a_in dk");
  close(dv, dv_want, rtol, what + " bwd other a_in dv");
  // a_whole: a_in's masked entries nonzero too (random), and dv reads every one of them, as the
  // pieces' a^T g does
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        if (j - i <= diagonal) continue;
        const T x = T(uniform(16, 0, (b * M + i) * N + j));
        a_rand[size_t((b * M + i) * N + j)] = x;
        for (int64_t e = 0; e < E; ++e) dv_want[size_t((b * N + j) * E + e)] += double(x) * g[size_t((b * M + i) * E + e)];
      }
  std::vector<T> dq2(dq.size(), nan), dk2(dk.size(), nan), dv2(dv.size(), nan);
  attention_bwd<T>(qt.data(), kt.data(), vt.data(), s_kept.data(), nullptr, a_rand.data(), gt.data(), dq2.data(),
                   dk2.data(), dv2.data(), batch, M, N, D, E, diagonal, scale, drop_p, seed, site, at, true);
  close(dq2, ref.dq, rtol, what + " bwd whole a_in dq");
  close(dk2, ref.dk, rtol, what + " bwd whole a_in dk");
  close(dv2, dv_want, rtol, what + " bwd whole a_in dv");
  // p_whole: the forward's p (masked entries 0) gives the forward's gradients; a p_in whose masked
  // entries are nonzero in some rows (every third row's, random) is read whole, as the pieces'
  // sum_keep(dP * P) reads it, and A (no a_in) is dropout(P) at every entry of those rows, as a
  // backward program's a = dropout(p) of its saved p is
  for (int round = 0; round < 2; ++round) {
    std::vector<double> P(ref.p);
    if (round == 1)
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t i = 0; i < M; i += 3)
          for (int64_t j = 0; j < N; ++j)
            if (j - i > diagonal) P[size_t((b * M + i) * N + j)] = double(T(uniform(17, 0, (b * M + i) * N + j)));
    const Ref want = pieces_backward(sh, P, q, k, v, g, diagonal, scale, drop_p, seed, site, true);
    const std::vector<T> pt = to_t<T>(P);
    std::vector<T> dq3(dq.size(), nan), dk3(dk.size(), nan), dv3(dv.size(), nan);
    attention_bwd<T>(qt.data(), kt.data(), vt.data(), nullptr, pt.data(), nullptr, gt.data(), dq3.data(), dk3.data(),
                     dv3.data(), batch, M, N, D, E, diagonal, scale, drop_p, seed, site, at, false, true);
    const std::string how = what + (round ? " bwd whole foreign p_in" : " bwd whole forward's p_in");
    close(dq3, want.dq, rtol, how + " dq");
    close(dk3, want.dk, rtol, how + " dk");
    close(dv3, want.dv, rtol, how + " dv");
  }
}

// The float exp of the softmax (attention_exp) against std::exp in double: within 3 ulp over
// [-87, 0], 0 below -87.34 and at -inf, NaN kept.
void attention_exp_check() {
  double worst = 0;
  for (int i = 0; i <= 200000; ++i) {
    const float x = -87.0f * float(i) / 200000.0f;
    const double want = std::exp(double(x));
    worst = std::max(worst, std::fabs(double(detail::attention_exp(x)) - want) / want);
  }
  check(worst < 3.6e-7, label("attention_exp relative error", worst));
  check(detail::attention_exp(-90.0f) == 0.0f && detail::attention_exp(-std::numeric_limits<float>::infinity()) == 0.0f,
        "attention_exp underflows to 0");
  check(std::isnan(detail::attention_exp(std::numeric_limits<float>::quiet_NaN())), "attention_exp keeps NaN");
  check(detail::attention_exp(0.0f) == 1.0f, "attention_exp(0) is 1");
}

// A wrong call throws std::invalid_argument whose message names the parameter.
void attention_errors() {
  const AttentionIndex plain{1, 1, 0, 1};
  const auto throws = [](const std::string& name, auto f) {
    try {
      f();
    } catch (const std::invalid_argument& e) {
      check(std::string(e.what()).find(name) != std::string::npos,
            "attention error names " + name + ": " + e.what());
      return;
    }
    check(false, "attention: no error for a bad " + name);
  };
  float x[64] = {};
  throws("M", [&] {
    attention_fwd<float>(x, x, x, x, nullptr, nullptr, nullptr, nullptr, 1, -1, 2, 2, 2, 0, 1.0, 0.0, 0, 0, plain);
  });
  throws("s_in", [&] {
    attention_bwd<float>(x, x, x, nullptr, nullptr, nullptr, x, x, x, x, 1, 2, 2, 2, 2, 0, 1.0, 0.0, 0, 0, plain);
  });
  throws("at.mid_offset", [&] {
    attention_fwd<float>(x, x, x, x, nullptr, nullptr, nullptr, nullptr, 2, 2, 2, 2, 2, 0, 1.0, 0.0, 0, 0,
                         AttentionIndex{2, 3, 2, 1});
  });
  throws("batch", [&] {
    attention_fwd<float>(x, x, x, x, nullptr, nullptr, nullptr, nullptr, 3, 2, 2, 2, 2, 0, 1.0, 0.0, 0, 0,
                         AttentionIndex{2, 4, 0, 1});
  });
}

}  // namespace

void test_attention() {
  int rank, size;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  // unsliced shapes: several row blocks (M > 64), M < N, M > N
  const Shape shapes[] = {{2, 1, 1, 0, 1, 70, 70, 8, 5}, {1, 1, 1, 0, 1, 20, 33, 6, 7}, {2, 1, 1, 0, 1, 75, 40, 4, 3}};
  // sliced: 2 (outer) x 2 of 4 mids from 2 x inner 1; and inner 3 with 1 of 2 mids from 1
  const Shape sliced[] = {{2, 2, 4, 2, 1, 9, 9, 4, 3}, {1, 1, 2, 1, 3, 5, 7, 3, 2}};
  // empty: batch 0 (also by mid_local 0), M 0, N 0, D 0, E 0
  const Shape empty[] = {{0, 1, 1, 0, 1, 4, 4, 2, 2}, {2, 0, 3, 3, 1, 4, 4, 2, 2} /* a rank with no head */, {1, 1, 1, 0, 1, 0, 4, 2, 2}, {1, 1, 1, 0, 1, 4, 0, 2, 2},
                         {1, 1, 1, 0, 1, 5, 5, 0, 2}, {1, 1, 1, 0, 1, 5, 5, 2, 0}};
  int64_t n = 0;
  const auto mine = [&] { return n++ % size == rank; };
  const auto both = [&](const Shape& sh, int64_t diag, double p) {
    if (mine()) attention_case<float>(sh, diag, p);
    if (mine()) attention_case<double>(sh, diag, p);
  };
  for (const Shape& sh : shapes)
    for (int64_t diag : {-1, 0, 2})
      for (double p : {0.0, 0.3}) both(sh, diag, p);
  for (const Shape& sh : sliced)
    for (double p : {0.0, 0.3}) both(sh, 0, p);
  for (const Shape& sh : empty) both(sh, 0, 0.3);
  both(Shape{1, 1, 1, 0, 1, 6, 6, 3, 3}, -10, 0.3);  // no kept entry at all
  both(Shape{1, 1, 1, 0, 1, 6, 4, 3, 3}, 10, 0.3);   // nothing masked
  if (mine()) attention_case<float>(Shape{1, 1, 1, 0, 1, 3, 3, 2, 2}, std::numeric_limits<int64_t>::max(), 0.0);
  if (mine()) attention_case<float>(Shape{1, 1, 1, 0, 1, 3, 3, 2, 2}, std::numeric_limits<int64_t>::min(), 0.0);
  if (mine()) attention_errors();
  if (mine()) attention_exp_check();
}

}  // namespace t
