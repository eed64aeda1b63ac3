// coconet CUDA runtime: what the generated CUDA code (coconetc/codegen/cuda) calls around its
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

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("coconet (cuda): ") + what + ": " + cudaGetErrorString(e));
}
inline void check(ncclResult_t e, const char* what) {
  if (e != ncclSuccess) throw std::runtime_error(std::string("coconet (nccl): ") + what + ": " + ncclGetErrorString(e));
}
inline void check(cublasStatus_t e, const char* what) {
  if (e != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("coconet (cublas): ") + what + ": " + cublasGetStatusString(e));
}
#define COCONET_CUDA(x) ::coconet::cuda::check((x), #x)

inline void require(bool ok, const std::string& msg) {
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
inline cudaStream_t device_stream(std::map<int, cudaStream_t>& streams, const char* name) {
  return per_device(streams, [name](int) {
    cudaStream_t cs;
    COCONET_CUDA(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
    COCONET_STREAM_NAME(cs, name);
    return cs;
  });
}

inline Ctx context(const CallArgs& a) {
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
inline void* scratch_bytes(int site, size_t bytes) {
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
inline cudaEvent_t event(int site) {
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
inline void join(cudaStream_t s, cudaStream_t waiter, int site) {
  cudaEvent_t e = event(site);
  COCONET_CUDA(cudaEventRecord(e, s));
  COCONET_CUDA(cudaStreamWaitEvent(waiter, e, 0));
}

// A second compute stream (per device, made once): an overlap's fused collective runs its kernels
// there while the call's stream computes the next block of the matmul.
inline cudaStream_t side_stream() {
  static std::mutex mu;
  static std::map<int, cudaStream_t> streams;
  std::lock_guard<std::mutex> lock(mu);
  return device_stream(streams, "the side stream");
}

// Elements per chunk of a fused collective: COCONET_CUDA_CHUNK, else `whole` when it is positive
// (one rank: nothing to overlap, so one chunk), else 2^22.
inline int64_t chunk_elems(int64_t whole = 0) {
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

#include "batch.cuh"  // a batch's calls combining their reductions (needs Ctx, scratch, launch above)

namespace coconet {
namespace cuda {

// ---- pointwise kernels: Lets once per thread, 16-byte vector accesses where aligned -------------
//
// A Loop (and a fused collective's chunk) is one kernel whose lambda runs once per thread: it
// computes the Lets, then walks the thread's elements (grid-stride). With V > 1 elements per
// vector (16 bytes of the widest operand type) and every operand pointer aligned for V of its
// elements (checked on the host before the launch: aligned<V>), the thread first takes whole
// groups of V elements (th.vectors(): one vector load or store per operand), then the tail past
// the last whole group one element at a time (th.elements(), which is everything otherwise).

// lo, lo + step, ... below hi, for a range-for in device code.
struct Strided {
  int64_t lo, hi, step;
  struct It {
    int64_t i, step;
    COCONET_HD int64_t operator*() const { return i; }
    COCONET_HD It& operator++() {
      i += step;
      return *this;
    }
    COCONET_HD bool operator!=(const It& e) const { return i < e.i; }
  };
  COCONET_HD It begin() const { return It{lo, step}; }
  COCONET_HD It end() const { return It{hi, step}; }
};

// One thread's share of the elements [0, n) of a pointwise kernel (see above; the symmetric
// kernel's SymThread offers the same two loops over its block's tiles).
template <int V>
struct Thread {
  int64_t n = 0, first = 0, stride = 1;
  bool vec = false;
  // the first element of each whole group of V elements this thread takes (none unless vec)
  COCONET_HD Strided vectors() const { return vec ? Strided{first * V, n / V * V, stride * V} : Strided{0, 0, 1}; }
  // the elements it takes one at a time: those past the last whole group, or all of them
  COCONET_HD Strided elements() const { return Strided{(vec ? n / V * V : 0) + first, n, stride}; }
};

// V elements of T held in registers, aligned as one vector access (V * sizeof(T) bytes, at most 16).
template <class T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
  COCONET_HD T& operator[](int k) { return v[k]; }
  COCONET_HD const T& operator[](int k) const { return v[k]; }
};
template <int V, class T>
COCONET_HD inline Vec<T, V> load(const T* p) {
  COCONET_VECTOR_ACCESS(p, sizeof(Vec<T, V>));
#ifdef COCONET_EMULATE
  Vec<T, V> x;
  std::memcpy(&x, p, sizeof x);
  return x;
#else
  return *reinterpret_cast<const Vec<T, V>*>(p);
#endif
}
template <int V, class T>
COCONET_HD inline void store(T* p, const Vec<T, V>& x) {
  COCONET_VECTOR_ACCESS(p, sizeof(Vec<T, V>));
#ifdef COCONET_EMULATE
  std::memcpy(p, &x, sizeof x);
#else
  *reinterpret_cast<Vec<T, V>*>(p) = x;
#endif
}

// Whether every pointer is aligned for a vector of V of its elements.
template <int V>
COCONET_HD inline bool aligned() {
  return true;
}
template <int V, class T, class... Rest>
COCONET_HD inline bool aligned(const T* p, const Rest*... rest) {
  return reinterpret_cast<uintptr_t>(p) % (sizeof(T) * V) == 0 && aligned<V>(rest...);
}

template <int V, class F>
__global__ void threads_kernel(int64_t n, bool vec, F f) {
  f(Thread<V>{n, blockIdx.x * int64_t(blockDim.x) + threadIdx.x, int64_t(gridDim.x) * blockDim.x, vec});
}

// This device's multiprocessors (asked once per device).
inline int sm_count() {
  static std::mutex mu;
  static std::map<int, int> sms;
  std::lock_guard<std::mutex> lock(mu);
  return per_device(sms, [](int dev) {
    int n = 0;
    COCONET_CUDA(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n > 0 ? n : 1;
  });
}

// f(th) once per thread of a grid over [0, n) on stream s (th: a Thread<V>); vec: every operand is
// aligned<V> (the vector path). Blocks of 256 threads, as many as the work needs but at most 32
// per multiprocessor (4 waves of 8 resident blocks), so that a thread takes several vectors and
// its Lets are computed once for all of them.
template <int V, class F>
void launch_threads(int64_t n, bool vec, cudaStream_t s, F f) {
  if (n <= 0) {
    COCONET_ACCESS();  // (emulation) no kernel: its declared ranges go with it
    return;
  }
  vec = vec && V > 1 && n >= V;
  const int threads = 256;
  const int64_t work = vec ? (n + V - 1) / V : n;
  const int64_t blocks = std::min<int64_t>((work + threads - 1) / threads, int64_t(sm_count()) * 32);
  void (*kernel)(int64_t, bool, F) = threads_kernel<V, F>;
  COCONET_COUNT_KERNEL(vec);
  COCONET_LAUNCH(kernel, static_cast<unsigned>(blocks), threads, 0, s, n, vec, f);
  COCONET_CUDA(cudaGetLastError());
}

template <class T, bool SQUARES>
__global__ void partial_sum_kernel(const T* x, int64_t n, double* acc) {
  __shared__ double part[256];
  double s = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    double v = static_cast<double>(to_compute(x[i]));
    s += SQUARES ? v * v : v;
  }
  part[threadIdx.x] = s;
  __syncthreads();
  for (int k = blockDim.x / 2; k > 0; k /= 2) {
    if (threadIdx.x < k) part[threadIdx.x] += part[threadIdx.x + k];
    __syncthreads();
  }
  if (threadIdx.x == 0) atomicAdd(acc, part[0]);
}

template <class T, bool SQRT>
__global__ void finish_sum_kernel(const double* acc, T* dst) {
  double v = SQRT ? sqrt(acc[0]) : acc[0];
  dst[0] = from_compute<T>(static_cast<compute_t<T>>(v));
}

// *acc += the sum (or sum of squares) of x[0, n): a block reduction (nothing when n <= 0).
template <class T, bool NORM>
void partial_sum(const T* x, int64_t n, double* acc, const Ctx& c) {
  if (n <= 0) return;
  int64_t blocks = (n + 255) / 256;
  if (blocks > 4096) blocks = 4096;
  void (*partial)(const T*, int64_t, double*) = partial_sum_kernel<T, NORM>;
  COCONET_ACCESS(COCONET_R(x, 0, n), COCONET_W(acc, 0, 1));
  COCONET_LAUNCH(partial, static_cast<unsigned>(blocks), 256, 0, c.stream, x, n, acc);
  COCONET_CUDA(cudaGetLastError());
}

// dst[0] = *acc (or its square root), acc combined already (reduce_across, or combine).
template <class T, bool NORM>
void finish_sum(const double* acc, T* dst, const Ctx& c) {
  void (*finish)(const double*, T*) = finish_sum_kernel<T, NORM>;
  COCONET_ACCESS(COCONET_R(acc, 0, 1), COCONET_W(dst, 0, 1));
  COCONET_LAUNCH(finish, 1, 1, 0, c.stream, acc, dst);
  COCONET_CUDA(cudaGetLastError());
}

// dst[0] = sum (or L2 norm) of x[0, n); cross_rank: the ranks' partial sums are added (NCCL);
// in a batch, every call's too (batch.cuh).
template <class T, bool NORM>
void reduce_sum(const T* x, T* dst, int64_t n, bool cross_rank, const Ctx& c, int site) {
  double* acc = scratch<double>(site, 1);
  COCONET_CUDA(cudaMemsetAsync(acc, 0, sizeof(double), c.stream));
  partial_sum<T, NORM>(x, n, acc, c);
  reduce_across(acc, 1, cross_rank, false, c);
  finish_sum<T, NORM>(acc, dst, c);
}

// ---- max(x), min(x) ---------------------------------------------------------------------------
// acc[0]: the largest element not NaN so far (for a min, of the negated elements: a min is the max
// of its negation), -inf for none yet (NumPy's `initial`); acc[1]: 1 once an element is NaN. The
// ranks' acc combine with one ncclMax (no NaN travels), the result is NaN where any was (torch.amax).
// Two passes: each block folds its grid-stride share into parts[2 b, 2 b + 1], then one block
// folds the parts into acc.
constexpr int kExtremeBlocks = 1024;

template <int = 0>  // a template: the header may be in several translation units
__global__ void extreme_init_kernel(double* acc) {
  acc[0] = -HUGE_VAL;
  acc[1] = 0;
}

// part/bad: a block's 256 values, folded into [0] (the block's threads all call it).
template <int = 0>
__device__ inline void extreme_fold_block(double* part, double* bad) {
  __syncthreads();
  for (int k = blockDim.x / 2; k > 0; k /= 2) {
    if (threadIdx.x < k) {
      part[threadIdx.x] = part[threadIdx.x + k] > part[threadIdx.x] ? part[threadIdx.x + k] : part[threadIdx.x];
      bad[threadIdx.x] = bad[threadIdx.x + k] > bad[threadIdx.x] ? bad[threadIdx.x + k] : bad[threadIdx.x];
    }
    __syncthreads();
  }
}

template <class T, bool MAX>
__global__ void partial_extreme_kernel(const T* x, int64_t n, double* parts) {
  __shared__ double part[256];
  __shared__ double bad[256];
  double m = -HUGE_VAL, f = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    double v = static_cast<double>(to_compute(x[i]));
    if (v != v) {
      f = 1;
    } else {
      v = MAX ? v : -v;
      m = v > m ? v : m;
    }
  }
  part[threadIdx.x] = m;
  bad[threadIdx.x] = f;
  extreme_fold_block(part, bad);
  if (threadIdx.x == 0) {
    parts[2 * blockIdx.x] = part[0];
    parts[2 * blockIdx.x + 1] = bad[0];
  }
}

template <int = 0>
__global__ void fold_extreme_kernel(const double* parts, int blocks, double* acc) {  // one block
  __shared__ double part[256];
  __shared__ double bad[256];
  double m = -HUGE_VAL, f = 0;
  for (int b = threadIdx.x; b < blocks; b += blockDim.x) {
    m = parts[2 * b] > m ? parts[2 * b] : m;
    f = parts[2 * b + 1] > f ? parts[2 * b + 1] : f;
  }
  part[threadIdx.x] = m;
  bad[threadIdx.x] = f;
  extreme_fold_block(part, bad);
  if (threadIdx.x == 0) {
    acc[0] = part[0] > acc[0] ? part[0] : acc[0];
    acc[1] = bad[0] > acc[1] ? bad[0] : acc[1];
  }
}

template <class T, bool MAX>
__global__ void finish_extreme_kernel(const double* acc, T* dst) {
  double v = acc[1] > 0 ? nan("") : (MAX ? acc[0] : -acc[0]);
  dst[0] = from_compute<T>(static_cast<compute_t<T>>(v));
}

// acc (2 doubles) += the extreme of x[0, n); parts: kExtremeBlocks pairs of scratch (by default
// right after acc, as extreme_acc lays them out).
template <class T, bool MAX>
void partial_extreme(const T* x, int64_t n, double* acc, const Ctx& c, double* parts = nullptr) {
  if (n <= 0) return;
  int64_t blocks = (n + 255) / 256;
  if (blocks > kExtremeBlocks) blocks = kExtremeBlocks;
  if (parts == nullptr) parts = acc + 2;
  void (*partial)(const T*, int64_t, double*) = partial_extreme_kernel<T, MAX>;
  COCONET_ACCESS(COCONET_R(x, 0, n), COCONET_W(parts, 0, 2 * blocks));
  COCONET_LAUNCH(partial, static_cast<unsigned>(blocks), 256, 0, c.stream, x, n, parts);
  COCONET_CUDA(cudaGetLastError());
  void (*fold)(const double*, int, double*) = fold_extreme_kernel<>;
  COCONET_ACCESS(COCONET_R(parts, 0, 2 * blocks), COCONET_W(acc, 0, 2));
  COCONET_LAUNCH(fold, 1, 256, 0, c.stream, parts, static_cast<int>(blocks), acc);
  COCONET_CUDA(cudaGetLastError());
}

// dst[0] = the extreme acc holds, acc combined already (reduce_across, or combine).
template <class T, bool MAX>
void finish_extreme(const double* acc, T* dst, const Ctx& c) {
  void (*finish)(const double*, T*) = finish_extreme_kernel<T, MAX>;
  COCONET_ACCESS(COCONET_R(acc, 0, 2), COCONET_W(dst, 0, 1));
  COCONET_LAUNCH(finish, 1, 1, 0, c.stream, acc, dst);
  COCONET_CUDA(cudaGetLastError());
}

// acc[0, 2) = no element yet, on the call's stream.
inline void extreme_init(double* acc, const Ctx& c) {
  void (*init)(double*) = extreme_init_kernel<>;
  COCONET_ACCESS(COCONET_W(acc, 0, 2));
  COCONET_LAUNCH(init, 1, 1, 0, c.stream, acc);
  COCONET_CUDA(cudaGetLastError());
}

inline double* extreme_acc(int site, const Ctx& c) {
  double* acc = scratch<double>(site, 2 + 2 * kExtremeBlocks);
  extreme_init(acc, c);
  return acc;
}

// dst[0] = max(x[0, n)) (MAX) or min; cross_rank: over the ranks' parts too; in a batch, over
// every call's (batch.cuh).
template <class T, bool MAX>
void reduce_extreme(const T* x, T* dst, int64_t n, bool cross_rank, const Ctx& c, int site) {
  double* acc = extreme_acc(site, c);
  partial_extreme<T, MAX>(x, n, acc, c);
  reduce_across(acc, 2, cross_rank, true, c);
  finish_extreme<T, MAX>(acc, dst, c);
}

// The sum of v over the block's threads (blockDim.x a power of two, at most kRowThreads), added
// in shared memory in a fixed order (deterministic); every thread gets it.
constexpr int kRowThreads = 256;
template <class A>
__device__ A block_sum(A* part, A v) {
  part[threadIdx.x] = v;
  __syncthreads();
  for (int k = blockDim.x / 2; k > 0; k /= 2) {
    if (int(threadIdx.x) < k) part[threadIdx.x] += part[threadIdx.x + k];
    __syncthreads();
  }
  const A total = part[0];
  __syncthreads();  // every thread has read it before part is written again
  return total;
}

// eps of a layernorm: a literal, or a computed 0-d value in device memory
COCONET_HD inline double eps_value(double eps) { return eps; }
template <class E>
COCONET_HD inline double eps_value(const E* eps) { return double(to_compute(eps[0])); }

// f(row, part) for row in [0, rows): a block of kRowThreads threads a row (the grid striding the
// rows), part the block's shared scratch for block_sum (in type A).
template <class A, class F>
__global__ void rows_kernel(int64_t rows, F f) {
  __shared__ A part[kRowThreads];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) f(r, part);
}
template <class A, class F>
void launch_rows(int64_t rows, cudaStream_t s, F f) {
  if (rows <= 0) {
    COCONET_ACCESS();  // (emulation) no kernel: its declared ranges go with it
    return;
  }
  void (*kernel)(int64_t, F) = rows_kernel<A, F>;
  COCONET_LAUNCH(kernel, static_cast<unsigned>(std::min<int64_t>(rows, 65535)), kRowThreads, 0, s, rows, f);
  COCONET_CUDA(cudaGetLastError());
}

// One row of a layernorm over the last dim, by the block's threads striding it (coalesced):
// pointwise.h's layernorm_of (the mean, then the mean squared deviation, in the compute type C),
// each pass's partial sums added by block_sum; out(j, value) for each element j of the row, its
// value in C. The layernorm kernel's row, and a fused collective's row-wise phase's
// (codegen/cuda/fused.py). (One thread a row, before, read its row alone: a chain of dependent,
// uncoalesced loads H long.)
template <class T, class C, class Out>
__device__ void layernorm_row_block(const T* xr, const T* g, const T* b, C eps, int64_t H, C* part, Out out) {
  const auto sum = [&](auto f) {
    C s = 0;
    for (int64_t j = threadIdx.x; j < H; j += blockDim.x) s += f(j);
    return block_sum(part, s);
  };
  const auto each = [&](auto f) {
    for (int64_t j = threadIdx.x; j < H; j += blockDim.x) f(j);
  };
  layernorm_of([&](int64_t j) { return to_compute(xr[j]); }, g, b, eps, H, sum, each, out);
}

// layernorm over the last dim, a block a row; EPS: a double (a literal) or const E* (a computed
// 0-d value in device memory, read by each block).
template <class T, class EPS>
void layernorm_rows(const T* x, const T* g, const T* b, EPS eps, int64_t rows, int64_t H, T* y, const Ctx& c) {
  using C = compute_t<T>;
  launch_rows<C>(rows, c.stream, [=] __device__(int64_t r, C* part) {
    layernorm_row_block(x + r * H, g, b, static_cast<C>(eps_value(eps)), H, part,
                        [&](int64_t j, C v) { y[r * H + j] = from_compute<T>(v); });
  });
}

template <class T>
void layernorm(const T* x, const T* g, const T* b, double eps, int64_t rows, int64_t H, T* y, const Ctx& c) {
  COCONET_ACCESS(COCONET_R(x, 0, rows * H), COCONET_R(g, 0, H), COCONET_R(b, 0, H), COCONET_W(y, 0, rows * H));
  layernorm_rows(x, g, b, eps, rows, H, y, c);
}

// The largest of v over the block's threads, NaN propagating (as block_sum: a fixed order, every
// thread gets it).
template <class A>
__device__ A block_max(A* part, A v) {
  part[threadIdx.x] = v;
  __syncthreads();
  for (int k = blockDim.x / 2; k > 0; k /= 2) {
    if (int(threadIdx.x) < k) {
      const A o = part[threadIdx.x + k];
      if (o > part[threadIdx.x] || o != o) part[threadIdx.x] = o;
    }
    __syncthreads();
  }
  const A total = part[0];
  __syncthreads();
  return total;
}

// softmax over the last dim, a block a row: pointwise.h's softmax_of (the row's max, the sum of
// exp(x - max), then each exp(x - max) / sum, in the compute type; a fully masked row (all -inf)
// is zeros), by the block's threads striding the row, their parts combined by block_max and
// block_sum, as the CPU's softmax_row.
template <class T>
void softmax(const T* x, T* y, int64_t rows, int64_t H, const Ctx& c) {
  using C = compute_t<T>;
  COCONET_ACCESS(COCONET_R(x, 0, rows * H), COCONET_W(y, 0, rows * H));
  launch_rows<C>(rows, c.stream, [=] __device__(int64_t r, C* part) {
    const T* xr = x + r * H;
    const auto largest = [&](auto f) {
      C m = -std::numeric_limits<C>::infinity();
      for (int64_t j = threadIdx.x; j < H; j += blockDim.x) m = max_step(m, f(j));
      return block_max(part, m);
    };
    const auto total = [&](auto f) {
      C s = 0;
      for (int64_t j = threadIdx.x; j < H; j += blockDim.x) s += f(j);
      return block_sum(part, s);
    };
    const auto each = [&](auto f) {
      for (int64_t j = threadIdx.x; j < H; j += blockDim.x) f(j);
    };
    softmax_of<C>([&](int64_t j) { return to_compute(xr[j]); }, largest, total, each,
                  [&](int64_t j, C v) { y[r * H + j] = from_compute<T>(v); });
  });
}

// transpose: y[o, j, m, i, k] = x[o, i, m, j, k], x seen as [outer, a, mid, b, inner], one thread per
// element of y (the mirror of kernels.h's).
template <class T>
void transpose(const T* x, T* y, int64_t outer, int64_t a, int64_t mid, int64_t b, int64_t inner, const Ctx& c) {
  const int64_t n = outer * a * mid * b * inner;
  COCONET_ACCESS(COCONET_R(x, 0, n), COCONET_W(y, 0, n));
  launch(n, c.stream, [=] __device__(int64_t e) {
    const int64_t k = e % inner, i = (e / inner) % a, m = (e / (inner * a)) % mid, j = (e / (inner * a * mid)) % b,
                  o = e / (inner * a * mid * b);
    y[e] = x[(((o * a + i) * mid + m) * b + j) * inner + k];
  });
}

// conv2d NCHW x OIHW, one thread per output element, accumulated in double.
template <class T>
void conv2d(const T* x, const T* w, T* y, int64_t N, int64_t C, int64_t H, int64_t W, int64_t O, int64_t KH,
            int64_t KW, int64_t stride, int64_t pad, const Ctx& c) {
  const int64_t OH = (H + 2 * pad - KH) / stride + 1, OW = (W + 2 * pad - KW) / stride + 1;
  COCONET_ACCESS(COCONET_R(x, 0, N * C * H * W), COCONET_R(w, 0, O * C * KH * KW), COCONET_W(y, 0, N * O * OH * OW));
  launch(N * O * OH * OW, c.stream, [=] __device__(int64_t i) {
    int64_t ow = i % OW, oh = (i / OW) % OH, o = (i / (OW * OH)) % O, n = i / (OW * OH * O);
    double acc = 0;
    for (int64_t ci = 0; ci < C; ++ci)
      for (int64_t kh = 0; kh < KH; ++kh) {
        int64_t ih = oh * stride - pad + kh;
        if (ih < 0 || ih >= H) continue;
        for (int64_t kw = 0; kw < KW; ++kw) {
          int64_t iw = ow * stride - pad + kw;
          if (iw < 0 || iw >= W) continue;
          acc += static_cast<double>(to_compute(x[((n * C + ci) * H + ih) * W + iw])) *
                 static_cast<double>(to_compute(w[((o * C + ci) * KH + kh) * KW + kw]));
        }
      }
    y[i] = from_compute<T>(static_cast<compute_t<T>>(acc));
  });
}

// ---- cuBLAS --------------------------------------------------------------------------------------

inline cublasHandle_t blas() {
  static std::mutex mu;
  static std::map<int, cublasHandle_t> hs;
  std::lock_guard<std::mutex> lock(mu);
  return per_device(hs, [](int) {
    cublasHandle_t h;
    COCONET_CUDA(cublasCreate(&h));
    return h;
  });
}

template <class T> struct BlasType;
template <> struct BlasType<float> { static constexpr cudaDataType_t t = CUDA_R_32F; };
template <> struct BlasType<double> { static constexpr cudaDataType_t t = CUDA_R_64F; };
template <> struct BlasType<half> { static constexpr cudaDataType_t t = CUDA_R_16F; };
template <> struct BlasType<bfloat16> { static constexpr cudaDataType_t t = CUDA_R_16BF; };

// Row-major C[M, N] = op(A) x op(B), ldc: op(A) is A[M, K] (lda), or A[K, M]^T when ta; op(B) is
// B[K, N] (ldb), or B[N, K]^T when tb (grad.cuh: matmul_nt, matmul_tn). cuBLAS is column-major,
// so it computes C^T = op(B)^T op(A)^T: the same pointers with the same transpose flags, swapped.
// f16/bf16 accumulate in f32, f64 in f64, f32 in f32 (no TF32).
template <class T>
void gemm_trans(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb,
                T* C, int64_t ldc, cudaStream_t s) {
  if (M <= 0 || N <= 0) return;
  cublasHandle_t h = blas();
  COCONET_CUDA(cublasSetStream(h, s));
  if (K <= 0) {
    COCONET_CUDA(cudaMemset2DAsync(C, ldc * sizeof(T), 0, N * sizeof(T), M, s));
    return;
  }
  const cublasOperation_t opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (std::is_same<T, double>::value) {
    const double alpha = 1, beta = 0;
    COCONET_CUDA(cublasGemmEx(h, opb, opa, int(N), int(M), int(K), &alpha, B, BlasType<T>::t, int(ldb), A,
                              BlasType<T>::t, int(lda), &beta, C, BlasType<T>::t, int(ldc), CUBLAS_COMPUTE_64F,
                              CUBLAS_GEMM_DEFAULT));
  } else {
    const float alpha = 1, beta = 0;
    COCONET_CUDA(cublasGemmEx(h, opb, opa, int(N), int(M), int(K), &alpha, B, BlasType<T>::t, int(ldb), A,
                              BlasType<T>::t, int(lda), &beta, C, BlasType<T>::t, int(ldc), CUBLAS_COMPUTE_32F,
                              CUBLAS_GEMM_DEFAULT));
  }
}

// Row-major C[M, N] = A[M, K] (lda) x B[K, N] (ldb), ldc.
template <class T>
void gemm(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc,
          cudaStream_t s) {
  gemm_trans<T>(false, false, M, N, K, A, lda, B, ldb, C, ldc, s);
}
template <class T>
void matmul(const T* A, const T* B, T* C, int64_t M, int64_t K, int64_t N, cudaStream_t s) {
  gemm<T>(M, N, K, A, K, B, N, C, N, s);
}

// Batched: C[i] = A[i] x B[i] for i < batch (A[i] at A + i * stride_a, stride_a = 0: one A for every
// batch; B[i] at B + i * stride_b; C dense [batch, M, N]), one cublasGemmStridedBatchedEx (row-major
// as gemm_trans: C^T = B^T A^T), accumulating as gemm_trans does.
template <class T>
void matmul(const T* A, const T* B, T* C, int64_t batch, int64_t M, int64_t K, int64_t N, int64_t stride_a,
            int64_t stride_b, cudaStream_t s) {
  if (batch <= 0 || M <= 0 || N <= 0) return;
  if (K <= 0) {
    COCONET_CUDA(cudaMemsetAsync(C, 0, size_t(batch * M * N) * sizeof(T), s));
    return;
  }
  cublasHandle_t h = blas();
  COCONET_CUDA(cublasSetStream(h, s));
  const bool f64 = std::is_same<T, double>::value;
  const double alpha64 = 1, beta64 = 0;
  const float alpha32 = 1, beta32 = 0;
  const void* alpha = f64 ? static_cast<const void*>(&alpha64) : static_cast<const void*>(&alpha32);
  const void* beta = f64 ? static_cast<const void*>(&beta64) : static_cast<const void*>(&beta32);
  COCONET_CUDA(cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, int(N), int(M), int(K), alpha, B, BlasType<T>::t,
                                          int(N), static_cast<long long>(stride_b), A, BlasType<T>::t, int(K),
                                          static_cast<long long>(stride_a), beta, C, BlasType<T>::t, int(N),
                                          static_cast<long long>(M * N), int(batch),
                                          f64 ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// ---- NCCL ----------------------------------------------------------------------------------------

template <class T> struct NcclType;
template <> struct NcclType<float> { static constexpr ncclDataType_t t = ncclFloat32; };
template <> struct NcclType<double> { static constexpr ncclDataType_t t = ncclFloat64; };
template <> struct NcclType<half> { static constexpr ncclDataType_t t = ncclFloat16; };
template <> struct NcclType<bfloat16> { static constexpr ncclDataType_t t = ncclBfloat16; };
template <> struct NcclType<int32_t> { static constexpr ncclDataType_t t = ncclInt32; };
template <> struct NcclType<int64_t> { static constexpr ncclDataType_t t = ncclInt64; };

struct Group_ {  // ncclGroupStart/End as a scope
  Group_() { COCONET_CUDA(ncclGroupStart()); }
  ~Group_() noexcept(false) { COCONET_CUDA(ncclGroupEnd()); }
};

template <class T>
void allreduce(ncclRedOp_t op, const T* x, T* y, int64_t n, const Ctx& c, cudaStream_t s = nullptr) {
  COCONET_CUDA(ncclAllReduce(x, y, size_t(n), NcclType<T>::t, op, c.comm, s ? s : c.stream));
}

// x: [outer, n, inner] (every rank the whole), y: this rank's slice [outer, |slice|, inner].
// Even split along the outermost dim: one ncclReduceScatter; otherwise (uneven slices, inner
// dims) one grouped ncclReduce per rank and outer index, each to the rank that keeps it.
template <class T>
void reduce_scatter(ncclRedOp_t op, const T* x, T* y, int64_t outer, int64_t n, int64_t inner, const Ctx& c) {
  const int R = c.group.size;
  if (outer == 1 && n % R == 0) {
    COCONET_CUDA(ncclReduceScatter(x, y, size_t(n / R * inner), NcclType<T>::t, op, c.comm, c.stream));
    return;
  }
  const int64_t mine = slice_range(n, R, c.group.rank).size();
  Group_ g;
  for (int r = 0; r < R; ++r) {
    Range sl = slice_range(n, R, r);
    if (sl.empty()) continue;
    for (int64_t o = 0; o < outer; ++o)
      COCONET_CUDA(ncclReduce(x + (o * n + sl.begin) * inner, y + o * mine * inner, size_t(sl.size() * inner),
                              NcclType<T>::t, op, r, c.comm, c.stream));
  }
}

// x: this rank's slice [outer, |slice|, inner], y: [outer, n, inner] gathered.
template <class T>
void allgather(const T* x, T* y, int64_t outer, int64_t n, int64_t inner, const Ctx& c) {
  const int R = c.group.size;
  if (outer == 1 && n % R == 0) {
    COCONET_CUDA(ncclAllGather(x, y, size_t(n / R * inner), NcclType<T>::t, c.comm, c.stream));
    return;
  }
  const int64_t mine = slice_range(n, R, c.group.rank).size();
  Group_ g;
  for (int r = 0; r < R; ++r) {
    Range sl = slice_range(n, R, r);
    if (sl.empty()) continue;
    for (int64_t o = 0; o < outer; ++o)
      COCONET_CUDA(ncclBroadcast(x + o * mine * inner, y + (o * n + sl.begin) * inner, size_t(sl.size() * inner),
                                 NcclType<T>::t, r, c.comm, c.stream));
  }
}

// Piece i of k of every rank's slice of dim 0 of [n, inner] (x: this rank's slice) straight into
// its place in y (slices.h piece_range): an overlap of an allgather along the dim it gathers.
template <class T>
void allgather_pieces(const T* x, T* y, int64_t n, int64_t inner, int k, int i, const Ctx& c) {
  const int R = c.group.size;
  const Range mine = slice_range(slice_range(n, R, c.group.rank).size(), k, i);
  Group_ g;
  for (int q = 0; q < R; ++q) {
    const Range p = piece_range(n, R, q, k, i);
    if (p.empty()) continue;
    COCONET_CUDA(ncclBroadcast(x + mine.begin * inner, y + p.begin * inner, size_t(p.size() * inner),
                               NcclType<T>::t, q, c.comm, c.stream));
  }
}

// This rank's slice of a replicated x: no communication.
template <class T>
void scatter_copy(const T* x, T* y, int64_t outer, int64_t n, int64_t inner, const Ctx& c) {
  Range sl = slice_range(n, c.group.size, c.group.rank);
  if (sl.empty() || outer == 0) return;
  const size_t w = size_t(sl.size() * inner) * sizeof(T);
  COCONET_CUDA(cudaMemcpy2DAsync(y, w, x + sl.begin * inner, size_t(n * inner) * sizeof(T), w, size_t(outer),
                                 cudaMemcpyDeviceToDevice, c.stream));
}

template <class T>
void broadcast(const T* x, T* y, int64_t n, int root, const Ctx& c) {
  COCONET_CUDA(ncclBroadcast(x, y, size_t(n), NcclType<T>::t, root, c.comm, c.stream));
}

// The reduction on root; the other ranks keep x.
template <class T>
void reduce(ncclRedOp_t op, const T* x, T* y, int64_t n, int root, const Ctx& c) {
  if (c.group.rank != root && x != y)
    COCONET_CUDA(cudaMemcpyAsync(y, x, size_t(n) * sizeof(T), cudaMemcpyDeviceToDevice, c.stream));
  COCONET_CUDA(ncclReduce(x, y, size_t(n), NcclType<T>::t, op, root, c.comm, c.stream));
}

// send(x, next|prev): the same in-group rank of the next (previous) group gets x; the first
// (last) group receives zeros. Grouped ncclSend/ncclRecv on the world communicator.
template <class T>
void send_shift(const T* x, T* y, int64_t n, bool next, const Ctx& c) {
  const int gs = c.wsize / c.groups, g = c.wrank / gs;
  const int to = next ? g + 1 : g - 1, from = next ? g - 1 : g + 1;
  const bool has_to = to >= 0 && to < c.groups, has_from = from >= 0 && from < c.groups;
  if (!has_from) COCONET_CUDA(cudaMemsetAsync(y, 0, size_t(n) * sizeof(T), c.stream));
  if (!has_to && !has_from) return;
  Group_ grp;
  if (has_to) COCONET_CUDA(ncclSend(x, size_t(n), NcclType<T>::t, to * gs + c.wrank % gs, c.world, c.stream));
  if (has_from) COCONET_CUDA(ncclRecv(y, size_t(n), NcclType<T>::t, from * gs + c.wrank % gs, c.world, c.stream));
}

template <class T>
void copy(const T* src, T* dst, int64_t n, const Ctx& c) {
  if (n > 0 && src != dst)
    COCONET_CUDA(cudaMemcpyAsync(dst, src, size_t(n) * sizeof(T), cudaMemcpyDeviceToDevice, c.stream));
}

// reshape: this rank's n elements copied as they are, after the host-side check of the sizes and
// slices (slices.h: reshape_problem), as kernels.h's.
template <class T>
void reshape(const T* x, T* y, int64_t n, int64_t n_in, int64_t n_out, int64_t whole, int64_t part, int64_t rest,
             int64_t ranks, const char* what, const Ctx& c) {
  const std::string why = reshape_problem(n_in, n_out, whole, part, rest, ranks, what);
  require(why.empty(), why);
  copy(x, y, n, c);
}

// ---- scattered tensors: copies, NCCL per piece, segment_norm ------------------------------------

// Contiguous src[0, n) into the logical range [0, n) of dst's segments.
template <class T>
void copy_in(const T* src, const Segments<T>& dst, int64_t n, const Ctx& c) {
  for (const Piece& pc : pieces(dst.starts, 0, n))
    COCONET_CUDA(cudaMemcpyAsync(dst.at(pc), src + pc.offset, size_t(pc.size) * sizeof(T), cudaMemcpyDeviceToDevice,
                                 c.stream));
}

// y[0, N) = the reduction over ranks of every segment of x: one grouped ncclAllReduce per segment.
template <class T>
void allreduce(ncclRedOp_t op, const Segments<T>& x, T* y, const Ctx& c) {
  Group_ g;
  for (size_t s = 0; s < x.ptrs.size(); ++s)
    if (x.sizes[s] > 0)
      COCONET_CUDA(ncclAllReduce(x.ptrs[s], y + x.starts[s], size_t(x.sizes[s]), NcclType<T>::t, op, c.comm, c.stream));
}

// y: this rank's slice of the logical [0, n) reduced over ranks; one grouped ncclReduce per piece of
// every rank's slice, to that rank (a non-root's receive buffer is its own piece: NCCL ignores it).
template <class T>
void reduce_scatter(ncclRedOp_t op, const Segments<T>& x, T* y, int64_t n, const Ctx& c) {
  const int R = c.group.size;
  Group_ g;
  for (int r = 0; r < R; ++r) {
    const Range sl = slice_range(n, R, r);
    for (const Piece& pc : pieces(x.starts, sl.begin, sl.end))
      COCONET_CUDA(ncclReduce(x.at(pc), r == c.group.rank ? y + pc.offset : x.at(pc), size_t(pc.size), NcclType<T>::t,
                              op, r, c.comm, c.stream));
  }
}

// Every rank's slice x of the logical [0, n) straight into the segments of y: one grouped
// ncclBroadcast per piece, in place on the receivers.
template <class T>
void allgather(const T* x, const Segments<T>& y, int64_t n, const Ctx& c) {
  const int R = c.group.size;
  Group_ g;
  for (int r = 0; r < R; ++r) {
    const Range sl = slice_range(n, R, r);
    for (const Piece& pc : pieces(y.starts, sl.begin, sl.end))
      COCONET_CUDA(ncclBroadcast(r == c.group.rank ? x + pc.offset : y.at(pc), y.at(pc), size_t(pc.size),
                                 NcclType<T>::t, r, c.comm, c.stream));
  }
}

// sq[s] += the sum of squares of x's elements in segment s, x holding the logical range
// [off, off + n) (contiguous, or a scattered tensor's segments): a block reduction per piece.
template <class T>
void segment_partial(const T* x, int64_t n, int64_t off, const std::vector<int64_t>& starts, double* sq,
                     const Ctx& c) {
  for (const Piece& pc : pieces(starts, off, off + n)) partial_sum<T, true>(x + pc.offset, pc.size, sq + pc.segment, c);
}
template <class T>
void segment_partial(const Segments<T>& x, int64_t n, int64_t off, const std::vector<int64_t>& starts, double* sq,
                     const Ctx& c) {
  for (const Piece& pc : pieces(starts, off, off + n)) partial_sum<T, true>(x.at(pc), pc.size, sq + pc.segment, c);
}

// out[i] = sqrt(sq[the segment holding logical element off + i]), i in [0, n): a fill kernel per piece.
template <class T>
void segment_norm_fill(const double* sq, T* out, int64_t n, int64_t off, const std::vector<int64_t>& starts,
                       const Ctx& c) {
  for (const Piece& pc : pieces(starts, off, off + n)) {
    T* o = out + pc.offset;
    const double* q = sq + pc.segment;
    COCONET_ACCESS(COCONET_R(q, 0, 1), COCONET_W(o, 0, pc.size));
    launch(pc.size, c.stream, [=] __device__ (int64_t j) {
      o[j] = from_compute<T>(static_cast<compute_t<T>>(sqrt(q[0])));
    });
  }
}

// out[i] = the L2 norm of the segment holding logical element off + i, i in [0, n): a block
// reduction per piece into a double per segment, the ranks' sums added when x is sliced
// (cross_rank), then a fill kernel per piece. X: const T* or Segments<T>.
template <class T, class X>
void segment_norm(const X& x, T* out, int64_t n, int64_t off, const std::vector<int64_t>& starts, bool cross_rank,
                  const Ctx& c, int site) {
  const size_t nseg = starts.size() - 1;
  double* sq = scratch<double>(site, int64_t(nseg));
  COCONET_BUFFER(sq, (nseg > 0 ? nseg : 1) * sizeof(double), "segment_norm partial sums");
  COCONET_CUDA(cudaMemsetAsync(sq, 0, (nseg > 0 ? nseg : 1) * sizeof(double), c.stream));
  segment_partial(x, n, off, starts, sq, c);
  if (cross_rank && nseg > 0)
    COCONET_CUDA(ncclAllReduce(sq, sq, nseg, ncclFloat64, ncclSum, c.comm, c.stream));
  segment_norm_fill(sq, out, n, off, starts, c);
}

// Block r of dim n of src [outer, n, inner], packed as [outer, |r|, inner] into P.
template <class T>
void pack(const T* src, T* P, int64_t outer, int64_t n, int64_t inner, Range r, cudaStream_t s) {
  if (r.empty() || outer == 0 || inner == 0) return;
  const size_t w = size_t(r.size() * inner) * sizeof(T);
  COCONET_CUDA(cudaMemcpy2DAsync(P, w, src + r.begin * inner, size_t(n * inner) * sizeof(T), w, size_t(outer),
                                 cudaMemcpyDeviceToDevice, s));
}

// Chunk r of dim n, packed as [outer, |r|, inner] in P, into its block of dst [outer, n, inner].
template <class T>
void unpack(const T* P, T* dst, int64_t outer, int64_t n, int64_t inner, Range r, cudaStream_t s) {
  if (r.empty() || outer == 0 || inner == 0) return;
  const size_t w = size_t(r.size() * inner) * sizeof(T);
  COCONET_CUDA(cudaMemcpy2DAsync(dst + r.begin * inner, size_t(n * inner) * sizeof(T), P, w, w, size_t(outer),
                                 cudaMemcpyDeviceToDevice, s));
}

// ---- a fused collective's reductions, accumulated chunk by chunk (Fused.partials) ------------
//
// One array of doubles per fused unit, accumulated by the chunks' partial_sum / partial_extreme /
// segment_partial calls on the call's stream: first `sums` partial sums (a sum or a norm: one; a
// segment_norm: one per segment; the `whole` sums and norms first, then the segments'), then a
// pair per max/min (extreme_acc's acc[0], acc[1]), then the block parts partial_extreme folds
// through (shared: the partial kernels run in stream order).
// After the last chunk, combine() adds the sums across the group and takes the pairs' ncclMax (NaN
// as the flag, min as the max of its negation: as reduce_extreme), in one grouped call; then
// finish_sum / finish_extreme / segment_norm_fill write the results.
struct Partials {
  double* acc;
  int64_t sums, extremes, whole;
  double* sum(int64_t at) const { return acc + at; }
  double* extreme(int64_t e) const { return acc + sums + 2 * e; }
  double* parts() const { return acc + sums + 2 * extremes; }
};

// The accumulators of fused unit `name` (whole sums and norms, segments' sums, max/min pairs),
// initialized on the call's stream (sums 0, extremes none yet).
inline Partials partials(int site, int64_t whole, int64_t segment_sums, int64_t extremes, const char* name,
                         const Ctx& c) {
  const int64_t sums = whole + segment_sums;
  const int64_t n = sums + 2 * extremes + (extremes > 0 ? 2 * kExtremeBlocks : 0);
  const Partials p{scratch<double>(site, n), sums, extremes, whole};
  COCONET_BUFFER(p.acc, size_t(n) * sizeof(double), std::string("the partial results of fused ") + name);
  (void)name;
  if (sums > 0) COCONET_CUDA(cudaMemsetAsync(p.acc, 0, size_t(sums) * sizeof(double), c.stream));
  for (int64_t e = 0; e < extremes; ++e) extreme_init(p.extreme(e), c);
  return p;
}

// Every rank's partial results combined, in place: one grouped call of one or two ncclAllReduce.
// In a batch (batch.cuh) the whole sums and the extremes over every call's too; each segment's
// norm only across ranks (its segments are the call's own parameters), as on the CPU.
inline void combine(const Partials& p, const Ctx& c) {
  if (Batch* b = current_batch()) {
    if (p.whole > 0) combine_calls(*b, batch_slot(), p.acc, p.whole, true, false, c);
    if (p.extremes > 0) combine_calls(*b, batch_slot(), p.extreme(0), 2 * p.extremes, true, true, c);
    if (p.sums > p.whole)
      COCONET_CUDA(ncclAllReduce(p.sum(p.whole), p.sum(p.whole), size_t(p.sums - p.whole), ncclFloat64, ncclSum,
                                 c.comm, c.stream));
    return;
  }
  Group_ g;
  if (p.sums > 0) COCONET_CUDA(ncclAllReduce(p.acc, p.acc, size_t(p.sums), ncclFloat64, ncclSum, c.comm, c.stream));
  if (p.extremes > 0)
    COCONET_CUDA(ncclAllReduce(p.extreme(0), p.extreme(0), size_t(2 * p.extremes), ncclFloat64, ncclMax, c.comm,
                               c.stream));
}

// ---- fused collectives: chunk by chunk on two streams ---------------------------------------
//
// This rank's slice (outermost dim) of the reduced value, [0, mine) elements, is cut into chunks.
// The reduction of chunk k+1 runs on the comm stream while chunk k computes on the call's stream;
// each computed chunk's gathered piece goes out on the comm stream after an event. The reduction
// of one chunk is a grouped ncclReduce per rank (each rank's slice part of that chunk, to that
// rank), so uneven slices need no padding; the gather is a grouped ncclBroadcast per rank.
//   reduce_to(k, buf): issue chunk k's reduction into buf on the comm stream
//   compute(k, lo, hi, red): queue chunk k's kernel (local elements [lo, hi), red[i - lo])
//   gather(k, lo): issue chunk k's gather on the comm stream
//   source(k): chunk k's own elements, for a group of one rank (the reduction over one rank is
//     the value itself and the gather is in place): then each chunk's kernel reads the source
//     directly on the call's stream; nothing is copied, reduced or gathered (nullptr: no such
//     source, e.g. a scattered one, and one rank goes the general way)
template <class T, class RF, class CF, class GF, class SF = std::nullptr_t>
void pipeline(int64_t chunks, T* red0, T* red1, const Ctx& c, int site, RF reduce_to, CF compute, GF gather,
              SF source = nullptr) {
  if (chunks <= 0) return;
  if constexpr (!std::is_same<SF, std::nullptr_t>::value) {
    if (c.group.size == 1) {
      for (int64_t k = 0; k < chunks; ++k) compute(k, source(k));
      return;
    }
  }
  cudaEvent_t start = event(site), done = event(site + 1), red_ev[2] = {event(site + 2), event(site + 3)},
              comp_ev[2] = {event(site + 4), event(site + 5)};
  T* red[2] = {red0, red1};
  COCONET_CUDA(cudaEventRecord(start, c.stream));
  COCONET_CUDA(cudaStreamWaitEvent(c.comm_stream, start, 0));
  reduce_to(0, red[0]);
  COCONET_CUDA(cudaEventRecord(red_ev[0], c.comm_stream));
  for (int64_t k = 0; k < chunks; ++k) {
    const int b = int(k % 2), nb = 1 - b;
    if (k + 1 < chunks) {
      reduce_to(k + 1, red[nb]);
      COCONET_CUDA(cudaEventRecord(red_ev[nb], c.comm_stream));
    }
    COCONET_CUDA(cudaStreamWaitEvent(c.stream, red_ev[b], 0));
    compute(k, red[b]);
    COCONET_CUDA(cudaEventRecord(comp_ev[b], c.stream));
    // chunk k is computed: its gather may read it, and buffer b is free for chunk k + 2
    COCONET_CUDA(cudaStreamWaitEvent(c.comm_stream, comp_ev[b], 0));
    gather(k);
  }
  COCONET_CUDA(cudaEventRecord(done, c.comm_stream));
  COCONET_CUDA(cudaStreamWaitEvent(c.stream, done, 0));
}

// Chunk k of this rank's slice part: reduce each rank's piece [r's begin + k*CH, ...) to r.
template <class T>
void reduce_chunk(ncclRedOp_t op, const T* x, T* red, int64_t n, int64_t inner, int64_t k, int64_t ch, const Ctx& c) {
  const int R = c.group.size;
  Group_ g;
  for (int r = 0; r < R; ++r) {
    Range sl = slice_range(n, R, r);
    const int64_t size = sl.size() * inner, lo = k * ch;
    if (lo >= size) continue;
    const int64_t cnt = size - lo < ch ? size - lo : ch;
    COCONET_CUDA(ncclReduce(x + sl.begin * inner + lo, red, size_t(cnt), NcclType<T>::t, op, r, c.comm, c.comm_stream));
  }
}

// The same over a scattered x (logical [0, n), 1-D): each rank's chunk is reduced piece by piece
// (one ncclReduce per piece inside one segment), grouped.
template <class T>
void reduce_chunk(ncclRedOp_t op, const Segments<T>& x, T* red, int64_t n, int64_t k, int64_t ch, const Ctx& c) {
  const int R = c.group.size;
  Group_ g;
  for (int r = 0; r < R; ++r) {
    const Range sl = slice_range(n, R, r);
    const int64_t lo = sl.begin + k * ch, hi = std::min(sl.end, lo + ch);
    for (const Piece& pc : pieces(x.starts, lo, hi))
      COCONET_CUDA(ncclReduce(x.at(pc), red + pc.offset, size_t(pc.size), NcclType<T>::t, op, r, c.comm, c.comm_stream));
  }
}

// Chunk k of every rank's slice part of the gathered value y (full size), each from its rank.
template <class T>
void gather_chunk(T* y, int64_t n, int64_t inner, int64_t k, int64_t ch, const Ctx& c) {
  const int R = c.group.size;
  Group_ g;
  for (int r = 0; r < R; ++r) {
    Range sl = slice_range(n, R, r);
    const int64_t size = sl.size() * inner, lo = k * ch;
    if (lo >= size) continue;
    const int64_t cnt = size - lo < ch ? size - lo : ch;
    T* at = y + sl.begin * inner + lo;
    COCONET_CUDA(ncclBroadcast(at, at, size_t(cnt), NcclType<T>::t, r, c.comm, c.comm_stream));
  }
}

// ---- fused collectives sliced along a dim other than the outermost --------------------------------
//
// The reduced value is [outer, n, inner] sliced along n; a rank's slice part is [outer, |slice|,
// inner] (local linear index l), cut into chunks of ch local elements as above. A chunk's local
// range [lo, hi) is one run of contiguous global elements per outer index it touches:
// f(global start, offset in the chunk, count) for each.
template <class F>
void chunk_runs(int64_t outer, int64_t n, int64_t inner, Range sl, int64_t lo, int64_t hi, F f) {
  const int64_t S = sl.size() * inner;
  if (S <= 0) return;
  for (int64_t o = lo / S; o < outer && o * S < hi; ++o) {
    const int64_t a = std::max(lo, o * S), b = std::min(hi, (o + 1) * S);
    if (b > a) f((o * n + sl.begin) * inner + (a - o * S), a - lo, b - a);
  }
}

// Chunk k of every rank's slice part of x [outer, n, inner], reduced to that rank into red:
// one grouped ncclReduce per run.
template <class T>
void reduce_chunk(ncclRedOp_t op, const T* x, T* red, int64_t outer, int64_t n, int64_t inner, int64_t k, int64_t ch,
                  const Ctx& c, int64_t row0 = 0, int64_t row1 = -1) {
  const int R = c.group.size;
  if (row1 < 0) row1 = outer;
  Group_ g;
  for (int r = 0; r < R; ++r) {
    const Range sl = slice_range(n, R, r);
    const int64_t S = sl.size() * inner, lo = row0 * S + k * ch, hi = std::min(row1 * S, lo + ch);
    chunk_runs(outer, n, inner, sl, lo, hi, [&](int64_t at, int64_t o, int64_t cnt) {
      COCONET_CUDA(ncclReduce(x + at, red + o, size_t(cnt), NcclType<T>::t, op, r, c.comm, c.comm_stream));
    });
  }
}

// Chunk k of every rank's slice part of the gathered y [outer, n, inner] (the rank's kernel wrote
// its part at its global place), from that rank, in place: one grouped ncclBroadcast per run.
template <class T>
void gather_chunk(T* y, int64_t outer, int64_t n, int64_t inner, int64_t k, int64_t ch, const Ctx& c,
                  int64_t row0 = 0, int64_t row1 = -1) {
  const int R = c.group.size;
  if (row1 < 0) row1 = outer;
  Group_ g;
  for (int r = 0; r < R; ++r) {
    const Range sl = slice_range(n, R, r);
    const int64_t S = sl.size() * inner, lo = row0 * S + k * ch, hi = std::min(row1 * S, lo + ch);
    chunk_runs(outer, n, inner, sl, lo, hi, [&](int64_t at, int64_t, int64_t cnt) {
      COCONET_CUDA(ncclBroadcast(y + at, y + at, size_t(cnt), NcclType<T>::t, r, c.comm, c.comm_stream));
    });
  }
}

#ifdef COCONET_EMULATE
// For the race detection: the runs of this rank's chunk [lo, hi) in the gathered y, written by the
// chunk's kernel (COCONET_ACCESS_RUNS: those spans with the listed ones).
template <class T>
std::vector<emu::Span> runs_w(T* y, int64_t outer, int64_t n, int64_t inner, Range sl, int64_t lo, int64_t hi) {
  std::vector<emu::Span> out;
  chunk_runs(outer, n, inner, sl, lo, hi, [&](int64_t at, int64_t, int64_t cnt) { out.push_back(emu::W(y, at, at + cnt)); });
  return out;
}
inline std::vector<emu::Span> with_spans(std::vector<emu::Span> a, const std::vector<emu::Span>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}
#define COCONET_ACCESS_RUNS(runs, ...) ::coconet::cuda::emu::declare(::coconet::cuda::with_spans({__VA_ARGS__}, runs))
#else
#define COCONET_ACCESS_RUNS(runs, ...)
#endif

// ---- scattered tensors: fused all-reduce, sum/norm, packed collectives ---------------------------

// Chunk k of the logical [0, n) of a scattered x, all-reduced into red: one grouped ncclAllReduce
// per piece of the chunk inside one segment, on the comm stream (a fused all-reduce's reduce_to).
template <class T>
void allreduce_chunk(ncclRedOp_t op, const Segments<T>& x, T* red, int64_t n, int64_t k, int64_t ch, const Ctx& c) {
  const int64_t lo = k * ch, hi = std::min(n, lo + ch);
  Group_ g;
  for (const Piece& pc : pieces(x.starts, lo, hi))
    COCONET_CUDA(ncclAllReduce(x.at(pc), red + pc.offset, size_t(pc.size), NcclType<T>::t, op, c.comm, c.comm_stream));
}

// dst[0] = sum (or L2 norm) of the logical [0, n) of a scattered x: a block reduction per piece
// into one double, the ranks' partial sums added when x is sliced (cross_rank), as reduce_sum.
template <class T, bool NORM>
void reduce_sum(const Segments<T>& x, T* dst, int64_t n, bool cross_rank, const Ctx& c, int site) {
  double* acc = scratch<double>(site, 1);
  COCONET_CUDA(cudaMemsetAsync(acc, 0, sizeof(double), c.stream));
  for (const Piece& pc : pieces(x.starts, 0, n)) partial_sum<T, NORM>(x.at(pc), pc.size, acc, c);
  reduce_across(acc, 1, cross_rank, false, c);
  finish_sum<T, NORM>(acc, dst, c);
}

// max (MAX) or min of the logical [0, n) of a scattered x, a block reduction per piece, as reduce_extreme.
template <class T, bool MAX>
void reduce_extreme(const Segments<T>& x, T* dst, int64_t n, bool cross_rank, const Ctx& c, int site) {
  double* acc = extreme_acc(site, c);
  for (const Piece& pc : pieces(x.starts, 0, n)) partial_extreme<T, MAX>(x.at(pc), pc.size, acc, c);
  reduce_across(acc, 2, cross_rank, true, c);
  finish_extreme<T, MAX>(acc, dst, c);
}

// Root's scattered x into every rank's contiguous y[0, n): one grouped ncclBroadcast per piece.
template <class T>
void broadcast(const Segments<T>& x, T* y, int64_t n, int root, const Ctx& c) {
  Group_ g;
  for (const Piece& pc : pieces(x.starts, 0, n))
    COCONET_CUDA(ncclBroadcast(x.at(pc), y + pc.offset, size_t(pc.size), NcclType<T>::t, root, c.comm, c.stream));
}

// The reduction of a scattered x on root into y[0, n), one grouped ncclReduce per piece; the other
// ranks keep x (copied piece by piece).
template <class T>
void reduce(ncclRedOp_t op, const Segments<T>& x, T* y, int64_t n, int root, const Ctx& c) {
  const std::vector<Piece> ps = pieces(x.starts, 0, n);
  if (c.group.rank != root)
    for (const Piece& pc : ps)
      COCONET_CUDA(cudaMemcpyAsync(y + pc.offset, x.at(pc), size_t(pc.size) * sizeof(T), cudaMemcpyDeviceToDevice,
                                   c.stream));
  Group_ g;
  for (const Piece& pc : ps)
    COCONET_CUDA(ncclReduce(x.at(pc), y + pc.offset, size_t(pc.size), NcclType<T>::t, op, root, c.comm, c.stream));
}

// This rank's slice of a replicated scattered x (logical [0, n)) into y: a copy per piece.
template <class T>
void scatter_copy(const Segments<T>& x, T* y, int64_t n, const Ctx& c) {
  const Range sl = slice_range(n, c.group.size, c.group.rank);
  for (const Piece& pc : pieces(x.starts, sl.begin, sl.end))
    COCONET_CUDA(cudaMemcpyAsync(y + pc.offset, x.at(pc), size_t(pc.size) * sizeof(T), cudaMemcpyDeviceToDevice,
                                 c.stream));
}

// send(x, next|prev) of a scattered x, as send_shift: a grouped ncclSend per piece, received into
// the matching piece of y (every rank's segments have the same sizes).
template <class T>
void send_shift(const Segments<T>& x, T* y, int64_t n, bool next, const Ctx& c) {
  const int gs = c.wsize / c.groups, g = c.wrank / gs;
  const int to = next ? g + 1 : g - 1, from = next ? g - 1 : g + 1;
  const bool has_to = to >= 0 && to < c.groups, has_from = from >= 0 && from < c.groups;
  if (!has_from) COCONET_CUDA(cudaMemsetAsync(y, 0, size_t(n) * sizeof(T), c.stream));
  if (!has_to && !has_from) return;
  Group_ grp;
  for (const Piece& pc : pieces(x.starts, 0, n)) {
    if (has_to)
      COCONET_CUDA(ncclSend(x.at(pc), size_t(pc.size), NcclType<T>::t, to * gs + c.wrank % gs, c.world, c.stream));
    if (has_from)
      COCONET_CUDA(ncclRecv(y + pc.offset, size_t(pc.size), NcclType<T>::t, from * gs + c.wrank % gs, c.world,
                            c.stream));
  }
}

// ---- layernorm with a computed eps ---------------------------------------------------------------

// layernorm over the last dim whose eps is a computed 0-d value in device memory: layernorm_rows.
template <class T, class E>
void layernorm(const T* x, const T* g, const T* b, const E* eps, int64_t rows, int64_t H, T* y, const Ctx& c) {
  COCONET_ACCESS(COCONET_R(x, 0, rows * H), COCONET_R(g, 0, H), COCONET_R(b, 0, H), COCONET_R(eps, 0, 1),
                 COCONET_W(y, 0, rows * H));
  layernorm_rows(x, g, b, eps, rows, H, y, c);
}

// ---- communicators -----------------------------------------------------------------------------

inline std::string unique_id() {
  ncclUniqueId id;
  COCONET_CUDA(ncclGetUniqueId(&id));
  return std::string(id.internal, sizeof(id.internal));
}

inline uintptr_t comm_init(const std::string& id_bytes, int nranks, int rank) {
  require(id_bytes.size() == sizeof(ncclUniqueId), "an NCCL unique id is 128 bytes");
  ncclUniqueId id;
  std::memcpy(id.internal, id_bytes.data(), sizeof(id.internal));
  ncclComm_t comm;
  COCONET_CUDA(ncclCommInitRank(&comm, nranks, id, rank));
  return reinterpret_cast<uintptr_t>(comm);
}

inline void comm_destroy(uintptr_t comm) { COCONET_CUDA(ncclCommDestroy(reinterpret_cast<ncclComm_t>(comm))); }

}  // namespace cuda
}  // namespace coconet

// ncclCommAbort on a communicator of this module (its NcclComm.handle), callable while a call of
// the module is blocked on it (from another thread, through ctypes: the Python runtime's abort
// path, coconetc/runtime/cuda.py); returns the ncclResult_t.
extern "C" __attribute__((visibility("default"), used)) inline int coconet_nccl_comm_abort(uintptr_t comm) {
  return int(ncclCommAbort(reinterpret_cast<ncclComm_t>(comm)));
}

// The communicator's asynchronous error (ncclCommGetAsyncError), 0 for none, its text in buf: for
// the Python runtime's watchdog, which polls it while the communicator lives (a GPU call returns
// before its collectives run, so their errors surface only here).
extern "C" __attribute__((visibility("default"), used)) inline int coconet_nccl_async_error(uintptr_t comm, char* buf,
                                                                                          int len) {
  ncclResult_t r = ncclSuccess;
  const ncclResult_t q = ncclCommGetAsyncError(reinterpret_cast<ncclComm_t>(comm), &r);
  if (q != ncclSuccess) r = q;
  if (r != ncclSuccess && len > 0) std::snprintf(buf, size_t(len), "%s", ncclGetErrorString(r));
  return int(r);
}

// Events for the same watchdog, which times each call's work on the GPU (a call returns before its
// collectives run, so one whose peers never join would otherwise hang the next synchronization
// untimed): after a call's work is queued, an event of a small pool is recorded on its stream
// (never waited for) and queried until it completes or the call's time is up. Handles are
// cudaEvent_t as integers; 0 from create: none could be made. create writes the device it was
// made on (the caller's current one), which query and destroy make current on the watchdog's
// thread first (once; device -1: never, on the caller's thread), so that that thread does not
// make a context of its own on device 0.
namespace coconet {
namespace cuda {
inline cudaError_t event_thread_device(int device) {
  static thread_local int current = -1;
  if (device < 0 || current == device) return cudaSuccess;
  const cudaError_t r = cudaSetDevice(device);
  if (r == cudaSuccess) current = device;
  return r;
}
}  // namespace cuda
}  // namespace coconet
extern "C" __attribute__((visibility("default"), used)) inline uintptr_t coconet_event_create(int* device) {
  cudaEvent_t e = nullptr;
  if (cudaGetDevice(device) != cudaSuccess) return 0;
  return cudaEventCreateWithFlags(&e, cudaEventDisableTiming) == cudaSuccess ? reinterpret_cast<uintptr_t>(e) : 0;
}
// The cudaError_t of cudaEventRecord(event, stream).
extern "C" __attribute__((visibility("default"), used)) inline int coconet_event_record(uintptr_t event,
                                                                                      uintptr_t stream) {
  return int(cudaEventRecord(reinterpret_cast<cudaEvent_t>(event), reinterpret_cast<cudaStream_t>(stream)));
}
// 0: the work before the event completed; 1: not yet (cudaErrorNotReady); else the cudaError_t of
// cudaEventQuery (a failed kernel: the device's error), its text in buf.
extern "C" __attribute__((visibility("default"), used)) inline int coconet_event_query(uintptr_t event, int device,
                                                                                     char* buf, int len) {
  const cudaError_t set = coconet::cuda::event_thread_device(device);
  if (set != cudaSuccess) {
    if (len > 0) std::snprintf(buf, size_t(len), "cudaSetDevice(%d): %s", device, cudaGetErrorString(set));
    return int(set);
  }
  const cudaError_t r = cudaEventQuery(reinterpret_cast<cudaEvent_t>(event));
  if (r == cudaErrorNotReady) {
    (void)cudaGetLastError();  // not an error: cleared, as PyTorch's CUDAEvent::query does
    return 1;
  }
  if (r != cudaSuccess && len > 0) std::snprintf(buf, size_t(len), "%s", cudaGetErrorString(r));
  return int(r);
}
extern "C" __attribute__((visibility("default"), used)) inline int coconet_event_destroy(uintptr_t event, int device) {
  const cudaError_t set = coconet::cuda::event_thread_device(device);
  return int(set != cudaSuccess ? set : cudaEventDestroy(reinterpret_cast<cudaEvent_t>(event)));
}

// The fused collective as one kernel over symmetric memory (NCCL device API), chosen at run time.
#include "symmetric.cuh"
// The tensor operations a derived (vector-Jacobian) program adds.
#include "grad.cuh"
