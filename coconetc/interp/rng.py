"""Counter-based dropout RNG: Philox4x32-10, bit-identical to ``runtime_cpp/coconet/rng.h``.

Every dropout decision is a pure function of ``(seed, site_key, idx, p)``, so the reference
interpreter and the generated C++/CUDA kernels agree on each element's mask regardless of how
the tensor is partitioned across ranks or threads:

* counter = ``(idx & 0xffffffff, idx >> 32, site_key, 0)`` with ``idx`` the element's global flat
  index (uint64);
* key = ``(seed & 0xffffffff, (seed >> 32) & 0xffffffff)`` with ``seed`` an int64 reinterpreted as
  uint64 (negative seeds wrap);
* an element is kept iff ``(philox(counter, key)[0] >> 8) >= dropout_threshold(p)``.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from coconetc.ir.rng_keys import site_key

__all__ = ["philox4x32", "site_key", "dropout_threshold", "dropout_keep"]

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF
_ONE = 1 << 24  # threshold meaning "drop everything"
_CHUNK = 1 << 15  # elements per dropout_keep work chunk

ArrayLike = npt.ArrayLike
U32Array = npt.NDArray[np.uint32]


def _as_u64(x: ArrayLike) -> npt.NDArray[np.uint64]:
    """Convert to a uint64 array holding the low 32 bits of ``x`` (signed inputs wrap)."""
    a = np.asarray(x)
    if a.dtype.kind not in "iub":
        raise TypeError(f"philox4x32 expects integer inputs, got dtype {a.dtype}")
    return a.astype(np.uint64) & np.uint64(_MASK32)


def philox4x32(
    c0: ArrayLike, c1: ArrayLike, c2: ArrayLike, c3: ArrayLike, k0: ArrayLike, k1: ArrayLike
) -> tuple[U32Array, U32Array, U32Array, U32Array]:
    """Philox4x32-10 of counter ``(c0, c1, c2, c3)`` under key ``(k0, k1)``.

    All six arguments are integer scalars or arrays (only their low 32 bits are used) and are
    broadcast together; the four output words are uint32 arrays of the broadcast shape. The
    32x32->64 multiplies are done in uint64, so nothing ever overflows.
    """
    m0, m1 = np.uint64(PHILOX_M0), np.uint64(PHILOX_M1)
    mask, s32 = np.uint64(_MASK32), np.uint64(32)
    c = [_as_u64(v) for v in (c0, c1, c2, c3)]
    ka, kb = _as_u64(k0), _as_u64(k1)  # fresh arrays: safe to bump in place
    shape = np.broadcast_shapes(*(a.shape for a in c), ka.shape, kb.shape)
    x0, x1, x2, x3 = (np.broadcast_to(a, shape) for a in c)  # read-only; never written
    for r in range(PHILOX_ROUNDS):
        if r:
            ka += np.uint64(PHILOX_W0)
            ka &= mask
            kb += np.uint64(PHILOX_W1)
            kb &= mask
        p0 = x0 * m0  # < 2**64: both factors are < 2**32
        p1 = x2 * m1
        # new = (hi(p1) ^ x1 ^ ka, lo(p1), hi(p0) ^ x3 ^ kb, lo(p0))
        n0 = p1 >> s32
        n0 ^= x1
        n0 ^= ka
        n2 = p0 >> s32
        n2 ^= x3
        n2 ^= kb
        p1 &= mask
        p0 &= mask
        x0, x1, x2, x3 = n0, p1, n2, p0
    return (
        x0.astype(np.uint32),
        x1.astype(np.uint32),
        x2.astype(np.uint32),
        x3.astype(np.uint32),
    )


def dropout_threshold(p: float) -> int:
    """Integer drop threshold in ``[0, 2**24]``: ``floor(p * 2**24)`` (float64), clamped.

    ``p <= 0`` gives 0 (keep everything), ``p >= 1`` gives ``2**24`` (drop everything).
    NaN is rejected.
    """
    p = float(p)
    if math.isnan(p):
        raise ValueError("dropout probability is NaN")
    if p <= 0.0:
        return 0
    if p >= 1.0:
        return _ONE
    return math.floor(p * 16777216.0)


def dropout_keep(seed: int, site_key: int, idx: ArrayLike, p: float) -> npt.NDArray[np.bool_]:
    """Keep mask (True = keep) for the elements with global flat indices ``idx``.

    ``seed`` is an int64 (negative values wrap to uint64), ``site_key`` a uint32 (see
    :func:`site_key`), ``idx`` any integer array (treated as uint64); the result has the shape
    of ``idx``.
    """
    thr = dropout_threshold(p)
    ix = np.asarray(idx)
    if ix.dtype.kind not in "iub":
        raise TypeError(f"dropout indices must be integers, got dtype {ix.dtype}")
    if thr == 0:
        return np.ones(ix.shape, dtype=bool)
    if thr >= _ONE:
        return np.zeros(ix.shape, dtype=bool)
    flat = ix.astype(np.uint64).reshape(-1)
    s = int(seed) & _MASK64
    key, k0, k1 = int(site_key) & _MASK32, s & _MASK32, s >> 32
    keep = np.empty(flat.shape, dtype=bool)
    # Work in cache-sized chunks: the ~40 elementwise passes then stay out of main memory.
    for lo in range(0, flat.size, _CHUNK):
        part = flat[lo : lo + _CHUNK]
        out0, _, _, _ = philox4x32(part & np.uint64(_MASK32), part >> np.uint64(32), key, 0, k0, k1)
        np.greater_equal(out0 >> np.uint32(8), np.uint32(thr), out=keep[lo : lo + _CHUNK])
    return keep.reshape(ix.shape)
