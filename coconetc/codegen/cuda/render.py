"""The CUDA renderer: the same execution plan (coconetc/plan) the CPU renderer lays out as C++
becomes CUDA C++ host code around kernels, NCCL and cuBLAS calls: the buffers' declarations
here, each unit through codegen/dispatch.py to loops.py (kernels), collectives.py, fused.py and
overlap.py (and reductions, library operations and copies here). It decides nothing: the plan
says what the CUDA backend does not implement (plan/targets.py; `unsupported(plan)` in
support.py reads it, `coconetc check --backend cuda` reports it at the directive), and rendering
such a plan is a bug (an assertion).

Conventions of the generated function (templates/module.cu.j2): `ctx` is the call's context
(coconet::cuda::Ctx: communicators, the call's stream and a comm stream), `comm` its Group
(size, rank; captured by kernels), `S_<sym>` the size symbols; every value `x` is a device
pointer `v_x` (scalars: a coconet::cuda::Scalar, indexable as v_x[0] on host and device).
A Loop is one grid-stride kernel (an extended __device__ lambda over the element index) whose
body is the element math of codegen/emit.py, the text the CPU loops use."""

from __future__ import annotations

from coconetc.codegen import dispatch, library_calls
from coconetc.codegen.base import Function, Writer, prod as _prod
from coconetc.codegen.cuda.collectives import collective
from coconetc.codegen.cuda.fused import CudaFused
from coconetc.codegen.cuda.loops import CudaKernels
from coconetc.codegen.cuda.notes import Notes
from coconetc.codegen.cuda.overlap import CudaOverlap
from coconetc.codegen.emit import CTYPE, literal
from coconetc.codegen.extern import extern_call
from coconetc.codegen.indexing import Indexing
from coconetc.codegen.reductions import reduction
from coconetc.ir import ops
from coconetc.plan.colsums import fused_sums
from coconetc.plan.epilogue import fused_loop, residual_only
from coconetc.plan.units import (Buffer, Collective, Copy, Fused, GatherMatmul, Library, Loop, Overlap, Plan, Reduce,
                                 Require, StartGather, Unit)


class CudaRenderer:
    """Renders one plan: the parts below share the function's Writer."""

    LOOP, COLLECTIVE = "kernel", " (NCCL)"

    def __init__(self, plan: Plan, fn: str, file: str, outputs: list[str]):
        self.w = Writer(plan, fn, file, outputs)
        self.idx = Indexing(self.w, "sp_{x}[q]")  # this piece of its segment
        self.notes = Notes(self.w, self.idx)
        self.kernels = CudaKernels(self.w, self.idx, self.notes)
        self.fusion = CudaFused(self.w, self.idx, self.kernels, self.notes, self.unit)
        self.overlaps = CudaOverlap(self.w, self.fusion, self.notes, self.unit)
        self.seg_declared = False
        self.fused_loop: Loop | None = None
        self.fused_by = ""  # the operation whose call renders fused_loop
        # the sum_leads a later matmul_tn computes as its bias-gradient epilogue (plan/epilogue.py)
        self.bgrad_sums = {u.epilogue.value for u in plan.units if isinstance(u, Library) and u.epilogue
                           and u.epilogue.kind == "bgrad" and "cuda" in u.fused}
        self.colsums = fused_sums(plan.units, "cuda")  # the sum_leads loops compute (plan/colsums.py)
        self.started: dict[str, int] = {}  # the prefetched gathers in flight on the comm stream: their marks

    def render(self) -> Function:
        assert not self.w.plan.unsupported("cuda"), self.w.plan.unsupported("cuda")  # generate() leaves those out
        return dispatch.function(self.w, self._declare, self.unit, self._reshape_check,
                                 mark="coconet::cuda::trace::Unit trace_{k}({k}, stream);")

    def _reshape_check(self, u: Library) -> None:
        """A reshape's check of its sizes alone (x == y: no copy), before the units run."""
        args = library_calls.call_args(self.w, u)
        ct = CTYPE[self.w.types[u.dst].dtype]
        self.w.emit(f"coconet::cuda::reshape<{ct}>({', '.join([args[1], *args[1:]])}, ctx);  // {u.dst}'s check")

    def unit(self, u: Unit) -> None:
        if u is self.fused_loop and residual_only(self.fused_by):  # rendered by its row-wise call (epilogue)
            self.fused_loop = None
            self.w.emit(f"// kernel {', '.join(i.name for i in u.items)}: the epilogue of the {self.fused_by} above")
            return
        if u is self.fused_loop:  # rendered by its matmul (epilogue)
            self.fused_loop = None
            self.w.emit(f"// kernel {', '.join(i.name for i in u.items)}: the epilogue of the cublasLtMatmul above "
                        "(or, where cuBLASLt refuses it, run there after the GEMM)")
            return
        dispatch.unit(self.w, self, u)

    def loop(self, u: Loop) -> None:
        self.kernels.render_loop(u)

    def collective(self, u: Collective) -> None:
        if u.prefetched:  # started by its StartGather on the comm stream: the call's stream waits for it
            self.w.emit(f"coconet::cuda::wait_mark({self.started.pop(u.dst)}, ctx.stream);  // {u.dst} has arrived")
            return
        self._after_prefetches()
        collective(self.w, u)

    def _after_prefetches(self) -> None:
        """Before an NCCL call on the call's stream, while prefetched gathers are in flight on
        the comm stream: the call's stream waits for them first, so that the NCCL calls of the
        communicator run in the order every rank issues them, one stream after the other (two
        NCCL kernels of one communicator on two streams may otherwise wait for each other)."""
        for dst, mark in self.started.items():
            self.w.emit(f"coconet::cuda::wait_mark({mark}, ctx.stream);  // the prefetched gather of {dst} first")

    def copy(self, u: Copy) -> None:
        n = _prod(self.w.ldims(self.w.types[u.src]))
        ct = CTYPE[self.w.types[u.src].dtype]
        dst = f"a.output<{ct}>({self.w.sig.outputs.index(u.dst)})" if u.what == "output" else f"v_{u.dst}"
        if u.dst in self.w.scattered:
            self.w.emit(f"coconet::cuda::copy_in<{ct}>(v_{u.src}, p_{u.dst}, {n}, ctx);  // {u.what} {u.dst}")
            return
        self.w.emit(f"coconet::cuda::copy<{ct}>(v_{u.src}, {dst}, {n}, ctx);  // {u.what} {u.dst}")

    def require(self, u: Require) -> None:
        self.w.emit(f'coconet::cuda::require({u.root} < comm.size, "{u.op}: root {u.root} is not a '
                  f'rank of a group of " + std::to_string(comm.size));')

    def fused(self, u: Fused) -> None:
        self._after_prefetches()
        self.fusion.render_fused(u)

    def overlap(self, u: Overlap) -> None:
        self.overlaps.render_overlap(u)

    def gather_matmul(self, u: GatherMatmul) -> None:
        self.overlaps.render_gather_matmul(u)

    def start_gather(self, u: StartGather) -> None:
        """A prefetched weight gather (plan/prefetch.py): NCCL on the comm stream once the call's
        stream has queued what its source needs, marked there; the call's stream waits for the
        mark at the gather's place (collective above), and computes meanwhile."""
        start, mark = self.w.site(), self.w.site()
        self.w.emit("{")
        self.w.emit(f"  coconet::cuda::join(ctx.stream, ctx.comm_stream, {start});  // its source is ready")
        self.w.emit("  coconet::cuda::Ctx pctx = ctx;  // the gather on the comm stream")
        self.w.emit("  pctx.stream = ctx.comm_stream;")
        self.w.emit("  auto gather = [&](const coconet::cuda::Ctx& ctx) {")
        n = len(self.w.lines)
        collective(self.w, u.gather)
        self.w.lines[n:] = [f"    {line}" for line in self.w.lines[n:]]
        self.w.emit("  };")
        self.w.emit("  gather(pctx);")
        self.w.emit(f"  coconet::cuda::mark(ctx.comm_stream, {mark});  // {u.gather.dst}: in flight until its wait")
        self.w.emit("}")
        self.started[u.gather.dst] = mark

    # --- buffers --------------------------------------------------------------------------
    def _declare(self, b: Buffer) -> None:
        ct = CTYPE[b.type.dtype]
        if dispatch.declare(self.w, b):  # output, alias, view
            if b.kind == "output":
                self.notes.name(f"v_{b.name}", _prod(self.w.ldims(b.type)), b.name, caller=True)
            return
        if b.kind == "scalar":
            self.w.emit(f"const coconet::cuda::Scalar<{ct}> v_{b.name}{{{ct}({self.w.scalar_arg(b.name, b.type.dtype)})}};")
        elif b.kind == "param":
            self.w.emit(f"{ct}* const v_{b.name} = a.tensor<{ct}>({self.w.tensor_arg(b.name)});")
            self.notes.name(f"v_{b.name}", _prod(self.w.ldims(b.type)), b.name, caller=True)
        elif b.kind == "segments":
            k = self.w.tensor_arg(b.name)
            if not self.seg_declared:
                self.w.emit("const std::vector<int64_t> seg_starts = coconet::segment_starts(a.seg_sizes);")
                self.seg_declared = True
            self.w.emit(f"const coconet::Segments<{ct}> p_{b.name} = a.segments<{ct}>({k});")
            self.w.emit(f"for (size_t s = 0; s < p_{b.name}.ptrs.size(); ++s)")
            self.w.emit(f'  COCONET_PARAM(p_{b.name}.ptrs[s], size_t(p_{b.name}.sizes[s]) * sizeof({ct}), "{b.name}", '
                        "stream);")
        elif b.kind == "into" or "cuda" in b.unallocated:  # no memory of its own (the plan)
            self.w.emit(f"// {b.name}: straight into {b.of}'s segments" if b.kind == "into" else
                        f"// {b.name}: not needed, the collective reads the segments piece by piece")
        elif b.kind == "scratch":
            dispatch.declare_scratch(self.w, b, f"coconet::cuda::scratch<{ct}>({self.w.site()}, "
                                     f"{_prod(self.w.ldims(b.type))})")
            self.notes.name(f"v_{b.name}", _prod(self.w.ldims(b.type)), b.name)
        elif b.kind == "chunks":
            self.w.emit(f"// {b.name}: only as packed chunks of its overlap")
        else:
            assert b.kind == "register", b.kind

    # --- reductions and library operations ------------------------------------------------
    def reduce(self, u: Reduce) -> None:
        xt, t = self.w.types[u.src], self.w.types[u.dst]
        assert xt.dtype == t.dtype, u  # else a gap of the plan on cuda (plan/targets.py)
        r = reduction(u.op)
        if r.per_segment:
            src = f"p_{u.src}" if u.src in self.w.scattered else f"v_{u.src}"
            self.w.emit(f"coconet::cuda::segment_norm<{CTYPE[xt.dtype]}>({src}, v_{u.dst}, {_prod(self.w.ldims(xt))}, "
                      f"{self.w.offset(xt)}, seg_starts, {'true' if u.cross_rank else 'false'}, ctx, {self.w.site()});")
            return
        # scattered: a kernel per piece; a max or min NaN propagating, the ranks' parts combined by one ncclMax
        src = f"p_{u.src}" if u.src in self.w.scattered else f"v_{u.src}"
        self.w.emit(f"coconet::cuda::{r.cuda('reduce', CTYPE[xt.dtype])}({src}, v_{u.dst}, "
                  f"{_prod(self.w.ldims(xt))}, {'true' if u.cross_rank else 'false'}, ctx, {self.w.site()});")

    def library(self, u: Library) -> None:
        entry = ops.get(u.op)
        if entry.extern is not None:  # the declared host function, on the call's stream
            assert entry.extern.cuda is not None, u.op  # unsupported() says so first
            self.w.emit(extern_call(self.w, u, entry.extern.cuda.function, ("stream",)) + ";")
            return
        ct = CTYPE[self.w.types[u.dst].dtype]
        if self._epilogue(u, ct):
            return
        if u.op in library_calls.OPS:  # runtime.cuh, grad.cuh
            last = "stream" if ops.has(u.op, ops.GEMM) else "ctx"
            op = f"{u.op}_acc" if u.accumulate else u.op  # (grad.cuh: C += the product, the accumulator's place)
            self.w.emit(f"coconet::cuda::{op}<{ct}>({', '.join(library_calls.call_args(self.w, u))}, {last});")
            return
        assert u.op == "layernorm", u.op
        x = u.args[0]
        lx, attrs = self.w.ldims(self.w.types[x]), dict(u.attrs)
        if "eps" in attrs:
            eps = literal(float(attrs["eps"]), "f64")  # type: ignore[arg-type]
        elif self.w.plan.buffer(u.args[3]).kind == "scalar":  # a scalar parameter (on the host)
            eps = f"double(coconet::to_compute(v_{u.args[3]}[0]))"
        else:  # a computed 0-d value, read on the device by the kernel
            eps = f"v_{u.args[3]}"
        self.w.emit(f"coconet::cuda::layernorm<{ct}>(v_{x}, v_{u.args[1]}, v_{u.args[2]}, {eps}, "
                  f"{_prod(lx[:-1])}, {lx[-1]}, v_{u.dst}, ctx);")


    def _epilogue(self, u: Library, ct: str) -> bool:
        """A matmul whose plan fuses its epilogue on CUDA (Library.fused, plan/epilogue.py) and the
        loop after it, as one cublasLtMatmul (blas.cuh matmul_epilogue) writing the loop's value;
        a matmul_tn with a bias-gradient epilogue as one (grad.cuh matmul_tn_bgrad), its
        sum_lead as nothing; False when they are rendered as two units."""
        if u.op == "sum_lead" and u.dst in self.bgrad_sums:
            self.w.emit(f"// {u.dst}: the bias-gradient epilogue of the cublasLtMatmul of a matmul_tn below")
            return True
        if u.op == "sum_lead" and u.dst in self.colsums:
            self.w.emit(f"// {u.dst}: summed by the loop that computes {u.args[0]} (plan: column sums)")
            return True
        if "cuda" not in u.fused:
            return False
        assert u.epilogue is not None
        if u.epilogue.kind == "bgrad":  # C = A^T B, and the column sums of B into the sum_lead's value
            args = library_calls.call_args(self.w, u)  # A, B, C, M, K, N
            db = u.epilogue.value
            acc = ", true" if u.accumulate else ""  # (C += the product: the accumulator's place)
            self.w.emit(f"coconet::cuda::matmul_tn_bgrad<{ct}>({', '.join(args)}, v_{db}, ctx{acc});  "
                        f"// {u.dst} = matmul_tn, then {u.epilogue}")
            return True
        loop = fused_loop(self.w.plan.units, u)
        if loop is None:
            return False
        if residual_only(u.op):  # residual(r): the call writes the loop's value, r added to each row
            args = library_calls.rowwise_args(self.w, u, loop)
            self.w.emit(f"coconet::cuda::{u.op}<{ct}>({', '.join([*args[:-1], 'ctx', args[-1]])});  "
                        f"// {u.dst}, then {u.epilogue}")
            self.fused_loop, self.fused_by = loop, u.op
            return True
        kind, operand = u.epilogue.kind, u.epilogue.operand
        bias, c, alpha = "nullptr", "nullptr", "1.0f"
        if kind == "bias":
            bias = f"v_{operand}"
        elif kind == "residual":
            c = f"v_{operand}"
        else:
            assert kind == "scale", u.epilogue
            alpha = (f"float(coconet::to_compute(v_{operand}[0]))" if operand in self.w.types
                     else f"float({operand})")  # a scalar parameter (on the host), or a literal
        args = library_calls.call_args(self.w, u)  # A, B, C, M, K, N
        a, b, _, m, k, n = args
        self.w.emit(f"if (!coconet::cuda::matmul_epilogue<{ct}>({a}, {b}, v_{loop.items[0].name}, {m}, {k}, {n}, "
                    f"{bias}, {c}, {alpha}, stream)) {{  // {u.dst} = matmul, then {u.epilogue}")
        # where cuBLASLt has no such GEMM: the GEMM, then the loop (its lets declared in here only)
        self.w.emit(f"  coconet::cuda::matmul<{ct}>({', '.join(args)}, stream);")
        consts, at = dict(self.w.consts), len(self.w.lines)
        self.kernels.render_loop(loop)
        self.w.consts = consts
        self.w.lines[at:] = [f"  {line}" for line in self.w.lines[at:]]
        self.w.emit("}")
        self.fused_loop, self.fused_by = loop, u.op
        return True


def render(plan: Plan, fn: str, file: str, outputs: list[str]) -> Function:
    return CudaRenderer(plan, fn, file, outputs).render()
