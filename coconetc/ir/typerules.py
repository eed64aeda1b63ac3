"""Typing rules (docs/language.md, "Types"): dtype promotion with weak scalars, NumPy
broadcasting of symbolic shapes, and layouts. Each operation's entry in the registry
(coconetc/ir/ops.py) names its rule; `ops.type_op` looks it up. Used by the checker to type a
program and by the schedule primitives to re-type the stages they move onto slices.

A rule is `rule(name, args, attrs, span) -> TType`: the operation's name, its typed operands,
its compile-time attributes, and where an error points."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from coconetc.errors import CompileError, Diagnostic, Span
from coconetc.ir.expr import Const, Expr
from coconetc.ir.types import (BITS, FLOATS, LOCAL, REPLICATED, Dim, Layout, TType, dim_op, eval_dim,
                               sliced)

Attrs = dict[str, Any]
Rule = Callable[[str, Sequence[Expr], Attrs, Span], TType]


class TypeErr(CompileError):
    def __init__(self, span: Span, message: str):
        super().__init__([Diagnostic(span, message)])


def _promote_weak(a: str, b: str) -> str:
    """Two weak (scalar) dtypes: float beats integer, then the wider wins."""
    if (a in FLOATS) != (b in FLOATS):
        return a if a in FLOATS else b
    return a if BITS[a] >= BITS[b] else b


def result_dtype(types: Sequence[TType], span: Span,
                 spans: Sequence[Span] = ()) -> tuple[str, bool]:
    """The dtype of a pointwise result, and whether it is weak. spans (one per type, when
    known) locate the offending operand of an error."""
    strong = [t for t in types if not t.weak]
    if not strong:
        dt = types[0].dtype
        for t in types[1:]:
            dt = _promote_weak(dt, t.dtype)
        return dt, True
    dts = sorted({t.dtype for t in strong})
    if len(dts) > 1:
        raise TypeErr(span, f"operands have different dtypes {' and '.join(dts)}; use cast(x, dtype)")
    dt = dts[0]
    bad = [i for i, t in enumerate(types) if t.weak and t.dtype in FLOATS]
    if dt not in FLOATS and bad:
        where = spans[bad[0]] if len(spans) == len(types) and spans[bad[0]] else span
        raise TypeErr(where, f"a float scalar with an {dt} tensor; use cast(x, dtype)")
    return dt, False


def broadcast(shapes: Sequence[tuple[Dim, ...]], span: Span) -> tuple[Dim, ...]:
    """NumPy broadcasting: trailing dims align; equal dims or a literal 1 combine."""
    n = max((len(s) for s in shapes), default=0)
    out: list[Dim] = []
    for i in range(n):
        dims = {s[len(s) - n + i] for s in shapes if len(s) - n + i >= 0} - {1}
        if len(dims) > 1:
            shown = " vs ".join("[" + ", ".join(map(str, s)) + "]" for s in shapes)
            raise TypeErr(span, f"shapes do not broadcast: {shown}")
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def combine_layouts(types: Sequence[TType], ndim: int, span: Span) -> Layout:
    """Pointwise layouts: equal, except that replicated combines with anything (a replicated
    operand of a sliced computation is read at the slice). Sliced dims count in the result's
    coordinates (trailing alignment)."""
    seen: set[Layout] = set()
    for t in types:
        lay = t.layout
        if lay.sliced:
            lay = sliced(lay.dim + ndim - t.ndim)
        if lay != REPLICATED:
            seen.add(lay)
    if len(seen) > 1:
        shown = " and ".join(sorted(str(x) for x in seen))
        raise TypeErr(span, f"cannot combine {shown} operands; a pointwise operation needs equal "
                      "layouts (only replicated combines with anything)")
    return seen.pop() if seen else REPLICATED


def _no_bool(args: Sequence[Expr], span: Span, what: str) -> None:
    for a in args:
        if a.type.dtype == "bool":
            raise TypeErr(a.span or span, f"a comparison can only be the condition of where(), not {what}")


def pointwise(args: Sequence[Expr], span: Span, what: str, allow_bool_first: bool = False) -> TType:
    _no_bool(args[1:] if allow_bool_first else args, span, f"an operand of {what}")
    types = [a.type for a in args]
    shape = broadcast([t.shape for t in types], span)
    valued = args[1:] if allow_bool_first else args
    dt, weak = result_dtype([a.type for a in valued], span, [a.span for a in valued])
    return TType(dt, shape, combine_layouts(types, len(shape), span), weak and not shape)


def pointwise_rule(name: str, args: Sequence[Expr], attrs: Attrs, span: Span) -> TType:
    """The default rule: broadcasting, dtype promotion, layouts (unary and binary operations)."""
    return pointwise(args, span, name)


def float_valued(name: str, args: Sequence[Expr], attrs: Attrs, span: Span) -> TType:
    """sqrt, exp, sigmoid, ...: of a weak integer (sqrt(2)), a weak f32 as in JAX (its value is
    not an integer); otherwise the pointwise rule."""
    (x,) = args
    if x.type.weak and x.type.dtype in ("i32", "i64"):
        return TType("f32", (), x.type.layout, True)
    return pointwise(args, span, name)


def reduction(name: str, args: Sequence[Expr], attrs: Attrs, span: Span) -> TType:
    (x,) = args
    _no_bool(args, span, "an operand of a reduction")
    lay = x.type.layout
    return TType(x.type.dtype, (), LOCAL if lay == LOCAL else REPLICATED)


def extreme(name: str, args: Sequence[Expr], attrs: Attrs, span: Span) -> TType:
    """max(x), min(x): as the other reductions, of a floating-point tensor only (an empty
    tensor's max is -inf, which no integer dtype holds)."""
    (x,) = args
    if x.type.dtype in ("i32", "i64"):
        word = "max" if name == "amax" else "min"
        raise TypeErr(span, f"{word}(x) of an {x.type.dtype} tensor: the reduction needs a floating-point "
                      f"dtype (cast(x, f32) or cast(x, f64) first)")
    return reduction(name, args, attrs, span)


def matmul(name: str, args: Sequence[Expr], attrs: Attrs, span: Span) -> TType:
    a, b = args
    _no_bool(args, span, "an operand of matmul")
    ta, tb = a.type, b.type
    if tb.ndim > 2 and ta.ndim >= 2:
        return batched_matmul(ta, tb, span)
    if tb.ndim != 2 or ta.ndim < 2:
        raise TypeErr(span, f"matmul needs [..., M, K] x [K, N]; got {ta.ndim}-d x {tb.ndim}-d")
    if ta.shape[-1] != tb.shape[0]:
        raise TypeErr(span, f"matmul inner dims differ: {ta.shape[-1]} vs {tb.shape[0]}")
    dt, _ = result_dtype([ta, tb], span)
    shape = ta.shape[:-1] + tb.shape[1:]
    return TType(dt, shape, _matmul_layout(ta, tb, span), False)


def _matmul_layout(ta: TType, tb: TType, span: Span) -> Layout:
    la, lb, last = ta.layout, tb.layout, ta.ndim - 1
    if la == sliced(last) and lb == sliced(0):
        return LOCAL  # row-parallel: partial sums
    if la == REPLICATED and lb == sliced(1):
        return sliced(last)  # column-parallel
    if lb == REPLICATED and (la in (LOCAL, REPLICATED) or (la.sliced and la.dim < last)):
        return la
    if LOCAL in (la, lb) and not la.sliced and not lb.sliced:
        return LOCAL
    raise TypeErr(span, f"matmul of {la} x {lb} has no tensor-parallel meaning (use sliced(last) x "
                  "sliced(0), replicated x sliced(1), or a replicated right operand)")


def batched_matmul(ta: TType, tb: TType, span: Span) -> TType:
    """matmul(a, b) with b batched, as torch.matmul: a [..., M, K] x b [..., K, N] with equal
    batch dims, or a 2-d a [M, K] broadcast over b's batch. Layouts by the role of the sliced
    dims (batch_roles): the same batch dim sliced in both -> sliced there (heads); a's M rows
    sliced, b replicated -> sliced(M); a replicated, b's N columns sliced -> sliced(last); a 2-d
    a replicated with b sliced along a batch dim -> that batch dim; K sliced in both -> local
    partial sums."""
    if ta.shape[-1] != tb.shape[-2]:
        raise TypeErr(span, f"matmul inner dims differ: {ta.shape[-1]} vs {tb.shape[-2]}")
    if ta.ndim != 2 and ta.shape[:-2] != tb.shape[:-2]:
        shown = " x ".join("[" + ", ".join(map(str, t.shape)) + "]" for t in (ta, tb))
        raise TypeErr(span, f"batched matmul needs equal batch dims, or a 2-d left operand broadcast over "
                      f"the right one's: {shown}")
    dt, _ = result_dtype([ta, tb], span)
    shape = tb.shape[:-2] + (ta.shape[-2], tb.shape[-1])
    return TType(dt, shape, _batched_layout(ta, tb, len(shape), span), False)


def batch_roles(ta: TType, tb: TType, ndim: int) -> tuple[str, str]:
    """The role of each operand's sliced dim in a batched matmul of result rank ndim: 'b<d>'
    (batch dim d of the result), 'M', 'K', 'N', or its layout kind when not sliced."""
    def role(t: TType, names: tuple[str, str]) -> str:
        if not t.layout.sliced:
            return t.layout.kind
        d, nb = t.layout.dim, t.ndim - 2
        return f"b{d + ndim - t.ndim}" if d < nb else names[d - nb]
    return role(ta, ("M", "K")), role(tb, ("K", "N"))


def _batched_layout(ta: TType, tb: TType, ndim: int, span: Span) -> Layout:
    ra, rb = batch_roles(ta, tb, ndim)
    if ra == rb == "K":
        return LOCAL  # each rank's part of the contracted dim: partial sums
    if ra == rb and ra.startswith("b"):
        return sliced(int(ra[1:]))
    if ra == "M" and rb == "replicated":
        return sliced(ndim - 2)
    if ra == "replicated" and (rb == "N" or (rb.startswith("b") and ta.ndim == 2)):
        return sliced(ndim - 1 if rb == "N" else int(rb[1:]))
    if not ta.layout.sliced and not tb.layout.sliced:
        return REPLICATED if ra == rb == "replicated" else LOCAL
    raise TypeErr(span, f"batched matmul of {ta.layout} x {tb.layout} has no tensor-parallel meaning (slice the "
                  "same batch dim of both, a's rows with b replicated, b's columns with a replicated, or the "
                  "contracted dim of both)")


def layernorm(name: str, args: Sequence[Expr], attrs: Attrs, span: Span) -> TType:
    x, gamma, beta, eps = args
    _no_bool(args, span, "an operand of layernorm")
    t = x.type
    if t.ndim < 1:
        raise TypeErr(span, "layernorm needs a tensor")
    for g in (gamma, beta):
        if g.type.shape != t.shape[-1:]:  # (a 0-d beta, no bias, is typed as one: frontend/checker.py)
            raise TypeErr(g.span or span, f"layernorm's gamma/beta must have shape [{t.shape[-1]}]")
        if g.type.layout != REPLICATED:
            raise TypeErr(g.span or span, "layernorm's gamma/beta must be replicated")
    if eps.type.shape != ():
        raise TypeErr(eps.span or span, "layernorm's eps must be a scalar")
    if t.layout == sliced(t.ndim - 1):
        raise TypeErr(span, "layernorm normalizes the last dim, which this tensor has sliced")
    dt, _ = result_dtype([t, gamma.type, beta.type], span)
    return TType(dt, t.shape, t.layout)


def rowwise(name: str, args: Sequence[Expr], attrs: Attrs, span: Span) -> TType:
    """softmax: over the last dim of a floating-point tensor; the result has x's type; the last
    dim must be whole on each rank (any other dim may be sliced)."""
    (x,) = args
    _no_bool(args, span, f"an operand of {name}")
    t = x.type
    if t.ndim < 1:
        raise TypeErr(x.span or span, f"{name} needs a tensor (it works over the last dim), not a scalar")
    if t.dtype not in FLOATS:
        raise TypeErr(x.span or span, f"{name} of an {t.dtype} tensor: cast(x, f32) first")
    if t.layout == sliced(t.ndim - 1):
        raise TypeErr(x.span or span, f"{name} works over the last dim, which this tensor has sliced "
                      f"({t.layout}); gather it first or slice another dim")
    return TType(t.dtype, t.shape, t.layout)


def transpose(name: str, args: Sequence[Expr], attrs: Attrs, span: Span) -> TType:
    """transpose(x, dim0, dim1): dims dim0 and dim1 swapped; a slice moves with its dim (a
    rank's part transposed is its part of the result), so any layout is carried."""
    (x,) = args
    t, d0, d1 = x.type, attrs["dim0"], attrs["dim1"]
    for d in (d0, d1):
        if not 0 <= d < t.ndim:
            raise TypeErr(span, f"transpose dim {d} is out of range for a {t.ndim}-d tensor")
    shape = list(t.shape)
    shape[d0], shape[d1] = shape[d1], shape[d0]
    lay = t.layout
    if lay.sliced and lay.dim in (d0, d1):
        lay = sliced(d1 if lay.dim == d0 else d0)
    return TType(t.dtype, tuple(shape), lay, t.weak)


def index(name: str, args: Sequence[Expr], attrs: Attrs, span: Span) -> TType:
    """index(x, i): x[i], the i-th slice along dim 0 (a layer of a stacked parameter: repeat,
    docs/language.md). Dim 0 must be an integer literal L with 0 <= i < L, and not sliced; a
    slice along dim d >= 1 is the result's slice along d - 1."""
    (x,) = args
    t, i = x.type, attrs["i"]
    if t.ndim < 1:
        raise TypeErr(span, "index needs a tensor of at least 1 dim (its dim 0 is indexed)")
    n = t.shape[0]
    if not isinstance(n, int):
        raise TypeErr(span, f"index: dim 0 of {t} is '{n}', not an integer literal (the index is checked "
                      "at compile time)")
    if not 0 <= i < n:
        raise TypeErr(span, f"index {i} is out of range for dim 0 of size {n}")
    lay = t.layout
    if lay.sliced:
        if lay.dim == 0:
            raise TypeErr(x.span or span, "index of a tensor sliced along dim 0 (the indexed dim); slice "
                          "another dim")
        lay = sliced(lay.dim - 1)
    return TType(t.dtype, t.shape[1:], lay, t.weak)


INFER = -1  # reshape: the one dim whose size follows from the others


def reshape_group(old: Sequence[Dim], new: Sequence[Dim]) -> tuple[int, int, int]:
    """How reshape maps `old` onto `new` (equal dims kept in front and behind): (p, n_old,
    n_new), the changed group being old[p:p + n_old] -> new[p:p + n_new]. INFER matches no dim."""
    p = 0
    while p < min(len(old), len(new)) and old[p] == new[p]:
        p += 1
    q = 0
    while q < min(len(old), len(new)) - p and old[-1 - q] == new[-1 - q]:
        q += 1
    return p, len(old) - p - q, len(new) - p - q


def _prod_dims(dims: Sequence[Dim]) -> Dim:
    out: Dim = 1
    for d in dims:
        out = dim_op("*", out, d)
    return out


def reshape(name: str, args: Sequence[Expr], attrs: Attrs, span: Span) -> TType:
    """reshape(x, [d, ...]): one dim split into adjacent dims ([B, S, H] -> [B, S, nh, hd]) or
    adjacent dims merged into one, the dims in front and behind unchanged; one entry may be -1
    (its size follows). A sliced dim outside the group stays sliced (moved with its position);
    inside it, only the group's outermost dim may be sliced, and the slice goes to the result's
    outermost dim of the group (a dim sliced over heads stays sliced over heads; that each
    rank's part is whole heads is checked when the call runs: reshape_slices)."""
    (x,) = args
    t, want = x.type, tuple(attrs["shape"])
    if list(want).count(INFER) > 1:
        raise TypeErr(span, "reshape: at most one dim may be -1")
    if any(isinstance(d, int) and d < INFER for d in want):
        raise TypeErr(span, f"reshape: a negative size {min(d for d in want if isinstance(d, int))}")
    p, n_old, n_new = reshape_group(t.shape, want)
    group_old, group_new = t.shape[p:p + n_old], list(want[p:p + n_new])
    if INFER in want and INFER not in group_new:
        raise TypeErr(span, "reshape: -1 stands for a dim of the split or merged group")
    if not (n_old == 1 or n_new == 1):
        shown = ", ".join(map(str, t.shape))
        raise TypeErr(span, f"reshape [{shown}] -> [{', '.join(map(str, want))}]: a reshape splits one dim "
                      "into adjacent dims or merges adjacent dims into one (the other dims unchanged)")
    if INFER in group_new:
        known = _prod_dims([d for d in group_new if d != INFER])
        group_new[group_new.index(INFER)] = dim_op("//", _prod_dims(group_old), known)
    old_n, new_n = _prod_dims(group_old), _prod_dims(group_new)
    if isinstance(old_n, int) and isinstance(new_n, int) and old_n != new_n:
        raise TypeErr(span, f"reshape: {' x '.join(map(str, group_old)) or '1'} = {old_n} elements cannot "
                      f"become {' x '.join(map(str, group_new)) or '1'} = {new_n}")
    shape = t.shape[:p] + tuple(group_new) + t.shape[p + n_old:]
    lay = t.layout
    if lay.sliced and p + n_old <= lay.dim:
        lay = sliced(lay.dim + n_new - n_old)
    elif lay.sliced and lay.dim > p:
        raise TypeErr(x.span or span, f"reshape of a tensor sliced along dim {lay.dim}: only the outermost "
                      f"dim ({p}) of the dims it {'merges' if n_new == 1 else 'splits'} may be sliced")
    return TType(t.dtype, shape, lay, t.weak)


def reshape_slices(src: TType, dst: TType) -> tuple[Dim, Dim, Dim] | None:
    """For a reshape whose group holds the sliced dim: (whole, part, rest), the sizes for which
    every rank's slice of `whole` must be its slice of `part` times `rest` (the run-time
    condition ceil(whole / R) == ceil(part / R) * rest, whole == part * rest); None otherwise."""
    lay = src.layout
    p, n_old, n_new = reshape_group(src.shape, dst.shape)
    if not lay.sliced or lay.dim != p or n_old == 0:
        return None
    if n_old == 1:  # a split: the old dim whole, the first new dim the part
        return src.shape[p], dst.shape[p], _prod_dims(dst.shape[p + 1:p + n_new])
    return dst.shape[p], src.shape[p], _prod_dims(src.shape[p + 1:p + n_old])


def reshape_problem(src: TType, dst: TType, sizes: dict[str, int], ranks: int) -> str | None:
    """Why a reshape of src into dst cannot run with these sizes on a group of `ranks` (None:
    it can): the element counts differ (a -1 that does not divide, sizes that disagree), or
    a rank's slice of the sliced dim is not its slice of the result's (heads that do not divide
    among the ranks). The same on every rank; runtime_cpp's reshape checks it alike."""
    n_src = math.prod(eval_dim(d, sizes) for d in src.shape)
    n_dst = math.prod(eval_dim(d, sizes) for d in dst.shape)
    if n_src != n_dst:
        shown = ", ".join(str(eval_dim(d, sizes)) for d in dst.shape)
        return (f"reshape of [{', '.join(str(eval_dim(d, sizes)) for d in src.shape)}] ({n_src} elements) into "
                f"[{shown}] ({n_dst}): the sizes disagree")
    cut = reshape_slices(src, dst)
    if cut is None:
        return None
    whole, part, rest = (eval_dim(d, sizes) for d in cut)
    if -(-whole // ranks) != -(-part // ranks) * rest:
        return (f"reshape of a dim of {whole} sliced over {ranks} ranks into {part} x {rest}: each rank's "
                f"slice must hold whole groups of {rest} (ceil({whole}/{ranks}) != ceil({part}/{ranks}) * {rest}; "
                f"make {part} divisible by {ranks})")
    return None


def conv2d(name: str, args: Sequence[Expr], attrs: Attrs, span: Span) -> TType:
    x, w = args
    tx, tw = x.type, w.type
    if tx.ndim != 4 or tw.ndim != 4:
        raise TypeErr(span, "conv2d needs x: [N, C, H, W] and w: [O, C, KH, KW]")
    if tx.shape[1] != tw.shape[1]:
        raise TypeErr(span, f"conv2d channels differ: {tx.shape[1]} vs {tw.shape[1]}")
    s, p = attrs["stride"], attrs["padding"]  # defaults filled in by type_op
    ho, wo = (dim_op("+", dim_op("//", dim_op("-", dim_op("+", h, 2 * p), k), s), 1)
              for h, k in ((tx.shape[2], tw.shape[2]), (tx.shape[3], tw.shape[3])))
    dt, _ = result_dtype([tx, tw], span)
    lx, lw = tx.layout, tw.layout
    if lw == REPLICATED and lx in (LOCAL, REPLICATED, sliced(0)):
        lay = lx
    elif lx == sliced(1) and lw == sliced(1):
        lay = LOCAL
    elif lx == REPLICATED and lw == sliced(0):
        lay = sliced(1)
    else:
        raise TypeErr(span, f"conv2d of {lx} x {lw} has no parallel meaning")
    return TType(dt, (tx.shape[0], tw.shape[0], ho, wo), lay)


def segment_norm(name: str, args: Sequence[Expr], attrs: Attrs, span: Span) -> TType:
    (x,) = args
    if x.type.ndim != 1:
        raise TypeErr(span, "segment_norm needs a 1-d (scattered) tensor")
    return TType(x.type.dtype, x.type.shape, x.type.layout)


def cast(name: str, args: Sequence[Expr], attrs: Attrs, span: Span) -> TType:
    t = args[0].type
    _no_bool(args, span, "an operand of cast")
    return TType(attrs["dtype"], t.shape, t.layout, False)


def dropout(name: str, args: Sequence[Expr], attrs: Attrs, span: Span) -> TType:
    x, p, seed = args
    if isinstance(p, Const) and not 0 <= p.value < 1:
        raise TypeErr(p.span, f"dropout probability must be in [0, 1), got {p.value}")
    if not isinstance(p, Const) and p.type.dtype not in FLOATS:
        raise TypeErr(p.span, "dropout's p must be a float")
    _no_bool(args, span, "an operand of dropout")
    if p.type.shape != () or seed.type.shape != ():
        raise TypeErr(span, "dropout(x, p, seed): p and seed must be scalars")
    if seed.type.dtype not in ("i64", "i32"):
        raise TypeErr(seed.span or span, f"dropout's seed must be an i64 scalar, not {seed.type.dtype}")
    return x.type


def where(name: str, args: Sequence[Expr], attrs: Attrs, span: Span) -> TType:
    if args[0].type.dtype != "bool":
        raise TypeErr(args[0].span or span, "where's condition must be a comparison (a < b, ...)")
    return pointwise(args, span, "where", allow_bool_first=True)


def compare(name: str, args: Sequence[Expr], attrs: Attrs, span: Span) -> TType:
    t = pointwise(args, span, "a comparison")
    return TType("bool", t.shape, t.layout)


def causal(name: str, args: Sequence[Expr], attrs: Attrs, span: Span) -> TType:
    """causal(x, diagonal=0): a condition of x's shape and layout (true where the element's
    last index is at most its second-last index + diagonal); x's values are not read."""
    (x,) = args
    if x.type.ndim < 2:
        raise TypeErr(x.span or span, f"causal needs a tensor of at least 2 dims (its last two are the "
                      f"query and key positions), not a {x.type.ndim}-d one")
    return TType("bool", x.type.shape, x.type.layout)


def collective(name: str, args: Sequence[Expr], attrs: Attrs, span: Span) -> TType:
    return collective_type(name, args[0].type, attrs, span, args[0].span)


def collective_type(op: str, t: TType, attrs: dict, span: Span, arg_span: Span | None = None) -> TType:
    """arg_span: the input's span, where a layout error points (else span, the call's)."""
    lay, at = t.layout, arg_span or span
    if op in ("allreduce", "reducescatter", "broadcast", "reduce") and lay.sliced:
        raise TypeErr(at, f"{op} needs a local (or replicated) input, not {lay}")
    if op == "allgather" and not lay.sliced:
        raise TypeErr(at, f"allgather needs a sliced input, not {lay}")
    if op == "scatter" and lay != REPLICATED:
        raise TypeErr(at, f"scatter needs a replicated input, not {lay}")
    if op in ("reducescatter", "scatter"):
        dim = attrs["dim"]
        if not 0 <= dim < t.ndim:
            raise TypeErr(span, f"{op} dim={dim} is out of range for a {t.ndim}-d tensor")
        return TType(t.dtype, t.shape, sliced(dim))
    result = {"allreduce": REPLICATED, "allgather": REPLICATED, "broadcast": REPLICATED,
              "reduce": LOCAL, "send": lay}[op]
    return TType(t.dtype, t.shape, result)


def extern_rule(like: int, slicing: str, dims: tuple[int, ...]) -> Rule:
    """An extern operation's rule: the result has the shape, dtype and layout of operand
    `like` (`type = x`). Other tensor operands are replicated and never reach the dim `like`
    is sliced along (the library gets them whole), or sliced exactly as `like`. A slice of
    `like` must be one the declaration allows (slicing: free, rows, dims(...), none)."""
    def rule(name: str, args: Sequence[Expr], attrs: Attrs, span: Span) -> TType:
        _no_bool(args, span, f"an operand of {name}")
        t = args[like].type
        lay = t.layout
        if lay.sliced and not _slice_allowed(slicing, dims, lay.dim, t.ndim):
            raise TypeErr(span, f"{name} does not commute with slicing along dim {lay.dim} "
                          "(its declaration's slicing); gather it first")
        for i, a in enumerate(args):
            at = a.type
            if i == like or at.ndim == 0 and not at.layout.sliced:
                continue
            same = at.layout == lay and (at.shape == t.shape or not lay.sliced)
            whole = at.layout == REPLICATED and not (lay.sliced and at.ndim >= t.ndim - lay.dim)
            if not (same or whole):
                raise TypeErr(a.span or span, f"{name}'s operand {i + 1} is {at.layout} {at}; it must "
                              f"be replicated (and not cut by the slice of operand {like + 1}) or "
                              f"have operand {like + 1}'s shape and layout")
        dt, _ = result_dtype([a.type for a in args], span, [a.span for a in args])
        return TType(dt, t.shape, lay, t.weak)
    return rule


def _slice_allowed(slicing: str, dims: tuple[int, ...], dim: int, ndim: int) -> bool:
    if slicing == "rows":
        return dim < ndim - 1
    if slicing == "dims":
        return dim in dims
    return slicing == "free"
