// coconet runtime: blocking collectives on a Comm's group (docs/language.md, "Communication").
//
// Sliced tensors are viewed as [outer, n, inner] around the sliced dim (slices.h); rank r holds
// [outer, slice_range(n, R, r), inner] as one contiguous buffer, with uneven and empty slices.
// A group on one node runs all-reduce, reduce-scatter and (outer == 1) all-gather of 16 KiB and
// more through its shared window, and a group over several nodes of as many ranks each its
// all-reduce, reduce-scatter and all-gather hierarchically (fused_shm.h; Open MPI's own reduce-scatter
// measured 4 to 8 times slower than a copy of its bytes on one node).  Otherwise fast paths map
// straight onto MPI (MPI_Allreduce, MPI_Reduce_scatter, MPI_Allgatherv with per-rank counts);
// the rest (outer > 1, scattered tensors, sizes beyond MPI's int counts) runs
// in rounds through a bounded staging buffer, never a copy of the whole tensor.
//
// Every rank of the group must call a collective with the same sizes.  avg divides the sum by
// the group size (reduce_ops.h).
#pragma once

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <vector>

#include "comm.h"
#include "dtypes.h"
#include "errors.h"
#include "reduce_ops.h"
#include "segments.h"
#include "slices.h"

namespace coconet {

// Elements per round of the staged paths (per rank): bounds the staging memory.
constexpr int64_t kStageElems = int64_t(1) << 20;
// Largest element count passed to one MPI call on the unstaged paths.
constexpr int64_t kMaxMpiElems = int64_t(1) << 30;

// ---- plumbing --------------------------------------------------------------------------------

// MPI's send buffer argument: MPI_IN_PLACE when reducing in place.
inline const void* send_or_in_place(const void* in, const void* out) {
  return in == out ? MPI_IN_PLACE : in;
}

// int copies of 64-bit counts (throws, identically on every rank, if one does not fit).
inline std::vector<int> int_counts(const std::vector<int64_t>& v, const char* what) {
  std::vector<int> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = mpi_count(v[i], what);
  return r;
}

// Exclusive prefix sums.
inline std::vector<int64_t> prefix(const std::vector<int64_t>& v) {
  std::vector<int64_t> r(v.size(), 0);
  for (size_t i = 1; i < v.size(); ++i) r[i] = r[i - 1] + v[i - 1];
  return r;
}

// True when every value fits an MPI int.
inline bool fits_int(const std::vector<int64_t>& v) {
  return std::all_of(v.begin(), v.end(), [](int64_t x) { return x <= INT_MAX; });
}

// Per-rank element counts of a sliced [outer, n, inner] tensor restricted to `rows` outer rows.
inline std::vector<int64_t> slice_elems(const Shape3& s, int R, int64_t rows) {
  std::vector<int64_t> c = slice_counts(s.n, R);
  for (auto& x : c) x *= rows * s.inner;
  return c;
}

// ---- rounds over the slices of a tensor --------------------------------------------------------

// Splits every rank's slice of a [outer, n, inner] tensor into rounds of at most C elements.
// Round k covers, for every rank r, one contiguous piece of r's slice (flat global indices);
// all ranks agree on the number of rounds.  Used by the staged collectives and fused.h.
struct RoundPlan {
  Shape3 shape;
  int R = 1;
  int64_t C = 1;
  int64_t per_row = 0;  // rounds per outer row
  int64_t rounds = 0;

  // C is clamped to the widest slice of one row, so buffers sized by C never exceed it.
  RoundPlan(Shape3 s, int R_, int64_t C_) : shape(s), R(R_) {
    int64_t widest = slice_chunk(s.n, R) * s.inner;  // largest slice of one row
    C = std::max<int64_t>(1, std::min(C_, widest));
    per_row = (widest + C - 1) / C;
    rounds = s.outer * per_row;
  }

  // Flat global range of rank r's piece in round k (possibly empty).
  Range range(int64_t k, int r) const {
    int64_t o = k / per_row, j = k % per_row;
    Range s = slice_range(shape.n, R, r);
    int64_t base = o * shape.n * shape.inner;
    int64_t lo = base + s.begin * shape.inner + j * C;
    int64_t hi = std::min(lo + C, base + s.end * shape.inner);
    return hi > lo ? Range{lo, hi} : Range{lo, lo};
  }

  // Offset of rank r's piece of round k inside r's own slice buffer [outer, s_r, inner].
  int64_t slice_offset(int64_t k, int r) const {
    int64_t o = k / per_row, j = k % per_row;
    return o * slice_range(shape.n, R, r).size() * shape.inner + j * C;
  }
};

// ---- allreduce -------------------------------------------------------------------------------

// The shared-memory allreduce of fused_shm.h (included at the end of this file; instantiated
// once, in the compiled runtime: COCONET_SHARED, state.h): false when
// the group is not on one node or the message is small (then MPI's allreduce runs instead).
template <class T>
COCONET_SHARED bool allreduce_shm(Op op, const T* in, T* out, int64_t count, Comm& comm);
// ... its reduce-scatter of a [outer, n, inner] tensor (false: MPI's runs instead) ...
template <class T>
COCONET_SHARED bool reduce_scatter_shm(Op op, const Segments<const T>& in, T* out_slice, Shape3 s, Comm& comm);
// ... and its allgather (false: MPI's runs instead).
template <class T>
COCONET_SHARED bool allgather_shm(const T* in_slice, T* out, Shape3 s, Comm& comm);

// out = in reduced over the group (in == out allowed).  Result replicated on every rank.
template <class T>
void allreduce(Op op, const T* in, T* out, int64_t count, Comm& comm) {
  if (allreduce_shm(op, in, out, count, comm)) return;
  for (int64_t at = 0; at < count; at += kMaxMpiElems) {
    int n = static_cast<int>(std::min(kMaxMpiElems, count - at));
    COCONET_MPI(MPI_Allreduce(send_or_in_place(in + at, out + at), out + at, n, mpi_type<T>(),
                              mpi_op<T>(op), comm.group));
  }
  finish_avg(op, out, count, comm.size);
}

// Scattered allreduce: in and out are segment lists of one logical tensor (in may equal out).
// Buckets of `stage` elements: a bucket inside one segment is reduced in place, one that
// crosses segments goes through a bucket-sized staging buffer.
template <class TI, class T>
void allreduce(Op op, const Segments<TI>& in, const Segments<T>& out, Comm& comm,
               int64_t stage = kStageElems) {
  static_assert(std::is_same<std::remove_const_t<TI>, T>::value, "allreduce: dtype mismatch");
  require(in.total() == out.total(), "allreduce: scattered input and output sizes differ");
  const Segments<const T> src = in;
  T* buf = scratch_as<T>(comm, 0, kScratchStage, std::min(stage, in.total()));
  for (int64_t a = 0; a < in.total(); a += stage) {
    int64_t b = std::min(a + stage, in.total()), n = b - a;
    const T* sp = nullptr;
    T* dp = nullptr;
    src.for_each(a, b, [&](const T* p, int64_t, int64_t len) { sp = len == n ? p : nullptr; });
    out.for_each(a, b, [&](T* p, int64_t, int64_t len) { dp = len == n ? p : nullptr; });
    if (sp && dp) {
      allreduce(op, sp, dp, n, comm);
      continue;
    }
    copy_out(src, a, b, buf);
    allreduce(op, buf, buf, n, comm);
    copy_in(static_cast<const T*>(buf), out, a, b);
  }
}

// Sum of one double over the group (the cross-rank step of norm/sum of a sliced tensor).
inline double allreduce_sum(double x, Comm& comm) {
  double r = 0;
  COCONET_MPI(MPI_Allreduce(&x, &r, 1, MPI_DOUBLE, MPI_SUM, comm.group));
  return r;
}

// Elementwise sum of n doubles over the group, in place (per-segment partials of segment_norm).
inline void allreduce_sum(double* xs, int64_t n, Comm& comm) {
  allreduce(Op::sum, xs, xs, n, comm);
}

// ---- reduce_scatter ----------------------------------------------------------------------------

// Staged rounds: rank r's pieces of round k packed back to back, MPI_Reduce_scatter, result
// written at the piece's place in out_slice.  Serves scattered inputs and huge sizes.
template <class T>
void reduce_scatter_rounds(Op op, const Segments<const T>& in, T* out_slice, Shape3 s,
                           Comm& comm, int64_t stage) {
  RoundPlan plan(s, comm.size, stage);
  T* buf = scratch_as<T>(comm, 0, kScratchStage, plan.C * comm.size);
  std::vector<int> counts(static_cast<size_t>(comm.size));
  for (int64_t k = 0; k < plan.rounds; ++k) {
    int64_t at = 0;
    for (int r = 0; r < comm.size; ++r) {
      Range g = plan.range(k, r);
      copy_out(in, g.begin, g.end, buf + at);
      counts[static_cast<size_t>(r)] = static_cast<int>(g.size());
      at += g.size();
    }
    T* dst = out_slice + plan.slice_offset(k, comm.rank);
    COCONET_MPI(MPI_Reduce_scatter(buf, dst, counts.data(), mpi_type<T>(), mpi_op<T>(op),
                                   comm.group));
  }
}

// Packs rows [o0, o0+rows) of in [outer, n, inner] rank by rank: [r][row][slice_r][inner].
template <class T>
void pack_by_rank(const T* in, T* buf, Shape3 s, int R, int64_t o0, int64_t rows) {
  for (int r = 0; r < R; ++r) {
    Range sl = slice_range(s.n, R, r);
    size_t bytes = static_cast<size_t>(sl.size() * s.inner) * sizeof(T);
    for (int64_t o = o0; o < o0 + rows; ++o, buf += sl.size() * s.inner)
      std::memcpy(buf, in + (o * s.n + sl.begin) * s.inner, bytes);
  }
}

// Inverse of pack_by_rank: writes rank-major rows back into out [outer, n, inner].
template <class T>
void unpack_by_rank(const T* buf, T* out, Shape3 s, int R, int64_t o0, int64_t rows) {
  for (int r = 0; r < R; ++r) {
    Range sl = slice_range(s.n, R, r);
    size_t bytes = static_cast<size_t>(sl.size() * s.inner) * sizeof(T);
    for (int64_t o = o0; o < o0 + rows; ++o, buf += sl.size() * s.inner)
      std::memcpy(out + (o * s.n + sl.begin) * s.inner, buf, bytes);
  }
}

// outer > 1: batches of outer rows packed rank-major, one MPI_Reduce_scatter per batch.
template <class T>
void reduce_scatter_rows(Op op, const T* in, T* out_slice, Shape3 s, Comm& comm,
                         int64_t stage) {
  int64_t row = s.n * s.inner, mine = slice_range(s.n, comm.size, comm.rank).size() * s.inner;
  int64_t batch = std::max<int64_t>(1, stage / std::max<int64_t>(row, 1));
  T* buf = scratch_as<T>(comm, 0, kScratchStage, std::min(batch, s.outer) * row);
  for (int64_t o0 = 0; o0 < s.outer; o0 += batch) {
    int64_t rows = std::min(batch, s.outer - o0);
    std::vector<int> counts = int_counts(slice_elems(s, comm.size, rows), "reduce_scatter");
    pack_by_rank(in, buf, s, comm.size, o0, rows);
    COCONET_MPI(MPI_Reduce_scatter(buf, out_slice + o0 * mine, counts.data(),
                                   mpi_type<T>(), mpi_op<T>(op), comm.group));
  }
}

// out_slice [outer, my slice of n, inner] = in [outer, n, inner] reduced over the group.
template <class T>
void reduce_scatter(Op op, const T* in, T* out_slice, int64_t outer, int64_t n, int64_t inner,
                    Comm& comm, int64_t stage = kStageElems) {
  Shape3 s{outer, n, inner};
  if (s.total() == 0 || reduce_scatter_shm(op, Segments<const T>::one(in, s.total()), out_slice, s, comm))
    return;
  std::vector<int64_t> counts = slice_elems(s, comm.size, 1);
  if (outer == 1 && fits_int(counts)) {
    std::vector<int> c = int_counts(counts, "reduce_scatter");
    COCONET_MPI(MPI_Reduce_scatter(in, out_slice, c.data(), mpi_type<T>(), mpi_op<T>(op),
                                   comm.group));
  } else if (outer == 1 || !fits_int(counts)) {  // huge slices: staged rounds
    reduce_scatter_rounds(op, Segments<const T>::one(in, s.total()), out_slice, s, comm, stage);
  } else {
    reduce_scatter_rows(op, in, out_slice, s, comm, stage);
  }
  finish_avg(op, out_slice, outer * counts[static_cast<size_t>(comm.rank)], comm.size);
}

// 1-D reduce_scatter: out_slice = this rank's slice of the reduction of in[0 .. n).
template <class T>
void reduce_scatter(Op op, const T* in, T* out_slice, int64_t n, Comm& comm) {
  reduce_scatter(op, in, out_slice, 1, n, 1, comm);
}

// Scattered reduce_scatter: the logical tensor `in` (segments) reduced; this rank gets its
// slice of the logical index range in the contiguous buffer out_slice.
template <class TI, class T>
void reduce_scatter(Op op, const Segments<TI>& in, T* out_slice, Comm& comm,
                    int64_t stage = kStageElems) {
  static_assert(std::is_same<std::remove_const_t<TI>, T>::value, "reduce_scatter: dtype");
  Shape3 s{1, in.total(), 1};
  if (s.total() == 0 || reduce_scatter_shm<T>(op, in, out_slice, s, comm)) return;
  reduce_scatter_rounds<T>(op, in, out_slice, s, comm, stage);
  finish_avg(op, out_slice, slice_range(s.n, comm.size, comm.rank).size(), comm.size);
}

// ---- allgather -------------------------------------------------------------------------------

// Staged rounds: MPI_Allgatherv of each rank's piece of round k, unpacked into `out`.
template <class T>
void allgather_rounds(const T* in_slice, const Segments<T>& out, Shape3 s, Comm& comm,
                      int64_t stage) {
  RoundPlan plan(s, comm.size, stage);
  T* buf = scratch_as<T>(comm, 0, kScratchStage, plan.rounds ? plan.C * comm.size : 0);
  std::vector<int> counts(static_cast<size_t>(comm.size)), displs(counts.size());
  for (int64_t k = 0; k < plan.rounds; ++k) {
    for (int r = 0, at = 0; r < comm.size; at += counts[static_cast<size_t>(r)], ++r) {
      counts[static_cast<size_t>(r)] = static_cast<int>(plan.range(k, r).size());
      displs[static_cast<size_t>(r)] = at;
    }
    const T* src = in_slice + plan.slice_offset(k, comm.rank);
    COCONET_MPI(MPI_Allgatherv(src, counts[static_cast<size_t>(comm.rank)], mpi_type<T>(),
                               buf, counts.data(), displs.data(), mpi_type<T>(), comm.group));
    for (int r = 0; r < comm.size; ++r) {
      Range g = plan.range(k, r);
      copy_in(static_cast<const T*>(buf) + displs[static_cast<size_t>(r)], out, g.begin, g.end);
    }
  }
}

// outer > 1: batches of outer rows gathered rank-major, then unpacked.
template <class T>
void allgather_rows(const T* in_slice, T* out, Shape3 s, Comm& comm, int64_t stage) {
  int64_t row = s.n * s.inner, mine = slice_range(s.n, comm.size, comm.rank).size() * s.inner;
  int64_t batch = std::max<int64_t>(1, stage / std::max<int64_t>(row, 1));
  T* buf = scratch_as<T>(comm, 0, kScratchStage, std::min(batch, s.outer) * row);
  for (int64_t o0 = 0; o0 < s.outer; o0 += batch) {
    int64_t rows = std::min(batch, s.outer - o0);
    std::vector<int64_t> c64 = slice_elems(s, comm.size, rows);
    std::vector<int> counts = int_counts(c64, "allgather"), displs = int_counts(prefix(c64), "");
    COCONET_MPI(MPI_Allgatherv(in_slice + o0 * mine, counts[static_cast<size_t>(comm.rank)],
                               mpi_type<T>(), buf, counts.data(), displs.data(),
                               mpi_type<T>(), comm.group));
    unpack_by_rank(static_cast<const T*>(buf), out, s, comm.size, o0, rows);
  }
}

// out [outer, n, inner] on every rank = the concatenation of all ranks' slices in_slice
// [outer, slice, inner].  in_slice may be out's own slice when outer == 1 (in place).
template <class T>
void allgather(const T* in_slice, T* out, int64_t outer, int64_t n, int64_t inner, Comm& comm,
               int64_t stage = kStageElems) {
  Shape3 s{outer, n, inner};
  if (s.total() == 0 || allgather_shm(in_slice, out, s, comm)) return;
  std::vector<int64_t> counts = slice_elems(s, comm.size, 1), displs = prefix(counts);
  if (outer == 1 && fits_int(counts) && fits_int(displs)) {
    std::vector<int> c = int_counts(counts, "allgather"), d = int_counts(displs, "allgather");
    const T* mine = out + displs[static_cast<size_t>(comm.rank)];
    const void* src = in_slice == mine ? MPI_IN_PLACE : static_cast<const void*>(in_slice);
    COCONET_MPI(MPI_Allgatherv(src, c[static_cast<size_t>(comm.rank)], mpi_type<T>(), out,
                               c.data(), d.data(), mpi_type<T>(), comm.group));
  } else if (outer == 1 || !fits_int(counts)) {
    allgather_rounds(in_slice, Segments<T>::one(out, s.total()), s, comm, stage);
  } else {
    allgather_rows(in_slice, out, s, comm, stage);
  }
}

// 1-D allgather of slices of an n-element tensor.
template <class T>
void allgather(const T* in_slice, T* out, int64_t n, Comm& comm) {
  allgather(in_slice, out, 1, n, 1, comm);
}

// Scattered allgather: every rank's slice of the logical tensor gathered into the segments.
template <class T>
void allgather(const T* in_slice, const Segments<T>& out, Comm& comm,
               int64_t stage = kStageElems) {
  allgather_rounds(in_slice, out, Shape3{1, out.total(), 1}, comm, stage);
}

// scatter(x, dim): this rank's slice of a replicated [outer, n, inner] tensor (a local copy).
template <class T>
void scatter_copy(const T* in, T* out_slice, int64_t outer, int64_t n, int64_t inner,
                  Comm& comm) {
  Range sl = slice_range(n, comm.size, comm.rank);
  size_t bytes = static_cast<size_t>(sl.size() * inner) * sizeof(T);
  for (int64_t o = 0; o < outer; ++o)
    std::memcpy(out_slice + o * sl.size() * inner, in + (o * n + sl.begin) * inner, bytes);
}

// ---- broadcast, reduce -------------------------------------------------------------------------

// out on every rank = root's in (root is a rank of the group).
template <class T>
void broadcast(const T* in, T* out, int64_t count, int root, Comm& comm) {
  require(root >= 0 && root < comm.size, "broadcast: root " + std::to_string(root) +
                                             " is not a rank of the group (size " +
                                             std::to_string(comm.size) + ")");
  if (comm.rank == root && in != out)
    std::memcpy(out, in, static_cast<size_t>(count) * sizeof(T));
  for (int64_t at = 0; at < count; at += kMaxMpiElems) {
    int n = static_cast<int>(std::min(kMaxMpiElems, count - at));
    COCONET_MPI(MPI_Bcast(out + at, n, mpi_type<T>(), root, comm.group));
  }
}

// out on root = in reduced over the group; on the other ranks out = in.
template <class T>
void reduce(Op op, const T* in, T* out, int64_t count, int root, Comm& comm) {
  require(root >= 0 && root < comm.size, "reduce: root " + std::to_string(root) +
                                             " is not a rank of the group (size " +
                                             std::to_string(comm.size) + ")");
  bool is_root = comm.rank == root;
  for (int64_t at = 0; at < count; at += kMaxMpiElems) {
    int n = static_cast<int>(std::min(kMaxMpiElems, count - at));
    const void* src = is_root ? send_or_in_place(in + at, out + at) : in + at;
    COCONET_MPI(MPI_Reduce(src, is_root ? out + at : nullptr, n, mpi_type<T>(), mpi_op<T>(op),
                           root, comm.group));
  }
  if (is_root) finish_avg(op, out, count, comm.size);
  if (!is_root && in != out) std::memcpy(out, in, static_cast<size_t>(count) * sizeof(T));
}

// ---- send ------------------------------------------------------------------------------------

// send(x, next): out = the `in` of the same in-group rank of the previous group (zeros in the
// first group).  send(x, prev): from the next group (zeros in the last).  in == out allowed.
template <class T>
void send_shift(const T* in, T* out, int64_t count, Direction d, Comm& comm) {
  int dest = comm.peer(d);
  int src = comm.peer(d == Direction::next ? Direction::prev : Direction::next);
  for (int64_t at = 0; at < count; at += kMaxMpiElems) {
    int n = static_cast<int>(std::min(kMaxMpiElems, count - at));
    if (in == out)
      COCONET_MPI(MPI_Sendrecv_replace(out + at, n, mpi_type<T>(), dest, 0, src, 0, comm.world,
                                       MPI_STATUS_IGNORE));
    else
      COCONET_MPI(MPI_Sendrecv(in + at, n, mpi_type<T>(), dest, 0, out + at, n, mpi_type<T>(),
                               src, 0, comm.world, MPI_STATUS_IGNORE));
  }
  if (src == MPI_PROC_NULL) std::memset(static_cast<void*>(out), 0, static_cast<size_t>(count) * sizeof(T));
}

}  // namespace coconet

#include "fused_shm.h"  // allreduce_shm (it needs RoundPlan from here)
