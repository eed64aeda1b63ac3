"""What a call tells the other ranks and how they check it, for every backend (the call's one
entry is entry.py): this rank's call described (the function, the schedule, groups, every
scalar's bits, every shape) and, once every rank's description has been exchanged (agree.py),
checked to agree and bound to the size symbols (`agreed`). Any error raises the same exception
on every rank before a buffer is touched.

COCONET_CHECK_REPLICATED=1 (a debug mode, off by default, as TORCH_DISTRIBUTED_DEBUG=DETAIL):
each description also carries a digest of every `replicated` tensor argument's bytes, and
ranks of a group whose digests differ raise on every rank, naming the parameter and the ranks
(the one home of that check, for the CPU module and the CUDA one alike)."""

from __future__ import annotations

import functools
import hashlib
import os
import struct
from typing import Any

import numpy as np

from coconetc.ir.arguments import bind_sizes, describe, is_torch
from coconetc.ir.dtypes import TABLE
from coconetc.ir.nodes import Program
from coconetc.ir.storage import STORAGE
from coconetc.runtime import agree

ERRORS = {"TypeError": TypeError, "ValueError": ValueError, "RuntimeError": RuntimeError}
HEAD = ("module", "function", "schedule", "groups", "communicator size")
PACK = {n: d.pack for n, d in TABLE.items() if d.pack}  # a scalar's bits
ENV_CHECK_REPLICATED = "COCONET_CHECK_REPLICATED"  # 1: compare replicated tensors' values across ranks
_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def check_groups(name: str, groups: Any) -> None:
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"{name}(): groups must be a positive integer, got {groups!r}")


def tensor_shapes(p: Program, values: dict) -> dict[str, Any]:
    """The tensors' shapes of checked arguments (a list of them for segments): what the ranks
    bind the size symbols from (the scalars travel as bits, scalar_bits)."""
    return {k: v for k, v in describe(p, values).items() if k not in scalar_names(p)}


def scalar_names(p: Program) -> frozenset[str]:
    return frozenset(q.name for q in p.params if q.scalar)


def torch_updates(p: Program, kwargs: dict, updated: set[str]) -> list[Any]:
    """The PyTorch tensors the call updates in place. Outside torch.no_grad() one that requires
    grad is refused, as PyTorch refuses an in-place operation on a leaf that requires grad;
    under no_grad their version counters are bumped after the call (as torch.optim does)."""
    found = []
    for q in p.params:
        if q.name not in updated:
            continue
        v = kwargs[q.name]
        found += [t for t in (v if isinstance(v, (list, tuple)) else [v]) if is_torch(t)]
    if not found:
        return []
    import torch
    for t in found:
        if t.requires_grad and torch.is_grad_enabled():
            name = next(q.name for q in p.params if q.name in updated and _holds(kwargs[q.name], t))
            kind = "a leaf Variable" if t.is_leaf else "a tensor"
            raise RuntimeError(f"'{name}': {kind} that requires grad is being used in an in-place "
                               f"operation ({p.name} updates '{name}' in place); call it under "
                               "torch.no_grad(), as optimizers do")
    return found


def _holds(v: Any, t: Any) -> bool:
    return v is t or (isinstance(v, (list, tuple)) and any(x is t for x in v))


def _bits(dtype: str, v: int | float) -> bytes:
    fmt = PACK.get(dtype)
    if fmt is not None:
        try:
            return struct.pack(fmt, v)
        except (OverflowError, struct.error):  # beyond the dtype's range: as NumPy rounds it
            pass
    return np.asarray(v, STORAGE[dtype]).tobytes()


def scalar_bits(p: Program, values: dict) -> tuple[tuple[str, Any, bytes], ...]:
    """Each scalar's name, value and bits in the parameter's dtype (what the ranks compare)."""
    return tuple((q.name, values[q.name], _bits(q.type.dtype, values[q.name]))
                 for q in p.params if q.scalar)


def description(head: tuple, p: Program, values: dict, shapes: dict) -> tuple:
    """What this rank tells the others of its call: (head, the scalars' bits, the shapes), and
    under COCONET_CHECK_REPLICATED the digests of its replicated tensors as a fourth item (so
    that, with the check off, the record exchanged is what it always was)."""
    desc = (head, scalar_bits(p, values), shapes)
    return desc + (replicated_digests(p, values),) if check_replicated() else desc


@functools.cache
def check_replicated() -> bool:
    """COCONET_CHECK_REPLICATED, read once per process (at its first call), as NCCL_DEBUG is
    read at initialization: so the hot path (fastpath.py), which is never taken with the check
    on, needs no look at the environment to know it is still off."""
    raw = os.environ.get(ENV_CHECK_REPLICATED, "").strip().lower()
    if raw in _OFF:
        return False
    if raw in _ON:
        return True
    raise ValueError(f"{ENV_CHECK_REPLICATED}={raw!r}: expected 1 (check that every replicated "
                     "tensor argument is the same on every rank of a group) or 0")


def replicated_digests(p: Program, values: dict) -> tuple[tuple[str, bytes], ...]:
    """(name, digest) of every `replicated` tensor argument, in parameter order."""
    return tuple((q.name, value_digest(values[q.name])) for q in p.params
                 if not q.scalar and q.type.layout.kind == "replicated")


def value_digest(v: Any) -> bytes:
    """16 bytes of blake2b over the bytes of V (a NumPy array, a CUDA tensor, or a list of
    segments: their bytes in order; the segment sizes are compared with the shapes). blake2b
    runs at about 1 GB/s per core here, as fast as sha1/sha256 and within 2x of zlib.crc32,
    and a 128-bit digest makes two different values that look equal a 2^-128 chance, where a
    32-bit CRC would miss one in 4 billion: the cost of a debug mode, for a check that can be
    trusted. The comparison is bitwise (-0.0 differs from 0.0, as NaN payloads do)."""
    h = hashlib.blake2b(digest_size=16)
    for part in v if isinstance(v, list) else [v]:
        h.update(_host_bytes(part).data)
    return h.digest()


def _host_bytes(v: Any) -> np.ndarray:
    """V's bytes in host memory: a view of a (C-contiguous) NumPy array; a torch tensor
    (the CUDA module) copied to the host once the device's queued work is done, so that the
    digest is of the value the call will read (a debug mode: the synchronization is its cost)."""
    if isinstance(v, np.ndarray):
        return v.reshape(-1).view(np.uint8)
    import torch
    if v.is_cuda:
        torch.cuda.synchronize(v.device)
    return v.detach().reshape(-1).view(torch.uint8).cpu().numpy()


# --- what every rank was given ---------------------------------------------------------------
def agreed(everyone: list, rank: int, p: Program | None, mine: tuple, cache: list):
    """Raises (the same on every rank) unless every rank's call is well-formed and agrees;
    returns (the size symbols, the segment sizes). `cache` holds the last call's shapes and
    what they bound (a training loop calls with the same shapes again and again)."""
    if mine[0] == "error":
        raise ERRORS[mine[1]](mine[2])
    for r, item in enumerate(everyone):
        if item[0] == "error":
            raise ValueError(f"rank {r} was given bad arguments: {item[2]}")
    assert p is not None  # this rank's own error was raised above
    descs = [item[1] for item in everyone]
    first = descs[0][:2]
    if any(d[:2] != first for d in descs):  # rare: find what differs, to say so
        _disagreement(descs, rank, p)
    shapes = [d[2] for d in descs]
    groups = first[0][3]
    if cache and cache[0] is p and cache[1] == groups and cache[2] == shapes:
        bound = cache[3]
    else:
        bound = bind_sizes(p, shapes, groups)
        cache[:] = [p, groups, shapes, bound]
    if len(descs[rank]) > 3 or any(len(d) > 3 for d in descs):  # COCONET_CHECK_REPLICATED
        _replicated_differ(descs, p, groups)
    return bound


def _replicated_differ(descs: list, p: Program, groups: int) -> None:
    """Raises (the same on every rank) unless every rank checks the replicated values and
    their digests agree within each group (shapes agreed already). Against the most common
    digest of the group (the lowest rank's among equals), so that one odd rank is the one named."""
    off = [r for r, d in enumerate(descs) if len(d) <= 3]
    if off:
        on = [r for r, d in enumerate(descs) if len(d) > 3]
        raise ValueError(f"{p.name}(): {ENV_CHECK_REPLICATED} is on (1) on {agree.ranks_text(on)} "
                         f"but off on {agree.ranks_text(off)}: set it the same on every rank")
    gs = len(descs) // groups
    for i, (name, _) in enumerate(descs[0][3]):
        for g in range(0, len(descs), gs):
            digests = [d[3][i][1] for d in descs[g:g + gs]]
            ref = max(digests, key=digests.count)  # the first among the most common
            bad = [g + r for r, x in enumerate(digests) if x != ref]
            if bad:
                whose = f"{agree.ranks_text(bad)}'s value differs" if len(bad) == 1 else \
                    f"the values of {agree.ranks_text(bad)} differ"
                raise ValueError(f"{p.name}(): '{name}' is replicated but {whose} from rank "
                                 f"{g + digests.index(ref)}'s ({ENV_CHECK_REPLICATED}=1): a "
                                 "replicated parameter must hold the same value (bitwise) on "
                                 "every rank of a group")


def _disagreement(descs: list, rank: int, p: Program) -> None:
    for k, label in enumerate(HEAD):
        bad = agree.differ([d[0][k] for d in descs])
        if bad:
            raise ValueError(f"{p.name}(): the ranks disagree on the {label}: {bad}")
    groups = descs[rank][0][3]
    gs = len(descs) // groups if len(descs) % groups == 0 else len(descs)
    for i, (name, _, _) in enumerate(descs[rank][1]):
        for g in range(0, len(descs), gs):
            bad = agree.differ([d[1][i] for d in descs[g:g + gs]], key=lambda nvb: nvb[2],
                               show=lambda nvb: nvb[1], first=g)
            if bad:
                raise ValueError(f"{p.name}(): scalar '{name}' differs between ranks ({bad}); "
                                 "a scalar must be the same on every rank of a group")
