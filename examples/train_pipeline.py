"""Train a pipeline stage across 2 groups of ranks, its backward the compiled derived program of
examples/pipeline.ccn, against the same computation in one process:

    coconetc launch -n 4 examples/train_pipeline.py          # 2 groups (stages) of 2 ranks

`stage(y, b, r)` all-reduces its group's partial activations y (each rank's own, `local`),
applies `relu(s + b) + r` and sends the result to the next group (`send(h, next)`). Group 0 is
the first stage: its output reaches group 1, where the loss is computed; the backward sends the
loss's gradient back (`send(g, prev)`, derived) and group 0's parameters (its ranks' y, and b
and r, replicated in the group) are trained by SGD. Group 1 is the last stage: what it sends
goes nowhere, so its parameters get zero gradients. Every rank calls forward and backward
together (the collectives are inside the compiled programs).

The same first stage and loss are computed in one process with plain PyTorch; the script
prints both loss curves and exits with an error when they part by more than --tol."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from mpi4py import MPI

import coconetc.torch as ct

PIPELINE = Path(__file__).with_name("pipeline.ccn")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--tol", type=float, default=1e-4)
    a = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank, ranks = comm.Get_rank(), comm.Get_size()
    if ranks % 2:
        sys.exit("run on an even number of ranks: 2 groups (stages) of ranks/2")
    gs = ranks // 2
    group, member = rank // gs, rank % gs

    gen = torch.Generator().manual_seed(0)
    ys = [torch.randn(a.batch, a.hidden, generator=gen) for _ in range(gs)]  # group 0's ranks' parts
    b, r = torch.randn(a.hidden, generator=gen), torch.randn(a.batch, a.hidden, generator=gen)
    target = torch.randn(a.batch, a.hidden, generator=gen)

    stage = ct.function(PIPELINE, "stage", comm=comm, groups=2)
    params = [t.clone().requires_grad_(True) for t in (ys[member], b, r)]
    opt = torch.optim.SGD(params, lr=a.lr)
    ref_y = [t.clone().requires_grad_(True) for t in ys]
    ref_b, ref_r = b.clone().requires_grad_(True), r.clone().requires_grad_(True)
    ref_opt = torch.optim.SGD([*ref_y, ref_b, ref_r], lr=a.lr)
    if rank == 0:
        print(f"{ranks} ranks as 2 stages of {gs}; loss on stage 2, stage 1 trained")
        print(f"{'step':>4}  {'pipeline':>10}  {'one process':>12}")
    worst = 0.0
    for step in range(a.steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        nxt = stage(y=params[0], b=params[1], r=params[2])
        # the last stage computes the loss from what it received; the first received nothing
        mine = ((nxt - target) ** 2).mean() if group == 1 else (nxt * 0).sum()
        mine.backward()
        loss = comm.bcast(mine.item() if rank == gs else None, root=gs)
        ref = ((torch.relu(sum(ref_y) + ref_b) + ref_r - target) ** 2).mean()
        ref.backward()
        opt.step()
        ref_opt.step()
        worst = max(worst, abs(loss - ref.item()) / abs(ref.item()))
        if rank == 0 and (step % 5 == 0 or step == a.steps - 1):
            print(f"{step:4d}  {loss:10.6f}  {ref.item():12.6f}")
    if rank == 0:
        print(f"largest relative loss difference {worst:.2e}")
    if worst > a.tol:
        sys.exit(f"rank {rank}: the loss curves part by {worst:.2e} > --tol {a.tol}")


if __name__ == "__main__":
    main()
