"""split, reorder and slice: each checks legality, then rewrites the program (pure)."""

from __future__ import annotations

from dataclasses import replace

from coconetc.errors import NOWHERE, ScheduleError
from coconetc.ir import ops
from coconetc.ir.nodes import POINTWISE, Op, Program, Ref, Stage, walk
from coconetc.ir.rewrite import (depends_on, drop_stage, insert_after, is_used, rename,
                                 rename_program, retype_program)
from coconetc.ir.types import REPLICATED, TType, sliced
from coconetc.ir.typerules import TypeErr
from coconetc.schedule.directives import Reorder, Slice, Split, span_of


def _stage(p: Program, name: str, d, directive: str) -> Stage:
    s = p.stage(name)
    if s is None:
        known = ", ".join(x.name for x in p.stages)
        raise ScheduleError(span_of(d, name), directive, name, f"no stage named '{name}' (stages: {known})")
    if p.fusion_of(name) is not None:
        raise ScheduleError(span_of(d, name), directive, name, "the stage is already fused; fuse last")
    return s


def _fresh(p: Program, names, d, directive: str) -> None:
    seen: set[str] = set()
    for n in names:
        if p.param(n) or p.stage(n) or n in seen or any(f.name == n for f in p.fusions):
            raise ScheduleError(span_of(d, "=" + n), directive, n, f"the name '{n}' is already taken")
        seen.add(n)


def split(p: Program, d: Split) -> Program:
    """rs, ag = split(g1, dim=0)

    before:  g1 = allreduce(sum, g)
    after:   rs = reducescatter(sum, g, dim=0)
             ag = allgather(rs)          # every reader of g1 now reads ag
    """
    s = _stage(p, d.stage, d, "split")
    if not (isinstance(s.expr, Op) and s.expr.op == "allreduce"):
        raise ScheduleError(span_of(d, d.stage), "split", d.stage, "only an allreduce can be split")
    _fresh(p, (d.rs, d.ag), d, "split")
    x, t = s.expr.args[0], s.type
    if not 0 <= d.dim < t.ndim:
        raise ScheduleError(span_of(d, "dim="), "split", d.stage, f"dim={d.dim} is out of range for a {t.ndim}-d tensor")
    attrs = (("dim", d.dim), ("op", s.expr.attr("op")))
    rs_t = TType(t.dtype, t.shape, sliced(d.dim))
    rs = Stage(d.rs, Op("reducescatter", (x,), rs_t, attrs, s.expr.span), s.span)
    ag = Stage(d.ag, Op("allgather", (Ref(d.rs, rs_t),), t, (), s.expr.span), s.span)
    stages = tuple(x for st in p.stages for x in ((rs, ag) if st.name == s.name else (st,)))
    return rename_program(replace(p, stages=stages), {s.name: d.ag})


def _movable(s: Stage, dim: int, d: Reorder) -> None:
    """Every operation of the stage commutes with slicing along dim (the registry's slicing)."""
    for node in walk(s.expr):
        if not isinstance(node, Op):
            continue
        entry = ops.get(node.op)
        slicing = entry.slicing
        if slicing == ops.DIMS and dim not in entry.slice_dims:
            raise ScheduleError(span_of(d, s.name), "reorder", s.name,
                                f"{node.op} commutes with slicing only along dim "
                                f"{', '.join(map(str, entry.slice_dims)) or '(none)'}, not dim {dim}")
        if slicing == ops.NEVER:
            raise ScheduleError(span_of(d, s.name), "reorder", s.name,
                                f"{node.op} does not commute with slicing; only pointwise computations, "
                                "reductions (sum, norm, max(x), ...), layernorm and send can move")
        if slicing == ops.ROWS and dim == node.type.ndim - 1:
            raise ScheduleError(span_of(d, s.name), "reorder", s.name,
                                f"{node.op} {'normalizes' if node.op == 'layernorm' else 'works on'} "
                                "the last dim, which the slice would cut")


def _listed(p: Program, d: Reorder) -> list[str]:
    """The stages a reorder moves: at least one, each once."""
    if not d.stages:
        readers = [u.name for u in p.users(d.ag)]
        raise ScheduleError(span_of(d, d.ag), "reorder", d.ag,
                            "no stage to move: name the stages that read it, as in "
                            f"reorder({d.ag}, {', '.join(readers) or '...'})")
    moved = list(dict.fromkeys(d.stages))
    if len(moved) != len(d.stages):
        twice = next(m for i, m in enumerate(d.stages) if m in d.stages[:i])
        raise ScheduleError(span_of(d, twice + "#2"), "reorder", twice, "the stage is listed twice")
    return moved


def reorder(p: Program, d: Reorder, advise: bool = True) -> Program:
    """agm, agw = reorder(ag, m1, w1)

    before:  rs = reducescatter(sum, g)  ag = allgather(rs)
             m1 = update(m, b * m + g1') w1 = update(w, w - m1)
    after:   rs = reducescatter(sum, g)
             m1 = b * m + rs             # on this rank's slice; m read at the slice
             agm = allgather(m1)         # m <- agm (still needed whole)
             w1 = w - m1                 # on the slice
             agw = allgather(w1)         # w <- agw
    """
    ag = _stage(p, d.ag, d, "reorder")
    if not (isinstance(ag.expr, Op) and ag.expr.op == "allgather" and isinstance(ag.expr.args[0], Ref)):
        raise ScheduleError(span_of(d, d.ag), "reorder", d.ag, "the first argument must be an allgather stage")
    src = ag.expr.args[0].name
    moved = _listed(p, d)
    original = p
    try:
        p = _retype_moved(p, ag, src, moved, d)
    except ScheduleError as err:
        if advise and err.reason.startswith("the stage does not consume"):
            raise ScheduleError(span_of(d, err.stage), "reorder", err.stage,
                                err.reason + _left_out(original, d, err.stage)) from None
        if not (advise and err.reason.startswith("would run as")):
            raise
        raise ScheduleError(span_of(d, err.stage), "reorder", err.stage,
                            err.reason + _between_too(original, d, moved)) from None
    needed = [m for m in moved if _needed_whole(p, m, moved)]
    if len(needed) != len(d.outs) and advise and not _readers_too(original, p, d, moved, needed):
        # named right, would the reorder be accepted? if not, its own refusal (with the names
        # right in its advice) says more than the count does
        renamed = replace(d, outs=tuple(_keep_names(original, d.outs, needed)))
        try:
            reorder(original, renamed, advise=False)
        except ScheduleError:
            reorder(original, renamed)
    if len(needed) != len(d.outs):
        raise ScheduleError(span_of(d, "=" + d.outs[0] if d.outs else "()"), "reorder", d.ag,
                            f"{len(needed)} reordered value(s) are still needed whole "
                            f"({', '.join(needed) or 'none'}), so it returns {len(needed)} "
                            f"allgather(s); {len(d.outs)} name(s) given"
                            + (_readers_too(original, p, d, moved, needed) or _named(original, d, needed)))
    _fresh(p, d.outs, d, "reorder")
    for m, out in zip(needed, d.outs):
        t = p.type_of(m)
        gather = Stage(out, Op("allgather", (Ref(m, t),), replace(t, layout=REPLICATED), (), d.span), d.span)
        p = rename_program(replace(p, stages=insert_after(p.stages, m, gather)), {m: out},
                           skip={*moved, out})
    # the stages left in place now read the gathered values: type them again (a stage that
    # read a moved value was typed as sliced while it read the slice)
    try:
        p = retype_program(p)
    except TypeErr:
        # a stage left out of the list sits between two moved ones (mhat between m1 and w1):
        # it reads a gathered value, and the moved stage that reads it runs whole
        deps = depends_on(original)
        left_out = {s.name for s in original.stages if s.name not in moved and deps[s.name] & set(moved)}
        late = next((m for m in moved if deps[m] & left_out), None)
        if late is None:
            raise
        raise ScheduleError(span_of(d, late), "reorder", late, "would run whole, not on slices: it reads "
                            "stages left out of the list that read a reordered value (through its allgather)"
                            + (_between_too(original, d, moved) if advise else "")) from None
    return drop_stage(p, d.ag) if not is_used(p, d.ag) else p


def _left_out(p: Program, d: Reorder, stage: str) -> str:
    """Advice for a listed stage that reads no all-gathered value (a decay `w * (1 - lr * wd)`):
    the reorder without it (and without the other such stages), when that one is legal."""
    deps = depends_on(p)
    rest = [m for m in dict.fromkeys(d.stages) if p.stage(m) is not None and
            (d.ag in deps[m] or any(x in deps[m] for x in d.stages if x != m and d.ag in deps.get(x, ())))]
    if not rest or len(rest) == len(d.stages):
        return ""
    try:
        outs = _keep_names(p, d.outs, reorder_gathers(p, d.ag, tuple(rest)))
        reorder(p, Reorder(d.ag, tuple(rest), tuple(outs), d.span), advise=False)
    except ScheduleError:
        return ""
    left = f"{', '.join(outs)} = " if outs else ""
    gone = ", ".join(f"'{m}'" for m in d.stages if m not in rest)
    return (f" (it reads no all-gathered value; slicing the parameters it reads takes it onto the slices); "
            f"leave {gone} out: {left}reorder({', '.join((d.ag, *rest))})")


def _between_too(p: Program, d: Reorder, moved: list[str]) -> str:
    """Advice for a listed stage that would not run on slices because it reads stages left
    out of the list that read the allgather or a listed stage: the reorder with them listed
    too (in the program's order), when that reorder is legal; else ""."""
    deps = depends_on(p)
    listed = set(moved)
    between = [s.name for s in p.stages if s.name not in listed and s.kind == "compute"
               and (d.ag in deps[s.name] or deps[s.name] & listed)
               and any(s.name in deps[m] for m in moved)]
    if not between:
        return ""
    more = tuple(s.name for s in p.stages if s.name in listed or s.name in between)
    try:
        gathers = reorder_gathers(p, d.ag, more)
        outs = _keep_names(p, d.outs, gathers)
        reorder(p, Reorder(d.ag, more, tuple(outs), d.span), advise=False)
    except ScheduleError:
        return ""
    left = f"{', '.join(outs)} = " if outs else ""
    return f"; add {', '.join(repr(n) for n in between)} to the reorder: {left}reorder({', '.join((d.ag, *more))})"


def _readers_too(p: Program, moved_p: Program, d: Reorder, moved: list[str], needed: list[str]) -> str:
    """The other way out of a count that does not match: the computations that still read a
    reordered value whole (a norm, an inf/NaN count of the gradient) moved onto the slices too,
    so fewer values are needed whole ("" when they cannot all move)."""
    readers = {u.name for m in needed for u in moved_p.users(m) if u.name not in moved and u.kind == "compute"}
    if not readers:
        return ""
    more = [s.name for s in p.stages if s.name in readers or s.name in moved]
    try:
        gathers = reorder_gathers(p, d.ag, tuple(more))
    except ScheduleError:
        return ""
    if len(gathers) >= len(needed):
        return ""
    outs = _keep_names(p, d.outs, gathers)
    left = f"{', '.join(outs)} = " if outs else ""
    whole = ", ".join(f"'{m}'" for m in needed if any(u.name in readers for u in moved_p.users(m)))
    return f"; or move what reads {whole} whole onto the slices too: {left}reorder({d.ag}, {', '.join(more)})"


def _named(p: Program, d: Reorder, needed: list[str]) -> str:
    """The reorder with one name per allgather it returns (the names given kept, for the last
    values: a schedule names the gathers it fuses or keeps, the weights' last)."""
    outs = _keep_names(p, d.outs, needed)
    left = f"{', '.join(outs)} = " if outs else ""
    what = "name them" if len(outs) > 1 else "name it" if outs else "give it no names"
    return f"; {what}: {left}reorder({', '.join((d.ag, *d.stages))})"


def _keep_names(p: Program, given: tuple[str, ...], values: list[str]) -> list[str]:
    """Names for the allgathers of `values`: a name given that names a value (agw or ag_w1
    for w1, as the examples and the advice name them) for it; the other names given for the
    last values left (all of them when there are as many); ag_<value> for the rest."""
    out: list[str | None] = [None] * len(values)
    free = list(given)
    for i, v in enumerate(values):
        n = next((n for n in _gather_forms(v) if n in free), None)
        if n is not None:
            out[i] = n
            free.remove(n)
    others = {x.name for x in p.stages} - set(values)
    free = [n for n in free if not any(n in _gather_forms(x) for x in others)]  # another value's
    rest = [i for i, n in enumerate(out) if n is None]
    keep = min(len(free), len(rest))
    for i, n in zip(rest[len(rest) - keep:], free[len(free) - keep:]):
        out[i] = n
    left = [i for i, n in enumerate(out) if n is None]
    fresh = iter(gather_names(p, [values[i] for i in left]))
    for i in left:
        n = next(fresh)
        out[i] = n if n not in out else n + "_"
    return [n for n in out if n is not None]


def _gather_forms(v: str) -> tuple[str, ...]:
    """The names a schedule gives the allgather of value v (agw, ag_w1 for w1)."""
    base = v.rstrip("0123456789") or v
    return (f"ag_{v}", f"ag{v}", f"ag_{base}", f"ag{base}")


def gather_names(p: Program, values: list[str]) -> list[str]:
    """Names for the allgathers of `values` in advice: ag_<value>, numbered where P has it."""
    taken = {s.name for s in p.stages} | {q.name for q in p.params} | {f.name for f in p.fusions}
    return [next(n for k in range(len(taken) + 1) if (n := f"ag_{m}{k or ''}") not in taken) for m in values]


def reorder_gathers(p: Program, ag: str, stages: tuple[str, ...]) -> list[str]:
    """The reordered values that `reorder(ag, *stages)` returns an allgather for (those still
    needed whole), in the order listed; raises ScheduleError where the reorder is illegal."""
    probe = Reorder(ag, stages, (), NOWHERE)
    s = _stage(p, ag, probe, "reorder")
    if not (isinstance(s.expr, Op) and s.expr.op == "allgather" and isinstance(s.expr.args[0], Ref)):
        raise ScheduleError(NOWHERE, "reorder", ag, "the first argument must be an allgather stage")
    moved = list(dict.fromkeys(stages))
    q = _retype_moved(p, s, s.expr.args[0].name, moved, probe)
    return [m for m in moved if _needed_whole(q, m, moved)]


def _retype_moved(p: Program, ag: Stage, src: str, moved: list[str], d: Reorder) -> Program:
    """Point the moved stages at the slice (src) instead of the gathered ag, and re-type."""
    deps = depends_on(p)
    dim = p.type_of(src).layout.dim
    for m in moved:
        s = _stage(p, m, d, "reorder")
        if ag.name not in deps[m] and not any(x in deps[m] for x in moved):
            raise ScheduleError(span_of(d, m), "reorder", m, f"the stage does not consume '{ag.name}'")
        if s.type.layout.sliced:
            raise ScheduleError(span_of(d, m), "reorder", m, "the stage already runs on slices")
        _movable(s, dim, d)
    stages = tuple(replace(s, expr=rename(s.expr, {ag.name: src})) if s.name in moved else s
                   for s in p.stages)
    # type up to the last moved stage only: the stages after it will read the gathered values
    # (reorder inserts the allgathers next), not the slices (a matmul reading a layernorm of a
    # moved residual would not type on the slice, and need not)
    last = max(i for i, s in enumerate(stages) if s.name in moved) + 1
    try:
        head = retype_program(replace(p, stages=stages[:last]))
    except TypeErr as err:
        bad = getattr(err, "stage", "")
        raise ScheduleError(span_of(d, bad), "reorder", bad, err.diagnostics[0].message) from None
    q = replace(p, stages=head.stages + stages[last:])
    for m in moved:
        t = q.type_of(m)
        if t.layout != sliced(dim) and not (t.ndim == 0 and t.layout == REPLICATED):
            raise ScheduleError(span_of(d, m), "reorder", m, f"would run as {t.layout}, not on slices")
    return q


def _needed_whole(p: Program, name: str, moved: list[str]) -> bool:
    if not p.type_of(name).layout.sliced:
        return False  # a norm/sum of slices: the partial results are already reduced
    if any(s == name for _, s in p.outputs):
        return True
    if any(s == name and not p.type_of(t).layout.sliced for t, s in p.updates):
        return True
    return any(u.name not in moved for u in p.users(name))


def slice_params(p: Program, d: Slice) -> Program:
    """slice(m)

    before:  m: f32[N] replicated     m1 = b * m + rs (sliced)   agm = allgather(m1)  # m <- agm
    after:   m: f32[N] sliced(0)      m1 = b * m + rs            # m <- m1 (only the slice)
    """
    for name in d.params:
        p = _slice_one(p, name, d)
    try:
        return retype_program(p)
    except TypeErr as err:
        bad = getattr(err, "stage", ",".join(d.params))
        raise ScheduleError(span_of(d, bad), "slice", bad, err.diagnostics[0].message) from None


def _slice_one(p: Program, name: str, d: Slice) -> Program:
    param = p.param(name)
    if param is None or param.scalar:
        raise ScheduleError(span_of(d, name), "slice", name, "only a tensor parameter can be sliced")
    if param.type.layout.sliced:
        raise ScheduleError(span_of(d, name), "slice", name, "the parameter is already sliced")
    users = p.users(name)
    layouts = set().union(*({u.type.layout} if not _follows(p, u, name) else _readers_layouts(p, u)
                            for u in users)) if users else set()
    if not users or len(layouts) != 1 or not next(iter(layouts)).sliced:
        shown = ", ".join(f"{u.name} ({u.type.layout})" for u in users) or "none"
        raise ScheduleError(span_of(d, name), "slice", name, f"every use must run on slices after reorder; uses: {shown}"
                            + _reorder_first(p, d))
    lay = next(iter(layouts))
    if lay.dim >= param.type.ndim or any(u.type.ndim != param.type.ndim for u in users):
        raise ScheduleError(span_of(d, name), "slice", name, "its uses are sliced along a dim the parameter does not have")
    src = dict(p.updates).get(name)
    if src is not None:
        p = _unsliced_update(p, name, src, lay, d)
    params = tuple(replace(q, type=replace(q.type, layout=lay), scattered=False) if q.name == name
                   else q for q in p.params)
    return replace(p, params=params)


def _reorder_first(p: Program, d: Slice) -> str:
    """Advice for a slice whose parameters are read by stages that still run whole after a
    split's all-gather (left out of the reorder, or no reorder yet): the reorder that moves
    them (and the stages between the all-gather and them) onto the slices, then the slice,
    when both are accepted; else ""."""
    whole = list({u.name: u for q in d.params if p.param(q) is not None and not p.type_of(q).layout.sliced
                  for u in p.users(q) if not u.type.layout.sliced and not _follows(p, u, q)}.values())
    if not whole:
        return ""
    deps = depends_on(p)
    gathers = [s.name for s in p.stages if isinstance(s.expr, Op) and s.expr.op == "allgather"
               and any(s.name in deps[u.name] for u in whole)]
    params = tuple(x for x in d.params if not p.type_of(x).layout.sliced)
    for g, wide in ((g, wide) for g in gathers for wide in (True, False)):
        # every whole computation after the all-gather (as a zero schedule moves them), else
        # only those the slice needs
        stages = tuple(s.name for s in p.stages if g in deps[s.name] and not s.type.layout.sliced
                       and s.kind == "compute"
                       and (wide or s in whole or any(s.name in deps[u.name] for u in whole)))
        try:
            outs = _keep_names(p, (), reorder_gathers(p, g, stages))
            q = reorder(p, Reorder(g, stages, tuple(outs), d.span), advise=False)
            slice_params(q, replace(d, params=params))
        except ScheduleError:
            continue
        left = f"{', '.join(outs)} = " if outs else ""
        moved = ", ".join(f"'{u.name}'" for u in whole)
        return (f"; move {moved} onto the slices first: {left}reorder({', '.join((g, *stages))}); "
                f"slice({', '.join(d.params)})")
    return ""


def _follows(p: Program, u: Stage, name: str) -> bool:
    """A stage that runs whole only because the parameter it reads is whole, and runs on the
    slices once the parameter is sliced: a pointwise computation over the parameter's elements
    (the decay `wd1 = w * (1 - lr * wd)` of an AdamW written in two stages) whose other
    operands are replicated, that only stages running on slices read (or other such stages),
    and that is neither returned nor an update. Reorder cannot move it (it reads no
    allgather); slicing the parameter does."""
    if u.type.layout != REPLICATED or u.kind != "compute" or u.type.shape != p.type_of(name).shape:
        return False
    if any(isinstance(n, Op) and n.op not in POINTWISE for n in walk(u.expr)):
        return False
    if any(isinstance(n, Ref) and n.name != name and p.type_of(n.name).ndim and p.type_of(n.name).layout != REPLICATED
           for n in walk(u.expr)):
        return False
    if any(s == u.name for _, s in p.outputs) or any(s == u.name for _, s in p.updates):
        return False
    readers = p.users(u.name)
    return bool(readers) and all(r.type.layout.sliced or _follows(p, r, u.name) for r in readers)


def _readers_layouts(p: Program, u: Stage) -> set:
    """The layouts of the stages on slices that read a stage that _follows its parameter."""
    return set().union(*({r.type.layout} if r.type.layout.sliced else _readers_layouts(p, r) for r in p.users(u.name)))


def _unsliced_update(p: Program, name: str, src: str, lay, d: Slice) -> Program:
    """Make the update of a sliced parameter come from the slice, not its allgather."""
    s = p.stage_named(src)
    if s.type.layout == lay:
        return p
    gathered = s.expr.args[0] if isinstance(s.expr, Op) and s.expr.op == "allgather" else None
    if not (isinstance(gathered, Ref) and p.type_of(gathered.name).layout == lay):
        raise ScheduleError(span_of(d, name), "slice", name, f"its update '{src}' is computed whole; reorder it first")
    if p.fusion_of(src) is not None:
        raise ScheduleError(span_of(d, name), "slice", name, f"'{src}' is already fused; slice before fuse")
    updates = tuple((t, gathered.name if t == name else v) for t, v in p.updates)
    p = replace(p, updates=updates)
    return drop_stage(p, src) if not is_used(p, src) else p
