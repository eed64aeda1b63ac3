"""The interpreter's own math for collectives: combining one array per rank. Each
operation's NumPy function is in the registry (coconetc/ir/ops.py, coconetc/ir/reference.py)."""

from __future__ import annotations

import numpy as np

from coconetc.ir.reference import div

_COMBINE = {"sum": np.add, "avg": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}


def reduce_values(vals: list[np.ndarray], op: str) -> np.ndarray:
    """Combine one array per rank: sum, avg, prod, max, min (in rank order)."""
    fn = _COMBINE[op]
    acc = vals[0].copy()
    for v in vals[1:]:
        acc = fn(acc, v)
    if op == "avg":
        acc = div(acc, np.asarray(len(vals), dtype=acc.dtype))
    return acc
