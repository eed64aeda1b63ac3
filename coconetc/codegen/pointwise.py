"""Pointwise text both backends write beyond one element's math (emit.py): the values of one
element (a loop's, a fused chunk's or a kernel's items, in registers and stored), the Lets
computed once before a loop's elements, and the layernorm of one row (a fused collective's
row-wise phase: the CPU chunk's loop over rows, a CUDA thread per row)."""

from __future__ import annotations

from collections.abc import Callable

from coconetc.codegen.base import Writer
from coconetc.codegen.emit import COMPUTE, CTYPE, Load, emit, literal
from coconetc.codegen.indexing import Indexing
from coconetc.ir.nodes import Const, Expr, Ref
from coconetc.ir.types import TType
from coconetc.plan.units import Let

Items = list[tuple[str, Expr, bool]]  # (name, its expression per element, stored)


def values(idx: Indexing, items: Items, regs: dict[str, str], read: Callable[[str], tuple[TType, Load]],
           stores: Callable[[str], list[str]], dtype: Callable[[str], str] | None = None) -> list[str]:
    """The element math of every item in order (emit.py), each value rounded to its storage type
    and kept in x_<name> (where later items read it; regs: values already in registers), then
    written to each target stores(name) gives. read(name): the type an item is computed over
    (its operands' indexing, dropout's global index) and how an operand is loaded there;
    dtype(name): the item's dtype (default: its buffer's)."""
    local = dict(regs)
    lines = []
    for name, e, _ in items:
        t, base = read(name)
        dt = dtype(name) if dtype else idx.w.types[name].dtype
        ct = CTYPE[dt]
        load = lambda r, base=base: local.get(r.name) or base(r)  # noqa: E731
        lines.append(f"const {COMPUTE[dt]} x_{name} = coconet::round_to<{ct}>({emit(e, load, idx.extra(t, load))});")
        local[name] = f"x_{name}"
        lines += [f"{target} = coconet::from_compute<{ct}>(x_{name});" for target in stores(name)]
    return lines


def lets(w: Writer, lets: tuple[Let, ...]) -> list[str]:
    """Scalars computed once before a loop's elements: named locals (so the compiler keeps them
    in registers and can vectorize the loop; a CUDA thread computes them once, they may read a
    device value such as a norm computed before the kernel). Each is declared in w.consts."""
    out = []
    for k in lets:
        code = emit(k.expr, lambda r: w.consts.get(r.name) or f"coconet::to_compute(v_{r.name}[0])")
        out.append(f"const {COMPUTE[k.expr.type.dtype]} {k.name} = {code};")
        w.consts[k.name] = k.name
    return out


def layernorm_eps(eps: Expr) -> str:
    """A layernorm's epsilon as a double: a literal, or a 0-d value read as the call starts."""
    if isinstance(eps, Const):
        return literal(eps.value, "f64")
    return f"double(coconet::to_compute(v_{eps.name}[0]))" if isinstance(eps, Ref) else ""


def layernorm_row(C: str, H: str, x: Callable[[str], str], j: str, eps: str) -> list[str]:
    """The mean and inverse deviation (in compute type C) of the row starting at `row` (H
    elements, element `row + j` read as x(index)), then the head of the loop over its elements,
    left open (j its index); layernorm_value is the element's value there."""
    return [f"{C} mean = 0, var = 0;",
            f"for (int64_t {j} = 0; {j} < {H}; ++{j}) mean += {x(f'row + {j}')};",
            f"mean /= static_cast<{C}>({H});",
            f"for (int64_t {j} = 0; {j} < {H}; ++{j}) {{ const {C} d = {x(f'row + {j}')} - mean; var += d * d; }}",
            f"var /= static_cast<{C}>({H});",
            f"const {C} inv = {C}(1) / std::sqrt(var + static_cast<{C}>({eps}));",
            f"for (int64_t {j} = 0; {j} < {H}; ++{j}) {{"]


def layernorm_value(T: str, xj: str, gamma: str, beta: str, j: str) -> str:
    """Element j of the row (read as xj) normalized, scaled by gamma[j], shifted by beta[j] and
    rounded to the storage type T."""
    return (f"coconet::round_to<{T}>(({xj} - mean) * inv * coconet::to_compute(v_{gamma}[{j}]) + "
            f"coconet::to_compute(v_{beta}[{j}]))")
