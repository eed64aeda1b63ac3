"""The language's partition of a sliced dimension among the ranks of a group."""

from __future__ import annotations

import numpy as np


def slice_range(n: int, parts: int, i: int) -> tuple[int, int]:
    """c = ceil(n / parts); part i holds [i*c, min((i+1)*c, n))."""
    c = -(-n // parts) if parts else 0
    return min(i * c, n), min((i + 1) * c, n)


def take_slice(a: np.ndarray, axis: int, n: int, parts: int, i: int) -> np.ndarray:
    b, e = slice_range(n, parts, i)
    index = [slice(None)] * a.ndim
    index[axis] = slice(b, e)
    return a[tuple(index)]
