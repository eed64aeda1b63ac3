"""Symmetric windows: `window_empty`, a tensor registered as a window of an NCCL communicator,
which a fused collective's symmetric kernel (symmetric.cuh) reads in place."""

from __future__ import annotations

from typing import Any

import numpy as np

from coconetc.ir.storage import STORAGE
from coconetc.runtime import agree
from coconetc.runtime.layout import TORCH_DTYPES, checked_shape
from coconetc.runtime.nccl import NcclComm, exchange
from coconetc.runtime.watchdog import guarded


def window_empty(ext: Any, comm: NcclComm, shape: int | tuple[int, ...], dtype: str = "f32", *,
                 stream: Any = None) -> Any:
    """An uninitialised torch tensor of SHAPE and language DTYPE that a fused collective's
    symmetric kernel (symmetric.cuh) reads in place, where it would stage a copy of any other
    input: NCCL memory registered as a window of COMM (ncclMemAlloc, ncclCommWindowRegister)
    where the communicator can run that kernel (every rank on one node, NCCL's device API),
    else ordinary device memory. On the current CUDA device (under the host emulation: a CPU
    tensor in shared memory). Collective over COMM: every rank calls it together, with the
    same shape and dtype (checked on every rank, under the watchdog). Only a module's first 64
    windows on a communicator are read in place (symmetric.cuh: kSymUserWindows). The memory
    lives until the process ends, as coconetc.empty's windows do."""
    import ctypes
    import math

    import torch
    shape = checked_shape(shape, dtype, "window_empty")
    what = f"window_empty({shape}, {dtype!r})"
    mine = ("window_empty", shape, dtype)
    everyone = exchange(comm, mine, what, agree.timeout_s())
    bad = [r for r, x in enumerate(everyone) if x != mine]
    if bad:
        raise ValueError(f"{what}: rank {bad[0]} asks for {everyone[bad[0]][1]} {everyone[bad[0]][2]!r}; "
                         f"every rank must ask for the same shape and dtype")
    nbytes = math.prod(shape) * STORAGE[dtype].itemsize
    tdt = getattr(torch, TORCH_DTYPES[dtype])
    emulated = bool(getattr(ext, "emulated", False))
    if emulated:
        handle = 0
    else:
        st: Any = stream if stream is not None else torch.cuda.current_stream()
        handle = int(getattr(st, "cuda_stream", st))
    ptr = guarded(ext, comm, what, lambda: ext.window_empty(comm.handle, handle, nbytes), handle)
    comm.windows += 1
    if emulated:
        raw = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr)) if nbytes else \
            np.empty(0, np.uint8)
        return torch.from_numpy(raw).view(tdt).reshape(shape)

    class _Device:  # the bytes as a CUDA array (torch reads __cuda_array_interface__, no copy)
        __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                    "version": 3, "strides": None, "stream": None}
    if not nbytes:
        return torch.empty(shape, dtype=tdt, device=torch.device("cuda", torch.cuda.current_device()))
    return torch.as_tensor(_Device(), device="cuda").view(tdt).reshape(shape)
