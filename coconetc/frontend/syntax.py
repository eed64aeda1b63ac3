"""The syntax tree: one class per grammar rule of grammar/coconet.lark, each with a Span.
Spans never take part in comparisons (`field(compare=False)`): two trees are equal when they
say the same thing, wherever it was written."""

from __future__ import annotations

from dataclasses import dataclass, field

from coconetc.errors import Span


INF = "inf"  # the name of the literal infinity (-inf: a masked score), unless a parameter or stage has it


@dataclass(frozen=True)
class Number:
    text: str
    span: Span = field(compare=False)

    @property
    def is_float(self) -> bool:
        return any(ch in self.text for ch in ".eE")

    @property
    def value(self) -> float | int:
        return float(self.text) if self.is_float else int(self.text)


@dataclass(frozen=True)
class Name:
    id: str
    span: Span = field(compare=False)


@dataclass(frozen=True)
class Kwarg:
    name: str
    value: Expr | String | ShapeArg  # a string or a list only where a schedule directive takes one
    span: Span = field(compare=False)


@dataclass(frozen=True)
class Call:
    fn: str
    args: tuple[Expr, ...]
    kwargs: tuple[Kwarg, ...]
    span: Span = field(compare=False)
    fn_span: Span = field(compare=False)


@dataclass(frozen=True)
class BinOp:
    op: str  # + - * / ** < <= > >= == !=
    left: Expr
    right: Expr
    span: Span = field(compare=False)
    # the operator token itself, where type errors point
    op_span: Span | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Neg:
    operand: Expr
    span: Span = field(compare=False)


Expr = Number | Name | Call | BinOp | Neg


@dataclass(frozen=True)
class DimName:
    name: str
    span: Span = field(compare=False)


@dataclass(frozen=True)
class DimInt:
    value: int
    span: Span = field(compare=False)


@dataclass(frozen=True)
class ShapeArg:
    """A shape written as an argument, `[B, S, 16, -1]` (reshape's)."""

    dims: tuple[DimName | DimInt, ...]
    span: Span = field(compare=False)


@dataclass(frozen=True)
class LayoutDecl:
    kind: str  # as written: local, replicated, sliced (checked later)
    dim: int | None
    scattered: str | None  # the trailing word, normally "scattered"
    span: Span = field(compare=False)


@dataclass(frozen=True)
class Param:
    name: str
    dtype: str
    shape: tuple[DimName | DimInt, ...] | None  # None: a scalar
    layout: LayoutDecl | None
    span: Span = field(compare=False)
    dtype_span: Span = field(compare=False)


@dataclass(frozen=True)
class Assign:
    targets: tuple[Name, ...]
    value: Expr
    span: Span = field(compare=False)


@dataclass(frozen=True)
class ReturnItem:
    name: Name
    alias: Name | None
    span: Span = field(compare=False)


@dataclass(frozen=True)
class Return:
    items: tuple[ReturnItem, ...]
    span: Span = field(compare=False)


@dataclass(frozen=True)
class ExprStmt:
    value: Expr
    span: Span = field(compare=False)


Stmt = Assign | Return | ExprStmt


@dataclass(frozen=True)
class Program:
    name: str
    params: tuple[Param, ...]
    body: tuple[Stmt, ...]
    span: Span = field(compare=False)
    name_span: Span = field(compare=False)


@dataclass(frozen=True)
class Schedule:
    name: str
    program: str
    body: tuple[Stmt, ...] | None  # None: `schedule auto for p` without a block
    span: Span = field(compare=False)
    program_span: Span = field(compare=False)
    name_span: Span | None = field(default=None, compare=False)
    grad: bool = False  # `for grad(program)`: a schedule of the program's derived program

    @property
    def target(self) -> str:
        """The name of the program the directives apply to (the derived one: `<program>_grad`)."""
        return f"{self.program}_grad" if self.grad else self.program


@dataclass(frozen=True)
class OpDecl:
    """`op NAME(params) = body`: an operation defined by an expression of its parameters."""

    name: str
    params: tuple[Name, ...]
    body: Expr
    span: Span = field(compare=False)
    name_span: Span = field(compare=False)


@dataclass(frozen=True)
class Word:
    """A setting's word, with its integers when written `word(1, 2)`."""

    word: str
    ints: tuple[int, ...] | None
    span: Span = field(compare=False)


@dataclass(frozen=True)
class String:
    text: str  # without the quotes
    span: Span = field(compare=False)


@dataclass(frozen=True)
class Setting:
    """`key = value, ...` inside an extern declaration."""

    key: str
    values: tuple[Word | String, ...]
    span: Span = field(compare=False)
    key_span: Span = field(compare=False)


@dataclass(frozen=True)
class ExternDecl:
    """`extern op NAME(params) { settings }`: an operation implemented by library functions."""

    name: str
    params: tuple[Name, ...]
    settings: tuple[Setting, ...]
    span: Span = field(compare=False)
    name_span: Span = field(compare=False)


@dataclass(frozen=True)
class Import:
    """`from "other.ccn" import p, q`: programs of another file that this file's programs may
    call (docs/language.md, "Calling programs")."""

    path: String
    names: tuple[Name, ...]
    span: Span = field(compare=False)


@dataclass(frozen=True)
class File:
    """A parsed .ccn file: its programs and schedules, in order."""

    file: str
    source: str
    programs: tuple[Program, ...] = field(default=())
    schedules: tuple[Schedule, ...] = field(default=())
    ops: tuple[OpDecl, ...] = field(default=())
    externs: tuple[ExternDecl, ...] = field(default=())
    imports: tuple[Import, ...] = field(default=())
