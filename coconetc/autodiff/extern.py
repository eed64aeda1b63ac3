"""The derivative of an extern operation: its declared `grad_<p> = "expr"` expanded with the
call's operands (docs/language.md, "Extern operations"), as the checker expands a defined
operation's body at its call: the parameters are the operands, `g` the result's cotangent,
`y` the result. The layout rules are the derivation's own (vjp._Deriver.add)."""

from __future__ import annotations

from typing import Any

from coconetc.errors import CompileError
from coconetc.frontend import gradexpr
from coconetc.frontend.checker import _Ctx, _expr
from coconetc.frontend.defs import Scope
from coconetc.ir import ops
from coconetc.ir.expr import Expr, Op, Ref
from coconetc.ir.typerules import TypeErr

# vjp.Parts (not imported: vjp imports this module)
Parts = list[tuple[Expr, Expr | None, bool | None]]


def rule(d: Any, e: Op, y: Ref, g: Ref) -> Parts:
    """Each operand's contribution: its declared derivative, typed with the operands (None
    for an operand that needs none: one that does not depend on wrt). An operand that needs
    one and has none is an error at the call. d: the vjp._Deriver."""
    entry = ops.get(e.op)
    assert entry.extern is not None
    params = tuple(a.name for a in entry.params if a.kind == "value")
    grads = dict(entry.extern.grads)
    env: dict[str, Expr] = {gradexpr.COTANGENT: g, gradexpr.RESULT: y, **dict(zip(params, e.args))}
    scope = ops.scope_of(e.op)  # the declaring file's externs: the names its derivatives call
    parts: Parts = []
    for p, arg in zip(params, e.args):
        if not d.is_active(arg):
            parts.append((arg, None, None))
            continue
        if p not in grads:
            shown = ", ".join(params)
            raise CompileError.at(e.span, f"extern operation '{ops.shown(e.op)}' has no derivative for its operand '{p}': "
                                  f"cannot differentiate through it; declare one in its extern block, "
                                  f"grad_{p} = \"...\", an expression of {shown}, g (the result's "
                                  "cotangent) and y (the result) (docs/language.md, Extern operations)")
        ctx = _Ctx({}, scope=Scope(externs=set(scope)), env=env)
        try:
            with ops.extern_scope(scope):
                c = _expr(gradexpr.parse_text(grads[p], params), ctx)
        except (TypeErr, CompileError) as err:
            first = err.diagnostics[0]
            raise CompileError.at(e.span, f"the derivative grad_{p} of '{ops.shown(e.op)}' ({grads[p]}): {first.message}") from None
        if not _fits(c.type.shape, arg.type.shape):
            shown = ", ".join(map(str, c.type.shape))
            raise CompileError.at(e.span, f"the derivative grad_{p} of '{ops.shown(e.op)}' ({grads[p]}) has shape "
                                  f"[{shown}], which does not sum down to {p}'s {arg.type}")
        if c.type.ndim < arg.type.ndim:  # a scalar (or a broadcast value) spread over the operand
            c = d.op("add", d.op("mul", arg, d.const(0.0, arg)), c)
        parts.append((arg, c, None))
    return parts


def _fits(have: tuple, want: tuple) -> bool:
    """A contribution of shape `have` becomes one of shape `want` by the derivation's
    unbroadcasting (leading dims summed, a size-1 dim of `want` summed to 1) or, when it has
    fewer dims, by spreading it over the operand (NumPy broadcasting)."""
    if len(have) < len(want):
        return all(h == w or h == 1 for h, w in zip(have, want[len(want) - len(have):]))
    return all(h == w or w == 1 for h, w in zip(have[len(have) - len(want):], want))
