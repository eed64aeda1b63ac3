"""Every call's entry: the ranks of the caller's communicator exchange what each was given
(a non-blocking allgather of fixed 1 KiB blocks, each holding a rank's description of a few
hundred bytes; a second round, an allgatherv, only when some description is longer) and check
that they agree, before any buffer is touched; a rank that does not arrive in time stops the
job (a watchdog).

Exchanged: this rank's error, or the call's description: the function, the schedule, groups,
the communicator's size, every scalar's bits (in the parameter's dtype) and every shape. Any
difference raises the same exception on every rank, naming the parameter and the ranks.

Watchdog: the exchange is polled against a deadline of COCONET_TIMEOUT seconds (default 600; 0
waits for ever). Past it, the rank asks every other rank whether it is waiting in the same call
(point-to-point, answered from the others' polling loops), prints which ranks did not arrive
and aborts the job (MPI_Abort), as NCCL's and PyTorch's watchdogs do."""

from __future__ import annotations

import os
import pickle
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

ENV_TIMEOUT = "COCONET_TIMEOUT"
DEFAULT_TIMEOUT = 600.0
_TAG_WHO, _TAG_HERE = 31_001, 31_002  # only ever sent by a rank about to abort the job
_GRACE = 1.0  # seconds the timed-out rank waits for the others to say where they are
_BLOCK = 1024  # bytes per rank in the exchange's first (usually only) round


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


class _Calls:
    """Per communicator: how many calls this rank has entered (for the watchdog's message)."""

    def __init__(self) -> None:
        self.n = 0


_KEYVAL: list[int] = []


def _calls(comm) -> _Calls:
    from mpi4py import MPI
    if not _KEYVAL:
        _KEYVAL.append(MPI.Comm.Create_keyval())
    got = comm.Get_attr(_KEYVAL[0])
    if got is None:
        got = _Calls()
        comm.Set_attr(_KEYVAL[0], got)
    return got


def exchange(comm, mine: Any, what: str, limit: float) -> list[Any]:
    """Every rank's `mine` (picklable), in rank order, or the job aborts after `limit` seconds
    (0: no limit)."""
    if comm.Get_size() == 1:
        return [mine]
    from mpi4py import MPI
    calls = _calls(comm)
    calls.n += 1
    w = _Watch(comm, calls.n, what, limit)
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


class _Watch:
    """Polls requests against one deadline; answers the others' "who is here?" meanwhile."""

    def __init__(self, comm, call: int, what: str, limit: float):
        self.comm, self.call, self.what, self.limit = comm, call, what, limit
        self.deadline = time.monotonic() + limit if limit > 0 else None

    def wait(self, req) -> None:
        if req.Test():
            return
        if self.deadline is None:
            req.Wait()
            return
        spins = 0
        while not req.Test():
            spins += 1
            if spins < 1000:  # the others are usually microseconds away: spin on Test
                continue
            self._answer()
            if time.monotonic() > self.deadline:
                self._expire()
            time.sleep(0 if spins < 1200 else 1e-4 if spins < 3000 else 1e-3)

    def _answer(self) -> None:
        from mpi4py import MPI
        st = MPI.Status()
        while self.comm.Iprobe(MPI.ANY_SOURCE, _TAG_WHO, st):
            self.comm.recv(source=st.Get_source(), tag=_TAG_WHO)
            self.comm.isend((self.call, self.what), dest=st.Get_source(), tag=_TAG_HERE)

    def _expire(self) -> None:
        from mpi4py import MPI
        me, size = self.comm.Get_rank(), self.comm.Get_size()
        for r in range(size):
            if r != me:
                self.comm.isend(self.call, dest=r, tag=_TAG_WHO)
        where: dict[int, tuple[int, str]] = {me: (self.call, self.what)}
        st, end = MPI.Status(), time.monotonic() + _GRACE
        while time.monotonic() < end and len(where) < size:
            self._answer()
            if self.comm.Iprobe(MPI.ANY_SOURCE, _TAG_HERE, st):
                where[st.Get_source()] = self.comm.recv(source=st.Get_source(), tag=_TAG_HERE)
            else:
                time.sleep(1e-3)
        _abort(watchdog_message(me, size, self.call, self.what, self.limit, where))


def watchdog_message(me: int, size: int, call: int, what: str, limit: float,
                     where: dict[int, tuple[int, str]]) -> str:
    missing = [r for r in range(size) if r not in where]
    elsewhere = [f"rank {r} is in call #{c} ({w})" for r, (c, w) in sorted(where.items())
                 if (c, w) != (call, what)]
    here = sorted(r for r, cw in where.items() if cw == (call, what))
    text = (f"coconet watchdog: {what}, call #{call} on this communicator, rank {me}: "
            f"waited {limit:g} s ({ENV_TIMEOUT}) for every rank to enter the call; "
            f"{_ranks(missing) if missing else 'no rank'} did not arrive")
    if elsewhere:
        text += "; " + "; ".join(elsewhere)
    return text + f" ({_ranks(here)} did). Aborting the job."


def _ranks(rs: list[int]) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


def _abort(message: str, code: int = 1) -> None:
    from mpi4py import MPI
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    MPI.COMM_WORLD.Abort(code)


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
    return "; ".join(f"{_ranks(rs)}: {shown[k]!r}" for k, rs in groups.items())
