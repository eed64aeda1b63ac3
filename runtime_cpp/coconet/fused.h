// coconet runtime: fused collectives (`fuse(rs, c1, c2, ..., ag)` in a schedule).
//
// fused_rs_compute_ag: reduce-scatter + computation + all-gather as one pipelined unit.  The
// reduced tensor is never materialized: only one chunk of it exists at a time.
//
// Algorithm.  The input is a local full-size tensor viewed as [outer, n, inner], sliced along n
// (slices.h).  Every rank's slice is cut into rounds of at most C = chunk_elems elements
// (RoundPlan: round k holds one contiguous piece of every rank's slice; all ranks agree on the
// number of rounds, so ranks with short or empty slices just send and receive nothing).
// For round k, on every rank:
//   1. reduce (point to point): the owner r of a piece receives every other rank's contribution
//      for it (MPI_Irecv into a chunk-sized slot per peer) and every rank sends each owner its
//      own contribution straight from the input (MPI_Isend; a piece that crosses segments of a
//      scattered input goes as one hindexed datatype, no packing);
//   2. accumulate: the owner combines the contributions in rank order in the compute type
//      (float for f16/bf16), divides for avg, and rounds to T (the IR types the reduced value as
//      T), giving the reduced chunk;
//   3. compute(global_begin, global_end, reduced) runs on the chunk.  It writes this rank's
//      outputs: sliced state (m, v of ZeRO) and, for each GatherTarget, the chunk's place in
//      the full-size output buffer (global indices);
//   4. gather (point to point): the owner sends the chunk's region of every GatherTarget to
//      every other rank, which receives it straight into the same region (in place).
// Double buffering: round k+1's reduce messages are posted (two slots) before round k is
// accumulated and computed, and gathers stay in flight while later rounds compute.  MPI only
// progresses inside MPI calls, so compute runs in pieces of progress_elems and MPI_Testall is
// called on the outstanding requests between pieces.  Only point-to-point messages are used,
// so a FusedRsComputeAg can run as an overlap() task next to others, posting in data-dependent
// order, without cross-matching (each in-flight task gets its own channel).
//
// fused_allreduce_compute: allreduce chunk by chunk (MPI_Iallreduce, double buffered on the
// task's channel) and compute(global_begin, global_end, reduced) on every rank over the whole
// tensor.  For programs that keep the allreduce (no split) but fuse the computation.
//
// Requirements: compute must not write the input ranges of later rounds (writing the input of
// the current chunk, e.g. an in-place update of the reduced tensor itself, is fine); compute
// must not throw (exceptions abort the job, errors.h).  Memory: 2 * R * C elements of T plus C
// of compute_t<T>, from the Comm's scratch buffers (reused from call to call).
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "collectives.h"
#include "comm.h"
#include "dtypes.h"
#include "errors.h"
#include "fused_shm.h"
#include "reduce_ops.h"
#include "segments.h"
#include "slices.h"

namespace coconet {

// ---- reduce-scatter + compute + all-gather -----------------------------------------------------

template <class T, class Compute>
class FusedRsComputeAg {
 public:
  // Starts the operation (posts the first two rounds); test()/wait() finish it.  Argument
  // checks throw before anything is posted.
  FusedRsComputeAg(Op op, Segments<const T> in, Shape3 shape, Comm& comm, int channel,
                   int64_t chunk_elems, Compute compute, std::vector<GatherTarget> gathers,
                   int64_t progress_elems = kProgressElems)
      : op_(op), in_(std::move(in)), raw_in_(raw(in_)), plan_(shape, comm.size, chunk_elems),
        R_(comm.size), me_(comm.rank), compute_(std::move(compute)),
        gathers_(std::move(gathers)), piece_(std::max<int64_t>(progress_elems, 1)) {
    require(in_.total() == shape.total(), "fused collective: input has " +
                                              std::to_string(in_.total()) + " elements, shape " +
                                              std::to_string(shape.total()));
    for (const GatherTarget& g : gathers_)
      require(g.total() == shape.total(), "fused collective: gather target size mismatch");
    mpi_count(plan_.C, "fused collective chunk");
    comm_ = comm.channel(channel);
    int64_t c = plan_.rounds ? plan_.C : 0;
    for (int s = 0; s < 2; ++s) slots_[s] = scratch_as<T>(comm, channel, s, c * R_);
    red_ = scratch_as<compute_t<T>>(comm, channel, 2, c);
    post_more();
  }

  FusedRsComputeAg(const FusedRsComputeAg&) = delete;
  FusedRsComputeAg& operator=(const FusedRsComputeAg&) = delete;

  // Makes progress without blocking; true once everything is done.
  bool test() { return advance(false); }

  // Runs to completion.
  void wait() { advance(true); }

 private:
  static constexpr int kTagReduce = 11, kTagGather = 12;

  // Keeps rounds done_ and done_+1 posted.
  void post_more() {
    while (posted_ < std::min(done_ + 2, plan_.rounds)) post_reduce(posted_++);
  }

  // Posts round k's reduce messages: receive peers' contributions to my piece, send mine to
  // every owner.
  void post_reduce(int64_t k) {
    int slot = static_cast<int>(k % 2);
    Range mine = plan_.range(k, me_);
    for (int p = 0; p < R_; ++p) {
      if (p == me_ || mine.empty()) continue;
      reqs_[slot].emplace_back();
      COCONET_MPI(MPI_Irecv(slots_[slot] + p * plan_.C, static_cast<int>(mine.size()),
                            mpi_type<T>(), p, kTagReduce, comm_, &reqs_[slot].back()));
    }
    for (int p = 0; p < R_; ++p) {
      if (p == me_) continue;
      Range theirs = plan_.range(k, p);
      isend_range(raw_in_, theirs.begin, theirs.end, p, kTagReduce, comm_, reqs_[slot]);
    }
  }

  // Combines round k's contributions (rank order) into red_.
  void reduce_round(int64_t k) {
    Range mine = plan_.range(k, me_);
    const T* slot = slots_[k % 2];
    for (int r = 0; r < R_; ++r) {
      if (r != me_) {
        accumulate(op_, r == 0, red_, slot + r * plan_.C, mine.size());
        continue;
      }
      in_.for_each(mine.begin, mine.end, [&](const T* p, int64_t at, int64_t len) {
        accumulate(op_, r == 0, red_ + at, p, len);
      });
    }
    finish_chunk<T>(op_, red_, mine.size(), R_);
  }

  // Posts round k's gathers: my piece of every target to every peer, theirs into place.
  void post_gather(int64_t k) {
    Range mine = plan_.range(k, me_);
    for (const GatherTarget& g : gathers_) {
      for (int p = 0; p < R_; ++p) {
        if (p == me_) continue;
        Range theirs = plan_.range(k, p);
        irecv_range(g, theirs.begin, theirs.end, p, kTagGather, comm_, gather_reqs_);
        isend_range(g, mine.begin, mine.end, p, kTagGather, comm_, gather_reqs_);
      }
    }
  }

  // Drives MPI: the next round's reduce and the outstanding gathers.
  void progress() {
    test_all(reqs_[(done_ + 1) % 2]);
    test_all(gather_reqs_);
  }

  // Reduces, computes and gathers round done_.
  void run_round() {
    int64_t k = done_;
    reduce_round(k);
    Range mine = plan_.range(k, me_);
    compute_in_pieces(mine.begin, mine.end, red_, piece_, compute_, [&] { progress(); });
    post_gather(k);
    ++done_;
    post_more();
  }

  // Runs every round whose messages have arrived (all of them when block); true when done.
  bool advance(bool block) {
    while (done_ < plan_.rounds) {
      auto& reqs = reqs_[done_ % 2];
      if (block) {
        wait_all(reqs);
      } else if (!test_all(reqs)) {
        test_all(gather_reqs_);
        return false;
      }
      run_round();
    }
    if (block) wait_all(gather_reqs_);
    return test_all(gather_reqs_);
  }

  Op op_;
  Segments<const T> in_;
  RawSegments raw_in_;
  RoundPlan plan_;
  int R_, me_;
  Compute compute_;
  std::vector<GatherTarget> gathers_;
  int64_t piece_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  T* slots_[2] = {nullptr, nullptr};  // per round parity: R chunks, one per peer (scratch)
  std::vector<MPI_Request> reqs_[2];
  std::vector<MPI_Request> gather_reqs_;
  compute_t<T>* red_ = nullptr;  // the reduced chunk (scratch)
  int64_t posted_ = 0, done_ = 0;
};

// Blocking fused reduce-scatter + compute + all-gather over a [outer, n, inner] tensor given as
// segments (a contiguous tensor is Segments<const T>::one(ptr, total)).
// compute(global_begin, global_end, const compute_t<T>* reduced) is called on this rank's
// slice, chunk by chunk, with global flat indices into [outer, n, inner].
template <class T, class Compute>
void fused_rs_compute_ag(Op op, const Segments<const T>& in, Shape3 shape, Comm& comm,
                         int64_t chunk_elems, Compute compute, std::vector<GatherTarget> gathers,
                         int64_t progress_elems = kProgressElems) {
  if (use_shm(comm)) {  // every rank of the group on this node: through the shared window
    fused_rs_compute_ag_shm(op, in, shape, comm, chunk_elems, compute, gathers, progress_elems);
    return;
  }
  if (use_hier(comm, shape)) {  // the group over several nodes of L ranks: hierarchically
    fused_rs_compute_ag_hier(op, in, shape, comm, chunk_elems, compute, gathers, progress_elems);
    return;
  }
  FusedRsComputeAg<T, Compute> f(op, in, shape, comm, 0, chunk_elems, std::move(compute),
                                 std::move(gathers), progress_elems);
  f.wait();
}

// Blocking fused collective over a contiguous 1-D tensor of n elements.
template <class T, class Compute>
void fused_rs_compute_ag(Op op, const T* in, int64_t n, Comm& comm, int64_t chunk_elems,
                         Compute compute, std::vector<GatherTarget> gathers) {
  fused_rs_compute_ag<T>(op, Segments<const T>::one(in, n), Shape3{1, n, 1}, comm, chunk_elems,
                         std::move(compute), std::move(gathers));
}

// ---- compute + all-gather (phase B of a fused collective with reductions) ---------------------

// compute(global_begin, global_end) on this rank's slice of a [outer, n, inner] tensor, chunk
// by chunk (the reduce-scatter's RoundPlan), writing this rank's part of every GatherTarget;
// on one node through the group's window (compute_ag_shm, fused_shm.h), over several nodes
// hierarchically (compute_ag_hier), else each chunk is sent to every other rank as soon as it is
// computed, and theirs received into place (point to point), so the all-gather overlaps the
// computation.  Every rank takes part
// (empty slices compute nothing).
template <class T, class Compute>
void compute_ag(Shape3 shape, Comm& comm, int64_t chunk_elems, Compute compute,
                const std::vector<GatherTarget>& gathers) {
  if (use_shm(comm)) {  // every rank of the group on this node: through the shared window
    compute_ag_shm(shape, comm, chunk_elems, compute, gathers);
    return;
  }
  if (use_hier(comm, shape)) {  // the group over several nodes of L ranks: hierarchically
    compute_ag_hier(shape, comm, chunk_elems, compute, gathers);
    return;
  }
  constexpr int kTagPhaseB = 13;
  const int R = comm.size, me = comm.rank;
  RoundPlan plan(shape, R, chunk_elems);
  mpi_count(plan.C, "fused collective chunk");
  MPI_Comm c = comm.channel(0);
  std::vector<MPI_Request> reqs;
  for (int64_t k = 0; k < plan.rounds; ++k) {
    Range mine = plan.range(k, me);
    if (!mine.empty())
      abort_on_exception("fused collective compute", [&] {
        trace::Span span("fused collective: compute a chunk");
        compute(mine.begin, mine.end);
      });
    for (const GatherTarget& g : gathers)
      for (int p = 0; p < R; ++p) {
        if (p == me) continue;
        Range theirs = plan.range(k, p);
        irecv_range(g, theirs.begin, theirs.end, p, kTagPhaseB, c, reqs);
        isend_range(g, mine.begin, mine.end, p, kTagPhaseB, c, reqs);
      }
    test_all(reqs);
  }
  wait_all(reqs);
}

// ---- allreduce + compute -----------------------------------------------------------------------

template <class T, class Compute>
class FusedAllreduceCompute {
 public:
  // Starts the operation (posts the first two chunks' MPI_Iallreduce on the channel).
  FusedAllreduceCompute(Op op, Segments<const T> in, Comm& comm, int channel, int64_t chunk_elems,
                        Compute compute, int64_t progress_elems = kProgressElems)
      : op_(op), in_(std::move(in)), R_(comm.size), C_(std::max<int64_t>(chunk_elems, 1)),
        compute_(std::move(compute)), piece_(std::max<int64_t>(progress_elems, 1)) {
    mpi_count(C_, "fused allreduce chunk");
    comm_ = comm.channel(channel);
    C_ = std::min(C_, std::max<int64_t>(in_.total(), 1));
    rounds_ = (in_.total() + C_ - 1) / C_;
    int64_t c = rounds_ ? C_ : 0;
    for (int s = 0; s < 2; ++s) {
      sbuf_[s] = scratch_as<T>(comm, channel, s, c);
      rbuf_[s] = scratch_as<T>(comm, channel, 2 + s, c);
    }
    red_ = scratch_as<compute_t<T>>(comm, channel, 4, c);
    post_more();
  }

  FusedAllreduceCompute(const FusedAllreduceCompute&) = delete;
  FusedAllreduceCompute& operator=(const FusedAllreduceCompute&) = delete;

  // Makes progress without blocking; true once everything is done.
  bool test() { return advance(false); }

  // Runs to completion.
  void wait() { advance(true); }

 private:
  Range chunk(int64_t k) const { return Range{k * C_, std::min((k + 1) * C_, in_.total())}; }

  // Keeps chunks done_ and done_+1 posted.
  void post_more() {
    while (posted_ < std::min(done_ + 2, rounds_)) post(posted_++);
  }

  // Posts chunk k's MPI_Iallreduce (a chunk inside one segment is sent from where it lies).
  void post(int64_t k) {
    int s = static_cast<int>(k % 2);
    Range c = chunk(k);
    const T* src = nullptr;
    in_.for_each(c.begin, c.end, [&](const T* p, int64_t, int64_t len) {
      src = len == c.size() ? p : nullptr;
    });
    if (!src) {
      copy_out(in_, c.begin, c.end, sbuf_[s]);
      src = sbuf_[s];
    }
    COCONET_MPI(MPI_Iallreduce(src, rbuf_[s], static_cast<int>(c.size()), mpi_type<T>(),
                               mpi_op<T>(op_), comm_, &req_[s]));
  }

  // Converts chunk done_ to the compute type and computes on it.
  void run_round() {
    Range c = chunk(done_);
    const T* r = rbuf_[done_ % 2];
    for (int64_t i = 0; i < c.size(); ++i) red_[i] = to_compute(r[i]);
    finish_chunk<T>(op_, red_, c.size(), R_);
    MPI_Request& next = req_[(done_ + 1) % 2];
    compute_in_pieces(c.begin, c.end, red_, piece_, compute_, [&] {
      int flag;
      COCONET_MPI(MPI_Test(&next, &flag, MPI_STATUS_IGNORE));
    });
    ++done_;
    post_more();
  }

  // Computes every chunk whose allreduce has finished (all of them when block).
  bool advance(bool block) {
    while (done_ < rounds_) {
      MPI_Request& req = req_[done_ % 2];
      int flag = 1;
      if (block) {
        trace::Span span("wait");
        COCONET_MPI(MPI_Wait(&req, MPI_STATUS_IGNORE));
      } else {
        COCONET_MPI(MPI_Test(&req, &flag, MPI_STATUS_IGNORE));
      }
      if (!flag) return false;
      run_round();
    }
    return true;
  }

  Op op_;
  Segments<const T> in_;
  int R_;
  int64_t C_;
  Compute compute_;
  int64_t piece_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int64_t rounds_ = 0, posted_ = 0, done_ = 0;
  T* sbuf_[2] = {nullptr, nullptr};  // packed input of a chunk crossing segments (scratch)
  T* rbuf_[2] = {nullptr, nullptr};  // reduced chunks (scratch)
  MPI_Request req_[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  compute_t<T>* red_ = nullptr;  // the reduced chunk in the compute type (scratch)
};

// Blocking fused allreduce + compute over a logical 1-D tensor given as segments.
// compute(global_begin, global_end, const compute_t<T>* reduced) covers [0, total) on every
// rank, chunk by chunk.
template <class T, class Compute>
void fused_allreduce_compute(Op op, const Segments<const T>& in, Comm& comm, int64_t chunk_elems,
                             Compute compute, int64_t progress_elems = kProgressElems) {
  if (use_hier(comm, Shape3{1, in.total(), 1})) {  // the group over several nodes
    fused_allreduce_compute_hier(op, in, comm, chunk_elems, compute, progress_elems);
    return;
  }
  FusedAllreduceCompute<T, Compute> f(op, in, comm, 0, chunk_elems, std::move(compute),
                                      progress_elems);
  f.wait();
}

// Blocking fused allreduce + compute over a contiguous tensor of n elements.
template <class T, class Compute>
void fused_allreduce_compute(Op op, const T* in, int64_t n, Comm& comm, int64_t chunk_elems,
                             Compute compute) {
  fused_allreduce_compute<T>(op, Segments<const T>::one(in, n), comm, chunk_elems,
                             std::move(compute));
}

}  // namespace coconet
