"""IR nodes, all frozen (edit with dataclasses.replace). A program is a list of stages, each
an expression tree (expr.py, re-exported here) whose leaves are references to parameters or
earlier stages."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from coconetc.errors import NOWHERE, Span
from coconetc.ir import ops
from coconetc.ir.expr import Const, Expr, Op, Ref, refs, walk
from coconetc.ir.types import Layout, TType


class OpNames:
    """The names of the registered operations of some kinds, read from the registry each time
    (so an operation registered at run time belongs at once): `op in POINTWISE`."""

    def __init__(self, *kinds: str):
        self.kinds = kinds

    def __contains__(self, op: object) -> bool:
        d = ops.REGISTRY.get(op) if isinstance(op, str) else None
        return d is not None and d.kind in self.kinds

    def __iter__(self) -> Iterator[str]:
        return iter(ops.names(*self.kinds))

    def __len__(self) -> int:
        return len(ops.names(*self.kinds))

    def __repr__(self) -> str:
        return f"OpNames{ops.names(*self.kinds)}"


POINTWISE = OpNames("pointwise", "random", "index")  # what a loop can compute element by element
REDUCTIONS = OpNames("reduction")
TENSOR_OPS = OpNames("tensor")
COLLECTIVES = OpNames("collective")

__all__ = ["COLLECTIVES", "POINTWISE", "REDUCTIONS", "TENSOR_OPS", "Const", "Expr", "Fusion", "Op", "OpNames",
           "Overlap", "Param", "Program", "Ref", "Stage", "refs", "walk"]


@dataclass(frozen=True)
class Param:
    name: str
    type: TType
    scalar: bool = False
    scattered: bool = False
    span: Span = field(default=NOWHERE, compare=False)


@dataclass(frozen=True)
class Stage:
    name: str
    expr: Expr
    span: Span = field(default=NOWHERE, compare=False)

    @property
    def type(self) -> TType:
        return self.expr.type

    @property
    def top(self) -> Op:
        """The operation at the top of the stage's expression (for a stage known to have one:
        a collective or tensor stage)."""
        if not isinstance(self.expr, Op):
            raise TypeError(f"stage '{self.name}' is not an operation")
        return self.expr

    @property
    def kind(self) -> str:
        """'collective', 'tensor' (matmul/layernorm/conv2d at the top) or 'compute'."""
        kind = ops.get(self.expr.op).kind if isinstance(self.expr, Op) else ""
        return kind if kind in ("collective", "tensor") else "compute"


@dataclass(frozen=True)
class Fusion:
    name: str
    stages: tuple[str, ...]
    span: Span = field(default=NOWHERE, compare=False)


"""The operations an overlap can cut into chunks (plan/units.py Overlap.gemm)."""


@dataclass(frozen=True)
class Overlap:
    """A matmul `producer` and the collective (or fusion) `consumer` that reads it; or the
    other way, an allgather or broadcast `producer` and the matmul `consumer` that reads it."""

    producer: str
    consumer: str  # a collective stage or a fusion; or a matmul
    chunks: int
    dim: int  # the dim of the producer's result that is cut into chunks
    span: Span = field(default=NOWHERE, compare=False)


@dataclass(frozen=True)
class Program:
    """A typed (possibly scheduled) program. outputs: (public name, stage) pairs returned as
    new arrays; updates: (parameter, stage) pairs written into the parameter in place."""

    name: str
    params: tuple[Param, ...]
    stages: tuple[Stage, ...]
    outputs: tuple[tuple[str, str], ...] = ()
    updates: tuple[tuple[str, str], ...] = ()
    fusions: tuple[Fusion, ...] = ()
    overlaps: tuple[Overlap, ...] = ()
    prefetch: int = 0  # a schedule's prefetch(depth=d): how far ahead weight gathers start (0: none)
    span: Span = field(default=NOWHERE, compare=False)

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)

    def stage(self, name: str) -> Stage | None:
        return next((s for s in self.stages if s.name == name), None)

    def stage_named(self, name: str) -> Stage:
        """The stage called name (KeyError if there is none)."""
        s = self.stage(name)
        if s is None:
            raise KeyError(f"no stage '{name}' in program '{self.name}'")
        return s

    def type_of(self, name: str) -> TType:
        p = self.param(name)
        if p is not None:
            return p.type
        s = self.stage(name)
        if s is None:
            raise KeyError(name)
        return s.type

    def users(self, name: str) -> list[Stage]:
        return [s for s in self.stages if name in refs(s.expr)]

    def summed_gemms(self, name: str) -> tuple[Stage, ...]:
        """The GEMM stages that stage `name` sums, when it is `t1 + t2 + ...` of two or more
        stages, each a matmul or a matmul_nt of a 2-d right operand with name's type, read by
        no other stage, neither an output nor an update (a derived program's input gradient
        through several linear layers: attention's q, k and v). An overlap computes such a
        producer chunk by chunk, one GEMM after another into the same rows (plan/units.py
        Overlap.terms). () when it is not such a sum."""
        s = self.stage(name)
        names: list[str] = []

        def terms(e: Expr) -> bool:
            if isinstance(e, Op) and e.op == "add":
                return all(terms(a) for a in e.args)
            if isinstance(e, Ref):
                names.append(e.name)
                return True
            return False
        if s is None or not terms(s.expr) or len(names) < 2 or len(set(names)) != len(names):
            return ()
        out = {x for _, x in self.outputs + self.updates}
        found = tuple(self.stage(n) for n in names)
        ok = all(t is not None and isinstance(t.expr, Op) and ops.has(t.expr.op, ops.OVERLAPPED) and t.type == s.type
                 and t.expr.args[1].type.ndim == 2 and t.name not in out
                 and [u.name for u in self.users(t.name)] == [name] for t in found)
        return tuple(t for t in found if t is not None) if ok else ()

    def fusion_of(self, stage: str) -> Fusion | None:
        return next((f for f in self.fusions if stage in f.stages), None)

    def layout_of(self, name: str) -> Layout:
        return self.type_of(name).layout
