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


def expand(d: EachLayer, repeat: str, layers: int, block: str, result: str, directives: Any) -> list[Any]:
    """D's DIRECTIVES (schedule d.schedule of BLOCK, whose result is its stage RESULT) once per
    layer of REPEAT (LAYERS of them), renamed as the layer's stages are; each points at D."""
    out = []
    for d2 in directives:
        kind = type(d2).__name__
        if kind not in NAMED:
            word = WORD[kind]
            raise CompileError.at(d.at("block_schedule="), f"each_layer(): schedule {d.schedule} of {block} holds "
                                  f"{word}(...), which each_layer does not repeat (it holds split, reorder, fuse "
                                  "and overlap only); write it in this schedule, for the whole program")
    for layer in range(layers):
        last = layer == layers - 1

        def name(n: str, last: bool = last, layer: int = layer) -> str:
            return repeat if last and n == result else stage_name(repeat, n, layer)
        for d2 in directives:
            new = {}
            for f in NAMED[type(d2).__name__]:
                v = getattr(d2, f)
                new[f] = None if v is None else tuple(name(x) for x in v) if isinstance(v, tuple) else name(v)
            out.append(replace(d2, **new, span=d.span, where=(("()", d.at("()")),)))
    return out
