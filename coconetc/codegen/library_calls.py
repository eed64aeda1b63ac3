"""A Library unit's runtime call, the same on every backend: its function and its arguments
(operand pointers, then this rank's sizes and the unit's integer attributes). The CPU renderer
calls `coconet::<function><T>(args)` (runtime_cpp/coconet: gemm.h, kernels.h, grad.h), the CUDA
renderer `coconet::cuda::<function><T>(args, stream or ctx)` (coconet/cuda: runtime.cuh,
grad.cuh), so the two backends cannot disagree on what they pass. layernorm is not here: its
eps is read differently by each backend (a computed 0-d eps stays on the device for CUDA);
layernorm_dx's and layernorm_dgamma's eps is a literal or a scalar parameter (autodiff/vjp.py
derives them only then), read on the host by both.

Sizes are this rank's (Writer.ldims): every operand is the rank's local part, and the layouts the
typing rules allow (coconetc/autodiff/ops.py) make the local sizes of the operands and the result
agree, so the same formulas hold for every layout."""

from __future__ import annotations

from dataclasses import replace

from coconetc.codegen.base import Writer, cdim, prod
from coconetc.codegen.emit import literal
from coconetc.ir.typerules import reshape_slices
from coconetc.plan.units import GatherMatmul, Library, Loop, Overlap

OPS = ("matmul", "conv2d", "softmax", "transpose", "reshape", "matmul_nt", "matmul_tn", "sum_lead", "sum_keep", "mean_last",
       "index", "unindex",
       "layernorm_dx", "layernorm_dgamma", "conv2d_dx", "conv2d_dw")
"""The Library operations whose call this module lays out."""



def call_args(w: Writer, u: Library) -> list[str]:
    """The arguments of u's runtime function (the function is named as the operation)."""
    dims = [w.ldims(w.types[a]) for a in u.args]
    out = w.ldims(w.types[u.dst])
    ptrs = [f"v_{a}" for a in u.args]
    attrs = dict(u.attrs)
    if u.op == "matmul" and len(dims[1]) > 2:  # batched: A[batch or -, M, K] x B[batch, K, N], strided
        la, lb = dims[0], dims[1]
        stride_a = prod(la[-2:]) if len(la) > 2 else "int64_t(0)"  # a 2-d A: the same for every batch
        return [*ptrs, f"v_{u.dst}", prod(out[:-2]), la[-2], la[-1], lb[-1], stride_a, prod(lb[-2:])]
    if u.op == "matmul":  # A[M, K] x B[K, N]
        la, lb = dims[0], dims[1]
        return [*ptrs, f"v_{u.dst}", prod(la[:-1]), la[-1], lb[1]]
    if u.op == "matmul_nt":  # A[M, N] x B[K, N]^T -> [M, K]
        la, lb = dims[0], dims[1]
        return [*ptrs, f"v_{u.dst}", prod(la[:-1]), la[-1], lb[0]]
    if u.op == "matmul_tn":  # A[M, K]^T x B[M, N] -> [K, N], M over every leading dim
        la, lb = dims[0], dims[1]
        return [*ptrs, f"v_{u.dst}", prod(la[:-1]), la[-1], lb[-1]]
    if u.op == "sum_lead":  # [outer, inner] -> [inner]
        n, lx = int(attrs["n"]), dims[0]  # type: ignore[call-overload]
        return [ptrs[0], f"v_{u.dst}", prod(lx[:n]), prod(lx[n:])]
    if u.op == "sum_keep":  # [outer, mid, inner] -> [outer, 1, inner]
        d, lx = int(attrs["dim"]), dims[0]  # type: ignore[call-overload]
        return [ptrs[0], f"v_{u.dst}", prod(lx[:d]), lx[d], prod(lx[d + 1:])]
    if u.op in BLOCK:
        return _block_args(w, u, dims[0])
    if u.op in ("layernorm_dx", "layernorm_dgamma"):  # x[rows, h] (gamma[h]) g[rows, h] -> dx[rows, h] or dgamma[h]
        lx = dims[0]
        eps = (literal(float(attrs["eps"]), "f64") if "eps" in attrs  # type: ignore[arg-type]
               else f"double(coconet::to_compute(v_{u.args[-1]}[0]))")  # a scalar parameter
        vals = ptrs[:-1] if "eps" not in attrs else ptrs
        return [*vals, f"v_{u.dst}", eps, prod(lx[:-1]), lx[-1]]
    if u.op == "mean_last":  # [rows, h] -> [rows, 1]
        lx = dims[0]
        return [ptrs[0], f"v_{u.dst}", prod(lx[:-1]), lx[-1]]
    conv = [str(attrs["stride"]), str(attrs["padding"])]
    if u.op == "conv2d":  # x[N, C, H, W] x w[O, C, KH, KW]
        lx, lw = dims[0], dims[1]
        return [*ptrs, f"v_{u.dst}", *lx, lw[0], lw[2], lw[3], *conv]
    if u.op == "conv2d_dx":  # g[N, O, HO, WO], w[O, C, KH, KW] -> dx[N, C, H, W] (x: the shape only)
        lg, lw = dims[0], dims[1]
        return [ptrs[0], ptrs[1], f"v_{u.dst}", *out, lg[1], lw[2], lw[3], lg[2], lg[3], *conv]
    assert u.op == "conv2d_dw", u.op  # x[N, C, H, W], g[N, O, HO, WO] -> dw[O, C, KH, KW] (w: the shape only)
    lx, lg = dims[0], dims[1]
    return [ptrs[0], ptrs[1], f"v_{u.dst}", *lx, out[0], out[2], out[3], lg[2], lg[3], *conv]


def rowwise_args(w: Writer, u: Library, loop: Loop) -> list[str]:
    """call_args of a row-wise call (layernorm_dx) whose plan fuses its residual epilogue
    (plan/epilogue.py): the loop's value as the result, and the residual after the sizes."""
    assert u.epilogue is not None
    operand, value = u.epilogue.operand, u.epilogue.value
    args = call_args(w, u)
    at = args.index(f"v_{u.dst}")
    return [*args[:at], f"v_{value}", *args[at + 1:], f"v_{operand}"]


BLOCK = ("softmax", "transpose", "reshape", "index", "unindex")
"""The operations of a transformer block that move or normalize one operand (block_args)."""


def _block_args(w: Writer, u: Library, lx: list[str]) -> list[str]:
    x, attrs = f"v_{u.args[0]}", dict(u.attrs)
    if u.op == "softmax":  # [rows, h] -> [rows, h]
        return [x, f"v_{u.dst}", prod(lx[:-1]), lx[-1]]
    if u.op == "index":  # x[L, n] -> x[i], this rank's n elements of a layer (dim 0 is never sliced)
        return [x, f"v_{u.dst}", prod(w.ldims(w.types[u.dst])), str(attrs["i"])]
    if u.op == "unindex":  # g[n] -> out[L, n], g at row i
        return [x, f"v_{u.dst}", prod(lx), str(attrs["i"]), str(attrs["n"])]
    if u.op == "transpose":  # [outer, a, mid, b, inner] -> [outer, b, mid, a, inner]
        d0, d1 = sorted((int(attrs["dim0"]), int(attrs["dim1"])))  # type: ignore[call-overload]
        return [x, f"v_{u.dst}", prod(lx[:d0]), lx[d0], prod(lx[d0 + 1:d1]), lx[d1], prod(lx[d1 + 1:])]
    assert u.op == "reshape", u.op  # a copy, after the check of the sizes and slices (typerules.reshape_slices)
    src, dst = w.types[u.args[0]], w.types[u.dst]
    cut = reshape_slices(src, dst)
    check = [cdim(d) for d in cut] if cut is not None else ["int64_t(0)"] * 3
    line = int(attrs.get("line", 0)) or u.line  # type: ignore[call-overload]
    what = f'"reshape ({w.file}:{line})"' if line else f'"reshape ({w.file})"'
    return [x, f"v_{u.dst}", prod(lx), prod(w.gdims(src)), prod(w.gdims(dst)), *check, "int64_t(comm.size)", what]


def overlap_rows(w: Writer, u: Overlap | GatherMatmul, first: str, count: str, dst: str) -> tuple[str, list[str]]:
    """An overlap's GEMM (u.gemm: matmul or matmul_nt) on `count` rows of a from row `first`
    (a seen as [rows, inner]), into `dst`: the function and its arguments, as call_args lays
    them out (matmul: A[M, K] x B[K, N]; matmul_nt: A[M, N] x B[K, N]^T; a batched matmul:
    the rows are whole batches of M)."""
    la, lb = w.ldims(w.types[u.a]), w.ldims(w.types[u.b])
    if u.gemm == "matmul_tn":  # C[K, N] = A[M, K]^T x B[M, N], M over every leading dim: rows of C, columns of A
        m, k, n = prod(la[:-1]), la[-1], lb[-1]
        return "gemm_trans", ["true", "false", count, n, m, f"v_{u.a} + {first}", k, f"v_{u.b}", n, dst, n]
    if len(lb) > 2:  # batched (matmul): whole batches of M rows, a strided-batched GEMM (call_args)
        M, K, N = la[-2], la[-1], lb[-1]
        stride_a = prod(la[-2:]) if len(la) > 2 else "int64_t(0)"
        a = f"v_{u.a} + ({first}) / {M} * {stride_a}" if len(la) > 2 else f"v_{u.a}"
        return u.gemm, [a, f"v_{u.b} + ({first}) / {M} * {prod(lb[-2:])}", dst, f"({count}) / {M}", M, K, N, stride_a,
                        prod(lb[-2:])]
    inner, cols = la[-1], (lb[1] if u.gemm == "matmul" else lb[0])
    return u.gemm, [f"v_{u.a} + {first} * {inner}", f"v_{u.b}", dst, count, inner, cols]


def overlap_gemms(w: Writer, u: Overlap, first: str, count: str, dst: str) -> list[tuple[str, list[str]]]:
    """The GEMMs of an overlap's chunk of rows (overlap_rows): its one GEMM, or, where the
    producer is a sum of GEMMs (u.terms), the first and then each other one added into the same
    rows (matmul_acc, matmul_nt_acc: beta = 1)."""
    calls = [overlap_rows(w, u, first, count, dst)]
    for t in u.terms:
        fn, args = overlap_rows(w, replace(u, a=t.a, b=t.b, gemm=t.gemm, terms=()), first, count, dst)
        calls.append((f"{fn}_acc", args))
    return calls


def overlap_cols(w: Writer, u: Overlap, dst: str) -> tuple[str, list[str]]:
    """An overlap's GEMM on chunk r of its result's last dim, into the packed dst[M, |r|]: a
    block of b's columns (matmul: gemm) or of b's rows (matmul_nt: gemm_trans, b transposed)."""
    ly, la, lb = (w.ldims(w.types[n]) for n in (u.producer, u.a, u.b))
    m, inner = prod(ly[:-1]), la[-1]
    if u.gemm == "matmul":
        return "gemm", [m, "r.size()", inner, f"v_{u.a}", inner, f"v_{u.b} + r.begin", lb[1], dst, "r.size()"]
    if u.gemm == "matmul_tn":  # P[K, |r|] = A[M, K]^T x B[M, r], M over every leading dim
        k, rows = la[-1], prod(la[:-1])
        return "gemm_trans", ["true", "false", k, "r.size()", rows, f"v_{u.a}", k, f"v_{u.b} + r.begin", lb[-1], dst,
                              "r.size()"]
    assert u.gemm == "matmul_nt", u.gemm
    return "gemm_trans", ["false", "true", m, "r.size()", inner, f"v_{u.a}", inner, f"v_{u.b} + r.begin * {lb[1]}",
                          lb[1], dst, "r.size()"]


def weight_chunk(w: Writer, u: GatherMatmul, acc: str) -> tuple[str, list[str], str]:
    """The GEMM of chunk r of a gathered right operand (GatherMatmul.right: rows r of u.b, the
    gathered weight, along dim 0; its columns r along dim 1). Along the dim the consumer
    contracts (u.accumulates) it adds its product into the consumer (acc: a C++ condition, true
    but for the first chunk's first GEMM: beta = 1); along the other it writes the consumer's
    columns r. The function (gemm_trans, both backends), its arguments and its accumulate flag
    (after the stream on CUDA)."""
    la, (k, n) = w.ldims(w.types[u.a]), w.ldims(w.types[u.b])
    m, c, a, nt = prod(la[:-1]), f"v_{u.consumer}", f"v_{u.a}", u.gemm == "matmul_nt"
    assert u.gemm in ("matmul", "matmul_nt"), u.gemm
    b = f"v_{u.b} + r.begin * {n}" if u.dim == 0 else f"v_{u.b} + r.begin"
    flags = ["false", "true" if nt else "false"]
    if u.accumulates:  # matmul: y[M, N] += a[M, r] x b[r, N]; matmul_nt: y[M, K] += a[M, r] x b[K, r]^T
        cols = k if nt else n
        return "gemm_trans", [*flags, m, cols, "r.size()", f"{a} + r.begin", la[-1], b, n, c, cols], acc
    if nt:  # y[M, r] = a[M, N] x b[r, N]^T
        return "gemm_trans", [*flags, m, "r.size()", n, a, n, b, n, f"{c} + r.begin", k], "false"
    return "gemm_trans", [*flags, m, "r.size()", k, a, k, b, n, f"{c} + r.begin", n], "false"  # y[M, r] = a x b[:, r]
