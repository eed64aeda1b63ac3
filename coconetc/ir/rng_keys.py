"""The per-dropout-site word of the counter-based RNG (runtime_cpp/coconet/rng.h), shared by
the interpreter (coconetc/interp/rng.py) and the code generator."""

from __future__ import annotations

FNV1A_OFFSET = 0x811C9DC5
FNV1A_PRIME = 0x01000193
_MASK32 = 0xFFFFFFFF


def site_key(name: str) -> int:
    """32-bit FNV-1a hash of the UTF-8 bytes of ``name``: the per-dropout-site counter word."""
    h = FNV1A_OFFSET
    for byte in name.encode("utf-8"):
        h = ((h ^ byte) * FNV1A_PRIME) & _MASK32
    return h
