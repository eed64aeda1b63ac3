"""The IR verifier, run on the program after every schedule directive (as MLIR and xDSL verify
after every pass): every reference names a parameter or an earlier stage, with its type; every
stage's type is what the operation registry gives its operands (types and layouts re-derived
bottom-up); names are unique; updates write parameters with values of their shape and dtype;
outputs, fusions and overlaps name stages that exist. A failure is a compiler bug (IRInvalid,
naming the directive whose rewrite broke the program), never a user error."""

from __future__ import annotations

from coconetc.ir.nodes import Op, Program, Ref, walk
from coconetc.ir.rewrite import retype
from coconetc.ir.typerules import TypeErr
from coconetc.ir.types import TType


class IRInvalid(AssertionError):
    """A directive's rewrite produced an inconsistent program (a bug in coconetc)."""


def verify_program(p: Program, after: str = "") -> Program:
    """p, checked; after: what produced it (a directive), named in the error."""
    problem = _first_problem(p)
    if problem:
        where = f" after {after}" if after else ""
        raise IRInvalid(f"program {p.name}{where}: {problem}")
    return p


def _first_problem(p: Program) -> str:
    for check in (_names, _stages, _updates_outputs, _fusions_overlaps):
        problem = check(p)
        if problem:
            return problem
    return ""


def _names(p: Program) -> str:
    seen: set[str] = set()
    for n in [q.name for q in p.params] + [s.name for s in p.stages] + [f.name for f in p.fusions]:
        if n in seen:
            return f"the name '{n}' is defined twice"
        seen.add(n)
    return ""


def _stages(p: Program) -> str:
    """References defined before use, with the type they were defined with; each stage typed
    as the registry types its operation."""
    types: dict[str, TType] = {q.name: q.type for q in p.params}
    for s in p.stages:
        for r in (n for n in walk(s.expr) if isinstance(n, Ref)):
            if r.name not in types:
                return f"stage '{s.name}' reads '{r.name}', which is not defined before it"
            if r.type != types[r.name]:
                return f"stage '{s.name}' reads '{r.name}' as {r.type}, but it is {types[r.name]}"
        try:
            again = retype(s.expr, types.__getitem__)
        except TypeErr as err:
            return f"stage '{s.name}' no longer types: {err}"
        if again != s.expr:
            return f"stage '{s.name}' is typed {s.type}, but its operands give {again.type}" + _where(s.expr, again)
        types[s.name] = s.type
    return ""


def _where(e, again) -> str:
    """The innermost operation whose type changed, when it is not the stage's own."""
    inner = [(a.op, a.type, b.type) for a, b in zip(walk(e), walk(again)) if isinstance(a, Op) and a.type != b.type]
    return f" ({inner[-1][0]}: {inner[-1][1]}, re-typed {inner[-1][2]})" if len(inner) > 1 else ""


def _updates_outputs(p: Program) -> str:
    for t, src in p.updates:
        q, s = p.param(t), p.stage(src)
        if q is None:
            return f"an update writes '{t}', which is not a parameter"
        if s is None:
            return f"the update of '{t}' names '{src}', which is not a stage"
        if (s.type.dtype, s.type.shape) != (q.type.dtype, q.type.shape):
            return f"the update of '{t}' ({q.type}) writes '{src}' ({s.type})"
    for pub, src in p.outputs:
        if p.stage(src) is None and p.param(src) is None:
            return f"the output '{pub}' names '{src}', which is not defined"
    return ""


def _fusions_overlaps(p: Program) -> str:
    fused: set[str] = set()
    for f in p.fusions:
        for n in f.stages:
            if p.stage(n) is None:
                return f"fusion '{f.name}' holds '{n}', which is not a stage"
            if n in fused:
                return f"'{n}' is in two fusions"
            fused.add(n)
    for o in p.overlaps:
        if p.stage(o.producer) is None:
            return f"an overlap's producer '{o.producer}' is not a stage"
        if p.stage(o.consumer) is None and not any(f.name == o.consumer for f in p.fusions):
            return f"an overlap's consumer '{o.consumer}' is neither a stage nor a fusion"
    return ""
