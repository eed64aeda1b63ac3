"""Pipeline parallelism, coconet against torch.distributed.pipelining, side by side in one run:
a nanoGPT-shaped GPT (bench/nanogpt.py, f32) cut into P stages of one rank each, P in --stages
(2, 4), M in --microbatches (4, 8) micro-batches, every order of coconetc.pipeline.orders:

  coconet  coconetc.torch.pipeline: the blocks gpt_block.ccn's `gpt_block` (compiled forward,
           derived backward; under zero_bubble its B/W split), the embeddings and the tied head
           in torch; Pipeline(...).step(idx, targets)
  torch    the same model's nanoGPT Blocks (the same weights) in torch.distributed.pipelining
           PipelineStages over gloo: ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B (2
           stages a rank), ScheduleInterleavedZeroBubble (ZB1P, one stage a rank; where torch
           refuses it, ScheduleZBVZeroBubble with 2 stages a rank, and the reason is reported);
           zero_bubble_h2, which torch has no single-stage schedule for: torch's schedule runtime
           (_PipelineScheduleRuntime, the one its zero-bubble schedules run on) given coconet's
           own action lists (F, I for B, W), those coconet's Pipeline ran in its step before
           (built for F = B = W, then again for its measured times); zero_bubble_v:
           ScheduleZBVZeroBubble (2 stages a rank, rank r holding stages r and 2P-1-r)

Both run the same layer cut (layer bounds as even as can be, interleaved: virtual stage
c * P + rank; zero_bubble_v: r and 2P-1-r), the same weights, the same batch; the first step's mean losses are checked to
agree within 1e-4 relative. A step is the pipeline's forward and backward over the batch (the
gradients left in .grad; no optimizer step, no tied-embedding all-reduce, in either).

Per (P, M, order):
  * iteration time: median over --reps steps (after one warm-up step) of the slowest rank's
    time from a barrier to the end of its step; coconet's and torch's steps alternate;
  * action times: the median F, B (and W) of coconet's events (their work) and of torch's stage
    calls (forward_one_chunk, backward_one_chunk, backward_weight_one_chunk) over every rank and
    timed step, and torch's over coconet's: where every rank's stage is waiting on the other's,
    as in GPipe and 1F1B, the step's ratio is close to these;
  * measured bubble (coconet): 1 - busy / (P x makespan) from Pipeline.events of every rank
    (times from the step's start, right after a barrier; gathered to rank 0), median over the
    steps;
  * predicted bubble: orders.simulate(order, Costs(...)) with costs the mean F, B, W action
    times of coconet's own events, each rank's first action of a step left out (one cost per
    kind for every stage: the first stage's embeddings and the last stage's head and loss are
    averaged in; the mean, not the median: a step's work is the sum of its actions', and the
    slower actions are the rarer), and three more measured from them: a transfer's latency, the
    median over the steps of the transfers an action waited for; the time between two actions
    of a rank, the mean of the gaps (step_overheads: the runtime's own time, which the measured
    bubble counts as idle); and each rank's first action of a step longer by the median over
    steps and ranks of that action's time over its kind's mean on its rank (Costs.first, the
    step's warm-up); and "pred/st", the same simulation with each rank's own mean F, B, W (the
    stages' imbalance in); and, in the lines after the table, each step replayed: the
    simulation with every action's own measured work (what is left between it and the measured
    bubble is waiting no action's time explains: messages, the cores' sharing; what is between
    it and "pred/st", the actions' spread around their means, such as where the pipeline's fill
    waits for a slow one);
  * peak activations per rank: coconet: Timeline.peak_activations of the measured timeline
    (micro-batches held, per chunk) x the bytes of one micro-batch's Layer.saved values on the
    rank's chunk (the coconet layers only: the torch embeddings/head graph not counted; under
    zero_bubble the B's kept values between B and W neither); torch: the most entries in the
    rank's stages' fwd_cache + backward_state at once (micro-batches whose autograd graph is
    alive) x the bytes of the tensors autograd saves in one micro-batch's forward of the stage
    (saved_tensors_hooks, each storage once). The largest over the ranks is shown.

With --old-receives, coconet's step is timed a second time in each round with the receives of
its first step: a header before each message and a blocking receive where the action needs it,
none posted ahead ("old ms"; "old/new": its median over the default's).

Run: python bench/pipeline.py [--layers 8] [--hidden 256] [--heads 4] [--seq 128] [--batch 8]
     [--vocab 512] [--stages 2,4] [--microbatches 4,8] [--orders gpipe,1f1b,interleaved,zero_bubble,zero_bubble_h2,zero_bubble_v]
     [--reps 5] [--json PATH] [--old-receives]
It relaunches itself under mpiexec once for each P, on P ranks (a pipeline of P stages of one
rank, as a user runs one: no idle ranks beside it on the cores), then prints the table of every
case (and with --json writes every number). Started under mpiexec itself, it runs every P in that
job, the ranks past a pipeline's P waiting at the barriers."""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from coconetc.pipeline import ORDERS, default_chunks, layer_bounds, make

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
_EXAMPLE = HERE.parent / "examples" / "gpt_block.ccn"
GPT_BLOCK: str | Path = _EXAMPLE if _EXAMPLE.exists() else "gpt_block.ccn"  # the shipped example by name
PROGRAM = "gpt_block"
TORCH_ORDERS = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                "zero_bubble": "ScheduleInterleavedZeroBubble", "zero_bubble_h2": "coconet's lists",
                "zero_bubble_v": "ScheduleZBVZeroBubble"}
V_INTERLEAVED = 2


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def chunks_of(order: str) -> int:
    """Model chunks a rank: V_INTERLEAVED under interleaved, else the order's own (2 under zero_bubble_v)."""
    return V_INTERLEAVED if order == "interleaved" else default_chunks(order)


def check_args(a: argparse.Namespace) -> None:
    if a.hidden % a.heads:
        raise SystemExit(f"--hidden {a.hidden} is not a multiple of --heads {a.heads}")
    for o in a.orders:
        if o not in ORDERS:
            raise SystemExit(f"--orders: unknown order {o!r} ({', '.join(ORDERS)})")
    for P in a.stages:
        if P < 2:
            raise SystemExit(f"--stages {P}: a pipeline of at least 2 stages")
        need = P * max([chunks_of(o) for o in a.orders] + [2 if "zero_bubble" in a.orders else 1])
        if a.layers < need:
            raise SystemExit(f"--layers {a.layers}: fewer than the {need} virtual stages of P={P} "
                             f"({V_INTERLEAVED} a rank under interleaved, 2 under zero_bubble_v and torch's "
                             "ZBV fallback for zero_bubble)")
    for M in a.microbatches:
        if a.batch % M:
            raise SystemExit(f"--batch {a.batch} does not split into {M} equal micro-batches")


# --- the model ------------------------------------------------------------------------------------
def base_model(a: argparse.Namespace) -> Any:
    """nanoGPT's GPT, seeded, its layernorms and biases moved off 1 and 0 (bench/gpt_block.py --model)."""
    import torch
    import nanogpt
    cfg = nanogpt.GPTConfig(block_size=a.seq, vocab_size=a.vocab, n_layer=a.layers, n_head=a.heads,
                            n_embd=a.hidden)
    torch.manual_seed(0)
    m = nanogpt.GPT(cfg)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape) * 0.1)
    return m


def coconet_pipeline(model: Any, a: argparse.Namespace, order: str, M: int, P: int, comm: Any, block: Any) -> Any:
    """(Pipeline, its chunks, its parameters) of this rank (pipeline rank comm.Get_rank() of P)."""
    import torch
    import torch.nn.functional as F

    from coconetc.torch.gpt import block_parameters
    from coconetc.torch.pipeline import Chunk, Pipeline
    s = comm.Get_rank()
    V = chunks_of(order)
    placed = make(order, P, M, V)
    bounds = layer_bounds(a.layers, P * V)
    tr = model.transformer
    scale = 1.0 / math.sqrt(a.hidden // a.heads)
    params: list[torch.Tensor] = []
    chunks = []
    for c in range(V):
        stage = placed.stage(s, c)
        layers = []
        for i in range(bounds[stage], bounds[stage + 1]):
            ws = {k: v.clone().contiguous().requires_grad_(True) for k, v in block_parameters(tr.h[i], a.heads).items()}
            params += ws.values()
            layers.append(block.layer(ws, scale=scale, pdrop=0.0, seed=i))
        pre = post = None
        if stage == 0:
            wte = tr.wte.weight.detach().clone().requires_grad_(True)
            wpe = tr.wpe.weight.detach().clone().requires_grad_(True)
            params += [wte, wpe]

            def pre(idx: torch.Tensor, wte=wte, wpe=wpe) -> torch.Tensor:
                return wte[idx] + wpe[:idx.shape[1]]
        if stage == P * V - 1:
            head = tr.wte.weight.detach().clone().requires_grad_(True)
            lw = tr.ln_f.weight.detach().clone().requires_grad_(True)
            lb = tr.ln_f.bias.detach().clone().requires_grad_(True)
            params += [head, lw, lb]

            def post(x: torch.Tensor, head=head, lw=lw, lb=lb) -> torch.Tensor:
                return F.layer_norm(x, (a.hidden,), lw, lb, 1e-5) @ head.T
        chunks.append(Chunk(layers, pre=pre, post=post))

    def loss_fn(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, a.vocab), tgt.reshape(-1))
    return Pipeline(chunks, order, microbatches=M, comm=comm, loss_fn=loss_fn), chunks, params


def coconet_saved_bytes(chunks: list[Any], a: argparse.Namespace, M: int) -> int:
    """Bytes of one micro-batch's Layer.saved values in the largest of this rank's chunks (a
    forward of a zero micro-batch through each layer; the saved values dropped after)."""
    import torch
    best = 0
    for ch in chunks:
        x = torch.zeros(a.batch // M, a.seq, a.hidden)
        total = 0
        for layer in ch.layers:
            x = layer.forward(-1, x)
            total += sum(t.numel() * t.element_size() for t in layer.saved.pop(-1).values())
        best = max(best, total)
    return best


class TorchStage:
    """nn.Module of one virtual stage for torch.distributed.pipelining: the embeddings (first),
    nanoGPT blocks LO..HI, ln_f and the tied head (last); copies of the model's modules."""

    @staticmethod
    def make(model: Any, lo: int, hi: int, first: bool, last: bool) -> Any:
        import copy

        import torch
        from torch import nn

        class Stage(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                tr = model.transformer
                self.first, self.last = first, last
                if first:
                    self.wte, self.wpe = copy.deepcopy(tr.wte), copy.deepcopy(tr.wpe)
                self.h = nn.ModuleList(copy.deepcopy(tr.h[i]) for i in range(lo, hi))
                if last:
                    self.ln_f = copy.deepcopy(tr.ln_f)
                    self.lm_head = nn.Linear(model.config.n_embd, model.config.vocab_size, bias=False)
                    with torch.no_grad():
                        self.lm_head.weight.copy_(tr.wte.weight)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                if self.first:
                    x = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
                for b in self.h:
                    x = b(x)
                if self.last:
                    x = self.lm_head(self.ln_f(x))
                return x
        return Stage()


def torch_saved_bytes(mod: Any, x: Any) -> int:
    """Bytes autograd saves in one forward of MOD on X (each storage once)."""
    import torch
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            st = t.untyped_storage()
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        except Exception:  # noqa: BLE001
            pass
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = mod(x)
    del out
    return sum(seen.values())


def torch_pipeline(model: Any, a: argparse.Namespace, order: str, M: int, P: int, group: Any) -> dict[str, Any]:
    """torch's schedule for ORDER on this rank (group rank of P): {schedule, stages, name, V,
    note, saved_bytes}; raises what torch raises."""
    import torch
    import torch.nn.functional as F
    from torch.distributed import pipelining as pp
    import torch.distributed as dist
    r = dist.get_rank(group)
    note = ""

    def loss_fn(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, a.vocab), tgt.reshape(-1))

    def build(V: int, stage_ids: list[int], cls: Any) -> dict[str, Any]:
        bounds = layer_bounds(a.layers, P * V)
        mods = [TorchStage.make(model, bounds[i], bounds[i + 1], i == 0, i == P * V - 1) for i in stage_ids]
        stages = [pp.PipelineStage(m, i, P * V, torch.device("cpu"), group=group) for m, i in zip(mods, stage_ids)]
        if V == 1 and cls in (pp.ScheduleGPipe, pp.Schedule1F1B):
            sched = cls(stages[0], n_microbatches=M, loss_fn=loss_fn)
        else:
            sched = cls(stages, n_microbatches=M, loss_fn=loss_fn)
        # bytes saved by one micro-batch's forward of each local stage (its input: tokens or a hidden state)
        mb = a.batch // M
        saved = 0
        for m, i in zip(mods, stage_ids):
            x = (torch.zeros(mb, a.seq, dtype=torch.long) if i == 0
                 else torch.zeros(mb, a.seq, a.hidden, requires_grad=True))
            saved = max(saved, torch_saved_bytes(m, x))
        first = 0 in stage_ids
        last = P * V - 1 in stage_ids
        return {"schedule": sched, "stages": stages, "mods": mods, "name": cls.__name__, "V": V,
                "first": first, "last": last, "saved_bytes": saved}

    if order == "gpipe":
        got = build(1, [r], pp.ScheduleGPipe)
    elif order == "1f1b":
        got = build(1, [r], pp.Schedule1F1B)
    elif order in ("interleaved", "zero_bubble_v"):  # (each rank's stages as coconet's order places them)
        placed = make(order, P, M, chunks_of(order))
        got = build(placed.chunks, [placed.stage(r, c) for c in range(placed.chunks)],
                    pp.ScheduleInterleaved1F1B if order == "interleaved" else pp.ScheduleZBVZeroBubble)
    elif order == "zero_bubble_h2":
        got = build(1, [r], same_order(order, P, M))
    else:
        try:
            got = build(1, [r], pp.ScheduleInterleavedZeroBubble)
        except Exception as err:  # noqa: BLE001  torch's reason, reported; then what it offers
            note = (f"ScheduleInterleavedZeroBubble with one stage a rank: {type(err).__name__}: {err}; "
                    "ran ScheduleZBVZeroBubble (2 stages a rank, V-shaped: rank r holds stages r and 2P-1-r)")
            got = build(2, [r, 2 * P - 1 - r], pp.ScheduleZBVZeroBubble)
    got["note"] = note
    return got


def same_order(order: str, P: int, M: int) -> Any:
    """A torch schedule class that runs coconet's ORDER (one stage a rank) on torch's pipeline
    runtime: each rank's actions as torch's compute actions (F; B as I, the input gradient, where
    the order splits the backward; W), lowered by torch to its sends and receives. use(o): run
    the lists of the Order o from the next step on (coconet's, built again for its measured
    times: both sides run the same lists)."""
    from torch.distributed.pipelining.schedules import _Action, _ComputationType, _PipelineScheduleRuntime

    class SameOrder(_PipelineScheduleRuntime):
        def __init__(self, stages: list[Any], n_microbatches: int, loss_fn: Any) -> None:
            super().__init__(stages=stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
            self.use(make(order, P, M))

        def use(self, o: Any) -> None:
            self.source = o
            kinds = {"F": _ComputationType.FORWARD, "W": _ComputationType.BACKWARD_WEIGHT,
                     "B": _ComputationType.BACKWARD_INPUT if o.split_backward else _ComputationType.FULL_BACKWARD}
            self.pipeline_order = {r: [_Action(o.stage(r, x.chunk), kinds[x.kind], x.microbatch) for x in acts]
                                   for r, acts in enumerate(o.actions)}
            self._prepare_schedule_with_comms(self.pipeline_order)
    SameOrder.__name__ = f"_PipelineScheduleRuntime({order})"
    return SameOrder


def torch_step(tp: dict[str, Any], idx: Any, tgt: Any, live: list[int]) -> float | None:
    """One step of torch's schedule; the mean loss on the rank of the last stage."""
    sched = tp["schedule"]
    losses: list[Any] = []
    kw: dict[str, Any] = {}
    if tp["last"]:
        kw = {"target": tgt, "losses": losses}
    if tp["first"]:
        sched.step(idx, **kw)
    else:
        sched.step(**kw)
    return float(sum(float(x) for x in losses) / len(losses)) if tp["last"] else None


def watch_live(tp: dict[str, Any], peak: list[int], times: dict[str, list[float]]) -> None:
    """PEAK[0]: the most micro-batches (per stage) whose forward state this rank's stages hold at
    once. TIMES: each action's seconds by kind (F: forward_one_chunk, without the last stage's
    loss, which torch's schedule computes after the call and coconet's F includes; B:
    backward_one_chunk, a full backward or, split, the input gradient; W:
    backward_weight_one_chunk), as coconet's Event times its actions (torch's receives are
    waited for before the call, so no wait is in them)."""
    stages = tp["stages"]

    def count() -> None:
        peak[0] = max(peak[0], sum(len(s.fwd_cache) + len(s.backward_state) for s in stages))

    def timed(kind: str, orig: Any, then: Any = None) -> Any:
        def run(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            out = orig(*args, **kw)
            times.setdefault(kind, []).append(time.perf_counter() - t0)
            if then is not None:
                then()
            return out
        return run
    for s in stages:
        s.forward_one_chunk = timed("F", s.forward_one_chunk, count)
        s.backward_one_chunk = timed("B", s.backward_one_chunk)
        if hasattr(s, "backward_weight_one_chunk"):  # (a torch without zero bubble has none)
            s.backward_weight_one_chunk = timed("W", s.backward_weight_one_chunk)


# --- the run ----------------------------------------------------------------------------------------
def barrier(world: Any, inside: bool) -> None:
    """Every rank of WORLD together (MPI_Ibarrier): the pipeline's ranks poll it, the ranks
    outside the pipeline sleep between polls (they leave the cores to those that run)."""
    req = world.Ibarrier()
    while not req.Test():
        if not inside:
            time.sleep(0.0005)


def work_events(pipe: Any) -> list[tuple]:
    """This rank's (kind, m, chunk, start, end, work) of the last step, times from the step's
    start; work: the action's time less its receives' waits (Event.work)."""
    return [(ev.kind, ev.microbatch, ev.chunk, ev.start, ev.end, max(ev.work, 0.0)) for ev in pipe.events]


def bubble_of(events: list[list[tuple]]) -> float:
    """Idle fraction of every rank's events (orders.idle_fraction: 1 - work / (ranks x
    makespan), as coconetc trace-merge reads it from a trace)."""
    from coconetc.pipeline.orders import idle_fraction
    return idle_fraction(((e[3], e[4], e[5]) for evs in events for e in evs), len(events))


def step_overheads(events: list[list[tuple]], order: Any) -> tuple[list[float], list[float]]:
    """One step's transfers and gaps. Transfers: where an action waited for its input from
    another rank (orders.needs: the F of the stage before, the B of the stage after) that ended
    after the action began, the time from that input's end to the start of the action's work (its end less
    its work). Gaps: for each action after a rank's first, the time from the action before's end
    to its start, plus its wait where no such input explains it (a receive's own cost)."""
    from coconetc.pipeline import orders
    end: dict[tuple[int, int, str], float] = {}
    owner: dict[tuple[int, int, str], int] = {}
    for r, rank_evs in enumerate(events):
        for e in rank_evs:
            key = (order.stage(r, e[2]), e[1], e[0])
            end[key], owner[key] = e[4], r
    transfers, gaps = [], []
    for r, rank_evs in enumerate(events):
        for i, e in enumerate(rank_evs):
            remote = [end[n] for n in orders.needs(order, (order.stage(r, e[2]), e[1], e[0])) if owner.get(n, r) != r]
            waited = bool(remote) and max(remote) >= e[3]
            if waited:
                transfers.append(e[4] - e[5] - max(remote))
            if i:
                gaps.append(e[3] - rank_evs[i - 1][4] + (0.0 if waited else e[4] - e[3] - e[5]))
    return transfers, gaps


class Case:
    """One (P, M, order) on every rank of WORLD; SUB and GROUP: the pipeline's P ranks' MPI
    communicator and torch process group (None on the other ranks)."""

    def __init__(self, world: Any, sub: Any, group: Any, P: int, M: int, order: str, a: argparse.Namespace,
                 model: Any, block: Any):
        self.world, self.sub, self.P, self.M, self.order, self.a = world, sub, P, M, order, a
        self.inside = world.Get_rank() < P
        self.tp: dict[str, Any] | None = None
        self.live = [0]
        self.torch_times: dict[str, list[float]] = {}  # kind -> this rank's torch action seconds
        err = ""
        if self.inside:
            self.pipe, self.chunks, self.cparams = coconet_pipeline(model, a, order, M, P, sub, block)
            try:
                if a.no_torch:
                    err = "not run (--no-torch)"
                else:
                    self.tp = torch_pipeline(model, a, order, M, P, group)
                    watch_live(self.tp, self.live, self.torch_times)
            except Exception as e:  # noqa: BLE001
                err = f"{type(e).__name__}: {e}"
        self.torch_err = next((e for e in world.allgather(err) if e), "")

    def coconet_step(self, idx: Any, tgt: Any, ahead: bool = True) -> tuple[float, float | None, list[tuple]]:
        """(seconds, loss on the last stage's rank, this rank's events) of one step; AHEAD:
        False for the headers and blocking receives of a first step (--old-receives)."""
        if not self.inside:
            barrier(self.world, False)
            return 0.0, None, []
        self.pipe._ahead = ahead
        for p in self.cparams:
            p.grad = None
        r, last = self.sub.Get_rank(), self.pipe.order.place(self.pipe.order.stages - 1)[0]
        barrier(self.world, True)
        t0 = time.perf_counter()
        loss = self.pipe.step(idx if r == 0 else None, tgt if r == last else None)
        dt = time.perf_counter() - t0
        return dt, loss, work_events(self.pipe)

    def torch_step(self, idx: Any, tgt: Any) -> tuple[float, float | None, str]:
        """(seconds, loss on the last stage's rank, the error torch raised or "")."""
        if not self.inside:
            barrier(self.world, False)
            return 0.0, None, ""
        assert self.tp is not None
        for m in self.tp["mods"]:
            m.zero_grad(set_to_none=True)
        barrier(self.world, True)
        t0 = time.perf_counter()
        try:
            loss, err = torch_step(self.tp, idx, tgt, self.live), ""
        except Exception as e:  # noqa: BLE001
            loss, err = None, f"{type(e).__name__}: {e}"
        return time.perf_counter() - t0, loss, err

    def run(self, idx: Any, tgt: Any) -> dict[str, Any] | None:
        """The timed steps (one warm-up, then --reps, coconet's and torch's in turn); rank 0's result."""
        from mpi4py import MPI
        world = self.world
        ct: list[float] = []
        tt: list[float] = []
        ot: list[float] = []
        events: list[list[list[tuple]]] = []  # per timed step, per rank
        self.step_orders: list[Any] = []  # per timed step, the order it ran (retimed: Pipeline's retime)
        losses = (0.0, 0.0)
        gc.collect()  # the previous case's garbage collected now, not inside a timed step
        gc.disable()
        for rep in range(self.a.reps + 1):
            used = self.pipe.order if self.inside else None
            dt, cl, evs = self.coconet_step(idx, tgt)
            ct.append(world.allreduce(dt, op=MPI.MAX))
            got = world.gather(evs, root=0)
            if rep > 0 and world.Get_rank() == 0:
                events.append(got[:self.P])
                self.step_orders.append(used)
            if self.a.old_receives:
                ot.append(world.allreduce(self.coconet_step(idx, tgt, ahead=False)[0], op=MPI.MAX))
            tl = None
            sched = self.tp["schedule"] if self.tp else None
            if hasattr(sched, "use") and sched.source is not self.pipe.order:
                sched.use(self.pipe.order)  # (coconet's lists built again for its times: torch runs them too)
            if not self.torch_err:
                dt, tl, err = self.torch_step(idx, tgt)
                tt.append(world.allreduce(dt, op=MPI.MAX))
                self.torch_err = next((e for e in world.allgather(err) if e), "")
            if rep == 0:
                losses = (world.allreduce(cl or 0.0), world.allreduce(tl or 0.0))
                self.torch_times.clear()  # (the warm-up step's actions are not counted)
        gc.enable()
        cbytes = coconet_saved_bytes(self.chunks, self.a, self.M) if self.inside else 0
        tp = self.tp
        per_rank = world.gather({"cbytes": cbytes, "tbytes": tp["saved_bytes"] if tp else 0, "tlive": self.live[0],
                                 "tname": tp["name"] if tp else None, "tnote": tp["note"] if tp else "",
                                 "ttimes": self.torch_times}, root=0)
        if world.Get_rank() != 0:
            return None
        res = self.summary(ct[1:], tt[1:] if not self.torch_err else [], losses, events, per_rank[:self.P])
        if ot:
            res.update({"coconet_old_s": statistics.median(ot[1:]), "coconet_old_times_s": ot[1:]})
            res["old_over_new"] = res["coconet_old_s"] / res["coconet_s"]
        return res

    def summary(self, ct: list[float], tt: list[float], losses: tuple[float, float], events: list[Any],
                per_rank: list[dict[str, Any]]) -> dict[str, Any]:
        from coconetc.pipeline import orders
        P, M, order = self.P, self.M, self.order
        res: dict[str, Any] = {"P": P, "M": M, "order": order, "coconet_s": statistics.median(ct),
                               "coconet_times_s": ct, "torch_s": statistics.median(tt) if tt else None,
                               "torch_times_s": tt, "torch_schedule": per_rank[0]["tname"],
                               "torch_note": per_rank[0]["tnote"] or None, "torch_error": self.torch_err or None}
        res["ratio"] = res["torch_s"] / res["coconet_s"] if tt else None
        res["loss_coconet"], res["loss_torch"] = losses
        if tt:
            res["loss_rel_diff"] = abs(losses[0] - losses[1]) / abs(losses[1])
            res["loss_match"] = res["loss_rel_diff"] <= 1e-4
        res["bubble_measured"] = statistics.median(bubble_of(evs) for evs in events)
        res["bubble_measured_by_step"] = [bubble_of(evs) for evs in events]
        res["coconet_events_last_step"] = events[-1]  # per rank: (kind, micro-batch, chunk, start, end, work)
        # coconet's own action times (their work: receive waits taken out), the median of each
        # kind over every action, printed beside torch's
        durs: dict[str, list[float]] = {"F": [], "B": [], "W": []}
        for evs in events:
            for rank_evs in evs:
                for e in rank_evs:
                    durs[e[0]].append(e[5])
        res["costs_s"] = {k: statistics.median(v) if v else 0.0 for k, v in durs.items()}
        if tt:  # torch's action times, every rank's, by kind: the step's ratio is theirs over coconet's
            tdurs = {k: [x for p in per_rank for x in p["ttimes"].get(k, [])] for k in "FBW"}
            res["torch_costs_s"] = {k: statistics.median(v) if v else 0.0 for k, v in tdurs.items()}
        o = self.pipe.order  # (as the last timed step ran it)
        mean, per_mean, warm = model_costs(events)
        res["model_costs_s"] = mean
        res["costs_per_rank_s"] = [[r, c, k, t] for (r, c, k), t in sorted(per_mean.items())]  # rank, chunk, kind
        res["first_action_extra_s"] = warm
        over = [step_overheads(evs, o) for evs in events]
        lat, gaps = [x for t, _ in over for x in t], [x for _, g in over for x in g]
        transfer = max(0.0, statistics.median(lat)) if lat else 0.0
        gap = max(0.0, statistics.fmean(gaps)) if gaps else 0.0
        res["transfer_latency_s"], res["action_gap_s"] = transfer, gap
        sim = orders.simulate(o, orders.Costs(forward=mean["F"], backward=mean["B"], input_grad=mean["B"],
                                              weight_grad=mean["W"], transfer=transfer, first=warm, gap=gap))
        res["bubble_predicted"] = sim.bubble()
        stage_costs = []  # each virtual stage's mean F, B, W on its rank
        for st in range(o.stages):
            r, c = o.place(st)
            t = {k: per_mean.get((r, c, k), 0.0) for k in "FBW"}
            stage_costs.append(orders.Costs(forward=t["F"], backward=t["B"], input_grad=t["B"], weight_grad=t["W"],
                                            transfer=transfer, first=warm, gap=gap))
        res["bubble_predicted_per_stage"] = orders.simulate(o, stage_costs).bubble()
        # each step replayed: the order's dependencies with each action's own work (what is left
        # between this and the measured bubble: waiting that no action's time explains)
        res["bubble_replayed"] = statistics.median(
            orders.simulate(ran, stage_costs, times={(r, orders.Action(e[0], e[1], e[2])): e[5]
                                                     for r, rank_evs in enumerate(evs) for e in rank_evs}).bubble()
            for evs, ran in zip(events, self.step_orders))
        res["bubble_textbook"] = orders.predicted_bubble(order, P, M, o.chunks,
                                                         orders.Costs(mean["F"], mean["B"], mean["B"], mean["W"]))
        # peak activations on the measured timeline of the last step
        slots = tuple(orders.Slot(r, orders.Action(e[0], e[1], e[2]), o.stage(r, e[2]), e[3], e[4])
                      for r, rank_evs in enumerate(events[-1]) for e in rank_evs)
        meas = orders.Timeline(o, tuple(sorted(slots, key=lambda x: (x.rank, x.start))), max(x.end for x in slots))
        peaks = [meas.peak_activations(r) for r in range(P)]
        cb = [p["cbytes"] for p in per_rank]
        res.update({"coconet_peak_microbatches": peaks,
                    "coconet_peak_microbatches_simulated": [sim.peak_activations(r) for r in range(P)],
                    "coconet_saved_bytes_per_microbatch": cb, "coconet_peak_microbatches_max": max(peaks),
                    "coconet_peak_bytes": max(n * b for n, b in zip(peaks, cb))})
        if tt:
            tl, tb = [p["tlive"] for p in per_rank], [p["tbytes"] for p in per_rank]
            res.update({"torch_peak_microbatches": tl, "torch_saved_bytes_per_microbatch": tb,
                        "torch_peak_microbatches_max": max(tl), "torch_peak_bytes": max(n * b for n, b in zip(tl, tb))})
        return res


def model_costs(events: list[Any]) -> tuple[dict[str, float], dict[tuple[int, int, str], float], float]:
    """The cost model's action times from coconet's events of every timed step (per rank: (kind,
    micro-batch, chunk, start, end, work)): each kind's mean work, each (rank, chunk, kind)'s, each
    rank's first action of a step left out (a step's work is the sum of its actions', which their
    mean gives and their median, the slower actions being the rarer, does not); and a step's
    warm-up (Costs.first): the median over steps and ranks of a rank's first action's work over
    its kind's mean on its rank."""
    every: dict[Any, list[float]] = {}  # (rank, chunk, kind) and kind -> every action's work
    later: dict[Any, list[float]] = {}  # the same, each rank's first action of a step left out
    for evs in events:
        for r, rank_evs in enumerate(evs):
            for i, e in enumerate(rank_evs):
                for key in ((r, e[2], e[0]), e[0]):
                    every.setdefault(key, []).append(e[5])
                    if i:
                        later.setdefault(key, []).append(e[5])
    # (a kind that a rank runs only first in a step, as at M = 1: its firsts)
    means = {key: statistics.fmean(later.get(key) or v) for key, v in every.items()}
    per_rank = {k: t for k, t in means.items() if isinstance(k, tuple)}
    firsts = [e[5] - per_rank[(r, e[2], e[0])] for evs in events for r, rank_evs in enumerate(evs)
              for e in rank_evs[:1]]
    return {k: means.get(k, 0.0) for k in "FBW"}, per_rank, max(0.0, statistics.median(firsts)) if firsts else 0.0


def init_gloo(comm: Any) -> Any:
    """torch.distributed over gloo on the mpiexec job's ranks: MASTER_ADDR 127.0.0.1, a free
    port of rank 0's broadcast over MPI."""
    import torch.distributed as dist
    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=comm.Get_rank(), world_size=comm.Get_size())
    return dist


def details(results: list[dict[str, Any]]) -> None:
    """The losses' check, torch's notes, coconet's action times and the bubble's prediction error."""
    print("\nfirst-step losses (coconet / torch, relative difference; tolerance 1e-4):")
    for r in results:
        if "loss_rel_diff" in r:
            print(f"  P={r['P']} M={r['M']} {r['order']:14s} {r['loss_coconet']:.6f} / {r['loss_torch']:.6f}  "
                  f"{r['loss_rel_diff']:.1e} {'ok' if r['loss_match'] else 'MISMATCH'}")
    notes = {}
    for r in results:
        for key in ("torch_note", "torch_error"):
            if r.get(key):
                notes.setdefault(r[key], []).append(f"P={r['P']} M={r['M']} {r['order']}")
    for text, where in notes.items():
        print(f"note ({', '.join(where)}): {text}")
    print("coconet's action times (median work, ms; receive waits taken out; the cost model takes their means); "
          "torch's (median, ms) and torch / coconet where torch ran:")
    for r in results:
        c, t = r["costs_s"], r.get("torch_costs_s")
        line = f"  P={r['P']} M={r['M']} {r['order']:14s} F {c['F'] * 1e3:.2f}  B {c['B'] * 1e3:.2f}" + (
            f"  W {c['W'] * 1e3:.2f}" if c["W"] else "")
        if t:
            line += "   torch " + "  ".join(f"{k} {t[k] * 1e3:.2f} ({t[k] / c[k]:.2f}x)" for k in "FBW" if t[k] and c[k])
        print(line)
    for key, what in (("bubble_predicted", "orders.simulate, one cost a kind"),
                      ("bubble_predicted_per_stage", "each rank's own costs"),
                      ("bubble_replayed", "each step replayed with each action's own time")):
        gaps = [abs(r["bubble_measured"] - r[key]) / max(r[key], 1e-9) for r in results]
        if gaps:
            print(f"measured against predicted bubble ({what}): largest difference {max(gaps):.0%} of the "
                  f"predicted; within 10% in {sum(g <= 0.1 for g in gaps)} of {len(gaps)} cases")


def report(results: list[dict[str, Any]], a: argparse.Namespace, meta: dict[str, Any]) -> None:
    print(f"\nnanoGPT pipeline step (forward + backward of the batch), f32, {a.layers} layers, H={a.hidden}, "
          f"{a.heads} heads, T={a.seq}, B={a.batch}, vocabulary {a.vocab}; one rank a stage; median of {a.reps} "
          "(slowest rank); bubble: idle fraction of coconet's ranks, measured / simulated with its own action "
          "times; peak: the most micro-batches held by a rank x one micro-batch's saved bytes (max over ranks)")
    head = (f"{'P':>2s} {'M':>2s} {'order':14s} {'coconet ms':>10s} {'torch ms':>9s} {'torch/cc':>8s} "
            f"{'bubble':>7s} {'pred':>6s} {'pred/st':>7s} {'cc peak':>7s} {'cc MB':>7s} {'th peak':>7s} {'th MB':>7s}  torch schedule")
    if a.old_receives:
        head = head.replace(" torch ms", f" {'old ms':>8s} {'old/new':>7s} torch ms")
    print(head)
    for r in results:
        tms = f"{r['torch_s'] * 1e3:9.1f}" if r.get("torch_s") else f"{'-':>9s}"
        ratio = f"{r['ratio']:8.2f}" if r.get("ratio") else f"{'-':>8s}"
        tpk = f"{r['torch_peak_microbatches_max']:7d}" if "torch_peak_microbatches_max" in r else f"{'-':>7s}"
        tmb = f"{r['torch_peak_bytes'] / 2**20:7.2f}" if "torch_peak_bytes" in r else f"{'-':>7s}"
        sched = r["torch_schedule"] or "-"
        if r.get("torch_error") and not r.get("torch_s"):
            sched += " (not run: see the notes)"
        old = f" {r['coconet_old_s'] * 1e3:8.1f} {r['old_over_new']:7.2f}" if "coconet_old_s" in r else ""
        print(f"{r['P']:2d} {r['M']:2d} {r['order']:14s} {r['coconet_s'] * 1e3:10.1f}{old} {tms} {ratio} "
              f"{r['bubble_measured']:7.3f} {r['bubble_predicted']:6.3f} {r['bubble_predicted_per_stage']:7.3f} "
              f"{r['coconet_peak_microbatches_max']:7d} "
              f"{r['coconet_peak_bytes'] / 2**20:7.2f} {tpk} {tmb}  {sched}")
    details(results)
    if a.json:
        out = Path(a.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**meta, "results": results}, indent=2))
        print(f"\nwrote {out}")


ENV_PART = "COCONET_BENCH_PIPELINE_PART"  # jobs(): where a job's rank 0 writes its cases


def jobs(a: argparse.Namespace) -> int:
    """Each P of --stages in a job of its own of P ranks (a pipeline of P stages of one rank as a
    user runs one: no idle ranks beside it on the cores), one after the other; then the report of
    every case, as one job's would be. Non-zero if a job failed or found a loss mismatch."""
    import tempfile

    from coconetc.launch.mpiexec import run_python
    # this run's own arguments, a last --stages (argparse keeps an option's last value) naming the job's P
    argv = [str(Path(__file__).resolve()), *sys.argv[1:]]
    results: list[dict[str, Any]] = []
    meta: dict[str, Any] = {}
    rc = 0
    with tempfile.TemporaryDirectory(prefix="coconet-bench-pipeline-") as tmp:
        for P in a.stages:
            part = Path(tmp) / f"P{P}.json"
            rc = max(rc, run_python(P, [*argv, "--stages", str(P)], env={ENV_PART: str(part)}))
            if not part.exists():  # the job ended before its report: its own output says why
                return rc or 1
            meta = json.loads(part.read_text())
            results += meta.pop("results")
    meta["ranks"] = a.stages  # one job a P, of P ranks
    report(results, a, meta)
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--stages", type=ints, default=[2, 4], help="pipeline sizes P (comma-separated; default 2,4)")
    ap.add_argument("--microbatches", type=ints, default=[4, 8], help="micro-batch counts M (default 4,8)")
    ap.add_argument("--orders", type=lambda t: t.split(","), default=list(ORDERS),
                    help=f"comma-separated, of {', '.join(ORDERS)} (default all)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None, help="write every number here")
    ap.add_argument("--no-torch", action="store_true", help="coconet's pipeline only")
    ap.add_argument("--old-receives", action="store_true",
                    help="time coconet's step with a header and a blocking receive a message too")
    a = ap.parse_args()
    check_args(a)
    ranks = max(a.stages)
    if "OMPI_COMM_WORLD_SIZE" not in os.environ and "PMI_SIZE" not in os.environ:  # build once, then the jobs
        import coconetc
        coconetc.load(GPT_BLOCK, log=lambda msg: None, grad=(f"{PROGRAM}:x",))
        return jobs(a)
    os.environ.setdefault("COCONET_THREADS", "1")
    import warnings

    import torch
    from mpi4py import MPI
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    if world.Get_size() < ranks:
        raise SystemExit(f"--stages {max(a.stages)} needs {ranks} ranks, the job has {world.Get_size()}")
    dist = init_gloo(world)
    from coconetc.torch.pipeline import Block
    block = Block(GPT_BLOCK, PROGRAM, comm=MPI.COMM_SELF)
    model = base_model(a)
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(a.vocab, (a.batch, a.seq), generator=g)
    tgt = torch.randint(a.vocab, (a.batch, a.seq), generator=g)
    results = []
    for P in a.stages:
        sub = world.Split(0 if rank < P else MPI.UNDEFINED, rank)
        group = dist.new_group(list(range(P)))
        for M in a.microbatches:
            for order in a.orders:
                if order == "interleaved" and M % P:
                    if rank == 0:
                        print(f"P={P} M={M} interleaved: M not divisible by P (Megatron's requirement): not run")
                    continue
                case = Case(world, sub if rank < P else None, group if rank < P else None, P, M, order, a,
                            model, block)
                res = case.run(idx, tgt)
                if rank == 0:
                    print(f"P={P} M={M} {order}: coconet {res['coconet_s'] * 1e3:.1f} ms, torch "
                          + (f"{res['torch_s'] * 1e3:.1f} ms" if res["torch_s"] else "-"), flush=True)
                    results.append(res)
    if rank == 0:
        meta = {"machine": platform.node(), "processor": platform.processor() or platform.machine(),
                "cpus": os.cpu_count(), "ranks": world.Get_size(), "threads_per_rank": 1,
                "coconet_threads": os.environ.get("COCONET_THREADS"), "torch": torch.__version__, "dtype": "f32",
                "sizes": {"layers": a.layers, "hidden": a.hidden, "heads": a.heads, "seq": a.seq, "batch": a.batch,
                          "vocab": a.vocab}, "reps": a.reps, "interleaved_chunks": V_INTERLEAVED}
        part = os.environ.get(ENV_PART)
        if part:  # one job of jobs(): its cases for the report of every P
            Path(part).write_text(json.dumps({**meta, "results": results}))
        else:
            report(results, a, meta)
    bad = world.bcast([f"P={r['P']} M={r['M']} {r['order']}" for r in results if r.get("loss_match") is False]
                      if rank == 0 else None, root=0)
    world.Barrier()
    dist.destroy_process_group()
    if bad and rank == 0:
        print(f"MISMATCH: coconet's and torch's first-step losses differ by more than 1e-4 relative in "
              f"{', '.join(bad)}: not the same work", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
