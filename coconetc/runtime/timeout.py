"""COCONET_TIMEOUT, the one home of the time a call may take (every watchdog reads it: watchdog.py):
seconds (default 600; 0: no limit) within which every rank must enter a call and its work finish."""

from __future__ import annotations

import os
from typing import Any

ENV_TIMEOUT = "COCONET_TIMEOUT"
DEFAULT_TIMEOUT = 600.0

_ENVIRON = getattr(os.environ, "_data", None)  # os.environ's own dict (POSIX: bytes keys)
_ENV_KEY = os.environ.encodekey(ENV_TIMEOUT) if hasattr(os.environ, "encodekey") else ENV_TIMEOUT


def timeout_raw() -> Any:
    """COCONET_TIMEOUT as set now, unparsed (cheap: a repeated call compares it with what it
    read when its checks ran, and runs the checks again when it changed)."""
    if _ENVIRON is not None:
        return _ENVIRON.get(_ENV_KEY)
    return os.environ.get(ENV_TIMEOUT)


def timeout_s() -> float:
    raw = os.environ.get(ENV_TIMEOUT, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        t = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_TIMEOUT}={raw!r}: expected seconds (0: no limit)") from None
    if t < 0 or t != t:
        raise ValueError(f"{ENV_TIMEOUT}={raw!r}: expected seconds >= 0 (0: no limit)")
    return t


def deadline(limit: float, start: float) -> float | None:
    """The time.monotonic() past which a call that began at START is late (None: no limit)."""
    return start + limit if limit > 0 else None
