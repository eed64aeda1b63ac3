"""Random inputs for a program (one argument mapping per rank) and the same inputs in a
schedule's calling convention: what every check against the interpreter feeds both runs.

Each floating-point tensor is drawn by what it reaches: in [0.5, 1.5] (positive, away from 0) if
an operation defined only for positive values needs it (`positive_params`), else in [-1, 1], so
that products and sums cancel as they do on real data. Positive everywhere, as before, made every
matmul's terms add up: a transformer block's attention scores reached hundreds, softmax saturated
and its derived program's gradients reached 1e5, beyond an f32 comparison's tolerance."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from coconetc.interp.values import STORAGE, take_slice
from coconetc.ir import ops
from coconetc.ir.expr import Const, Expr, Op, Ref, walk
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


def _values(q: Param, shape: tuple[int, ...], rng: np.random.Generator, positive: bool,
            typical: bool = False) -> np.ndarray:
    """Q's values: integers in [-50, 50), floats in U(0.5, 1.5) where positive, else U(-1, 1).
    TYPICAL (timing runs): a float tensor of two or more dims divided by the square root of its
    first dim, a weight's fan-in in `x @ w`, as an initializer scales it, so that sums over
    many products stay near 1. With U(-1, 1) weights a GPT block at H = 1024 puts GELU's inputs
    near |x| = 13, whose derivative x exp(-x^2/2) is subnormal: every GEMM reading it took
    microcode assists, 47x its time (docs/gpt_block.md)."""
    dt = STORAGE[q.type.dtype]
    if q.type.dtype.startswith("i"):
        return rng.integers(-50, 50, size=shape).astype(dt)
    v = rng.uniform(0.5, 1.5, size=shape) if positive else rng.uniform(-1.0, 1.0, size=shape)
    if typical and len(shape) >= 2 and shape[0] > 1:
        v /= np.sqrt(shape[0])
    return v.astype(dt)


# --- which inputs must be positive -----------------------------------------------------------
# Each operation's input domain and result sign is its definition's (ir/ops.py OpDef.domain).
_UNKNOWN = None  # a value whose sign no positive input settles (a difference, a negation, gelu ...)


def positive_params(p: Program) -> set[str]:
    """The floating-point tensor parameters of p drawn positive: those an operation needs positive
    (its Domain.positive). A domain argument whose sign the inputs settle (`var + eps` of squares, a sum
    of square roots) needs only the inputs it names; one they do not settle (`x - y`), every input
    it reads, as does any argument of an operation not known here (one registered by a user)."""
    signs = _Signs(p)
    positive: set[str] = set()
    for s in p.stages:
        for n in walk(s.expr):
            if isinstance(n, Op):
                for a, settled in _restricted(n):
                    need = signs.needs(a) if settled else _UNKNOWN
                    positive |= signs.reads(a) if need is None else need
    return positive


def _restricted(n: Op) -> list[tuple[Expr, bool]]:
    """The arguments of n that must be positive, each with whether its sign can be settled
    (False: an operation not known here, whose every argument is drawn positive, as before)."""
    d = _domain(n.op)
    if d is None:
        return [(a, False) for a in n.args]
    if (d.waived == ops.INTEGER_EXPONENT and _integral(n.args[1])) or (d.waived == ops.NONZERO_DIVISOR and
                                                                      all(_guarded(n.args[i]) for i in d.positive)):
        return []
    return [(n.args[i], True) for i in d.positive]


def _domain(op: str) -> ops.Domain | None:
    """The operation's Domain (None: an operation not known, or one that declares none)."""
    try:
        return ops.get(op).domain
    except KeyError:
        return None


class _Signs:
    """Which inputs settle the sign of an expression of one program."""

    def __init__(self, p: Program):
        self.p = p
        self.stages = {s.name: s.expr for s in p.stages}
        self.memo: dict[str, frozenset[str] | None] = {}

    def reads(self, e: Expr, seen: set[str] | None = None) -> set[str]:
        """The floating-point tensor parameters e reads, through the stages it reads."""
        seen = set() if seen is None else seen
        out: set[str] = set()
        for n in walk(e):
            if isinstance(n, Ref) and n.name not in seen:
                seen.add(n.name)
                q = self.p.param(n.name)
                if q is not None and not q.scalar and not q.type.dtype.startswith("i"):
                    out.add(n.name)
                elif n.name in self.stages:
                    out |= self.reads(self.stages[n.name], seen)
        return out

    def needs(self, e: Expr) -> frozenset[str] | None:
        """The inputs that, drawn positive, make e >= 0 (_UNKNOWN: none do)."""
        if isinstance(e, Const):
            return frozenset() if e.value >= 0 else _UNKNOWN
        if isinstance(e, Ref):
            return self._ref(e.name)
        assert isinstance(e, Op)
        d = _domain(e.op)
        result = d.result if d is not None else ops.UNKNOWN
        square = d is not None and ((d.square == ops.SAME_ARGUMENTS and e.args[0] == e.args[1])
                                    or (d.square == ops.EVEN_EXPONENT and _even(e.args[1])))
        if result == ops.NONNEG or square:
            return frozenset()
        if result == ops.EITHER:  # max(a, b) >= 0 when either is
            known = [n for n in map(self.needs, e.args) if n is not None]
            return min(known, key=len) if known else _UNKNOWN
        if d is None or result != ops.FOLLOWS:
            return _UNKNOWN
        out: frozenset[str] = frozenset()
        for i in range(len(e.args)) if d.of is None else d.of:
            n = self.needs(e.args[i])
            if n is None:
                return _UNKNOWN
            out |= n
        return out

    def _ref(self, name: str) -> frozenset[str] | None:
        q = self.p.param(name)
        if q is None:  # a stage, computed once
            if name not in self.memo:
                self.memo[name] = self.needs(self.stages[name])
            return self.memo[name]
        if q.scalar:  # scalars are drawn in [0.05, 0.95], integers >= 0
            return frozenset()
        return _UNKNOWN if q.type.dtype.startswith("i") else frozenset((name,))


def _guarded(e: Expr) -> bool:
    """A divisor never 0 by construction: where(v == 0, c, v) with a literal c != 0 (gelu's
    derivative divides by its input so)."""
    if not (isinstance(e, Op) and e.op == "where" and isinstance(e.args[0], Op) and e.args[0].op == "eq"):
        return False
    (v, zero), c = e.args[0].args, e.args[1]
    return (isinstance(zero, Const) and zero.value == 0 and isinstance(c, Const) and c.value != 0
            and e.args[2] == v)


def _integral(e: Expr) -> bool:
    return isinstance(e, Const) and float(e.value).is_integer()


def _even(e: Expr) -> bool:
    return _integral(e) and int(e.value) % 2 == 0  # type: ignore[union-attr]


def _scalar(q: Param, rng: np.random.Generator, probability: bool) -> Any:
    if q.type.dtype.startswith("i"):  # within the dtype (an i32 step count, an i64 seed)
        return int(rng.integers(0, 2**40 if q.type.dtype == "i64" else 2**31))
    # a dropout's probability at most 0.5 (its 1/(1-p) scale at most 2, as in training)
    return float(np.asarray(rng.uniform(0.05, 0.5 if probability else 0.95), dtype=STORAGE[q.type.dtype]))


def dropout_probabilities(p: Program) -> set[str]:
    """The scalar parameters p passes as a dropout's probability."""
    return {n.args[1].name for s in p.stages for n in walk(s.expr)
            if isinstance(n, Op) and n.op == "dropout" and isinstance(n.args[1], Ref)}


def random_inputs(p: Program, ranks: int, groups: int = 1, sizes: Mapping[str, int] | None = None,
                  seed: int = 0, segments: Sequence[int] | None = None, typical: bool = False,
                  values: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """One argument mapping per rank, in p's calling convention. Replicated values are equal
    within a group, sliced ones are cut from one global tensor per group. typical: magnitudes
    for timing (_values). values: scalars given instead of drawn (the others are drawn as
    without them)."""
    rng = np.random.default_rng(seed)
    sz = {s: (sizes or {}).get(s, DEFAULT_SIZE) for s in size_symbols(p)}
    gs = ranks // groups
    positive, probabilities = positive_params(p), dropout_probabilities(p)
    out: list[dict[str, Any]] = [{} for _ in range(ranks)]
    for q in p.params:
        if q.scalar:
            v = _scalar(q, rng, q.name in probabilities)
            v = (values or {}).get(q.name, v)
            for r in range(ranks):
                out[r][q.name] = v
            continue
        shape = tuple(eval_dim(d, sz) for d in q.type.shape)
        segs = tuple(segments) if segments is not None else default_segments(shape[0]) if shape else ()
        for g in range(groups):
            shared = _values(q, shape, rng, q.name in positive, typical)
            for j in range(gs):
                full = _values(q, shape, rng, q.name in positive, typical) if q.type.layout.kind == "local" else shared
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
