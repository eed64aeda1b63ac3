"""`Module`: a differentiable program (`function`) with its parameters, this rank's part of
each, as a `torch.nn.Module`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from coconetc.runtime import layout
from coconetc.torch.differentiable import function
from coconetc.torch.params import bind
from coconetc.torch.parts import joined


class Module(torch.nn.Module):
    """A differentiable program with its parameters: `parameters` maps some of the program's
    tensor parameters to their FULL values (the same on every rank, e.g. from one seeded
    initialisation); each becomes an `nn.Parameter` holding this rank's part in the program's
    layout (sliced: this rank's slice; replicated: the whole tensor), so a tensor-parallel
    layer is a module and any torch optimizer trains it. `forward(*rest, **rest)` takes the
    other parameters (positional ones in the program's order: `layer(x)`). `full(name)` gathers a parameter's whole value (collective over `comm`).
    The other keywords are `function`'s.

        layer = coconetc.torch.Module("tp_mlp.ccn", "tp_mlp", parameters={"w1": w1, "b1": b1, ...})
        y = layer(x=x); loss(y).backward(); opt.step()
    """

    def __init__(self, source: str | Path, program: str | None = None, *, parameters: dict[str, torch.Tensor],
                 schedule: str = "default", grad_schedule: str = "default", comm: Any = None, groups: int = 1,
                 backend: str | None = None, process_group: Any = None):
        super().__init__()
        self.fn = function(source, program, schedule=schedule, grad_schedule=grad_schedule, comm=comm,
                           groups=groups, backend=backend, process_group=process_group)
        self.groups = groups
        p = self.fn.program
        gs, r = self._position()
        self._index: dict[str, tuple[slice, ...]] = {}
        for name, full in parameters.items():
            q = layout.param(p, name, f"coconetc.torch.Module({p.name})")
            if q.scalar or q.type.layout.kind == "local":
                raise ValueError(f"coconetc.torch.Module({p.name}): parameter {name!r} is {q.type}: only "
                                 "replicated or sliced tensors can be module parameters")
            if full.dim() != q.type.ndim:
                raise ValueError(f"coconetc.torch.Module({p.name}): {name!r} is {q.type}, got a "
                                 f"{full.dim()}-d tensor")
            index = layout.local_index(q, list(full.shape), gs, r)
            self._index[name] = index
            self.register_parameter(name, torch.nn.Parameter(full.detach()[index].clone().contiguous()))

    def _position(self) -> tuple[int, int]:
        """(ranks per group, this rank's index in its group)."""
        return self.fn._position()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        rest = [q.name for q in self.fn.program.params if q.name not in self._index]
        kwargs = bind(self.fn.program.name, rest, args, kwargs)
        clash = sorted(set(kwargs) & set(self._index))
        if clash:
            raise TypeError(f"{self.fn.program.name}: {clash[0]!r} is a parameter of the module; do not pass it")
        return self.fn(**{name: getattr(self, name) for name in self._index}, **kwargs)

    def full(self, name: str) -> torch.Tensor:
        """Parameter NAME's whole value, gathered from the ranks' parts (collective over the
        ranks of this rank's group)."""
        part = getattr(self, name).detach()
        q = layout.param(self.fn.program, name, "Module.full")
        if not q.type.layout.sliced:
            return part.clone()
        gs, r = self._position()
        comm = self.fn.comm
        if comm is None:  # a torch.distributed process group
            import torch.distributed as dist
            parts: list[Any] = [None] * dist.get_world_size(self.fn.process_group)
            dist.all_gather_object(parts, part.cpu(), group=self.fn.process_group)
            mine = (dist.get_rank(self.fn.process_group) // gs) * gs
            parts = parts[mine:mine + gs]
            return torch.cat(parts, dim=q.type.layout.dim).to(part.device)
        group = comm if self.groups == 1 else comm.Split(comm.Get_rank() // gs, r)
        try:
            return joined(group, [part], [q.type.layout.dim])[0]
        finally:
            if group is not comm:
                group.Free()
