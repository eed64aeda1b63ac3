"""The two tensor operations a derived (vector-Jacobian) program needs beyond the language's,
registered when coconetc.autodiff is imported: the matmuls with one operand transposed that
give matmul's operand gradients, and the sum over leading dims that undoes broadcasting.

- `matmul_nt(a, b)`: a [..., M, N] x b [K, N] -> [..., M, K] (a @ b^T): dA of matmul.
- `matmul_tn(a, b)`: a [..., K] x b [..., N] -> [K, N], summed over every leading dim
  (a^T @ b with the batch dims folded into M): dB of matmul.
- `sum_lead(x, n=k)`: x summed over its first k dims: a broadcast operand's cotangent.
- `sum_keep(x, dim=d)`: the sum over dim d, kept as a dim of size 1: an operand broadcast
  along a size-1 dim.
- `conv2d_dx(g, w, x, stride, padding)`, `conv2d_dw(x, g, w, stride, padding)`: conv2d's
  operand gradients (the transposed convolution and the weight's correlation); the third
  operand gives only the result's shape.
- `unindex(g, i=l, n=L)`: [L, *g.shape], g at row l and zeros elsewhere: the gradient of
  `index(w, l)` (a layer of a stacked parameter); the layers' contributions are added.
- `mean_last(x)`: the mean over the last dim, kept as a dim of size 1 ([..., H] -> [..., 1]):
  layernorm's statistics (where eps itself is differentiated).
- `layernorm_dx(x, gamma, g, eps)`: layernorm's input gradient, rstd * (dxhat - mean(dxhat) -
  xhat * mean(dxhat * xhat)) with dxhat = g * gamma, per row over the last dim (the row's
  statistics as the forward computes them); rows whole, as layernorm's own (ROWS).
- `layernorm_dgamma(x, g, eps)`: layernorm's gamma gradient, g * xhat summed over every leading
  dim ([H]); laid out as `sum_lead(g * xhat, n=ndim-1)` would be.

Their layout rules are the transposes of matmul's tensor-parallel rules (typerules.matmul); a
result that sums over a sliced dim is `local` (per-rank partial sums) and the derivation adds
the cross-rank reduction. The interpreter runs them through the NumPy references below; the
planner makes each a Library unit (kind "tensor", ir/ops.py KINDS; its integer settings in attrs) that
both backends run (runtime_cpp/coconet/grad.h and cuda/grad.cuh, called as codegen/library_calls.py
lays out)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from coconetc.errors import Span
from coconetc.ir import ops
from coconetc.ir import typerules as tr
from coconetc.ir.expr import Expr
from coconetc.ir.types import LOCAL, REPLICATED, Layout, TType, sliced


def _nt(name: str, args: Sequence[Expr], attrs: tr.Attrs, span: Span) -> TType:
    a, b = args
    ta, tb = a.type, b.type
    if tb.ndim != 2 or ta.ndim < 2 or ta.shape[-1] != tb.shape[1]:
        raise tr.TypeErr(span, f"matmul_nt needs [..., M, N] x [K, N]; got {ta} x {tb}")
    dt, _ = tr.result_dtype([ta, tb], span)
    la, lb, last = ta.layout, tb.layout, ta.ndim - 1
    lay: Layout
    if lb == sliced(0) and la in (LOCAL, REPLICATED):
        lay = sliced(last)
    elif lb == sliced(1) and la == sliced(last):
        lay = LOCAL  # each rank's part of the contracted dim: partial sums
    elif lb == REPLICATED and not (la.sliced and la.dim == last):
        lay = la
    elif LOCAL in (la, lb) and not la.sliced and not lb.sliced:
        lay = LOCAL
    else:
        raise tr.TypeErr(span, f"matmul_nt of {la} x {lb} has no tensor-parallel meaning")
    return TType(dt, ta.shape[:-1] + (tb.shape[0],), lay)


def _tn(name: str, args: Sequence[Expr], attrs: tr.Attrs, span: Span) -> TType:
    a, b = args
    ta, tb = a.type, b.type
    if ta.ndim < 1 or ta.shape[:-1] != tb.shape[:-1]:
        raise tr.TypeErr(span, f"matmul_tn needs [..., K] x [..., N] with equal leading dims; got {ta} x {tb}")
    dt, _ = tr.result_dtype([ta, tb], span)
    la, lb, last = ta.layout, tb.layout, ta.ndim - 1
    lay: Layout
    if la == sliced(last) and lb in (LOCAL, REPLICATED):
        lay = sliced(0)
    elif la == REPLICATED and lb == sliced(last):
        lay = sliced(1)
    elif la.sliced and la == lb and la.dim < last:
        lay = LOCAL  # the sum runs over a sliced dim: per-rank partial sums
    elif not la.sliced and not lb.sliced:
        lay = REPLICATED if la == lb == REPLICATED else LOCAL
    else:
        raise tr.TypeErr(span, f"matmul_tn of {la} x {lb} has no tensor-parallel meaning")
    return TType(dt, (ta.shape[-1], tb.shape[-1]), lay)


def _sum_lead(name: str, args: Sequence[Expr], attrs: tr.Attrs, span: Span) -> TType:
    (x,) = args
    n, t = attrs["n"], x.type
    if not 1 <= n <= t.ndim:
        raise tr.TypeErr(span, f"sum_lead n={n} is out of range for a {t.ndim}-d tensor")
    return TType(t.dtype, t.shape[n:], _lead_layout(t.layout, n))


def _lead_layout(lay: Layout, n: int) -> Layout:
    """The layout of a sum over the first n dims: a slice of a summed dim leaves per-rank partial
    sums (local)."""
    if lay.sliced:
        return sliced(lay.dim - n) if lay.dim >= n else LOCAL
    return lay


def _unindex(name: str, args: Sequence[Expr], attrs: tr.Attrs, span: Span) -> TType:
    """unindex(g, i, n): [n, *g.shape], g at row i and zeros elsewhere (index's gradient); g's
    slice along dim d is the result's along d + 1."""
    (g,) = args
    t, i, n = g.type, attrs["i"], attrs["n"]
    if not 0 <= i < n:
        raise tr.TypeErr(span, f"unindex {i} is out of range for a dim of size {n}")
    lay = sliced(t.layout.dim + 1) if t.layout.sliced else t.layout
    return TType(t.dtype, (n, *t.shape), lay)


def _mean_last(name: str, args: Sequence[Expr], attrs: tr.Attrs, span: Span) -> TType:
    (x,) = args
    t = x.type
    if t.ndim < 1 or t.layout == sliced(t.ndim - 1):
        raise tr.TypeErr(span, f"mean_last needs a tensor whose last dim is whole; got {t}")
    return TType(t.dtype, t.shape[:-1] + (1,), t.layout)


def _ln_rows(name: str, x: Expr, g: Expr, eps: Expr, span: Span) -> Layout:
    """The checks layernorm_dx and layernorm_dgamma share: x and its result's cotangent g of one
    shape, a scalar eps, rows whole; the layout of g * xhat."""
    t = x.type
    if t.ndim < 1 or g.type.shape != t.shape:
        raise tr.TypeErr(span, f"{name} needs x and g of one shape [..., H]; got {t} and {g.type}")
    if eps.type.shape != ():
        raise tr.TypeErr(eps.span or span, f"{name}'s eps must be a scalar")
    lay = tr.combine_layouts([t, g.type], t.ndim, span)
    if lay == sliced(t.ndim - 1):
        raise tr.TypeErr(span, f"{name} normalizes the last dim, which is sliced")
    return lay


def _ln_dx(name: str, args: Sequence[Expr], attrs: tr.Attrs, span: Span) -> TType:
    x, gamma, g, eps = args
    lay = _ln_rows(name, x, g, eps, span)
    if gamma.type.shape != x.type.shape[-1:] or gamma.type.layout != REPLICATED:
        raise tr.TypeErr(gamma.span or span, f"{name}'s gamma must be replicated, of shape [{x.type.shape[-1]}]")
    dt, _ = tr.result_dtype([x.type, gamma.type, g.type], span)
    return TType(dt, x.type.shape, lay)


def _ln_dgamma(name: str, args: Sequence[Expr], attrs: tr.Attrs, span: Span) -> TType:
    x, g, eps = args
    lay = _ln_rows(name, x, g, eps, span)
    dt, _ = tr.result_dtype([x.type, g.type], span)
    n = x.type.ndim - 1
    return TType(dt, x.type.shape[n:], _lead_layout(lay, n))


def _sum_keep(name: str, args: Sequence[Expr], attrs: tr.Attrs, span: Span) -> TType:
    (x,) = args
    d, t = attrs["dim"], x.type
    if not 0 <= d < t.ndim:
        raise tr.TypeErr(span, f"sum_keep dim={d} is out of range for a {t.ndim}-d tensor")
    lay = LOCAL if t.layout == sliced(d) else t.layout  # a sliced dim summed: per-rank partial sums
    return TType(t.dtype, t.shape[:d] + (1,) + t.shape[d + 1:], lay)


def _conv_dx(name: str, args: Sequence[Expr], attrs: tr.Attrs, span: Span) -> TType:
    g, w, x = args
    lg, lw = g.type.layout, w.type.layout
    lay: Layout
    if lw == REPLICATED and lg in (LOCAL, REPLICATED, sliced(0)):
        lay = lg
    elif lw == sliced(1) and lg in (LOCAL, REPLICATED):
        lay = sliced(1)
    elif lw == sliced(0) and lg == sliced(1):
        lay = LOCAL  # each rank's output channels: partial sums
    elif LOCAL in (lg, lw) and not lg.sliced and not lw.sliced:
        lay = LOCAL
    else:
        raise tr.TypeErr(span, f"conv2d_dx of {lg} x {lw} has no parallel meaning")
    dt, _ = tr.result_dtype([g.type, w.type], span)
    return TType(dt, x.type.shape, lay)


def _conv_dw(name: str, args: Sequence[Expr], attrs: tr.Attrs, span: Span) -> TType:
    x, g, w = args
    lx, lg = x.type.layout, g.type.layout
    lay: Layout
    if lx == sliced(1) and lg in (LOCAL, REPLICATED):
        lay = sliced(1)
    elif lx == REPLICATED and lg == sliced(1):
        lay = sliced(0)
    elif lx == sliced(0) and lg == sliced(0):
        lay = LOCAL  # the batch summed over slices: partial sums
    elif not lx.sliced and not lg.sliced:
        lay = REPLICATED if lx == lg == REPLICATED else LOCAL
    else:
        raise tr.TypeErr(span, f"conv2d_dw of {lx} x {lg} has no parallel meaning")
    dt, _ = tr.result_dtype([x.type, g.type], span)
    return TType(dt, w.type.shape, lay)


def _windows(xp: np.ndarray, kh: int, kw: int, stride: int, ho: int, wo: int) -> np.ndarray:
    win = np.lib.stride_tricks.sliding_window_view(xp, (kh, kw), axis=(2, 3))
    return win[:, :, ::stride, ::stride][:, :, :ho, :wo]  # n c ho wo kh kw


def _np_conv_dx(g: np.ndarray, w: np.ndarray, x: np.ndarray, stride: int, padding: int) -> np.ndarray:
    n, c, h, wd = x.shape
    _, _, kh, kw = w.shape
    ho, wo = g.shape[2], g.shape[3]
    xp = np.zeros((n, c, h + 2 * padding, wd + 2 * padding), dtype=g.dtype)
    if xp.size and g.size and w.size:
        contrib = np.einsum("nohw,ocij->nchwij", g, w)
        for i in range(kh):
            for j in range(kw):
                xp[:, :, i:i + stride * ho:stride, j:j + stride * wo:stride] += contrib[..., i, j]
    return xp[:, :, padding:padding + h, padding:padding + wd]


def _np_conv_dw(x: np.ndarray, g: np.ndarray, w: np.ndarray, stride: int, padding: int) -> np.ndarray:
    _, _, kh, kw = w.shape
    ho, wo = g.shape[2], g.shape[3]
    if not (x.size and g.size):
        return np.zeros(w.shape, dtype=g.dtype)
    xp = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    return np.asarray(np.einsum("nchwij,nohw->ocij", _windows(xp, kh, kw, stride, ho, wo), g), dtype=g.dtype)


def _np_nt(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.matmul(a, np.swapaxes(b, -1, -2))


def _np_tn(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    m = int(np.prod(a.shape[:-1]))  # explicit: a slice may be empty
    return np.asarray(a.reshape(m, a.shape[-1]).T @ b.reshape(m, b.shape[-1]))


def _np_unindex(g: np.ndarray, i: int, n: int) -> np.ndarray:
    out = np.zeros((n, *g.shape), dtype=g.dtype)
    out[i] = g
    return out


def _np_sum_lead(x: np.ndarray, n: int) -> np.ndarray:
    return np.asarray(x.sum(axis=tuple(range(n)), dtype=x.dtype))


def _np_sum_keep(x: np.ndarray, dim: int) -> np.ndarray:
    return np.asarray(x.sum(axis=dim, keepdims=True, dtype=x.dtype))


def _np_mean_last(x: np.ndarray) -> np.ndarray:
    return np.asarray(x.mean(axis=-1, keepdims=True, dtype=x.dtype))


def _np_xhat(x: np.ndarray, eps: object) -> tuple[np.ndarray, np.ndarray]:
    """xhat and rstd of each row of x (over the last dim), as the forward computes them (two passes)."""
    mean = x.mean(axis=-1, keepdims=True, dtype=x.dtype)
    xc = x - mean
    rstd = 1 / np.sqrt((xc * xc).mean(axis=-1, keepdims=True, dtype=x.dtype) + x.dtype.type(float(eps)))  # type: ignore[arg-type]
    return xc * rstd, rstd


def _np_ln_dx(x: np.ndarray, gamma: np.ndarray, g: np.ndarray, eps: object) -> np.ndarray:
    xhat, rstd = _np_xhat(x, eps)
    dxhat = g * gamma
    mean = dxhat.mean(axis=-1, keepdims=True, dtype=x.dtype)
    proj = (dxhat * xhat).mean(axis=-1, keepdims=True, dtype=x.dtype)
    return np.asarray(rstd * (dxhat - mean - xhat * proj), dtype=x.dtype)


def _np_ln_dgamma(x: np.ndarray, g: np.ndarray, eps: object) -> np.ndarray:
    xhat, _ = _np_xhat(x, eps)
    return np.asarray((g * xhat).reshape(-1, x.shape[-1]).sum(axis=0, dtype=x.dtype), dtype=x.dtype)


_CONV = (ops.Arg("stride", "int", default=1, minimum=1), ops.Arg("padding", "int", default=0))

DEFS = (
    ops.OpDef("matmul_nt", "tensor", ops.AB, _nt, ops.NEVER, numpy=_np_nt, fusable=False,
              cost=ops.Cost(2, inner=True), doc="a @ b^T (matmul's input gradient)",
              traits=frozenset({ops.GEMM, ops.OVERLAPPED}), domain=ops.ALL_FOLLOW),
    ops.OpDef("matmul_tn", "tensor", ops.AB, _tn, ops.NEVER, numpy=_np_tn, fusable=False,
              cost=ops.Cost(2, inner=True), doc="a^T @ b over all leading dims (matmul's weight gradient)",
              traits=frozenset({ops.GEMM}), domain=ops.ALL_FOLLOW),
    ops.OpDef("sum_lead", "tensor", (ops.Arg("x"), ops.Arg("n", "int", minimum=1)), _sum_lead,
              ops.NEVER, numpy=_np_sum_lead, doc="the sum over the first n dims", domain=ops.ALL_FOLLOW),
    ops.OpDef("sum_keep", "tensor", (ops.Arg("x"), ops.Arg("dim", "int")), _sum_keep, ops.NEVER,
              numpy=_np_sum_keep, doc="the sum over one dim, kept as a dim of size 1", domain=ops.ALL_FOLLOW),
    ops.OpDef("conv2d_dx", "tensor", (ops.Arg("g"), ops.Arg("w"), ops.Arg("x"), *_CONV), _conv_dx, ops.NEVER,
              numpy=_np_conv_dx, fusable=False, cost=ops.Cost(2, inner=True), doc="conv2d's input gradient",
              domain=ops.ANY),
    ops.OpDef("conv2d_dw", "tensor", (ops.Arg("x"), ops.Arg("g"), ops.Arg("w"), *_CONV), _conv_dw, ops.NEVER,
              numpy=_np_conv_dw, fusable=False, cost=ops.Cost(2, inner=True), doc="conv2d's weight gradient",
              domain=ops.ANY),
    ops.OpDef("unindex", "tensor", (ops.Arg("g"), ops.Arg("i", "int"), ops.Arg("n", "int", minimum=1)), _unindex,
              ops.NEVER, numpy=_np_unindex, fusable=False, cost=ops.Cost(0),
              doc="[n, *g.shape]: g at row i, zeros elsewhere (index's gradient)", domain=ops.FIRST_FOLLOWS),
    ops.OpDef("mean_last", "tensor", ops.X, _mean_last, ops.ROWS, numpy=_np_mean_last,
              doc="the mean over the last dim, kept as a dim of size 1", domain=ops.ALL_FOLLOW),
    ops.OpDef("layernorm_dx", "tensor", (ops.Arg("x"), ops.Arg("gamma"), ops.Arg("g"), ops.Arg("eps", literal="f32")),
              _ln_dx, ops.ROWS, numpy=_np_ln_dx, cost=ops.Cost(14, 1),
              doc="layernorm's input gradient (g: the result's cotangent), per row over the last dim",
              traits=frozenset({ops.ROWWISE, ops.RESIDUAL}), domain=ops.ANY),
    ops.OpDef("layernorm_dgamma", "tensor", (ops.Arg("x"), ops.Arg("g"), ops.Arg("eps", literal="f32")),
              _ln_dgamma, ops.NEVER, numpy=_np_ln_dgamma, fusable=False, cost=ops.Cost(10, inner=True),
              doc="layernorm's gamma gradient: g * xhat summed over every leading dim", domain=ops.ANY),
)

for _d in DEFS:
    if _d.name not in ops.REGISTRY:
        ops.register_built_in(_d)
