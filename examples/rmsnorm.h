// A small C++ library with two row operations, RMSNorm and its input gradient, called by
// examples/extern_ops.ccn through its `extern op rmsnorm` and `extern op rmsnorm_dx` declarations. The calling convention is coconet's for extern operations
// (docs/language.md, "Extern operations"): tensor operands as pointers to this rank's
// elements, 0-d operands as values, then the result and its shape as rows x last dim.
#pragma once

#include <cmath>
#include <cstdint>

namespace cclib {

// y[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w   (RMSNorm over the last dim)
template <class T, class C>
void rmsnorm(const T* x, const T* w, C eps, T* y, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    double ss = 0.0;
    for (int64_t c = 0; c < cols; ++c) ss += double(xr[c]) * double(xr[c]);
    const double inv = 1.0 / std::sqrt(ss / double(cols > 0 ? cols : 1) + double(eps));
    for (int64_t c = 0; c < cols; ++c) yr[c] = T(double(xr[c]) * inv * double(w[c]));
  }
}

// dx[r, :] = inv * g * w - x * inv^3 * mean(g * w * x)   with inv = 1 / sqrt(mean(x[r, :]^2) + eps)
// (RMSNorm's input gradient for the result's cotangent g)
template <class T, class C>
void rmsnorm_dx(const T* g, const T* x, const T* w, C eps, T* dx, int64_t rows, int64_t cols) {
  const double n = double(cols > 0 ? cols : 1);
  for (int64_t r = 0; r < rows; ++r) {
    const T* gr = g + r * cols;
    const T* xr = x + r * cols;
    T* dr = dx + r * cols;
    double ss = 0.0, dot = 0.0;
    for (int64_t c = 0; c < cols; ++c) {
      ss += double(xr[c]) * double(xr[c]);
      dot += double(gr[c]) * double(w[c]) * double(xr[c]);
    }
    const double inv = 1.0 / std::sqrt(ss / n + double(eps));
    const double k = inv * inv * inv * dot / n;
    for (int64_t c = 0; c < cols; ++c) dr[c] = T(inv * double(gr[c]) * double(w[c]) - double(xr[c]) * k);
  }
}

}  // namespace cclib
