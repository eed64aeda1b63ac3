"""The directives beside a `pipeline(...)` in its schedule (split, reorder, fuse, overlap, and
each_layer's, expanded), each given to the virtual stage whose stages it names: a pipelined
run cuts the program unscheduled into a program a virtual stage (schedule/pipeline.py
stage_program), and each runs under these directives of its own (sourcefile.with_grads), so a
stage's schedule is checked and proven on the stage's program as any schedule is."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from coconetc.errors import CompileError
from coconetc.ir.nodes import Program
from coconetc.schedule.directives import span_of
from coconetc.schedule.each_layer import NAMED, WORD
from coconetc.schedule.pipeline import Cut, Pipeline, stage_bounds


def stage_directives(p: Program, c: Cut, directives: Sequence[Any]) -> list[list[Any]]:
    """For each virtual stage of C (p cut by a pipeline directive of DIRECTIVES), the other
    DIRECTIVES that name its stages (those each defines count as its stage's); an error at one
    naming stages of two virtual stages. Run after DIRECTIVES were applied to p whole, so each
    names only p's stages or names an earlier directive defines."""
    owner: dict[str, int] = {}
    for k in range(len(c.layers)):
        lo, hi = stage_bounds(p, c, k)
        owner.update((st.name, k) for st in p.stages[lo:hi])
    out: list[list[Any]] = [[] for _ in c.layers]
    for d in directives:
        if isinstance(d, Pipeline):
            continue
        names = [n for f in NAMED[type(d).__name__] for n in _names(getattr(d, f))]
        known = {n: owner[n] for n in names if n in owner}
        ks = sorted(set(known.values()))
        if len(ks) > 1:
            a = next(n for n in names if known.get(n) == ks[0])
            b = next(n for n in names if known.get(n) == ks[1])
            raise CompileError.at(span_of(d, "()"), f"{WORD[type(d).__name__]}(): it "
                                  f"names {a} (virtual stage {ks[0]}) and {b} (virtual stage {ks[1]}); beside "
                                  "pipeline(...) a directive stays within the layers of one stage (cut the layers so that both are in "
                                  "one stage, with layers=[...], or leave the directive out)")
        k = ks[0] if ks else 0
        owner.update((n, k) for n in names if n not in owner)
        out[k].append(d)
    return out


def _names(v: Any) -> tuple[str, ...]:
    return () if v is None else v if isinstance(v, tuple) else (v,)
