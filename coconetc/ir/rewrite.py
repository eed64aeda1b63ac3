"""Small pure helpers for rewriting programs: renaming references, dependencies, re-typing."""

from __future__ import annotations

from dataclasses import replace

from collections.abc import Callable

from coconetc.ir.nodes import Const, Expr, Program, Ref, Stage, refs
from coconetc.ir.ops import type_op
from coconetc.ir.typerules import TypeErr
from coconetc.ir.types import TType


def retype(e: Expr, env: Callable[[str], TType]) -> Expr:
    """Re-type an expression bottom-up after the types of the names it reads changed."""
    if isinstance(e, Ref):
        return replace(e, type=env(e.name))
    if isinstance(e, Const):
        return e
    args = tuple(retype(a, env) for a in e.args)
    return replace(e, args=args, type=type_op(e.op, args, dict(e.attrs), e.span))


def rename(e: Expr, mapping: dict[str, str]) -> Expr:
    """Replace references by name (types are fixed up by retype afterwards)."""
    if isinstance(e, Ref):
        return replace(e, name=mapping.get(e.name, e.name))
    if isinstance(e, Const):
        return e
    return replace(e, args=tuple(rename(a, mapping) for a in e.args))


def rename_program(p: Program, mapping: dict[str, str], skip: frozenset[str] | set[str] = frozenset()) -> Program:
    """Point every reader (stages not in skip, outputs, updates) at the new names."""
    stages = tuple(s if s.name in skip else replace(s, expr=rename(s.expr, mapping))
                   for s in p.stages)
    outputs = tuple((pub, mapping.get(s, s)) for pub, s in p.outputs)
    updates = tuple((t, mapping.get(s, s)) for t, s in p.updates)
    return replace(p, stages=stages, outputs=outputs, updates=updates)


def retype_program(p: Program) -> Program:
    """Re-type every stage in order (raises TypeErr where a stage no longer types)."""
    types = {q.name: q.type for q in p.params}
    stages = []
    for s in p.stages:
        try:
            expr = retype(s.expr, types.__getitem__)
        except TypeErr as err:
            err.stage = s.name  # type: ignore[attr-defined]  # which stage no longer types
            raise
        types[s.name] = expr.type
        stages.append(replace(s, expr=expr))
    return replace(p, stages=tuple(stages))


def depends_on(p: Program) -> dict[str, set[str]]:
    """For every stage, the stages it reads, directly or not."""
    deps: dict[str, set[str]] = {}
    for s in p.stages:
        direct = {r for r in refs(s.expr) if r in deps}
        deps[s.name] = set(direct).union(*(deps[r] for r in direct))
    return deps


def is_used(p: Program, name: str) -> bool:
    return (bool(p.users(name)) or any(s == name for _, s in p.outputs)
            or any(s == name for _, s in p.updates))


def drop_stage(p: Program, name: str) -> Program:
    return replace(p, stages=tuple(s for s in p.stages if s.name != name))


def insert_after(stages: tuple[Stage, ...], after: str, new: Stage) -> tuple[Stage, ...]:
    i = next(i for i, s in enumerate(stages) if s.name == after)
    return stages[: i + 1] + (new,) + stages[i + 1:]
