"""`coconetc.empty(shape, dtype, comm=...)`: arrays in MPI-3 shared memory, so that a fused
collective reads the peers' buffers in place instead of staging a copy (the CPU analogue of
NCCL's symmetric memory; runtime_cpp/coconet/fused_shm.h).

Each call allocates one window (`MPI_Win_allocate_shared`, collective over the ranks of COMM on
this node) and returns this rank's segment as a NumPy array or a torch tensor. The window is
registered here and told to every module call (`CallArgs.windows`: id, address, bytes, handle),
so the runtime can recognise a parameter that lives in one. A window lives until the process
ends (freeing it is collective, which a garbage collector cannot be).

`empty_node` makes one array for the whole node instead: every rank maps the same bytes (the
window's memory is the node's first rank's), and its id carries NODE_SHARED, so that a fused
collective whose gather target lies there skips the copies (every rank's part of the target
is already where every rank reads it; comm.h). DistributedOptimizer keeps one copy of the
weights per node this way where the schedule allows it (torch.py)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from coconetc.ir.storage import STORAGE
from coconetc.runtime.node_ranks import node_comm
from coconetc.runtime.layout import FRAMEWORKS, TORCH_DTYPES, checked_shape

_KEEP: list[Any] = []  # the windows and their node communicators, alive until the process ends
WINDOWS: list[int] = []  # (id, address, bytes, MPI_Win handle) of every window, flattened
_NEXT = [0]
NODE_SHARED = 1 << 41  # in an id: one memory for the node (ShmWindow::kNodeShared, comm.h)


def one_node(comm: Any) -> bool:
    """Whether every rank of COMM can share memory with every other (collective over COMM;
    False across simulated nodes, COCONET_SIMULATE_NODES)."""
    node = node_comm(comm)  # (simulated nodes never share memory)
    try:
        return node.Get_size() == comm.Get_size()
    finally:
        node.Free()


def empty(shape: int | tuple[int, ...], dtype: str = "f32", *, comm: Any = None,
          framework: str = "numpy") -> Any:
    """An uninitialised array of SHAPE and language DTYPE ("f32", "bf16", ...) in a shared
    window over the ranks of COMM (default COMM_WORLD) on this node (coconetc.runtime.node_ranks): a NumPy array
    (framework="numpy") or a torch tensor ("torch"). Collective over COMM."""
    return _allocate(shape, dtype, comm, framework, "coconetc.empty()", one=False)


def empty_node(shape: int | tuple[int, ...], dtype: str = "f32", *, comm: Any = None,
               framework: str = "numpy") -> Any:
    """As `empty`, but one array for all the ranks of COMM on this node: what one rank writes
    there every rank reads. Collective over COMM; the caller keeps the ranks from writing what
    another reads at the same time."""
    return _allocate(shape, dtype, comm, framework, "coconetc.runtime.shm.empty_node()", one=True)


def _allocate(shape: int | tuple[int, ...], dtype: str, comm: Any, framework: str, what: str,
              one: bool) -> Any:
    from mpi4py import MPI
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {', '.join(map(repr, FRAMEWORKS))}, got {framework!r}")
    shape = checked_shape(shape, dtype, what)
    comm = MPI.COMM_WORLD if comm is None else comm
    dt = STORAGE[dtype]
    nbytes = math.prod(shape) * dt.itemsize
    node = node_comm(comm)  # (under COCONET_SIMULATE_NODES: the simulated node's ranks only)
    mine = max(nbytes, 1) if not one or node.Get_rank() == 0 else 0
    win = MPI.Win.Allocate_shared(mine, dt.itemsize, comm=node)
    mem = win.Shared_query(0)[0] if one else win.tomemory()
    wid = node.allreduce(_NEXT[0], op=MPI.MAX)  # the same id on every rank of the window
    _NEXT[0] = wid + 1
    _KEEP.append((win, node))
    raw = np.frombuffer(mem, dtype=np.uint8, count=nbytes)  # type: ignore[call-overload]
    arr = raw.view(dt).reshape(shape)
    WINDOWS.extend([wid | (NODE_SHARED if one else 0), arr.ctypes.data if nbytes else 0, nbytes,
                    MPI._handleof(win)])
    if framework == "numpy":
        return arr
    import torch
    tdt = getattr(torch, TORCH_DTYPES[dtype])
    if not nbytes:
        return torch.empty(shape, dtype=tdt)
    return torch.frombuffer(mem, dtype=tdt, count=math.prod(shape)).view(shape)
