"""The layers of a repeat in a checked program (docs/language.md, "Repeating a program over
layers"): `y = repeat(block, x, ...)` inlines layer l's stages as `y__l<l>__<stage>` (its
per-layer parameters `y__l<l>__<param>` first), in order, and names the last layer's result `y`.
A pass that cuts a program between layers (a pipeline) reads the ranges here."""

from __future__ import annotations

import re

from coconetc.ir.nodes import Program, Stage


def layer_of(stage: str, name: str) -> int | None:
    """The layer of repeat `name` that stage `stage` belongs to (None: none; the last layer's
    result, `name` itself, is reported as -1: the caller knows the count)."""
    if stage == name:
        return -1
    m = re.fullmatch(re.escape(name) + r"__l(\d+)__.+", stage)
    return int(m.group(1)) if m else None


def layer_ranges(p: Program, name: str) -> list[tuple[int, int]]:
    """For `name = repeat(...)` in p: each layer's stages as a range [start, stop) of indices
    into p.stages, layer 0 first. [] when p has no such repeat."""
    found: dict[int, list[int]] = {}
    last = None
    for i, s in enumerate(p.stages):
        k = layer_of(s.name, name)
        if k == -1:
            last = i
        elif k is not None:
            found.setdefault(k, []).append(i)
    if not found:
        return []
    layers = [found.get(k, []) for k in range(max(found) + 1)]
    if last is not None:
        layers[-1].append(last)
    return [(min(ix), max(ix) + 1) for ix in layers if ix]


def repeats(p: Program) -> list[str]:
    """The names of p's repeats (`y = repeat(...)`: stages `y__l<k>__...` and the result `y`),
    in order."""
    found: dict[str, None] = {}
    names = {s.name for s in p.stages}
    for s in p.stages:
        m = re.fullmatch(r"(.+?)__l(\d+)__.+", s.name)
        if m and m.group(1) in names:
            found.setdefault(m.group(1))
    return list(found)


def stray(p: Program, name: str) -> tuple[Stage, int] | None:
    """The first stage of p (and its layer) named like a stage of repeat `name`'s layers that is
    not one: a user's own `name__l<k>__<stage>` (a name every other layer lacks, or out of its
    layer's run of stages). None: none found. With one layer only a name out of the run shows."""
    found: dict[int, list[int]] = {}
    ends = []
    for i, s in enumerate(p.stages):
        k = layer_of(s.name, name)
        if k == -1:
            ends.append(i)
        elif k is not None:
            found.setdefault(k, []).append(i)
    if not found:
        return None
    gap = next((k for j, k in enumerate(sorted(found)) if k != j), None)
    if gap is not None:  # a layer number past the layers before it
        return p.stages[found[gap][0]], gap
    n = len(found)

    def own(k: int, i: int) -> str:
        return p.stages[i].name[len(f"{name}__l{k}__"):]
    names = [{own(k, i) for i in found.get(k, [])} for k in range(n)]
    common = set.intersection(*names[:-1]) if n > 1 else names[0]
    if n > 1 and len(names[-1]) >= len(common):  # the last layer's result is `name`, not name__l<k>__...
        return p.stages[max(found[n - 1])], n - 1
    for k in range(n):
        run = _longest_run(sorted(found.get(k, []) + (ends if k == n - 1 else [])))
        for i in found.get(k, []):
            if own(k, i) not in common or i not in run:
                return p.stages[i], k
    return None


def _longest_run(ix: list[int]) -> set[int]:
    """The longest run of consecutive integers in sorted IX."""
    best: list[int] = []
    cur: list[int] = []
    for i in ix:
        cur = cur + [i] if cur and i == cur[-1] + 1 else [i]
        if len(cur) > len(best):
            best = cur
    return set(best)
