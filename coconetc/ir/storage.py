"""The NumPy dtype that stores each language dtype (ml_dtypes gives NumPy bfloat16)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

STORAGE = {"f16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16),
           "f32": np.dtype(np.float32), "f64": np.dtype(np.float64),
           "i32": np.dtype(np.int32), "i64": np.dtype(np.int64), "bool": np.dtype(bool)}
