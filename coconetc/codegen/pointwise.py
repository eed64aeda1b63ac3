"""Pointwise text both backends write beyond one element's math (emit.py): the values of one
element (a loop's, a fused chunk's or a kernel's items, in registers and stored), the Lets
computed once before a loop's elements, and a layernorm's epsilon and the call laying out one
row of it in a CPU fused collective's row-wise phase (the row's math is pointwise.h's
layernorm_of, which the CPU library call and the CUDA block per row share)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from coconetc.codegen.base import Writer
from coconetc.codegen.emit import COMPUTE, CTYPE, Load, emit, literal
from coconetc.codegen.indexing import Indexing
from coconetc.ir.nodes import Const, Expr, Ref
from coconetc.ir.types import TType
from coconetc.plan.fusion_legality import ROW_VALUE, row_op, substitute
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


@dataclass(frozen=True)
class RowDx:
    """A fused collective's row-wise stage that is a pointwise expression of one layernorm_dx
    (plan/fusion_legality.row_op), as both backends lay it out: the call's operands, the compute
    and storage types C and T, the row's length H, and `rest`, the expression around the call
    with the call's value in ROW_VALUE (the register dx_: the call's result rounded to T, as the
    library call stores it)."""

    x: Ref
    gamma: Ref
    g: Ref
    eps: str
    C: str
    T: str
    H: str
    rest: Expr

    @classmethod
    def of(cls, item_name: str, expr: Expr, w: Writer) -> RowDx:
        e = row_op(expr)
        assert e is not None, item_name
        x, gamma, g, eps = e.args
        assert isinstance(x, Ref) and isinstance(gamma, Ref) and isinstance(g, Ref)
        t = w.types[item_name]
        return cls(x, gamma, g, layernorm_eps(eps), COMPUTE[t.dtype], CTYPE[t.dtype], w.ldims(t)[-1],
                   substitute(expr, e, Ref(ROW_VALUE, e.type)))

    def at(self, r: Ref, idx: str, collective: str) -> str:
        """R's element IDX in C: the reduced chunk `red` for the collective's own value."""
        return f"red[{idx} - lo]" if r.name == collective else f"coconet::to_compute(v_{r.name}[{idx}])"

    def element(self, col: str) -> list[str]:
        """The element's index i and its register dx_, inside the call's `(col, v)` lambda."""
        return [f"const int64_t i = row + {col};", f"const {self.C} dx_ = coconet::round_to<{self.T}>(v);"]


def layernorm_row(C: str, H: str, xj: str, gamma: str, beta: str, eps: str) -> str:
    """The head of the call that lays out the layernorm of the row starting at `row` (H elements,
    element `row + j` read as xj) in compute type C (pointwise.h: layernorm_row_by, the row's math
    in one home), left open in its callback over the row's elements (j, and v: the element's value
    in C)."""
    return (f"coconet::layernorm_row_by([&](int64_t j) {{ return {xj}; }}, v_{gamma}, v_{beta}, "
            f"static_cast<{C}>({eps}), {H}, [&](int64_t j, {C} v) {{")
