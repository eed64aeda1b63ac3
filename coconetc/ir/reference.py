"""NumPy definitions of the operations' math: the reference semantics that the operation
registry (ops.py) points at and the interpreter runs. Plain functions of arrays (no ranks, no
RNG); what needs those lives in the interpreter."""

from __future__ import annotations

import math

import numpy as np

from coconetc.ir.storage import STORAGE  # the NumPy dtype that stores each language dtype

_erf = np.vectorize(math.erf, otypes=[np.float64])


def gelu(x: np.ndarray) -> np.ndarray:
    """Exact GELU, x * Phi(x) (PyTorch's default, not the tanh approximation)."""
    return (0.5 * x * (1.0 + _erf(np.asarray(x, dtype=np.float64) / math.sqrt(2.0)))).astype(x.dtype)


def div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Floats divide; integers divide truncating toward zero (as C does)."""
    if np.issubdtype(np.result_type(a, b), np.integer):
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.trunc(np.true_divide(a, b)).astype(np.result_type(a, b))
    return np.true_divide(a, b)


def sigmoid(x: np.ndarray) -> np.ndarray:
    one = x.dtype.type(1)
    return one / (one + np.exp(-x))


def rsqrt(x: np.ndarray) -> np.ndarray:
    return x.dtype.type(1) / np.sqrt(x)


def relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, x.dtype.type(0))


def cast(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round to the target dtype's storage (the interpreter then computes in its compute type)."""
    return np.asarray(x).astype(STORAGE[dtype])


def sum_partial(x: np.ndarray) -> np.float64:
    return np.sum(x, dtype=np.float64)


def sumsq_partial(x: np.ndarray) -> np.float64:
    return np.sum(np.square(x, dtype=np.float64))


def max_partial(x: np.ndarray) -> np.float64:
    """The largest element in float64, NaN if any is NaN; -inf when x is empty (a slice of no
    elements: the identity of max, NumPy's `initial`)."""
    return np.max(np.asarray(x, dtype=np.float64), initial=-np.inf)


def min_partial(x: np.ndarray) -> np.float64:
    """The smallest element (as max_partial; +inf when x is empty)."""
    return np.min(np.asarray(x, dtype=np.float64), initial=np.inf)


def layernorm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = np.square(x - mean).mean(axis=-1, keepdims=True)
    return ((x - mean) / np.sqrt(var + x.dtype.type(float(eps))) * gamma + beta).astype(x.dtype)


def softmax(x: np.ndarray) -> np.ndarray:
    """Over the last dim, the row's max subtracted first (numerically stable). -inf entries
    get 0; a row whose entries are all -inf (fully masked) is all zeros, as FlashAttention and
    xformers define it (torch.softmax gives NaN there)."""
    m = np.max(x, axis=-1, keepdims=True, initial=-np.inf)
    m = np.where(m == -np.inf, x.dtype.type(0), m)  # a fully masked row: exp(-inf) = 0 everywhere
    e = np.exp(x - m)
    s = np.sum(e, axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(s == 0, x.dtype.type(0), e / s).astype(x.dtype)  # NaN stays NaN


def transpose(x: np.ndarray, dim0: int, dim1: int) -> np.ndarray:
    return np.ascontiguousarray(np.swapaxes(x, dim0, dim1))


def index(x: np.ndarray, i: int) -> np.ndarray:
    """x[i] along dim 0 (dim 0 is never sliced, so a rank's part indexes as the whole does)."""
    return np.ascontiguousarray(x[i])


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
