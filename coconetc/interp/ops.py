"""NumPy definitions of the language's operations (the interpreter's math)."""

from __future__ import annotations

import math

import numpy as np

_erf = np.vectorize(math.erf, otypes=[np.float64])


def _gelu(x: np.ndarray) -> np.ndarray:
    """Exact GELU, x * Phi(x) (PyTorch's default, not the tanh approximation)."""
    return (0.5 * x * (1.0 + _erf(np.asarray(x, dtype=np.float64) / math.sqrt(2.0)))).astype(x.dtype)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Floats divide; integers divide truncating toward zero (as C does)."""
    if np.issubdtype(np.result_type(a, b), np.integer):
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.trunc(np.true_divide(a, b)).astype(np.result_type(a, b))
    return np.true_divide(a, b)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    one = x.dtype.type(1)
    return one / (one + np.exp(-x))


COMPARE_OPS = ("lt", "le", "gt", "ge", "eq", "ne")
POINTWISE_FNS = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": _div, "pow": np.power,
    "neg": np.negative, "min": np.minimum, "max": np.maximum,
    "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
    "eq": np.equal, "ne": np.not_equal, "where": np.where,
    "sqrt": np.sqrt, "rsqrt": lambda x: x.dtype.type(1) / np.sqrt(x), "exp": np.exp, "log": np.log,
    "abs": np.abs, "tanh": np.tanh, "sigmoid": _sigmoid, "relu": lambda x: np.maximum(x, x.dtype.type(0)),
    "gelu": _gelu, "cast": None, "dropout": None,
}


def reduce_values(vals: list[np.ndarray], op: str) -> np.ndarray:
    """Combine one array per rank: sum, avg, prod, max, min (in rank order)."""
    fn = {"sum": np.add, "avg": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}[op]
    acc = vals[0].copy()
    for v in vals[1:]:
        acc = fn(acc, v)
    if op == "avg":
        acc = _div(acc, np.asarray(len(vals), dtype=acc.dtype))
    return acc


def layernorm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = np.square(x - mean).mean(axis=-1, keepdims=True)
    return ((x - mean) / np.sqrt(var + x.dtype.type(eps)) * gamma + beta).astype(x.dtype)


def conv2d(x: np.ndarray, w: np.ndarray, stride: int, padding: int) -> np.ndarray:
    """NCHW x OIHW -> NOHW, cross-correlation as in PyTorch."""
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    ho = (h + 2 * padding - kh) // stride + 1
    wo = (wd + 2 * padding - kw) // stride + 1
    if min(n, o, ho, wo) <= 0 or c == 0:
        return np.zeros((n, o, max(ho, 0), max(wo, 0)), dtype=x.dtype)
    win = np.lib.stride_tricks.sliding_window_view(xp, (kh, kw), axis=(2, 3))
    win = win[:, :, ::stride, ::stride][:, :, :ho, :wo]  # n c ho wo kh kw
    return np.einsum("nchwij,ocij->nohw", win, w).astype(x.dtype)
