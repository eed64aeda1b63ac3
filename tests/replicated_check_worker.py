"""COCONET_CHECK_REPLICATED on two ranks, run by tests/test_replicated_check.py as

    mpiexec -n 2 python tests/replicated_check_worker.py MODE BACKEND FILE

BACKEND cpu: coconetc.load(FILE) (adam.ccn); cuda: the CUDA module under the host emulation
(coconetc.runtime.cuda.load_emulated, sgd.ccn; NumPy arrays stand for device memory).

MODE on     (COCONET_CHECK_REPLICATED=1 in the job's environment): rank 1 passes a `w` that
            differs from rank 0's (by one bit of one element, then on a repeat of calls that
            agreed, the hot path's buffers): every rank raises a ValueError naming 'w' and
            rank 1 and no buffer changes; groups=2 (each rank its own group) runs; the same
            `w` everywhere runs.
MODE off    (the variable unset): the same wrong call runs, silently (the gap this mode is for).
MODE mixed  (set on rank 0 only): every call raises on every rank, saying where it is not set.

Each rank prints "RANK r: <check> ok" per check passed, then "RANK r: done"."""

from __future__ import annotations

import os
import sys

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
N = 11


def _args(backend: str, differ: bool) -> dict:
    """This rank's arguments: the same w, m, v on every rank (w on rank 1 one bit off when
    DIFFER), a gradient of its own."""
    rng = np.random.default_rng(7)
    w = rng.uniform(0.5, 1.5, N).astype(np.float32)
    if differ and rank == 1:
        w[N // 2] = np.nextafter(w[N // 2], np.float32(2))
    g = np.random.default_rng(rank).uniform(0.5, 1.5, N).astype(np.float32)
    if backend == "cuda":
        return dict(g=g, w=w, lr=0.01)
    m, v = (rng.uniform(0.5, 1.5, N).astype(np.float32) for _ in range(2))
    return dict(g=g, w=w, m=m, v=v, lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, step=3.0)


def _load(backend: str, file: str):
    if backend == "cuda":
        from coconetc.runtime.cuda import load_emulated
        return load_emulated(file, log=lambda msg: None).sgd
    import coconetc
    return coconetc.load(file, log=lambda msg: None).adam


def _raises(fn, args: dict, needles: list[str], **kw) -> None:
    """fn(**args) raises a ValueError naming every needle, and leaves every array as it was."""
    before = {k: v.copy() for k, v in args.items() if isinstance(v, np.ndarray)}
    try:
        fn(**args, **kw)
    except ValueError as err:
        missing = [n for n in needles if n not in str(err)]
        assert not missing, f"rank {rank}: {err!r} does not name {missing}"
        print(f"RANK {rank}: raised: {err}", flush=True)
    else:
        raise AssertionError(f"rank {rank}: no error (expected one naming {needles})")
    changed = [k for k in before if not np.array_equal(before[k], args[k])]
    assert not changed, f"rank {rank}: {changed} changed by a call that failed"


def mode_on(fn, backend: str) -> None:
    needles = ["'w' is replicated", "rank 1's value differs from rank 0's", "COCONET_CHECK_REPLICATED=1"]
    _raises(fn, _args(backend, differ=True), needles)
    print(f"RANK {rank}: differs ok", flush=True)
    good = _args(backend, differ=False)
    for _ in range(3):  # calls that agree, with the same buffers (the CPU hot path, when off)
        fn(**good)
    if backend == "cpu":
        assert all(f.hot is None for f in fn.recent.values()), "a hot path under the check"
    w = good["w"]
    saved = w[N // 2]
    if rank == 1:
        w[N // 2] = np.nextafter(saved, np.float32(2))  # the same buffer, its value changed
    _raises(fn, good, needles)
    w[N // 2] = saved
    print(f"RANK {rank}: repeated ok", flush=True)
    fn(**_args(backend, differ=True), groups=2)  # each rank its own group: nothing to compare
    print(f"RANK {rank}: groups ok", flush=True)
    fn(**good)
    print(f"RANK {rank}: same ok", flush=True)


def mode_off(fn, backend: str) -> None:
    args = _args(backend, differ=True)
    before = args["w"].copy()
    fn(**args)  # runs: without the check nothing compares the values of w
    assert not np.array_equal(args["w"], before)
    print(f"RANK {rank}: ran ok", flush=True)


def mode_mixed(fn, backend: str) -> None:
    for _ in range(2):
        _raises(fn, _args(backend, differ=False), ["COCONET_CHECK_REPLICATED is on (1) on rank 0",
                                                    "off on rank 1"])
    print(f"RANK {rank}: mixed ok", flush=True)


def main(argv: list[str]) -> int:
    mode, backend, file = argv
    if mode == "mixed":
        os.environ["COCONET_CHECK_REPLICATED"] = "1" if rank == 0 else "0"
    fn = _load(backend, file)
    {"on": mode_on, "off": mode_off, "mixed": mode_mixed}[mode](fn, backend)
    print(f"RANK {rank}: done", flush=True)
    return 0


if __name__ == "__main__":  # a failing rank stops the job
    from coconetc.jobs.abort import stop_job_on_failure
    sys.exit(stop_job_on_failure(lambda comm: main(sys.argv[1:]), "replicated_check_worker"))
