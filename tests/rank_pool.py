"""Ranks started once and given jobs: a pool of R MPI ranks per rank count in each pytest process,
each rank a long-lived Python (tests/pool_rank.py) that runs `python WORKER ARGS` jobs one after
the other as `runpy` runs a script, so NumPy, mpi4py, coconetc, torch and every module a job
loaded stay imported for the next job instead of being started again by another `mpiexec`.

    rc, out, err = rank_pool.run(2, [WORKER, "mode", "arg"], timeout=600)

The test process talks to the ranks over a Unix socket each (a job a JSON line in, `DONE rc` out);
an idle rank waits in a blocking read, so a pool costs no CPU between jobs. Each rank writes a
job's stdout and stderr (its file descriptors 1 and 2, so the compiled code's output too) to files
of its own, joined in rank order for the caller. A job runs in the caller's environment (as
it is when the job is sent, MPI's own variables kept), and the ranks' environment, sys.argv,
sys.path and working directory are restored after it.

A pool serves the callers whose COCONET_* variables are the ones it started with (the compiled
runtime reads some once); a test that sets one besides POOLED gets ranks of its own for each
job, started by an mpiexec of their own, as before pools. A job that fails on any
rank (an exception, a non-zero exit, a rank aborting the job, or the timeout) ends the pool, as
it ends an `mpiexec` job: no rank is left in a collective of a failed job, and the next job
starts a fresh pool. Tests of what mpiexec itself does keep their own launch."""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from coconetc.launch import mpiexec

RANK = Path(__file__).with_name("pool_rank.py")
START_TIMEOUT = 120.0


class PoolError(RuntimeError):
    pass


class Pool:
    def __init__(self, ranks: int):
        self.ranks = ranks
        self.dir = Path(tempfile.mkdtemp(prefix=f"ccn_pool{ranks}_"))
        self.jobs = 0
        path = str(self.dir / "s")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(ranks)
        self.listener.settimeout(START_TIMEOUT)
        self.log = open(self.dir / "pool.log", "w")
        self.env = environment(ranks)
        self.proc = subprocess.Popen(mpiexec.command(ranks, [sys.executable, str(RANK), path]),
                                     env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.conns: list[socket.socket | None] = [None] * ranks
        try:
            for _ in range(ranks):
                conn, _addr = self.listener.accept()
                r = int(conn.makefile("r").readline())
                self.conns[r] = conn
        except (OSError, ValueError) as err:
            self.close()
            raise PoolError(f"a pool of {ranks} ranks did not start: {err}\n{self._log()}") from err

    def _log(self) -> str:
        try:
            return (self.dir / "pool.log").read_text()[-4000:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, argv: list[str], timeout: float) -> tuple[int, str, str]:
        """ARGV (a script and its arguments) on every rank: (exit code, the ranks' stdout and
        their stderr, each joined in rank order). 124 after TIMEOUT seconds."""
        self.jobs += 1
        out = self.dir / f"job{self.jobs}"
        line = json.dumps({"argv": [str(a) for a in argv], "out": str(out), "cwd": os.getcwd(),
                           "env": environment(self.ranks, segments=False)}) + "\n"
        for c in self.conns:
            assert c is not None
            c.sendall(line.encode())
        rc = self._wait(timeout)
        if rc:  # a failed job ends the pool, as it ends an mpiexec job
            self.stop()
        stdout = "".join(_read(Path(f"{out}.rank{r}.out")) for r in range(self.ranks))
        stderr = "".join(_read(Path(f"{out}.rank{r}.err")) for r in range(self.ranks))
        if rc:
            stderr += self._log()
            self.close()
        for r in range(self.ranks):
            for ext in ("out", "err"):
                Path(f"{out}.rank{r}.{ext}").unlink(missing_ok=True)
        return rc, stdout, stderr

    def _wait(self, timeout: float) -> int:
        """Every rank's `DONE rc`: the first non-zero code, 1 for a rank gone (it aborted the
        job, or was killed) and 124 after TIMEOUT seconds."""
        codes: dict[int, int] = {}
        bufs = {r: b"" for r in range(self.ranks)}
        end = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            for r, c in enumerate(self.conns):
                sel.register(c, selectors.EVENT_READ, r)  # type: ignore[arg-type]
            while len(codes) < self.ranks:
                left = end - time.monotonic()
                if left <= 0:
                    return 124
                events = sel.select(timeout=min(left, 1.0))
                if not events and not self.alive():
                    return self.proc.returncode or 1
                for key, _ in events:
                    r = key.data
                    chunk = key.fileobj.recv(4096)  # type: ignore[union-attr]
                    bufs[r] += chunk
                    if not chunk or bufs[r].endswith(b"\n"):
                        codes[r] = int(bufs[r].split()[-1]) if chunk else 1
                        sel.unregister(key.fileobj)
        return next((c for c in codes.values() if c), 0)

    def stop(self) -> None:
        """The ranks ended (the files stay)."""
        for c in self.conns:
            if c is not None:
                try:
                    c.close()
                except OSError:
                    pass
        self.conns = [None] * self.ranks
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except OSError:
                    pass

    def close(self) -> None:
        """The ranks ended and the files removed."""
        self.stop()
        mpiexec.release(self.env)
        self.listener.close()
        self.log.close()
        for f in self.dir.iterdir():
            f.unlink(missing_ok=True)
        try:
            self.dir.rmdir()
        except OSError:
            pass


def _text(b: bytes | str | None) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else b or ""


def _read(p: Path) -> str:
    try:
        return p.read_text(errors="replace")
    except OSError:
        return ""


def environment(ranks: int, segments: bool = True) -> dict[str, str]:
    """The ranks' environment: mpiexec's, with waiting ranks yielding their core (the tests run
    two pytest workers, each starting ranks, on as many cores: always more ranks than cores; a
    rank spinning in MPI would slow the emulation's stream threads beside it). SEGMENTS: for a
    job of new ranks (mpiexec.environment)."""
    return {**mpiexec.environment(ranks, segments=segments), "OMPI_MCA_mpi_yield_when_idle": "1"}


def _own() -> tuple[tuple[str, str], ...]:
    """The variables of coconet's (COCONET_*) now: the compiled runtime reads some once, when a
    rank first needs them, so a pool serves only the callers whose variables are the ones it
    started with."""
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("COCONET_")))


# The variables a pool may be started with besides the session's: where modules are cached, and
# whether CUDA modules are the host emulation's. Any other (an injected fault, a timeout, a
# simulated node count) gets ranks of its own for each job, as a test that sets one expects a
# process in which nothing ran before.
POOLED = ("COCONET_CACHE", "COCONET_CUDA_EMULATE")
_BASE = {k: v for k, v in _own() if k not in POOLED}


_pools: dict[tuple[int, tuple[tuple[str, str], ...]], Pool] = {}


def run(ranks: int, argv: list[str], timeout: float = 600) -> tuple[int, str, str]:
    """`python ARGV` on the pool of RANKS ranks started in the caller's COCONET_* variables
    (started now if there is none, or if the last job ended it): (exit code, stdout, stderr)."""
    key = ranks, _own()
    if {k: v for k, v in key[1] if k not in POOLED} != _BASE:
        return fresh(ranks, argv, timeout)
    pool = _pools.get(key)
    if pool is None or not pool.alive() or None in pool.conns:
        if pool is not None:
            pool.close()
        try:
            pool = Pool(ranks)
        except PoolError as err:
            if LAUNCHER_FAILED not in str(err):
                raise
            pool = Pool(ranks)  # (the launcher failed to start: no rank ran)
        _pools[key] = pool
    rc, out, err = pool.run(argv, timeout)
    if rc:
        _pools.pop(key, None)
    return rc, out, err


# What Open MPI's launcher prints when its PMIx server could not start (now and then, on this
# machine, about once in a few hundred launches): no rank started, so the launch is tried again.
LAUNCHER_FAILED = "The PMIx server's listener thread failed to start"


def fresh(ranks: int, argv: list[str], timeout: float = 600, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """`python ARGV` on ranks of its own (an mpiexec of its own, ENV added to the environment they
    start in): (exit code, stdout, stderr); 124 after TIMEOUT seconds. A launcher that failed to
    start (LAUNCHER_FAILED) is started once more."""
    for attempt in (1, 2):
        job = {**environment(ranks), **(env or {})}
        try:
            res = subprocess.run(mpiexec.command(ranks, [sys.executable, *argv]), env=job, capture_output=True,
                                 text=True, stdin=subprocess.DEVNULL, timeout=timeout)
        except subprocess.TimeoutExpired as err:
            return 124, _text(err.stdout), _text(err.stderr)
        finally:
            mpiexec.release(job)
        if not (res.returncode and LAUNCHER_FAILED in res.stderr + res.stdout and attempt == 1):
            break
    return res.returncode, res.stdout, res.stderr


def completed(ranks: int, argv: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """run() as subprocess.run(..., capture_output=True, text=True) answers."""
    rc, out, err = run(ranks, argv, timeout)
    return subprocess.CompletedProcess([sys.executable, *argv], rc, out, err)


@atexit.register
def close_all() -> None:
    for p in _pools.values():
        p.close()
    _pools.clear()
