"""Lowering a (scheduled) program to the body of one C++ function: Python decides every
statement here; the template only lays the functions out.

Conventions of the generated function (see templates/module.cpp.j2):
  * `comm` is this call's coconet::Comm (group split done), `seg_starts` the scattered
    segments' start offsets, `S_<sym>` the size symbols' values.
  * Every value `x` (parameter, stage or temporary) is a pointer `v_x` to this rank's local
    elements in storage type; a parameter that is still scattered is a Segments object `p_x`.
  * Stages returned by the program write straight into the output arrays the caller allocated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coconetc.codegen.emit import COMPUTE, CTYPE, emit, literal
from coconetc.ir import printer
from coconetc.ir.nodes import COLLECTIVES, POINTWISE, Const, Expr, Op, Program, Ref, Stage, walk
from coconetc.ir.types import Dim, DimExpr, TType
from coconetc.interp.rng import site_key

_OPS = {o: f"coconet::Op::{o}" for o in ("sum", "avg", "prod", "max", "min")}


@dataclass
class Signature:
    """What the Python side passes, in order."""

    tensors: list[str] = field(default_factory=list)  # tensor parameters (scattered ones too)
    scalars: list[str] = field(default_factory=list)  # scalar parameters
    outputs: list[str] = field(default_factory=list)  # public output names
    sizes: list[str] = field(default_factory=list)  # size symbols


@dataclass
class Function:
    name: str
    comment: str
    body: list[str]
    signature: Signature


def cdim(d: Dim) -> str:
    if isinstance(d, int):
        return f"int64_t({d})"
    if isinstance(d, str):
        return f"S_{d}"
    assert isinstance(d, DimExpr)
    return f"({cdim(d.a)} {'/' if d.op == '//' else d.op} {cdim(d.b)})"


def _prod(items: list[str]) -> str:
    return " * ".join(items) if items else "int64_t(1)"


class Lowerer:
    def __init__(self, p: Program, fn: str, file: str):
        self.p, self.fn, self.file = p, fn, file
        self.lines: list[str] = []
        self.types: dict[str, TType] = {q.name: q.type for q in p.params}
        self.scattered = {q.name for q in p.params if q.scattered}
        self.ntemp = 0
        self.consts: dict[str, str] = {}  # hoisted scalar constants: name -> C++ name
        self.seg_inplace: dict[str, str] = {}  # allgather stage -> scattered parameter it fills
        self.sig = Signature(sizes=sorted({s for q in p.params for d in q.type.shape
                                           for s in _symbols(d)}))

    # --- shapes ------------------------------------------------------------------------
    def gdims(self, t: TType) -> list[str]:
        return [cdim(d) for d in t.shape]

    def ldims(self, t: TType) -> list[str]:
        dims = self.gdims(t)
        if t.layout.sliced:
            dims[t.layout.dim] = f"coconet::slice_range({dims[t.layout.dim]}, comm.size, comm.rank).size()"
        return dims

    def offset(self, t: TType) -> str:
        if not t.layout.sliced:
            return "int64_t(0)"
        return f"coconet::slice_range({self.gdims(t)[t.layout.dim]}, comm.size, comm.rank).begin"

    def emit(self, line: str) -> None:
        self.lines.append(line)

    # --- the function ---------------------------------------------------------------------
    def lower(self) -> Function:
        self._prologue()
        self.order = execution_order(self.p)
        units = self._units()
        self.in_fused = {n for u in units if isinstance(u, FusedPlan) for n in u.members}
        in_place = self._in_place_updates()
        outputs = {s: pub for pub, s in self.p.outputs}
        for unit in units:
            if isinstance(unit, OverlapPlan):
                self._overlap(unit, outputs, in_place)
            elif isinstance(unit, FusedPlan):
                self._fused(unit, outputs, in_place)
            elif len(unit) > 1:
                self._chain(unit, outputs, in_place)
            else:
                self._stage(unit[0], outputs.get(unit[0].name), in_place.get(unit[0].name))
        self._epilogue(in_place)
        comment = f"program {self.p.name} ({self.file})"
        return Function(self.fn, comment, self.lines, self.sig)

    def _units(self) -> list:
        """What runs as one piece: a fused collective, a chain of pointwise stages over the
        same elements (one loop, intermediates in registers), or a single stage."""
        units: list = []
        done: set[str] = set()
        overlaps = {o.producer: overlap_plan(self.p, o) for o in self.p.overlaps}
        consumers = {pl.collective.name for pl in overlaps.values() if pl is not None}
        planned: set[str] = set()
        for s in self.order:
            if s.name in done:
                continue
            if overlaps.get(s.name) is not None:
                units.append(overlaps[s.name])
                done.update((s.name, overlaps[s.name].collective.name))
                continue
            fusion = self.p.fusion_of(s.name)
            plan = None
            if fusion and fusion.name not in planned and not consumers & set(fusion.stages):
                plan = fused_plan(self.p, fusion, self.scattered, self)
            if fusion:
                planned.add(fusion.name)  # members the plan leaves out run one by one
            if plan is not None:
                units.append(plan)
                done.update(plan.members)
            elif (units and isinstance(units[-1], list) and self._chainable(s)
                  and self._chainable(units[-1][-1]) and units[-1][-1].type == s.type):
                units[-1].append(s)
            else:
                units.append([s])
        return units

    def _chainable(self, s: Stage) -> bool:
        return (s.kind == "compute" and all(not isinstance(n, Op) or n.op in POINTWISE for n in walk(s.expr))
                and not any(isinstance(n, Ref) and n.name in self.scattered for n in walk(s.expr)))

    def _prologue(self) -> None:
        for i, sym in enumerate(self.sig.sizes):
            self.emit(f"const int64_t S_{sym} = a.sizes[{i}];")
        for q in self.p.params:
            ct = CTYPE[q.type.dtype]
            if q.scalar:
                k = len(self.sig.scalars)
                self.sig.scalars.append(q.name)
                src = "iscalars" if q.type.dtype.startswith("i") else "scalars"
                self.emit(f"const {ct} v_{q.name}[1] = {{{ct}(a.{src}[{k}])}};")
                continue
            k = len(self.sig.tensors)
            self.sig.tensors.append(q.name)
            if q.name in self.scattered:
                self.emit(f"const coconet::Segments<{ct}> p_{q.name} = a.segments<{ct}>({k});")
            else:
                self.emit(f"{ct}* const v_{q.name} = a.tensor<{ct}>({k});")
        self.sig.outputs = [pub for pub, _ in self.p.outputs]
        for op in (n for s in self.p.stages for n in walk(s.expr)):
            if isinstance(op, Op) and op.op in ("broadcast", "reduce"):
                root = op.attr("root")
                self.emit(f'coconet::require({root} < comm.size, "{op.op}: root {root} is not a '
                          f'rank of a group of " + std::to_string(comm.size));')

    def _in_place_updates(self) -> dict[str, str]:
        """Stages that may write their parameter's buffer directly: no later stage reads the
        parameter, and the stage reads it (if at all) only at the element it writes."""
        result = {}
        order = [s.name for s in self.order]
        returned = {s for _, s in self.p.outputs}
        for t, src in self.p.updates:
            if src in returned or any(s == t for _, s in self.p.outputs):
                continue
            later = order[order.index(src) + 1:]
            if any(t in _reads(self.p.stage(n).expr) for n in later):
                continue
            if t in self.scattered:
                if self._gathers_only_into(src):
                    self.seg_inplace[src] = t
                continue
            if self._reads_elementwise_only(self.p.stage(src), t):
                result[src] = t
        return result

    def _gathers_only_into(self, src: str) -> bool:
        """An allgather whose value is only the update of a scattered parameter: it can gather
        straight into the parameter's segments."""
        s = self.p.stage(src)
        return (isinstance(s.expr, Op) and s.expr.op == "allgather" and not self.p.users(src)
                and src not in self.in_fused)

    def _reads_elementwise_only(self, s: Stage, t: str) -> bool:
        if t not in _reads(s.expr):
            return True
        if s.kind == "collective" or any(isinstance(n, Op) and n.op not in POINTWISE
                                         for n in walk(s.expr)):
            return False
        return all(n.type.shape == s.type.shape and n.type.layout == s.type.layout
                   for n in walk(s.expr) if isinstance(n, Ref) and n.name == t)

    def _epilogue(self, in_place: dict[str, str]) -> None:
        for t, src in self.p.updates:
            if in_place.get(src) == t or self.seg_inplace.get(src) == t:
                continue
            n = _prod(self.ldims(self.types[t]))
            if t in self.scattered:
                self.emit(f"coconet::copy_in(v_{src}, p_{t}, 0, {n});  // update {t}")
            else:
                self.emit(f"std::copy_n(v_{src}, {n}, v_{t});  // update {t}")
        for pub, s in self.p.outputs:
            if self.p.param(s) is not None:
                self.emit(f"std::copy_n(v_{s}, {_prod(self.ldims(self.types[s]))}, a.output<{CTYPE[self.types[s].dtype]}>({self.sig.outputs.index(pub)}));")

    # --- stages -------------------------------------------------------------------------
    def _comment(self, s: Stage) -> None:
        line = s.span.line if s.span and s.span.line else "?"
        self.emit(f"// stage {s.name} ({self.file}:{line}): {s.name} = {printer.expr(s.expr)}")

    def _place(self, s: Stage, output: str | None, param: str | None) -> None:
        """Where stage s's value lives: an output array, its parameter (in place), or new."""
        ct = CTYPE[s.type.dtype]
        if output is not None and self.p.param(s.name) is None:
            self.emit(f"{ct}* const v_{s.name} = a.output<{ct}>({self.sig.outputs.index(output)});")
        elif param is not None:
            self.emit(f"{ct}* const v_{s.name} = v_{param};  // updates {param} in place")
        else:
            self._alloc(s.name, s.type)
        self.types[s.name] = s.type

    def _stage(self, s: Stage, output: str | None, param: str | None) -> None:
        self._comment(s)
        e = s.expr
        if s.name in self.seg_inplace:
            t, x = self.seg_inplace[s.name], self._materialize(e.args[0], s.name)
            self.types[s.name] = s.type
            self.emit(f"coconet::allgather(v_{x}, p_{t}, comm);  // straight into {t}'s segments")
            return
        self._place(s, output, param)
        if isinstance(e, Op) and e.op in COLLECTIVES:
            x = self._materialize(e.args[0], s.name)
            self._collective(s.name, e, x)
        elif isinstance(e, Op) and e.op not in POINTWISE:
            self._kernel(s.name, e)
        else:
            self._loop(s.name, s.type, self._hoist(e, s.name))

    def _alloc(self, name: str, t: TType) -> None:
        ct = CTYPE[t.dtype]
        # kept across calls (per thread): no allocation and no page faults after the first call
        self.emit(f"{ct}* const v_{name} = coconet::scratch<{ct}, {self._site()}>({_prod(self.ldims(t))});")

    def _site(self) -> int:
        self.nsite = getattr(self, "nsite", 0) + 1
        return self.nsite

    def _temp(self, stage: str, t: TType) -> str:
        name = f"t{self.ntemp}_{stage}"
        self.ntemp += 1
        self._alloc(name, t)
        self.types[name] = t
        return name

    def _materialize(self, e: Expr, stage: str) -> str:
        """A value's name: a reference as it is, anything else computed into a temporary."""
        if isinstance(e, Ref):
            return e.name
        name = self._temp(stage, e.type)
        if isinstance(e, Op) and e.op not in POINTWISE:
            self._kernel(name, e)
        else:
            self._loop(name, e.type, self._hoist(e, stage))
        return name

    def _hoist(self, e: Expr, stage: str) -> Expr:
        """Replace the non-pointwise parts of an expression by temporaries computed first."""
        if isinstance(e, (Ref, Const)):
            return e
        if e.op not in POINTWISE:
            return Ref(self._materialize(e, stage), e.type)
        from dataclasses import replace
        return replace(e, args=tuple(self._hoist(a, stage) for a in e.args))

    # --- pointwise loops ------------------------------------------------------------------
    def _scalars_out(self, e: Expr, stage: str) -> Expr:
        """Compute the scalar-only parts of a loop's expression (beta1 ** step, ...) once,
        before the loop: each becomes a named constant the loader returns as it is."""
        if isinstance(e, Op) and e.type.ndim == 0 and e.op in POINTWISE and e.op != "dropout":
            name = f"k{len(self.consts)}_{stage}"
            code = emit(e, lambda r: self.consts.get(r.name) or f"coconet::to_compute(v_{r.name}[0])")
            self.emit(f"const {COMPUTE[e.type.dtype]} {name} = {code};")
            self.consts[name] = name
            return Ref(name, e.type)
        if isinstance(e, Op):
            from dataclasses import replace
            return replace(e, args=tuple(self._scalars_out(a, stage) for a in e.args))
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

    def _loop(self, dst: str, t: TType, e: Expr) -> None:
        """A loop computing dst = e over dst's local elements."""
        self._loop_items(t, [(dst, self._scalars_out(e, dst), True)])

    def _loop_items(self, t: TType, items: list[tuple[str, Expr, bool]]) -> None:
        ct, n = CTYPE[t.dtype], _prod(self.ldims(t))
        regs = {name for name, _, _ in items}
        refs = [r for _, e, _ in items for r in walk(e) if isinstance(r, Ref) and r.name not in regs]
        segmented = any(r.name in self.scattered for r in refs)
        needs_coords = any(self._access(r, t) is None for r in refs) or (
            any(isinstance(x, Op) and x.op == "dropout" for _, e, _ in items for x in walk(e))
            and self._gidx_simple(t) is None)
        base = self._loader(t)
        if len(items) == 1:
            name, e, _ = items[0]
            store = f"v_{name}[i] = coconet::from_compute<{ct}>({emit(e, base, self._extra(t))});"
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
            self.emit(f"  coconet::for_each_piece(seg_starts, off, off + {n}, "
                      "[&](size_t s, int64_t a0, int64_t b0, int64_t len) {")
            self.emit("    for (int64_t j = 0; j < len; ++j) {")
            self.emit("      const int64_t i = b0 + j;")
            self.emit(f"      {store}")
            self.emit("    }")
            self.emit("  });")
        else:
            self.emit(f"  const int64_t n = {n};")
            self.emit("  COCONET_PARALLEL_FOR(n)")
            self.emit("  for (int64_t i = 0; i < n; ++i) {")
            if needs_coords:
                self._coords(t)
            self.emit(f"    {store}")
            self.emit("  }")
        self.emit("}")

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

    # --- reductions and tensor operations ---------------------------------------------------
    def _kernel(self, dst: str, e: Op) -> None:
        args = [self._materialize(a, dst) if not isinstance(a, Const) else None for a in e.args]
        ct = CTYPE[e.type.dtype]
        x = args[0]
        xt = self.types[x] if x else None
        if e.op in ("sum", "norm"):
            src = f"p_{x}" if x in self.scattered else f"v_{x}"
            fn = "sum_of" if e.op == "sum" else "sumsq_of"
            n = _prod(self.ldims(xt))
            self.emit(f"{{ double acc = coconet::{fn}({src}, {n});")
            if xt.layout.sliced:
                self.emit("  acc = coconet::allreduce_sum(acc, comm);")
            value = "acc" if e.op == "sum" else "std::sqrt(acc)"
            self.emit(f"  v_{dst}[0] = coconet::from_compute<{ct}>(static_cast<{COMPUTE[e.type.dtype]}>({value})); }}")
        elif e.op == "segment_norm":
            src = f"p_{x}" if x in self.scattered else f"v_{x}"
            self.emit(f"coconet::segment_norm({src}, v_{dst}, {_prod(self.ldims(xt))}, {self.offset(xt)}, "
                      f"seg_starts, {'true' if xt.layout.sliced else 'false'}, comm);")
        elif e.op == "matmul":
            a_t, b_t = self.types[args[0]], self.types[args[1]]
            la, lb = self.ldims(a_t), self.ldims(b_t)
            rows = _prod(la[:-1])
            self.emit(f"coconet::matmul<{ct}>(v_{args[0]}, v_{args[1]}, v_{dst}, {rows}, {la[-1]}, {lb[1]});")
        elif e.op == "layernorm":
            lx = self.ldims(xt)
            eps = e.args[3]
            eps_s = literal(eps.value, "f64") if isinstance(eps, Const) else f"double(coconet::to_compute(v_{eps.name}[0]))"
            self.emit(f"coconet::layernorm<{ct}>(v_{x}, v_{args[1]}, v_{args[2]}, {eps_s}, "
                      f"{_prod(lx[:-1])}, {lx[-1]}, v_{dst});")
        elif e.op == "conv2d":
            lx, lw = self.ldims(xt), self.ldims(self.types[args[1]])
            s, pad = e.attr("stride", 1), e.attr("padding", 0)
            self.emit(f"coconet::conv2d<{ct}>(v_{x}, v_{args[1]}, v_{dst}, {', '.join(lx)}, "
                      f"{lw[0]}, {lw[2]}, {lw[3]}, {s}, {pad});")
        else:
            raise NotImplementedError(f"cpu backend: {e.op}")

    # --- fused collectives -----------------------------------------------------------------
    def _fused(self, plan: FusedPlan, outputs: dict, in_place: dict) -> None:
        """One fused collective: each chunk of this rank's slice is reduced (fused.h), the
        fusion's computations run on it at once, and gathered values are written straight into
        their slice of the full-size result, which the collective fills in from the others."""
        coll = plan.collective
        self.emit(f"// fused {plan.name}: {', '.join(plan.members)} ({coll.expr.op} + computation"
                  f"{' + allgather' if plan.gather else ''}, chunk by chunk)")
        x = self._materialize(coll.expr.args[0], coll.name)
        xt, ct = self.types[x], CTYPE[coll.type.dtype]
        if plan.gather is not None:
            self._comment(plan.gather)
            self._place(plan.gather, outputs.get(plan.gather.name), in_place.get(plan.gather.name))
        gathered = plan.gather.expr.args[0].name if plan.gather is not None else None
        off = self.offset(coll.type) if coll.type.layout.sliced else "int64_t(0)"
        d0 = coll.type.layout.dim if coll.type.layout.sliced else 0
        o = f"off_{plan.name}"
        self.emit(f"const int64_t {o} = {off} * {_prod(self.gdims(coll.type)[d0 + 1:])};")
        stored = [c for c in plan.computes if self._needed_after(c.name, plan.members)]
        for c in plan.computes:
            self._comment(c)
            self.types[c.name] = c.type
            if c.name == gathered and d0 == 0:
                self.emit(f"  {CTYPE[c.type.dtype]}* const v_{c.name} = v_{plan.gather.name} + {o};"
                          "  // computed in place inside the gathered result")
            elif c in stored:
                self._place(c, outputs.get(c.name), in_place.get(c.name))
            else:
                self.emit(f"  // ({c.name} lives in a register of the fused loop)")
        src = (f"coconet::Segments<const {ct}>(p_{x})" if x in self.scattered
               else f"coconet::Segments<const {ct}>::one(v_{x}, {_prod(self.ldims(xt))})")
        exprs = {c.name: self._scalars_out(c.expr, c.name) for c in plan.computes}
        chunk_names = {coll.name} | {c.name for c in plan.computes}
        self.emit(f"auto compute_{plan.name} = [&](int64_t gb, int64_t ge, const {COMPUTE[coll.type.dtype]}* red) {{")
        # [gb, ge) lies in one row of the [outer, n, inner] view; lo: its first local index
        g = self.gdims(coll.type)
        d = coll.type.layout.dim if coll.type.layout.sliced else 0
        row, inner_d = _prod(g[d:]), _prod(g[d + 1:])
        mine = self.ldims(coll.type)[d] if coll.type.layout.sliced else g[d]
        self.emit(f"  const int64_t row_ = gb / ({row});")
        self.emit(f"  const int64_t lo = row_ * {mine} * {inner_d} + (gb - row_ * ({row})) - {o}, hi = lo + (ge - gb);")
        self.emit(f"  const int64_t off = {off};")
        self.emit("  (void)off; (void)hi;")
        t0 = plan.computes[0].type
        coords = any(self._access(r, c.type) is None for c in plan.computes
                     for r in walk(exprs[c.name]) if isinstance(r, Ref) and r.name not in chunk_names) or (
            any(isinstance(x, Op) and x.op == "dropout" for c in plan.computes for x in walk(exprs[c.name]))
            and self._gidx_simple(t0) is None)
        if coords:
            for k, dim in enumerate(self.ldims(t0)):
                self.emit(f"  const int64_t L{k} = {dim};")
        segmented = any(isinstance(n, Ref) and n.name in self.scattered
                        for c in plan.computes for n in walk(exprs[c.name]))
        if segmented:
            self.emit("  coconet::for_each_piece(seg_starts, gb, ge, [&](size_t s, int64_t a0, int64_t b0, int64_t len) {")
            self.emit("    for (int64_t j = 0; j < len; ++j) {")
            self.emit("      const int64_t i = lo + b0 + j;")
        else:
            self.emit("    for (int64_t i = lo; i < hi; ++i) {")
        if coords:
            self._coords(t0)
        chunk = {coll.name: "red[i - lo]"}
        for c in plan.computes:
            base = self._loader(c.type)
            load = lambda r, base=base: chunk.get(r.name) or base(r)  # noqa: E731
            body = emit(exprs[c.name], load, self._extra(c.type, load))
            self.emit(f"      const {COMPUTE[c.type.dtype]} x_{c.name} = coconet::round_to<{CTYPE[c.type.dtype]}>({body});")
            chunk[c.name] = f"x_{c.name}"
            if c in stored or (c.name == gathered and d0 == 0):
                self.emit(f"      v_{c.name}[i] = coconet::from_compute<{CTYPE[c.type.dtype]}>(x_{c.name});")
            if c.name == gathered and d0 != 0:  # this rank's part, at its global index
                self.emit(f"      v_{plan.gather.name}[gb + (i - lo)] = coconet::from_compute<{CTYPE[c.type.dtype]}>(x_{c.name});")
        self.emit("    }")
        if segmented:
            self.emit("  });")
        self.emit("  };")
        op = _OPS[coll.expr.attr("op")]
        if coll.expr.op == "reducescatter":
            targets = (f"{{coconet::gather_target(v_{plan.gather.name}, {_prod(self.gdims(plan.gather.type))})}}"
                       if plan.gather is not None else "{}")
            self.emit(f"coconet::fused_rs_compute_ag<{ct}>({op}, {src}, "
                      f"coconet::Shape3{{{self._shape3(xt, coll.type.layout.dim)}}}, comm, "
                      f"coconet::fused_chunk_elems(), compute_{plan.name}, {targets});")
        else:
            self.emit(f"coconet::fused_allreduce_compute<{ct}>({op}, {src}, comm, "
                      f"coconet::fused_chunk_elems(), compute_{plan.name});")
        self.types[coll.name] = coll.type

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
        for s in (y, c):
            self._comment(s)
            self._place(s, outputs.get(s.name), in_place.get(s.name))
        ct = CTYPE[y.type.dtype]
        ly, la, lb, lc = (self.ldims(self.types[n]) for n in (y.name, a, b, c.name))
        rows, per_row = ly[0], _prod(ly[1:-1])
        chunk = f"coconet::chunk_range({rows}, {plan.chunks}, i)"
        self.emit(f"coconet::overlap({plan.chunks}, [&](int i) {{")
        self.emit(f"  const coconet::Range r = {chunk};")
        self.emit(f"  coconet::matmul<{ct}>(v_{a} + r.begin * {per_row} * {la[-1]}, v_{b}, "
                  f"v_{y.name} + r.begin * {_prod(ly[1:])}, r.size() * {per_row}, {la[-1]}, {lb[1]});")
        self.emit("}, [&](int i, int channel) {")
        self.emit(f"  const coconet::Range r = {chunk};")
        src, dst = f"v_{y.name} + r.begin * {_prod(ly[1:])}", f"v_{c.name} + r.begin * {_prod(lc[1:])}"
        op = _OPS[c.expr.attr("op")]
        if c.expr.op == "allreduce":
            self.emit(f"  return coconet::start_allreduce({op}, {src}, {dst}, r.size() * {_prod(ly[1:])}, comm, channel);")
        else:
            g, d = self.gdims(y.type), c.type.layout.dim
            self.emit(f"  return coconet::start_reduce_scatter({op}, {src}, {dst}, r.size() * {_prod(g[1:d])}, "
                      f"{g[d]}, {_prod(g[d + 1:])}, comm, channel);")
        self.emit("});")

    # --- collectives ----------------------------------------------------------------------
    def _shape3(self, t: TType, d: int) -> str:
        g = self.gdims(t)
        return f"{_prod(g[:d])}, {g[d]}, {_prod(g[d + 1:])}"

    def _collective(self, dst: str, e: Op, x: str) -> None:
        xt, t = self.types[x], e.type
        op = _OPS.get(e.attr("op"), "")
        n = _prod(self.ldims(xt))
        seg = x in self.scattered
        if e.op == "allreduce":
            if seg:
                ct = CTYPE[t.dtype]
                self.emit(f"coconet::allreduce({op}, p_{x}, coconet::Segments<{ct}>::one(v_{dst}, {n}), comm);")
            else:
                self.emit(f"coconet::allreduce({op}, v_{x}, v_{dst}, {n}, comm);")
        elif e.op == "reducescatter":
            if seg:
                self.emit(f"coconet::reduce_scatter({op}, p_{x}, v_{dst}, comm);")
            else:
                self.emit(f"coconet::reduce_scatter({op}, v_{x}, v_{dst}, {self._shape3(xt, t.layout.dim)}, comm);")
        elif e.op == "allgather":
            self.emit(f"coconet::allgather(v_{x}, v_{dst}, {self._shape3(t, xt.layout.dim)}, comm);")
        elif e.op == "scatter":
            src = self._contiguous(x, xt)
            self.emit(f"coconet::scatter_copy({src}, v_{dst}, {self._shape3(xt, t.layout.dim)}, comm);")
        elif e.op == "broadcast":
            self.emit(f"coconet::broadcast({self._contiguous(x, xt)}, v_{dst}, {n}, {e.attr('root')}, comm);")
        elif e.op == "reduce":
            self.emit(f"coconet::reduce({op}, {self._contiguous(x, xt)}, v_{dst}, {n}, {e.attr('root')}, comm);")
        elif e.op == "send":
            d = "coconet::Direction::next" if e.attr("direction") == "next" else "coconet::Direction::prev"
            self.emit(f"coconet::send_shift({self._contiguous(x, xt)}, v_{dst}, {n}, {d}, comm);")

    def _contiguous(self, x: str, xt: TType) -> str:
        """A pointer to x's elements; a scattered parameter is gathered into a temporary."""
        if x not in self.scattered:
            return f"v_{x}"
        name = self._temp(x, xt)
        self.emit(f"coconet::copy_out(coconet::Segments<const {CTYPE[xt.dtype]}>(p_{x}), 0, "
                  f"{_prod(self.ldims(xt))}, v_{name});")
        return f"v_{name}"


@dataclass
class FusedPlan:
    name: str
    members: tuple[str, ...]
    collective: Stage  # the reducescatter (or allreduce)
    computes: list[Stage]  # pointwise stages on its chunks, in order
    gather: Stage | None  # the allgather of one computed value


def fused_plan(p: Program, fusion, scattered: set[str], low: Lowerer) -> FusedPlan | None:
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
    for s in stages:
        if s.kind == "collective":
            continue
        if not _chunkable_stage(s, first, inside, scattered, low):
            break
        computes.append(s)
        inside[s.name] = None
    if not computes:
        return None
    if gather is not None and gather.expr.args[0].name not in inside:
        gather = None
    done = tuple(inside) + ((gather.name,) if gather is not None else ())
    return FusedPlan(fusion.name, done, first, computes, gather)


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

@dataclass
class OverlapPlan:
    producer: Stage  # a matmul
    collective: Stage  # the allreduce or reducescatter that reads it
    chunks: int


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


def _symbols(d: Dim) -> set[str]:
    from coconetc.ir.types import dim_symbols
    return dim_symbols(d)


def _reads(e: Expr) -> set[str]:
    return {n.name for n in walk(e) if isinstance(n, Ref)}


def lower(p: Program, fn: str, file: str) -> Function:
    return Lowerer(p, fn, file).lower()
