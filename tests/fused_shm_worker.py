"""Run under mpiexec by tests/test_fused_shm.py: the zero and fused Adam schedules through the
shared-memory fused collective (input staged, or in place in coconetc.empty's window) give the
point-to-point path's results bit for bit (default and rs_c_ag, whose allreduce and allgathers
also go through the window, MPI's up to the order of the sum), on COMM_WORLD and on a split sub-communicator, for
sizes the ranks do not divide and sizes below the number of ranks. Prints "ok" on rank 0."""

from __future__ import annotations

import os
import sys

import numpy as np

import coconetc
from mpi4py import MPI


def step(fn, sched, comm, g, path):
    R, r, n = comm.Get_size(), comm.Get_rank(), len(g)
    c = -(-n // R)
    lo, hi = min(n, r * c), min(n, (r + 1) * c)
    base = np.random.default_rng(7)
    w = base.uniform(0.5, 1.5, n).astype(np.float32)
    m, v = (base.uniform(0.1, 1.0, n).astype(np.float32) for _ in range(2))
    if sched == "zero":
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
        for label, x in (("staged", g), ("empty", ge)):
            got = step(fn, sched, comm, x, "shm")
            for a, b, name in zip(want, got, "wmv"):
                assert np.array_equal(a, b), f"{sched} {label} n={n} R={comm.Get_size()}: {name} differs"
        assert np.array_equal(ge, g), "the input in the window was changed"
    for sched in ("default", "rs_c_ag"):  # allreduce, allgather through the window (or MPI)
        want = step(fn, sched, comm, g, "p2p")
        got = step(fn, sched, comm, g, "shm")
        for a, b, name in zip(want, got, "wmv"):  # MPI may sum in another order
            assert np.allclose(a, b, rtol=1e-5, atol=1e-6), f"{sched} n={n} R={comm.Get_size()}: {name} differs"


def main() -> int:
    fn = coconetc.load(sys.argv[1], log=lambda msg: None).adam
    world = MPI.COMM_WORLD
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
