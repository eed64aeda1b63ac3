"""A call's arguments against a program's parameters, checked once for both the interpreter
(coconetc/interp/bind.py) and the loader of compiled modules (coconetc/runtime/loader.py):
each parameter on its own (`check_param`), then the size symbols across the ranks, from the
shapes alone (`bind_sizes`), then buffers that overlap (`overlapping`). Errors name the
parameter (TypeError for a wrong kind of value, ValueError for a wrong shape or size)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from coconetc.ir.storage import STORAGE
from coconetc.ir.slices import slice_range
from coconetc.ir.nodes import Param, Program
from coconetc.ir.types import eval_dim

INT_RANGE = {"i32": (-2**31, 2**31 - 1), "i64": (-2**63, 2**63 - 1)}


def is_torch(v: Any) -> bool:
    return type(v).__module__.startswith("torch")


def check_param(q: Param, v: Any, *, updated: bool = False, contiguous: bool = False) -> Any:
    """One argument, on this rank: a scalar becomes a Python int or float; a tensor a NumPy
    array (a view of a PyTorch tensor, never a copy); a scattered tensor a list of 1-d arrays.
    `contiguous`: the compiled code takes C-contiguous buffers; `updated`: it writes into it."""
    if q.scalar:
        return _scalar(q, v)
    if q.scattered and isinstance(v, (list, tuple)):
        parts = [_array(q, x, updated, contiguous) for x in v]
        for x in parts:
            if x.ndim != 1:
                raise ValueError(f"'{q.name}': every segment must be 1-d, got shape {x.shape}")
        return parts
    a = _array(q, v, updated, contiguous)
    if a.ndim != q.type.ndim:
        raise ValueError(f"'{q.name}' must be {q.type.ndim}-d ({q.type}), got shape {a.shape}")
    return [a] if q.scattered else a


def scalar_from_text(q: Param, text: str) -> int | float:
    """Scalar parameter Q's value written as text (a command line's NAME=NUMBER), checked as a
    call's argument is."""
    whole = q.type.dtype in INT_RANGE
    try:
        v = int(text) if whole else float(text)
    except ValueError:
        raise TypeError(f"'{q.name}' must be {'an integer' if whole else 'a number'} ({q.type.dtype}), "
                        f"got {text!r}") from None
    return _scalar(q, v)


def _scalar(q: Param, v: Any) -> int | float:
    if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, (int, float, np.number)):
        raise TypeError(f"'{q.name}' must be a number ({q.type.dtype} scalar), got {type(v).__name__}")
    if q.type.dtype not in INT_RANGE:
        return float(v)
    if not float(v).is_integer():
        raise TypeError(f"'{q.name}' must be an integer ({q.type.dtype}), got {v!r}")
    lo, hi = INT_RANGE[q.type.dtype]
    if not lo <= int(v) <= hi:
        raise ValueError(f"'{q.name}' = {int(v)} does not fit {q.type.dtype}")
    return int(v)


def from_torch(q: Param, v: Any, contiguous: bool) -> np.ndarray:
    """A NumPy view of the CPU tensor v (bf16 through its bits), checked for parameter q."""
    if v.device.type != "cpu":
        raise ValueError(f"'{q.name}' is on {v.device}; this module runs on the CPU")
    if contiguous and not v.is_contiguous():
        raise ValueError(f"'{q.name}' is not contiguous; pass .contiguous()")
    v = v.detach()
    if str(v.dtype) == "torch.bfloat16":  # NumPy has no bfloat16: view the bits
        import torch
        return v.view(torch.int16).numpy().view(STORAGE["bf16"])
    return v.numpy()


def _array(q: Param, v: Any, updated: bool, contiguous: bool) -> np.ndarray:
    if is_torch(v) and hasattr(v, "device"):
        v = from_torch(q, v, contiguous)
    if not isinstance(v, np.ndarray):
        raise TypeError(f"'{q.name}' must be a NumPy array or a PyTorch tensor ({q.type}), "
                        f"got {type(v).__name__}")
    if v.dtype != STORAGE[q.type.dtype]:
        raise TypeError(f"'{q.name}' must have dtype {q.type.dtype}, got {v.dtype}")
    if contiguous and not v.flags.c_contiguous:
        raise ValueError(f"'{q.name}' is not contiguous (C order); pass np.ascontiguousarray(...)")
    if updated and not v.flags.writeable:
        raise ValueError(f"'{q.name}' is updated in place but is read-only")
    return v


def describe(p: Program, values: Mapping[str, Any]) -> dict[str, Any]:
    """What the other ranks need to know of checked arguments: shapes (a list of them for
    segments) and scalar values, not data."""
    out: dict[str, Any] = {}
    for q in p.params:
        v = values[q.name]
        out[q.name] = v if q.scalar else [x.shape for x in v] if isinstance(v, list) else v.shape
    return out


def _flat_shape(shape: Any) -> tuple[int, ...]:
    return (sum(s[0] for s in shape),) if isinstance(shape, list) else tuple(shape)


def bind_sizes(p: Program, shapes: Sequence[Mapping[str, Any]], groups: int = 1
               ) -> tuple[dict[str, int], tuple[int, ...] | None]:
    """Every rank's `describe` -> (size symbols, the segment sizes of scattered parameters),
    or the first inconsistency, named. Identical on every rank that sees the same shapes."""
    ranks = len(shapes)
    if ranks < 1 or groups < 1 or ranks % groups:
        raise ValueError(f"{ranks} ranks do not form {groups} equal groups")
    segments = _segments(p, shapes)
    flat = [{q.name: _flat_shape(d[q.name]) for q in p.params if not q.scalar} for d in shapes]
    gs = ranks // groups
    sizes: dict[str, int] = {}
    owner: dict[str, str] = {}
    for q in p.params:
        if q.scalar:
            continue
        for axis, dim in enumerate(q.type.shape):
            lay = q.type.layout
            sliced = lay.sliced and lay.dim == axis
            n = sum(flat[r][q.name][axis] for r in range(gs)) if sliced else flat[0][q.name][axis]
            if isinstance(dim, int):
                if n != dim:
                    raise ValueError(f"'{q.name}': dim {axis} must be {dim}, got {n}")
            elif dim in sizes and sizes[dim] != n:
                raise ValueError(f"'{q.name}': size {dim} = {n} here but {sizes[dim]} from '{owner[dim]}'")
            elif isinstance(dim, str):
                sizes[dim], owner[dim] = n, q.name
        for axis, dim in enumerate(q.type.shape):
            _check_parts(q, axis, eval_dim(dim, sizes), [f[q.name] for f in flat], gs)
    return sizes, segments


def _segments(p: Program, shapes: Sequence[Mapping[str, Any]]) -> tuple[int, ...] | None:
    segments: tuple[int, ...] | None = None
    owner = ""
    for q in p.params:
        if q.scalar or not q.scattered:
            continue
        for d in shapes:
            s = d[q.name]
            segs = tuple(x[0] for x in s) if isinstance(s, list) else (s[0],)
            if segments is not None and segs != segments:
                raise ValueError(f"'{q.name}': its segment sizes {list(segs)} differ from "
                                 f"'{owner}''s {list(segments)}")
            if segments is None:
                segments, owner = segs, q.name
    return segments


def _check_parts(q: Param, axis: int, n: int, shapes: list[tuple[int, ...]], gs: int) -> None:
    lay = q.type.layout
    for r, shape in enumerate(shapes):
        want = n
        if lay.sliced and lay.dim == axis:
            lo, hi = slice_range(n, gs, r % gs)
            want = hi - lo
        if shape[axis] != want:
            raise ValueError(f"'{q.name}' on rank {r}: dim {axis} must be {want} "
                             f"({q.type}, {gs} ranks per group), got {shape[axis]}")


def _buffers(p: Program, values: Mapping[str, Any]):
    for q in p.params:
        v = values[q.name]
        if q.scalar:
            continue
        parts = v if isinstance(v, list) else [v]
        for k, a in enumerate(parts):
            label = f"'{q.name}'" + (f" (segment {k})" if len(parts) > 1 else "")
            yield label, a


def overlapping(p: Program, values: Mapping[str, Any]) -> tuple[str, str] | None:
    """Two parameters (or segments) whose memory overlaps, by name; None if none do. The
    arrays are contiguous (checked), so their byte ranges are exact."""
    spans = []
    for label, a in _buffers(p, values):
        if a.nbytes:
            start = a.__array_interface__["data"][0]
            spans.append((start, start + a.nbytes, label))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            return a, b
    return None
