"""The host's (Python) time of one `DistributedOptimizer.step()` on the CUDA backend, without a
GPU: the CUDA module built for the host emulation (COCONET_CUDA_EMULATE=1), one rank, with the
module's function and the emulation's synchronization replaced by no-ops, so that what is timed
is only what a GPU's host would run before the step's work is queued (an idle GPU waits for it:
bench/common.device_timed counts it). Reference in the same run: `torch.optim.Adam(fused=True)`
on CPU tensors of the same size (its arithmetic included).

Run: python bench/cuda_step_host.py [--schedules default,zero] [--n 1024] [--reps 2000]
On several ranks (each step's agreement with the other ranks is then timed too: over MPI, or
with --group gloo over a torch.distributed gloo group, as under torchrun):
  coconetc launch -n 2 python bench/cuda_step_host.py [--group gloo]
(rank 0's medians are printed; torch's fused Adam has no agreement to make). For a before/after
comparison, run it once with this tree and once with PYTHONPATH pointing at another checkout
(the table names the coconetc it imported). Medians of REPS calls, in us."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from adam_step import HP  # noqa: E402  (Adam's hyper-parameters, as the other benches)

ADAM = common.ROOT / "examples" / "adam.ccn"


def per_call_us(fn, reps: int) -> float:
    return common.host_timed(fn, reps, warmup=50) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedules", default="default,zero,fused")
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--group", choices=["mpi", "gloo"], default="mpi",
                    help="on several ranks: agree over MPI (default) or over a torch.distributed gloo group")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    os.environ["COCONET_CUDA_EMULATE"] = "1"
    import torch
    from mpi4py import MPI

    import coconetc
    from coconetc.torch import DistributedOptimizer
    world = MPI.COMM_WORLD
    ranks, rank = world.Get_size(), world.Get_rank()
    group = None
    if ranks > 1 and a.group == "gloo":
        import torch.distributed as dist
        port = world.bcast(29500 + os.getpid() % 2000 if rank == 0 else None)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
        group = dist.group.WORLD
    rows = []
    for sched in a.schedules.split(","):
        p = torch.nn.Parameter(torch.rand(a.n))
        p.grad = torch.randn(a.n)
        opt = DistributedOptimizer([p], str(ADAM), schedule=sched, backend="cuda", process_group=group, **HP)
        ext = opt._fn.ext
        ext.synchronize = lambda: None  # only Python is timed: no emulated kernel, no wait for it
        setattr(ext, f"adam__{sched}", lambda args: None)
        rows.append((f"DistributedOptimizer(adam.ccn) [{sched}], module call a no-op", per_call_us(opt.step, a.reps)))
    q = torch.nn.Parameter(torch.rand(a.n))
    q.grad = torch.randn(a.n)
    ref = torch.optim.Adam([q], lr=1e-3, fused=True)
    rows.append(("torch.optim.Adam(fused=True), CPU tensors (with its arithmetic)", per_call_us(ref.step, a.reps)))
    if rank:
        return 0
    over = "" if ranks == 1 else f", {ranks} ranks agreeing over {'a gloo group' if group is not None else 'MPI'}"
    print(f"coconetc from {Path(coconetc.__file__).parent}, N = {a.n}{over}, medians of {a.reps} calls\n")
    print("| step | host us per call |\n| --- | --- |")
    for label, us in rows:
        print(f"| {label} | {us:.1f} |")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(coconetc=str(Path(coconetc.__file__).parent), n=a.n, reps=a.reps,
                                                ranks=ranks, group=a.group if ranks > 1 else None,
                                                rows=[dict(step=k, host_us=v) for k, v in rows]), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
