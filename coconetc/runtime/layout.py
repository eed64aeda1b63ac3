"""Where a compiled function's parameters live on one rank: the public layout helpers
(`fn.local_shape`, `fn.local_index`, `fn.empty`, `fn.zeros` on every function of a loaded
module), so that nobody computes a slice by hand.

A parameter `sliced(d)` of global size n along d is held by rank i of a group of R ranks as
indices [i*c, min((i+1)*c, n)) with c = ceil(n / R) (coconetc/ir/slices.py); every other
layout is held whole. The rank and group size come from an mpi4py communicator (default
COMM_WORLD), or from `rank=`/`ranks=` given explicitly (no MPI needed then)."""

from __future__ import annotations

from typing import Any

import numpy as np

from coconetc.ir.storage import STORAGE
from coconetc.ir.slices import slice_range
from coconetc.ir.dtypes import TABLE
from coconetc.ir.nodes import Param, Program
from coconetc.ir.types import eval_dim

FRAMEWORKS = ("numpy", "torch")
TORCH_DTYPES = {n: d.torch for n, d in TABLE.items()}


def checked_shape(shape: int | tuple[int, ...], dtype: str, what: str) -> tuple[int, ...]:
    """SHAPE (a size or a sequence of sizes) as a tuple, once DTYPE is known to be a language
    dtype and no size is negative (the allocators' check: coconetc.empty, window_empty; WHAT
    names the caller in the message)."""
    if dtype not in STORAGE:
        raise ValueError(f"{what}: unknown dtype {dtype!r} (one of {', '.join(STORAGE)})")
    shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"{what}: negative size in shape {shape}")
    return shape


def group_position(comm: Any, rank: int | None, ranks: int | None, groups: int) -> tuple[int, int]:
    """(ranks per group, this rank's index in its group) from a communicator or explicit
    rank/ranks (explicit values win; the communicator defaults to COMM_WORLD)."""
    if rank is None or ranks is None:
        if comm is None:
            from mpi4py import MPI
            comm = MPI.COMM_WORLD
        rank = comm.Get_rank() if rank is None else rank
        ranks = comm.Get_size() if ranks is None else ranks
    for label, v in (("ranks", ranks), ("rank", rank), ("groups", groups)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{label} must be an integer, got {v!r}")
    if ranks < 1 or groups < 1 or ranks % groups:
        raise ValueError(f"{ranks} ranks do not form {groups} equal groups")
    if not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} is not one of {ranks} ranks")
    gs = ranks // groups
    return gs, rank % gs


def param(p: Program, name: str, what: str) -> Param:
    for q in p.params:
        if q.name == name:
            return q
    raise ValueError(f"{what}: {p.name} has no parameter {name!r} "
                     f"(its parameters: {', '.join(q.name for q in p.params)})")


def bind(p: Program, q: Param, sizes: dict[str, Any], what: str) -> list[int]:
    """The global shape of q for the given size symbols (each needed one named if missing)."""
    known = sorted({d for x in p.params for d in x.type.shape if isinstance(d, str)})
    extra = sorted(set(sizes) - set(known))
    if extra:
        raise TypeError(f"{what}: {extra[0]!r} is not a size of {p.name} "
                        f"(its sizes: {', '.join(known) or 'none'})")
    for k, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{what}: size {k} must be a non-negative integer, got {v!r}")
    shape = []
    for d in q.type.shape:
        if isinstance(d, str) and d not in sizes:
            raise TypeError(f"{what}: the size {d} of {q.name!r} is needed ({d}=...)")
        shape.append(int(eval_dim(d, {k: int(v) for k, v in sizes.items()})))
    return shape


def local_index(q: Param, shape: list[int], gs: int, r: int) -> tuple[slice, ...]:
    """Index of this rank's part in the global array: `full[index]`."""
    index = [slice(0, n) for n in shape]
    if not q.scalar and q.type.layout.sliced:
        d = q.type.layout.dim
        lo, hi = slice_range(shape[d], gs, r)
        index[d] = slice(lo, hi)
    return tuple(index)


def local_shape(q: Param, shape: list[int], gs: int, r: int) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in local_index(q, shape, gs, r))


def allocate(shape: tuple[int, ...], dtype: str, framework: str, fill: bool) -> Any:
    """A NumPy array or a torch tensor of this shape and language dtype (zeros if fill)."""
    if framework == "numpy":
        return (np.zeros if fill else np.empty)(shape, STORAGE[dtype])
    if framework == "torch":
        import torch
        make = torch.zeros if fill else torch.empty
        return make(shape, dtype=getattr(torch, TORCH_DTYPES[dtype]))
    raise ValueError(f"framework must be one of {', '.join(map(repr, FRAMEWORKS))}, got {framework!r}")
