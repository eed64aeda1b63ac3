// The CUDA side of examples/rmsnorm.h: host functions that launch one block per row on the
// stream coconet passes last (extern operations' CUDA convention, docs/language.md). Pointers
// are device pointers to this rank's elements; eps comes by value.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace cclib {

template <class T, class C>
__global__ void rmsnorm_rows_kernel(const T* x, const T* w, C eps, T* y, int64_t cols) {
  extern __shared__ double partial[];
  const int64_t r = blockIdx.x;
  const T* xr = x + r * cols;
  T* yr = y + r * cols;
  double ss = 0.0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) ss += double(xr[c]) * double(xr[c]);
  partial[threadIdx.x] = ss;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();
  }
  const double inv = rsqrt(partial[0] / double(cols > 0 ? cols : 1) + double(eps));
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = T(double(xr[c]) * inv * double(w[c]));
}

template <class T, class C>
void rmsnorm_cuda(const T* x, const T* w, C eps, T* y, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows <= 0) return;
  constexpr unsigned threads = 256;
  rmsnorm_rows_kernel<T, C><<<unsigned(rows), threads, threads * sizeof(double), stream>>>(x, w, eps, y, cols);
}

// RMSNorm's input gradient (rmsnorm.h's rmsnorm_dx): two row sums, sum(x^2) and sum(g w x)
template <class T, class C>
__global__ void rmsnorm_dx_rows_kernel(const T* g, const T* x, const T* w, C eps, T* dx, int64_t cols) {
  extern __shared__ double partial[];  // [0, blockDim.x): sum(x^2); [blockDim.x, 2 blockDim.x): sum(g w x)
  const int64_t r = blockIdx.x;
  const T* gr = g + r * cols;
  const T* xr = x + r * cols;
  T* dr = dx + r * cols;
  double ss = 0.0, dot = 0.0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    ss += double(xr[c]) * double(xr[c]);
    dot += double(gr[c]) * double(w[c]) * double(xr[c]);
  }
  partial[threadIdx.x] = ss;
  partial[blockDim.x + threadIdx.x] = dot;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      partial[threadIdx.x] += partial[threadIdx.x + s];
      partial[blockDim.x + threadIdx.x] += partial[blockDim.x + threadIdx.x + s];
    }
    __syncthreads();
  }
  const double n = double(cols > 0 ? cols : 1);
  const double inv = rsqrt(partial[0] / n + double(eps));
  const double k = inv * inv * inv * partial[blockDim.x] / n;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) dr[c] = T(inv * double(gr[c]) * double(w[c]) - double(xr[c]) * k);
}

template <class T, class C>
void rmsnorm_dx_cuda(const T* g, const T* x, const T* w, C eps, T* dx, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows <= 0) return;
  constexpr unsigned threads = 256;
  rmsnorm_dx_rows_kernel<T, C><<<unsigned(rows), threads, 2 * threads * sizeof(double), stream>>>(g, x, w, eps, dx, cols);
}

}  // namespace cclib
