"""The IR as readable .ccn text. A printed program parses and checks back to the same IR; a
scheduled program prints as the program it has become (split collectives, sliced parameters,
gathers) plus a schedule block holding its fusions and overlaps."""

from __future__ import annotations

import re

from coconetc.ir import ops
from coconetc.ir.nodes import Const, Expr, Op, Overlap, Program, Ref, refs, walk
from coconetc.ir.types import DimExpr

_NEG = 3  # unary minus binds tighter than * and looser than ** (the grammar's levels)


def expr(e: Expr, parent: int = -1, sites: Draws | None = None) -> str:
    """Precedence-aware: parentheses only where the grammar needs them. sites: the stage's
    draws, so that a random operation whose site is not the stage's next draw says its own."""
    if isinstance(e, Ref):
        return e.name
    if isinstance(e, Const):
        text = _number(e.value)  # a negative literal binds like unary minus: (-2) ** x
        return f"({text})" if text.startswith("-") and _NEG < parent else text
    d = ops.get(e.op)
    if d.infix is not None:
        sym, prec, right_assoc = d.infix.symbol, d.infix.prec, d.infix.right
        left = expr(e.args[0], prec + (1 if right_assoc else 0), sites)
        right = expr(e.args[1], _NEG if right_assoc else prec + 1, sites)  # grammar: atom ** unary
        text = f"{left} {sym} {right}"
        return f"({text})" if prec < parent or (prec == 0 and parent == 0) else text
    if d.prefix is not None:
        text = d.prefix + expr(e.args[0], _NEG, sites)
        return f"({text})" if _NEG < parent else text
    return _call(e, d, sites)


def _number(v: float | int) -> str:
    if isinstance(v, int):
        return str(v)
    if v in (float("inf"), float("-inf")):  # the language's inf
        return "inf" if v > 0 else "-inf"
    text = repr(float(v))
    return text if ("." in text or "e" in text or "n" in text) else text + ".0"


def _call(e: Op, d: ops.OpDef, sites: Draws | None = None) -> str:
    """Arguments in the registry's order; those with a default always as keywords."""
    values = iter(e.args)
    args = []
    for a in d.params:
        if a.kind == "value":
            args.append(expr(next(values), -1, sites))
        elif a.kind == "shape":
            args.append("[" + ", ".join(map(str, e.attr(a.name))) + "]")
        elif a.required:
            args.append(str(e.attr(a.name)))
        else:
            args.append(f"{a.name}={ops.attr(e, a.name)}")
    if sites is not None and d.kind == "random":  # after its operands: the checker's order
        args += sites.keywords(e)
    return f"{ops.spelled(d)}({', '.join(args)})"


class Draws:
    """The random draws of one stage's expression as it is printed (operands before their
    operation, as the checker numbers them): a random operation whose RNG site (`NAME#k`) is
    the stage's next draw prints as it is; another gets `site=NAME, draw=k` (which the checker
    gives it without counting it as one of the stage's draws)."""

    def __init__(self, stage: str) -> None:
        self.stage, self.k = stage, 0

    def keywords(self, e: Op) -> list[str]:
        site = str(e.attr("site"))
        if site == f"{self.stage}#{self.k}":
            self.k += 1
            return []
        name, _, draw = site.rpartition("#")
        return [f"site={name}"] + ([f"draw={draw}"] if draw != "0" else [])


def _dim(d) -> str:
    return str(d) if not isinstance(d, DimExpr) else str(d)


def program(p: Program) -> str:
    params = []
    for q in p.params:
        if q.scalar:
            params.append(f"{q.name}: {q.type.dtype}")
            continue
        dims = ", ".join(_dim(d) for d in q.type.shape)
        scattered = " scattered" if q.scattered else ""
        params.append(f"{q.name}: {q.type.dtype}[{dims}] {q.type.layout}{scattered}")
    lines = [*_externs(p), f"program {p.name}(", *(f"    {x}," for x in params), ") {"]
    updates = {s: t for t, s in p.updates}
    for s in p.stages:
        rhs = expr(s.expr, sites=Draws(s.name))
        if s.name in updates:
            rhs = f"update({updates[s.name]}, {rhs})"
        lines.append(f"    {s.name} = {rhs}")
    if p.outputs:
        items = [s if pub == s else f"{s} as {pub}" for pub, s in p.outputs]
        lines.append(f"    return {', '.join(items)}")
    lines.append("}")
    return "\n".join(lines) + "\n" + _schedule_block(p)


def _externs(p: Program) -> list[str]:
    """The declarations of the extern operations p calls, and of those their derivatives
    (grad_p = "...") call, so that the text parses alone."""
    used = list(dict.fromkeys(n.op for s in p.stages for n in walk(s.expr) if isinstance(n, Op)))
    for name in used:  # grows while it is read: the extern operations a derivative calls
        ext, scope = ops.get(name).extern, ops.scope_of(name)  # (by the names its file wrote)
        for _, text in ext.grads if ext is not None else ():
            used += [scope[c].name for c in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*\(", text)
                     if c in scope and scope[c].name not in used]
    decls = [ext.decl for ext in (ops.get(n).extern for n in used) if ext is not None]
    return [line for d in decls for line in d.splitlines()]


def _schedule_block(p: Program) -> str:
    if not p.fusions and not p.overlaps and not p.prefetch:
        return ""
    lines = [f"schedule printed for {p.name} {{"]
    for f in p.fusions:
        lines.append(f"    {f.name} = fuse({', '.join(f.stages)})")
    for o in p.overlaps:
        lines.append(f"    overlap({o.producer}, {o.consumer}, chunks={o.chunks}, dim={o.dim})")
    if p.prefetch:
        lines.append(f"    prefetch(depth={p.prefetch})")
    return "\n".join(lines) + "\n}\n"


def dot(p: Program) -> str:
    """Graphviz dot of the stage graph; edges carry the layout of the value they move."""
    lines = [f'digraph "{p.name}" {{', "  rankdir=LR;", "  compound=true;",
             "  node [fontname=monospace];"]
    fused = {n: f.name for f in p.fusions for n in f.stages}
    for q in p.params:
        lines.append(f'  "{q.name}" [shape=box, label="{q.name}\\n{q.type}"];')
    for f in p.fusions:
        lines.append(f'  subgraph "cluster_{f.name}" {{ label="{f.name}"; style=dashed;')
        lines += [f'    "{n}";' for n in f.stages]
        lines.append("  }")
    for s in p.stages:
        op = s.expr.op if isinstance(s.expr, Op) else "ref"
        shape = "ellipse" if s.kind == "collective" else "box"
        style = ", style=rounded" if s.name in fused and shape == "box" else ""
        lines.append(f'  "{s.name}" [shape={shape}{style}, label="{s.name} = {op}\\n{s.type}"];')
        for r in refs(s.expr):
            lines.append(f'  "{r}" -> "{s.name}" [label="{p.layout_of(r)}"];')
    for t, src in p.updates:
        lines.append(f'  "{src}" -> "{t}" [style=dashed, label="update"];')
    for o in p.overlaps:
        head = _overlap_head(p, o)
        lines.append(f'  "{o.producer}" -> {head}style=dotted, label="overlap x{o.chunks}"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _overlap_head(p: Program, o: Overlap) -> str:
    """An overlap's consumer may be a fusion, which is a cluster, not a node: the edge goes to
    the member that reads the producer and is clipped at the cluster's border (lhead)."""
    fusion = next((f for f in p.fusions if f.name == o.consumer), None)
    if fusion is None:
        return f'"{o.consumer}" ['
    head = next((n for n in fusion.stages if o.producer in refs(p.stage_named(n).expr)), fusion.stages[0])
    return f'"{head}" [lhead="cluster_{fusion.name}", '
