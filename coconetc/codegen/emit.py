"""The one precedence-aware C++ expression emitter. It renders the math of a pointwise
expression for one element from each operation's Cpp template in the registry
(coconetc/ir/ops.py); how an operand is loaded (and which index it uses) is the caller's
business, passed in as `load`. CPU loops and CUDA kernels use the same text."""

from __future__ import annotations

import math
from collections.abc import Callable

from coconetc.ir import ops
from coconetc.ir.dtypes import TABLE
from coconetc.ir.nodes import Const, Expr, Op, Ref
from coconetc.ir.types import REDUCE_OPS

CTYPE = {n: d.ctype for n, d in TABLE.items()}
COMPUTE = {n: TABLE[d.compute].ctype for n, d in TABLE.items()}
REDUCE_OP = {o: f"coconet::Op::{o}" for o in REDUCE_OPS}

Load = Callable[[Ref], str]
Extra = Callable[[Op], str]


def cbool(b: bool) -> str:
    """A C++ bool literal."""
    return "true" if b else "false"


def literal(value: float | int, dtype: str) -> str:
    ct = COMPUTE[dtype]
    if dtype in ("i32", "i64"):
        return f"{ct}({int(value)})"
    if math.isinf(value):  # the language's inf (-inf: a masked score)
        return f"{'-' if value < 0 else ''}std::numeric_limits<{ct}>::infinity()"
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
        return load(e), ops.ATOM
    if isinstance(e, Const):
        return literal(e.value, e.type.dtype), ops.ATOM
    d = ops.REGISTRY.get(e.op)
    if d is None or d.cpp is None:
        if extra is None:
            raise NotImplementedError(f"emit: {e.op} is not a pointwise operation")
        return extra(e), ops.ATOM
    c, dt = d.cpp, e.type.dtype
    want = _common(e.args) if d.operands == ops.TO_COMMON else dt
    texts = []
    for i, a in enumerate(e.args):
        need = c.operand_prec[i] if i < len(c.operand_prec) else 0
        as_is = d.operands == ops.AS_IS or (d.operands == ops.COND_FIRST and i == 0)
        texts.append(_raw(a, load, extra, need) if as_is else _as(a, want, load, extra, need))
    return c.template.format(*texts, ct=COMPUTE[dt], ctype=CTYPE[dt]), c.prec


def _raw(e: Expr, load: Load, extra: Extra | None, prec: int) -> str:
    """Operand e as it is (a where's condition, a cast's source)."""
    text, p = _emit(e, load, extra)
    return text if p >= prec else f"({text})"


def _common(args) -> str:
    """The dtype comparison operands are brought to (the strong one, else the first)."""
    strong = [a.type.dtype for a in args if not a.type.weak]
    return strong[0] if strong else args[0].type.dtype
