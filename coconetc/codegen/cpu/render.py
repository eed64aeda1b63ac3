"""The CPU backend's renderer: an execution plan (coconetc/plan) becomes the body of one C++
function. Every decision was taken by the planner; this only lays the units out as C++.

Conventions of the generated function (see templates/module.cpp.j2):
  * `comm` is this call's coconet::Comm (group split done), `seg_starts` the scattered
    segments' start offsets, `S_<sym>` the size symbols' values.
  * Every value `x` (parameter, stage or temporary) is a pointer `v_x` to this rank's local
    elements in storage type; a parameter that is still scattered is a Segments object `p_x`.
  * Each unit is preceded by a comment naming the schedule, the unit and its .ccn line.
"""

from __future__ import annotations

from coconetc.codegen.emit import COMPUTE, CTYPE, REDUCE_OP, literal
from coconetc.codegen.cpu.fused import FusedEmitter
from coconetc.codegen.base import Function, RenderBase
from coconetc.ir import ops
from coconetc.codegen.cpu.loops import prod as _prod
from coconetc.plan.units import (Buffer, Collective, Copy, Fused, Library, Loop, Overlap, Plan,
                                 Reduce, Require, Unit)


class CpuRenderer(FusedEmitter):
    """Renders one plan; loops in loops.py, fused collectives and overlap in fused.py."""

    def unit(self, u: Unit) -> None:
        if isinstance(u, Loop):
            self._comment(u.line, f"loop: {', '.join(i.name for i in u.items)}")
            self.render_loop(u)
        elif isinstance(u, Reduce):
            self._comment(u.line, f"reduce {u.dst} = {u.op}({u.src})")
            self._reduce(u)
        elif isinstance(u, Library):
            self._comment(u.line, f"{u.op} {u.dst}")
            self._library(u)
        elif isinstance(u, Collective):
            self._comment(u.line, f"{u.op} {u.dst}")
            self._collective(u)
        elif isinstance(u, Copy):
            self._copy(u)
        elif isinstance(u, Require):
            self.emit(f'coconet::require({u.root} < comm.size, "{u.op}: root {u.root} is not a '
                      f'rank of a group of " + std::to_string(comm.size));')
        elif isinstance(u, Fused):
            self._comment(u.line, f"fused collective {u.name}: {', '.join(u.members)}")
            self.render_fused(u)
        else:
            assert isinstance(u, Overlap)
            self._comment(u.line, f"overlap {u.producer} -> {u.collective}: {u.chunks} chunks along dim {u.dim}")
            self.render_overlap(u)

    # --- buffers --------------------------------------------------------------------------
    def _declare(self, b: Buffer) -> None:
        ct = CTYPE[b.type.dtype]
        if b.kind == "scalar":
            k = len(self.sig.scalars)
            self.sig.scalars.append(b.name)
            src = "iscalars" if b.type.dtype.startswith("i") else "scalars"
            self.emit(f"const {ct} v_{b.name}[1] = {{{ct}(a.{src}[{k}])}};")
        elif b.kind in ("param", "segments"):
            k = len(self.sig.tensors)
            self.sig.tensors.append(b.name)
            if b.kind == "segments":
                self.emit(f"const coconet::Segments<{ct}> p_{b.name} = a.segments<{ct}>({k});")
            else:
                self.emit(f"{ct}* const v_{b.name} = a.tensor<{ct}>({k});")
        elif b.kind == "output":
            self.emit(f"{ct}* const v_{b.name} = a.output<{ct}>({self.sig.outputs.index(b.of)});")
        elif b.kind == "alias":
            self.emit(f"{ct}* const v_{b.name} = v_{b.of};  // updates {b.of} in place")
        elif b.kind == "scratch":
            # kept across calls (per thread): no allocation and no page faults after the first call;
            # the source of a fused collective or an all-reduce in the group's shared window, where
            # the collectives use one, so that the peers read it in place (nothing staged)
            self.nsite += 1
            n = _prod(self.ldims(b.type))
            if b.name in self._read_by_collectives():
                self.emit(f"{ct}* const v_{b.name} = coconet::shared_scratch<{ct}, {self.nsite}>(comm, {n});")
            else:
                self.emit(f"{ct}* const v_{b.name} = coconet::scratch<{ct}, {self.nsite}>({n});")
        elif b.kind == "view":
            inner = _prod(self.gdims(b.type)[1:])
            self.emit(f"{ct}* const v_{b.name} = v_{b.of} + {self.offset(b.type)} * {inner};"
                      "  // computed in place inside the gathered result")

    def _read_by_collectives(self) -> set[str]:
        """Buffers a fused collective or an all-reduce of this plan reads (not inside an
        overlap, whose chunks go point to point)."""
        return {u.src for u in self.plan.units
                if isinstance(u, Fused) or (isinstance(u, Collective) and u.op == "allreduce")}

    # --- reductions and library operations ------------------------------------------------
    def _reduce(self, u: Reduce) -> None:
        xt, t = self.types[u.src], self.types[u.dst]
        src = f"p_{u.src}" if u.src in self.scattered else f"v_{u.src}"
        n = _prod(self.ldims(xt))
        if u.op == "segment_norm":
            self.emit(f"coconet::segment_norm({src}, v_{u.dst}, {n}, {self.offset(xt)}, "
                      f"seg_starts, {'true' if u.cross_rank else 'false'}, comm);")
            return
        fn = "sum_of" if u.op == "sum" else "sumsq_of"
        self.emit(f"{{ double acc = coconet::{fn}({src}, {n});")
        if u.cross_rank:
            self.emit("  acc = coconet::allreduce_sum(acc, comm);")
        value = "acc" if u.op == "sum" else "std::sqrt(acc)"
        self.emit(f"  v_{u.dst}[0] = coconet::from_compute<{CTYPE[t.dtype]}>("
                  f"static_cast<{COMPUTE[t.dtype]}>({value})); }}")

    def _library(self, u: Library) -> None:
        entry = ops.get(u.op)
        if entry.extern is not None:
            assert entry.extern.cpp is not None, u.op  # declare() requires it
            self.emit(extern_call(self, u, entry.extern.cpp.function) + ";")
            return
        ct = CTYPE[self.types[u.dst].dtype]
        x = u.args[0]
        xt = self.types[x]
        if u.op == "matmul":
            la, lb = self.ldims(xt), self.ldims(self.types[u.args[1]])
            self.emit(f"coconet::matmul<{ct}>(v_{x}, v_{u.args[1]}, v_{u.dst}, {_prod(la[:-1])}, {la[-1]}, {lb[1]});")
        elif u.op == "layernorm":
            lx, attrs = self.ldims(xt), dict(u.attrs)
            eps = (literal(float(attrs["eps"]), "f64") if "eps" in attrs  # type: ignore[arg-type]
                   else f"double(coconet::to_compute(v_{u.args[3]}[0]))")
            self.emit(f"coconet::layernorm<{ct}>(v_{x}, v_{u.args[1]}, v_{u.args[2]}, {eps}, "
                      f"{_prod(lx[:-1])}, {lx[-1]}, v_{u.dst});")
        else:
            assert u.op == "conv2d", u.op
            lx, lw, attrs = self.ldims(xt), self.ldims(self.types[u.args[1]]), dict(u.attrs)
            self.emit(f"coconet::conv2d<{ct}>(v_{x}, v_{u.args[1]}, v_{u.dst}, {', '.join(lx)}, "
                      f"{lw[0]}, {lw[2]}, {lw[3]}, {attrs['stride']}, {attrs['padding']});")

    # --- collectives ----------------------------------------------------------------------
    def _collective(self, u: Collective) -> None:
        x, dst = u.src, u.dst
        xt, t = self.types[x], self.types[dst]
        op = REDUCE_OP.get(u.reduce, "")
        n = _prod(self.ldims(xt))
        seg = x in self.scattered
        if u.packed:
            self.emit(f"coconet::copy_out(coconet::Segments<const {CTYPE[xt.dtype]}>(p_{x}), 0, {n}, v_{u.packed});")
            x, seg = u.packed, False
        if u.into:
            self.emit(f"coconet::allgather(v_{x}, p_{u.into}, comm);  // straight into {u.into}'s segments")
        elif u.op == "allreduce":
            if seg:
                ct = CTYPE[t.dtype]
                self.emit(f"coconet::allreduce({op}, p_{x}, coconet::Segments<{ct}>::one(v_{dst}, {n}), comm);")
            else:
                self.emit(f"coconet::allreduce({op}, v_{x}, v_{dst}, {n}, comm);")
        elif u.op == "reducescatter":
            if seg:
                self.emit(f"coconet::reduce_scatter({op}, p_{x}, v_{dst}, comm);")
            else:
                self.emit(f"coconet::reduce_scatter({op}, v_{x}, v_{dst}, {self.shape3(xt, t.layout.dim)}, comm);")
        elif u.op == "allgather":
            self.emit(f"coconet::allgather(v_{x}, v_{dst}, {self.shape3(t, xt.layout.dim)}, comm);")
        elif u.op == "scatter":
            self.emit(f"coconet::scatter_copy(v_{x}, v_{dst}, {self.shape3(xt, t.layout.dim)}, comm);")
        elif u.op == "broadcast":
            self.emit(f"coconet::broadcast(v_{x}, v_{dst}, {n}, {u.root}, comm);")
        elif u.op == "reduce":
            self.emit(f"coconet::reduce({op}, v_{x}, v_{dst}, {n}, {u.root}, comm);")
        else:
            assert u.op == "send", u.op
            d = "coconet::Direction::next" if u.direction == "next" else "coconet::Direction::prev"
            self.emit(f"coconet::send_shift(v_{x}, v_{dst}, {n}, {d}, comm);")

    def _copy(self, u: Copy) -> None:
        n = _prod(self.ldims(self.types[u.src]))
        if u.what == "output":
            ct = CTYPE[self.types[u.src].dtype]
            self.emit(f"std::copy_n(v_{u.src}, {n}, a.output<{ct}>({self.sig.outputs.index(u.dst)}));")
        elif u.dst in self.scattered:
            self.emit(f"coconet::copy_in(v_{u.src}, p_{u.dst}, 0, {n});  // update {u.dst}")
        else:
            self.emit(f"std::copy_n(v_{u.src}, {n}, v_{u.dst});  // update {u.dst}")


def extern_call(r: RenderBase, u: Library, function: str, extra: tuple[str, ...] = ()) -> str:
    """An extern operation's call (docs/language.md, "Extern operations"): each tensor
    operand as a pointer to this rank's elements, each 0-d operand as a value of the result's
    compute type, then the result's pointer and its local shape as rows x last dim."""
    t = r.types[u.dst]
    ct = COMPUTE[t.dtype]
    consts, names = dict(dict(u.attrs)["consts"]), iter(u.args)  # type: ignore[call-overload]
    args = []
    for i in range(len(ops.get(u.op).params)):
        if i in consts:
            args.append(f"static_cast<{ct}>({literal(consts[i], 'f64')})")
            continue
        a = next(names)
        scalar = r.types[a].ndim == 0
        args.append(f"static_cast<{ct}>(coconet::to_compute(v_{a}[0]))" if scalar else f"v_{a}")
    dims = r.ldims(t)
    rows, cols = (_prod(dims[:-1]), dims[-1]) if dims else ("int64_t(1)", "int64_t(1)")
    return f"{function}({', '.join([*args, f'v_{u.dst}', rows, cols, *extra])})"


def render(plan: Plan, fn: str, file: str, outputs: list[str]) -> Function:
    return CpuRenderer(plan, fn, file, outputs).render()
