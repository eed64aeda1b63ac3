"""Types of IR values: dtype, symbolic global shape, layout."""

from __future__ import annotations

from dataclasses import dataclass

from coconetc.ir.dtypes import BITS, DTYPES, FLOATS

__all__ = ["BITS", "DTYPES", "FLOATS"]  # (and the rest of this module's names)
REDUCE_OPS = ("sum", "avg", "prod", "max", "min")


@dataclass(frozen=True)
class DimExpr:
    """A derived size, e.g. a conv2d output: (H + 2 - KH) // 1 + 1."""

    op: str  # + - * //
    a: Dim
    b: Dim

    def __str__(self) -> str:
        return f"({self.a} {self.op} {self.b})"


Dim = int | str | DimExpr

_FOLD = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
         "//": lambda a, b: a // b}


def dim_op(op: str, a: Dim, b: Dim) -> Dim:
    """a op b, folded where both are known; x + 0, x * 1 and x // 1 simplify to x."""
    if isinstance(a, int) and isinstance(b, int):
        return _FOLD[op](a, b)
    if (op in "+-" and b == 0) or (op in ("*", "//") and b == 1):
        return a
    if op == "*" and a == 1:
        return b
    if op == "//" and isinstance(a, DimExpr) and a.op == "*" and b in (a.a, a.b):  # (x * y) // x: y
        return a.b if b == a.a else a.a
    return DimExpr(op, a, b)


def eval_dim(d: Dim, sizes: dict[str, int]) -> int:
    """The value of a dim given the size symbols' values (KeyError for an unbound symbol)."""
    if isinstance(d, int):
        return d
    if isinstance(d, str):
        return sizes[d]
    return _FOLD[d.op](eval_dim(d.a, sizes), eval_dim(d.b, sizes))


def dim_symbols(d: Dim) -> set[str]:
    if isinstance(d, str):
        return {d}
    if isinstance(d, DimExpr):
        return dim_symbols(d.a) | dim_symbols(d.b)
    return set()


@dataclass(frozen=True)
class Layout:
    """Where a value lives relative to the rank's group (docs/language.md, "Parameters")."""

    kind: str  # local | replicated | sliced
    dim: int = 0  # the sliced dim (0 for the other kinds)

    def __str__(self) -> str:
        return f"sliced({self.dim})" if self.kind == "sliced" else self.kind

    @property
    def sliced(self) -> bool:
        return self.kind == "sliced"


LOCAL, REPLICATED = Layout("local"), Layout("replicated")


def sliced(dim: int) -> Layout:
    return Layout("sliced", dim)


@dataclass(frozen=True)
class TType:
    """dtype, global (logical) shape and layout of a value. `weak`: a scalar or literal whose
    dtype yields to a tensor's in arithmetic (as in JAX and PyTorch)."""

    dtype: str
    shape: tuple[Dim, ...]
    layout: Layout
    weak: bool = False

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __str__(self) -> str:
        dims = ", ".join(str(d) for d in self.shape)
        return f"{self.dtype}[{dims}] {self.layout}"


def scalar_type(dtype: str, weak: bool = True) -> TType:
    return TType(dtype, (), REPLICATED, weak)
