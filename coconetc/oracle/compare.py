"""The comparison of two runs within each dtype's tolerance (a schedule's run against the
program it came from, or a compiled run against the interpreter's run of the same program
on the same inputs)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from coconetc.interp.interpreter import Result, run
from coconetc.interp.values import STORAGE, TOLERANCE, take_slice
from coconetc.ir.dtypes import FLOATS
from coconetc.ir.nodes import Program

_ULPS = 16  # of the largest element, allowed on every element (_diff)

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
    return compare(ref, got, src or ir, ir, groups), got


def compare(ref: Sequence[Result], got: Sequence[Result], src: Program, dst: Program,
            groups: int = 1) -> list[str]:
    """Differences between runs of src (ref) and dst (got) beyond dtype tolerance."""
    gs = len(ref) // groups
    loosest = _loosest(src)
    problems = []
    for r, (a, b) in enumerate(zip(ref, got)):
        for name, want in a.outputs.items():
            problems += _diff(f"rank {r} output '{name}'", want, b.outputs.get(name), loosest)
        for name, want in a.updates.items():
            lay = dst.type_of(name).layout
            if lay.sliced and not src.type_of(name).layout.sliced:
                want = take_slice(want, lay.dim, want.shape[lay.dim], gs, r % gs)
            problems += _diff(f"rank {r} updated '{name}'", want, b.updates.get(name), loosest)
    return problems


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
