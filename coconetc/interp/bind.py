"""Binding a call's arguments (one mapping per rank) to a program's parameters, with the
checks the compiled modules use (coconetc/ir/arguments.py): dtype, rank and layout, size
symbols, scattered segments. Errors name the parameter."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from coconetc.ir.storage import STORAGE
from coconetc.ir.arguments import bind_sizes, check_param, describe
from coconetc.ir.nodes import Param, Program


@dataclass
class Bound:
    ranks: int
    groups: int
    sizes: dict[str, int]
    segments: tuple[int, ...] | None
    env: list[dict[str, np.ndarray]]  # per rank: parameter -> storage array (scattered: joined)

    @property
    def group_size(self) -> int:
        return self.ranks // self.groups


def bind(p: Program, inputs: Sequence[Mapping[str, Any]], groups: int = 1) -> Bound:
    ranks = len(inputs)
    if ranks < 1 or groups < 1 or ranks % groups:
        raise ValueError(f"{ranks} ranks do not form {groups} equal groups")
    checked: list[dict[str, Any]] = [{} for _ in range(ranks)]
    for q in p.params:
        for r in range(ranks):
            if q.name not in inputs[r]:
                raise TypeError(f"{p.name}() missing argument '{q.name}' (rank {r})")
            checked[r][q.name] = check_param(q, inputs[r][q.name])
    sizes, segments = bind_sizes(p, [describe(p, c) for c in checked], groups)
    env = [{q.name: _storage(q, c[q.name]) for q in p.params} for c in checked]
    return Bound(ranks, groups, sizes, segments, env)


def _storage(q: Param, v: Any) -> np.ndarray:
    dt = STORAGE[q.type.dtype]
    if q.scalar:
        return np.array(v, dtype=dt)
    if isinstance(v, list):
        return np.concatenate(v) if v else np.zeros(0, dt)
    return v
