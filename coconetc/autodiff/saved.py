"""The derived program cut in two at the values the forward keeps for the backward, as a
training framework runs it: a forward that also returns the *saved values*, and a backward that
reads them instead of computing them again.

g = vjp(p) computes p's values before its cotangents (the values the backward reads). split(p,
g) chooses which of them the forward saves: every value the backward reads that is one of p's
own stages and not 0-d (the stages a schedule of p names, so that p's schedules apply to the
saving forward unchanged), except a layer of a stacked parameter (`index(w, i)`: a view of w);
the rest (operations the derivation gave a stage of their own, such
as the `a + b1` inside `gelu(a + b1)`, and 0-d values) are recomputed by the backward from the
saved values and the inputs.

- forward `<p>_fwd`: p, returning its outputs and then the saved values (`saved_<v>`);
- backward `<p>_bwd`: p's parameters, then the saved values (parameters named as the stages,
  their types and layouts), then the cotangents (as g's); it returns g's outputs.

Both are ordinary programs: checked, planned, scheduled (the file's schedules of p and of
grad(p) are applied to them again: their stage names are p's and g's)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from coconetc.autodiff.vjp import cotangent_params, live, recomputed
from coconetc.ir.expr import Op, Ref, refs
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
        if name in own and g.stage_named(name).type.ndim > 0 and not _layer_of_param(g.stage_named(name).expr, p):
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


def _layer_of_param(e: object, p: Program) -> bool:
    """index(w, i) of a parameter w (a layer of a stacked parameter, repeat): recomputed by the
    backward, where it is a view of w (plan/targets.py), rather than saved (a copy of the layer
    returned by the forward)."""
    return isinstance(e, Op) and e.op == "index" and isinstance(e.args[0], Ref) and p.param(e.args[0].name) is not None


@dataclass(frozen=True)
class Pairing:
    """The two programs a training step runs for program p under a forward `schedule` and a
    backward `grad_schedule`: p's saving forward `<p>_fwd` and the backward `<p>_bwd` that
    reads what it saved, where both schedules apply to the programs cut there (the default, or
    a schedule the file has for each); otherwise p itself and the whole derived program, which
    computes the forward values it reads again. saved: the values the forward keeps (the
    backward's parameters between p's and the cotangents); recomputed: the forward values the
    backward computes."""

    forward: str
    backward: str
    saved: tuple[str, ...]
    recomputed: tuple[str, ...]
    cut: bool


def pairing(programs: dict[str, Program], schedules: dict[str, dict], program: str, grad: str,
            schedule: str, grad_schedule: str, default: str) -> Pairing:
    """The Pairing of PROGRAM (its derived program GRAD) in a file whose programs (the
    derived and cut ones included: sourcefile.with_grads) and schedules by program are given;
    DEFAULT: the unscheduled program's label."""
    fwd, bwd = fwd_name(program), bwd_name(program)
    cut = (schedule == default or schedule in schedules.get(fwd, {})) and \
        (grad_schedule == default or grad_schedule in schedules.get(bwd, {}))
    p, g = programs[program], programs[grad]
    back = programs[bwd if cut else grad]
    saved = tuple(q.name for q in back.params[len(p.params):len(back.params) - len(cotangent_params(g, p))])
    again = set(recomputed(g, p))
    return Pairing(fwd if cut else program, bwd if cut else grad, saved,
                   tuple(s.name for s in back.stages if s.name in again), cut)
