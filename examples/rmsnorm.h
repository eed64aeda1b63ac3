// A small C++ library with one row operation, called by examples/extern_ops.ccn through its
// `extern op rmsnorm` declaration. The calling convention is coconet's for extern operations
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

}  // namespace cclib
