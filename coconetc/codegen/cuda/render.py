"""The CUDA renderer: the same execution plan (coconetc/plan) the CPU renderer lays out as C++
becomes CUDA C++ host code around kernels, NCCL and cuBLAS calls. It decides nothing: units it
does not implement yet are listed by `unsupported(plan)`, which `coconetc check --backend cuda`
reports at the directive, and rendering one raises.

Conventions of the generated function (templates/module.cu.j2): `ctx` is the call's context
(coconet::cuda::Ctx: communicators, the call's stream and a comm stream), `comm` its Group
(size, rank; captured by kernels), `S_<sym>` the size symbols; every value `x` is a device
pointer `v_x` (scalars: a coconet::cuda::Scalar, indexable as v_x[0] on host and device).
A Loop is one grid-stride kernel (an extended __device__ lambda over the element index) whose
body is the element math of codegen/emit.py, the text the CPU loops use."""

from __future__ import annotations

from coconetc.codegen.base import Function, prod as _prod
from coconetc.codegen.emit import COMPUTE, CTYPE, literal
from coconetc.codegen.cuda.kernels import Kernel, KernelEmitter, Outs
from coconetc.codegen.cpu.render import extern_call
from coconetc.ir import ops
from coconetc.ir.nodes import Const, Expr, Op, Ref, walk
from coconetc.ir.types import TType
from coconetc.plan.units import (Buffer, Collective, Copy, Fused, Let, Library, Loop, Overlap, Plan,
                                 Reduce, Require, Unit)

NCCL_OP = {"sum": "ncclSum", "avg": "ncclAvg", "prod": "ncclProd", "max": "ncclMax", "min": "ncclMin"}


class Unsupported(Exception):
    """A plan unit the CUDA renderer does not implement yet (line: its .ccn line)."""

    def __init__(self, line: int, what: str):
        super().__init__(what)
        self.line, self.what = line, what


def unsupported(plan: Plan) -> list[Unsupported]:
    """What of this plan the CUDA renderer cannot render yet, one entry per unit."""
    out: list[Unsupported] = []
    kinds = {b.name: b.kind for b in plan.buffers}
    ndims = {b.name: b.type.ndim for b in plan.buffers}
    scattered = {b.name for b in plan.buffers if b.kind == "segments"}

    def unit(u: Unit) -> None:
        if isinstance(u, Overlap) and u.fused is not None:
            f = u.fused
            if not u.direct or (f.op == "reducescatter" and f.type.layout.dim == 0) or f.src != u.producer:
                out.append(Unsupported(u.line, "overlap into a fused collective other than an all-reduce or a "
                                               "reduce-scatter along a dim other than 0 fed by rows of the matmul "
                                               "is not in the CUDA backend yet"))
            else:
                unit(f)
        elif isinstance(u, Library) and ops.get(u.op).extern is not None:
            out.extend(_extern_problems(u, kinds, ndims))
        elif isinstance(u, Collective) and u.src in scattered and u.op == "allgather":  # (the CPU's neither)
            out.append(Unsupported(u.line, f"an allgather of a sliced scattered tensor ('{u.src}') is not in the "
                                           "CUDA backend yet"))
        elif isinstance(u, Fused):
            out.extend(_fused_problems(u, kinds))
            for a in u.after:
                unit(a)
    for u in plan.units:
        unit(u)
    return out


def _units(units: tuple[Unit, ...]) -> list[Unit]:
    """The units and those that run after a fused collective's chunks, in order."""
    return [x for u in units for x in [u, *(_units(u.after) if isinstance(u, Fused) else [])]]


def _extern_problems(u: Library, kinds: dict[str, str], ndims: dict[str, int]) -> list[Unsupported]:
    ext = ops.get(u.op).extern
    assert ext is not None
    if ext.cuda is None:
        return [Unsupported(u.line, f"extern operation '{u.op}' declares no cuda implementation "
                                    "('cuda = \"header\", \"function\"')")]
    computed = [a for a in u.args if ndims.get(a) == 0 and kinds.get(a) != "scalar"]
    if computed:
        return [Unsupported(u.line, f"a computed 0-d operand ('{computed[0]}') of extern operation "
                                    f"'{u.op}' is not in the CUDA backend yet (it lives on the device)")]
    return []


def _fused_problems(u: Fused, kinds: dict[str, str]) -> list[Unsupported]:
    for p in u.phases:
        if p.kind != "rows":
            continue
        x = p.items[0].expr.args[0] if isinstance(p.items[0].expr, Op) else None
        if (not isinstance(x, Ref) or (x.name != u.collective and kinds.get(x.name) in (None, "register"))
                or u.type.layout.dim == u.type.ndim - 1):
            return [Unsupported(u.line, "a row-wise phase reading a value kept in registers, or sliced along "
                                        "its rows, is not in the CUDA backend yet")]
    if kinds.get(u.collective) not in ("register", "scratch", "output", "alias"):
        return [Unsupported(u.line, f"a fused collective whose reduced value is '{kinds.get(u.collective)}' is "
                                    "not in the CUDA backend yet")]
    return []


class CudaRenderer(KernelEmitter):
    def __init__(self, plan: Plan, fn: str, file: str, outputs: list[str]):
        super().__init__(plan, fn, file, outputs)
        self.nevent = 0
        self.seg_declared = False
        self.unpacked = {c.packed for c in _units(plan.units) if isinstance(c, Collective) and c.packed}

    def site(self) -> int:
        self.nsite += 1
        return self.nsite

    def render(self) -> Function:
        problems = unsupported(self.plan)
        if problems:
            raise problems[0]
        return super().render()

    def unit(self, u: Unit) -> None:
        if isinstance(u, Loop):
            self._comment(u.line, f"kernel: {', '.join(i.name for i in u.items)}")
            self._loop(u.type, u.lets, [(i.name, i.expr, i.store) for i in u.items], u.seg_dst)
        elif isinstance(u, Reduce):
            self._comment(u.line, f"reduce {u.dst} = {u.op}({u.src})")
            self._reduce(u)
        elif isinstance(u, Library):
            self._comment(u.line, f"{u.op} {u.dst}")
            self._library(u)
        elif isinstance(u, Collective):
            self._comment(u.line, f"{u.op} {u.dst} (NCCL)")
            self._collective(u)
        elif isinstance(u, Copy):
            n = _prod(self.ldims(self.types[u.src]))
            ct = CTYPE[self.types[u.src].dtype]
            dst = f"a.output<{ct}>({self.sig.outputs.index(u.dst)})" if u.what == "output" else f"v_{u.dst}"
            if u.dst in self.scattered:
                self.emit(f"coconet::cuda::copy_in<{ct}>(v_{u.src}, p_{u.dst}, {n}, ctx);  // {u.what} {u.dst}")
                return
            self.emit(f"coconet::cuda::copy<{ct}>(v_{u.src}, {dst}, {n}, ctx);  // {u.what} {u.dst}")
        elif isinstance(u, Require):
            self.emit(f'coconet::cuda::require({u.root} < comm.size, "{u.op}: root {u.root} is not a '
                      f'rank of a group of " + std::to_string(comm.size));')
        elif isinstance(u, Fused):
            self._comment(u.line, f"fused collective {u.name}: {', '.join(u.members)}")
            self._fused(u)
        else:
            assert isinstance(u, Overlap)
            self._comment(u.line, f"overlap {u.producer} -> {u.collective}: {u.chunks} chunks along dim {u.dim}")
            self._overlap(u)

    # --- buffers --------------------------------------------------------------------------
    def _declare(self, b: Buffer) -> None:
        ct = CTYPE[b.type.dtype]
        if b.kind == "scalar":
            k = len(self.sig.scalars)
            self.sig.scalars.append(b.name)
            src = "iscalars" if b.type.dtype.startswith("i") else "scalars"
            self.emit(f"const coconet::cuda::Scalar<{ct}> v_{b.name}{{{ct}(a.{src}[{k}])}};")
        elif b.kind == "param":
            k = len(self.sig.tensors)
            self.sig.tensors.append(b.name)
            self.emit(f"{ct}* const v_{b.name} = a.tensor<{ct}>({k});")
            self._name(f"v_{b.name}", _prod(self.ldims(b.type)), b.name, caller=True)
        elif b.kind == "segments":
            k = len(self.sig.tensors)
            self.sig.tensors.append(b.name)
            if not self.seg_declared:
                self.emit("const std::vector<int64_t> seg_starts = coconet::cuda::segment_starts(a.seg_sizes);")
                self.seg_declared = True
            self.emit(f"const coconet::cuda::Segs<{ct}> p_{b.name} = a.segments<{ct}>({k});")
            self.emit(f"for (size_t s = 0; s < p_{b.name}.ptrs.size(); ++s)")
            self.emit(f'  COCONET_PARAM(p_{b.name}.ptrs[s], size_t(p_{b.name}.size(s)) * sizeof({ct}), "{b.name}", '
                      "stream);")
        elif b.kind == "into" or b.name in self.unpacked:  # no memory of its own
            self.emit(f"// {b.name}: straight into {b.of}'s segments" if b.kind == "into" else
                      f"// {b.name}: not needed, the collective reads the segments piece by piece")
        elif b.kind == "output":
            self.emit(f"{ct}* const v_{b.name} = a.output<{ct}>({self.sig.outputs.index(b.of)});")
            self._name(f"v_{b.name}", _prod(self.ldims(b.type)), b.name, caller=True)
        elif b.kind == "alias":
            self.emit(f"{ct}* const v_{b.name} = v_{b.of};  // updates {b.of} in place")
        elif b.kind == "scratch":
            self.emit(f"{ct}* const v_{b.name} = coconet::cuda::scratch<{ct}>({self.site()}, "
                      f"{_prod(self.ldims(b.type))});")
            self._name(f"v_{b.name}", _prod(self.ldims(b.type)), b.name)
        elif b.kind == "view":
            inner = _prod(self.gdims(b.type)[1:])
            self.emit(f"{ct}* const v_{b.name} = v_{b.of} + {self.offset(b.type)} * {inner};"
                      "  // computed in place inside the gathered result")
        elif b.kind == "chunks":
            self.emit(f"// {b.name}: only as packed chunks of its overlap")
        elif b.kind != "register":
            raise Unsupported(b.line, f"buffer kind '{b.kind}' is not in the CUDA backend yet")

    def _name(self, ptr: str, n: str, name: str, caller: bool = False) -> None:
        """The buffer's name for the host emulation's race reports (nothing under nvcc).
        caller: a parameter or output, produced on the call's stream before the call."""
        if caller:
            self.emit(f'COCONET_PARAM({ptr}, size_t({n}) * sizeof(*{ptr}), "{name}", stream);')
        else:
            self.emit(f'COCONET_BUFFER({ptr}, size_t({n}) * sizeof(*{ptr}), "{name}");')

    def _access_note(self, t: TType, items: list[tuple[str, Expr, bool]], lets: tuple[Let, ...], lo: str, hi: str,
                     regs: dict[str, str], indent: str, extra: tuple[str, ...] = (), runs: str = "") -> None:
        """COCONET_ACCESS before a kernel: the element ranges it reads and writes, for the host
        emulation's race detection (expands to nothing under nvcc). Element i of the loop is
        i in [lo, hi); an operand indexed other than by i is read whole."""
        inside = {name for name, _, _ in items} | set(regs)
        spans: dict[str, str] = {}
        refs = [r for _, e, _ in items for r in walk(e) if isinstance(r, Ref)]
        refs += [r for k in lets for r in walk(k.expr) if isinstance(r, Ref)]
        for r in refs:
            if r.name in inside or r.name in self.consts or r.name in spans:
                continue
            kind = next((b.kind for b in self.plan.buffers if b.name == r.name), None)
            if kind in (None, "scalar", "register"):  # a Let, a scalar on the host, a value in registers
                continue
            idx = self._access(r, t) if any(r is x for _, e, _ in items for x in walk(e)) else "0"
            if idx == "SEG":  # this piece of a segment (a kernel per piece)
                spans[r.name] = f"COCONET_R(sp_{r.name}, 0, pc.size)"
            elif idx == "0":
                spans[r.name] = f"COCONET_R(v_{r.name}, 0, 1)"
            elif idx == "i":
                spans[r.name] = f"COCONET_R(v_{r.name}, {lo}, {hi})"
            elif idx is not None and idx.startswith("i + "):
                o = idx[4:]
                spans[r.name] = f"COCONET_R(v_{r.name}, {o} + {lo}, {o} + {hi})"
            else:
                spans[r.name] = f"COCONET_RA(v_{r.name})"
        out = list(spans.values())
        out += [f"COCONET_R({ptr.split('[')[0].split('(')[-1]}, 0, {hi} - ({lo}))" for ptr in regs.values()]
        out += [f"COCONET_W(v_{name}, {lo}, {hi})" for name, _, stored in items if stored]
        out += extra
        if runs:  # and the spans the runtime lists (a chunk's runs in a gathered value)
            self.emit(f"{indent}COCONET_ACCESS_RUNS({runs}, {', '.join(out)});")
        else:
            self.emit(f"{indent}COCONET_ACCESS({', '.join(out)});")

    # --- kernels --------------------------------------------------------------------------
    def _needs_coords(self, t: TType, items: list[tuple[str, Expr, bool]], skip: set[str]) -> bool:
        refs = [r for _, e, _ in items for r in walk(e) if isinstance(r, Ref) and r.name not in skip]
        return any(self._access(r, t) is None for r in refs) or (
            any(isinstance(x, Op) and x.op == "dropout" for _, e, _ in items for x in walk(e))
            and self._gidx_simple(t) is None)

    def _loader(self, t: TType):
        base = super()._loader(t)

        def load(r: Ref) -> str:
            if r.name not in self.consts and r.name in self.scattered:
                return f"coconet::to_compute(sp_{r.name}[q])"  # this piece of its segment
            return base(r)
        return load

    def _loop(self, t: TType, lets: tuple[Let, ...], items: list[tuple[str, Expr, bool]], seg_dst: str = "") -> None:
        regs = {name for name, _, _ in items}
        segs = sorted({r.name for _, e, _ in items for r in walk(e)
                       if isinstance(r, Ref) and r.name in self.scattered and r.name not in regs} | ({seg_dst} - {""}))
        if segs:
            self._seg_loop(t, lets, items, seg_dst, segs)
            return
        saved = dict(self.consts)
        n = _prod(self.ldims(t))
        coords = self._needs_coords(t, items, {name for name, _, _ in items})
        self._loop_head(t, coords)
        self._access_note(t, items, lets, "0", n, {}, "  ")
        self._kernel(t, Kernel(n), lets, items, coords, "  ")
        self.emit("}")
        self.consts = saved

    def _loop_head(self, t: TType, coords: bool) -> None:
        """A loop's block opens with this rank's slice offset and, when the body needs
        coordinates, the local extent of each dim."""
        self.emit("{")
        self.emit(f"  const int64_t off = {self.offset(t)};  // this rank's slice offset")
        self.emit("  (void)off;")
        if coords:
            for k, d in enumerate(self.ldims(t)):
                self.emit(f"  const int64_t L{k} = {d};")

    def _seg_loop(self, t: TType, lets: tuple[Let, ...], items: list[tuple[str, Expr, bool]], seg_dst: str,
                  segs: list[str]) -> None:
        """A loop reading (or, seg_dst, storing into) scattered tensors: one kernel per piece of
        this rank's logical range inside one segment (as the CPU loop's pieces), each scattered
        operand read through its piece's pointer sp_<x>[q]; element i = pc.offset + q."""
        saved = dict(self.consts)
        n = _prod(self.ldims(t))
        coords = self._needs_coords(t, items, {name for name, _, _ in items})
        if seg_dst:  # the single item is stored into seg_dst's segments, not into a buffer of its own
            assert len(items) == 1, items
            items = [(items[0][0], items[0][1], False)]
        self._loop_head(t, coords)
        self.emit(f"  for (const coconet::cuda::Piece& pc : coconet::cuda::pieces(seg_starts, off, off + {n})) {{")
        self.emit("  const int64_t b0 = pc.offset;")
        for x in segs:
            self.emit(f"  {CTYPE[self.types[x].dtype]}* const sp_{x} = p_{x}.at(pc);")
        self._access_note(t, items, lets, "b0", "b0 + pc.size", {}, "  ",
                          (f"COCONET_W(sp_{seg_dst}, 0, pc.size)",) if seg_dst else ())
        outs: Outs = {items[0][0]: [(f"sp_{seg_dst}[q]", f"sp_{seg_dst}")]} if seg_dst else {}
        self._kernel(t, Kernel("pc.size", "q", ("const int64_t i = b0 + q;",), "b0", outs=outs), lets, items, coords,
                     "  ")
        self.emit("  }")
        self.emit("}")
        self.consts = saved

    # --- reductions and library operations ------------------------------------------------
    def _reduce(self, u: Reduce) -> None:
        xt, t = self.types[u.src], self.types[u.dst]
        if xt.dtype != t.dtype:
            raise Unsupported(u.line, "a reduction whose result dtype differs from its input's")
        if u.op == "segment_norm":
            src = f"p_{u.src}" if u.src in self.scattered else f"v_{u.src}"
            self.emit(f"coconet::cuda::segment_norm<{CTYPE[xt.dtype]}>({src}, v_{u.dst}, {_prod(self.ldims(xt))}, "
                      f"{self.offset(xt)}, seg_starts, {'true' if u.cross_rank else 'false'}, ctx, {self.site()});")
            return
        norm = "true" if u.op == "norm" else "false"
        src = f"p_{u.src}" if u.src in self.scattered else f"v_{u.src}"  # scattered: a kernel per piece
        self.emit(f"coconet::cuda::reduce_sum<{CTYPE[xt.dtype]}, {norm}>({src}, v_{u.dst}, "
                  f"{_prod(self.ldims(xt))}, {'true' if u.cross_rank else 'false'}, ctx, {self.site()});")

    def _library(self, u: Library) -> None:
        entry = ops.get(u.op)
        if entry.extern is not None:  # the declared host function, on the call's stream
            assert entry.extern.cuda is not None, u.op  # unsupported() says so first
            self.emit(extern_call(self, u, entry.extern.cuda.function, ("stream",)) + ";")
            return
        ct = CTYPE[self.types[u.dst].dtype]
        x = u.args[0]
        xt = self.types[x]
        if u.op == "matmul":
            la, lb = self.ldims(xt), self.ldims(self.types[u.args[1]])
            self.emit(f"coconet::cuda::matmul<{ct}>(v_{x}, v_{u.args[1]}, v_{u.dst}, {_prod(la[:-1])}, "
                      f"{la[-1]}, {lb[1]}, stream);")
        elif u.op == "layernorm":
            lx, attrs = self.ldims(xt), dict(u.attrs)
            if "eps" in attrs:
                eps = literal(float(attrs["eps"]), "f64")  # type: ignore[arg-type]
            elif self.plan.buffer(u.args[3]).kind == "scalar":  # a scalar parameter (on the host)
                eps = f"double(coconet::to_compute(v_{u.args[3]}[0]))"
            else:  # a computed 0-d value, read on the device by the kernel
                eps = f"v_{u.args[3]}"
            self.emit(f"coconet::cuda::layernorm<{ct}>(v_{x}, v_{u.args[1]}, v_{u.args[2]}, {eps}, "
                      f"{_prod(lx[:-1])}, {lx[-1]}, v_{u.dst}, ctx);")
        else:
            assert u.op == "conv2d", u.op
            lx, lw, attrs = self.ldims(xt), self.ldims(self.types[u.args[1]]), dict(u.attrs)
            self.emit(f"coconet::cuda::conv2d<{ct}>(v_{x}, v_{u.args[1]}, v_{u.dst}, {', '.join(lx)}, "
                      f"{lw[0]}, {lw[2]}, {lw[3]}, {attrs['stride']}, {attrs['padding']}, ctx);")

    # --- collectives ----------------------------------------------------------------------
    def _collective(self, u: Collective) -> None:
        x, dst = u.src, u.dst
        xt, t = self.types[x], self.types[dst]
        ct = CTYPE[xt.dtype]
        op = NCCL_OP.get(u.reduce, "")
        n = _prod(self.ldims(xt))
        if u.into:
            self.emit(f"coconet::cuda::allgather<{ct}>(v_{x}, p_{u.into}, {_prod(self.gdims(xt))}, ctx);"
                      f"  // straight into {u.into}'s segments")
        elif x in self.scattered:  # NCCL (or a copy) per segment / piece, grouped
            self._collective_segs(u, ct, op, n)
        elif u.op == "allreduce":
            self.emit(f"coconet::cuda::allreduce<{ct}>({op}, v_{x}, v_{dst}, {n}, ctx);")
        elif u.op == "reducescatter":
            self.emit(f"coconet::cuda::reduce_scatter<{ct}>({op}, v_{x}, v_{dst}, {self.shape3(xt, t.layout.dim)}, ctx);")
        elif u.op == "allgather":
            self.emit(f"coconet::cuda::allgather<{ct}>(v_{x}, v_{dst}, {self.shape3(t, xt.layout.dim)}, ctx);")
        elif u.op == "scatter":
            self.emit(f"coconet::cuda::scatter_copy<{ct}>(v_{x}, v_{dst}, {self.shape3(xt, t.layout.dim)}, ctx);")
        elif u.op == "broadcast":
            self.emit(f"coconet::cuda::broadcast<{ct}>(v_{x}, v_{dst}, {n}, {u.root}, ctx);")
        elif u.op == "reduce":
            self.emit(f"coconet::cuda::reduce<{ct}>({op}, v_{x}, v_{dst}, {n}, {u.root}, ctx);")
        else:
            assert u.op == "send", u.op
            nxt = "true" if u.direction == "next" else "false"
            self.emit(f"coconet::cuda::send_shift<{ct}>(v_{x}, v_{dst}, {n}, {nxt}, ctx);")

    def _collective_segs(self, u: Collective, ct: str, op: str, n: str) -> None:
        """A collective of a scattered tensor, one NCCL call (or copy) per piece of its segments,
        into the contiguous result: the plan's packed temporary is not needed (never filled)."""
        x, dst = u.src, u.dst
        if u.op == "allreduce":
            self.emit(f"coconet::cuda::allreduce<{ct}>({op}, p_{x}, v_{dst}, ctx);")
        elif u.op == "reducescatter":
            self.emit(f"coconet::cuda::reduce_scatter<{ct}>({op}, p_{x}, v_{dst}, {n}, ctx);")
        elif u.op == "broadcast":
            self.emit(f"coconet::cuda::broadcast<{ct}>(p_{x}, v_{dst}, {n}, {u.root}, ctx);")
        elif u.op == "reduce":
            self.emit(f"coconet::cuda::reduce<{ct}>({op}, p_{x}, v_{dst}, {n}, {u.root}, ctx);")
        elif u.op == "scatter":
            self.emit(f"coconet::cuda::scatter_copy<{ct}>(p_{x}, v_{dst}, {n}, ctx);")
        else:
            assert u.op == "send", u.op
            nxt = "true" if u.direction == "next" else "false"
            self.emit(f"coconet::cuda::send_shift<{ct}>(p_{x}, v_{dst}, {n}, {nxt}, ctx);")

    # --- fused collectives ----------------------------------------------------------------
    def _fused(self, u: Fused, block: tuple[str, str] | None = None) -> None:
        """Chunks of this rank's part of the reduced value: the reduction of chunk k+1 on the
        comm stream while chunk k's kernel runs on the call's stream, then chunk k's gather on
        the comm stream after an event (coconet::cuda::pipeline). block: only the rows
        [row0, row1) of dim 0 (an overlap's chunk; the collective is sliced along d != 0, so they
        are one contiguous range of this rank's part)."""
        t = u.type
        xt = self.types[u.src]
        ct = CTYPE[t.dtype]
        op = NCCL_OP[u.reduce]
        g = self.gdims(xt)
        d = t.layout.dim if u.op == "reducescatter" else 0
        outer = _prod(g[:d])
        if u.op == "reducescatter":
            n0, inner = g[d], _prod(g[d + 1:])
        else:  # an allreduce: one "slice" of everything
            n0, inner = _prod(g), "int64_t(1)"
        nm = u.name
        mine = _prod(self.ldims(t))
        direct = u.src not in self.scattered  # one rank: each chunk's kernel can read the source itself
        if block is None and self._symmetric_ok(u):
            self._fused_symmetric(u, ct, op, n0, inner, mine)
        self.emit("{")
        rows_arg = self._fused_extent(u, block, outer, n0, inner, mine)
        self._chunk_size(u, direct)
        self.emit(f"  const int64_t chunks_{nm} = (most_{nm} + ch_{nm} - 1) / ch_{nm};")
        nred = f"ch_{nm}"
        if direct:
            nred = f"nred_{nm}"
            self.emit(f"  const int64_t nred_{nm} = comm.size == 1 ? 0 : ch_{nm};  // one rank: no chunk buffers")
        self.emit(f"  {ct}* const red0_{nm} = coconet::cuda::scratch<{ct}>({self.site()}, {nred});")
        self.emit(f"  {ct}* const red1_{nm} = coconet::cuda::scratch<{ct}>({self.site()}, {nred});")
        self._name(f"red0_{nm}", nred, f"red0 (chunk buffer 0 of fused {nm})")
        self._name(f"red1_{nm}", nred, f"red1 (chunk buffer 1 of fused {nm})")
        self._reduce_to(u, ct, op, d, outer, n0, inner, rows_arg)
        self.emit(f"  auto compute = [&](int64_t k, {ct}* red) {{")
        self.emit(f"    const int64_t lo = base_{nm} + k * ch_{nm}, hi = std::min(lo + ch_{nm}, mine_{nm});")
        self.emit("    if (hi <= lo) return;")
        self._chunk_kernel(u)
        self.emit("  };")
        if u.gather and d != 0:
            gg = self.gdims(self.types[u.gather])
            self.emit(f"  auto gather = [&](int64_t k) {{ coconet::cuda::gather_chunk<{ct}>(v_{u.gather}, "
                      f"{_prod(gg[:d])}, {gg[d]}, {_prod(gg[d + 1:])}, k, ch_{nm}, ctx{rows_arg}); }};")
        elif u.gather:
            self.emit(f"  auto gather = [&](int64_t k) {{ coconet::cuda::gather_chunk<{ct}>(v_{u.gather}, "
                      f"{self.gdims(self.types[u.gather])[0]}, {_prod(self.gdims(self.types[u.gather])[1:])}, "
                      f"k, ch_{nm}, ctx); }};")
        else:
            self.emit("  auto gather = [&](int64_t) {};")
        if self.plan.buffer(u.collective).kind != "register":  # the reduced value is kept
            self.emit(f"  auto keep = [&](int64_t k, {ct}* red) {{ const int64_t lo = base_{nm} + k * ch_{nm}; "
                      f"coconet::cuda::copy<{ct}>(red, v_{u.collective} + lo, std::min(ch_{nm}, mine_{nm} - lo), ctx); }};")
            self.emit("  auto compute_keep = [&](int64_t k, auto* red) { keep(k, red); compute(k, red); };")
            fn = "compute_keep"
        else:
            fn = "compute"
        if direct:
            self.emit(f"  auto source = [&](int64_t k) {{ return v_{u.src} + base_{nm} + k * ch_{nm}; }};"
                      "  // one rank: chunk k's own elements")
        self.emit(f"  coconet::cuda::pipeline<{ct}>(chunks_{nm}, red0_{nm}, red1_{nm}, ctx, {self.site() * 8}, "
                  f"reduce_to, {fn}, gather{', source' if direct else ''});")
        self.emit("}")
        for a in u.after if block is None else ():  # an overlap's block: after every block (_overlap_fused)
            self.unit(a)

    def _fused_extent(self, u: Fused, block: tuple[str, str] | None, outer: str, n0: str, inner: str,
                      mine: str) -> str:
        """base_/mine_/most_<name>: where this rank's part (or the overlap block's rows of it)
        starts and ends, and the elements of the largest part (every rank takes part in every
        chunk's reduction: as many chunks as the largest slice). Returns the rows argument of
        the block's gather (empty without a block)."""
        nm = u.name
        if block is None:
            self.emit(f"  const int64_t base_{nm} = 0;")
            self.emit(f"  const int64_t mine_{nm} = {mine};")
            self.emit(f"  (void)base_{nm};")
            if u.op == "reducescatter":
                self.emit(f"  const int64_t most_{nm} = {outer} * coconet::slice_chunk({n0}, comm.size) * {inner};")
            else:
                self.emit(f"  const int64_t most_{nm} = mine_{nm};")
            return ""
        per = _prod(self.ldims(u.type)[1:])
        self.emit(f"  const int64_t base_{nm} = {block[0]} * {per};  // this block of rows of this rank's part")
        self.emit(f"  const int64_t mine_{nm} = {block[1]} * {per};")
        if u.op == "reducescatter":
            self.emit(f"  const int64_t most_{nm} = ({block[1]} - {block[0]}) * coconet::slice_chunk({n0}, "
                      f"comm.size) * {inner};")
        else:  # an all-reduce: this block's elements
            self.emit(f"  const int64_t most_{nm} = mine_{nm} - base_{nm};")
        self.emit(f"  (void)base_{nm};")
        return f", {block[0]}, {block[1]}"

    def _chunk_size(self, u: Fused, direct: bool) -> None:
        """ch_<name>: COCONET_CUDA_CHUNK or 2^22 elements (whole rows for a row-wise phase); on
        one rank, when the chunks read the source directly, all of them (nothing to overlap)."""
        nm = u.name
        whole = f"comm.size == 1 ? most_{nm} : 0" if direct else ""
        if u.rows is not None:  # chunks of whole rows (a row-wise phase)
            rows = self.gdims(u.type)[-1]
            self.emit(f"  const int64_t ch_{nm} = (coconet::cuda::chunk_elems({whole}) + {rows} - 1) / {rows} * {rows};")
        else:
            self.emit(f"  const int64_t ch_{nm} = coconet::cuda::chunk_elems({whole});")
    def _symmetric_ok(self, u: Fused) -> bool:
        """Can this fused unit also run as one kernel over symmetric memory (symmetric.cuh)? A
        reduce-scatter along dim 0 of a contiguous tensor, pointwise phases only."""
        refs = {r.name for p in u.phases for i in p.items for r in walk(i.expr) if isinstance(r, Ref)}
        return (u.op == "reducescatter" and u.type.layout.dim == 0 and u.rows is None
                and u.reduce in ("sum", "avg", "max", "min") and all(p.kind == "pointwise" for p in u.phases)
                and not ({u.src, u.gather} | refs) & self.scattered)

    def _fused_symmetric(self, u: Fused, ct: str, op: str, n0: str, inner: str, mine: str) -> None:
        """The fused unit as one kernel over NCCL symmetric memory where the run time allows it
        (coconet::cuda::use_symmetric; else the pipeline after it): the element function is the
        pipeline chunk kernel's body, the reduced value passed in (red_v) instead of read from
        the chunk buffer."""
        saved = dict(self.consts)
        t = u.type
        items = [(i.name, i.expr, i.store) for p in u.phases for i in p.items]
        inside = {u.collective} | {name for name, _, _ in items}
        coords = self._needs_coords(t, items, inside)
        self.emit(f'if (coconet::cuda::use_symmetric(ctx, "{u.name}")) {{  // one kernel over symmetric memory')
        self.emit(f"  const int64_t off = {self.offset(t)};")
        self.emit("  (void)off;")
        if coords:
            for k, d in enumerate(self.ldims(t)):
                self.emit(f"  const int64_t L{k} = {d};")
        lets = self._lets(u.lets)
        self._access_note(t, items, u.lets, "0", mine, {}, "  ")
        g = f"v_{u.gather}" if u.gather else f"static_cast<{ct}*>(nullptr)"
        gt = CTYPE[self.types[u.gather].dtype] if u.gather else ct
        keep = f"v_{u.collective}" if self.plan.buffer(u.collective).kind == "scratch" else f"static_cast<{ct}*>(nullptr)"
        self.emit(f"  coconet::cuda::fused_symmetric<{ct}, {gt}>({op}, v_{u.src}, {n0}, {inner}, {g}, {keep}, ctx, "
                  f"[=] __device__ (int64_t i, {ct} red_v) {{")
        for line in lets:
            self.emit(f"    {line}")
        outs = {name: [(f"v_{name}[i]", "")] if stored else [] for name, _, stored in items}
        body = self._body(t, items, {u.collective: "coconet::to_compute(red_v)"}, self._loader(t), outs,
                          lambda target, name: target)
        for line in self._with_coords(t, coords, body):
            self.emit(f"    {line}")
        self.emit("  });")
        self.emit("} else  // the chunked pipeline on the host API")
        self.consts = saved

    def _reduce_to(self, u: Fused, ct: str, op: str, d: int, outer: str, n0: str, inner: str, rows_arg: str) -> None:
        """The pipeline's reduce_to(k, red): chunk k's reduction on the comm stream."""
        nm = u.name
        if u.op == "reducescatter" and u.src in self.scattered:  # NCCL per piece of a segment
            self.emit(f"  auto reduce_to = [&](int64_t k, {ct}* red) {{ coconet::cuda::reduce_chunk<{ct}>({op}, "
                      f"p_{u.src}, red, {n0}, k, ch_{nm}, ctx); }};")
        elif u.op == "reducescatter" and d != 0:  # one ncclReduce per run of each rank's chunk
            self.emit(f"  auto reduce_to = [&](int64_t k, {ct}* red) {{ coconet::cuda::reduce_chunk<{ct}>({op}, "
                      f"v_{u.src}, red, {outer}, {n0}, {inner}, k, ch_{nm}, ctx{rows_arg}); }};")
        elif u.op == "reducescatter":
            self.emit(f"  auto reduce_to = [&](int64_t k, {ct}* red) {{ coconet::cuda::reduce_chunk<{ct}>({op}, "
                      f"v_{u.src}, red, {n0}, {inner}, k, ch_{nm}, ctx); }};")
        elif u.src in self.scattered:  # an all-reduce: NCCL per piece of the chunk inside a segment
            self.emit(f"  auto reduce_to = [&](int64_t k, {ct}* red) {{ coconet::cuda::allreduce_chunk<{ct}>({op}, "
                      f"p_{u.src}, red, mine_{nm}, k, ch_{nm}, ctx); }};")
        else:
            lo = f"base_{nm} + k * ch_{nm}" if rows_arg else f"k * ch_{nm}"  # an overlap's block starts at base_
            self.emit(f"  auto reduce_to = [&](int64_t k, {ct}* red) {{ const int64_t lo = {lo}; "
                      f"coconet::cuda::allreduce<{ct}>({op}, v_{u.src} + lo, red, "
                      f"std::min(ch_{nm}, mine_{nm} - lo), ctx, ctx.comm_stream); }};")

    def _chunk_kernel(self, u: Fused) -> None:
        """The chunk's phases in order: a pointwise phase is one kernel over the chunk's
        elements, a row-wise phase (layernorm) one kernel of a thread per row of the chunk
        (chunks hold whole rows); a value crossing phases is read from its buffer."""
        saved = dict(self.consts)
        t = u.type
        inside = {u.collective} | {i.name for p in u.phases for i in p.items}
        pointwise = [(i.name, i.expr, i.store) for p in u.phases if p.kind == "pointwise" for i in p.items]
        coords = self._needs_coords(t, pointwise, inside)
        self.emit(f"    const int64_t off = {self.offset(t)};")
        self.emit("    (void)off;")
        if coords:
            for k, d in enumerate(self.ldims(t)):
                self.emit(f"    const int64_t L{k} = {d};")
        runs, store = self._gather_store(u)
        for ph in u.phases:
            items = [(i.name, i.expr, i.store) for i in ph.items]
            if ph.kind == "rows":
                self._chunk_rows(u, ph.items[0], runs, bool(store))
            else:
                self._chunk_pointwise(u, items, inside, coords, runs, store)
        self.consts = saved

    def _chunk_pointwise(self, u: Fused, items: list[tuple[str, Expr, bool]], inside: set[str], coords: bool,
                         runs: str, store: Outs) -> None:
        t = u.type
        saved = dict(self.consts)
        segs = sorted({r.name for _, e, _ in items for r in walk(e)
                       if isinstance(r, Ref) and r.name in self.scattered and r.name not in inside})
        if not any(name == u.gathered for name, _, _ in items):
            runs = ""
        if segs:  # a kernel per piece of the chunk inside one segment (element j = pc.offset + q)
            self.emit("    for (const coconet::cuda::Piece& pc : coconet::cuda::pieces(seg_starts, off + lo, off + hi)) {")
            self.emit("    const int64_t b0 = pc.offset;")
            for x in segs:
                self.emit(f"    {CTYPE[self.types[x].dtype]}* const sp_{x} = p_{x}.at(pc);")
            self._access_note(t, items, u.lets, "lo + b0", "lo + b0 + pc.size", {}, "    ",
                              ("COCONET_R(red, b0, b0 + pc.size)",))
            k = Kernel("pc.size", "q", ("const int64_t j = b0 + q;", "const int64_t i = lo + j;"), "lo + b0",
                       {u.collective: ("coconet::to_compute(red[j])", "red + b0")}, store)
        else:
            self._access_note(t, items, u.lets, "lo", "hi", {u.collective: "red"}, "    ", (), runs)
            k = Kernel("hi - lo", "j", ("const int64_t i = lo + j;",), "lo",
                       {u.collective: ("coconet::to_compute(red[j])", "red")}, store)
        self._kernel(t, k, u.lets, items, coords, "    ")
        if segs:
            self.emit("    }")
        self.consts = saved

    def _chunk_rows(self, u: Fused, item, runs: str, gstore: bool) -> None:
        """layernorm over the chunk's whole rows, one thread per row (as the layernorm kernel),
        in the compute type; x is the reduced chunk or a value stored by an earlier phase."""
        assert isinstance(item.expr, Op) and item.expr.op == "layernorm", item
        x, g, b, eps = item.expr.args
        assert isinstance(x, Ref) and isinstance(g, Ref) and isinstance(b, Ref)
        t = self.types[item.name]
        C, T = COMPUTE[t.dtype], CTYPE[t.dtype]
        H = self.ldims(t)[-1]
        eps_s = (literal(float(eps.value), "f64") if isinstance(eps, Const)
                 else f"double(coconet::to_compute(v_{eps.name}[0]))" if isinstance(eps, Ref) else "")

        def X(idx: str) -> str:
            return (f"coconet::to_compute(red[{idx} - lo])" if x.name == u.collective
                    else f"coconet::to_compute(v_{x.name}[{idx}])")
        spans = ["COCONET_R(red, 0, hi - lo)" if x.name == u.collective else f"COCONET_R(v_{x.name}, lo, hi)",
                 f"COCONET_RA(v_{g.name})", f"COCONET_RA(v_{b.name})"]
        if item.store:
            spans.append(f"COCONET_W(v_{item.name}, lo, hi)")
        gathered = gstore and item.name == u.gathered
        if gathered:
            self.emit(f"    COCONET_ACCESS_RUNS({runs}, {', '.join(spans)});")
        else:
            self.emit(f"    COCONET_ACCESS({', '.join(spans)});")
        self.emit(f"    coconet::cuda::launch((hi - lo) / ({H}), stream, [=] __device__ (int64_t q) {{"
                  f"  // layernorm {item.name}, a thread per row")
        self.emit(f"    const int64_t row = lo + q * ({H});")
        self.emit(f"    {C} mean = 0, var = 0;")
        self.emit(f"    for (int64_t c = 0; c < {H}; ++c) mean += {X('row + c')};")
        self.emit(f"    mean /= static_cast<{C}>({H});")
        self.emit(f"    for (int64_t c = 0; c < {H}; ++c) {{ const {C} d = {X('row + c')} - mean; var += d * d; }}")
        self.emit(f"    var /= static_cast<{C}>({H});")
        self.emit(f"    const {C} inv = {C}(1) / std::sqrt(var + static_cast<{C}>({eps_s}));")
        self.emit(f"    for (int64_t c = 0; c < {H}; ++c) {{")
        self.emit("      const int64_t i = row + c;")
        self.emit(f"      const {C} x_{item.name} = coconet::round_to<{T}>(({X('i')} - mean) * inv * "
                  f"coconet::to_compute(v_{g.name}[c]) + coconet::to_compute(v_{b.name}[c]));")
        if item.store:
            self.emit(f"      v_{item.name}[i] = coconet::from_compute<{T}>(x_{item.name});")
        if gathered:
            gg = self.gdims(self.types[u.gather])
            d = u.type.layout.dim
            self.emit(f"      v_{u.gather}[(i / gm_ * {gg[d]} + off) * {_prod(gg[d + 1:])} + i % gm_] = "
                      f"coconet::from_compute<{T}>(x_{item.name});")
        self.emit("    }")
        self.emit("    });")

    def _gather_store(self, u: Fused):
        """A fused reduce-scatter along dim d != 0 that gathers: the chunk kernel stores the
        gathered value at its global place in the gathered buffer (the chunk's runs, declared
        for the race detection), which the chunk's gather then broadcasts in place.
        Returns (the runs' spans, the store: {name: [(target, None)]}), or ("", {})."""
        t = u.type
        d = t.layout.dim if u.op == "reducescatter" else 0
        if not u.gather or d == 0:
            return "", {}
        gg = self.gdims(self.types[u.gather])
        gn, ginner = gg[d], _prod(gg[d + 1:])
        self.emit(f"    const int64_t gm_ = {self.ldims(t)[d]} * {ginner};  // this rank's part of one outer index")
        runs = (f"coconet::cuda::runs_w(v_{u.gather}, {_prod(gg[:d])}, {gn}, {ginner}, "
                f"coconet::slice_range({gn}, comm.size, comm.rank), lo, hi)")
        return runs, {u.gathered: [(f"v_{u.gather}[(i / gm_ * {gn} + off) * {ginner} + i % gm_]", None)]}

    # --- overlap ---------------------------------------------------------------------------
    def _overlap(self, u: Overlap) -> None:
        """The matmul in chunks on the call's stream; each chunk's collective on the comm stream
        after an event (so it runs while the next chunk's GEMM does); the call's stream waits
        for the comm stream at the end. direct: chunks are rows of y in place; otherwise each
        chunk is computed packed [outer, |r|, inner], its collective runs on the packed chunk
        and the result is unpacked into its block of the collective's result."""
        if u.fused is not None:
            self._overlap_fused(u, u.fused)
            return
        y, c = u.producer, u.collective
        yt, ctt = self.types[y], self.types[c]
        ct = CTYPE[yt.dtype]
        op = NCCL_OP.get(u.reduce, "")
        ly, la, lb, lc = (self.ldims(self.types[n]) for n in (y, u.a, u.b, c))
        gy = self.gdims(yt)
        K, N = la[-1], lb[1]
        ev, done = self.site(), self.site()
        self.emit("{")
        self.emit("  coconet::cuda::Ctx cctx = ctx;  // collectives on the comm stream")
        self.emit("  cctx.stream = ctx.comm_stream;")
        if u.direct:
            rows, per_row = ly[0], _prod(ly[1:-1])
            self.emit(f"  for (int i = 0; i < {u.chunks}; ++i) {{")
            self.emit(f"    const coconet::Range r = coconet::slice_range({rows}, {u.chunks}, i);")
            self.emit("    if (r.empty()) continue;")
            self.emit(f"    coconet::cuda::matmul<{ct}>(v_{u.a} + r.begin * {per_row} * {K}, v_{u.b}, "
                      f"v_{y} + r.begin * {_prod(ly[1:])}, r.size() * {per_row}, {K}, {N}, stream);")
            self.emit(f"    coconet::cuda::join(ctx.stream, ctx.comm_stream, {ev});")
            src, dst = f"v_{y} + r.begin * {_prod(ly[1:])}", f"v_{c} + r.begin * {_prod(lc[1:])}"
            if u.op == "allreduce":
                self.emit(f"    coconet::cuda::allreduce<{ct}>({op}, {src}, {dst}, r.size() * {_prod(ly[1:])}, cctx);")
            else:
                d = ctt.layout.dim
                self.emit(f"    coconet::cuda::reduce_scatter<{ct}>({op}, {src}, {dst}, r.size() * {_prod(gy[1:d])}, "
                          f"{gy[d]}, {_prod(gy[d + 1:])}, cctx);")
            self.emit("  }")
        else:
            self._overlap_packed(u, ct, op, ly, la, lb, lc, gy, ev)
        self.emit(f"  coconet::cuda::join(ctx.comm_stream, ctx.stream, {done});")
        self.emit("}")

    def _overlap_fused(self, u: Overlap, f: Fused) -> None:
        """The matmul's row blocks (cuBLAS) on the call's stream; after each block an event, and
        the fused collective of that block of rows on a side stream (its reductions and gathers
        on the comm stream, its kernels on the side stream), so the next block's GEMM runs while
        this block communicates and computes; the call's stream waits for the side stream at
        the end."""
        y = u.producer
        ct = CTYPE[self.types[y].dtype]
        ly, la, lb = (self.ldims(self.types[n]) for n in (y, u.a, u.b))
        K, N = la[-1], lb[1]
        rows, per_row = ly[0], _prod(ly[1:-1])
        ev, done = self.site(), self.site()
        self.emit("{")
        self.emit("  coconet::cuda::Ctx sctx = ctx;  // the fused collective's kernels on a side stream")
        self.emit("  sctx.stream = coconet::cuda::side_stream();")
        self.emit(f"  for (int ob = 0; ob < {u.chunks}; ++ob) {{")
        self.emit(f"    const coconet::Range rb = coconet::slice_range({rows}, {u.chunks}, ob);")
        self.emit("    if (rb.empty()) continue;")
        self.emit(f"    coconet::cuda::matmul<{ct}>(v_{u.a} + rb.begin * {per_row} * {K}, v_{u.b}, "
                  f"v_{y} + rb.begin * {_prod(ly[1:])}, rb.size() * {per_row}, {K}, {N}, stream);")
        self.emit(f"    coconet::cuda::join(ctx.stream, sctx.stream, {ev});  // this block's rows are computed")
        self.emit("    {")
        self.emit("    const coconet::cuda::Ctx& ctx = sctx;")
        self.emit("    const cudaStream_t stream = ctx.stream;")
        self._comment(f.line, f"fused collective {f.name}: {', '.join(f.members)} (rows rb of dim 0)")
        self._fused(f, ("rb.begin", "rb.end"))
        self.emit("    }")
        self.emit("  }")
        self.emit(f"  coconet::cuda::join(sctx.stream, ctx.stream, {done});")
        for a in f.after:  # what waits for every chunk of every block, on the call's stream
            self.unit(a)
        self.emit("}")

    def _overlap_packed(self, u: Overlap, ct: str, op: str, ly, la, lb, lc, gy, ev: int) -> None:
        y, c = u.producer, u.collective
        yt, ctt = self.types[y], self.types[c]
        d, nd = u.dim, yt.ndim
        K, N = la[-1], lb[1]
        outer, n, inner = _prod(ly[:d]), ly[d], _prod(ly[d + 1:])
        oc, ic = _prod(lc[:d]), _prod(lc[d + 1:])
        self.emit(f"  {ct}* const P_all = coconet::cuda::scratch<{ct}>({self.site()}, {_prod(ly)});")
        self.emit(f"  {ct}* const Q_all = coconet::cuda::scratch<{ct}>({self.site()}, {_prod(lc)});")
        self._name("P_all", _prod(ly), f"packed chunks of {y}")
        self._name("Q_all", _prod(lc), f"packed chunks of {c}")
        self.emit(f"  for (int i = 0; i < {u.chunks}; ++i) {{")
        self.emit(f"    const coconet::Range r = coconet::slice_range({n}, {u.chunks}, i);")
        self.emit("    if (r.empty()) continue;")
        self.emit(f"    {ct}* const P = P_all + {outer} * r.begin * {inner};")
        self.emit(f"    {ct}* const Q = Q_all + {oc} * r.begin * {ic};")
        if d == nd - 1:  # a column block of b: P[M, |r|]
            self.emit(f"    coconet::cuda::gemm<{ct}>({_prod(ly[:-1])}, r.size(), {K}, v_{u.a}, {K}, "
                      f"v_{u.b} + r.begin, {N}, P, r.size(), stream);")
        else:
            rows_per = _prod(ly[d + 1:-1])
            self.emit(f"    for (int64_t o = 0; o < {outer}; ++o)")
            self.emit(f"      coconet::cuda::matmul<{ct}>(v_{u.a} + (o * {n} + r.begin) * {rows_per} * {K}, v_{u.b}, "
                      f"P + o * r.size() * {inner}, r.size() * {rows_per}, {K}, {N}, stream);")
        if u.keep_producer:
            self.emit(f"    coconet::cuda::unpack<{ct}>(P, v_{y}, {outer}, {n}, {inner}, r, stream);")
        self.emit(f"    coconet::cuda::join(ctx.stream, ctx.comm_stream, {ev});")
        gp = [g if k != d else "r.size()" for k, g in enumerate(self.gdims(yt))]
        if u.op == "allreduce":
            self.emit(f"    coconet::cuda::allreduce<{ct}>({op}, P, Q, {oc} * r.size() * {ic}, cctx);")
        elif u.op == "reducescatter":
            dr = ctt.layout.dim
            self.emit(f"    coconet::cuda::reduce_scatter<{ct}>({op}, P, Q, {_prod(gp[:dr])}, {gp[dr]}, "
                      f"{_prod(gp[dr + 1:])}, cctx);")
        else:
            da = yt.layout.dim
            self.emit(f"    coconet::cuda::allgather<{ct}>(P, Q, {_prod(gp[:da])}, {gp[da]}, {_prod(gp[da + 1:])}, cctx);")
        self.emit(f"    coconet::cuda::unpack<{ct}>(Q, v_{c}, {oc}, {lc[d]}, {ic}, r, ctx.comm_stream);")
        self.emit("  }")


def render(plan: Plan, fn: str, file: str, outputs: list[str]) -> Function:
    return CudaRenderer(plan, fn, file, outputs).render()
