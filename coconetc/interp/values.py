"""How the interpreter stores values: NumPy dtypes, compute dtypes, slices of a group. The
storage dtypes and the slice partition live in coconetc/ir (storage.py, slices.py; the loader uses them too)."""

from __future__ import annotations

import numpy as np

from coconetc.ir.storage import STORAGE
from coconetc.ir.slices import slice_range, take_slice

__all__ = ["COMPUTE", "STORAGE", "TOLERANCE", "global_index", "slice_range", "take_slice"]

# f16 and bf16 compute in f32 inside a stage and are rounded when the stage is stored
# (as PyTorch's "opmath"); the generated code does the same.
COMPUTE = {**STORAGE, "f16": np.dtype(np.float32), "bf16": np.dtype(np.float32)}
TOLERANCE = {"f16": (2e-2, 2e-2), "bf16": (6e-2, 6e-2), "f32": (2e-4, 1e-5),
             "f64": (1e-9, 1e-12), "i32": (0, 0), "i64": (0, 0)}


def global_index(gshape: tuple[int, ...], local_shape: tuple[int, ...], offsets: tuple[int, ...]) -> np.ndarray:
    """The flat index, in the global (logical) tensor, of every element of a local block."""
    idx = np.zeros(local_shape, dtype=np.int64)
    stride = 1
    for axis in reversed(range(len(gshape))):
        shape = [1] * len(gshape)
        shape[axis] = local_shape[axis]
        coord = np.arange(local_shape[axis], dtype=np.int64) + offsets[axis]
        idx = idx + coord.reshape(shape) * stride
        stride *= gshape[axis]
    return idx
