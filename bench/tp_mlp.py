"""Forward + backward of Megatron's tensor-parallel MLP (examples/tp_mlp.ccn: column-parallel
matmul, gelu, row-parallel matmul, all-reduce, bias) on R ranks, side by side in one run:

  baselines (PyTorch, this rank's weight slices, autograd; Megatron's conjugates written as
  autograd functions: identity forward / all-reduce backward in front of the column-parallel
  matmul, all-reduce forward / identity backward after the row-parallel one)
  * torch + torch.distributed gloo all_reduce
  * torch + mpi4py Allreduce            (bf16: the all-reduce in f32; MPI has no bf16 sum)
  coconet: coconetc.torch.function, the compiled forward and its derived backward, each
  forward schedule with each backward schedule of the file

One step: y = layer(x, w1, b1, w2, b2); y.backward(dy), with x requiring its gradient (a layer
inside a model). The derived backward recomputes the forward values it reads (`coconetc show
examples/tp_mlp.ccn -p tp_mlp --grad` lists them): here one matmul and the gelu.

On GPUs (`--backend cuda`): CUDA tensors, one GPU a rank, against the same layer with
torch.distributed's NCCL all-reduce (bench/cuda_gpu_run.sh runs it on one GPU).

Run: python bench/tp_mlp.py [--backend cpu|cuda] [--dtype f32|bf16] [--b 8] [--s 512] [--h 1024,4096] [--ffn 4]
     [--schedules default,overlapped|all] [--grad-schedules default,overlapped|all]
     [--ranks 2] [--reps 3] [--json PATH] [--profile ROWS]"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

MPI4PY = "torch + mpi4py Allreduce"
GLOO = "torch + torch.distributed gloo all_reduce"
NCCL = "torch (CUDA) + torch.distributed nccl all_reduce"


def ccn_file(dtype: str) -> Path:
    return common.example_in_dtype("tp_mlp.ccn", dtype, "f32")


def schedules(path: Path, fwd: str, bwd: str) -> tuple[list[str], list[str]]:
    """(forward schedules, backward schedules) of tp_mlp to time: the ones named, or "all" of the file."""
    from coconetc.sourcefile import load_file
    mod = load_file(path)
    every = (["default", *[s for s, v in mod.schedules["tp_mlp"].items() if not v.auto]],
             ["default", *[s for s, v in mod.schedules.get("tp_mlp_grad", {}).items() if not v.auto]])
    return tuple(e if want == "all" else want.split(",") for e, want in zip(every, (fwd, bwd)))  # type: ignore[return-value]


def allreduce(comm, how: str):
    """The all-reduce of a tensor in place: gloo or mpi4py (bf16 through f32)."""
    import torch
    from mpi4py import MPI
    if how in ("gloo", "nccl"):
        dist = common.gloo(comm, backend=how)
        return lambda t: dist.all_reduce(t)

    def mpi(t):
        if t.dtype == torch.float32:
            comm.Allreduce(MPI.IN_PLACE, t.numpy(), op=MPI.SUM)
            return
        f = t.float()
        comm.Allreduce(MPI.IN_PLACE, f.numpy(), op=MPI.SUM)
        t.copy_(f)
    return mpi


def megatron(comm, how: str):
    """The layer in PyTorch with Megatron's two conjugate autograd functions."""
    import torch
    reduce = allreduce(comm, how)

    class F(torch.autograd.Function):  # identity forward, all-reduce backward
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            g = g.contiguous()
            reduce(g)
            return g

    class G(torch.autograd.Function):  # all-reduce forward, identity backward
        @staticmethod
        def forward(ctx, p):
            p = p.contiguous()
            reduce(p)
            return p

        @staticmethod
        def backward(ctx, g):
            return g

    def layer(x, w1, b1, w2, b2):
        h = torch.nn.functional.gelu(F.apply(x) @ w1 + b1)
        return G.apply(h @ w2) + b2
    return layer


def run_size(comm, a, h: int, path: Path, fwd: list[str], bwd: list[str]) -> dict:
    import torch

    import coconetc.torch as ct
    from coconetc.ir.slices import slice_range
    R, rank = comm.Get_size(), comm.Get_rank()
    f = a.ffn * h
    lo, hi = slice_range(f, R, rank)
    dt = {"f32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(a.b, a.s, h, generator=gen).to(dt)
    w1 = (torch.randn(h, f, generator=gen) / h ** 0.5)[:, lo:hi].to(dt).contiguous()
    b1 = torch.randn(f, generator=gen)[lo:hi].to(dt).contiguous()
    w2 = (torch.randn(f, h, generator=gen) / f ** 0.5)[lo:hi].to(dt).contiguous()
    b2 = torch.randn(h, generator=gen).to(dt)
    dy = torch.randn(a.b, a.s, h, generator=gen).to(dt)
    gpu = a.backend == "cuda" and torch.cuda.is_available()  # (else: the host emulation, CPU tensors)
    if gpu:
        x, w1, b1, w2, b2, dy = (t.cuda() for t in (x, w1, b1, w2, b2, dy))
    leaves = [t.requires_grad_(True) for t in (x, w1, b1, w2, b2)]

    def step(layer):
        def run():
            for t in leaves:
                t.grad = None
            layer(*leaves).backward(dy)
            if gpu:
                torch.cuda.synchronize()
        return run

    baselines = ((NCCL, "nccl"),) if gpu else ((GLOO, "gloo"), (MPI4PY, "mpi4py"))
    fns = {("b", label): step(megatron(comm, how)) for label, how in baselines}
    for s in fwd:
        for g in bwd:
            fn = ct.function(path, "tp_mlp", schedule=s, grad_schedule=g, comm=comm, backend=a.backend)
            fns["c", f"{s} / grad {g}"] = step(lambda x, w1, b1, w2, b2, fn=fn: fn(x=x, w1=w1, b1=b1, w2=w2, b2=b2))
    # every variant's gradients agree (the same step, computed differently)
    ref = None
    for key, run in fns.items():
        run()
        got = [t.grad.float().clone() for t in leaves]
        if ref is None:
            ref = got
            continue
        tol = 2e-2 if a.dtype == "bf16" else 1e-3
        for name, g, r in zip(("x", "w1", "b1", "w2", "b2"), got, ref):
            err = float((g - r).abs().max() / r.abs().max())
            if err > tol:
                raise SystemExit(f"{key}: d_{name} differs from the first baseline's by {err:.2e} (relative)")
    t = common.timed_all(comm, fns, a.reps, warmup=1)
    profile_kernels(fns, a.profile if gpu else 0)
    return {"baselines": {k: v for (kind, k), v in t.items() if kind == "b"},
            "coconet": {k: v for (kind, k), v in t.items() if kind == "c"}, "roofline": None,
            "shape": {"B": a.b, "S": a.s, "H": h, "F": f}}


def profile_kernels(fns: dict, rows: int) -> None:
    """Each variant's GPU kernels over 3 steps (torch.profiler: CUPTI sees the module's kernels
    too), the ROWS that took the most device time, printed: where a variant's time goes."""
    if rows <= 0:
        return
    import torch
    from torch.profiler import ProfilerActivity, profile
    for (_, label), run in fns.items():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                run()
        print(f"\n{label}: kernels over 3 steps")
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=70))
    torch.cuda.synchronize()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", choices=("f32", "bf16"), default="f32")
    ap.add_argument("--b", type=int, default=8)
    ap.add_argument("--s", type=int, default=512)
    ap.add_argument("--h", default="1024,4096", help="hidden sizes, comma-separated")
    ap.add_argument("--ffn", type=int, default=4, help="F = ffn x hidden")
    ap.add_argument("--schedules", default="default,overlapped", help="forward schedules, or all")
    ap.add_argument("--grad-schedules", default="default,overlapped", help="schedules of grad(tp_mlp), or all")
    ap.add_argument("--backend", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: CUDA tensors, one GPU a rank, against torch + NCCL (under COCONET_CUDA_EMULATE=1 "
                    "without a GPU: the CUDA module on CPU tensors, against the CPU baselines)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", type=int, default=0, metavar="ROWS",
                    help="on a GPU: print each variant's ROWS costliest kernels (torch.profiler)")
    a = ap.parse_args()
    path = ccn_file(a.dtype)
    if not common.in_mpi_job() and a.ranks > 1:  # one rank runs here (MPI's singleton): no mpiexec needed
        import coconetc
        coconetc.load(path, grad="tp_mlp", backend=a.backend)  # built once, before the ranks start
        from coconetc.launch.mpiexec import run_python
        return run_python(a.ranks, [__file__, *sys.argv[1:]])
    comm = common.setup_rank()
    if a.backend == "cuda":
        import torch
        if torch.cuda.is_available():
            torch.cuda.set_device(comm.Get_rank() % torch.cuda.device_count())
    fwd, bwd = schedules(path, a.schedules, a.grad_schedules)
    results = {a.b * a.s * h: run_size(comm, a, h, path, fwd, bwd) for h in map(int, a.h.split(","))}
    if comm.Get_rank() == 0:
        common.report(f"tp_mlp forward + backward, {a.dtype}, B={a.b} S={a.s} F={a.ffn}H (elements of x)",
                      f"tp_mlp_{a.backend}_{a.dtype}" if a.backend == "cuda" else f"tp_mlp_{a.dtype}", results,
                      [MPI4PY, GLOO, NCCL], {"ranks": comm.Get_size(), "dtype": a.dtype, "backend": a.backend}, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
