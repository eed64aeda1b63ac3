"""A CUDA module's calls timed on the GPU, for the NCCL watchdog (runtime/watchdog.py: Watchdog).

On a GPU a call returns once its kernels and collectives are queued on its stream; a collective
that a peer never joins (a rank stuck, gone, or making other calls) then never completes, and
without this nothing would time it: the job would hang at the next synchronization. As
PyTorch's ProcessGroupNCCL does, an event is recorded on the call's stream after its work
(`cudaEventRecord`, never waited for) and the watchdog queries the oldest outstanding one
(`cudaEventQuery`): past the call's time (COCONET_TIMEOUT) it aborts the communicator. Events
come from a small pool: one whose work completed goes back to it, so a job makes as many as
its calls ever had outstanding at once. Through the module's exported C functions
(runtime_cpp/coconet/cuda/runtime.cuh: coconet_event_*), called with ctypes so that the
watchdog's thread can query while the caller's thread is inside the module."""

from __future__ import annotations

import ctypes
from collections import deque
from typing import Any, NamedTuple

from coconetc.runtime.timeout import ENV_TIMEOUT

_NOT_READY = 1  # coconet_event_query: cudaErrorNotReady


class Work(NamedTuple):
    """A call's work queued on a stream, up to its event."""

    event: int
    what: str  # the call, as errors name it
    deadline: float  # time.monotonic() past which it is late
    limit: float  # the seconds it was given


class Events:
    """The outstanding calls' events, oldest first, and the pool they are recycled into. Not
    thread-safe: the watchdog holds its lock around every use."""

    def __init__(self, ext: Any):
        lib = ctypes.CDLL(ext.__file__)
        self._create, self._record = lib.coconet_event_create, lib.coconet_event_record
        self._query, self._destroy = lib.coconet_event_query, lib.coconet_event_destroy
        self._create.argtypes, self._create.restype = [ctypes.POINTER(ctypes.c_int)], ctypes.c_uint64
        self._record.argtypes, self._record.restype = [ctypes.c_uint64, ctypes.c_uint64], ctypes.c_int
        self._query.argtypes = [ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        self._query.restype = ctypes.c_int
        self._destroy.argtypes, self._destroy.restype = [ctypes.c_uint64, ctypes.c_int], ctypes.c_int
        self._buf = ctypes.create_string_buffer(256)
        self._device = ctypes.c_int(0)  # the events' device (set by create, on the caller's thread)
        self.free: list[int] = []
        self.outstanding: deque[Work] = deque()
        self.made = 0  # events created (the pool's size, with those outstanding)

    def record(self, stream: int, what: str, deadline: float, limit: float) -> None:
        """An event after the work queued on `stream` so far (the call `what`'s)."""
        self.reap()
        event = self.free.pop() if self.free else self._new(what)
        code = self._record(event, stream)
        if code:
            self.free.append(event)
            raise RuntimeError(f"{what}: cudaEventRecord after the call's work failed (cudaError {code})")
        self.outstanding.append(Work(event, what, deadline, limit))

    def _new(self, what: str) -> int:
        event = self._create(ctypes.byref(self._device))
        if not event:
            raise RuntimeError(f"{what}: cudaEventCreate failed (the watchdog's event for the call)")
        self.made += 1
        return event

    def reap(self) -> None:
        """The events whose work completed back to the pool, from the oldest on (on the caller's
        thread: its current device is left alone)."""
        while self.outstanding and self._query(self.outstanding[0].event, -1, self._buf, len(self._buf)) == 0:
            self.free.append(self.outstanding.popleft().event)

    def late(self, now: float) -> str | None:
        """Why the oldest outstanding work failed, if it did: it is not complete past its
        deadline, or its event reports a CUDA error (a kernel that faulted); None otherwise.
        Completed work is recycled on the way. On the watchdog's thread."""
        while self.outstanding:
            work = self.outstanding[0]
            code = self._ask(work.event)
            if code == _NOT_READY:
                if now <= work.deadline:
                    return None
                return (f"the work of {work.what} (its kernels and NCCL collectives, queued on the call's "
                        f"stream) did not complete within {work.limit:g} s of the call ({ENV_TIMEOUT}): "
                        "a collective that some rank never joined (stuck, gone, or making other calls)")
            self.free.append(self.outstanding.popleft().event)
            if code:
                return (f"a CUDA error in the work of {work.what}: {self._buf.value.decode(errors='replace')} "
                        f"(cudaEventQuery: {code})")
        return None

    def _ask(self, event: int) -> int:
        """coconet_event_query, the events' device made current on this thread first (once)."""
        return self._query(event, self._device, self._buf, len(self._buf))

    def close(self) -> None:
        """On the watchdog's thread: every event destroyed (those not reached yet are released
        when their stream reaches them, as cudaEventDestroy does)."""
        for event in self.free + [w.event for w in self.outstanding]:
            self._destroy(event, self._device)
        self.free, self.outstanding = [], deque()
