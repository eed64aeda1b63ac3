// coconet CUDA runtime: NCCL collectives on the call's stream, contiguous and scattered (a call per piece), segment_norm (runtime.cuh includes every part, in order).
#pragma once

#include "blas.cuh"

namespace coconet {
namespace cuda {

// ---- NCCL ----------------------------------------------------------------------------------------

template <class T> struct NcclType;
template <> struct NcclType<float> { static constexpr ncclDataType_t t = ncclFloat32; };
template <> struct NcclType<double> { static constexpr ncclDataType_t t = ncclFloat64; };
template <> struct NcclType<half> { static constexpr ncclDataType_t t = ncclFloat16; };
template <> struct NcclType<bfloat16> { static constexpr ncclDataType_t t = ncclBfloat16; };
template <> struct NcclType<int32_t> { static constexpr ncclDataType_t t = ncclInt32; };
template <> struct NcclType<int64_t> { static constexpr ncclDataType_t t = ncclInt64; };

struct Group_ {  // ncclGroupStart/End as a scope
  Group_() { COCONET_CUDA(ncclGroupStart()); }
  ~Group_() noexcept(false) { COCONET_CUDA(ncclGroupEnd()); }
};

template <class T>
void allreduce(ncclRedOp_t op, const T* x, T* y, int64_t n, const Ctx& c, cudaStream_t s = nullptr) {
  const trace::Piece nccl("NCCL allreduce", -1, s ? s : c.stream);
  COCONET_CUDA(ncclAllReduce(x, y, size_t(n), NcclType<T>::t, op, c.comm, s ? s : c.stream));
}

// x: [outer, n, inner] (every rank the whole), y: this rank's slice [outer, |slice|, inner].
// Even split along the outermost dim: one ncclReduceScatter; otherwise (uneven slices, inner
// dims) one grouped ncclReduce per rank and outer index, each to the rank that keeps it.
template <class T>
void reduce_scatter(ncclRedOp_t op, const T* x, T* y, int64_t outer, int64_t n, int64_t inner, const Ctx& c) {
  const int R = c.group.size;
  const trace::Piece nccl("NCCL reduce-scatter", -1, c.stream);
  if (outer == 1 && n % R == 0) {
    COCONET_CUDA(ncclReduceScatter(x, y, size_t(n / R * inner), NcclType<T>::t, op, c.comm, c.stream));
    return;
  }
  const int64_t mine = slice_range(n, R, c.group.rank).size();
  Group_ g;
  for (int r = 0; r < R; ++r) {
    Range sl = slice_range(n, R, r);
    if (sl.empty()) continue;
    for (int64_t o = 0; o < outer; ++o)
      COCONET_CUDA(ncclReduce(x + (o * n + sl.begin) * inner, y + o * mine * inner, size_t(sl.size() * inner),
                              NcclType<T>::t, op, r, c.comm, c.stream));
  }
}

// x: this rank's slice [outer, |slice|, inner], y: [outer, n, inner] gathered.
template <class T>
void allgather(const T* x, T* y, int64_t outer, int64_t n, int64_t inner, const Ctx& c) {
  const int R = c.group.size;
  const trace::Piece nccl("NCCL allgather", -1, c.stream);
  if (outer == 1 && n % R == 0) {
    COCONET_CUDA(ncclAllGather(x, y, size_t(n / R * inner), NcclType<T>::t, c.comm, c.stream));
    return;
  }
  const int64_t mine = slice_range(n, R, c.group.rank).size();
  Group_ g;
  for (int r = 0; r < R; ++r) {
    Range sl = slice_range(n, R, r);
    if (sl.empty()) continue;
    for (int64_t o = 0; o < outer; ++o)
      COCONET_CUDA(ncclBroadcast(x + o * mine * inner, y + (o * n + sl.begin) * inner, size_t(sl.size() * inner),
                                 NcclType<T>::t, r, c.comm, c.stream));
  }
}

// Piece i of k of every rank's slice of dim 0 of [n, inner] (x: this rank's slice) straight into
// its place in y (slices.h piece_range): an overlap of an allgather along the dim it gathers.
template <class T>
void allgather_pieces(const T* x, T* y, int64_t n, int64_t inner, int k, int i, const Ctx& c) {
  const int R = c.group.size;
  const Range mine = slice_range(slice_range(n, R, c.group.rank).size(), k, i);
  const trace::Piece nccl("NCCL allgather", i, c.stream);
  Group_ g;
  for (int q = 0; q < R; ++q) {
    const Range p = piece_range(n, R, q, k, i);
    if (p.empty()) continue;
    COCONET_CUDA(ncclBroadcast(x + mine.begin * inner, y + p.begin * inner, size_t(p.size() * inner),
                               NcclType<T>::t, q, c.comm, c.stream));
  }
}

// This rank's slice of a replicated x: no communication.
template <class T>
void scatter_copy(const T* x, T* y, int64_t outer, int64_t n, int64_t inner, const Ctx& c) {
  Range sl = slice_range(n, c.group.size, c.group.rank);
  if (sl.empty() || outer == 0) return;
  const size_t w = size_t(sl.size() * inner) * sizeof(T);
  COCONET_CUDA(cudaMemcpy2DAsync(y, w, x + sl.begin * inner, size_t(n * inner) * sizeof(T), w, size_t(outer),
                                 cudaMemcpyDeviceToDevice, c.stream));
}

template <class T>
void broadcast(const T* x, T* y, int64_t n, int root, const Ctx& c) {
  const trace::Piece nccl("NCCL broadcast", -1, c.stream);
  COCONET_CUDA(ncclBroadcast(x, y, size_t(n), NcclType<T>::t, root, c.comm, c.stream));
}

// The reduction on root; the other ranks keep x.
template <class T>
void reduce(ncclRedOp_t op, const T* x, T* y, int64_t n, int root, const Ctx& c) {
  const trace::Piece nccl("NCCL reduce", -1, c.stream);
  if (c.group.rank != root && x != y)
    COCONET_CUDA(cudaMemcpyAsync(y, x, size_t(n) * sizeof(T), cudaMemcpyDeviceToDevice, c.stream));
  COCONET_CUDA(ncclReduce(x, y, size_t(n), NcclType<T>::t, op, root, c.comm, c.stream));
}

// send(x, next|prev): the same in-group rank of the next (previous) group gets x; the first
// (last) group receives zeros. Grouped ncclSend/ncclRecv on the world communicator.
template <class T>
void send_shift(const T* x, T* y, int64_t n, bool next, const Ctx& c) {
  const int gs = c.wsize / c.groups, g = c.wrank / gs;
  const int to = next ? g + 1 : g - 1, from = next ? g - 1 : g + 1;
  const bool has_to = to >= 0 && to < c.groups, has_from = from >= 0 && from < c.groups;
  if (!has_from) COCONET_CUDA(cudaMemsetAsync(y, 0, size_t(n) * sizeof(T), c.stream));
  if (!has_to && !has_from) return;
  const trace::Piece nccl("NCCL send/recv", -1, c.stream);
  Group_ grp;
  if (has_to) COCONET_CUDA(ncclSend(x, size_t(n), NcclType<T>::t, to * gs + c.wrank % gs, c.world, c.stream));
  if (has_from) COCONET_CUDA(ncclRecv(y, size_t(n), NcclType<T>::t, from * gs + c.wrank % gs, c.world, c.stream));
}

template <class T>
void copy(const T* src, T* dst, int64_t n, const Ctx& c) {
  if (n > 0 && src != dst)
    COCONET_CUDA(cudaMemcpyAsync(dst, src, size_t(n) * sizeof(T), cudaMemcpyDeviceToDevice, c.stream));
}

// index: x[i] along dim 0, this rank's n elements of it, as kernels.h's (no copy when y is x's row i).
template <class T>
void index(const T* x, T* y, int64_t n, int64_t i, const Ctx& c) {
  copy(x + i * n, y, n, c);
}

// unindex: out[L, n] zeros with g at row i (index's gradient), as grad.h's.
template <class T>
void unindex(const T* g, T* out, int64_t n, int64_t i, int64_t L, const Ctx& c) {
  if (L * n > 0) COCONET_CUDA(cudaMemsetAsync(out, 0, size_t(L * n) * sizeof(T), c.stream));
  copy(g, out + i * n, n, c);
}

// reshape: this rank's n elements copied as they are, after the host-side check of the sizes and
// slices (slices.h: reshape_problem), as kernels.h's.
template <class T>
void reshape(const T* x, T* y, int64_t n, int64_t n_in, int64_t n_out, int64_t whole, int64_t part, int64_t rest,
             int64_t ranks, const char* what, const Ctx& c) {
  const std::string why = reshape_problem(n_in, n_out, whole, part, rest, ranks, what);
  require(why.empty(), why);
  if (x != y) copy(x, y, n, c);  // y == x: the plan holds the result in x's memory (Buffer.same_as)
}

// ---- scattered tensors: copies, NCCL per piece, segment_norm ------------------------------------

// Contiguous src[0, n) into the logical range [0, n) of dst's segments.
template <class T>
void copy_in(const T* src, const Segments<T>& dst, int64_t n, const Ctx& c) {
  for (const Piece& pc : pieces(dst.starts, 0, n))
    COCONET_CUDA(cudaMemcpyAsync(dst.at(pc), src + pc.offset, size_t(pc.size) * sizeof(T), cudaMemcpyDeviceToDevice,
                                 c.stream));
}

// y[0, N) = the reduction over ranks of every segment of x: one grouped ncclAllReduce per segment.
template <class T>
void allreduce(ncclRedOp_t op, const Segments<T>& x, T* y, const Ctx& c) {
  const trace::Piece nccl("NCCL allreduce", -1, c.stream);
  Group_ g;
  for (size_t s = 0; s < x.ptrs.size(); ++s)
    if (x.sizes[s] > 0)
      COCONET_CUDA(ncclAllReduce(x.ptrs[s], y + x.starts[s], size_t(x.sizes[s]), NcclType<T>::t, op, c.comm, c.stream));
}

// y: this rank's slice of the logical [0, n) reduced over ranks; one grouped ncclReduce per piece of
// every rank's slice, to that rank (a non-root's receive buffer is its own piece: NCCL ignores it).
template <class T>
void reduce_scatter(ncclRedOp_t op, const Segments<T>& x, T* y, int64_t n, const Ctx& c) {
  const int R = c.group.size;
  const trace::Piece nccl("NCCL reduce-scatter", -1, c.stream);
  Group_ g;
  for (int r = 0; r < R; ++r) {
    const Range sl = slice_range(n, R, r);
    for (const Piece& pc : pieces(x.starts, sl.begin, sl.end))
      COCONET_CUDA(ncclReduce(x.at(pc), r == c.group.rank ? y + pc.offset : x.at(pc), size_t(pc.size), NcclType<T>::t,
                              op, r, c.comm, c.stream));
  }
}

// Every rank's slice x of the logical [0, n) straight into the segments of y: one grouped
// ncclBroadcast per piece, in place on the receivers.
template <class T>
void allgather(const T* x, const Segments<T>& y, int64_t n, const Ctx& c) {
  const int R = c.group.size;
  const trace::Piece nccl("NCCL allgather", -1, c.stream);
  Group_ g;
  for (int r = 0; r < R; ++r) {
    const Range sl = slice_range(n, R, r);
    for (const Piece& pc : pieces(y.starts, sl.begin, sl.end))
      COCONET_CUDA(ncclBroadcast(r == c.group.rank ? x + pc.offset : y.at(pc), y.at(pc), size_t(pc.size),
                                 NcclType<T>::t, r, c.comm, c.stream));
  }
}

// sq[s] += the sum of squares of x's elements in segment s, x holding the logical range
// [off, off + n) (contiguous, or a scattered tensor's segments): a block reduction per piece.
template <class T>
void segment_partial(const T* x, int64_t n, int64_t off, const std::vector<int64_t>& starts, double* sq,
                     const Ctx& c) {
  for (const Piece& pc : pieces(starts, off, off + n)) partial_sum<T, true>(x + pc.offset, pc.size, sq + pc.segment, c);
}
template <class T>
void segment_partial(const Segments<T>& x, int64_t n, int64_t off, const std::vector<int64_t>& starts, double* sq,
                     const Ctx& c) {
  for (const Piece& pc : pieces(starts, off, off + n)) partial_sum<T, true>(x.at(pc), pc.size, sq + pc.segment, c);
}

// out[i] = sqrt(sq[the segment holding logical element off + i]), i in [0, n): a fill kernel per piece.
template <class T>
void segment_norm_fill(const double* sq, T* out, int64_t n, int64_t off, const std::vector<int64_t>& starts,
                       const Ctx& c) {
  for (const Piece& pc : pieces(starts, off, off + n)) {
    T* o = out + pc.offset;
    const double* q = sq + pc.segment;
    COCONET_ACCESS(COCONET_R(q, 0, 1), COCONET_W(o, 0, pc.size));
    launch(pc.size, c.stream, [=] __device__ (int64_t j) {
      o[j] = from_compute<T>(static_cast<compute_t<T>>(sqrt(q[0])));
    });
  }
}

// out[i] = the L2 norm of the segment holding logical element off + i, i in [0, n): a block
// reduction per piece into a double per segment, the ranks' sums added when x is sliced
// (cross_rank), then a fill kernel per piece. X: const T* or Segments<T>.
template <class T, class X>
void segment_norm(const X& x, T* out, int64_t n, int64_t off, const std::vector<int64_t>& starts, bool cross_rank,
                  const Ctx& c, int site) {
  const size_t nseg = starts.size() - 1;
  double* sq = scratch<double>(site, int64_t(nseg));
  COCONET_BUFFER(sq, (nseg > 0 ? nseg : 1) * sizeof(double), "segment_norm partial sums");
  COCONET_CUDA(cudaMemsetAsync(sq, 0, (nseg > 0 ? nseg : 1) * sizeof(double), c.stream));
  segment_partial(x, n, off, starts, sq, c);
  if (cross_rank && nseg > 0) {
    const trace::Piece nccl("NCCL allreduce", -1, c.stream);
    COCONET_CUDA(ncclAllReduce(sq, sq, nseg, ncclFloat64, ncclSum, c.comm, c.stream));
  }
  segment_norm_fill(sq, out, n, off, starts, c);
}

// Block r of dim n of src [outer, n, inner], packed as [outer, |r|, inner] into P.
template <class T>
void pack(const T* src, T* P, int64_t outer, int64_t n, int64_t inner, Range r, cudaStream_t s) {
  if (r.empty() || outer == 0 || inner == 0) return;
  const size_t w = size_t(r.size() * inner) * sizeof(T);
  COCONET_CUDA(cudaMemcpy2DAsync(P, w, src + r.begin * inner, size_t(n * inner) * sizeof(T), w, size_t(outer),
                                 cudaMemcpyDeviceToDevice, s));
}

// Chunk r of dim n, packed as [outer, |r|, inner] in P, into its block of dst [outer, n, inner].
template <class T>
void unpack(const T* P, T* dst, int64_t outer, int64_t n, int64_t inner, Range r, cudaStream_t s) {
  if (r.empty() || outer == 0 || inner == 0) return;
  const size_t w = size_t(r.size() * inner) * sizeof(T);
  COCONET_CUDA(cudaMemcpy2DAsync(dst + r.begin * inner, size_t(n * inner) * sizeof(T), P, w, w, size_t(outer),
                                 cudaMemcpyDeviceToDevice, s));
}

}  // namespace cuda
}  // namespace coconet
