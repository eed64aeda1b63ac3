"""Pointwise loops of the CPU backend: one loop per stage or chain of stages, operands loaded
at the right index (broadcasting, a replicated operand read at a slice, scattered segments),
dropout at the element's global index. A mixin of the Lowerer (lower.py)."""

from __future__ import annotations

from dataclasses import replace

from coconetc.codegen.emit import COMPUTE, CTYPE, emit, literal
from coconetc.common.rng_keys import site_key
from coconetc.ir.nodes import POINTWISE, Const, Expr, Op, Ref, Stage, walk
from coconetc.ir.types import TType


def prod(items: list[str]) -> str:
    return " * ".join(items) if items else "int64_t(1)"


_prod = prod


class LoopEmitter:
    # --- pointwise loops ------------------------------------------------------------------
    def _scalars_out(self, e: Expr, stage: str, refs_too: bool = True) -> Expr:
        """Compute the scalar-only parts of a loop's expression (beta1 ** step, ...) once,
        before the loop: each becomes a named local constant the loader returns as it is (so
        the compiler keeps it in a register and can vectorize the loop). `refs_too`: also
        0-d values read as they are (not in a 0-d loop, which may be computing them)."""
        hoist_ref = refs_too and isinstance(e, Ref) and e.type.ndim == 0 and e.name not in self.consts
        if hoist_ref or (isinstance(e, Op) and e.type.ndim == 0 and e.op in POINTWISE and e.op != "dropout"):
            name = f"k{len(self.consts)}_{stage}"
            code = emit(e, lambda r: self.consts.get(r.name) or f"coconet::to_compute(v_{r.name}[0])")
            self.emit(f"const {COMPUTE[e.type.dtype]} {name} = {code};")
            self.consts[name] = name
            return Ref(name, e.type)
        if isinstance(e, Op):
            return replace(e, args=tuple(self._scalars_out(a, stage, refs_too) for a in e.args))
        return e

    def _chain(self, stages: list[Stage], outputs: dict, in_place: dict) -> None:
        """Consecutive pointwise stages over the same elements as one loop: a value read only
        inside the chain stays in a register; the others are stored."""
        names = {s.name for s in stages}
        items = []
        for s in stages:
            self._comment(s)
            store = self._needed_after(s.name, tuple(names))
            if store:
                self._place(s, outputs.get(s.name), in_place.get(s.name))
            else:
                self.types[s.name] = s.type
                self.emit(f"// ({s.name} lives in a register of the loop below)")
            items.append((s.name, self._scalars_out(s.expr, s.name), store))
        self._loop_items(stages[0].type, items)

    def _loop(self, dst: str, t: TType, e: Expr, seg_dst: str | None = None) -> None:
        """A loop computing dst = e over dst's local elements (seg_dst: stored into that
        scattered parameter's segments instead)."""
        self._loop_items(t, [(dst, self._scalars_out(e, dst, t.ndim > 0), True)], seg_dst)

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
            lines, local = [], {}
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

