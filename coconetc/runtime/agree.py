"""Every call's entry: the ranks of the caller's communicator exchange what each was given
(a non-blocking allgather of fixed 1 KiB blocks, each holding a rank's description of a few
hundred bytes; a second round, an allgatherv, only when some description is longer) and check
that they agree, before any buffer is touched; a rank that does not arrive in time stops the
job (a watchdog).

Exchanged: this rank's error, or the call's description: the function, the schedule, groups,
the communicator's size, every scalar's bits (in the parameter's dtype) and every shape. Any
difference raises the same exception on every rank, naming the parameter and the ranks.

The watchdog (watchdog.py: Watchdog; COCONET_TIMEOUT: timeout.py): the exchange is
polled against a deadline of COCONET_TIMEOUT seconds (default 600; 0 waits for ever). Past it,
the rank asks every other rank whether it is waiting in the same call, prints which ranks did
not arrive and aborts the job (MPI_Abort), as NCCL's and PyTorch's watchdogs do.

A call that repeats an agreed one (the same buffers; coconetc/runtime/fastpath.py) exchanges
less: a fixed 64-byte record (`Channel.agreed`: the digest of the description every rank gave
at the last full agreement, and the call's scalar bits), over a persistent allgather kept per
communicator; only when the records differ does the full exchange above follow, to say what
differs."""

from __future__ import annotations

import hashlib
import pickle
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from coconetc.runtime.timeout import DEFAULT_TIMEOUT as DEFAULT_TIMEOUT
from coconetc.runtime.timeout import ENV_TIMEOUT as ENV_TIMEOUT
from coconetc.runtime.timeout import timeout_raw as timeout_raw
from coconetc.runtime.timeout import timeout_s as timeout_s
from coconetc.runtime.watchdog import Watchdog, wait
from coconetc.runtime.watchdog import ranks_text as ranks_text

_BLOCK = 1024  # bytes per rank in the exchange's first (usually only) round


RECORD = 64  # bytes per rank of a repeated call's round: kind, configuration digest, scalars
_HEADER = 24  # the kind (8 bytes) and the configuration digest (16)
SCALAR_BYTES = RECORD - _HEADER
_FAST = (0x636F636F6E657401).to_bytes(8, "little")  # "a repeat of configuration G"
_FULL = (0x636F636F6E657402).to_bytes(8, "little")  # "this rank needs the full exchange"


class Channel:
    """Per communicator (created at this rank's first call on it, which is every rank's first:
    calls are collective): how many calls this rank has entered (for the watchdog's message)
    and the persistent allgather of the repeated calls' records (MPI_Allgather_init, or a
    non-blocking allgather where the MPI library has no persistent collectives)."""

    def __init__(self, comm) -> None:
        self.n = 0
        self.comm = comm
        self.size = comm.Get_size()
        self.send = bytearray(RECORD)
        self.recv = bytearray(RECORD * self.size)
        self.lock = threading.Lock()  # one call at a time uses the buffers
        self.req = None
        if self.size > 1:
            try:
                self.req = comm.Allgather_init(self.send, self.recv)
            except Exception:  # noqa: BLE001 - an MPI library (or mpi4py) without persistent collectives
                self.req = None

    def agreed(self, config: bytes | None, scalars: bytes, groups: int, what: str,
               limit: float, start: float) -> bool:
        """One round under the watchdog: True when every rank repeats the same agreed call
        (config: the digest of the last full agreement, 16 bytes; None: this rank needs the full
        exchange) with the same scalar bits in each group; False on every rank otherwise (then
        every rank goes on to the full exchange). Counts the call."""
        self.n += 1
        if self.size == 1:
            return config is not None
        if not self.lock.acquire(blocking=False):  # another thread is in a call on this comm
            return self._agreed_unshared(config, scalars, groups, what, limit, start)
        try:
            send = _record(self.send, config, scalars)
            if self.req is not None:
                self.req.Start()
                req = self.req
            else:
                req = self.comm.Iallgather(send, self.recv)
            if not req.Test():
                wait(req, self.comm, self.n, what, limit, start)
            return _uniform(self.recv, send, config is not None, self.size, groups)
        finally:
            self.lock.release()

    def _agreed_unshared(self, config, scalars, groups, what, limit, start) -> bool:
        send = _record(bytearray(RECORD), config, scalars)
        recv = bytearray(RECORD * self.size)
        req = self.comm.Iallgather(send, recv)
        if not req.Test():
            wait(req, self.comm, self.n, what, limit, start)
        return _uniform(recv, send, config is not None, self.size, groups)


def agreed_over(allgather: Callable[[bytearray], bytes], config: bytes | None, scalars: bytes, size: int,
                groups: int) -> bool:
    """Channel.agreed's round over another transport (a torch.distributed group): ALLGATHER
    takes this rank's record and returns every rank's, in rank order. Not counted, and not
    watched: the transport's own timeout applies."""
    if size == 1:
        return config is not None
    send = _record(bytearray(RECORD), config, scalars)
    return _uniform(bytearray(allgather(send)), send, config is not None, size, groups)


def _record(send: bytearray, config: bytes | None, scalars: bytes) -> bytearray:
    """SEND filled with this rank's record: _FULL, or _FAST, the configuration digest and the
    scalars' bits (zero-padded)."""
    if config is None:
        send[:8] = _FULL
    else:
        send[:8] = _FAST
        send[8:_HEADER] = config
        send[_HEADER:_HEADER + len(scalars)] = scalars
        send[_HEADER + len(scalars):] = bytes(SCALAR_BYTES - len(scalars))
    return send


def _uniform(recv: bytearray, mine: bytearray, fast: bool, size: int, groups: int) -> bool:
    """The same answer on every rank (a function of the gathered records alone, given that
    a rank's own record is among them): every record is a repeat of one configuration, with
    the same scalars within each group."""
    if not fast:
        return False
    if groups == 1 or size % groups:
        return recv == mine * size
    gs = size // groups
    head = bytes(recv[:_HEADER])
    if head[:8] != _FAST:
        return False
    for g in range(groups):
        first = recv[g * gs * RECORD:(g * gs + 1) * RECORD]
        if first[:_HEADER] != head or recv[g * gs * RECORD:(g + 1) * gs * RECORD] != first * gs:
            return False
    return True


def digest(value: Any) -> bytes:
    """16 bytes that name VALUE (built of str, int, bytes, tuples, lists, dicts) identically in
    every process: blake2b of its repr (Python's hash() is salted per process)."""
    return hashlib.blake2b(repr(value).encode(), digest_size=16).digest()


def scalar_record(bits: bytes) -> bytes:
    """The scalar part of a record: the bits themselves when they fit, else their digest."""
    if len(bits) <= SCALAR_BYTES:
        return bits
    return hashlib.blake2b(bits, digest_size=SCALAR_BYTES).digest()


_KEYVAL: list[int] = []


def channel(comm) -> Channel:
    """This communicator's Channel (created on this rank's first call on it)."""
    from mpi4py import MPI
    if not _KEYVAL:
        _KEYVAL.append(MPI.Comm.Create_keyval(delete_fn=_free_channel))
    got = comm.Get_attr(_KEYVAL[0])
    if got is None:
        got = Channel(comm)
        comm.Set_attr(_KEYVAL[0], got)
    return got


def _free_channel(comm, keyval, ch) -> None:
    req, ch.req = ch.req, None
    if req is not None:
        try:
            req.Free()
        except Exception:  # noqa: BLE001 - MPI already finalized: nothing left to free
            pass


def exchange(comm, mine: Any, what: str, limit: float, *, counted: bool = False) -> list[Any]:
    """Every rank's `mine` (picklable), in rank order, or the job aborts after `limit` seconds
    (0: no limit). counted: this call was already counted (Channel.agreed ran first)."""
    if comm.Get_size() == 1:
        return [mine]
    from mpi4py import MPI
    calls = channel(comm)
    if not counted:
        calls.n += 1
    w = Watchdog(comm, what, limit, None, calls.n)
    data = pickle.dumps(mine, protocol=pickle.HIGHEST_PROTOCOL)
    # one round in the usual case: fixed blocks of [length, the description if it fits]
    R = comm.Get_size()
    block = np.zeros(_BLOCK, np.uint8)
    block[:8] = np.frombuffer(np.int64(len(data)).tobytes(), np.uint8)
    if len(data) <= _BLOCK - 8:
        block[8:8 + len(data)] = np.frombuffer(data, np.uint8)
    blocks = np.empty((R, _BLOCK), np.uint8)
    w.wait(comm.Iallgather(block, blocks))
    sizes = [int(n) for n in blocks[:, :8].copy().view(np.int64)[:, 0]]
    if max(sizes) <= _BLOCK - 8:
        return [pickle.loads(blocks[r, 8:8 + c].tobytes()) for r, c in enumerate(sizes)]
    out = np.empty(sum(sizes), np.uint8)  # some description is longer: a second round for all
    displs = [sum(sizes[:r]) for r in range(len(sizes))]
    w.wait(comm.Iallgatherv(np.frombuffer(data, np.uint8), [out, sizes, displs, MPI.BYTE]))
    return [pickle.loads(out[d:d + c].tobytes()) for d, c in zip(displs, sizes)]


# --- the comparison, identical on every rank -----------------------------------------------
def differ(values: list[Any], key: Callable[[Any], Any] = lambda v: v,
           show: Callable[[Any], Any] = lambda v: v, first: int = 0) -> str | None:
    """None if every rank has the same value (by key); else 'rank 0: a; ranks 1, 2: b' (the
    ranks numbered from `first`)."""
    groups: dict[Any, list[int]] = {}
    shown: dict[Any, Any] = {}
    for r, v in enumerate(values):
        k = key(v)
        groups.setdefault(k, []).append(first + r)
        shown.setdefault(k, show(v))
    if len(groups) == 1:
        return None
    return "; ".join(f"{ranks_text(rs)}: {shown[k]!r}" for k, rs in groups.items())
