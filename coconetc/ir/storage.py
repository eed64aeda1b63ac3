"""The NumPy dtype that stores each language dtype (ml_dtypes gives NumPy bfloat16).

ml_dtypes is imported on the first look-up of "bf16" (importing it takes about half a second,
more than the rest of a warm `coconetc.load`), so a process that never touches a bf16 value
never pays for it."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np


def _bfloat16() -> np.dtype:
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)


class _Storage(Mapping[str, np.dtype]):
    """dtype name -> NumPy dtype; "bf16"'s is made on its first look-up."""

    _LAZY = {"bf16": _bfloat16}

    def __init__(self) -> None:
        self._known: dict[str, np.dtype] = {
            "f16": np.dtype(np.float16), "f32": np.dtype(np.float32), "f64": np.dtype(np.float64),
            "i32": np.dtype(np.int32), "i64": np.dtype(np.int64), "bool": np.dtype(bool)}
        self._order = ("f16", "bf16", "f32", "f64", "i32", "i64", "bool")

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


STORAGE: Mapping[str, np.dtype] = _Storage()
