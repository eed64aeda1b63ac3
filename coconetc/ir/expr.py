"""IR expressions, frozen (edit with dataclasses.replace): a reference to a parameter or an
earlier stage, a constant, or an operation over expressions. A leaf of the IR: the typing
rules (typerules.py) and the registry (ops.py) read expressions, and nodes.py builds stages
and programs from them, so this module imports neither."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from coconetc.errors import NOWHERE, Span
from coconetc.ir.types import TType


@dataclass(frozen=True)
class Ref:
    """A parameter or an earlier stage, by name."""

    name: str
    type: TType
    span: Span = field(default=NOWHERE, compare=False)


@dataclass(frozen=True)
class Const:
    value: float | int
    type: TType
    span: Span = field(default=NOWHERE, compare=False)


@dataclass(frozen=True)
class Op:
    """An operation. attrs are compile-time settings: ('op', 'sum'), ('dim', 1), ('root', 0),
    ('dtype', 'f32'), ('stride', 1), ('padding', 0), ('direction', 'next'), ('site', 'out#0')."""

    op: str
    args: tuple[Expr, ...]
    type: TType
    attrs: tuple[tuple[str, Any], ...] = ()
    span: Span = field(default=NOWHERE, compare=False)

    def attr(self, key: str, default: Any = None) -> Any:
        return dict(self.attrs).get(key, default)


Expr = Ref | Const | Op


def walk(e: Expr) -> Iterator[Expr]:
    """Every node of an expression, parents before children."""
    yield e
    if isinstance(e, Op):
        for a in e.args:
            yield from walk(a)


def refs(e: Expr) -> list[str]:
    """Names an expression reads, in order of first appearance."""
    return list(dict.fromkeys(n.name for n in walk(e) if isinstance(n, Ref)))
