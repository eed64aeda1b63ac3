"""The one precedence-aware C++ expression emitter. It renders the math of a pointwise
expression for one element; how an operand is loaded (and which index it uses) is the
caller's business, passed in as `load`. CPU loops and CUDA kernels use the same text."""

from __future__ import annotations

from collections.abc import Callable

from coconetc.ir.nodes import Const, Expr, Op, Ref

CTYPE = {"f16": "coconet::half", "bf16": "coconet::bfloat16", "f32": "float", "f64": "double",
         "i32": "int32_t", "i64": "int64_t", "bool": "bool"}
COMPUTE = {**CTYPE, "f16": "float", "bf16": "float"}
REDUCE_OP = {o: f"coconet::Op::{o}" for o in ("sum", "avg", "prod", "max", "min")}

# C++ precedence, higher binds tighter (only what we emit).
_BIN = {"add": ("+", 6), "sub": ("-", 6), "mul": ("*", 7), "div": ("/", 7),
        "lt": ("<", 5), "le": ("<=", 5), "gt": (">", 5), "ge": (">=", 5),
        "eq": ("==", 4), "ne": ("!=", 4)}
_UNARY = 8
_ATOM = 9
_FN1 = {"sqrt": "std::sqrt", "exp": "std::exp", "log": "std::log", "abs": "std::abs",
        "tanh": "std::tanh", "rsqrt": "coconet::rsqrt", "sigmoid": "coconet::sigmoid",
        "relu": "coconet::relu", "gelu": "coconet::gelu"}

Load = Callable[[Ref], str]
Extra = Callable[[Op], str]


def literal(value: float | int, dtype: str) -> str:
    ct = COMPUTE[dtype]
    if dtype in ("i32", "i64"):
        return f"{ct}({int(value)})"
    if ct == "double":
        return repr(float(value))
    return f"{float(value)!r}f"


def emit(e: Expr, load: Load, extra: Extra | None = None) -> str:
    """C++ for e's value in its compute type. `extra` renders ops this module does not know
    (e.g. dropout, which needs the element's global index)."""
    return _emit(e, load, extra)[0]


def _as(e: Expr, want: str, load: Load, extra: Extra | None, prec: int) -> str:
    """Operand e converted to the compute type of dtype `want` (weak scalars and literals)."""
    if isinstance(e, Const):
        return literal(e.value, want)
    text, p = _emit(e, load, extra)
    if COMPUTE[e.type.dtype] != COMPUTE[want] and e.type.dtype != "bool":
        return f"static_cast<{COMPUTE[want]}>({text})"
    return text if p >= prec else f"({text})"


def _emit(e: Expr, load: Load, extra: Extra | None) -> tuple[str, int]:
    if isinstance(e, Ref):
        return load(e), _ATOM
    if isinstance(e, Const):
        return literal(e.value, e.type.dtype), _ATOM
    assert isinstance(e, Op)
    dt = e.type.dtype
    if e.op in _BIN:
        sym, prec = _BIN[e.op]
        operand_dt = dt if dt != "bool" else _common(e.args)
        left = _as(e.args[0], operand_dt, load, extra, prec)
        right = _as(e.args[1], operand_dt, load, extra, prec + 1)
        return f"{left} {sym} {right}", prec
    if e.op == "neg":
        return f"-{_as(e.args[0], dt, load, extra, _UNARY)}", _UNARY
    if e.op in _FN1:
        return f"{_FN1[e.op]}({_as(e.args[0], dt, load, extra, 0)})", _ATOM
    if e.op in ("min", "max", "pow"):
        fn = {"min": "coconet::minimum", "max": "coconet::maximum", "pow": "coconet::power"}[e.op]
        a, b = (_as(x, dt, load, extra, 0) for x in e.args)
        return f"{fn}<{COMPUTE[dt]}>({a}, {b})", _ATOM
    if e.op == "where":
        c = _emit(e.args[0], load, extra)[0]
        a, b = (_as(x, dt, load, extra, 0) for x in e.args[1:])
        return f"(({c}) ? {COMPUTE[dt]}({a}) : {COMPUTE[dt]}({b}))", _ATOM
    if e.op == "cast":
        src = _emit(e.args[0], load, extra)[0]
        return f"coconet::cast_to<{CTYPE[dt]}>({src})", _ATOM
    if extra is None:
        raise NotImplementedError(f"emit: {e.op} is not a pointwise operation")
    return extra(e), _ATOM


def _common(args) -> str:
    """The dtype comparison operands are brought to (the strong one, else the first)."""
    strong = [a.type.dtype for a in args if not a.type.weak]
    return strong[0] if strong else args[0].type.dtype
