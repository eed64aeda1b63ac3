"""AST -> typed IR. Checks names, single assignment, dtypes, shapes and layouts, and reports
every error of a program at once (a stage that fails is skipped, so one mistake is reported
once, not again at each use)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from coconetc.ir.limits import too_big
from coconetc.errors import CompileError, Diagnostic, Span
from coconetc.frontend import calls, syntax
from coconetc.frontend.defs import Scope, bind, bind_def, builtin_of, without_site
from coconetc.ir import nodes as ir
from coconetc.ir import ops
from coconetc.ir.types import DTYPES, FLOATS, LOCAL, REPLICATED, Dim, TType, dim_symbols, scalar_type, sliced
from coconetc.ir.ops import type_op
from coconetc.ir.typerules import TypeErr

# update(t, value) is a statement form, not an operation of the registry
_UPDATE = ops.OpDef("update", "pointwise", (ops.Arg("t"), ops.Arg("value")))


class _Skip(Exception):
    """Raised when an expression reads a stage that already failed (reported once)."""


@dataclass
class _Ctx:
    params: dict[str, ir.Param]
    stages: dict[str, ir.Stage] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)
    errors: list[Diagnostic] = field(default_factory=list)
    stage: str = ""
    sites: int = 0
    scope: Scope = field(default_factory=Scope)
    env: dict[str, ir.Expr] | None = None  # inside a defined operation's body: its operands
    extents: dict[int, tuple[int, int, ir.Expr]] = field(default_factory=dict)  # see _extent
    # inside an inlined program (a call): its size symbols in the caller's dims, its stages'
    # new names (site=NAME), the programs being inlined (outermost first), and each inlined
    # stage's call (for a later statement that takes its name)
    dims: dict[str, Dim] | None = None
    renames: dict[str, str] = field(default_factory=dict)
    stack: tuple[str, ...] = ()
    inlined: dict[str, str] = field(default_factory=dict)

    def type_of(self, name: str, span: Span) -> TType:
        if name in self.failed:
            raise _Skip
        if name in self.params:
            return self.params[name].type
        if name in self.stages:
            return self.stages[name].type
        raise TypeErr(span, f"unknown name '{name}'")


def check_program(prog: syntax.Program, scope: Scope | None = None) -> ir.Program:
    """Type a program; raises CompileError with every error found. scope: the operations its
    file defines and declares, and its programs, which it may call (frontend/defs.py). A
    program is checked once per scope (a call checks its callee first)."""
    scope = scope or Scope()
    done = scope.checked.get(prog.name)
    if done is not None and done[0] is prog:
        if isinstance(done[1], CompileError):
            raise done[1]
        return done[1]  # type: ignore[return-value]
    try:
        out = _check_program(prog, scope)
    except CompileError as err:
        scope.checked[prog.name] = (prog, err)
        raise
    scope.checked[prog.name] = (prog, out)
    return out


def _check_program(prog: syntax.Program, scope: Scope) -> ir.Program:
    ctx = _Ctx({}, scope=scope, stack=(prog.name,))
    params = [q for q in (_param(p, ctx) for p in prog.params) if q is not None]
    ctx.params = {p.name: p for p in params}
    # a parameter with a bad declaration is reported once, not again at each use
    ctx.failed.update(p.name for p in prog.params if p.name not in ctx.params)
    updates: dict[str, str] = {}
    outputs: list[tuple[str, str]] = []
    for stmt in prog.body:
        try:
            _statement(stmt, ctx, updates, outputs)
        except TypeErr as err:
            ctx.errors.extend(err.diagnostics)
            ctx.failed.update(t.id for t in getattr(stmt, "targets", ()))
        except _Skip:
            ctx.failed.update(t.id for t in getattr(stmt, "targets", ()))
    if ctx.errors:
        raise CompileError(ctx.errors)
    return ir.Program(prog.name, tuple(params), tuple(ctx.stages.values()), tuple(outputs),
                      tuple(updates.items()), span=prog.span)


def _param(p: syntax.Param, ctx: _Ctx) -> ir.Param | None:
    def err(span: Span, msg: str) -> None:  # records the error; the parameter is then None
        ctx.errors.append(Diagnostic(span, msg))
    if p.name in ctx.params:
        err(p.span, f"parameter '{p.name}' is declared twice")
    ctx.params[p.name] = None  # type: ignore[assignment]  # marks the name as taken
    if p.dtype not in DTYPES:
        err(p.dtype_span, f"unknown dtype '{p.dtype}' (one of {', '.join(DTYPES)})")
        return None
    if p.shape is None:
        if p.layout is not None:
            err(p.layout.span, f"scalar '{p.name}' takes no layout (scalars are replicated)")
            return None
        return ir.Param(p.name, scalar_type(p.dtype), scalar=True, span=p.span)
    shape = tuple(d.name if isinstance(d, syntax.DimName) else d.value for d in p.shape)
    for d in p.shape:
        if isinstance(d, syntax.DimInt) and d.value < 1:
            err(d.span, "a dimension must be at least 1")
    big = too_big((d.value for d in p.shape if isinstance(d, syntax.DimInt)), p.dtype)
    if big:
        err(p.span, f"'{p.name}' is too large: {big}")
    lay, scattered = _layout(p.layout, len(shape), ctx)
    if lay is None:
        return None
    return ir.Param(p.name, TType(p.dtype, shape, lay), scattered=scattered, span=p.span)


def _layout(decl: syntax.LayoutDecl | None, ndim: int, ctx: _Ctx):
    if decl is None:
        return REPLICATED, False
    kinds = {"local": LOCAL, "replicated": REPLICATED}
    if decl.kind not in (*kinds, "sliced"):
        ctx.errors.append(Diagnostic(decl.span, f"unknown layout '{decl.kind}' (local, replicated, sliced(d))"))
        return None, False
    if decl.dim is not None and decl.kind != "sliced":
        ctx.errors.append(Diagnostic(decl.span, f"layout '{decl.kind}' takes no dimension"))
        return None, False
    lay = kinds.get(decl.kind) or sliced(decl.dim or 0)
    if lay.sliced and not lay.dim < ndim:
        ctx.errors.append(Diagnostic(decl.span, f"sliced({lay.dim}) is out of range for a {ndim}-d tensor"))
        return None, False
    if decl.scattered is None:
        return lay, False
    if decl.scattered != "scattered":
        ctx.errors.append(Diagnostic(decl.span, f"unexpected '{decl.scattered}' after the layout (did you mean 'scattered'?)"))
        return None, False
    if ndim != 1:
        ctx.errors.append(Diagnostic(decl.span, "only a 1-d tensor can be scattered"))
        return None, False
    return lay, True


def _statement(stmt: syntax.Stmt, ctx: _Ctx, updates: dict, outputs: list) -> None:
    if isinstance(stmt, syntax.Return):
        return _return(stmt, ctx, outputs)
    if isinstance(stmt, syntax.ExprStmt):
        value = stmt.value
        if not (isinstance(value, syntax.Call) and value.fn == "update"):
            raise TypeErr(stmt.span, "an expression on its own does nothing; assign it: name = ...")
        target = value.args[0].id if value.args and isinstance(value.args[0], syntax.Name) else "t"
        new = f"{target}_new"
        while new in ctx.stages or new in ctx.params:
            new += "_"
        targets: tuple[syntax.Name, ...] = (syntax.Name(new, stmt.span),)
    else:
        targets, value = stmt.targets, stmt.value
    if isinstance(value, syntax.Call) and calls.is_call(value, ctx.scope):
        _defined(targets, ctx)
        _program_call([t.id for t in targets], value, ctx, stmt.span)
        return
    if len(targets) != 1:
        raise TypeErr(targets[1].span, "a program statement defines one name (several names are for schedules)")
    name = targets[0]
    _defined(targets, ctx)
    ctx.stage, ctx.sites = name.id, 0
    expr = _top(value, ctx, updates)
    if expr.type.dtype == "bool":
        raise TypeErr(_where_of(value), "a comparison can only be the condition of where()")
    ctx.stages[name.id] = ir.Stage(name.id, expr, stmt.span)


def _defined(targets: tuple[syntax.Name, ...], ctx: _Ctx) -> None:
    """A statement's names must be new (an inlined call's stages are named too)."""
    for name in targets:
        if name.id in ctx.params or name.id in ctx.stages or name.id in ctx.failed:
            why = f" (a stage of the call {ctx.inlined[name.id]})" if name.id in ctx.inlined else ""
            raise TypeErr(name.span, f"'{name.id}' is already defined{why} (names are single-assignment)")
        if targets.count(name) > 1:
            raise TypeErr(name.span, f"'{name.id}' is named twice")


def _where_of(e: syntax.Expr) -> Span:
    """Where an error about an expression points: a binary operation's operator."""
    return (isinstance(e, syntax.BinOp) and e.op_span) or e.span


def _top(value: syntax.Expr, ctx: _Ctx, updates: dict) -> ir.Expr:
    """A stage's right-hand side: collectives and update() may only stand here."""
    if isinstance(value, syntax.Call) and value.fn == "update":
        return _update(value, ctx, updates)
    if isinstance(value, syntax.Call) and _is_collective(value):
        return _call(value, ctx, top=True)
    return _expr(value, ctx)


def _is_collective(call: syntax.Call) -> bool:
    d = ops.called(call.fn)
    return d is not None and d.kind == "collective"


def _update(call: syntax.Call, ctx: _Ctx, updates: dict) -> ir.Expr:
    pos, _ = _bind(call)
    t = pos[0]
    if isinstance(t, syntax.Name) and t.id in ctx.failed:
        raise _Skip  # a parameter with a bad declaration, reported already
    if not isinstance(t, syntax.Name) or t.id not in ctx.params or ctx.params[t.id] is None:
        raise TypeErr(t.span, "update's first argument must be a parameter tensor")
    param = ctx.params[t.id]
    if param.scalar:
        raise TypeErr(t.span, f"cannot update scalar '{t.id}' (scalars are inputs only)")
    if t.id in updates:
        raise TypeErr(t.span, f"'{t.id}' is already updated by '{updates[t.id]}'")
    value = pos[1]
    expr = (_call(value, ctx, top=True) if isinstance(value, syntax.Call) and _is_collective(value)
            else _expr(value, ctx))
    if expr.type.dtype == "bool":
        raise TypeErr(_where_of(value), "a comparison can only be the condition of where()")
    _check_update(param, expr, value.span)
    updates[t.id] = ctx.stage
    return expr


def _check_update(param: ir.Param, expr: ir.Expr, span: Span) -> None:
    pt, et = param.type, expr.type
    if et.dtype != pt.dtype and not et.weak:
        raise TypeErr(span, f"update of '{param.name}' ({pt.dtype}) with a {et.dtype} value; use cast")
    if et.shape != pt.shape:
        shown = ", ".join(map(str, et.shape))
        raise TypeErr(span, f"update of '{param.name}' needs shape {pt}; the value has [{shown}]")
    ok = et.layout == pt.layout or et.layout == REPLICATED or (pt.layout == LOCAL and not et.layout.sliced)
    if not ok:
        raise TypeErr(span, f"update of {pt.layout} '{param.name}' with a {et.layout} value "
                      "(ranks would disagree; communicate first)")


def _return(stmt: syntax.Return, ctx: _Ctx, outputs: list) -> None:
    if outputs:
        raise TypeErr(stmt.span, "a program has one return statement")
    for item in stmt.items:
        ctx.type_of(item.name.id, item.name.span)
        public = (item.alias or item.name).id
        if public in (o[0] for o in outputs):
            raise TypeErr(item.span, f"'{public}' is returned twice")
        outputs.append((public, item.name.id))


def _expr(e: syntax.Expr, ctx: _Ctx) -> ir.Expr:
    if isinstance(e, syntax.ShapeArg):
        raise TypeErr(e.span, "a shape [...] is not a value (it is reshape's second argument)")
    if isinstance(e, syntax.Number):
        return ir.Const(e.value, scalar_type("f32" if e.is_float else "i64"), e.span)
    if isinstance(e, syntax.Name):
        if ctx.env is not None and e.id in ctx.env:  # a defined operation's parameter (checked by defs.py)
            return ctx.env[e.id]
        if e.id == syntax.INF and (ctx.env is not None or (e.id not in ctx.params and e.id not in ctx.stages)):
            return ir.Const(math.inf, scalar_type("f32"), e.span)
        return ir.Ref(e.id, ctx.type_of(e.id, e.span), e.span)
    if isinstance(e, syntax.Neg):
        x = _expr(e.operand, ctx)
        if isinstance(x, ir.Const):
            return ir.Const(-x.value, x.type, e.span)
        return _op(ops.prefix("-").name, (x,), {}, e.span)
    if isinstance(e, syntax.BinOp):
        args = (_expr(e.left, ctx), _expr(e.right, ctx))
        return _op(ops.infix(e.op).name, args, {}, e.span, _where_of(e))
    return _call(e, ctx, top=False)


def _op(op: str, args: tuple, attrs: dict, span: Span, err_span: Span | None = None) -> ir.Op:
    """err_span: where a type error points (default: the whole operation)."""
    t = type_op(op, args, attrs, err_span or span)
    return ir.Op(op, _literals_as_f64(args), t, tuple(sorted(attrs.items())), span)


def _literals_as_f64(args: tuple) -> tuple:
    """A float literal with an f64 value takes its dtype (docs/language.md, "Types": literals take the
    tensor's dtype), so that `x * 0.1` multiplies by the double 0.1, not by 0.1 rounded to f32.
    (Narrower floats compute in f32 anyway.)"""
    if not any(isinstance(a, ir.Expr) and not a.type.weak and a.type.dtype == "f64" for a in args):
        return args
    return tuple(ir.Const(a.value, replace(a.type, dtype="f64"), a.span)
                 if isinstance(a, ir.Const) and a.type.weak and a.type.dtype in FLOATS and a.type.dtype != "f64" else a
                 for a in args)


def _signature(call: syntax.Call, ctx: _Ctx | None = None) -> ops.OpDef:
    d = _UPDATE if call.fn == "update" else builtin_of(call)
    if d is not None and d.extern is not None and ctx is not None and call.fn not in ctx.scope.externs:
        d = None  # declared by another file: not part of this one's language
    if d is None:
        raise TypeErr(call.fn_span, f"unknown operation '{call.fn}'")
    return d


def _bind(call: syntax.Call) -> tuple[list[syntax.Expr], dict[str, object]]:
    """Match a call's arguments to its signature: positional list, keyword values."""
    d = _signature(call)
    return bind(call, tuple(a.name for a in d.params if a.required), d.defaults())


def _expand(call: syntax.Call, ctx: _Ctx) -> ir.Expr:
    """A call of an operation the file defines: its body, typed with the call's operands. An
    error in the body (shapes that do not broadcast, ...) is reported at the call. A program's
    call (inlined by _program_call) may only be a statement's whole right-hand side."""
    if call.fn not in ctx.scope.defs:
        raise TypeErr(call.span, f"a call of a program ({calls.callee(call) or call.fn}) must be the whole "
                      "right-hand side of a statement: y = f(...)")
    d = ctx.scope.defs[call.fn]
    values = [_expr(a, ctx) for a in bind_def(call, d)]
    outer, ctx.env = ctx.env, dict(zip((p.id for p in d.params), values))
    try:
        out = _expr(d.body, ctx)
    except _TooBig as err:
        if outer is not None:
            raise
        first = err.diagnostics[0]  # reported at the program's call, naming where it grew
        raise _TooBig(call.span, f"{call.fn}(): {first.message} (at line {first.span.line}, "
                      f"col {first.span.col})") from None
    except TypeErr as err:
        first = err.diagnostics[0]
        where = f"line {first.span.line}, col {first.span.col}"
        raise TypeErr(call.span, f"{call.fn}(): {first.message} (in its body, {where})") from None
    finally:
        ctx.env = outer
    depth, size = _extent(out, ctx.extents)
    if depth > MAX_EXPANDED_DEPTH or size > MAX_EXPANDED_SIZE:
        raise _TooBig(call.span, f"{call.fn}() expands to an expression of {size} operations "
                      f"nested {depth} levels deep (at most {MAX_EXPANDED_SIZE} and "
                      f"{MAX_EXPANDED_DEPTH}); split it into several stages")
    return out


class _TooBig(TypeErr):
    """A defined operation's expansion is too large (reported where it first grows too big)."""


# Calls of defined operations nest their bodies; every later pass walks expressions recursively
# (and an operand used twice in a body is computed twice: nested definitions can grow fast).
MAX_EXPANDED_DEPTH = 300
MAX_EXPANDED_SIZE = 5000


def _extent(e: ir.Expr, memo: dict[int, tuple[int, int, ir.Expr]]) -> tuple[int, int]:
    """How deep an expression nests and how many nodes it has as a tree, without recursion.
    memo: what earlier expansions measured, by node (kept alive with it, so ids stay unique)."""
    stack: list[tuple[ir.Expr, bool]] = [(e, False)]
    while stack:
        node, done = stack.pop()
        args = node.args if isinstance(node, ir.Op) else ()
        if not done:
            stack.append((node, True))
            stack.extend((a, False) for a in args if id(a) not in memo)
            continue
        parts = [memo[id(a)] for a in args]
        memo[id(node)] = (1 + max((p[0] for p in parts), default=0), 1 + sum(p[1] for p in parts), node)
    return memo[id(e)][:2]


def _word(arg: ops.Arg, e: object, call: syntax.Call) -> object:
    """A compile-time argument: a reduction op, dtype or direction word, or an integer."""
    name = arg.name
    if arg.kind == "word":
        if not (isinstance(e, syntax.Name) and e.id in arg.choices):
            span = getattr(e, "span", call.span)
            raise TypeErr(span, f"{call.fn}()'s {name} must be one of {', '.join(arg.choices)}")
        return e.id
    if isinstance(e, int):
        return e
    if isinstance(e, syntax.Number) and not e.is_float:
        return e.value
    if isinstance(e, syntax.Neg) and isinstance(e.operand, syntax.Number) and not e.operand.is_float:
        return -e.operand.value
    raise TypeErr(getattr(e, "span", call.span), f"{call.fn}()'s {name} must be an integer literal")


def _call(call: syntax.Call, ctx: _Ctx, top: bool) -> ir.Expr:
    if call.fn == "update":
        raise TypeErr(call.span, "update() must be the whole right-hand side of a statement")
    if call.fn in ctx.scope.failed:
        raise _Skip  # a definition with errors, reported at the definition
    if call.fn in ctx.scope.defs or calls.is_call(call, ctx.scope):
        return _expand(call, ctx)
    if call.fn == PERMUTE and call.fn not in ops.REGISTRY:
        return _permute(call, ctx)
    d = _signature(call, ctx)
    if d.kind == "collective" and not top:
        raise TypeErr(call.span, f"{call.fn}() must be the whole right-hand side of a statement "
                      "(give the computation around it its own stage)")
    site = None
    if d.kind == "random":  # site=NAME, draw=k: the RNG site it draws at (its stage's by default)
        call, written = without_site(call)
        site = _site(call, written, ctx)
    args, attrs = _arguments(call, d, ctx)
    _check_ints(call, d, attrs)
    if "dim" in attrs and not attrs["dim"] < args[0].type.ndim:  # type: ignore[operator]
        raise TypeErr(_arg_span(call, "dim"), f"{call.fn} dim={attrs['dim']} is out of range for a "
                      f"{args[0].type.ndim}-d tensor")
    # the RNG stream of this call site (docs/language.md, "Operations")
    if d.kind == "random" and site is None:
        attrs["site"] = f"{ctx.stage}#{ctx.sites}"
        ctx.sites += 1
    elif d.kind == "random":
        attrs["site"] = site
    if call.fn == "segment_norm":
        _check_segmented(call, args[0], ctx)
    if call.fn == "layernorm":
        args = _layernorm_beta(args)
    return _op(d.name, tuple(args), attrs, call.span)


def _layernorm_beta(args: list[ir.Expr]) -> list[ir.Expr]:
    """layernorm(x, w, 0.0, eps), a layernorm without a bias (nanoGPT's bias=False, torch's
    bias=None): a 0-d beta b with w of x's last dim is typed as the [H] beta `b * w` for a literal
    0 (`0.0 * w`), else `b + 0.0 * w`: the kernels read an [H] beta, and the derivation adds
    nothing to w's gradient for a product with a literal 0 (autodiff/vjp.py, `back`)."""
    x, w, b, eps = args
    if b.type.shape != () or w.type.shape != x.type.shape[-1:] or b.type.dtype == "bool":
        return args
    span = b.span
    zero = ir.Const(0.0, scalar_type("f32"), span)
    if isinstance(b, ir.Const) and b.value == 0:
        return [x, w, _op("mul", (zero, w), {}, span), eps]
    return [x, w, _op("add", (b, _op("mul", (zero, w), {}, span)), {}, span), eps]


def _arguments(call: syntax.Call, d: ops.OpDef, ctx: _Ctx) -> tuple[list[ir.Expr], dict[str, object]]:
    """The call's operands, typed, and its compile-time settings (words, integers, shapes)."""
    pos, kws = _bind(call)
    given = dict(zip((a.name for a in d.params if a.required), pos)) | kws
    attrs: dict[str, object] = {}
    args: list[ir.Expr] = []
    for arg in d.params:
        if arg.kind == "value":
            args.append(_value(arg, _expr(given[arg.name], ctx)))  # type: ignore[arg-type]
        elif arg.kind == "shape":
            attrs[arg.name] = _shape(given[arg.name], call, ctx)
        else:
            attrs[arg.name] = _word(arg, given[arg.name], call)
    return args, attrs


PERMUTE = "permute"  # permute(x, [2, 0, 1]): written as the transposes it is (no operation of its own)


def _permute(call: syntax.Call, ctx: _Ctx) -> ir.Expr:
    """permute(x, [p0, p1, ...]): result dim i is x's dim p_i, as torch.permute; checked, then
    typed as the transposes (swaps in order) that make it, each carrying the layout."""
    if len(call.args) != 2 or call.kwargs:
        raise TypeErr(call.span, "permute() takes 2 arguments (permute(x, [d0, d1, ...]))")
    x, order = _expr(call.args[0], ctx), call.args[1]
    if not isinstance(order, syntax.ShapeArg) or not all(isinstance(d, syntax.DimInt) for d in order.dims):
        raise TypeErr(order.span, "permute()'s dims must be written [d0, d1, ...] (integers)")
    perm = [d.value for d in order.dims if isinstance(d, syntax.DimInt)]
    if sorted(perm) != list(range(x.type.ndim)):
        raise TypeErr(order.span, f"permute of a {x.type.ndim}-d tensor needs an order of the dims 0..{x.type.ndim - 1}, "
                      f"each once; got [{', '.join(map(str, perm))}]")
    cur = list(range(x.type.ndim))
    for i, want in enumerate(perm):
        j = cur.index(want)
        if j != i:
            x = _op("transpose", (x,), {"dim0": i, "dim1": j}, call.span)
            cur[i], cur[j] = cur[j], cur[i]
    return x


def _shape(e: object, call: syntax.Call, ctx: _Ctx) -> tuple[int | str, ...]:
    """A shape argument `[B, S, 16, -1]`: size symbols of the program's parameters, integers."""
    if not isinstance(e, syntax.ShapeArg):
        raise TypeErr(getattr(e, "span", call.span), f"{call.fn}()'s shape must be written [d, ...] (size "
                      "symbols, integers, one -1)")
    if ctx.dims is not None:  # inside an inlined program: its size symbols mean the caller's dims
        return tuple(ctx.dims[d.name] if isinstance(d, syntax.DimName) else d.value  # type: ignore[misc]
                     for d in e.dims)
    known = {s for q in ctx.params.values() if q is not None for d in q.type.shape for s in dim_symbols(d)}
    out: list[int | str] = []
    for d in e.dims:
        if isinstance(d, syntax.DimName) and d.name not in known:
            raise TypeErr(d.span, f"unknown size '{d.name}' (a size symbol of a parameter's shape, an integer "
                          "or -1)")
        out.append(d.name if isinstance(d, syntax.DimName) else d.value)
    return tuple(out)


def _site(call: syntax.Call, written: dict[str, syntax.Kwarg], ctx: _Ctx) -> str | None:
    """The RNG site `site=NAME, draw=k` names, `NAME#k` (None: none written, the stage's own
    next draw). NAME is a word, not a value: the stage whose k-th random draw this one repeats
    (the same mask), which need not be a stage of this program (docs/language.md)."""
    if not written:
        return None
    name = written.get("site")
    if name is not None and not isinstance(name.value, syntax.Name):
        raise TypeErr(name.value.span, f"{call.fn}()'s site must be a stage's name (site=NAME: the "
                      "stage whose random draw it repeats)")
    draw = written.get("draw")
    k = 0 if draw is None else _word(ops.Arg("draw", "int"), draw.value, call)
    if not isinstance(k, int) or k < 0:
        raise TypeErr(draw.value.span if draw else call.span, f"{call.fn}()'s draw must not be negative")
    stage = name.value.id if name is not None else ctx.stage  # type: ignore[union-attr]
    if name is not None:  # a stage of an inlined program: its new name
        stage = ctx.renames.get(stage, stage)
    return f"{stage}#{k}"


def _value(arg: ops.Arg, e: ir.Expr) -> ir.Expr:
    """A literal where the parameter says what dtype a literal takes (layernorm's eps: f32)."""
    if arg.literal is None or not isinstance(e, ir.Const):
        return e
    return ir.Const(float(e.value), scalar_type(arg.literal), e.span)


def _arg_span(call: syntax.Call, name: str) -> Span:
    """The span of the argument bound to parameter `name` (the call's when it is defaulted)."""
    for kw in call.kwargs:
        if kw.name == name:
            return kw.value.span
    d = _signature(call)
    allowed = tuple(a.name for a in d.params if a.required) + tuple(d.defaults())
    i = allowed.index(name) if name in allowed else len(call.args)
    return call.args[i].span if i < len(call.args) else call.span


def _check_ints(call: syntax.Call, d: ops.OpDef, attrs: dict) -> None:
    for a in d.settings:
        if a.kind != "int" or attrs[a.name] >= a.minimum:
            continue
        if a.minimum > 0:
            raise TypeErr(_arg_span(call, a.name), f"{call.fn}'s {a.name} must be at least {a.minimum}")
        raise TypeErr(_arg_span(call, a.name), f"{call.fn}()'s {a.name} must not be negative")


def _check_segmented(call: syntax.Call, x: ir.Expr, ctx: _Ctx) -> None:
    segmented = {p.type.shape for p in ctx.params.values() if p is not None and p.scattered}
    if x.type.shape not in segmented:
        raise TypeErr(x.span or call.span, "segment_norm needs a tensor with the shape of a scattered parameter")


# --- calls of programs (docs/language.md, "Calling programs", "Repeating a program over layers") ---

def _program_call(targets: list[str], call: syntax.Call, ctx: _Ctx, span: Span) -> None:
    """`targets = f(args)`, or `target = repeat(f, carried, args)`: f's stages inlined into the
    caller, typed with the arguments (as a defined operation's body is), so that every later
    layer sees an ordinary program."""
    repeat = call.fn == calls.REPEAT
    name = calls.callee(call)
    if name is None or name not in ctx.scope.programs:
        where = call.args[0].span if call.args else call.span
        raise TypeErr(where, "repeat's first argument must be the name of a program of this file: "
                      "repeat(f, x, ...)")
    cycle = calls.cycle(name, ctx.stack, ctx.scope)
    if cycle:
        raise TypeErr(call.args[0].span if repeat else call.fn_span, f"recursive call: {' -> '.join(cycle)} "
                      "(a program cannot call itself, directly or through others)")
    try:
        f = check_program(ctx.scope.programs[name], ctx.scope)
    except CompileError:
        raise _Skip from None  # its errors are reported at the program itself
    if f.updates:
        raise TypeErr(call.span, f"{name}() updates its parameter '{f.updates[0][0]}': a called program may not "
                      "update its parameters (return the new value instead)")
    given = replace(call, fn=name, args=call.args[1:]) if repeat else call
    pos, _ = bind(given, tuple(q.name for q in f.params), {})
    values = {q.name: (a, _expr(a, ctx)) for q, a in zip(f.params, pos)}
    if repeat:
        _repeat(targets, name, f, values, call, ctx)
        return
    if len(targets) != len(f.outputs):
        shown = ", ".join(pub for pub, _ in f.outputs)
        raise TypeErr(call.span, f"{name}() returns {len(f.outputs)} value{'s' * (len(f.outputs) != 1)} ({shown}); "
                      f"{len(targets)} name{'s' * (len(targets) != 1)} given")
    dims: dict[str, Dim] = {}
    env = {q.name: _argument(q, *values[q.name], name, dims, targets[0], None, call, ctx) for q in f.params}
    _inline(name, f, env, dims, targets, targets[0], None, call, ctx)


def _argument(q: ir.Param, a: syntax.Expr, v: ir.Expr, fname: str, dims: dict[str, Dim], lhs: str,
              layer: int | None, call: syntax.Call, ctx: _Ctx) -> ir.Expr:
    """Argument v (written a) for the callee's parameter q: checked against q's declaration
    (binding q's size symbols in `dims`), a tensor computed by an expression given a stage of
    its own (`lhs__<q>`)."""
    if q.scalar:
        if v.type.ndim != 0 or not (isinstance(v, ir.Const) or (isinstance(v, ir.Ref) and v.type.weak)):
            raise TypeErr(a.span, f"{fname}()'s '{q.name}' is a scalar ({q.type.dtype}): pass a scalar parameter "
                          "or a number")
        if isinstance(v, ir.Const):
            if v.type.dtype in FLOATS and q.type.dtype not in FLOATS:
                raise TypeErr(a.span, f"{fname}()'s '{q.name}' is {q.type.dtype}: a float does not fit")
            return ir.Const(v.value, q.type, v.span)  # the number as the parameter
        if v.type.dtype != q.type.dtype:
            raise TypeErr(a.span, f"{fname}()'s '{q.name}' is {q.type.dtype}; the argument is {v.type.dtype}")
        return v
    _match(q, v, a.span, fname, dims)
    if q.scattered and not (isinstance(v, ir.Ref) and v.name in ctx.params and ctx.params[v.name].scattered):
        raise TypeErr(a.span, f"{fname}()'s '{q.name}' is scattered: pass a scattered parameter")
    if isinstance(v, ir.Ref):
        return v
    return _new_stage(calls.stage_name(lhs, q.name, layer), v, a.span, call, fname, ctx)


def _match(q: ir.Param, v: ir.Expr, span: Span, fname: str, dims: dict[str, Dim]) -> None:
    """A tensor argument must have the parameter's dtype, dims (its size symbols bound to the
    argument's, the same at every use) and layout, exactly."""
    pt, vt = q.type, v.type
    what = f"{fname}()'s '{q.name}' is {pt}"
    if vt.dtype != pt.dtype:
        raise TypeErr(span, f"{what}; the argument is {vt} (use cast)")
    if vt.ndim != pt.ndim:
        raise TypeErr(span, f"{what}; the argument is {vt} ({vt.ndim} dims, not {pt.ndim})")
    for i, (pd, vd) in enumerate(zip(pt.shape, vt.shape)):
        if isinstance(pd, str):
            if pd in dims and dims[pd] != vd:
                raise TypeErr(span, f"{what}; the argument is {vt}: size '{pd}' is {dims[pd]} by an earlier "
                              f"argument, {vd} here (dim {i})")
            dims.setdefault(pd, vd)
        elif pd != vd:
            raise TypeErr(span, f"{what}; the argument is {vt}: dim {i} is {vd}, not {pd}")
    if vt.layout != pt.layout:
        raise TypeErr(span, f"{what}; the argument is {vt.layout}: a called program takes each tensor in the "
                      "layout it declares (communicate first)")


def _new_stage(name: str, expr: ir.Expr, span: Span, call: syntax.Call, fname: str, ctx: _Ctx,
               result: bool = False) -> ir.Ref:
    """A stage an inlined call adds; its name must be new (else an error at the call)."""
    if name in ctx.params or name in ctx.stages or name in ctx.failed:
        raise TypeErr(call.span, f"the call of {fname} names a stage '{name}', which is already defined "
                      f"(a call 'y = {fname}(...)' names its stages y__<stage>): rename one of them")
    ctx.stages[name] = ir.Stage(name, expr, span)
    if not result:
        ctx.inlined[name] = f"of {fname} at line {call.span.line}"
    return ir.Ref(name, expr.type, span)


def _inline(fname: str, f: ir.Program, env: dict[str, ir.Expr], dims: dict[str, Dim], results: list[str] | None,
            lhs: str, layer: int | None, call: syntax.Call, ctx: _Ctx) -> list[ir.Expr]:
    """f's statements typed with env (its parameters' values), each stage named `lhs__<stage>`
    (`lhs__l<layer>__<stage>`), its returned stages named `results` (None: as the others).
    Returns the values f returns. An error in the body is reported at the call."""
    prog = ctx.scope.programs[fname]
    renames = {t.id: calls.stage_name(lhs, t.id, layer) for st in prog.body if isinstance(st, syntax.Assign)
               for t in st.targets}
    taken = set()
    for i, (_, src) in enumerate(f.outputs):
        if results is not None and src in renames and src not in taken:
            renames[src] = results[i]
            taken.add(src)
    own = dict(env)
    saved = (ctx.env, ctx.dims, ctx.renames, ctx.stack, ctx.stage, ctx.sites)
    ctx.env, ctx.dims, ctx.renames, ctx.stack = own, dims, renames, (*ctx.stack, fname)
    try:
        for st in prog.body:
            if not isinstance(st, syntax.Assign):
                continue  # the return (read below); an update was refused
            if isinstance(st.value, syntax.Call) and calls.is_call(st.value, ctx.scope):
                _program_call([renames[t.id] for t in st.targets], st.value, ctx, st.span)
                for t in st.targets:
                    own[t.id] = ir.Ref(renames[t.id], ctx.stages[renames[t.id]].type, t.span)
                continue
            n = st.targets[0].id
            ctx.stage, ctx.sites = renames[n], 0
            own[n] = _new_stage(renames[n], _top(st.value, ctx, {}), st.span, call, fname, ctx,
                                result=renames[n] in (results or ()))
    except _Skip:
        raise
    except TypeErr as err:
        first = err.diagnostics[0]
        raise TypeErr(call.span, f"{fname}(): {first.message} (in its body, line {first.span.line}, "
                      f"col {first.span.col})") from None
    finally:
        ctx.env, ctx.dims, ctx.renames, ctx.stack, ctx.stage, ctx.sites = saved
    out: list[ir.Expr] = []
    for i, (_, src) in enumerate(f.outputs):
        v = own[src]
        if results is not None and not (isinstance(v, ir.Ref) and v.name == results[i]):
            v = _new_stage(results[i], v, call.span, call, fname, ctx, result=True)  # a parameter returned
        out.append(v)
    return out


def _repeat(targets: list[str], fname: str, f: ir.Program, values: dict[str, tuple[syntax.Expr, ir.Expr]],
            call: syntax.Call, ctx: _Ctx) -> None:
    """`y = repeat(f, x, args...)`: f once per layer, layer l reading layer l-1's result for
    f's first parameter, row l of each stacked argument (one more leading dim than f's
    parameter, an integer literal L: the layers) and the shared ones as they are."""
    lhs = targets[0]
    if len(targets) != 1 or len(f.outputs) != 1:
        raise TypeErr(call.span, f"repeat({fname}, ...) needs a program that returns one value (the carried one), "
                      "named by one name")
    first = f.params[0] if f.params else None
    if first is None or first.scalar:
        raise TypeErr(call.span, f"repeat({fname}, ...): {fname}'s first parameter is the carried value, a tensor")
    stacked, layers = _stacked(lhs, fname, f, values, call, ctx)
    carried = values[first.name][1]
    want = carried.type
    for layer in range(layers):
        dims: dict[str, Dim] = {}
        env: dict[str, ir.Expr] = {}
        for q in f.params:
            a, v = values[q.name]
            if q is first:
                v = carried
            elif q.name in stacked:
                row = _op("index", (stacked[q.name],), {"i": layer}, a.span)
                v = _new_stage(calls.stage_name(lhs, q.name, layer), row, a.span, call, fname, ctx)
            env[q.name] = _argument(q, a, v, fname, dims, lhs, layer, call, ctx)
        last = layer == layers - 1
        (carried,) = _inline(fname, f, env, dims, [lhs] if last else None, lhs, layer, call, ctx)
        got = carried.type
        if (got.dtype, got.shape, got.layout) != (want.dtype, want.shape, want.layout):
            raise TypeErr(call.span, f"repeat: {fname}() returns {got}, but its carried parameter '{first.name}' "
                          f"takes {want}: a layer's result must be the next layer's input")


def _stacked(lhs: str, fname: str, f: ir.Program, values: dict[str, tuple[syntax.Expr, ir.Expr]],
             call: syntax.Call, ctx: _Ctx) -> tuple[dict[str, ir.Expr], int]:
    """A repeat's stacked arguments (by f's parameter; one computed by an expression given a
    stage of its own, `lhs__<q>`) and the layer count they agree on."""
    stacked: dict[str, ir.Expr] = {}
    count: tuple[int, str] | None = None
    for q in f.params[1:]:
        a, v = values[q.name]
        if q.scalar or v.type.ndim == q.type.ndim:
            continue  # shared by every layer
        if v.type.ndim != q.type.ndim + 1:
            raise TypeErr(a.span, f"repeat: {fname}()'s '{q.name}' has {q.type.ndim} dims; the argument has "
                          f"{v.type.ndim} (shared by every layer: {q.type.ndim}; stacked, one per layer: "
                          f"{q.type.ndim + 1})")
        n = v.type.shape[0]
        if not isinstance(n, int):
            raise TypeErr(a.span, f"repeat: the layer count of the argument for '{q.name}' (its dim 0) is '{n}', a "
                          "size symbol; write it as an integer literal (the checker unrolls the layers)")
        if count is not None and n != count[0]:
            raise TypeErr(a.span, f"repeat: the argument for '{q.name}' stacks {n} layers, the one for "
                          f"'{count[1]}' {count[0]}")
        if v.type.layout.sliced and v.type.layout.dim == 0:
            raise TypeErr(a.span, f"repeat: the argument for '{q.name}' is sliced along its layer dim (0); a "
                          "stacked parameter is sliced(d) along a dim d >= 1 of its layers (sliced(d-1) each)")
        count = count or (n, q.name)
        stacked[q.name] = v if isinstance(v, ir.Ref) else _new_stage(calls.stage_name(lhs, q.name), v, a.span,
                                                                      call, fname, ctx)
    if count is None:
        raise TypeErr(call.span, f"repeat({fname}, ...) needs a stacked argument (one more leading dim than "
                      f"{fname}'s parameter: the layers)")
    return stacked, count[0]
