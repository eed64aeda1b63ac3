"""Run under mpiexec with COCONET_SIMULATE_NODES=K by tests/test_nodes.py: Adam's schedules on a
group over K simulated nodes run hierarchically (the module's _hier_runs counts every call whose
fused collective or all-reduce did) and give the flat point-to-point path's results
(COCONET_FUSED=p2p), up to the order of the sums, for sizes the ranks do not divide and below
the number of ranks; node_comm holds the simulated node's ranks.
Prints "OK nodes ..." (or "FAIL nodes: why") on rank 0."""

from __future__ import annotations

import os
import sys

import numpy as np

import coconetc
from coconetc.runtime.node_ranks import node_comm
from mpi4py import MPI

HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)


def step(fn, sched, comm, g, path):
    """Three calls of SCHED (COCONET_FUSED=PATH) from the same start: (w, m, v) after them."""
    R, r, n = comm.Get_size(), comm.Get_rank(), len(g)
    c = -(-n // R)
    lo, hi = min(n, r * c), min(n, (r + 1) * c)
    base = np.random.default_rng(7)
    w = base.uniform(0.5, 1.5, n).astype(np.float32)
    m, v = (base.uniform(0.1, 1.0, n).astype(np.float32) for _ in range(2))
    if sched == "zero":
        m, v = m[lo:hi].copy(), v[lo:hi].copy()
    os.environ["COCONET_FUSED"] = path
    for k in range(3):
        fn(schedule=sched, comm=comm, g=g.copy(), w=w, m=m, v=v, **HP, step=float(k + 1))
    del os.environ["COCONET_FUSED"]
    return w, m, v


def main() -> int:
    fn = coconetc.load(sys.argv[1], log=lambda msg: None).adam
    world = MPI.COMM_WORLD
    R, K = world.Get_size(), int(os.environ["COCONET_SIMULATE_NODES"])
    runs = fn.ext._hier_runs
    problems = []
    node = node_comm(world)
    if node.Get_size() != R // K:
        problems.append(f"node_comm has {node.Get_size()} ranks, want {R // K}")
    node.Free()
    for n in (4099, 3, 70001):
        g = np.random.default_rng(100 + world.Get_rank()).standard_normal(n).astype(np.float32)
        # default: the all-reduce (hierarchical from 16 KiB); zero, fused: the fused collective,
        # and fused's all-gathers of m and v (hierarchical from 16 KiB)
        big = 4 * n >= 1 << 14
        for sched, want in (("default", 3 if big else 0), ("zero", 3), ("fused", 3 + 6 * big)):
            flat = step(fn, sched, world, g, "p2p")
            before = runs()
            got = step(fn, sched, world, g, "")
            if runs() - before != want:
                problems.append(f"{sched} n={n}: {runs() - before} hierarchical calls, want {want}")
            for a, b, name in zip(flat, got, "wmv"):
                if not np.allclose(a, b, rtol=1e-5, atol=1e-6):
                    problems.append(f"{sched} n={n}: {name} differs by {np.abs(a - b).max()}")
    problems = [f"rank {r}: {p}" for r, mine in enumerate(world.allgather(problems)) for p in mine]
    if world.Get_rank() == 0:
        print(f"FAIL nodes: {'; '.join(problems)}" if problems else f"OK nodes R={R} K={K}")
    sys.stdout.flush()
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
