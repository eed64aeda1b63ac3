"""Binding a call's arguments (one mapping per rank) to a program's parameters: dtype, rank
and layout checks, size symbols, scattered segments. Errors name the parameter."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from coconetc.interp.values import STORAGE, slice_range
from coconetc.ir.nodes import Param, Program
from coconetc.ir.types import eval_dim


@dataclass
class Bound:
    ranks: int
    groups: int
    sizes: dict[str, int]
    segments: tuple[int, ...] | None
    env: list[dict[str, np.ndarray]]  # per rank: parameter -> storage array (scattered: joined)

    @property
    def group_size(self) -> int:
        return self.ranks // self.groups


def bind(p: Program, inputs: Sequence[Mapping[str, Any]], groups: int = 1) -> Bound:
    ranks = len(inputs)
    if ranks < 1 or groups < 1 or ranks % groups:
        raise ValueError(f"{ranks} ranks do not form {groups} equal groups")
    env: list[dict[str, np.ndarray]] = [{} for _ in range(ranks)]
    segments: tuple[int, ...] | None = None
    seg_owner = ""
    for q in p.params:
        for r in range(ranks):
            if q.name not in inputs[r]:
                raise TypeError(f"{p.name}() missing argument '{q.name}' (rank {r})")
            value, segs = _convert(q, inputs[r][q.name])
            if segs is not None and segments is not None and segs != segments:
                raise ValueError(f"'{q.name}': its segment sizes {list(segs)} differ from "
                                 f"'{seg_owner}''s {list(segments)}")
            if segs is not None and segments is None:
                segments, seg_owner = segs, q.name
            env[r][q.name] = value
    b = Bound(ranks, groups, {}, segments, env)
    _bind_sizes(p, b)
    return b


def _convert(q: Param, v: Any) -> tuple[np.ndarray, tuple[int, ...] | None]:
    dt = STORAGE[q.type.dtype]
    if q.scalar:
        if isinstance(v, np.ndarray) and v.ndim == 0:
            v = v.item()
        if not isinstance(v, (int, float, np.number)) or isinstance(v, bool):
            raise TypeError(f"'{q.name}' must be a number ({q.type.dtype} scalar), got {type(v).__name__}")
        if q.type.dtype.startswith("i") and not float(v).is_integer():
            raise TypeError(f"'{q.name}' must be an integer ({q.type.dtype}), got {v!r}")
        return np.array(v, dtype=dt), None
    segs = None
    if q.scattered and isinstance(v, (list, tuple)):
        parts = [_array(q, x, 1) for x in v]
        segs = tuple(len(x) for x in parts)
        v = np.concatenate(parts) if parts else np.zeros(0, dt)
    elif q.scattered:
        v = _array(q, v, 1)
        segs = (len(v),)
    return _array(q, v, q.type.ndim), segs


def _array(q: Param, v: Any, ndim: int) -> np.ndarray:
    if not isinstance(v, np.ndarray):
        raise TypeError(f"'{q.name}' must be a NumPy array ({q.type}), got {type(v).__name__}")
    if v.dtype != STORAGE[q.type.dtype]:
        raise TypeError(f"'{q.name}' must have dtype {q.type.dtype}, got {v.dtype}")
    if v.ndim != ndim:
        raise ValueError(f"'{q.name}' must be {ndim}-d ({q.type}), got shape {v.shape}")
    return v


def _bind_sizes(p: Program, b: Bound) -> None:
    owner: dict[str, str] = {}
    for q in p.params:
        for axis, dim in enumerate(q.type.shape):
            n = _global_size(q, axis, b)
            if isinstance(dim, int):
                if n != dim:
                    raise ValueError(f"'{q.name}': dim {axis} must be {dim}, got {n}")
            elif dim in b.sizes and b.sizes[dim] != n:
                raise ValueError(f"'{q.name}': size {dim} = {n} here but {b.sizes[dim]} "
                                 f"from '{owner[dim]}'")
            elif isinstance(dim, str):
                b.sizes[dim], owner[dim] = n, q.name
        for axis, dim in enumerate(q.type.shape):
            _check_parts(q, axis, eval_dim(dim, b.sizes), b)


def _global_size(q: Param, axis: int, b: Bound) -> int:
    lay = q.type.layout
    if lay.sliced and lay.dim == axis:
        return sum(b.env[r][q.name].shape[axis] for r in range(b.group_size))
    return b.env[0][q.name].shape[axis]


def _check_parts(q: Param, axis: int, n: int, b: Bound) -> None:
    lay = q.type.layout
    for r in range(b.ranks):
        got = b.env[r][q.name].shape[axis]
        want = n
        if lay.sliced and lay.dim == axis:
            lo, hi = slice_range(n, b.group_size, r % b.group_size)
            want = hi - lo
        if got != want:
            raise ValueError(f"'{q.name}' on rank {r}: dim {axis} must be {want} "
                             f"({q.type}, {b.group_size} ranks per group), got {got}")
