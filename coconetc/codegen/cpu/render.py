"""The CPU backend's renderer: an execution plan (coconetc/plan) becomes the body of one C++
function. Every decision was taken by the planner; this only lays the units out as C++: the
buffers' declarations here, each unit through codegen/dispatch.py to loops.py, collectives.py,
fused.py and overlap.py (and reductions, library operations and copies here).

Conventions of the generated function (see templates/module.cpp.j2):
  * `comm` is this call's coconet::Comm (group split done), `seg_starts` the scattered
    segments' start offsets, `S_<sym>` the size symbols' values.
  * Every value `x` (parameter, stage or temporary) is a pointer `v_x` to this rank's local
    elements in storage type; a parameter that is still scattered is a Segments object `p_x`.
  * Each unit is preceded by a comment naming the schedule, the unit and its .ccn line.
"""

from __future__ import annotations

from coconetc.codegen import dispatch, library_calls
from coconetc.codegen.base import Function, Writer, prod as _prod
from coconetc.codegen.cpu.collectives import collective, start_allgather
from coconetc.codegen.cpu.fused import CpuFused
from coconetc.codegen.cpu.loops import CpuLoops
from coconetc.codegen.cpu.overlap import CpuOverlap
from coconetc.codegen.emit import COMPUTE, CTYPE, cbool, literal
from coconetc.codegen.extern import extern_call
from coconetc.codegen.indexing import Indexing
from coconetc.codegen.reductions import reduction
from coconetc.ir import ops
from coconetc.plan.attention import unwritten
from coconetc.plan.colsums import fused_sums
from coconetc.plan.lngrads import carried
from coconetc.plan.epilogue import accumulates, fused_loop, residual_only
from coconetc.ir.rng_keys import site_key
from coconetc.plan.units import (Attention, Buffer, Collective, Copy, Fused, GatherMatmul, Library, Loop, Overlap, Plan,
                                 Reduce, Require, StartGather, Unit)


class CpuRenderer:
    """Renders one plan: the parts below share the function's Writer."""

    LOOP, COLLECTIVE = "loop", ""

    def __init__(self, plan: Plan, fn: str, file: str, outputs: list[str]):
        self.w = Writer(plan, fn, file, outputs)
        self.idx = Indexing(self.w, "p_{x}.ptrs[s][a0 + j]")
        self.loops = CpuLoops(self.w, self.idx)
        self.fusion = CpuFused(self.w, self.idx, self.loops, self.unit)
        self.overlaps = CpuOverlap(self.w, self.fusion, self.unit)
        self.fused_loop: Loop | None = None
        self.fused_by = ""  # the operation whose call renders fused_loop
        self.colsums = fused_sums(plan.units, "cpu")  # sum_leads the loops compute (plan/colsums.py)
        self.lngrads = carried(plan.units, "cpu")  # what layernorm_dx calls compute beside dx (plan/lngrads.py)
        self.attention = {id(plan.units[i]): (a, i == a.members[-1])
                          for a in plan.attention if "cpu" in a.fused for i in a.members}
        # the values only an attention call's members compute, which the call does not write: no memory
        self.inside = {n for a in plan.attention if "cpu" in a.fused for n in unwritten(plan.units, self.w.buffers, a)}
        self.started: list[str] = []  # the prefetched gathers in flight (StartGather)

    def render(self) -> Function:
        return dispatch.function(self.w, self._declare, self._top, self._reshape_check,
                                 mark="coconet::trace::Unit trace_{k}({k});")

    def _top(self, u: Unit) -> None:
        """A unit of the function's body; while prefetched gathers are in flight (started, not
        yet waited for), each is tested after it, so that MPI moves it between the units."""
        self.unit(u)
        if isinstance(u, Collective) and u.prefetched:
            self.started.remove(u.dst)
        for name in self.started:
            if not (isinstance(u, StartGather) and u.gather.dst == name):
                self.w.emit(f"pf_{name}->test();  // the prefetched gather of {name}, in flight")

    def _reshape_check(self, u: Library) -> None:
        """A reshape's check of its sizes alone (x == y: no copy), before the units run."""
        args = library_calls.call_args(self.w, u)
        ct = CTYPE[self.w.types[u.dst].dtype]
        self.w.emit(f"coconet::reshape<{ct}>({', '.join([args[1], *args[1:]])});  // {u.dst}'s check")

    def unit(self, u: Unit) -> None:
        if u is self.fused_loop:  # rendered by its matmul or its row-wise call (epilogue)
            self.fused_loop = None
            by = self.fused_by if residual_only(self.fused_by) else "matmul"
            self.w.emit(f"// loop {', '.join(i.name for i in u.items)}: the epilogue of the {by} above")
            return
        if id(u) in self.attention:
            a, last = self.attention[id(u)]
            what = ", ".join(i.name for i in u.items) if isinstance(u, Loop) else getattr(u, "dst", "")
            self.w.emit(f"// {what}: part of the {a.kind} attention call (plan: attention)")
            if last:
                self._attention(a)
            return
        dispatch.unit(self.w, self, u)

    def _attention(self, a: Attention) -> None:
        """A causal attention core as one call (Plan.attention; runtime_cpp/coconet/attention.h)."""
        w = self.w
        ts = w.types[a.scores]
        ct = CTYPE[ts.dtype]
        ld, gd = w.ldims(ts), w.gdims(ts)
        if ts.layout.sliced:  # a leading dim sliced across the ranks (heads): dropout's global index
            dd = ts.layout.dim
            index = f"{ld[dd]}, {gd[dd]}, {w.offset(ts)}, {_prod(ld[dd + 1:-2])}"
        else:
            index = "1, 1, 0, 1"

        def number(x: str, default: str) -> str:
            if not x:
                return default
            if x.startswith("1/"):  # a division by the scale (plan/attention.py _scaled)
                return f"1.0 / {number(x[2:], default)}"
            return f"double(coconet::to_compute(v_{x}[0]))" if x in w.types else literal(float(x), "f64")

        def ptr(x: str) -> str:
            return f"v_{x}" if x else f"static_cast<{ct}*>(nullptr)"
        seed = f"int64_t(v_{a.seed}[0])" if a.seed in w.types else f"int64_t({a.seed or 0})"
        sizes = f"{_prod(ld[:-2])}, {ld[-2]}, {ld[-1]}, {w.ldims(w.types[a.q])[-1]}, {w.ldims(w.types[a.v])[-1]}"
        tail = (f"{sizes}, int64_t({a.diagonal}), {number(a.scale, '1.0')}, {number(a.drop_p, '0.0')}, {seed}, "
                f"{site_key(a.site) if a.drop_p else 0}u /* {a.site} */, coconet::AttentionIndex{{{index}}}")
        if a.kind == "forward":
            w.emit(f"coconet::attention_fwd<{ct}>(v_{a.q}, v_{a.k}, v_{a.v}, v_{a.o}, {ptr(a.s)}, {ptr(a.w)}, "
                   f"{ptr(a.p)}, {ptr(a.a)}, {tail});")
        else:
            w.emit(f"coconet::attention_bwd<{ct}>(v_{a.q}, v_{a.k}, v_{a.v}, {ptr(a.s_in)}, {ptr(a.p_in)}, "
                   f"{ptr(a.a_in)}, v_{a.g}, v_{a.dq}, v_{a.dk}, v_{a.dv}, {tail}, {cbool(a.a_whole)}, {cbool(a.p_whole)});")

    def loop(self, u: Loop) -> None:
        self.loops.render_loop(u)

    def collective(self, u: Collective) -> None:
        if u.prefetched:  # started by its StartGather: wait for it
            self.w.emit(f"pf_{u.dst}->wait();")
            self.w.emit(f"pf_{u.dst}.reset();")
            return
        collective(self.w, u)

    def start_gather(self, u: StartGather) -> None:
        """A weight's all-gather started without blocking (a schedule's prefetch), on channel 1 of
        the group (MPI matches the non-blocking collectives of a communicator in the order every
        rank starts them, which is the plan's)."""
        self.w.emit(f"std::unique_ptr<coconet::Task> pf_{u.gather.dst} = {start_allgather(self.w, u.gather)}")
        self.started.append(u.gather.dst)

    def require(self, u: Require) -> None:
        self.w.emit(f'coconet::require({u.root} < comm.size, "{u.op}: root {u.root} is not a '
                  f'rank of a group of " + std::to_string(comm.size));')

    def fused(self, u: Fused) -> None:
        self.fusion.render_fused(u)

    def overlap(self, u: Overlap) -> None:
        self.overlaps.render_overlap(u)

    def gather_matmul(self, u: GatherMatmul) -> None:
        self.overlaps.render_gather_matmul(u)

    # --- buffers --------------------------------------------------------------------------
    def _declare(self, b: Buffer) -> None:
        ct = CTYPE[b.type.dtype]
        if dispatch.declare(self.w, b):  # output, alias, view
            return
        if b.kind == "scalar":
            self.w.emit(f"const {ct} v_{b.name}[1] = {{{ct}({self.w.scalar_arg(b.name, b.type.dtype)})}};")
        elif b.kind == "segments":
            self.w.emit(f"const coconet::Segments<{ct}> p_{b.name} = a.segments<{ct}>({self.w.tensor_arg(b.name)});")
        elif b.kind == "param":
            self.w.emit(f"{ct}* const v_{b.name} = a.tensor<{ct}>({self.w.tensor_arg(b.name)});")
        elif b.kind == "scratch" and b.name in self.inside:
            self.w.emit(f"{ct}* const v_{b.name} = nullptr;  // inside the attention call only: no memory")
        elif b.kind == "scratch":
            # kept across calls (per thread): no allocation and no page faults after the first call;
            # where the plan places it in the group's shared window (Buffer.shared: the source of
            # a fused collective or an all-reduce), the peers read it in place (nothing staged)
            self.w.nsite += 1
            n = _prod(self.w.ldims(b.type))
            dispatch.declare_scratch(self.w, b, f"coconet::shared_scratch<{ct}, {self.w.nsite}>(comm, {n})" if b.shared
                                     else f"coconet::scratch<{ct}, {self.w.nsite}>({n})")

    # --- reductions and library operations ------------------------------------------------
    def reduce(self, u: Reduce) -> None:
        xt, t = self.w.types[u.src], self.w.types[u.dst]
        src = f"p_{u.src}" if u.src in self.w.scattered else f"v_{u.src}"
        n = _prod(self.w.ldims(xt))
        r = reduction(u.op)
        if r.per_segment:
            self.w.emit(f"coconet::segment_norm({src}, v_{u.dst}, {n}, {self.w.offset(xt)}, "
                      f"seg_starts, {'true' if u.cross_rank else 'false'}, comm);")
            return
        self.w.emit(f"{{ double acc = coconet::{r.partial}({src}, {n});")
        # across ranks when over slices, and across the calls of a batch (batch.h); a max, and a
        # min as the max of its negation, NaN propagating
        cross = "true" if u.cross_rank else "false"
        if r.extreme:
            self.w.emit(f"  acc = {r.sign}coconet::reduce_extreme({r.sign}acc, {cross}, comm);")
        else:
            self.w.emit(f"  acc = coconet::reduce_partial(acc, {cross}, comm);")
        self.w.emit(f"  v_{u.dst}[0] = coconet::from_compute<{CTYPE[t.dtype]}>("
                  f"static_cast<{COMPUTE[t.dtype]}>({r.finished('acc')})); }}")

    def library(self, u: Library) -> None:
        entry = ops.get(u.op)
        if entry.extern is not None:
            assert entry.extern.cpp is not None, u.op  # declare() requires it
            self.w.emit(extern_call(self.w, u, entry.extern.cpp.function) + ";")
            return
        ct = CTYPE[self.w.types[u.dst].dtype]
        if self._epilogue(u, ct):
            return
        if u.accumulate:  # (grad.h: C += the product, C the accumulator's place)
            self.w.emit(f"coconet::{u.op}_acc<{ct}>({', '.join(library_calls.call_args(self.w, u))});  "
                        f"// added into {u.dst}'s place in the accumulator")
            return
        if u.op == "sum_lead" and u.dst in self.colsums:
            self.w.emit(f"// {u.dst}: summed by the loop that computes {u.args[0]} (plan: column sums)")
            return
        if u.dst in self.lngrads:
            self.w.emit(f"// {u.dst}: computed by {self.lngrads[u.dst]}'s layernorm_dx (plan: layernorm gradients)")
            return
        if u.op == "layernorm_dx" and u.grads is not None and "cpu" in u.grads.on:
            self.w.emit(f"coconet::layernorm_dx_grads<{ct}>({', '.join(self._with_grads(u, library_calls.call_args(self.w, u)))});")
            return
        if u.op in library_calls.OPS:  # gemm.h, kernels.h, grad.h
            self.w.emit(f"coconet::{u.op}<{ct}>({', '.join(library_calls.call_args(self.w, u))});")
            return
        assert u.op == "layernorm", u.op
        x = u.args[0]
        lx, attrs = self.w.ldims(self.w.types[x]), dict(u.attrs)
        eps = (literal(float(attrs["eps"]), "f64") if "eps" in attrs  # type: ignore[arg-type]
               else f"double(coconet::to_compute(v_{u.args[3]}[0]))")
        self.w.emit(f"coconet::layernorm<{ct}>(v_{x}, v_{u.args[1]}, v_{u.args[2]}, {eps}, "
                  f"{_prod(lx[:-1])}, {lx[-1]}, v_{u.dst});")

    @staticmethod
    def _with_grads(u: Library, args: list[str]) -> list[str]:
        """A layernorm_dx call's arguments (x, gamma, g, dx, eps, ...) with the dgamma and dbeta
        it carries after dx (grad.h layernorm_dx_grads; nullptr for one it does not)."""
        assert u.grads is not None
        extra = [f"v_{n}" if n else "nullptr" for n in (u.grads.dgamma, u.grads.dbeta)]
        return [*args[:4], *extra, *args[4:]]

    def _epilogue(self, u: Library, ct: str) -> bool:
        """A matmul whose plan fuses its epilogue on the CPU (Library.fused, plan/epilogue.py) and
        the loop after it, as one blocked pass (CpuLoops.render_epilogue); False when it is
        rendered as two units."""
        if "cpu" not in u.fused:
            return False
        loop = fused_loop(self.w.plan.units, u)
        if loop is None:
            return False
        if residual_only(u.op):  # residual(r): the call writes the loop's value, r added to each row
            args = library_calls.rowwise_args(self.w, u, loop)
            if u.grads is not None and "cpu" in u.grads.on:
                self.w.emit(f"coconet::{u.op}_grads<{ct}>({', '.join(self._with_grads(u, args))});  "
                            f"// {u.dst}, then {u.epilogue}")
            else:
                self.w.emit(f"coconet::{u.op}<{ct}>({', '.join(args)});  // {u.dst}, then {u.epilogue}")
            self.fused_loop, self.fused_by = loop, u.op
            return True
        if accumulates(u, loop, self.w.buffers):
            assert u.epilogue is not None  # (C += the GEMM: beta = 1 into the updated parameter)
            acc = [f"v_{u.epilogue.operand}" if a == f"v_{u.dst}" else a for a in library_calls.call_args(self.w, u)]
            self.w.emit(f"coconet::{u.op}_acc<{ct}>({', '.join(acc)});  // {u.epilogue.value} = "
                        f"{u.epilogue.operand} + {u.dst}, in place")
            self.fused_loop, self.fused_by = loop, u.op
            return True
        args = library_calls.call_args(self.w, u)  # A, B, C, M, K, N
        k, n = args[4], args[5]
        gemm = (f"coconet::matmul<{ct}>({args[0]} + r0 * ({k}), {args[1]}, {args[2]} + r0 * ({n}), "
                f"rn, {k}, {n});")
        self.loops.render_epilogue(loop, gemm, args[3], n)
        self.fused_loop, self.fused_by = loop, u.op
        return True

    def copy(self, u: Copy) -> None:
        n = _prod(self.w.ldims(self.w.types[u.src]))
        if u.what == "output":
            ct = CTYPE[self.w.types[u.src].dtype]
            self.w.emit(f"std::copy_n(v_{u.src}, {n}, a.output<{ct}>({self.w.sig.outputs.index(u.dst)}));")
        elif u.dst in self.w.scattered:
            self.w.emit(f"coconet::copy_in(v_{u.src}, p_{u.dst}, 0, {n});  // update {u.dst}")
        else:
            self.w.emit(f"std::copy_n(v_{u.src}, {n}, v_{u.dst});  // update {u.dst}")


def render(plan: Plan, fn: str, file: str, outputs: list[str]) -> Function:
    return CpuRenderer(plan, fn, file, outputs).render()
