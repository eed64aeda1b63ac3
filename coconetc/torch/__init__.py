"""PyTorch adoption: `coconetc.torch.DistributedOptimizer`, a `.ccn` optimizer step as a
`torch.optim.Optimizer`; `coconetc.torch.function`, a `.ccn` program as a differentiable torch
function (its backward pass the compiled derived program); `coconetc.torch.Module`, such a
function with its parameters (sliced for this rank) as an `nn.Module`.

    opt = DistributedOptimizer(model.parameters(), "examples/adam.ccn", schedule="zero",
                               lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
    loss.backward(); opt.step()             # every rank, with its own gradients

The program's tensor parameter named by `weights` receives the model's parameters, the one
named by `grads` their gradients; every other tensor parameter is optimizer state, kept here as
zeros in the layout the schedule gives it (this rank's slice under `slice(...)`); the scalar
named by `step` is the 1-based step count (a program with no scalar `step`, as SGD, takes
none); every other scalar lives in `param_groups` (so
`torch.optim.lr_scheduler` works). One call of the compiled function per parameter group and
step. `state_dict()` is the whole optimizer state on every rank (slices gathered), and
`load_state_dict()` slices it again for this optimizer's schedule and rank count.
The flat weights and gradients live in shared windows (coconetc.empty, collective over `comm`:
every rank constructs the optimizer, and adds each parameter group, at the same point, checked
under the watchdog) so that the fused collectives read the peers' gradients and updated weights
in place instead of copying them (docs/performance.md): by default (`shared_memory=None`) where
that is safe (the CPU backend, flat weights, every rank of `comm` on one node); `True` or
`False` forces it.
`backend=` (None: the parameters' device) picks the CPU module or the CUDA one (NCCL made from
`comm` or from a torch.distributed `process_group=`; CPU tensors for CUDA ones only under
COCONET_CUDA_EMULATE=1); `master=` names f32 master weights for mixed precision.
`across_groups=True` (both backends) takes every `sum`/`norm`/`max`/`min` of the program over
all parameter groups together, as `clip_grad_norm_(model.parameters())` and GradScaler's inf
check do: the groups' calls run as one batch (coconetc/runtime/batch.py) that stops at each
reduction until every group has its partial result (on CUDA, on the one stream of the step). After each step `opt.outputs` holds the program's outputs
per group; `skipped=` names one that, nonzero, means the step was skipped (it does not count),
and `feedback=` sets scalars from outputs (a loss scale), as GradScaler does.
Each `function`/`Module` call is a pair of torch.library custom operators (ops.py:
the forward, and the derived program as its autograd formula; fake implementations from the
program's types), so torch.compile and torch.export trace through it; DistributedOptimizer.step
is torch.compiler.disable'd (call it outside the compiled region).
See docs/pytorch.md. Needs PyTorch (`import coconetc` alone does not).

The package, a file per story:
  optimizer.py       DistributedOptimizer (its groups' buffers, the step, checkpoints)
  roles.py           which parameter of the optimizer's program is what
  differentiable.py  function (Differentiable): a program as an autograd function
  module.py          Module: such a function with its parameters
  ops.py             the torch.library custom operators of function / Module calls
  gpt.py             a nanoGPT block's weights in gpt_block.ccn's layouts, the sequence-parallel
                     region's edges, GPTPipeline: nanoGPT's GPT in pipeline stages
  sharded.py         shard / Sharded: a model's parameters kept sharded between steps (each
                     rank its slice_range of a dim), gathered for the forward, gradients
                     reduce-scattered, whole-tensor checkpoints on any rank count
  units.py           its units: gathered one at a time, their gradients reduce-scattered
  in_backward.py     Sharded.adamw_in_backward: AdamW inside the backward, fused into each
                     unit's reduce-scatter (examples/adamw_sharded.ccn)
  parts.py           what it computes with: each rank's part, agreeing, the collectives
  optim_state.py     a torch optimizer's state over the parts, whole, and back on any ranks
  params.py          what they share: the module loaded once, arguments bound and on the
                     backend's device, torch's params and param groups"""

from __future__ import annotations

try:
    import torch  # noqa: F401
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("coconetc.torch needs PyTorch (pip install torch)") from err

from typing import Any

from coconetc.torch import gpt
from coconetc.torch.differentiable import Differentiable, function
from coconetc.torch.module import Module
from coconetc.torch.sharded import Sharded, shard

__all__ = ["DistributedOptimizer", "Differentiable", "Module", "Sharded", "function", "gpt", "shard"]


def __getattr__(name: str) -> Any:
    """DistributedOptimizer imported on first use: its step's torch.compiler.disable imports
    torch._dynamo, which doubles the import of coconetc.torch (seconds in every rank) for a
    process that only calls functions."""
    if name == "DistributedOptimizer":
        from coconetc.torch.optimizer import DistributedOptimizer
        return DistributedOptimizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
