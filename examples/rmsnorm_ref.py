"""The Python reference of examples/rmsnorm.h's rmsnorm, named by the `reference` of the
`extern op rmsnorm` declaration in examples/extern_ops.ccn. The interpreter calls it on NumPy
arrays (each rank's operands, in the result's compute dtype), so every equivalence check of a
program or schedule that calls rmsnorm runs it."""

import numpy as np


def rmsnorm(x, w, eps):
    """RMSNorm over the last dim: x / sqrt(mean(x**2) + eps) * w."""
    x64 = np.asarray(x, dtype=np.float64)
    ms = np.mean(x64 * x64, axis=-1, keepdims=True) if x64.shape[-1] else np.zeros(x64.shape[:-1] + (1,))
    return (x64 / np.sqrt(ms + float(eps)) * np.asarray(w, dtype=np.float64)).astype(np.asarray(x).dtype)
