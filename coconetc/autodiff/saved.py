"""The derived program cut in two at the values the forward keeps for the backward, as a
training framework runs it: a forward that also returns the *saved values*, and a backward that
reads them instead of computing them again.

g = vjp(p) computes p's values before its cotangents (the values the backward reads). split(p,
g) chooses which of them the forward saves: every value the backward reads that is one of p's
own stages and not 0-d (the stages a schedule of p names, so that p's schedules apply to the
saving forward unchanged); the rest (operations the derivation gave a stage of their own, such
as the `a + b1` inside `gelu(a + b1)`, and 0-d values) are recomputed by the backward from the
saved values and the inputs.

- forward `<p>_fwd`: p, returning its outputs and then the saved values (`saved_<v>`);
- backward `<p>_bwd`: p's parameters, then the saved values (parameters named as the stages,
  their types and layouts), then the cotangents (as g's); it returns g's outputs.

Both are ordinary programs: checked, planned, scheduled (the file's schedules of p and of
grad(p) are applied to them again: their stage names are p's and g's)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from coconetc.autodiff.vjp import cotangent_params, live
from coconetc.ir.expr import refs
from coconetc.ir.nodes import Param, Program


@dataclass(frozen=True)
class Split:
    forward: Program  # p returning its outputs, then the saved values
    backward: Program  # p's parameters, the saved values, the cotangents -> g's outputs
    saved: tuple[str, ...]  # the values the forward keeps, in the order both use
    recomputed: tuple[str, ...]  # the forward values the backward computes again


def fwd_name(program: str) -> str:
    return f"{program}_fwd"


def bwd_name(program: str) -> str:
    return f"{program}_bwd"


def split(p: Program, g: Program) -> Split:
    own = {s.name for s in p.stages}
    dep = set(cotangent_params(g, p))
    outs = {s for _, s in g.outputs}
    forward: dict[str, object] = {}
    for st in g.stages:
        if dep & set(refs(st.expr)) or st.name in outs:
            dep.add(st.name)
        else:
            forward[st.name] = st
    saved: list[str] = []
    again: set[str] = set()

    def need(name: str) -> None:
        if name not in forward or name in saved or name in again:
            return
        if name in own and g.stage_named(name).type.ndim > 0:
            saved.append(name)
            return
        again.add(name)
        for r in refs(g.stage_named(name).expr):
            need(r)

    for st in g.stages:
        if st.name in dep:
            for r in refs(st.expr):
                need(r)
    order = [s.name for s in g.stages if s.name in saved]  # the program's order
    fwd = replace(p, name=fwd_name(p.name),
                  outputs=tuple(p.outputs) + tuple((f"saved_{v}", v) for v in order))
    kept = [st for st in g.stages if st.name not in saved and (st.name in dep or st.name in again)]
    n = len(p.params)
    params = (*g.params[:n], *(Param(v, g.stage_named(v).type) for v in order), *g.params[n:])
    bwd = replace(g, name=bwd_name(p.name), params=params, stages=tuple(live(kept, g.outputs)))
    return Split(fwd, bwd, tuple(order), tuple(s.name for s in bwd.stages if s.name in again))
