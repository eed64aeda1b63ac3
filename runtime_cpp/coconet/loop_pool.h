// coconet runtime: the threads a generated loop runs on when cores are left over after the
// ranks (COCONET_THREADS, or the cores divided among the ranks of a node, above 1).
//
// Not OpenMP's: libgomp's workers spin for a while after every parallel region (unless
// OMP_WAIT_POLICY=passive, read once when the process loads libgomp, which torch usually has
// done before coconet runs), and the BLAS library's own threads spin after every GEMM. On as
// many cores as threads the two took turns at the cores: a GPT block's forward and backward at
// one rank on 2 cores ran 2.5 to 3 times slower with 2 threads than with 1. These workers sleep
// on a condition variable between loops, so a GEMM right after a loop has the cores.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "state.h"

namespace coconet {

class LoopPool {
 public:
  // fn(b) for every b in [0, nb), on up to `threads` threads, the caller one of them (each b
  // once, in no particular order). One loop at a time in the process: a loop started while
  // another runs (a call in another thread) runs on the caller alone. An exception thrown by
  // fn is rethrown here once every thread has stopped.
  void run(int64_t nb, int threads, const std::function<void(int64_t)>& fn) {
    const int n = static_cast<int>(std::min<int64_t>(threads, nb));
    std::unique_lock<std::mutex> busy(run_mu_, std::try_to_lock);
    if (n <= 1 || !busy.owns_lock()) {
      for (int64_t b = 0; b < nb; ++b) fn(b);
      return;
    }
    {
      std::lock_guard<std::mutex> g(mu_);
      while (static_cast<int>(workers_.size()) < n - 1) {
        const int id = static_cast<int>(workers_.size());
        workers_.emplace_back([this, id] { serve(id); });
        workers_.back().detach();  // (the pool lives as long as the process)
      }
      fn_ = &fn;
      nb_ = nb;
      next_.store(0, std::memory_order_relaxed);
      wanted_ = n - 1;
      left_ = n - 1;
      error_ = nullptr;
      ++generation_;
    }
    start_.notify_all();
    work();
    std::unique_lock<std::mutex> g(mu_);
    done_.wait(g, [this] { return left_ == 0; });
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void work() {
    try {
      for (int64_t b; (b = next_.fetch_add(1, std::memory_order_relaxed)) < nb_;) (*fn_)(b);
    } catch (...) {
      next_.store(nb_, std::memory_order_relaxed);  // (the others stop at their next block)
      std::lock_guard<std::mutex> g(mu_);
      if (!error_) error_ = std::current_exception();
    }
  }

  void serve(int id) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> g(mu_);
    for (;;) {
      start_.wait(g, [&] { return generation_ != seen; });
      seen = generation_;
      if (id >= wanted_) continue;  // (this loop wants fewer threads)
      g.unlock();
      work();
      g.lock();
      if (--left_ == 0) done_.notify_one();
    }
  }

  std::mutex run_mu_;  // held by the loop running
  std::mutex mu_;
  std::condition_variable start_, done_;
  std::vector<std::thread> workers_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t nb_ = 0;
  std::atomic<int64_t> next_{0};
  int wanted_ = 0, left_ = 0;
  uint64_t generation_ = 0;
  std::exception_ptr error_;
};

// The process's pool (COCONET_STATE: one for every module and unit; never destroyed, so no
// worker outlives it).
COCONET_STATE LoopPool& loop_pool() COCONET_STATE_BODY({
  static LoopPool* pool = new LoopPool;
  return *pool;
})

}  // namespace coconet
