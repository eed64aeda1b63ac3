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
#pragma once

#ifndef COCONET_EMULATE
#define COCONET_EMULATE 1
#endif

#include <mpi.h>
#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "../dtypes.h"
#include "../gemm.h"

#define __device__
#define __global__
#define __host__
#define __forceinline__ inline
#define __shared__ static thread_local

// ---- CUDA runtime types --------------------------------------------------------------------------

enum cudaError_t { cudaSuccess = 0, cudaErrorNotReady = 600, cudaErrorUnknown = 999 };
enum cudaMemcpyKind { cudaMemcpyHostToHost = 0, cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2,
                      cudaMemcpyDeviceToDevice = 3, cudaMemcpyDefault = 4 };
enum cudaDataType_t { CUDA_R_16F = 2, CUDA_R_32F = 0, CUDA_R_64F = 1, CUDA_R_16BF = 14 };
#define cudaStreamNonBlocking 0x01
#define cudaEventDisableTiming 0x02

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};

namespace coconet {
namespace cuda {
namespace emu {
struct Stream;
struct Event;
}  // namespace emu
}  // namespace cuda
}  // namespace coconet
typedef coconet::cuda::emu::Stream* cudaStream_t;
typedef coconet::cuda::emu::Event* cudaEvent_t;

inline thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

// ---- NCCL and cuBLAS types -------------------------------------------------------------------------

enum ncclResult_t { ncclSuccess = 0, ncclInternalError = 3, ncclInvalidArgument = 4, ncclRemoteError = 6 };
enum ncclRedOp_t { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4 };
enum ncclDataType_t { ncclInt8 = 0, ncclUint8 = 1, ncclInt32 = 2, ncclUint32 = 3, ncclInt64 = 4, ncclUint64 = 5,
                      ncclFloat16 = 6, ncclFloat32 = 7, ncclFloat64 = 8, ncclBfloat16 = 9 };
struct ncclUniqueId { char internal[128]; };
namespace coconet { namespace cuda { namespace emu { struct Comm; } } }
typedef coconet::cuda::emu::Comm* ncclComm_t;

enum cublasStatus_t { CUBLAS_STATUS_SUCCESS = 0, CUBLAS_STATUS_NOT_SUPPORTED = 15 };
enum cublasOperation_t { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 };
enum cublasComputeType_t { CUBLAS_COMPUTE_32F = 68, CUBLAS_COMPUTE_64F = 70 };
enum cublasGemmAlgo_t { CUBLAS_GEMM_DEFAULT = -1 };
namespace coconet { namespace cuda { namespace emu { struct Blas { cudaStream_t stream = nullptr; }; } } }
typedef coconet::cuda::emu::Blas* cublasHandle_t;

namespace coconet {
namespace cuda {
namespace emu {

// ---- byte ranges, buffers and the happens-before relation --------------------------------------

struct Span {
  uintptr_t lo = 0, hi = 0;
  bool write = false;
  bool whole = false;  // the whole buffer that contains lo
};
template <class T> Span R(const T* p, int64_t lo, int64_t hi) {
  return Span{uintptr_t(p + lo), uintptr_t(p + (hi > lo ? hi : lo)), false, false};
}
template <class T> Span W(const T* p, int64_t lo, int64_t hi) {
  return Span{uintptr_t(p + lo), uintptr_t(p + (hi > lo ? hi : lo)), true, false};
}
template <class T> Span RA(const T* p) { return Span{uintptr_t(p), uintptr_t(p) + 1, false, true}; }
inline Span bytes(const void* p, size_t n, bool write) {
  return Span{uintptr_t(p), uintptr_t(p) + n, write, false};
}
// rows x cols elements of `el` bytes, `ld` elements apart
inline void strided(std::vector<Span>& out, const void* p, int64_t rows, int64_t cols, int64_t ld, size_t el,
                    bool write) {
  if (rows <= 0 || cols <= 0) return;
  if (ld == cols || rows == 1) {
    out.push_back(bytes(p, size_t(rows * cols) * el, write));
    return;
  }
  for (int64_t r = 0; r < rows; ++r) out.push_back(bytes(static_cast<const char*>(p) + size_t(r * ld) * el, size_t(cols) * el, write));
}

using Clock = std::vector<uint64_t>;
inline uint64_t at(const Clock& c, int s) { return size_t(s) < c.size() ? c[size_t(s)] : 0; }
inline void merge(Clock& a, const Clock& b) {
  if (a.size() < b.size()) a.resize(b.size(), 0);
  for (size_t k = 0; k < b.size(); ++k) a[k] = std::max(a[k], b[k]);
}

struct Record {
  uintptr_t lo, hi;
  int stream;
  uint64_t seq;
  bool write;
  std::string what;
};
struct Region {
  uintptr_t end;
  std::string name;
  std::vector<Record> records;
};

class RaceError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Task {
  std::function<void()> fn;
};

struct Stream {
  int id = 0;
  std::string name;
  // execution
  std::deque<Task> queue;
  uint64_t enqueued = 0, completed = 0;
  std::thread worker;
  bool stop = false;
  std::string error;
  // detection
  Clock clock;
};

struct Event {
  Stream* stream = nullptr;
  uint64_t position = 0;  // done when stream->completed >= position
  Clock clock;
  bool recorded = false;
  std::atomic<double> at{0};  // when its stream reached it (seconds; cudaEventElapsedTime)
};

struct State {
  std::mutex mu;  // execution: queues and counters
  std::condition_variable cv;
  std::vector<Stream*> streams;
  std::recursive_mutex det;  // detection: clocks and buffers (host threads only)
  Clock host;
  std::map<uintptr_t, Region> regions;
  std::vector<Span> pending;  // COCONET_ACCESS before the next kernel launch
  bool pending_set = false;
  int allocs = 0;
};
inline State& state() {
  static State* s = new State();  // never destroyed: worker threads may outlive static teardown
  return *s;
}

inline void worker_loop(Stream* s) {
  State& st = state();
  for (;;) {
    Task t;
    {
      std::unique_lock<std::mutex> lock(st.mu);
      st.cv.wait(lock, [&] { return s->stop || !s->queue.empty(); });
      if (s->queue.empty()) return;
      t = std::move(s->queue.front());
      s->queue.pop_front();
    }
    try {
      t.fn();
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(st.mu);
      if (s->error.empty()) s->error = e.what();
    }
    {
      std::lock_guard<std::mutex> lock(st.mu);
      s->completed += 1;
    }
    st.cv.notify_all();
  }
}

inline Stream* make_stream(const std::string& name) {
  State& st = state();
  Stream* s = new Stream();
  {
    std::lock_guard<std::recursive_mutex> d(st.det);
    std::lock_guard<std::mutex> lock(st.mu);
    s->id = int(st.streams.size());
    s->name = name.empty() ? "stream #" + std::to_string(s->id) : name;
    st.streams.push_back(s);
    s->clock = st.host;
  }
  s->worker = std::thread(worker_loop, s);
  s->worker.detach();
  return s;
}
inline Stream* get(cudaStream_t s) {
  static Stream* legacy = make_stream("the call's stream (default stream)");
  return s ? s : legacy;
}

inline void name_stream(cudaStream_t s, const std::string& name) {
  State& st = state();
  Stream* x = get(s);
  std::lock_guard<std::mutex> lock(st.mu);
  x->name = name + " (stream #" + std::to_string(x->id) + ")";
}

inline std::string describe_stream(int id) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  return size_t(id) < st.streams.size() ? st.streams[size_t(id)]->name : "stream #" + std::to_string(id);
}

// A buffer the generated code knows by name (parameters, outputs, scratch): accesses inside it
// are checked. Registering a range drops what was registered over it before.
inline void name_buffer(const void* p, size_t n, const std::string& name) {
  State& st = state();
  std::lock_guard<std::recursive_mutex> d(st.det);
  uintptr_t lo = uintptr_t(p), hi = lo + (n ? n : 1);
  auto it = st.regions.find(lo);
  if (it != st.regions.end() && it->second.end == hi) {
    it->second.name = name;
    return;
  }
  for (auto r = st.regions.begin(); r != st.regions.end();) {
    if (r->first < hi && lo < r->second.end) r = st.regions.erase(r);
    else ++r;
  }
  st.regions[lo] = Region{hi, name, {}};
}
inline void access(Stream* s, std::vector<Span> spans, const std::string& what);
// A parameter or output of the call: named, and written on the call's stream before the call
// (what the caller queued there produced it), so the call's other streams must wait for it.
inline void caller_buffer(const void* p, size_t n, const std::string& name, cudaStream_t s) {
  name_buffer(p, n, name);
  access(get(s), {bytes(p, n ? n : 1, true)}, "the caller's work before the call");
}
inline void forget_buffer(const void* p) {
  State& st = state();
  std::lock_guard<std::recursive_mutex> d(st.det);
  st.regions.erase(uintptr_t(p));
}
inline Region* region_of(uintptr_t a) {
  State& st = state();
  auto it = st.regions.upper_bound(a);
  if (it == st.regions.begin()) return nullptr;
  --it;
  return a < it->second.end ? &it->second : nullptr;
}

// One operation queued on s: advance s's clock and check its accesses against every unordered
// access of another stream; throws RaceError naming the buffer and both streams.
inline void access(Stream* s, std::vector<Span> spans, const std::string& what) {
  State& st = state();
  std::lock_guard<std::recursive_mutex> d(st.det);
  merge(s->clock, st.host);
  if (s->clock.size() <= size_t(s->id)) s->clock.resize(size_t(s->id) + 1, 0);
  const uint64_t seq = ++s->clock[size_t(s->id)];
  for (Span sp : spans) {
    if (sp.hi <= sp.lo && !sp.whole) continue;
    Region* reg = region_of(sp.lo);
    if (!reg) continue;  // not a buffer of the call (untracked)
    uintptr_t base = 0;
    for (auto& kv : st.regions)
      if (&kv.second == reg) base = kv.first;
    if (sp.whole) sp.lo = base, sp.hi = reg->end;
    sp.hi = std::min(sp.hi, reg->end);
    for (const Record& r : reg->records) {
      if (r.hi <= sp.lo || sp.hi <= r.lo) continue;
      if (r.stream == s->id || at(s->clock, r.stream) >= r.seq) continue;
      if (!r.write && !sp.write) continue;
      std::ostringstream m;
      m << "coconet emulate: race on buffer '" << reg->name << "' (bytes [" << std::max(r.lo, sp.lo) - base << ", "
        << std::min(r.hi, sp.hi) - base << ") of " << reg->end - base << "): " << what << " on "
        << s->name << " " << (sp.write ? "writes" : "reads") << " it, but " << r.what << " on "
        << describe_stream(r.stream) << " " << (r.write ? "writes" : "reads")
        << " it and no event orders the two (a cudaStreamWaitEvent is missing)";
      throw RaceError(m.str());
    }
    if (sp.write) {
      auto& rs = reg->records;
      rs.erase(std::remove_if(rs.begin(), rs.end(), [&](const Record& r) { return sp.lo <= r.lo && r.hi <= sp.hi; }),
               rs.end());
    }
    reg->records.push_back(Record{sp.lo, sp.hi, s->id, seq, sp.write, what});
  }
}

// The end of a call on stream s: everything the call did on other streams must be ordered
// before it (the caller may use every buffer on s right after).
inline void call_end(cudaStream_t cs) {
  State& st = state();
  Stream* s = get(cs);
  std::lock_guard<std::recursive_mutex> d(st.det);
  merge(s->clock, st.host);
  for (auto& kv : st.regions)
    for (const Record& r : kv.second.records)
      if (r.stream != s->id && at(s->clock, r.stream) < r.seq) {
        std::ostringstream m;
        m << "coconet emulate: race on buffer '" << kv.second.name << "': " << r.what << " on "
          << describe_stream(r.stream) << " " << (r.write ? "writes" : "reads") << " it, but the end of the call on "
          << s->name << " is not ordered after it (a cudaStreamWaitEvent is missing)";
        throw RaceError(m.str());
      }
}

inline void enqueue(Stream* s, std::function<void()> fn) {
  State& st = state();
  {
    std::lock_guard<std::mutex> lock(st.mu);
    s->queue.push_back(Task{std::move(fn)});
    s->enqueued += 1;
  }
  st.cv.notify_all();
}

inline void op(cudaStream_t cs, std::vector<Span> spans, const std::string& what, std::function<void()> fn) {
  Stream* s = get(cs);
  access(s, std::move(spans), what);
  enqueue(s, std::move(fn));
}

inline void sync_stream(Stream* s) {
  State& st = state();
  std::string err;
  {
    std::unique_lock<std::mutex> lock(st.mu);
    const uint64_t want = s->enqueued;
    st.cv.wait(lock, [&] { return s->completed >= want; });
    err.swap(s->error);
  }
  {
    std::lock_guard<std::recursive_mutex> d(st.det);
    merge(st.host, s->clock);
  }
  if (!err.empty()) throw std::runtime_error("coconet emulate: " + s->name + ": " + err);
}

inline void sync_all() {
  State& st = state();
  get(nullptr);
  std::vector<Stream*> all;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    all = st.streams;
  }
  for (Stream* s : all) sync_stream(s);
  std::lock_guard<std::recursive_mutex> d(st.det);
  for (auto& kv : st.regions) kv.second.records.clear();  // everything is ordered before the host now
}

// ---- kernels: blocks in turn, threads as fibers ------------------------------------------------

// A fiber switch: on x86-64 six callee-saved registers and the stack pointer (no system call);
// elsewhere ucontext (swapcontext saves the signal mask with a system call: slower).
#if defined(__x86_64__)
#define COCONET_EMU_FAST_SWITCH 1
extern "C" void coconet_emu_switch(void** save_sp, void* to_sp);
__asm__(
    ".text\n"
    ".weak coconet_emu_switch\n"
    ".type coconet_emu_switch, @function\n"
    "coconet_emu_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
    "  ret\n"
    ".size coconet_emu_switch, .-coconet_emu_switch\n");
#endif

struct Fiber {
#ifdef COCONET_EMU_FAST_SWITCH
  void* sp = nullptr;
#else
  ucontext_t ctx;
#endif
  std::unique_ptr<char[]> stack;
  bool done = false;
  unsigned tid = 0;
};
constexpr size_t kFiberStack = 256 * 1024;
inline std::vector<std::unique_ptr<Fiber>>& fiber_pool() {  // per stream thread, kept across launches
  static thread_local std::vector<std::unique_ptr<Fiber>> pool;
  return pool;
}
struct BlockRun {
#ifdef COCONET_EMU_FAST_SWITCH
  void* sched = nullptr;
#else
  ucontext_t sched;
#endif
  Fiber* cur = nullptr;
  const std::function<void()>* body = nullptr;
  std::vector<std::unique_ptr<Fiber>>& fibers = fiber_pool();
  bool direct = false;
  std::string error;
};
inline thread_local BlockRun* block_run = nullptr;

inline void set_thread(unsigned t) {
  threadIdx.x = t % blockDim.x;
  threadIdx.y = (t / blockDim.x) % blockDim.y;
  threadIdx.z = t / (blockDim.x * blockDim.y);
}

// back to the block's scheduler (a barrier, or the thread's end)
inline void yield_fiber(BlockRun* b, Fiber* f) {
#ifdef COCONET_EMU_FAST_SWITCH
  coconet_emu_switch(&f->sp, b->sched);
#else
  swapcontext(&f->ctx, &b->sched);
#endif
}

inline void fiber_entry() {
  BlockRun* b = block_run;
  try {
    (*b->body)();
  } catch (const std::exception& e) {
    if (b->error.empty()) b->error = e.what();
  }
  b->cur->done = true;
#ifdef COCONET_EMU_FAST_SWITCH
  yield_fiber(b, b->cur);  // never resumed
  std::abort();
#endif
}

inline void resume(BlockRun& b, Fiber* f) {
  b.cur = f;
  set_thread(f->tid);
#ifdef COCONET_EMU_FAST_SWITCH
  coconet_emu_switch(&b.sched, f->sp);
#else
  swapcontext(&b.sched, &f->ctx);
#endif
  b.cur = nullptr;
}

inline void start(BlockRun& b, Fiber* f, unsigned tid) {
  if (!f->stack) f->stack.reset(new char[kFiberStack]);
  f->done = false;
  f->tid = tid;
#ifdef COCONET_EMU_FAST_SWITCH
  // the stack as coconet_emu_switch leaves it: six registers, then `ret` into fiber_entry,
  // which starts with the stack aligned as after a call
  uintptr_t top = (uintptr_t(f->stack.get()) + kFiberStack) & ~uintptr_t(15);
  void** p = reinterpret_cast<void**>(top);
  *--p = nullptr;  // fiber_entry's return address: it never returns
  *--p = reinterpret_cast<void*>(&fiber_entry);
  for (int k = 0; k < 6; ++k) *--p = nullptr;
  f->sp = p;
#else
  getcontext(&f->ctx);
  f->ctx.uc_stack.ss_sp = f->stack.get();
  f->ctx.uc_stack.ss_size = kFiberStack;
  f->ctx.uc_link = &b.sched;
  makecontext(&f->ctx, fiber_entry, 0);
#endif
  resume(b, f);
}

inline void run_block(BlockRun& b, unsigned nthreads) {
  if (b.fibers.empty()) b.fibers.emplace_back(new Fiber());
  start(b, b.fibers[0].get(), 0);
  if (b.fibers[0]->done) {  // no barrier in this block: the other threads as plain calls
    b.direct = true;
    for (unsigned t = 1; t < nthreads; ++t) {
      set_thread(t);
      (*b.body)();
    }
    b.direct = false;
    return;
  }
  while (b.fibers.size() < nthreads) b.fibers.emplace_back(new Fiber());
  for (unsigned t = 1; t < nthreads; ++t) start(b, b.fibers[t].get(), t);
  for (;;) {
    unsigned done = 0;
    for (unsigned t = 0; t < nthreads; ++t) done += b.fibers[t]->done;
    if (done == nthreads) return;
    if (done != 0) throw std::runtime_error("coconet emulate: __syncthreads not reached by every thread of a block");
    for (unsigned t = 0; t < nthreads; ++t) resume(b, b.fibers[t].get());
  }
}

inline void launch(dim3 grid, dim3 block, cudaStream_t cs, std::function<void()> body) {
  State& st = state();
  std::vector<Span> spans;
  {
    std::lock_guard<std::recursive_mutex> d(st.det);
    spans.swap(st.pending);
    st.pending_set = false;
  }
  op(cs, std::move(spans), "a kernel", [grid, block, body = std::move(body)] {
    BlockRun b;
    BlockRun* saved = block_run;
    block_run = &b;
    b.body = &body;
    blockDim = block;
    gridDim = grid;
    const unsigned nthreads = block.x * block.y * block.z;
    for (unsigned z = 0; z < grid.z; ++z)
      for (unsigned y = 0; y < grid.y; ++y)
        for (unsigned x = 0; x < grid.x; ++x) {
          blockIdx = dim3(x, y, z);
          run_block(b, nthreads);
          if (!b.error.empty()) break;
        }
    block_run = saved;
    if (!b.error.empty()) throw std::runtime_error(b.error);
  });
}

inline void declare(std::vector<Span> spans) {
  State& st = state();
  std::lock_guard<std::recursive_mutex> d(st.det);
  st.pending = std::move(spans);
  st.pending_set = true;
}

// ---- MPI -------------------------------------------------------------------------------------------

inline bool mpi_init() {
  int ok = 0;
  MPI_Initialized(&ok);
  if (!ok) {
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
  }
  return true;
}
inline const bool mpi_ready = mpi_init();  // MPI is up when the module loads

inline void mpi_check(int rc, const char* what) {
  if (rc != MPI_SUCCESS) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    throw std::runtime_error(std::string("coconet emulate: ") + what + ": " + std::string(msg, size_t(len)));
  }
}

struct Comm {
  MPI_Comm mpi = MPI_COMM_NULL;
  int size = 1, rank = 0;
  uint64_t issued = 0, done = 0;  // calls run in the order they were issued
  std::atomic<bool> aborted{false};  // ncclCommAbort: its calls in flight stop waiting and fail
  std::atomic<int> async_error{0};  // what ncclCommGetAsyncError reports (injected_async_failure)
};

// The (MPI_COMM_WORLD) rank a fault-injection variable names, -1 for none; and whether it is this one.
inline int injected_rank(const char* env) {
  const char* e = std::getenv(env);
  return e && *e ? std::atoi(e) : -1;
}
inline bool is_this_world_rank(int r) {
  int me = 0;
  if (r >= 0) MPI_Comm_rank(MPI_COMM_WORLD, &me);
  return r >= 0 && me == r;
}

// COCONET_EMULATE_NCCL_FAIL_RANK=r: every NCCL call of (MPI_COMM_WORLD) rank r fails before it
// communicates, as an NCCL error would (the peers then wait for it until the communicator is
// aborted): for testing the abort path (tests/test_torch_optimizer_cuda.py).
inline void injected_failure(const char* call) {
  static const int fail = injected_rank("COCONET_EMULATE_NCCL_FAIL_RANK");
  if (is_this_world_rank(fail))
    throw std::runtime_error(std::string(call) + ": unhandled system error (injected by COCONET_EMULATE_NCCL_FAIL_RANK)");
}

// COCONET_EMULATE_NCCL_ASYNC_FAIL_RANK=r: the NCCL calls of (MPI_COMM_WORLD) rank r complete, but
// leave their communicator with an asynchronous error (ncclCommGetAsyncError: ncclRemoteError),
// as a connection that breaks after a collective went out would on a GPU, where the call has
// long returned: for testing the watchdog that polls for it (coconetc/runtime/cuda.py).
inline void injected_async_failure(Comm* comm) {
  static const int fail = injected_rank("COCONET_EMULATE_NCCL_ASYNC_FAIL_RANK");
  if (is_this_world_rank(fail)) comm->async_error.store(int(ncclRemoteError));
}

// COCONET_EMULATE_NCCL_HANG_RANK=r[:k]: the NCCL calls of (MPI_COMM_WORLD) rank r after its first k
// (default 0) never complete: the call blocks its stream, posting nothing (so the peers' calls wait
// for it too), until the communicator is aborted, as a GPU collective that a peer never joins (a
// rank stuck or gone) would: the work queued behind it never completes, cudaEventQuery reports it
// not ready, and ncclCommAbort ends it. For testing the watchdog that times each call's work with
// a CUDA event (coconetc/runtime/cuda.py).
inline void injected_hang(Comm* comm, const char* call) {
  static const int hang = injected_rank("COCONET_EMULATE_NCCL_HANG_RANK");
  static const long after = [] {
    const char* e = std::getenv("COCONET_EMULATE_NCCL_HANG_RANK");
    const char* colon = e ? std::strchr(e, ':') : nullptr;
    return colon ? std::atol(colon + 1) : 0L;
  }();
  static std::atomic<long> calls{0};
  if (!is_this_world_rank(hang) || calls.fetch_add(1) < after) return;
  while (!comm->aborted.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  throw std::runtime_error(std::string(call) + ": the communicator was aborted (ncclCommAbort) while the call hung "
                           "(injected by COCONET_EMULATE_NCCL_HANG_RANK)");
}

inline size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    default: return 8;
  }
}

template <class T, int OP>
void user_op(void* in, void* inout, int* len, MPI_Datatype*) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    auto x = to_compute(a[i]), y = to_compute(b[i]);
    decltype(x) r = OP == ncclProd ? x * y : OP == ncclMax ? (x < y ? y : x) : OP == ncclMin ? (y < x ? y : x) : x + y;
    b[i] = from_compute<T>(r);
  }
}
template <class T>
MPI_Op make_op(int op) {
  MPI_Op o;
  switch (op) {
    case ncclProd: MPI_Op_create(&user_op<T, ncclProd>, 1, &o); break;
    case ncclMax: MPI_Op_create(&user_op<T, ncclMax>, 1, &o); break;
    case ncclMin: MPI_Op_create(&user_op<T, ncclMin>, 1, &o); break;
    default: MPI_Op_create(&user_op<T, ncclSum>, 1, &o); break;
  }
  return o;
}
inline MPI_Datatype builtin_type(ncclDataType_t t) {
  switch (t) {
    case ncclFloat32: return MPI_FLOAT;
    case ncclFloat64: return MPI_DOUBLE;
    case ncclInt32: return MPI_INT32_T;
    case ncclInt64: return MPI_INT64_T;
    default: return MPI_DATATYPE_NULL;  // f16/bf16: bytes with user operations
  }
}
inline MPI_Datatype mpi_type(ncclDataType_t t) {
  if (builtin_type(t) != MPI_DATATYPE_NULL) return builtin_type(t);
  static std::mutex mu;
  static std::map<size_t, MPI_Datatype> types;
  std::lock_guard<std::mutex> lock(mu);
  auto it = types.find(type_size(t));
  if (it == types.end()) {
    MPI_Datatype d;
    MPI_Type_contiguous(int(type_size(t)), MPI_BYTE, &d);
    MPI_Type_commit(&d);
    it = types.emplace(type_size(t), d).first;
  }
  return it->second;
}
inline MPI_Op mpi_op(ncclDataType_t t, ncclRedOp_t op) {
  if (builtin_type(t) != MPI_DATATYPE_NULL)  // MPI's own reductions (ncclAvg: a sum, divided after)
    return op == ncclProd ? MPI_PROD : op == ncclMax ? MPI_MAX : op == ncclMin ? MPI_MIN : MPI_SUM;
  static std::mutex mu;
  static std::map<std::pair<int, int>, MPI_Op> ops;
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_pair(int(t), int(op));
  auto it = ops.find(key);
  if (it != ops.end()) return it->second;
  MPI_Op o;
  switch (t) {
    case ncclFloat16: o = make_op<half>(op); break;
    case ncclBfloat16: o = make_op<bfloat16>(op); break;
    case ncclFloat32: o = make_op<float>(op); break;
    case ncclFloat64: o = make_op<double>(op); break;
    case ncclInt32: o = make_op<int32_t>(op); break;
    case ncclInt64: o = make_op<int64_t>(op); break;
    default: throw std::runtime_error("coconet emulate: NCCL data type not emulated");
  }
  ops.emplace(key, o);
  return o;
}
template <class T>
void divide(void* p, size_t n, int by) {
  T* x = static_cast<T*>(p);
  for (size_t i = 0; i < n; ++i) x[i] = from_compute<T>(to_compute(x[i]) / static_cast<compute_t<T>>(by));
}
inline void average(ncclDataType_t t, void* p, size_t n, int by) {
  switch (t) {
    case ncclFloat16: divide<half>(p, n, by); break;
    case ncclBfloat16: divide<bfloat16>(p, n, by); break;
    case ncclFloat32: divide<float>(p, n, by); break;
    case ncclFloat64: divide<double>(p, n, by); break;
    case ncclInt32: divide<int32_t>(p, n, by); break;
    case ncclInt64: divide<int64_t>(p, n, by); break;
    default: break;
  }
}

// One NCCL call, run as nonblocking MPI on temporaries (so aliasing buffers are fine).
struct Call {
  enum Kind { AllReduce, Reduce, Broadcast, AllGather, ReduceScatter, Send, Recv } kind;
  const void* send;
  void* recv;
  size_t count;
  ncclDataType_t type;
  ncclRedOp_t op;
  int root;  // root or peer
  Comm* comm;
  std::vector<char> a, b;
};

inline const char* call_name(Call::Kind k) {
  static const char* names[] = {"ncclAllReduce", "ncclReduce", "ncclBroadcast", "ncclAllGather",
                                "ncclReduceScatter", "ncclSend", "ncclRecv"};
  return names[k];
}

inline void spans_of(const Call& c, std::vector<Span>& out) {
  const size_t el = type_size(c.type), n = c.count * el, R = size_t(c.comm->size);
  switch (c.kind) {
    case Call::AllReduce: out.push_back(bytes(c.send, n, false)); out.push_back(bytes(c.recv, n, true)); break;
    case Call::Reduce:
      out.push_back(bytes(c.send, n, false));
      if (c.comm->rank == c.root) out.push_back(bytes(c.recv, n, true));
      break;
    case Call::Broadcast:
      if (c.comm->rank == c.root) out.push_back(bytes(c.send, n, false));
      if (c.comm->rank != c.root || c.send != c.recv) out.push_back(bytes(c.recv, n, true));
      break;
    case Call::AllGather: out.push_back(bytes(c.send, n, false)); out.push_back(bytes(c.recv, n * R, true)); break;
    case Call::ReduceScatter: out.push_back(bytes(c.send, n * R, false)); out.push_back(bytes(c.recv, n, true)); break;
    case Call::Send: out.push_back(bytes(c.send, n, false)); break;
    case Call::Recv: out.push_back(bytes(c.recv, n, true)); break;
  }
}

inline void run_calls(std::vector<Call>& calls) {
  std::vector<MPI_Request> reqs;
  if (!calls.empty()) injected_failure(call_name(calls[0].kind));
  if (!calls.empty()) injected_hang(calls[0].comm, call_name(calls[0].kind));
  for (Call& c : calls) injected_async_failure(c.comm);
  for (Call& c : calls) {
    const size_t el = type_size(c.type), n = c.count * el, R = size_t(c.comm->size);
    const MPI_Datatype dt = mpi_type(c.type);
    const int cnt = int(c.count);
    MPI_Request rq = MPI_REQUEST_NULL;
    MPI_Comm m = c.comm->mpi;
    switch (c.kind) {
      case Call::AllReduce:
      case Call::Reduce:
        c.a.assign(static_cast<const char*>(c.send), static_cast<const char*>(c.send) + n);
        c.b.resize(n);
        if (c.kind == Call::AllReduce)
          mpi_check(MPI_Iallreduce(c.a.data(), c.b.data(), cnt, dt, mpi_op(c.type, c.op), m, &rq), "MPI_Iallreduce");
        else
          mpi_check(MPI_Ireduce(c.a.data(), c.b.data(), cnt, dt, mpi_op(c.type, c.op), c.root, m, &rq), "MPI_Ireduce");
        break;
      case Call::Broadcast:
        c.b.resize(n);
        if (c.comm->rank == c.root) std::memcpy(c.b.data(), c.send, n);
        mpi_check(MPI_Ibcast(c.b.data(), cnt, dt, c.root, m, &rq), "MPI_Ibcast");
        break;
      case Call::AllGather:
        c.a.assign(static_cast<const char*>(c.send), static_cast<const char*>(c.send) + n);
        c.b.resize(n * R);
        mpi_check(MPI_Iallgather(c.a.data(), cnt, dt, c.b.data(), cnt, dt, m, &rq), "MPI_Iallgather");
        break;
      case Call::ReduceScatter:
        c.a.assign(static_cast<const char*>(c.send), static_cast<const char*>(c.send) + n * R);
        c.b.resize(n);
        mpi_check(MPI_Ireduce_scatter_block(c.a.data(), c.b.data(), cnt, dt, mpi_op(c.type, c.op), m, &rq),
                  "MPI_Ireduce_scatter_block");
        break;
      case Call::Send:
        c.a.assign(static_cast<const char*>(c.send), static_cast<const char*>(c.send) + n);
        mpi_check(MPI_Isend(c.a.data(), cnt, dt, c.root, 7, m, &rq), "MPI_Isend");
        break;
      case Call::Recv:
        c.b.resize(n);
        mpi_check(MPI_Irecv(c.b.data(), cnt, dt, c.root, 7, m, &rq), "MPI_Irecv");
        break;
    }
    reqs.push_back(rq);
  }
  // polled, so that ncclCommAbort on another thread ends the wait (the requests are then left
  // behind with the communicator, which is unusable after an abort, as NCCL's)
  for (int flag = 0;;) {
    mpi_check(MPI_Testall(int(reqs.size()), reqs.data(), &flag, MPI_STATUSES_IGNORE), "MPI_Testall");
    if (flag) break;
    if (!calls.empty() && calls[0].comm->aborted.load())
      throw std::runtime_error(std::string(call_name(calls[0].kind)) + ": the communicator was aborted (ncclCommAbort)");
    std::this_thread::yield();
  }
  for (Call& c : calls) {
    const bool out = c.kind == Call::AllReduce || c.kind == Call::AllGather || c.kind == Call::ReduceScatter ||
                     c.kind == Call::Broadcast || c.kind == Call::Recv || (c.kind == Call::Reduce && c.comm->rank == c.root);
    if (!out) continue;
    if (c.op == ncclAvg && c.kind != Call::Broadcast && c.kind != Call::AllGather && c.kind != Call::Recv)
      average(c.type, c.b.data(), c.b.size() / type_size(c.type), c.comm->size);
    std::memcpy(c.recv, c.b.data(), c.b.size());
  }
}

struct GroupState {
  int depth = 0;
  std::vector<Call> calls;
  cudaStream_t stream = nullptr;
};
inline thread_local GroupState group;

inline void submit(std::vector<Call> calls, cudaStream_t cs) {
  if (calls.empty()) return;
  std::vector<Span> spans;
  std::string what;
  for (const Call& c : calls) {
    spans_of(c, spans);
    if (what.find(call_name(c.kind)) == std::string::npos) what += std::string(what.empty() ? "" : "/") + call_name(c.kind);
  }
  Comm* comm = calls[0].comm;
  State& st = state();
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    for (const Call& c : calls)
      if (c.comm != comm) throw std::runtime_error("coconet emulate: one NCCL group on several communicators");
    ticket = comm->issued++;
  }
  op(cs, std::move(spans), what, [calls = std::move(calls), comm, ticket]() mutable {
    State& st = state();
    {
      std::unique_lock<std::mutex> lock(st.mu);
      st.cv.wait(lock, [&] { return comm->done == ticket; });
    }
    try {
      run_calls(calls);
    } catch (...) {
      { std::lock_guard<std::mutex> lock(st.mu); comm->done += 1; }
      st.cv.notify_all();
      throw;
    }
    { std::lock_guard<std::mutex> lock(st.mu); comm->done += 1; }
    st.cv.notify_all();
  });
}

inline ncclResult_t nccl(Call c, cudaStream_t s) {
  if (!c.comm) return ncclInvalidArgument;
  if (group.depth > 0) {
    if (!group.calls.empty() && group.stream != s) throw std::runtime_error("coconet emulate: one NCCL group on several streams");
    group.stream = s;
    group.calls.push_back(std::move(c));
  } else {
    std::vector<Call> one;
    one.push_back(std::move(c));
    submit(std::move(one), s);
  }
  return ncclSuccess;
}

}  // namespace emu
}  // namespace cuda
}  // namespace coconet

// ---- the CUDA runtime API ----------------------------------------------------------------------------

inline const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaSuccess ? "no error" : e == cudaErrorNotReady ? "device not ready" : "emulation error";
}
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline cudaError_t cudaGetDevice(int* d) { *d = 0; return cudaSuccess; }
inline cudaError_t cudaSetDevice(int) { return cudaSuccess; }
inline cudaError_t cudaMalloc(void** p, size_t n) {
  namespace e = coconet::cuda::emu;
  *p = std::calloc(n ? n : 1, 1);
  if (!*p) return cudaErrorUnknown;
  e::name_buffer(*p, n, "device allocation #" + std::to_string(++e::state().allocs));
  return cudaSuccess;
}
template <class T> cudaError_t cudaMalloc(T** p, size_t n) { return cudaMalloc(reinterpret_cast<void**>(p), n); }
inline cudaError_t cudaFree(void* p) {
  coconet::cuda::emu::sync_all();
  coconet::cuda::emu::forget_buffer(p);
  std::free(p);
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  *s = coconet::cuda::emu::make_stream("");
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, 0); }
inline cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  coconet::cuda::emu::sync_stream(coconet::cuda::emu::get(s));
  return cudaSuccess;
}
inline cudaError_t cudaDeviceSynchronize() {
  coconet::cuda::emu::sync_all();
  return cudaSuccess;
}
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) {
  *e = new coconet::cuda::emu::Event();
  return cudaSuccess;
}
inline cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, 0); }
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t cs = nullptr) {
  namespace m = coconet::cuda::emu;
  m::State& st = m::state();
  m::Stream* s = m::get(cs);
  m::enqueue(s, [e] {  // the time the stream reaches the event, for cudaEventElapsedTime
    e->at = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  });
  std::lock_guard<std::recursive_mutex> d(st.det);
  std::lock_guard<std::mutex> lock(st.mu);
  e->stream = s;
  e->position = s->enqueued;
  m::merge(s->clock, st.host);
  e->clock = s->clock;
  e->recorded = true;
  return cudaSuccess;
}
inline cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  namespace m = coconet::cuda::emu;
  if (!e->recorded) return cudaSuccess;
  m::State& st = m::state();
  std::unique_lock<std::mutex> lock(st.mu);
  st.cv.wait(lock, [&] { return e->stream->completed >= e->position; });
  return cudaSuccess;
}
// Whether the event's stream has reached it (never waits): cudaErrorNotReady while the work queued
// before it runs, or is blocked (an NCCL call whose peers never join).
inline cudaError_t cudaEventQuery(cudaEvent_t e) {
  namespace m = coconet::cuda::emu;
  if (!e->recorded) return cudaSuccess;
  m::State& st = m::state();
  std::lock_guard<std::mutex> lock(st.mu);
  return e->stream->completed >= e->position ? cudaSuccess : cudaErrorNotReady;
}
// As CUDA's: an event its stream has not reached yet is released once it is (the release queued
// behind it; a stream blocked for ever keeps it).
inline cudaError_t cudaEventDestroy(cudaEvent_t e) {
  namespace m = coconet::cuda::emu;
  if (!e) return cudaSuccess;
  if (!e->recorded || cudaEventQuery(e) == cudaSuccess) {
    delete e;
    return cudaSuccess;
  }
  m::enqueue(e->stream, [e] { delete e; });
  return cudaSuccess;
}
// Milliseconds between two events their streams have reached (the host's wall clock there).
inline cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  cudaEventSynchronize(start);
  cudaEventSynchronize(end);
  *ms = float((end->at.load() - start->at.load()) * 1e3);
  return cudaSuccess;
}
inline cudaError_t cudaStreamWaitEvent(cudaStream_t cs, cudaEvent_t e, unsigned = 0) {
  namespace m = coconet::cuda::emu;
  m::State& st = m::state();
  m::Stream* s = m::get(cs);
  if (!e->recorded) return cudaSuccess;
  m::Stream* on = e->stream;
  const uint64_t pos = e->position;
  {
    std::lock_guard<std::recursive_mutex> d(st.det);
    m::merge(s->clock, e->clock);
  }
  m::enqueue(s, [on, pos] {
    m::State& st2 = m::state();
    std::unique_lock<std::mutex> lock(st2.mu);
    st2.cv.wait(lock, [&] { return on->completed >= pos; });
  });
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind, cudaStream_t s = nullptr) {
  namespace m = coconet::cuda::emu;
  if (n == 0) return cudaSuccess;
  m::op(s, {m::bytes(src, n, false), m::bytes(dst, n, true)}, "cudaMemcpyAsync",
        [dst, src, n] { std::memmove(dst, src, n); });
  return cudaSuccess;
}
inline cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind k) {
  cudaMemcpyAsync(dst, src, n, k, nullptr);
  return cudaStreamSynchronize(nullptr);
}
inline cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                                     size_t height, cudaMemcpyKind, cudaStream_t s = nullptr) {
  namespace m = coconet::cuda::emu;
  if (width == 0 || height == 0) return cudaSuccess;
  std::vector<m::Span> spans;
  m::strided(spans, src, int64_t(height), int64_t(width), int64_t(spitch), 1, false);
  m::strided(spans, dst, int64_t(height), int64_t(width), int64_t(dpitch), 1, true);
  m::op(s, std::move(spans), "cudaMemcpy2DAsync", [=] {
    for (size_t r = 0; r < height; ++r)
      std::memmove(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch, width);
  });
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t s = nullptr) {
  namespace m = coconet::cuda::emu;
  if (n == 0) return cudaSuccess;
  m::op(s, {m::bytes(p, n, true)}, "cudaMemsetAsync", [=] { std::memset(p, v, n); });
  return cudaSuccess;
}
inline cudaError_t cudaMemset2DAsync(void* p, size_t pitch, int v, size_t width, size_t height, cudaStream_t s = nullptr) {
  namespace m = coconet::cuda::emu;
  if (width == 0 || height == 0) return cudaSuccess;
  std::vector<m::Span> spans;
  m::strided(spans, p, int64_t(height), int64_t(width), int64_t(pitch), 1, true);
  m::op(s, std::move(spans), "cudaMemset2DAsync", [=] {
    for (size_t r = 0; r < height; ++r) std::memset(static_cast<char*>(p) + r * pitch, v, width);
  });
  return cudaSuccess;
}

inline void __syncthreads() {
  namespace m = coconet::cuda::emu;
  m::BlockRun* b = m::block_run;
  if (!b || b->direct || !b->cur)
    throw std::runtime_error("coconet emulate: __syncthreads not reached by every thread of a block");
  m::yield_fiber(b, b->cur);
}

template <class T> inline T atomicAdd(T* p, T v) {  // a block's threads and a stream's blocks run in turn
  T old = *p;
  *p = old + v;
  return old;
}

// ---- NCCL ------------------------------------------------------------------------------------------

inline const char* ncclGetErrorString(ncclResult_t r) {
  if (r == ncclRemoteError) return "remote process exited or there was a network error";  // NCCL's words
  return r == ncclSuccess ? "no error" : "emulation error";
}
inline ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* r) {
  *r = ncclResult_t(comm->async_error.load());
  return ncclSuccess;
}
inline ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  std::memset(id->internal, 0, sizeof(id->internal));
  std::strcpy(id->internal, "coconet host emulation");
  return ncclSuccess;
}
inline ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId, int rank) {
  namespace m = coconet::cuda::emu;
  int provided = 0, wsize = 1;
  MPI_Query_thread(&provided);
  if (provided != MPI_THREAD_MULTIPLE)
    throw std::runtime_error("coconet emulate: MPI must be initialized with MPI_THREAD_MULTIPLE");
  MPI_Comm_size(MPI_COMM_WORLD, &wsize);
  auto* c = new m::Comm();
  if (nranks == 1) {
    m::mpi_check(MPI_Comm_dup(MPI_COMM_SELF, &c->mpi), "MPI_Comm_dup");
  } else if (nranks == wsize) {
    m::mpi_check(MPI_Comm_split(MPI_COMM_WORLD, 0, rank, &c->mpi), "MPI_Comm_split");
  } else {
    delete c;
    throw std::runtime_error("coconet emulate: an NCCL communicator is MPI_COMM_WORLD or one rank");
  }
  MPI_Comm_size(c->mpi, &c->size);
  MPI_Comm_rank(c->mpi, &c->rank);
  *comm = c;
  return ncclSuccess;
}
inline ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* out, void*) {
  namespace m = coconet::cuda::emu;
  coconet::cuda::emu::sync_all();
  auto* c = new m::Comm();
  m::mpi_check(MPI_Comm_split(comm->mpi, color, key, &c->mpi), "MPI_Comm_split");
  MPI_Comm_size(c->mpi, &c->size);
  MPI_Comm_rank(c->mpi, &c->rank);
  *out = c;
  return ncclSuccess;
}
inline ncclResult_t ncclCommAbort(ncclComm_t comm) {  // no wait for the calls in flight: they fail
  if (comm) comm->aborted.store(true);
  return ncclSuccess;
}
inline ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  coconet::cuda::emu::sync_all();
  MPI_Comm_free(&comm->mpi);
  delete comm;
  return ncclSuccess;
}
inline ncclResult_t ncclCommCount(ncclComm_t c, int* n) { *n = c->size; return ncclSuccess; }
inline ncclResult_t ncclCommUserRank(ncclComm_t c, int* r) { *r = c->rank; return ncclSuccess; }
inline ncclResult_t ncclGroupStart() {
  coconet::cuda::emu::group.depth += 1;
  return ncclSuccess;
}
inline ncclResult_t ncclGroupEnd() {
  namespace m = coconet::cuda::emu;
  if (--m::group.depth == 0) {
    std::vector<m::Call> calls;
    calls.swap(m::group.calls);
    m::submit(std::move(calls), m::group.stream);
  }
  return ncclSuccess;
}
inline ncclResult_t ncclAllReduce(const void* s, void* r, size_t n, ncclDataType_t t, ncclRedOp_t op, ncclComm_t c,
                                  cudaStream_t st) {
  return coconet::cuda::emu::nccl({coconet::cuda::emu::Call::AllReduce, s, r, n, t, op, 0, c, {}, {}}, st);
}
inline ncclResult_t ncclReduce(const void* s, void* r, size_t n, ncclDataType_t t, ncclRedOp_t op, int root,
                               ncclComm_t c, cudaStream_t st) {
  return coconet::cuda::emu::nccl({coconet::cuda::emu::Call::Reduce, s, r, n, t, op, root, c, {}, {}}, st);
}
inline ncclResult_t ncclBroadcast(const void* s, void* r, size_t n, ncclDataType_t t, int root, ncclComm_t c,
                                  cudaStream_t st) {
  return coconet::cuda::emu::nccl({coconet::cuda::emu::Call::Broadcast, s, r, n, t, ncclSum, root, c, {}, {}}, st);
}
inline ncclResult_t ncclAllGather(const void* s, void* r, size_t n, ncclDataType_t t, ncclComm_t c, cudaStream_t st) {
  return coconet::cuda::emu::nccl({coconet::cuda::emu::Call::AllGather, s, r, n, t, ncclSum, 0, c, {}, {}}, st);
}
inline ncclResult_t ncclReduceScatter(const void* s, void* r, size_t n, ncclDataType_t t, ncclRedOp_t op,
                                      ncclComm_t c, cudaStream_t st) {
  return coconet::cuda::emu::nccl({coconet::cuda::emu::Call::ReduceScatter, s, r, n, t, op, 0, c, {}, {}}, st);
}
inline ncclResult_t ncclSend(const void* s, size_t n, ncclDataType_t t, int peer, ncclComm_t c, cudaStream_t st) {
  return coconet::cuda::emu::nccl({coconet::cuda::emu::Call::Send, s, nullptr, n, t, ncclSum, peer, c, {}, {}}, st);
}
inline ncclResult_t ncclRecv(void* r, size_t n, ncclDataType_t t, int peer, ncclComm_t c, cudaStream_t st) {
  return coconet::cuda::emu::nccl({coconet::cuda::emu::Call::Recv, nullptr, r, n, t, ncclSum, peer, c, {}, {}}, st);
}

// ---- cuBLAS: the CPU backend's GEMM ---------------------------------------------------------------

inline const char* cublasGetStatusString(cublasStatus_t s) { return s == CUBLAS_STATUS_SUCCESS ? "ok" : "not supported"; }
inline cublasStatus_t cublasCreate(cublasHandle_t* h) { *h = new coconet::cuda::emu::Blas(); return CUBLAS_STATUS_SUCCESS; }
inline cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s) { h->stream = s; return CUBLAS_STATUS_SUCCESS; }

namespace coconet {
namespace cuda {
namespace emu {
// cuBLAS is column-major: C (m x n, ldc) = op(A) (m x k, lda) op(B) (k x n, ldb) is, row-major,
// C^T (n x m) = op(B)^T (n x k) op(A)^T (k x m): the CPU GEMM with the operands swapped, each
// with its own transpose flag (a transposed operand is stored the other way round).
template <class T>
void gemm_colmajor(cudaStream_t s, bool ta, bool tb, int m, int n, int k, const void* A, int lda, const void* B,
                   int ldb, void* C, int ldc) {
  std::vector<Span> spans;
  strided(spans, B, tb ? k : n, tb ? n : k, ldb, sizeof(T), false);
  strided(spans, A, ta ? m : k, ta ? k : m, lda, sizeof(T), false);
  strided(spans, C, n, m, ldc, sizeof(T), true);
  op(s, std::move(spans), "cublasGemmEx", [=] {
    if (!ta && !tb)
      coconet::gemm<T>(n, m, k, static_cast<const T*>(B), ldb, static_cast<const T*>(A), lda, static_cast<T*>(C), ldc);
    else
      coconet::gemm_trans<T>(tb, ta, n, m, k, static_cast<const T*>(B), ldb, static_cast<const T*>(A), lda,
                             static_cast<T*>(C), ldc);
  });
}
}  // namespace emu
}  // namespace cuda
}  // namespace coconet

inline cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                                   const void* alpha, const void* A, cudaDataType_t at, int lda, const void* B,
                                   cudaDataType_t, int ldb, const void* beta, void* C, cudaDataType_t, int ldc,
                                   cublasComputeType_t ct, cublasGemmAlgo_t) {
  namespace emu = coconet::cuda::emu;
  const auto tr = [](cublasOperation_t o) { return o == CUBLAS_OP_T; };
  const bool one = ct == CUBLAS_COMPUTE_64F ? *static_cast<const double*>(alpha) == 1 && *static_cast<const double*>(beta) == 0
                                            : *static_cast<const float*>(alpha) == 1 && *static_cast<const float*>(beta) == 0;
  if (!one) return CUBLAS_STATUS_NOT_SUPPORTED;
  switch (at) {
    case CUDA_R_32F: emu::gemm_colmajor<float>(h->stream, tr(ta), tr(tb), m, n, k, A, lda, B, ldb, C, ldc); break;
    case CUDA_R_64F: emu::gemm_colmajor<double>(h->stream, tr(ta), tr(tb), m, n, k, A, lda, B, ldb, C, ldc); break;
    case CUDA_R_16F: emu::gemm_colmajor<coconet::half>(h->stream, tr(ta), tr(tb), m, n, k, A, lda, B, ldb, C, ldc); break;
    case CUDA_R_16BF: emu::gemm_colmajor<coconet::bfloat16>(h->stream, tr(ta), tr(tb), m, n, k, A, lda, B, ldb, C, ldc); break;
    default: return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  return CUBLAS_STATUS_SUCCESS;
}

// Strided-batched: batch GEMMs as cublasGemmEx's, operand i at its pointer + i * its stride (a stride
// of 0: the same matrix for every batch), each one of cublasGemmEx's operations on the handle's stream.
inline cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                                                 int n, int k, const void* alpha, const void* A, cudaDataType_t at,
                                                 int lda, long long sa, const void* B, cudaDataType_t bt, int ldb,
                                                 long long sb, const void* beta, void* C, cudaDataType_t ctp, int ldc,
                                                 long long sc, int batch, cublasComputeType_t ct, cublasGemmAlgo_t algo) {
  size_t bytes = 0;
  switch (at) {
    case CUDA_R_32F: bytes = 4; break;
    case CUDA_R_64F: bytes = 8; break;
    case CUDA_R_16F: case CUDA_R_16BF: bytes = 2; break;
    default: return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  for (int i = 0; i < batch; ++i) {
    const cublasStatus_t st = cublasGemmEx(
        h, ta, tb, m, n, k, alpha, static_cast<const char*>(A) + size_t(i) * size_t(sa) * bytes, at, lda,
        static_cast<const char*>(B) + size_t(i) * size_t(sb) * bytes, bt, ldb, beta,
        static_cast<char*>(C) + size_t(i) * size_t(sc) * bytes, ctp, ldc, ct, algo);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
  }
  return CUBLAS_STATUS_SUCCESS;
}

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
// The NCCL device API subset symmetric.cuh uses (symmetric memory, LSA pointers and barriers).
#include "emulate_nccl_device.h"
