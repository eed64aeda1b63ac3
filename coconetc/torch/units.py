"""coconetc.torch.shard's units (sharded.py): the groups of parameters gathered together, each
only while its module runs, as FSDP2 gathers each `fully_shard`ed module.

A unit is a submodule and the parameters its subtree owns that no deeper unit owns; the root
unit is the whole module's remaining parameters (and every parameter tied across units).

Forward: a unit's pre-hook finishes its all-gather (started earlier, as a prefetch, where
PREFETCH > 0) and starts the gathers of the PREFETCH units that followed it in the last forward
(the first forward: in the order of the units); its forward hook puts the parts back on the
owning modules and, with RESHARD after forward (not the root's), frees the whole tensors'
storage (the tensors autograd saved stay, empty), hooking the unit's outputs. What one forward
of a unit leaves for its backward is a `Run`, held by that forward's graph (several forwards
before one backward each have theirs).

Backward: when it reaches a unit's outputs, the unit is gathered again into that storage and
the gathers of the PREFETCH units before it (in the forward's order) start. When the unit's
backward ends (its `_Gather` node: every use of its whole tensors done) the whole tensors are
freed and its gradients' reduce-scatter (and the whole parameters' all-reduce) starts,
non-blocking; it is waited for when the next unit's starts (one unit's gradient buffers in flight
at a time), the last at the end of the backward by a callback; each writes (accumulates) the
parts' .grad. With Sharded.adamw_in_backward, a unit's gradients go to its update instead
(in_backward.py: the fused reduce-scatter, no .grad).

Each unit has a communicator of its own (a Dup of the handle's), so that the ranks may start the
units' collectives in different orders (a unit whose backward did not run on a rank is caught up
by that callback); every collective is waited for under coconet's watchdog. The root unit is
gathered for the whole forward and backward (the root's own parameters are used around every
other unit's)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from coconetc.torch.ops import ranged
from coconetc.torch.parts import _REDUCE_DTYPES, Parts, Spec, _padded, part_index


@dataclass(eq=False)
class Unit:
    """One unit: its name ("" for the root), module, parameter names (in the handle's order)
    and communicator; its all-gather under way, if any."""
    name: str
    module: torch.nn.Module
    names: list[str]
    comm: Any = None
    gather: tuple[Any, torch.Tensor] | None = None  # an all-gather under way: (request, its buffer)
    run: Run | None = None  # its forward's, until the next forward of the model

    def label(self) -> str:
        return f"unit {self.name!r}" if self.name else "the root unit"


@dataclass(eq=False)
class Run:
    """One forward of a unit with a graph, for its backward: the storage of each whole sharded
    tensor it used (None for a parameter kept whole), whether freed, whether its backward ran.
    Held by its graph (the _Gather node, the output hooks) and by the unit until the next forward."""
    unit: Unit
    wanted: list[bool]  # which parameters want a gradient (requires_grad)
    storages: list[Any] = field(default_factory=list)
    freed: bool = False
    done: bool = False


@dataclass(eq=False)
class _Reduction:
    """A unit's gradients on their way: the requests, their buffers, and where each gradient lies."""
    unit: Unit
    reqs: list[tuple[Any, str]]
    flags: np.ndarray  # for each wanted parameter: some rank gave it a gradient
    wanted: list[int]  # the unit's indices of the parameters reduced
    where: dict[int, torch.Tensor]  # index -> its reduced gradient (ready once the requests are)
    keep: list[Any]  # the send buffers, alive until the requests end


class InBackward(Protocol):
    """What takes a unit's gradients instead of the reduction (in_backward.py's update)."""

    def gradients(self, run: Run, grads: list[torch.Tensor | None]) -> None: ...

    def backward_ended(self) -> None: ...


class _Gather(torch.autograd.Function):
    """Forward: a unit's whole tensors (its all-gather finished; its whole parameters as they
    are). Backward: the unit's backward has ended: its whole tensors freed, its gradients'
    reduction started (their parts' .grad written at the end of the backward, not returned)."""

    @staticmethod
    def forward(ctx: Any, units: Units, run: Run, *parts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.units, ctx.run = units, run
        ctx.set_materialize_grads(False)  # (an unused parameter's gradient comes as None, not zeros)
        wholes = units.finish_gather(run.unit, list(parts))
        run.storages = [w.untyped_storage() if s.dim is not None else None
                        for s, w in zip(units.specs(run.unit), wholes)]
        return tuple(wholes)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        ctx.units.backward_ended(ctx.run, list(grads))
        return (None, None, *(None for _ in grads))


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A contiguous tensor's strides."""
    out, n = [], 1
    for d in reversed(shape):
        out.append(n)
        n *= d
    return tuple(reversed(out))


class Units:
    """The units of one Sharded handle (PARTS), their gathers, reshards and reductions."""

    def __init__(self, parts: Parts, units: list[Unit], reshard: bool, prefetch: int):
        self.parts, self.units, self.reshard, self.prefetch = parts, units, reshard, prefetch
        self.root = units[0]
        self.runs: list[weakref.ref[Run]] = []  # the forwards' runs not backwarded yet, in order
        self.order: list[Unit] = units  # the order the last forward ran the units in (first: as listed)
        self.ran: list[Unit] = []  # the units this forward has run
        self.pending: list[_Reduction] = []
        self.queued = False  # the end-of-backward callback is queued
        self.in_backward: InBackward | None = None  # the update inside the backward, if asked

    def specs(self, u: Unit) -> list[Spec]:
        return [self.parts.specs[n] for n in u.names]

    def _cut(self, u: Unit) -> list[Spec]:
        return [s for s in self.specs(u) if s.dim is not None]

    # --- gathers -------------------------------------------------------------------------------
    def start_gather(self, u: Unit) -> None:
        """Starts U's all-gather (in place in one byte buffer), unless one is under way."""
        if u.gather is not None:
            return
        with ranged(f"coconet shard: start the all-gather of {u.label()}", "shard"):
            self._start_gather(u)

    def _start_gather(self, u: Unit) -> None:
        from mpi4py import MPI
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

    def finish_gather(self, u: Unit, parts: list[torch.Tensor] | None = None,
                      into: Run | None = None) -> list[torch.Tensor]:
        """U's gather (started here if it was not) waited for and its whole tensors written: new
        ones (PARTS, this rank's parts, give the whole parameters as they are), or, INTO a run,
        into the freed storage of the tensors its forward used (a gather again in the backward)."""
        self.start_gather(u)
        assert u.gather is not None
        req, buf = u.gather
        if req is not None:
            self.parts._wait(req, f"all-gather of {u.label()}", u.comm)
        u.gather = None
        with ranged(f"coconet shard: copy out the all-gather of {u.label()}", "shard"):
            return self._copy_out(u, buf, parts, into)

    def _copy_out(self, u: Unit, buf: torch.Tensor, parts: list[torch.Tensor] | None,
                  into: Run | None) -> list[torch.Tensor]:
        """finish_gather's whole tensors from U's gathered BUF."""
        p = self.parts
        out: list[torch.Tensor] = []
        displs = [sum(sum(_padded(s.nbytes(p.ranks, q)) for s in self._cut(u)) for q in range(r))
                  for r in range(p.ranks)]
        where = list(displs)
        for i, s in enumerate(self.specs(u)):
            if s.dim is None:
                out.append(parts[i].view_as(parts[i]) if parts is not None else p._params[s.name].detach())
                continue
            if into is not None:
                st = into.storages[i]
                size = int(np.prod(s.shape)) * s.dtype.itemsize
                if st.nbytes() == size:  # (not freed: its storage was not resizable)
                    where = [at + _padded(s.nbytes(p.ranks, r)) for r, at in enumerate(where)]
                    out.append(torch.empty(0))
                    continue
                st.resize_(size)
                w = torch.empty(0, dtype=s.dtype).set_(st, 0, s.shape, _strides(s.shape))  # (autograd's saved one's)
            else:
                w = torch.empty(s.shape, dtype=s.dtype)
            for r in range(p.ranks):
                n = s.nbytes(p.ranks, r)
                idx = part_index(s.shape, s.dim, p.ranks, r)
                w[idx].copy_(buf[where[r]:where[r] + n].view(s.dtype).view(s.part(p.ranks, r)))
                where[r] += _padded(n)
            out.append(w)
        if into is not None:
            into.freed = False
        return out

    @staticmethod
    def free(run: Run) -> None:
        """RUN's whole sharded tensors' storage freed (the tensors stay, empty, where autograd
        saved them); one handed to numpy (tensor.numpy(), as a compiled coconet program's
        arguments are) is not resizable and stays until its graph goes."""
        if not run.freed:
            for st in run.storages:
                if st is not None and st.resizable():
                    st.resize_(0)
                    run.freed = True

    def drop_gather(self, u: Unit) -> None:
        """A prefetched gather its unit did not use: waited for (every rank started it) and dropped."""
        if u.gather is not None and u.gather[0] is not None:
            self.parts._wait(u.gather[0], f"all-gather of {u.label()}", u.comm)
        u.gather = None

    # --- forward -------------------------------------------------------------------------------
    def before(self, u: Unit) -> list[torch.Tensor]:
        """U about to run: its whole tensors (the gathers of the PREFETCH units that ran after it
        in the last forward started first)."""
        if u is self.root:
            for v in self.units:
                v.run = None  # (a run lives on while its graph does)
            self.runs = [r for r in self.runs if r() is not None]
            self.ran = []
        self.start_gather(u)
        order = self.order if u in self.order else self.units
        at = order.index(u)
        for v in order[at + 1:at + 1 + self.prefetch]:
            self.start_gather(v)
        self.ran.append(u)
        tensors: list[torch.Tensor] = [self.parts._params[n] for n in u.names]
        wanted = [t.requires_grad for t in tensors]
        if torch.is_grad_enabled() and any(wanted):
            u.run = Run(u, wanted)
            self.runs.append(weakref.ref(u.run))
            return list(_Gather.apply(self, u.run, *tensors))
        u.run = None
        with torch.no_grad():
            return self.finish_gather(u, tensors)

    def after(self, u: Unit, output: Any) -> None:
        """U has run: its whole tensors freed (no graph: dropped; RESHARD, but the root's: their
        storage), its outputs hooked to gather it again (and prefetch) when the backward reaches it."""
        run = u.run
        if run is not None:
            if self.reshard and u is not self.root:
                self.free(run)
            for t in torch.utils._pytree.tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda g, run=run: self.before_backward(run))
        if u is self.root:
            self.order = self.ran  # (the next forward prefetches in this order)
            for v in self.units:
                self.drop_gather(v)  # (prefetched for a unit this forward did not run: stale after a step)

    # --- backward ------------------------------------------------------------------------------
    def _queue(self) -> None:
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.after_backward)

    def before_backward(self, run: Run) -> None:
        """The backward reaches RUN's outputs: its whole tensors gathered again where freed, the
        previous PREFETCH runs' (in the forwards' order) gathers started."""
        self._queue()
        if not run.freed:
            return
        live = [r for r in (ref() for ref in self.runs) if r is not None]
        if run in live:
            at = live.index(run)
            for r in reversed(live[max(0, at - self.prefetch):at]):
                if r.freed and not r.done:
                    self.start_gather(r.unit)
        self.finish_gather(run.unit, into=run)

    def backward_ended(self, run: Run, grads: list[torch.Tensor | None], wait: bool = True) -> None:
        """RUN's backward has ended (its _Gather node ran): whole tensors freed, reduction started."""
        self._queue()
        run.done = True
        self.free(run)
        self.start_reduce(run, grads, wait)

    def after_backward(self) -> None:
        """The end of the backward: a run whose backward did not run here (its outputs did not
        reach the loss on this rank) joins its collectives with no gradients; then every
        reduction is waited for and the parts' gradients written."""
        for r in reversed([ref() for ref in self.runs]):  # (the order a backward reaches them in)
            if r is not None and not r.done:
                if r.freed:
                    self.finish_gather(r.unit, into=r)  # (the other ranks gathered it again)
                # (no reduction waited for until every run has started its own: another rank's
                # backward may reach this one's units before its last one's reduction starts)
                self.backward_ended(r, [None] * len(r.unit.names), wait=False)
        self.runs = []
        self.queued = False
        self.flush()
        if self.in_backward is not None:
            self.in_backward.backward_ended()

    # --- gradients -----------------------------------------------------------------------------
    def start_reduce(self, run: Run, grads: list[torch.Tensor | None], wait: bool = True) -> None:
        """U's wanted gradients summed over the ranks, non-blocking: which exist on some rank (an
        all-reduce of flags), the sharded ones reduce-scattered to the parts, the whole ones
        all-reduced; in float32 (float64 for float64 parameters), one collective of each kind
        per such dtype. A gradient missing here counts as zeros."""
        if self.in_backward is not None:
            self.in_backward.gradients(run, grads)  # (the gradients go into the update, not to .grad)
            return
        if not any(run.wanted):
            return
        with ranged(f"coconet shard: start the gradients' reduce-scatter of {run.unit.label()}", "shard"):
            self._start_reduce(run, grads)
        if wait:
            self.flush(leave=1)  # (the earlier ones had a unit's backward to progress: their buffers go)

    def _start_reduce(self, run: Run, grads: list[torch.Tensor | None]) -> None:
        from mpi4py import MPI
        p, u = self.parts, run.unit
        wanted = [i for i, w in enumerate(run.wanted) if w]
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

    def flush(self, leave: int = 0) -> None:
        """Every reduction under way but the last LEAVE waited for, in the order started, and its
        gradients written to the parts' .grad (added to one already there, as autograd accumulates)."""
        cut = max(0, len(self.pending) - leave)
        pending, self.pending = self.pending[:cut], self.pending[cut:]
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
