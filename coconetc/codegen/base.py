"""What every backend's renderer writes into: the function being written (its lines, the plan's
buffers and their types, the Lets already declared, the signature the Python side passes), and
the C++ for shapes (global and this rank's local dims, slice offsets).

Composition, not inheritance: one Writer per generated function, held by every part of a
backend's renderer (its loops or kernels, collectives, fused collectives, overlap) and by the
shared pieces (indexing.py, pointwise.py, dispatch.py): each part keeps it as `self.w` and
writes through it (self.w.emit, self.w.ldims, self.w.consts, ...)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from coconetc.ir.types import Dim, DimExpr, TType, dim_symbols
from coconetc.plan.units import Buffer, Plan


# What a lambda's body reads of its enclosing function (codegen/cpu: the loops on the loop threads,
# the column-sum blocks, a fused collective's chunks): the buffers' pointers (v_), the Lets
# (k<n>_) and the sizes (S_, L<k>). Writer.closure_locals copies them into locals at the top of
# the body.
_CAPTURED = r"v_\w+|k\d+_\w+|L\d+|S_\w+"
_ASSIGNED = re.compile(r"\b(\w+)\s*(?:\[1\]\s*)?[-+*/|&]?=(?!=)")  # NAME = / NAME += (not NAME[i] = ...)


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


class Writer:
    """The body of one generated function, as it is written."""

    def __init__(self, plan: Plan, fn: str, file: str, outputs: list[str]):
        self.plan, self.fn, self.file = plan, fn, file
        self.lines: list[str] = []
        self.buffers: dict[str, Buffer] = {b.name: b for b in plan.buffers}
        self.types: dict[str, TType] = {b.name: b.type for b in plan.buffers}
        self.scattered = {b.name for b in plan.buffers if b.kind == "segments"}
        self.nsite = 0  # call sites numbered so far (scratch buffers, events, ...)
        self.consts: dict[str, str] = {}  # Lets already declared: name -> C++ name
        sizes = sorted({s for b in plan.buffers if b.kind in ("param", "segments") for d in b.type.shape
                        for s in dim_symbols(d)})
        self.sig = Signature(sizes=sizes, outputs=outputs)

    def emit(self, line: str) -> None:
        self.lines.append(line)

    def tensor_arg(self, name: str) -> int:
        """The next tensor the Python side passes (its index in the call's tensors) is `name`."""
        self.sig.tensors.append(name)
        return len(self.sig.tensors) - 1

    def scalar_arg(self, name: str, dtype: str) -> str:
        """The next scalar the Python side passes is `name`: its value in the call's arguments."""
        self.sig.scalars.append(name)
        return f"a.{'iscalars' if dtype.startswith('i') else 'scalars'}[{len(self.sig.scalars) - 1}]"

    def comment(self, line: int, what: str) -> None:
        """The comment before a unit: the schedule, what the unit is, its .ccn line."""
        where = f"{self.file}:{line}" if line else self.file
        self.emit(f"// [{self.plan.schedule}] {what} ({where})")

    @contextmanager
    def closure_locals(self, pad: str, also: tuple[str, ...] = ()) -> Iterator[None]:
        """The lines emitted inside: a lambda's body that captures by reference. Each pointer,
        Let and size it reads of the enclosing function (and each name in ALSO: other locals of
        the enclosing function it reads) is copied into a local (l_NAME) first and read from
        there: GCC does not vectorize a loop whose base pointers it loads through the closure
        (-fopt-info-vec: "evolution of base is not affine"), so without the copies a loop on the
        loop threads ran scalar. PAD: the declarations' indent."""
        start = len(self.lines)
        yield
        body = self.lines[start:]
        captured = re.compile(rf"\b({'|'.join([_CAPTURED, *also])})\b")
        code = [part for line in body for part in line.split('"')[::2]]  # outside string literals
        assigned = {m for part in code for m in _ASSIGNED.findall(part)}
        names = sorted({m for part in code for m in captured.findall(part)} - assigned)
        if not names:
            return
        keep = set(names)

        def local(line: str) -> str:
            parts = line.split('"')
            parts[::2] = [captured.sub(lambda m: f"l_{m[1]}" if m[1] in keep else m[1], p) for p in parts[::2]]
            return '"'.join(parts)
        self.lines[start:] = [f"{pad}const auto l_{n} = {n};" for n in names] + [local(line) for line in body]

    @contextmanager
    def saved_consts(self) -> Iterator[None]:
        """A scope of Lets: those declared inside (a callback's, a kernel's locals) are forgotten
        at its end, so code after it declares them again where it needs them."""
        saved = dict(self.consts)
        try:
            yield
        finally:
            self.consts = saved

    def site(self) -> int:
        """A new call site's number."""
        self.nsite += 1
        return self.nsite

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

    def shape3(self, t: TType, d: int) -> str:
        g = self.gdims(t)
        return f"{_prod(g[:d])}, {g[d]}, {_prod(g[d + 1:])}"
