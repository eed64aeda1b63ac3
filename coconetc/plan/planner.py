"""From a scheduled program to its execution plan: one pure function, `plan_program`.

Every decision about how a program runs is taken here, for every backend: the order of the
stages, which pointwise stages share one loop, which values stay in registers, which stages
write their parameter in place or straight into an output, where non-pointwise parts of an
expression are computed first, what a fused collective computes on each chunk and what must
wait for all chunks, how an overlap cuts its matmul. What no backend can run is a PlanError
at the directive that asked for it, so `coconetc check` reports it.

The passes, in order, are one flat list, PASSES: lowering (what runs, the same for every
target), epilogues (plan/epilogue.py), attention calls (plan/attention.py), column sums
(plan/colsums.py), layernorm gradients (plan/lngrads.py), the per-target decisions (plan/targets.py: each target's algorithms and
chunking, buffer placement, what a target does not implement, located) and the verifier
(plan/verify.py). `coconetc show --format plan --after NAME` prints the plan after any of them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from coconetc.errors import NOWHERE, Span
from coconetc.ir import ops as registry
from coconetc.ir.gathers import weight_gathers
from coconetc.ir.nodes import POINTWISE, Const, Expr, Fusion, Op, Program, Ref, Stage, refs, walk
from coconetc.ir.rewrite import depends_on, retype
from coconetc.ir.types import TType
from coconetc.plan import attention
from coconetc.plan.colsums import with_colsums
from coconetc.plan.epilogue import with_epilogues
from coconetc.plan.lngrads import with_grads
from coconetc.plan.prefetch import with_prefetch
from coconetc.plan.fusion_legality import (REDUCE_UNIT, FusedSpec, GatherSpec, OverlapSpec, PlanError, fed_matmul,
                                           fused_spec, gather_spec, op_of, overlap_spec, row_op, same_elements, stage_of,
                                           substitute, unfed_matmul)
from coconetc.plan.targets import decide, diagnostics
from coconetc.plan.verify import verify
from coconetc.plan.units import (Buffer, Collective, Copy, Fused, GatherMatmul, Item, Let, Library, Loop, Overlap,
                                 Phase, Plan, Reduce, Require, StartGather, Term, Unit)


def _lower(plan: Plan, p: Program) -> Plan:
    return _Planner(p, plan.schedule).run()


def _prefetch(plan: Plan, p: Program) -> Plan:
    if not p.prefetch:
        return plan
    units = with_prefetch(list(plan.units), {b.name: b for b in plan.buffers}, p.prefetch, set(weight_gathers(p)))
    return replace(plan, units=tuple(units))


def _epilogues(plan: Plan, p: Program) -> Plan:
    return replace(plan, units=tuple(with_epilogues(list(plan.units), {b.name: b for b in plan.buffers})))


def _attention(plan: Plan, p: Program) -> Plan:
    return replace(plan, attention=attention.find(plan.units, {b.name: b for b in plan.buffers}))


def _colsums(plan: Plan, p: Program) -> Plan:
    skip = {i for a in plan.attention if "cpu" in a.fused for i in a.members}  # (the CPU's attention call sums them)
    return replace(plan, units=tuple(with_colsums(list(plan.units), {b.name: b for b in plan.buffers}, skip)))


def _lngrads(plan: Plan, p: Program) -> Plan:
    return replace(plan, units=tuple(with_grads(list(plan.units), {b.name: b for b in plan.buffers})))


def _decide(plan: Plan, p: Program) -> Plan:
    return decide(plan, lambda u: _locate(p, u))


def _verify(plan: Plan, p: Program) -> Plan:
    return verify(plan)


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[Plan, Program], Plan]
    does: str


# The planner: each pass takes the plan as the passes before it left it (`coconetc show --format
# plan --after NAME` prints it there).
PASSES: tuple[Pass, ...] = (
    Pass("lower", _lower, "the program's stages in execution order as units and buffers: the schedule's fusions, "
                          "overlaps and fed gathers, chains of row-wise stages, in-place updates"),
    Pass("prefetch", _prefetch, "each weight's all-gather started depth weight gathers ahead (a schedule's "
                                "prefetch), what makes its source from the parameters moved with it"),
    Pass("epilogues", _epilogues, "each GEMM or row-wise call with the loop after it that it can carry as an epilogue"),
    Pass("attention", _attention, "the causal attention chains that run as one call"),
    Pass("colsums", _colsums, "each column sum carried by the loop that writes its operand"),
    Pass("lngrads", _lngrads, "each layernorm's weight and bias gradients carried by its input gradient's call"),
    Pass("decide", _decide, "every target's decisions: where each buffer lives, reshapes as views, each unit's "
                            "strategy, and what each target does not implement"),
    Pass("verify", _verify, "the checks every plan passes (each buffer written before it is read, ...)"),
)
PASS_NAMES = tuple(x.name for x in PASSES)


def plan_program(p: Program, schedule: str = "default", target: str | None = None, after: str | None = None) -> Plan:
    """The execution plan of a (scheduled) program, with every target's decisions: PASSES in
    order. target: also require that this target implements all of it (else a PlanError at each
    directive it does not implement). after: the plan as the pass of this name left it (no
    later pass run, and target not checked)."""
    if after is not None and after not in PASS_NAMES:
        raise ValueError(f"plan_program: no pass {after!r}; the passes: {', '.join(PASS_NAMES)}")
    plan = Plan(p.name, schedule, (), (), ())
    for x in PASSES:
        plan = x.run(plan, p)
        if x.name == after:
            return plan
    if target is not None and plan.unsupported(target):
        raise PlanError(diagnostics(plan, target))
    return plan


def _locate(p: Program, u: Unit) -> Span:
    """Where a unit comes from: its directive (fuse, overlap), else its stage (a temporary:
    the stage it was made for)."""
    if isinstance(u, Fused):
        return next((f.span for f in p.fusions if f.name == u.name), NOWHERE)
    if isinstance(u, Overlap):
        return next((o.span for o in p.overlaps if o.producer == u.producer), NOWHERE)
    if isinstance(u, GatherMatmul):
        return next((o.span for o in p.overlaps if o.producer == u.gather.dst), NOWHERE)
    name = u.gather.dst if isinstance(u, StartGather) else getattr(u, "dst", "")
    s = p.stage(name) or p.stage(_temp_owner(name))
    return s.span if s is not None else NOWHERE


def _temp_owner(name: str) -> str:
    """The stage a temporary (_Planner._temp: t<n>_<stage>) was made for."""
    head, _, stage = name.partition("_")
    return stage if head[:1] == "t" and head[1:].isdigit() else ""


def reads(e: Expr) -> set[str]:
    return {n.name for n in walk(e) if isinstance(n, Ref)}


def execution_order(p: Program) -> list[Stage]:
    """The stages in the order they run: a collective that is not fused waits until just
    before its first reader (or the end), so that pointwise stages it would separate can share
    one loop; what a fusion reads runs before the fusion's first member. Data dependencies are
    kept."""
    order: list[Stage] = []
    pending: list[Stage] = []
    early = _read_by_fusions(p)
    placed: set[str] = set()
    for s in p.stages:
        if s.name in placed:
            continue
        if s.kind == "collective" and p.fusion_of(s.name) is None:
            pending.append(s)
            continue
        fusion = p.fusion_of(s.name)
        need = reads(s.expr)
        ahead = early.get(s.name, [])
        if fusion is not None:
            need = {n for m in fusion.stages for n in reads(stage_of(p, m).expr)}
        need |= {n for x in ahead for n in reads(x.expr)}
        needed = _pending_needed(pending, need)
        order += needed
        pending = [x for x in pending if x not in needed]
        for x in ahead:  # (computed before the fusion's first member)
            if x.name not in placed:
                order.append(x)
                placed.add(x.name)
        order.append(s)
        placed.add(s.name)
    return _next_to_reader(p, order + pending)


def _pointwise_compute(p: Program, s: Stage) -> bool:
    """A compute stage of pointwise operations over its elements only (what a loop computes),
    in no fusion and no overlap."""
    return (s.kind == "compute" and s.type.ndim > 0 and p.fusion_of(s.name) is None
            and all(not isinstance(n, Op) or n.op in POINTWISE for n in walk(s.expr))
            and not any(s.name in (o.producer, o.consumer) for o in p.overlaps))


def _next_to_reader(p: Program, order: list[Stage]) -> list[Stage]:
    """A pointwise stage that one later pointwise stage of its type reads, and no other stage,
    moved to just before that reader, so that the two share one loop and the value stays in a
    register (a derived program recomputes a GELU's input, hm + b_fc, at its start for the
    GELU's backward after two GEMMs: written and read again, 8 bytes an element, without
    this). Not a value the program returns or writes in place."""
    kept = {x for _, x in p.outputs + p.updates}
    readers: dict[str, list[Stage]] = {}
    for r in p.stages:
        for name in refs(r.expr):
            readers.setdefault(name, []).append(r)
    out = list(order)
    for s in reversed(order):  # (the last first: a chain of them ends next to its reader together)
        users = readers.get(s.name, [])
        if (s.name in kept or len(users) != 1 or not _pointwise_compute(p, s)
                or not _pointwise_compute(p, users[0]) or users[0].type != s.type):
            continue
        between = out[out.index(s) + 1:out.index(users[0])]
        if all(_pointwise_compute(p, x) and x.type == s.type for x in between):
            continue  # in one loop with its reader already
        out.remove(s)
        out.insert(out.index(users[0]), s)
    return out


def _read_by_fusions(p: Program) -> dict[str, list[Stage]]:
    """For each fusion, the stages between its members in program order that its members read
    (directly or through one another) and that read no member or stage computed after the
    fusion starts: a layernorm's beta computed from its gamma (`0.0 * ln_w`) between the
    residual it normalizes and the layernorm. They run before the fusion's first member (or the
    matmul whose overlap it is), as what a fusion reads must; keyed by that first stage."""
    out: dict[str, list[Stage]] = {}
    index = {s.name: i for i, s in enumerate(p.stages)}
    for fusion in p.fusions:
        members = set(fusion.stages)
        starts = members | {o.producer for o in p.overlaps if o.consumer in members | {fusion.name}}
        first = min(index[m] for m in starts if m in index)
        need = {n for m in members for n in reads(stage_of(p, m).expr)} - members
        later = p.stages[first + 1:]
        for s in reversed(later):  # what the members read, through the stages between them
            if s.name in need and s.name not in members:
                need |= reads(s.expr)
        chosen: set[str] = set()
        for s in later:  # those computed from values ready before the fusion starts
            if (s.name in need and s.name not in members and s.kind != "collective"
                    and all(index.get(n, -1) < first or n in chosen for n in reads(s.expr))):
                chosen.add(s.name)
        if chosen:
            out[p.stages[first].name] = [s for s in p.stages if s.name in chosen]
    return out


def _pending_needed(pending: list[Stage], need: set[str]) -> list[Stage]:
    need = set(need)
    for x in reversed(pending):
        if x.name in need:
            need |= reads(x.expr)
    return [x for x in pending if x.name in need]


class _Planner:
    def __init__(self, p: Program, schedule: str):
        self.p, self.schedule = p, schedule
        self.types: dict[str, TType] = {q.name: q.type for q in p.params}
        self.scattered = {q.name for q in p.params if q.scattered}
        self.buffers: dict[str, Buffer] = {}
        self.out: list[Unit] = []
        self.ntemp = 0
        self.lets: set[str] = set()
        self.seg_inplace: dict[str, str] = {}  # stage -> scattered parameter it is stored into
        self.outputs = {s: pub for pub, s in p.outputs}

    # --- the whole program ----------------------------------------------------------------
    def run(self) -> Plan:
        p = self.p
        for q in p.params:
            kind = "scalar" if q.scalar else "segments" if q.scattered else "param"
            self.buffers[q.name] = Buffer(q.name, q.type, kind, line=_line(q.span))
        for s in p.stages:
            e = s.expr
            if isinstance(e, Op) and e.op in ("broadcast", "reduce"):
                self.out.append(Require(e.op, int(e.attr("root"))))
        self.order = execution_order(p)
        groups = self._groups()
        self.in_fused = {n for g in groups for n in _fused_members(g)}
        self.in_place = self._in_place_updates()
        for g in groups:
            self._group(g)
        self._write_back()
        params = tuple(q.name for q in p.params if not q.scalar) + tuple(q.name for q in p.params if q.scalar)
        return Plan(p.name, self.schedule, params, tuple(self.buffers.values()), tuple(self.out))

    def _groups(self) -> list:
        """What runs as one piece: an overlap, a fused collective (with the members that wait
        for all its chunks), a chain of pointwise stages over the same elements, a stage."""
        p = self.p
        groups: list = []
        done: set[str] = set()
        # the other way: a collective (an allgather or a broadcast, schedule/fusion.py) feeding a matmul
        into = {o.producer: o for o in p.overlaps if stage_of(p, o.producer).kind == "collective"}
        overlaps = {o.producer: o for o in p.overlaps if o.producer not in into}
        waiting: dict[str, GatherSpec] = {}  # a gather whose matmul still waits for an operand
        done.update(t.name for o in overlaps for t in p.summed_gemms(o))  # computed inside their sum's overlap
        for i, s in enumerate(self.order):
            late = next((w for w in waiting.values() if w.collective.name in reads(s.expr)), None)
            if late is not None:
                if s.name != late.consumer.name:
                    raise PlanError.at(late.span, f"overlap: '{s.name}' reads '{late.collective.name}' before "
                                       f"'{late.consumer.name}' can start (it waits for operands computed after "
                                       f"'{late.collective.name}'): compute them before '{late.collective.name}'")
                groups.append(waiting.pop(late.collective.name))
                done.add(s.name)
                continue
            if s.name in done:
                continue
            if s.name in into:
                spec = gather_spec(p, into[s.name], self.scattered)
                needs = {n for n in reads(spec.consumer.expr) if p.stage(n) is not None} - {s.name}
                if needs <= done:
                    groups.append(spec)
                    done.update((s.name, spec.consumer.name))
                else:  # at the matmul's place, once its other operands are computed
                    waiting[s.name] = spec
                    done.add(s.name)
                continue
            if s.name in overlaps:
                ov = overlap_spec(p, overlaps[s.name], self.scattered)
                ov.then = fed_matmul(p, ov, into, self.scattered)
                groups.append(ov)
                done.update((s.name, ov.collective.name))
                if ov.fused is not None:
                    done.update(ov.fused.fusion.stages)
                if ov.then is not None:
                    self._fed_after(ov.then, done | {x.name for x in self.order[:i]})
                    done.add(ov.then.consumer.name)
                continue
            fusion = p.fusion_of(s.name)
            if fusion is not None:
                unfed_matmul(p, fusion, into)
                groups.append(self._fusion_group(fusion))
                done.update(fusion.stages)
                continue
            self._chain_or_single(groups, s)
        return groups

    def _fed_after(self, then: GatherSpec, done: set[str]) -> None:
        """The matmul an overlap's fused collective feeds runs inside that overlap: its other
        operands must be computed before the overlap starts (DONE: the stages before it)."""
        y, g = then.consumer, then.collective
        late = sorted(n for n in reads(y.expr) if self.p.stage(n) is not None and n != g.name and n not in done)
        if late:
            raise PlanError.at(then.span, f"overlap: '{y.name}' reads {', '.join(map(repr, late))}, computed after "
                               f"the overlap whose fused collective gathers '{g.name}': compute "
                               f"{'it' if len(late) == 1 else 'them'} before it")

    def _fusion_group(self, fusion: Fusion):
        spec = fused_spec(self.p, fusion, self.scattered, rows_ok=True)
        if spec is not None:
            return spec
        stages = [stage_of(self.p, n) for n in fusion.stages]
        if any(s.kind == "collective" for s in stages):
            raise AssertionError("fused_spec refuses with a PlanError")  # pragma: no cover
        chain: list[Stage] = []
        for s in stages:
            if not self._chainable(s) or (chain and s.type != chain[0].type):
                first = chain[0] if chain else next((x for x in stages if x is not s), s)
                raise PlanError.at(fusion.span, f"fuse: '{s.name}' cannot share one loop with "
                                   f"'{first.name}' ({_why_not_chained(s, first, self.scattered)}); "
                                   + self._chain_advice(fusion, stages))
            chain.append(s)
        return chain

    def _chain_advice(self, fusion: Fusion, stages: list[Stage]) -> str:
        """A fusion of computations is one loop: keep the members that share one (pointwise,
        over the elements of the first such member) and leave out the others and what reads
        them (else a cycle)."""
        ok = [s for s in stages if self._chainable(s)]
        first = ok[0] if ok else None
        drop = {s.name for s in stages if first is None or not self._chainable(s) or s.type != first.type}
        deps = depends_on(self.p)
        # a member that reads a left-out stage stays only if that stage reads no kept member
        # (else it would sit between two members: a cycle); reading it from outside is fine
        gone = set(drop)
        while True:
            kept = {s.name for s in stages} - gone
            more = {m for m in kept if any(x in deps.get(m, set()) and deps.get(x, set()) & kept for x in gone)}
            if not more:
                break
            gone |= more
        keep = [s.name for s in stages if s.name not in gone]
        left = ", ".join(f"'{n}'" for n in fusion.stages if n in gone)
        if len(keep) < 2:
            return f"only one loop's worth would remain without {left}: remove this fuse directive"
        head = "" if fusion.name.startswith("fused") else f"{fusion.name} = "
        return f"leave out {left}: {head}fuse({', '.join(keep)})"

    def _chain_or_single(self, groups: list, s: Stage) -> None:
        last = groups[-1] if groups else None
        if (isinstance(last, list) and self._chainable(s) and self._chainable(last[-1])
                and last[-1].type == s.type and self.p.fusion_of(last[-1].name) is None):
            last.append(s)
        else:
            groups.append([s])

    def _chainable(self, s: Stage) -> bool:
        return (s.kind == "compute" and s.type.ndim > 0
                and all(not isinstance(n, Op) or n.op in POINTWISE for n in walk(s.expr))
                and not any(isinstance(n, Ref) and n.name in self.scattered for n in walk(s.expr)))

    # --- in-place decisions ---------------------------------------------------------------
    def _in_place_updates(self) -> dict[str, str]:
        """Stages that may write their parameter's buffer directly: no later stage reads the
        parameter, and the stage reads it (if at all) only at the element it writes."""
        result = {}
        order = [s.name for s in self.order]
        returned = set(self.outputs)
        for t, src in self.p.updates:
            if src in returned or t in returned:
                continue
            later = order[order.index(src) + 1:]
            if any(t in reads(stage_of(self.p, n).expr) for n in later):
                continue
            if t in self.scattered:
                if self._gathers_only_into(src) or self._segment_store(src, t):
                    self.seg_inplace[src] = t
                continue
            if self._reads_elementwise_only(stage_of(self.p, src), t):
                result[src] = t
        return result

    def _gathers_only_into(self, src: str) -> bool:
        s = stage_of(self.p, src)
        return (isinstance(s.expr, Op) and s.expr.op == "allgather" and not self.p.users(src)
                and src not in self.in_fused)

    def _segment_store(self, src: str, t: str) -> bool:
        s = stage_of(self.p, src)
        return (s.kind == "compute" and s.type.ndim == 1 and not s.type.layout.sliced
                and not self.p.users(src) and src not in self.in_fused
                and self._reads_elementwise_only(s, t))

    def _reads_elementwise_only(self, s: Stage, t: str) -> bool:
        """Does s read t only at the element it writes? Non-pointwise parts (norms, matmuls)
        are computed before the loop, so what they read does not count."""
        if t not in reads(s.expr):
            return True
        if s.kind != "compute" or (isinstance(s.expr, Op) and s.expr.op not in POINTWISE):
            return False
        return all(r.type.shape == s.type.shape and r.type.layout == s.type.layout
                   for r in _pointwise_refs(s.expr) if r.name == t)

    # --- buffers --------------------------------------------------------------------------
    def _place(self, s: Stage) -> None:
        """Where stage s's value lives: an output array, its parameter (in place), or new."""
        pub, param = self.outputs.get(s.name), self.in_place.get(s.name)
        if pub is not None and self.p.param(s.name) is None:
            self._buffer(s.name, s.type, "output", pub, _line(s.span))
        elif param is not None:
            self._buffer(s.name, s.type, "alias", param, _line(s.span))
        else:
            self._buffer(s.name, s.type, "scratch", line=_line(s.span))

    def _buffer(self, name: str, t: TType, kind: str, of: str = "", line: int = 0) -> None:
        self.buffers[name] = Buffer(name, t, kind, of, line)
        self.types[name] = t

    def _temp(self, stage: str, t: TType) -> str:
        name = f"t{self.ntemp}_{stage}"
        self.ntemp += 1
        self._buffer(name, t, "scratch")
        return name

    # --- units ----------------------------------------------------------------------------
    def _group(self, g) -> None:
        if isinstance(g, OverlapSpec):
            self._overlap(g)
        elif isinstance(g, GatherSpec):
            self._gather_matmul(g)
        elif isinstance(g, FusedSpec):
            self.out.append(self._fused(g))
        elif len(g) > 1 or (self.p.fusion_of(g[0].name) is not None):
            self._chain(g)
        else:
            self._stage(g[0])

    def _chain(self, stages: list[Stage]) -> None:
        """Consecutive pointwise stages over the same elements as one loop: a value read only
        inside the chain stays in a register; the others are stored."""
        names = tuple(s.name for s in stages)
        items: list[Item] = []
        lets: list[Let] = []
        for s in stages:
            store = self._needed_after(s.name, names)
            if store:
                self._place(s)
            else:
                self._buffer(s.name, s.type, "register", line=_line(s.span))
            items.append(Item(s.name, self._scalars_out(s.expr, s.name, lets), store))
        self.out.append(Loop(stages[0].type, tuple(items), tuple(lets), line=_line(stages[0].span)))

    def _stage(self, s: Stage) -> None:
        e, line = s.expr, _line(s.span)
        if s.name in self.seg_inplace and s.kind == "collective":
            t, x = self.seg_inplace[s.name], self._materialize(op_of(s).args[0], s.name)
            self._buffer(s.name, s.type, "into", t, line)
            self.out.append(Collective(s.name, "allgather", x, into=t, line=line))
            return
        if s.name in self.seg_inplace:
            t = self.seg_inplace[s.name]
            hoisted = self._hoist(e, s.name)
            self._buffer(s.name, s.type, "into", t, line)
            self._loop(s.name, s.type, hoisted, seg_dst=t, line=line)
            return
        if isinstance(e, Op) and e.op not in POINTWISE:
            args = self._operands(e, s.name)
            self._place(s)
            self._kernel(s.name, e, args, line)
            return
        hoisted = self._hoist(e, s.name)
        self._place(s)
        self._loop(s.name, s.type, hoisted, line=line)

    def _operands(self, e: Op, stage: str) -> list[str | None]:
        if e.op in ("allreduce", "reducescatter", "allgather", "broadcast", "reduce", "scatter", "send"):
            return [self._materialize(e.args[0], stage)]
        return [self._materialize(a, stage) if not isinstance(a, Const) else None for a in e.args]

    def _loop(self, dst: str, t: TType, e: Expr, seg_dst: str = "", line: int = 0) -> None:
        lets: list[Let] = []
        item = Item(dst, self._scalars_out(e, dst, lets, t.ndim > 0))
        self.out.append(Loop(t, (item,), tuple(lets), seg_dst, line))

    def _kernel(self, dst: str, e: Op, args: list[str | None], line: int) -> None:
        x = args[0]
        assert x is not None
        if e.op in REDUCE_UNIT:
            self.out.append(Reduce(dst, REDUCE_UNIT[e.op], x, self.types[x].layout.sliced, line))
        elif registry.get(e.op).extern is not None:  # constants by position, values by name
            consts = tuple((i, a.value) for i, a in enumerate(e.args) if isinstance(a, Const))
            self.out.append(Library(dst, e.op, tuple(a for a in args if a is not None),
                                    (("consts", consts),), line))
        elif registry.get(e.op).kind == "tensor":  # a runtime function of every backend (ops.py KINDS)
            attrs: tuple = tuple((a.name, e.attr(a.name, a.default)) for a in registry.get(e.op).settings
                                 if a.kind == "int")  # conv2d's stride and padding, sum_lead's n, ...
            last = registry.get(e.op).params[-1]
            if last.literal is not None and isinstance(e.args[-1], Const):  # layernorm's eps, written as a number
                attrs = ((last.name, e.args[-1].value),)  # (else the last operand names it)
            if e.op == "reshape":  # the line its run-time check names (a temporary's unit has none)
                attrs = (("line", _line(e.span)),)
            self.out.append(Library(dst, e.op, tuple(a for a in args if a is not None), attrs, line))
        else:
            self._collective(dst, e, x, line)

    def _collective(self, dst: str, e: Op, x: str, line: int) -> None:
        packed = ""
        if x in self.scattered and e.op in ("broadcast", "reduce", "scatter", "send"):
            packed = self._temp(x, self.types[x])  # these take one contiguous buffer
        self.out.append(Collective(dst, e.op, x, e.attr("op") or "", int(e.attr("root") or 0),
                                   e.attr("direction") or "", packed=packed, line=line))

    def _materialize(self, e: Expr, stage: str) -> str:
        """A value's name: a reference as it is, anything else computed into a temporary."""
        if isinstance(e, Ref):
            return e.name
        assert isinstance(e, Op), e
        if e.op not in POINTWISE:
            args = self._operands(e, stage)
            name = self._temp(stage, e.type)
            self._kernel(name, e, args, 0)
            return name
        hoisted = self._hoist(e, stage)
        name = self._temp(stage, e.type)
        self._loop(name, e.type, hoisted)
        return name

    def _hoist(self, e: Expr, stage: str) -> Expr:
        """Replace the non-pointwise parts of an expression by temporaries computed first."""
        if isinstance(e, (Ref, Const)):
            return e
        if e.op not in POINTWISE:
            return Ref(self._materialize(e, stage), e.type)
        return replace(e, args=tuple(self._hoist(a, stage) for a in e.args))

    def _scalars_out(self, e: Expr, stage: str, lets: list[Let], refs_too: bool = True) -> Expr:
        """The scalar-only parts of a loop's expression (beta1 ** step, ...) become Lets,
        computed once before the loop. `refs_too`: also 0-d values read as they are (not in a
        0-d loop, which may be computing them)."""
        hoist_ref = refs_too and isinstance(e, Ref) and e.type.ndim == 0 and e.name not in self.lets
        if hoist_ref or (isinstance(e, Op) and e.type.ndim == 0 and e.op in POINTWISE and e.op != "dropout"):
            name = f"k{len(self.lets)}_{stage}"
            lets.append(Let(name, e))
            self.lets.add(name)
            return Ref(name, e.type)
        if isinstance(e, Op):
            return replace(e, args=tuple(self._scalars_out(a, stage, lets, refs_too) for a in e.args))
        return e

    def _row_operands(self, c: Stage) -> Expr:
        """A row-wise stage's expression with the row operation's operands from before the fusion
        (layernorm's gamma and beta, layernorm_dx's x and gamma) that are expressions, not values,
        computed into temporaries before the fused collective (a beta written `0.0 * ln_w`)."""
        e = row_op(c.expr)
        assert e is not None, c.name
        outside = (1, 2) if e.op == "layernorm" else (0, 1)
        args = tuple(Ref(self._materialize(a, c.name), a.type) if i in outside and not isinstance(a, Ref) else a
                     for i, a in enumerate(e.args))
        return substitute(c.expr, e, replace(e, args=args)) if args != e.args else c.expr

    def _needed_after(self, name: str, members: tuple[str, ...]) -> bool:
        """Is a value read outside these stages (so it must be stored)?"""
        return (any(u.name not in members for u in self.p.users(name))
                or name in self.outputs or any(s == name for _, s in self.p.updates))

    # --- fused collectives ----------------------------------------------------------------
    def _fused(self, f: FusedSpec, overlapped: bool = False) -> Fused:
        coll = f.collective
        x = self._materialize(op_of(coll).args[0], coll.name)
        if f.gather is not None:
            self._place(f.gather)
        g0 = op_of(f.gather).args[0] if f.gather is not None else None
        gathered = g0.name if isinstance(g0, Ref) else ""
        d0 = coll.type.layout.dim if coll.type.layout.sliced else 0
        later = _read_by_later_phase(f.computes)
        stored = {c.name for c in f.computes if self._needed_after(c.name, f.members) or c.name in later}
        for c in f.computes:
            if c.name == gathered and d0 == 0 and f.gather is not None:
                self._buffer(c.name, c.type, "view", f.gather.name, _line(c.span))
                stored.add(c.name)
            elif c.name in stored:
                self._place(c)
            else:
                self._buffer(c.name, c.type, "register", line=_line(c.span))
        store_reduced = self._needed_after(coll.name, f.members)
        if store_reduced:
            self._place(coll)
        else:
            self._buffer(coll.name, coll.type, "register", line=_line(coll.span))
        # what a chunk's stages compute from outside the fusion (norm(w), ...) comes first
        exprs = {c.name: self._row_operands(c) if _is_rows(c) else self._hoist(c.expr, c.name) for c in f.computes}
        lets: list[Let] = []
        phases = []
        for ph in _phases(f.computes):
            rows = _is_rows(ph[0])
            items = tuple(Item(c.name, exprs[c.name] if rows else self._scalars_out(exprs[c.name], c.name, lets),
                               c.name in stored) for c in ph)
            phases.append(Phase("rows" if rows else "pointwise", items))
        if store_reduced:
            keep = Item(coll.name, Ref(coll.name, coll.type), True)
            if phases and phases[0].kind == "pointwise":
                phases[0] = Phase("pointwise", (keep,) + phases[0].items)
            else:
                phases.insert(0, Phase("pointwise", (keep,)))
        after = self._after(f)
        partials: tuple[str, ...] = ()
        if op_of(coll).op == "reducescatter":
            after, phases, partials = self._partials(f, after, phases, lets, overlapped)
            if (store_reduced and self.p.param(x) is None and not self._needed_after(coll.name, f.fusion.stages)
                    and not any(coll.name in _unit_reads(a) for a in after
                                if not (isinstance(a, Reduce) and a.dst in partials))):
                # the reduction of a value the program computes (a weight gradient that an update
                # inside the backward reduce-scatters), read after the chunks only by reductions
                # accumulated chunk by chunk: not kept, so that no rank stores the gradient (CUDA's
                # one-kernel symmetric path, which reads it after, is then not taken). A
                # parameter's (an optimizer step's gradient) is kept for that path.
                store_reduced = False
                self._buffer(coll.name, coll.type, "register", line=_line(coll.span))
                phases = [Phase(ph.kind, items) for ph in phases
                          if (items := tuple(i for i in ph.items if i.name != coll.name))]
        gather_after = _gather_after(after, coll.type, self.buffers) if partials else ""
        if gather_after:
            self._gathered_in_place(after)
        return Fused(f.fusion.name, f.members, coll.name, op_of(coll).op, op_of(coll).attr("op"), x,
                     coll.type, tuple(phases), tuple(lets), f.gather.name if f.gather else "",
                     gathered, f.rows, store_reduced, after, _line(f.fusion.span), partials=partials,
                     gather_after=gather_after, piece_loops=_piece_loops(after, partials, coll.type) if gather_after else 0)

    def _gathered_in_place(self, after: tuple[Unit, ...]) -> None:
        """Phase B's last loop computes the value its closing allgather gathers (Fused.gather_after):
        a value of its own only for the gather (scratch) is computed in place inside the gathered
        result, this rank's part (a view, as in phase A), so the gather copies nothing of this
        rank's and the loop writes straight into the result (AdamW's w1 straight into w). The
        loop reads the result's storage (w, updated in place) only at the element it writes."""
        coll = after[-1]
        assert isinstance(coll, Collective)
        b = self.buffers[coll.src]
        if (b.kind != "scratch" or coll.into or self.buffers[coll.dst].kind == "into"
                or any(u.name != coll.dst for u in self.p.users(coll.src))):
            return  # (gathered into a scattered parameter's segments: no one place to compute in)
        del self.buffers[coll.src]  # declared after the result it lies in
        self._buffer(b.name, b.type, "view", coll.dst, b.line)

    def _partials(self, f: FusedSpec, after: tuple[Unit, ...], phases: list[Phase], lets: list[Let],
                  overlapped: bool) -> tuple[tuple[Unit, ...], list[Phase], tuple[str, ...]]:
        """The reductions of phase B over values of the chunk (the reduced value, a stored value
        of phase A, or a pointwise expression of them, which joins phase A as a stored item):
        each is accumulated chunk by chunk as the chunks arrive; their partial results are
        combined across the group in one small all-reduce after the chunks (Fused.partials).
        OVERLAPPED (an overlap's fused collective, one per block of the matmul's rows): the
        chunks of every block add to the same partial results, combined after the last block;
        only whole-slice reductions (sum, norm, max, min) of values of the chunk."""
        coll = f.collective
        chunk = {coll.name} | {c.name for c in f.computes}
        made_after = {getattr(a, "dst", "") for a in after} | {i.name for a in after if isinstance(a, Loop)
                                                                 for i in a.items}
        readers: dict[str, int] = {}
        for a in after:
            for n in _unit_reads(a):
                readers[n] = readers.get(n, 0) + 1
        units = list(after)
        partials: list[str] = []
        for a in after:
            if not isinstance(a, Reduce) or (overlapped and (a.op == "segment_norm" or not a.cross_rank)):
                continue
            param = (a.src in self.buffers and self.buffers[a.src].kind in ("param", "segments")
                     and not any(b.kind == "alias" and b.of == a.src and b.name in chunk  # not written in phase A
                                 for b in self.buffers.values()))
            if not a.cross_rank:
                if param and _whole_of_slices(self.types[a.src], coll.type):
                    # a reduction of a replicated parameter (LAMB's segment_norm(w)): every rank
                    # would read all of it; instead each accumulates its slice's part as the
                    # chunks pass, and the partial results are summed across the group
                    partials.append(a.dst)
                    units = self._per_element_on_the_slice(a, units, coll.type)
                continue
            if (a.src in chunk or param) and same_elements(self.types[a.src], coll.type):
                partials.append(a.dst)
                continue
            loop = next((u for u in units if isinstance(u, Loop) and len(u.items) == 1
                         and u.items[0].name == a.src), None)
            if (loop is None or loop.seg_dst or readers.get(a.src, 0) != 1 or not same_elements(loop.type, coll.type)
                    or reads(loop.items[0].expr) & (made_after - {k.name for k in loop.lets})):
                continue
            units.remove(loop)  # computed on each chunk, stored for the reduction
            lets.extend(loop.lets)
            item = Item(a.src, loop.items[0].expr, True)
            if phases and phases[-1].kind == "pointwise":
                phases[-1] = Phase("pointwise", phases[-1].items + (item,))
            else:
                phases.append(Phase("pointwise", (item,)))
            chunk.add(a.src)
            partials.append(a.dst)
        return tuple(units), phases, tuple(partials)

    def _per_element_on_the_slice(self, a: Reduce, units: list[Unit], t: TType) -> list[Unit]:
        """A segment_norm of a replicated parameter holds its segment's norm at each of the N
        elements; when only loops over this rank's slice (of type t) read it, it is kept for
        the slice's elements only (written once per element of the slice, not of all N)."""
        b = self.buffers[a.dst]
        readers = [u for u in units if a.dst in _unit_reads(u)]
        if (a.op != "segment_norm" or b.kind != "scratch" or self.p.stage(a.dst) is not None
                or not all(isinstance(u, Loop) and not u.seg_dst and u.type.shape == t.shape
                           and u.type.layout == t.layout for u in readers)):
            return units
        sliced = replace(b.type, layout=t.layout)
        self._buffer(a.dst, sliced, "scratch", line=b.line)

        def again(e: Expr) -> Expr:
            typed = {r.name: r.type for r in walk(e) if isinstance(r, Ref)} | {a.dst: sliced}
            return retype(e, typed.__getitem__)

        def retyped(u: Unit) -> Unit:
            if u not in readers:
                return u
            assert isinstance(u, Loop)
            return replace(u, items=tuple(replace(i, expr=again(i.expr)) for i in u.items))
        return [retyped(u) for u in units]

    def _after(self, f: FusedSpec) -> tuple[Unit, ...]:
        """The fusion's members that wait for every chunk, planned as units of their own."""
        rest = [s for s in self.order if s.name in f.fusion.stages and s.name not in f.members]
        saved, self.out = self.out, []
        groups: list = []
        for s in rest:
            if groups and isinstance(groups[-1], list) and self._chainable(s) and \
                    self._chainable(groups[-1][-1]) and groups[-1][-1].type == s.type:
                groups[-1].append(s)
            else:
                groups.append([s])
        for g in groups:
            if len(g) > 1:
                self._chain(g)
            else:
                self._stage(g[0])
        after, self.out = self.out, saved
        return tuple(after)

    # --- overlap --------------------------------------------------------------------------
    def _overlap(self, ov: OverlapSpec) -> None:
        y, c = ov.producer, ov.collective
        gemms = ov.terms or (y,)  # (a sum of GEMMs: each term's operands; the terms get no buffer)
        operands = [(self._materialize(op_of(t).args[0], t.name), self._materialize(op_of(t).args[1], t.name))
                    for t in gemms]
        (a, b), rest = operands[0], operands[1:]
        terms = tuple(Term(op_of(t).op, ta, tb) for t, (ta, tb) in zip(gemms[1:], rest))
        keep = ov.direct or self._needed_after(y.name, (c.name,))
        if keep:
            self._place(y)
        else:
            self._buffer(y.name, y.type, "chunks", line=_line(y.span))  # only packed chunks
        fused = None
        if ov.fused is None:
            self._place(c)
        else:
            fused = self._fused(ov.fused, overlapped=True)
        then = self._fed(ov.then) if ov.then is not None else None
        self.out.append(Overlap(y.name, a, b, c.name, op_of(c).op, op_of(c).attr("op") or "", ov.chunks,
                                ov.dim, ov.direct, fused, keep, _line(ov.span), op_of(gemms[0]).op, then, terms))

    def _fed(self, gs: GatherSpec) -> GatherMatmul:
        """The matmul a fused collective's gather feeds inside its overlap (Overlap.then): the
        gather itself is the fused collective's (placed by _fused)."""
        g, y = gs.collective, gs.consumer
        x = op_of(g).args[0]
        b = self._materialize(op_of(y).args[1], y.name)
        self._place(y)
        gather = Collective(g.name, "allgather", x.name if isinstance(x, Ref) else "", "", line=_line(g.span))
        return GatherMatmul(gather, y.name, b, gs.chunks, gs.dim, gs.how, op_of(y).op, _line(gs.span))

    def _gather_matmul(self, gs: GatherSpec) -> None:
        g, y = gs.collective, gs.consumer
        x = self._materialize(op_of(g).args[0], g.name)
        other = self._materialize(op_of(y).args[0 if gs.right else 1], y.name)
        self._place(g)
        self._place(y)
        e = op_of(g)
        gather = Collective(g.name, e.op, x, "", int(e.attr("root") or 0), line=_line(g.span))
        self.out.append(GatherMatmul(gather, y.name, other, gs.chunks, gs.dim, gs.how, op_of(y).op, _line(gs.span),
                                     gs.right))

    # --- the end of the function ----------------------------------------------------------
    def _write_back(self) -> None:
        for t, src in self.p.updates:
            if self.in_place.get(src) == t or self.seg_inplace.get(src) == t:
                continue
            self.out.append(Copy(t, src, "update"))
        for pub, s in self.p.outputs:
            if self.p.param(s) is not None:
                self.out.append(Copy(pub, s, "output"))


def _line(span: Span | None) -> int:
    return span.line if span is not None and span.line else 0


def _fused_members(g) -> tuple[str, ...]:
    if isinstance(g, FusedSpec):
        return g.members
    if isinstance(g, OverlapSpec) and g.fused is not None:
        return g.fused.members
    return ()


def _pointwise_refs(e: Expr) -> list[Ref]:
    """References in the pointwise part of an expression (not inside a hoisted operation)."""
    if isinstance(e, Ref):
        return [e]
    if isinstance(e, Op) and e.op in POINTWISE:
        return [r for a in e.args for r in _pointwise_refs(a)]
    return []


def _why_not_chained(s: Stage, first: Stage, scattered: set[str]) -> str:
    if s.kind != "compute" or any(isinstance(n, Op) and n.op not in POINTWISE for n in walk(s.expr)):
        op = next(n.op for n in walk(s.expr) if isinstance(n, Op) and n.op not in POINTWISE)
        return f"'{s.name}' computes {op}, which is not pointwise"
    if s.type.ndim == 0:
        return f"'{s.name}' is a scalar"
    if any(isinstance(n, Ref) and n.name in scattered for n in walk(s.expr)):
        return f"'{s.name}' reads a scattered parameter outside a fused collective"
    return f"they run over different elements: {s.type} and {first.type}"


def _gather_after(after: tuple[Unit, ...], t: TType, buffers: dict[str, Buffer]) -> str:
    """Phase B's last loop and the allgather of one of its values, when the gather can go
    piece by piece as the loop computes (over the chunk's elements, sliced along dim 0): the
    allgather's name (Fused.gather_after), else ""."""
    if len(after) < 2:
        return ""
    loop, coll = after[-2], after[-1]
    if not (isinstance(loop, Loop) and isinstance(coll, Collective) and coll.op == "allgather"):
        return ""
    stored = {i.name for i in loop.items if i.store}
    src = buffers[coll.src].type
    ok = (coll.src in stored and not loop.seg_dst and not coll.packed and t.layout.sliced
          and t.layout.dim == 0 and loop.type.shape == t.shape and loop.type.layout == t.layout
          and src.shape == t.shape and src.layout == t.layout)
    return coll.dst if ok else ""


def _piece_loops(after: tuple[Unit, ...], partials: tuple[str, ...], t: TType) -> int:
    """How many loops of phase B (the reductions accumulated chunk by chunk left out) run piece
    by piece with its closing allgather (Fused.piece_loops): the run of loops over the elements
    of the fused collective's slice just before it."""
    rest = [a for a in after if not (isinstance(a, Reduce) and a.dst in partials)]
    n = 0
    for a in reversed(rest[:-1]):
        if not (isinstance(a, Loop) and not a.seg_dst and a.type.shape == t.shape and a.type.layout == t.layout):
            break
        n += 1
    return n


def _whole_of_slices(rt: TType, t: TType) -> bool:
    """Is rt a replicated value whose elements a chunk of t (sliced along dim 0, a contiguous
    range of global indices) covers at the chunk's global indices?"""
    return rt.shape == t.shape and not rt.layout.sliced and t.layout.sliced and t.layout.dim == 0


def _unit_reads(u: Unit) -> set[str]:
    """The values a unit of a fusion's phase B reads."""
    if isinstance(u, Loop):
        return {n for i in u.items for n in reads(i.expr)} | {n for k in u.lets for n in reads(k.expr)}
    if isinstance(u, (Reduce, Collective)):
        return {u.src}
    if isinstance(u, Library):
        return set(u.args)
    return set()


def _is_rows(s: Stage) -> bool:
    """A fused collective's row-wise stage (fusion_legality.row_op: only those join a fusion's
    computes with a row-wise operation in them)."""
    return row_op(s.expr) is not None


def _phases(computes: list[Stage]) -> list[list[Stage]]:
    """Runs of pointwise stages, and each row-wise stage on its own."""
    phases: list[list[Stage]] = []
    for c in computes:
        if _is_rows(c) or not phases or _is_rows(phases[-1][0]):
            phases.append([c])
        else:
            phases[-1].append(c)
    return phases


def _read_by_later_phase(computes: list[Stage]) -> set[str]:
    """Values a later phase reads: they cannot stay in a register of the loop computing them."""
    out: set[str] = set()
    seen: set[str] = set()
    for phase in _phases(computes):
        out |= {n for c in phase for n in reads(c.expr)} & seen
        seen |= {c.name for c in phase}
    return out


__all__ = ["PlanError", "plan_program", "execution_order", "same_elements"]
