"""mlp_out (examples/mlp_out.ccn: row-parallel matmul + all-reduce + bias + dropout + residual)
against its bare matmul, in f32, bf16 and f16, side by side in one run.

For each dtype, every rank times (interleaved repetitions, medians):
  * torch.matmul of this rank's slice ([B*S, K/R] x [K/R, H]) in f32 (and in bf16 itself),
  * the module's own matmul of the same slice (a one-stage program: OpenBLAS sgemm, f16/bf16
    widened to f32 as gemm.h does it),
  * torch.matmul + mpi4py Allreduce (f32) + torch bias/dropout/residual (what a user writes),
  * coconet mlp_out: default, rs_c_ag, overlap_ar, overlapped.
The ratio column is time / (the module's bare matmul): 1.00 means the layer costs no more than
its matmul, i.e. communication and elementwise work are entirely hidden.

Run: python bench/mlp_gemm.py [--b 8] [--s 512] [--k 1024] [--h 1024] [--ranks 2] [--reps 7]
     [--dtypes f32,bf16,f16]
It relaunches itself under mpiexec; rank 0 prints the table and writes
bench/results/mlp_gemm.json.  The .ccn files for f32 and bf16 are examples/mlp_out.ccn with the
dtype substituted, written to a temporary directory."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SCHEDULES = ("default", "rs_c_ag", "fused", "overlap_ar", "overlapped")
BARE = """program mm(x: {dt}[M, K], w: {dt}[K, H]) {{
    y = matmul(x, w)
    return y
}}
"""


def sources(tmp: Path, dtypes: list[str]) -> dict[str, Path]:
    """One file per dtype: mlp_out with the dtype substituted, plus a bare local matmul."""
    text = (HERE.parent / "examples" / "mlp_out.ccn").read_text()
    out = {}
    for dt in dtypes:
        p = tmp / f"mlp_gemm_{dt}.ccn"
        p.write_text(text.replace("f16[", f"{dt}[") + "\n" + BARE.format(dt=dt))
        out[dt] = p
    return out


def _np_dtype(dt: str):
    if dt == "bf16":
        import ml_dtypes
        return ml_dtypes.bfloat16
    return {"f32": np.float32, "f16": np.float16}[dt]


def _torch_dtype(dt: str):
    import torch
    return {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dt]


def variants(mod, dt: str, comm, a) -> list[tuple[str, object]]:
    import torch
    from mpi4py import MPI

    from coconetc.ir.slices import slice_range
    R, rank = comm.Get_size(), comm.Get_rank()
    lo, hi = slice_range(a.k, R, rank)
    rng = np.random.default_rng(0)
    npdt = _np_dtype(dt)
    x = rng.uniform(-1, 1, (a.b, a.s, a.k)).astype(np.float32)[:, :, lo:hi].astype(npdt).copy()
    w = (rng.uniform(-1, 1, (a.k, a.h)) / a.k ** 0.5).astype(np.float32)[lo:hi].astype(npdt).copy()
    b = rng.uniform(-1, 1, a.h).astype(np.float32).astype(npdt)
    r = rng.uniform(-1, 1, (a.b, a.s, a.h)).astype(np.float32).astype(npdt)
    tdt = _torch_dtype(dt)
    x32 = torch.from_numpy(x.astype(np.float32)).reshape(-1, hi - lo)
    w32 = torch.from_numpy(w.astype(np.float32))
    xt, wt = x32.to(tdt), w32.to(tdt)
    x2 = x.reshape(-1, hi - lo)
    out: list[tuple[str, object]] = [
        ("torch.matmul f32 (bare)", lambda: torch.matmul(x32, w32)),
        ("coconet matmul (bare)", lambda: mod.mm(x=x2, w=w)),
    ]
    if dt == "bf16":  # torch's f16 matmul on the CPU is a slow fallback (~70x sgemm): skipped
        out.insert(1, (f"torch.matmul {dt} (bare)", lambda: torch.matmul(xt, wt)))
    bt, rt = torch.from_numpy(b.astype(np.float32)), torch.from_numpy(r.astype(np.float32))
    gen = torch.Generator().manual_seed(0)
    y32 = np.empty((a.b * a.s, a.h), np.float32)

    def baseline():
        torch.matmul(x32, w32, out=torch.from_numpy(y32))
        comm.Allreduce(MPI.IN_PLACE, y32, op=MPI.SUM)
        s = torch.from_numpy(y32).reshape(a.b, a.s, a.h) + bt
        mask = torch.rand(s.shape, generator=gen) >= 0.1
        return (torch.where(mask, s / 0.9, torch.zeros(())) + rt).to(tdt)
    out.append(("torch matmul + MPI Allreduce + torch (f32)", baseline))
    for sched in SCHEDULES:
        out.append((f"coconet mlp_out {sched}", lambda s=sched: mod.mlp_out(
            x=x, w=w, b=b, r=r, seed=1234, schedule=None if s == "default" else s)))
    return out


def timed(comm, fns: list[tuple[str, object]], reps: int) -> list[tuple[str, float]]:
    """Interleaved: each repetition runs every variant once (both ranks in step)."""
    for _, fn in fns:
        fn()  # warm-up
    times: dict[str, list[float]] = {n: [] for n, _ in fns}
    for _ in range(reps):
        for name, fn in fns:
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            comm.Barrier()
            times[name].append(time.perf_counter() - t0)
    return [(n, statistics.median(times[n])) for n, _ in fns]


def main() -> int:
    ap = argparse.ArgumentParser()
    for dim, default in (("b", 8), ("s", 512), ("k", 1024), ("h", 1024)):
        ap.add_argument(f"--{dim}", type=int, default=default)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dtypes", default="f32,bf16,f16")
    ap.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    dtypes = a.dtypes.split(",")
    if "OMPI_COMM_WORLD_SIZE" not in os.environ and "PMI_SIZE" not in os.environ:
        import coconetc
        tmp = Path(tempfile.mkdtemp(prefix="mlp_gemm_"))
        for p in sources(tmp, dtypes).values():
            coconetc.load(p)  # build once, before the ranks start
        from coconetc.launch.mpiexec import run_python
        return run_python(a.ranks, [__file__, *sys.argv[1:], "--dir", str(tmp)])
    os.environ.setdefault("COCONET_THREADS", "1")
    import torch
    torch.set_num_threads(1)
    import coconetc
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    files = sources(Path(a.dir), dtypes)
    results = {}
    for dt in dtypes:
        mod = coconetc.load(files[dt], log=lambda msg: None)
        rows = timed(comm, variants(mod, dt, comm, a), a.reps)
        results[dt] = dict(rows)
        if comm.Get_rank() == 0:
            bare = dict(rows)["coconet matmul (bare)"]
            width = max(len(n) for n, _ in rows)
            print(f"\nmlp_out {dt}, B={a.b} S={a.s} K={a.k} H={a.h}, {comm.Get_size()} ranks, "
                  f"median of {a.reps} (interleaved)")
            print(f"{'variant':{width}s} {'ms':>9s} {'x bare matmul':>14s}")
            for name, t in rows:
                print(f"{name:{width}s} {t * 1e3:9.2f} {t / bare:14.2f}")
            sys.stdout.flush()
    if comm.Get_rank() == 0:
        res = HERE / "results"
        res.mkdir(exist_ok=True)
        (res / "mlp_gemm.json").write_text(json.dumps(
            {"sizes": {k: getattr(a, k) for k in ("b", "s", "k", "h", "ranks", "reps")},
             "median_seconds": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
