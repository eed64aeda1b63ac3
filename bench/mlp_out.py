"""Megatron's row-parallel output layer (examples/mlp_out.ccn): matmul of this rank's slice,
all-reduce of the partial sums, bias + dropout + residual. Side by side in one run, for each
sequence length S:

  baselines
  * bare matmul                                     (torch.matmul of this rank's slice alone)
  * torch matmul + mpi4py Allreduce + torch ops     (bias, dropout, residual)
  * torch matmul + torch.distributed gloo all_reduce + torch ops
    (with --dtype f16 or bf16 the baselines compute in f32: the CPU has no f16 matmul worth
    timing, and mpi4py has no f16 sum)
  coconet: default (matmul, allreduce, loop), rs_c_ag, fused (the whole matmul, then a fused
  reduce-scatter + dropout + all-gather), overlap_ar (matmul chunks overlapped
  with their allreduce), overlapped (matmul chunks each through a fused reduce-scatter +
  dropout + all-gather)

Run: python bench/mlp_out.py [--dtype f16|bf16|f32] [--b 8] [--s 128,512] [--k 1024] [--h 1024]
     [--ranks 2] [--reps 10] [--json PATH]
--dtype f32 or bf16 compiles a copy of mlp_out.ccn with that dtype in place of f16 (in the temp
directory)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

BARE = "bare matmul"
MPI4PY = "torch matmul + mpi4py Allreduce + torch ops"
GLOO = "torch matmul + torch.distributed gloo all_reduce + torch ops"


def ccn_file(dtype: str) -> Path:
    return common.example_in_dtype("mlp_out.ccn", dtype, "f16")


def baseline(comm, x, w, b, r, how: str):
    import torch
    from mpi4py import MPI
    def f32(a):  # NumPy has no bf16 of its own (ml_dtypes'): through f32
        return torch.from_numpy(a.astype(np.float32))
    xt, wt, bt, rt = f32(x), f32(w), f32(b), f32(r)
    gen = torch.Generator().manual_seed(0)
    dist = common.gloo(comm) if how == "gloo" else None
    out_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(r.dtype.name, torch.float32)

    def step():
        y = torch.matmul(xt, wt)
        if how == "bare":
            return y
        if dist is not None:
            dist.all_reduce(y)
        else:
            comm.Allreduce(MPI.IN_PLACE, y.numpy(), op=MPI.SUM)
        s = y + bt
        mask = torch.rand(s.shape, generator=gen) >= 0.1
        return (torch.where(mask, s / 0.9, torch.zeros(())) + rt).to(out_dtype)
    return step


def run_size(mod, comm, a, S: int) -> dict:
    from coconetc.ir.slices import slice_range
    R, rank = comm.Get_size(), comm.Get_rank()
    lo, hi = slice_range(a.k, R, rank)
    from coconetc.ir.storage import STORAGE
    dt = STORAGE[a.dtype]
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (a.b, S, a.k)).astype(dt)[:, :, lo:hi].copy()
    w = (rng.uniform(-1, 1, (a.k, a.h)) / a.k ** 0.5).astype(dt)[lo:hi].copy()
    b, r = rng.uniform(-1, 1, a.h).astype(dt), rng.uniform(-1, 1, (a.b, S, a.h)).astype(dt)
    fns = {("b", label): baseline(comm, x, w, b, r, how) for label, how in ((BARE, "bare"), (MPI4PY, "mpi4py"), (GLOO, "gloo"))}
    args = dict(x=x, w=w, b=b, r=r, seed=1234)
    for sched in ("default", "rs_c_ag", "fused", "overlap_ar", "overlapped"):
        fns["c", sched] = lambda s=sched: mod.mlp_out(schedule=None if s == "default" else s, **args)
    t = common.timed_all(comm, fns, a.reps)
    return {"baselines": {k: v for (kind, k), v in t.items() if kind == "b"},
            "coconet": {k: v for (kind, k), v in t.items() if kind == "c"}, "roofline": None,
            "shape": {"B": a.b, "S": S, "K": a.k, "H": a.h}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", choices=("f16", "bf16", "f32"), default="f16")
    for dim, default in (("b", 8), ("k", 1024), ("h", 1024)):
        ap.add_argument(f"--{dim}", type=int, default=default)
    ap.add_argument("--s", default="128,512", help="sequence lengths, comma-separated")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not common.in_mpi_job():
        import coconetc
        coconetc.load(ccn_file(a.dtype))
        return common.relaunch(a.ranks, __file__, [])
    comm = common.setup_rank()
    import coconetc
    mod = coconetc.load(ccn_file(a.dtype), log=lambda msg: None)
    results = {a.b * S * a.h: run_size(mod, comm, a, S) for S in map(int, a.s.split(","))}
    if comm.Get_rank() == 0:
        common.report(f"mlp_out, {a.dtype}, B={a.b} K={a.k} H={a.h} (elements of the output), "
                      f"{comm.Get_size()} ranks", f"mlp_out_{a.dtype}", results, [MPI4PY, GLOO],
                      {"ranks": comm.Get_size(), "dtype": a.dtype}, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
