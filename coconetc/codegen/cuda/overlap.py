"""Overlap pipelines of the CUDA renderer: the matmul in chunks (cuBLAS) on the call's stream,
each chunk's collective (NCCL) or fused collective (fused.py) on another stream after an event,
so it runs while the next chunk's GEMM does."""

from __future__ import annotations

from collections.abc import Callable

from coconetc.codegen import dispatch, library_calls
from coconetc.codegen.base import Writer, prod as _prod
from coconetc.codegen.cuda.collectives import NCCL_OP
from coconetc.codegen.cuda.fused import CudaFused
from coconetc.codegen.cuda.notes import Notes
from coconetc.codegen.emit import CTYPE
from coconetc.plan.units import Fused, GatherChunks, GatherMatmul, Overlap, Unit

# an overlap's pieces in a trace (coconet/cuda/trace.cuh; docs/tracing.md): a chunk's GEMM (produce, on the
# call's stream; consume: the GEMM reading a gathered chunk) and its communication (on the comm stream)
PRODUCE, CONSUME = "overlap: produce the chunk", "overlap: consume the chunk"
COMMUNICATE, GATHER = "overlap: communicate the chunk", "overlap: gather the chunk"


class CudaOverlap:
    """unit: renders the units that wait for every chunk (the renderer's dispatch)."""

    def __init__(self, w: Writer, fusion: CudaFused, notes: Notes, unit: Callable[[Unit], None]):
        self.w = w
        self.fusion, self.notes, self.unit = fusion, notes, unit

    def render_overlap(self, u: Overlap) -> None:
        """The matmul in chunks on the call's stream; each chunk's collective on the comm stream
        after an event (so it runs while the next chunk's GEMM does); the call's stream waits
        for the comm stream at the end. direct: chunks are rows of y in place; otherwise each
        chunk is computed packed [outer, |r|, inner], its collective runs on the packed chunk
        and the result is unpacked into its block of the collective's result."""
        if u.fused is not None:
            self._overlap_fused(u, u.fused)
            return
        y, c = u.producer, u.collective
        yt = self.w.types[y]
        ct = CTYPE[yt.dtype]
        op = NCCL_OP.get(u.reduce, "")
        ly, lc = (self.w.ldims(self.w.types[n]) for n in (y, c))
        ev, done = self.w.site(), self.w.site()
        self.w.emit("{")
        self.w.emit("  coconet::cuda::Ctx cctx = ctx;  // collectives on the comm stream")
        self.w.emit("  cctx.stream = ctx.comm_stream;")
        if u.direct:
            rows, per_row = ly[0], _prod(ly[1:-1])
            self.w.emit(f"  for (int i = 0; i < {u.chunks}; ++i) {{")
            self.w.emit(f"    const coconet::Range r = coconet::slice_range({rows}, {u.chunks}, i);")
            self.w.emit("    if (r.empty()) continue;")
            self._piece(PRODUCE, "i", "stream")
            for call in library_calls.overlap_gemms(self.w, u, f"r.begin * {per_row}", f"r.size() * {per_row}",
                                                    f"v_{y} + r.begin * {_prod(ly[1:])}"):
                self._gemm(ct, call, "      ")
            self.w.emit("    }")
            self.w.emit(f"    coconet::cuda::join(ctx.stream, ctx.comm_stream, {ev});")
            src, dst = f"v_{y} + r.begin * {_prod(ly[1:])}", f"v_{c} + r.begin * {_prod(lc[1:])}"
            self._piece(COMMUNICATE, "i", "ctx.comm_stream")
            self.w.emit("  " + dispatch.chunk_collective(self.w, u, {
                "allreduce": lambda _: f"    coconet::cuda::allreduce<{ct}>({op}, {src}, {dst}, r.size() * "
                                       f"{_prod(ly[1:])}, cctx);",
                "reducescatter": lambda split: f"    coconet::cuda::reduce_scatter<{ct}>({op}, {src}, {dst}, {split}, "
                                               "cctx);"}))
            self.w.emit("    }")
            self.w.emit("  }")
        else:
            self._overlap_packed(u, ct, op, ly, lc, ev)
        self.w.emit(f"  coconet::cuda::join(ctx.comm_stream, ctx.stream, {done});")
        self.w.emit("}")

    def _overlap_fused(self, u: Overlap, f: Fused) -> None:
        """The matmul's row blocks (cuBLAS) on the call's stream; after each block an event, and
        the fused collective of that block of rows on a side stream (its reductions and gathers
        on the comm stream, its kernels on the side stream), so the next block's GEMM runs while
        this block communicates and computes; the call's stream waits for the side stream at
        the end."""
        y = u.producer
        ct = CTYPE[self.w.types[y].dtype]
        ly = self.w.ldims(self.w.types[y])
        rows, per_row = ly[0], _prod(ly[1:-1])
        ev, done = self.w.site(), self.w.site()
        self.w.emit("{")
        layout = self.fusion.partials_begin(f)  # on the call's stream, before the first block's event
        self.w.emit("  coconet::cuda::Ctx sctx = ctx;  // the fused collective's kernels on a side stream")
        self.w.emit("  sctx.stream = coconet::cuda::side_stream();")
        if u.then is None:
            self.w.emit(f"  for (int ob = 0; ob < {u.chunks}; ++ob) {{")
            self.w.emit(f"    const coconet::Range rb = coconet::slice_range({rows}, {u.chunks}, ob);")
            self.w.emit("    if (rb.empty()) continue;")
        else:  # one more pass: block ob-1's rows of the fed matmul after block ob's GEMM
            gathered = self.w.site()
            self.w.emit(f"  for (int ob = 0; ob <= {u.chunks}; ++ob) {{")
            self.w.emit(f"    const coconet::Range rb = coconet::slice_range({rows}, {u.chunks}, ob < {u.chunks} ? ob : 0);")
            self.w.emit(f"    const bool here = ob < {u.chunks} && !rb.empty();")
            self.w.emit("    if (here) {")
        self._piece(PRODUCE, "ob", "stream")
        for call in library_calls.overlap_gemms(self.w, u, f"rb.begin * {per_row}", f"rb.size() * {per_row}",
                                                f"v_{y} + rb.begin * {_prod(ly[1:])}"):
            self._gemm(ct, call, "      ")
        self.w.emit("    }")
        self.w.emit(f"    coconet::cuda::join(ctx.stream, sctx.stream, {ev});  // this block's rows are computed")
        if u.then is not None:
            self.w.emit("    }")
            self._fed_rows(u.then, ct, u.chunks, rows, gathered)
            self.w.emit("    if (!here) continue;")
        self.w.emit("    {")
        self.w.emit("    const coconet::cuda::Ctx& ctx = sctx;")
        self.w.emit("    const cudaStream_t stream = ctx.stream;")
        self.w.comment(f.line, f"fused collective {f.name}: {', '.join(f.members)} (rows rb of dim 0)")
        self.fusion.render_fused(f, ("rb.begin", "rb.end"), layout)
        self.w.emit("    }")
        if u.then is not None:
            self.w.emit(f"    coconet::cuda::mark(sctx.stream, {gathered});  // block ob's rows of {u.then.a} are gathered")
        self.w.emit("  }")
        self.w.emit(f"  coconet::cuda::join(sctx.stream, ctx.stream, {done});")
        self.fusion.after_chunks(f, layout)  # what waits for every chunk of every block, on the call's stream
        self.w.emit("}")

    def _fed_rows(self, t: GatherMatmul, ct: str, chunks: int, rows: str, gathered: int) -> None:
        """Block ob-1's rows of the matmul fed by the fused collective's gather (Overlap.then), on
        the call's stream once that block's fused collective is done (its mark on the side stream),
        queued after block ob's GEMM and before block ob's fused collective, which thus runs
        while they multiply."""
        rows_per, cols = _prod(self.w.ldims(self.w.types[t.a])[1:-1]), self.w.ldims(self.w.types[t.consumer])[-1]
        self.w.emit(f"    const coconet::Range rp = coconet::slice_range({rows}, {chunks}, ob > 0 ? ob - 1 : 0);")
        self.w.emit("    if (ob > 0 && !rp.empty()) {")
        self.w.emit(f"      coconet::cuda::wait_mark({gathered}, ctx.stream);  // block ob-1's fused collective is done")
        self._piece(CONSUME, "ob - 1", "ctx.stream", "      ")
        self._gemm_rows(t, ct, f"rp.begin * {rows_per}", f"rp.size() * {rows_per}", cols, "        ")
        self.w.emit("      }")
        self.w.emit("    }")

    def _overlap_packed(self, u: Overlap, ct: str, op: str, ly, lc, ev: int) -> None:
        y, c = u.producer, u.collective
        yt = self.w.types[y]
        d, nd = u.dim, yt.ndim
        outer, n, inner = _prod(ly[:d]), ly[d], _prod(ly[d + 1:])
        oc, ic = _prod(lc[:d]), _prod(lc[d + 1:])
        self.w.emit(f"  {ct}* const P_all = coconet::cuda::scratch<{ct}>({self.w.site()}, {_prod(ly)});")
        self.w.emit(f"  {ct}* const Q_all = coconet::cuda::scratch<{ct}>({self.w.site()}, {_prod(lc)});")
        self.notes.name("P_all", _prod(ly), f"packed chunks of {y}")
        self.notes.name("Q_all", _prod(lc), f"packed chunks of {c}")
        self.w.emit(f"  for (int i = 0; i < {u.chunks}; ++i) {{")
        self.w.emit(f"    const coconet::Range r = coconet::slice_range({n}, {u.chunks}, i);")
        self.w.emit("    if (r.empty()) continue;")
        self.w.emit(f"    {ct}* const P = P_all + {outer} * r.begin * {inner};")
        self.w.emit(f"    {ct}* const Q = Q_all + {oc} * r.begin * {ic};")
        self._piece(PRODUCE, "i", "stream")
        if d == nd - 1:  # a block of b (its columns; matmul_nt: its rows): P[M, |r|]
            self._gemm(ct, library_calls.overlap_cols(self.w, u, "P"), "      ")
        else:
            rows_per = _prod(ly[d + 1:-1])
            self.w.emit(f"      for (int64_t o = 0; o < {outer}; ++o)")
            self._gemm(ct, library_calls.overlap_rows(self.w, u, f"(o * {n} + r.begin) * {rows_per}",
                                                f"r.size() * {rows_per}", f"P + o * r.size() * {inner}"), "        ")
        if u.keep_producer:
            self.w.emit(f"      coconet::cuda::unpack<{ct}>(P, v_{y}, {outer}, {n}, {inner}, r, stream);")
        self.w.emit("    }")
        self.w.emit(f"    coconet::cuda::join(ctx.stream, ctx.comm_stream, {ev});")
        self._piece(COMMUNICATE, "i", "ctx.comm_stream")
        self.w.emit("  " + dispatch.chunk_collective(self.w, u, {
            "allreduce": lambda _: f"    coconet::cuda::allreduce<{ct}>({op}, P, Q, {oc} * r.size() * {ic}, cctx);",
            "reducescatter": lambda split: f"    coconet::cuda::reduce_scatter<{ct}>({op}, P, Q, {split}, cctx);",
            "allgather": lambda split: f"    coconet::cuda::allgather<{ct}>(P, Q, {split}, cctx);"}))
        self.w.emit(f"      coconet::cuda::unpack<{ct}>(Q, v_{c}, {oc}, {lc[d]}, {ic}, r, ctx.comm_stream);")
        self.w.emit("    }")
        self.w.emit("  }")

    def render_gather_matmul(self, u: GatherMatmul) -> None:
        """The other way: chunk i's allgather or broadcast (NCCL) on the comm stream, then an
        event the call's stream waits for before chunk i's rows of the consumer (cuBLAS), so
        chunk i+1 is in flight while chunk i is multiplied. The comm stream first waits for the
        source to be computed."""
        c, g = u.gather, dispatch.gather_chunk(self.w, u)
        ct = CTYPE[self.w.types[c.dst].dtype]
        ev, go = self.w.site(), self.w.site()
        self.w.emit("{")
        self.w.emit("  coconet::cuda::Ctx cctx = ctx;  // the gather's chunks on the comm stream")
        self.w.emit("  cctx.stream = ctx.comm_stream;")
        self.w.emit(f"  coconet::cuda::join(ctx.stream, ctx.comm_stream, {go});  // its source is computed")
        if u.how == GatherChunks.PACKED:
            X, G = (self.w.ldims(self.w.types[n]) for n in (c.src, c.dst))
            self.w.emit(f"  {ct}* const P_all = coconet::cuda::scratch<{ct}>({self.w.site()}, {_prod(X)});")
            self.w.emit(f"  {ct}* const Q_all = coconet::cuda::scratch<{ct}>({self.w.site()}, {_prod(G)});")
            self.notes.name("P_all", _prod(X), f"packed chunks of {c.src}")
            self.notes.name("Q_all", _prod(G), f"packed chunks of {c.dst}")
        self.w.emit(f"  for (int i = 0; i < {u.chunks}; ++i) {{")
        arrived = f"    coconet::cuda::join(ctx.comm_stream, ctx.stream, {ev});  // chunk i has arrived"
        if u.how == GatherChunks.PIECES:
            self._piece(GATHER, "i", "ctx.comm_stream")
            self.w.emit(f"      coconet::cuda::allgather_pieces<{ct}>(v_{c.src}, v_{c.dst}, {g.n}, {g.g_inner}, "
                        f"{u.chunks}, i, cctx);")
            self.w.emit("    }")
            self.w.emit(arrived)
            self._piece(CONSUME, "i", "stream")
            self.w.emit("      for (int q = 0; q < comm.size; ++q) {")
            self.w.emit(f"        const coconet::Range r = coconet::piece_range({g.n}, comm.size, q, {u.chunks}, i);")
            self.w.emit("        if (r.empty()) continue;")
            if u.right:
                self._weight_chunk(u, ct, "i > 0 || q > 0", "        ")
            else:
                self._gemm_rows(u, ct, f"r.begin * {g.rows_per}", f"r.size() * {g.rows_per}", g.cols, "        ")
            self.w.emit("      }")
            self.w.emit("    }")
        else:
            self.w.emit(f"    const coconet::Range r = coconet::slice_range({g.n}, {u.chunks}, i);")
            self.w.emit("    if (r.empty()) continue;")
            src, dst = g.rows_src, g.rows_dst
            self._piece(GATHER, "i", "ctx.comm_stream")
            if u.how == GatherChunks.PACKED:
                self.w.emit(f"      {ct}* const P = P_all + {g.x_outer} * r.begin * {g.x_inner};")
                self.w.emit(f"      {ct}* const Q = Q_all + {g.g_outer} * r.begin * {g.g_inner};")
                self.w.emit(f"      coconet::cuda::pack<{ct}>(v_{c.src}, P, {g.x_outer}, {g.n}, {g.x_inner}, r, "
                            "ctx.comm_stream);")
                src, dst = "P", "Q"
            if c.op == "allgather":
                self.w.emit(f"      coconet::cuda::allgather<{ct}>({src}, {dst}, {g.call}, cctx);")
            else:
                self.w.emit(f"      coconet::cuda::broadcast<{ct}>({src}, {dst}, {g.call}, {c.root}, cctx);")
            if u.how == GatherChunks.PACKED:
                self.w.emit(f"      coconet::cuda::unpack<{ct}>(Q, v_{c.dst}, {g.g_outer}, {g.n}, {g.g_inner}, r, "
                            "ctx.comm_stream);")
            self.w.emit("    }")
            self.w.emit(arrived)
            self._piece(CONSUME, "i", "stream")
            if u.right:
                self._weight_chunk(u, ct, "i > 0", "      ")
            elif u.how == GatherChunks.ROWS:
                self._gemm_rows(u, ct, f"r.begin * {g.rows_per}", f"r.size() * {g.rows_per}", g.cols, "      ")
            else:
                self.w.emit(f"      for (int64_t o = 0; o < {g.g_outer}; ++o)")
                self._gemm_rows(u, ct, f"(o * {g.n} + r.begin) * {g.rows_per}", f"r.size() * {g.rows_per}", g.cols,
                                "        ")
            self.w.emit("    }")
        self.w.emit("  }")
        self.w.emit("}")

    def _piece(self, what: str, chunk: str, stream: str, ind: str = "    ") -> None:
        """Opens a block whose work queued on STREAM is a piece of the unit in a trace
        (coconet/cuda/trace.cuh: Piece, chunk CHUNK); the caller closes it."""
        self.w.emit(f"{ind}{{")
        self.w.emit(f'{ind}  const coconet::cuda::trace::Piece tp("{what}", {chunk}, {stream});')

    def _gemm_rows(self, u: GatherMatmul, ct: str, first: str, count: str, cols: str, ind: str) -> None:
        self._gemm(ct, library_calls.overlap_rows(self.w, u, f"({first})", count, f"v_{u.consumer} + ({first}) * {cols}"),
                   ind)

    def _weight_chunk(self, u: GatherMatmul, ct: str, acc: str, ind: str) -> None:
        """Chunk r of a gathered right operand (GatherMatmul.right), on the call's stream: a
        matmul adds its part of the contracted dim into the consumer (beta = 1 but for the
        first chunk's first GEMM), a matmul_nt writes the consumer's columns r."""
        fn, args, flag = library_calls.weight_chunk(self.w, u, acc)
        self.w.emit(f"{ind}coconet::cuda::{fn}<{ct}>({', '.join(args)}, stream, {flag});")

    def _gemm(self, ct: str, call: tuple[str, list[str]], ind: str) -> None:
        """One GEMM of the overlap (cuBLAS, runtime.cuh / grad.cuh) on the call's stream."""
        fn, args = call
        self.w.emit(f"{ind}coconet::cuda::{fn}<{ct}>({', '.join(args)}, stream);")
