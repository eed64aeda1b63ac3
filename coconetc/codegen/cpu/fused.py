"""Fused collectives and overlap pipelines of the plan as C++ (fused.h, overlap.h): a mixin
of the CpuRenderer (render.py). The plan says what each chunk computes; this lays it out."""

from __future__ import annotations

from coconetc.codegen.emit import COMPUTE, CTYPE, REDUCE_OP, emit, literal
from coconetc.codegen.cpu.loops import LoopEmitter, prod as _prod
from coconetc.ir.nodes import Const, Op, Ref, walk
from coconetc.plan.units import Fused, Item, Overlap, Phase


class FusedEmitter(LoopEmitter):
    # --- fused collectives ----------------------------------------------------------------
    def render_fused(self, u: Fused) -> None:
        """One fused collective: each chunk of this rank's slice is reduced (fused.h), the
        phases run on it at once, and gathered values are written straight into their place
        in the full-size result, which the collective fills in from the others. Then what
        waits for all chunks."""
        ct = COMPUTE[u.type.dtype]
        self.emit(f"const int64_t off_{u.name} = {self._fused_offset(u)};")
        self.emit(f"auto compute_{u.name} = [&](int64_t gb, int64_t ge, const {ct}* red) {{")
        self._chunk(u, f"off_{u.name}")
        self.emit("};")
        self._fused_call(u)
        for a in u.after:
            self.unit(a)

    def _fused_offset(self, u: Fused) -> str:
        t = u.type
        d0 = t.layout.dim if t.layout.sliced else 0
        off = self.offset(t) if t.layout.sliced else "int64_t(0)"
        return f"{off} * {_prod(self.gdims(t)[d0 + 1:])}"

    def _chunk(self, u: Fused, o: str) -> None:
        """The callback's body: the Lets, where [gb, ge) lies, the phases' loops."""
        saved = dict(self.consts)
        self.render_lets(u.lets)  # locals of the callback (in registers; not captured)
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
        eps_s = (literal(eps.value, "f64") if isinstance(eps, Const)
                 else f"double(coconet::to_compute(v_{eps.name}[0]))" if isinstance(eps, Ref) else "")
        self.emit(f"  for (int64_t row = lo; row < hi; row += {H}) {{  // layernorm {item.name}, row by row")
        self.emit(f"    {C} mean = 0, var = 0;")
        self.emit(f"    for (int64_t j = 0; j < {H}; ++j) mean += {X('row + j')};")
        self.emit(f"    mean /= static_cast<{C}>({H});")
        self.emit(f"    for (int64_t j = 0; j < {H}; ++j) {{ const {C} d = {X('row + j')} - mean; var += d * d; }}")
        self.emit(f"    var /= static_cast<{C}>({H});")
        self.emit(f"    const {C} inv = {C}(1) / std::sqrt(var + static_cast<{C}>({eps_s}));")
        self.emit(f"    for (int64_t j = 0; j < {H}; ++j) {{")
        self.emit(f"      const {C} y = coconet::round_to<{T}>(({X('row + j')} - mean) * inv * "
                  f"coconet::to_compute(v_{g.name}[j]) + coconet::to_compute(v_{b.name}[j]));")
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
        coords = any(self._access(r, t0) is None for r in operands) or (
            any(isinstance(x, Op) and x.op == "dropout" for i in ph.items for x in walk(i.expr))
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
        elif coords and t0.ndim > 0:  # runs along the last dim: no division per element
            self.open_row_runs(t0, "lo", "hi")
            self._chunk_body(u, ph, d0)
            self.emit("    }")
            self.emit("  }")
            return
        else:
            self.emit("  COCONET_IVDEP")
            self.emit("    for (int64_t i = lo; i < hi; ++i) {")
        if coords:
            self._coords(t0)
        self._chunk_body(u, ph, d0)
        self.emit("    }")
        if segmented:
            self.emit("  }")

    def _chunk_body(self, u: Fused, ph: Phase, d0: int) -> None:
        regs = {u.collective: "red[i - lo]"}
        for item in ph.items:
            t = self.types[item.name]
            ct, base = CTYPE[t.dtype], self._loader(t)
            load = lambda r, base=base: regs.get(r.name) or base(r)  # noqa: E731
            body = emit(item.expr, load, self._extra(t, load))
            self.emit(f"      const {COMPUTE[t.dtype]} x_{item.name} = coconet::round_to<{ct}>({body});")
            regs[item.name] = f"x_{item.name}"
            if item.store:
                self.emit(f"      v_{item.name}[i] = coconet::from_compute<{ct}>(x_{item.name});")
            if item.name == u.gathered and d0 != 0:  # this rank's part, at its global index
                self.emit(f"      v_{u.gather}[gb + (i - lo)] = coconet::from_compute<{ct}>(x_{item.name});")

    def _chunk_sizes(self, u: Fused) -> tuple[str, str]:
        chunk, progress = "coconet::fused_chunk_elems()", ""
        if u.rows is not None:  # chunks and progress pieces of whole rows
            rows = self.gdims(u.type)[-1]
            chunk = f"coconet::round_up(coconet::fused_chunk_elems(), {rows})"
            progress = f", coconet::round_up(coconet::kProgressElems, {rows})"
        return chunk, progress

    def _fused_call(self, u: Fused) -> None:
        xt, ct = self.types[u.src], CTYPE[u.type.dtype]
        src = (f"coconet::Segments<const {ct}>(p_{u.src})" if u.src in self.scattered
               else f"coconet::Segments<const {ct}>::one(v_{u.src}, {_prod(self.ldims(xt))})")
        op, fn = REDUCE_OP[u.reduce], f"compute_{u.name}"
        chunk, progress = self._chunk_sizes(u)
        if u.op != "reducescatter":
            self.emit(f"coconet::fused_allreduce_compute<{ct}>({op}, {src}, comm, {chunk}, {fn}{progress});")
            return
        targets = (f"{{coconet::gather_target(v_{u.gather}, {_prod(self.gdims(self.types[u.gather]))})}}"
                   if u.gather else "{}")
        self.emit(f"coconet::fused_rs_compute_ag<{ct}>({op}, {src}, "
                  f"coconet::Shape3{{{self.shape3(xt, u.type.layout.dim)}}}, comm, "
                  f"{chunk}, {fn}, {targets}{progress});")

    # --- overlap --------------------------------------------------------------------------
    def render_overlap(self, u: Overlap) -> None:
        if u.fused is not None:
            self.emit(f"const int64_t off_{u.fused.name} = {self._fused_offset(u.fused)};")
        if u.direct:
            self._overlap_rows(u)
        else:
            self._overlap_packed(u)
        if u.fused is not None:
            for a in u.fused.after:
                self.unit(a)

    def _overlap_rows(self, u: Overlap) -> None:
        """The matmul in chunks of rows (dim 0 of its result); each chunk's collective starts
        (non-blocking, overlap.h) as soon as the chunk is computed, while the next computes."""
        y = u.producer
        ct = CTYPE[self.types[y].dtype]
        ly, la, lb = (self.ldims(self.types[n]) for n in (y, u.a, u.b))
        rows, per_row = ly[0], _prod(ly[1:-1])
        chunk = f"coconet::chunk_range({rows}, {u.chunks}, i)"
        K, N = la[-1], lb[1]
        # b prepared once (f16/bf16 widened to f32 once, not once per chunk); each chunk's GEMM
        # in row blocks with the communication in flight progressed between them (gemm_steps)
        self.emit(f"const auto* const bp_{y} = coconet::gemm_prepare_b<{ct}>(v_{u.b}, {K}, {N}, {N});")
        self.emit(f"const int64_t bld_{y} = coconet::gemm_b_ld<{ct}>({N}, {N});")
        self.emit(f"coconet::overlap({u.chunks}, [&](int i, coconet::Overlap& ov) {{")
        self.emit(f"  const coconet::Range r = {chunk};")
        self.emit(f"  coconet::gemm_steps<{ct}>(r.size() * {per_row}, {N}, {K}, v_{u.a} + r.begin * {per_row} * {K}, "
                  f"{K}, bp_{y}, bld_{y}, v_{y} + r.begin * {_prod(ly[1:])}, {N}, coconet::kOverlapSteps, "
                  "[&] { ov.progress(); });")
        self.emit("}, [&](int i, int channel) {")
        self.emit(f"  const coconet::Range r = {chunk};")
        if u.fused is not None:
            self._overlap_fused_task(u, ly)
            return
        lc = self.ldims(self.types[u.collective])
        src, dst = f"v_{y} + r.begin * {_prod(ly[1:])}", f"v_{u.collective} + r.begin * {_prod(lc[1:])}"
        op = REDUCE_OP[u.reduce]
        if u.op == "allreduce":
            self.emit(f"  return coconet::start_allreduce({op}, {src}, {dst}, r.size() * {_prod(ly[1:])}, comm, channel);")
        else:
            g, d = self.gdims(self.types[y]), self.types[u.collective].layout.dim
            self.emit(f"  return coconet::start_reduce_scatter({op}, {src}, {dst}, r.size() * {_prod(g[1:d])}, "
                      f"{g[d]}, {_prod(g[d + 1:])}, comm, channel);")
        self.emit("});")

    def _overlap_fused_task(self, u: Overlap, ly: list[str]) -> None:
        """Chunk i of the matmul's rows goes through its own fused collective (a task of
        overlap.h): the fusion's computation runs on each reduced piece of that chunk, and the
        gathered value is sent as soon as it is computed. Indices inside the callback are made
        global (base: the chunk's first element in the full tensor)."""
        f = u.fused
        assert f is not None
        y = u.producer
        ct, d0 = CTYPE[f.type.dtype], f.type.layout.dim if f.type.layout.sliced else 0
        g = self.gdims(self.types[y])
        self.emit(f"  const int64_t base = r.begin * {_prod(ly[1:])}, count = r.size() * {_prod(ly[1:])};")
        self.emit(f"  auto compute = [&, base](int64_t gb0, int64_t ge0, const {COMPUTE[f.type.dtype]}* red) {{")
        self.emit("    const int64_t gb = gb0 + base, ge = ge0 + base;")
        self._chunk(f, f"off_{f.name}")
        self.emit("  };")
        targets = (f"{{coconet::gather_target(v_{f.gather} + base, count)}}" if f.gather else "{}")
        op = REDUCE_OP[f.reduce]
        shape = (f"r.size() * {_prod(g[1:d0])}, {g[d0]}, {_prod(g[d0 + 1:])}" if f.type.layout.sliced
                 else "1, count, 1")
        start = "start_fused_rs_compute_ag" if f.op == "reducescatter" else "start_fused_allreduce_compute"
        shape_arg = f"coconet::Shape3{{{shape}}}, " if f.op == "reducescatter" else ""
        extra = f", {targets}" if f.op == "reducescatter" else ""
        self.emit(f"  return coconet::{start}<{ct}>({op}, coconet::Segments<const {ct}>::one(v_{y} + base, count), "
                  f"{shape_arg}comm, channel, coconet::overlap_task_chunk_elems(count, comm.size), compute{extra});")
        self.emit("});")

    def _overlap_packed(self, u: Overlap) -> None:
        """Chunks along any dim d of the matmul's result y: chunk i is computed into a packed
        buffer [outer, |r|, inner] (one GEMM per outer index; along the last dim, a GEMM with
        a column block of b), its collective runs on the packed chunk, and the packed result
        is unpacked into its block of the result (overlap.h, start_packed)."""
        y, c = u.producer, u.collective
        yt, ct_t = self.types[y], self.types[c]
        ct = CTYPE[yt.dtype]
        ly, la, lb, lc = (self.ldims(self.types[n]) for n in (y, u.a, u.b, c))
        d, nd = u.dim, yt.ndim
        gy = self.gdims(yt)
        outer, n, inner = _prod(ly[:d]), ly[d], _prod(ly[d + 1:])
        self.emit(f"coconet::PackedChunks<{ct}> pk_{y}({u.chunks}, {outer}, {n}, {inner});")
        self.emit(f"coconet::overlap({u.chunks}, [&](int i) {{")
        self.emit(f"  const coconet::Range r = coconet::chunk_range({n}, {u.chunks}, i);")
        self.emit(f"  {ct}* const P = pk_{y}.in(i);")
        K = la[-1]
        if d == nd - 1:  # a column block of b: P[M, |r|]
            self.emit(f"  coconet::gemm<{ct}>({_prod(ly[:-1])}, r.size(), {K}, v_{u.a}, {K}, "
                      f"v_{u.b} + r.begin, {lb[1]}, P, r.size());")
        else:  # for each outer index, |r| * (rows per index of dim d) contiguous rows of a
            rows_per = _prod(ly[d + 1:-1])
            self.emit(f"  for (int64_t o = 0; o < {outer}; ++o)")
            self.emit(f"    coconet::matmul<{ct}>(v_{u.a} + (o * {n} + r.begin) * {rows_per} * {K}, v_{u.b}, "
                      f"P + o * r.size() * {inner}, r.size() * {rows_per}, {K}, {lb[1]});")
        if u.keep_producer:
            self.emit(f"  coconet::unpack_block(P, v_{y}, {outer}, {n}, {inner}, r);")
        self.emit("}, [&](int i, int channel) {")
        self.emit(f"  const coconet::Range r = coconet::chunk_range({n}, {u.chunks}, i);")
        self.emit(f"  {ct}* const P = pk_{y}.in(i);")
        # the packed chunk as a tensor: the global dims with dim d cut to |r|
        gp = [g if k != d else "r.size()" for k, g in enumerate(gy)]
        op = REDUCE_OP.get(u.reduce, "")
        lcd = [x if k != d else "r.size()" for k, x in enumerate(lc)]
        out_n = _prod(lcd)
        self.emit(f"  {ct}* const Q = pk_{y}.out(i, {out_n});")
        if u.op == "allreduce":
            start = f"coconet::start_allreduce({op}, P, Q, {_prod(lcd)}, comm, channel)"
        elif u.op == "reducescatter":
            dr = ct_t.layout.dim
            start = (f"coconet::start_reduce_scatter({op}, P, Q, {_prod(gp[:dr])}, {gp[dr]}, "
                     f"{_prod(gp[dr + 1:])}, comm, channel)")
        else:
            da = yt.layout.dim
            start = (f"coconet::start_allgather(P, Q, {_prod(gp[:da])}, {gp[da]}, {_prod(gp[da + 1:])}, "
                     "comm, channel)")
        self.emit(f"  return coconet::then_unpack({start}, Q, v_{c}, {_prod(lc[:d])}, {lc[d]}, "
                  f"{_prod(lc[d + 1:])}, r);")
        self.emit("});")
