"""One data-parallel AdamW step with global-norm gradient clipping (f32, N elements, the gradient
summed over the ranks, clipped to a norm of `maxnorm`, decoupled weight decay), every variant
side by side in one run, at every size (default 2^16 .. 2^24):

  baselines
  * mpi4py Allreduce + torch clip_grad_norm_ + torch AdamW(fused=True)   (reduced in place)
  * torch.distributed gloo + torch clip_grad_norm_ + torch AdamW(fused=True)
  coconet examples/adamw.ccn: default, rs_c_ag, sliced, zero; and examples/adam.ccn zero (plain
  Adam, no clipping, no decay: the target is AdamW zero within 1.1x of it); both zero steps also
  through coconetc.torch.DistributedOptimizer with its default arguments (one torch Parameter of
  N elements; on one node its flat weights and gradient in shared windows, one copy of the
  weights for the node's ranks), what a PyTorch user runs
  * the memory roofline of each schedule, a bound: the least bytes its calling convention must
    move (common.min_bytes: the reduced slice kept between the norm and the update; the
    optimizer's with one copy of the weights) over the STREAM bandwidth measured in the same run
    (common.stream_bandwidth).

Before timing, every AdamW variant makes one step from the same w and gradients (eps set near
the clipped gradient's size, so that the update depends on the clipping factor) and its change
of w is compared with the mpi4py baseline's (rtol 1e-3, atol 1e-3 lr); a mismatch stops the run.

Run: python bench/adamw_step.py [--sizes 16,18,20,22,24] [--ranks 2] [--reps 10] [--json PATH]
It relaunches itself under mpiexec; rank 0 prints a table per size (milliseconds of the slowest
rank, medians; speed-up against the best PyTorch composition), a markdown table of all sizes,
writes bench/results/adamw_step.json (unless --json) and a PNG plot beside it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ALLREDUCE = "mpi4py Allreduce + clip_grad_norm_ + torch AdamW(fused=True)"
GLOO = "torch.distributed gloo + clip_grad_norm_ + torch AdamW(fused=True)"
ADAM_ZERO = "adam.ccn zero (plain Adam)"
OPT = "zero, DistributedOptimizer (defaults)"
ADAM_OPT = "adam.ccn zero, DistributedOptimizer (defaults)"
SCHEDULES = ("default", "rs_c_ag", "sliced", "zero")
SLICED = ("sliced", "zero")  # the schedules that keep m and v sliced (ZeRO)
HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.01, maxnorm=1.0)

ADAMW_CCN = common.ROOT / "examples" / "adamw.ccn"
ADAM_CCN = common.ROOT / "examples" / "adam.ccn"


def torch_adamw(g, w, reduce, hp):
    """clip_grad_norm_ + AdamW(fused=True) on a torch copy of w after REDUCE(gradient) sums the
    ranks' gradients in place (as bench/adam_step.py's baselines: the summed gradient is
    reduced again at the next repetition, so its values grow; the time does not depend on
    them). Returns (step, the weights)."""
    import torch
    wt, gt = torch.from_numpy(w.copy()), torch.from_numpy(g.copy())
    wt.grad = gt
    opt = torch.optim.AdamW([wt], lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                            weight_decay=hp["wd"], fused=True)

    def step():
        reduce(gt)
        torch.nn.utils.clip_grad_norm_([wt], hp["maxnorm"])
        opt.step()
    return step, wt.numpy()


def coconet_step(fn, sched, comm, g, w, hp):
    """One call of the compiled step (FN: mod.adamw or mod.adam), m and v in the schedule's
    layout. Returns (step, the weights)."""
    lo, hi, _, _ = common.rank_slice(comm, len(g))
    size = hi - lo if sched in SLICED or fn.name == "adam" else len(g)
    args = dict(g=g.copy(), w=w.copy(), m=np.zeros(size, np.float32), v=np.zeros(size, np.float32),
                step=1.0, **hp)
    name = None if sched == "default" else sched
    return (lambda: fn(schedule=name, **args)), args["w"]


def variants(mods, comm, g, w, hp) -> tuple[dict, dict]:
    """The baselines and the AdamW schedules with the hyperparameters HP."""
    from mpi4py import MPI
    dist = common.gloo(comm)
    base = {ALLREDUCE: torch_adamw(g, w, lambda gt: comm.Allreduce(MPI.IN_PLACE, gt.numpy(), op=MPI.SUM), hp),
            GLOO: torch_adamw(g, w, dist.all_reduce, hp)}
    ours = {s: coconet_step(mods["adamw"].adamw, s, comm, g, w, hp) for s in SCHEDULES}
    ours[OPT] = common.optimizer_step(ADAMW_CCN, comm, g, w, hp)
    return base, ours


def check(mods, comm, g, w) -> float:
    """One step of every AdamW variant from the same w and gradients; each one's change of w
    against the mpi4py baseline's (every rank stops on a mismatch). Adam's first step is
    m / sqrt(v) = sign(g) where the gradient is far above eps, whatever the clipping factor, so
    the check runs with eps near the clipped gradient's size (maxnorm / sqrt(n)): there the
    update depends on the factor, and the decay (wd lr w) is above the tolerance. Returns the
    largest difference relative to lr."""
    hp = {**HP, "eps": HP["maxnorm"] / np.sqrt(len(g))}
    base, ours = variants(mods, comm, g, w, hp)
    for step, _ in [*base.values(), *ours.values()]:
        step()
    want = base[ALLREDUCE][1] - w
    bad, worst = [], 0.0
    for label, (_, got) in {GLOO: base[GLOO], **ours}.items():
        diff = float(np.abs((got - w) - want).max())
        worst = max(worst, diff / hp["lr"])
        if not np.allclose(got - w, want, rtol=1e-3, atol=1e-3 * hp["lr"]):
            bad.append(f"{label}: max |diff| {diff:.3g}")
    bad = comm.allreduce(bad)
    if bad:
        raise SystemExit(f"adamw_step N={len(g)}: the step differs from the baseline's: {'; '.join(bad)}")
    return comm.allreduce(worst, op=__import__("mpi4py").MPI.MAX)


def run_size(mods, comm, n: int, reps: int, bw_reps: int) -> dict:
    g = np.random.default_rng(comm.Get_rank()).standard_normal(n).astype(np.float32)
    w = np.random.default_rng(0).uniform(0.5, 1.5, n).astype(np.float32)
    worst = check(mods, comm, g, w)
    reps = common.reps_for(n, reps)
    base, ours = variants(mods, comm, g, w, HP)
    adam_hp = {k: v for k, v in HP.items() if k not in ("wd", "maxnorm")}
    ours[ADAM_ZERO] = coconet_step(mods["adam"].adam, "zero", comm, g, w, adam_hp)
    ours[ADAM_OPT] = common.optimizer_step(ADAM_CCN, comm, g, w, adam_hp)
    fns = {("b", k): v[0] for k, v in base.items()}
    fns.update({("c", k): v[0] for k, v in ours.items()})
    t = common.timed_all(comm, fns, reps)
    conv = {s: {"state_sliced": s in SLICED, "kept": 1} for s in SCHEDULES}
    # the optimizer's own convention: m, v sliced, and on one node one copy of the weights
    conv[OPT] = {"state_sliced": True, "kept": 1, "weights_shared": getattr(ours[OPT][0], "shared_weights", False)}
    return {"baselines": {k: t["b", k] for k in base}, "coconet": {k: t["c", k] for k in ours},
            "reps": reps, "check_max_diff_over_lr": worst,
            **common.rooflines(comm, n, conv, 16 * n, bw_reps)}


def markdown(results: dict) -> str:
    """One row per size: ms of each variant (speed-up against the best baseline), the
    roofline, the best schedule's fraction of it and AdamW zero over plain Adam zero."""
    first = results[min(results)]
    cols = [*first["baselines"], *first["coconet"]]
    out = ["| N | " + " | ".join(cols) + " | roofline (bound) | best at % of bound | zero / Adam zero "
           "| the same through the optimizer |", "| --- " * (len(cols) + 5) + "|"]
    for n, r in sorted(results.items()):
        ref = min(r["baselines"].values())
        times = {**r["baselines"], **r["coconet"]}
        best = min(r["coconet"][s] for s in (*SCHEDULES, OPT))
        cells = [f"{times[c] * 1e3:.3f} ({ref / times[c]:.2f})" for c in cols]
        out.append(f"| 2^{n.bit_length() - 1} | " + " | ".join(cells) +
                   f" | {r['roofline'] * 1e3:.3f} | {100 * r['roofline'] / best:.0f}% |"
                   f" {r['coconet']['zero'] / r['coconet'][ADAM_ZERO]:.2f} |"
                   f" {r['coconet'][OPT] / r['coconet'][ADAM_OPT]:.2f} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="16,18,20,22,24",
                    help="exponents of 2 (or sizes), comma-separated; e.g. 16,20 for a quick run")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not common.in_mpi_job():
        return common.relaunch(a.ranks, __file__, ["adamw.ccn", "adam.ccn"])
    comm = common.setup_rank()
    import coconetc
    mods = {"adamw": coconetc.load(ADAMW_CCN, log=lambda msg: None),
            "adam": coconetc.load(ADAM_CCN, log=lambda msg: None)}
    results = {n: run_size(mods, comm, n, a.reps, 2 * a.reps) for n in common.sizes_arg(a.sizes)}
    if comm.Get_rank() == 0:
        common.report(f"AdamW + global-norm clipping step, f32, {comm.Get_size()} ranks", "adamw_step",
                      results, [ALLREDUCE, GLOO],
                      {"ranks": comm.Get_size(), "stream_bandwidth_Bps": common.best_stream(),
                       "roofline_note": common.ROOFLINE_NOTE, "hyperparameters": HP}, a.json)
        print("\nms of the slowest rank, median (speed-up against the best PyTorch composition):\n")
        print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
