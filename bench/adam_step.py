"""One data-parallel Adam step (f32, N elements, the gradient summed over the ranks), every
variant side by side in one run, at every size (default 2^16 .. 2^24):

  baselines
  * mpi4py Allreduce + torch Adam(fused=True)          (the gradient all-reduced in place)
  * torch.distributed gloo + torch Adam(fused=True)    (torch.distributed.all_reduce, gloo)
  * mpi4py ReduceScatter + torch Adam(fused=True) on the slice + Allgather  (hand-written ZeRO)
  coconet examples/adam.ccn: default, rs_c_ag, zero, fused; "zero p2p" is zero with the
  point-to-point fused collective forced (COCONET_FUSED=p2p) instead of the shared-memory one,
  "zero, g in coconetc.empty" the zero schedule with the gradient allocated in the shared window
  (no staging copy); "zero, g and w in coconetc.empty" the parameters there too (the peers read
  each rank's updated part of w in place: no copy of it into the window); "zero,
  DistributedOptimizer" the same step through coconetc.torch.DistributedOptimizer (a torch
  Parameter of N elements) with its default arguments (on one node its flat weights and
  gradient in shared windows, one copy of the weights for the node's ranks), with
  shared_weights=False (each rank's own copy of the weights, in its window) and with
  shared_memory=False (ordinary tensors).
  * the memory roofline of each schedule, a bound: the least bytes a step with its calling
    convention must move (common.min_bytes: 18 an element at R = 2 for sliced m, v; 22
    replicated; 16 with one copy of the weights for the node) over the STREAM bandwidth measured in the same run (common.stream_bandwidth), and
    each schedule's time as a fraction of it.

--backend cuda (a machine with a GPU; R = 1, NCCL refuses two ranks on one GPU): the generated
CUDA Adam step (default, rs_c_ag, zero, fused) against torch.optim.Adam(fused=True) on the same
GPU, and each one's fraction of the device copy bandwidth (28 bytes an element) measured in the
same run; default size 2^26 (bench/cuda_gpu_check.py holds the timing code).

--nodes K (docs/cluster.md): the ranks as K simulated nodes (COCONET_SIMULATE_NODES=K) and only
the algorithms of the default and zero schedules side by side: "one node" (the group's shared
window, on a communicator made without the simulation), "K nodes, hierarchical" (node window,
MPI across the simulated nodes, node window) and "flat point to point" (COCONET_FUSED=p2p: MPI's
allreduce, the point-to-point fused collective), against the mpi4py baseline; JSON
bench/results/adam_step_nodes.json. The simulated nodes still talk through shared memory, so this
measures what the hierarchy costs on one machine, not what it saves on a network (the cost
model's view: `coconetc explain examples/adam.ccn --ranks 4 --nodes 2`).

Run: python bench/adam_step.py [--sizes 16,18,20,22,24] [--ranks 2] [--reps 10] [--json PATH]
     python bench/adam_step.py --ranks 4 --nodes 2 [--sizes 20,22] [--reps 10] [--json PATH]
     python bench/adam_step.py --backend cuda [--sizes 26] [--archs 90] [--reps 20] [--json PATH]
It relaunches itself under mpiexec; rank 0 prints a table per size (milliseconds of the slowest
rank, medians; speed-up against the best baseline), writes the JSON (bench/results/adam_step.json
unless --json) and a PNG plot beside it. Not a test: compare the ratios from one run."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ALLREDUCE = "mpi4py Allreduce + torch Adam(fused=True)"
GLOO = "torch.distributed gloo + torch Adam(fused=True)"
ZERO = "mpi4py ReduceScatter + torch Adam(fused=True) on the slice + Allgather (hand-written ZeRO)"
HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)

ADAM_CCN = common.ROOT / "examples" / "adam.ccn"


def _adam(params):
    import torch
    return torch.optim.Adam(params, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"], fused=True)


def baseline_allreduce(comm, g, w):
    import torch
    from mpi4py import MPI
    wt, gt = torch.from_numpy(w.copy()), torch.from_numpy(g.copy())
    wt.grad = gt  # the gradient is reduced in place, where the optimizer reads it
    opt = _adam([wt])

    def step():
        comm.Allreduce(MPI.IN_PLACE, gt.numpy(), op=MPI.SUM)
        opt.step()
    return step


def baseline_gloo(comm, g, w):
    import torch
    dist = common.gloo(comm)
    wt, gt = torch.from_numpy(w.copy()), torch.from_numpy(g.copy())
    wt.grad = gt
    opt = _adam([wt])

    def step():
        dist.all_reduce(gt)
        opt.step()
    return step


def baseline_zero(comm, g, w):
    import torch
    from mpi4py import MPI
    lo, hi, counts, displs = common.rank_slice(comm, len(g))
    wfull = w.copy()
    ws = torch.from_numpy(wfull[lo:hi])  # a view: the optimizer updates this rank's part of w
    gs = torch.empty(hi - lo, dtype=torch.float32)
    ws.grad = gs
    opt = _adam([ws])

    def step():
        comm.Reduce_scatter(g, gs.numpy(), recvcounts=counts, op=MPI.SUM)
        opt.step()
        comm.Allgatherv(MPI.IN_PLACE, [wfull, counts, displs, MPI.FLOAT])
    return step


def coconet_step(mod, sched, comm, g, w, path=None, empty=False, w_empty=False):
    import coconetc
    n = len(g)
    lo, hi, _, _ = common.rank_slice(comm, n)
    size = hi - lo if sched == "zero" else n
    m, v = np.zeros(size, np.float32), np.zeros(size, np.float32)
    if empty:
        gg = coconetc.empty((n,), "f32", comm=comm)
        gg[...] = g
        g = gg
    if w_empty:  # the parameters in the window too: the peers read the updated w in place
        ww = coconetc.empty((n,), "f32", comm=comm)
        ww[...] = w
        w = ww
    args = dict(g=g, w=w.copy() if not w_empty else w, m=m, v=v, step=1.0, **HP)
    name = None if sched == "default" else sched

    def step():
        if path:
            os.environ["COCONET_FUSED"] = path
        mod.adam(schedule=name, **args)
        if path:
            del os.environ["COCONET_FUSED"]
    return step


def run_size(mod, comm, n: int, reps: int, bw_reps: int) -> dict:
    rng = np.random.default_rng(comm.Get_rank())
    g = rng.standard_normal(n).astype(np.float32)
    w = np.random.default_rng(0).uniform(0.5, 1.5, n).astype(np.float32)
    reps = common.reps_for(n, reps)
    base = {label: make(comm, g, w)
            for label, make in ((ALLREDUCE, baseline_allreduce), (GLOO, baseline_gloo), (ZERO, baseline_zero))}
    variants = {s: coconet_step(mod, s, comm, g, w) for s in ("default", "rs_c_ag", "zero", "fused")}
    variants["zero p2p"] = coconet_step(mod, "zero", comm, g, w, path="p2p")
    variants["zero, g in coconetc.empty"] = coconet_step(mod, "zero", comm, g, w, empty=True)
    variants["zero, g and w in coconetc.empty"] = coconet_step(mod, "zero", comm, g, w, empty=True, w_empty=True)
    for label, kw in (("zero, DistributedOptimizer (defaults)", {}),
                      ("zero, DistributedOptimizer(shared_weights=False)", {"shared_weights": False}),
                      ("zero, DistributedOptimizer(shared_memory=False)", {"shared_memory": False})):
        variants[label] = common.optimizer_step(ADAM_CCN, comm, g, w, HP, **kw)[0]
    t = common.timed_all(comm, {**{("b", k): f for k, f in base.items()},
                                **{("c", k): f for k, f in variants.items()}}, reps)
    base = {k: t["b", k] for k in base}
    ours = {k: t["c", k] for k in variants}
    conv = {s: {"state_sliced": s.startswith("zero"),  # every zero variant: m, v sliced
                "weights_shared": getattr(f, "shared_weights", False)} for s, f in variants.items()}
    return {"baselines": base, "coconet": ours, "reps": reps,
            **common.rooflines(comm, n, conv, 16 * n, bw_reps)}


def nodes_step(mod, sched, comm, g, w, path=None):
    """SCHED on COMM (COCONET_FUSED=PATH around the call when given)."""
    R, r, n = comm.Get_size(), comm.Get_rank(), len(g)
    c = -(-n // R)
    mine = max(0, min(n, (r + 1) * c) - min(n, r * c))
    size = mine if sched == "zero" else n
    args = dict(g=g.copy(), w=w.copy(), m=np.zeros(size, np.float32), v=np.zeros(size, np.float32),
                step=1.0, **HP)
    name = None if sched == "default" else sched

    def step():
        if path:
            os.environ["COCONET_FUSED"] = path
        mod.adam(schedule=name, comm=comm, **args)
        if path:
            del os.environ["COCONET_FUSED"]
    return step


def run_nodes_size(mod, comm, k: int, n: int, reps: int) -> dict:
    """--nodes K: one node, K simulated nodes (hierarchical) and flat point to point, for default
    and zero. Each communicator's nodes are fixed on its first call: `one` is made and first
    called without COCONET_SIMULATE_NODES, `sim` with it."""
    rng = np.random.default_rng(comm.Get_rank())
    g = rng.standard_normal(n).astype(np.float32)
    w = np.random.default_rng(0).uniform(0.5, 1.5, n).astype(np.float32)
    reps = common.reps_for(n, reps)
    env = os.environ.pop("COCONET_SIMULATE_NODES")
    one = comm.Dup()
    for s in ("default", "zero"):
        nodes_step(mod, s, one, g, w)()
    os.environ["COCONET_SIMULATE_NODES"] = env
    sim = comm.Dup()
    variants = {}
    for s in ("default", "zero"):
        variants[f"{s}, one node"] = nodes_step(mod, s, one, g, w)
        variants[f"{s}, {k} nodes, hierarchical"] = nodes_step(mod, s, sim, g, w)
        variants[f"{s}, flat point to point"] = nodes_step(mod, s, sim, g, w, path="p2p")
    runs = mod.adam.ext._hier_runs
    before = runs()
    variants[f"zero, {k} nodes, hierarchical"]()
    assert runs() == before + 1, "the hierarchical path did not run"
    base = {ALLREDUCE: baseline_allreduce(comm, g, w)}
    t = common.timed_all(comm, {**{("b", x): f for x, f in base.items()},
                                **{("c", x): f for x, f in variants.items()}}, reps)
    return {"baselines": {x: t["b", x] for x in base}, "coconet": {x: t["c", x] for x in variants}, "reps": reps}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default=None,
                    help="exponents of 2 (or sizes), comma-separated (default 16,18,20,22,24; cuda: 26)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 10; cuda: 20)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--backend", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--archs", default="90", help="cuda: the architectures to compile for")
    ap.add_argument("--nodes", type=int, default=None,
                    help="the ranks as K simulated nodes: hierarchical against flat and one node (see above)")
    a = ap.parse_args()
    if a.backend == "cuda":
        return cuda_main(a)
    a.sizes, a.reps = a.sizes or "16,18,20,22,24", a.reps or 10
    if a.nodes is not None and (a.nodes < 2 or a.ranks % a.nodes):
        ap.error(f"--nodes {a.nodes}: at least 2 nodes, dividing --ranks {a.ranks}")
    if not common.in_mpi_job():
        if a.nodes:
            os.environ["COCONET_SIMULATE_NODES"] = str(a.nodes)
        return common.relaunch(a.ranks, __file__, ["adam.ccn"])
    comm = common.setup_rank()
    import coconetc
    mod = coconetc.load(ADAM_CCN, log=lambda msg: None)
    sizes = common.sizes_arg(a.sizes)
    if a.nodes:
        res = {n: run_nodes_size(mod, comm, a.nodes, n, a.reps) for n in sizes}
        if comm.Get_rank() == 0:
            common.report(f"Adam step, f32, {comm.Get_size()} ranks as {a.nodes} simulated nodes, median of reps",
                          "adam_step_nodes", res, [ALLREDUCE], {"ranks": comm.Get_size(), "nodes": a.nodes},
                          a.json)
        return 0
    results = {n: run_size(mod, comm, n, a.reps, 2 * a.reps) for n in sizes}
    if comm.Get_rank() == 0:
        common.report(f"Adam step, f32, {comm.Get_size()} ranks, median of reps", "adam_step", results,
                      [ALLREDUCE, GLOO, ZERO], {"ranks": comm.Get_size(),
                                                "stream_bandwidth_Bps": common.best_stream(),
                                                "roofline_note": common.ROOFLINE_NOTE},
                      a.json)
    return 0


def cuda_main(a) -> int:
    """--backend cuda: one GPU, R = 1 (bench/cuda_gpu_check.py: bench)."""
    import json

    import torch
    if not torch.cuda.is_available():
        print("adam_step.py --backend cuda: no CUDA device here (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    import cuda_gpu_check
    torch_label = "torch.optim.Adam(fused=True)"
    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ranks": 1, "sizes": {}}
    for n in common.sizes_arg(a.sizes or "26"):
        rows = cuda_gpu_check.bench(n, a.archs, a.reps or 20)
        copy_row = rows[0]
        copy_s = 2 * n * 4 / (copy_row["gbps"] * 1e9)
        roof = 7 * 4 * n / (2 * n * 4 / copy_s)  # Adam's 28 bytes an element at the copy bandwidth
        ours = {r["what"].split("[")[1].split("]")[0]: r["ms"] / 1e3 for r in rows if r["what"].startswith("coconet")}
        base = {torch_label: next(r["ms"] for r in rows if r["what"] == torch_label) / 1e3}
        out["sizes"][n] = {"baselines": base, "coconet": ours, "roofline": roof,
                           "copy_bandwidth_Bps": copy_row["gbps"] * 1e9,
                           "max_abs_diff_vs_torch": {r["what"]: r["ms"] for r in rows if r["what"].startswith("max")}}
        print(f"\nAdam step, f32, N = {n}, one GPU ({out['device']}); ms, median of {a.reps or 20}")
        print("| variant | ms | x torch fused Adam | fraction of copy bandwidth |\n| --- | --- | --- | --- |")
        t0 = base[torch_label]
        for label, t in [*base.items(), *ours.items()]:
            print(f"| {label} | {t * 1e3:.3f} | {t / t0:.2f} | {roof / t:.0%} |", flush=True)
    top = out["sizes"][max(out["sizes"])]
    out.update(baselines=top["baselines"], coconet=top["coconet"], roofline=top["roofline"])
    path = Path(a.json) if a.json else common.ROOT / "bench" / "results" / "adam_step_cuda.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
