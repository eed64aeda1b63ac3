"""Pointwise loops of the CPU backend: a Loop unit of the plan as one C++ loop, operands
loaded at the right index (broadcasting, a replicated operand read at a slice, scattered
segments), dropout at the element's global index. A mixin of the CpuRenderer (render.py)."""

from __future__ import annotations

from coconetc.codegen.base import RenderBase, prod
from coconetc.codegen.emit import COMPUTE, CTYPE, emit, literal
from coconetc.ir.rng_keys import site_key
from coconetc.ir.nodes import Const, Expr, Op, Ref, walk
from coconetc.ir.types import TType
from coconetc.plan.units import Let, Loop


_prod = prod


class LoopEmitter(RenderBase):
    # --- pointwise loops ------------------------------------------------------------------
    def render_lets(self, lets: tuple[Let, ...]) -> None:
        """Scalars computed once before a loop: named locals the loader returns as they are
        (so the compiler keeps them in registers and can vectorize the loop)."""
        for k in lets:
            code = emit(k.expr, lambda r: self.consts.get(r.name) or f"coconet::to_compute(v_{r.name}[0])")
            self.emit(f"const {COMPUTE[k.expr.type.dtype]} {k.name} = {code};")
            self.consts[k.name] = k.name

    def render_loop(self, u: Loop) -> None:
        self.render_lets(u.lets)
        self._loop_items(u.type, [(i.name, i.expr, i.store) for i in u.items], u.seg_dst or None)

    def _loop_items(self, t: TType, items: list[tuple[str, Expr, bool]], seg_dst: str | None = None) -> None:
        ct, n = CTYPE[t.dtype], _prod(self.ldims(t))
        regs = {name for name, _, _ in items}
        refs = [r for _, e, _ in items for r in walk(e) if isinstance(r, Ref) and r.name not in regs]
        segmented = seg_dst is not None or any(r.name in self.scattered for r in refs)
        needs_coords = any(self._access(r, t) is None for r in refs) or (
            any(isinstance(x, Op) and x.op == "dropout" for _, e, _ in items for x in walk(e))
            and self._gidx_simple(t) is None)
        base = self._loader(t)
        if len(items) == 1:
            name, e, _ = items[0]
            target = f"p_{seg_dst}.ptrs[s][a0 + j]" if seg_dst else f"v_{name}[i]"
            store = f"{target} = coconet::from_compute<{ct}>({emit(e, base, self._extra(t))});"
        else:
            lines: list[str] = []
            local: dict[str, str] = {}
            for name, e, stored in items:
                load = lambda r: local.get(r.name) or base(r)  # noqa: E731
                body = emit(e, load, self._extra(t, load))
                lines.append(f"const {COMPUTE[t.dtype]} x_{name} = coconet::round_to<{ct}>({body});")
                local[name] = f"x_{name}"
                if stored:
                    lines.append(f"v_{name}[i] = coconet::from_compute<{ct}>(x_{name});")
            store = "\n      ".join(lines)
        self.emit("{")
        self.emit(f"  const int64_t off = {self.offset(t)};  // this rank's slice offset")
        self.emit("  (void)off;")
        if needs_coords:
            for k, d in enumerate(self.ldims(t)):
                self.emit(f"  const int64_t L{k} = {d};")
        if segmented:
            self.emit(f"  for (const coconet::Piece& pc : coconet::pieces(seg_starts, off, off + {n})) {{")
            self.emit("    const size_t s = pc.segment;")
            self.emit("    const int64_t a0 = pc.at, b0 = pc.offset;")
            self.emit("    COCONET_IVDEP")
            self.emit("    for (int64_t j = 0; j < pc.size; ++j) {")
            self.emit("      const int64_t i = b0 + j;")
            self.emit(f"      {store}")
            self.emit("    }")
            self.emit("  }")
        else:
            # a plain loop (vectorizable: operands are locals, not captured by an OpenMP region),
            # and an OpenMP copy of it for large loops when cores are left over
            self.emit(f"  const int64_t n = {n};")
            self.emit("#ifdef _OPENMP")
            self.emit("  if (n > coconet::kParallelMin && coconet::omp_threads() > 1) {")
            self.emit("#pragma omp parallel for num_threads(coconet::omp_threads())")
            self._for(t, store, needs_coords)
            self.emit("  } else")
            self.emit("#endif")
            self.emit("  {")
            if needs_coords and t.ndim > 0:
                self.row_runs(t, "int64_t(0)", "n", [store])
            else:
                self.emit("  COCONET_IVDEP")
                self._for(t, store, needs_coords)
            self.emit("  }")
        self.emit("}")

    def _for(self, t: TType, store: str, needs_coords: bool) -> None:
        self.emit("  for (int64_t i = 0; i < n; ++i) {")
        if needs_coords:
            self._coords(t)
        self.emit(f"    {store}")
        self.emit("  }")

    def row_runs(self, t: TType, lo: str, hi: str, body: list[str]) -> None:
        self.open_row_runs(t, lo, hi)
        for line in body:
            self.emit(f"      {line}")
        self.emit("    }")
        self.emit("  }")

    def open_row_runs(self, t: TType, lo: str, hi: str) -> None:
        """for i in [lo, hi) with coordinates c0.. (the L<k> in scope), as runs along the last
        dim: the leading coordinates are divided out once per run, the last one counts up, so
        the inner loop has no division and vectorizes (dropout's Philox included). Leaves
        two braces open (open_row_runs); the body uses i and the c<k>."""
        last = t.ndim - 1
        self.emit(f"  for (int64_t i0 = {lo}, e0; i0 < {hi}; i0 = e0) {{")
        self.emit(f"    int64_t rest = i0 / L{last};")
        self.emit(f"    const int64_t j0 = i0 - rest * L{last};")
        for k in reversed(range(last)):
            if k == 0:
                self.emit("    const int64_t c0 = rest;")
            else:
                self.emit(f"    const int64_t c{k} = rest % L{k}; rest /= L{k};")
        self.emit("    (void)rest;")
        self.emit(f"    e0 = std::min<int64_t>({hi}, i0 + (L{last} - j0));")
        self.emit("    COCONET_IVDEP")
        self.emit("    for (int64_t i = i0; i < e0; ++i) {")
        self.emit(f"      const int64_t c{last} = j0 + (i - i0);")

    def _coords(self, t: TType) -> None:
        self.emit("    int64_t rest = i;")
        for k in reversed(range(t.ndim)):
            if k == 0:
                self.emit("    const int64_t c0 = rest;")
            else:
                self.emit(f"    const int64_t c{k} = rest % L{k}; rest /= L{k};")
        if t.ndim == 0:
            self.emit("    (void)rest;")

    def _access(self, r: Ref, t: TType) -> str | None:
        """Index expression for an operand when no coordinates are needed, else None."""
        rt = r.type
        if r.name in self.consts:
            return "0"
        if r.name in self.scattered:
            return "SEG"
        if rt.ndim == 0:
            return "0"
        same = rt.shape == t.shape
        if same and (rt.layout == t.layout or (not rt.layout.sliced and not t.layout.sliced)):
            return "i"
        if same and not rt.layout.sliced and t.layout.sliced and t.layout.dim == 0:
            inner = _prod(self.gdims(t)[1:])
            return f"i + off * {inner}"
        return None

    def _loader(self, t: TType):
        def load(r: Ref) -> str:
            if r.name in self.consts:
                return self.consts[r.name]
            idx = self._access(r, t)
            if idx == "SEG":
                return f"coconet::to_compute(p_{r.name}.ptrs[s][a0 + j])"
            if idx is None:
                idx = self._generic_index(r.type, t)
            return f"coconet::to_compute(v_{r.name}[{idx}])"
        return load

    def _generic_index(self, rt: TType, t: TType) -> str:
        """Index of an operand element from the result's coordinates c0.. (broadcasting, and
        a replicated operand of a sliced result read at the slice)."""
        shift = t.ndim - rt.ndim
        ld = self.ldims(rt)
        terms = []
        for k in range(rt.ndim):
            if rt.shape[k] == 1:
                continue
            coord = f"c{k + shift}"
            if t.layout.sliced and t.layout.dim == k + shift and not rt.layout.sliced:
                coord = f"({coord} + off)"
            terms.append(f"{coord} * {_prod(ld[k + 1:])}")
        return " + ".join(terms) or "0"

    def _gidx_simple(self, t: TType) -> str | None:
        if not t.layout.sliced:
            return "i"
        if t.layout.dim == 0:
            return f"(i + off * {_prod(self.gdims(t)[1:])})"
        return None

    def _extra(self, t: TType, load=None):
        """Renders dropout (it needs the element's global index); `load` as for emit()."""
        load = load or self._loader(t)

        def extra(op: Op) -> str:
            assert op.op == "dropout", op.op
            x, p, seed = op.args
            gidx = self._gidx_simple(t) or self._global_index(t)
            xs = emit(x, load, extra)
            ps = literal(p.value, "f64") if isinstance(p, Const) else f"double({emit(p, load)})"
            seeds = f"int64_t({emit(seed, load)})"
            key = site_key(op.attr("site"))
            return (f"coconet::dropout<{COMPUTE[t.dtype]}>({xs}, {ps}, {seeds}, {key}u /* "
                    f"{op.attr('site')} */, static_cast<uint64_t>({gidx}))")
        return extra

    def _global_index(self, t: TType) -> str:
        g = self.gdims(t)
        terms = []
        for k in range(t.ndim):
            coord = f"c{k}" if k != t.layout.dim else f"(c{k} + off)"
            terms.append(f"{coord} * {_prod(g[k + 1:])}")
        return " + ".join(terms) or "0"

