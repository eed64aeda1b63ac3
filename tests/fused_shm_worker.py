"""Run under mpiexec by tests/test_fused_shm.py: the zero and fused Adam schedules through the
shared-memory fused collective (input staged, or in place in coconetc.empty's window, and the
gathered w in a window too, read there by the peers) give the
point-to-point path's results bit for bit (default and rs_c_ag, whose allreduce, reduce-scatter
and allgathers also go through the window, MPI's up to the order of the sum), on COMM_WORLD and on a split sub-communicator, for
sizes the ranks do not divide and sizes below the number of ranks. Prints "ok" on rank 0."""

from __future__ import annotations

import os
import sys

import numpy as np

import coconetc
from mpi4py import MPI


def step(fn, sched, comm, g, path, w_in_window=False):
    R, r, n = comm.Get_size(), comm.Get_rank(), len(g)
    c = -(-n // R)
    lo, hi = min(n, r * c), min(n, (r + 1) * c)
    base = np.random.default_rng(7)
    w = base.uniform(0.5, 1.5, n).astype(np.float32)
    if w_in_window:  # the gathered output in a window too: the peers read it in place
        we = coconetc.empty((n,), "f32", comm=comm)
        we[...] = w
        w = we
    m, v = (base.uniform(0.1, 1.0, n).astype(np.float32) for _ in range(2))
    if sched.partition("@")[0] == "zero":  # (a label may name the algorithm: zero@p2p)
        m, v = m[lo:hi].copy(), v[lo:hi].copy()
    os.environ["COCONET_FUSED"] = path
    for k in range(3):  # several calls: both parities of the window's regions
        fn(schedule=sched, comm=comm, g=g, w=w, m=m, v=v, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, step=float(k + 1))
    return w, m, v


def check(fn, comm, n):
    g = np.random.default_rng(100 + comm.Get_rank()).standard_normal(n).astype(np.float32)
    ge = coconetc.empty((n,), "f32", comm=comm)
    ge[...] = g
    for sched in ("zero", "fused"):
        want = step(fn, sched, comm, g, "p2p")
        for label, x, w_in in (("staged", g, False), ("empty", ge, False), ("g and w in empty", ge, True)):
            got = step(fn, sched, comm, x, "shm", w_in)
            for a, b, name in zip(want, got, "wmv"):
                assert np.array_equal(a, b), f"{sched} {label} n={n} R={comm.Get_size()}: {name} differs"
        assert np.array_equal(ge, g), "the input in the window was changed"
    for sched in ("default", "rs_c_ag"):  # allreduce, allgather through the window (or MPI)
        want = step(fn, sched, comm, g, "p2p")
        for label, x, w_in in (("staged", g, False), ("g and w in empty", ge, True)):
            gx = x.copy() if x is g else x  # default all-reduces g in place
            if x is ge:
                ge[...] = g
            got = step(fn, sched, comm, gx, "shm", w_in)
            for a, b, name in zip(want, got, "wmv"):  # MPI may sum in another order
                assert np.allclose(a, b, rtol=1e-5, atol=1e-6), f"{sched} {label} n={n} R={comm.Get_size()}: {name} differs"


def algorithms(fn, comm, n=70000):
    """A schedule label's fused-collective algorithm ("zero@p2p", "zero@shm") overrides
    COCONET_FUSED for that call: the same results bit for bit, and the window is used exactly
    when the label (or, for a plain label, COCONET_FUSED) says so (the module's _shm_runs)."""
    g = np.random.default_rng(300 + comm.Get_rank()).standard_normal(n).astype(np.float32)
    runs = fn.ext._shm_runs
    results = {}
    for env in ("p2p", "shm"):
        for label in ("zero", "zero@p2p", "zero@shm", "fused@p2p"):
            before = runs()
            results[env, label] = step(fn, label, comm, g, env)  # 3 calls, COCONET_FUSED=env
            windowed = runs() - before
            want = 0 if label.endswith("@p2p") or (label == "zero" and env == "p2p") else 3
            assert windowed == want, f"{label} with COCONET_FUSED={env}: {windowed} calls on the window, want {want}"
    # the plain collectives too: rs_c_ag's reduce-scatter and its three all-gathers, default's
    # all-reduce, each on the window (3 calls), none under @p2p
    for label, per_call in (("rs_c_ag", 4), ("rs_c_ag@p2p", 0), ("default", 1), ("default@p2p", 0)):
        before = runs()
        step(fn, label, comm, g.copy(), "shm")
        assert runs() - before == 3 * per_call, f"{label}: {runs() - before} collectives on the window, want {3 * per_call}"
    for key, got in results.items():
        ref = results["p2p", "fused@p2p" if key[1].startswith("fused") else "zero@p2p"]
        for a, b, name in zip(ref, got, "wmv"):
            assert np.array_equal(a, b), f"{key}: {name} differs"
    w = np.ones(n, np.float32)
    mine = fn.local_shape("m", schedule="zero", comm=comm, N=n)
    try:
        fn(schedule="zero@ring", comm=comm, g=g, w=w, m=np.ones(mine, np.float32), v=np.ones(mine, np.float32), lr=1.0, beta1=0.9,
           beta2=0.9, eps=1e-8, step=1.0)
    except ValueError as err:
        assert "unknown fused-collective algorithm 'ring'" in str(err), err
    else:
        raise AssertionError("zero@ring ran")
    assert np.all(w == 1), "w was changed by a call that was refused"


def main() -> int:
    fn = coconetc.load(sys.argv[1], log=lambda msg: None).adam
    world = MPI.COMM_WORLD
    algorithms(fn, world)
    for n in (1, 2, 5, 4099, 70000, 300001):
        check(fn, world, n)
    os.environ["COCONET_SHM_DOUBLE"] = "0"  # one region a call, fenced by barriers
    check(fn, world, 70000)
    del os.environ["COCONET_SHM_DOUBLE"]
    sub = world.Split(world.Get_rank() % 2, world.Get_rank())
    for n in (3, 4099):
        check(fn, sub, n)
    if world.Get_rank() == 0:
        print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
