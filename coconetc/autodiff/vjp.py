"""The vector-Jacobian program of a typed program (reverse mode, at the IR level).

vjp(p, wrt) returns a new typed Program. Its parameters are p's plus one cotangent `d_<out>`
an output (the output's type and layout); it computes p's stages (every operation nested in a
differentiated stage gets a stage of its own: the values the backward reads), then the
cotangents in reverse order, and returns `d_<x>` for every x in wrt.

The loss it differentiates is L = sum over outputs of <out, d_out>, each logical value counted
once: a local output on every rank (its own cotangent), a replicated output once (its cotangent
is one logical value, the same on every rank), a sliced output once over its global shape. So a
replicated input's gradient is the full gradient, identical on every rank; a local input's is
that rank's own; a sliced input's is sliced like the input.

Layouts: a contribution to a replicated value computed per rank (by an operation whose result
is local, or by a collective's input side) is summed across ranks (an allreduce); one computed
on slices is gathered (an allgather), or summed when the slices were reduced away. The cotangent
of a local value may be typed replicated (every rank's cotangent is then the same), which is a
valid local value. docs/autodiff.md has the rules."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from coconetc.autodiff import ops as _gradops  # noqa: F401  (registers the operations a derived program adds)
from coconetc.errors import NOWHERE, CompileError, Span
from coconetc.ir import ops
from coconetc.ir.expr import Const, Expr, Op, Ref, refs
from coconetc.ir.nodes import Param, Program, Stage
from coconetc.ir.types import FLOATS, LOCAL, REPLICATED, TType

COMPARISONS = ("lt", "le", "gt", "ge", "eq", "ne", "causal")  # conditions: never a stage of their own

# A rule's answer: for each operand, (operand, its contribution or None, per_rank); per_rank
# None: the contribution is per rank when the operation's result is local.
Parts = list[tuple[Expr, Expr | None, bool | None]]


def default_wrt(p: Program) -> list[str]:
    """Every floating tensor parameter."""
    return [q.name for q in p.params if not q.scalar and q.type.dtype in FLOATS]


def vjp(p: Program, wrt: Sequence[str] | None = None, name: str | None = None) -> Program:
    """The vector-Jacobian program of p with respect to wrt (default: default_wrt(p))."""
    return _Deriver(p, list(default_wrt(p) if wrt is None else wrt), name or f"{p.name}_grad").run()


def differentiable(op: str) -> bool:
    return op in RULES


def live(stages: Sequence[Stage], outputs: Sequence[tuple[str, str]]) -> list[Stage]:
    """The stages the outputs read, in order: a forward value no cotangent needs (the
    program's own outputs, mostly) is not computed by the derived program."""
    need = {s for _, s in outputs}
    keep = []
    for st in reversed(stages):
        if st.name in need:
            keep.append(st)
            need |= set(refs(st.expr))
    return keep[::-1]


def cotangent_params(g: Program, p: Program) -> list[str]:
    """The cotangent parameters (`d_<output>`, one an output of p) of g = vjp(p): those after p's own."""
    return [q.name for q in g.params[len(p.params):]]


def recomputed(g: Program, p: Program) -> list[str]:
    """The forward values g = vjp(p) computes before its cotangents: the values the backward
    reads, recomputed from the inputs (none depends on a cotangent)."""
    dep = set(cotangent_params(g, p))
    out = []
    for st in g.stages:
        if dep & set(refs(st.expr)):
            dep.add(st.name)
        else:
            out.append(st.name)
    return out


@dataclass
class _Deriver:
    p: Program
    wrt: list[str]
    name: str
    stages: list[Stage] = field(default_factory=list)
    ct: dict[str, Ref] = field(default_factory=dict)  # a value's cotangent so far
    # a replicated value's per-rank partial sums not yet summed across ranks, each with the last
    # stage when it was added: added up and all-reduced once when the cotangent is read
    # (cotangent), after the last of those stages
    partial: dict[str, list[tuple[Ref, str]]] = field(default_factory=dict)
    taken: set[str] = field(default_factory=set)
    active: set[str] = field(default_factory=set)  # values that depend on wrt
    types: dict[str, TType] = field(default_factory=dict)

    # --- building ------------------------------------------------------------------------
    def fresh(self, base: str) -> str:
        n, k = base, 1
        while n in self.taken:
            k += 1
            n = f"{base}{k}"
        self.taken.add(n)
        return n

    def emit(self, base: str, e: Expr) -> Ref:
        if isinstance(e, Ref):
            return e
        n = self.fresh(base)
        self.stages.append(Stage(n, e))
        self.types[n] = e.type
        return Ref(n, e.type)

    def op(self, name: str, *args: Expr, base: str | None = None, **attrs: object) -> Expr:
        """A typed operation; a collective gets a stage of its own (the language wants a
        collective as the whole right-hand side of a statement) and is returned as its name,
        and so does its operand when that is a computation (`<base>_part`), so that a schedule
        can name it (overlap the matmul that feeds a backward all-reduce)."""
        collective = ops.get(name).kind == "collective"
        if collective and args and isinstance(args[0], Op):
            args = (self.emit(f"{base or 'g_' + name}_part", args[0]), *args[1:])
        t = ops.type_op(name, args, attrs, NOWHERE)
        e = Op(name, tuple(args), t, tuple(sorted(attrs.items())))  # the checker's order: equal to the parsed
        return self.emit(base or f"g_{name}", e) if collective else e

    def const(self, v: float, like: Expr) -> Const:
        """A weak float constant in like's dtype."""
        return Const(float(v), TType(like.type.dtype if like.type.dtype in FLOATS else "f64", (), REPLICATED, True))

    def scalars(self) -> set[str]:
        """The program's scalar parameters."""
        return {q.name for q in self.p.params if q.scalar}

    def is_active(self, e: Expr) -> bool:
        return any(n in self.active for n in refs(e))

    # --- the derivation --------------------------------------------------------------------
    def run(self) -> Program:
        p = self.p
        self.refuse()
        self.taken = {q.name for q in p.params} | {s.name for s in p.stages}
        self.active = set(self.wrt)
        for s in p.stages:
            if self.is_active(s.expr) and s.type.dtype in FLOATS:
                self.active.add(s.name)
        names = [self.fresh(f"d_{x}") for x in self.wrt]
        self.stages = self.hoisted(p.stages)
        self.types = {**{q.name: q.type for q in p.params}, **{s.name: s.type for s in self.stages}}
        params = list(p.params)
        for pub, sname in p.outputs:
            t = p.stage_named(sname).type
            dname = self.fresh(f"d_{pub}")
            params.append(Param(dname, t, scalar=t.ndim == 0 and t.layout == REPLICATED))
            if sname in self.active:
                self.add(sname, Ref(dname, t), per_rank=False, span=p.stage_named(sname).span)
        forward = len(self.stages)
        for s in reversed(self.stages[:forward]):
            g = self.cotangent(s.name)
            if g is not None:
                self.back(s, g)
        for x in self.wrt:
            self.cotangent(x)
        outputs = [(out, self.gradient(x, out, forward)) for x, out in zip(self.wrt, names)]
        return Program(self.name, tuple(params), tuple(live(self.stages, outputs)), tuple(outputs), span=p.span)

    def refuse(self) -> None:
        """What cannot be differentiated at all: updates, nothing returned, a bad wrt."""
        p = self.p
        for t, s in p.updates:
            raise CompileError.at(p.stage_named(s).span or p.span,
                                  f"update({t}, ...) has no derivative: a program with updates cannot be differentiated")
        if not p.outputs:
            raise CompileError.at(p.span, f"program '{p.name}' returns nothing to differentiate")
        for i, x in enumerate(self.wrt):
            if x in self.wrt[:i]:
                raise CompileError.at(p.span, f"'{x}' is named twice in the inputs to differentiate with respect to")
            q = p.param(x)
            if q is None:
                raise CompileError.at(p.span, f"'{p.name}' has no parameter '{x}' to differentiate with respect to")
            if q.type.dtype not in FLOATS:
                raise CompileError.at(q.span or p.span, f"parameter '{x}' is {q.type.dtype}: only floating values have gradients")

    def gradient(self, x: str, out: str, forward: int) -> str:
        """The stage named `out` holding x's gradient: the last stage of its cotangent renamed
        (when nothing else reads it and it is no other value's cotangent), or a new one (a
        copy; zeros when the outputs do not depend on x)."""
        q = self.p.param(x)
        assert q is not None
        g = self.ct.get(x)
        shared = [y for y, h in self.ct.items() if h == g and y != x]  # a contribution passed on as it is
        read = g is not None and any(g.name in refs(s.expr) for s in self.stages)
        if g is not None and not shared and not read and any(s.name == g.name for s in self.stages[forward:]):
            i = next(i for i, s in enumerate(self.stages) if s.name == g.name)
            self.stages[i] = replace(self.stages[i], name=out)
            return out
        zeros = self.op("mul", Ref(x, q.type), self.const(0.0, Ref(x, q.type)))
        e = zeros if g is None else g if g.type.shape == q.type.shape else self.op("add", zeros, g)
        self.stages.append(Stage(out, e))
        return out

    def hoisted(self, stages: Sequence[Stage]) -> list[Stage]:
        """The forward stages with every operation nested in an active stage given a stage of
        its own (the values the backward reads are saved, not recomputed). Comparisons (where's
        condition) stay nested."""
        out: list[Stage] = []

        def name_args(e: Expr, base: str) -> Expr:
            if not isinstance(e, Op):
                return e
            args = []
            for a in e.args:
                if isinstance(a, Op) and a.op not in COMPARISONS and self.is_active(a):
                    a = name_args(a, base)
                    assert isinstance(a, Op)
                    n = self.fresh(f"{base}_{ops.shown(a.op)}")
                    out.append(Stage(n, a, a.span))
                    self.active.add(n)
                    a = Ref(n, a.type, a.span)
                args.append(a)
            return replace(e, args=tuple(args))

        for s in stages:
            out.append(replace(s, expr=name_args(s.expr, s.name)) if s.name in self.active else s)
        return out

    def back(self, s: Stage, g: Ref) -> None:
        """Propagate cotangent g of stage s to the names its operation reads (after hoisting,
        every active operand is a name)."""
        e = s.expr
        span = e.span or s.span or self.p.span
        if isinstance(e, Ref):
            self.add(e.name, g, per_rank=False, span=span)
            return
        if not isinstance(e, Op):
            return
        rule = RULES.get(e.op)
        if rule is None and ops.get(e.op).extern is not None:  # its declared grad_<p> (autodiff/extern.py)
            from coconetc.autodiff.extern import rule
        if rule is None:
            detail = f"({ops.attr(e, 'op')})" if any(k == "op" for k, _ in e.attrs) else ""
            raise CompileError.at(span, f"'{ops.shown(e.op)}{detail}' has no derivative (yet): cannot differentiate through it")
        for arg, c, per_rank in rule(self, e, Ref(s.name, e.type), g):
            if c is not None and isinstance(arg, Ref) and arg.name in self.active and not _times_zero(c):
                self.add(arg.name, c, e.type.layout == LOCAL if per_rank is None else per_rank, span)

    def add(self, name: str, c: Expr, per_rank: bool, span: Span) -> None:
        """Accumulate contribution c into the cotangent of `name`. per_rank: c was computed on
        each rank for its own use of the value (a local result, a collective's input). A
        replicated value's per-rank partial sums (the input gradients of the column-parallel
        matmuls that read it: q, k and v's) are added up first and all-reduced once, when the
        cotangent is read (Megatron's one all-reduce for its fused qkv)."""
        t = self.types[name]
        c = self.unbroadcast(c, t, span)
        if t.layout == REPLICATED and (per_rank or c.type.layout != REPLICATED):
            if c.type.layout.sliced:
                c = self.op("allgather", c, base=f"g_{name}")
            else:
                part = self.emit(f"g_{name}_part", c)
                self.partial.setdefault(name, []).append((part, self.stages[-1].name if self.stages else ""))
                return
        self.contribute(name, c)

    def contribute(self, name: str, c: Expr) -> None:
        t = self.types[name]
        if c.type.dtype != t.dtype:
            c = self.op("cast", c, dtype=t.dtype)
        old = self.ct.get(name)
        self.ct[name] = self.emit(f"g_{name}", c if old is None else self.op("add", old, c))

    def cotangent(self, name: str) -> Ref | None:
        """The cotangent of `name`, its per-rank partial sums all-reduced (once) first: the sum
        and its allreduce placed right after the last partial sum (where one partial sum's
        allreduce always was)."""
        parts = self.partial.pop(name, [])
        if parts:
            n = len(self.stages)
            total: Expr = parts[0][0]
            for q, _ in parts[1:]:
                total = self.op("add", total, q)
            summed = self.op("allreduce", total, op="sum", base=f"g_{name}")
            self._move_up(n, [m for _, m in parts])  # (they read only the partial sums)
            old, n = self.ct.get(name), len(self.stages)
            self.contribute(name, summed)
            assert isinstance(summed, Ref)  # (a collective is a stage of its own: _Deriver.op)
            self._move_up(n, [summed.name, old.name if old is not None else ""])
        return self.ct.get(name)

    def _move_up(self, n: int, after: list[str]) -> None:
        """Moves the stages from index n on to just after the last of the stages named in
        `after` ("" or a parameter: none), where they would have been emitted."""
        index = {x.name: i for i, x in enumerate(self.stages[:n])}
        made, at = self.stages[n:], max((index[m] + 1 for m in after if m in index), default=0)
        self.stages[n:] = []
        self.stages[at:at] = made

    def unbroadcast(self, c: Expr, t: TType, span: Span) -> Expr:
        """c summed down to shape t.shape (NumPy broadcasting undone)."""
        if c.type.shape == t.shape:
            return c
        if not t.shape:
            return self.op("sum", c)
        if c.type.ndim > t.ndim:
            c = self.op("sum_lead", c, n=c.type.ndim - t.ndim)
        for i, (have, want) in enumerate(zip(c.type.shape, t.shape)):
            if want == 1 and have != 1:  # broadcast along a size-1 dim
                c = self.op("sum_keep", c, dim=i)
        return c


# --- the rules: one function an operation ----------------------------------------------------
Rule = Callable[[_Deriver, Op, Ref, Ref], Parts]
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _unary(f: Callable[[_Deriver, Expr, Ref, Ref], Expr]) -> Rule:
    """A one-operand rule from dx = f(d, x, y, g) with y the result."""
    return lambda d, e, y, g: [(e.args[0], f(d, e.args[0], y, g), None)]


def _pow(d: _Deriver, e: Op, y: Ref, g: Ref) -> Parts:
    x, k = e.args
    dx = d.op("mul", d.op("mul", g, k), d.op("pow", x, d.op("sub", k, d.const(1.0, k))))
    dk = d.op("mul", d.op("mul", g, y), d.op("log", x)) if d.is_active(k) else None
    return [(x, dx, None), (k, dk, None)]


def _gelu(d: _Deriver, x: Expr, y: Ref, g: Ref) -> Expr:
    """gelu'(x) = Phi(x) + x phi(x); Phi(x) = gelu(x) / x (0.5 at 0): the language has no erf."""
    o, c = d.op, d.const
    zero = o("eq", x, c(0.0, x))
    cdf = o("where", zero, c(0.5, x), o("div", y, o("where", zero, c(1.0, x), x)))
    pdf = o("mul", o("exp", o("mul", o("mul", x, x), c(-0.5, x))), c(_INV_SQRT_2PI, x))
    return o("mul", g, o("add", cdf, o("mul", x, pdf)))


def _select(keep: str) -> Rule:
    """min/max: the cotangent goes to the operand chosen (the first one on a tie)."""
    def rule(d: _Deriver, e: Op, y: Ref, g: Ref) -> Parts:
        a, b = e.args
        pick, z = d.op(keep, a, b), d.const(0.0, g)
        return [(a, d.op("where", pick, g, z), None), (b, d.op("where", pick, z, g), None)]
    return rule


def _where(d: _Deriver, e: Op, y: Ref, g: Ref) -> Parts:
    """A causal condition reads only its operand's shape and layout: where the cotangent has
    both, the backward's condition reads the cotangent instead, so the forward need not keep the
    operand for it (attention's scores, when its softmax is kept: plan/attention.py)."""
    cond, a, b = e.args
    if isinstance(cond, Op) and cond.op == "causal":
        x = cond.args[0]
        if (x.type.shape, x.type.layout) == (g.type.shape, g.type.layout):
            cond = replace(cond, args=(g, *cond.args[1:]))
    z = d.const(0.0, g)
    return [(cond, None, None), (a, d.op("where", cond, g, z), None), (b, d.op("where", cond, z, g), None)]


def _reduced(d: _Deriver, e: Op, y: Expr, g: Expr) -> Expr:
    """A rank's share of the cotangent g of y = reduce(op, x) over the group (y and g whole):
    sum: g; avg: g / R; max, min: g where x is the result, split evenly among the ranks that
    tie (as torch.amax does: the shares add up to g, so a replicated x, the same on every rank,
    gets exactly g); prod: g * y / x."""
    x, how = e.args[0], ops.attr(e, "op")
    if how == "sum":
        return g
    if how == "avg":
        ranks = d.op("allreduce", Const(1.0, TType("f32", (), REPLICATED, True)), op="sum")
        return d.op("div", g, d.op("cast", ranks, dtype=g.type.dtype))
    if how in ("max", "min"):
        # n >= 1 where x is the result (the literals' dtype is weak: cast, as text reads them as f32)
        f32 = TType("f32", (), REPLICATED, True)
        ties = d.op("allreduce", d.op("where", d.op("eq", x, y), Const(1.0, f32), Const(0.0, f32)), op="sum")
        return d.op("where", d.op("eq", x, y), d.op("div", g, d.op("cast", ties, dtype=g.type.dtype)), d.const(0.0, g))
    return d.op("div", d.op("mul", g, y), x)


def _layernorm(d: _Deriver, e: Op, y: Ref, g: Ref) -> Parts:
    """y = xhat * gamma + beta with xhat = (x - mean) * rsqrt(var + eps) over the last dim:
    dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = g * gamma;
    dgamma = g * xhat and dbeta = g summed over the leading dims. dx and dgamma are one operation
    each (layernorm_dx, layernorm_dgamma: a pass for the row's statistics, one for the result);
    where eps is differentiated, or is neither a literal nor a scalar parameter, the pieces."""
    x, gamma, beta, eps = e.args
    o = d.op
    if not d.is_active(eps) and (isinstance(eps, Const) or (isinstance(eps, Ref) and eps.name in d.scalars())):
        return [(x, o("layernorm_dx", x, gamma, g, eps), None), (gamma, o("layernorm_dgamma", x, g, eps), None),
                (beta, g, None)]
    xc = d.emit("g_xc", o("sub", x, o("mean_last", x)))
    rstd = d.emit("g_rstd", o("rsqrt", o("add", o("mean_last", o("mul", xc, xc)), eps)))
    xhat = d.emit("g_xhat", o("mul", xc, rstd))
    dxhat = d.emit("g_dxhat", o("mul", g, gamma))
    dx = o("mul", rstd, o("sub", o("sub", dxhat, o("mean_last", dxhat)),
                          o("mul", xhat, o("mean_last", o("mul", dxhat, xhat)))))
    deps = None
    if d.is_active(eps):  # dy/deps = -0.5 gamma xc rstd^3
        deps = o("mul", o("mul", dxhat, xc), o("mul", o("mul", rstd, o("mul", rstd, rstd)), d.const(-0.5, rstd)))
    return [(x, dx, None), (gamma, o("mul", g, xhat), None), (beta, g, None), (eps, deps, None)]


def _softmax(d: _Deriver, e: Op, y: Ref, g: Ref) -> Parts:
    """y = softmax(x) over the last dim: dx = y * (g - the row sum of g * y). A masked entry
    (y = 0) and a fully masked row (all zeros) get 0."""
    o = d.op  # the row sums a stage of their own: stored in the dtype by every backend alike
    row = d.emit("g_rows", o("sum_keep", o("mul", g, y), dim=y.type.ndim - 1))
    return [(e.args[0], o("mul", y, o("sub", g, row)), None)]


def _batched_matmul(d: _Deriver, e: Op, g: Ref) -> Parts:
    """y = a @ b with b batched: dA = g @ b^T, dB = a^T @ g, each a batched matmul of the
    operands with their last two dims transposed (a 2-d a's dA is summed over the batch when
    it is added: unbroadcast)."""
    a, b = e.args
    return [(a, d.op("matmul", g, _swap_last(d, b)), None), (b, d.op("matmul", _swap_last(d, a), g), None)]


def _swap_last(d: _Deriver, x: Expr) -> Expr:
    """x with its last two dims transposed."""
    return d.op("transpose", x, dim0=x.type.ndim - 2, dim1=x.type.ndim - 1)


def _reshape(d: _Deriver, e: Op, y: Ref, g: Ref) -> Parts:
    """g reshaped back to x's shape (written with -1 for x's one computed dim, if any)."""
    x = e.args[0]
    back = tuple(s if isinstance(s, (int, str)) else -1 for s in x.type.shape)
    if back.count(-1) > 1:
        raise CompileError.at(e.span or d.p.span, f"reshape of a tensor with computed dims {x.type}: its derivative "
                              "cannot write the shape back (at most one dim may be computed)")
    return [(x, d.op("reshape", g, shape=back), None)]


def _gathered(d: _Deriver, e: Op, g: Ref) -> Expr:
    """An allgather's transpose: this rank's slice of its cotangent (a scatter). When the
    cotangent is an allreduce(sum) of partial sums that only this reads (the input gradients of
    the row-parallel matmuls that read the gathered value: Megatron's sequence-parallel
    backward), the allreduce and the scatter are one reducescatter: half the traffic."""
    dim = e.args[0].type.layout.dim
    s = next((x for x in d.stages if x.name == g.name), None)
    if (s is not None and isinstance(s.expr, Op) and s.expr.op == "allreduce" and ops.attr(s.expr, "op") == "sum"
            and not any(g.name in refs(x.expr) for x in d.stages)):
        return d.op("reducescatter", s.expr.args[0], op="sum", dim=dim,
                    base=f"g_{e.args[0].name}" if isinstance(e.args[0], Ref) else None)
    return d.op("scatter", g, dim=dim)


def _is_root(d: _Deriver, e: Op) -> Expr:
    """A local condition, true on the group's rank `root` only: reduce(sum, 1.0, root) is the
    group's size R there and 1 elsewhere (and R = 1 alone is the root)."""
    one = Const(1.0, TType("f32", (), REPLICATED, True))
    counted = d.op("reduce", one, op="sum", root=ops.attr(e, "root"))
    return d.op("eq", counted, d.op("allreduce", one, op="sum"))


def _broadcast(d: _Deriver, e: Op, y: Ref, g: Ref) -> Parts:
    """y = x on the root: the root's x gets g, the others nothing."""
    return [(e.args[0], d.op("where", _is_root(d, e), g, d.const(0.0, g)), True)]


def _reduce(d: _Deriver, e: Op, y: Ref, g: Ref) -> Parts:
    """reduce(op, x, root): the root's y is every rank's x reduced, another rank's y its own x;
    so every x gets its share of the root's cotangent (as allreduce's, _reduced, with the
    root's y and g broadcast: sum g, avg g / R, max/min g where x is the root's result split
    among the ties, prod g y / x), and a rank other than the root its own cotangent too."""
    root = ops.attr(e, "root")
    share = _reduced(d, e, d.op("broadcast", y, root=root), d.op("broadcast", g, root=root))
    own = d.op("where", _is_root(d, e), d.const(0.0, g), g)
    return [(e.args[0], d.op("add", share, own), True)]


def _segment_norm(d: _Deriver, e: Op, y: Ref, g: Ref) -> Parts:
    """y_i = the norm of x's segment holding i: dx_i = x_i * (the sum over i's segment of g / y).
    The language has no segment sum, but segment_norm gives one of a value v >= 0 as
    segment_norm(sqrt(v)) ** 2: so v's positive and negative parts, one each."""
    o, c = d.op, d.const
    x = e.args[0]
    v = d.emit("g_v", o("div", g, _nonzero(d, y)))  # a zero segment (x = 0 there) gets 0
    pos = o("segment_norm", o("sqrt", o("max", v, c(0.0, v))))
    neg = o("segment_norm", o("sqrt", o("max", o("neg", v), c(0.0, v))))
    total = o("sub", o("mul", pos, pos), o("mul", neg, neg))
    return [(x, o("mul", x, total), None)]


def _nonzero(d: _Deriver, y: Expr) -> Expr:
    """A norm as a divisor: 1 where it is 0 (x is then 0 too, and x * (g / 1) gives the
    subgradient 0 there, as PyTorch does, not 0 * inf = NaN)."""
    return d.op("where", d.op("eq", y, d.const(0.0, y)), d.const(1.0, y), y)


def _dropout(d: _Deriver, e: Op, y: Ref, g: Ref) -> Parts:
    """The forward's mask: the same seed, the same RNG site (attrs), the same element indices.
    The probability has no derivative (the mask is a step function of it): a p that depends on
    wrt is an error, not a silent zero."""
    if d.is_active(e.args[1]):
        raise CompileError.at(e.args[1].span or e.span, "dropout's probability has no derivative (the mask is a step "
                                                        "function of it): leave it out of wrt")
    return [(e.args[0], Op("dropout", (g, *e.args[1:]), g.type, e.attrs), None), (e.args[1], None, None), (e.args[2], None, None)]


def _extreme(d: _Deriver, e: Op, y: Ref, g: Ref) -> Parts:
    """y = max(x) (or min(x)): the subgradient torch.amax takes: g goes to the elements equal
    to y, split evenly among the ties (their number summed across the ranks of a sliced x, as
    the sum reduction does; none where y is NaN)."""
    x = e.args[0]
    hit = d.op("eq", x, y)
    f32 = TType("f32", (), REPLICATED, True)  # the literals as text reads them (weak f32): cast the count
    ties = d.op("cast", d.op("sum", d.op("where", hit, Const(1.0, f32), Const(0.0, f32))), dtype=g.type.dtype)
    return [(x, d.op("where", hit, d.op("div", g, ties), d.const(0.0, g)), False)]


def _spread(d: _Deriver, x: Expr, g: Expr) -> Expr:
    """A scalar cotangent at every element of x (x * 0 + g: the language has no fill)."""
    return d.op("add", d.op("mul", x, d.const(0.0, x)), g)


def _times_zero(c: Expr) -> bool:
    """Is contribution c a product with a literal 0 (the cotangent of `0.0 * w`, the beta of a
    layernorm without a bias: frontend/checker.py)? It adds nothing, so it is left out, and what
    only it read (the beta's gradient: a sum over rows, under sequence parallelism an all-reduce)
    is never computed. (An inf or NaN cotangent times 0 would be NaN; the literal says the value
    does not depend on w.)"""
    return isinstance(c, Op) and c.op == "mul" and any(isinstance(a, Const) and a.value == 0 for a in c.args)


RULES: dict[str, Rule] = {
    "add": lambda d, e, y, g: [(e.args[0], g, None), (e.args[1], g, None)],
    "sub": lambda d, e, y, g: [(e.args[0], g, None), (e.args[1], d.op("neg", g), None)],
    "mul": lambda d, e, y, g: [(e.args[0], d.op("mul", g, e.args[1]), None), (e.args[1], d.op("mul", g, e.args[0]), None)],
    "div": lambda d, e, y, g: [(e.args[0], d.op("div", g, e.args[1]), None),
                               (e.args[1], d.op("neg", d.op("div", d.op("mul", g, y), e.args[1])), None)],
    "neg": _unary(lambda d, x, y, g: d.op("neg", g)),
    "pow": _pow,
    "sqrt": _unary(lambda d, x, y, g: d.op("div", d.op("mul", g, d.const(0.5, g)), y)),
    "rsqrt": _unary(lambda d, x, y, g: d.op("div", d.op("mul", d.op("mul", g, d.const(-0.5, g)), y), x)),
    "exp": _unary(lambda d, x, y, g: d.op("mul", g, y)),
    "log": _unary(lambda d, x, y, g: d.op("div", g, x)),
    "abs": _unary(lambda d, x, y, g: d.op("where", d.op("lt", x, d.const(0.0, x)), d.op("neg", g), g)),
    "tanh": _unary(lambda d, x, y, g: d.op("mul", g, d.op("sub", d.const(1.0, y), d.op("mul", y, y)))),
    "sigmoid": _unary(lambda d, x, y, g: d.op("mul", d.op("mul", g, y), d.op("sub", d.const(1.0, y), y))),
    "relu": _unary(lambda d, x, y, g: d.op("where", d.op("gt", x, d.const(0.0, x)), g, d.const(0.0, g))),
    "gelu": _unary(_gelu),
    "where": _where,
    "min": _select("le"),
    "max": _select("ge"),
    "cast": _unary(lambda d, x, y, g: d.op("cast", g, dtype=x.type.dtype)),
    # reductions: the scalar cotangent at every element (per_rank False: a sum of a sliced
    # value is replicated and already whole)
    "sum": lambda d, e, y, g: [(e.args[0], _spread(d, e.args[0], g), False)],
    "norm": lambda d, e, y, g: [(e.args[0], d.op("mul", e.args[0], d.op("div", g, _nonzero(d, y))), False)],
    "segment_norm": _segment_norm,
    "amax": _extreme,
    "amin": _extreme,
    # matmul: dA = dC @ B^T, dB = A^T @ dC (the batch dims of A summed)
    "matmul": lambda d, e, y, g: _batched_matmul(d, e, g) if e.args[1].type.ndim > 2 else [
        (e.args[0], d.op("matmul_nt", g, e.args[1]), None), (e.args[1], d.op("matmul_tn", e.args[0], g), None)],
    "layernorm": _layernorm,
    "softmax": _softmax,
    "transpose": lambda d, e, y, g: [(e.args[0], d.op("transpose", g, dim0=ops.attr(e, "dim0"),
                                                      dim1=ops.attr(e, "dim1")), None)],
    "reshape": _reshape,
    "index": lambda d, e, y, g: [(e.args[0], d.op("unindex", g, i=ops.attr(e, "i"), n=e.args[0].type.shape[0]),
                                  None)],
    "dropout": _dropout,
    "conv2d": lambda d, e, y, g: [
        (e.args[0], d.op("conv2d_dx", g, e.args[1], e.args[0], stride=ops.attr(e, "stride"), padding=ops.attr(e, "padding")), None),
        (e.args[1], d.op("conv2d_dw", e.args[0], g, e.args[1], stride=ops.attr(e, "stride"), padding=ops.attr(e, "padding")), None)],
    # collectives: the input side is per rank
    "allreduce": lambda d, e, y, g: [(e.args[0], _reduced(d, e, y, g), True)],
    "reducescatter": lambda d, e, y, g: [(e.args[0], _reduced(d, e, d.op("allgather", y), d.op("allgather", g)), True)],
    "broadcast": _broadcast,
    "reduce": _reduce,
    "send": lambda d, e, y, g: [(e.args[0], d.op("send", g, direction="prev" if ops.attr(e, "direction") == "next" else "next"), False)],
    "allgather": lambda d, e, y, g: [(e.args[0], _gathered(d, e, g), False)],
    "scatter": lambda d, e, y, g: [(e.args[0], d.op("allgather", g), False)],
}
