// coconet runtime: calls of one module function run as one step whose reductions span them.
//
// A torch optimizer clips by the norm of every parameter group's gradient together
// (clip_grad_norm_(model.parameters())); a coconet program computes norm(g1) over the one group
// it is called with.  run_batch() runs the calls for several groups so that every reduction of
// the program (sum, norm, max, min: what reduce_partials()/reduce_extremes() receive) is taken
// over all of them:
// each call runs in a worker thread of its own (its scratch memory is its own, thread-local),
// one at a time in turn, and stops at each reduction after leaving its partial result; when the
// last call has left its own, the results are added (and summed across ranks once, if the
// reduction is over slices), and every call goes on with the total.  Only one call runs at a
// time, so MPI sees one thread at a time (MPI_THREAD_SERIALIZED is enough) and the calls
// communicate in the same order on every rank.  A call's reductions must be reached in the
// same order by every call of the batch: the same function, whose control flow does not depend
// on the values.
#pragma once

#include <mpi.h>

#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "collectives.h"
#include "comm.h"
#include "errors.h"
#include "kernels.h"

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

class Batch {
 public:
  explicit Batch(int calls) : n_(calls), parts_(static_cast<size_t>(calls)) {}

  // Call `slot` waits for its turn (before it starts).
  void enter(int slot) {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return turn_ == slot; });
  }

  // Call `slot` is done: the next one runs.
  void leave(int slot) {
    std::lock_guard<std::mutex> lk(mu_);
    turn_ = slot + 1;
    cv_.notify_all();
  }

  // Call `slot`'s partial results v[0..k) at a reduction: replaced by the sum (extreme: the
  // max, NaN propagating) over every call of the batch, and over the group's ranks when
  // cross_rank.
  void combine(int slot, double* v, int64_t k, bool cross_rank, Comm& comm, bool extreme = false) {
    const std::vector<uint64_t>* user = comm.shm.user;  // the call's own, restored below
    const int algo = comm.shm.algo;
    std::unique_lock<std::mutex> lk(mu_);
    parts_[static_cast<size_t>(slot)].assign(v, v + k);
    if (slot + 1 < n_) {
      turn_ = slot + 1;
    } else {  // the last call: every partial result is here
      total_.assign(static_cast<size_t>(k), extreme ? -HUGE_VAL : 0.0);
      for (const std::vector<double>& p : parts_) {
        if (static_cast<int64_t>(p.size()) != k)
          abort_all("coconet batch: the calls reached a reduction of different sizes");
        for (size_t i = 0; i < p.size(); ++i)
          total_[i] = extreme ? extreme_step<true>(total_[i], p[i]) : total_[i] + p[i];
      }
      if (cross_rank) across_ranks(total_.data(), k, extreme, comm);  // only this thread runs now
      turn_ = 0;
    }
    cv_.notify_all();
    cv_.wait(lk, [&] { return turn_ == slot; });
    std::copy(total_.begin(), total_.end(), v);
    comm.shm.user = user;
    comm.shm.algo = algo;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int n_;
  int turn_ = 0;
  std::vector<std::vector<double>> parts_;
  std::vector<double> total_;
};

// The batch the calling thread's call belongs to (nullptr outside run_batch), and its place.
inline Batch*& current_batch() {
  static thread_local Batch* b = nullptr;
  return b;
}
inline int& batch_slot() {
  static thread_local int s = 0;
  return s;
}

// The generated code's cross-rank (and, in a batch, cross-call) step of a reduction: v[0..k)
// are this call's partial results (sums of values, or of squares for a norm; extreme: maxima,
// a min as the max of its negation); cross_rank: the reduction is over slices.
inline void reduce_across(double* v, int64_t k, bool cross_rank, Comm& comm, bool extreme) {
  if (Batch* b = current_batch()) {
    b->combine(batch_slot(), v, k, cross_rank, comm, extreme);
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

// Worker threads kept for the process, one per place in a batch, so that each keeps its
// thread-local scratch memory (module.h: scratch) from one step to the next.
class Workers {
 public:
  static Workers& get() {
    static Workers* w = new Workers();  // never destroyed: its threads outlive static teardown
    return *w;
  }

  // Runs job(k) for k in [0, n) on workers 0..n-1 and waits for all of them.
  void run(int n, const std::function<void(int)>& job) {
    std::unique_lock<std::mutex> lk(mu_);
    while (static_cast<int>(threads_.size()) < n) {
      const int k = static_cast<int>(threads_.size());
      std::thread([this, k] { loop(k); }).detach();
      threads_.push_back(k);
    }
    job_ = &job;
    width_ = todo_ = n;
    ++round_;
    cv_.notify_all();
    done_.wait(lk, [&] { return todo_ == 0; });
    job_ = nullptr;
  }

 private:
  void loop(int k) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* job = nullptr;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return round_ != seen && k < width_; });
        seen = round_;
        job = job_;
      }
      (*job)(k);
      std::lock_guard<std::mutex> lk(mu_);
      if (--todo_ == 0) done_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_, done_;
  std::vector<int> threads_;
  const std::function<void(int)>* job_ = nullptr;
  int todo_ = 0, width_ = 0;
  uint64_t round_ = 0;
};

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
  Batch batch(n);
  std::function<void(int)> job = [&](int k) {
    current_batch() = &batch;
    batch_slot() = k;
    batch.enter(k);
    abort_on_exception("a call of the batch", [&] { f(calls[static_cast<size_t>(k)]); });
    current_batch() = nullptr;
    batch.leave(k);
  };
  Workers::get().run(n, job);
}

}  // namespace coconet
