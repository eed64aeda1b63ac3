"""A layernorm's three gradients in one pass (the CPU): in a derived program a layernorm's
backward is three library calls over the same rows, `dx = layernorm_dx(x, gamma, g)`,
`dgamma = layernorm_dgamma(x, g)` and `dbeta = sum_lead(g)`, each reading x or g (or both)
from memory. The layernorm_dx call can add each row's g * xhat and g into the column sums as it
computes the row's dx, so x and g are read once (Library.grads; runtime_cpp/coconet/grad.h
layernorm_dx_grads, whose sums are the separate calls' bit for bit). The rule, in one place
(grads_of):

- the unit is a top-level Library layernorm_dx(x, gamma, g) (not a fused collective's row-wise
  phase), of one dtype throughout;
- dgamma: a later top-level Library layernorm_dgamma(x, g) with the same eps (a literal or the
  same scalar parameter) and the same dtype;
- dbeta: a later top-level Library sum_lead(g) over every leading dim of g, its result 1-d, of
  g's dtype, not one a loop already sums (plan/colsums.py);
- neither result is a scattered parameter's segments, and no unit between the layernorm_dx and
  the call whose result it takes writes x or g or touches that result.

At least one of the two is found, or the unit stays as it is. On the CPU the layernorm_dx call
computes them (the other calls render as nothing); CUDA runs the three calls as before."""

from __future__ import annotations

from dataclasses import replace

from coconetc.plan.colsums import fused_sums
from coconetc.plan.units import Buffer, LayernormGrads, Library, Unit, _may_write, _touches

ON = ("cpu",)  # the backends whose layernorm_dx computes the gradients it carries


def _eps(u: Library) -> object:
    """The unit's eps: its literal, else the scalar parameter (its last argument)."""
    attrs = dict(u.attrs)
    return ("literal", attrs["eps"]) if "eps" in attrs else ("param", u.args[-1])


def _clear(units: list[Unit], i: int, j: int, x: str, g: str, dst: str) -> bool:
    """No unit strictly between i and j writes x or g or touches dst."""
    return not any(_may_write(v, x) or _may_write(v, g) or _touches(v, {dst}) for v in units[i + 1:j])


def grads_of(units: list[Unit], i: int, buffers: dict[str, Buffer],
             summed: set[str] | None = None) -> LayernormGrads | None:
    """For units[i] a layernorm_dx the rule above accepts: the gradients it can carry; else None.
    SUMMED: fused_sums(units, "cpu"), where the caller has it."""
    u = units[i]
    if not (isinstance(u, Library) and u.op == "layernorm_dx") or u.grads is not None:
        return None
    x, g = u.args[0], u.args[2]
    if u.dst in (x, g):
        return None
    dtype = buffers[u.dst].type.dtype
    if any(buffers[n].type.dtype != dtype for n in (x, g)):
        return None
    if summed is None:
        summed = fused_sums(units, "cpu")
    dgamma = dbeta = ""
    for j in range(i + 1, len(units)):
        v = units[j]
        if not isinstance(v, Library) or v.dst not in buffers:
            continue
        out = buffers[v.dst]
        if out.kind == "segments" or out.type.dtype != dtype:
            continue
        if not dgamma and v.op == "layernorm_dgamma" and v.args[:2] == (x, g) and _eps(v) == _eps(u) \
                and _clear(units, i, j, x, g, v.dst):
            dgamma = v.dst
        elif not dbeta and v.op == "sum_lead" and v.args[0] == g and v.dst not in summed \
                and dict(v.attrs).get("n") == buffers[g].type.ndim - 1 and out.type.ndim == 1 \
                and _clear(units, i, j, x, g, v.dst):
            dbeta = v.dst
    return LayernormGrads(dgamma, dbeta, ON) if dgamma or dbeta else None


def with_grads(units: list[Unit], buffers: dict[str, Buffer]) -> list[Unit]:
    """UNITS with each layernorm_dx the rule accepts carrying its layernorm's gradients."""
    out = list(units)
    summed = fused_sums(units, "cpu")  # (the loops' column sums: a layernorm's gradients do not change them)
    for i, u in enumerate(out):
        grads = grads_of(out, i, buffers, summed)
        if grads is not None:
            assert isinstance(u, Library)
            out[i] = replace(u, grads=grads)
    return out


def carried(units, backend: str) -> dict[str, str]:
    """The results of layernorm_dgamma and sum_lead calls that a layernorm_dx of UNITS computes
    on BACKEND (those calls render as nothing there), each with that layernorm_dx's result."""
    return {n: u.dst for u in units if isinstance(u, Library) and u.grads is not None and backend in u.grads.on
            for n in (u.grads.dgamma, u.grads.dbeta) if n}
