"""The derived program cut in two at the values the forward keeps for the backward, as a
training framework runs it: a forward that also returns the *saved values*, and a backward that
reads them instead of computing them again.

g = vjp(p) computes p's values before its cotangents (the values the backward reads). split(p,
g) chooses which of them the forward saves: every value the backward reads that is one of p's
own stages and not 0-d (the stages a schedule of p names, so that p's schedules apply to the
saving forward unchanged), except a layer of a stacked parameter (`index(w, i)`: a view of w)
and a weight's all-gather (ir/gathers.py: a parameter sliced over the ranks, gathered where it
is used; FSDP's reshard after the forward: the backward gathers it again, so that between the
two a rank holds only its slices; a schedule's keep_gathered() pairs the cut that saves them,
`<p>_fwd_kept`/`<p>_bwd_kept`); the rest (operations the derivation gave a stage of their own, such
as the `a + b1` inside `gelu(a + b1)`, and 0-d values) are recomputed by the backward from the
saved values and the inputs; so is a dropout of one of p's stages (attention's `a = dropout(p)`:
its mask is drawn again from the seed; _dropout_of_own).

- forward `<p>_fwd`: p, returning its outputs and then the saved values (`saved_<v>`);
- backward `<p>_bwd`: p's parameters, then the saved values (parameters named as the stages,
  their types and layouts), then the cotangents (as g's); it returns g's outputs.

Both are ordinary programs: checked, planned, scheduled (the file's schedules of p and of
grad(p) are applied to them again: their stage names are p's and g's)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from coconetc.autodiff.vjp import cotangent_params, live, recomputed
from coconetc.ir.expr import Op, Ref, refs
from coconetc.ir.gathers import weight_of
from coconetc.ir.nodes import Param, Program, Stage


@dataclass(frozen=True)
class Split:
    forward: Program  # p returning its outputs, then the saved values
    backward: Program  # p's parameters, the saved values, the cotangents -> g's outputs
    saved: tuple[str, ...]  # the values the forward keeps, in the order both use
    recomputed: tuple[str, ...]  # the forward values the backward computes again


KEPT = "_kept"  # the cut that keeps the forward's gathered weights (keep_gathered()): <p>_fwd_kept, <p>_bwd_kept


def fwd_name(program: str, kept: bool = False) -> str:
    return f"{program}_fwd{KEPT if kept else ''}"


def bwd_name(program: str, kept: bool = False) -> str:
    return f"{program}_bwd{KEPT if kept else ''}"


def split(p: Program, g: Program, keep_gathered: bool = False) -> Split:
    """p's derived program G cut at the values p's forward saves for the backward (the module
    docstring). keep_gathered: the weights' all-gathers are saved too (the schedule directive
    keep_gathered(): memory for time), named <p>_fwd_kept, <p>_bwd_kept; by default the
    backward gathers them again."""
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
        e = g.stage_named(name).expr
        if name in own and g.stage_named(name).type.ndim > 0 and not _layer_of_param(e, p) \
                and (keep_gathered or not _weight_gather(e, p)) and not _dropout_of_own(e, own):
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
    fwd = replace(p, name=fwd_name(p.name, keep_gathered),
                  outputs=tuple(p.outputs) + tuple((f"saved_{v}", v) for v in order))
    kept = [st for st in g.stages if st.name not in saved and (st.name in dep or st.name in again)]
    n = len(p.params)
    params = (*g.params[:n], *(Param(v, g.stage_named(v).type) for v in order), *g.params[n:])
    bwd = replace(g, name=bwd_name(p.name, keep_gathered), params=params, stages=tuple(live(kept, g.outputs)))
    return Split(fwd, bwd, tuple(order), tuple(s.name for s in bwd.stages if s.name in again))


def _weight_gather(e: object, p: Program) -> bool:
    """allgather of a weight (ir/gathers.py): gathered again by the backward, not saved."""
    return isinstance(e, Op) and e.op == "allgather" and bool(e.args) and weight_of(p, e.args[0]) is not None


def _dropout_of_own(e: object, own: set[str]) -> bool:
    """dropout(x, rate, seed) of a stage x of p: recomputed by the backward from x (saved in its
    place where the backward reads it), its mask drawn again at the same elements (a pure function
    of the seed, the site and the element's index), rather than saved beside x: attention's
    a = dropout(p) is a second [.., S, S] value per layer otherwise. At rate 0 it is a copy (none
    inside the CPU's attention call, which computes it from p as it goes); at a rate above 0 one
    more pass of the generator where no call takes it in."""
    return isinstance(e, Op) and e.op == "dropout" and isinstance(e.args[0], Ref) and e.args[0].name in own


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
    fwd, bwd = _cut_names(schedules, program, grad, grad_schedule)
    cut = _applies(schedules, fwd, schedule, default) and _applies(schedules, bwd, grad_schedule, default)
    p, g = programs[program], programs[grad]
    back = programs[bwd if cut else grad]
    saved = tuple(q.name for q in back.params[len(p.params):len(back.params) - len(cotangent_params(g, p))])
    again = set(recomputed(g, p))
    return Pairing(fwd if cut else program, bwd if cut else grad, saved,
                   tuple(s.name for s in back.stages if s.name in again), cut)


def _cut_names(schedules: dict[str, dict], program: str, grad: str, grad_schedule: str) -> tuple[str, str]:
    """The forward and backward of PROGRAM's training cut that GRAD_SCHEDULE pairs: a grad
    schedule that says keep_gathered() pairs the cut that keeps the gathered weights
    (sourcefile.ScheduleIR.keeps_gathered; the schedule layer is above this one)."""
    kept = bool(getattr(schedules.get(grad, {}).get(grad_schedule), "keeps_gathered", False))
    return fwd_name(program, kept), bwd_name(program, kept)


def _applies(schedules: dict[str, dict], cut: str, schedule: str, default: str) -> bool:
    """SCHEDULE applies to the cut program CUT (with_grads gave it the schedules that do)."""
    return schedule == default or schedule in schedules.get(cut, {})


def uncut(schedules: dict[str, dict], program: str, grad: str, schedule: str, grad_schedule: str,
          default: str) -> str:
    """Why `pairing` runs PROGRAM and the whole derived program GRAD rather than the training cut
    under these schedules, naming the schedules that do apply to each cut program; "" where it
    cuts."""
    fwd, bwd = _cut_names(schedules, program, grad, grad_schedule)
    why = []
    for s, cut, what in ((schedule, fwd, "schedule"), (grad_schedule, bwd, "grad_schedule")):
        if not _applies(schedules, cut, s, default):
            fits = [n for n, v in schedules.get(cut, {}).items() if n != default and not getattr(v, "auto", False)]
            why.append(f"{what} {s!r} names values {cut} does not have (the schedules that apply to "
                       f"{cut}: {', '.join(repr(n) for n in fits) or 'none but the default'})")
    if not why:
        return ""
    return ("; ".join(why) + f", so each training step runs {program} and then the whole derived program "
            f"{grad}, which computes the forward again (`coconetc show FILE -p {program} --grad -s "
            f"{grad_schedule}` says what a step runs)")


@dataclass(frozen=True)
class InputWeight:
    """The backward `<p>_bwd` cut in two for a pipeline's zero-bubble orders (Qi et al. 2023):
    `input_grad` computes the gradients of INPUTS (the activations a pipeline stage sends back)
    and `weight_grad` the rest (the weights'), later, from what input_grad kept.

    - `<p>_bwd_input`: `<p>_bwd`'s parameters; returns the gradients of the inputs, then the
      values the weight gradients read that it computed on the way (`kept_<v>`: cotangents
      such as the gradient of a matmul's output, and forward values the backward recomputed);
    - `<p>_bwd_weight`: `<p>_bwd`'s parameters, then the kept values (parameters named as
      the stages); returns the other gradients, computing only what input_grad did not.

    So no stage is computed twice: the two together do what `<p>_bwd` does."""

    input_grad: Program
    weight_grad: Program
    grads: tuple[str, ...]  # input_grad's outputs that are gradients (`d_<x>`): INPUTS' and any it made anyway
    kept: tuple[str, ...]  # the values input_grad hands to weight_grad, in the order both use


def input_name(program: str) -> str:
    return f"{program}_bwd_input"


def weight_name(program: str) -> str:
    return f"{program}_bwd_weight"


def split_input_weight(p: Program, bwd: Program, inputs: tuple[str, ...]) -> InputWeight:
    """`bwd` (split(p, g).backward) cut at the gradients of p's parameters INPUTS (see
    InputWeight). Raises ValueError naming an input that is not a differentiated parameter."""
    grads = dict(bwd.outputs)
    for x in inputs:
        if f"d_{x}" not in grads:
            known = ", ".join(n[2:] for n in grads)
            raise ValueError(f"{p.name}: {x!r} has no gradient to split the backward at (the "
                             f"differentiated parameters: {known})")
    ins = tuple((f"d_{x}", grads[f"d_{x}"]) for x in inputs)
    first = live(bwd.stages, ins)
    done = {s.name for s in first}
    # a weight's gradient input_grad computes anyway (a stage it needs too) is its output
    early = tuple(o for o in bwd.outputs if o not in ins and o[1] in done)
    rest = tuple(o for o in bwd.outputs if o not in ins and o not in early)
    later = [s for s in live(bwd.stages, rest) if s.name not in done]
    wanted = {r for s in later for r in refs(s.expr)} | {s for _, s in rest}
    kept = tuple(s.name for s in first if s.name in wanted)
    b = replace(bwd, name=input_name(p.name), stages=tuple(first),
                outputs=ins + early + tuple((f"kept_{v}", v) for v in kept))
    w = replace(bwd, name=weight_name(p.name), stages=tuple(later), outputs=rest,
                params=(*bwd.params, *(Param(v, bwd.stage_named(v).type) for v in kept)))
    return InputWeight(b, w, tuple(n for n, _ in ins + early), kept)


ACC = "_acc"  # a backward that adds the weights' gradients into accumulators: <p>_bwd_acc, <p>_bwd_weight_acc


def acc_name(backward: str) -> str:
    return f"{backward}{ACC}"


def accumulator(weight: str) -> str:
    """The parameter of an accumulating backward that weight W's gradient is added into."""
    return f"acc_{weight}"


def accumulating(bwd: Program, weights: tuple[str, ...]) -> Program:
    """BWD (a backward: `<p>_bwd` or `<p>_bwd_weight`) adding the gradient of each of WEIGHTS it
    returns into a parameter of its own instead, in place: `acc_<w>` of the gradient's type,
    `update(acc_<w>, acc_<w> + d_<w>)` right after the stage that computes it (so a weight
    gradient that is one GEMM becomes one GEMM with beta = 1 into the accumulator on the CPU:
    plan/epilogue.py accumulates). The gradients of micro-batches after the first add up in
    `.grad` with no tensor of their own and no pass adding them (Megatron's gradient
    accumulation fusion); its other outputs (an input's gradient) are returned as BWD's."""
    outs = dict(bwd.outputs)
    names = {st.name for st in bwd.stages}
    stage_of = {w: outs[f"d_{w}"] for w in weights if outs.get(f"d_{w}") in names}
    shared = Counter(stage_of.values())  # (a stage that is two weights' gradient: returned as it is)
    of = {st: w for w, st in stage_of.items() if shared[st] == 1}
    params, stages, updates = list(bwd.params), [], []
    for st in bwd.stages:
        stages.append(st)
        w = of.get(st.name)
        if w is not None:
            t = st.type
            acc = accumulator(w)
            params.append(Param(acc, t))
            stages.append(Stage(f"{st.name}{ACC}", Op("add", (Ref(acc, t), Ref(st.name, t)), t), st.span))
            updates.append((acc, f"{st.name}{ACC}"))
    return replace(bwd, name=acc_name(bwd.name), params=tuple(params), stages=tuple(stages),
                   outputs=tuple(o for o in bwd.outputs if o[1] not in of), updates=tuple(updates))
