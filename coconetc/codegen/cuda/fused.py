"""Fused collectives of the CUDA renderer: chunks of this rank's part of the reduced value in a
pipeline (coconet::cuda::pipeline): chunk k+1 reduced on the comm stream while chunk k's
phases run as kernels (loops.py) on the call's stream, then chunk k gathered; or, where the run
time allows it, the whole unit as one kernel over NCCL symmetric memory (symmetric.cuh)."""

from __future__ import annotations

from collections.abc import Callable

from coconetc.codegen.base import Writer, prod as _prod
from coconetc.codegen.cuda.collectives import NCCL_OP
from coconetc.codegen.cuda.loops import CudaKernels, Kernel, Outs
from coconetc.codegen.cuda.notes import Notes
from coconetc.codegen.emit import COMPUTE, CTYPE
from coconetc.codegen.indexing import Indexing
from coconetc.codegen import pointwise
from coconetc.codegen.pointwise import layernorm_eps
from coconetc.codegen.reductions import reduction
from coconetc.ir.nodes import Expr, Op, Ref, walk
from coconetc.plan.fusion_legality import ROW_VALUE
from coconetc.plan.units import Algorithm, Fused, Reduce, Unit
from coconetc.plan.vectors import phase_width, symmetric_width


class CudaFused:
    """unit: renders the units that wait for every chunk (the renderer's dispatch)."""

    def __init__(self, w: Writer, idx: Indexing, kernels: CudaKernels, notes: Notes, unit: Callable[[Unit], None]):
        self.w = w
        self.idx, self.kernels, self.notes, self.unit = idx, kernels, notes, unit

    def render_fused(self, u: Fused, block: tuple[str, str] | None = None,
                     layout: dict[str, str] | None = None) -> None:
        """Chunks of this rank's part of the reduced value: the reduction of chunk k+1 on the
        comm stream while chunk k's kernel runs on the call's stream, then chunk k's gather on
        the comm stream after an event (coconet::cuda::pipeline). block: only the rows
        [row0, row1) of dim 0 (an overlap's chunk; the collective is sliced along d != 0, so they
        are one contiguous range of this rank's part; layout: the accumulators every block's
        chunks add to, made before the first block, partials_begin)."""
        t = u.type
        xt = self.w.types[u.src]
        ct = CTYPE[t.dtype]
        op = NCCL_OP[u.reduce]
        g = self.w.gdims(xt)
        d = u.dim
        outer = _prod(g[:d])
        if u.op == "reducescatter":
            n0, inner = g[d], _prod(g[d + 1:])
        else:  # an allreduce: one "slice" of everything
            n0, inner = _prod(g), "int64_t(1)"
        nm = u.name
        mine = _prod(self.w.ldims(t))
        direct = u.on("cuda").chunking.whole_alone  # one rank: each chunk's kernel reads the source itself
        if block is None:
            layout = self.partials_begin(u)
        assert layout is not None, u.name
        symmetric = block is None and self._symmetric_ok(u)
        if symmetric:
            self._fused_symmetric(u, ct, op, n0, inner, mine, layout)
        self.w.emit("{")
        rows_arg = self._fused_extent(u, block, outer, n0, inner, mine)
        self._chunk_size(u)
        self.w.emit(f"  const int64_t chunks_{nm} = (most_{nm} + ch_{nm} - 1) / ch_{nm};")
        nred = f"ch_{nm}"
        if direct:
            nred = f"nred_{nm}"
            self.w.emit(f"  const int64_t nred_{nm} = comm.size == 1 ? 0 : ch_{nm};  // one rank: no chunk buffers")
        self.w.emit(f"  {ct}* const red0_{nm} = coconet::cuda::scratch<{ct}>({self.w.site()}, {nred});")
        self.w.emit(f"  {ct}* const red1_{nm} = coconet::cuda::scratch<{ct}>({self.w.site()}, {nred});")
        self.notes.name(f"red0_{nm}", nred, f"red0 (chunk buffer 0 of fused {nm})")
        self.notes.name(f"red1_{nm}", nred, f"red1 (chunk buffer 1 of fused {nm})")
        self._reduce_to(u, ct, op, d, outer, n0, inner, rows_arg)
        self.w.emit(f"  auto compute = [&](int64_t k, {ct}* red) {{")
        self.w.emit(f"    const int64_t lo = base_{nm} + k * ch_{nm}, hi = std::min(lo + ch_{nm}, mine_{nm});")
        self.w.emit("    if (hi <= lo) return;")
        self._chunk_kernel(u)
        self._accumulate(u, layout, "red", "    ")
        self.w.emit("  };")
        if u.gather and d != 0:
            gg = self.w.gdims(self.w.types[u.gather])
            self.w.emit(f"  auto gather = [&](int64_t k) {{ coconet::cuda::gather_chunk<{ct}>(v_{u.gather}, "
                      f"{_prod(gg[:d])}, {gg[d]}, {_prod(gg[d + 1:])}, k, ch_{nm}, ctx{rows_arg}); }};")
        elif u.gather:
            self.w.emit(f"  auto gather = [&](int64_t k) {{ coconet::cuda::gather_chunk<{ct}>(v_{u.gather}, "
                      f"{self.w.gdims(self.w.types[u.gather])[0]}, {_prod(self.w.gdims(self.w.types[u.gather])[1:])}, "
                      f"k, ch_{nm}, ctx); }};")
        else:
            self.w.emit("  auto gather = [&](int64_t) {};")
        if u.store_reduced:  # the reduced value is kept
            self.w.emit(f"  auto keep = [&](int64_t k, {ct}* red) {{ const int64_t lo = base_{nm} + k * ch_{nm}; "
                      f"coconet::cuda::copy<{ct}>(red, v_{u.collective} + lo, std::min(ch_{nm}, mine_{nm} - lo), ctx); }};")
            self.w.emit("  auto compute_keep = [&](int64_t k, auto* red) { keep(k, red); compute(k, red); };")
            fn = "compute_keep"
        else:
            fn = "compute"
        if direct:
            self.w.emit(f"  auto source = [&](int64_t k) {{ return v_{u.src} + base_{nm} + k * ch_{nm}; }};"
                      "  // one rank: chunk k's own elements")
        self.w.emit(f"  coconet::cuda::pipeline<{ct}>(chunks_{nm}, red0_{nm}, red1_{nm}, ctx, {self.w.site() * 8}, "
                  f"reduce_to, {fn}, gather{', source' if direct else ''});")
        self.w.emit("}")
        if symmetric:  # auto's timed trial calls: the unit's end
            self.w.emit(f"coconet::cuda::fused_done(choice_{nm}, ctx);")
        if block is None:  # an overlap's block: after every block (overlap.py: _overlap_fused)
            self.after_chunks(u, layout)

    def after_chunks(self, u: Fused, layout: dict[str, str]) -> None:
        """What waits for every chunk (an overlap's: of every block), on the call's stream: the
        partial results combined across the group, then phase B."""
        self._combine(u, layout)
        partials = u.accumulated("cuda")
        for a in u.after:
            if a not in partials:
                self.unit(a)

    # --- reductions accumulated chunk by chunk (Fused.partials; runtime.cuh: Partials) ----------
    def partials_begin(self, u: Fused) -> dict[str, str]:
        """The accumulators of the reductions the chunks accumulate (pa_<name>), initialized
        before the first chunk (an overlap's: before its first block). Returns, per
        reduction, its accumulator (an expression)."""
        partials = u.accumulated("cuda")
        if not partials:
            return {}
        sums: list[str] = []  # the sums' sizes so far
        layout: dict[str, str] = {}
        extremes = 0
        # the whole-slice sums and norms first: in a batch they are combined across its calls too
        # (runtime.cuh: combine), each segment's norm only across ranks
        whole = sum(not reduction(r.op).extreme and not reduction(r.op).per_segment for r in partials)
        for r in sorted(partials, key=lambda r: reduction(r.op).per_segment):
            if reduction(r.op).extreme:
                layout[r.dst] = f"pa_{u.name}.extreme({extremes})"
                extremes += 1
            else:
                layout[r.dst] = f"pa_{u.name}.sum({' + '.join(sums) or '0'})"
                sums.append("int64_t(seg_starts.size() - 1)" if reduction(r.op).per_segment else "1")
        self.w.emit(f"// {u.name}: {', '.join(f'{r.op}({r.src})' for r in partials)} accumulated chunk by chunk")
        self.w.emit(f"const coconet::cuda::Partials pa_{u.name} = coconet::cuda::partials({self.w.site()}, "
                    f"{whole}, {' + '.join(sums[whole:]) or '0'}, {extremes}, \"{u.name}\", ctx);")
        return layout

    def _accumulate(self, u: Fused, layout: dict[str, str], red: str, ind: str) -> None:
        """After chunk [lo, hi)'s kernels, on the call's stream: each reduction's partial
        result over the chunk's values (red: the reduced chunk; a value stored by a phase or a
        parameter at the chunk's elements) added to its accumulator."""
        for r in (a for a in u.after if isinstance(a, Reduce) and a.dst in layout):
            T, acc = CTYPE[self.w.types[r.src].dtype], layout[r.dst]
            x = (red if r.src == u.collective else f"p_{r.src}" if r.src in self.w.scattered
                 else f"v_{r.src} + lo" if self.w.types[r.src].layout.sliced
                 else f"v_{r.src} + off + lo")  # a replicated parameter: at the chunk's global index
            rd = reduction(r.op)
            if rd.per_segment:  # per segment (x: from logical element off + lo, or the segments)
                self.w.emit(f"{ind}coconet::cuda::segment_partial<{T}>({x}, hi - lo, off + lo, seg_starts, {acc}, ctx);")
                continue
            fn = rd.cuda("partial", T)
            parts = f", pa_{u.name}.parts()" if rd.extreme else ""
            if r.src in self.w.scattered and r.src != u.collective:  # a block reduction per piece
                self.w.emit(f"{ind}for (const coconet::Piece& pc : coconet::pieces(seg_starts, off + lo, "
                            f"off + hi)) coconet::cuda::{fn}(p_{r.src}.at(pc), pc.size, {acc}, ctx{parts});")
            else:
                self.w.emit(f"{ind}coconet::cuda::{fn}({x}, hi - lo, {acc}, ctx{parts});")

    def _combine(self, u: Fused, layout: dict[str, str]) -> None:
        """After the last chunk: every rank's partial results combined (one grouped
        ncclAllReduce; in a batch, every call's too), then each reduction finished into its 0-d result (a segment_norm: its
        segment's norm per element)."""
        if not layout:
            return
        self.w.emit(f"coconet::cuda::combine(pa_{u.name}, ctx);  // {u.name}: the partial results across the group")
        for r in (a for a in u.after if isinstance(a, Reduce) and a.dst in layout):
            xt, acc = self.w.types[r.src], layout[r.dst]
            T = CTYPE[xt.dtype]
            if reduction(r.op).per_segment:  # its segment's norm at each element of the result
                dt = self.w.types[r.dst]
                self.w.emit(f"coconet::cuda::segment_norm_fill<{T}>({acc}, v_{r.dst}, {_prod(self.w.ldims(dt))}, "
                            f"{self.w.offset(dt)}, seg_starts, ctx);")
            else:
                self.w.emit(f"coconet::cuda::{reduction(r.op).cuda('finish', T)}({acc}, v_{r.dst}, ctx);")

    def _fused_extent(self, u: Fused, block: tuple[str, str] | None, outer: str, n0: str, inner: str,
                      mine: str) -> str:
        """base_/mine_/most_<name>: where this rank's part (or the overlap block's rows of it)
        starts and ends, and the elements of the largest part (every rank takes part in every
        chunk's reduction: as many chunks as the largest slice). Returns the rows argument of
        the block's gather (empty without a block)."""
        nm = u.name
        if block is None:
            self.w.emit(f"  const int64_t base_{nm} = 0;")
            self.w.emit(f"  const int64_t mine_{nm} = {mine};")
            self.w.emit(f"  (void)base_{nm};")
            if u.op == "reducescatter":
                self.w.emit(f"  const int64_t most_{nm} = {outer} * coconet::slice_chunk({n0}, comm.size) * {inner};")
            else:
                self.w.emit(f"  const int64_t most_{nm} = mine_{nm};")
            return ""
        per = _prod(self.w.ldims(u.type)[1:])
        self.w.emit(f"  const int64_t base_{nm} = {block[0]} * {per};  // this block of rows of this rank's part")
        self.w.emit(f"  const int64_t mine_{nm} = {block[1]} * {per};")
        # rows of dim 0 as outer indices of the collective's [outer, n0, inner] (a reduce-scatter
        # along d > 1: each row of dim 0 is prod(dims 1..d-1) outer indices)
        g = self.w.gdims(u.type)
        d = u.dim
        b0, b1 = (block if d <= 1 else (f"{block[0]} * {_prod(g[1:d])}", f"{block[1]} * {_prod(g[1:d])}"))
        if u.op == "reducescatter":
            self.w.emit(f"  const int64_t most_{nm} = ({b1} - {b0}) * coconet::slice_chunk({n0}, "
                      f"comm.size) * {inner};")
        else:  # an all-reduce: this block's elements
            self.w.emit(f"  const int64_t most_{nm} = mine_{nm} - base_{nm};")
        self.w.emit(f"  (void)base_{nm};")
        return f", {b0}, {b1}"

    def _chunk_size(self, u: Fused) -> None:
        """ch_<name>, as the plan's chunking says (Fused.on("cuda")): COCONET_CUDA_CHUNK or 2^22
        elements (whole rows for a row-wise phase); whole_alone: on one rank all of them."""
        nm, chunking = u.name, u.on("cuda").chunking
        whole = f"comm.size == 1 ? most_{nm} : 0" if chunking.whole_alone else ""
        if chunking.rows is not None:  # chunks of whole rows (a row-wise phase)
            rows = self.w.gdims(u.type)[-1]
            self.w.emit(f"  const int64_t ch_{nm} = (coconet::cuda::chunk_elems({whole}) + {rows} - 1) / {rows} * {rows};")
        else:
            self.w.emit(f"  const int64_t ch_{nm} = coconet::cuda::chunk_elems({whole});")

    def _symmetric_ok(self, u: Fused) -> bool:
        """Does the plan let this fused unit also run as one kernel over symmetric memory
        (symmetric.cuh), chosen at run time?"""
        return Algorithm.SYMMETRIC in u.on("cuda").algorithms

    def _fused_symmetric(self, u: Fused, ct: str, op: str, n0: str, inner: str, mine: str,
                         layout: dict[str, str]) -> None:
        """The fused unit as one kernel over NCCL symmetric memory where the run time chooses it
        (coconet::cuda::choose_fused; else the pipeline after it; fused_done after both). Its
        per-thread function is the pipeline chunk kernel's, rendered by the same
        CudaKernels.kernel: the Lets once per thread, whole vectors of V elements where every operand is aligned, then single
        elements; the reduced value comes from the kernel (th.reduce(i) per element, then read
        as red_v; th.vreduce(i0) per vector) instead of the chunk buffer, and the gathered value
        is stored in this rank's window too (th.out). The reductions the chunks would accumulate
        are accumulated after the kernel, over the slice it kept, as one chunk."""
        with self.w.saved_consts():
            t = u.type
            items = [(i.name, i.expr, i.store) for p in u.phases for i in p.items]
            inside = {u.collective} | {name for name, _, _ in items}
            coords = self.idx.needs_coords(t, [e for _, e, _ in items], inside)
            assert any(isinstance(r, Ref) and r.name == u.collective for _, e, _ in items for r in walk(e)), u.name
            self.w.emit(f'const coconet::cuda::FusedChoice choice_{u.name} = coconet::cuda::choose_fused(ctx, '
                        f'"{self.w.fn}", "{u.name}", {n0} * {inner});  // auto: the faster, measured on the first calls')
            self.w.emit(f"if (choice_{u.name}.symmetric) {{  // one kernel over symmetric memory")
            self.w.emit(f"  const int64_t off = {self.w.offset(t)};")
            self.w.emit("  (void)off;")
            if coords:
                for line in self.idx.extents(t):
                    self.w.emit(f"  {line}")
            self.notes.access(t, items, u.lets, "0", mine, {}, "  ")
            g = f"v_{u.gather}" if u.gather else f"static_cast<{ct}*>(nullptr)"
            gt = CTYPE[self.w.types[u.gather].dtype] if u.gather else ct
            keep = f"v_{u.collective}" if u.store_reduced else f"static_cast<{ct}*>(nullptr)"  # scratch (the plan)
            outs: Outs = {}
            if u.gather:  # the gathered value: in the caller's tensor (the item's store) and this rank's window
                assert any(name == u.gathered and stored for name, _, stored in items), u.name
                outs = {u.gathered: [("th.out[i]", "th.out")]}
            k = Kernel(mine, "i", regs={u.collective: ("coconet::to_compute(red_v)", "")}, outs=outs,
                       elem_defs=(f"const {ct} red_v = th.reduce(i);",), vloads={u.collective: "th.vreduce"},
                       own=("th.out",))

            def launch(V: int, ok: str) -> str:
                return (f"coconet::cuda::fused_symmetric<{ct}, {gt}, {V}>({op}, v_{u.src}, {n0}, {inner}, {g}, {keep}, "
                        f"ctx, {ok}, [=] __device__ (const coconet::cuda::SymThread<{ct}, {gt}, {V}>& th) {{")
            self.kernels.kernel(t, k, u.lets, items, coords, symmetric_width(self.w.plan, u), "  ", launch)
            if layout:  # the whole slice as one chunk (the reduced value is kept: the Reduce reads it)
                assert u.store_reduced or all(r.src != u.collective for r in u.accumulated("cuda")), u.name
                self.w.emit(f"  const int64_t lo = 0, hi = {mine};")
                self._accumulate(u, layout, f"v_{u.collective}", "  ")
            self.w.emit("} else  // the chunked pipeline on the host API")

    def _reduce_to(self, u: Fused, ct: str, op: str, d: int, outer: str, n0: str, inner: str, rows_arg: str) -> None:
        """The pipeline's reduce_to(k, red): chunk k's reduction on the comm stream."""
        nm = u.name
        if u.op == "reducescatter" and u.src in self.w.scattered:  # NCCL per piece of a segment
            self.w.emit(f"  auto reduce_to = [&](int64_t k, {ct}* red) {{ coconet::cuda::reduce_chunk<{ct}>({op}, "
                      f"p_{u.src}, red, {n0}, k, ch_{nm}, ctx); }};")
        elif u.op == "reducescatter" and d != 0:  # one ncclReduce per run of each rank's chunk
            self.w.emit(f"  auto reduce_to = [&](int64_t k, {ct}* red) {{ coconet::cuda::reduce_chunk<{ct}>({op}, "
                      f"v_{u.src}, red, {outer}, {n0}, {inner}, k, ch_{nm}, ctx{rows_arg}); }};")
        elif u.op == "reducescatter":
            self.w.emit(f"  auto reduce_to = [&](int64_t k, {ct}* red) {{ coconet::cuda::reduce_chunk<{ct}>({op}, "
                      f"v_{u.src}, red, {n0}, {inner}, k, ch_{nm}, ctx); }};")
        elif u.src in self.w.scattered:  # an all-reduce: NCCL per piece of the chunk inside a segment
            self.w.emit(f"  auto reduce_to = [&](int64_t k, {ct}* red) {{ coconet::cuda::allreduce_chunk<{ct}>({op}, "
                      f"p_{u.src}, red, mine_{nm}, k, ch_{nm}, ctx); }};")
        else:
            lo = f"base_{nm} + k * ch_{nm}" if rows_arg else f"k * ch_{nm}"  # an overlap's block starts at base_
            self.w.emit(f"  auto reduce_to = [&](int64_t k, {ct}* red) {{ const int64_t lo = {lo}; "
                      f"coconet::cuda::allreduce<{ct}>({op}, v_{u.src} + lo, red, "
                      f"std::min(ch_{nm}, mine_{nm} - lo), ctx, ctx.comm_stream); }};")

    def _chunk_kernel(self, u: Fused) -> None:
        """The chunk's phases in order: a pointwise phase is one kernel over the chunk's
        elements, a row-wise phase (layernorm) one kernel of a block per row of the chunk
        (chunks hold whole rows); a value crossing phases is read from its buffer."""
        with self.w.saved_consts():
            t = u.type
            inside = {u.collective} | {i.name for p in u.phases for i in p.items}
            pointwise = [(i.name, i.expr, i.store) for p in u.phases if p.kind == "pointwise" for i in p.items]
            coords = self.idx.needs_coords(t, [e for _, e, _ in pointwise], inside)
            self.w.emit(f"    const int64_t off = {self.w.offset(t)};")
            self.w.emit("    (void)off;")
            if coords:
                for line in self.idx.extents(t):
                    self.w.emit(f"    {line}")
            runs, store = self._gather_store(u)
            for ph in u.phases:
                items = [(i.name, i.expr, i.store) for i in ph.items]
                if ph.kind == "rows":
                    self._chunk_rows(u, ph.items[0], runs, bool(store))
                else:
                    self._chunk_pointwise(u, items, inside, coords, phase_width(self.w.plan, u, ph), runs, store)

    def _chunk_pointwise(self, u: Fused, items: list[tuple[str, Expr, bool]], inside: set[str], coords: bool,
                         width: int, runs: str, store: Outs) -> None:
        t = u.type
        with self.w.saved_consts():
            segs = sorted({r.name for _, e, _ in items for r in walk(e)
                           if isinstance(r, Ref) and r.name in self.w.scattered and r.name not in inside})
            if not any(name == u.gathered for name, _, _ in items):
                runs = ""
            if segs:  # a kernel per piece of the chunk inside one segment (element j = pc.offset + q)
                self.w.emit("    for (const coconet::Piece& pc : coconet::pieces(seg_starts, off + lo, off + hi)) {")
                self.w.emit("    const int64_t b0 = pc.offset;")
                for x in segs:
                    self.w.emit(f"    {CTYPE[self.w.types[x].dtype]}* const sp_{x} = p_{x}.at(pc);")
                self.notes.access(t, items, u.lets, "lo + b0", "lo + b0 + pc.size", {}, "    ",
                                  ("COCONET_R(red, b0, b0 + pc.size)",))
                k = Kernel("pc.size", "q", ("const int64_t j = b0 + q;", "const int64_t i = lo + j;"), "lo + b0",
                           {u.collective: ("coconet::to_compute(red[j])", "red + b0")}, store)
            else:
                self.notes.access(t, items, u.lets, "lo", "hi", {u.collective: "red"}, "    ", (), runs)
                k = Kernel("hi - lo", "j", ("const int64_t i = lo + j;",), "lo",
                           {u.collective: ("coconet::to_compute(red[j])", "red")}, store)
            self.kernels.kernel(t, k, u.lets, items, coords, width, "    ")
            if segs:
                self.w.emit("    }")

    def _chunk_rows(self, u: Fused, item, runs: str, gstore: bool) -> None:
        """layernorm over the chunk's whole rows, a block per row (coconet::cuda::launch_rows and
        layernorm_row_block, as the layernorm unit's kernel), in the compute type; x is the
        reduced chunk or a value stored by an earlier phase."""
        assert isinstance(item.expr, Op), item
        if item.expr.op != "layernorm":
            self._chunk_rows_dx(u, item, runs, gstore)
            return
        x, g, b, eps = item.expr.args
        assert isinstance(x, Ref) and isinstance(g, Ref) and isinstance(b, Ref)
        t = self.w.types[item.name]
        C, T = COMPUTE[t.dtype], CTYPE[t.dtype]
        H = self.w.ldims(t)[-1]
        xr = "red + (row - lo)" if x.name == u.collective else f"v_{x.name} + row"
        spans = ["COCONET_R(red, 0, hi - lo)" if x.name == u.collective else f"COCONET_R(v_{x.name}, lo, hi)",
                 f"COCONET_RA(v_{g.name})", f"COCONET_RA(v_{b.name})"]
        if item.store:
            spans.append(f"COCONET_W(v_{item.name}, lo, hi)")
        gathered = gstore and item.name == u.gathered
        if gathered:
            self.w.emit(f"    COCONET_ACCESS_RUNS({runs}, {', '.join(spans)});")
        else:
            self.w.emit(f"    COCONET_ACCESS({', '.join(spans)});")
        self.w.emit(f"    coconet::cuda::launch_rows<{C}>((hi - lo) / ({H}), stream, [=] __device__ (int64_t q, {C}* part) {{"
                  f"  // layernorm {item.name}, a block per row")
        self.w.emit(f"      const int64_t row = lo + q * ({H});")
        self.w.emit(f"      coconet::cuda::layernorm_row_block({xr}, v_{g.name}, v_{b.name}, "
                  f"static_cast<{C}>({layernorm_eps(eps)}), {H}, part, [&](int64_t c, {C} v) {{")
        self.w.emit("        const int64_t i = row + c;")
        self.w.emit(f"        const {C} x_{item.name} = coconet::round_to<{T}>(v);")
        if item.store:
            self.w.emit(f"        v_{item.name}[i] = coconet::from_compute<{T}>(x_{item.name});")
        if gathered:
            gg = self.w.gdims(self.w.types[u.gather])
            d = u.dim
            self.w.emit(f"        v_{u.gather}[(i / gm_ * {gg[d]} + off) * {_prod(gg[d + 1:])} + i % gm_] = "
                      f"coconet::from_compute<{T}>(x_{item.name});")
        self.w.emit("      });")
        self.w.emit("    });")

    def _chunk_rows_dx(self, u: Fused, item, runs: str, gstore: bool) -> None:
        """A row-wise phase whose stage is a pointwise expression of one layernorm_dx (plan/
        fusion_legality.row_op): a block per row of the chunk (grad.cuh layernorm_dx_row_block),
        each element's input gradient rounded to the storage type as the library call's result,
        then the expression around it (codegen/pointwise.py values)."""
        rd = pointwise.RowDx.of(item.name, item.expr, self.w)
        t, C, H, c = self.w.types[item.name], rd.C, rd.H, u.collective
        spans = [f"COCONET_RA(v_{rd.gamma.name})"]
        for r in sorted({n.name for n in walk(item.expr) if isinstance(n, Ref)} - {rd.gamma.name}):
            if r == u.collective:
                spans.append("COCONET_R(red, 0, hi - lo)")
            elif self.w.types[r].ndim > 0:
                spans.append(f"COCONET_R(v_{r}, lo, hi)")
        if item.store:
            spans.append(f"COCONET_W(v_{item.name}, lo, hi)")
        gathered = gstore and item.name == u.gathered
        self.w.emit(f"    COCONET_ACCESS_RUNS({runs}, {', '.join(spans)});" if gathered
                    else f"    COCONET_ACCESS({', '.join(spans)});")
        self.w.emit(f"    coconet::cuda::launch_rows<{C}>((hi - lo) / ({H}), stream, [=] __device__ (int64_t q, {C}* part) {{"
                    f"  // layernorm_dx in {item.name}, a block per row")
        self.w.emit(f"      const int64_t row = lo + q * ({H});")
        self.w.emit(f"      coconet::cuda::layernorm_dx_row_block([&](int64_t j) {{ return {C}({rd.at(rd.x, 'row + j', c)}); }}, "
                    f"v_{rd.gamma.name}, [&](int64_t j) {{ return {C}({rd.at(rd.g, 'row + j', c)}); }}, "
                    f"static_cast<{C}>({rd.eps}), {H}, part, [&](int64_t c, {C} v) {{")
        for line in rd.element("c"):
            self.w.emit(f"        {line}")
        stores = [f"v_{item.name}[i]"] if item.store else []
        if gathered:
            gg = self.w.gdims(self.w.types[u.gather])
            d = u.dim
            stores.append(f"v_{u.gather}[(i / gm_ * {gg[d]} + off) * {_prod(gg[d + 1:])} + i % gm_]")
        regs = {ROW_VALUE: "dx_", u.collective: "red[i - lo]"}
        for line in pointwise.values(self.idx, [(item.name, rd.rest, item.store)], regs,
                                     lambda name: (t, self.idx.loader(t)), lambda name: stores):
            self.w.emit(f"        {line}")
        self.w.emit("      });")
        self.w.emit("    });")

    def _gather_store(self, u: Fused):
        """A fused reduce-scatter along dim d != 0 that gathers: the chunk kernel stores the
        gathered value at its global place in the gathered buffer (the chunk's runs, declared
        for the race detection), which the chunk's gather then broadcasts in place.
        Returns (the runs' spans, the store: {name: [(target, None)]}), or ("", {})."""
        t = u.type
        d = u.dim
        if not u.gather or d == 0:
            return "", {}
        gg = self.w.gdims(self.w.types[u.gather])
        gn, ginner = gg[d], _prod(gg[d + 1:])
        self.w.emit(f"    const int64_t gm_ = {self.w.ldims(t)[d]} * {ginner};  // this rank's part of one outer index")
        runs = (f"coconet::cuda::runs_w(v_{u.gather}, {_prod(gg[:d])}, {gn}, {ginner}, "
                f"coconet::slice_range({gn}, comm.size, comm.rank), lo, hi)")
        return runs, {u.gathered: [(f"v_{u.gather}[(i / gm_ * {gn} + off) * {ginner} + i % gm_]", None)]}
