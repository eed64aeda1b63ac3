"""fuse and overlap: they change how stages run together, never what they compute."""

from __future__ import annotations

import re
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import replace

from coconetc.errors import NOWHERE, ScheduleError
from coconetc.ir import ops
from coconetc.ir.nodes import POINTWISE, Fusion, Op, Overlap, Program, Ref, Stage, walk
from coconetc.ir.rewrite import depends_on
from coconetc.schedule.directives import Fuse, OverlapD, Reorder, span_of
from coconetc.schedule.primitives import _fresh, _stage, gather_names, reorder, reorder_gathers


def fuse(p: Program, d: Fuse) -> Program:
    """f = fuse(rs, m1, w1, agw)

    before:  rs = reducescatter(...)  m1 = ...  w1 = ...  agw = allgather(w1)   (four units)
    after:   the same stages, run as one fused collective named f: each chunk of the slice
             is computed on as soon as it is reduced, and gathered as soon as it is computed.
    """
    _check_names(p, d)
    stages = [_stage(p, n, d, "fuse") for n in dict.fromkeys(d.stages)]
    name = d.name or f"fused{len(p.fusions)}"
    if d.name:
        _fresh(p, (d.name,), d, "fuse")
    _check_members(p, stages, d)
    _check_convex(p, {s.name for s in stages}, d, name)
    order = _contiguous(p, {s.name for s in stages})
    pos = {s.name: i for i, s in enumerate(order)}
    updates = tuple(sorted(p.updates, key=lambda u: pos.get(u[1], -1)))  # canonical: stage order
    # the members in the order they run (a fusion listed out of order, fuse(w1, m1), would
    # otherwise compute w1 before the m1 it reads)
    names = {s.name for s in stages}
    members = tuple(s.name for s in order if s.name in names)
    return replace(p, stages=order, updates=updates, fusions=p.fusions + (Fusion(name, members, d.span),))


def _check_names(p: Program, d: Fuse) -> None:
    """Unknown or already fused stages, a name already taken: each refused with the directive
    that would do (the others, another name)."""
    members = list(dict.fromkeys(d.stages))
    for n in members:
        other = p.fusion_of(n)
        if p.stage(n) is not None and other is None:
            continue
        rest = [m for m in members if m != n and p.stage(m) is not None and p.fusion_of(m) is None]
        rest = _settled(p, d, rest) if len(rest) >= 2 else rest
        fix = (f"leave it out: {_fuse_text(d, rest)}" if len(rest) >= 2
               else "nothing would be left to fuse; remove this fuse directive")
        if other is not None:
            raise ScheduleError(span_of(d, n), "fuse", n, f"the stage is already fused (in '{other.name}'; "
                                f"a stage belongs to one fusion, so fuse last); {fix}")
        known = ", ".join(x.name for x in p.stages)
        raise ScheduleError(span_of(d, n), "fuse", n, f"no stage named '{n}' (stages: {known}); "
                            + (_gather_instead(p, d, n) or fix))
    if d.name and (p.param(d.name) or p.stage(d.name) or any(f.name == d.name for f in p.fusions)):
        taken = {q.name for q in p.params} | {x.name for x in p.stages} | {f.name for f in p.fusions}
        fresh = next(f"{d.name}{k}" for k in range(2, len(taken) + 3) if f"{d.name}{k}" not in taken)
        raise ScheduleError(span_of(d, "=" + d.name), "fuse", d.name, f"the name '{d.name}' is already taken; "
                            f"choose another: {fresh} = fuse({', '.join(members)})")


# the advice at the end of a refusal, as the messages write it: a fuse directive (group 1 the
# directive, group 2 its members), or a reorder then a fuse (sourcefile._settled follows them too)
FUSE_ADVICE = re.compile(r"((?:\w+ = )?fuse\(([^()]*)\))\s*$")
REORDER_FIRST_ADVICE = re.compile(r"(?:[\w, ]+ = )?reorder\([^()]*\); (?:\w+ = )?fuse\([^()]*\)\s*$")
# _settled is running (in this thread or task): the probes it makes do not settle in turn
_settling: ContextVar[bool] = ContextVar("coconet_fuse_settling", default=False)


def _settled(p: Program, d: Fuse, stages: list[str]) -> list[str]:
    """The members of an advised fusion, completed by what the refusal of it would advise in
    turn (the stages between two members, that would make a cycle, added), so that following
    one advice never ends in another refusal of the fusion; `stages` when that fusion is
    accepted or its refusal advises nothing more."""
    if _settling.get():
        return stages
    token = _settling.set(True)
    try:
        for _ in range(3):
            try:
                fuse(p, replace(d, stages=tuple(stages)))
                return stages
            except ScheduleError as err:
                m = FUSE_ADVICE.search(err.reason)
                if m is None or "fuse" not in err.directive or REORDER_FIRST_ADVICE.search(err.reason):
                    return stages  # a reorder first: its names are not stages of P yet
                more = [x.strip() for x in m[2].split(",")]
                if more == stages or len(more) < 2 or any(p.stage(x) is None for x in more):
                    return stages
                stages = more
        return stages
    finally:
        _settling.reset(token)


def _gather_instead(p: Program, d: Fuse, n: str) -> str | None:
    """An unknown name where a fusion of a reducescatter wants its allgather (the user's name
    for it, which a reorder named otherwise, as its advice's ag_<value>): the allgather of the
    last member still gathered, in its place, when that fusion is accepted; else None."""
    members = [m for m in dict.fromkeys(d.stages) if m != n]
    listed = [p.stage(m) for m in members]
    if any(s is None or p.fusion_of(s.name) is not None for s in listed):
        return None
    ops_ = [s.top.op for s in listed if s is not None and s.kind == "collective"]
    if ops_ != ["reducescatter"]:
        return None
    gathers = [s for s in p.stages if s.kind == "collective" and isinstance(s.expr, Op) and s.expr.op == "allgather"
               and isinstance(s.expr.args[0], Ref) and s.expr.args[0].name in members]
    if not gathers:
        return None
    g = gathers[-1]
    advised = replace(d, stages=tuple(_settled(p, d, [g.name if m == n else m for m in dict.fromkeys(d.stages)])))
    if g.name not in advised.stages:
        return None  # the fusion that would be accepted leaves that all-gather out after all
    try:
        fuse(p, advised)
    except ScheduleError:
        return None
    return (f"the all-gather of '{g.expr.args[0].name}' is '{g.name}': "  # type: ignore[union-attr]
            f"{_fuse_text(advised, list(advised.stages))}")


def _check_members(p: Program, stages: list[Stage], d: Fuse) -> None:
    colls = [s for s in stages if s.kind == "collective"]
    kinds = sorted(s.top.op for s in colls)
    if len(colls) > 2 or (len(colls) == 2 and kinds != ["allgather", "reducescatter"]):
        keep = _allowed_collectives(colls)
        drop = {s.name for s in colls} - keep
        raise ScheduleError(span_of(d, colls[-1].name), "fuse", colls[-1].name,
                            "a fusion holds at most one collective, or one reducescatter/allgather "
                            f"pair; here: {', '.join(f'{s.name} ({s.top.op})' for s in colls)}; "
                            + _without(p, d, drop, f"leave out {_names(drop)}"))
    for s in stages:
        bad = next((n.op for n in walk(s.expr) if isinstance(n, Op) and not ops.get(n.op).fusable), None)
        if bad:
            raise ScheduleError(span_of(d, s.name), "fuse", s.name, f"{bad} cannot be fused into a loop "
                                "(overlap it with its collective instead: overlap() after the fuse); "
                                + _without(p, d, {s.name}, f"leave '{s.name}' out"))
    for s in stages:
        o = next((o for o in p.overlaps if s.name in (o.producer, o.consumer)), None)
        if o is None:
            continue
        if o.producer == s.name and s.kind == "collective":  # the other way: a gather feeding a matmul
            continue  # (the fused collective's gather feeds it chunk by chunk: plan/planner.py)
        text = f"overlap({o.producer}, {o.consumer}, chunks={o.chunks})"
        name = d.name or "f"
        raise ScheduleError(span_of(d, s.name), "fuse", s.name,
                            f"'{s.name}' is already overlapped ({text}): fuse first, then overlap the fusion: "
                            f"{name} = fuse({', '.join(dict.fromkeys(d.stages))}) and then "
                            f"overlap({o.producer}, {name}, chunks={o.chunks}) in place of {text}")
    if len(colls) == 2:
        rs = next(s for s in colls if s.top.op == "reducescatter")
        ag = next(s for s in colls if s.top.op == "allgather")
        if rs.type.layout != ag.top.args[0].type.layout:
            raise ScheduleError(span_of(d, ag.name), "fuse", ag.name, f"it gathers {ag.top.args[0].type.layout} "
                                f"data but {rs.name} scatters {rs.type.layout}; "
                                + _without(p, d, {ag.name}, f"leave '{ag.name}' out"))


def _allowed_collectives(colls: list[Stage]) -> set[str]:
    """The collectives a fusion may keep: the first reducescatter (with the first allgather) or
    the first collective."""
    rs = next((s for s in colls if s.top.op == "reducescatter"), None)
    if rs is not None:
        ag = next((s for s in colls if s.top.op == "allgather" and s.top.args[0].type.layout == rs.type.layout), None)
        return {rs.name} | ({ag.name} if ag is not None else set())
    return {colls[0].name}


def _names(names) -> str:
    return ", ".join(f"'{n}'" for n in sorted(names))


def _fuse_text(d: Fuse, stages: list[str]) -> str:
    return f"{d.name + ' = ' if d.name else ''}fuse({', '.join(stages)})"


def _without(p: Program, d: Fuse, drop: set[str], what: str,
             readers: str = " and the members that would make a cycle without it") -> str:
    """Advice: the fusion without `drop`, and without the members that would make a cycle
    through what is left out (a member that reads a left-out stage which reads the fusion)."""
    deps = depends_on(p)
    members = list(dict.fromkeys(d.stages))
    gone = set(drop)
    while True:
        kept = set(members) - gone
        more = {m for m in kept if any(x in deps.get(m, set()) and deps.get(x, set()) & kept
                                       for x in gone | _outside_between(p, kept, deps))}
        if not more:
            break
        gone |= more
    keep = [m for m in members if m not in gone]
    extra = [m for m in members if m in gone - set(drop)]
    also = f"{readers} ({', '.join(extra)})" if extra else ""
    computes = [m for m in keep if p.stage_named(m).kind != "collective"]
    if len(keep) < 2 or not computes:
        return f"{what}{also}: nothing would be left to fuse; remove this fuse directive"
    return f"{what}{also}: {_fuse_text(d, keep)}"


def _outside_between(p: Program, kept: set[str], deps: dict[str, set[str]]) -> set[str]:
    """The stages outside `kept` that read it and that it reads."""
    return {s.name for s in p.stages if s.name not in kept and deps[s.name] & kept
            and any(s.name in deps.get(g, ()) for g in kept)}


def _check_convex(p: Program, group: set[str], d: Fuse, name: str) -> None:
    """No stage outside the group may sit between two members (that would be a cycle)."""
    deps = depends_on(p)
    for s in p.stages:
        if s.name in group:
            continue
        reader = next((g for g in d.stages if s.name in deps.get(g, ())), None)
        if deps[s.name] & group and reader is not None:
            raise ScheduleError(span_of(d, reader), "fuse", s.name, f"'{s.name}' reads the fusion and the fusion "
                                f"reads it: fusing would make a cycle; {_cycle_advice(p, group, d, deps)}")


def _cycle_advice(p: Program, group: set[str], d: Fuse, deps: dict[str, set[str]]) -> str:
    """Every stage between two members must join the fusion (when each can: computations whose
    operations fuse, and, in a fusion of computations only, pointwise ones over the members'
    elements), else the members that read them must leave it."""
    moved = reorder_advice(p, d.stages, d.name)  # members that read a split's allgather
    if moved is not None:
        return moved[0]
    between = [s for s in p.stages if s.name not in group and deps[s.name] & group
               and any(s.name in deps.get(g, ()) for g in group)]
    members = [p.stage_named(n) for n in dict.fromkeys(d.stages)]
    collective = any(m.kind == "collective" for m in members)
    first = next((m for m in members if m.kind != "collective"), members[0])

    def joins(s: Stage) -> bool:
        if s.kind != "compute":
            return False
        if any(isinstance(n, Op) and not ops.get(n.op).fusable for n in walk(s.expr)):
            return False
        return collective or (s.type == first.type and
                              all(not isinstance(n, Op) or n.op in POINTWISE for n in walk(s.expr)))
    if all(joins(s) for s in between):
        names = {s.name for s in between}
        order = [s.name for s in p.stages if s.name in group or s.name in names]
        add = ", ".join(f"'{s.name}'" for s in between)
        return f"add {add} to the fusion: {_fuse_text(d, order)}"
    cannot = {s.name for s in between if not joins(s)}
    return _without(p, d, cannot, f"{_names(cannot)} cannot join the fusion: leave out the members that read it",
                    "")


# reorder_advice is running (in this thread or task): the fusions it probes advise nothing in turn
_advising: ContextVar[bool] = ContextVar("coconet_reorder_advising", default=False)


def reorder_advice(p: Program, members: Sequence[str], name: str | None) -> tuple[str, Program] | None:
    if _advising.get():
        return None
    token = _advising.set(True)
    try:
        return _reorder_advice(p, members, name)
    finally:
        _advising.reset(token)


def _reorder_advice(p: Program, members: Sequence[str], name: str | None) -> tuple[str, Program] | None:
    """A split not followed by a reorder, or a reorder that left stages reading an allgather (a
    norm, a clipping factor): when the members (of a fuse directive, not applied to P) hold a
    reducescatter and computations that read its allgather (or the allgather of a member), the
    advice to move those computations (and the stages between them) onto the slices first
    (`reorder`) and fuse them with the members (and the allgather of the last value still needed
    whole), with the program both directives give.
    None when there is no such allgather or either directive is refused."""
    def is_op(n: str, op: str) -> bool:
        s = p.stage(n)
        return s is not None and s.kind == "collective" and isinstance(s.expr, Op) and s.expr.op == op
    rs = next((m for m in members if is_op(m, "reducescatter")), None)
    if rs is None:
        return None
    listed = list(dict.fromkeys(members))
    gathers = [u.name for u in p.users(rs) if is_op(u.name, "allgather")]
    gathers += [s.name for s in p.stages if is_op(s.name, "allgather") and s.name not in gathers and s.name not in listed
                and any(isinstance(a, Ref) and a.name in listed for a in s.expr.args)]  # type: ignore[union-attr]
    deps = depends_on(p)
    for ag in gathers:
        # the members that read the allgather, and the stages between them (else a cycle), in order
        stages = [s.name for s in p.stages if s.kind != "collective" and ag in deps.get(s.name, ())
                  and (s.name in listed or any(s.name in deps.get(m, ()) for m in listed))]
        if not stages:
            continue
        order = {s.name: i for i, s in enumerate(p.stages)}
        # the other members listed (a norm of a replicated parameter, LAMB's norm(w)) stay in
        # the fusion where they can; else the fusion of the moved stages alone
        others = [m for m in listed if m not in stages and m != rs and p.stage(m) is not None
                  and not is_op(m, "allgather")]
        advice = None
        if others:
            advice = _moved_and_fused(p, rs, ag, stages, tuple(sorted({rs, *stages, *others}, key=order.__getitem__)),
                                      name)
        if advice is None:
            advice = _moved_and_fused(p, rs, ag, stages, (rs, *stages), name)
        partly = [n for n in stages if not p.stage_named(n).type.layout.sliced]
        if advice is None and partly and partly != stages:
            # some stages already on the slices: move the others too, and fuse them with the
            # members listed (in the program's order)
            keep = sorted({*listed, *partly}, key=lambda n: order.get(n, len(order)))
            advice = _moved_and_fused(p, rs, ag, partly, tuple(keep), name, gather=False)
        if advice is None:
            continue
        q, left, moved, advised = advice
        return (f"'{moved[0]}' reads the all-gathered '{ag}', not the chunks of '{rs}': move "
                f"{'the stages' if len(moved) > 1 else 'it'} onto the slices{' too' if moved != stages else ' first'}, "
                f"then fuse them: {left}reorder({ag}, {', '.join(moved)}); "
                f"{_fuse_text(advised, list(advised.stages))}", q)
    return None


def _moved_and_fused(p: Program, rs: str, ag: str, stages: list[str], members: tuple[str, ...],
                     name: str | None, gather: bool = True) -> tuple[Program, str, list[str], Fuse] | None:
    """reorder(ag, stages) and then fuse(members) (with the allgather of the last value still
    needed whole when `gather`), applied to P: the program, the reorder's names (`a, b = `),
    the stages and the fuse directive; None when either is refused."""
    try:
        outs = gather_names(p, reorder_gathers(p, ag, tuple(stages)))
        q = reorder(p, Reorder(ag, tuple(stages), tuple(outs), NOWHERE))
        advised = Fuse((*members, *(outs[-1:] if gather else ())), name, NOWHERE)
        q = fuse(q, advised)
    except ScheduleError:
        return None
    return q, f"{', '.join(outs)} = " if outs else "", stages, advised


def _contiguous(p: Program, group: set[str]) -> tuple[Stage, ...]:
    """Reorder stages so that the group's members are adjacent (valid by convexity), as early
    as what they read allows: a stage between them that no member reads (directly or not) runs
    after them (so a derived program's reduce-scatter fused with an update runs where the
    backward makes its gradient, not after the rest of the backward)."""
    deps = depends_on(p)
    idx = [i for i, s in enumerate(p.stages) if s.name in group]
    first, last = idx[0], idx[-1]
    middle = p.stages[first:last + 1]
    read = set().union(*(deps[s.name] for s in middle if s.name in group))
    before = [s for s in middle if s.name not in group and s.name in read]
    after = [s for s in middle if s.name not in group and s.name not in read]
    members = [s for s in middle if s.name in group]
    return p.stages[:first] + tuple(before + members + after) + p.stages[last + 1:]


def overlap(p: Program, d: OverlapD) -> Program:
    """overlap(y, f, chunks=4)

    before:  y = matmul(x, w)    f = fuse(rs, out, ago)          (y, then all of f)
    after:   y is computed in 4 chunks along one dim of its result; each chunk's communication
             in f starts as soon as the chunk is ready, while the next chunk computes.

    The producer is a matmul, or a derived program's matmul_nt (a x b^T, the input gradient
    of a matmul): chunks along its leading dims are row blocks of a, along its last dim row
    blocks of b; or a matmul_tn (a^T x b, the weight gradient, reduce-scattered over the
    data-parallel ranks: FSDP): chunks along dim 0 are column blocks of a, along dim 1 of b. Or a sum of such stages (Program.summed_gemms: an input gradient through
    several linear layers, attention's q, k and v): each chunk's rows are one GEMM after
    another into the same rows, chunked along dim 0 only.
    """
    prod = p.stage(d.producer)
    if prod is not None and isinstance(prod.expr, Op) and prod.expr.op in GATHERS:
        return _overlap_into(p, d, prod)
    terms = p.summed_gemms(d.producer)
    if prod is None or not (isinstance(prod.expr, Op) and (ops.has(prod.expr.op, ops.OVERLAPPED)
                                                           or prod.expr.op == "matmul_tn") or terms):
        raise ScheduleError(span_of(d, d.producer), "overlap", d.producer,
                            "the producer must be a matmul stage (or a derived program's matmul_nt or matmul_tn), "
                            "a sum of such stages that nothing else reads, "
                            "or an allgather or a broadcast whose result a matmul reads")
    first = terms[0] if terms else prod
    assert isinstance(first.expr, Op)
    if first.expr.args[1].type.ndim > 2 and first.expr.op == "matmul_nt":
        raise ScheduleError(span_of(d, d.producer), "overlap", d.producer,
                            f"a batched {first.expr.op} cannot be overlapped yet")
    coll = _consumer_collective(p, d)
    if not (isinstance(coll.top.args[0], Ref) and coll.top.args[0].name == d.producer):
        raise ScheduleError(span_of(d, d.consumer), "overlap", d.consumer,
                            f"its collective '{coll.name}' does not read '{d.producer}' directly")
    if any(d.producer in (o.producer, o.consumer) for o in p.overlaps):
        raise ScheduleError(span_of(d, d.producer), "overlap", d.producer, "the producer is already overlapped")
    dims = _chunkable(prod, first, coll)
    dim = dims[0] if d.dim is None and dims else d.dim
    at = span_of(d, "dim=" if d.dim is not None else d.consumer)
    if dim not in dims:
        raise ScheduleError(at, "overlap", d.consumer, f"cannot chunk along dim {dim}; "
                            f"chunkable dims: {', '.join(map(str, dims)) or 'none'}")
    if terms and dim != 0:
        advice = (f"overlap({d.producer}, {d.consumer}, chunks={d.chunks})" if 0 in dims
                  else "dim 0 cannot be chunked here: remove this overlap")
        raise ScheduleError(at, "overlap", d.consumer, f"a sum of matmuls ('{d.producer}') is chunked along its rows "
                            f"(dim 0) only: {advice}")
    return replace(p, overlaps=p.overlaps + (Overlap(d.producer, d.consumer, d.chunks, dim, d.span),))


GATHERS = ("allgather", "broadcast")
"""The collectives whose result a matmul can consume chunk by chunk (plan/units.py GatherMatmul)."""


def _overlap_into(p: Program, d: OverlapD, coll: Stage) -> Program:
    """overlap(g, y, chunks=4): the other way (async-TP's all-gather-matmul)

    before:  g = allgather(x)    y = matmul(g, w)                 (all of g, then y)
    after:   g is gathered in 4 chunks along one dim of its result; each chunk's rows of y are
             multiplied as soon as the chunk has arrived, while the next chunk is in flight.

    The consumer is a matmul (or a derived program's matmul_nt) whose left operand is g; the
    chunks are blocks along a dim of g before its last (the contracted one): a leading dim
    other than the one an allgather gathers, or, when that is dim 0, pieces of every rank's
    slice of dim 0 (chunk i: piece i of each rank's rows). An allgather of a fusion (a fused
    reduce-scatter's) feeds the matmul chunk for chunk with the fused collective's own overlap
    (plan/planner.py).

    Or g is the consumer's RIGHT operand, a weight gathered where it is used (FSDP, ZeRO-3):
    before:  wg = allgather(w)    y = matmul(x, wg)
    after:   wg is gathered in 4 blocks of its rows (the contracted dim), y = the sum over the
             blocks r of x[..., r] wg[r, :], each added as soon as block r has arrived
             (_weight_overlap: or blocks of its columns, dim=1, each writing y's columns)."""
    cons = p.stage(d.consumer)
    if cons is None or not (isinstance(cons.expr, Op) and ops.has(cons.expr.op, ops.OVERLAPPED)):
        raise ScheduleError(span_of(d, d.consumer), "overlap", d.consumer,
                            f"the consumer of the {coll.top.op} '{coll.name}' must be a matmul stage "
                            f"(or a derived program's matmul_nt) that reads it: give the matmul a stage of "
                            f"its own (m = matmul({coll.name}, w)) and overlap({coll.name}, m, ...)")
    a, b = cons.expr.args[0], cons.expr.args[1]
    right = not (isinstance(a, Ref) and a.name == coll.name)
    if right and not (isinstance(b, Ref) and b.name == coll.name):
        raise ScheduleError(span_of(d, d.consumer), "overlap", d.consumer,
                            f"'{d.consumer}' does not read it as an operand")
    if b.type.ndim > 2:
        raise ScheduleError(span_of(d, d.consumer), "overlap", d.consumer,
                            "a batched matmul (a batched right operand) cannot be overlapped yet: remove this overlap")
    if p.fusion_of(cons.name) is not None:
        raise ScheduleError(span_of(d, d.consumer), "overlap", d.consumer, "the matmul is fused")
    for o in p.overlaps:
        if d.consumer in (o.producer, o.consumer) or d.producer in (o.producer, o.consumer):
            name = d.consumer if d.consumer in (o.producer, o.consumer) else d.producer
            raise ScheduleError(span_of(d, name), "overlap", name, f"'{name}' is already overlapped")
    gathered = coll.top.args[0].type.layout.dim if coll.top.op == "allgather" else None
    if right:
        return _weight_overlap(p, d, coll, cons, gathered)
    dims = [i for i in range(coll.type.ndim - 1) if i != gathered or i == 0]
    dim = dims[0] if d.dim is None and dims else d.dim
    if dim not in dims:
        at = span_of(d, "dim=" if d.dim is not None else d.producer)
        why = "the contracted dim, " if dim == coll.type.ndim - 1 else ""
        why += "the gathered dim (other than 0), " if dim == gathered else ""
        raise ScheduleError(at, "overlap", d.producer, f"cannot chunk '{d.producer}' along dim {dim} "
                            f"({why or 'no such dim, '}chunkable dims: {', '.join(map(str, dims)) or 'none'})")
    return replace(p, overlaps=p.overlaps + (Overlap(d.producer, d.consumer, d.chunks, dim, d.span),))


WEIGHT_GEMMS = ("matmul", "matmul_nt")
"""The GEMMs that take a gathered right operand chunk by chunk (plan/units.py GatherMatmul.right)."""


def _weight_overlap(p: Program, d: OverlapD, coll: Stage, cons: Stage, gathered: int | None) -> Program:
    """overlap(wg, y, chunks=k[, dim=d]): wg (a weight gathered where it is used: FSDP,
    ZeRO-3) is y's RIGHT operand, 2-d, cut along its rows (dim 0: pieces of every rank's slice
    when it gathers dim 0, else blocks of rows in place) or, unless it gathers dim 1, its
    columns (dim 1, each chunk packed). A chunk along the dim y contracts (a matmul's rows of
    wg, a matmul_nt's columns) adds its product into y; along the other it writes y's columns.
    The left operand may not be sliced along the dim it contracts."""
    op, x = cons.top.op, cons.top.args[0]
    at = span_of(d, d.consumer)
    if op not in WEIGHT_GEMMS:
        raise ScheduleError(at, "overlap", d.consumer, f"a gathered right operand is taken chunk by chunk by a "
                            f"matmul or a derived program's matmul_nt, not a {op}: remove this overlap")
    if coll.type.ndim != 2:
        raise ScheduleError(at, "overlap", d.consumer, f"'{coll.name}' is {coll.type}: a gathered right operand "
                            "must be 2-d (a batched one cannot be overlapped yet): remove this overlap")
    if x.type.layout.sliced and x.type.layout.dim == x.type.ndim - 1:
        raise ScheduleError(at, "overlap", d.consumer, f"its left operand is sliced along the dim it contracts "
                            f"({x.type}): remove this overlap")
    dims = [0] if gathered == 1 else [0, 1]
    dim = 0 if d.dim is None else d.dim
    if dim not in dims:
        good = f"overlap({d.producer}, {d.consumer}, chunks={d.chunks})"
        why = "the dim it gathers, other than 0" if dim == gathered else "no such dim"
        raise ScheduleError(span_of(d, "dim="), "overlap", d.producer,
                            f"cannot chunk '{d.producer}' along dim {dim} ({why}): a gathered right operand is cut "
                            f"along its rows (dim 0){' or its columns (dim 1)' if 1 in dims else ''}, each chunk "
                            f"multiplied as it arrives: {good}")
    return replace(p, overlaps=p.overlaps + (Overlap(d.producer, d.consumer, d.chunks, dim, d.span),))


def _consumer_collective(p: Program, d: OverlapD) -> Stage:
    fusion = next((f for f in p.fusions if f.name == d.consumer), None)
    if fusion is None:
        s = p.stage(d.consumer)
        if s is None or s.kind != "collective":
            raise ScheduleError(span_of(d, d.consumer), "overlap", d.consumer, "the consumer must be a collective or a fusion")
        return s
    colls = [s for s in map(p.stage_named, fusion.stages) if s.kind == "collective"]
    if not colls:
        raise ScheduleError(span_of(d, d.consumer), "overlap", d.consumer, "the fusion holds no collective")
    return colls[0]


def _chunkable(prod: Stage, gemm: Stage, coll: Stage) -> list[int]:
    """Dims of the producer's result that both sides can cut: not the producer's own sliced
    dim, not the dim the collective scatters or gathers; of a batched matmul (a batched right
    operand), only its batch dims (each chunk a strided-batched GEMM of whole batches). gemm:
    the producer, or the first GEMM of the sum it is."""
    t = prod.type
    banned = {t.layout.dim} if t.layout.sliced else set()
    if gemm.top.args[1].type.ndim > 2 and gemm.top.op == "matmul":
        banned |= {t.ndim - 2, t.ndim - 1}
    op = coll.top
    if op.op in ("reducescatter", "scatter"):
        banned.add(ops.attr(op, "dim"))
    if op.op == "allgather":
        banned.add(op.args[0].type.layout.dim)
    return [i for i in range(t.ndim) if i not in banned]


