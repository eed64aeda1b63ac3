"""Overlap pipelines of the plan as C++ (overlap.h): a matmul in chunks, each chunk's
collective (or fused collective, cpu/fused.py) started, non-blocking, as soon as the chunk is
computed, while the next one computes. The plan says how the matmul is cut; this lays it out."""

from __future__ import annotations

from collections.abc import Callable

from coconetc.codegen import dispatch, library_calls
from coconetc.codegen.base import Writer, prod as _prod
from coconetc.codegen.cpu.fused import CpuFused
from coconetc.codegen.emit import COMPUTE, CTYPE, REDUCE_OP
from coconetc.plan.units import GatherChunks, GatherMatmul, Overlap, Unit


class CpuOverlap:
    """unit: renders the units that wait for every chunk (the renderer's dispatch)."""

    def __init__(self, w: Writer, fusion: CpuFused, unit: Callable[[Unit], None]):
        self.w = w
        self.fusion, self.unit = fusion, unit

    def render_overlap(self, u: Overlap) -> None:
        if u.fused is not None:
            self.fusion.partials_begin(u.fused)  # every block's chunks add to them
            self.w.emit(f"const int64_t off_{u.fused.name} = {self.fusion.fused_offset(u.fused)};")
        if u.direct:
            self._overlap_rows(u)
        else:
            self._overlap_packed(u)
        if u.fused is not None:
            self.fusion.after_chunks(u.fused)

    def _overlap_rows(self, u: Overlap) -> None:
        """The matmul in chunks of rows (dim 0 of its result); each chunk's collective starts
        (non-blocking, overlap.h) as soon as the chunk is computed, while the next computes."""
        y = u.producer
        ct = CTYPE[self.w.types[y].dtype]
        ly, la, lb = (self.w.ldims(self.w.types[n]) for n in (y, u.a, u.b))
        rows, per_row = ly[0], _prod(ly[1:-1])
        chunk = f"coconet::slice_range({rows}, {u.chunks}, i)"
        K, N = la[-1], lb[-1]
        steps = u.gemm == "matmul" and len(lb) == 2 and not u.terms  # (a batched matmul: its strided-batched call)
        if steps:
            # b prepared once (f16/bf16 widened to f32 once, not once per chunk); each chunk's GEMM
            # in row blocks with the communication in flight progressed between them (gemm_steps)
            self.w.emit(f"const auto* const bp_{y} = coconet::gemm_prepare_b<{ct}>(v_{u.b}, {K}, {N}, {N});")
            self.w.emit(f"const int64_t bld_{y} = coconet::gemm_b_ld<{ct}>({N}, {N});")
        if u.then is not None and u.then.gemm == "matmul":  # the fed matmul's b, prepared once too
            self._prepare_b(u.then, ct)
        driver = "overlap" if u.then is None else "overlap_through"  # (then: a third stage per chunk)
        self.w.emit(f"coconet::{driver}({u.chunks}, [&](int i, coconet::Overlap& ov) {{")
        self.w.emit(f"  const coconet::Range r = {chunk};")
        if steps:
            self.w.emit(f"  coconet::gemm_steps<{ct}>(r.size() * {per_row}, {N}, {K}, v_{u.a} + r.begin * {per_row} * {K}, "
                      f"{K}, bp_{y}, bld_{y}, v_{y} + r.begin * {_prod(ly[1:])}, {N}, coconet::kOverlapSteps, "
                      "[&] { ov.progress(); });")
        else:  # the chunk's rows in one GEMM (grad.h; a sum of GEMMs: one after another), then the
            # communication in flight progressed after each
            for fn, args in library_calls.overlap_gemms(self.w, u, f"r.begin * {per_row}", f"r.size() * {per_row}",
                                                        f"v_{y} + r.begin * {_prod(ly[1:])}"):
                self.w.emit(f"  coconet::{fn}<{ct}>({', '.join(args)});")
                self.w.emit("  ov.progress();")
        self.w.emit("}, [&](int i, int channel) {")
        self.w.emit(f"  const coconet::Range r = {chunk};")
        if u.fused is not None:
            self._overlap_fused_task(u, ly, chunk)
            return
        lc = self.w.ldims(self.w.types[u.collective])
        src, dst = f"v_{y} + r.begin * {_prod(ly[1:])}", f"v_{u.collective} + r.begin * {_prod(lc[1:])}"
        op = REDUCE_OP[u.reduce]
        self.w.emit(dispatch.chunk_collective(self.w, u, {
            "allreduce": lambda _: f"  return coconet::start_allreduce({op}, {src}, {dst}, r.size() * {_prod(ly[1:])}, "
                                   "comm, channel);",
            "reducescatter": lambda split: f"  return coconet::start_reduce_scatter({op}, {src}, {dst}, {split}, comm, "
                                           "channel);"}))
        self.w.emit("});")

    def _overlap_fused_task(self, u: Overlap, ly: list[str], block: str) -> None:
        """Chunk i of the matmul's rows goes through its own fused collective (a task of
        overlap.h): the fusion's computation runs on each reduced piece of that chunk, and the
        gathered value is sent as soon as it is computed. Indices inside the callback are made
        global (base: the chunk's first element in the full tensor)."""
        f = u.fused
        assert f is not None
        y = u.producer
        ct, d0 = CTYPE[f.type.dtype], f.dim
        g = self.w.gdims(self.w.types[y])
        self.w.emit(f"  const int64_t base = r.begin * {_prod(ly[1:])}, count = r.size() * {_prod(ly[1:])};")
        self.w.emit(f"  auto compute = [&, base](int64_t gb0, int64_t ge0, const {COMPUTE[f.type.dtype]}* red) {{")
        self.w.emit("    const int64_t gb = gb0 + base, ge = ge0 + base;")
        self.fusion.chunk(f, f"off_{f.name}")
        self.w.emit("  };")
        targets = (f"{{coconet::gather_target(v_{f.gather} + base, count)}}" if f.gather else "{}")
        op = REDUCE_OP[f.reduce]
        shape = (f"r.size() * {_prod(g[1:d0])}, {g[d0]}, {_prod(g[d0 + 1:])}" if f.type.layout.sliced
                 else "1, count, 1")
        start = "start_fused_rs_compute_ag" if f.op == "reducescatter" else "start_fused_allreduce_compute"
        shape_arg = f"coconet::Shape3{{{shape}}}, " if f.op == "reducescatter" else ""
        extra = f", {targets}" if f.op == "reducescatter" else ""
        chunk, progress = self.fusion.chunk_sizes(f, "count")  # (progress: pieces of whole rows)
        self.w.emit(f"  return coconet::{start}<{ct}>({op}, coconet::Segments<const {ct}>::one(v_{y} + base, count), "
                  f"{shape_arg}comm, channel, {chunk}, compute{extra}{progress});")
        if u.then is not None:  # chunk i's rows of the gathered value, multiplied once its task is done
            t = u.then
            rows_per, cols = _prod(self.w.ldims(self.w.types[t.a])[1:-1]), self.w.ldims(self.w.types[t.consumer])[-1]
            self.w.emit("}, [&](int i, coconet::Overlap& ov) {")
            self.w.emit(f"  const coconet::Range r = {block};")
            self._gemm_rows(t, ct, f"r.begin * {rows_per}", f"r.size() * {rows_per}", cols, "  ")
        self.w.emit("});")

    def _overlap_packed(self, u: Overlap) -> None:
        """Chunks along any dim d of the matmul's result y: chunk i is computed into a packed
        buffer [outer, |r|, inner] (one GEMM per outer index; along the last dim, a GEMM with
        a column block of b), its collective runs on the packed chunk, and the packed result
        is unpacked into its block of the result (overlap.h, start_packed)."""
        y, c = u.producer, u.collective
        yt = self.w.types[y]
        ct = CTYPE[yt.dtype]
        ly, lc = (self.w.ldims(self.w.types[n]) for n in (y, c))
        d, nd = u.dim, yt.ndim
        outer, n, inner = _prod(ly[:d]), ly[d], _prod(ly[d + 1:])
        self.w.emit(f"coconet::PackedChunks<{ct}> pk_{y}({u.chunks}, {outer}, {n}, {inner});")
        self.w.emit(f"coconet::overlap({u.chunks}, [&](int i) {{")
        self.w.emit(f"  const coconet::Range r = coconet::slice_range({n}, {u.chunks}, i);")
        self.w.emit(f"  {ct}* const P = pk_{y}.in(i);")
        if d == nd - 1:  # a block of b (its columns; matmul_nt: its rows): P[M, |r|]
            fn, args = library_calls.overlap_cols(self.w, u, "P")
            self.w.emit(f"  coconet::{fn}<{ct}>({', '.join(args)});")
        else:  # for each outer index, |r| * (rows per index of dim d) contiguous rows of a
            rows_per = _prod(ly[d + 1:-1])
            fn, args = library_calls.overlap_rows(self.w, u, f"(o * {n} + r.begin) * {rows_per}", f"r.size() * {rows_per}",
                                            f"P + o * r.size() * {inner}")
            self.w.emit(f"  for (int64_t o = 0; o < {outer}; ++o)")
            self.w.emit(f"    coconet::{fn}<{ct}>({', '.join(args)});")
        if u.keep_producer:
            self.w.emit(f"  coconet::unpack_block(P, v_{y}, {outer}, {n}, {inner}, r);")
        self.w.emit("}, [&](int i, int channel) {")
        self.w.emit(f"  const coconet::Range r = coconet::slice_range({n}, {u.chunks}, i);")
        self.w.emit(f"  {ct}* const P = pk_{y}.in(i);")
        op = REDUCE_OP.get(u.reduce, "")
        lcd = [x if k != d else "r.size()" for k, x in enumerate(lc)]
        out_n = _prod(lcd)
        self.w.emit(f"  {ct}* const Q = pk_{y}.out(i, {out_n});")
        start = dispatch.chunk_collective(self.w, u, {
            "allreduce": lambda _: f"coconet::start_allreduce({op}, P, Q, {_prod(lcd)}, comm, channel)",
            "reducescatter": lambda split: f"coconet::start_reduce_scatter({op}, P, Q, {split}, comm, channel)",
            "allgather": lambda split: f"coconet::start_allgather(P, Q, {split}, comm, channel)"})
        self.w.emit(f"  return coconet::then_unpack({start}, Q, v_{c}, {_prod(lc[:d])}, {lc[d]}, "
                  f"{_prod(lc[d + 1:])}, r);")
        self.w.emit("});")

    def render_gather_matmul(self, u: GatherMatmul) -> None:
        """The other way (overlap.h overlap_into): chunk i's allgather or broadcast started
        (non-blocking) before chunk i-1 is multiplied; chunk i's rows of the consumer multiplied
        as soon as it has arrived, the next chunk's communication tested between row blocks."""
        c, g = u.gather, dispatch.gather_chunk(self.w, u)
        ct = CTYPE[self.w.types[c.dst].dtype]
        if u.gemm == "matmul" and not u.right:
            self._prepare_b(u, ct)
        if u.how == GatherChunks.PACKED:
            self.w.emit(f"coconet::PackedChunks<{ct}> pk_{c.dst}({u.chunks}, {g.x_outer}, {g.n}, {g.x_inner});")
        self.w.emit(f"coconet::overlap_into({u.chunks}, [&](int i, int channel) {{")
        if u.how == GatherChunks.PIECES:
            self.w.emit(f"  return coconet::start_allgather_pieces(v_{c.src}, v_{c.dst}, {g.n}, {g.g_inner}, "
                        f"{u.chunks}, i, comm, channel);")
        else:
            self.w.emit(f"  const coconet::Range r = coconet::slice_range({g.n}, {u.chunks}, i);")
            src, dst = g.rows_src, g.rows_dst
            if u.how == GatherChunks.PACKED:
                self.w.emit(f"  {ct}* const P = pk_{c.dst}.in(i);")
                self.w.emit(f"  coconet::pack_block(v_{c.src}, P, {g.x_outer}, {g.n}, {g.x_inner}, r);")
                self.w.emit(f"  {ct}* const Q = pk_{c.dst}.out(i, {g.packed_elems});")
                src, dst = "P", "Q"
            start = (f"coconet::start_allgather({src}, {dst}, {g.call}, comm, channel)" if c.op == "allgather" else
                     f"coconet::start_broadcast({src}, {dst}, {g.call}, {c.root}, comm, channel)")
            if u.how == GatherChunks.PACKED:
                start = f"coconet::then_unpack({start}, Q, v_{c.dst}, {g.g_outer}, {g.n}, {g.g_inner}, r)"
            self.w.emit(f"  return {start};")
        self.w.emit("}, [&](int i, coconet::Overlap& ov) {")
        if u.right:
            self._weight_chunk(u, g.n, ct)
        elif u.how == GatherChunks.PIECES:
            self.w.emit("  for (int q = 0; q < comm.size; ++q) {")
            self.w.emit(f"    const coconet::Range r = coconet::piece_range({g.n}, comm.size, q, {u.chunks}, i);")
            self._gemm_rows(u, ct, f"r.begin * {g.rows_per}", f"r.size() * {g.rows_per}", g.cols, "    ")
            self.w.emit("  }")
        elif u.how == GatherChunks.ROWS:
            self.w.emit(f"  const coconet::Range r = coconet::slice_range({g.n}, {u.chunks}, i);")
            self._gemm_rows(u, ct, f"r.begin * {g.rows_per}", f"r.size() * {g.rows_per}", g.cols, "  ")
        else:
            self.w.emit(f"  const coconet::Range r = coconet::slice_range({g.n}, {u.chunks}, i);")
            self.w.emit(f"  for (int64_t o = 0; o < {g.g_outer}; ++o) {{")
            self._gemm_rows(u, ct, f"(o * {g.n} + r.begin) * {g.rows_per}", f"r.size() * {g.rows_per}", g.cols, "    ")
            self.w.emit("  }")
        self.w.emit("});")

    def _weight_chunk(self, u: GatherMatmul, n: str, ct: str) -> None:
        """Chunk i of a gathered right operand (its rows or columns r; pieces: rank q's piece i of its
        rows, for each q): one GEMM each, then the next chunk's communication tested."""
        ind = "  "
        if u.how == GatherChunks.PIECES:
            self.w.emit("  for (int q = 0; q < comm.size; ++q) {")
            self.w.emit(f"    const coconet::Range r = coconet::piece_range({n}, comm.size, q, {u.chunks}, i);")
            ind, first = "    ", "i > 0 || q > 0"
        else:
            self.w.emit(f"  const coconet::Range r = coconet::slice_range({n}, {u.chunks}, i);")
            first = "i > 0"
        fn, args, acc = library_calls.weight_chunk(self.w, u, first)
        self.w.emit(f"{ind}coconet::{fn}<{ct}>({', '.join(args)}, {acc});")
        self.w.emit(f"{ind}ov.progress();")
        if u.how == GatherChunks.PIECES:
            self.w.emit("  }")

    def _prepare_b(self, u: GatherMatmul, ct: str) -> None:
        """A consuming matmul's b prepared once (f16/bf16 widened once, not once per chunk)."""
        K, N = self.w.ldims(self.w.types[u.b])
        y = u.consumer
        self.w.emit(f"const auto* const bp_{y} = coconet::gemm_prepare_b<{ct}>(v_{u.b}, {K}, {N}, {N});")
        self.w.emit(f"const int64_t bld_{y} = coconet::gemm_b_ld<{ct}>({N}, {N});")

    def _gemm_rows(self, u: GatherMatmul, ct: str, first: str, count: str, cols: str, ind: str) -> None:
        """`count` rows of the consumer from row `first`, the next chunk's communication tested
        between row blocks (a matmul: gemm_steps) or after (a matmul_nt)."""
        dst = f"v_{u.consumer} + ({first}) * {cols}"
        if u.gemm == "matmul":
            K, N = self.w.ldims(self.w.types[u.b])
            self.w.emit(f"{ind}coconet::gemm_steps<{ct}>({count}, {N}, {K}, v_{u.a} + ({first}) * {K}, {K}, "
                        f"bp_{u.consumer}, bld_{u.consumer}, {dst}, {N}, coconet::kOverlapSteps, [&] {{ ov.progress(); }});")
            return
        fn, args = library_calls.overlap_rows(self.w, u, f"({first})", count, dst)
        self.w.emit(f"{ind}coconet::{fn}<{ct}>({', '.join(args)});")
        self.w.emit(f"{ind}ov.progress();")
