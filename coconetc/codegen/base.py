"""What every part of the CPU renderer shares: the function being written, the plan's
buffers, and the C++ for shapes (global and this rank's local dims, slice offsets)."""

from __future__ import annotations

from dataclasses import dataclass, field

from coconetc.ir.types import Dim, DimExpr, TType, dim_symbols
from coconetc.plan.units import Buffer, Plan, Unit


@dataclass
class Signature:
    """What the Python side passes, in order."""

    tensors: list[str] = field(default_factory=list)  # tensor parameters (scattered ones too)
    scalars: list[str] = field(default_factory=list)  # scalar parameters
    outputs: list[str] = field(default_factory=list)  # public output names
    sizes: list[str] = field(default_factory=list)  # size symbols


@dataclass
class Function:
    name: str
    comment: str
    body: list[str]
    signature: Signature


def cdim(d: Dim) -> str:
    if isinstance(d, int):
        return f"int64_t({d})"
    if isinstance(d, str):
        return f"S_{d}"
    assert isinstance(d, DimExpr)
    return f"({cdim(d.a)} {'/' if d.op == '//' else d.op} {cdim(d.b)})"


def prod(items: list[str]) -> str:
    return " * ".join(items) if items else "int64_t(1)"


_prod = prod


class RenderBase:
    def __init__(self, plan: Plan, fn: str, file: str, outputs: list[str]):
        self.plan, self.fn, self.file = plan, fn, file
        self.lines: list[str] = []
        self.types: dict[str, TType] = {b.name: b.type for b in plan.buffers}
        self.scattered = {b.name for b in plan.buffers if b.kind == "segments"}
        self.nsite = 0
        self.consts: dict[str, str] = {}  # Lets already declared: name -> C++ name
        sizes = sorted({s for b in plan.buffers if b.kind in ("param", "segments") for d in b.type.shape
                        for s in dim_symbols(d)})
        self.sig = Signature(sizes=sizes, outputs=outputs)

    # --- the function ---------------------------------------------------------------------
    # --- shapes ---------------------------------------------------------------------------
    def gdims(self, t: TType) -> list[str]:
        return [cdim(d) for d in t.shape]

    def ldims(self, t: TType) -> list[str]:
        dims = self.gdims(t)
        if t.layout.sliced:
            dims[t.layout.dim] = f"coconet::slice_range({dims[t.layout.dim]}, comm.size, comm.rank).size()"
        return dims

    def offset(self, t: TType) -> str:
        if not t.layout.sliced:
            return "int64_t(0)"
        return f"coconet::slice_range({self.gdims(t)[t.layout.dim]}, comm.size, comm.rank).begin"

    def emit(self, line: str) -> None:
        self.lines.append(line)

    def shape3(self, t: TType, d: int) -> str:
        g = self.gdims(t)
        return f"{_prod(g[:d])}, {g[d]}, {_prod(g[d + 1:])}"

    # --- the function: every backend lays it out the same way ------------------------------
    def render(self) -> Function:
        for i, sym in enumerate(self.sig.sizes):
            self.emit(f"const int64_t S_{sym} = a.sizes[{i}];")
        for b in self.plan.buffers:
            self._declare(b)
        for u in self.plan.units:
            self.unit(u)
        comment = f"program {self.plan.program}, schedule {self.plan.schedule} ({self.file})"
        return Function(self.fn, comment, self.lines, self.sig)

    def _comment(self, line: int, what: str) -> None:
        where = f"{self.file}:{line}" if line else self.file
        self.emit(f"// [{self.plan.schedule}] {what} ({where})")

    def _declare(self, b: Buffer) -> None:
        raise NotImplementedError

    def unit(self, u: Unit) -> None:
        raise NotImplementedError
