"""Train a small residual MLP with Megatron-style tensor parallelism on R MPI ranks, each block
the compiled examples/tp_mlp.ccn (forward and backward), against the same model in one process:

    coconetc launch -n 2 examples/train_tp.py
    coconetc launch -n 2 examples/train_tp.py --schedule overlapped --grad-schedule overlapped

Each block is `coconetc.torch.Module`: w1 (column-parallel) and w2 (row-parallel) hold this
rank's columns / rows, b2 is replicated; the forward's all-reduce and the backward's (the
input gradient of the column-parallel matmul) run inside the compiled module. The data (a
noisy non-linear regression) is generated here, the same on every rank; every rank sees the
whole batch (tensor parallelism splits the weights, not the data). Every rank computes the same
loss from the replicated output, so any torch optimizer steps the parameters: the sliced ones
are this rank's parts, the replicated ones identical on every rank.

The same model is trained in one process on every rank (plain PyTorch, full weights, the same
initial values) and the two loss curves are printed side by side; the script exits with an
error when they part by more than --tol (relative)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from mpi4py import MPI

import coconetc.torch as ct

TP_MLP = Path(__file__).with_name("tp_mlp.ccn")


def data(n: int, s: int, h: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, s, h, generator=gen)
    y = torch.sin(x.roll(1, dims=2)) * torch.tanh(x.roll(-3, dims=2)) + 0.01 * torch.randn(n, s, h, generator=gen)
    return x, y


def init(blocks: int, h: int, f: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Full initial weights of every block (the same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    return [{"w1": torch.randn(h, f, generator=gen) / math.sqrt(h), "b1": torch.zeros(f),
             "w2": torch.randn(f, h, generator=gen) / math.sqrt(f), "b2": torch.zeros(h)}
            for _ in range(blocks)]


class Reference(torch.nn.Module):
    """The same model in one process: y = x + gelu(x @ w1 + b1) @ w2 + b2, block after block."""

    def __init__(self, weights: list[dict[str, torch.Tensor]]):
        super().__init__()
        self.blocks = torch.nn.ModuleList()
        for w in weights:
            block = torch.nn.Module()
            for name, t in w.items():
                block.register_parameter(name, torch.nn.Parameter(t.clone()))
            self.blocks.append(block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            gelu = torch.nn.functional.gelu(x @ b.w1 + b.b1)
            x = x + gelu @ b.w2 + b.b2
        return x


class TensorParallel(torch.nn.Module):
    """The model with each block the compiled tensor-parallel MLP."""

    def __init__(self, weights: list[dict[str, torch.Tensor]], schedule: str, grad_schedule: str):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            ct.Module(TP_MLP, "tp_mlp", parameters=w, schedule=schedule, grad_schedule=grad_schedule)
            for w in weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x=x)
        return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="default", help="the forward's schedule in tp_mlp.ccn")
    ap.add_argument("--grad-schedule", default="default", help="the backward's: a `schedule s for grad(tp_mlp)`")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--tol", type=float, default=1e-3)
    a = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank, ranks = comm.Get_rank(), comm.Get_size()

    x, y = data(8, 16, a.hidden)
    weights = init(a.blocks, a.hidden, a.ffn)
    tp = TensorParallel(weights, a.schedule, a.grad_schedule)
    ref = Reference(weights)
    opts = [torch.optim.AdamW(m.parameters(), lr=a.lr) for m in (tp, ref)]
    held = sum(p.numel() for p in tp.parameters())
    if rank == 0:
        print(f"{ranks} ranks, schedule {a.schedule!r}, grad schedule {a.grad_schedule!r}: "
              f"{held} parameters on each rank of {sum(p.numel() for p in ref.parameters())}")
        print(f"{'step':>4}  {'tensor-parallel':>15}  {'one process':>12}")
    worst = 0.0
    for step in range(a.steps):
        losses = []
        for model, opt in zip((tp, ref), opts):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        worst = max(worst, abs(losses[0] - losses[1]) / abs(losses[1]))
        if rank == 0 and (step % 5 == 0 or step == a.steps - 1):
            print(f"{step:4d}  {losses[0]:15.6f}  {losses[1]:12.6f}")
    # every rank's parts of the weights, gathered, against the one-process model's
    diff = max(float((b.full(n) - getattr(r, n).detach()).abs().max())
               for b, r in zip(tp.blocks, ref.blocks) for n in ("w1", "b1", "w2", "b2"))
    if rank == 0:
        print(f"largest relative loss difference {worst:.2e}; largest weight difference {diff:.2e}")
    if worst > a.tol:
        sys.exit(f"rank {rank}: the loss curves part by {worst:.2e} > --tol {a.tol}")


if __name__ == "__main__":
    main()
