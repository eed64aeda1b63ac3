"""One pipeline stage (examples/pipeline.ccn, `stage`): tensor-parallel inside each group of
ranks, the activations all-reduced in the group, relu + bias + residual, and the result sent to
the same rank of the next group. Side by side in one run, for each batch size B:

  * baseline: mpi4py Allreduce in the group + torch ops + Sendrecv to the next group
  * coconet default (allreduce, loop, send of the whole h) and sliced_p2p (reduce-scatter, loop
    on the slice, send of the slice only, all-gather after the send: on the receiving side)
  and the bytes each rank sends per step, counted from the schedule's messages (the ring
  algorithms' volumes: an allreduce sends 2 (G-1)/G of its bytes, a reduce-scatter or an
  all-gather (G-1)/G; a send all it sends), the largest over the ranks.

It needs groups of at least 2 ranks to show anything, so it runs 4 ranks in 2 groups by default
(oversubscribed on a 2-core machine: compare the ratios, not the times).
Run: python bench/stage_step.py [--ranks 4] [--groups 2] [--sizes 256,1024] [--h 1024] [--reps 10] [--json PATH]"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

BASE = "mpi4py Allreduce + torch ops + Sendrecv"


def sent_bytes(sched: str, B: int, H: int, G: int, groups: int, group_index: int) -> int:
    """Bytes this rank sends per step (see the module's docstring)."""
    full = 4 * B * H
    first, last = group_index == 0, group_index == groups - 1
    reduce = 2 * (G - 1) * full // G if sched in ("default", BASE) else (G - 1) * full // G
    send = 0 if last else (full if sched in ("default", BASE) else -(-B // G) * H * 4)
    gather = 0 if sched in ("default", BASE) or first else (G - 1) * full // G
    return reduce + send + gather


def baseline(comm, groups: int, y, b, r):
    import torch
    from mpi4py import MPI
    R, rank = comm.Get_size(), comm.Get_rank()
    G = R // groups
    gi = rank // G
    group = comm.Split(gi, rank)
    nxt_peer = rank + G if gi + 1 < groups else MPI.PROC_NULL
    prev_peer = rank - G if gi > 0 else MPI.PROC_NULL
    yt, bt, rt = (torch.from_numpy(a.copy()) for a in (y, b, r))
    s = torch.empty_like(yt)
    recv = np.zeros_like(y)

    def step():
        group.Allreduce(yt.numpy(), s.numpy(), op=MPI.SUM)
        h = torch.relu(s + bt) + rt
        comm.Sendrecv(h.numpy(), dest=nxt_peer, recvbuf=recv, source=prev_peer)
        return recv
    return step


def run_size(mod, comm, a, B: int) -> dict:
    R, rank = comm.Get_size(), comm.Get_rank()
    G = R // a.groups
    rng = np.random.default_rng(rank)
    y = rng.standard_normal((B, a.h)).astype(np.float32)
    b = np.random.default_rng(0).standard_normal(a.h).astype(np.float32)
    r = np.random.default_rng(1 + rank // G).standard_normal((B, a.h)).astype(np.float32)
    fns = {("b", BASE): baseline(comm, a.groups, y, b, r)}
    for sched in ("default", "sliced_p2p"):
        fns["c", sched] = lambda s=sched: mod.stage(schedule=None if s == "default" else s, groups=a.groups,
                                                    y=y, b=b, r=r)
    t = common.timed_all(comm, fns, common.reps_for(B * a.h, a.reps))
    gi = rank // G
    sent = {k: comm.allreduce(sent_bytes(k, B, a.h, G, a.groups, gi), op=max) for k in (BASE, "default", "sliced_p2p")}
    return {"baselines": {BASE: t["b", BASE]}, "coconet": {k: v for (kind, k), v in t.items() if kind == "c"},
            "roofline": None, "bytes_sent_per_rank": sent, "shape": {"B": B, "H": a.h, "groups": a.groups}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--sizes", default="256,1024", help="batch sizes B, comma-separated")
    ap.add_argument("--h", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not common.in_mpi_job():
        return common.relaunch(a.ranks, __file__, ["pipeline.ccn"])
    comm = common.setup_rank()
    import coconetc
    mod = coconetc.load(common.ROOT / "examples" / "pipeline.ccn", log=lambda msg: None)
    results = {B * a.h: run_size(mod, comm, a, B) for B in map(int, a.sizes.split(","))}
    if comm.Get_rank() == 0:
        common.report(f"pipeline stage, f32, H={a.h}, {comm.Get_size()} ranks in {a.groups} groups",
                      "stage_step", results, [BASE], {"ranks": comm.Get_size(), "groups": a.groups}, a.json)
        for n, res in sorted(results.items()):
            print(f"bytes sent per rank per step, {n} elements: " +
                  ", ".join(f"{k}: {v}" for k, v in res["bytes_sent_per_rank"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
