"""The all-gathers of weights in a program: a parameter kept sliced over the data-parallel ranks
between steps and gathered where it is used (FSDP, ZeRO-3; docs/sharded.md), directly
(`allgather(w)`) or through the layer a repeat takes of a stacked one (`allgather(index(w, l))`,
a reshape of it too). Nothing the program computes feeds such a gather, so it may start at any
point of the call: what a schedule's `prefetch(depth=d)` moves (coconetc/schedule/prefetch.py,
plan/prefetch.py)."""

from __future__ import annotations

from coconetc.ir.expr import Expr, Op, Ref
from coconetc.ir.nodes import Program

VIEWS = ("index", "reshape")  # what may stand between a parameter and its gather


def weight_of(p: Program, e: Expr) -> str | None:
    """The parameter E is a view of (E itself a parameter, a stage or an expression made only of
    VIEWS of one), or None; a parameter the program updates in place is not a weight here (its
    value changes during the call)."""
    seen: set[str] = set()
    while True:
        if isinstance(e, Op) and e.op in VIEWS and e.args:
            e = e.args[0]
            continue
        if not isinstance(e, Ref) or e.name in seen:
            return None
        seen.add(e.name)
        q = p.param(e.name)
        if q is not None:
            return None if q.scalar or any(t == q.name for t, _ in p.updates) else q.name
        s = p.stage(e.name)
        if s is None:
            return None
        e = s.expr


def weight_gathers(p: Program) -> list[str]:
    """The stages of P that all-gather a weight (weight_of), in program order."""
    return [s.name for s in p.stages if isinstance(s.expr, Op) and s.expr.op == "allgather" and s.expr.args
            and weight_of(p, s.expr.args[0]) is not None]
