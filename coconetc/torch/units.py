"""coconetc.torch.shard's units (sharded.py): the groups of parameters gathered together, each
only while its module runs, as FSDP2 gathers each `fully_shard`ed module.

A unit is a submodule and the parameters its subtree owns that no deeper unit owns; the root
unit is the whole module's remaining parameters (and every parameter tied across units). Its
forward pre-hook finishes the unit's all-gather (issued earlier, as a prefetch, where PREFETCH
> 0) and starts the next PREFETCH units' (in the order of the units); its forward hook puts the
parts back on the owning modules and, with RESHARD after forward, frees the whole tensors'
storage (the tensors autograd saved stay, empty), hooking the unit's outputs so that the
backward gathers again into that storage before the unit's backward ops run, and starts the
previous PREFETCH units' gathers (in the order the forward ran them). When the unit's backward
ends (the `_Gather` node, every use of its whole tensors done) the whole tensors are freed and
its gradients' reduce-scatter (and the whole parameters' all-reduce) starts, non-blocking; a
callback at the end of the backward waits for every one and writes (accumulates) the parts'
.grad. Each unit has a communicator of its own (a Dup of the handle's), so that the ranks may
start the units' collectives in different orders (a unit whose backward never ran on a rank is
caught up by that callback); every collective is waited for under coconet's watchdog.

The root unit is gathered for the whole forward and backward (the root's own parameters are
used around every other unit's)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from coconetc.torch.parts import _REDUCE_DTYPES, Parts, Spec, _padded, part_index


@dataclass(eq=False)
class Unit:
    """One unit: its name ("" for the root), module, parameter names (in the handle's order)
    and communicator; what it holds now."""
    name: str
    module: torch.nn.Module
    names: list[str]
    comm: Any = None
    whole: list[torch.Tensor] | None = None  # the tensors its forward used (the sharded ones' storage may be freed)
    gather: tuple[Any, torch.Tensor] | None = None  # an all-gather under way: (request, its buffer)
    graph: bool = False  # its last forward built a graph through it (its backward is due)
    freed: bool = False  # its whole sharded tensors' storage is freed (gather again to use them)
    done: bool = False  # its backward of the graph ran
    wanted: list[bool] = field(default_factory=list)  # which parameters want a gradient (requires_grad)

    def label(self) -> str:
        return f"unit {self.name!r}" if self.name else "the root unit"


@dataclass(eq=False)
class _Reduction:
    """A unit's gradients on their way: the requests, their buffers, and where each gradient lies."""
    unit: Unit
    reqs: list[tuple[Any, str]]
    flags: np.ndarray  # for each wanted parameter: some rank gave it a gradient
    wanted: list[int]  # the unit's indices of the parameters reduced
    where: dict[int, torch.Tensor]  # index -> its reduced gradient (ready once the requests are)
    keep: list[Any]  # the send buffers, alive until the requests end


class _Gather(torch.autograd.Function):
    """Forward: a unit's whole tensors (its all-gather finished; its whole parameters as they
    are). Backward: the unit's backward has ended: its whole tensors freed, its gradients'
    reduction started (their parts' .grad written at the end of the backward, not returned)."""

    @staticmethod
    def forward(ctx: Any, units: Units, unit: Unit, *parts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.units, ctx.unit = units, unit
        ctx.set_materialize_grads(False)  # (an unused parameter's gradient comes as None, not zeros)
        return tuple(units.finish_gather(unit, list(parts)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        ctx.units.backward_ended(ctx.unit, list(grads))
        return (None, None, *(None for _ in grads))


class Units:
    """The units of one Sharded handle (PARTS), their gathers, reshards and reductions."""

    def __init__(self, parts: Parts, units: list[Unit], reshard: bool, prefetch: int):
        self.parts, self.units, self.reshard, self.prefetch = parts, units, reshard, prefetch
        self.root = units[0]
        self.order: list[Unit] = []  # the units in the order this forward ran them
        self.pending: list[_Reduction] = []
        self.queued = False  # the end-of-backward callback is queued

    def specs(self, u: Unit) -> list[Spec]:
        return [self.parts.specs[n] for n in u.names]

    def _cut(self, u: Unit) -> list[Spec]:
        return [s for s in self.specs(u) if s.dim is not None]

    # --- gathers -------------------------------------------------------------------------------
    def start_gather(self, u: Unit) -> None:
        """Starts U's all-gather (in place in one byte buffer), unless its whole tensors are
        there or their gather is under way."""
        from mpi4py import MPI
        if u.gather is not None or (u.whole is not None and not u.freed):
            return
        p = self.parts
        cut = self._cut(u)
        counts = [sum(_padded(s.nbytes(p.ranks, r)) for s in cut) for r in range(p.ranks)]
        displs = [sum(counts[:r]) for r in range(p.ranks)]
        buf = torch.empty(sum(counts), dtype=torch.uint8)
        at = displs[p.rank]
        for s in cut:
            n = s.nbytes(p.ranks, p.rank)
            buf[at:at + n] = p._params[s.name].detach().contiguous().reshape(-1).view(torch.uint8)
            at += _padded(n)
        req = u.comm.Iallgatherv(MPI.IN_PLACE, [buf.numpy(), counts, displs, MPI.BYTE]) if cut else None
        u.gather = (req, buf)

    def finish_gather(self, u: Unit, parts: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """U's gather waited for and its whole tensors written: into the freed storage of the
        tensors its forward used (a gather again in the backward), else new ones (PARTS, this
        rank's parts, give the whole parameters as they are)."""
        self.start_gather(u)
        assert u.gather is not None
        req, buf = u.gather
        if req is not None:
            self.parts._wait(req, f"all-gather of {u.label()}", u.comm)
        u.gather = None
        p = self.parts
        refill = u.whole is not None and u.freed
        out: list[torch.Tensor] = []
        displs = [sum(sum(_padded(s.nbytes(p.ranks, q)) for s in self._cut(u)) for q in range(r))
                  for r in range(p.ranks)]
        where = list(displs)
        for i, s in enumerate(self.specs(u)):
            if s.dim is None:
                out.append(u.whole[i] if refill and u.whole is not None else parts[i].view_as(parts[i])
                           if parts is not None else p._params[s.name].detach())
                continue
            if refill and u.whole is not None:
                w = u.whole[i]
                w.untyped_storage().resize_(w.numel() * w.element_size())
                target = w.data  # (its own version counter: autograd's saved copy stays valid)
            else:
                w = target = torch.empty(s.shape, dtype=s.dtype)
            for r in range(p.ranks):
                n = s.nbytes(p.ranks, r)
                idx = part_index(s.shape, s.dim, p.ranks, r)
                target[idx].copy_(buf[where[r]:where[r] + n].view(s.dtype).view(s.part(p.ranks, r)))
                where[r] += _padded(n)
            out.append(w)
        u.freed = False
        return out

    def free(self, u: Unit) -> None:
        """U's whole sharded tensors' storage freed (the tensors stay, empty, where autograd
        saved them)."""
        if u.whole is not None and not u.freed:
            for s, w in zip(self.specs(u), u.whole):
                if s.dim is not None:
                    w.untyped_storage().resize_(0)
            u.freed = True

    def drop_gather(self, u: Unit) -> None:
        """A prefetched gather its unit did not use: waited for (every rank started it) and dropped."""
        if u.gather is not None and u.gather[0] is not None:
            self.parts._wait(u.gather[0], f"all-gather of {u.label()}", u.comm)
        u.gather = None

    # --- forward -------------------------------------------------------------------------------
    def before(self, u: Unit) -> list[torch.Tensor]:
        """U about to run: its whole tensors (the next PREFETCH units' gathers started first)."""
        if u is self.root:
            self.order = []
            for v in self.units:  # a forward whose graph was dropped without a backward
                v.whole, v.freed, v.graph, v.done = None, False, False, False
        self.start_gather(u)
        at = self.units.index(u)
        for v in self.units[at + 1:at + 1 + self.prefetch]:
            self.start_gather(v)
        tensors: list[torch.Tensor] = [self.parts._params[n] for n in u.names]
        u.wanted = [t.requires_grad for t in tensors]
        u.graph = torch.is_grad_enabled() and any(u.wanted)
        u.done = False
        if u.graph:
            wholes = list(_Gather.apply(self, u, *tensors))
        else:
            with torch.no_grad():
                wholes = self.finish_gather(u, tensors)
        u.whole, u.freed = wholes, False
        if u not in self.order:
            self.order.append(u)
        return wholes

    def after(self, u: Unit, output: Any) -> None:
        """U has run: its whole tensors freed (no graph; or RESHARD, but the root's), its outputs
        hooked to gather it again (and prefetch) when the backward reaches it."""
        if not u.graph:
            self.free(u)
            u.whole = None
        else:
            if self.reshard and u is not self.root:
                self.free(u)
            tensors = [t for t in torch.utils._pytree.tree_leaves(output)
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            for t in tensors:
                t.register_hook(lambda g, u=u: self.before_backward(u))
        if u is self.root:
            for v in self.units:
                self.drop_gather(v)  # (prefetched for a unit this forward did not run: stale after a step)

    # --- backward ------------------------------------------------------------------------------
    def _queue(self) -> None:
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.after_backward)

    def before_backward(self, u: Unit) -> None:
        """The backward reaches U's outputs: its whole tensors gathered again where freed, the
        previous PREFETCH units' (in the forward's order) gathers started."""
        self._queue()
        if not u.graph or u.done:
            return
        if u.freed:
            self.finish_gather(u)
        if u in self.order:
            at = self.order.index(u)
            for v in reversed(self.order[max(0, at - self.prefetch):at]):
                if v.graph and not v.done and v.freed:
                    self.start_gather(v)

    def backward_ended(self, u: Unit, grads: list[torch.Tensor | None]) -> None:
        """U's backward has ended (its _Gather node ran): whole tensors freed, reduction started."""
        self._queue()
        u.done = True
        self.free(u)
        u.whole = None
        self.start_reduce(u, grads)

    def after_backward(self) -> None:
        """The end of the backward: a unit whose backward did not run here (its outputs did not
        reach the loss on this rank) joins its collectives with no gradients; then every
        reduction is waited for and the parts' gradients written."""
        self.queued = False
        for u in self.order:
            if u.graph and not u.done:
                if u.freed:
                    self.finish_gather(u)  # (the other ranks gathered it again)
                self.backward_ended(u, [None] * len(u.names))
        for u in self.units:
            u.graph = False
        self.queued = False
        self.flush()

    # --- gradients -----------------------------------------------------------------------------
    def start_reduce(self, u: Unit, grads: list[torch.Tensor | None]) -> None:
        """U's wanted gradients summed over the ranks, non-blocking: which exist on some rank (an
        all-reduce of flags), the sharded ones reduce-scattered to the parts, the whole ones
        all-reduced; in float32 (float64 for float64 parameters), one collective of each kind
        per such dtype. A gradient missing here counts as zeros."""
        from mpi4py import MPI
        p = self.parts
        wanted = [i for i, w in enumerate(u.wanted) if w]
        if not wanted:
            return
        specs = self.specs(u)
        flags = np.array([grads[i] is not None for i in wanted], dtype=np.uint8)
        reqs: list[tuple[Any, str]] = [(u.comm.Iallreduce(MPI.IN_PLACE, flags, MPI.MAX),
                                        f"all-reduce of which gradients of {u.label()} exist")]
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in wanted:
            by_dtype.setdefault(_REDUCE_DTYPES.get(specs[i].dtype, torch.float32), []).append(i)
        where: dict[int, torch.Tensor] = {}
        keep: list[Any] = []
        for rdt, idx in by_dtype.items():
            def whole(i: int, rdt: torch.dtype = rdt) -> torch.Tensor:
                g = grads[i]
                return torch.zeros(specs[i].shape, dtype=rdt) if g is None else g.to(rdt)
            cut = [i for i in idx if specs[i].dim is not None]
            if cut:
                wholes = {i: whole(i) for i in cut}
                send = torch.cat([wholes[i][part_index(specs[i].shape, specs[i].dim, p.ranks, r)].reshape(-1)
                                  for r in range(p.ranks) for i in cut])
                del wholes
                counts = [sum(int(np.prod(specs[i].part(p.ranks, r))) for i in cut) for r in range(p.ranks)]
                recv = torch.empty(counts[p.rank], dtype=rdt)
                reqs.append((u.comm.Ireduce_scatter(send.numpy(), recv.numpy(), counts, MPI.SUM),
                             f"reduce-scatter of the gradients of {u.label()}"))
                keep.append(send)
                at = 0
                for i in cut:
                    shape = specs[i].part(p.ranks, p.rank)
                    n = int(np.prod(shape))
                    where[i] = recv[at:at + n].view(shape)
                    at += n
            kept = [i for i in idx if specs[i].dim is None]
            if kept:
                flat = torch.cat([whole(i).reshape(-1) for i in kept])
                reqs.append((u.comm.Iallreduce(MPI.IN_PLACE, flat.numpy(), MPI.SUM),
                             f"all-reduce of the whole parameters' gradients of {u.label()}"))
                at = 0
                for i in kept:
                    where[i] = flat[at:at + int(np.prod(specs[i].shape))].view(specs[i].shape)
                    at += where[i].numel()
        self.pending.append(_Reduction(u, reqs, flags, wanted, where, keep))

    def flush(self) -> None:
        """Every reduction under way waited for, in the order started, and its gradients
        written to the parts' .grad (added to one already there, as autograd accumulates)."""
        pending, self.pending = self.pending, []
        scale = 1 / self.parts.ranks if self.parts.reduce == "avg" else 1
        for red in pending:
            for req, what in red.reqs:
                self.parts._wait(req, what, red.unit.comm)
            for k, i in enumerate(red.wanted):
                if not red.flags[k]:
                    continue
                name = red.unit.names[i]
                param = self.parts._params[name]
                g = red.where[i]
                g = (g * scale if scale != 1 else g).to(param.dtype)
                if param.grad is None:
                    param.grad = g.clone() if g._base is not None else g  # (not a view of the buffer)
                else:
                    param.grad.add_(g)
