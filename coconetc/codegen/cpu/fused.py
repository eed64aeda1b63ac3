"""Fused collectives of the plan as C++ (fused.h): each chunk of this rank's part is reduced,
the phases computed on it (a callback), the gathered values written at their place. The plan
says what each chunk computes; this lays it out."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from coconetc.codegen import pointwise
from coconetc.codegen.base import Writer, prod as _prod
from coconetc.codegen.cpu.loops import CpuLoops
from coconetc.codegen.emit import COMPUTE, CTYPE, REDUCE_OP
from coconetc.codegen.indexing import Indexing
from coconetc.codegen.pointwise import layernorm_eps, layernorm_row
from coconetc.codegen.reductions import reduction
from coconetc.ir.nodes import Op, Ref, walk
from coconetc.plan.fusion_legality import ROW_VALUE
from coconetc.plan.units import Collective, Fused, GatherAfter, Item, Loop, Phase, Reduce, Unit


class CpuFused:
    """unit: renders the units that wait for every chunk (the renderer's dispatch)."""

    def __init__(self, w: Writer, idx: Indexing, loops: CpuLoops, unit: Callable[[Unit], None]):
        self.w = w
        self.idx, self.loops, self.unit = idx, loops, unit

    def render_fused(self, u: Fused) -> None:
        """One fused collective: each chunk of this rank's slice is reduced (fused.h), the
        phases run on it at once, and gathered values are written straight into their place
        in the full-size result, which the collective fills in from the others. Then what
        waits for all chunks."""
        ct = COMPUTE[u.type.dtype]
        self.partials_begin(u)
        self.w.emit(f"const int64_t off_{u.name} = {self.fused_offset(u)};")
        self.w.emit(f"auto compute_{u.name} = [&](int64_t gb, int64_t ge, const {ct}* red) {{")
        self.chunk(u, f"off_{u.name}")
        self.w.emit("};")
        self._fused_call(u)
        self.after_chunks(u)

    def partials_begin(self, u: Fused) -> None:
        """The accumulators (pa_<name>) of the reductions that the chunks accumulate, before the
        first chunk (an overlap's: before its first block)."""
        for r in u.accumulated("cpu"):
            red = reduction(r.op)
            n = "seg_starts.size() - 1" if red.per_segment else "1"
            self.w.emit(f"std::vector<double> pa_{r.dst}({n}, {red.identity});")

    def after_chunks(self, u: Fused) -> None:
        """What waits for every chunk (an overlap's: of every block): the partial results
        combined across the group, then phase B (its loops piece by piece with the closing
        allgather where the plan says so)."""
        partials = u.accumulated("cpu")
        if partials:
            self._combine(u, partials)
        rest = [a for a in u.after if a not in partials]  # phase B
        pieces = u.on("cpu").gather_after == GatherAfter.PER_PIECE
        loops = [a for a in rest[len(rest) - 1 - u.piece_loops:-1] if isinstance(a, Loop)] if pieces else []
        for a in rest[:len(rest) - len(loops) - 1] if pieces else rest:
            self.unit(a)
        if pieces:
            coll = rest[-1]
            assert isinstance(coll, Collective) and coll.dst == u.gather_after and loops
            self._gather_pieces(u, loops, coll)

    def _gather_pieces(self, u: Fused, loops: list[Loop], coll: Collective) -> None:
        """Phase B's loops over this rank's slice (Fused.gather_after) in the reduce-scatter's
        chunks, each chunk of the gathered value sent to the other ranks as soon as it is
        computed (coconet::compute_ag, fused.h): the loops' items as phases of a chunk callback."""
        b = replace(u, name=f"{u.name}_b", collective="", phases=tuple(Phase("pointwise", lp.items) for lp in loops),
                    lets=tuple(k for lp in loops for k in lp.lets), gather="", gathered="", partials=())
        loop = loops[-1]
        ct = CTYPE[self.w.types[coll.src].dtype]
        self.w.emit(f"const int64_t off_{b.name} = {self.fused_offset(b)};")
        self.w.emit(f"auto compute_{b.name} = [&](int64_t gb, int64_t ge) {{  // {loop.items[-1].name}, "
                    f"then its piece of {coll.dst} to every rank")
        self.chunk(b, f"off_{b.name}")
        if coll.into:
            self.w.emit(f"  coconet::copy_in(v_{coll.src} + lo, p_{coll.into}, gb, ge);")
            target = f"coconet::gather_target(p_{coll.into})"
        else:
            if self.w.plan.buffer(coll.src).kind != "view":  # a view: computed in its place already
                self.w.emit(f"  std::copy(v_{coll.src} + lo, v_{coll.src} + hi, v_{coll.dst} + gb);")
            target = f"coconet::gather_target(v_{coll.dst}, {_prod(self.w.gdims(self.w.types[coll.dst]))})"
        self.w.emit("};")
        xt = self.w.types[coll.src]
        chunk, _ = self.chunk_sizes(u)
        self.w.emit(f"coconet::compute_ag<{ct}>(coconet::Shape3{{{self.w.shape3(xt, 0)}}}, comm, {chunk}, "
                    f"compute_{b.name}, {{{target}}});")

    def _accumulate(self, u: Fused, r: Reduce) -> None:
        """Adds the chunk's part of reduction r (its sum, or sum of squares, per segment for a
        segment_norm) to pa_<dst>: the chunk's values are the reduced chunk or stored at once."""
        t = self.w.types[r.src]
        # the chunk's first element: in the reduced chunk, in a value over the slice, or at its
        # global index in a replicated parameter
        first = "red" if r.src == u.collective else f"v_{r.src} + lo" if t.layout.sliced else f"v_{r.src} + gb"
        red = reduction(r.op)
        self.w.emit(f"  {{  // {r.dst}: partial {r.op}({r.src}) of the chunk")
        scattered = r.src in self.w.scattered and r.src != u.collective  # a parameter still in its segments
        if scattered or red.per_segment:  # piece by piece of the segments
            self.w.emit("    for (const coconet::Piece& pc : coconet::pieces(seg_starts, gb, ge))")
            at = f"p_{r.src}.ptrs[pc.segment] + pc.at" if scattered else f"{first} + pc.offset"
            part, ind = f"coconet::{red.partial}({at}, pc.size)", "      "
        else:
            part, ind = f"coconet::{red.partial}({first}, hi - lo)", "    "
        acc = f"pa_{r.dst}[{'pc.segment' if red.per_segment else '0'}]"
        self.w.emit(f"{ind}{red.accumulate(acc, part)};")
        self.w.emit("  }")

    def _combine(self, u: Fused, partials: list[Reduce]) -> None:
        """One small all-reduce of every partial result, then each reduction finished. The
        partial results of max(x), min(x) are combined apart, in one more all-reduce (max of
        the maxima and of the negated minima, NaN propagating: coconet::reduce_extremes, across a batch's calls too)."""
        extremes = [r for r in partials if reduction(r.op).extreme]
        partials = [r for r in partials if r not in extremes]
        if extremes:
            self._combine_extremes(u, extremes)
        if not partials:
            return
        self.w.emit(f"{{  // {u.name}: the partial results of {', '.join(r.dst for r in partials)}, summed across ranks")
        # the whole-slice reductions first: they are summed across the calls of a batch too
        # (batch.h), each segment's norm only across ranks
        partials = sorted(partials, key=lambda r: reduction(r.op).per_segment)
        whole = [r for r in partials if not reduction(r.op).per_segment]
        self.w.emit("  std::vector<double> parts;")
        for r in partials:
            self.w.emit(f"  parts.insert(parts.end(), pa_{r.dst}.begin(), pa_{r.dst}.end());")
        if whole:
            self.w.emit(f"  coconet::reduce_partials(parts.data(), {len(whole)}, true, comm);")
        if len(whole) < len(partials):
            self.w.emit(f"  coconet::allreduce_sum(parts.data() + {len(whole)}, "
                        f"static_cast<int64_t>(parts.size()) - {len(whole)}, comm);")
        self.w.emit("  size_t at = 0;")
        for r in partials:
            t = self.w.types[r.dst]
            T, C = CTYPE[t.dtype], COMPUTE[t.dtype]
            if reduction(r.op).per_segment:
                n = _prod(self.w.ldims(t))
                self.w.emit(f"  coconet::segment_norm_finish(parts.data() + at, v_{r.dst}, {n}, {self.w.offset(t)}, "
                            "seg_starts);")
            else:
                self.w.emit(f"  v_{r.dst}[0] = coconet::from_compute<{T}>(static_cast<{C}>("
                            f"{reduction(r.op).finished('parts[at]')}));")
            self.w.emit(f"  at += pa_{r.dst}.size();")
        self.w.emit("  (void)at;")
        self.w.emit("}")

    def _combine_extremes(self, u: Fused, extremes: list[Reduce]) -> None:
        """The max/min partial results across ranks (a min as the max of its negation), each
        written to its 0-d result."""
        sign = {r.dst: reduction(r.op).sign for r in extremes}
        self.w.emit(f"{{  // {u.name}: the partial results of {', '.join(r.dst for r in extremes)}, "
                    "their largest/smallest across ranks")
        self.w.emit(f"  double ext[{len(extremes)}] = {{{', '.join(f'{sign[r.dst]}pa_{r.dst}[0]' for r in extremes)}}};")
        self.w.emit(f"  coconet::reduce_extremes(ext, {len(extremes)}, true, comm);  // and across a batch's calls")
        for i, r in enumerate(extremes):
            t = self.w.types[r.dst]
            self.w.emit(f"  v_{r.dst}[0] = coconet::from_compute<{CTYPE[t.dtype]}>("
                        f"static_cast<{COMPUTE[t.dtype]}>({reduction(r.op).finished(f'{sign[r.dst]}ext[{i}]')}));")
        self.w.emit("}")

    def fused_offset(self, u: Fused) -> str:
        t = u.type
        d0 = u.dim
        off = self.w.offset(t) if t.layout.sliced else "int64_t(0)"
        return f"{off} * {_prod(self.w.gdims(t)[d0 + 1:])}"

    def chunk(self, u: Fused, o: str) -> None:
        """The callback's body: the Lets, where [gb, ge) lies, the phases' loops (what it reads
        of the enclosing function in locals, so that its loops vectorize: Writer.closure_locals)."""
        with self.w.saved_consts(), self.w.closure_locals("  "):
            self.loops.render_lets(u.lets)  # locals of the callback (in registers; not captured)
            t = u.type
            d = u.dim
            g = self.w.gdims(t)
            row, inner_d = _prod(g[d:]), _prod(g[d + 1:])
            mine = self.w.ldims(t)[d] if t.layout.sliced else g[d]
            off = self.w.offset(t) if t.layout.sliced else "int64_t(0)"
            self.w.emit(f"  const int64_t row_ = gb / ({row});")
            self.w.emit(f"  const int64_t lo = row_ * {mine} * {inner_d} + (gb - row_ * ({row})) - {o}, "
                      "hi = lo + (ge - gb);")
            self.w.emit(f"  const int64_t off = {off};")
            self.w.emit("  (void)off; (void)hi;")

            def phases() -> None:
                for ph in u.phases:
                    if ph.kind == "rows":
                        self._chunk_rows(u, ph.items[0], d)
                    else:
                        self._chunk_pointwise(u, ph, d)
                for r in u.accumulated("cpu"):  # the chunk's part of each reduction (Fused.partials)
                    self._accumulate(u, r)
            self.idx.unswitch_dropout("  ", phases)

    def _chunk_rows(self, u: Fused, item: Item, d0: int) -> None:
        assert isinstance(item.expr, Op)
        if item.expr.op != "layernorm":
            self._chunk_rows_dx(u, item, d0)
            return
        x, g, b, eps = item.expr.args
        t = self.w.types[item.name]
        C, T = COMPUTE[t.dtype], CTYPE[t.dtype]
        H = self.w.ldims(t)[-1]
        assert isinstance(x, Ref) and isinstance(g, Ref) and isinstance(b, Ref)

        def X(idx: str) -> str:
            return f"red[{idx} - lo]" if x.name == u.collective else f"coconet::to_compute(v_{x.name}[{idx}])"
        self.w.emit(f"  for (int64_t row = lo; row < hi; row += {H}) {{  // layernorm {item.name}, row by row")
        self.w.emit(f"    {layernorm_row(C, H, X('row + j'), g.name, b.name, layernorm_eps(eps))}")
        self.w.emit(f"      const {C} y = coconet::round_to<{T}>(v);")
        if item.store:
            self.w.emit(f"      v_{item.name}[row + j] = coconet::from_compute<{T}>(y);")
        if u.gathered == item.name and d0 != 0:
            self.w.emit(f"      v_{u.gather}[gb + (row + j - lo)] = coconet::from_compute<{T}>(y);")
        self.w.emit("    });")
        self.w.emit("  }")

    def _chunk_rows_dx(self, u: Fused, item: Item, d0: int) -> None:
        """A row-wise phase whose stage is a pointwise expression of one layernorm_dx (plan/
        fusion_legality.row_op): each row's input gradient (grad.h layernorm_dx_row_by), rounded
        to the storage type as the library call's result, then the expression around it at each
        element of the row (codegen/pointwise.py values, as a pointwise phase's)."""
        r = pointwise.RowDx.of(item.name, item.expr, self.w)
        C, c = r.C, u.collective
        self.w.emit(f"  for (int64_t row = lo; row < hi; row += {r.H}) {{  // layernorm_dx in {item.name}, row by row")
        self.w.emit(f"    coconet::layernorm_dx_row_by([&](int64_t j) {{ return {C}({r.at(r.x, 'row + j', c)}); }}, "
                    f"v_{r.gamma.name}, [&](int64_t j) {{ return {C}({r.at(r.g, 'row + j', c)}); }}, "
                    f"static_cast<{C}>({r.eps}), {r.H}, [&](int64_t j, {C} v) {{")
        for line in r.element("j"):
            self.w.emit(f"      {line}")
        stores = [f"v_{item.name}[i]"] if item.store else []
        if u.gathered == item.name and d0 != 0:
            stores.append(f"v_{u.gather}[gb + (i - lo)]")
        read = lambda name: (self.w.types[name], self.idx.loader(self.w.types[name]))  # noqa: E731
        for line in pointwise.values(self.idx, [(item.name, r.rest, item.store)], {ROW_VALUE: "dx_", u.collective: "red[i - lo]"},
                                     read, lambda name: stores):
            self.w.emit(f"      {line}")
        self.w.emit("    });")
        self.w.emit("  }")

    def _chunk_pointwise(self, u: Fused, ph: Phase, d0: int) -> None:
        t0 = self.w.types[ph.items[0].name]
        inside = {u.collective} | {i.name for p in u.phases for i in p.items}
        operands = [r for i in ph.items for r in walk(i.expr) if isinstance(r, Ref) and r.name not in inside]
        coords = self.idx.needs_coords(t0, [i.expr for i in ph.items], inside)
        if coords:
            for line in self.idx.extents(t0):
                self.w.emit(f"  {line}")
        kept = any(i.name == u.collective and i.store for i in ph.items)
        if kept:  # the reduced chunk kept for phase B: one streaming copy, not a store per element
            self.w.emit(f"  coconet::keep_chunk(v_{u.collective} + lo, red, hi - lo);")
        segmented = any(r.name in self.w.scattered for r in operands)
        if segmented:
            self.w.emit("  for (const coconet::Piece& pc : coconet::pieces(seg_starts, gb, ge)) {")
            self.w.emit("    const size_t s = pc.segment;")
            self.w.emit("    const int64_t a0 = pc.at, b0 = pc.offset;")
            self.w.emit("    COCONET_IVDEP")
            self.w.emit("    for (int64_t j = 0; j < pc.size; ++j) {")
            self.w.emit("      const int64_t i = lo + b0 + j;")
        elif coords and t0.ndim > 0:  # runs along the last dim: no division per element
            self.loops.open_row_runs(t0, "lo", "hi")
            self._chunk_body(u, ph, d0)
            self.w.emit("    }")
            self.w.emit("  }")
            return
        else:
            self.w.emit("  COCONET_IVDEP")
            self.w.emit("    for (int64_t i = lo; i < hi; ++i) {")
        if coords:
            self.loops.coords(t0)
        self._chunk_body(u, ph, d0)
        self.w.emit("    }")
        if segmented:
            self.w.emit("  }")

    def _chunk_body(self, u: Fused, ph: Phase, d0: int) -> None:
        """The phase's values of element i (codegen/pointwise.py), each over its own type, the
        reduced value read from the chunk (red)."""
        stored = {i.name for i in ph.items if i.store}

        def stores(name: str) -> list[str]:
            out = [f"v_{name}[i]"] if name in stored and name != u.collective else []  # (kept: keep_chunk)
            if name == u.gathered and d0 != 0:  # this rank's part, at its global index
                out.append(f"v_{u.gather}[gb + (i - lo)]")
            return out
        items = [(i.name, i.expr, i.store) for i in ph.items]
        read = lambda name: (self.w.types[name], self.idx.loader(self.w.types[name]))  # noqa: E731
        for line in pointwise.values(self.idx, items, {u.collective: "red[i - lo]"}, read, stores):
            self.w.emit(f"      {line}")

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
            rows = self.w.gdims(u.type)[-1]
            chunk = f"coconet::round_up({chunk}, {rows})"
            if chunking.progress_rows:  # and progress pieces of whole rows
                progress = f", coconet::round_up(coconet::kProgressElems, {rows})"
        return chunk, progress

    def _fused_call(self, u: Fused) -> None:
        xt, ct = self.w.types[u.src], CTYPE[u.type.dtype]
        src = (f"coconet::Segments<const {ct}>(p_{u.src})" if u.src in self.w.scattered
               else f"coconet::Segments<const {ct}>::one(v_{u.src}, {_prod(self.w.ldims(xt))})")
        op, fn = REDUCE_OP[u.reduce], f"compute_{u.name}"
        chunk, progress = self.chunk_sizes(u)
        if u.op != "reducescatter":
            self.w.emit(f"coconet::fused_allreduce_compute<{ct}>({op}, {src}, comm, {chunk}, {fn}{progress});")
            return
        targets = (f"{{coconet::gather_target(v_{u.gather}, {_prod(self.w.gdims(self.w.types[u.gather]))})}}"
                   if u.gather else "{}")
        self.w.emit(f"coconet::fused_rs_compute_ag<{ct}>({op}, {src}, "
                  f"coconet::Shape3{{{self.w.shape3(xt, u.dim)}}}, comm, "
                  f"{chunk}, {fn}, {targets}{progress});")
