"""The derivatives an `extern op` declares (docs/language.md, "Extern operations"):

    extern op rmsnorm(x, w, eps) {
        ...
        grad_x = "rsqrt(mean_last(x * x) + eps) * (g * w - x * mean_last(g * w * x) / (mean_last(x * x) + eps))"
        grad_w = "g * x * rsqrt(mean_last(x * x) + eps)"
    }

`grad_<p> = "expr"`: operand p's contribution to the gradient, an expression of the
operation's parameters, `g` (the result's cotangent) and `y` (the result). It may call the
language's operations (collectives and random operations excepted), the operations derived
programs add (`matmul_nt`, `matmul_tn`, `sum_lead`, `sum_keep`, `mean_last`, ...) and the
extern operations the file declares. The derivation (coconetc/autodiff/extern.py) types it
with the call's operands, as a defined operation's body is typed at its call.

This module parses such a string (its spans are the file's: line and column inside the
string) and checks it once the file's declarations are known (`check`, from
defs.check_defs): unknown names, unknown operations, arity, each at its place."""

from __future__ import annotations

from dataclasses import fields, is_dataclass, replace
from functools import lru_cache
from typing import Any

from coconetc.errors import CompileError, Diagnostic, Span
from coconetc.frontend import syntax

PREFIX = "grad_"
COTANGENT, RESULT = "g", "y"


def operand(key: str) -> str:
    """The operand a `grad_<p>` setting is about ('' for another key)."""
    return key[len(PREFIX):] if key.startswith(PREFIX) else ""


def names(params: tuple[str, ...]) -> tuple[str, ...]:
    """What a derivative may read: the parameters, then g and y (a parameter named g or y
    hides them)."""
    return tuple(dict.fromkeys((*params, COTANGENT, RESULT)))


def parse_text(text: str, params: tuple[str, ...]) -> syntax.Expr:
    """The expression of a derivative string (spans in a one-line text of its own)."""
    return _parse(text, params)


def _head(params: tuple[str, ...]) -> str:
    return f"op __grad__({', '.join(names(params))}) = "


@lru_cache(maxsize=256)
def _parse(text: str, params: tuple[str, ...]) -> syntax.Expr:
    from coconetc.frontend.parser import parse  # parser -> syntax; no cycle, but keep it lazy
    tree = parse(_head(params) + text + "\n", "<grad>")
    return tree.ops[0].body


def _shift(span: Span, head: int, at: Span) -> Span:
    """A span of the one-line synthetic text moved into the string at `at` (its opening
    quote at column at.col)."""
    def col(c: int) -> int:
        return max(at.col + 1, at.col + c - head)  # col head+1 is the string's first char
    return Span(at.file, at.line, col(span.col), at.line, col(span.end_col) if span.end_col else 0, at.source)


def _moved(node: Any, at: Span, head: int) -> Any:
    """Every span of a syntax tree moved from the synthetic text into the file."""
    if isinstance(node, tuple):
        return tuple(_moved(x, at, head) for x in node)
    if isinstance(node, Span):
        return _shift(node, head, at)
    if not is_dataclass(node) or isinstance(node, type):
        return node
    return replace(node, **{f.name: _moved(getattr(node, f.name), at, head) for f in fields(node)})


def parse_string(s: syntax.String, params: tuple[str, ...]) -> syntax.Expr:
    """A derivative setting's string as an expression; a syntax error points into the string."""
    head = len(_head(params))
    try:
        body = _parse(s.text, params)
    except CompileError as err:
        raise CompileError([Diagnostic(_shift(d.span, head, s.span), _said(d.message, d.span.col > head + len(s.text)))
                            for d in err.diagnostics]) from None
    return _moved(body, s.span, head)


def _said(message: str, at_end: bool) -> str:
    if at_end:  # past the string's last character
        return "the derivative's expression ends too early"
    return f"in the derivative: {message.replace('the end of the file', 'the end of the string')}"


def check(decl: syntax.ExternDecl, defined: set[str], externs: set[str]) -> list[Diagnostic]:
    """The `grad_<p>` settings of one declaration: p a parameter, the value one string, the
    expression's names, operations and arities. defined: the file's `op` definitions (which a
    derivative may not call: write the expression out); externs: the file's extern ops."""
    from coconetc.frontend.defs import Scope, _call_operands

    params = tuple(p.id for p in decl.params)
    errors: list[Diagnostic] = []
    for s in decl.settings:
        p = operand(s.key)
        if not s.key.startswith(PREFIX):
            continue
        from coconetc.autodiff import ops as _gradops  # noqa: F401  (mean_last, sum_lead, ...: a derivative may call them)
        if p not in params:
            errors.append(Diagnostic(s.key_span, f"'{s.key}': '{p}' is not a parameter of '{decl.name}' "
                                     f"(grad_p = \"...\" declares the derivative of parameter p: "
                                     f"one of {', '.join(params)})"))
            continue
        if len(s.values) != 1 or not isinstance(s.values[0], syntax.String):
            errors.append(Diagnostic(s.span, f"'{s.key}' takes one string: an expression of "
                                     f"{', '.join(names(params))} (g: the result's cotangent, y: the result)"))
            continue
        try:
            body = parse_string(s.values[0], params)
        except CompileError as err:
            errors += err.diagnostics
            continue
        errors += _check_body(decl, s.key, body, params, defined, Scope(externs=externs), _call_operands)
    return errors


def _check_body(decl, key, body, params, defined, scope, call_operands) -> list[Diagnostic]:
    from coconetc.ir import ops

    allowed = names(params)
    errors: list[Diagnostic] = []
    owner = syntax.OpDecl(f"{decl.name}'s {key}", decl.params, body, decl.span, decl.name_span)

    def err(span: Span, msg: str) -> None:
        errors.append(Diagnostic(span, msg))

    def visit(e: syntax.Expr) -> None:
        if isinstance(e, syntax.Name):
            if e.id not in allowed:
                err(e.span, f"unknown name '{e.id}' in {decl.name}'s {key} (a derivative reads "
                    f"{', '.join(allowed)}: the parameters, g the result's cotangent, y the result)")
        elif isinstance(e, syntax.Neg):
            visit(e.operand)
        elif isinstance(e, syntax.BinOp):
            visit(e.left)
            visit(e.right)
        elif isinstance(e, syntax.Call):
            if e.fn in defined:
                err(e.fn_span, f"'{e.fn}' is a defined operation (op {e.fn}(...) = ...): a derivative "
                    "may call built-in and extern operations only; write its expression out")
                return
            entry = ops.called(e.fn)
            if entry is not None and entry.kind == "collective":
                err(e.fn_span, f"{e.fn}() communicates: a derivative computes on each rank (the "
                    "derivation adds the communication the layouts need)")
                return
            if entry is not None and entry.kind == "random" and (entry.extern is None or e.fn in scope.externs):
                err(e.fn_span, f"{e.fn}() draws random numbers: a derivative may not")
                return
            for x in call_operands(e, owner, {}, scope, {owner.name: []}, err):
                visit(x)
    visit(body)
    return [Diagnostic(d.span, d.message.replace(f"in the body of '{owner.name}'", f"in {decl.name}'s {key}"))
            for d in errors]
