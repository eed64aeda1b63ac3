"""Schedule directives as frozen records, built from a schedule block's statements."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from coconetc.errors import CompileError, Diagnostic, Span
from coconetc.frontend import syntax
from coconetc.pipeline import orders
from coconetc.schedule.each_layer import WORD, EachLayer
from coconetc.schedule.pipeline import Pipeline
from coconetc.schedule.prefetch import KeepGathered, Prefetch


@dataclass(frozen=True)
class Split:
    """rs, ag = split(s, dim=0)"""

    stage: str
    dim: int
    rs: str
    ag: str
    span: Span = field(compare=False)
    where: tuple[tuple[str, Span], ...] = field(default=(), compare=False, repr=False)


@dataclass(frozen=True)
class Reorder:
    """a1, a2 = reorder(ag, s1, s2, ...)"""

    ag: str
    stages: tuple[str, ...]
    outs: tuple[str, ...]
    span: Span = field(compare=False)
    where: tuple[tuple[str, Span], ...] = field(default=(), compare=False, repr=False)


@dataclass(frozen=True)
class Slice:
    """slice(t, ...)"""

    params: tuple[str, ...]
    span: Span = field(compare=False)
    where: tuple[tuple[str, Span], ...] = field(default=(), compare=False, repr=False)


@dataclass(frozen=True)
class Fuse:
    """f = fuse(s1, s2, ...)"""

    stages: tuple[str, ...]
    name: str | None
    span: Span = field(compare=False)
    where: tuple[tuple[str, Span], ...] = field(default=(), compare=False, repr=False)


@dataclass(frozen=True)
class OverlapD:
    """overlap(producer, consumer, chunks=k[, dim=d])"""

    producer: str
    consumer: str
    chunks: int
    dim: int | None
    span: Span = field(compare=False)
    where: tuple[tuple[str, Span], ...] = field(default=(), compare=False, repr=False)


Directive = Split | Reorder | Slice | Fuse | OverlapD | Pipeline | Prefetch | KeepGathered | EachLayer


def span_of(d: Directive, key: str) -> Span:
    """Where in the directive an error about `key` points: a stage or parameter argument by
    its name ('name#2' for its second mention), a defined name as '=name', a keyword argument's
    value as 'dim=', the directive's word as '()' (also where an unknown key points)."""
    where = dict(d.where)
    return where.get(key) or where.get("()") or d.span


def _where(targets, call: syntax.Call) -> tuple[tuple[str, Span], ...]:
    spans: dict[str, Span] = {"()": call.fn_span}
    for t in targets:
        spans.setdefault("=" + t.id, t.span)
    for a in call.args:
        if isinstance(a, syntax.Name):
            spans.setdefault(a.id + "#2" if a.id in spans else a.id, a.span)
    for k in call.kwargs:
        spans.setdefault(k.name + "=", k.value.span)
    return tuple(spans.items())
_ARITY = {"split": (2, 2), "reorder": (0, 999), "slice": (0, 0), "fuse": (0, 1), "overlap": (0, 0),
          "pipeline": (0, 0), "prefetch": (0, 0), "keep_gathered": (0, 0), "each_layer": (0, 0)}
_PIPELINE = {"stages", "microbatches", "order", "chunks", "layers", "max_activations"}


def from_ast(body: tuple[syntax.Stmt, ...]) -> list[Directive]:
    """Directive records for a schedule block; raises CompileError listing every bad line."""
    out, errors = [], []
    for stmt in body:
        try:
            out.append(_directive(stmt))
        except CompileError as err:
            errors.extend(err.diagnostics)
    if errors:
        raise CompileError(errors)
    _alone(out)
    return out


def _alone(directives: list[Directive]) -> None:
    """One pipeline(...) a schedule; beside it only directives of stages (split, reorder, fuse,
    overlap, each_layer), which each virtual stage takes for its layers
    (schedule/stage_directives.py): a slice, prefetch or keep_gathered would reach no stage."""
    pipes = [d for d in directives if isinstance(d, Pipeline)]
    if not pipes:
        return
    if len(pipes) > 1:
        raise _err(span_of(pipes[1], "()"), f"pipeline(): one a schedule (the first is at line {pipes[0].span.line})")
    other = next((d for d in directives if isinstance(d, (Slice, Prefetch, KeepGathered))), None)
    if other is not None:
        fn = WORD[type(other).__name__]
        raise _err(span_of(other, "()"), f"{fn}(): beside pipeline(...) a schedule holds directives of stages "
                   "(split, reorder, fuse, overlap, each_layer), which each virtual stage takes for its layers; "
                   f"a {fn} would reach no stage. Give it a schedule of its own (where the program runs whole)")


def _err(span: Span, msg: str) -> CompileError:
    return CompileError([Diagnostic(span, msg)])


def _directive(stmt: syntax.Stmt) -> Directive:
    if isinstance(stmt, syntax.Return):
        raise _err(stmt.span, "a schedule has no return statement")
    targets = stmt.targets if isinstance(stmt, syntax.Assign) else ()
    call = stmt.value
    if not isinstance(call, syntax.Call) or call.fn not in _ARITY:
        span = call.fn_span if isinstance(call, syntax.Call) else call.span
        raise _err(span, "a schedule holds directives: split, reorder, slice, fuse, overlap, pipeline, prefetch, "
                         "keep_gathered, each_layer")
    lo, hi = _ARITY[call.fn]
    if not lo <= len(targets) <= hi:
        want = f"{lo}" if lo == hi else f"{lo} to {hi}"
        raise _err(stmt.span, f"{call.fn} defines {want} names, not {len(targets)}")
    names = [_name(a, call) for a in call.args]
    kws = _keywords(call)
    outs = tuple(t.id for t in targets)
    where = _where(targets, call)
    keywords_only = _KEYWORDS_ONLY.get(call.fn)
    if keywords_only is not None:
        return keywords_only(call, names, kws, stmt.span, where)
    if call.fn == "split":
        _only(call, kws, {"dim"})
        return Split(_one(names, call), _int(kws.get("dim"), call, 0), outs[0], outs[1], stmt.span, where)
    _only(call, kws, {"chunks", "dim"} if call.fn == "overlap" else set())
    if not names:
        raise _err(call.span, f"{call.fn}() needs at least one stage name")
    if call.fn == "reorder":
        return Reorder(names[0], tuple(names[1:]), outs, stmt.span, where)
    if call.fn == "slice":
        return Slice(tuple(names), stmt.span, where)
    if call.fn == "fuse":
        return Fuse(tuple(names), outs[0] if outs else None, stmt.span, where)
    if len(names) != 2:
        raise _err(call.span, "overlap(producer, consumer, chunks=k) takes two stage names")
    if "chunks" not in kws:
        raise _err(call.span, "overlap() needs chunks=k")
    dim = _int(kws["dim"], call, 0) if "dim" in kws else None
    return OverlapD(names[0], names[1], _int(kws["chunks"], call, 1), dim, stmt.span, where)


def _keywords(call: syntax.Call) -> dict[str, syntax.Kwarg]:
    """CALL's keyword arguments by name; an error at one given twice."""
    kws: dict[str, syntax.Kwarg] = {}
    for k in call.kwargs:
        if k.name in kws:
            raise _err(k.span, f"{call.fn}() got '{k.name}' twice")
        kws[k.name] = k
    return kws


def _pipeline(call: syntax.Call, names: list[str], kws: dict[str, syntax.Kwarg], span: Span,
              where: tuple[tuple[str, Span], ...]) -> Pipeline:
    _only(call, kws, _PIPELINE)
    if len(names) > 1:
        raise _err(call.span, "pipeline() takes at most one name: the repeat whose layers it cuts")
    for need in ("stages", "microbatches"):
        if need not in kws:
            raise _err(call.span, f"pipeline() needs {need}=")
    order = "1f1b"
    if "order" in kws:
        v = kws["order"].value
        if not isinstance(v, syntax.String):
            raise _err(v.span, "pipeline()'s order is a string: " + ", ".join(f'"{o}"' for o in orders.ORDERS))
        order = v.text
    layers = None
    if "layers" in kws:
        v = kws["layers"].value
        if not (isinstance(v, syntax.ShapeArg) and all(isinstance(x, syntax.DimInt) for x in v.dims)):
            raise _err(v.span, "pipeline()'s layers is a list of integers, each virtual stage's layer count: "
                               "layers=[3, 1]")
        layers = tuple(int(x.value) for x in v.dims if isinstance(x, syntax.DimInt))
    chunks = _int(kws.get("chunks"), call, 1) if "chunks" in kws else orders.default_chunks(order)
    most = _int(kws["max_activations"], call, 1) if "max_activations" in kws else None
    return Pipeline(names[0] if names else None, _int(kws["stages"], call, 1), _int(kws["microbatches"], call, 1),
                    order, chunks, layers, most, span, where)


def _prefetch(call: syntax.Call, names: list[str], kws: dict[str, syntax.Kwarg], span: Span,
              where: tuple[tuple[str, Span], ...]) -> Prefetch:
    _only(call, kws, {"depth"})
    if names:
        raise _err(call.span, "prefetch() takes no stage names: prefetch(depth=d) starts every weight gather d "
                              "gathers ahead")
    return Prefetch(_int(kws.get("depth"), call, 1), span, where)


def _keep_gathered(call: syntax.Call, names: list[str], kws: dict[str, syntax.Kwarg], span: Span,
                   where: tuple[tuple[str, Span], ...]) -> KeepGathered:
    _only(call, kws, set())
    if names:
        raise _err(call.span, "keep_gathered() takes no names: it keeps every weight the forward gathers")
    return KeepGathered(span, where)


def _each_layer(call: syntax.Call, names: list[str], kws: dict[str, syntax.Kwarg], span: Span,
                where: tuple[tuple[str, Span], ...]) -> EachLayer:
    _only(call, kws, {"block_schedule"})
    if len(names) > 1:
        raise _err(call.span, "each_layer() takes at most one name: the repeat whose layers it schedules")
    v = kws["block_schedule"].value if "block_schedule" in kws else None
    if not isinstance(v, syntax.String):
        raise _err(v.span if v is not None else call.span,
                   'each_layer() needs block_schedule="s": the name of a schedule of the repeated block')
    return EachLayer(names[0] if names else None, v.text, span, where)


_KEYWORDS_ONLY: dict[str, Callable[..., Directive]] = {"pipeline": _pipeline, "prefetch": _prefetch,
                                                       "keep_gathered": _keep_gathered, "each_layer": _each_layer}


def _name(a: syntax.Expr, call: syntax.Call) -> str:
    if not isinstance(a, syntax.Name):
        raise _err(a.span, f"{call.fn}() takes stage or parameter names")
    return a.id


def _one(names: list[str], call: syntax.Call) -> str:
    if len(names) != 1:
        raise _err(call.span, f"{call.fn}() takes one stage name")
    return names[0]


def _only(call: syntax.Call, kws: dict, allowed: set[str]) -> None:
    for k, kw in kws.items():
        if k not in allowed:
            raise _err(kw.span, f"{call.fn}() has no argument '{k}'")


def _int(kw: syntax.Kwarg | None, call: syntax.Call, lowest: int) -> int:
    if kw is None:
        return lowest
    v = kw.value
    if not (isinstance(v, syntax.Number) and not v.is_float and int(v.value) >= lowest):
        raise _err(v.span, f"{call.fn}()'s {kw.name} must be an integer >= {lowest}")
    return int(v.value)


def text(d: Directive) -> str:
    """The directive as one line of a schedule block (what from_ast reads back)."""
    if isinstance(d, Split):
        dim = f", dim={d.dim}" if d.dim else ""
        return f"{d.rs}, {d.ag} = split({d.stage}{dim})"
    if isinstance(d, Reorder):
        outs = f"{', '.join(d.outs)} = " if d.outs else ""
        return f"{outs}reorder({', '.join((d.ag, *d.stages))})"
    if isinstance(d, Slice):
        return f"slice({', '.join(d.params)})"
    if isinstance(d, Fuse):
        name = f"{d.name} = " if d.name else ""
        return f"{name}fuse({', '.join(d.stages)})"
    if isinstance(d, Prefetch):
        return f"prefetch(depth={d.depth})"
    if isinstance(d, KeepGathered):
        return "keep_gathered()"
    if isinstance(d, EachLayer):
        return f'each_layer({d.repeat + ", " if d.repeat else ""}block_schedule="{d.schedule}")'
    if isinstance(d, Pipeline):
        args = [d.repeat] if d.repeat else []
        args += [f"stages={d.stages}", f"microbatches={d.microbatches}", f'order="{d.order}"']
        if d.chunks != orders.default_chunks(d.order):  # (written only where not the default)
            args.append(f"chunks={d.chunks}")
        if d.layers is not None:
            args.append(f"layers=[{', '.join(map(str, d.layers))}]")
        if d.max_activations is not None:
            args.append(f"max_activations={d.max_activations}")
        return f"pipeline({', '.join(args)})"
    dim = f", dim={d.dim}" if d.dim is not None else ""
    return f"overlap({d.producer}, {d.consumer}, chunks={d.chunks}{dim})"


def schedule_text(name: str, program: str, directives: tuple[Directive, ...] | list[Directive]) -> str:
    """A whole schedule block as .ccn text."""
    body = "".join(f"    {text(d)}\n" for d in directives)
    return f"schedule {name} for {program} {{\n{body}}}\n"
