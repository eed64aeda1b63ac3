"""What a tensor's size must fit: its element count and its byte count are int64 everywhere
(the generated code, NumPy, MPI counts are checked separately by the runtime)."""

from __future__ import annotations

import math
from collections.abc import Iterable

from coconetc.ir.dtypes import TABLE

INT64_MAX = 2**63 - 1
ITEMSIZE = {n: d.itemsize for n, d in TABLE.items()}


def too_big(dims: Iterable[int], dtype: str) -> str | None:
    """None if the elements and the bytes of a tensor of these dims fit int64; else why not."""
    dims = list(dims)
    for d in dims:
        if d > INT64_MAX:
            return f"dimension {d} does not fit int64"
    n = math.prod(dims)
    if n > INT64_MAX:
        return f"{n} elements do not fit int64"
    if n * ITEMSIZE.get(dtype, 8) > INT64_MAX:
        return f"{n} elements of {dtype} ({n * ITEMSIZE.get(dtype, 8)} bytes) do not fit int64"
    return None
