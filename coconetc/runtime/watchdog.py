"""coconet's watchdog, for every backend: a call whose ranks do not all arrive, or whose work
does not finish, within COCONET_TIMEOUT seconds (timeout.py: default 600; 0: no limit), or that
fails on one rank, ends on every rank, naming the ranks and the call, as NCCL's and PyTorch's
watchdogs do.

One class, `Watchdog`: the call running on one communicator (its number there, what it is, its
limit and deadline), watched where the call waits, and one way to end it. It watches two ways, by
what the communicator is:

- an MPI communicator (every call's entry exchanges, agree.py): `wait(req)` polls the request
  in the thread that waits on it, answering the others' "who is here?" meanwhile; past the
  deadline the rank asks every other rank where it is (point to point, answered from the others'
  polling loops), prints which ranks did not arrive and aborts the job (MPI_Abort). One is made
  for each call's exchanges: it holds no thread;
- an NCCL communicator (a CUDA module's calls, `guarded`): one for the communicator's life, whose
  thread polls for the peers' abort notices, asynchronous NCCL errors, a call past its deadline
  and work queued on the GPU that has not completed in time (events.py); a CUDA or NCCL error on
  one rank aborts the communicator on every rank (ncclCommAbort) and raises on each, naming the
  failing rank and the call."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from coconetc.runtime.events import Events
from coconetc.runtime.timeout import ENV_TIMEOUT, deadline, timeout_s

NcclComm = Any  # runtime/nccl.py's (which imports this file's users: named, not imported)
_TAG_WHO, _TAG_HERE = 31_001, 31_002  # only ever sent by a rank about to abort the job
_GRACE = 1.0  # seconds the timed-out rank waits for the others to say where they are


def wait(req, comm, call: int, what: str, limit: float, start: float) -> None:
    """Waits for REQ (an MPI request of call number `call` on comm) under the watchdog, the
    deadline `limit` seconds after `start` (a time.monotonic() taken at the call's entry)."""
    Watchdog(comm, what, limit, start, call).wait(req)


class Watchdog:
    """The watchdog of the calls on one communicator (module docstring). Made with the call
    it watches (an MPI communicator's exchanges: `what`, `limit` seconds from `start`, default
    now, 0 for none, `call` its number on the communicator), or with `ext`, the CUDA module of
    an NCCL communicator, for the communicator's life: then `begin` and `end` tell it each call,
    and its thread watches."""

    running = True  # a call is running (an NCCL communicator's watchdog: between begin and end)

    def __init__(self, comm, what: str = "", limit: float = 0.0, start: float | None = None,
                 call: int = 0, *, ext: Any = None):
        # positional arguments only on the MPI exchanges' path: a keyword costs ~0.1 us a call
        self.comm, self.n, self.what, self.limit = comm, call, what, limit
        self.deadline = deadline(limit, time.monotonic() if start is None else start)
        if ext is not None:
            self.running = False  # an NCCL communicator's watchdog waits for its first call
            self._start_thread(ext)

    # --- an MPI request, polled in the thread that waits on it ---------------------------------
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
            self.comm.isend((self.n, self.what), dest=st.Get_source(), tag=_TAG_HERE)

    def _expire(self) -> None:
        from mpi4py import MPI
        me, size = self.comm.Get_rank(), self.comm.Get_size()
        for r in range(size):
            if r != me:
                self.comm.isend(self.n, dest=r, tag=_TAG_WHO)
        where: dict[int, tuple[int, str]] = {me: (self.n, self.what)}
        st, end = MPI.Status(), time.monotonic() + _GRACE
        while time.monotonic() < end and len(where) < size:
            self._answer()
            if self.comm.Iprobe(MPI.ANY_SOURCE, _TAG_HERE, st):
                where[st.Get_source()] = self.comm.recv(source=st.Get_source(), tag=_TAG_HERE)
            else:
                time.sleep(1e-3)
        _abort(watchdog_message(me, size, self.n, self.what, self.limit, where))

    # --- an NCCL communicator's calls, watched by a thread -------------------------------------
    def _start_thread(self, ext: Any) -> None:
        """A daemon thread, from the communicator's first call until it is aborted, that polls
        for the peers' abort notices and for this rank's asynchronous NCCL error
        (ncclCommGetAsyncError, the module's coconet_nccl_async_error: on a GPU a call returns
        before its collectives run, so their errors surface after it), every 2 ms (MPI notices)
        or 20 ms (a store's) while a call runs and every 50 ms between calls, for a call still
        running on the host past its deadline, and for a call whose work on the GPU (kernels
        and collectives, queued when it returned) has not completed COCONET_TIMEOUT seconds
        after it (an event recorded on the call's stream, events.py: a collective that a peer
        never joins). What it hears aborts the communicator (and, if it is this rank's own, is
        sent to the peers first); the call running raises, or the next one."""
        import ctypes
        self.ext = ext
        self.heard: list[tuple[int, str]] = []
        self.last = ""  # the last call begun, named in an error heard between calls
        self.lock = threading.Lock()
        self.wake = threading.Event()
        fn = ctypes.CDLL(ext.__file__).coconet_nccl_async_error
        fn.argtypes, fn.restype = [ctypes.c_uint64, ctypes.c_char_p, ctypes.c_int], ctypes.c_int
        self._async_error, self._buf = fn, ctypes.create_string_buffer(512)
        self.events = Events(ext)
        self.stopped = False
        if not WATCHDOGS:  # stopped before MPI is finalized at exit (atexit runs in reverse)
            import atexit
            atexit.register(stop_watchdogs)
        self.thread = threading.Thread(target=self._run, name="coconet NCCL watchdog", daemon=True)
        self.thread.start()

    def begin(self, what: str, limit: float) -> None:
        """A call starts. The thread is not woken for it: a step on the GPU returns once its
        work is queued, and waking the thread at every call made it poll (MPI, NCCL, the
        events) during every step, holding the GIL and the lock against the caller; a call
        that blocks is polled every 2 ms once the thread's current wait (at most 50 ms) ends."""
        with self.lock:
            self.running, self.what, self.last, self.limit = True, what, what, limit
            self.deadline = deadline(limit, time.monotonic())

    def enqueued(self, stream: int) -> None:
        """The call's work is queued on `stream` (its cudaStream_t): an event recorded after it
        times it from now on (not waited for); what remains of the call on the host (the
        emulation's synchronization) has no deadline of its own."""
        with self.lock:
            if not self.running or not self.limit or self.comm.aborted is not None:
                return
            self.events.record(stream, self.what, time.monotonic() + self.limit, self.limit)
            self.deadline = None

    def end(self) -> None:
        with self.lock:
            self.running = False

    def own_error(self, what: str, err: BaseException) -> None:
        """This rank's call raised: the peers are told and the communicator aborted (unless a
        notice came first)."""
        with self.lock:
            if self.heard:
                return
            self.heard.append((self.comm.rank, str(err)))
            self.comm.notices.send(self.heard[0])
            abort_nccl(self.ext, self.comm, f"rank {self.comm.rank} failed in {what}")

    def _poll(self) -> tuple[int, str] | None:
        notice = self.comm.notices.poll()
        if notice is not None:
            return notice
        code = self._async_error(self.comm.handle, self._buf, len(self._buf))
        if code:
            when = f"in {self.what}" if self.running else f"after {self.last}"
            mine = (self.comm.rank, f"an asynchronous NCCL error {when}: {self._buf.value.decode(errors='replace')} "
                                    f"(ncclCommGetAsyncError: {code})")
        elif self.running and self.deadline is not None and time.monotonic() > self.deadline:
            mine = (self.comm.rank, f"the call did not finish in {timeout_s():g} s ({ENV_TIMEOUT})")
        elif (late := self.events.late(time.monotonic())) is not None:
            mine = (self.comm.rank, late)
        else:
            return None
        self.comm.notices.send(mine)
        return mine

    def _run(self) -> None:
        while self.comm.aborted is None and not self.stopped:
            busy = self.running
            self.wake.wait(0.05 if not busy else 0.002 if self.comm.mpi is not None else 0.02)
            self.wake.clear()
            with self.lock:
                if self.stopped:
                    return
                if self.heard or self.comm.aborted is not None:
                    break
                try:
                    notice = self._poll()
                except Exception:  # noqa: BLE001 - MPI or the store gone (the job is ending)
                    return
                if notice is None:
                    continue
                self.heard.append(notice)
                abort_nccl(self.ext, self.comm, f"rank {notice[0]} failed in {self.what}" if self.running
                            else f"rank {notice[0]} failed after {self.last}: {notice[1]}")
                break
        with self.lock:  # aborted: the events go (not at exit, where the process frees them)
            if not self.stopped:
                self.events.close()


def watchdog_message(me: int, size: int, call: int, what: str, limit: float,
                     where: dict[int, tuple[int, str]]) -> str:
    missing = [r for r in range(size) if r not in where]
    elsewhere = [f"rank {r} is in call #{c} ({w})" for r, (c, w) in sorted(where.items())
                 if (c, w) != (call, what)]
    here = sorted(r for r, cw in where.items() if cw == (call, what))
    text = (f"coconet watchdog: {what}, call #{call} on this communicator, rank {me}: "
            f"waited {limit:g} s ({ENV_TIMEOUT}) for every rank to enter the call; ")
    if missing:
        text += f"{ranks_text(missing)} did not arrive"
    else:  # every rank answered from a call: not all from this one (different calls, or out of step)
        text += "every rank is in a call of this communicator, but not all in this one"
    if elsewhere:
        text += "; " + "; ".join(elsewhere)
    return text + f" ({ranks_text(here)} {'did' if missing else 'in this one'}). Aborting the job."


def ranks_text(rs: list[int]) -> str:
    """'rank 1' or 'ranks 1, 3'."""
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


def _abort(message: str, code: int = 1) -> None:
    from mpi4py import MPI
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    MPI.COMM_WORLD.Abort(code)


def abort_nccl(ext: Any, comm: NcclComm, why: str) -> None:
    """ncclCommAbort on this rank's communicator (the module's coconet_nccl_comm_abort, through
    ctypes, so it runs while another thread is blocked in the module), once."""
    if comm.aborted is not None:
        return
    comm.aborted = why
    import ctypes
    lib = ctypes.CDLL(ext.__file__)
    lib.coconet_nccl_comm_abort.argtypes = [ctypes.c_uint64]
    lib.coconet_nccl_comm_abort(comm.handle)


WATCHDOGS: dict[int, Watchdog] = {}


def stop_watchdogs() -> None:
    for dog in list(WATCHDOGS.values()):
        dog.stopped = True
        dog.wake.set()
    for dog in list(WATCHDOGS.values()):
        dog.thread.join(1.0)


def refuse_aborted(comm: NcclComm, what: str) -> None:
    """An aborted communicator refuses every call at once, before any exchange with the peers
    (which may have stopped calling)."""
    if comm.aborted is not None:
        raise RuntimeError(f"{what}: the NCCL communicator was aborted ({comm.aborted}); make a new one")


def guarded(ext: Any, comm: NcclComm, what: str, body, stream: int = 0, sync: Any = None) -> Any:
    """body() (a call of the module on comm, queuing its work on `stream`, a cudaStream_t), then
    sync() if given (the emulation's synchronization), with the abort path: a CUDA or NCCL error on one
    rank aborts the NCCL communicator (ncclCommAbort) on every rank and raises on each, naming
    the failing rank and the call. The failing rank tells the others (a notice over a duplicate
    of the MPI communicator, or in the process group's store) and aborts its communicator; on
    every other rank the communicator's watchdog (Watchdog), polling for notices, aborts this
    rank's communicator, which ends the calls blocked on it (the emulation polls its NCCL waits;
    NCCL's own abort does that on a GPU); a call still running after COCONET_TIMEOUT seconds
    aborts the same way, naming this rank. An error NCCL reports asynchronously, after a call
    returned (a GPU call returns before its collectives run), is found by the same watchdog
    between calls and ends the job the same way: the next call raises, on every rank; so does
    work queued by body() that has not completed COCONET_TIMEOUT seconds after it returned (an
    event recorded on `stream` after body(), queried by the watchdog: a collective that some
    rank never joins, which NCCL's abort ends). An aborted communicator is unusable: later
    calls on it raise at once. One-rank communicators run body() (and sync()) as they are."""
    refuse_aborted(comm, what)
    if comm.notices is None or comm.size == 1:
        result = body()
        if sync is not None:
            sync()
        return result
    dog = WATCHDOGS.get(id(comm))
    if dog is None or dog.comm is not comm:
        dog = WATCHDOGS[id(comm)] = Watchdog(comm, ext=ext)
    dog.begin(what, timeout_s())
    failed: BaseException | None = None
    try:
        result = body()
        dog.enqueued(stream)
        if sync is not None:
            sync()
    except (RuntimeError, ValueError) as err:
        failed = err
    finally:
        dog.end()
    if failed is not None:
        dog.own_error(what, failed)
    if dog.heard:
        r, why = dog.heard[0]
        raise RuntimeError(f"{what}: rank {r} failed: {why}; the NCCL communicator was aborted "
                           f"(ncclCommAbort) on every rank (this is rank {comm.rank})") from failed
    return result
