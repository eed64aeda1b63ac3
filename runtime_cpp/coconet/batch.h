// coconet runtime (CPU backend): calls of one module function run as one step whose reductions
// span them.
//
// A torch optimizer clips by the norm of every parameter group's gradient together
// (clip_grad_norm_(model.parameters())); a coconet program computes norm(g1) over the one group
// it is called with.  run_batch() runs the calls for several groups so that every reduction of
// the program (sum, norm, max, min: what reduce_partials()/reduce_extremes() receive) is taken
// over all of them.  The turn-taking is both backends' (turns.h); here, the CPU's part: each call
// runs in a worker thread of its own (its scratch memory is its own, thread-local), and at a
// reduction the last call adds the host values every call left (and sums them across ranks once,
// over MPI, if the reduction is over slices).  Only one call runs at a time, so MPI sees one
// thread at a time (MPI_THREAD_SERIALIZED is enough).  The CUDA counterpart: cuda/batch.cuh.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "collectives.h"
#include "comm.h"
#include "errors.h"
#include "kernels.h"
#include "turns.h"

namespace coconet {

// v[0..k) combined across the group's ranks, in place: summed, or (extreme) their max, NaN
// propagating.
inline void across_ranks(double* v, int64_t k, bool extreme, Comm& comm) {
  if (extreme) {
    allreduce_max(v, k, comm);
  } else {
    allreduce_sum(v, k, comm);
  }
}

// Call `slot` of batch b at a reduction: its partial results v[0, k) (host memory) replaced by
// the sum (extreme: the max, NaN propagating) over every call of the batch, and over the group's
// ranks when cross_rank.
inline void combine(Batch& b, int slot, double* v, int64_t k, bool cross_rank, Comm& comm, bool extreme) {
  const std::vector<uint64_t>* user = comm.shm.user;  // the call's own, restored below
  const int algo = comm.shm.algo;
  b.combine(slot, v, k, [&](const std::vector<double*>& parts, int64_t n) {
    std::vector<double> total(static_cast<size_t>(n), extreme ? -HUGE_VAL : 0.0);
    for (const double* p : parts)
      for (size_t i = 0; i < total.size(); ++i)
        total[i] = extreme ? extreme_step<true>(total[i], p[i]) : total[i] + p[i];
    if (cross_rank) across_ranks(total.data(), n, extreme, comm);  // only this thread runs now
    for (double* p : parts) std::copy(total.begin(), total.end(), p);
  });
  comm.shm.user = user;
  comm.shm.algo = algo;
}

// The generated code's cross-rank (and, in a batch, cross-call) step of a reduction: v[0..k)
// are this call's partial results (sums of values, or of squares for a norm; extreme: maxima,
// a min as the max of its negation); cross_rank: the reduction is over slices.
inline void reduce_across(double* v, int64_t k, bool cross_rank, Comm& comm, bool extreme) {
  if (Batch* b = current_batch()) {
    combine(*b, batch_slot(), v, k, cross_rank, comm, extreme);
  } else if (cross_rank) {
    across_ranks(v, k, extreme, comm);
  }
}
inline void reduce_partials(double* v, int64_t k, bool cross_rank, Comm& comm) {
  reduce_across(v, k, cross_rank, comm, false);
}
inline double reduce_partial(double x, bool cross_rank, Comm& comm) {
  reduce_across(&x, 1, cross_rank, comm, false);
  return x;
}
inline void reduce_extremes(double* v, int64_t k, bool cross_rank, Comm& comm) {
  reduce_across(v, k, cross_rank, comm, true);
}
inline double reduce_extreme(double x, bool cross_rank, Comm& comm) {
  reduce_across(&x, 1, cross_rank, comm, true);
  return x;
}

// Runs f on each call's arguments as one batch (see the top of this file). Needs an MPI
// initialized with at least MPI_THREAD_SERIALIZED (mpi4py's default is MULTIPLE).
template <class Args>
void run_batch(void (*f)(const Args&), const std::vector<Args>& calls) {
  const int n = static_cast<int>(calls.size());
  if (n == 0) return;
  int level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&level);
  require(level >= MPI_THREAD_SERIALIZED,
          "a batch of calls (DistributedOptimizer(across_groups=True)) runs them in worker threads "
          "one at a time: MPI must be initialized with MPI_THREAD_SERIALIZED or more (mpi4py's "
          "default, mpi4py.rc.thread_level = 'multiple', gives it)");
  abort_on_exception("coconet batch", [&] { run_together(f, calls); });
}

}  // namespace coconet
