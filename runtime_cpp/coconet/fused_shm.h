// coconet runtime: the fused reduce-scatter + compute + all-gather through an MPI-3 shared-memory
// window, when every rank of the group is on this node (the CPU analogue of NCCL's symmetric
// memory), and the chunk arithmetic it shares with the point-to-point path of fused.h.
//
// Algorithm (fused_rs_compute_ag_shm; the window is the group's ShmWindow, comm.h):
//   1. stage: each rank copies the parts of its input that the other ranks reduce (their slices)
//      into its segment of the window, at their global indices (one pass over (R-1)/R of the
//      input; its own slice is read where it lies);  sync (MPI_Win_sync + MPI_Barrier);
//   2. reduce + compute: each rank reduces its slice chunk by chunk (RoundPlan: the same chunks,
//      so the same compute() calls, as the point-to-point path) reading every peer's segment
//      directly, in rank order, in the compute type; compute() runs on the chunk at once and
//      writes this rank's outputs; the chunk of every gather target, still in cache, is copied
//      into this rank's segment at its global indices (for one target of the input's element
//      size, the unused own-slice part of the staged input region);  sync;
//   3. gather: each rank copies every other rank's part of every target out of their segments.
// Regions are double-buffered (the two halves of the segment, by the parity of the call) while
// both fit in shm_double_bytes(), so a rank may stage call k+1 while a peer still reads call k: two
// barriers a call; above that, one region and a barrier before and after the call
// (ShmWindow::region_for, comm.h).  Memory: per rank, the full-size input (and each gather
// target of another element size) in the window, grown when needed and kept across calls.
// COCONET_FUSED=p2p forces the point-to-point path (it must be the same on every rank).
//
// A group over several nodes of L ranks each (nodes as comm.h's node_comm says, so also the
// simulated nodes of COCONET_SIMULATE_NODES) runs hierarchically instead: the node's window,
// MPI among the ranks of the same local rank across nodes, the node's window again
// (fused_rs_compute_ag_hier below; docs/cluster.md).
#pragma once

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "collectives.h"
#include "comm.h"
#include "dtypes.h"
#include "errors.h"
#include "reduce_ops.h"
#include "segments.h"
#include "slices.h"
#include "state.h"

namespace coconet {

// A full-size output of a fused collective, gathered in place: compute() writes this rank's
// part at global indices, the fused collective fills in the other ranks' parts.
using GatherTarget = RawSegments;

// A contiguous full-size output of `total` elements.
template <class T>
GatherTarget gather_target(T* full, int64_t total) {
  return raw(full, total);
}

// A scattered full-size output.
template <class T>
GatherTarget gather_target(const Segments<T>& full) {
  return raw(full);
}

// Elements of compute between two MPI progress calls.
constexpr int64_t kProgressElems = int64_t(1) << 15;

// Accumulates one contribution into dst in the compute type (first: dst = src).
template <class T>
void accumulate(Op op, bool first, compute_t<T>* dst, const T* src, int64_t n) {
  if (first) {
    for (int64_t i = 0; i < n; ++i) dst[i] = to_compute(src[i]);
  } else {
    with_op(op, [&](auto o) {  // the op fixed for the loop: no switch per element
      for (int64_t i = 0; i < n; ++i) dst[i] = combine(o.value, dst[i], to_compute(src[i]));
    });
  }
}

// avg's division and the rounding of a reduced chunk to T's precision.
template <class T>
void finish_chunk(Op op, compute_t<T>* x, int64_t n, int group_size) {
  const compute_t<T> div = static_cast<compute_t<T>>(group_size);
  if (op == Op::avg && group_size > 1)
    for (int64_t i = 0; i < n; ++i) x[i] = x[i] / div;
  if constexpr (is_half_like<T>::value)
    for (int64_t i = 0; i < n; ++i) x[i] = round_to<T>(x[i]);
}

// Runs compute over [begin, end) in pieces, calling `progress` between pieces.
template <class C, class Compute, class Progress>
void compute_in_pieces(int64_t begin, int64_t end, const C* reduced, int64_t piece,
                       Compute& compute, Progress&& progress) {
  for (int64_t a = begin; a < end; a += piece) {
    int64_t b = std::min(a + piece, end);
    abort_on_exception("fused collective compute", [&] {
      trace::Span span("fused collective: compute a chunk");
      compute(a, b, reduced + (a - begin));
    });
    progress();
  }
}

// ---- the shared-memory path ---------------------------------------------------------------------

// Window regions are double-buffered while both copies fit in this many bytes per rank
// (COCONET_SHM_DOUBLE bytes if set, the same on every rank: tests set 0 to fence every call).
inline size_t shm_double_bytes() {
  const char* env = std::getenv("COCONET_SHM_DOUBLE");
  return env ? static_cast<size_t>(std::atoll(env)) : size_t(64) << 20;
}

// Collectives run through a shared window in this process (the module's _shm_runs(): tests
// see which algorithm a call took).
COCONET_STATE std::atomic<int64_t>& shm_runs() COCONET_STATE_BODY({
  static std::atomic<int64_t> n{0};
  return n;
})

// Hierarchical collectives run in this process (the module's _hier_runs()).
COCONET_STATE std::atomic<int64_t>& hier_runs() COCONET_STATE_BODY({
  static std::atomic<int64_t> n{0};
  return n;
})

// True unless the call (CallArgs::fused, e.g. schedule "zero@p2p") or, when the call does not
// say, COCONET_FUSED asks for point-to-point (or the group has one rank).
COCONET_LIBRARY bool window_allowed(const Comm& comm) COCONET_LIBRARY_BODY({
  if (comm.size <= 1 || comm.shm.algo == 1) return false;
  if (comm.shm.algo == 0) {
    const char* env = std::getenv("COCONET_FUSED");
    if (env && std::strcmp(env, "p2p") == 0) return false;
  }
  return true;
})

// True when fused collectives on `comm` go through its shared-memory window: more than one rank,
// all on this node (nodes as node_comm in comm.h says), and window_allowed (collective over the
// group on first use).
COCONET_LIBRARY bool shm_chosen(Comm& comm) COCONET_LIBRARY_BODY({
  return window_allowed(comm) && comm.shm.available(comm.group, comm.size, comm.sim_node);
})

// shm_chosen, counting the runs (shm_runs).
inline bool use_shm(Comm& comm) {
  if (!shm_chosen(comm)) return false;
  shm_runs().fetch_add(1, std::memory_order_relaxed);
  return true;
}

// True when fused collectives (and large all-reduces) on `comm` run hierarchically (see
// fused_rs_compute_ag_hier): the group spans several nodes that hold the same number of its
// ranks, window_allowed, and the per-node messages of a [outer, n, inner] tensor fit MPI's int
// counts (the same answer on every rank; collective over the group on first use).
inline bool hier_chosen(Comm& comm, Shape3 shape) {
  if (!window_allowed(comm) || comm.shm.available(comm.group, comm.size, comm.sim_node)) return false;
  if (!comm.shm.layout().hierarchical()) return false;
  const int64_t widest = slice_chunk(shape.n, comm.size) * shape.inner * shape.outer;
  return widest <= INT_MAX;
}

// hier_chosen, counting the runs (hier_runs).
inline bool use_hier(Comm& comm, Shape3 shape) {
  if (!hier_chosen(comm, shape)) return false;
  hier_runs().fetch_add(1, std::memory_order_relaxed);
  return true;
}

inline size_t align64(size_t n) { return (n + 63) / 64 * 64; }

// Copies the logical range [begin, end) of `s` to contiguous bytes at dst.
inline void raw_copy_out(const RawSegments& s, int64_t begin, int64_t end, char* dst) {
  const size_t es = s.elem_size;
  for_each_piece(s.starts, begin, end, [&](size_t seg, int64_t so, int64_t ro, int64_t len) {
    std::memcpy(dst + static_cast<size_t>(ro) * es, s.ptrs[seg] + static_cast<size_t>(so) * es,
                static_cast<size_t>(len) * es);
  });
}

// Copies contiguous bytes at src into the logical range [begin, end) of `s` (nothing where they
// are the same bytes: a target in a node-shared window, comm.h, which its owner wrote in place).
inline void raw_copy_in(const char* src, const RawSegments& s, int64_t begin, int64_t end) {
  const size_t es = s.elem_size;
  for_each_piece(s.starts, begin, end, [&](size_t seg, int64_t so, int64_t ro, int64_t len) {
    char* const dst = s.ptrs[seg] + static_cast<size_t>(so) * es;
    const char* const from = src + static_cast<size_t>(ro) * es;
    if (dst != from) std::memcpy(dst, from, static_cast<size_t>(len) * es);
  });
}

// Calls f(r, range) for every non-empty piece of every other rank's slice of `shape`.
template <class F>
void for_each_peer_piece(Shape3 shape, int R, int me, F&& f) {
  RoundPlan whole(shape, R, std::numeric_limits<int64_t>::max());  // one piece per outer row
  for (int64_t k = 0; k < whole.rounds; ++k)
    for (int r = 0; r < R; ++r) {
      Range q = whole.range(k, r);
      if (r != me && !q.empty()) f(r, q);
    }
}

// Gather targets (the first ones of a call) whose place in a shared window the header can name.
constexpr size_t kInPlaceTargets = 3;

// The gather targets (each of `total` elements; checked) one after the other in a window region,
// 64-byte aligned: each one's offset in `goff`; returns the bytes they take.
inline size_t lay_out_targets(const std::vector<GatherTarget>& gathers, int64_t total, std::vector<size_t>& goff) {
  goff.assign(gathers.size(), 0);
  size_t bytes = 0;
  for (size_t g = 0; g < gathers.size(); ++g) {
    require(gathers[g].total() == total, "fused collective: gather target size mismatch");
    goff[g] = bytes;
    bytes += align64(static_cast<size_t>(total) * gathers[g].elem_size);
  }
  return bytes;
}

// Where the peers read this call's gather targets through the group's window: each target that
// lies in a user window (coconetc.empty) in place, the others from each rank's region at
// `goff[g]` (past the region's 64-byte header, whose slots 2 + 2g, 3 + 2g name the place).
// announce() before the sync that publishes the header, resolve() after it.
struct WindowTargets {
  ShmWindow& win;
  size_t at;  // the call's region
  const std::vector<GatherTarget>& gathers;
  std::vector<size_t> goff;
  int64_t total;
  int R;
  static constexpr size_t kHead = 64;
  std::vector<const char*> part{};  // [g * R + r]: where rank r's part of target g is read
  bool read_in_place = false;       // (the same on every rank)

  int64_t* head(int r) const { return reinterpret_cast<int64_t*>(win.base(r) + at); }
  char* seg(int r) const { return win.base(r) + at + kHead; }
  size_t named() const { return std::min(gathers.size(), kInPlaceTargets); }
  bool in_place(size_t g, int r) const { return g < named() && head(r)[2 + 2 * g] >= 0; }

  // This rank's targets that peers can read in place, in its header.
  void announce(int me) const {
    for (size_t g = 0; g < named(); ++g) {
      const std::pair<int64_t, int64_t> t =
          gathers[g].ptrs.size() == 1
              ? win.user_window_of(gathers[g].ptrs[0], static_cast<size_t>(total) * gathers[g].elem_size)
              : std::pair<int64_t, int64_t>{-1, 0};
      head(me)[2 + 2 * g] = t.first;
      head(me)[3 + 2 * g] = t.second;
    }
  }

  // Every rank's place of every target (after the sync that follows announce()).
  void resolve() {
    part.assign(gathers.size() * static_cast<size_t>(R), nullptr);
    for (size_t g = 0; g < gathers.size(); ++g)
      for (int r = 0; r < R; ++r) {
        read_in_place |= in_place(g, r);
        part[g * R + r] = in_place(g, r) ? win.user_memory(head(r)[2 + 2 * g], r, head(r)[3 + 2 * g])
                                         : seg(r) + goff[g];
      }
  }

  // This rank's range q of every target not read in place, copied into its region.
  void publish(int me, Range q) const {
    for (size_t g = 0; g < gathers.size(); ++g)
      if (!in_place(g, me))
        raw_copy_out(gathers[g], q.begin, q.end, seg(me) + goff[g] + static_cast<size_t>(q.begin) * gathers[g].elem_size);
  }

  // The other ranks' parts of every target, from their region or their target itself.
  void collect(Shape3 shape, int me) const {
    for (size_t g = 0; g < gathers.size(); ++g)
      for_each_peer_piece(shape, R, me, [&](int r, Range q) {
        raw_copy_in(part[g * R + r] + static_cast<size_t>(q.begin) * gathers[g].elem_size, gathers[g], q.begin, q.end);
      });
  }
};

// Blocking fused reduce-scatter + compute + all-gather through the group's shared window (see
// the top of this file); the same contract as fused_rs_compute_ag (fused.h).
template <class T, class Compute>
void fused_rs_compute_ag_shm(Op op, const Segments<const T>& in, Shape3 shape, Comm& comm,
                             int64_t chunk_elems, Compute& compute,
                             const std::vector<GatherTarget>& gathers, int64_t progress_elems) {
  const int64_t total = shape.total();
  require(in.total() == total, "fused collective: input has " + std::to_string(in.total()) +
                                   " elements, shape " + std::to_string(total));
  for (const GatherTarget& g : gathers)
    require(g.total() == total, "fused collective: gather target size mismatch");
  const int R = comm.size, me = comm.rank;
  // region layout: [header: where this rank's input is][staged input][each gather target not
  // kept in the input's own-slice part]
  constexpr size_t kHead = WindowTargets::kHead;
  size_t region = kHead + align64(static_cast<size_t>(total) * sizeof(T));
  std::vector<size_t> goff(gathers.size(), 0);
  for (size_t k = 0; k < gathers.size(); ++k) {
    if (k == 0 && gathers[k].elem_size == sizeof(T)) continue;
    goff[k] = region - kHead;
    region += align64(static_cast<size_t>(total) * gathers[k].elem_size);
  }
  ShmWindow& win = comm.shm;
  bool fenced = false;
  const size_t at = win.region_for(region, fenced, shm_double_bytes());
  WindowTargets targets{win, at, gathers, goff, total, R};
  auto head = [&](int r) { return targets.head(r); };
  auto seg = [&](int r) { return targets.seg(r); };

  // 1. stage what the others reduce, unless the input lies in a shared window (coconetc.empty)
  std::pair<int64_t, int64_t> user{-1, 0};
  if (in.count() == 1) user = win.user_window_of(in.ptrs[0], static_cast<size_t>(total) * sizeof(T));
  head(me)[0] = user.first;
  head(me)[1] = user.second;
  T* staged = reinterpret_cast<T*>(seg(me));
  if (user.first < 0)
    for_each_peer_piece(shape, R, me, [&](int, Range q) { copy_out(in, q.begin, q.end, staged + q.begin); });
  // a gather target in a shared window too (coconetc.empty) is read there by the peers: this
  // rank's part is not published into the region (one pass over 1/R of it fewer per rank)
  targets.announce(me);
  win.sync();
  std::vector<const T*> input(static_cast<size_t>(R));  // every rank's input, readable here
  for (int r = 0; r < R; ++r)
    input[static_cast<size_t>(r)] = reinterpret_cast<const T*>(
        head(r)[0] < 0 ? seg(r) : win.user_memory(head(r)[0], r, head(r)[1]));
  targets.resolve();

  // 2. reduce this rank's slice from every rank, compute, publish each target's chunk
  RoundPlan plan(shape, R, chunk_elems);
  compute_t<T>* red = scratch_as<compute_t<T>>(comm, 0, 2, plan.rounds ? plan.C : 0);
  const int64_t piece = std::max<int64_t>(progress_elems, 1);
  for (int64_t k = 0; k < plan.rounds; ++k) {
    Range q = plan.range(k, me);
    if (q.empty()) continue;
    for (int r = 0; r < R; ++r) {
      if (r == me) {
        in.for_each(q.begin, q.end, [&](const T* p, int64_t o, int64_t len) {
          accumulate(op, r == 0, red + o, p, len);
        });
      } else {
        accumulate(op, r == 0, red, input[static_cast<size_t>(r)] + q.begin, q.size());
      }
    }
    finish_chunk<T>(op, red, q.size(), R);
    compute_in_pieces(q.begin, q.end, red, piece, compute, [] {});
    targets.publish(me, q);
  }
  win.sync();

  // 3. the other ranks' parts of every target, from their region or their target itself
  targets.collect(shape, me);
  // nobody stages the next call over a region still being read; and a target read in place is
  // the caller's again only when no peer reads it any more (the same choice on every rank)
  if (fenced || targets.read_in_place) win.sync();
}

// Phase B of a fused collective with reductions (compute_ag, fused.h) through the group's
// window: compute(begin, end) on this rank's slice chunk by chunk (the reduce-scatter's
// RoundPlan), each chunk of every gather target published into this rank's region while it is in
// cache (or read in place by the peers where the target lies in a user window); one sync; the
// other ranks' parts copied out (and a sync after, as in fused_rs_compute_ag_shm).
template <class Compute>
void compute_ag_shm(Shape3 shape, Comm& comm, int64_t chunk_elems, Compute& compute,
                    const std::vector<GatherTarget>& gathers) {
  const int64_t total = shape.total();
  const int R = comm.size, me = comm.rank;
  std::vector<size_t> goff;
  const size_t region = WindowTargets::kHead + lay_out_targets(gathers, total, goff);
  ShmWindow& win = comm.shm;
  bool fenced = false;
  const size_t at = win.region_for(region, fenced, shm_double_bytes());
  WindowTargets targets{win, at, gathers, goff, total, R};
  targets.announce(me);
  RoundPlan plan(shape, R, chunk_elems);
  for (int64_t k = 0; k < plan.rounds; ++k) {
    Range q = plan.range(k, me);
    if (q.empty()) continue;
    abort_on_exception("fused collective compute", [&] {
      trace::Span span("fused collective: compute a chunk");
      compute(q.begin, q.end);
    });
    targets.publish(me, q);
  }
  win.sync();
  targets.resolve();
  targets.collect(shape, me);
  if (fenced || targets.read_in_place) win.sync();
}


// ---- the hierarchical path: groups over several nodes -----------------------------------------

// f(node, range) for every non-empty piece of U_j: the slices of the ranks of local rank j on
// every node (by node, then row), of a [outer, n, inner] tensor over the node layout `nl`.
template <class F>
void for_each_union_piece(Shape3 shape, int R, const NodeLayout& nl, int j, F&& f) {
  RoundPlan whole(shape, R, std::numeric_limits<int64_t>::max());  // round o: row o's whole slices
  for (int kk = 0; kk < nl.nodes; ++kk)
    for (int64_t o = 0; o < whole.rounds; ++o) {
      Range q = whole.range(o, nl.at(kk, j));
      if (!q.empty()) f(kk, q);
    }
}

// Steps 4 and 5 of fused_rs_compute_ag_hier (below): every rank's part of every target, already
// written in place, gathered over a group of M nodes of L ranks: across nodes among the ranks of
// the same local rank (each then holds U_l), then within the node through the window region at
// `at` (target g at goff[g]; with L = 1 no window), and a sync after when the region is fenced.
COCONET_LIBRARY void gather_hier(Shape3 shape, Comm& comm, const std::vector<GatherTarget>& gathers,
                                 size_t at, const std::vector<size_t>& goff, bool fenced) COCONET_LIBRARY_BODY({
  constexpr int kTagGather = 22;
  const NodeLayout& nl = comm.shm.layout();
  const int R = comm.size, me = comm.rank, M = nl.nodes, L = nl.per_node, k = nl.node, l = nl.local;
  RoundPlan whole(shape, R, std::numeric_limits<int64_t>::max());
  std::vector<MPI_Request> reqs;
  for (const GatherTarget& g : gathers)
    for (int kk = 0; kk < M; ++kk) {
      if (kk == k) continue;
      for (int64_t o = 0; o < whole.rounds; ++o) {
        Range theirs = whole.range(o, nl.at(kk, l)), ours = whole.range(o, me);
        irecv_range(g, theirs.begin, theirs.end, kk, kTagGather, nl.across, reqs);
        isend_range(g, ours.begin, ours.end, kk, kTagGather, nl.across, reqs);
      }
    }
  wait_all(reqs);
  if (L == 1) return;
  ShmWindow& win = comm.shm;
  auto seg = [&](int j) { return win.base(j) + at; };
  for (size_t g = 0; g < gathers.size(); ++g) {
    const size_t es = gathers[g].elem_size;
    for_each_union_piece(shape, R, nl, l, [&](int, Range q) {
      raw_copy_out(gathers[g], q.begin, q.end, seg(l) + goff[g] + static_cast<size_t>(q.begin) * es);
    });
  }
  win.sync();
  for (size_t g = 0; g < gathers.size(); ++g) {
    const size_t es = gathers[g].elem_size;
    for (int j = 0; j < L; ++j)
      if (j != l)
        for_each_union_piece(shape, R, nl, j, [&](int, Range q) {
          raw_copy_in(seg(j) + goff[g] + static_cast<size_t>(q.begin) * es, gathers[g], q.begin, q.end);
        });
  }
  if (fenced) win.sync();
})

// compute_ag (fused.h) over a group on several nodes (hier_chosen): compute(begin, end) on this
// rank's slice chunk by chunk (the reduce-scatter's RoundPlan), then gather_hier of the targets
// through a region of the node's window of their own.
template <class Compute>
void compute_ag_hier(Shape3 shape, Comm& comm, int64_t chunk_elems, Compute& compute,
                     const std::vector<GatherTarget>& gathers) {
  std::vector<size_t> goff;
  const size_t region = lay_out_targets(gathers, shape.total(), goff);
  RoundPlan plan(shape, comm.size, chunk_elems);
  for (int64_t kr = 0; kr < plan.rounds; ++kr) {
    Range q = plan.range(kr, comm.rank);
    if (!q.empty())
      abort_on_exception("fused collective compute", [&] {
        trace::Span span("fused collective: compute a chunk");
        compute(q.begin, q.end);
      });
  }
  bool fenced = false;
  const size_t at = comm.shm.layout().per_node > 1 ? comm.shm.region_for(region, fenced, shm_double_bytes()) : 0;
  gather_hier(shape, comm, gathers, at, goff, fenced);
}


// Blocking fused reduce-scatter + compute + all-gather over a group of M nodes of L ranks each
// (hier_chosen; the same contract as fused_rs_compute_ag, fused.h).  With U_l the union of the
// slices of the ranks of local rank l on every node (rank (k, l) of node k owns the language's
// slice slice_range(n, R, r) of its group rank r, so uneven and empty slices need nothing
// special):
//   1. within the node: each rank stages into its segment of the node's window the parts of its
//      input that its node peers reduce (U_j, j != l);  sync;  local rank l reduces U_l over
//      the node's ranks (node order, compute type), packed by node and row;
//   2. across nodes (MPI point to point on the ranks of local rank l, one per node): each node's
//      partial of rank (k', l)'s slice goes to that rank, which combines the M partials in node
//      order, divides for avg, rounds to T: its reduced slice, as on one node;
//   3. compute() on the slice in the chunks of the flat paths (RoundPlan), writing this rank's
//      part of every gather target;
//   4. across nodes: this rank's part of every target to the ranks of the same local rank
//      (each then holds U_l of every target);
//   5. within the node: U_l of every target published in the window;  sync;  the other node
//      ranks' U_j copied out (and a sync after when the region is fenced, as on one node).
// With one rank per node (L = 1) no window is used: steps 2-4 only.  Memory: the window holds
// the full-size input and each target of another element size (as fused_rs_compute_ag_shm);
// scratch for U_l and M contributions to this rank's slice in the compute type.
template <class T, class Compute>
void fused_rs_compute_ag_hier(Op op, const Segments<const T>& in, Shape3 shape, Comm& comm,
                              int64_t chunk_elems, Compute& compute,
                              const std::vector<GatherTarget>& gathers, int64_t progress_elems) {
  using C = compute_t<T>;
  constexpr int kTagReduce = 21;
  const int64_t total = shape.total();
  require(in.total() == total, "fused collective: input has " + std::to_string(in.total()) +
                                   " elements, shape " + std::to_string(total));
  for (const GatherTarget& g : gathers)
    require(g.total() == total, "fused collective: gather target size mismatch");
  const NodeLayout& nl = comm.shm.layout();
  const int R = comm.size, me = comm.rank, M = nl.nodes, L = nl.per_node, k = nl.node, l = nl.local;
  MPI_Comm across = nl.across;
  auto for_union = [&](int j, auto&& f) { for_each_union_piece(shape, R, nl, j, f); };
  auto elems = [&](int r) { return slice_range(shape.n, R, r).size() * shape.inner * shape.outer; };
  std::vector<int64_t> off(static_cast<size_t>(M) + 1, 0);  // node kk's part of U_l in `part`
  for (int kk = 0; kk < M; ++kk) off[kk + 1] = off[kk] + elems(nl.at(kk, l));

  // the node's window: [staged input][each gather target not kept in the input's U_l part]
  ShmWindow& win = comm.shm;
  std::vector<size_t> goff(gathers.size(), 0);
  size_t at = 0;
  bool fenced = false;
  if (L > 1) {
    size_t region = align64(static_cast<size_t>(total) * sizeof(T));
    for (size_t g = 0; g < gathers.size(); ++g) {
      if (g == 0 && gathers[g].elem_size == sizeof(T)) continue;
      goff[g] = region;
      region += align64(static_cast<size_t>(total) * gathers[g].elem_size);
    }
    at = win.region_for(region, fenced, shm_double_bytes());
  }
  auto seg = [&](int j) { return win.base(j) + at; };

  // 1. within the node: stage what the peers reduce, then reduce U_l
  if (L > 1) {
    T* staged = reinterpret_cast<T*>(seg(l));
    for (int j = 0; j < L; ++j)
      if (j != l) for_union(j, [&](int, Range q) { copy_out(in, q.begin, q.end, staged + q.begin); });
    win.sync();
  }
  C* part = scratch_as<C>(comm, 0, 5, off[M]);
  int64_t p = 0;
  for_union(l, [&](int, Range q) {
    for (int j = 0; j < L; ++j) {
      if (j == l) {
        in.for_each(q.begin, q.end, [&](const T* src, int64_t o, int64_t len) {
          accumulate(op, j == 0, part + p + o, src, len);
        });
      } else {
        accumulate(op, j == 0, part + p, reinterpret_cast<const T*>(seg(j)) + q.begin, q.size());
      }
    }
    p += q.size();
  });

  // 2. across nodes: every node's partial of this rank's slice, combined in node order
  const int64_t mine = off[k + 1] - off[k];
  C* got = scratch_as<C>(comm, 0, 6, mine * M);
  C* red = scratch_as<C>(comm, 0, 7, mine);
  std::vector<MPI_Request> reqs;
  for (int kk = 0; kk < M; ++kk) {
    if (kk == k) continue;
    if (mine) {
      reqs.emplace_back();
      COCONET_MPI(MPI_Irecv(got + kk * mine, static_cast<int>(mine), mpi_type<C>(), kk, kTagReduce,
                            across, &reqs.back()));
    }
    const int64_t theirs = off[kk + 1] - off[kk];
    if (theirs) {
      reqs.emplace_back();
      COCONET_MPI(MPI_Isend(part + off[kk], static_cast<int>(theirs), mpi_type<C>(), kk, kTagReduce,
                            across, &reqs.back()));
    }
  }
  wait_all(reqs);
  for (int kk = 0; kk < M; ++kk)
    accumulate(op, kk == 0, red, kk == k ? part + off[k] : got + kk * mine, mine);
  finish_chunk<T>(op, red, mine, R);

  // 3. compute on this rank's slice, chunk by chunk (the flat paths' chunks)
  RoundPlan plan(shape, R, chunk_elems);
  const int64_t piece = std::max<int64_t>(progress_elems, 1);
  for (int64_t kr = 0; kr < plan.rounds; ++kr) {
    Range q = plan.range(kr, me);
    if (!q.empty())
      compute_in_pieces(q.begin, q.end, red + plan.slice_offset(kr, me), piece, compute, [] {});
  }

  // 4. and 5. across nodes, then within the node
  gather_hier(shape, comm, gathers, at, goff, fenced);
}

// Blocking fused allreduce + compute over a group on several nodes (hier_chosen): the reduced
// tensor gathered hierarchically into scratch in the compute type, then compute() over
// [0, total) chunk by chunk (the contract of fused_allreduce_compute, fused.h).
template <class T, class Compute>
void fused_allreduce_compute_hier(Op op, const Segments<const T>& in, Comm& comm,
                                  int64_t chunk_elems, Compute& compute, int64_t progress_elems) {
  using C = compute_t<T>;
  const int64_t total = in.total();
  C* full = scratch_as<C>(comm, 0, 9, total);
  auto keep = [full](int64_t b, int64_t e, const C* red) { std::copy(red, red + (e - b), full + b); };
  std::vector<GatherTarget> gathers{gather_target(full, total)};
  fused_rs_compute_ag_hier<T>(op, in, Shape3{1, total, 1}, comm, chunk_elems, keep, gathers,
                              int64_t(1) << 40);
  const int64_t chunk = std::max<int64_t>(chunk_elems, 1), piece = std::max<int64_t>(progress_elems, 1);
  for (int64_t a = 0; a < total; a += chunk)
    compute_in_pieces(a, std::min(a + chunk, total), full + a, piece, compute, [] {});
}

// Messages below this many bytes go through MPI_Allreduce (two barriers cost more there).
constexpr size_t kShmAllreduceMinBytes = size_t(1) << 14;

// allreduce (collectives.h) through the group's window: a fused reduce-scatter whose "compute"
// writes the reduced chunk into out and whose gather target is out (in == out allowed).
template <class T>
bool allreduce_shm(Op op, const T* in, T* out, int64_t count, Comm& comm) {
  if (static_cast<size_t>(count) * sizeof(T) < kShmAllreduceMinBytes) return false;
  const Shape3 shape{1, count, 1};
  const bool flat = use_shm(comm);
  if (!flat && !use_hier(comm, shape)) return false;
  auto copy = [out](int64_t b, int64_t e, const compute_t<T>* red) {
    for (int64_t i = b; i < e; ++i) out[i] = from_compute<T>(red[i - b]);
  };
  std::vector<GatherTarget> gathers{gather_target(out, count)};
  const int64_t chunk = int64_t(1) << 16;
  if (flat)
    fused_rs_compute_ag_shm<T>(op, Segments<const T>::one(in, count), shape, comm, chunk, copy, gathers, chunk);
  else
    fused_rs_compute_ag_hier<T>(op, Segments<const T>::one(in, count), shape, comm, chunk, copy, gathers, chunk);
  return true;
}

// reduce_scatter (collectives.h) of a [outer, n, inner] tensor (segments: scattered inputs)
// through the group's window: a fused reduce-scatter whose "compute" writes the reduced chunk at
// its place in out_slice [outer, my slice, inner], with nothing to gather (false: MPI's runs).
template <class T>
bool reduce_scatter_shm(Op op, const Segments<const T>& in, T* out_slice, Shape3 shape, Comm& comm) {
  if (static_cast<size_t>(shape.total()) * sizeof(T) < kShmAllreduceMinBytes) return false;
  const bool flat = use_shm(comm);
  if (!flat && !use_hier(comm, shape)) return false;
  const Range sl = slice_range(shape.n, comm.size, comm.rank);
  const int64_t row = shape.n * shape.inner, mine = sl.size() * shape.inner;
  auto put = [&](int64_t b, int64_t e, const compute_t<T>* red) {  // [b, e) within one row
    const int64_t o = b / row;
    T* dst = out_slice + o * mine + (b - o * row - sl.begin * shape.inner);
    for (int64_t i = 0; i < e - b; ++i) dst[i] = from_compute<T>(red[i]);
  };
  const std::vector<GatherTarget> none;
  const int64_t chunk = int64_t(1) << 16;
  if (flat)
    fused_rs_compute_ag_shm<T>(op, in, shape, comm, chunk, put, none, chunk);
  else
    fused_rs_compute_ag_hier<T>(op, in, shape, comm, chunk, put, none, chunk);
  return true;
}

// allgather (collectives.h) of a [1, n, inner] tensor through the group's window: each rank
// copies its slice into its segment, then, after a barrier, the others' slices out of theirs;
// over several nodes ([outer, n, inner]) hierarchically (gather_hier).
template <class T>
bool allgather_shm(const T* in_slice, T* out, Shape3 s, Comm& comm) {
  const size_t bytes = static_cast<size_t>(s.total()) * sizeof(T);
  if (bytes < kShmAllreduceMinBytes) return false;
  if (!shm_chosen(comm) && use_hier(comm, s)) {  // over several nodes: this rank's slice in
    const Range sl = slice_range(s.n, comm.size, comm.rank);  // place, then gather_hier
    const int64_t row = s.n * s.inner, mine = sl.size() * s.inner;
    for (int64_t o = 0; o < s.outer; ++o)
      if (in_slice + o * mine != out + o * row + sl.begin * s.inner)
        std::memmove(out + o * row + sl.begin * s.inner, in_slice + o * mine, static_cast<size_t>(mine) * sizeof(T));
    auto none = [](int64_t, int64_t) {};
    compute_ag_hier(s, comm, int64_t(1) << 40, none, {gather_target(out, s.total())});
    return true;
  }
  if (s.outer != 1 || !use_shm(comm)) return false;
  ShmWindow& win = comm.shm;
  bool fenced = false;
  const size_t at = win.region_for(align64(bytes), fenced, shm_double_bytes());
  auto range = [&](int r) {
    Range q = slice_range(s.n, comm.size, r);
    return Range{q.begin * s.inner, q.end * s.inner};
  };
  Range mine = range(comm.rank);
  const size_t n = static_cast<size_t>(mine.size()) * sizeof(T);
  if (n) std::memcpy(win.base(comm.rank) + at + static_cast<size_t>(mine.begin) * sizeof(T), in_slice, n);
  if (n && in_slice != out + mine.begin) std::memmove(out + mine.begin, in_slice, n);
  win.sync();
  for (int r = 0; r < comm.size; ++r) {
    Range q = range(r);
    if (r == comm.rank || q.empty()) continue;
    std::memcpy(out + q.begin, win.base(r) + at + static_cast<size_t>(q.begin) * sizeof(T),
                static_cast<size_t>(q.size()) * sizeof(T));
  }
  if (fenced) win.sync();
  return true;
}

// The collectives for every dtype a program has, instantiated once per machine (runtime.cpp,
// the runtime library every unit links) instead of in every unit of every module: those through
// the window instantiate the fused pieces above for their dtype, which took most of a unit's
// compile time (a bf16 all-reduce several seconds), and the plain all-reduce, reduce-scatter and
// all-gather that call them were compiled again by every unit that calls one. A generated unit
// defines COCONET_LINKS_RUNTIME; code that uses the headers alone (runtime_cpp/tests)
// instantiates them itself.
// (COCONET_SHARED on each instantiation too: the types half and bfloat16 are hidden, which would
// make their instantiations hidden, out of the units' reach.)
#define COCONET_COLLECTIVES(T, EXTERN)                                                                         \
  EXTERN template COCONET_SHARED bool allreduce_shm<T>(Op, const T*, T*, int64_t, Comm&);                    \
  EXTERN template COCONET_SHARED bool reduce_scatter_shm<T>(Op, const Segments<const T>&, T*, Shape3, Comm&); \
  EXTERN template COCONET_SHARED bool allgather_shm<T>(const T*, T*, Shape3, Comm&);                         \
  EXTERN template COCONET_SHARED void allreduce<T>(Op, const T*, T*, int64_t, Comm&);                        \
  EXTERN template COCONET_SHARED void reduce_scatter<T>(Op, const T*, T*, int64_t, int64_t, int64_t, Comm&,  \
                                                        int64_t);                                            \
  EXTERN template COCONET_SHARED void allgather<T>(const T*, T*, int64_t, int64_t, int64_t, Comm&, int64_t);
#define COCONET_EACH_DTYPE(X) X(float) X(double) X(half) X(bfloat16) X(int32_t) X(int64_t)
#ifdef COCONET_LINKS_RUNTIME
#define COCONET_EXTERN_COLLECTIVES(T) COCONET_COLLECTIVES(T, extern)
COCONET_EACH_DTYPE(COCONET_EXTERN_COLLECTIVES)
#undef COCONET_EXTERN_COLLECTIVES
#endif

}  // namespace coconet
