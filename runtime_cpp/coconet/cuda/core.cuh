// coconet CUDA runtime, its core (runtime.cuh includes every part): the includes (or the host
// emulation), errors, the call's arguments and context, streams, scratch buffers and kernel launch.
//
// What the generated CUDA code (coconetc/codegen/cuda) calls around its
// kernels. Collectives are stock NCCL on the call's stream, matmul is cuBLAS (cublasGemmEx),
// layernorm and conv2d are direct kernels, sum/norm are block reductions accumulated in double.
// Element math comes from ../pointwise.h, the same text the CPU loops use.
#pragma once

#ifndef COCONET_NO_MPI
#define COCONET_NO_MPI
#endif

#ifdef COCONET_EMULATE
// Host emulation (g++ -DCOCONET_EMULATE): the CUDA runtime, NCCL and cuBLAS on the CPU and MPI.
#include "emulate.h"
#else
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <nccl.h>
// What the emulation (emulate.h) defines, here for nvcc: a kernel launch, the byte ranges a
// kernel reads and writes (race detection under emulation) and a buffer's name.
#define COCONET_LAUNCH(kernel, grid, block, smem, stream, ...) kernel<<<(grid), (block), (smem), (stream)>>>(__VA_ARGS__)
#define COCONET_ACCESS(...)
#define COCONET_BUFFER(p, nbytes, name)
#define COCONET_PARAM(p, nbytes, name, stream)
#define COCONET_STREAM_NAME(stream, name)
#define COCONET_UNROLL _Pragma("unroll")
#define COCONET_VECTOR_ACCESS(p, bytes)
#define COCONET_COUNT_KERNEL(vector)
#define COCONET_COUNT_INDEX(bits)
// The largest index a kernel with 32-bit indices may form (pointwise.cuh: index32)
#define COCONET_INDEX32_LIMIT() int64_t(INT32_MAX)
// A host function of this runtime that the emulation compiles once into its library
// (emulate_types.h): for nvcc, an ordinary inline function.
#define COCONET_EMU inline
#endif

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../call_args.h"
#include "../dtypes.h"
#include "../pointwise.h"
#include "../slices.h"
#include "../turns.h"

namespace coconet {
namespace cuda {

COCONET_EMU void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("coconet (cuda): ") + what + ": " + cudaGetErrorString(e));
}
COCONET_EMU void check(ncclResult_t e, const char* what) {
  if (e != ncclSuccess) throw std::runtime_error(std::string("coconet (nccl): ") + what + ": " + ncclGetErrorString(e));
}
COCONET_EMU void check(cublasStatus_t e, const char* what) {
  if (e != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("coconet (cublas): ") + what + ": " + cublasGetStatusString(e));
}
#define COCONET_CUDA(x) ::coconet::cuda::check((x), #x)

COCONET_EMU void require(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument(msg);
}

// This call's group: trivially copyable, so kernels capture it (slice offsets in device code).
struct Group {
  int size = 1;
  int rank = 0;
};

// A scalar parameter: indexable like a 0-d tensor (v_x[0]) on the host and in kernels.
template <class T>
struct Scalar {
  T v;
  COCONET_HD const T& operator[](int64_t) const { return v; }
};

// ---- scattered tensors (`f32[N] ... scattered`): a list of 1-D device buffers (segments) taken as
// one logical 1-D tensor, never copied into one buffer. The host walks the pieces of a logical
// range (as the CPU runtime's segments.h) and issues one kernel, copy or NCCL call per piece.

// What Python passes (../call_args.h), with the stream, the NCCL communicator and the tensors
// every rank's call has in a window of comm. A scattered tensor is coconet::Segments (../pieces.h).
struct CallArgs : CallArgsBase {
  uintptr_t stream = 0;  // cudaStream_t (0: the legacy default stream)
  uintptr_t comm = 0;    // ncclComm_t of all ranks
  // the tensors that every rank's call has in a window of comm (window_index, symmetric.cuh;
  // agreed by the call's exchange): the symmetric kernel reads them in place on every rank, so
  // its own window needs no room to stage them
  std::vector<uintptr_t> in_place;
};

// The call's context: the group's communicator (split from the world one when groups > 1),
// the world communicator (send between groups), the compute stream and a comm stream.
struct Ctx {
  ncclComm_t world = nullptr;
  ncclComm_t comm = nullptr;
  int wsize = 1, wrank = 0, groups = 1;
  Group group;
  cudaStream_t stream = nullptr;
  cudaStream_t comm_stream = nullptr;
  std::vector<uintptr_t> in_place;  // CallArgs::in_place
};

// The current device's value in `values`, made by make(device) on first use; the caller holds
// the lock that guards `values`.
template <class T, class Make>
T per_device(std::map<int, T>& values, Make make) {
  int dev = 0;
  COCONET_CUDA(cudaGetDevice(&dev));
  auto it = values.find(dev);
  if (it == values.end()) it = values.emplace(dev, make(dev)).first;
  return it->second;
}

// This device's stream in `streams` (non-blocking, made on first use); the caller holds the lock.
COCONET_EMU cudaStream_t device_stream(std::map<int, cudaStream_t>& streams, const char* name) {
  return per_device(streams, [name](int) {
    cudaStream_t cs;
    COCONET_CUDA(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
    COCONET_STREAM_NAME(cs, name);
    return cs;
  });
}

COCONET_EMU Ctx context(const CallArgs& a) {
  static std::mutex mu;
  static std::map<std::pair<uintptr_t, int>, ncclComm_t> splits;
  static std::map<int, cudaStream_t> comm_streams;
  Ctx c;
  c.world = reinterpret_cast<ncclComm_t>(a.comm);
  c.stream = reinterpret_cast<cudaStream_t>(a.stream);
  c.groups = a.groups;
  c.in_place = a.in_place;
  COCONET_CUDA(ncclCommCount(c.world, &c.wsize));
  COCONET_CUDA(ncclCommUserRank(c.world, &c.wrank));
  require(a.groups >= 1 && c.wsize % a.groups == 0,
          "groups=" + std::to_string(a.groups) + " does not divide " + std::to_string(c.wsize) + " ranks");
  std::lock_guard<std::mutex> lock(mu);
  if (a.groups == 1) {
    c.comm = c.world;
  } else {
    auto key = std::make_pair(a.comm, a.groups);
    auto it = splits.find(key);
    if (it == splits.end()) {
      ncclComm_t sub;
      int gs = c.wsize / a.groups;
      COCONET_CUDA(ncclCommSplit(c.world, c.wrank / gs, c.wrank % gs, &sub, nullptr));
      it = splits.emplace(key, sub).first;
    }
    c.comm = it->second;
  }
  c.comm_stream = device_stream(comm_streams, "the comm stream");
  COCONET_CUDA(ncclCommCount(c.comm, &c.group.size));
  COCONET_CUDA(ncclCommUserRank(c.comm, &c.group.rank));
  return c;
}

// Device buffers of the function's own, kept across calls (one per site; grown when needed).
// Each call of a batch (batch.cuh) has its own, by its place in the batch (0 outside one): a
// call paused at a reduction keeps its values there while the others run.
COCONET_EMU void* scratch_bytes(int site, size_t bytes) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, std::pair<void*, size_t>> bufs;
  const int slot = batch_slot();
  std::lock_guard<std::mutex> lock(mu);
  auto& b = bufs[{slot, site}];
  if (b.second < bytes) {
    if (b.first) COCONET_CUDA(cudaFree(b.first));
    b.first = nullptr;
    COCONET_CUDA(cudaMalloc(&b.first, bytes > 0 ? bytes : 1));
    b.second = bytes;
    COCONET_BUFFER(b.first, bytes > 0 ? bytes : 1,
                   "scratch #" + std::to_string(site) + (slot ? " of batch call " + std::to_string(slot) : ""));
  }
  return b.first;
}
template <class T> T* scratch(int site, int64_t n) {
  return static_cast<T*>(scratch_bytes(site, static_cast<size_t>(n > 0 ? n : 1) * sizeof(T)));
}

// An event per site, made once.
COCONET_EMU cudaEvent_t event(int site) {
  static std::mutex mu;
  static std::map<int, cudaEvent_t> evs;
  std::lock_guard<std::mutex> lock(mu);
  auto it = evs.find(site);
  if (it == evs.end()) {
    cudaEvent_t e;
    COCONET_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    it = evs.emplace(site, e).first;
  }
  return it->second;
}
// `waiter` waits for what has been queued on `s` so far.
COCONET_EMU void join(cudaStream_t s, cudaStream_t waiter, int site) {
  cudaEvent_t e = event(site);
  COCONET_CUDA(cudaEventRecord(e, s));
  COCONET_CUDA(cudaStreamWaitEvent(waiter, e, 0));
}

// mark() records what has been queued on `s` so far at `site`; wait_mark() makes `waiter` wait for
// the last such record (a join split in two: the waiter's wait is queued later, after other work
// of its own, and waits only for what `s` had queued at the mark).
COCONET_EMU void mark(cudaStream_t s, int site) { COCONET_CUDA(cudaEventRecord(event(site), s)); }
COCONET_EMU void wait_mark(int site, cudaStream_t waiter) { COCONET_CUDA(cudaStreamWaitEvent(waiter, event(site), 0)); }

// A second compute stream (per device, made once): an overlap's fused collective runs its kernels
// there while the call's stream computes the next block of the matmul.
COCONET_EMU cudaStream_t side_stream() {
  static std::mutex mu;
  static std::map<int, cudaStream_t> streams;
  std::lock_guard<std::mutex> lock(mu);
  return device_stream(streams, "the side stream");
}

// Elements per chunk of a fused collective: COCONET_CUDA_CHUNK, else `whole` when it is positive
// (one rank: nothing to overlap, so one chunk), else 2^22.
COCONET_EMU int64_t chunk_elems(int64_t whole = 0) {
  static int64_t n = [] {
    const char* s = std::getenv("COCONET_CUDA_CHUNK");
    int64_t v = s ? std::atoll(s) : 0;
    return v > 0 ? v : 0;
  }();
  return n > 0 ? n : whole > 0 ? whole : int64_t(1) << 22;
}

// ---- kernels -----------------------------------------------------------------------------------

template <class F>
__global__ void each_kernel(int64_t n, F f) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) f(i);
}

// f(i) for i in [0, n): a grid-stride loop (bounds-checked), on stream s.
template <class F>
void launch(int64_t n, cudaStream_t s, F f) {
  if (n <= 0) {
    COCONET_ACCESS();  // (emulation) no kernel: its declared ranges go with it
    return;
  }
  const int threads = 256;
  int64_t blocks = (n + threads - 1) / threads;
  if (blocks > 65536) blocks = 65536;
  COCONET_LAUNCH(each_kernel, static_cast<unsigned>(blocks), threads, 0, s, n, f);
  COCONET_CUDA(cudaGetLastError());
}

}  // namespace cuda
}  // namespace coconet
