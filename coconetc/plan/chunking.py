"""What fuse() and overlap() become: which stages of a fusion run on each chunk of its
collective as the chunk arrives, which wait for all chunks, and how an overlap cuts its
matmul. A fusion or an overlap that cannot run as asked is a PlanError at its directive
(never a silent fallback to separate stages)."""

from __future__ import annotations

from dataclasses import dataclass

from coconetc.errors import CompileError, Span
from coconetc.ir.nodes import POINTWISE, Const, Fusion, Op, Overlap, Program, Ref, Stage, walk
from coconetc.ir.types import Dim, TType


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


def same_elements(rt: TType, t: TType) -> bool:
    """Does a value of type rt hold, at local index i, the element a loop over t computes at
    its local index i?"""
    return rt.shape == t.shape and (rt.layout == t.layout or (not rt.layout.sliced and not t.layout.sliced))


def fused_spec(p: Program, fusion: Fusion, scattered: set[str], rows_ok: bool = True) -> FusedSpec | None:
    """How a fusion with a collective runs as one fused collective (None: it has none).

    It needs a reducescatter (or an allreduce). The stages at the head of the fusion that run
    over the reduced elements are computed on each chunk as it arrives; the gather is part of
    the fused collective when it gathers one of them. Stages that need all chunks first (a
    norm, a segment_norm) and what follows them run when the chunks are done."""
    stages = [stage_of(p, n) for n in fusion.stages]
    colls = [s for s in stages if s.kind == "collective"]
    if not colls:
        return None
    first = next((s for s in colls if op_of(s).op in ("reducescatter", "allreduce")), None)
    if first is None:
        c = colls[0]
        raise PlanError.at(fusion.span, f"fuse: a fused collective reduces chunk by chunk: it needs "
                           f"a reducescatter or an allreduce, and '{c.name}' is {op_of(c).op}")
    gather = next((s for s in colls if op_of(s).op == "allgather"), None)
    computes: list[Stage] = []
    inside = {first.name: None}  # ordered
    rows = None
    for s in stages:
        if s.kind == "collective":
            continue
        if rows_ok and _row_stage(s, first, inside, scattered):
            rows = first.type.shape[-1]
        elif not _chunkable_stage(p, s, first, inside, scattered):
            break
        computes.append(s)
        inside[s.name] = None
    if not computes:
        c0 = next((x for x in stages if x.kind != "collective"), None)
        why = (f"'{c0.name}' cannot run on a chunk of '{first.name}' as it arrives "
               f"({_why_not_chunkable(p, c0, first, inside, scattered, rows_ok)})" if c0 is not None
               else "it holds no computation")
        raise PlanError.at(fusion.span, f"fuse: nothing to compute inside the collective: {why}")
    if gather is not None and _arg_name(gather) not in inside:
        gather = None
    done = tuple(inside) + ((gather.name,) if gather is not None else ())
    return FusedSpec(fusion, done, first, computes, gather, rows)


def _arg_name(s: Stage) -> str:
    a = op_of(s).args[0]
    assert isinstance(a, Ref)
    return a.name


def _row_stage(s: Stage, first: Stage, inside: dict, scattered: set[str]) -> bool:
    """layernorm(x, gamma, beta, eps) of a value of the fused chunk, over its last dim: with
    chunks of whole rows, each chunk's rows are normalized as soon as they are computed."""
    e = s.expr
    if not (isinstance(e, Op) and e.op == "layernorm" and s.type == first.type and first.type.ndim >= 1):
        return False
    x, g, b, eps = e.args
    return (isinstance(x, Ref) and x.name in inside and not scattered & {n.name for n in walk(e) if isinstance(n, Ref)}
            and all(isinstance(a, Ref) and a.name not in inside for a in (g, b))
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
            if n.op == "layernorm" and not rows_ok:
                return "a layernorm inside an overlapped fused collective"
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
    if fusion is not None:
        if not direct:
            raise PlanError.at(o.span, f"overlap: a fused consumer is chunked along dim 0 of "
                               f"'{y.name}' into an allreduce or a reducescatter along another dim; "
                               f"here dim={o.dim} into {op}" +
                               (f" along dim {coll.type.layout.dim}" if op == "reducescatter" else ""))
        fused = fused_spec(p, fusion, scattered, rows_ok=False)
    elif op not in ("allreduce", "reducescatter", "allgather"):
        raise PlanError.at(o.span, f"overlap: chunks of a matmul go to an allreduce, a "
                           f"reducescatter or an allgather; '{coll.name}' is {op}")
    return OverlapSpec(y, coll, o.chunks, o.dim, direct, fused, o.span)
