"""One data-parallel Adam step (f32, N elements, all-reduced gradient), side by side in one run:

  * baseline: mpi4py Allreduce of the gradient + torch.optim.Adam(fused=True) on the full tensor
  * coconet examples/adam.ccn compiled for the CPU: default, rs_c_ag, zero, fused schedules
  * the memory roofline of the zero schedule (its memory traffic / copy bandwidth, measured here)

Run: python bench/adam_step.py [--n 4194304] [--ranks 2] [--reps 10]
It relaunches itself under mpiexec; rank 0 prints a table of medians (and ratios to the
baseline) and writes bench/results/adam_step.json. Not a test: numbers on a 2-core machine are
noisy, so compare the ratios from one run."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def _timed(comm, fn, reps: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        comm.Barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _baseline(comm, g, w, args):
    import torch
    from mpi4py import MPI
    wt = torch.from_numpy(w.copy())
    gt = torch.from_numpy(g.copy())
    wt.grad = torch.zeros_like(wt)
    opt = torch.optim.Adam([wt], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, fused=True)

    def step():
        comm.Allreduce(MPI.IN_PLACE, gt.numpy(), op=MPI.SUM)
        wt.grad.copy_(gt)
        opt.step()
    return step


def _coconet(mod, sched, comm, g, w, m, v):
    from coconetc.common.slices import slice_range
    R, r = comm.Get_size(), comm.Get_rank()
    if sched == "zero":
        lo, hi = slice_range(len(m), R, r)
        m, v = m[lo:hi].copy(), v[lo:hi].copy()
    args = dict(g=g, w=w.copy(), m=m.copy(), v=v.copy(), lr=1e-3, beta1=0.9, beta2=0.999,
                eps=1e-8, step=1.0)
    return lambda: mod.adam(schedule=None if sched == "default" else sched, **args)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1 << 22)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    if "OMPI_COMM_WORLD_SIZE" not in os.environ and "PMI_SIZE" not in os.environ:
        import coconetc
        coconetc.load(HERE.parent / "examples" / "adam.ccn")  # build once, before the ranks start
        from coconetc.launch.mpiexec import run_python
        return run_python(a.ranks, [__file__, *sys.argv[1:]])
    import coconetc
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    os.environ.setdefault("COCONET_THREADS", "1")
    mod = coconetc.load(HERE.parent / "examples" / "adam.ccn", log=lambda msg: None)
    rng = np.random.default_rng(comm.Get_rank())
    g = rng.standard_normal(a.n).astype(np.float32)
    shared = np.random.default_rng(0)
    w, m, v = (shared.uniform(0.5, 1.5, a.n).astype(np.float32) for _ in range(3))
    rows = [("mpi4py Allreduce + torch Adam(fused=True)", _timed(comm, _baseline(comm, g, w, a), a.reps))]
    # roofline of the zero schedule: the bytes a rank must move through memory (read g; read and
    # write its slices of m and v; read its slice of w; write all of w), at the copy bandwidth
    # measured now, with every rank copying at once
    src, dst = np.ones(a.n, np.float32), np.empty(a.n, np.float32)
    bw = 2 * src.nbytes / _timed(comm, lambda: np.copyto(dst, src), a.reps)
    mine = -(-a.n // comm.Get_size())
    rows.append(("roofline of zero (memory traffic / copy bandwidth)", 4 * (2 * a.n + 5 * mine) / bw))
    for sched in ("default", "rs_c_ag", "zero", "fused"):
        rows.append((f"coconet {sched}", _timed(comm, _coconet(mod, sched, comm, g, w, m, v), a.reps)))
    if comm.Get_rank() == 0:
        report(f"Adam step, f32, N = {a.n}, {comm.Get_size()} ranks, median of {a.reps}", rows,
               "adam_step", {"n": a.n, "ranks": comm.Get_size(), "reps": a.reps})
    return 0


def report(title: str, rows: list[tuple[str, float]], name: str, meta: dict) -> None:
    """Print the table (milliseconds, speed-up against the first row) and write the JSON."""
    base, width = rows[0][1], max(len(n) for n, _ in rows)
    print(title)
    print(f"{'variant':{width}s} {'ms':>9s} {'speed-up vs baseline':>22s}")
    for label, t in rows:
        print(f"{label:{width}s} {t * 1e3:9.2f} {base / t:22.2f}")
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({**meta, "median_seconds": dict(rows)}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
