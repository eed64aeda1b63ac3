"""The NumPy dtype that stores each language dtype (ml_dtypes gives NumPy bfloat16).

ml_dtypes is imported on the first look-up of "bf16" (importing it takes about half a second,
more than the rest of a warm `coconetc.load`), so a process that never touches a bf16 value
never pays for it."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from coconetc.ir.dtypes import TABLE


def _bfloat16() -> np.dtype:
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)


class _Storage(Mapping[str, np.dtype]):
    """dtype name -> NumPy dtype; "bf16"'s is made on its first look-up."""

    _LAZY = {"bf16": _bfloat16}

    def __init__(self) -> None:
        self._known: dict[str, np.dtype] = {n: np.dtype(d.numpy) for n, d in TABLE.items() if n not in self._LAZY}
        self._order = tuple(TABLE)

    def __getitem__(self, name: str) -> np.dtype:
        try:
            return self._known[name]
        except KeyError:
            if name not in self._LAZY:
                raise
        self._known[name] = dt = self._LAZY[name]()
        return dt

    def __contains__(self, name: object) -> bool:
        return name in self._order

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def name_of(self, dtype: np.dtype) -> str:
        """The language dtype NumPy's DTYPE stores (a KeyError if none), without making bf16's
        when DTYPE is not it (iterating items() would import ml_dtypes)."""
        for n, d in self._known.items():
            if d == dtype:
                return n
        for n in self._LAZY:
            if np.dtype(dtype).name == TABLE[n].numpy:
                return n
        raise KeyError(dtype)


STORAGE = _Storage()
