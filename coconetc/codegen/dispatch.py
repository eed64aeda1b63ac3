"""What both backends dispatch the same way, each with its own text: the function's layout
(size symbols, buffers, units), a plan unit to the backend's renderer of its kind (after the
comment naming the schedule, the unit and its .ccn line), and a collective to the backend's
call of its kind (a table (op, segments) -> text in codegen/cpu/collectives.py and
codegen/cuda/collectives.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from coconetc.codegen.base import Function, Writer, prod
from coconetc.codegen.emit import CTYPE
from coconetc.plan.units import (Buffer, Collective, Copy, Fused, GatherMatmul, Library, Loop, Overlap, Reduce, Require,
                                 StartGather, Unit, title)


def function(w: Writer, declare: Callable[[Buffer], None], unit: Callable[[Unit], None],
             check: Callable[[Library], None] | None = None, mark: str = "") -> Function:
    """The function, laid out the same way by every backend: the size symbols, each buffer
    of the plan declared, the reshapes' checks where a unit computes into an output's memory
    before its reshape would check the sizes (check(u): the backend's text), each unit rendered.
    mark: the backend's trace mark of unit k (its declaration of trace_{k}, formatted with k;
    coconet/trace.h, coconet/cuda/trace.cuh: the unit's index in the plan, which
    coconetc/runtime/trace.py names), each unit between it and trace_{k}.end()."""
    for i, sym in enumerate(w.sig.sizes):
        w.emit(f"const int64_t S_{sym} = a.sizes[{i}];")
    for b in _declaration_order(w.plan.buffers):
        declare(b)
    into = dict.fromkeys(where for b in w.plan.buffers if (where := _reshape_held_in(w, b)))
    if check is not None and into:
        w.emit("// every reshape's sizes checked first, in order: a reshape's source is computed in "
               + " or in ".join(into))
        for u in w.plan.units:
            if isinstance(u, Library) and u.op == "reshape":
                check(u)
    for k, u in enumerate(w.plan.units):
        if mark:
            w.emit(mark.format(k=k))
        unit(u)
        if mark:
            w.emit(f"trace_{k}.end();")
    comment = f"program {w.plan.program}, schedule {w.plan.schedule} ({w.file})"
    return Function(w.fn, comment, w.lines, w.sig)


def _declaration_order(buffers) -> list[Buffer]:
    """The buffers in plan order, except that one held in another's memory (Buffer.same_as,
    Buffer.reuses, Buffer.one_rank_as) comes after that one (a reshape's source held in the output it is
    reshaped into)."""
    out: list[Buffer] = []
    done: set[str] = set()
    waiting = list(buffers)
    while waiting:
        b = next(x for x in waiting if all(not o or o in done or o not in {y.name for y in waiting}
                                           for o in (x.same_as, x.reuses, x.one_rank_as)))
        waiting.remove(b)
        out.append(b)
        done.add(b.name)
    return out


def reshape_into_output(w: Writer, b: Buffer) -> Library | None:
    """For a buffer held in an output's memory (plan/targets.py: a returned reshape's source),
    the reshape unit; None otherwise."""
    if not b.same_as or b.same_at is not None or w.buffers[b.same_as].kind != "output":
        return None
    return next(u for u in w.plan.units if isinstance(u, Library) and u.op == "reshape" and u.args[0] == b.name)


def _reshape_held_in(w: Writer, b: Buffer) -> str:
    """Where B's memory lies when a reshape's source is computed in a place a reshape's size
    check must come before ("" otherwise): an output's (B a returned reshape's source:
    reshape_into_output), or, for B a reshape held in its source's memory, the place of another
    buffer that source is made in (plan/targets.py: a row of a stacked gradient,
    assembled_stacks; an accumulator, accumulated_in_place). A source larger than the reshape
    would run past it, so every reshape's sizes are checked before anything runs."""
    if reshape_into_output(w, b) is not None:
        return "an output's memory"
    src = w.buffers.get(b.same_as) if b.same_as and b.same_at is None else None
    if src is None or not src.same_as or w.plan.is_index(src.name):
        return ""
    return "an accumulator's memory" if w.buffers[src.same_as].kind == "alias" else "a row of a stacked gradient"


def declare_scratch(w: Writer, b: Buffer, memory: str) -> None:
    """A scratch buffer's declaration with its MEMORY (the backend's allocation): at one rank the
    other buffer's memory instead where the plan makes an all-reduce's result and source one
    (Buffer.one_rank_as, plan/targets.py one_rank_results)."""
    ct = CTYPE[b.type.dtype]
    if b.one_rank_as:
        w.emit(f"{ct}* const v_{b.name} = comm.size == 1 ? v_{b.one_rank_as} : {memory};  "
               f"// one rank: {b.one_rank_as}'s memory, the all-reduce copies nothing")
    else:
        w.emit(f"{ct}* const v_{b.name} = {memory};")


def declare(w: Writer, b: Buffer) -> bool:
    """The declarations every backend writes the same way (a buffer that is a place in another:
    an output, an in-place update, a view inside a gathered result, a reshape of its source held
    in the source's memory); False for the others."""
    ct = CTYPE[b.type.dtype]
    if b.same_as and reshape_into_output(w, b) is not None:
        w.emit(f"{ct}* const v_{b.name} = v_{b.same_as};  // reshaped into the output {b.same_as}: computed in its "
               "memory, no copy")
    elif b.same_as and b.same_at is not None:
        what = ("an index" if w.plan.is_index(b.name) else "the accumulator: its GEMM adds into it"
                if w.buffers[b.same_as].kind == "alias" else "a layer's gradient made in its row")
        w.emit(f"{ct}* const v_{b.name} = v_{b.same_as} + {b.same_at} * {prod(w.ldims(b.type))};  "
               f"// row {b.same_at} of {b.same_as} ({what}): its memory, no copy")
    elif b.same_as and w.buffers[b.same_as].kind == "alias":
        w.emit(f"{ct}* const v_{b.name} = v_{b.same_as};  // the accumulator {b.same_as}: its GEMM adds into it")
    elif b.same_as:
        w.emit(f"{ct}* const v_{b.name} = v_{b.same_as};  // a reshape of {b.same_as}: its memory, no copy")
    elif b.reuses:
        w.emit(f"{ct}* const v_{b.name} = v_{b.reuses};  // in {b.reuses}'s memory: gathered after its last reader")
    elif b.kind == "output":
        w.emit(f"{ct}* const v_{b.name} = a.output<{ct}>({w.sig.outputs.index(b.of)});")
    elif b.kind == "alias":
        w.emit(f"{ct}* const v_{b.name} = v_{b.of};  // updates {b.of} in place")
    elif b.kind == "view":
        inner = prod(w.gdims(b.type)[1:])
        w.emit(f"{ct}* const v_{b.name} = v_{b.of} + {w.offset(b.type)} * {inner};"
               "  // computed in place inside the gathered result")
    else:
        return False
    return True


class Renderer(Protocol):
    """A backend's renderers of the plan's units (codegen/cpu/render.py, codegen/cuda/render.py)."""

    LOOP: str  # what a Loop becomes, for its comment ("loop", "kernel")
    COLLECTIVE: str  # the end of a collective's comment

    def loop(self, u: Loop) -> None: ...
    def reduce(self, u: Reduce) -> None: ...
    def library(self, u: Library) -> None: ...
    def collective(self, u: Collective) -> None: ...
    def copy(self, u: Copy) -> None: ...
    def require(self, u: Require) -> None: ...
    def fused(self, u: Fused) -> None: ...
    def overlap(self, u: Overlap) -> None: ...
    def gather_matmul(self, u: GatherMatmul) -> None: ...
    def start_gather(self, u: StartGather) -> None: ...


def unit(w: Writer, r: Renderer, u: Unit) -> None:
    """One unit: its comment (but a copy's and a require's, which write their own), then the
    backend's text for it."""
    if not isinstance(u, (Copy, Require)):
        w.comment(u.line, title(u, r.LOOP, r.COLLECTIVE))
    if isinstance(u, Loop):
        r.loop(u)
    elif isinstance(u, Reduce):
        r.reduce(u)
    elif isinstance(u, Library):
        r.library(u)
    elif isinstance(u, Collective):
        r.collective(u)
    elif isinstance(u, Copy):
        r.copy(u)
    elif isinstance(u, Require):
        r.require(u)
    elif isinstance(u, Fused):
        r.fused(u)
    elif isinstance(u, GatherMatmul):
        r.gather_matmul(u)
    elif isinstance(u, StartGather):
        r.start_gather(u)
    else:
        assert isinstance(u, Overlap)
        r.overlap(u)


@dataclass(frozen=True)
class Operands:
    """One collective's operands, as every backend's call text reads them."""

    w: Writer
    u: Collective
    x: str  # the value read: the source, or the packed copy a backend made of it
    segments: bool  # x is a scattered parameter, read segment by segment (p_<x>)
    op: str  # the reduction, in the backend's spelling ("" for none)

    @property
    def dst(self) -> str:
        return self.u.dst

    @property
    def ct(self) -> str:
        """The element type (a collective keeps its source's)."""
        return CTYPE[self.w.types[self.u.src].dtype]

    @property
    def n(self) -> str:
        """This rank's elements of the source."""
        return prod(self.w.ldims(self.w.types[self.u.src]))

    @property
    def total(self) -> str:
        """The source's global elements."""
        return prod(self.w.gdims(self.w.types[self.u.src]))

    @property
    def split(self) -> str:
        """The source as [outer, n, inner] around the dim its result is sliced along."""
        xt, t = self.w.types[self.u.src], self.w.types[self.u.dst]
        return self.w.shape3(xt, t.layout.dim)

    @property
    def join(self) -> str:
        """The result as [outer, n, inner] around the dim its source is sliced along."""
        xt, t = self.w.types[self.u.src], self.w.types[self.u.dst]
        return self.w.shape3(t, xt.layout.dim)


Calls = Mapping[tuple[str, bool], Callable[[Operands], str]]


def collective(w: Writer, u: Collective, calls: Calls, reduce_ops: Mapping[str, str], x: str = "") -> None:
    """The backend's call of one collective: calls[(op, segments)], ("into", False) for an
    allgather straight into a scattered parameter's segments. x: what is read, if not u.src."""
    x = x or u.src
    a = Operands(w, u, x, x in w.scattered, reduce_ops.get(u.reduce, ""))
    if w.buffers[u.dst].one_rank_as == u.src or w.buffers[u.src].one_rank_as == u.dst:  # (plan/targets.py)
        w.emit("if (comm.size > 1)  // one rank: the result is the source")
    w.emit(calls[("into", False) if u.into else (u.op, a.segments)](a))


def chunk_collective(w: Writer, u: Overlap, calls: Mapping[str, Callable[[str], str]]) -> str:
    """The backend's call of one overlap chunk's collective (chunk r of the matmul's result):
    calls[op](split), split the chunk as [outer, n, inner] around the dim the collective cuts
    (a reduce-scatter: its result's sliced dim; an allgather: its source's), "" for an
    all-reduce (the backend counts its elements). direct: the chunk is rows r of dim 0;
    otherwise the packed chunk, dim u.dim cut to r."""
    if u.op == "allreduce":
        return calls["allreduce"]("")
    yt = w.types[u.producer]
    d = w.types[u.collective].layout.dim if u.op == "reducescatter" else yt.layout.dim
    g = w.gdims(yt)
    if u.direct:
        return calls[u.op](f"r.size() * {prod(g[1:d])}, {g[d]}, {prod(g[d + 1:])}")
    gp = [x if k != u.dim else "r.size()" for k, x in enumerate(g)]
    return calls[u.op](f"{prod(gp[:d])}, {gp[d]}, {prod(gp[d + 1:])}")


@dataclass(frozen=True)
class GatherChunk:
    """Chunk r of an overlap the other way (GatherMatmul), as every backend lays it out: the
    chunked dim's extent `n`; the source and the gathered value seen as [outer, n, inner]
    around it (`x_outer`, `x_inner`, `g_outer`, `g_inner`); the chunk's rows in place (how ==
    rows: `rows_src`, `rows_dst`); the chunk's collective (`call`: an allgather's [outer, n,
    inner] around the gathered dim, a broadcast's element count; `packed_elems`: a packed
    chunk's gathered elements); a GEMM's rows per index of the chunked dim (`rows_per`) and the
    consumer's columns (`cols`)."""

    n: str
    x_outer: str
    x_inner: str
    g_outer: str
    g_inner: str
    rows_src: str
    rows_dst: str
    call: str
    packed_elems: str
    rows_per: str
    cols: str


def gather_chunk(w: Writer, u: GatherMatmul) -> GatherChunk:
    c, d = u.gather, u.dim
    G, X, Y = (w.ldims(w.types[n]) for n in (c.dst, c.src, u.consumer))
    gp = [x if k != d else "r.size()" for k, x in enumerate(G)]
    if c.op == "allgather":
        ld = w.types[c.src].layout.dim
        call = f"{prod(gp[:ld])}, {gp[ld]}, {prod(gp[ld + 1:])}"
    else:
        call = prod(gp)
    return GatherChunk(G[d], prod(X[:d]), prod(X[d + 1:]), prod(G[:d]), prod(G[d + 1:]),
                       f"v_{c.src} + r.begin * {prod(X[1:])}", f"v_{c.dst} + r.begin * {prod(G[1:])}", call,
                       prod(gp), prod(G[d + 1:-1]), Y[-1])
