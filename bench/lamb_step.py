"""One data-parallel LAMB step (f32, N elements in L layers, the gradient averaged over the
ranks, per-layer trust ratios), every variant side by side in one run, at every size:

  baselines (LAMB written in PyTorch: torch ops on one flat buffer, per-layer norms on views)
  * mpi4py Allreduce + LAMB in PyTorch
  * torch.distributed gloo + LAMB in PyTorch
  coconet examples/lamb.ccn (g, w, m, v passed as one array per layer): default, rs_c_ag, zero
  * the memory roofline of each schedule, a bound: the least bytes its calling convention must
    move (common.min_bytes, the update r kept between its norms and the update of w) over the
    STREAM bandwidth measured in the same run (common.stream_bandwidth).

Run: python bench/lamb_step.py [--sizes 16,18,20,22,24] [--layers 8] [--ranks 2] [--reps 10] [--json PATH]"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ALLREDUCE = "mpi4py Allreduce + LAMB in PyTorch"
GLOO = "torch.distributed gloo + LAMB in PyTorch"
HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-6, wd=0.01)

LAMB_CCN = common.ROOT / "examples" / "lamb.ccn"


def torch_lamb(sizes: list[int], w, gt):
    """LAMB in PyTorch over the flat buffers w, g (gt averaged already), state m, v."""
    import torch
    wt, m, v = torch.from_numpy(w.copy()), torch.zeros(len(w)), torch.zeros(len(w))
    bounds = np.cumsum([0, *sizes])
    step = [0]

    def update():
        step[0] += 1
        b1, b2 = HP["beta1"], HP["beta2"]
        m.mul_(b1).add_(gt, alpha=1 - b1)
        v.mul_(b2).addcmul_(gt, gt, value=1 - b2)
        r = (m / (1 - b1 ** step[0])) / ((v / (1 - b2 ** step[0])).sqrt_().add_(HP["eps"]))
        r.add_(wt, alpha=HP["wd"])
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            wl, rl = wt[lo:hi], r[lo:hi]
            ratio = (wl.norm() / rl.norm()).item()
            wl.add_(rl, alpha=-HP["lr"] * ratio)
    return update


def baseline_allreduce(comm, sizes, g, w):
    import torch
    from mpi4py import MPI
    gt = torch.from_numpy(g.copy())
    update = torch_lamb(sizes, w, gt)
    R = comm.Get_size()

    def step():
        comm.Allreduce(MPI.IN_PLACE, gt.numpy(), op=MPI.SUM)
        gt.div_(R)
        update()
    return step


def baseline_gloo(comm, sizes, g, w):
    import torch
    dist = common.gloo(comm)
    gt = torch.from_numpy(g.copy())
    update = torch_lamb(sizes, w, gt)

    def step():
        dist.all_reduce(gt)  # gloo has no AVG: sum, then divide
        gt.div_(dist.get_world_size())
        update()
    return step


def coconet_step(mod, sched, comm, sizes, g, w):
    n = len(g)
    split = lambda a: np.split(a, np.cumsum(sizes)[:-1])  # noqa: E731  (one array per layer)
    lo, hi, _, _ = common.rank_slice(comm, n)
    mine = hi - lo
    if sched == "zero":
        m, v = np.zeros(mine, np.float32), np.zeros(mine, np.float32)
    else:
        m, v = split(np.zeros(n, np.float32)), split(np.zeros(n, np.float32))
    args = dict(g=split(g.copy()), w=split(w.copy()), m=m, v=v, step=1.0, **HP)
    name = None if sched == "default" else sched
    return lambda: mod.lamb(schedule=name, **args)


def run_size(mod, comm, n: int, layers: int, reps: int, bw_reps: int) -> dict:
    sizes = [len(x) for x in np.array_split(np.arange(n), layers)]
    g = np.random.default_rng(comm.Get_rank()).standard_normal(n).astype(np.float32)
    w = np.random.default_rng(0).uniform(0.5, 1.5, n).astype(np.float32)
    reps = common.reps_for(n, reps)
    fns = {("b", ALLREDUCE): baseline_allreduce(comm, sizes, g, w), ("b", GLOO): baseline_gloo(comm, sizes, g, w)}
    for s in ("default", "rs_c_ag", "zero"):
        fns["c", s] = coconet_step(mod, s, comm, sizes, g, w)
    t = common.timed_all(comm, fns, reps)
    # r, the update, is kept between the pass that takes its per-layer norms and the update of w
    conv = {s: {"state_sliced": s == "zero", "kept": 1} for s in ("default", "rs_c_ag", "zero")}
    return {"baselines": {k: v for (kind, k), v in t.items() if kind == "b"},
            "coconet": {k: v for (kind, k), v in t.items() if kind == "c"},
            "reps": reps, "layers": layers, **common.rooflines(comm, n, conv, 16 * n, bw_reps)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="16,18,20,22,24", help="exponents of 2 (or sizes), comma-separated")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not common.in_mpi_job():
        return common.relaunch(a.ranks, __file__, ["lamb.ccn"])
    comm = common.setup_rank()
    import coconetc
    mod = coconetc.load(LAMB_CCN, log=lambda msg: None)
    sizes = common.sizes_arg(a.sizes)
    results = {n: run_size(mod, comm, n, a.layers, a.reps, 2 * a.reps) for n in sizes}
    if comm.Get_rank() == 0:
        common.report(f"LAMB step, f32, {a.layers} layers, {comm.Get_size()} ranks", "lamb_step", results,
                      [ALLREDUCE, GLOO], {"ranks": comm.Get_size(),
                                          "stream_bandwidth_Bps": common.best_stream(),
                                          "roofline_note": common.ROOFLINE_NOTE}, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
