// coconet CUDA runtime: reductions on the device: max(x), min(x), sums and norms accumulated in double, row reductions (layernorm, softmax) (runtime.cuh includes every part, in order).
#pragma once

#include "pointwise.cuh"

namespace coconet {
namespace cuda {

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
COCONET_EMU void extreme_init(double* acc, const Ctx& c) {
  void (*init)(double*) = extreme_init_kernel<>;
  COCONET_ACCESS(COCONET_W(acc, 0, 2));
  COCONET_LAUNCH(init, 1, 1, 0, c.stream, acc);
  COCONET_CUDA(cudaGetLastError());
}

COCONET_EMU double* extreme_acc(int site, const Ctx& c) {
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
// rows), part the block's shared scratch for block_sum (in type A). The row is an I: int32_t where
// every index the rows' kernel forms fits (extent: the elements of its rows, 0 when not known:
// int64_t), else int64_t; f takes either (generic, or an int64_t parameter).
template <class A, class I, class F>
__global__ void rows_kernel(I rows, F f) {
  __shared__ A part[kRowThreads];
  for (I r = blockIdx.x; r < rows; r += I(gridDim.x)) f(r, part);
}
template <class A, class F>
void launch_rows(int64_t rows, int64_t extent, cudaStream_t s, F f) {
  if (rows <= 0) {
    COCONET_ACCESS();  // (emulation) no kernel: its declared ranges go with it
    return;
  }
  const int64_t blocks = std::min<int64_t>(rows, 65535);
  // the largest index: a row past the last (+ the grid), an element past the row's end (+ a block)
  if (extent > 0 && index32(std::max(rows, extent), blocks + kRowThreads)) {
    COCONET_COUNT_INDEX(32);
    void (*kernel)(int32_t, F) = rows_kernel<A, int32_t, F>;
    COCONET_LAUNCH(kernel, static_cast<unsigned>(blocks), kRowThreads, 0, s, int32_t(rows), f);
  } else {
    COCONET_COUNT_INDEX(64);
    void (*kernel)(int64_t, F) = rows_kernel<A, int64_t, F>;
    COCONET_LAUNCH(kernel, static_cast<unsigned>(blocks), kRowThreads, 0, s, rows, f);
  }
  COCONET_CUDA(cudaGetLastError());
}
template <class A, class F>
void launch_rows(int64_t rows, cudaStream_t s, F f) {
  launch_rows<A>(rows, 0, s, f);
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
  launch_rows<C>(rows, rows * H, c.stream, [=] __device__(auto r, C* part) {
    using I = decltype(r);
    T* const yr = y + r * I(H);
    layernorm_row_block(x + r * I(H), g, b, static_cast<C>(eps_value(eps)), H, part,
                        [&](int64_t j, C v) { yr[j] = from_compute<T>(v); });
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
  launch_rows<C>(rows, rows * H, c.stream, [=] __device__(auto r, C* part) {
    using I = decltype(r);
    const T* xr = x + r * I(H);
    T* const yr = y + r * I(H);
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
                  [&](int64_t j, C v) { yr[j] = from_compute<T>(v); });
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

}  // namespace cuda
}  // namespace coconet
