"""The syntax tree: one class per grammar rule of grammar/coconet.lark, each with a Span."""

from __future__ import annotations

from dataclasses import dataclass, field

from coconetc.errors import Span


@dataclass(frozen=True)
class Number:
    text: str
    span: Span

    @property
    def is_float(self) -> bool:
        return any(ch in self.text for ch in ".eE")

    @property
    def value(self) -> float | int:
        return float(self.text) if self.is_float else int(self.text)


@dataclass(frozen=True)
class Name:
    id: str
    span: Span


@dataclass(frozen=True)
class Kwarg:
    name: str
    value: Expr
    span: Span


@dataclass(frozen=True)
class Call:
    fn: str
    args: tuple[Expr, ...]
    kwargs: tuple[Kwarg, ...]
    span: Span
    fn_span: Span


@dataclass(frozen=True)
class BinOp:
    op: str  # + - * / ** < <= > >= == !=
    left: Expr
    right: Expr
    span: Span
    op_span: Span | None = None  # the operator token itself, where type errors point


@dataclass(frozen=True)
class Neg:
    operand: Expr
    span: Span


Expr = Number | Name | Call | BinOp | Neg


@dataclass(frozen=True)
class DimName:
    name: str
    span: Span


@dataclass(frozen=True)
class DimInt:
    value: int
    span: Span


@dataclass(frozen=True)
class LayoutDecl:
    kind: str  # as written: local, replicated, sliced (checked later)
    dim: int | None
    scattered: str | None  # the trailing word, normally "scattered"
    span: Span


@dataclass(frozen=True)
class Param:
    name: str
    dtype: str
    shape: tuple[DimName | DimInt, ...] | None  # None: a scalar
    layout: LayoutDecl | None
    span: Span
    dtype_span: Span


@dataclass(frozen=True)
class Assign:
    targets: tuple[Name, ...]
    value: Expr
    span: Span


@dataclass(frozen=True)
class ReturnItem:
    name: Name
    alias: Name | None
    span: Span


@dataclass(frozen=True)
class Return:
    items: tuple[ReturnItem, ...]
    span: Span


@dataclass(frozen=True)
class ExprStmt:
    value: Expr
    span: Span


Stmt = Assign | Return | ExprStmt


@dataclass(frozen=True)
class Program:
    name: str
    params: tuple[Param, ...]
    body: tuple[Stmt, ...]
    span: Span
    name_span: Span


@dataclass(frozen=True)
class Schedule:
    name: str
    program: str
    body: tuple[Stmt, ...] | None  # None: `schedule auto for p` without a block
    span: Span
    program_span: Span
    name_span: Span | None = None


@dataclass(frozen=True)
class File:
    """A parsed .ccn file: its programs and schedules, in order."""

    file: str
    source: str
    programs: tuple[Program, ...] = field(default=())
    schedules: tuple[Schedule, ...] = field(default=())
