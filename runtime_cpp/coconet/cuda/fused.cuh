// coconet CUDA runtime: fused collectives: the reductions accumulated chunk by chunk, the chunk loop on two streams, sliced along any dim, over scattered tensors; layernorm with a computed eps (runtime.cuh includes every part, in order).
#pragma once

#include "collectives.cuh"

namespace coconet {
namespace cuda {

// ---- a fused collective's reductions, accumulated chunk by chunk (Fused.partials) ------------
//
// One array of doubles per fused unit, accumulated by the chunks' partial_sum / partial_extreme /
// segment_partial calls on the call's stream: first `sums` partial sums (a sum or a norm: one; a
// segment_norm: one per segment; the `whole` sums and norms first, then the segments'), then a
// pair per max/min (extreme_acc's acc[0], acc[1]), then the block parts partial_extreme folds
// through (shared: the partial kernels run in stream order).
// After the last chunk, combine() adds the sums across the group and takes the pairs' ncclMax (NaN
// as the flag, min as the max of its negation: as reduce_extreme), in one grouped call; then
// finish_sum / finish_extreme / segment_norm_fill write the results.
struct Partials {
  double* acc;
  int64_t sums, extremes, whole;
  double* sum(int64_t at) const { return acc + at; }
  double* extreme(int64_t e) const { return acc + sums + 2 * e; }
  double* parts() const { return acc + sums + 2 * extremes; }
};

// The accumulators of fused unit `name` (whole sums and norms, segments' sums, max/min pairs),
// initialized on the call's stream (sums 0, extremes none yet).
COCONET_EMU Partials partials(int site, int64_t whole, int64_t segment_sums, int64_t extremes, const char* name,
                         const Ctx& c) {
  const int64_t sums = whole + segment_sums;
  const int64_t n = sums + 2 * extremes + (extremes > 0 ? 2 * kExtremeBlocks : 0);
  const Partials p{scratch<double>(site, n), sums, extremes, whole};
  COCONET_BUFFER(p.acc, size_t(n) * sizeof(double), std::string("the partial results of fused ") + name);
  (void)name;
  if (sums > 0) COCONET_CUDA(cudaMemsetAsync(p.acc, 0, size_t(sums) * sizeof(double), c.stream));
  for (int64_t e = 0; e < extremes; ++e) extreme_init(p.extreme(e), c);
  return p;
}

// Every rank's partial results combined, in place: one grouped call of one or two ncclAllReduce.
// In a batch (batch.cuh) the whole sums and the extremes over every call's too; each segment's
// norm only across ranks (its segments are the call's own parameters), as on the CPU.
COCONET_EMU void combine(const Partials& p, const Ctx& c) {
  if (Batch* b = current_batch()) {
    if (p.whole > 0) combine_calls(*b, batch_slot(), p.acc, p.whole, true, false, c);
    if (p.extremes > 0) combine_calls(*b, batch_slot(), p.extreme(0), 2 * p.extremes, true, true, c);
    if (p.sums > p.whole)
      COCONET_CUDA(ncclAllReduce(p.sum(p.whole), p.sum(p.whole), size_t(p.sums - p.whole), ncclFloat64, ncclSum,
                                 c.comm, c.stream));
    return;
  }
  const trace::Piece nccl("NCCL allreduce", -1, c.stream);
  Group_ g;
  if (p.sums > 0) COCONET_CUDA(ncclAllReduce(p.acc, p.acc, size_t(p.sums), ncclFloat64, ncclSum, c.comm, c.stream));
  if (p.extremes > 0)
    COCONET_CUDA(ncclAllReduce(p.extreme(0), p.extreme(0), size_t(2 * p.extremes), ncclFloat64, ncclMax, c.comm,
                               c.stream));
}

// ---- fused collectives: chunk by chunk on two streams ---------------------------------------
//
// This rank's slice (outermost dim) of the reduced value, [0, mine) elements, is cut into chunks.
// The reduction of chunk k+1 runs on the comm stream while chunk k computes on the call's stream;
// each computed chunk's gathered piece goes out on the comm stream after an event. The reduction
// of one chunk is a grouped ncclReduce per rank (each rank's slice part of that chunk, to that
// rank), so uneven slices need no padding; the gather is a grouped ncclBroadcast per rank.
//   reduce_to(k, buf): issue chunk k's reduction into buf on the comm stream
//   compute(k, lo, hi, red): queue chunk k's kernel (local elements [lo, hi), red[i - lo])
//   gather(k, lo): issue chunk k's gather on the comm stream
//   source(k): chunk k's own elements, for a group of one rank (the reduction over one rank is
//     the value itself and the gather is in place): then each chunk's kernel reads the source
//     directly on the call's stream; nothing is copied, reduced or gathered (nullptr: no such
//     source, e.g. a scattered one, and one rank goes the general way)
template <class T, class RF, class CF, class GF, class SF = std::nullptr_t>
void pipeline(int64_t chunks, T* red0, T* red1, const Ctx& c, int site, RF reduce_to, CF compute, GF gather,
              SF source = nullptr) {
  if (chunks <= 0) return;
  if constexpr (!std::is_same<SF, std::nullptr_t>::value) {
    if (c.group.size == 1) {
      for (int64_t k = 0; k < chunks; ++k) {
        const trace::Piece tp("fused collective: compute a chunk", k, c.stream);
        compute(k, source(k));
      }
      return;
    }
  }
  cudaEvent_t start = event(site), done = event(site + 1), red_ev[2] = {event(site + 2), event(site + 3)},
              comp_ev[2] = {event(site + 4), event(site + 5)};
  T* red[2] = {red0, red1};
  COCONET_CUDA(cudaEventRecord(start, c.stream));
  COCONET_CUDA(cudaStreamWaitEvent(c.comm_stream, start, 0));
  reduce_to(0, red[0]);
  COCONET_CUDA(cudaEventRecord(red_ev[0], c.comm_stream));
  for (int64_t k = 0; k < chunks; ++k) {
    const int b = int(k % 2), nb = 1 - b;
    if (k + 1 < chunks) {
      reduce_to(k + 1, red[nb]);
      COCONET_CUDA(cudaEventRecord(red_ev[nb], c.comm_stream));
    }
    COCONET_CUDA(cudaStreamWaitEvent(c.stream, red_ev[b], 0));
    {
      const trace::Piece tp("fused collective: compute a chunk", k, c.stream);
      compute(k, red[b]);
    }
    COCONET_CUDA(cudaEventRecord(comp_ev[b], c.stream));
    // chunk k is computed: its gather may read it, and buffer b is free for chunk k + 2
    COCONET_CUDA(cudaStreamWaitEvent(c.comm_stream, comp_ev[b], 0));
    gather(k);
  }
  COCONET_CUDA(cudaEventRecord(done, c.comm_stream));
  COCONET_CUDA(cudaStreamWaitEvent(c.stream, done, 0));
}

// Chunk k of this rank's slice part: reduce each rank's piece [r's begin + k*CH, ...) to r.
template <class T>
void reduce_chunk(ncclRedOp_t op, const T* x, T* red, int64_t n, int64_t inner, int64_t k, int64_t ch, const Ctx& c) {
  const int R = c.group.size;
  const trace::Piece nccl("NCCL reduce", k, c.comm_stream);
  Group_ g;
  for (int r = 0; r < R; ++r) {
    Range sl = slice_range(n, R, r);
    const int64_t size = sl.size() * inner, lo = k * ch;
    if (lo >= size) continue;
    const int64_t cnt = size - lo < ch ? size - lo : ch;
    COCONET_CUDA(ncclReduce(x + sl.begin * inner + lo, red, size_t(cnt), NcclType<T>::t, op, r, c.comm, c.comm_stream));
  }
}

// The same over a scattered x (logical [0, n), 1-D): each rank's chunk is reduced piece by piece
// (one ncclReduce per piece inside one segment), grouped.
template <class T>
void reduce_chunk(ncclRedOp_t op, const Segments<T>& x, T* red, int64_t n, int64_t k, int64_t ch, const Ctx& c) {
  const int R = c.group.size;
  const trace::Piece nccl("NCCL reduce", k, c.comm_stream);
  Group_ g;
  for (int r = 0; r < R; ++r) {
    const Range sl = slice_range(n, R, r);
    const int64_t lo = sl.begin + k * ch, hi = std::min(sl.end, lo + ch);
    for (const Piece& pc : pieces(x.starts, lo, hi))
      COCONET_CUDA(ncclReduce(x.at(pc), red + pc.offset, size_t(pc.size), NcclType<T>::t, op, r, c.comm, c.comm_stream));
  }
}

// Chunk k of every rank's slice part of the gathered value y (full size), each from its rank.
template <class T>
void gather_chunk(T* y, int64_t n, int64_t inner, int64_t k, int64_t ch, const Ctx& c) {
  const int R = c.group.size;
  const trace::Piece nccl("NCCL broadcast", k, c.comm_stream);
  Group_ g;
  for (int r = 0; r < R; ++r) {
    Range sl = slice_range(n, R, r);
    const int64_t size = sl.size() * inner, lo = k * ch;
    if (lo >= size) continue;
    const int64_t cnt = size - lo < ch ? size - lo : ch;
    T* at = y + sl.begin * inner + lo;
    COCONET_CUDA(ncclBroadcast(at, at, size_t(cnt), NcclType<T>::t, r, c.comm, c.comm_stream));
  }
}

// ---- fused collectives sliced along a dim other than the outermost --------------------------------
//
// The reduced value is [outer, n, inner] sliced along n; a rank's slice part is [outer, |slice|,
// inner] (local linear index l), cut into chunks of ch local elements as above. A chunk's local
// range [lo, hi) is one run of contiguous global elements per outer index it touches:
// f(global start, offset in the chunk, count) for each.
template <class F>
void chunk_runs(int64_t outer, int64_t n, int64_t inner, Range sl, int64_t lo, int64_t hi, F f) {
  const int64_t S = sl.size() * inner;
  if (S <= 0) return;
  for (int64_t o = lo / S; o < outer && o * S < hi; ++o) {
    const int64_t a = std::max(lo, o * S), b = std::min(hi, (o + 1) * S);
    if (b > a) f((o * n + sl.begin) * inner + (a - o * S), a - lo, b - a);
  }
}

// Chunk k of every rank's slice part of x [outer, n, inner], reduced to that rank into red:
// one grouped ncclReduce per run.
template <class T>
void reduce_chunk(ncclRedOp_t op, const T* x, T* red, int64_t outer, int64_t n, int64_t inner, int64_t k, int64_t ch,
                  const Ctx& c, int64_t row0 = 0, int64_t row1 = -1) {
  const int R = c.group.size;
  if (row1 < 0) row1 = outer;
  const trace::Piece nccl("NCCL reduce", k, c.comm_stream);
  Group_ g;
  for (int r = 0; r < R; ++r) {
    const Range sl = slice_range(n, R, r);
    const int64_t S = sl.size() * inner, lo = row0 * S + k * ch, hi = std::min(row1 * S, lo + ch);
    chunk_runs(outer, n, inner, sl, lo, hi, [&](int64_t at, int64_t o, int64_t cnt) {
      COCONET_CUDA(ncclReduce(x + at, red + o, size_t(cnt), NcclType<T>::t, op, r, c.comm, c.comm_stream));
    });
  }
}

// Chunk k of every rank's slice part of the gathered y [outer, n, inner] (the rank's kernel wrote
// its part at its global place), from that rank, in place: one grouped ncclBroadcast per run.
template <class T>
void gather_chunk(T* y, int64_t outer, int64_t n, int64_t inner, int64_t k, int64_t ch, const Ctx& c,
                  int64_t row0 = 0, int64_t row1 = -1) {
  const int R = c.group.size;
  if (row1 < 0) row1 = outer;
  const trace::Piece nccl("NCCL broadcast", k, c.comm_stream);
  Group_ g;
  for (int r = 0; r < R; ++r) {
    const Range sl = slice_range(n, R, r);
    const int64_t S = sl.size() * inner, lo = row0 * S + k * ch, hi = std::min(row1 * S, lo + ch);
    chunk_runs(outer, n, inner, sl, lo, hi, [&](int64_t at, int64_t, int64_t cnt) {
      COCONET_CUDA(ncclBroadcast(y + at, y + at, size_t(cnt), NcclType<T>::t, r, c.comm, c.comm_stream));
    });
  }
}

#ifdef COCONET_EMULATE
// For the race detection: the runs of this rank's chunk [lo, hi) in the gathered y, written by the
// chunk's kernel (COCONET_ACCESS_RUNS: those spans with the listed ones).
template <class T>
std::vector<emu::Span> runs_w(T* y, int64_t outer, int64_t n, int64_t inner, Range sl, int64_t lo, int64_t hi) {
  std::vector<emu::Span> out;
  chunk_runs(outer, n, inner, sl, lo, hi, [&](int64_t at, int64_t, int64_t cnt) { out.push_back(emu::W(y, at, at + cnt)); });
  return out;
}
COCONET_EMU std::vector<emu::Span> with_spans(std::vector<emu::Span> a, const std::vector<emu::Span>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}
#define COCONET_ACCESS_RUNS(runs, ...) ::coconet::cuda::emu::declare(::coconet::cuda::with_spans({__VA_ARGS__}, runs))
#else
#define COCONET_ACCESS_RUNS(runs, ...)
#endif

// ---- scattered tensors: fused all-reduce, sum/norm, packed collectives ---------------------------

// Chunk k of the logical [0, n) of a scattered x, all-reduced into red: one grouped ncclAllReduce
// per piece of the chunk inside one segment, on the comm stream (a fused all-reduce's reduce_to).
template <class T>
void allreduce_chunk(ncclRedOp_t op, const Segments<T>& x, T* red, int64_t n, int64_t k, int64_t ch, const Ctx& c) {
  const int64_t lo = k * ch, hi = std::min(n, lo + ch);
  const trace::Piece nccl("NCCL allreduce", k, c.comm_stream);
  Group_ g;
  for (const Piece& pc : pieces(x.starts, lo, hi))
    COCONET_CUDA(ncclAllReduce(x.at(pc), red + pc.offset, size_t(pc.size), NcclType<T>::t, op, c.comm, c.comm_stream));
}

// dst[0] = sum (or L2 norm) of the logical [0, n) of a scattered x: a block reduction per piece
// into one double, the ranks' partial sums added when x is sliced (cross_rank), as reduce_sum.
template <class T, bool NORM>
void reduce_sum(const Segments<T>& x, T* dst, int64_t n, bool cross_rank, const Ctx& c, int site) {
  double* acc = scratch<double>(site, 1);
  COCONET_CUDA(cudaMemsetAsync(acc, 0, sizeof(double), c.stream));
  for (const Piece& pc : pieces(x.starts, 0, n)) partial_sum<T, NORM>(x.at(pc), pc.size, acc, c);
  reduce_across(acc, 1, cross_rank, false, c);
  finish_sum<T, NORM>(acc, dst, c);
}

// max (MAX) or min of the logical [0, n) of a scattered x, a block reduction per piece, as reduce_extreme.
template <class T, bool MAX>
void reduce_extreme(const Segments<T>& x, T* dst, int64_t n, bool cross_rank, const Ctx& c, int site) {
  double* acc = extreme_acc(site, c);
  for (const Piece& pc : pieces(x.starts, 0, n)) partial_extreme<T, MAX>(x.at(pc), pc.size, acc, c);
  reduce_across(acc, 2, cross_rank, true, c);
  finish_extreme<T, MAX>(acc, dst, c);
}

// Root's scattered x into every rank's contiguous y[0, n): one grouped ncclBroadcast per piece.
template <class T>
void broadcast(const Segments<T>& x, T* y, int64_t n, int root, const Ctx& c) {
  const trace::Piece nccl("NCCL broadcast", -1, c.stream);
  Group_ g;
  for (const Piece& pc : pieces(x.starts, 0, n))
    COCONET_CUDA(ncclBroadcast(x.at(pc), y + pc.offset, size_t(pc.size), NcclType<T>::t, root, c.comm, c.stream));
}

// The reduction of a scattered x on root into y[0, n), one grouped ncclReduce per piece; the other
// ranks keep x (copied piece by piece).
template <class T>
void reduce(ncclRedOp_t op, const Segments<T>& x, T* y, int64_t n, int root, const Ctx& c) {
  const trace::Piece nccl("NCCL reduce", -1, c.stream);
  const std::vector<Piece> ps = pieces(x.starts, 0, n);
  if (c.group.rank != root)
    for (const Piece& pc : ps)
      COCONET_CUDA(cudaMemcpyAsync(y + pc.offset, x.at(pc), size_t(pc.size) * sizeof(T), cudaMemcpyDeviceToDevice,
                                   c.stream));
  Group_ g;
  for (const Piece& pc : ps)
    COCONET_CUDA(ncclReduce(x.at(pc), y + pc.offset, size_t(pc.size), NcclType<T>::t, op, root, c.comm, c.stream));
}

// This rank's slice of a replicated scattered x (logical [0, n)) into y: a copy per piece.
template <class T>
void scatter_copy(const Segments<T>& x, T* y, int64_t n, const Ctx& c) {
  const Range sl = slice_range(n, c.group.size, c.group.rank);
  for (const Piece& pc : pieces(x.starts, sl.begin, sl.end))
    COCONET_CUDA(cudaMemcpyAsync(y + pc.offset, x.at(pc), size_t(pc.size) * sizeof(T), cudaMemcpyDeviceToDevice,
                                 c.stream));
}

// send(x, next|prev) of a scattered x, as send_shift: a grouped ncclSend per piece, received into
// the matching piece of y (every rank's segments have the same sizes).
template <class T>
void send_shift(const Segments<T>& x, T* y, int64_t n, bool next, const Ctx& c) {
  const int gs = c.wsize / c.groups, g = c.wrank / gs;
  const int to = next ? g + 1 : g - 1, from = next ? g - 1 : g + 1;
  const bool has_to = to >= 0 && to < c.groups, has_from = from >= 0 && from < c.groups;
  if (!has_from) COCONET_CUDA(cudaMemsetAsync(y, 0, size_t(n) * sizeof(T), c.stream));
  if (!has_to && !has_from) return;
  const trace::Piece nccl("NCCL send/recv", -1, c.stream);
  Group_ grp;
  for (const Piece& pc : pieces(x.starts, 0, n)) {
    if (has_to)
      COCONET_CUDA(ncclSend(x.at(pc), size_t(pc.size), NcclType<T>::t, to * gs + c.wrank % gs, c.world, c.stream));
    if (has_from)
      COCONET_CUDA(ncclRecv(y + pc.offset, size_t(pc.size), NcclType<T>::t, from * gs + c.wrank % gs, c.world,
                            c.stream));
  }
}

// ---- layernorm with a computed eps ---------------------------------------------------------------

// layernorm over the last dim whose eps is a computed 0-d value in device memory: layernorm_rows.
template <class T, class E>
void layernorm(const T* x, const T* g, const T* b, const E* eps, int64_t rows, int64_t H, T* y, const Ctx& c) {
  COCONET_ACCESS(COCONET_R(x, 0, rows * H), COCONET_R(g, 0, H), COCONET_R(b, 0, H), COCONET_R(eps, 0, 1),
                 COCONET_W(y, 0, rows * H));
  layernorm_rows(x, g, b, eps, rows, H, y, c);
}

}  // namespace cuda
}  // namespace coconet
