"""Small pure helpers for rewriting programs: renaming references, dependencies, re-typing."""

from __future__ import annotations

from dataclasses import replace

from collections.abc import Callable

from coconetc.ir.nodes import Const, Expr, Program, Ref, Stage, refs, walk
from coconetc.ir.ops import type_op, typing_state
from coconetc.ir.typerules import TypeErr
from coconetc.ir.types import TType


# Expressions retype made (by id, each held so that its id stays its own), with the typing
# state they were typed under: such an expression, read again where every name it reads has
# the type its reference carries, types as itself, so retype returns it without re-typing
# (a schedule's directives and the verifier after each re-type every stage of a program of
# hundreds, most of them unchanged). Emptied when full.
_TYPED: dict[int, tuple[Expr, object]] = {}
_TYPED_MAX = 1 << 14


def retype(e: Expr, env: Callable[[str], TType]) -> Expr:
    """Re-type an expression bottom-up after the types of the names it reads changed."""
    if isinstance(e, Ref):
        return replace(e, type=env(e.name))
    if isinstance(e, Const):
        return e
    state = typing_state()
    seen = _TYPED.get(id(e))
    if seen is not None and seen[0] is e and seen[1] == state and \
            all(n.type == env(n.name) for n in walk(e) if isinstance(n, Ref)):
        return e
    out = _retyped(e, env)
    if len(_TYPED) >= _TYPED_MAX:
        _TYPED.clear()
    _TYPED[id(out)] = (out, state)
    return out


def _retyped(e: Expr, env: Callable[[str], TType]) -> Expr:
    if isinstance(e, Ref):
        return replace(e, type=env(e.name))
    if isinstance(e, Const):
        return e
    args = tuple(_retyped(a, env) for a in e.args)
    return replace(e, args=args, type=type_op(e.op, args, dict(e.attrs), e.span))


def rename(e: Expr, mapping: dict[str, str]) -> Expr:
    """Replace references by name (types are fixed up by retype afterwards); e itself where it
    reads none of them."""
    if not any(isinstance(n, Ref) and n.name in mapping for n in walk(e)):
        return e
    return _renamed(e, mapping)


def _renamed(e: Expr, mapping: dict[str, str]) -> Expr:
    if isinstance(e, Ref):
        return replace(e, name=mapping.get(e.name, e.name))
    if isinstance(e, Const):
        return e
    return replace(e, args=tuple(_renamed(a, mapping) for a in e.args))


def rename_program(p: Program, mapping: dict[str, str], skip: frozenset[str] | set[str] = frozenset()) -> Program:
    """Point every reader (stages not in skip, outputs, updates) at the new names."""
    stages = tuple(s if s.name in skip or (e := rename(s.expr, mapping)) is s.expr else replace(s, expr=e)
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
        stages.append(s if expr is s.expr else replace(s, expr=expr))
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
