"""The derivatives an `extern op` declares (docs/language.md, "Extern operations"):

    extern op rmsnorm(x, w, eps) {
        ...
        grad_x = "rmsnorm_dx(g, x, w, eps)"      # another extern operation of the file
        grad_w = "g * rmsnorm(x, w * 0 + 1, eps)"
    }

`grad_<p> = "expr"`: operand p's contribution to the gradient, an expression of the
operation's parameters, `g` (the result's cotangent) and `y` (the result). It may call the
language's operations (collectives and random operations excepted) and the extern operations
the file declares (the operation itself included). The derivation (coconetc/autodiff/extern.py) types it
with the call's operands, as a defined operation's body is typed at its call.

This module parses such a string (its spans are the file's: line and column inside the
string); defs.check_grads checks it once the file's declarations are known: unknown names,
unknown operations, arity, each at its place."""

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
