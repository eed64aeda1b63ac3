// Scattered tensors (segments.h) and the staged collective paths: allreduce, reduce_scatter
// and allgather on segment lists (with empty segments and stages that cut across segments).
#include "coconet/collectives.h"
#include "coconet/segments.h"
#include "test_util.h"

namespace t {
namespace {

// Segment sizes adding up to n, cycling through a pattern with empty segments.
std::vector<int64_t> segment_sizes(int64_t n) {
  const int64_t pattern[] = {3, 0, 5, 1, 10, 2, 0};
  std::vector<int64_t> sizes;
  for (int64_t at = 0, i = 0; at < n; ++i) {
    int64_t s = std::min(pattern[i % 7], n - at);
    sizes.push_back(s);
    at += s;
  }
  sizes.push_back(0);
  return sizes;
}

// Storage for a scattered tensor: one vector per segment, filled from a flat vector.
template <class T>
struct Scattered {
  std::vector<std::vector<T>> bufs;
  Segments<T> segs;
  Scattered(const std::vector<T>& flat, const std::vector<int64_t>& sizes) {
    int64_t at = 0;
    for (int64_t s : sizes) {
      bufs.emplace_back(flat.begin() + at, flat.begin() + at + s);
      at += s;
    }
    std::vector<T*> ptrs;
    for (auto& b : bufs) ptrs.push_back(b.data());
    segs = Segments<T>(ptrs, sizes);
  }
  std::vector<T> flat() const {
    std::vector<T> v;
    for (auto& b : bufs) v.insert(v.end(), b.begin(), b.end());
    return v;
  }
};

template <class T>
void scattered_suite(Comm& c) {
  for (int64_t n : test_sizes(c.size)) {
    auto sizes = segment_sizes(n);
    for (Op op : {Op::sum, Op::avg, Op::max}) {
      auto data = [&](int r) { return int_data<T>(n + 100 * int(op), r, n); };
      std::vector<T> want = reference_reduce<T>(op, c.size, data);
      // A small stage makes every segment boundary cross a stage; keep the message count
      // modest for the large size (4 oversubscribed ranks on 2 cores pay ~1 ms per message).
      for (int64_t stage : {n > 100 ? int64_t(61) : int64_t(4), kStageElems}) {
        Scattered<T> in(data(c.rank), sizes), out(std::vector<T>(size_t(n)), sizes);
        allreduce(op, in.segs, out.segs, c, stage);
        same(out.flat(), want, 0.0, label("scattered allreduce", op_name(op), "n =", n, "stage", stage));
        allreduce(op, in.segs, in.segs, c, stage);
        same(in.flat(), want, 0.0, label("scattered allreduce in place", op_name(op), "n =", n));
      }
      Scattered<T> in(data(c.rank), sizes);
      Range mine = slice_range(n, c.size, c.rank);
      std::vector<T> slice(size_t(mine.size()));
      reduce_scatter(op, in.segs, slice.data(), c, 3);
      same(slice, std::vector<T>(want.begin() + mine.begin, want.begin() + mine.end), 0.0,
           label("scattered reduce_scatter", op_name(op), "n =", n));
      Scattered<T> full(std::vector<T>(size_t(n), make<T>(42)), sizes);
      allgather(slice.data(), full.segs, c, 3);
      same(full.flat(), want, 0.0, label("scattered allgather n =", n));
    }
  }
}

// A scattered reduce_scatter of 16 KiB and more: the shared window's path (fused_shm.h).
template <class T>
void scattered_window_suite(Comm& c) {
  const int64_t n = 8195;
  for (Op op : {Op::sum, Op::avg, Op::max}) {
    auto data = [&](int r) { return int_data<T>(n + 100 * int(op), r, n); };
    std::vector<T> want = reference_reduce<T>(op, c.size, data);
    Scattered<T> in(data(c.rank), segment_sizes(n));
    Range mine = slice_range(n, c.size, c.rank);
    std::vector<T> slice(size_t(mine.size()));
    reduce_scatter(op, in.segs, slice.data(), c);
    same(slice, std::vector<T>(want.begin() + mine.begin, want.begin() + mine.end), 0.0,
         label("scattered reduce_scatter (window)", op_name(op), "n =", n));
  }
}

// The staged round paths on [outer, n, inner] (outer > 1 included).
template <class T>
void rounds_suite(Comm& c) {
  for (int64_t n : test_sizes(c.size)) {
    Shape3 s{3, n, 2};
    auto data = [&](int r) { return int_data<T>(n * 7 + 1, r, s.total()); };
    std::vector<T> red = reference_reduce<T>(Op::sum, c.size, data), in = data(c.rank);
    Range sl = slice_range(n, c.size, c.rank);
    std::vector<T> want, got(size_t(s.outer * sl.size() * s.inner));
    for (int64_t o = 0; o < s.outer; ++o)
      for (int64_t i = sl.begin * s.inner; i < sl.end * s.inner; ++i) want.push_back(red[size_t(o * n * s.inner + i)]);
    reduce_scatter_rounds<T>(Op::sum, Segments<const T>::one(in.data(), s.total()), got.data(), s, c, 3);
    same(got, want, 0.0, label("reduce_scatter_rounds n =", n));
    std::vector<T> full(size_t(s.total()), make<T>(9));
    allgather_rounds<T>(got.data(), Segments<T>::one(full.data(), s.total()), s, c, 3);
    same(full, red, 0.0, label("allgather_rounds n =", n));
  }
}

}  // namespace

void test_scattered() {
  Comm c(MPI_COMM_WORLD, 1);
  for_each_dtype([&](auto tag) {
    scattered_suite<decltype(tag)>(c);
    rounds_suite<decltype(tag)>(c);
    scattered_window_suite<decltype(tag)>(c);
  });
  // for_each_piece: pieces of a range that crosses empty segments.
  std::vector<int64_t> starts = segment_starts({2, 0, 3, 0, 1});
  std::vector<int64_t> got;
  for_each_piece(starts, 1, 6, [&](size_t s, int64_t so, int64_t ro, int64_t len) {
    got.insert(got.end(), {int64_t(s), so, ro, len});
  });
  check(got == std::vector<int64_t>({0, 1, 0, 1, 2, 0, 1, 3, 4, 0, 4, 1}), "for_each_piece");
}

}  // namespace t
