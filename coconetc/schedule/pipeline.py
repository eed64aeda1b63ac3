"""The `pipeline(...)` directive: a model program's layers cut into pipeline stages, run on
micro-batches in an order of coconetc.pipeline.orders (docs/pipeline.md).

    schedule pp for gpt {
        pipeline(stages=2, microbatches=4, order="zero_bubble")
    }

It names the repeat whose layers it cuts (`pipeline(y, ...)`, or the program's only repeat) and
takes: stages (pipeline ranks, P), microbatches (M), order (a name of orders.ORDERS, default
"1f1b"), chunks (V model chunks a rank: the interleaved order's, 2 by default; zero_bubble_v's,
2; the others' 1),
layers (each virtual stage's layer count, in stage order; default as even as can be, the first
stages taking one more) and max_activations (refuses an order under which a rank would hold
more micro-batches' activations at once). It changes nothing the program computes: the
program is checked against it (the layers are there, the split is legal, the order exists and
keeps to the limit) and the plan shows its timeline."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from coconetc.errors import CompileError, Span
from coconetc.ir.expr import Expr, Op, Ref, refs, walk
from coconetc.ir.layers import layer_ranges, repeats, stray
from coconetc.ir.nodes import Param, Program
from coconetc.pipeline import orders

@dataclass(frozen=True)
class Pipeline:
    """pipeline([repeat, ]stages=P, microbatches=M, order="1f1b", chunks=V, layers=[...], max_activations=K)"""

    repeat: str | None
    stages: int
    microbatches: int
    order: str
    chunks: int
    layers: tuple[int, ...] | None
    max_activations: int | None
    span: Span = field(compare=False)
    where: tuple[tuple[str, Span], ...] = field(default=(), compare=False, repr=False)

    def at(self, key: str) -> Span:
        return dict(self.where).get(key) or self.span


def directive(directives) -> Pipeline | None:
    """The pipeline(...) directive among a schedule's DIRECTIVES (None: it has none)."""
    return next((d for d in directives if isinstance(d, Pipeline)), None)


def repeat_of(p: Program, d: Any, word: str = "pipeline") -> str:
    """The repeat D (a pipeline or each_layer directive, WORD) is about: the one it names, or
    p's only one."""
    names = repeats(p)
    if d.repeat is not None:
        if d.repeat not in names:
            raise CompileError.at(d.at(d.repeat), f"{word}(): '{d.repeat}' is not a repeat of {p.name} "
                                  f"(its repeats: {', '.join(names) or 'none'})")
        return d.repeat
    if len(names) != 1:
        what = "cut into stages" if word == "pipeline" else "schedule"
        why = f"has no repeat (`y = repeat(block, x, ...)`) to {what}" if not names else \
            f"has {len(names)} repeats ({', '.join(names)}): name the one to {what}, {word}({names[0]}, ...)"
        raise CompileError.at(d.at("()"), f"{word}(): {p.name} {why}")
    return names[0]


@dataclass(frozen=True)
class Cut:
    """What a checked pipeline directive runs: the order, and each virtual stage's layers."""

    repeat: str
    order: orders.Order
    layers: tuple[tuple[int, int], ...]  # virtual stage -> [first layer, stop)


def cut(p: Program, d: Pipeline) -> Cut:
    """D checked against p; raises CompileError at the argument that is wrong."""
    name = repeat_of(p, d)
    bad = stray(p, name)
    if bad is not None:
        raise CompileError.at(bad[0].span, f"pipeline(): stage '{bad[0].name}' is named as repeat() names a stage "
                              f"of layer {bad[1]} of {name} ({name}__l<layer>__<stage>), but it is not one (the "
                              "other layers have no such stage, or it stands apart from its layer's stages): the "
                              "layers are found by these names; rename it")
    try:
        order = orders.make(d.order, d.stages, d.microbatches, d.chunks)
    except ValueError as err:
        key = "order=" if "order" in str(err) and d.order not in orders.ORDERS else \
            "microbatches=" if "microbatch" in str(err) else "chunks="
        raise CompileError.at(d.at(key), f"pipeline(): {err}") from None
    n = len(layer_ranges(p, name))
    virtual = d.stages * d.chunks
    # the chunks first: with a chunk count that divides the layers, stages=n // chunks is a cut
    # (the stages' advice below never leads to this refusal)
    if d.chunks > 1 and n % d.chunks:
        raise CompileError.at(d.at("chunks="), f"pipeline(): chunks={d.chunks} does not divide {name}'s {n} layers "
                              f"into equal chunks a rank (use a chunk count that divides {n})")
    if virtual > n:
        many = f"{d.stages} stages" if d.chunks == 1 else f"{d.stages} stages x {d.chunks} chunks a rank"
        raise CompileError.at(d.at("stages="), f"pipeline(): {many} need {virtual} layers; {name} has {n} "
                              f"(use stages={n // d.chunks} or fewer)")
    even = orders.layer_bounds(n, virtual)
    sizes = d.layers if d.layers is not None else tuple(b - a for a, b in zip(even, even[1:]))
    if d.layers is not None:
        if len(sizes) != virtual:
            raise CompileError.at(d.at("layers="), f"pipeline(): layers= gives {len(sizes)} stages' layers; "
                                  f"the pipeline has {virtual} virtual stages ({d.stages} x {d.chunks})")
        if any(k < 1 for k in sizes):
            s = next(i for i, k in enumerate(sizes) if k < 1)
            raise CompileError.at(d.at("layers="), f"pipeline(): virtual stage {s} has "
                                  f"{'no' if sizes[s] == 0 else sizes[s]} layers; every stage needs at least one")
        if sum(sizes) != n:
            raise CompileError.at(d.at("layers="), f"pipeline(): layers= adds up to {sum(sizes)}; {name} has {n}")
    if d.max_activations is not None:
        peak = _peaks(order)
        worst = max(range(d.stages), key=lambda r: peak[r])
        if peak[worst] > d.max_activations:
            raise CompileError.at(d.at("max_activations="), f"pipeline(): order {d.order} holds {peak[worst]} "
                                  f"micro-batches' activations at once on rank {worst}, over max_activations="
                                  f"{d.max_activations} ({_within(d)})")
    bounds, start = [], 0
    for k in sizes:
        bounds.append((start, start + k))
        start += k
    return Cut(name, order, tuple(bounds))


def _peaks(order: orders.Order) -> list[int]:
    """Each rank's most micro-batches held at once, ORDER simulated at unit costs."""
    t = orders.simulate(order)
    return [t.peak_activations(r) for r in range(order.ranks)]


def _within(d: Pipeline) -> str:
    """What keeps to D's max_activations: the other one-chunk orders that do at its stages and
    micro-batches, and the most micro-batches its own order does it with (M = 1 holds one)."""
    assert d.max_activations is not None
    fits = [f'order "{o}"' for o in orders.ORDERS if o != d.order and orders.default_chunks(o) == 1
            and max(_peaks(orders.make(o, d.stages, d.microbatches))) <= d.max_activations]
    for m in range(d.microbatches - 1, 0, -1):
        try:
            within = max(_peaks(orders.make(d.order, d.stages, m, d.chunks))) <= d.max_activations
        except ValueError:  # (the interleaved order: micro-batches a multiple of the stages)
            continue
        if within:
            return "within it: " + _either(fits + [f"microbatches={m}"])
    return "within it: " + _either(fits) if fits else "no order keeps to it: a larger max_activations"


def _either(choices: list[str]) -> str:
    return choices[0] if len(choices) == 1 else ", ".join(choices[:-1]) + " or " + choices[-1]


def check(p: Program, d: Pipeline) -> Program:
    """apply()'s entry: the program unchanged, once D is legal for it."""
    cut(p, d)
    return p


def timeline_text(p: Program, d: Pipeline, width: int = 100) -> str:
    """The plan's pipeline section: each virtual stage's layers, each rank's actions in order,
    and the simulated timeline (orders.render) with the bubble and the peak activations; the
    costs: a forward of one layer 1, its backward 2 (input gradient 1 and weight gradient 1
    when the order splits it), each scaled by the stages' mean layer count."""
    c = cut(p, d)
    order = c.order
    lines = [f"# pipeline: {d.stages} stages x {d.chunks} chunk(s) a rank, {d.microbatches} micro-batches, "
             f"order {d.order}, the layers of {c.repeat}"]
    for s, (a, b) in enumerate(c.layers):
        rank, chunk = order.place(s)
        lines.append(f"#   virtual stage {s} (rank {rank}, chunk {chunk}): layers {a}..{b - 1}")
    for r, acts in enumerate(order.actions):
        lines.append(f"#   rank {r}: {' '.join(map(str, acts))}")
    per_stage = [b - a for a, b in c.layers]
    mean = sum(per_stage) / len(per_stage)
    costs = orders.Costs(forward=mean, backward=2 * mean, input_grad=mean, weight_grad=mean)
    t = orders.simulate(order, costs)
    lines += [f"# {ln}" for ln in orders.render(t, width).splitlines()]
    return "\n".join(lines)


def stage_rows(p: Program, c: Cut, stage: int) -> dict[str, tuple[int, int]]:
    """The rows [first, stop) of each stacked parameter (`w: f32[L, ...]`, read only as layers
    `index(w, l)`) that virtual stage STAGE reads: its program takes that part of the parameter
    (stage_program), and its gradient is that part of the whole one."""
    lo, hi = stage_bounds(p, c, stage)
    used: dict[str, list[int]] = {}
    other: set[str] = set()
    for st in p.stages[lo:hi]:
        for e in walk(st.expr):
            if isinstance(e, Op):
                for i, a in enumerate(e.args):
                    if isinstance(a, Ref) and p.param(a.name) is not None:
                        if e.op == "index" and i == 0:
                            used.setdefault(a.name, []).append(int(e.attr("i")))
                        else:
                            other.add(a.name)
    return {n: (min(ks), max(ks) + 1) for n, ks in used.items() if n not in other}


def stage_bounds(p: Program, c: Cut, stage: int) -> tuple[int, int]:
    """Virtual stage STAGE's stages of p as [lo, hi) indices: its layers' (the first stage also
    those before the repeat, the last those after it)."""
    ranges = layer_ranges(p, c.repeat)
    a, b = c.layers[stage]
    lo = 0 if stage == 0 else ranges[a][0]
    hi = len(p.stages) if stage == len(c.layers) - 1 else ranges[b - 1][1]
    return lo, hi


def stage_program(p: Program, c: Cut, stage: int, name: str | None = None) -> Program:
    """Virtual stage STAGE of p cut by C, as a program of its own (`<p>_stage<k>`): the stages
    of its layers (the first stage also those before the repeat, the last those after it); its
    parameters, in p's order, p's parameters it reads (a stacked one: only the rows of its layers,
    stage_rows), then the values of earlier stages it reads (the activation it receives, typed
    as p types it); it returns what later stages read (the activation it sends on), or p's
    outputs (the last stage)."""
    if p.updates:
        raise CompileError.at(p.span, f"pipeline(): {p.name} updates its parameters; a pipeline cuts a "
                              "program without update (the optimizer steps after the backward)")
    lo, hi = stage_bounds(p, c, stage)
    rows = stage_rows(p, c, stage)
    types = {n: replace(p.type_of(n), shape=(b - a, *p.type_of(n).shape[1:])) for n, (a, b) in rows.items()}

    def rebased(e: Expr) -> Expr:
        if isinstance(e, Ref) and e.name in types:
            return replace(e, type=types[e.name])
        if isinstance(e, Op):
            args = tuple(rebased(x) for x in e.args)
            attrs = e.attrs
            if e.op == "index" and isinstance(e.args[0], Ref) and e.args[0].name in rows:
                first = rows[e.args[0].name][0]
                attrs = tuple((k, v - first if k == "i" else v) for k, v in e.attrs)
            return replace(e, args=args, attrs=attrs)
        return e

    inside = tuple(replace(st, expr=rebased(st.expr)) for st in p.stages[lo:hi])
    defined = {s.name for s in inside}
    read: dict[str, None] = {}
    for s in inside:
        for r in refs(s.expr):
            if r not in defined:
                read.setdefault(r)
    params = [replace(q, type=types[q.name]) if q.name in types else q for q in p.params if q.name in read]
    params += [Param(n, p.stage_named(n).type) for n in read if p.param(n) is None]
    if stage == len(c.layers) - 1:
        outputs = tuple(o for o in p.outputs if o[1] in defined)
    else:
        later = {r for s in p.stages[hi:] for r in refs(s.expr)} | {s for _, s in p.outputs}
        outputs = tuple((n, n) for n in defined if n in later)
    return Program(name or f"{p.name}_stage{stage}", tuple(params), inside, outputs, span=p.span)


def stage_name(program: str, schedule: str, stage: int) -> str:
    """The name of a pipeline schedule's virtual stage program in a file (sourcefile.with_grads)."""
    return f"{program}_{schedule}_stage{stage}"


def stage_input(p: Program, sp: Program, stage: int, first: str) -> str:
    """The parameter of SP (virtual stage STAGE of p) that receives the activation: FIRST (p's
    parameter the layers start from, named by the caller) on stage 0, else the one value an
    earlier stage sends."""
    if stage == 0:
        if sp.param(first) is None:
            raise CompileError.at(p.span, f"pipeline: {p.name}'s first stage reads no parameter '{first}' "
                                  f"(its parameters: {', '.join(q.name for q in sp.params)})")
        return first
    received = [q.name for q in sp.params if p.param(q.name) is None]
    if len(received) != 1:
        raise CompileError.at(p.span, f"pipeline: stage {stage} of {p.name} receives {len(received)} values "
                              f"({', '.join(received)}); a stage receives one (the repeat's carried value)")
    return received[0]
