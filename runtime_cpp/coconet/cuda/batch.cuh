// coconet CUDA runtime: calls of one module function run as one step whose reductions span
// them (DistributedOptimizer(across_groups=True)), the CUDA counterpart of ../batch.h.
//
// The turn-taking is both backends' (../turns.h): each call runs in a worker thread of its own,
// one at a time in turn, and stops at each reduction after leaving its partial results.  Here
// they are device memory (k doubles, the call's own scratch: scratch() keys its buffers by the
// call's place in the batch, so what a paused call keeps there survives the other calls), written
// on the call's stream.  Every call of a batch runs on one stream (run_batch checks it), in turn,
// so stream order orders one call's kernels after the other's: the last call to arrive folds
// every call's partial results into a total on that stream (in the order of the calls, as the
// CPU adds them), all-reduces it across the group's ranks once when the reduction is over slices
// (NCCL), and copies it back into each call's buffer; every call goes on with the total.  A
// fused collective's comm stream needs nothing more: pipeline() makes it wait for the call's
// stream before its first chunk and the call's stream wait for it after its last, so its work
// lies between two points of the one stream.  Extremes are (max, NaN flag) pairs (runtime.cuh:
// reduce_extreme) and combine by max, NaN propagating as the CPU's.
//
// Included by runtime.cuh, after Ctx, scratch and launch, before the reductions that use it.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "../turns.h"
#include "trace.cuh"

namespace coconet {
namespace cuda {

constexpr int kBatchTotalSite = -1;  // the scratch() site of a batch's total (the last call's)

// total[0, k) folded with part[0, k) on the call's stream: added, or (extreme) their max.
COCONET_EMU void fold_into(double* total, const double* part, int64_t k, bool extreme, const Ctx& c) {
  COCONET_ACCESS(COCONET_R(part, 0, k), COCONET_W(total, 0, k));
  if (extreme) {
    launch(k, c.stream, [=] __device__(int64_t i) { total[i] = part[i] > total[i] ? part[i] : total[i]; });
  } else {
    launch(k, c.stream, [=] __device__(int64_t i) { total[i] += part[i]; });
  }
}

// Call `slot` of batch b at a reduction: its partial results acc[0, k) (device memory, on the
// call's stream) replaced by the sum (extreme: the max) over every call of the batch, and over
// the group's ranks when cross_rank.
COCONET_EMU void combine_calls(Batch& b, int slot, double* acc, int64_t k, bool cross_rank, bool extreme, const Ctx& c) {
  b.combine(slot, acc, k, [&](const std::vector<double*>& parts, int64_t n) {
    const size_t bytes = size_t(n) * sizeof(double);
    double* total = scratch<double>(kBatchTotalSite, n);
    COCONET_CUDA(cudaMemcpyAsync(total, parts[0], bytes, cudaMemcpyDeviceToDevice, c.stream));
    for (size_t s = 1; s < parts.size(); ++s) fold_into(total, parts[s], n, extreme, c);
    if (cross_rank) {
      const trace::Piece nccl("NCCL allreduce", -1, c.stream);
      COCONET_CUDA(ncclAllReduce(total, total, size_t(n), ncclFloat64, extreme ? ncclMax : ncclSum, c.comm, c.stream));
    }
    for (double* p : parts) COCONET_CUDA(cudaMemcpyAsync(p, total, bytes, cudaMemcpyDeviceToDevice, c.stream));
  });
}

// The cross-rank (and, in a batch, cross-call) step of a reduction: acc[0, k) are this call's
// partial results on its stream (sums, of squares for a norm; extreme: (max, NaN flag) pairs, a
// min as the max of its negation); cross_rank: the reduction is over slices.
COCONET_EMU void reduce_across(double* acc, int64_t k, bool cross_rank, bool extreme, const Ctx& c) {
  if (Batch* b = current_batch()) {
    combine_calls(*b, batch_slot(), acc, k, cross_rank, extreme, c);
  } else if (cross_rank) {
    const trace::Piece nccl("NCCL allreduce", -1, c.stream);
    COCONET_CUDA(ncclAllReduce(acc, acc, size_t(k), ncclFloat64, extreme ? ncclMax : ncclSum, c.comm, c.stream));
  }
}

// Runs f on each call's arguments as one batch (see the top of this file), each worker on the
// calling thread's device.
COCONET_EMU void run_batch(void (*f)(const CallArgs&), const std::vector<CallArgs>& calls) {
  for (const CallArgs& a : calls)
    require(a.stream == calls[0].stream,
            "a batch of calls (DistributedOptimizer(across_groups=True)) runs them on one stream, in turn: "
            "every call must be given the same stream");
  int dev = 0;
  COCONET_CUDA(cudaGetDevice(&dev));
  run_together(f, calls, [dev] { COCONET_CUDA(cudaSetDevice(dev)); });
}

}  // namespace cuda
}  // namespace coconet
