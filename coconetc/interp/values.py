"""How the interpreter stores values: NumPy dtypes, compute dtypes, slices of a group. The
storage dtypes and the slice partition live in coconetc/ir (storage.py, slices.py; the loader uses them too)."""

from __future__ import annotations

import numpy as np

from coconetc.ir.dtypes import TABLE
from coconetc.ir.storage import STORAGE
from coconetc.ir.slices import slice_range, take_slice

__all__ = ["COMPUTE", "STORAGE", "TOLERANCE", "global_index", "slice_range", "take_slice"]

# f16 and bf16 compute in f32 inside a stage and are rounded when the stage is stored
# (as PyTorch's "opmath"); the generated code does the same.
COMPUTE = {n: STORAGE[d.compute] for n, d in TABLE.items()}
TOLERANCE = {n: d.tolerance for n, d in TABLE.items() if d.tolerance is not None}


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
