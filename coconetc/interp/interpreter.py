"""The reference interpreter: runs a typed or scheduled program on R simulated ranks with
NumPy. Every node is evaluated for all ranks at once (a list with one array per rank), so
collectives and cross-rank reductions are plain functions of that list."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from coconetc.interp import collectives
from coconetc.interp.bind import Bound, bind
from coconetc.interp.values import COMPUTE, STORAGE, global_index, slice_range
from coconetc.ir import ops as registry
from coconetc.ir import typerules
from coconetc.ir.nodes import Const, Expr, Op, Program, Ref
from coconetc.ir.types import eval_dim

# How a reduction's per-rank partial results combine (OpDef.combine); max/min propagate NaN.
_CROSS: dict[str, Callable[..., Any]] = {"sum": np.add, "max": np.maximum, "min": np.minimum}

Values = list[np.ndarray]


@dataclass
class Result:
    outputs: dict[str, np.ndarray]  # public name -> value
    updates: dict[str, np.ndarray]  # parameter -> new value (scattered: joined)
    segments: tuple[int, ...] | None


def run(p: Program, inputs: Sequence[Mapping[str, Any]], groups: int = 1) -> list[Result]:
    """Run `p`; inputs[r] maps parameter names to rank r's arguments. Returns one Result a rank."""
    b = bind(p, inputs, groups)
    ev = _Evaluator(p, b)
    for s in p.stages:
        vals = ev.eval(s.expr)
        st = STORAGE[s.type.dtype]
        for r in range(b.ranks):
            b.env[r][s.name] = np.asarray(vals[r]).astype(st, copy=False)
    return [Result({pub: b.env[r][s] for pub, s in p.outputs},
                   {t: b.env[r][s] for t, s in p.updates}, b.segments) for r in range(b.ranks)]


class _Evaluator:
    def __init__(self, p: Program, b: Bound):
        self.p, self.b = p, b
        self.gs = b.group_size

    def eval(self, e: Expr) -> Values:
        if isinstance(e, Ref):
            ct = COMPUTE[e.type.dtype]
            return [np.asarray(self.b.env[r][e.name]).astype(ct) for r in range(self.b.ranks)]
        if isinstance(e, Const):
            v = np.asarray(e.value, dtype=COMPUTE[e.type.dtype])
            return [v] * self.b.ranks
        d = registry.get(e.op)
        if d.kind == "collective":
            return getattr(self, "_" + e.op)(e, self.eval(e.args[0]))
        if d.numpy is None:  # needs ranks, segments or the RNG: a method of its own
            return getattr(self, "_" + e.op)(e)
        if d.kind == "reduction":
            return self._reduction(e, d.numpy, d.finish)
        if d.kind == "tensor":
            return self._tensor(e, d, d.numpy)
        return self._pointwise(e, d, d.numpy)

    # --- helpers ---------------------------------------------------------------------
    def gshape(self, e: Expr) -> tuple[int, ...]:
        return tuple(eval_dim(d, self.b.sizes) for d in e.type.shape)

    def offsets(self, e: Expr, r: int) -> tuple[int, ...]:
        lay, shape = e.type.layout, self.gshape(e)
        offs = [0] * len(shape)
        if lay.sliced:
            offs[lay.dim] = slice_range(shape[lay.dim], self.gs, r % self.gs)[0]
        return tuple(offs)

    def group(self, r: int) -> range:
        g = r // self.gs
        return range(g * self.gs, (g + 1) * self.gs)

    def _at_slice(self, out: Expr, arg: Expr, vals: Values) -> Values:
        """Read a replicated operand of a sliced computation at the slice's indices."""
        lay = out.type.layout
        if not lay.sliced or arg.type.layout.sliced:
            return vals
        axis = lay.dim - (out.type.ndim - arg.type.ndim)
        if axis < 0 or arg.type.shape[axis] == 1:
            return vals
        n = self.gshape(out)[lay.dim]
        res = []
        for r, v in enumerate(vals):
            lo, hi = slice_range(n, self.gs, r % self.gs)
            res.append(np.take(v, np.arange(lo, hi), axis=axis))
        return res

    # --- pointwise ---------------------------------------------------------------------
    def _pointwise(self, e: Op, d: registry.OpDef, fn: Callable[..., Any]) -> Values:
        """The registry's NumPy function, element by element, in the compute type."""
        ct = COMPUTE[e.type.dtype]
        argvals = [self._at_slice(e, a, self.eval(a)) for a in e.args]
        settings = {a.name: registry.attr(e, a.name) for a in d.settings}
        res = []
        for r in range(self.b.ranks):
            args = _operands(d.operands, [np.asarray(v[r]) for v in argvals], ct)
            res.append(np.asarray(fn(*args, **settings)).astype(ct, copy=False))
        return res

    def _dropout(self, e: Op) -> Values:
        from coconetc.interp.rng import dropout_keep, site_key
        x = self.eval(e.args[0])
        ps, seeds = self.eval(e.args[1]), self.eval(e.args[2])
        ct = COMPUTE[e.type.dtype]
        key = site_key(e.attr("site"))
        res = []
        for r in range(self.b.ranks):
            # a literal p is used as written (a double), as the generated code does
            p = float(e.args[1].value) if isinstance(e.args[1], Const) else float(ps[r])
            idx = global_index(self.gshape(e), x[r].shape, self.offsets(e, r))
            keep = dropout_keep(int(seeds[r]), key, idx, p)
            scale = ct.type(1.0 / (1.0 - p)) if p < 1 else ct.type(0)
            res.append(np.where(keep, x[r] * scale, ct.type(0)).astype(ct))
        return res

    def _causal(self, e: Op) -> Values:
        """True where the element's global last index <= its second-last index + diagonal."""
        n, diag = e.type.ndim, int(registry.attr(e, "diagonal"))
        res = []
        for r, x in enumerate(self.eval(e.args[0])):
            offs = self.offsets(e, r)
            rows = np.arange(x.shape[-2]) + offs[n - 2]
            cols = np.arange(x.shape[-1]) + offs[n - 1]
            mask = cols[None, :] <= rows[:, None] + diag
            res.append(np.broadcast_to(mask, x.shape).copy())
        return res

    # --- reductions ------------------------------------------------------------------
    def _cross(self, e: Op, partial: list[np.ndarray]) -> list[np.ndarray]:
        """Sum per-rank partial results over the group when the input was sliced (max(x),
        min(x): their largest or smallest, NaN propagating: the registry's combine)."""
        if not e.args[0].type.layout.sliced:
            return partial
        how = _CROSS[registry.get(e.op).combine]
        return [functools.reduce(how, [partial[q] for q in self.group(r)]) for r in range(self.b.ranks)]

    def _reduction(self, e: Op, partial: Callable[..., Any], finish: Callable[[Any], Any] | None) -> Values:
        """Per-rank partial results (the registry's function), combined over the group when the
        input was sliced, then finished (norm: the square root)."""
        x = self.eval(e.args[0])
        part = self._cross(e, [partial(v) for v in x])
        return [np.asarray(finish(v) if finish else v, dtype=COMPUTE[e.type.dtype]) for v in part]

    def _segment_norm(self, e: Op) -> Values:
        x = self.eval(e.args[0])
        n = self.gshape(e)[0]
        segs = self.b.segments or (n,)
        bounds = np.cumsum((0,) + tuple(segs))
        parts = []
        for r, v in enumerate(x):
            off = self.offsets(e, r)[0]
            gidx = np.arange(off, off + len(v))
            seg_of = np.searchsorted(bounds, gidx, side="right") - 1
            parts.append(np.bincount(seg_of, weights=np.square(v, dtype=np.float64), minlength=len(segs)))
        totals = self._cross(e, parts)
        res = []
        for r, v in enumerate(x):
            off = self.offsets(e, r)[0]
            seg_of = np.searchsorted(bounds, np.arange(off, off + len(v)), side="right") - 1
            res.append(np.sqrt(totals[r])[seg_of].astype(COMPUTE[e.type.dtype]))
        return res

    # --- tensor operations -----------------------------------------------------------
    def _tensor(self, e: Op, d: registry.OpDef, fn: Callable[..., Any]) -> Values:
        """The registry's function on each rank's operands, in the result's compute type."""
        vals = [self.eval(a) for a in e.args]
        ct = COMPUTE[e.type.dtype]
        settings = {a.name: registry.attr(e, a.name) for a in d.settings}
        return [fn(*(v[r].astype(ct) for v in vals), **settings) for r in range(self.b.ranks)]

    def _reshape(self, e: Op) -> Values:
        """Each rank's part reshaped to its part of the result (the sliced dim's extent is the
        rank's slice); sizes that disagree raise, as the generated code does."""
        src = e.args[0]
        why = typerules.reshape_problem(src.type, e.type, self.b.sizes, self.gs)
        if why is not None:
            raise ValueError(f"line {e.span.line}, col {e.span.col}: {why}" if e.span.line else why)
        shape, lay = list(self.gshape(e)), e.type.layout
        res = []
        for r, v in enumerate(self.eval(src)):
            mine = list(shape)
            if lay.sliced:
                lo, hi = slice_range(shape[lay.dim], self.gs, r % self.gs)
                mine[lay.dim] = hi - lo
            res.append(v.reshape(mine))
        return res

    # --- collectives (within each group) ---------------------------------------------
    def _reduced(self, e: Op, x: Values) -> Values:
        op = e.attr("op")
        out = []
        for r in range(self.b.ranks):
            out.append(collectives.reduce_values([x[q] for q in self.group(r)], op))
        return out

    def _allreduce(self, e: Op, x: Values) -> Values:
        return self._reduced(e, x)

    def _reducescatter(self, e: Op, x: Values) -> Values:
        full = self._reduced(e, x)
        return self._scatter(e, full)

    def _scatter(self, e: Op, x: Values) -> Values:
        d = e.type.layout.dim
        n = self.gshape(e)[d]
        res = []
        for r, v in enumerate(x):
            lo, hi = slice_range(n, self.gs, r % self.gs)
            res.append(np.take(v, np.arange(lo, hi), axis=d))
        return res

    def _allgather(self, e: Op, x: Values) -> Values:
        d = e.args[0].type.layout.dim
        return [np.concatenate([x[q] for q in self.group(r)], axis=d) for r in range(self.b.ranks)]

    def _root(self, e: Op) -> int:
        root = e.attr("root")
        if root >= self.gs:
            raise ValueError(f"{e.op}: root {root} is not a rank of a group of {self.gs}")
        return root

    def _broadcast(self, e: Op, x: Values) -> Values:
        root = self._root(e)
        return [x[self.group(r)[root]] for r in range(self.b.ranks)]

    def _reduce(self, e: Op, x: Values) -> Values:
        root = self._root(e)
        red = self._reduced(e, x)
        return [red[r] if r % self.gs == root else x[r] for r in range(self.b.ranks)]

    def _send(self, e: Op, x: Values) -> Values:
        step = 1 if e.attr("direction") == "next" else -1
        res = []
        for r in range(self.b.ranks):
            src = r - step * self.gs
            res.append(x[src] if 0 <= src < self.b.ranks else np.zeros_like(x[r]))
        return res


def _operands(how: str, args: list[np.ndarray], ct: np.dtype) -> list[np.ndarray]:
    """Bring one rank's operands to the type the operation computes in (registry.operands)."""
    if how == registry.AS_IS:
        return args
    if how == registry.COND_FIRST:
        return [args[0]] + [a.astype(ct) for a in args[1:]]
    if how == registry.TO_COMMON:
        common = np.result_type(*[a.dtype for a in args])
        return [a.astype(common) for a in args]
    return [a.astype(ct) for a in args]
