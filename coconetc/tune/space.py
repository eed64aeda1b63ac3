"""The schedules the autotuner considers for one program: the file's own, plus the ones it
writes itself from the program's IR.

For every allreduce `s` of the program (the same level applied to each allreduce that admits
it) the generated schedules are, with their labels:

    auto_split            rs, ag = split(s)
    auto_rs_c_ag          + agX.. = reorder(ag, <the computations that follow s>)
    auto_rs_c_ag_slice    + slice(<the optimizer state>)
    auto_fused            split, reorder, fuse(rs, <moved stages>, <one gather>)
    auto_fused_slice      split, reorder, slice, fuse
    ..._overlapK          + overlap(<the matmul producing s's input>, <s, rs or the fusion>,
                          chunks=K) for K in 2, 4, 8 (also on the unsplit allreduce: auto_overlapK),
                          and overlap(<g>, <the matmul that reads g>, chunks=K) for each
                          allgather or broadcast g a matmul reads (left operand first)
    ..._dD                split along dim D (every dim of s is tried; D = 0 is not named)

"The computations that follow s": every stage that reads s's value directly or through other
such stages (the reorder check moves what may move; if all of them cannot, the last ones are
dropped one at a time). "The optimizer state": a parameter whose update feeds the update of
another parameter (Adam's m and v feed w's update; w itself feeds no other update: it is the
weights, which the rest of a model reads whole, so the tuner never slices them).

Every candidate goes through the schedule checks (coconetc/schedule) and the planner; an
illegal one is dropped, never run. A generated schedule whose scheduled program prints as a
hand-written one's is the hand-written one (its label is kept)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from coconetc.sourcefile import DEFAULT, SourceFile
from coconetc.errors import NOWHERE, CompileError, ScheduleError
from coconetc.ir import printer
from coconetc.ir.nodes import Op, Program, Ref, Stage
from coconetc.ir.rewrite import depends_on
from coconetc.plan import Plan, PlanError, plan_program
from coconetc.plan.label import parse
from coconetc.plan.units import Fused, Overlap
from coconetc.schedule import apply_all
from coconetc.schedule.directives import Directive, Fuse, OverlapD, Reorder, Slice, Split, schedule_text
from coconetc.schedule.fusion import GATHERS
from coconetc.schedule.primitives import reorder_gathers

CHUNKS = (2, 4, 8)
LEVELS = ("split", "rs_c_ag", "rs_c_ag_slice", "fused", "fused_slice")


@dataclass(frozen=True)
class Candidate:
    label: str
    program: str
    directives: tuple[Directive, ...]
    ir: Program
    plan: Plan
    generated: bool
    convention: str = ""  # see convention()

    @property
    def schedule(self) -> str:
        """The schedule's name: the label without its fused-collective algorithm ("zero@p2p")."""
        return parse(self.label).name

    @property
    def text(self) -> str:
        """The schedule as a .ccn block ('' for the program itself)."""
        if self.schedule == DEFAULT:
            return ""
        return schedule_text(self.schedule, self.program, self.directives)


# The fused collectives' algorithms the tuner measures besides the default (the node's
# shared-memory window where every rank is on one node): point-to-point messages.
ALGORITHMS = ("p2p",)


def algorithm_variants(cands: list[Candidate], ranks: int) -> list[Candidate]:
    """The fused-collective algorithm as a choice: each candidate with a fused collective again
    as "label@p2p" (plan/label.py: ScheduleLabel), the plain label running on the shared
    window where it can. None on one rank (no communication to choose for)."""
    if ranks <= 1:
        return []
    return [replace(c, label=str(parse(c.label).with_algorithm(a))) for c in cands if has_fused(c.plan)
            for a in ALGORITHMS]


def has_fused(plan: Plan) -> bool:
    def fused(units) -> bool:
        return any(isinstance(u, Fused) or (isinstance(u, Overlap) and u.fused is not None) for u in units)
    return fused(plan.units)


def convention(ir: Program, base: Program) -> str:
    """The calling convention of a scheduled program relative to its program's: '' when every
    parameter keeps its declared layout, else e.g. 'm: sliced(0), v: sliced(0)'."""
    diff = []
    for q in ir.params:
        old = base.param(q.name)
        if old is None or old.type.layout != q.type.layout:
            diff.append(f"{q.name}: {q.type.layout}")
    return ", ".join(diff)


def candidates(mod: SourceFile, program: str) -> list[Candidate]:
    """The program itself, its hand-written schedules, then the generated ones that are legal
    and not the same as one before them."""
    base = mod.programs[program]
    out = [Candidate(DEFAULT, program, (), base, mod.plans[(program, DEFAULT)], False)]
    for name, s in mod.schedules.get(program, {}).items():
        if s.ir is not None:
            out.append(Candidate(name, program, s.directives, s.ir, mod.plans[(program, name)],
                                 False, convention(s.ir, base)))
    seen = {printer.program(c.ir) for c in out}
    for label, ds in generate(base):
        ir = _checked(base, ds)
        if ir is None:
            continue
        key = printer.program(ir)
        if key in seen:
            continue
        seen.add(key)
        try:
            plan = plan_program(ir, label)
        except (PlanError, CompileError, ScheduleError):
            continue
        out.append(Candidate(label, program, ds, ir, plan, True, convention(ir, base)))
    return out


def _checked(base: Program, ds: tuple[Directive, ...]) -> Program | None:
    try:
        return apply_all(base, ds)
    except (ScheduleError, CompileError, PlanError):
        return None


def generate(p: Program) -> list[tuple[str, tuple[Directive, ...]]]:
    """(label, directives) of every schedule the tuner writes for p, legal or not yet known."""
    ars = [s.name for s in p.stages if s.kind == "collective" and s.top.op == "allreduce"]
    state = state_params(p)
    out: list[tuple[str, tuple[Directive, ...]]] = []
    for k in CHUNKS:
        ds = _overlaps(p, ars, {}, k)
        ds += _gather_overlaps(p, ds, k)
        if ds:
            out.append((f"auto_overlap{k}", ds))
    dims = range(max((p.type_of(a).ndim for a in ars), default=0))
    for dim in dims:
        for level in LEVELS:
            ds, consumers = _level(p, ars, level, dim, state)
            if not ds:
                continue
            label = f"auto_{level}" + (f"_d{dim}" if dim else "")
            out.append((label, ds))
            ds, consumers = _named_fusions(p, ds, consumers)  # `f = fuse(...)`, as the examples
            q = apply_all(p, ds)
            for k in CHUNKS:
                more = _overlaps(q, ars, consumers, k)
                more += _gather_overlaps(q, more, k)
                if more:
                    out.append((f"{label}_overlap{k}", ds + more))
    return out


def _named_fusions(p: Program, ds: tuple[Directive, ...], consumers: dict[str, str]):
    """The one unnamed fusion named `f` (what an overlap refers to, as the examples write it)."""
    fuses = [d for d in ds if isinstance(d, Fuse) and d.name is None]
    if len(fuses) != 1 or p.param("f") is not None or p.stage("f") is not None:
        return ds, consumers
    named = tuple(replace(d, name="f") if d is fuses[0] else d for d in ds)
    return named, {a: "f" if c == "fused0" else c for a, c in consumers.items()}


def state_params(p: Program) -> list[str]:
    """Updated parameters whose new value feeds the update of another parameter."""
    deps = depends_on(p)
    found = []
    for t, src in p.updates:
        if any(src in deps[other] for u, other in p.updates if u != t and other in deps):
            found.append(t)
    return found


def _level(p: Program, ars: list[str], level: str, dim: int, state: list[str]):
    """The directives of one level applied to each allreduce that admits it, and for each
    allreduce the stage or fusion an overlap would pipeline."""
    ds: list[Directive] = []
    consumers: dict[str, str] = {}
    q = p
    for a in ars:
        try:
            mine, consumer = _one(q, a, level, dim, state, len(ars) > 1)
            q = apply_all(q, mine)
        except (ScheduleError, CompileError, PlanError):
            continue
        ds += mine
        consumers[a] = consumer
    return tuple(ds), consumers


def _one(q: Program, a: str, level: str, dim: int, state: list[str], several: bool):
    rs, ag = (f"rs_{a}", f"ag_{a}") if several else ("rs", "ag")
    split = Split(a, dim, rs, ag, NOWHERE)
    q1 = apply_all(q, (split,))
    if level == "split":
        return [split], rs
    moved, outs = _movable(q1, ag)
    reorder = Reorder(ag, moved, outs, NOWHERE)
    q2 = apply_all(q1, (reorder,))
    ds: list[Directive] = [split, reorder]
    if level.endswith("slice"):
        todo = tuple(t for t in state if not q2.type_of(t).layout.sliced)
        if not todo:
            raise ScheduleError(NOWHERE, "slice", a, "no optimizer state to slice")
        ds.append(Slice(todo, NOWHERE))
        q2 = apply_all(q2, ds[-1:])
    if not level.startswith("fused"):
        return ds, rs
    fuse = _fuse(q2, rs, moved, outs)
    return ds + [fuse], fuse.name or "fused0"


def _movable(q: Program, ag: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The computations that follow ag (all of them, else fewer from the end) and the names of
    the allgathers the reorder returns."""
    deps = depends_on(q)
    follow = [s.name for s in q.stages if s.kind == "compute" and ag in deps[s.name]]
    while follow:
        try:
            needed = reorder_gathers(q, ag, tuple(follow))
            return tuple(follow), _gather_names(q, needed)
        except ScheduleError:
            follow.pop()
    raise ScheduleError(NOWHERE, "reorder", ag, "nothing after the allgather can move")


def _gather_names(q: Program, needed: list[str]) -> tuple[str, ...]:
    """agX for the parameter X a value updates, else ag + the stage's first letter (as the
    examples name them), made unique."""
    updated = {s: t for t, s in q.updates}
    names: list[str] = []
    for m in needed:
        name = "ag" + (updated[m] if m in updated else m[0])
        if name in names or q.param(name) or q.stage(name):
            name = f"ag_{m}"
        names.append(name)
    return tuple(names)


def _fuse(q: Program, rs: str, moved: tuple[str, ...], outs: tuple[str, ...]) -> Fuse:
    """fuse(rs, the moved stages still there, one of the gathers: the last one that is legal)."""
    members = [s for s in moved if q.stage(s) is not None and q.stage_named(s).type.layout.sliced]
    gathers = [g for g in outs if q.stage(g) is not None]
    for g in [*reversed(gathers), None]:
        f = Fuse((rs, *members, *([g] if g else [])), None, NOWHERE)
        try:
            plan_program(apply_all(q, (f,)))
            return f
        except (ScheduleError, CompileError, PlanError):
            continue
    raise ScheduleError(NOWHERE, "fuse", rs, "no fusion of the reducescatter is legal")


def _overlaps(q: Program, ars: list[str], consumers: dict[str, str], k: int) -> tuple[Directive, ...]:
    """overlap(<matmul>, <consumer>, chunks=k) for each allreduce fed by a matmul."""
    out: list[Directive] = []
    base = q
    for a in ars:
        producer = _matmul_input(base, a, consumers.get(a))
        if producer is None:
            continue
        consumer = consumers.get(a, a)
        d = OverlapD(producer, consumer, k, None, NOWHERE)
        try:
            plan_program(apply_all(q, (*out, d)))
        except (ScheduleError, CompileError, PlanError):
            continue
        out.append(d)
    return tuple(out)


def _gather_overlaps(q: Program, before: tuple[Directive, ...], k: int) -> tuple[Directive, ...]:
    """overlap(<gather>, <matmul>, chunks=k) for each allgather or broadcast (not fused) that a
    matmul stage reads as its left operand (the other way: all-gather-matmul), or else as its
    right one (a weight gathered where it is used: FSDP)."""
    out: list[Directive] = []
    for g in q.stages:
        if g.kind != "collective" or g.top.op not in GATHERS or q.fusion_of(g.name):
            continue
        reads = [(i, s) for s in q.users(g.name) if isinstance(s.expr, Op) and s.expr.op == "matmul"
                 for i, a in enumerate(s.expr.args) if isinstance(a, Ref) and a.name == g.name]
        y = min(reads, key=lambda r: r[0])[1] if reads else None
        if y is None:
            continue
        d = OverlapD(g.name, y.name, k, None, NOWHERE)
        try:
            plan_program(apply_all(q, (*before, *out, d)))
        except (ScheduleError, CompileError, PlanError):
            continue
        out.append(d)
    return tuple(out)


def _matmul_input(q: Program, a: str, consumer: str | None) -> str | None:
    """The matmul stage whose value the allreduce a (or what replaced it) reads."""
    name = a if q.stage(a) is not None else None
    if name is None and consumer is not None:
        f = next((f for f in q.fusions if f.name == consumer), None)
        name = f.stages[0] if f is not None else consumer
    s: Stage | None = q.stage(name) if name else None
    if s is None or not isinstance(s.expr, Op) or not isinstance(s.expr.args[0], Ref):
        return None
    src = q.stage(s.expr.args[0].name)
    if src is None or not isinstance(src.expr, Op) or src.expr.op != "matmul" or src.expr.args[1].type.ndim > 2:
        return None
    return src.name
