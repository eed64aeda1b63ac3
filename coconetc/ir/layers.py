"""The layers of a repeat in a checked program (docs/language.md, "Repeating a program over
layers"): `y = repeat(block, x, ...)` inlines layer l's stages as `y__l<l>__<stage>` (its
per-layer parameters `y__l<l>__<param>` first), in order, and names the last layer's result `y`.
A pass that cuts a program between layers (a pipeline) reads the ranges here."""

from __future__ import annotations

import re

from coconetc.ir.nodes import Program


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
    """The names of p's repeats (`y = repeat(...)`: stages `y__l<k>__...`), in order."""
    found: dict[str, None] = {}
    for s in p.stages:
        m = re.fullmatch(r"(.+?)__l(\d+)__.+", s.name)
        if m:
            found.setdefault(m.group(1))
    return list(found)
