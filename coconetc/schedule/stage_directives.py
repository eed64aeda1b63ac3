"""The directives beside a `pipeline(...)` in its schedule (split, reorder, fuse, overlap, and
each_layer's, expanded), each given to the virtual stage whose stages it names: a pipelined
run cuts the program unscheduled into a program a virtual stage (schedule/pipeline.py
stage_program), and each runs under these directives of its own (sourcefile.with_grads), so a
stage's schedule is checked and proven on the stage's program as any schedule is. The
schedule of the model's derived program of the pipeline schedule's name goes to the stages'
derived programs the same way, each directive to the one that holds the values it names."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from coconetc.errors import CompileError
from coconetc.ir.nodes import Program
from coconetc.schedule.directives import span_of
from coconetc.schedule.each_layer import NAMED, WORD, names_of
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
        names = [n for n, _ in names_of(d)]
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


def stage_grad_directives(backs: list[Program], directives: Sequence[Any], program: str,
                          schedule: str) -> list[list[Any]]:
    """grad(PROGRAM)'s schedule SCHEDULE's DIRECTIVES for each of the stages' derived programs
    BACKS: each goes to the one that holds every value it names (those an earlier directive
    there defines count); an error at one that no one holds."""
    held = [{st.name for st in q.stages} | {x.name for x in q.params} for q in backs]
    out: list[list[Any]] = [[] for _ in backs]
    for x in directives:
        kind = type(x).__name__
        why = (f"{WORD[kind]}(): schedule {schedule} of {program} cuts it into pipeline stages, so "
               f"grad({program})'s schedule {schedule} schedules each stage's backward")
        if kind not in NAMED:
            raise CompileError.at(span_of(x, "()"), f"{why}, with directives of stages only (split, reorder, fuse, "
                                  f"overlap, each_layer): give the {WORD[kind]} a schedule of its own")
        names = names_of(x)
        reads = [n for n, defines in names if not defines]
        ks = [k for k, h in enumerate(held) if all(n in h for n in reads)]
        if len(ks) != 1:
            raise CompileError.at(span_of(x, "()"), f"{why}, and {'no' if not ks else 'more than one'} stage's "
                                  f"derived program holds all of {', '.join(reads) or 'its values'}: cut the layers "
                                  "so that one stage holds them (layers=[...]), or leave the directive out (`coconetc "
                                  f"show FILE -p {program} --grad` prints the derived program's names)")
        out[ks[0]].append(x)
        held[ks[0]] |= {n for n, defines in names if defines}
    return out
