"""The Python references of examples/rmsnorm.h's rmsnorm and rmsnorm_dx, named by the `reference` of the
`extern op` declarations in examples/extern_ops.ccn. The interpreter calls it on NumPy
arrays (each rank's operands, in the result's compute dtype), so every equivalence check of a
program or schedule that calls rmsnorm runs it."""

import numpy as np


def rmsnorm(x, w, eps):
    """RMSNorm over the last dim: x / sqrt(mean(x**2) + eps) * w."""
    x64 = np.asarray(x, dtype=np.float64)
    ms = np.mean(x64 * x64, axis=-1, keepdims=True) if x64.shape[-1] else np.zeros(x64.shape[:-1] + (1,))
    return (x64 / np.sqrt(ms + float(eps)) * np.asarray(w, dtype=np.float64)).astype(np.asarray(x).dtype)


def rmsnorm_dx(g, x, w, eps):
    """RMSNorm's input gradient over the last dim: with r = 1 / sqrt(mean(x**2) + eps),
    dx = r * g * w - x * r**3 * mean(g * w * x)."""
    x64, gw = np.asarray(x, dtype=np.float64), np.asarray(g, dtype=np.float64) * np.asarray(w, dtype=np.float64)
    n = max(x64.shape[-1], 1)
    r = 1.0 / np.sqrt(np.sum(x64 * x64, axis=-1, keepdims=True) / n + float(eps))
    dot = np.sum(gw * x64, axis=-1, keepdims=True) / n
    return (r * gw - x64 * r ** 3 * dot).astype(np.asarray(x).dtype)
