"""How fuse() and overlap() run in the CPU backend: plans (which stages a fused collective
computes on its chunks, which collective an overlap chunks) and their emitters, a mixin of the
Lowerer (lower.py); plus the order in which stages run."""

from __future__ import annotations

from dataclasses import dataclass

from coconetc.codegen.emit import COMPUTE, CTYPE, REDUCE_OP, emit
from coconetc.codegen.loops import prod as _prod
from coconetc.codegen.emit import literal
from coconetc.ir.nodes import POINTWISE, Const, Expr, Op, Program, Ref, Stage, walk



def reads(e: Expr) -> set[str]:
    return {n.name for n in walk(e) if isinstance(n, Ref)}


_reads = reads


class ScheduleEmitter:
    # --- fused collectives -----------------------------------------------------------------
    def _fused(self, plan: FusedPlan, outputs: dict, in_place: dict) -> None:
        """One fused collective: each chunk of this rank's slice is reduced (fused.h), the
        fusion's computations run on it at once, and gathered values are written straight into
        their place in the full-size result, which the collective fills in from the others."""
        coll = plan.collective
        self.emit(f"// fused {plan.name}: {', '.join(plan.members)} ({coll.expr.op} + computation"
                  f"{' + allgather' if plan.gather else ''}, chunk by chunk)")
        x = self._materialize(coll.expr.args[0], coll.name)
        if plan.gather is not None:
            self._comment(plan.gather)
            self._place(plan.gather, outputs.get(plan.gather.name), in_place.get(plan.gather.name))
        d0 = coll.type.layout.dim if coll.type.layout.sliced else 0
        off = self.offset(coll.type) if coll.type.layout.sliced else "int64_t(0)"
        o = f"off_{plan.name}"
        self.emit(f"const int64_t {o} = {off} * {_prod(self.gdims(coll.type)[d0 + 1:])};")
        stored = self._fused_buffers(plan, outputs, in_place, d0, o)
        self.emit(f"auto compute_{plan.name} = [&](int64_t gb, int64_t ge, "
                  f"const {COMPUTE[coll.type.dtype]}* red) {{")
        # scalars as locals of the callback (in registers; not captured, so no aliasing)
        exprs = {c.name: self._scalars_out(c.expr, c.name) for c in plan.computes if not _is_rows(c)}
        self._chunk_prologue(coll, d0, off, o)
        self._chunk_loop(plan, exprs, stored, d0)
        self.emit("};")
        self._fused_call(plan, x)
        self.types[coll.name] = coll.type

    def _overlap_fused_buffers(self, plan: FusedPlan, outputs: dict, in_place: dict) -> None:
        coll = plan.collective
        if plan.gather is not None:
            self._comment(plan.gather)
            self._place(plan.gather, outputs.get(plan.gather.name), in_place.get(plan.gather.name))
        d0 = coll.type.layout.dim if coll.type.layout.sliced else 0
        off = self.offset(coll.type) if coll.type.layout.sliced else "int64_t(0)"
        self.emit(f"const int64_t off_{plan.name} = {off} * {_prod(self.gdims(coll.type)[d0 + 1:])};")
        self.overlap_stored = self._fused_buffers(plan, outputs, in_place, d0, f"off_{plan.name}")
        self.types[coll.name] = coll.type

    def _overlap_fused_task(self, plan: OverlapPlan, ly: list[str]) -> None:
        """Chunk i of the matmul's rows goes through its own fused collective (a task of
        overlap.h): the fusion's computation runs on each reduced piece of that chunk, and the
        gathered value is sent as soon as it is computed. Indices inside the callback are made
        global (base: the chunk's first element in the full tensor)."""
        f, y = plan.fused, plan.producer
        coll = f.collective
        ct, d0 = CTYPE[coll.type.dtype], coll.type.layout.dim if coll.type.layout.sliced else 0
        off = self.offset(coll.type) if coll.type.layout.sliced else "int64_t(0)"
        g = self.gdims(y.type)
        self.emit(f"  const int64_t base = r.begin * {_prod(ly[1:])}, count = r.size() * {_prod(ly[1:])};")
        self.emit(f"  auto compute = [&, base](int64_t gb0, int64_t ge0, const {COMPUTE[coll.type.dtype]}* red) {{")
        self.emit("    const int64_t gb = gb0 + base, ge = ge0 + base;")
        exprs = {c.name: self._scalars_out(c.expr, c.name) for c in f.computes if not _is_rows(c)}
        self._chunk_prologue(coll, d0, off, f"off_{f.name}")
        self._chunk_loop(f, exprs, self.overlap_stored, d0)
        self.emit("  };")
        targets = (f"{{coconet::gather_target(v_{f.gather.name} + base, count)}}" if f.gather is not None else "{}")
        op = REDUCE_OP[coll.expr.attr("op")]
        shape = (f"r.size() * {_prod(g[1:d0])}, {g[d0]}, {_prod(g[d0 + 1:])}" if coll.type.layout.sliced
                 else "1, count, 1")
        start = "start_fused_rs_compute_ag" if coll.expr.op == "reducescatter" else "start_fused_allreduce_compute"
        shape_arg = f"coconet::Shape3{{{shape}}}, " if coll.expr.op == "reducescatter" else ""
        extra = f", {targets}" if coll.expr.op == "reducescatter" else ""
        self.emit(f"  return coconet::{start}<{ct}>({op}, coconet::Segments<const {ct}>::one(v_{y.name} + base, count), "
                  f"{shape_arg}comm, channel, coconet::fused_chunk_elems(), compute{extra});")
        self.emit("});")

    def _fused_buffers(self, plan: FusedPlan, outputs: dict, in_place: dict, d0: int, o: str) -> list:
        """Where the fused stages' values live; returns the ones that must be stored."""
        gathered = plan.gather.expr.args[0].name if plan.gather is not None else None
        later = _read_by_later_phase(plan.computes)
        stored = [c for c in plan.computes if self._needed_after(c.name, plan.members) or c.name in later]
        for c in plan.computes:
            self._comment(c)
            self.types[c.name] = c.type
            if c.name == gathered and d0 == 0:
                self.emit(f"{CTYPE[c.type.dtype]}* const v_{c.name} = v_{plan.gather.name} + {o};"
                          "  // computed in place inside the gathered result")
                stored.append(c)
            elif c in stored:
                self._place(c, outputs.get(c.name), in_place.get(c.name))
            else:
                self.emit(f"// ({c.name} lives in a register of the fused loop)")
        return stored

    def _chunk_prologue(self, coll: Stage, d: int, off: str, o: str) -> None:
        """[gb, ge) lies in one row of the [outer, n, inner] view; lo is its first local index."""
        g = self.gdims(coll.type)
        row, inner_d = _prod(g[d:]), _prod(g[d + 1:])
        mine = self.ldims(coll.type)[d] if coll.type.layout.sliced else g[d]
        self.emit(f"  const int64_t row_ = gb / ({row});")
        self.emit(f"  const int64_t lo = row_ * {mine} * {inner_d} + (gb - row_ * ({row})) - {o}, "
                  "hi = lo + (ge - gb);")
        self.emit(f"  const int64_t off = {off};")
        self.emit("  (void)off; (void)hi;")

    def _chunk_loop(self, plan: FusedPlan, exprs: dict, stored: list, d0: int) -> None:
        """The callback's loops: runs of pointwise stages share one loop over the chunk; a
        layernorm is a loop over the chunk's rows."""
        for phase in _phases(plan.computes):
            if phase[0].expr.op == "layernorm" if isinstance(phase[0].expr, Op) else False:
                self._chunk_rows(plan, phase[0], stored, d0)
            else:
                self._chunk_pointwise(plan, phase, exprs, stored, d0)

    def _chunk_rows(self, plan: FusedPlan, s: Stage, stored: list, d0: int) -> None:
        x, g, b, eps = s.expr.args
        coll, C, T = plan.collective, COMPUTE[s.type.dtype], CTYPE[s.type.dtype]
        H = self.ldims(s.type)[-1]

        def X(idx: str) -> str:
            return f"red[{idx} - lo]" if x.name == coll.name else f"coconet::to_compute(v_{x.name}[{idx}])"
        eps_s = literal(eps.value, "f64") if isinstance(eps, Const) else f"double(coconet::to_compute(v_{eps.name}[0]))"
        gathered = plan.gather is not None and plan.gather.expr.args[0].name == s.name
        self.emit(f"  for (int64_t row = lo; row < hi; row += {H}) {{  // layernorm {s.name}, row by row")
        self.emit(f"    {C} mean = 0, var = 0;")
        self.emit(f"    for (int64_t j = 0; j < {H}; ++j) mean += {X('row + j')};")
        self.emit(f"    mean /= static_cast<{C}>({H});")
        self.emit(f"    for (int64_t j = 0; j < {H}; ++j) {{ const {C} d = {X('row + j')} - mean; var += d * d; }}")
        self.emit(f"    var /= static_cast<{C}>({H});")
        self.emit(f"    const {C} inv = {C}(1) / std::sqrt(var + static_cast<{C}>({eps_s}));")
        self.emit(f"    for (int64_t j = 0; j < {H}; ++j) {{")
        self.emit(f"      const {C} y = coconet::round_to<{T}>(({X('row + j')} - mean) * inv * "
                  f"coconet::to_compute(v_{g.name}[j]) + coconet::to_compute(v_{b.name}[j]));")
        if s in stored:
            self.emit(f"      v_{s.name}[row + j] = coconet::from_compute<{T}>(y);")
        if gathered and d0 != 0:
            self.emit(f"      v_{plan.gather.name}[gb + (row + j - lo)] = coconet::from_compute<{T}>(y);")
        self.emit("    }")
        self.emit("  }")

    def _chunk_pointwise(self, plan: FusedPlan, phase: list, exprs: dict, stored: list, d0: int) -> None:
        coll, t0 = plan.collective, phase[0].type
        exprs = {c.name: exprs[c.name] for c in phase}
        inside = {coll.name} | {c.name for c in plan.computes}
        operands = [r for e in exprs.values() for r in walk(e) if isinstance(r, Ref) and r.name not in inside]
        coords = any(self._access(r, t0) is None for r in operands) or (
            any(isinstance(x, Op) and x.op == "dropout" for e in exprs.values() for x in walk(e))
            and self._gidx_simple(t0) is None)
        if coords:
            for k, dim in enumerate(self.ldims(t0)):
                self.emit(f"  const int64_t L{k} = {dim};")
        segmented = any(r.name in self.scattered for r in operands)
        if segmented:
            self.emit("  for (const coconet::Piece& pc : coconet::pieces(seg_starts, gb, ge)) {")
            self.emit("    const size_t s = pc.segment;")
            self.emit("    const int64_t a0 = pc.at, b0 = pc.offset;")
            self.emit("    COCONET_IVDEP")
            self.emit("    for (int64_t j = 0; j < pc.size; ++j) {")
            self.emit("      const int64_t i = lo + b0 + j;")
        else:
            self.emit("  COCONET_IVDEP")
            self.emit("    for (int64_t i = lo; i < hi; ++i) {")
        if coords:
            self._coords(t0)
        self._chunk_body(plan, phase, exprs, stored, d0)
        self.emit("    }")
        if segmented:
            self.emit("  }")

    def _chunk_body(self, plan: FusedPlan, phase: list, exprs: dict, stored: list, d0: int) -> None:
        gathered = plan.gather.expr.args[0].name if plan.gather is not None else None
        regs = {plan.collective.name: "red[i - lo]"}
        for c in phase:
            ct, base = CTYPE[c.type.dtype], self._loader(c.type)
            load = lambda r, base=base: regs.get(r.name) or base(r)  # noqa: E731
            body = emit(exprs[c.name], load, self._extra(c.type, load))
            self.emit(f"      const {COMPUTE[c.type.dtype]} x_{c.name} = coconet::round_to<{ct}>({body});")
            regs[c.name] = f"x_{c.name}"
            if c in stored:
                self.emit(f"      v_{c.name}[i] = coconet::from_compute<{ct}>(x_{c.name});")
            if c.name == gathered and d0 != 0:  # this rank's part, at its global index
                self.emit(f"      v_{plan.gather.name}[gb + (i - lo)] = coconet::from_compute<{ct}>(x_{c.name});")

    def _fused_call(self, plan: FusedPlan, x: str) -> None:
        coll = plan.collective
        xt, ct = self.types[x], CTYPE[coll.type.dtype]
        src = (f"coconet::Segments<const {ct}>(p_{x})" if x in self.scattered
               else f"coconet::Segments<const {ct}>::one(v_{x}, {_prod(self.ldims(xt))})")
        op, fn = REDUCE_OP[coll.expr.attr("op")], f"compute_{plan.name}"
        chunk, progress = "coconet::fused_chunk_elems()", ""
        if plan.rows is not None:  # chunks and progress pieces of whole rows
            chunk = f"coconet::round_up(coconet::fused_chunk_elems(), {plan.rows})"
            progress = f", coconet::round_up(coconet::kProgressElems, {plan.rows})"
        if coll.expr.op != "reducescatter":
            self.emit(f"coconet::fused_allreduce_compute<{ct}>({op}, {src}, comm, {chunk}, {fn}{progress});")
            return
        targets = (f"{{coconet::gather_target(v_{plan.gather.name}, {_prod(self.gdims(plan.gather.type))})}}"
                   if plan.gather is not None else "{}")
        self.emit(f"coconet::fused_rs_compute_ag<{ct}>({op}, {src}, "
                  f"coconet::Shape3{{{self._shape3(xt, coll.type.layout.dim)}}}, comm, "
                  f"{chunk}, {fn}, {targets}{progress});")

    def _needed_after(self, name: str, members: tuple[str, ...]) -> bool:
        """Is a fused stage's value read outside its fusion (so it must be stored)?"""
        return (any(u.name not in members for u in self.p.users(name))
                or any(s == name for _, s in self.p.outputs) or any(s == name for _, s in self.p.updates))

    # --- overlap ----------------------------------------------------------------------------
    def _overlap(self, plan: OverlapPlan, outputs: dict, in_place: dict) -> None:
        """The matmul in chunks of rows (dim 0 of its result); each chunk's collective starts
        (non-blocking, overlap.h) as soon as the chunk is computed, while the next computes."""
        y, c = plan.producer, plan.collective
        self.emit(f"// overlap {y.name} -> {c.name}: {plan.chunks} chunks along dim 0 of {y.name}")
        a = self._materialize(y.expr.args[0], y.name)
        b = self._materialize(y.expr.args[1], y.name)
        self._comment(y)
        self._place(y, outputs.get(y.name), in_place.get(y.name))
        if plan.fused is None:
            self._comment(c)
            self._place(c, outputs.get(c.name), in_place.get(c.name))
        else:
            self._overlap_fused_buffers(plan.fused, outputs, in_place)
        ct = CTYPE[y.type.dtype]
        ly, la, lb = (self.ldims(self.types[n]) for n in (y.name, a, b))
        lc = self.ldims(c.type)
        rows, per_row = ly[0], _prod(ly[1:-1])
        chunk = f"coconet::chunk_range({rows}, {plan.chunks}, i)"
        self.emit(f"coconet::overlap({plan.chunks}, [&](int i) {{")
        self.emit(f"  const coconet::Range r = {chunk};")
        self.emit(f"  coconet::matmul<{ct}>(v_{a} + r.begin * {per_row} * {la[-1]}, v_{b}, "
                  f"v_{y.name} + r.begin * {_prod(ly[1:])}, r.size() * {per_row}, {la[-1]}, {lb[1]});")
        self.emit("}, [&](int i, int channel) {")
        self.emit(f"  const coconet::Range r = {chunk};")
        if plan.fused is not None:
            return self._overlap_fused_task(plan, ly)
        src, dst = f"v_{y.name} + r.begin * {_prod(ly[1:])}", f"v_{c.name} + r.begin * {_prod(lc[1:])}"
        op = REDUCE_OP[c.expr.attr("op")]
        if c.expr.op == "allreduce":
            self.emit(f"  return coconet::start_allreduce({op}, {src}, {dst}, r.size() * {_prod(ly[1:])}, comm, channel);")
        else:
            g, d = self.gdims(y.type), c.type.layout.dim
            self.emit(f"  return coconet::start_reduce_scatter({op}, {src}, {dst}, r.size() * {_prod(g[1:d])}, "
                      f"{g[d]}, {_prod(g[d + 1:])}, comm, channel);")
        self.emit("});")



@dataclass
class FusedPlan:
    name: str
    members: tuple[str, ...]
    collective: Stage  # the reducescatter (or allreduce)
    computes: list[Stage]  # pointwise stages on its chunks, in order
    gather: Stage | None  # the allgather of one computed value
    rows: str | None = None  # a layernorm is computed per chunk: chunks hold whole rows of this size


def fused_plan(p: Program, fusion, scattered: set[str], low, rows_ok: bool = True) -> FusedPlan | None:
    """How a fusion runs as one fused collective, or None when this backend runs it stage by
    stage. It needs a reducescatter along dim 0 (or an allreduce). The pointwise stages at the
    head of the fusion that run over the reduced elements are computed on each chunk as it
    arrives; the gather is part of the fused collective when it gathers one of them. Stages that
    need all chunks first (a norm, a segment_norm) and what follows run after it."""
    stages = [p.stage(n) for n in fusion.stages]
    colls = [s for s in stages if s.kind == "collective"]
    first = next((s for s in colls if s.expr.op in ("reducescatter", "allreduce")), None)
    if first is None:
        return None
    gather = next((s for s in colls if s.expr.op == "allgather"), None)
    computes: list[Stage] = []
    inside = {first.name: None}  # ordered
    rows = None
    for s in stages:
        if s.kind == "collective":
            continue
        if rows_ok and _row_stage(s, first, inside, scattered, low):
            rows = low.gdims(first.type)[-1]
        elif not _chunkable_stage(s, first, inside, scattered, low):
            break
        computes.append(s)
        inside[s.name] = None
    if not computes:
        return None
    if gather is not None and gather.expr.args[0].name not in inside:
        gather = None
    done = tuple(inside) + ((gather.name,) if gather is not None else ())
    return FusedPlan(fusion.name, done, first, computes, gather, rows)


def _row_stage(s: Stage, first: Stage, inside: dict, scattered: set[str], low) -> bool:
    """layernorm(x, gamma, beta, eps) of a value of the fused chunk, over its last dim: with
    chunks of whole rows, each chunk's rows are normalized as soon as they are computed."""
    e = s.expr
    if not (isinstance(e, Op) and e.op == "layernorm" and s.type == first.type and first.type.ndim >= 1):
        return False
    x, g, b, eps = e.args
    return (isinstance(x, Ref) and x.name in inside and not scattered & set(_reads(e))
            and all(isinstance(a, Ref) and a.name not in inside for a in (g, b))
            and (isinstance(eps, Const) or (isinstance(eps, Ref) and eps.name not in inside)))


def _chunkable_stage(s: Stage, first: Stage, inside: set[str], scattered: set[str], low) -> bool:
    if s.type.shape != first.type.shape or s.type.layout != first.type.layout:
        return False
    for n in walk(s.expr):
        if isinstance(n, Op) and n.op not in POINTWISE:
            return False
        if isinstance(n, Ref) and n.name in scattered and s.type.ndim != 1:
            return False
        if isinstance(n, Ref) and n.name not in scattered and (
                low.p.stage(n.name) is not None and n.name not in inside and
                low.p.fusion_of(n.name) is low.p.fusion_of(s.name)):
            return False  # reads a fusion member that runs after the fused collective
        if isinstance(n, Ref) and n.name in inside and low._access(n, s.type) != "i":
            return False
    return True

def _is_rows(s: Stage) -> bool:
    return isinstance(s.expr, Op) and s.expr.op == "layernorm"


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
        out |= {n for c in phase for n in _reads(c.expr)} & seen
        seen |= {c.name for c in phase}
    return out


@dataclass
class OverlapPlan:
    producer: Stage  # a matmul
    collective: Stage  # the allreduce or reducescatter that reads it
    chunks: int
    fused: FusedPlan | None = None  # when the consumer is a fusion: each chunk's fused collective


def overlap_plan(p: Program, o) -> OverlapPlan | None:
    """overlap() as generated code: the matmul chunked along dim 0 of its result (a batch or
    row dim), each chunk's allreduce/reducescatter started as soon as it is ready. None (run one
    after the other) for other dims or collectives."""
    y = p.stage(o.producer)
    fusion = next((f for f in p.fusions if f.name == o.consumer), None)
    names = fusion.stages if fusion else (o.consumer,)
    coll = next((p.stage(n) for n in names if p.stage(n).kind == "collective"), None)
    if coll is None or o.dim != 0 or y.type.ndim < 2 or y.type.layout.sliced:
        return None
    if coll.expr.op not in ("allreduce", "reducescatter") or not isinstance(coll.expr.args[0], Ref):
        return None
    if coll.expr.op == "reducescatter" and coll.type.layout.dim == 0:
        return None
    return OverlapPlan(y, coll, o.chunks)


def execution_order(p: Program) -> list[Stage]:
    """The stages in the order the generated code runs them: a collective that is not fused
    waits until just before its first reader (or the end), so that pointwise stages it would
    separate can share one loop. Data dependencies are kept."""
    order: list[Stage] = []
    pending: list[Stage] = []
    for s in p.stages:
        if s.kind == "collective" and p.fusion_of(s.name) is None:
            pending.append(s)
            continue
        needed = _pending_needed(pending, _reads(s.expr))
        order += needed
        pending = [x for x in pending if x not in needed]
        order.append(s)
    return order + pending


def _pending_needed(pending: list[Stage], reads: set[str]) -> list[Stage]:
    need = set(reads)
    for x in reversed(pending):
        if x.name in need:
            need |= _reads(x.expr)
    return [x for x in pending if x.name in need]


