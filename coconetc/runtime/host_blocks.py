"""The host memory of CPU calls' outputs, kept: an output of MIN_BYTES or more is carved from a
block a freed output of the same size gave back, as PyTorch's CUDA caching allocator keeps
device memory (and for the same reason: fresh memory is slow).

Without it, every large output is fresh memory: glibc maps an allocation of 32 MiB or more
anew each time and unmaps it on free, so each call's first write to it page-faults on every
page (the attention call writing a GPT block's saved probabilities, 64 MiB at B=8, S=512, 8
heads a rank, took 100 to 261 ms instead of 38 to 59 in a third of its calls that way on a
virtual machine: docs/results/cpu_2026-12-06_host_cache.md). A kept block is written again at
memory speed.

A block goes back when the last array viewing it dies (its base is a _Lent whose __del__
returns the block; the return is an append, safe from any thread and at any point of a take).
At most COCONET_HOST_CACHE_MB megabytes of free blocks are kept (default: an eighth of the
machine's memory shared among the job's ranks on it; 0 turns the cache off): past it, the least
recently freed go back to the system. Memory in use is never held back: the cache holds only
outputs already freed. Takes are serialized by a lock (threads may call at once)."""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict

import numpy as np

MIN_BYTES = 1 << 20  # smaller outputs come from malloc's own free lists (no fresh pages)
_ALIGN = 64  # a cache line: an output starts on one, as the generated code's vector loads like

_returned: list[np.ndarray] = []  # blocks whose outputs died since the last take
_free: dict[int, list[np.ndarray]] = {}  # size -> free blocks of that size (the last freed last)
_lru: OrderedDict[int, int] = OrderedDict()  # id(free block) -> its size, the least recently freed first
_state = {"free_bytes": 0, "limit": -1}
_lock = threading.Lock()
# the launchers' count of this job's ranks on this machine (Open MPI, MPICH/Hydra, PMI)
_LOCAL_RANKS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE")


def limit() -> int:
    """The most bytes of free blocks kept (COCONET_HOST_CACHE_MB; read once)."""
    if _state["limit"] < 0:
        text = os.environ.get("COCONET_HOST_CACHE_MB", "").strip()
        if text:
            try:
                mb = float(text)
            except ValueError:
                raise ValueError(f"COCONET_HOST_CACHE_MB must be a number of megabytes, got {text!r}") from None
            if mb < 0:
                raise ValueError(f"COCONET_HOST_CACHE_MB must be 0 (no cache) or more, got {text!r}")
            _state["limit"] = int(mb * (1 << 20))
        else:
            local = next((int(v) for v in map(os.environ.get, _LOCAL_RANKS) if v and v.isdigit() and int(v) > 0), 1)
            _state["limit"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (8 * local)
    return _state["limit"]


class _Lent:
    """The base of an output carved from a block: gives the block back when the output (and
    every view of it) is gone."""

    def __init__(self, block: np.ndarray, nbytes: int):
        self.block = block
        at = block.ctypes.data
        self.__array_interface__ = {"data": (at + -at % _ALIGN, False), "shape": (nbytes,),
                                    "typestr": "|u1", "version": 3}

    def __del__(self) -> None:
        _returned.append(self.block)


def _file_returned() -> None:
    """Files the blocks returned since the last take, the least recently freed going back to the
    system past the limit."""
    cap = limit()
    while _returned:
        b = _returned.pop(0)
        _free.setdefault(b.nbytes, []).append(b)
        _lru[id(b)] = b.nbytes
        _state["free_bytes"] += b.nbytes
    while _state["free_bytes"] > cap and _lru:
        key, size = _lru.popitem(last=False)
        blocks = _free[size]
        i = next(i for i, b in enumerate(blocks) if id(b) == key)
        _state["free_bytes"] -= blocks.pop(i).nbytes


def empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialized array of this shape and dtype: from a kept block when it is large."""
    dtype = np.dtype(dtype)
    nbytes = dtype.itemsize * math.prod(shape)  # (not np.prod: 3 us, on every call's hot path)
    if nbytes < MIN_BYTES or limit() == 0:
        return np.empty(shape, dtype)
    size = nbytes + _ALIGN
    with _lock:
        if _returned or _state["free_bytes"] > _state["limit"]:
            _file_returned()
        blocks = _free.get(size)
        block = blocks.pop() if blocks else None
        if block is not None:
            del _lru[id(block)]
            _state["free_bytes"] -= size
    if block is None:
        block = np.empty(size, np.uint8)
    # (bytes viewed as the dtype: an __array_interface__ cannot name ml_dtypes' bfloat16)
    return np.asarray(_Lent(block, nbytes)).view(dtype).reshape(shape)


def kept_bytes() -> int:
    """The bytes of free blocks kept now (those returned since the last take included)."""
    return _state["free_bytes"] + sum(b.nbytes for b in _returned)


def release() -> int:
    """Every kept free block given back to the system (coconetc.empty_cache); the bytes released."""
    with _lock:
        _file_returned()
        freed = _state["free_bytes"]
        _free.clear()
        _lru.clear()
        _state["free_bytes"] = 0
    return freed
