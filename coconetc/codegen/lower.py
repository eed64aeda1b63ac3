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

from coconetc.codegen.emit import COMPUTE, CTYPE, REDUCE_OP, literal
from coconetc.errors import CompileError
from coconetc.codegen.loops import LoopEmitter, prod as _prod
from coconetc.codegen.schedules import (FusedPlan, OverlapPlan, ScheduleEmitter, execution_order,
                                        fused_plan, overlap_plan, reads as _reads)
from coconetc.ir import printer
from coconetc.ir.nodes import COLLECTIVES, POINTWISE, Const, Expr, Op, Program, Ref, Stage, walk
from coconetc.ir.types import Dim, DimExpr, TType, dim_symbols



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


class Lowerer(LoopEmitter, ScheduleEmitter):
    """Lowers one program; the loop and schedule emitters are in loops.py and schedules.py."""

    def __init__(self, p: Program, fn: str, file: str):
        self.p, self.fn, self.file = p, fn, file
        self.lines: list[str] = []
        self.types: dict[str, TType] = {q.name: q.type for q in p.params}
        self.scattered = {q.name for q in p.params if q.scattered}
        self.ntemp = 0
        self.nsite = 0  # allocation sites, each with its own buffer kept across calls
        self.consts: dict[str, str] = {}  # hoisted scalar constants: name -> C++ name
        self.seg_inplace: dict[str, str] = {}  # allgather stage -> scattered parameter it fills
        self.sig = Signature(sizes=sorted({s for q in p.params for d in q.type.shape
                                           for s in dim_symbols(d)}))

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
        self.in_fused = {n for u in units for n in (u.members if isinstance(u, FusedPlan) else
                                                     u.fused.members if isinstance(u, OverlapPlan) and u.fused else ())}
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
        overlaps = {o.producer: self._overlap_plan(o) for o in self.p.overlaps}
        consumers = {pl.collective.name for pl in overlaps.values() if pl is not None}
        planned: set[str] = set()
        for s in self.order:
            if s.name in done:
                continue
            if overlaps.get(s.name) is not None:
                ov = overlaps[s.name]
                fusion = self.p.fusion_of(ov.collective.name)
                ov.fused = fused_plan(self.p, fusion, self.scattered, self, rows_ok=False) if fusion else None
                if fusion:
                    planned.add(fusion.name)
                units.append(ov)
                done.update((s.name, ov.collective.name, *(ov.fused.members if ov.fused else ())))
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

    def _overlap_plan(self, o) -> OverlapPlan:
        plan = overlap_plan(self.p, o)
        if plan is None:  # say so, rather than run it unoverlapped under the schedule's name
            raise CompileError.at(o.span, "overlap: the CPU backend chunks a matmul along dim 0 of its "
                                  "result (a batch or row dim) into an allreduce or a reducescatter "
                                  f"along another dim; here dim={o.dim} into '{o.consumer}'")
        return plan

    def _chainable(self, s: Stage) -> bool:
        return (s.kind == "compute" and s.type.ndim > 0 and all(not isinstance(n, Op) or n.op in POINTWISE for n in walk(s.expr))
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
                if self._gathers_only_into(src) or self._segment_store(src, t):
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

    def _segment_store(self, src: str, t: str) -> bool:
        """A pointwise stage whose value is only the update of a scattered parameter (read, if
        at all, at the element it writes) can store straight into the parameter's segments."""
        s = self.p.stage(src)
        return (s.kind == "compute" and s.type.ndim == 1 and not s.type.layout.sliced
                and not self.p.users(src) and src not in self.in_fused
                and self._reads_elementwise_only(s, t))

    def _reads_elementwise_only(self, s: Stage, t: str) -> bool:
        """Does s read t only at the element it writes? Non-pointwise parts (norms, matmuls)
        are computed before the loop, so what they read does not count."""
        if t not in _reads(s.expr):
            return True
        if s.kind != "compute" or (isinstance(s.expr, Op) and s.expr.op not in POINTWISE):
            return False
        return all(r.type.shape == s.type.shape and r.type.layout == s.type.layout
                   for r in _pointwise_refs(s.expr) if r.name == t)

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
        if s.name in self.seg_inplace and s.kind == "collective":
            t, x = self.seg_inplace[s.name], self._materialize(e.args[0], s.name)
            self.types[s.name] = s.type
            self.emit(f"coconet::allgather(v_{x}, p_{t}, comm);  // straight into {t}'s segments")
            return
        if s.name in self.seg_inplace:
            self.types[s.name] = s.type
            self.emit(f"// {s.name} is stored straight into {self.seg_inplace[s.name]}'s segments")
            self._loop(s.name, s.type, self._hoist(e, s.name), seg_dst=self.seg_inplace[s.name])
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
        self.nsite += 1
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

    # --- collectives ----------------------------------------------------------------------
    def _shape3(self, t: TType, d: int) -> str:
        g = self.gdims(t)
        return f"{_prod(g[:d])}, {g[d]}, {_prod(g[d + 1:])}"

    def _collective(self, dst: str, e: Op, x: str) -> None:
        xt, t = self.types[x], e.type
        op = REDUCE_OP.get(e.attr("op"), "")
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


def _pointwise_refs(e: Expr) -> list[Ref]:
    """References in the pointwise part of an expression (not inside a hoisted operation)."""
    if isinstance(e, Ref):
        return [e]
    if isinstance(e, Op) and e.op in POINTWISE:
        return [r for a in e.args for r in _pointwise_refs(a)]
    return []


def lower(p: Program, fn: str, file: str) -> Function:
    return Lowerer(p, fn, file).lower()
