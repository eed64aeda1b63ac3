// coconet runtime, both backends: the calls of one batch taking turns (what batch.h and
// cuda/batch.cuh share).
//
// run_batch() runs the calls of one module function for several parameter groups so that every
// reduction of the program is taken over all of them: each call runs in a worker thread of its
// own, one at a time in turn, and stops at each reduction after leaving its partial result
// (Batch::combine); the last call to arrive combines every call's partial results (the backend
// says how: host values summed and MPI, or device buffers summed on the stream and NCCL) and
// every call goes on with the total, one at a time in turn again.  A call's reductions must be
// reached in the same order by every call of the batch: the same function, whose control flow
// does not depend on the values.  Nothing here communicates (nor needs MPI or CUDA): only one
// call runs at a time, so the calls communicate in the same order on every rank.  A call that
// fails stops the batch: the calls waiting for their turn raise too, and run_together() raises
// the first error in the calling thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "state.h"

namespace coconet {

class Batch {
 public:
  explicit Batch(int calls) : n_(calls), parts_(static_cast<size_t>(calls)) {}

  int calls() const { return n_; }

  // Call `slot` waits for its turn (before it starts).
  void enter(int slot) {
    std::unique_lock<std::mutex> lk(mu_);
    wait(lk, slot);
  }

  // Call `slot` is done: the next one runs.
  void leave(int slot) {
    std::lock_guard<std::mutex> lk(mu_);
    turn_ = slot + 1;
    cv_.notify_all();
  }

  // Call `slot` at a reduction, its partial results v[0, k) left where they are (host memory,
  // or device memory: whatever `total` reads): the next call runs; the last call runs
  // total(parts, k), parts[s] the v of call s, which must replace every parts[s][0, k) by the
  // combined value; then every call goes on, in turn from the first.  v must stay valid while
  // the call waits (a paused call's memory is its own).
  void combine(int slot, double* v, int64_t k,
               const std::function<void(const std::vector<double*>& parts, int64_t k)>& total) {
    std::unique_lock<std::mutex> lk(mu_);
    parts_[static_cast<size_t>(slot)] = v;
    if (slot == 0) {
      k_ = k;
    } else if (k != k_) {
      throw std::runtime_error("coconet batch: the calls reached a reduction of different sizes");
    }
    if (slot + 1 < n_) {
      turn_ = slot + 1;
    } else {  // the last call: every partial result is there, and only this thread runs
      total(parts_, k);
      turn_ = 0;
    }
    cv_.notify_all();
    wait(lk, slot);
  }

  // A call failed with `what`: every call waiting for its turn raises; the first error is kept.
  void fail(const std::string& what) {
    std::lock_guard<std::mutex> lk(mu_);
    if (!failed_) error_ = what;
    failed_ = true;
    cv_.notify_all();
  }
  bool failed(std::string* what) {
    std::lock_guard<std::mutex> lk(mu_);
    if (failed_) *what = error_;
    return failed_;
  }

 private:
  void wait(std::unique_lock<std::mutex>& lk, int slot) {
    cv_.wait(lk, [&] { return turn_ == slot || failed_; });
    if (failed_) throw std::runtime_error("another call of the batch failed");
  }

  std::mutex mu_;
  std::condition_variable cv_;
  int n_;
  int turn_ = 0;
  int64_t k_ = 0;
  std::vector<double*> parts_;
  bool failed_ = false;
  std::string error_;
};

// The batch the calling thread's call belongs to (nullptr outside run_batch), and its place
// (0 outside a batch).
COCONET_STATE Batch*& current_batch() COCONET_STATE_BODY({
  static thread_local Batch* b = nullptr;
  return b;
})
COCONET_STATE int& batch_slot() COCONET_STATE_BODY({
  static thread_local int s = 0;
  return s;
})

// Worker threads kept for the process, one per place in a batch, so that each keeps its
// thread-local state (the CPU's scratch memory, module.h) from one step to the next.
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

// Runs f on each call's arguments as one batch (see the top of this file); each worker runs
// setup() first (the backend's per-thread state: the CUDA device). Raises the first call's error.
template <class Args>
void run_together(void (*f)(const Args&), const std::vector<Args>& calls,
                  const std::function<void()>& setup = nullptr) {
  const int n = static_cast<int>(calls.size());
  if (n == 0) return;
  Batch batch(n);
  std::function<void(int)> job = [&](int k) {
    current_batch() = &batch;
    batch_slot() = k;
    try {
      batch.enter(k);
      if (setup) setup();
      f(calls[static_cast<size_t>(k)]);
    } catch (const std::exception& e) {
      batch.fail(e.what());
    } catch (...) {
      batch.fail("unknown exception");
    }
    current_batch() = nullptr;
    batch_slot() = 0;
    batch.leave(k);
  };
  Workers::get().run(n, job);
  std::string error;
  if (batch.failed(&error)) throw std::runtime_error("a call of the batch: " + error);
}

}  // namespace coconet
