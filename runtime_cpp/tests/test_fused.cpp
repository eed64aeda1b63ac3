// fused.h: the fused reduce-scatter + compute + all-gather (SGD, ZeRO Adam, scattered LAMB-like
// update, outer > 1, in-place on the input) and the fused allreduce + compute, each compared
// with the unfused reduce_scatter + compute + allgather of collectives.h.
#include <cmath>

#include "coconet/collectives.h"
#include "coconet/fused.h"
#include "test_util.h"

namespace t {
namespace {

const int64_t kChunks[] = {1, 3, 64, int64_t(1) << 20};

std::vector<int64_t> fused_sizes(int R) {
  std::vector<int64_t> v = test_sizes(R);
  v.push_back(4099);
  return v;
}

// Every rank holds the same values (a replicated result really was gathered everywhere).
template <class T>
void check_replicated(const std::vector<T>& x, Comm& c, const std::string& what) {
  std::vector<T> root = x;
  broadcast(x.data(), root.data(), int64_t(x.size()), 0, c);
  same(x, root, 0.0, what + " replicated");
}

// SGD: w -= lr * sum(g), fused vs unfused.
template <class T>
void sgd_case(Comm& c, Op op, int64_t n, int64_t chunk, int64_t piece) {
  std::vector<T> g = real_data<T>(n, c.rank, n), w0 = real_data<T>(n + 1, 0, n);
  const compute_t<T> lr = compute_t<T>(std::is_integral<T>::value ? 2 : 0.1);
  if (std::is_integral<T>::value) g = int_data<T>(n, c.rank, n), w0 = int_data<T>(n + 1, 0, n);
  auto step = [&](T& w, compute_t<T> gr) { w = from_compute<T>(to_compute(w) - lr * gr); };
  std::vector<T> w = w0;
  auto compute = [&](int64_t b, int64_t e, const compute_t<T>* red) {
    for (int64_t i = b; i < e; ++i) step(w[size_t(i)], red[i - b]);
  };
  fused_rs_compute_ag<T>(op, Segments<const T>::one(g.data(), n), Shape3{1, n, 1}, c, chunk,
                         compute, {gather_target(w.data(), n)}, piece);
  Range sl = slice_range(n, c.size, c.rank);
  std::vector<T> ws = w0, red(size_t(sl.size()));
  reduce_scatter(op, g.data(), red.data(), n, c);
  for (int64_t i = sl.begin; i < sl.end; ++i) step(ws[size_t(i)], to_compute(red[size_t(i - sl.begin)]));
  allgather(ws.data() + sl.begin, ws.data(), n, c);
  std::string what = label("fused sgd", op_name(op), "n =", n, "chunk", chunk);
  same(w, ws, tol<T>(), what);
  check_replicated(w, c, what);
}

// Adam with m, v sliced (ZeRO) and w gathered, fused vs unfused.
template <class T>
void adam_case(Comm& c, int64_t n, int64_t chunk) {
  using C = compute_t<T>;
  const C b1 = C(0.9), b2 = C(0.999), eps = C(1e-8), lr = C(0.01), stepn = C(3);
  Range sl = slice_range(n, c.size, c.rank);
  std::vector<T> g = real_data<T>(n + 9, c.rank, n), w0 = real_data<T>(n + 8, 0, n);
  std::vector<T> m0 = real_data<T>(n + 7, 0, sl.size()), v0(size_t(sl.size()));
  for (auto& x : v0) x = make<T>(0.5);
  auto update = [&](T* m, T* v, T& w, C gr) {
    C mm = b1 * to_compute(*m) + (1 - b1) * gr, vv = b2 * to_compute(*v) + (1 - b2) * gr * gr;
    *m = from_compute<T>(mm);
    *v = from_compute<T>(vv);
    C mh = to_compute(*m) / (1 - std::pow(b1, stepn)), vh = to_compute(*v) / (1 - std::pow(b2, stepn));
    w = from_compute<T>(to_compute(w) - lr * mh / (std::sqrt(vh) + eps));
  };
  std::vector<T> w = w0, m = m0, v = v0;
  auto compute = [&](int64_t b, int64_t e, const C* red) {
    for (int64_t i = b; i < e; ++i)
      update(&m[size_t(i - sl.begin)], &v[size_t(i - sl.begin)], w[size_t(i)], red[i - b]);
  };
  fused_rs_compute_ag<T>(Op::sum, g.data(), n, c, chunk, compute, {gather_target(w.data(), n)});
  std::vector<T> wu = w0, mu = m0, vu = v0, red(size_t(sl.size()));
  reduce_scatter(Op::sum, g.data(), red.data(), n, c);
  for (int64_t i = sl.begin; i < sl.end; ++i)
    update(&mu[size_t(i - sl.begin)], &vu[size_t(i - sl.begin)], wu[size_t(i)], to_compute(red[size_t(i - sl.begin)]));
  allgather(wu.data() + sl.begin, wu.data(), n, c);
  std::string what = label("fused adam n =", n, "chunk", chunk);
  same(m, mu, tol<T>(), what + " m");
  same(v, vu, tol<T>(), what + " v");
  same(w, wu, tol<T>(), what + " w");
  check_replicated(w, c, what);
}

// Scattered g and w (one buffer per "layer"), two gather targets, avg.
template <class T>
void scattered_case(Comm& c, int64_t n, int64_t chunk) {
  std::vector<int64_t> sizes;
  for (int64_t at = 0, i = 0; at < n; ++i) sizes.push_back(std::min<int64_t>(1 + (i * 5) % 11, n - at)), at += sizes.back();
  sizes.insert(sizes.begin(), 0);
  auto split = [&](std::vector<T>& flat) {
    std::vector<T*> p;
    int64_t at = 0;
    for (int64_t s : sizes) p.push_back(flat.data() + at), at += s;
    return Segments<T>(p, sizes);  // views into one vector, but addressed as segments
  };
  std::vector<T> g = real_data<T>(n + 3, c.rank, n), w0 = real_data<T>(n + 4, 0, n);
  std::vector<T> w = w0, u(size_t(n), make<T>(0));
  Segments<T> gs = split(g), ws = split(w), us = split(u);
  auto compute = [&](int64_t b, int64_t e, const compute_t<T>* red) {
    ws.for_each(b, e, [&](T* p, int64_t ro, int64_t len) {
      for (int64_t k = 0; k < len; ++k) p[k] = from_compute<T>(to_compute(p[k]) * compute_t<T>(0.5) + red[ro + k]);
    });
    us.for_each(b, e, [&](T* p, int64_t ro, int64_t len) {
      for (int64_t k = 0; k < len; ++k) p[k] = from_compute<T>(red[ro + k]);
    });
  };
  fused_rs_compute_ag<T>(Op::avg, Segments<const T>(gs), Shape3{1, n, 1}, c, chunk, compute,
                         {gather_target(ws), gather_target(us)});
  std::vector<T> ua = std::vector<T>(size_t(n)), wa = w0;
  allreduce(Op::avg, g.data(), ua.data(), n, c);
  for (int64_t i = 0; i < n; ++i) wa[size_t(i)] = from_compute<T>(to_compute(wa[size_t(i)]) * compute_t<T>(0.5) + to_compute(ua[size_t(i)]));
  std::string what = label("fused scattered n =", n, "chunk", chunk);
  same(u, ua, tol<T>(), what + " reduced");
  same(w, wa, tol<T>(), what + " w");
}

// [outer, n, inner] sliced along n: out = reduced + bias[inner index].
template <class T>
void outer_case(Comm& c, int64_t n, int64_t chunk) {
  Shape3 s{3, n, 4};
  std::vector<T> y = real_data<T>(n + 5, c.rank, s.total()), out(size_t(s.total()), make<T>(0));
  auto f = [&](int64_t i, compute_t<T> r) { return from_compute<T>(r + compute_t<T>(i % s.inner)); };
  auto compute = [&](int64_t b, int64_t e, const compute_t<T>* red) {
    for (int64_t i = b; i < e; ++i) out[size_t(i)] = f(i, red[i - b]);
  };
  fused_rs_compute_ag<T>(Op::sum, Segments<const T>::one(y.data(), s.total()), s, c, chunk,
                         compute, {gather_target(out.data(), s.total())});
  Range sl = slice_range(n, c.size, c.rank);
  std::vector<T> red(size_t(s.outer * sl.size() * s.inner)), want(size_t(s.total()));
  reduce_scatter(Op::sum, y.data(), red.data(), s.outer, s.n, s.inner, c);
  std::vector<T> outs(red.size());
  for (int64_t o = 0, j = 0; o < s.outer; ++o)
    for (int64_t i = (o * n + sl.begin) * s.inner; i < (o * n + sl.end) * s.inner; ++i, ++j)
      outs[size_t(j)] = f(i, to_compute(red[size_t(j)]));
  allgather(outs.data(), want.data(), s.outer, s.n, s.inner, c);
  same(out, want, tol<T>(), label("fused outer>1 n =", n, "chunk", chunk));
}

// The input itself is the gather target: g = 0.5 * sum(g) in place.
template <class T>
void in_place_case(Comm& c, int64_t n, int64_t chunk) {
  auto data = [&](int r) { return int_data<T>(n + 21, r, n); };
  std::vector<T> g = data(c.rank), want = reference_reduce<T>(Op::sum, c.size, data);
  for (auto& x : want) x = from_compute<T>(to_compute(x) * compute_t<T>(2));
  auto compute = [&](int64_t b, int64_t e, const compute_t<T>* red) {
    for (int64_t i = b; i < e; ++i) g[size_t(i)] = from_compute<T>(red[i - b] * compute_t<T>(2));
  };
  fused_rs_compute_ag<T>(Op::sum, g.data(), n, c, chunk, compute, {gather_target(g.data(), n)});
  same(g, want, 0.0, label("fused in place n =", n, "chunk", chunk));
}

// Fused allreduce + compute: out = 2 * reduced + w on every rank, contiguous and scattered.
template <class T>
void allreduce_compute_case(Comm& c, Op op, int64_t n, int64_t chunk) {
  auto data = [&](int r) { return int_data<T>(n + 31, r, n); };
  std::vector<T> g = data(c.rank), w = int_data<T>(n + 32, 0, n), out = std::vector<T>(size_t(n)), want = reference_reduce<T>(op, c.size, data);
  for (int64_t i = 0; i < n; ++i) want[size_t(i)] = from_compute<T>(compute_t<T>(2) * to_compute(want[size_t(i)]) + to_compute(w[size_t(i)]));
  auto compute = [&](int64_t b, int64_t e, const compute_t<T>* red) {
    for (int64_t i = b; i < e; ++i) out[size_t(i)] = from_compute<T>(compute_t<T>(2) * red[i - b] + to_compute(w[size_t(i)]));
  };
  fused_allreduce_compute<T>(op, g.data(), n, c, chunk, compute);
  same(out, want, 0.0, label("fused allreduce", op_name(op), "n =", n, "chunk", chunk));
  std::vector<int64_t> sizes = {n / 3, 0, n - n / 3};
  Segments<const T> gs({g.data(), g.data(), g.data() + n / 3}, sizes);
  std::fill(out.begin(), out.end(), make<T>(0));
  fused_allreduce_compute<T>(op, gs, c, chunk, compute, 2);
  same(out, want, 0.0, label("fused allreduce scattered", op_name(op), "n =", n, "chunk", chunk));
}

template <class T>
void float_suite(Comm& c) {
  for (int64_t n : fused_sizes(c.size)) {
    for (int64_t chunk : kChunks) {
      // Rounds cost a few message latencies each: keep their number small on a loaded machine.
      if (n > 100 && chunk < 64) continue;
      sgd_case<T>(c, Op::sum, n, chunk, chunk == 64 ? 5 : kProgressElems);
      adam_case<T>(c, n, chunk);
      scattered_case<T>(c, n, chunk);
      if (n < 1000 || chunk > 64) outer_case<T>(c, n, chunk);
    }
  }
}

template <class T>
void exact_suite(Comm& c) {
  for (int64_t n : fused_sizes(c.size)) {
    for (int64_t chunk : {int64_t(3), int64_t(1000)}) {
      if (n > 100 && chunk < 64) continue;
      in_place_case<T>(c, n, chunk);
      for (Op op : kOps) allreduce_compute_case<T>(c, op, n, chunk);
    }
  }
  sgd_case<T>(c, Op::max, 50, 7, 3);
  sgd_case<T>(c, Op::avg, 50, 7, 3);
}

}  // namespace

void test_fused() {
  Comm c(MPI_COMM_WORLD, 1);
  float_suite<float>(c);
  float_suite<double>(c);
  float_suite<half>(c);
  float_suite<bfloat16>(c);
  for_each_dtype([&](auto tag) { exact_suite<decltype(tag)>(c); });
}

}  // namespace t
