"""`each_layer([y, ]block_schedule="s")`: a repeated block's schedule applied to every layer of a
repeat (`y = repeat(block, x, ...)`, docs/language.md, "Repeating a program over layers").

    schedule pp for gpt {
        each_layer(block_schedule="overlapped")
        pipeline(stages=2, microbatches=4)
    }

It stands for the block's schedule `s` written out once per layer, each directive's names
renamed as `repeat` names the layer's stages (`y__l<l>__<name>`; the block's result in the
last layer: `y`), the names the directives define too. Those directives are then checked and
applied as if written by hand, so the schedule is proven equal to the program the same way;
an error in one points at this directive. The block's schedule holds stage directives only
(split, reorder, fuse, overlap): what slices the model's parameters, prefetches its weights or
cuts it into a pipeline is written in the model's schedule itself. Beside a `pipeline(...)`,
each virtual stage runs its layers' directives (schedule/stage_directives.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from coconetc.errors import CompileError, Span
from coconetc.frontend.calls import stage_name


@dataclass(frozen=True)
class EachLayer:
    """each_layer([repeat, ]block_schedule="s")"""

    repeat: str | None
    schedule: str
    span: Span = field(compare=False)
    where: tuple[tuple[str, Span], ...] = field(default=(), compare=False, repr=False)

    def at(self, key: str) -> Span:
        return dict(self.where).get(key) or self.span


# per directive kind (by class name): its fields that hold names of stages, one or a tuple
NAMED = {"Split": ("stage", "rs", "ag"), "Reorder": ("ag", "stages", "outs"), "Fuse": ("stages", "name"),
          "OverlapD": ("producer", "consumer")}
# each directive kind's word in a schedule, by class name
WORD = {"Split": "split", "Reorder": "reorder", "Slice": "slice", "Fuse": "fuse", "OverlapD": "overlap",
        "Pipeline": "pipeline", "Prefetch": "prefetch", "KeepGathered": "keep_gathered", "EachLayer": "each_layer"}


@dataclass(frozen=True)
class Layers:
    """What renames a block's names into a layer's: `REPEAT = repeat(block, SOURCE, ...)` over
    LAYERS layers, the block returning its stage RESULT and carrying its parameter CARRIED
    (layer l's is layer l-1's result; layer 0's the model's SOURCE)."""

    repeat: str
    layers: int
    result: str
    carried: str
    source: str | None

    def name(self, n: str, layer: int) -> str:
        """The block's stage or parameter N in LAYER."""
        if n == self.carried:
            return (self.source or n) if layer == 0 else stage_name(self.repeat, self.result, layer - 1)
        return self.repeat if layer == self.layers - 1 and n == self.result else stage_name(self.repeat, n, layer)


def expand(d: EachLayer, at: Layers, block: str, directives: Any, forward: frozenset[str] | None = None) -> list[Any]:
    """D's DIRECTIVES (schedule d.schedule of BLOCK) once per layer of AT, renamed as the
    layer's stages are; each points at D. FORWARD: for a schedule of the block's derived
    program, the block's own names (its parameters and stages), which the derived program's
    names are made of (derived_name)."""
    out = []
    for d2 in directives:
        kind = type(d2).__name__
        if kind not in NAMED:
            word = WORD[kind]
            raise CompileError.at(d.at("block_schedule="), f"each_layer(): schedule {d.schedule} of {block} holds "
                                  f"{word}(...), which each_layer does not repeat (it holds split, reorder, fuse "
                                  "and overlap only); write it in this schedule, for the whole program")
    if forward is not None:
        _numbered(d, block, directives, forward)
    for layer in range(at.layers):
        def name(n: str, layer: int = layer) -> str:
            if forward is not None:
                return derived_name(n, forward, lambda m: at.name(m, layer))
            return at.name(n, layer)
        for d2 in directives:
            new = {}
            for f in NAMED[type(d2).__name__]:
                val = getattr(d2, f)
                new[f] = None if val is None else tuple(name(x) for x in val) if isinstance(val, tuple) else name(val)
            out.append(replace(d2, **new, span=d.span, where=(("()", d.at("()")),)))
    return out


# the fields of NAMED that hold names a directive defines
DEFINES = {"Split": ("rs", "ag"), "Reorder": ("outs",), "Fuse": ("name",), "OverlapD": ()}


def names_of(d: Any) -> list[tuple[str, bool]]:
    """The names a stage directive D (a kind of NAMED) holds, each with whether D defines it."""
    kind = type(d).__name__
    out = []
    for f in NAMED[kind]:
        v = getattr(d, f)
        out += [(n, f in DEFINES[kind]) for n in (() if v is None else v if isinstance(v, tuple) else (v,))]
    return out


def _numbered(d: EachLayer, block: str, directives: Any, forward: frozenset[str]) -> None:
    """An error at D for a name of the derived program's that is made of none of the block's
    FORWARD names (and no directive before defines): a value the derivation numbers
    (`g_allgather2`), whose number differs in each layer of a model."""
    defined: set[str] = set()
    for d2 in directives:
        for n, defines in names_of(d2):
            if defines:
                defined.add(n)
            elif n not in defined and n not in forward and _made_of(n, forward) is None:
                raise CompileError.at(d.at("block_schedule="), f"each_layer(): grad({block})'s schedule "
                                      f"'{d.schedule}' names {n}, a value the derivation numbers rather than "
                                      f"names after one of {block}'s, which is numbered otherwise in each layer "
                                      "of the model: write those directives for the model's derived program by "
                                      "hand (`coconetc show FILE -p MODEL --grad` prints its names)")


def derived_name(n: str, forward: frozenset[str], rename: Any) -> str:
    """The name in a model's derived program of N, a name of its block's derived program, where
    RENAME gives a block's name's in the layer: the derivation names a value's cotangent
    `g_<value><suffix>` and a parameter's gradient `d_<param>`, in the model `g_<layer's name>`
    (a layer's weight is its stage `y__l<l>__<w>`); the longest of the block's FORWARD names
    that N is made of is renamed. Other names (a schedule's own) as a layer's stages."""
    f = _made_of(n, forward)
    return rename(n) if f is None else "g_" + rename(f) + n[2 + len(f):]


def _made_of(n: str, forward: frozenset[str]) -> str | None:
    """The longest of FORWARD that N (`g_<f><suffix>` or `d_<f>`) is the cotangent of; None."""
    if not n.startswith(("g_", "d_")):
        return None
    rest = n[2:]
    made = [f for f in forward if rest == f or rest.startswith(f + "_") or (rest.startswith(f) and rest[len(f):].isdigit())]
    return max(made, key=len) if made else None
