"""Pointwise loops of the CPU backend: a Loop unit of the plan as one C++ loop (plain and
vectorizable, with a copy on the loop threads for large loops, runtime_cpp/coconet/loop_pool.h;
piece by piece over scattered segments; in runs along the last dim when the element's
coordinates are needed). Operands are loaded as
codegen/indexing.py says; the element math is codegen/emit.py's."""

from __future__ import annotations

from coconetc.codegen import pointwise
from coconetc.codegen.base import Writer, prod
from coconetc.codegen.emit import COMPUTE, CTYPE, emit
from coconetc.codegen.indexing import Indexing, coord_lines
from coconetc.codegen.pointwise import lets
from coconetc.ir.nodes import Expr, Ref, walk
from coconetc.ir.types import TType
from coconetc.plan.units import Let, Loop


_prod = prod
COLSUM_BLOCK = 1 << 16  # elements of a column-sum loop's block of rows (256 KiB of f32: in L2)


class CpuLoops:
    def __init__(self, w: Writer, idx: Indexing):
        self.w = w
        self.idx = idx

    def render_lets(self, lets_: tuple[Let, ...]) -> None:
        """Scalars computed once before a loop (codegen/pointwise.py)."""
        for line in lets(self.w, lets_):
            self.w.emit(line)

    def render_loop(self, u: Loop) -> None:
        self.render_lets(u.lets)
        if any("cpu" in c.on for c in u.colsums):
            self._colsum_loop(u)
            return
        self._loop_items(u.type, [(i.name, i.expr, i.store) for i in u.items], u.seg_dst or None)

    def _colsum_loop(self, u: Loop) -> None:
        """A loop that also adds up the column sums of some of its items (Loop.colsums,
        plan/colsums.py): blocks of COLSUM_BLOCK elements' whole rows, each block's rows in
        order, each element's value added into its block's partial sum of its column (in the
        compute type, beside the store, so the item is not read again); the blocks in parallel
        (the loop threads) or in turn, then the partial sums added in block order: the same result
        whatever the threads."""
        t = u.type
        sums = [c for c in u.colsums if "cpu" in c.on]
        items = [(i.name, i.expr, i.store) for i in u.items]
        coords = self.idx.needs_coords(t, [e for _, e, _ in items], {name for name, _, _ in items})
        base = self.idx.loader(t)
        stored = {name for name, _, st in items if st}

        def body() -> list[str]:
            return [*pointwise.values(self.idx, items, {}, lambda name: (t, base),
                                      lambda name: [f"v_{name}[i]"] if name in stored else [], lambda name: t.dtype),
                    *(f"cs_{c.dst}[col] += x_{c.value};" for c in sums)]
        last, ld = t.ndim - 1, self.w.ldims(t)
        w = self.w
        w.emit("{  // and the column sums " + ", ".join(f"{c.dst} of {c.value}" for c in sums))
        for line in self.idx.loop_head(t, coords):
            w.emit(f"  {line}")
        w.emit(f"  const int64_t n = {_prod(ld)}, cols = {ld[-1]}, rows = cols > 0 ? n / cols : 0;")
        w.emit(f"  const int64_t rb = std::max<int64_t>(1, int64_t({COLSUM_BLOCK}) / std::max<int64_t>(1, cols));"
               "  // rows a block")
        w.emit("  const int64_t nb = (rows + rb - 1) / rb;")
        for c in sums:
            w.emit(f"  std::vector<{COMPUTE[w.types[c.value].dtype]}> part_{c.dst}(size_t(std::max<int64_t>(nb, 1) * cols));")
        w.emit("  auto block = [&](int64_t blk) {")
        with w.closure_locals("    ", also=("cols", "rows", "rb")):
            for c in sums:
                w.emit(f"    {COMPUTE[w.types[c.value].dtype]}* const cs_{c.dst} = part_{c.dst}.data() + blk * cols;")

            def rows_() -> None:
                w.emit("    for (int64_t row = blk * rb, end = std::min<int64_t>(rows, (blk + 1) * rb); row < end; ++row) {")
                if coords:
                    w.emit("      int64_t rest = row;")
                    for line in coord_lines(range(last)):
                        w.emit(f"      {line}")
                    w.emit("      (void)rest;")
                w.emit("      COCONET_IVDEP")
                w.emit("      for (int64_t col = 0; col < cols; ++col) {")
                w.emit("        const int64_t i = row * cols + col;")
                if coords:
                    w.emit(f"        const int64_t c{last} = col;")
                for line in body():
                    w.emit(f"        {line}")
                w.emit("      }")
                w.emit("    }")
            self.idx.unswitch_dropout("    ", rows_)
        w.emit("  };")
        w.emit("  if (n > coconet::kParallelMin && coconet::omp_threads() > 1) coconet::parallel_blocks(nb, block);")
        w.emit("  else for (int64_t blk = 0; blk < nb; ++blk) block(blk);")
        for c in sums:
            ct = CTYPE[w.types[c.dst].dtype]
            w.emit("  for (int64_t blk = 1; blk < nb; ++blk) {  // block 0's partial sums += the others', in block order")
            w.emit("    COCONET_IVDEP")
            w.emit(f"    for (int64_t col = 0; col < cols; ++col) part_{c.dst}[col] += part_{c.dst}[blk * cols + col];")
            w.emit("  }")
            w.emit(f"  for (int64_t col = 0; col < cols; ++col) v_{c.dst}[col] = "
                   f"coconet::from_compute<{ct}>(part_{c.dst}[col]);")
        w.emit("}")

    def _reads_scattered(self, exprs: list[Expr], regs: set[str]) -> bool:
        """Whether EXPRS read a scattered parameter (not one of the loop's own values REGS)."""
        return any(isinstance(r, Ref) and r.name not in regs and r.name in self.w.scattered
                   for e in exprs for r in walk(e))

    def render_epilogue(self, u: Loop, gemm: str, rows: str, cols: str) -> None:
        """A GEMM's epilogue (plan/epilogue.py): the GEMM over blocks of rows, loop U applied to
        each block's elements right after that block's GEMM. GEMM: the call, with r0 (first row)
        and rn (rows) in scope. Blocks of 8 MiB of output and at least 1024 rows: OpenBLAS packs
        the whole right operand at every call, so smaller blocks cost more than the second pass
        they save (one thread, [4096, 1024] x [1024, 2048] f32 + bias + relu, medians of 5:
        one GEMM 185 ms, then the pass over its output 184 ms in all; blocks of 128 rows 217 ms,
        256 rows 191, 512 rows 187, 1024 rows 186; docs/performance.md)."""
        t = u.type
        ct = CTYPE[t.dtype]
        name, e = u.items[0].name, u.items[0].expr
        self.render_lets(u.lets)
        needs_coords = self.idx.needs_coords(t, [e], {name})
        store = self._store(t, e, f"v_{name}[i]")
        self.w.emit("{")
        for line in self.idx.loop_head(t, needs_coords):
            self.w.emit(f"  {line}")
        self.w.emit(f"  const int64_t rows = {rows}, cols = {cols};")
        self.w.emit(f"  const int64_t rb = std::max<int64_t>(1024, (int64_t(1) << 23) / std::max<int64_t>(1, cols * "
                    f"int64_t(sizeof({ct}))));")
        self.w.emit("  for (int64_t r0 = 0; r0 < rows; r0 += rb) {")
        self.w.emit("    const int64_t rn = std::min<int64_t>(rb, rows - r0);")
        self.w.emit(f"    {gemm}")
        self.w.emit("    const int64_t lo = r0 * cols, hi = (r0 + rn) * cols;")
        self._range(t, store, needs_coords, "  ")
        self.w.emit("  }")
        self.w.emit("}")

    def _loop_items(self, t: TType, items: list[tuple[str, Expr, bool]], seg_dst: str | None = None) -> None:
        n = _prod(self.w.ldims(t))
        regs = {name for name, _, _ in items}
        segmented = seg_dst is not None or self._reads_scattered([e for _, e, _ in items], regs)
        needs_coords = self.idx.needs_coords(t, [e for _, e, _ in items], regs)
        base = self.idx.loader(t)

        def stores() -> str:
            if len(items) == 1:
                name, e, _ = items[0]
                return self._store(t, e, f"p_{seg_dst}.ptrs[s][a0 + j]" if seg_dst else f"v_{name}[i]")
            stored = {name for name, _, st in items if st}
            lines = pointwise.values(self.idx, items, {}, lambda name: (t, base),
                                     lambda name: [f"v_{name}[i]"] if name in stored else [], lambda name: t.dtype)
            return "\n      ".join(lines)
        self.w.emit("{")
        for line in self.idx.loop_head(t, needs_coords):
            self.w.emit(f"  {line}")
        if segmented:
            self.w.emit(f"  for (const coconet::Piece& pc : coconet::pieces(seg_starts, off, off + {n})) {{")
            self.w.emit("    const size_t s = pc.segment;")
            self.w.emit("    const int64_t a0 = pc.at, b0 = pc.offset;")
            self.w.emit("    COCONET_IVDEP")
            self.w.emit("    for (int64_t j = 0; j < pc.size; ++j) {")
            self.w.emit("      const int64_t i = b0 + j;")
            self.w.emit(f"      {stores()}")
            self.w.emit("    }")
            self.w.emit("  }")
        else:
            # the elements from lo to hi, run on all of them, or in blocks of kParallelMin elements
            # on the loop threads (runtime_cpp/coconet/loop_pool.h) for large loops when cores are
            # left over: one copy, its operands read into locals first (closure_locals). (With a
            # serial copy in the enclosing function beside the threads' lambda, GCC did not
            # vectorize the serial copy of a dropout loop, "control flow in loop"; the rate's Let
            # is the lambda's capture there, its address taken.)
            self.w.emit(f"  const int64_t n = {n};")
            self.w.emit("  auto run = [&](int64_t lo, int64_t hi) {")
            with self.w.closure_locals("    "):
                self.idx.unswitch_dropout("    ", lambda: self._range(t, stores(), needs_coords, "    "))
            self.w.emit("  };")
            self.w.emit("  if (n > coconet::kParallelMin && coconet::omp_threads() > 1)")
            self.w.emit("    coconet::parallel_blocks((n + coconet::kParallelMin - 1) / coconet::kParallelMin, "
                        "[&](int64_t blk) {")
            self.w.emit("      const int64_t lo = blk * coconet::kParallelMin;")
            self.w.emit("      run(lo, std::min<int64_t>(n, lo + coconet::kParallelMin));")
            self.w.emit("    });")
            self.w.emit("  else")
            self.w.emit("    run(0, n);")
        self.w.emit("}")

    def _store(self, t: TType, e: Expr, target: str) -> str:
        """One item's line: TARGET = e at element i of a loop over t."""
        return f"{target} = coconet::from_compute<{CTYPE[t.dtype]}>({emit(e, self.idx.loader(t), self.idx.extra(t))});"

    def _range(self, t: TType, store: str, needs_coords: bool, pad: str) -> None:
        """The elements from lo to hi (locals in scope): in runs along the last dim where the
        coordinates are needed (row_runs), else one plain loop (PAD: the pragma's indent)."""
        if needs_coords and t.ndim > 0:
            self.row_runs(t, "lo", "hi", [store])
        else:
            self.w.emit(f"{pad}COCONET_IVDEP")
            self.w.emit("  for (int64_t i = lo; i < hi; ++i) {")
            self.w.emit(f"    {store}")
            self.w.emit("  }")

    def row_runs(self, t: TType, lo: str, hi: str, body: list[str]) -> None:
        self.open_row_runs(t, lo, hi)
        for line in body:
            self.w.emit(f"      {line}")
        self.w.emit("    }")
        self.w.emit("  }")

    def open_row_runs(self, t: TType, lo: str, hi: str) -> None:
        """for i in [lo, hi) with coordinates c0.. (the L<k> in scope), as runs along the last
        dim: the leading coordinates are divided out once per run, the last one counts up, so
        the inner loop has no division and vectorizes (dropout's Philox included). Leaves
        two braces open (open_row_runs); the body uses i and the c<k>."""
        last = t.ndim - 1
        self.w.emit(f"  for (int64_t i0 = {lo}, e0; i0 < {hi}; i0 = e0) {{")
        self.w.emit(f"    int64_t rest = i0 / L{last};")
        self.w.emit(f"    const int64_t j0 = i0 - rest * L{last};")
        for line in coord_lines(range(last)):
            self.w.emit(f"    {line}")
        self.w.emit("    (void)rest;")
        self.w.emit(f"    e0 = std::min<int64_t>({hi}, i0 + (L{last} - j0));")
        self.w.emit("    COCONET_IVDEP")
        self.w.emit("    for (int64_t i = i0; i < e0; ++i) {")
        self.w.emit(f"      const int64_t c{last} = j0 + (i - i0);")

    def coords(self, t: TType) -> None:
        """The element's coordinates c<k> from i (the L<k> in scope)."""
        self.w.emit("    int64_t rest = i;")
        for line in coord_lines(range(t.ndim)):
            self.w.emit(f"    {line}")
        if t.ndim == 0:
            self.w.emit("    (void)rest;")
