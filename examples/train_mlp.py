"""Train a small PyTorch MLP data-parallel on R MPI ranks with examples/adam.ccn as the optimizer:

    coconetc launch -n 2 examples/train_mlp.py --schedule zero
    coconetc launch -n 3 examples/train_mlp.py --schedule zero --checkpoint /tmp/mlp.pt --resume

The data (a noisy non-linear regression) is generated here, the same on every rank; each rank
trains on its own part of every batch. Gradients are summed across ranks by the optimizer
(adam.ccn starts with `allreduce(sum, g)`), so each rank's loss is its rows' error divided by
the global batch size. --checkpoint saves the model and the optimizer's (consolidated) state at
the end; --resume loads them first, under any schedule and rank count."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from mpi4py import MPI

from coconetc.torch import DistributedOptimizer

ADAM = Path(__file__).with_name("adam.ccn")


def data(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=gen)
    y = torch.stack([torch.sin(x[:, :4].sum(1) / 2), torch.tanh(x[:, 8:12].sum(1) / 2)], 1)
    return x, y + 0.01 * torch.randn(n, 2, generator=gen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="zero", help="default, rs_c_ag, zero or fused")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--checkpoint", help="save the model and optimizer state here at the end")
    ap.add_argument("--resume", action="store_true", help="load --checkpoint before training")
    a = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank, ranks = comm.Get_rank(), comm.Get_size()

    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 2))
    opt = DistributedOptimizer(model.parameters(), ADAM, schedule=a.schedule,
                               lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)  # per epoch
    if a.resume and a.checkpoint and os.path.exists(a.checkpoint):
        ckpt = torch.load(a.checkpoint, weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])

    x, y = data(1024)
    xt, yt = data(256, seed=1)
    held = sum(t.numel() for g in opt.state_tensors for t in g.values())
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"{ranks} ranks, schedule {opt.schedule}: {n} parameters, "
              f"optimizer state on rank 0: {held} of {2 * n} elements")
    for epoch in range(a.epochs):
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        for b in range(0, len(x), a.batch):
            idx = perm[b:b + a.batch]
            mine = idx[rank::ranks]  # this rank's rows of the batch
            opt.zero_grad()
            loss = ((model(x[mine]) - y[mine]) ** 2).sum() / len(idx)
            loss.backward()
            opt.step()
        sched.step()
        with torch.no_grad():
            test = ((model(xt) - yt) ** 2).mean().item()
        if rank == 0 and (epoch % 5 == 4 or epoch == a.epochs - 1):
            print(f"epoch {epoch + 1:3d}  lr {opt.param_groups[0]['lr']:.2e}  test mse {test:.4f}")

    state = opt.state_dict()  # every rank takes part: the state's slices are gathered
    if a.checkpoint and rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": state,
                    "scheduler": sched.state_dict()}, a.checkpoint)
        print(f"saved {a.checkpoint}")
    # the ranks' weights never drift apart: every rank applies the same update
    w = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    spread = comm.allreduce((w - comm.bcast(w)).abs().max().item(), op=MPI.MAX)
    if rank == 0:
        print(f"max weight difference between ranks: {spread}")


if __name__ == "__main__":
    main()
