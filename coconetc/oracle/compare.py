"""The comparison of two runs within each dtype's tolerance (a schedule's run against the
program it came from, or a compiled run against the interpreter's run of the same program
on the same inputs)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from typing import Any

import numpy as np

from coconetc.interp.interpreter import Result, run
from coconetc.interp.values import STORAGE, TOLERANCE, take_slice
from coconetc.ir.dtypes import FLOATS
from coconetc.ir.nodes import Program
from coconetc.ir.types import TType

_ULPS = 16  # of the largest element, allowed on every element (_diff)
# A result beyond the tolerance still matches when it is as accurate as the interpreter's own:
# against a run of the same program with every float widened to f64 (the exact result, to f32's
# eye), its largest error is at most _AS_ACCURATE times the interpreter's, which itself is within
# _PLAUSIBLE of the largest element (else the widened run is no reference).
_AS_ACCURATE = 4.0
_PLAUSIBLE = 1e-3

# What one rank's call of a compiled program gave: its returned outputs (by public name) and
# its updated parameters (scattered ones joined), as NumPy arrays.
RankResults = tuple[Mapping[str, np.ndarray], Mapping[str, np.ndarray]]


def check_compiled(results: Sequence[RankResults], ir: Program, inputs: Sequence[Mapping[str, Any]],
                   groups: int = 1, ref: Sequence[Result] | None = None,
                   src: Program | None = None) -> tuple[list[str], list[Result]]:
    """Every rank's results of a compiled run of `ir` on `inputs` (ir's calling convention)
    against the interpreter: its run of `ir` on the same inputs, or `ref`, a run of `src` (the
    program ir was scheduled from) on src's inputs. The differences and the compiled run as
    interpreter Results (for saving)."""
    ref = run(ir, inputs, groups) if ref is None else ref
    got = [Result(dict(o), dict(u), ref[r].segments) for r, (o, u) in enumerate(results)]
    return compare(ref, got, src or ir, ir, groups, widened_run(ir, inputs, groups)), got


def compare(ref: Sequence[Result], got: Sequence[Result], src: Program, dst: Program,
            groups: int = 1, exact: Callable[[], Sequence[Result] | None] | None = None) -> list[str]:
    """Differences between runs of src (ref) and dst (got) beyond dtype tolerance. EXACT: a run
    of dst widened to f64 on got's inputs (widened_run), called only if a difference is found: a
    result that is as accurate as ref's against it matches (cancelling sums of large terms carry
    more rounding than any fixed tolerance allows)."""
    gs = len(ref) // groups
    loosest = _loosest(src)
    problems = []

    def diff(what: str, want: np.ndarray, have: np.ndarray | None, r: int, kind: str, name: str) -> list[str]:
        found = _diff(what, want, have, loosest)
        if (not found or exact is None or have is None or want.shape != have.shape or want.dtype != have.dtype
                or want.dtype.kind != "f"):  # (a missing result, another shape or dtype: no second look)
            return found
        wide = exact()
        truth = None if wide is None else getattr(wide[r], kind).get(name)
        return found if truth is None else _as_accurate(what, want, have, truth) or []

    for r, (a, b) in enumerate(zip(ref, got)):
        for name, want in a.outputs.items():
            problems += diff(f"rank {r} output '{name}'", want, b.outputs.get(name), r, "outputs", name)
        for name, want in a.updates.items():
            lay = dst.type_of(name).layout
            if lay.sliced and not src.type_of(name).layout.sliced:
                want = take_slice(want, lay.dim, want.shape[lay.dim], gs, r % gs)
            problems += diff(f"rank {r} updated '{name}'", want, b.updates.get(name), r, "updates", name)
    return problems


def widened_run(p: Program, inputs: Sequence[Mapping[str, Any]],
                groups: int = 1) -> Callable[[], Sequence[Result] | None]:
    """A run of P with every float widened to f64 (types, casts, inputs), made when first called
    (once); None for a program that computes in f64 only, or that the interpreter cannot run
    widened."""
    @cache
    def made() -> Sequence[Result] | None:
        wide = _widened(p)
        if wide == p:
            return None
        try:
            return run(wide, [{k: _wide_value(v) for k, v in args.items()} for args in inputs], groups)
        except Exception:  # noqa: BLE001  (an op without f64: no widened reference, the tolerance stands)
            return None
    return made


def _widened(x: Any) -> Any:
    if isinstance(x, TType):
        return dataclasses.replace(x, dtype="f64") if x.dtype in FLOATS else x
    if isinstance(x, tuple):
        return tuple(_widened(v) for v in x)
    if isinstance(x, str):
        return "f64" if x in FLOATS else x  # (a cast's target)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: _widened(getattr(x, f.name)) for f in dataclasses.fields(x)
                                         if f.init and f.name not in ("name", "span", "op")})
    return x


def _wide_value(v: Any) -> Any:
    if isinstance(v, np.ndarray) and v.dtype.kind == "f":
        return v.astype(np.float64)
    if isinstance(v, (list, tuple)):
        return type(v)(_wide_value(u) for u in v)
    return v


def _as_accurate(what: str, want: np.ndarray, got: np.ndarray, truth: np.ndarray) -> list[str]:
    """[] when GOT is at most _AS_ACCURATE times as far from TRUTH (the f64 run) as WANT is."""
    t = truth.astype(np.float64)
    err_want, err_got = max_error(t, want), max_error(t, got)
    scale = float(np.max(np.abs(t))) if t.size else 0.0
    if err_got <= _AS_ACCURATE * err_want and err_want <= _PLAUSIBLE * scale:
        return []
    return [f"{what}: max abs difference {max_error(want, got):.3g}; from an f64 run: {err_got:.3g}, "
            f"the interpreter's own {err_want:.3g}"]


def max_error(want: np.ndarray, got: np.ndarray) -> float:
    if want.size == 0:
        return 0.0
    return float(np.max(np.abs(want.astype(np.float64) - got.astype(np.float64))))


def _loosest(p: Program) -> str | None:
    """The least precise float dtype a program computes with: a result stored as f32 but
    computed from f16 values (reduced in another order) carries f16's error."""
    dts = {s.type.dtype for s in p.stages} | {q.type.dtype for q in p.params if not q.scalar}
    floats = [d for d in FLOATS if d in dts]
    return max(floats, key=lambda d: TOLERANCE[d][0]) if floats else None


def _diff(what: str, want: np.ndarray, got: np.ndarray | None, loosest: str | None = None) -> list[str]:
    if got is None:
        return [f"{what}: missing"]
    if want.shape != got.shape or want.dtype != got.dtype:
        return [f"{what}: {got.dtype}{list(got.shape)} instead of {want.dtype}{list(want.shape)}"]
    name = STORAGE.name_of(want.dtype)
    rtol, atol = TOLERANCE[name]
    if loosest is not None and name in ("f32", "f64"):
        rtol, atol = max(rtol, TOLERANCE[loosest][0]), max(atol, TOLERANCE[loosest][1])
    if name in ("f32", "f64") and want.size:
        # an element that is a sum of cancelling terms (a softmax's or a layernorm's gradient)
        # carries the rounding of its largest terms, not its own: a few ulps of the tensor's
        # largest element are allowed on every element, as norm-wise checks (LAPACK's) allow
        finite = np.abs(want[np.isfinite(want)])
        atol = max(atol, _ULPS * float(np.finfo(want.dtype).eps) * float(finite.max() if finite.size else 0.0))
    if np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=atol, equal_nan=True):
        return []
    return [f"{what}: max abs difference {max_error(want, got):.3g} (rtol {rtol}, atol {atol:.3g})"]
