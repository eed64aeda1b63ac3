"""The arguments of a module function, laid out as the generated code takes them (CallArgs,
runtime_cpp/coconet/module.h): the tensors' addresses (each segment's for a scattered
parameter), the outputs allocated at this rank's local shape, the size symbols in sorted
order, the scalars as doubles and int64s. One copy for every backend: CPU modules take NumPy
arrays, CUDA modules torch CUDA tensors, the host emulation NumPy arrays standing for device
memory; they differ only in how an address is read (`ptr`) and an output made (`make`)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from coconetc.ir.nodes import Program
from coconetc.ir.slices import slice_range
from coconetc.ir.storage import STORAGE
from coconetc.ir.types import eval_dim
from coconetc.runtime import host_blocks


def local_shape(t, sizes: dict, gs: int, rank: int) -> tuple[int, ...]:
    """This rank's shape of a value of type T at these sizes, in a group of GS ranks."""
    shape = [eval_dim(d, sizes) for d in t.shape]
    if t.layout.sliced:
        lo, hi = slice_range(shape[t.layout.dim], gs, rank)
        shape[t.layout.dim] = hi - lo
    return tuple(shape)


def host_ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def device_ptr(t: Any) -> int:
    return t.data_ptr()


def numpy_empty(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    return host_blocks.empty(shape, STORAGE[dtype])


def tensors(args: Any, p: Program, values: dict, segments, ptr: Callable[[Any], int]) -> None:
    """Each tensor parameter's address (0 for a scattered one) and its segments' addresses."""
    ts, segs = [], []
    for q in p.params:
        if q.scalar:
            continue
        v = values[q.name]
        if isinstance(v, list):
            ts.append(0)
            segs.append([ptr(x) for x in v])
        else:
            ts.append(ptr(v))
            segs.append([])
    args.tensors, args.seg_ptrs, args.seg_sizes = ts, segs, list(segments or ())


def outputs(p: Program, sizes: dict, gs: int, rank: int, make: Callable[[tuple[int, ...], str], Any]) -> list:
    """The program's outputs, each made by `make(local shape, dtype)`."""
    return [make(local_shape(t, sizes, gs, rank), t.dtype) for t, _ in output_types(p)]


_IO: dict[int, tuple[weakref.ref, tuple, frozenset]] = {}  # id(program) -> (it, its outputs' types, updated)


def _io(p: Program) -> tuple[tuple, frozenset]:
    """P's outputs' types and the names of the parameters it updates, once per program: a
    program's type_of scans its stages, a derived program's hundred for each output, and every
    call with new buffers (each step of a training loop) asks (a weakref-checked cache by id)."""
    key = id(p)
    hit = _IO.get(key)
    if hit is None or hit[0]() is not p:
        outs = tuple((t, STORAGE[t.dtype]) for t in (p.type_of(s) for _, s in p.outputs))
        gone = weakref.ref(p, lambda _: _IO.pop(key, None))  # (a dead program's entry leaves with it)
        hit = _IO[key] = (gone, outs, frozenset(t for t, _ in p.updates))
    return hit[1], hit[2]


def output_types(p: Program) -> tuple:
    """(type, NumPy storage dtype) of each of P's outputs, in order."""
    return _io(p)[0]


def updated(p: Program) -> frozenset:
    """The names of the parameters P updates in place."""
    return _io(p)[1]


def ordered_sizes(sizes: dict) -> list[int]:
    """The size symbols' values as the module takes them: sorted by name (CallArgs::sizes)."""
    return [sizes[s] for s in sorted(sizes)]


def scalars(args: Any, p: Program, values: dict, sizes: dict | None) -> None:
    """The size symbols (sorted by name; None: a repeat's, already set) and the scalars (floats
    and integers apart)."""
    if sizes is not None:
        args.sizes = ordered_sizes(sizes)
    floats: list[float] = []
    ints: list[int] = []
    for q in p.params:  # (one pass: a training step's host time counts)
        if q.scalar:
            integer = q.type.dtype.startswith("i")
            floats.append(0.0 if integer else float(values[q.name]))
            ints.append(int(values[q.name]) if integer else 0)
    args.scalars, args.iscalars = floats, ints


def as_torch(a: np.ndarray):
    """A torch view of the array (bf16, which NumPy stores as ml_dtypes', through its bits)."""
    import torch
    if a.dtype.kind == "V" and a.dtype.name == "bfloat16":  # (kind first: name costs 2 us a call)
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def returned(outs: list) -> Any:
    """What a call returns: None, its one output, or a tuple of them."""
    return None if not outs else outs[0] if len(outs) == 1 else tuple(outs)
