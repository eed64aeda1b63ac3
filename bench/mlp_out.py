"""Megatron's row-parallel output layer (examples/mlp_out.ccn, f16): matmul of this rank's
slice, all-reduce of the partial sums, bias + dropout + residual. Side by side in one run:

  * baseline: torch.matmul + mpi4py Allreduce + torch bias/dropout/residual (f32 math on f16
    storage is not what torch does on the CPU, so the baseline computes in f32 and rounds)
  * coconet: default (matmul, allreduce, loop), rs_c_ag, overlap_ar (matmul chunks overlapped
    with their allreduce), overlapped (matmul chunks each through a fused reduce-scatter +
    dropout + all-gather)

Run: python bench/mlp_out.py [--b 8] [--s 512] [--k 1024] [--h 1024] [--ranks 2] [--reps 10]
It relaunches itself under mpiexec; rank 0 prints medians and ratios and writes
bench/results/mlp_out.json."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from adam_step import _timed, report  # noqa: E402  (same timing rule and table)


def _baseline(comm, x, w, b, r):
    import torch
    from mpi4py import MPI
    xt, wt = torch.from_numpy(x).float(), torch.from_numpy(w).float()
    bt, rt = torch.from_numpy(b).float(), torch.from_numpy(r).float()
    gen = torch.Generator().manual_seed(0)

    y16 = np.empty((x.shape[0], x.shape[1], w.shape[1]), np.float32)

    def step32():
        y = torch.matmul(xt, wt)
        y16[...] = y.numpy()
        comm.Allreduce(MPI.IN_PLACE, y16, op=MPI.SUM)  # mpi4py has no f16 sum: reduce in f32
        s = torch.from_numpy(y16) + bt
        mask = torch.rand(s.shape, generator=gen) >= 0.1
        return (torch.where(mask, s / 0.9, torch.zeros(())) + rt).half()
    return step32


def main() -> int:
    ap = argparse.ArgumentParser()
    for dim, default in (("b", 8), ("s", 512), ("k", 1024), ("h", 1024)):
        ap.add_argument(f"--{dim}", type=int, default=default)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    if "OMPI_COMM_WORLD_SIZE" not in os.environ and "PMI_SIZE" not in os.environ:
        import coconetc
        coconetc.load(HERE.parent / "examples" / "mlp_out.ccn")
        from coconetc.launch.mpiexec import run_python
        return run_python(a.ranks, [__file__, *sys.argv[1:]])
    import coconetc
    from mpi4py import MPI

    from coconetc.common.slices import slice_range
    comm = MPI.COMM_WORLD
    os.environ.setdefault("COCONET_THREADS", "1")
    import torch
    torch.set_num_threads(1)
    mod = coconetc.load(HERE.parent / "examples" / "mlp_out.ccn", log=lambda msg: None)
    R, rank = comm.Get_size(), comm.Get_rank()
    lo, hi = slice_range(a.k, R, rank)
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (a.b, a.s, a.k)).astype(np.float16)[:, :, lo:hi].copy()
    w = (rng.uniform(-1, 1, (a.k, a.h)) / a.k ** 0.5).astype(np.float16)[lo:hi].copy()
    b, r = rng.uniform(-1, 1, a.h).astype(np.float16), rng.uniform(-1, 1, (a.b, a.s, a.h)).astype(np.float16)
    rows = [("torch matmul + mpi4py Allreduce (f32) + torch dropout", _timed(comm, _baseline(comm, x, w, b, r), a.reps))]
    for sched in ("default", "rs_c_ag", "overlap_ar", "overlapped"):
        args = dict(x=x, w=w, b=b, r=r, seed=1234)
        rows.append((f"coconet {sched}", _timed(
            comm, lambda s=sched, kw=args: mod.mlp_out(schedule=None if s == "default" else s, **kw), a.reps)))
    if rank == 0:
        report(f"mlp_out, f16, B={a.b} S={a.s} K={a.k} H={a.h}, {R} ranks, median of {a.reps}",
               rows, "mlp_out", {"sizes": vars(a)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
