"""Random inputs for a program (one argument mapping per rank) and the same inputs in a
schedule's calling convention: what every check against the interpreter feeds both runs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from coconetc.interp.values import STORAGE, take_slice
from coconetc.ir.nodes import Param, Program
from coconetc.ir.types import dim_symbols, eval_dim

DEFAULT_SIZE = 10  # a size symbol without --size; 3 and 4 ranks do not divide it


def size_symbols(p: Program) -> list[str]:
    return sorted({s for q in p.params for d in q.type.shape for s in dim_symbols(d)})


def default_segments(n: int) -> tuple[int, ...]:
    """Uneven segments for a scattered tensor of n elements (one per 'layer')."""
    if n < 3:
        return (n,)
    a = max(1, n // 5)
    b = max(1, (n - a) // 2 + 1)
    return (a, b, n - a - b) if n - a - b > 0 else (a, n - a)


def _values(q: Param, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    dt = STORAGE[q.type.dtype]
    if q.type.dtype.startswith("i"):
        return rng.integers(-50, 50, size=shape).astype(dt)
    # positive and away from zero: safe under sqrt, log, rsqrt and division
    return rng.uniform(0.5, 1.5, size=shape).astype(dt)


def _scalar(q: Param, rng: np.random.Generator) -> Any:
    if q.type.dtype.startswith("i"):  # within the dtype (an i32 step count, an i64 seed)
        return int(rng.integers(0, 2**40 if q.type.dtype == "i64" else 2**31))
    return float(np.asarray(rng.uniform(0.05, 0.95), dtype=STORAGE[q.type.dtype]))


def random_inputs(p: Program, ranks: int, groups: int = 1, sizes: Mapping[str, int] | None = None,
                  seed: int = 0, segments: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """One argument mapping per rank, in p's calling convention. Replicated values are equal
    within a group, sliced ones are cut from one global tensor per group."""
    rng = np.random.default_rng(seed)
    sz = {s: (sizes or {}).get(s, DEFAULT_SIZE) for s in size_symbols(p)}
    gs = ranks // groups
    out: list[dict[str, Any]] = [{} for _ in range(ranks)]
    for q in p.params:
        if q.scalar:
            v = _scalar(q, rng)
            for r in range(ranks):
                out[r][q.name] = v
            continue
        shape = tuple(eval_dim(d, sz) for d in q.type.shape)
        segs = tuple(segments) if segments is not None else default_segments(shape[0]) if shape else ()
        for g in range(groups):
            shared = _values(q, shape, rng)
            for j in range(gs):
                full = _values(q, shape, rng) if q.type.layout.kind == "local" else shared
                out[g * gs + j][q.name] = _cut(q, full, gs, j, segs)
    return out


def _cut(q: Param, full: np.ndarray, gs: int, j: int, segs: tuple[int, ...]) -> Any:
    lay = q.type.layout
    if lay.sliced:
        return np.ascontiguousarray(take_slice(full, lay.dim, full.shape[lay.dim], gs, j))
    if q.scattered:
        return [full[a:b].copy() for a, b in _bounds(segs)]
    return full.copy()


def _bounds(segs: Sequence[int]) -> list[tuple[int, int]]:
    ends = np.cumsum((0, *segs))
    return list(zip(ends[:-1], ends[1:]))


def joined(v: Any) -> np.ndarray:
    return np.concatenate(v) if isinstance(v, (list, tuple)) else v


def adapt_inputs(inputs: Sequence[Mapping[str, Any]], src: Program, dst: Program,
                 groups: int = 1) -> list[dict[str, Any]]:
    """Inputs of `src` in `dst`'s calling convention (a parameter that dst slices is cut)."""
    gs = len(inputs) // groups
    out = []
    for r, args in enumerate(inputs):
        new = dict(args)
        for q in dst.params:
            old = src.param(q.name)
            if old is not None and q.type.layout != old.type.layout and q.type.layout.sliced:
                full = joined(args[q.name])
                d = q.type.layout.dim
                new[q.name] = np.ascontiguousarray(take_slice(full, d, full.shape[d], gs, r % gs))
        out.append(new)
    return out
