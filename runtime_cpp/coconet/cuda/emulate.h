// coconet host emulation of the CUDA runtime, NCCL and cuBLAS subset that runtime.cuh and the
// generated CUDA code use, so the same module.cu compiles with g++ (-DCOCONET_EMULATE) and runs
// on the CPU (coconetc run --backend cuda --emulate):
//   - device memory is host memory (cudaMalloc: malloc);
//   - each stream is a worker thread running its queue in order; an event records a stream's
//     position, cudaStreamWaitEvent makes the waiting stream block until that position is done;
//   - a kernel launch runs every block of the grid in turn on the stream's thread, the block's
//     threads as fibers (ucontext) so __syncthreads is a real barrier (a block whose thread 0
//     meets no barrier runs its other threads as plain calls);
//   - NCCL calls are MPI calls (MPI_THREAD_MULTIPLE) on a communicator of their own, run on the
//     stream's thread; the calls of one communicator run in the order they were issued;
//   - cuBLAS GEMMs are the CPU backend's GEMM (../gemm.h);
//   - race detection: every operation queued on a stream declares the byte ranges it reads and
//     writes (copies, memsets, NCCL and cuBLAS calls from their arguments, kernels from a
//     COCONET_ACCESS annotation the renderer emits). Vector clocks per stream (advanced by
//     enqueues, merged by cudaStreamWaitEvent and host synchronization) give the happens-before
//     relation of the queued work, independent of timing; a read or write that conflicts with an
//     unordered access of another stream raises at once, naming the buffer and both streams.
//
// One header a job, included in order: emulate_types.h (types and constants), emulate_memory.h
// (byte ranges and happens-before: the race detection), emulate_kernels.h (blocks and fibers),
// emulate_mpi.h (streams, events and communicators over MPI), emulate_cuda_api.h, emulate_nccl.h,
// emulate_blas.h; then here what runtime.cuh and the generated code use (launch and access macros)
// and the NCCL device API subset (emulate_nccl_device.h).
#pragma once

#include "emulate_blas.h"

// ---- what runtime.cuh and the generated code use -------------------------------------------------

#define COCONET_LAUNCH(kernel, grid, block, smem, stream, ...) \
  ::coconet::cuda::emu::launch(dim3(grid), dim3(block), (stream), [=]() { kernel(__VA_ARGS__); })
#define COCONET_ACCESS(...) ::coconet::cuda::emu::declare({__VA_ARGS__})
#define COCONET_R(p, lo, hi) ::coconet::cuda::emu::R((p), (lo), (hi))
#define COCONET_W(p, lo, hi) ::coconet::cuda::emu::W((p), (lo), (hi))
#define COCONET_RA(p) ::coconet::cuda::emu::RA(p)
#define COCONET_BUFFER(p, nbytes, name) ::coconet::cuda::emu::name_buffer((p), (nbytes), (name))
#define COCONET_STREAM_NAME(stream, name) ::coconet::cuda::emu::name_stream((stream), (name))
#define COCONET_PARAM(p, nbytes, name, stream) ::coconet::cuda::emu::caller_buffer((p), (nbytes), (name), (stream))

// ---- pointwise kernels (runtime.cuh: launch_threads, load, store) -------------------------------
// One emulated multiprocessor (so grids stay small and threads take several vectors), or with
// COCONET_EMULATE_SMS=a,b,c... (MPI_COMM_WORLD rank r: the (r mod count)-th): that many, which may
// differ between ranks (the symmetric kernel's grid must still be the same on every rank); each
// holds 2048 threads (COCONET_EMULATE_SM_THREADS=k: k, so that a grid of small blocks stays small),
// and a kernel's resident blocks per multiprocessor
// (cudaOccupancyMaxActiveBlocksPerMultiprocessor) are as many blocks as fit those threads. A
// vector access must be aligned as on a GPU, where a misaligned one faults; the kernels launched
// on the vector path and the vector accesses made are counted (the module's emulation_counts()).
enum cudaDeviceAttr { cudaDevAttrMaxThreadsPerMultiProcessor = 39, cudaDevAttrMultiProcessorCount = 16 };
namespace coconet {
namespace cuda {
namespace emu {
inline int threads_per_sm() {
  const char* e = std::getenv("COCONET_EMULATE_SM_THREADS");
  return e && *e ? std::max(1, std::atoi(e)) : 2048;
}
inline int sm_count() {
  const char* e = std::getenv("COCONET_EMULATE_SMS");
  if (!e || !*e) return 1;
  std::vector<int> counts;
  for (const char* q = e; *q;) {
    counts.push_back(std::max(1, std::atoi(q)));
    while (*q && *q != ',') ++q;
    if (*q == ',') ++q;
  }
  int me = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  return counts[size_t(me) % counts.size()];
}
}  // namespace emu
}  // namespace cuda
}  // namespace coconet
inline cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr a, int) {
  *v = a == cudaDevAttrMaxThreadsPerMultiProcessor ? coconet::cuda::emu::threads_per_sm() : coconet::cuda::emu::sm_count();
  return cudaSuccess;
}
template <class K>
inline cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, K, int block_size, size_t) {
  *blocks = block_size > 0 ? std::max(1, coconet::cuda::emu::threads_per_sm() / block_size) : 0;
  return cudaSuccess;
}
namespace coconet {
namespace cuda {
namespace emu {
struct Counts {
  std::atomic<int64_t> vector_kernels{0}, scalar_kernels{0}, vector_accesses{0};
  std::atomic<int64_t> index32_kernels{0}, index64_kernels{0};  // kernels launched with 32- or 64-bit indices
};
inline Counts& counts() {
  static Counts c;
  return c;
}
inline void vector_access(const void* p, size_t bytes) {
  if (reinterpret_cast<uintptr_t>(p) % bytes != 0)
    throw std::runtime_error("coconet emulate: a " + std::to_string(bytes) +
                             "-byte vector access at a misaligned address (a fault on a GPU)");
  counts().vector_accesses.fetch_add(1, std::memory_order_relaxed);
}
}  // namespace emu
}  // namespace cuda
}  // namespace coconet
#define COCONET_UNROLL
#define COCONET_VECTOR_ACCESS(p, bytes) ::coconet::cuda::emu::vector_access((p), (bytes))
#define COCONET_COUNT_KERNEL(vector) \
  ((vector) ? ::coconet::cuda::emu::counts().vector_kernels : ::coconet::cuda::emu::counts().scalar_kernels) += 1
#define COCONET_COUNT_INDEX(bits) \
  ((bits) == 32 ? ::coconet::cuda::emu::counts().index32_kernels : ::coconet::cuda::emu::counts().index64_kernels) += 1
// The largest index a kernel with 32-bit indices may form: INT32_MAX, or with
// COCONET_EMULATE_INDEX32_LIMIT=k, k (so that a test takes the 64-bit path at a size it can allocate).
namespace coconet {
namespace cuda {
namespace emu {
inline int64_t index32_limit() {
  static const int64_t limit = [] {
    const char* e = std::getenv("COCONET_EMULATE_INDEX32_LIMIT");
    return e && *e ? int64_t(std::atoll(e)) : int64_t(INT32_MAX);
  }();
  return limit;
}
}  // namespace emu
}  // namespace cuda
}  // namespace coconet
#define COCONET_INDEX32_LIMIT() ::coconet::cuda::emu::index32_limit()
// The NCCL device API subset symmetric.cuh uses (symmetric memory, LSA pointers and barriers).
#include "emulate_nccl_device.h"
