"""AdamW inside the backward of a sharded model (Sharded.adamw_in_backward): each unit's
parameters are updated as soon as the backward has made their gradients, the sharded ones by
examples/adamw_sharded.ccn's `adamw_shard` under its `fused` schedule (the reduce-scatter of the
gradients updating each chunk of this rank's parts as it arrives), the whole ones by its
`adamw_whole` (an all-reduce, then the update). No gradient is stored: the parameters' .grad
stay None.

A unit's call takes one flat vector of its parameters: for the sharded ones, rank r's parts
laid end to end from r * C (C: the largest rank's total, the rest zeros), so that the
program's `sliced` slice of a rank is its parts. This rank's parts, m and v live in three such
slices of their own, one for each call (a unit's parameters of one kind, param group and step
count): each parameter's data and its state (kept per parameter, shaped as its part, as
torch's AdamW keeps it) are views into them, so the call updates them in place, with no copy
and no buffer made for it. A tensor that was replaced since (a checkpoint loaded) is copied
into new slices at the next call.

The units are updated in one order on every rank (the reverse of shard()'s list of them, the
root last: the order a backward ends them in), a unit once its gradients are complete (every
forward of it in this backward has had its backward); a unit whose backward ends early waits
for those before it. So ranks whose backwards end the units in different orders (a unit that
did not reach the loss on one rank is caught up at the end of its backward) still make the
blocking calls in the same order."""

from __future__ import annotations

from dataclasses import dataclass, field
import math
from typing import TYPE_CHECKING, Any

import torch

from coconetc.torch.ops import profiled
from coconetc.torch.parts import part_index

if TYPE_CHECKING:
    from coconetc.torch.units import Run, Unit, Units

SOURCE = "adamw_sharded.ccn"  # (shipped with coconet: coconetc.paths.source_path)


@dataclass(eq=False)
class _Backward:
    """One backward's progress: the units to update in order, the next one's index, each
    unit's gradients summed over its forwards' backwards so far."""
    order: list[Unit]
    next: int = 0
    grads: dict[Unit, list[torch.Tensor | None]] = field(default_factory=dict)
    complete: set[Unit] = field(default_factory=set)


class AdamWInBackward(torch.optim.Optimizer):
    """What Sharded.adamw_in_backward() returns: a torch optimizer (its param groups: the
    module's trainable parameters, or those given; lr, betas, eps and weight_decay as
    torch.optim.AdamW's, per group, read at each unit's update, so a learning-rate scheduler
    works) whose state is torch.optim.AdamW's (step,
    exp_avg, exp_avg_sq, shaped as this rank's parts), so that Sharded.save/load and
    optim_state_dict take it as they take an AdamW. Its step() updates nothing: the backward
    did (a training loop that calls it, and a scheduler that wants it called, work as before)."""

    def __init__(self, units: Units, params: Any, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, shared_memory: bool = False):
        import coconetc
        from coconetc.paths import source_path
        if params is None:
            params = [t for t in units.parts._params.values() if t.requires_grad]
        super().__init__(params, dict(lr=float(lr), betas=(float(betas[0]), float(betas[1])), eps=float(eps),
                                      weight_decay=float(weight_decay)))
        mine = {id(t) for t in units.parts._params.values()}
        for g, group in enumerate(self.param_groups):
            for k, t in enumerate(group["params"]):
                if id(t) not in mine:
                    raise ValueError(f"param group {g} holds a tensor that is not one of the sharded module's "
                                     f"parameters (its {k}th, shaped {tuple(t.shape)})")
        self._units = units
        self._mod = coconetc.load(source_path(SOURCE), log=lambda msg: None)
        self._backward: _Backward | None = None
        # the sharded update's fused collective: point to point (its buffers go with the call)
        # unless asked through the shared-memory window (kept, sized by the largest unit)
        self._fused = "fused@shm" if shared_memory else "fused@p2p"
        # each call's parts, m and v (the tensors' storage), by the call's parameters' names
        self._flats: dict[tuple[str, ...], list[torch.Tensor]] = {}

    @torch.no_grad()
    def step(self, closure=None):
        """Nothing to update (the backward did); CLOSURE, if given, is called (under grad)."""
        if closure is not None:
            with torch.enable_grad():
                return closure()
        return None

    # --- the backward --------------------------------------------------------------------------
    def gradients(self, run: Run, grads: list[torch.Tensor | None]) -> None:
        """RUN's backward has ended with GRADS (the whole gradients of its unit's parameters):
        summed with the unit's other forwards' in this backward; the units complete by now
        updated, in order."""
        units = self._units
        live = [r for r in (ref() for ref in units.runs) if r is not None]
        if self._backward is None:
            with_runs = {r.unit for r in live} | {run.unit}
            self._backward = _Backward([u for u in reversed(units.units) if u in with_runs])
        bw, u = self._backward, run.unit
        acc = bw.grads.setdefault(u, [None] * len(grads))
        for i, g in enumerate(grads):
            if g is not None and run.wanted[i]:
                have = acc[i]
                # (autograd is done with G: kept as it is, and summed into in place where this
                # unit ran more than once)
                acc[i] = g.detach() if have is None else have.add_(g)
        if any(r.unit is u and not r.done and r is not run for r in live):
            return  # (another forward of this unit has its backward still to come)
        bw.complete.add(u)
        while bw.next < len(bw.order) and bw.order[bw.next] in bw.complete:
            done = bw.order[bw.next]
            self._update(done, bw.grads.pop(done))
            bw.next += 1

    def backward_ended(self) -> None:
        """The end of a backward (every run caught up): the next backward starts afresh."""
        bw, self._backward = self._backward, None
        if bw is not None and bw.next != len(bw.order):
            left = [u.label() for u in bw.order[bw.next:]]
            raise RuntimeError(f"coconetc.torch.Sharded.adamw_in_backward: the backward ended with "
                               f"{', '.join(left)} not updated")

    # --- one unit's update ---------------------------------------------------------------------
    def _update(self, u: Unit, grads: list[torch.Tensor | None]) -> None:
        p = self._units.parts
        specs = [p.specs[n] for n in u.names]
        group_of = {id(t): g for g, group in enumerate(self.param_groups) for t in group["params"]}
        wanted = [i for i, s in enumerate(specs) if p._params[s.name].requires_grad and id(p._params[s.name]) in group_of]
        for i in wanted:
            t = p._params[specs[i].name]
            if not self.state[t]:
                self.state[t] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(t.detach()),
                                 "exp_avg_sq": torch.zeros_like(t.detach())}
        # one call for each kind (sharded, whole), param group and step count (a parameter
        # frozen for a while has counted fewer steps): the same calls on every rank
        groups: dict[tuple[bool, int, int], list[int]] = {}
        for i in wanted:
            t = p._params[specs[i].name]
            step = int(self.state[t]["step"].item()) + 1
            groups.setdefault((specs[i].dim is not None, group_of[id(t)], step), []).append(i)
        scale = 1 / p.ranks if p.reduce == "avg" else 1.0
        for (cut, g, step), idx in groups.items():
            h = self.param_groups[g]
            args = dict(scale=scale, lr=float(h["lr"]), beta1=float(h["betas"][0]), beta2=float(h["betas"][1]),
                        eps=float(h["eps"]), wd=float(h["weight_decay"]), step=float(step))
            mine = [grads[i] for i in idx]
            for i in idx:
                grads[i] = None  # (each whole gradient goes once copied into the call's buffer)
            if cut:
                self._sharded(u, [specs[i] for i in idx], mine, args)
            else:
                self._whole(u, [specs[i] for i in idx], mine, args)
            for i in idx:
                self.state[p._params[specs[i].name]]["step"].fill_(float(step))

    def _sharded(self, u: Unit, specs: list, grads: list[torch.Tensor | None], args: dict[str, float]) -> None:
        R = self._units.parts.ranks
        C = max(sum(math.prod(s.part(R, r)) for s in specs) for r in range(R))
        send = torch.zeros(R * C, dtype=torch.float32)
        for r in range(R):
            at = r * C
            for s, g in zip(specs, grads):
                n = math.prod(s.part(R, r))
                if g is not None and n:
                    send[at:at + n] = g[part_index(s.shape, s.dim, R, r)].reshape(-1)
                at += n
        grads.clear()
        self._call(self._mod.adamw_shard, u, specs, send, C, dict(args, schedule=self._fused))

    def _whole(self, u: Unit, specs: list, grads: list[torch.Tensor | None], args: dict[str, float]) -> None:
        g = torch.cat([(torch.zeros(s.shape, dtype=torch.float32) if gr is None else gr).reshape(-1) for s, gr in zip(specs, grads)])
        grads.clear()
        self._call(self._mod.adamw_whole, u, specs, g, g.numel(), args)

    def _call(self, program: Any, u: Unit, specs: list, g: torch.Tensor, size: int, args: dict[str, Any]) -> None:
        """PROGRAM on U's communicator with gradient G and this rank's SPECS' parameters, m and v
        laid end to end in vectors of SIZE elements, updated in place (_flat)."""
        w, m, v = self._flat([s.name for s in specs], size)
        with profiled(program, args.get("schedule") or "default"):
            program(comm=u.comm, g=g, w=w, m=m, v=v, **args)

    def _tensors(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = self._units.parts._params[name]
        st = self.state[t]
        return t.data, st["exp_avg"], st["exp_avg_sq"]

    def _flat(self, names: list[str], size: int) -> list[torch.Tensor]:
        """The three vectors of SIZE elements whose slices are NAMES' parameters, m and v laid
        end to end: the ones made for these names at an earlier call if every tensor is still
        its view there, else new ones (the values copied in, and the parameters' data and state
        made views into them; the vectors of another call that shared a name dropped)."""
        key = tuple(names)
        flats = self._flats.get(key)
        if flats is not None and flats[0].numel() == size and self._views(names, flats):
            return flats
        for other in [k for k in self._flats if k != key and set(k) & set(names)]:
            del self._flats[other]
        flats = [torch.zeros(size, dtype=torch.float32) for _ in range(3)]
        at = 0
        for name in names:
            t = self._units.parts._params[name]
            views = [f[at:at + t.numel()].view(t.shape) for f in flats]
            with torch.no_grad():
                for view, src in zip(views, self._tensors(name)):
                    view.copy_(src)
            t.data = views[0]
            self.state[t]["exp_avg"], self.state[t]["exp_avg_sq"] = views[1], views[2]
            at += t.numel()
        self._flats[key] = flats
        return flats

    def _views(self, names: list[str], flats: list[torch.Tensor]) -> bool:
        """Whether every one of NAMES' tensors is still its view into FLATS."""
        at = 0
        for name in names:
            ts = self._tensors(name)
            for f, t in zip(flats, ts):
                if t.numel() and (t.data_ptr() != f.data_ptr() + f.element_size() * at or not t.is_contiguous()
                                  or t.dtype != torch.float32):
                    return False
            at += ts[0].numel()
        return True


def check_parameters(units: Units) -> None:
    """Every parameter that wants a gradient is float32 (the program's type): else a ValueError
    naming the first that is not."""
    p = units.parts
    for s in p.specs.values():
        t = p._params[s.name]
        if t.requires_grad and s.dtype != torch.float32:
            raise ValueError(f"coconetc.torch.Sharded.adamw_in_backward: parameter {s.name!r} is {s.dtype}; "
                             f"the update inside the backward steps float32 parameters (set its "
                             f"requires_grad=False, or leave adamw_in_backward out and step the model "
                             f"with a torch.optim optimizer after the backward)")
