"""Pipeline parallelism: a model cut into stages of ranks, trained on micro-batches in an order
of coconetc.pipeline.orders (GPipe, 1F1B, interleaved 1F1B, zero bubble), its blocks `.ccn`
programs (docs/pipeline.md).

    block = Block("gpt_block.ccn", "gpt_block_sp", comm=tp_comm)        # the compiled programs
    layers = [block.layer(params_of_layer_l, scale=0.125, pdrop=0.0, seed=l) for l in mine]
    pipe = Pipeline([Chunk(layers, pre=embed, post=head)], "1f1b", microbatches=4,
                    comm=pp_comm, loss_fn=loss)
    loss = pipe.step(idx, target)           # every rank of the pipeline, together
    pipe.clip_grad_norm_(1.0, embed_and_head_params)  # before opt.step(): the whole model's norm
    val = pipe.eval(idx, target, pdrop=0.0) # forward only (torch's schedule.eval): the batch's loss

A `Chunk` is what one virtual stage computes on this rank: an optional torch module first (the
first stage's embeddings), coconet layers, an optional torch module last (the last stage's
head). A coconet layer runs the compiled programs directly: its forward `<p>_fwd` keeps the
saved values per micro-batch; its backward is `<p>_bwd`, or, in the zero-bubble order, the
compiler's split of it at the input (autodiff/saved.py): `<p>_bwd_input` (B: the gradient the
previous stage waits for) and `<p>_bwd_weight` (W: the weights' gradients, run later to fill
the bubbles). From a step's second micro-batch on (each weight's `.grad` there), the backward
is the accumulating cut `<p>_bwd_acc` (W: `<p>_bwd_weight_acc`), which adds the weights'
gradients into their `.grad` in place (its weight-gradient GEMMs with beta = 1) instead of
returning new tensors that are then added. The torch modules run under autograd; their weight
gradients are made in B.

Between stages each rank sends to the same rank of the next stage's tensor-parallel group
(`comm` holds one rank of each stage: pipeline rank = stage). Where the block's input is
replicated across the group (tensor parallelism without sequence parallelism) each rank sends
only its slice of the activation along the sequence and the receiving group all-gathers it
(the CoCoNet paper's pipeline optimization); a sequence-parallel block's input is sliced
already and is sent as it is. Sends do not block (the rank goes on with its next action).
Receives are posted ahead (Irecv into buffers of the shapes a previous step with a batch of
this shape sent; the first such step sends a header with each message) and waited for where
their value is used; between layers the rank lets MPI move the messages in flight.

The loss of each micro-batch is divided by the number of micro-batches, so the gradients are
those of the batch's mean loss, as one process computes them (scale_grads=False: their sum)."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from coconetc.ir.expr import Op, refs, walk
from coconetc.launch.mpiexec import oversubscribed
from coconetc.pipeline import orders as _orders
from coconetc.plan.label import parse
from coconetc.torch.ops import profiled, ranged
from coconetc.torch.params import load

F, B, W = "F", "B", "W"
_HEADER = 10  # int64s: the dtype's index in _DTYPES, ndim, then up to 8 dims
# what a message between stages is sent as, by the tensor's dtype (_TORCH): bfloat16, which NumPy
# lacks, as its bits (int16, which no message is otherwise)
_DTYPES = (np.float32, np.float64, np.float16, np.int16)
_TORCH = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_KINDS = {F: 0, B: 1}
_NAP = 5e-5  # s between a waiting rank's polls where ranks outnumber cores (Pipeline._wait)
_AHEAD = 2  # receives of each kind (activations, gradients) posted ahead of the one waited for
_MADE = itertools.count()  # the pipelines this process made, in order (every rank makes them together)
RETIMED = 3  # steps after each of which a list-scheduled order is scheduled again (Pipeline retime=)


class Block:
    """The compiled programs of one `.ccn` block (PROGRAM of SOURCE) that a pipeline's layers
    run: `<p>_fwd`, `<p>_bwd`, its split at INPUT `<p>_bwd_input` / `<p>_bwd_weight`, and the
    accumulating `<p>_bwd_acc` / `<p>_bwd_weight_acc`.
    INPUT: the block's carried parameter (its activation in, of the output's shape and layout).
    comm: the stage's tensor-parallel group (every rank of it calls the block together).
    backend: "cpu", or "cuda" (CUDA tensors; with COCONET_CUDA_EMULATE=1 the host emulation,
    on CPU tensors). Messages between stages go through MPI from host memory either way."""

    def __init__(self, source: str | Path, program: str, *, comm: Any, input: str = "x",
                 schedule: str = "default", grad_schedule: str = "default", derive: str | None = None,
                 backend: str = "cpu"):
        from coconetc.autodiff.saved import acc_name, accumulator, bwd_name, fwd_name, input_name, weight_name
        self.source, self.program, self.input, self.comm = source, program, input, comm
        self.schedule, self.grad_schedule = schedule, grad_schedule
        # the module's derived programs (coconetc.load's grad=): the block's, cut at its input;
        # a pipeline schedule's stages are derived from their model program (from_schedule)
        if backend not in ("cpu", "cuda"):
            raise ValueError(f"Block: backend must be 'cpu' or 'cuda', got {backend!r}")
        # (+acc: the backwards that add the weights' gradients into their .grad in place)
        mod = load(source, ((derive or f"{program}:{input}") + "+acc",), "coconetc.torch.pipeline.Block",
                   backend=backend)
        # what the module's calls communicate on (NCCL from COMM for the CUDA backend; under
        # COCONET_CUDA_EMULATE=1 the emulation, on CPU tensors)
        self.call_comm = mod.backend.communicator(mod, comm)
        self.fwd = mod.programs[fwd_name(program)]
        # the program itself, which keeps nothing for a backward (Pipeline.eval); None where the
        # module lacks it (its layers then run the forward above and drop what it keeps)
        self.plain = mod.programs.get(program)
        self.bwd = mod.programs[bwd_name(program)]
        self.bwd_input = mod.programs[input_name(program)]
        self.bwd_weight = mod.programs[weight_name(program)]
        self.bwd_acc = mod.programs[acc_name(bwd_name(program))]
        self.bwd_weight_acc = mod.programs[acc_name(weight_name(program))]
        self._check_schedules(mod, program)
        # each function's schedule and the names of its outputs, by function (a call's results)
        self._results: dict[str, tuple[str, list[str]]] = {}
        p = self.fwd.program_of(parse(self._sched(self.fwd, schedule)))
        self.params = [q.name for q in p.params]
        if input not in self.params:
            raise ValueError(f"Block: {program} has no parameter {input!r} (its parameters: {', '.join(self.params)})")
        q = next(q for q in p.params if q.name == input)
        outs = [pub for pub, _ in p.outputs if not pub.startswith("saved_")]
        if len(outs) != 1:
            raise ValueError(f"Block: {program} returns {len(outs)} values; a pipeline's block returns one "
                             f"(its next layer's {input!r})")
        self.output = outs[0]
        self._decl = {q.name: q for q in p.params}
        self.replicated = q.type.layout.kind == "replicated"
        self.scalars = [q.name for q in p.params if q.scalar]
        self.weights = [n for n in self.params if n != input and n not in self.scalars]
        # the scalars the block's dropouts draw their masks from: each micro-batch's its own
        # (microbatch_seed)
        self.seeds = sorted({n for st in p.stages for e in walk(st.expr) if isinstance(e, Op) and e.op == "dropout"
                             for n in refs(e.args[2]) if n in self.scalars})
        # by accumulating backward, the weights whose gradients it adds into: weight -> its
        # accumulator parameter (the weight's .grad is passed there)
        self.accumulated = {}
        for fn in (self.bwd_acc, self.bwd_weight_acc):
            takes = {q.name for q in fn.program_of(parse("default")).params}
            self.accumulated[fn.name] = {w: accumulator(w) for w in self.weights if accumulator(w) in takes}

    def _check_schedules(self, mod: Any, program: str) -> None:
        """A schedule that PROGRAM (grad_schedule: its derived program) does not have: a
        ValueError naming the argument, before anything runs. One it has that does not apply to
        the cut program a layer runs (it names values the cut lacks): a warning, as
        coconetc.torch.function gives; that program then runs unscheduled."""
        import warnings

        from coconetc.sourcefile import grad_name
        for what, s, whole, cut in (("schedule", self.schedule, program, self.fwd),
                                    ("grad_schedule", self.grad_schedule, grad_name(program), self.bwd)):
            if s == "default" or s in cut.schedules:
                continue
            has = [n for n in (mod.programs[whole].schedules if whole in mod.programs else ()) if n != "default"]
            applies = ", ".join(repr(n) for n in cut.schedules if n != "default") or "none but the default"
            if s not in has:
                raise ValueError(f"Block: {what}={s!r}: {whole} has no such schedule (its schedules: "
                                 f"{', '.join(repr(n) for n in has) or 'none but the default'}; those that apply "
                                 f"to {cut.name}, which a layer runs: {applies})")
            warnings.warn(f"Block: {what} {s!r} names values {cut.name} does not have, so each layer runs {cut.name} "
                          f"unscheduled (the schedules that apply to it: {applies})", stacklevel=3)

    @staticmethod
    def _sched(fn: Any, schedule: str) -> str:
        """SCHEDULE where FN has it, else the default (a grad schedule that does not apply to
        the split programs: they run unscheduled)."""
        return schedule if schedule in fn.schedules else "default"

    def call(self, fn: Any, schedule: str, **kw: Any) -> dict[str, torch.Tensor]:
        """FN (one of this block's functions) under SCHEDULE where it has it: its outputs by name."""
        if fn.name not in self._results:
            label = self._sched(fn, schedule)
            self._results[fn.name] = (label, [pub for pub, _ in fn.program_of(parse(label)).outputs])
        label, names = self._results[fn.name]
        with profiled(fn, label):
            out = fn(schedule=label, comm=self.call_comm, **kw)
        return dict(zip(names, out if isinstance(out, tuple) else (out,)))

    def parts(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's parts of one layer's whole WEIGHTS (name -> the whole tensor, as on one
        process) in the block's layouts on its tensor-parallel group `comm`: each a new leaf
        tensor (a copy) whose `.grad` the pipeline fills, for `layer`. A replicated weight's part
        is all of it."""
        from coconetc.runtime.layout import local_index
        extra = sorted(set(weights) - set(self.weights))
        if extra:
            raise TypeError(f"Block.parts: {self.program} has no weight {extra[0]!r} (its weights: "
                            f"{', '.join(self.weights)})")
        size, rank = self.comm.Get_size(), self.comm.Get_rank()
        out = {}
        for n, w in weights.items():
            q = self._decl[n]
            if w.dim() != len(q.type.shape):
                raise ValueError(f"Block.parts: weights[{n!r}] has {w.dim()} dims; {self.program} declares "
                                 f"{n}: {q.type}")
            out[n] = w.detach()[local_index(q, list(w.shape), size, rank)].clone().requires_grad_(True)
        return out

    def whole(self, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One layer's whole weights, as on one process, from this rank's PARTS (name -> its part,
        as `parts` made it, or the part's `.grad`): `parts`' inverse, to save a checkpoint or
        compare with one process. A weight sliced across the block's tensor-parallel group
        `comm` is gathered from every rank's part along its sliced dim; a replicated one is its
        part (a copy); new tensors that require no grad. Collective over `comm`: each rank of it
        passes the same names; a name the block lacks, or names that differ across the ranks, a
        TypeError on every rank before any part is sent."""
        size, rank = self.comm.Get_size(), self.comm.Get_rank()
        mine = sorted(parts)
        lacks = next((n for n in mine if n not in self.weights), None)
        told = self.comm.allgather((mine, lacks)) if size > 1 else [(mine, lacks)]
        bad = next(((r, n) for r, (_, n) in enumerate(told) if n is not None), None)
        if bad is not None:
            whose = "" if bad[0] == rank else f" (rank {bad[0]} of comm passed it)"
            raise TypeError(f"Block.whole: {self.program} has no weight {bad[1]!r}{whose} (its weights: "
                            f"{', '.join(self.weights)})")
        if any(names != mine for names, _ in told):
            raise TypeError("Block.whole: the ranks of comm pass different weights (" +
                            "; ".join(f"rank {r}: {', '.join(names) or 'none'}" for r, (names, _) in enumerate(told)) +
                            "); each passes the same names")
        from coconetc.torch.parts import joined
        sliced = [n for n in mine if self._decl[n].type.layout.sliced] if size > 1 else []
        wholes = dict(zip(sliced, joined(self.comm, [parts[n] for n in sliced],
                                         [self._decl[n].type.layout.dim for n in sliced]))) if sliced else {}
        return {n: wholes[n] if n in wholes else parts[n].detach().clone() for n in mine}

    def layer(self, params: dict[str, torch.Tensor], **scalars: Any) -> Layer:
        """One layer of this block: its weights (this rank's parts, leaf tensors whose `.grad`
        the pipeline fills) and scalars."""
        missing = [n for n in self.weights if n not in params] + [n for n in self.scalars if n not in scalars]
        if missing:
            raise TypeError(f"Block.layer: {self.program} needs {missing[0]!r}")
        extra = sorted(set(params) - set(self.weights)) + sorted(set(scalars) - set(self.scalars))
        if extra:
            raise TypeError(f"Block.layer: {self.program} has no parameter {extra[0]!r} (its weights: "
                            f"{', '.join(self.weights)}; scalars: {', '.join(self.scalars)})")
        return Layer(self, params, scalars)


@dataclass
class Layer:
    """One call of a Block in a chunk, with its weights and scalars."""

    block: Block
    params: dict[str, torch.Tensor]
    scalars: dict[str, Any]
    saved: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # micro-batch -> saved values
    kept: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # micro-batch -> B's kept values

    def _args(self, m: int, scalars: dict[str, Any] | None = None) -> dict[str, Any]:
        """The arguments of micro-batch M's calls: the weights, and the scalars (SCALARS in place
        of the layer's own), each dropout seed micro-batch M's (microbatch_seed)."""
        # the leaves themselves: a module function reads their memory and is no autograd
        # function (a new detached tensor a call costs time and defeats the call's fast path)
        vals = {**self.scalars, **(scalars or {})}
        for s in self.block.seeds if m else ():
            vals[s] = microbatch_seed(vals[s], m)
        return {**self.params, **vals}

    def forward(self, m: int, x: torch.Tensor) -> torch.Tensor:
        b = self.block
        out = b.call(b.fwd, b.schedule, **self._args(m), **{b.input: x})
        self.saved[m] = {k[len("saved_"):]: v for k, v in out.items() if k.startswith("saved_")}
        self.saved[m][b.input] = x
        return out[b.output]

    def infer(self, m: int, x: torch.Tensor, scalars: dict[str, Any]) -> torch.Tensor:
        """The layer's output for X, micro-batch M's, keeping nothing for a backward
        (Pipeline.eval): the block's program itself, with SCALARS (those of its own among them)
        in place of the layer's."""
        b = self.block
        fn = b.plain if b.plain is not None else b.fwd
        kw = self._args(m, {k: v for k, v in scalars.items() if k in b.scalars})
        return b.call(fn, b.schedule, **kw, **{b.input: x})[b.output]

    def _bwd_args(self, m: int, dy: torch.Tensor) -> dict[str, Any]:
        b = self.block
        return {**self._args(m), **self.saved[m], f"d_{b.output}": dy.contiguous()}

    def _into(self, fn: Any) -> dict[str, torch.Tensor] | None:
        """The accumulators of FN (an accumulating backward): each weight's .grad, where every
        weight it adds into has one like the weight (after a first micro-batch); else None."""
        out = {}
        for w, acc in self.block.accumulated[fn.name].items():
            t = self.params[w]
            g = t.grad
            if g is None or g.dtype != t.dtype or g.device != t.device or g.shape != t.shape \
                    or not g.is_contiguous():
                return None
            out[acc] = g
        return out

    def _call_backward(self, plain: Any, acc: Any, args: dict[str, Any]) -> dict[str, torch.Tensor]:
        """PLAIN (a backward returning the weights' gradients), or its accumulating cut ACC with
        each weight's .grad as the accumulator where every one has a .grad to add into."""
        b = self.block
        into = self._into(acc)
        if into is None:
            return b.call(plain, b.grad_schedule, **args)
        return b.call(acc, b.grad_schedule, **args, **into)

    def backward(self, m: int, dy: torch.Tensor, split: bool) -> torch.Tensor:
        """The input's gradient; the weights' too unless SPLIT (then weight() makes them): the
        first micro-batch's taken as the weights' .grad, the later ones' added into it by the
        compiled backward itself (its accumulating cut: no new tensors, no pass adding them)."""
        b = self.block
        if not split:
            out = self._call_backward(b.bwd, b.bwd_acc, self._bwd_args(m, dy))
            self.saved.pop(m)
            self._accumulate(out)
            return out[f"d_{b.input}"]
        out = b.call(b.bwd_input, b.grad_schedule, **self._bwd_args(m, dy))
        self.kept[m] = {k[len("kept_"):]: v for k, v in out.items() if k.startswith("kept_")}
        self.kept[m][f"d_{b.output}"] = dy
        self._accumulate({k: v for k, v in out.items() if not k.startswith("kept_")})
        return out[f"d_{b.input}"]

    def weight(self, m: int) -> None:
        b = self.block
        kept = self.kept.pop(m)
        out = self._call_backward(b.bwd_weight, b.bwd_weight_acc,
                                  {**self._bwd_args(m, kept.pop(f"d_{b.output}")), **kept})
        self.saved.pop(m)
        self._accumulate(out)

    def _accumulate(self, grads: dict[str, torch.Tensor]) -> None:
        for k, g in grads.items():  # (d_<weight>: a weight's gradient; the input's has no weight)
            t = self.params.get(k[2:]) if k.startswith("d_") else None
            if t is None:
                continue
            if t.grad is None:  # the call's new output, which nothing else holds, taken as it is
                t.grad = g.reshape(t.shape) if g.dtype == t.dtype else g.to(t.dtype).reshape(t.shape)
            else:
                t.grad += g.reshape(t.shape)


@dataclass
class Chunk:
    """What one virtual stage computes on this rank: PRE (a torch callable: the micro-batch's
    input -> the first layer's input; the first stage only), LAYERS (coconet layers, in order),
    POST (a torch callable: the last layer's output -> what loss_fn takes; the last stage
    only)."""

    layers: Sequence[Layer] = ()
    pre: Callable[[Any], torch.Tensor] | None = None
    post: Callable[[torch.Tensor], Any] | None = None


@dataclass(frozen=True)
class Event:
    """One action as it ran on this rank (perf_counter seconds since the step began)."""

    kind: str
    microbatch: int
    chunk: int
    start: float
    end: float
    work: float = 0.0  # end - start less the time its receives waited for their messages


class Pipeline:
    """A pipeline of P stages (the ranks of COMM, in rank order; each the rank of its stage's
    tensor-parallel group at this rank's position) running ORDER (a name of
    coconetc.pipeline.orders.ORDERS, or an Order) over MICROBATCHES micro-batches; CHUNKS: this
    rank's virtual stages (one; V for the interleaved order, chunk c virtual stage c * P + rank;
    2 for zero_bubble_v, stages rank and 2 P - 1 - rank: Order.stage). loss_fn(output, target)
    -> the micro-batch's loss (mean over its rows); tp_comm: the stage's tensor-parallel group
    (for the sliced boundary), None for one rank; retime: a list-scheduled order given by name
    is scheduled again for the action times each of the first RETIMED steps measured;
    scale_grads: each micro-batch's loss divided by MICROBATCHES for its backward, so `.grad`
    holds the gradients of the batch's mean loss (True, torch's default), or not (False: their
    sum over the micro-batches); the same on every rank."""

    def __init__(self, chunks: Sequence[Chunk], order: str | _orders.Order, *, microbatches: int, comm: Any,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, tp_comm: Any = None,
                 retime: bool = True, scale_grads: bool = True):
        self.comm, self.tp_comm = comm, tp_comm
        self.rank, self.ranks = comm.Get_rank(), comm.Get_size()
        self.chunks = list(chunks)
        self.microbatches = microbatches
        self.loss_fn = loss_fn
        self.scale_grads = scale_grads
        self.events: list[Event] = []
        self._runs = 0  # steps and evals run so far (a trace's actions name theirs)
        self._id = next(_MADE)  # this process's count of its pipelines (a trace's actions name it)
        # where received activations go: the device of the layers' weights
        self._device = next((t.device for c in self.chunks for ly in c.layers for t in ly.params.values()),
                            torch.device("cpu"))
        self.parameters: dict[tuple[int, str], torch.Tensor] = {}  # from_schedule's leaves
        self.rows: dict[tuple[int, str], tuple[int, int]] = {}  # the rows of a stacked one it took
        tp = 1 if tp_comm is None else tp_comm.Get_size()
        self._tp_sizes = comm.allgather(tp)
        self.order, told = self._agree(lambda: self._checked(order), lambda _: scale_grads)
        if len(set(told)) > 1:
            raise ValueError(f"Pipeline: scale_grads differs across the ranks "
                             f"({', '.join(f'rank {r}: {v}' for r, v in enumerate(told))}); pass the same on every rank")
        # a list-scheduled order named here is scheduled again for the action times measured in
        # each of the first RETIMED steps (orders.make's costs), the same on every rank
        self._retimes = RETIMED if retime and isinstance(order, str) and order in _orders.LIST_SCHEDULED else 0
        self._timed: list[Event] = []  # the events of the steps retimed so far
        self._waited = 0.0  # the current action's time in receive waits
        # (dtype, shape) of each boundary's message, (kind, virtual stage) -> it, by the shape and
        # dtype of the batch's micro-batches (the first stage's): the receives of a step with a
        # batch seen before are posted ahead, without headers
        self._shapes: dict[tuple, dict[tuple[str, int], tuple[Any, tuple[int, ...]]]] = {}
        # False: a header before every message, blocking receives, no progress between the layers:
        # the receives as they were before they were posted ahead (every rank alike; to measure)
        self._ahead = True
        # a step's messages: sends in flight and their buffers, the boundaries' shapes known at
        # its start and those seen in it, the receives not posted yet and those posted
        self._pending: list[Any] = []
        self._keep: list[np.ndarray] = []
        self._known: dict[tuple[str, int], tuple[Any, tuple[int, ...]]] = {}
        self._seen: dict[tuple[str, int], tuple[Any, tuple[int, ...]]] = {}
        self._todo: dict[str, list[tuple[str, int, int, int]]] = {}
        self._posted: dict[tuple[str, int, int], tuple[Any, np.ndarray]] = {}
        # more ranks than cores on this machine: a rank waiting for a message sleeps between
        # polls, leaving its core to a rank that computes (MPI's wait spins, yielding at most)
        self._nap = _NAP if oversubscribed() else 0.0

    def _checked(self, order: str | _orders.Order) -> _orders.Order:
        M, V = self.microbatches, len(self.chunks)
        got = order if isinstance(order, _orders.Order) else _orders.make(order, self.ranks, M, V)
        _orders.check(got)
        if (got.ranks, got.microbatches, got.chunks) != (self.ranks, M, V):
            raise ValueError(f"Pipeline: order {got.name} is for {got.ranks} ranks, {got.microbatches} "
                             f"micro-batches and {got.chunks} chunks a rank; this pipeline has {self.ranks} "
                             f"ranks (comm), microbatches={M} and {V} chunks on rank {self.rank}")
        if M > 1024 or got.stages > 256:
            raise ValueError(f"Pipeline: at most 1024 micro-batches and 256 virtual stages, got microbatches={M} "
                             f"and {got.stages} stages")
        for c, chunk in enumerate(self.chunks):
            stage = got.stage(self.rank, c)
            if not chunk.layers and chunk.pre is None and chunk.post is None:
                raise ValueError(f"Pipeline: virtual stage {stage} (rank {self.rank}, chunk {c}) has no layers: "
                                 "give every stage at least one layer (fewer stages, or more layers)")
            if chunk.pre is not None and stage != 0:
                raise ValueError(f"Pipeline: chunk {c} of rank {self.rank} has pre= but is virtual stage {stage}; "
                                 "only stage 0 (rank 0, chunk 0) runs one")
            if chunk.post is not None and stage != got.stages - 1:
                raise ValueError(f"Pipeline: chunk {c} of rank {self.rank} has post= but is virtual stage {stage}; "
                                 f"only the last, {got.stages - 1}, runs one")
        if self.rank == got.place(got.stages - 1)[0] and self.loss_fn is None:
            raise ValueError(f"Pipeline: rank {self.rank} holds the last stage and needs loss_fn=")
        if not isinstance(self.scale_grads, bool):
            raise TypeError(f"Pipeline: scale_grads must be True or False, got {self.scale_grads!r}")
        sizes = self._tp_sizes
        if len(set(sizes)) > 1:
            raise ValueError(f"Pipeline: the stages' tensor-parallel groups (tp_comm) differ in size: "
                             f"{', '.join(f'rank {r}: {n}' for r, n in enumerate(sizes))}; every stage needs "
                             "a group of the same size")
        return got

    def _agree(self, what: Callable[[], Any], tell: Callable[[Any], Any] = lambda v: None) -> tuple[Any, list[Any]]:
        """WHAT's value, or its error raised on every rank of the pipeline (each rank's first,
        naming the rank), before any of them communicates further; and every rank's TELL(value)
        (small, picklable), by rank. WHAT must not communicate (a rank that raised would skip its
        collectives)."""
        try:
            value, err = what(), None
            told = tell(value)
        except (ValueError, TypeError) as e:
            value, err, told = None, e, None
        said = self.comm.allgather((None if err is None else f"{type(err).__name__}: {err}", told))
        bad = [(r, m) for r, (m, _) in enumerate(said) if m is not None]
        if bad:
            if err is not None:
                raise err
            r, m = bad[0]
            raise ValueError(f"Pipeline: rank {r} refused: {m}")
        return value, [t for _, t in said]

    # --- messages between stages -----------------------------------------------------------
    # A message's shape and dtype go ahead of it in a header the first time its boundary is
    # crossed with a batch of this shape (the receiver cannot know what pre= makes of it); from
    # then on both sides know them (_shapes, keyed by the batch's micro-batch shape, which every
    # rank learns in step()'s agreement), so only the data goes, into a buffer the receiver
    # posted (Irecv) ahead of the action that reads it, and waits for there.
    def _tag(self, kind: str, m: int, stage: int) -> int:
        return ((_KINDS[kind] * 1024 + m) * 256 + stage) * 2

    def _sliced(self, layers: Sequence[Layer]) -> bool:
        return bool(self.tp_comm is not None and self.tp_comm.Get_size() > 1 and layers and layers[0].block.replicated)

    def _send(self, t: torch.Tensor, to: int, kind: str, m: int, stage: int, sliced: bool) -> None:
        """T to rank TO, the (KIND, M)'s message for virtual stage STAGE."""
        if sliced:  # this rank's rows of the sequence (dim 1): the receiving group gathers them
            r, n = self.tp_comm.Get_rank(), self.tp_comm.Get_size()
            t = torch.tensor_split(t, n, dim=1)[r]
        t = t.detach().cpu()
        if t.dtype not in _TORCH or t.dim() > _HEADER - 2:
            raise TypeError(f"Pipeline: a stage sends a {t.dim()}-d {t.dtype} tensor; between stages go float32, "
                            "float64, float16 or bfloat16 tensors of at most 8 dims")
        a = np.ascontiguousarray((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy())
        tag, was = self._tag(kind, m, stage), self._known.get((kind, stage))
        if was is None:
            head = np.zeros(_HEADER, np.int64)
            head[:2] = _DTYPES.index(a.dtype.type), a.ndim
            head[2:2 + a.ndim] = a.shape
            self._pending.append(self.comm.Isend(head, dest=to, tag=tag))
            self._keep.append(head)
            self._seen[(kind, stage)] = (a.dtype.type, a.shape)
        elif was != (a.dtype.type, a.shape):
            raise ValueError(f"Pipeline: virtual stage {stage}'s {'activation' if kind == F else 'gradient'} of "
                             f"micro-batch {m} is a {t.dtype} tensor of shape {list(a.shape)}; an earlier step "
                             f"with a batch of this shape sent {_TORCH[_DTYPES.index(was[0])]} of shape "
                             f"{list(was[1])} (the "
                             "messages between stages must follow from the batch's shape)")
        self._pending.append(self.comm.Isend(a, dest=to, tag=tag + 1))
        self._keep.append(a)

    def _receives(self, actions: Sequence[_orders.Action]) -> dict[str, list[tuple[str, int, int, int]]]:
        """The receives of this rank's ACTIONS, in their order, by kind: (kind, micro-batch,
        virtual stage, from rank)."""
        order = self.order
        out: dict[str, list[tuple[str, int, int, int]]] = {F: [], B: []}
        for act in actions:
            stage = order.stage(self.rank, act.chunk)
            if act.kind == F and stage > 0:
                out[F].append((F, act.microbatch, stage, order.place(stage - 1)[0]))
            elif act.kind == B and stage < order.stages - 1:
                out[B].append((B, act.microbatch, stage, order.place(stage + 1)[0]))
        return out

    def _post(self, kind: str) -> None:
        """Post the next _AHEAD receives of KIND whose shape is known (Irecv into a new buffer)."""
        todo = self._todo[kind]
        while todo and sum(k[0] == kind for k in self._posted) < _AHEAD:
            key = todo[0]
            known = self._known.get((kind, key[2]))
            if known is None:
                return
            todo.pop(0)
            buf = np.empty(known[1], known[0])
            self._posted[key[:3]] = (self.comm.Irecv(buf, source=key[3], tag=self._tag(*key[:3]) + 1), buf)

    def _recv(self, kind: str, m: int, stage: int, frm: int, sliced: bool) -> torch.Tensor:
        """The (KIND, M)'s message for virtual stage STAGE from rank FRM, waited for here (the
        next receive of its kind posted first); its time is the action's _waited."""
        t0 = time.perf_counter()
        with ranged(f"wait: receive {'activation' if kind == F else 'gradient'} {m} from rank {frm}", "wait",
                    {"kind": kind, "microbatch": m, "from_rank": frm}):
            a = self._received(kind, m, stage, frm, sliced)
        self._waited += time.perf_counter() - t0
        got = torch.from_numpy(a)
        return (got.view(torch.bfloat16) if a.dtype == np.int16 else got).to(self._device)

    def _received(self, kind: str, m: int, stage: int, frm: int, sliced: bool) -> np.ndarray:
        """_recv's message as it arrived (a sliced one gathered across the stage's group)."""
        posted = self._posted.pop((kind, m, stage), None)
        if posted is None:  # not posted (its shape not known yet): the first not posted
            self._todo[kind].pop(0)
        self._post(kind)
        if posted is not None:
            self._wait([posted[0]])
            a = posted[1]
        else:
            tag = self._tag(kind, m, stage)
            head = np.empty(_HEADER, np.int64)
            self._wait([self.comm.Irecv(head, source=frm, tag=tag)])
            a = np.empty(tuple(int(d) for d in head[2:2 + head[1]]), dtype=_DTYPES[head[0]])
            self._wait([self.comm.Irecv(a, source=frm, tag=tag + 1)])
            self._seen[(kind, stage)] = (a.dtype.type, a.shape)
        if sliced:
            parts = self.tp_comm.allgather(a)
            a = np.concatenate(parts, axis=1)
        return a

    def _wait(self, reqs: list[Any]) -> None:
        """Until REQS are done: MPI's wait, or, on a machine with more ranks than cores, polls
        with a nap of _NAP s between them."""
        from mpi4py import MPI
        if not self._nap:
            MPI.Request.Waitall(reqs)
            return
        while not MPI.Request.Testall(reqs):
            time.sleep(self._nap)

    def _progress(self) -> None:
        """Let MPI move the messages in flight (it moves them only inside its calls): between
        the layers of an action, so a transfer goes on while the rank computes."""
        from mpi4py import MPI
        reqs = self._pending + [r for r, _ in self._posted.values()]
        if reqs and self._ahead:
            MPI.Request.Testall(reqs)
            self._pending = [r for r in self._pending if r]

    # --- the step -------------------------------------------------------------------------------
    def step(self, x: Any = None, target: Any = None, *, losses: list | None = None) -> float | None:
        """One step over the batch: X (the first stage's ranks: its first dim the batch, cut into
        `microbatches` equal parts) and TARGET (the last stage's, cut the same way). Leaves each
        parameter's gradient of the batch's mean loss in `.grad` (added to what is there, as
        torch's backward does); returns the mean loss on the last stage's ranks, None elsewhere.
        LOSSES: a list the last stage's ranks append each micro-batch's loss to (loss_fn's, a
        detached tensor, in micro-batch order), as torch's `schedule.step(..., losses=)`; the
        other ranks' is left as it is. `events` holds what ran when."""
        M, order = self.microbatches, self.order
        first, last = order.place(0)[0], order.place(order.stages - 1)[0]
        def cut() -> tuple[list[Any], list[Any]]:
            self._need_grad()
            _check_losses("step", losses)
            return (self._cut("x", x, M) if self.rank == first else [],
                    self._cut("target", target, M) if self.rank == last else [])
        (self._xs, self._ts), told = self._agree(
            cut, lambda v: (tuple(v[0][0].shape), str(v[0][0].dtype)) if v[0] else None)
        self._inputs: dict[tuple[int, int], torch.Tensor] = {}  # (chunk, m) -> the leaf a torch part starts from
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}  # (chunk, m) -> the loss its backward starts from
        # (chunk, m) -> the first stage's pre's output (its backward's start; a stage both first and last has both)
        self._pre_outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._losses: dict[int, torch.Tensor] = {}  # micro-batch -> its loss (the last stage's)
        self._run(order.actions[self.rank], told[first], self._act)
        if self._retimes:
            self._retimes -= 1
            self.order = self._retimed()
        return _mean_loss(self._losses, M, losses) if self.rank == last else None

    def clip_grad_norm_(self, max_norm: float, params: Iterable[torch.Tensor] = (), norm_type: float = 2.0, *,
                        tied: Iterable[torch.Tensor] = ()) -> float:
        """torch.nn.utils.clip_grad_norm_ over the whole model this pipeline trains, every rank
        of it together: the NORM_TYPE norm of all of the model's gradients, each parameter
        counted once: the layers' weights of every stage (one sliced across a stage's
        tensor-parallel group: its parts; a replicated one: once) and PARAMS, the parameters of
        the torch parts this rank holds (the embeddings, the head), replicated across its
        tensor-parallel group (a layer's weight among them counted as the layer's, each tensor
        once); then every one of those gradients, and TIED's, scaled by
        max_norm / (norm + 1e-6) where that is below 1. TIED: this rank's copies of parameters
        another stage holds too and passes in its PARAMS (a head tied to the token embedding,
        on the last stage): scaled alike, not counted again. Returns the norm, the same on every
        rank. Call it after step() (and after adding up tied weights' and data-parallel
        groups' gradients, which it leaves alike), before the optimizer's step. A gradient
        that is None is left out, as torch does."""
        from mpi4py import MPI
        if not (isinstance(max_norm, (int, float)) and max_norm > 0):
            raise ValueError(f"Pipeline.clip_grad_norm_: max_norm must be a number above 0, got {max_norm!r}")
        p = float(norm_type)
        if not (p > 0):
            raise ValueError(f"Pipeline.clip_grad_norm_: norm_type must be above 0 (or inf), got {norm_type!r}")
        grads = self._grads(params) + [(t.grad, False) for t in tied if t.grad is not None]
        inf = math.isinf(p)
        mine = 0.0
        for g, counted in grads:
            if counted and g.numel():
                v = float(torch.linalg.vector_norm(g.detach().double(), p))
                mine = max(mine, v) if inf else mine + v ** p
        op = MPI.MAX if inf else MPI.SUM
        if self.tp_comm is not None:
            mine = self.tp_comm.allreduce(mine, op=op)
        total = self.comm.allreduce(mine, op=op)
        norm = total if inf else total ** (1.0 / p)
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for g, _ in grads:
                g.mul_(coef)
        return norm

    def _grads(self, params: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, bool]]:
        """The gradients clip_grad_norm_ scales, each with whether this rank counts it in the
        norm: the layers' (a replicated weight's on its tensor-parallel group's first rank
        only) and PARAMS' (replicated across the group: its first rank's)."""
        first_of_group = self.tp_comm is None or self.tp_comm.Get_rank() == 0
        layers = [(n, t, ly) for c in self.chunks for ly in c.layers for n, t in ly.params.items()]
        out = [(t.grad, ly.block._decl[n].type.layout.kind != "replicated" or first_of_group)
               for n, t, ly in layers if t.grad is not None]
        seen = {id(t) for _, t, _ in layers}  # (a layer's weight passed in PARAMS too: counted as the layer's)
        return out + [(t.grad, first_of_group) for t in dict.fromkeys(params) if t.grad is not None and id(t) not in seen]

    def eval(self, x: Any = None, target: Any = None, *, losses: list | None = None, **scalars: Any) -> Any:
        """Forward only over the batch, as torch's `schedule.eval`: X (the first stage's ranks)
        and TARGET (the last stage's; optional) cut into micro-batches as step() cuts them, each
        micro-batch through every stage, nothing kept for a backward and nothing added to
        `.grad` (each layer runs its block's program itself; the torch parts under
        torch.no_grad()). On the last stage's ranks, with TARGET the batch's mean loss (loss_fn's
        over the micro-batches, averaged), without it the last stage's outputs (post's, else the
        last layer's) joined along dim 0 (a tuple of them element by element); None elsewhere.
        SCALARS: values of the layers' scalars for this call, given to every layer that has them
        (`pdrop=0.0`: no dropout, as torch's `model.eval()`); a name no layer of the pipeline has
        is a ValueError on every rank. LOSSES: with TARGET, as step()'s. `events` holds what ran
        when."""
        M, order = self.microbatches, self.order
        first, last = order.place(0)[0], order.place(order.stages - 1)[0]
        mine = sorted({n for c in self.chunks for ly in c.layers for n in ly.block.scalars})

        def cut() -> tuple[list[Any], list[Any]]:
            _check_losses("eval", losses)
            return (self._cut("x", x, M, "eval") if self.rank == first else [],
                    self._cut("target", target, M, "eval") if self.rank == last and target is not None else [])
        (self._xs, self._ts), told = self._agree(
            cut,
            lambda v: ((tuple(v[0][0].shape), str(v[0][0].dtype)) if v[0] else None, mine))
        have = sorted({n for _, names in told for n in names})
        unknown = sorted(set(scalars) - set(have))
        if unknown:
            raise ValueError(f"Pipeline.eval: no layer of the pipeline has a scalar {unknown[0]!r} (their scalars: "
                             f"{', '.join(have) or 'none'})")
        acts = sorted((_orders.Action(F, m, c) for c in range(len(self.chunks)) for m in range(M)),
                      key=lambda a: (order.stage(self.rank, a.chunk), a.microbatch))
        outs: dict[int, Any] = {}  # micro-batch -> the last stage's output (its loss where a target was given)

        def infer(act: _orders.Action) -> None:
            out = self._infer(act, scalars)
            if out is not None:
                outs[act.microbatch] = out
        with torch.no_grad():
            self._run(acts, told[first][0], infer)
        if self.rank != last:
            return None
        return _mean_loss(outs, M, losses) if self._ts else _joined([outs[m] for m in range(M)])

    def _infer(self, act: _orders.Action, scalars: dict[str, Any]) -> Any:
        """One micro-batch through this rank's chunk (eval): what the last stage makes of it
        (its loss where a target was given), None on the others."""
        order, chunk, m = self.order, self.chunks[act.chunk], act.microbatch
        stage = order.stage(self.rank, act.chunk)
        if stage == 0:
            h: Any = self._xs[m]
            if chunk.pre is not None:
                h = chunk.pre(h)
        else:
            h = self._recv(F, m, stage, order.place(stage - 1)[0], self._sliced(chunk.layers))
        for layer in chunk.layers:
            h = layer.infer(m, h, scalars)
            self._progress()
        if stage < order.stages - 1:
            self._send(h, order.place(stage + 1)[0], F, m, stage + 1, self._sliced(self._boundary_layers()))
            return None
        out = chunk.post(h) if chunk.post is not None else h
        if self._ts:
            assert self.loss_fn is not None
            return self.loss_fn(out, self._ts[m]).detach()
        return out

    def _run(self, acts: Sequence[_orders.Action], batch: Any, do: Callable[[_orders.Action], None]) -> None:
        """DO each of this rank's ACTS in order (step's, eval's), with the messages of a batch of
        the shape BATCH (its boundaries' shapes known from an earlier one: the receives posted
        ahead), each one's time in `events`; then the sends' end waited for."""
        self._known = self._shapes.get(batch, {}) if self._ahead else {}
        self._seen, self._pending, self._keep, self._posted = {}, [], [], {}
        self._todo = self._receives(acts)
        self._post(F)
        self._post(B)
        self.events = []
        run, self._runs = self._runs, self._runs + 1
        t0 = time.perf_counter()
        for act in acts:
            start = time.perf_counter() - t0
            self._waited = 0.0
            # (the action's range in torch.profiler's trace and coconet's, its layers' calls inside)
            stage = self.order.stage(self.rank, act.chunk)
            info = {"pipeline": self._id, "run": run, "stage": stage, "microbatch": act.microbatch, "kind": act.kind}
            with ranged(self._profiler_name(act, stage), "action", info):
                do(act)
                end = time.perf_counter() - t0
                ev = Event(act.kind, act.microbatch, act.chunk, start, end, end - start - self._waited)
                info["work_us"] = ev.work * 1e6
            self.events.append(ev)
            self._progress()
        with ranged("wait: the sends in flight", "wait", {"pipeline": self._id, "run": run}):
            self._wait(self._pending)
        self._pending, self._keep = [], []
        self._shapes[batch] = {**self._known, **self._seen}

    def _profiler_name(self, act: _orders.Action, stage: int) -> str:
        """The range of ACT, this rank's action of virtual stage STAGE, in torch.profiler's trace,
        named as torch's pipelining schedules name theirs: `PP:<stage><kind><micro-batch>`, kind F
        (forward), B (the whole backward), I (the input gradient where the backward is split) or
        W (the weights' gradients)."""
        kind = "I" if act.kind == B and self.order.split_backward else act.kind
        return f"PP:{stage}{kind}{act.microbatch}"

    def _act(self, act: _orders.Action) -> None:
        """One action of a step: a forward, a backward, or the layers' weight gradients."""
        if act.kind == F:
            self._forward(act)
        elif act.kind == B:
            self._backward(act)
        else:
            for layer in self.chunks[act.chunk].layers:
                layer.weight(act.microbatch)

    def _retimed(self) -> _orders.Order:
        """The order scheduled again for the action times of the steps so far: each virtual
        stage's median F, B and W work over them (on the slowest rank of its tensor-parallel
        group), gathered from every stage, so every rank of the pipeline and of each stage's
        group makes the same."""
        order, V = self.order, len(self.chunks)
        self._timed += self.events
        mine = np.zeros((V, 3))
        for c in range(V):
            for i, kind in enumerate(_orders.KINDS):
                times = sorted(e.work for e in self._timed if e.chunk == c and e.kind == kind)
                mine[c, i] = times[len(times) // 2] if times else 0.0
        if self.tp_comm is not None and self.tp_comm.Get_size() > 1:
            from mpi4py import MPI
            self.tp_comm.Allreduce(MPI.IN_PLACE, mine, op=MPI.MAX)
        every = self.comm.allgather(mine)
        costs = []
        for st in range(order.stages):
            r, c = order.place(st)
            f, b, w = (float(x) for x in every[r][c])
            costs.append(_orders.Costs(forward=f, backward=b + w, input_grad=b, weight_grad=w))
        return _orders.make(order.name, order.ranks, order.microbatches, order.chunks, costs)

    def _forward(self, act: _orders.Action) -> None:
        order, chunk, key = self.order, self.chunks[act.chunk], (act.chunk, act.microbatch)
        stage = order.stage(self.rank, act.chunk)
        if stage == 0:
            h: Any = self._xs[act.microbatch]
            if chunk.pre is not None:
                h = chunk.pre(h)
                if h.requires_grad:  # (a pre with no parameters, on a batch that needs none: no backward)
                    self._pre_outputs[key] = h
                h = h.detach()
        else:
            prev = order.place(stage - 1)[0]
            h = self._recv(F, act.microbatch, stage, prev, self._sliced(chunk.layers))
        for layer in chunk.layers:
            h = layer.forward(act.microbatch, h)
            self._progress()
        if stage < order.stages - 1:
            nxt = order.place(stage + 1)[0]
            self._send(h, nxt, F, act.microbatch, stage + 1, self._sliced(self._boundary_layers()))
            return
        leaf = h.detach().requires_grad_(True)
        out = chunk.post(leaf) if chunk.post is not None else leaf
        assert self.loss_fn is not None
        loss = self.loss_fn(out, self._ts[act.microbatch])
        self._losses[act.microbatch] = loss.detach()
        self._outputs[key] = loss / self.microbatches if self.scale_grads else loss
        self._inputs[key] = leaf

    def _backward(self, act: _orders.Action) -> None:
        order, chunk, key = self.order, self.chunks[act.chunk], (act.chunk, act.microbatch)
        stage = order.stage(self.rank, act.chunk)
        g: torch.Tensor | None
        if stage == order.stages - 1:
            leaf = self._inputs.pop(key)
            self._outputs.pop(key).backward()
            g = leaf.grad
        else:
            nxt = order.place(stage + 1)[0]
            g = self._recv(B, act.microbatch, stage, nxt, self._sliced(self._boundary_layers()))
        assert g is not None
        for layer in reversed(chunk.layers):
            g = layer.backward(act.microbatch, g, order.split_backward)
            self._progress()
        if stage > 0:
            prev = order.place(stage - 1)[0]
            self._send(g, prev, B, act.microbatch, stage - 1, self._sliced(chunk.layers))
        elif key in self._pre_outputs:  # the torch part before the first layer
            self._pre_outputs.pop(key).backward(g)

    def _boundary_layers(self) -> Sequence[Layer]:
        """Layers whose input stands for the next stage's (a block's output is its input's
        shape and layout, so every stage receives the same kind of activation): this rank's."""
        return self.chunks[0].layers or next((c.layers for c in self.chunks if c.layers), ())

    def _need_grad(self) -> None:
        """A ValueError, which step() raises on every rank, where autograd is off: a step's
        backward needs it on (the torch parts' graphs)."""
        if not torch.is_grad_enabled():
            raise ValueError(f"Pipeline.step: rank {self.rank} runs it with autograd off (inside torch.no_grad() or "
                             "torch.inference_mode()), which a step's backward needs on; for a forward only "
                             "use Pipeline.eval, which needs no gradients")

    def _cut(self, what: str, v: Any, M: int, fn: str = "step") -> list[Any]:
        if v is None:
            raise ValueError(f"Pipeline.{fn}: rank {self.rank} holds a stage that needs {what}=")
        n = v.shape[0]
        if n % M:
            raise ValueError(f"Pipeline.{fn}: {what}'s batch of {n} rows does not divide into "
                             f"microbatches={M} equal micro-batches (use a batch that is a multiple of {M})")
        return list(torch.split(v, n // M)) if isinstance(v, torch.Tensor) else np.split(v, M)


SEED_STEP = 0x9E3779B97F4A7C15  # microbatch_seed's stride (2**64 over the golden ratio, odd)


def microbatch_seed(seed: int, m: int) -> int:
    """The dropout seed micro-batch M of a step (or of Pipeline.eval) runs a layer with, from the
    layer's SEED: seed + m * SEED_STEP modulo 2**64, as a signed 64-bit integer; micro-batch 0
    runs with SEED itself. So every micro-batch draws masks of its own (one seed for all would
    drop the same elements of each), and two layers whose seeds are close (seed=i a layer) do
    not draw each other's."""
    v = (int(seed) + m * SEED_STEP) % (1 << 64)
    return v - (1 << 64) if v >= 1 << 63 else v


def _check_losses(what: str, losses: Any) -> None:
    if losses is not None and not isinstance(losses, list):
        raise TypeError(f"Pipeline.{what}: losses must be a list (each micro-batch's loss is appended to it) or None, "
                        f"got {type(losses).__name__}")


def _mean_loss(by_microbatch: dict[int, torch.Tensor], M: int, losses: list | None) -> float:
    """The batch's mean loss from each micro-batch's (a dict by micro-batch), which LOSSES (where
    a list) gets appended in micro-batch order."""
    ordered = [by_microbatch[m] for m in range(M)]
    if losses is not None:
        losses.extend(ordered)
    return sum(float(v) for v in ordered) / M


def _joined(outs: list[Any]) -> Any:
    """The micro-batches' outputs as one batch's, as torch's merge_chunks: tensors joined along
    dim 0; a tuple (or list) of them joined element by element; anything else, the list."""
    if all(isinstance(o, torch.Tensor) for o in outs):
        return torch.cat(outs, dim=0)
    if all(isinstance(o, (tuple, list)) and len(o) == len(outs[0]) for o in outs):
        return type(outs[0])(_joined([o[i] for o in outs]) for i in range(len(outs[0])))
    return outs


def from_schedule(source: str | Path, program: str, schedule: str, *, weights: dict[str, torch.Tensor],
                  comm: Any, tp_comm: Any = None, input: str = "x", scalars: dict[str, Any] | None = None,
                  pre: Callable[[Any], torch.Tensor] | None = None, post: Callable[[torch.Tensor], Any] | None = None,
                  loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, backend: str = "cpu",
                  scale_grads: bool = True) -> Pipeline:
    """The Pipeline of PROGRAM's schedule SCHEDULE (a `pipeline(...)` directive, docs/pipeline.md):
    this rank's virtual stages, each the compiled program of its layers (the stage programs
    and their derived programs built into the file's module), with the directive's order and
    micro-batches. weights: PROGRAM's tensor parameters other than INPUT (the batch the first
    stage reads), this rank's part in each one's layout; a stacked parameter `[L, ...]` whole
    along its layer dim (each stage takes, as a leaf of its own, the rows of its layers).
    scalars: the program's scalars. comm: one rank of each stage (pipeline rank = stage);
    tp_comm: the stage's tensor-parallel group (None: one rank a stage). `pipe.parameters`:
    (virtual stage, name) -> the leaf tensor whose `.grad` a step fills (give them to the
    optimizer; `pipe.rows`: (virtual stage, name) -> the rows [first, stop) of a stacked
    parameter it took); a parameter that several stages read (not stacked) is a leaf on each,
    and their gradients add up to its gradient. backend: as Block's; scale_grads: as Pipeline's."""
    from mpi4py import MPI

    from coconetc.schedule.pipeline import cut, directive, stage_input, stage_name, stage_program, stage_rows
    from coconetc.sourcefile import grad_name, load_file, stage_schedules
    from coconetc.paths import source_path
    source = source_path(source)
    sf = load_file(source)
    p = sf.program(program)
    directives = sf.schedule(program, schedule).directives
    d = directive(directives)
    if d is None:
        raise ValueError(f"from_schedule: schedule {schedule} of {program} has no pipeline(...) directive")
    c = cut(p, d)
    own = stage_schedules(sf, program, schedule)  # the stages' (and their backwards') schedules of this name
    if comm.Get_size() != c.order.ranks:
        raise ValueError(f"from_schedule: schedule {schedule} has stages={c.order.ranks}; comm has "
                         f"{comm.Get_size()} ranks (one rank of each stage)")
    scalars = dict(scalars or {})
    rank, last = comm.Get_rank(), c.order.stages - 1
    chunks = []
    params: dict[tuple[int, str], torch.Tensor] = {}
    taken: dict[tuple[int, str], tuple[int, int]] = {}
    for k in range(c.order.chunks):
        s = c.order.stage(rank, k)
        sp = stage_program(p, c, s, stage_name(program, schedule, s))
        block = Block(source, sp.name, comm=tp_comm if tp_comm is not None else MPI.COMM_SELF,
                      input=stage_input(p, sp, s, input), derive=f"{program}@{schedule}:{input}", backend=backend,
                      # its layers' directives (beside the pipeline; grad(program)'s), where it has any
                      schedule=schedule if sp.name in own else "default",
                      grad_schedule=schedule if grad_name(sp.name) in own else "default")
        rows = stage_rows(p, c, s)
        mine = {}
        for n in block.weights:
            if n not in weights:
                raise TypeError(f"from_schedule: weights has no {n!r} (stage {s} reads it)")
            w = weights[n][rows[n][0]:rows[n][1]] if n in rows else weights[n]
            mine[n] = params[(s, n)] = w.detach().clone().requires_grad_(True)
            if n in rows:
                taken[(s, n)] = rows[n]
        layer = block.layer(mine, **{n: scalars[n] for n in block.scalars if n in scalars})
        chunks.append(Chunk([layer], pre=pre if s == 0 else None, post=post if s == last else None))
    pipe = Pipeline(chunks, c.order, microbatches=c.order.microbatches, comm=comm, loss_fn=loss_fn, tp_comm=tp_comm,
                    scale_grads=scale_grads)
    pipe.parameters, pipe.rows = params, taken
    return pipe
