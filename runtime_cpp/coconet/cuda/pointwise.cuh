// coconet CUDA runtime: pointwise kernels (Lets once per thread, 16-byte vector accesses where aligned), launched over a Loop's elements (runtime.cuh includes every part, in order).
#pragma once

#include "core.cuh"
#include "batch.cuh"

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

// lo, lo + step, ... below hi, for a range-for in device code (I: the index type, as the kernel's).
template <class I>
struct StridedOf {
  I lo, hi, step;
  struct It {
    I i, step;
    COCONET_HD I operator*() const { return i; }
    COCONET_HD It& operator++() {
      i += step;
      return *this;
    }
    COCONET_HD bool operator!=(const It& e) const { return i < e.i; }
  };
  COCONET_HD It begin() const { return It{lo, step}; }
  COCONET_HD It end() const { return It{hi, step}; }
};
using Strided = StridedOf<int64_t>;

// One thread's share of the elements [0, n) of a pointwise kernel (see above; the symmetric
// kernel's SymThread offers the same two loops over its block's tiles), indexed in I: int32_t where
// every index the kernel forms fits (launch_threads decides), else int64_t. `index` names I for the
// kernel's lambda (generic: one body for both).
template <int V, class I = int64_t>
struct Thread {
  using index = I;
  I n = 0, first = 0, stride = 1;
  bool vec = false;
  // the first element of each whole group of V elements this thread takes (none unless vec)
  COCONET_HD StridedOf<I> vectors() const {
    return vec ? StridedOf<I>{I(first * V), I(n / V * V), I(stride * V)} : StridedOf<I>{0, 0, 1};
  }
  // the elements it takes one at a time: those past the last whole group, or all of them
  COCONET_HD StridedOf<I> elements() const { return StridedOf<I>{I((vec ? n / V * V : 0) + first), n, stride}; }
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

template <int V, class I, class F>
__global__ void threads_kernel(I n, bool vec, F f) {
  f(Thread<V, I>{n, I(blockIdx.x) * I(blockDim.x) + I(threadIdx.x), I(gridDim.x) * I(blockDim.x), vec});
}

// Whether a kernel over [0, n) whose threads step by `stride` elements may index in int32_t: every
// index it forms (an element, or one step past the last) is below n + stride. Decided at each
// launch; COCONET_INDEX32_LIMIT() is INT32_MAX (the emulation's may be set lower, to test both).
COCONET_EMU bool index32(int64_t n, int64_t stride) { return n + stride <= COCONET_INDEX32_LIMIT(); }

// This device's multiprocessors (asked once per device).
COCONET_EMU int sm_count() {
  static std::mutex mu;
  static std::map<int, int> sms;
  std::lock_guard<std::mutex> lock(mu);
  return per_device(sms, [](int dev) {
    int n = 0;
    COCONET_CUDA(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n > 0 ? n : 1;
  });
}

// f(th) once per thread of a grid over [0, n) on stream s (th: a Thread<V, I>, f generic over I:
// int32_t where index32 allows, else int64_t); vec: every operand is aligned<V> (the vector path).
// Blocks of 256 threads, as many as the work needs but at most 32 per multiprocessor (4 waves of 8
// resident blocks), so that a thread takes several vectors and its Lets are computed once for all
// of them.
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
  COCONET_COUNT_KERNEL(vec);
  if (index32(n, blocks * threads * V)) {
    COCONET_COUNT_INDEX(32);
    void (*kernel)(int32_t, bool, F) = threads_kernel<V, int32_t, F>;
    COCONET_LAUNCH(kernel, static_cast<unsigned>(blocks), threads, 0, s, int32_t(n), vec, f);
  } else {
    COCONET_COUNT_INDEX(64);
    void (*kernel)(int64_t, bool, F) = threads_kernel<V, int64_t, F>;
    COCONET_LAUNCH(kernel, static_cast<unsigned>(blocks), threads, 0, s, n, vec, f);
  }
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

}  // namespace cuda
}  // namespace coconet
