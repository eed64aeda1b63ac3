"""What fuse() and overlap() become: which stages of a fusion run on each chunk of its
collective as the chunk arrives, which wait for all chunks, and how an overlap cuts its
matmul. A fusion or an overlap that cannot run as asked is a PlanError at its directive
(never a silent fallback to separate stages)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from coconetc.errors import NOWHERE, CompileError, Span
from coconetc.ir import ops
from coconetc.ir.nodes import POINTWISE, Const, Expr, Fusion, Op, Overlap, Program, Ref, Stage, walk
from coconetc.ir.types import Dim, TType
from coconetc.plan.units import GatherChunks


class PlanError(CompileError):
    """A legal schedule that no backend can run as asked; located at its directive."""


def stage_of(p: Program, name: str) -> Stage:
    """The stage named `name` (it exists: the checker resolved every name)."""
    s = p.stage(name)
    assert s is not None, name
    return s


def op_of(s: Stage) -> Op:
    """A stage's top operation (for stages known to be operations: collectives, kernels)."""
    assert isinstance(s.expr, Op), s.name
    return s.expr


@dataclass
class FusedSpec:
    fusion: Fusion
    members: tuple[str, ...]  # what runs chunk by chunk: the collective, computes, the gather
    collective: Stage  # the reducescatter (or allreduce)
    computes: list[Stage]  # stages computed on each chunk, in order
    gather: Stage | None  # the allgather of one computed value
    rows: Dim | None = None  # chunks hold whole rows of this many elements (a layernorm)


@dataclass
class OverlapSpec:
    producer: Stage  # a matmul or a matmul_nt
    collective: Stage  # the collective that reads it
    chunks: int
    dim: int
    direct: bool  # chunks along dim 0: contiguous rows of every buffer
    fused: FusedSpec | None
    span: Span | None = None
    then: GatherSpec | None = None  # the matmul fed by the fused collective's gather (Overlap.then)
    terms: tuple[Stage, ...] = ()  # the GEMM stages whose sum the producer is (Overlap.terms)


@dataclass
class GatherSpec:
    """overlap() the other way: the collective (an allgather or a broadcast) in chunks along
    `dim` of its result, and the matmul that reads it multiplied chunk by chunk."""

    collective: Stage
    consumer: Stage  # a matmul or a matmul_nt whose left operand is the collective's result
    chunks: int
    dim: int
    how: GatherChunks
    span: Span = NOWHERE
    right: bool = False  # the collective's result is the consumer's right operand (a weight: GatherMatmul.right)


def same_elements(rt: TType, t: TType) -> bool:
    """Does a value of type rt hold, at local index i, the element a loop over t computes at
    its local index i?"""
    return rt.shape == t.shape and (rt.layout == t.layout or (not rt.layout.sliced and not t.layout.sliced))


def fused_spec(p: Program, fusion: Fusion, scattered: set[str], rows_ok: bool = True) -> FusedSpec | None:
    """How a fusion with a collective runs as one fused collective (None: it has none).

    It needs a reducescatter (or an allreduce). The stages of the fusion that run over the
    reduced elements (and read no stage that waits) are computed on each chunk as it arrives
    (phase A); the gather is part of the chunk loop when it gathers one of them. Stages that
    need every chunk first (a norm, a sum, a segment_norm of the reduced values, and what reads
    them: phase B) run when the chunks are done; the reductions themselves are accumulated
    chunk by chunk (the planner's Fused.partials)."""
    stages = [stage_of(p, n) for n in fusion.stages]
    colls = [s for s in stages if s.kind == "collective"]
    if not colls:
        return None
    first = next((s for s in colls if op_of(s).op in ("reducescatter", "allreduce")), None)
    if first is None:
        c = colls[0]
        raise PlanError.at(fusion.span, f"fuse: a fused collective reduces chunk by chunk: it needs "
                           f"a reducescatter or an allreduce, and '{c.name}' is {op_of(c).op}; "
                           + _advice_reducer(p, fusion, c))
    gather = next((s for s in colls if op_of(s).op == "allgather"), None)
    computes: list[Stage] = []
    inside = {first.name: None}  # ordered
    rows = None
    updated = {src: t for t, src in p.updates}
    waiting: set[str] = set()  # what the stages that wait for every chunk read
    for s in stages:
        if s.kind == "collective":
            continue
        if updated.get(s.name) in waiting:  # it would update a parameter they read, before them
            waiting |= {r.name for r in walk(s.expr) if isinstance(r, Ref)}
            continue
        if rows_ok and _row_stage(p, s, first, inside, scattered):
            rows = first.type.shape[-1]
        elif not _chunkable_stage(p, s, first, inside, scattered):
            waiting |= {r.name for r in walk(s.expr) if isinstance(r, Ref)}
            continue  # waits for every chunk (phase B); so does what reads it
        computes.append(s)
        inside[s.name] = None
    if not computes and not chunk_reductions(p, fusion, inside):
        c0 = next((x for x in stages if x.kind != "collective"), None)
        why = (f"'{c0.name}' cannot run on a chunk of '{first.name}' as it arrives "
               f"({_why_not_chunkable(p, c0, first, inside, scattered, rows_ok)})" if c0 is not None
               else "it holds no computation")
        raise PlanError.at(fusion.span, f"fuse: nothing to compute inside the collective: {why}, and no "
                           f"stage of the fusion reduces '{first.name}' (a sum, a norm or a max of it would be "
                           f"accumulated chunk by chunk); " + _advice_nothing(p, fusion, first, scattered, rows_ok))
    if gather is not None and _arg_name(gather) not in inside:
        gather = None
    done = tuple(inside) + ((gather.name,) if gather is not None else ())
    return FusedSpec(fusion, done, first, computes, gather, rows)


# The reductions of the language (IR operation names) and the Reduce unit's op for each.
REDUCE_UNIT = {"sum": "sum", "norm": "norm", "segment_norm": "segment_norm", "amax": "max", "amin": "min"}
REDUCTIONS = tuple(REDUCE_UNIT)


def chunk_reductions(p: Program, fusion: Fusion, inside: dict) -> list[Op]:
    """The reductions in the fusion's waiting stages that read values of the chunk (the reduced
    value, or a stage computed on each chunk) pointwise at the chunk's own elements: each can be
    accumulated chunk by chunk as the chunks arrive."""
    first = stage_of(p, next(iter(inside)))
    out: list[Op] = []
    for n in fusion.stages:
        if n in inside:
            continue
        s = stage_of(p, n)
        for e in walk(s.expr):
            if not (isinstance(e, Op) and e.op in REDUCTIONS):
                continue
            arg = e.args[0]
            refs = {r.name for r in walk(arg) if isinstance(r, Ref)}
            if (refs & set(inside) and same_elements(arg.type, first.type)
                    and all(isinstance(x, (Ref, Const)) or x.op in POINTWISE for x in walk(arg))
                    and not refs & (set(fusion.stages) - set(inside))):
                out.append(e)
    return out


def _fuse_text(fusion: Fusion, stages) -> str:
    head = f"{fusion.name} = " if not fusion.name.startswith("fused") else ""
    return f"{head}fuse({', '.join(stages)})"


def _advice_without(p: Program, fusion: Fusion, drop: set[str], what: str) -> str:
    """Advice: the fusion without `drop` and every member that reads them (else a cycle)."""
    from coconetc.ir.rewrite import depends_on
    deps = depends_on(p)
    gone = set(drop) | {m for m in fusion.stages if deps.get(m, set()) & set(drop)}
    keep = [m for m in fusion.stages if m not in gone]
    extra = sorted(gone - set(drop), key=fusion.stages.index)
    also = f" and what reads it ({', '.join(extra)})" if extra else ""
    if len(keep) < 2 or all(stage_of(p, m).kind == "collective" for m in keep):
        return f"{what}{also}: nothing would be left to fuse; remove this fuse directive"
    return f"{what}{also}: {_fuse_text(fusion, keep)}"


def _advice_reducer(p: Program, fusion: Fusion, c: Stage) -> str:
    """Advice for a fusion without a reducing collective: add the reducescatter whose slices
    its computations read (the head of the fused collective), else leave the collective out."""
    members = set(fusion.stages)
    for n in fusion.stages:
        s = stage_of(p, n)
        for r in walk(s.expr):
            rs = p.stage(r.name) if isinstance(r, Ref) else None
            if (rs is not None and rs.name not in members and rs.kind == "collective"
                    and op_of(rs).op == "reducescatter" and p.fusion_of(rs.name) is None
                    and all(op_of(x).op != "reducescatter" for x in map(p.stage_named, members)
                            if x.kind == "collective")):
                return (f"add the reducescatter '{rs.name}' that '{n}' reads: "
                        f"{_fuse_text(fusion, [rs.name, *fusion.stages])}")
    return _advice_without(p, fusion, {c.name}, f"leave '{c.name}' out")


def _advice_nothing(p: Program, fusion: Fusion, first: Stage, scattered: set[str], rows_ok: bool) -> str:
    """Advice when no stage computes on the chunks: add a stage that reads the reduced value
    pointwise at its own elements (it can run on each chunk), else remove the fusion."""
    inside = {first.name: None}
    for u in p.users(first.name):
        if u.name in fusion.stages or u.kind == "collective":
            continue
        if _why_not_chunkable(p, u, first, inside, scattered, rows_ok) == "":
            stages = list(fusion.stages)
            return (f"add '{u.name}', which computes on each chunk of '{first.name}', to the fusion: "
                    f"{_fuse_text(fusion, stages + [u.name])}")
    moved = _advice_reorder(p, fusion, scattered, rows_ok)
    if moved:
        return moved
    return (f"no stage computes pointwise on the elements of '{first.name}' (without the fusion the "
            f"collective and the stages run one after the other): remove this fuse directive")


def _advice_reorder(p: Program, fusion: Fusion, scattered: set[str], rows_ok: bool) -> str:
    """The fusion's stages read the all-gathered value (a split without reorder): the advice of
    schedule/fusion.py reorder_advice, given only when the fusion it leads to runs as a fused
    collective ('' otherwise)."""
    from coconetc.schedule.fusion import reorder_advice
    base = replace(p, fusions=tuple(f for f in p.fusions if f is not fusion))
    moved = reorder_advice(base, fusion.stages, None if fusion.name.startswith("fused") else fusion.name)
    if moved is None:
        return ""
    try:
        if fused_spec(moved[1], moved[1].fusions[-1], scattered, rows_ok) is None:
            return ""
    except CompileError:
        return ""
    return moved[0]


def _arg_name(s: Stage) -> str:
    a = op_of(s).args[0]
    assert isinstance(a, Ref)
    return a.name


# The row-wise operations a fused collective's row-wise phase holds: over the last dim, with
# chunks of whole rows each row is computed as soon as the chunk's rows are.


def row_op(e) -> Op | None:
    """The row-wise operation of a stage's expression: a layernorm as the whole stage, or one
    layernorm_dx inside a pointwise expression (a derived program's g_x = d_y + layernorm_dx(...),
    the rest computed on each element of the row as it is computed); None otherwise."""
    if isinstance(e, Op) and e.op == "layernorm":
        return e
    found = [n for n in walk(e) if isinstance(n, Op) and n.op not in POINTWISE]
    if len(found) != 1 or found[0].op != "layernorm_dx":
        return None
    return found[0] if not any(isinstance(n, Op) and n.op == "dropout" for n in walk(e)) else None


# The name a row-wise phase's renderers give the row operation's value in the expression around it.
ROW_VALUE = "@row"


def substitute(e, old: Op, new: Expr):
    """e with its subexpression `old` (the very node) replaced by `new`."""
    if e is old:
        return new
    if isinstance(e, Op):
        return replace(e, args=tuple(substitute(a, old, new) for a in e.args))
    return e


def _row_stage(p: Program, s: Stage, first: Stage, inside: dict, scattered: set[str]) -> bool:
    """layernorm(x, gamma, beta, eps) of a value of the fused chunk, over its last dim, or
    layernorm_dx(x, gamma, g, eps) of a cotangent g of the chunk (x a value from before the
    fusion), inside a pointwise expression of values from before the fusion at its own
    elements: with chunks of whole rows, each chunk's rows are computed as soon as they are.
    gamma, beta (layernorm_dx's x, gamma) may be expressions of values from before the fusion
    (a beta written `0.0 * ln_w`): the planner computes them before the fused collective."""
    e = row_op(s.expr)
    if e is None or s.type != first.type or first.type.ndim < 1:
        return False
    refs = {n.name for n in walk(s.expr) if isinstance(n, Ref)}
    fusion = p.fusion_of(s.name)
    members = set(fusion.stages) if fusion is not None else set()
    if scattered & refs or any(n in members and n not in inside for n in refs):
        return False  # (a member that waits for every chunk: not computed yet)
    if e.op == "layernorm":
        x, g, b, eps = e.args
        row_in, outside = x, (g, b)
    else:
        x, g, eps = e.args[0], e.args[2], e.args[3]
        row_in, outside = g, (x, e.args[1])
        wrapper = [n for n in walk(s.expr) if isinstance(n, Ref)
                   and not any(n is m for a in e.args for m in walk(a))]
        if any(n.name in inside or not same_elements(n.type, s.type) for n in wrapper):
            return False
        if isinstance(x, Ref) and not same_elements(x.type, s.type):
            return False
    return (isinstance(row_in, Ref) and row_in.name in inside
            and all(not any(isinstance(n, Ref) and n.name in inside for n in walk(a)) for a in outside)
            and (isinstance(eps, Const) or (isinstance(eps, Ref) and eps.name not in inside)))


def _chunkable_stage(p: Program, s: Stage, first: Stage, inside: dict, scattered: set[str]) -> bool:
    return _why_not_chunkable(p, s, first, inside, scattered, False) == ""


def _why_not_chunkable(p: Program, s: Stage, first: Stage, inside: dict, scattered: set[str],
                       rows_ok: bool) -> str:
    if s.type.shape != first.type.shape or s.type.layout != first.type.layout:
        return f"its elements ({s.type}) are not those of the chunk ({first.type})"
    fusion = p.fusion_of(s.name)
    members = set(fusion.stages) if fusion is not None else set()
    for n in walk(s.expr):
        if isinstance(n, Op) and n.op not in POINTWISE:
            if not {r.name for r in walk(n) if isinstance(r, Ref)} & (members | set(inside)):
                continue  # reads nothing of the fusion: computed before the fused collective
            if ops.has(n.op, ops.ROWWISE) and not rows_ok:
                return f"a {n.op} inside a fusion whose chunks are not whole rows"
            return f"{n.op} needs every chunk first"
        if isinstance(n, Ref) and n.name in scattered and s.type.ndim != 1:
            return f"it reads the scattered '{n.name}' as a {s.type.ndim}-d value"
        if isinstance(n, Ref) and n.name not in scattered and (
                p.stage(n.name) is not None and n.name not in inside and
                p.fusion_of(n.name) is p.fusion_of(s.name)):
            return f"it reads '{n.name}', which runs after the chunks"
        if isinstance(n, Ref) and n.name in inside and not same_elements(n.type, s.type):
            return f"it reads '{n.name}' at other elements than its own"
    return ""


def overlap_spec(p: Program, o: Overlap, scattered: set[str]) -> OverlapSpec:
    """overlap(): the matmul (or matmul_nt) cut into chunks along dim o.dim of its result. Along dim 0 into an
    allreduce, a reducescatter along another dim or a fusion holding one, chunks are contiguous
    rows everywhere; along any other dim (or into an allgather) each chunk is packed for its
    collective. A fused consumer must take the direct way."""
    y = stage_of(p, o.producer)
    fusion = next((f for f in p.fusions if f.name == o.consumer), None)
    names = fusion.stages if fusion else (o.consumer,)
    coll = next(stage_of(p, n) for n in names if stage_of(p, n).kind == "collective")
    op = op_of(coll).op
    direct = (o.dim == 0 and y.type.ndim >= 2 and not y.type.layout.sliced
              and (op == "allreduce" or (op == "reducescatter" and coll.type.layout.dim != 0)))
    fused = None
    terms = p.summed_gemms(y.name)
    if terms and not direct:
        raise PlanError.at(o.span, f"overlap: '{y.name}', a sum of matmuls, is chunked in blocks of its rows "
                           f"(dim 0) into an allreduce or a reducescatter along another dim; here into {op}" +
                           (f" along dim {coll.type.layout.dim}" if op == "reducescatter" else "") +
                           ": remove this overlap")
    if fusion is not None:
        if not direct:
            rows = (y.type.ndim >= 2 and not y.type.layout.sliced
                    and (op == "allreduce" or (op == "reducescatter" and coll.type.layout.dim != 0)))
            fix = (f"chunk it along dim 0: overlap({y.name}, {o.consumer}, chunks={o.chunks}, dim=0)" if rows else
                   "remove this overlap (the fused collective then runs after the matmul)")
            raise PlanError.at(o.span, f"overlap: a fused consumer is chunked along dim 0 of "
                               f"'{y.name}' into an allreduce or a reducescatter along another dim; "
                               f"here dim={o.dim} into {op}" +
                               (f" along dim {coll.type.layout.dim}" if op == "reducescatter" else "") + f": {fix}")
        fused = fused_spec(p, fusion, scattered, rows_ok=True)
    elif op not in ("allreduce", "reducescatter", "allgather"):
        raise PlanError.at(o.span, f"overlap: chunks of a matmul go to an allreduce, a "
                           f"reducescatter or an allgather; '{coll.name}' is {op}")
    return OverlapSpec(y, coll, o.chunks, o.dim, direct, fused, o.span, terms=terms)


def fed_matmul(p: Program, ov: OverlapSpec, into: dict[str, Overlap], scattered: set[str]) -> GatherSpec | None:
    """overlap(g, y) where g is the allgather of the fused collective that ov overlaps with its
    matmul: y multiplied block for block with ov's blocks of rows, each as soon as its fused
    collective is done (Overlap.then). The blocks must be the same: ov's chunks, along dim 0."""
    fusion = ov.fused.fusion if ov.fused is not None else None
    g = next((stage_of(p, n) for n in fusion.stages if n in into), None) if fusion is not None else None
    if g is None:
        return None
    assert ov.fused is not None and fusion is not None
    o, y = into[g.name], ov.producer
    spec = gather_spec(p, o, scattered)
    if spec.right:
        raise PlanError.at(o.span, f"overlap: '{g.name}' is gathered by the fused collective '{fusion.name}' and "
                           f"'{spec.consumer.name}' reads it as its right operand, which a fused collective does not "
                           f"feed chunk by chunk: remove this overlap")
    if ov.fused.gather is None or ov.fused.gather.name != g.name:
        raise PlanError.at(o.span, f"overlap: the fused collective '{fusion.name}' gathers '{g.name}' only after "
                           f"every chunk (what it gathers waits for all of them), so '{spec.consumer.name}' cannot "
                           f"take it chunk by chunk: remove this overlap")
    if g.type.shape[0] != y.type.shape[0]:
        raise PlanError.at(o.span, f"overlap: '{g.name}' ({g.type}) and '{y.name}' ({y.type}), whose overlap with "
                           f"'{fusion.name}' makes it, have different dim 0s, so '{spec.consumer.name}' cannot take "
                           f"it block for block: remove this overlap")
    if o.chunks != ov.chunks or o.dim != 0:
        raise PlanError.at(o.span, f"overlap: '{g.name}' is gathered by the fused collective '{fusion.name}' in "
                           f"the {ov.chunks} blocks of rows (dim 0) of its overlap with '{y.name}', and "
                           f"'{spec.consumer.name}' multiplies it block for block: "
                           f"overlap({g.name}, {spec.consumer.name}, chunks={ov.chunks})")
    return spec


def unfed_matmul(p: Program, fusion: Fusion, into: dict[str, Overlap]) -> None:
    """A fusion not overlapped with its matmul whose allgather is overlapped with the matmul
    that reads it: a PlanError advising the overlap that feeds it (fed_matmul)."""
    g = next((n for n in fusion.stages if n in into), None)
    if g is None:
        return
    o = into[g]
    colls = [stage_of(p, n) for n in fusion.stages if stage_of(p, n).kind == "collective"]
    src = op_of(colls[0]).args[0]
    made = p.stage(src.name) if isinstance(src, Ref) else None
    if made is not None and isinstance(made.expr, Op) and ops.has(made.expr.op, ops.OVERLAPPED):
        how = (f"overlap the fusion with the matmul that makes its input, with the same chunks: "
               f"overlap({made.name}, {fusion.name}, chunks={o.chunks})")
    else:
        how = f"remove overlap({g}, {o.consumer}, chunks={o.chunks}), or leave '{g}' out of '{fusion.name}'"
    raise PlanError.at(o.span, f"overlap: '{g}' is gathered by the fused collective '{fusion.name}', which "
                       f"takes it chunk for chunk to '{o.consumer}' only inside the fusion's own overlap: {how}")


def gather_spec(p: Program, o: Overlap, scattered: set[str]) -> GatherSpec:
    """overlap(g, y): chunks of g along dim 0 are contiguous rows of the collective's source, of
    g and of y ('rows'), unless dim 0 is the dim an allgather gathers: then chunk i is piece i
    of every rank's slice ('pieces'); along another dim each chunk is packed for its
    collective and unpacked into place ('packed')."""
    g, y = stage_of(p, o.producer), stage_of(p, o.consumer)
    x = op_of(g).args[0]
    if isinstance(x, Ref) and x.name in scattered:
        raise PlanError.at(o.span, f"overlap: the {op_of(g).op} '{g.name}' reads the scattered "
                           f"parameter '{x.name}', which is not gathered in chunks: remove this overlap")
    gathered = x.type.layout.dim if op_of(g).op == "allgather" else None
    how = GatherChunks.PIECES if o.dim == gathered else GatherChunks.ROWS if o.dim == 0 else GatherChunks.PACKED
    a = op_of(y).args[0]
    return GatherSpec(g, y, o.chunks, o.dim, how, o.span, right=not (isinstance(a, Ref) and a.name == g.name))
