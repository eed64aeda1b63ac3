// collectives.h on contiguous tensors: every collective, dtype and op, uneven and empty slices,
// outer > 1, the staged paths (forced with a tiny stage), the shared window's paths (16 KiB and
// more), groups for send_shift.
#include <cstring>

#include "coconet/collectives.h"
#include "test_util.h"

namespace t {
namespace {

// This rank's slice [outer, slice, inner] of a full [outer, n, inner] tensor.
template <class T>
std::vector<T> my_slice(const std::vector<T>& full, Shape3 s, int R, int r) {
  Range sl = slice_range(s.n, R, r);
  std::vector<T> out;
  for (int64_t o = 0; o < s.outer; ++o)
    for (int64_t i = sl.begin * s.inner; i < sl.end * s.inner; ++i)
      out.push_back(full[size_t(o * s.n * s.inner + i)]);
  return out;
}

template <class T>
void allreduce_case(Comm& c, Op op, int64_t n, bool in_place) {
  auto data = [&](int r) { return int_data<T>(n + 17 * int(op), r, n); };
  std::vector<T> in = data(c.rank), out = std::vector<T>(size_t(n));
  if (in_place) allreduce(op, in.data(), in.data(), n, c);
  else allreduce(op, in.data(), out.data(), n, c);
  same(in_place ? in : out, reference_reduce<T>(op, c.size, data), 0.0,
       label("allreduce", op_name(op), "n =", n, in_place ? "in place" : ""));
}

template <class T>
void reduce_scatter_case(Comm& c, Op op, Shape3 s, int64_t stage) {
  auto data = [&](int r) { return int_data<T>(s.total() * 3 + int(op), r, s.total()); };
  std::vector<T> in = data(c.rank);
  std::vector<T> want = my_slice(reference_reduce<T>(op, c.size, data), s, c.size, c.rank);
  std::vector<T> got(want.size());
  reduce_scatter(op, in.data(), got.data(), s.outer, s.n, s.inner, c, stage);
  same(got, want, 0.0, label("reduce_scatter", op_name(op), "shape", s.outer, s.n, s.inner, "stage", stage));
}

template <class T>
void allgather_case(Comm& c, Shape3 s, int64_t stage, bool in_place) {
  std::vector<T> full = int_data<T>(s.total() + 5, 0, s.total());  // what the slices come from
  std::vector<T> mine = my_slice(full, s, c.size, c.rank), out(full.size(), make<T>(99));
  if (in_place) {  // outer == 1: the slice already sits in place
    std::memcpy(out.data() + slice_range(s.n, c.size, c.rank).begin * s.inner, mine.data(), mine.size() * sizeof(T));
    allgather(out.data() + slice_range(s.n, c.size, c.rank).begin * s.inner, out.data(), 1, s.n, s.inner, c, stage);
  } else {
    allgather(mine.data(), out.data(), s.outer, s.n, s.inner, c, stage);
  }
  same(out, full, 0.0, label("allgather shape", s.outer, s.n, s.inner, "stage", stage, in_place ? "in place" : ""));
}

template <class T>
void broadcast_reduce_case(Comm& c, Op op, int64_t n, int root) {
  auto data = [&](int r) { return int_data<T>(n * 11 + root, r, n); };
  std::vector<T> in = data(c.rank), out = std::vector<T>(size_t(n));
  broadcast(in.data(), out.data(), n, root, c);
  same(out, data(root), 0.0, label("broadcast n =", n, "root", root));
  reduce(op, in.data(), out.data(), n, root, c);
  std::vector<T> want = c.rank == root ? reference_reduce<T>(op, c.size, data) : in;
  same(out, want, 0.0, label("reduce", op_name(op), "n =", n, "root", root));
}

template <class T>
void dtype_suite(Comm& c) {
  for (int64_t n : test_sizes(c.size)) {
    for (Op op : kOps) {
      allreduce_case<T>(c, op, n, false);
      allreduce_case<T>(c, op, n, true);
      reduce_scatter_case<T>(c, op, Shape3{1, n, 1}, kStageElems);
    }
    reduce_scatter_case<T>(c, Op::sum, Shape3{3, n, 2}, kStageElems);
    reduce_scatter_case<T>(c, Op::avg, Shape3{2, n, 1}, 5);   // row batches of 1..2 rows
    reduce_scatter_case<T>(c, Op::max, Shape3{1, n, 3}, 2);
    allgather_case<T>(c, Shape3{1, n, 1}, kStageElems, false);
    allgather_case<T>(c, Shape3{1, n, 1}, kStageElems, true);
    allgather_case<T>(c, Shape3{4, n, 3}, kStageElems, false);
    allgather_case<T>(c, Shape3{3, n, 1}, 4, false);
  }
  // 16 KiB and more in every dtype: the shared window's (or the nodes') reduce-scatter (fused_shm.h)
  const int64_t big = 8195;
  for (Op op : kOps) reduce_scatter_case<T>(c, op, Shape3{1, big, 1}, kStageElems);
  reduce_scatter_case<T>(c, Op::sum, Shape3{3, big / 3, 2}, kStageElems);
  reduce_scatter_case<T>(c, Op::avg, Shape3{2, big / 2, 1}, kStageElems);
  // ... and its all-gather (outer == 1 on one node; any shape over simulated nodes)
  allgather_case<T>(c, Shape3{1, big, 1}, kStageElems, false);
  allgather_case<T>(c, Shape3{1, big, 1}, kStageElems, true);
  allgather_case<T>(c, Shape3{3, big / 3, 2}, kStageElems, false);
  for (int root = 0; root < c.size; ++root)
    for (Op op : kOps) broadcast_reduce_case<T>(c, op, 9, root);
  broadcast_reduce_case<T>(c, Op::sum, 0, c.size - 1);
}

// send(x, next|prev) for every G dividing W, in place and not.
template <class T>
void send_suite() {
  int W, me;
  MPI_Comm_size(MPI_COMM_WORLD, &W);
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  for (int G = 1; G <= W; ++G) {
    if (W % G) continue;
    Comm c(MPI_COMM_WORLD, G);
    for (Direction d : {Direction::next, Direction::prev}) {
      for (bool in_place : {false, true}) {
        const int64_t n = 10;
        std::vector<T> in = int_data<T>(5, me, n), out(size_t(n), make<T>(7));
        send_shift(in.data(), in_place ? in.data() : out.data(), n, d, c);
        int from = d == Direction::next ? c.prev_peer : c.next_peer;
        std::vector<T> want = from == MPI_PROC_NULL ? std::vector<T>(size_t(n), make<T>(0)) : int_data<T>(5, from, n);
        same(in_place ? in : out, want, 0.0, label("send G =", G, d == Direction::next ? "next" : "prev", in_place ? "in place" : ""));
      }
    }
  }
}

}  // namespace

void test_collectives() {
  Comm c(MPI_COMM_WORLD, 1);
  for_each_dtype([&](auto tag) { dtype_suite<decltype(tag)>(c); });
  for_each_dtype([&](auto tag) { send_suite<decltype(tag)>(); });
  double s = allreduce_sum(double(c.rank + 1), c);
  check(s == c.size * (c.size + 1) / 2.0, "allreduce_sum scalar");
  std::vector<double> xs = {1.0, double(c.rank)};
  allreduce_sum(xs.data(), 2, c);
  check(xs[0] == c.size && xs[1] == c.size * (c.size - 1) / 2.0, "allreduce_sum array");
}

}  // namespace t
