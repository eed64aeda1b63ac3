"""Fused collectives of the plan as C++ (fused.h): each chunk of this rank's part is reduced,
the phases computed on it (a callback), the gathered values written at their place. The plan
says what each chunk computes; this lays it out."""

from __future__ import annotations

from collections.abc import Callable

from coconetc.codegen.base import Part, Writer, prod as _prod
from coconetc.codegen.cpu.loops import CpuLoops
from coconetc.codegen.emit import COMPUTE, CTYPE, REDUCE_OP, emit
from coconetc.codegen.indexing import Indexing
from coconetc.codegen.pointwise import layernorm_eps, layernorm_row, layernorm_value
from coconetc.ir.nodes import Op, Ref, walk
from coconetc.plan.units import Fused, Item, Phase, Unit


class CpuFused(Part):
    """unit: renders the units that wait for every chunk (the renderer's dispatch)."""

    def __init__(self, w: Writer, idx: Indexing, loops: CpuLoops, unit: Callable[[Unit], None]):
        super().__init__(w)
        self.idx, self.loops, self.unit = idx, loops, unit

    def render_fused(self, u: Fused) -> None:
        """One fused collective: each chunk of this rank's slice is reduced (fused.h), the
        phases run on it at once, and gathered values are written straight into their place
        in the full-size result, which the collective fills in from the others. Then what
        waits for all chunks."""
        ct = COMPUTE[u.type.dtype]
        self.emit(f"const int64_t off_{u.name} = {self.fused_offset(u)};")
        self.emit(f"auto compute_{u.name} = [&](int64_t gb, int64_t ge, const {ct}* red) {{")
        self.chunk(u, f"off_{u.name}")
        self.emit("};")
        self._fused_call(u)
        for a in u.after:
            self.unit(a)

    def fused_offset(self, u: Fused) -> str:
        t = u.type
        d0 = t.layout.dim if t.layout.sliced else 0
        off = self.offset(t) if t.layout.sliced else "int64_t(0)"
        return f"{off} * {_prod(self.gdims(t)[d0 + 1:])}"

    def chunk(self, u: Fused, o: str) -> None:
        """The callback's body: the Lets, where [gb, ge) lies, the phases' loops."""
        saved = dict(self.consts)
        self.loops.render_lets(u.lets)  # locals of the callback (in registers; not captured)
        t = u.type
        d = t.layout.dim if t.layout.sliced else 0
        g = self.gdims(t)
        row, inner_d = _prod(g[d:]), _prod(g[d + 1:])
        mine = self.ldims(t)[d] if t.layout.sliced else g[d]
        off = self.offset(t) if t.layout.sliced else "int64_t(0)"
        self.emit(f"  const int64_t row_ = gb / ({row});")
        self.emit(f"  const int64_t lo = row_ * {mine} * {inner_d} + (gb - row_ * ({row})) - {o}, "
                  "hi = lo + (ge - gb);")
        self.emit(f"  const int64_t off = {off};")
        self.emit("  (void)off; (void)hi;")
        for ph in u.phases:
            if ph.kind == "rows":
                self._chunk_rows(u, ph.items[0], d)
            else:
                self._chunk_pointwise(u, ph, d)
        self.consts = saved

    def _chunk_rows(self, u: Fused, item: Item, d0: int) -> None:
        assert isinstance(item.expr, Op)
        x, g, b, eps = item.expr.args
        t = self.types[item.name]
        C, T = COMPUTE[t.dtype], CTYPE[t.dtype]
        H = self.ldims(t)[-1]
        assert isinstance(x, Ref) and isinstance(g, Ref) and isinstance(b, Ref)

        def X(idx: str) -> str:
            return f"red[{idx} - lo]" if x.name == u.collective else f"coconet::to_compute(v_{x.name}[{idx}])"
        self.emit(f"  for (int64_t row = lo; row < hi; row += {H}) {{  // layernorm {item.name}, row by row")
        for line in layernorm_row(C, H, X, "j", layernorm_eps(eps)):
            self.emit(f"    {line}")
        self.emit(f"      const {C} y = {layernorm_value(T, X('row + j'), g.name, b.name, 'j')};")
        if item.store:
            self.emit(f"      v_{item.name}[row + j] = coconet::from_compute<{T}>(y);")
        if u.gathered == item.name and d0 != 0:
            self.emit(f"      v_{u.gather}[gb + (row + j - lo)] = coconet::from_compute<{T}>(y);")
        self.emit("    }")
        self.emit("  }")

    def _chunk_pointwise(self, u: Fused, ph: Phase, d0: int) -> None:
        t0 = self.types[ph.items[0].name]
        inside = {u.collective} | {i.name for p in u.phases for i in p.items}
        operands = [r for i in ph.items for r in walk(i.expr) if isinstance(r, Ref) and r.name not in inside]
        coords = self.idx.needs_coords(t0, [i.expr for i in ph.items], inside)
        if coords:
            for line in self.idx.extents(t0):
                self.emit(f"  {line}")
        segmented = any(r.name in self.scattered for r in operands)
        if segmented:
            self.emit("  for (const coconet::Piece& pc : coconet::pieces(seg_starts, gb, ge)) {")
            self.emit("    const size_t s = pc.segment;")
            self.emit("    const int64_t a0 = pc.at, b0 = pc.offset;")
            self.emit("    COCONET_IVDEP")
            self.emit("    for (int64_t j = 0; j < pc.size; ++j) {")
            self.emit("      const int64_t i = lo + b0 + j;")
        elif coords and t0.ndim > 0:  # runs along the last dim: no division per element
            self.loops.open_row_runs(t0, "lo", "hi")
            self._chunk_body(u, ph, d0)
            self.emit("    }")
            self.emit("  }")
            return
        else:
            self.emit("  COCONET_IVDEP")
            self.emit("    for (int64_t i = lo; i < hi; ++i) {")
        if coords:
            self.loops.coords(t0)
        self._chunk_body(u, ph, d0)
        self.emit("    }")
        if segmented:
            self.emit("  }")

    def _chunk_body(self, u: Fused, ph: Phase, d0: int) -> None:
        regs = {u.collective: "red[i - lo]"}
        for item in ph.items:
            t = self.types[item.name]
            ct, base = CTYPE[t.dtype], self.idx.loader(t)
            load = lambda r, base=base: regs.get(r.name) or base(r)  # noqa: E731
            body = emit(item.expr, load, self.idx.extra(t, load))
            self.emit(f"      const {COMPUTE[t.dtype]} x_{item.name} = coconet::round_to<{ct}>({body});")
            regs[item.name] = f"x_{item.name}"
            if item.store:
                self.emit(f"      v_{item.name}[i] = coconet::from_compute<{ct}>(x_{item.name});")
            if item.name == u.gathered and d0 != 0:  # this rank's part, at its global index
                self.emit(f"      v_{u.gather}[gb + (i - lo)] = coconet::from_compute<{ct}>(x_{item.name});")

    def chunk_sizes(self, u: Fused, count: str = "") -> tuple[str, str]:
        """The chunk and progress-piece sizes the plan chose for the CPU (Fused.on("cpu")):
        the default chunk, or an overlap task's share of its `count` elements."""
        chunking = u.on("cpu").chunking
        if chunking.elems == "task":
            chunk = f"coconet::overlap_task_chunk_elems({count}, comm.size)"
        else:
            assert chunking.elems == "default", chunking
            chunk = "coconet::fused_chunk_elems()"
        progress = ""
        if chunking.rows is not None:  # chunks of whole rows
            rows = self.gdims(u.type)[-1]
            chunk = f"coconet::round_up({chunk}, {rows})"
            if chunking.progress_rows:  # and progress pieces of whole rows
                progress = f", coconet::round_up(coconet::kProgressElems, {rows})"
        return chunk, progress

    def _fused_call(self, u: Fused) -> None:
        xt, ct = self.types[u.src], CTYPE[u.type.dtype]
        src = (f"coconet::Segments<const {ct}>(p_{u.src})" if u.src in self.scattered
               else f"coconet::Segments<const {ct}>::one(v_{u.src}, {_prod(self.ldims(xt))})")
        op, fn = REDUCE_OP[u.reduce], f"compute_{u.name}"
        chunk, progress = self.chunk_sizes(u)
        if u.op != "reducescatter":
            self.emit(f"coconet::fused_allreduce_compute<{ct}>({op}, {src}, comm, {chunk}, {fn}{progress});")
            return
        targets = (f"{{coconet::gather_target(v_{u.gather}, {_prod(self.gdims(self.types[u.gather]))})}}"
                   if u.gather else "{}")
        self.emit(f"coconet::fused_rs_compute_ag<{ct}>({op}, {src}, "
                  f"coconet::Shape3{{{self.shape3(xt, u.type.layout.dim)}}}, comm, "
                  f"{chunk}, {fn}, {targets}{progress});")
