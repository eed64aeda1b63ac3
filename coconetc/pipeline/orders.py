"""Pipeline-parallel micro-batch orders: which forward (F), backward (B) and weight-gradient (W)
action each pipeline rank runs, in which order; checked for completeness and deadlock, and
simulated to give a timeline, its bubble and its peak activations.

A bottom layer: it imports nothing from coconetc. The runtime (`coconetc/torch/pipeline.py`)
runs each rank's list strictly in order, with non-blocking sends and blocking receives;
`check` and `simulate` use exactly those rules, so an order that passes `check` cannot hang a
runtime that keeps them, and `simulate` gives the time it takes under given `Costs`.

The orders (P ranks, M micro-batches, V model chunks per rank):

- `gpipe`: every F, then every B, both in micro-batch order (torch's ScheduleGPipe).
- `1f1b`: P - rank - 1 warm-up forwards, then one F and one B in turn, then the remaining
  backwards (PipeDream-flush, Megatron's and torch's Schedule1F1B).
- `interleaved`: Megatron's interleaved 1F1B: V chunks per rank, virtual stage
  `chunk * P + rank`; micro-batches go through the chunks in groups of P; warm-up of
  2 (P - rank - 1) + (V - 1) P forwards (Megatron's `forward_backward_pipelining_with_
  interleaving`, torch's ScheduleInterleaved1F1B). Needs M divisible by P.
- `zero_bubble`: ZB-H1 (Qi et al. 2023, torch's ScheduleInterleavedZeroBubble with one chunk):
  1F1B's F/B order with B the input gradient only; rank r runs its first r steady-state steps
  without their W and every later step as F, B, W, so the r held-back W's fill the idle end
  of the pipeline. Every rank then holds at most P micro-batches' activations, 1F1B's peak
  (reached on its rank 0); the idle time falls from (P-1)(F+B+W) to (P-1)(F+B-W).
- `zero_bubble_h2`: ZB-H2 (Qi et al. 2023), zero bubble for more memory: every rank may hold
  up to 2P - 1 micro-batches' activations (from an F's start to its W's end), so the first
  ranks run more forwards before their first B and every rank keeps W's back to fill the end
  of the pipeline. Built by list scheduling with F = B = W, or with the action times given to
  `make` (`_list_scheduled`; the runtime gives it those it measured); what is left idle is
  mostly the pipeline's start, rank r waiting r forwards, and the last micro-batch's B
  travelling back. Not one of torch's single-stage schedules (bench/pipeline.py runs torch's
  pipelining on these very action lists).
- `zero_bubble_v`: ZB-V (Qi et al. 2024, "Pipeline parallelism with controllable memory";
  torch's ScheduleZBVZeroBubble): 2 chunks a rank placed in a V, rank r holding virtual stages
  r and 2P - 1 - r, so the first and the last stage are rank 0's and a micro-batch turns back
  at rank P - 1 without a transfer; the backward split into B and W, and every rank holding
  at most 2P chunks' activations (1F1B's peak: each chunk is half a stage). Built by the same
  list scheduling as ZB-H2 over the virtual stages (`_list_scheduled`, for given times alike); with F = B = W it
  idles only while the pipeline fills, about a third of 1F1B's bubble at equal memory.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

ORDERS = ("gpipe", "1f1b", "interleaved", "zero_bubble", "zero_bubble_h2", "zero_bubble_v")
SPLIT = ("zero_bubble", "zero_bubble_h2", "zero_bubble_v")  # the orders that split each backward into B and W
V_SHAPED = ("zero_bubble_v",)  # the orders whose rank r holds stages r and 2P - 1 - r (2 chunks)
LIST_SCHEDULED = ("zero_bubble_h2", "zero_bubble_v")  # built for given action times (make's costs)
KINDS = ("F", "B", "W")


def default_chunks(name: str) -> int:
    """The model chunks a rank holds under order NAME when the schedule does not say:
    2 for interleaved and zero_bubble_v, else 1."""
    return 2 if name == "interleaved" or name in V_SHAPED else 1


def _chunks(name: str, chunks: int | None) -> int:
    """CHUNKS as given, or NAME's own where None (1 for a name that is no order: refused after)."""
    return (default_chunks(name) if name in ORDERS else 1) if chunks is None else chunks


@dataclass(frozen=True)
class Action:
    """One step of a rank: `kind` F (forward), B (backward: the input gradient only when the
    order splits the backward, else the whole backward) or W (weight gradient) of micro-batch
    `microbatch` through this rank's model chunk `chunk`."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class Order:
    """Every rank's actions, in execution order. Virtual stage `chunk * ranks + rank` holds
    the model's layers in stage order (Megatron's interleaved mapping); where `v_shaped`, rank
    r's chunk 0 is stage r and its chunk 1 stage 2 ranks - 1 - r (ZB-V's)."""

    name: str
    ranks: int
    microbatches: int
    chunks: int
    split_backward: bool
    actions: tuple[tuple[Action, ...], ...]
    v_shaped: bool = False

    @property
    def stages(self) -> int:
        return self.ranks * self.chunks

    def stage(self, rank: int, chunk: int) -> int:
        """The virtual stage (0..P*V-1) of this rank's chunk."""
        if not (0 <= rank < self.ranks and 0 <= chunk < self.chunks):
            raise ValueError(f"no rank {rank} chunk {chunk} in an order of {self.ranks} ranks "
                             f"with {self.chunks} chunks each")
        if self.v_shaped and chunk % 2:
            return (chunk + 1) * self.ranks - 1 - rank
        return chunk * self.ranks + rank

    def place(self, stage: int) -> tuple[int, int]:
        """(rank, chunk) that runs a virtual stage."""
        if not 0 <= stage < self.stages:
            raise ValueError(f"no stage {stage}: the order has stages 0..{self.stages - 1}")
        chunk, rank = divmod(stage, self.ranks)
        return (self.ranks - 1 - rank if self.v_shaped and chunk % 2 else rank), chunk


def layer_bounds(layers: int, stages: int) -> list[int]:
    """How LAYERS layers go to STAGES virtual stages when nothing says otherwise: layer l runs
    on stage s when bounds[s] <= l < bounds[s + 1], as even as can be, the first stages taking
    one more when the layers do not divide."""
    q, rem = divmod(layers, stages)
    bounds = [0]
    for s in range(stages):
        bounds.append(bounds[-1] + q + (s < rem))
    return bounds


def make(name: str, ranks: int, microbatches: int, chunks: int | None = None,
         costs: Costs | Sequence[Costs] | None = None) -> Order:
    """The order `name` for `ranks` pipeline ranks, `microbatches` micro-batches and `chunks`
    model chunks per rank (more than one only for `interleaved` and `zero_bubble_v`; by
    default the order's own, default_chunks). COSTS (one Costs, or one a virtual stage, in
    stage order): the action times the list-scheduled orders (LIST_SCHEDULED) are built for,
    in place of F = B = W (of the lists built for them and those built for F = B = W, the one
    that ends first under them: list scheduling is greedy); the other orders are the same for
    any."""
    chunks = _chunks(name, chunks)
    _check_arguments(name, ranks, microbatches, chunks)
    P, M = ranks, microbatches
    if costs is not None and not isinstance(costs, Costs) and len(costs) != ranks * chunks:
        raise ValueError(f"make: {len(costs)} stages' costs for an order of {ranks * chunks} virtual stages")
    if name == "gpipe":
        lists = [[Action("F", m) for m in range(M)] + [Action("B", m) for m in range(M)]
                 for _ in range(P)]
    elif name == "1f1b":
        lists = [_one_f_one_b(P, M, r) for r in range(P)]
    elif name == "interleaved":
        lists = [_interleaved(P, M, chunks, r) for r in range(P)]
    elif name == "zero_bubble":
        lists = [_zb_h1(P, M, r) for r in range(P)]
    else:
        shape = Order(name, P, M, chunks, True, (), name in V_SHAPED)
        limit = 2 * P if shape.v_shaped else 2 * P - 1
        unit = replace(shape, actions=tuple(map(tuple, _list_scheduled(shape, limit))))
        if costs is None:
            return unit
        timed = replace(shape, actions=tuple(map(tuple, _list_scheduled(shape, limit, costs))))
        return min((timed, unit), key=lambda o: simulate(o, costs).makespan)
    return Order(name, P, M, chunks, name in SPLIT, tuple(tuple(a) for a in lists), name in V_SHAPED)


def _check_arguments(name: str, ranks: int, microbatches: int, chunks: int) -> None:
    if name not in ORDERS:
        raise ValueError(f"unknown pipeline order {name!r}; the orders are {', '.join(ORDERS)}")
    if ranks < 1:
        raise ValueError(f"ranks={ranks}: a pipeline needs at least one rank "
                         "(use ranks=1 for no pipeline)")
    if microbatches < 1:
        raise ValueError(f"microbatches={microbatches}: a step needs at least one micro-batch "
                         f"(use microbatches={max(ranks, 1)} or more to fill {ranks} ranks)")
    if chunks < 1:
        raise ValueError(f"chunks={chunks}: each rank holds at least one model chunk "
                         "(use chunks=1, or chunks=2 with order 'interleaved')")
    if name in V_SHAPED and chunks != 2:
        raise ValueError(f"order {name!r} runs 2 model chunks a rank (placed in a V), not chunks={chunks}: "
                         "use chunks=2, or order 'interleaved' for another number of chunks")
    if name != "interleaved" and name not in V_SHAPED and chunks != 1:
        raise ValueError(f"order {name!r} runs one model chunk per rank, not chunks={chunks}: "
                         "use chunks=1, or order 'interleaved' for several chunks")
    if name == "interleaved" and chunks < 2:
        raise ValueError(f"order 'interleaved' needs at least 2 model chunks per rank, not "
                         f"chunks={chunks}: use chunks=2, or order '1f1b' for one chunk")
    if name == "interleaved" and microbatches % ranks:
        lower, upper = microbatches // ranks * ranks, (microbatches // ranks + 1) * ranks
        use = f"microbatches={lower} or microbatches={upper}" if lower else f"microbatches={upper}"
        raise ValueError(f"order 'interleaved' needs microbatches divisible by ranks "
                         f"(Megatron's requirement: micro-batches go through the chunks in "
                         f"groups of {ranks}), not microbatches={microbatches} with "
                         f"ranks={ranks}: use {use}")


def _one_f_one_b(P: int, M: int, rank: int) -> list[Action]:
    warmup = min(P - rank - 1, M)
    acts = [Action("F", m) for m in range(warmup)]
    for i in range(M - warmup):
        acts += [Action("F", warmup + i), Action("B", i)]
    return acts + [Action("B", m) for m in range(M - warmup, M)]


def _interleaved(P: int, M: int, V: int, rank: int) -> list[Action]:
    """Megatron's order: the k-th forward of a rank runs chunk (k // P) % V on micro-batch
    (k // (P V)) P + k % P; the k-th backward the same with the chunks reversed."""
    total = M * V
    warmup = min(2 * (P - rank - 1) + (V - 1) * P, total)

    def nth(k: int, kind: str) -> Action:
        chunk = k % (P * V) // P
        return Action(kind, k // (P * V) * P + k % P, chunk if kind == "F" else V - 1 - chunk)

    acts = [nth(k, "F") for k in range(warmup)]
    for i in range(total - warmup):
        acts += [nth(warmup + i, "F"), nth(i, "B")]
    return acts + [nth(k, "B") for k in range(total - warmup, total)]


def _zb_h1(P: int, M: int, rank: int) -> list[Action]:
    """1F1B's F/B order; W of a step follows its B except on the rank's first `rank` steady
    steps, whose W's wait until the end."""
    warmup = min(P - rank - 1, M)
    acts = [Action("F", m) for m in range(warmup)]
    w = 0  # the next W to run, in micro-batch order
    for i in range(M - warmup):
        acts += [Action("F", warmup + i), Action("B", i)]
        if i >= rank:
            acts.append(Action("W", w))
            w += 1
    for m in range(M - warmup, M):
        acts += [Action("B", m), Action("W", w)]
        w += 1
    return acts + [Action("W", m) for m in range(w, M)]


def _list_scheduled(shape: Order, limit: int, costs: Costs | Sequence[Costs] | None = None) -> list[list[Action]]:
    """Each rank's list for SHAPE's ranks, micro-batches, chunks and placement (its actions
    unused), by list scheduling with F = B = W = 1 and at most LIMIT (chunk, micro-batch)
    activations held a rank (from an F's start to its W's end): the earliest action any rank
    can start goes next (ties: the lower rank); a rank picks, of each chunk's next B (once the
    next stage's B of it has ended), each chunk's next F (once the previous stage's has, if it
    holds fewer than LIMIT) and its oldest W not run, the one that can start first; on a tie B
    before F before W, and the later stage first. So a W runs only where the rank would
    otherwise wait, or where the limit stops its next F (ZB-H2 with one chunk and 2P - 1, ZB-V
    with two in a V and 2P). A heap of each rank's choice; an action changes only its own
    rank's and its neighbours' (the ranks of the stages next to its stage). COSTS (one Costs, or
    one a virtual stage): each action's time in place of 1 (F, B, W: forward, input_grad,
    weight_grad), so the W's fill the gaps those times leave. Where that fills a rank with first
    chunks' activations so that nothing can go on (ZB-V with unequal times can), scheduled again
    with a new micro-batch let in only where all its chunks' activations fit."""
    return _ListScheduler(shape, limit, costs, False).run() or _ListScheduler(shape, limit, costs, True).run() or []


class _ListScheduler:
    def __init__(self, shape: Order, limit: int, costs: Costs | Sequence[Costs] | None, reserve: bool):
        P, V = shape.ranks, shape.chunks
        self.costs, self.reserve = costs, reserve
        self.shape, self.limit, self.last = shape, limit, shape.stages - 1
        self.acts: list[list[Action]] = [[] for _ in range(P)]
        self.ends: dict[tuple[str, int, int], float] = {}  # (kind, stage, micro-batch) -> end
        self.free = [0.0] * P
        self.nf, self.nb = [[0] * V for _ in range(P)], [[0] * V for _ in range(P)]
        self.backs: list[list[Action]] = [[] for _ in range(P)]  # each rank's B's whose W has not run
        self.held = [0] * P
        self.version = [0] * P
        self.heap: list[tuple[float, int, int, int, int, Action]] = []  # (start, rank, version, tie, -stage, action)

    def run(self) -> list[list[Action]] | None:
        shape = self.shape
        for r in range(shape.ranks):
            self.choose(r)
        while self.heap:
            start, r, v, _, _, a = heapq.heappop(self.heap)
            if v != self.version[r]:
                continue  # (a choice made before the rank or a neighbour moved on)
            s = shape.stage(r, a.chunk)
            if a.kind == "F":
                self.nf[r][a.chunk] += 1
                self.held[r] += 1
            elif a.kind == "B":
                self.nb[r][a.chunk] += 1
                self.backs[r].append(a)
            else:
                self.backs[r].pop(0)
                self.held[r] -= 1
            self.free[r] = self.ends[(a.kind, s, a.microbatch)] = start + self.time(s, a.kind)
            self.acts[r].append(a)
            for q in {shape.place(t)[0] for t in (s - 1, s, s + 1) if 0 <= t <= self.last}:
                self.choose(q)
        if any(len(a) < 3 * shape.microbatches * shape.chunks for a in self.acts):
            assert not self.reserve  # (with it, a later chunk's F never waits for memory)
            return None
        return self.acts

    def time(self, stage: int, kind: str) -> float:
        if self.costs is None:
            return 1.0
        c = self.costs if isinstance(self.costs, Costs) else self.costs[stage]
        return c.of(kind, True)

    def choose(self, r: int) -> None:
        """Push rank R's next action (its earliest ready one) on the heap."""
        ready: list[tuple[float, int, int, Action]] = []
        ends, free, V, nf = self.ends, self.free[r], self.shape.chunks, self.nf[r]
        # the units that the micro-batches past some of this rank's chunks will take in the rest:
        # a new micro-batch starts (chunk 0) only where all of its chunks' fit besides them, so
        # a later chunk's F never waits for memory (no rank can fill up with first chunks)
        reserved = sum((nf[k] - nf[k + 1]) * (V - 1 - k) for k in range(V - 1))
        for c in range(V):
            s, m = self.shape.stage(r, c), self.nb[r][c]
            if m < self.nf[r][c]:
                need = ("F", s, m) if s == self.last else ("B", s + 1, m)
                if need in ends:
                    ready.append((max(free, ends[need]), 0, -s, Action("B", m, c)))
            m = nf[c]
            fits = (c > 0 or self.held[r] + reserved + V <= self.limit) if self.reserve else self.held[r] < self.limit
            if m < self.shape.microbatches and fits and (s == 0 or ("F", s - 1, m) in ends):
                ready.append((max(free, ends.get(("F", s - 1, m), 0.0)), 1, -s, Action("F", m, c)))
        if self.backs[r]:
            b = self.backs[r][0]
            ready.append((free, 2, -self.shape.stage(r, b.chunk), Action("W", b.microbatch, b.chunk)))
        self.version[r] += 1
        if ready:
            start, tie, neg, a = min(ready, key=lambda x: x[:3])
            heapq.heappush(self.heap, (start, r, self.version[r], tie, neg, a))


# What an action waits for: (stage, microbatch, kind) keys.
Key = tuple[int, int, str]


def needs(order: Order, key: Key) -> list[Key]:
    """What the action KEY = (stage, micro-batch, kind) waits for: an F the previous stage's F
    of its micro-batch; a B its own stage's F and the next stage's B; a W its own B."""
    stage, m, kind = key
    if kind == "F":
        return [(stage - 1, m, "F")] if stage > 0 else []
    if kind == "B":
        later = [(stage + 1, m, "B")] if stage < order.stages - 1 else []
        return [(stage, m, "F"), *later]
    return [(stage, m, "B")]


def _name(order: Order, key: Key) -> str:
    stage, m, kind = key
    rank, chunk = order.place(stage)
    return f"{Action(kind, m, chunk)} (stage {stage}, rank {rank})"


def check(order: Order) -> None:
    """Raise ValueError, naming the rank and the action, unless every rank's list runs each
    (stage, micro-batch, kind) exactly once, on the rank that holds the stage, and the lists
    run to the end under the runtime's rules without deadlock."""
    _check_shape(order)
    _run(order, Costs(), {})


def _check_shape(order: Order) -> None:
    if order.ranks < 1 or order.microbatches < 1 or order.chunks < 1:
        raise ValueError(f"order {order.name!r}: ranks={order.ranks}, microbatches="
                         f"{order.microbatches}, chunks={order.chunks}; each must be at least 1")
    if len(order.actions) != order.ranks:
        raise ValueError(f"order {order.name!r} has action lists for {len(order.actions)} ranks, "
                         f"not for its ranks={order.ranks}")
    kinds = KINDS if order.split_backward else KINDS[:2]
    seen: set[Key] = set()
    for rank, acts in enumerate(order.actions):
        for i, a in enumerate(acts):
            where = f"order {order.name!r}: rank {rank}, action {i} ({a})"
            _check_action(order, rank, a, kinds, where)
            key = (order.stage(rank, a.chunk), a.microbatch, a.kind)
            if key in seen:
                raise ValueError(f"{where}: runs twice")
            seen.add(key)
    for stage in range(order.stages):
        rank, chunk = order.place(stage)
        for m in range(order.microbatches):
            for kind in kinds:
                if (stage, m, kind) not in seen:
                    raise ValueError(f"order {order.name!r}: rank {rank} never runs "
                                     f"{Action(kind, m, chunk)} (stage {stage}); every stage "
                                     f"runs {', '.join(kinds)} once for each micro-batch")


def _check_action(order: Order, rank: int, a: Action, kinds: tuple[str, ...], where: str) -> None:
    if a.kind == "W" and not order.split_backward:
        raise ValueError(f"{where}: a W, but the order does not split the backward "
                         "(set split_backward=True, or make B the whole backward)")
    if a.kind not in kinds:
        raise ValueError(f"{where}: kind {a.kind!r} is none of {', '.join(kinds)}")
    if not 0 <= a.microbatch < order.microbatches:
        raise ValueError(f"{where}: micro-batch {a.microbatch} is not in "
                         f"0..{order.microbatches - 1}")
    if not 0 <= a.chunk < order.chunks:
        stages = ", ".join(str(order.stage(rank, c)) for c in range(order.chunks))
        raise ValueError(f"{where}: chunk {a.chunk} is not on this rank, which holds chunks "
                         f"0..{order.chunks - 1} (stages {stages})")


@dataclass(frozen=True)
class Costs:
    """Time of one action of one virtual stage, the latency of a transfer between ranks, the
    extra time of a rank's first action of a step, and the time between two actions of a rank."""

    forward: float = 1.0
    backward: float = 2.0  # the whole backward (B + W), when the order does not split it
    input_grad: float = 1.0  # B, when split
    weight_grad: float = 1.0  # W, when split
    transfer: float = 0.0  # added to every dependency between two ranks
    first: float = 0.0  # added to each rank's first action of a step (its warm-up: caches cold after the step before)
    gap: float = 0.0  # a rank's time between two of its actions (the runtime's own: not an action's work, so idle)

    def of(self, kind: str, split_backward: bool) -> float:
        if kind == "F":
            return self.forward
        if kind == "W":
            return self.weight_grad
        return self.input_grad if split_backward else self.backward


@dataclass(frozen=True)
class Slot:
    """One action as simulated."""

    rank: int
    action: Action
    stage: int
    start: float
    end: float


def idle_fraction(actions: Iterable[tuple[float, float, float]], ranks: int) -> float:
    """The bubble of a step whose ACTIONS (start, end, work: the time it computed, less what it
    waited for) ran on RANKS ranks: 1 - work / (ranks x makespan), the makespan from the first
    action's start to the last one's end over the ranks. What the simulation predicts
    (Timeline.bubble), the trace measures (coconetc trace-merge) and the bench reports."""
    acts = list(actions)
    if not acts:
        return 0.0
    span = max(a[1] for a in acts) - min(a[0] for a in acts)
    return 1 - sum(a[2] for a in acts) / (ranks * span) if span > 0 else 0.0


@dataclass(frozen=True)
class Timeline:
    """Every action's start and end when each rank runs its list in order, each action
    starting as soon as the rank is free and its inputs have arrived."""

    order: Order
    slots: tuple[Slot, ...]  # sorted by (rank, start)
    makespan: float

    def busy(self, rank: int) -> float:
        return sum(s.end - s.start for s in self.slots if s.rank == rank)

    def bubble(self) -> float:
        """Idle fraction of the ranks' time until the makespan."""
        return idle_fraction(((s.start, s.end, s.end - s.start) for s in self.slots), self.order.ranks)

    def peak_activations(self, rank: int) -> int:
        """Most micro-batches whose activations the rank holds at once, counted per (chunk,
        micro-batch): held from the F's start until the W's end (the B's when the backward is
        not split). With chunks, each is a chunk's activations, 1/V of a whole stage's."""
        release = "W" if self.order.split_backward else "B"
        events: list[tuple[float, int]] = []  # (time, +1 hold / -1 release); releases first
        for s in self.slots:
            if s.rank == rank and s.action.kind == "F":
                events.append((s.start, 1))
            elif s.rank == rank and s.action.kind == release:
                events.append((s.end, -1))
        held = peak = 0
        for _, step in sorted(events):
            held += step
            peak = max(peak, held)
        return peak


def simulate(order: Order, costs: Costs | Sequence[Costs] = Costs(),
             times: Mapping[tuple[int, Action], float] | None = None) -> Timeline:
    """The timeline of a checked order under `costs`: one Costs for every stage, or one per
    virtual stage (stage order; a stage with more layers, or the embeddings or the head, takes
    longer). TIMES: (rank, action) -> that one action's time, in place of its stage's cost (a
    measured step replayed: what its dependencies alone make of its actions' own times).
    ValueError as `check` for a bad one."""
    _check_shape(order)
    if not isinstance(costs, Costs) and len(costs) != order.stages:
        raise ValueError(f"simulate: {len(costs)} stages' costs for an order of {order.stages} virtual stages")
    slots = _run(order, costs, times or {})
    return Timeline(order, tuple(sorted(slots, key=lambda s: (s.rank, s.start))),
                    max((s.end for s in slots), default=0.0))


def _run(order: Order, costs: Costs | Sequence[Costs], times: Mapping[tuple[int, Action], float]) -> list[Slot]:
    """Run every rank's list in order: an action starts once its rank is free and what it needs
    has ended (plus `transfer` from another rank). Raises ValueError on a deadlock."""
    ends: dict[Key, float] = {}
    owner = {(order.stage(r, a.chunk), a.microbatch, a.kind): r
             for r, acts in enumerate(order.actions) for a in acts}
    nxt = [0] * order.ranks
    free = [0.0] * order.ranks
    slots: list[Slot] = []
    progress = True
    while progress:
        progress = False
        for rank, acts in enumerate(order.actions):
            while nxt[rank] < len(acts):
                a = acts[nxt[rank]]
                key = (order.stage(rank, a.chunk), a.microbatch, a.kind)
                inputs = needs(order, key)
                if any(n not in ends for n in inputs):
                    break
                c = costs if isinstance(costs, Costs) else costs[key[0]]
                start = max([free[rank] + (c.gap if nxt[rank] else 0.0)]
                            + [ends[n] + (c.transfer if owner[n] != rank else 0) for n in inputs])
                t = times.get((rank, a))
                if t is None:
                    t = c.of(a.kind, order.split_backward) + (c.first if nxt[rank] == 0 else 0.0)
                end = start + t
                ends[key] = free[rank] = end
                slots.append(Slot(rank, a, key[0], start, end))
                nxt[rank] += 1
                progress = True
    blocked = [r for r in range(order.ranks) if nxt[r] < len(order.actions[r])]
    if blocked:
        raise ValueError(f"order {order.name!r} deadlocks: "
                         + "; ".join(_blocked(order, r, nxt, ends, owner) for r in blocked))
    return slots


def _blocked(order: Order, rank: int, nxt: list[int], ends: dict[Key, float],
             owner: dict[Key, int]) -> str:
    a = order.actions[rank][nxt[rank]]
    key = (order.stage(rank, a.chunk), a.microbatch, a.kind)
    waits = []
    for n in needs(order, key):
        if n in ends:
            continue
        if owner[n] == rank:
            waits.append(f"{_name(order, n)}, which comes after it on the same rank")
        else:
            waits.append(f"{_name(order, n)}")
    return (f"rank {rank} waits at action {nxt[rank]} ({a}, stage {key[0]}) for "
            + " and ".join(waits))


def predicted_bubble(name: str, ranks: int, microbatches: int, chunks: int | None = None,
                     costs: Costs = Costs()) -> float:
    """The textbook idle fraction, with P ranks, M micro-batches, V chunks:

    - gpipe, 1f1b: (P-1) / (M+P-1), for any F and B times (P-1 idle (F+B) periods per rank
      against M busy ones);
    - interleaved: (P-1) / (V M + P-1) (Megatron: the bubble of 1F1B divided by V, each
      chunk's F and B being 1/V of a whole stage's);
    - zero_bubble: ZB-H1's idle time (P-1)(F + B - W) per rank against M (F + B + W) busy,
      with F, B, W the forward, input_grad and weight_grad of `costs` ((P-1) / (3M + P-1) for
      the defaults);
    - zero_bubble_h2, zero_bubble_v: no closed form (list-scheduled): the simulated bubble
      under `costs`.

    `simulate` is the source of truth: it can differ from these, most for interleaved with
    few micro-batches."""
    chunks = _chunks(name, chunks)
    _check_arguments(name, ranks, microbatches, chunks)
    P, M, V = ranks, microbatches, chunks
    if name == "interleaved":
        return (P - 1) / (V * M + P - 1)
    if name == "zero_bubble":
        f, b, w = costs.forward, costs.input_grad, costs.weight_grad
        idle = (P - 1) * max(0.0, f + b - w)
        return idle / (M * (f + b + w) + idle)
    if name in LIST_SCHEDULED:
        return simulate(make(name, P, M, V), costs).bubble()
    return (P - 1) / (M + P - 1)


def _label(order: Order, action: Action) -> str:
    """`F3`; `F3.1` (chunk 1) in an order with chunks."""
    chunk = f".{action.chunk}" if order.chunks > 1 else ""
    return f"{action.kind}{action.microbatch}{chunk}"


def render(timeline: Timeline, width: int = 100) -> str:
    """A text chart: a row per rank, time scaled to `width` columns, `.` idle. Each action is its
    label (`F3`, or `F3.1` for chunk 1 of an interleaved order) padded with blanks over its
    duration; when some label does not fit at this width, every action is its kind letter
    (lower case for chunks other than 0) padded with `-`, and a note gives the width that
    fits the labels. Then the bubble and each rank's peak activations."""
    order = timeline.order
    scale = width / timeline.makespan if timeline.makespan > 0 else 0.0
    cells = []
    for s in timeline.slots:
        a = min(round(s.start * scale), width - 1)
        b = max(min(round(s.end * scale), width), a + 1)
        act = s.action
        letter = act.kind if act.chunk == 0 else act.kind.lower()
        cells.append((s.rank, a, b, _label(order, act), letter))
    labels = all(len(label) <= b - a for _, a, b, label, _ in cells)
    rows = [["."] * width for _ in range(order.ranks)]
    for rank, a, b, label, letter in cells:
        rows[rank][a:b] = label.ljust(b - a) if labels else letter.ljust(b - a, "-")
    head = (f"{order.name}: {order.ranks} ranks, {order.microbatches} micro-batches"
            + (f", {order.chunks} chunks per rank" if order.chunks > 1 else "")
            + f"; makespan {timeline.makespan:g}")
    pad = len(f"rank {order.ranks - 1}")
    lines = [head] + [f"{f'rank {r}':<{pad}} |{''.join(row)}|" for r, row in enumerate(rows)]
    shortest = min((s.end - s.start for s in timeline.slots if s.end > s.start), default=0.0)
    if not labels and shortest > 0:
        longest = max(len(label) for *_, label, _ in cells)
        lines.append(f"(kinds only: micro-batches show at width="
                     f"{math.ceil((longest + 1) * timeline.makespan / shortest)})")
    peaks = ", ".join(f"rank {r} {timeline.peak_activations(r)}" for r in range(order.ranks))
    lines.append(f"bubble {timeline.bubble():.4f} ({timeline.bubble():.1%}); "
                 f"peak activations: {peaks}")
    return "\n".join(lines)


COLORS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}


def chart(timeline: Timeline, path: str) -> None:
    """A PNG Gantt chart of the timeline at `path`: a row per rank, colored by kind (paler for
    later chunks), each action labelled as in `render`."""
    try:
        import matplotlib
    except ImportError as e:
        from coconetc.paths import install_command
        raise RuntimeError(f"chart needs matplotlib: {install_command('bench')}") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = timeline.order
    fig, ax = plt.subplots(figsize=(min(24.0, max(6.0, timeline.makespan * 0.25)),
                                    0.5 * order.ranks + 1.2))
    for s in timeline.slots:
        ax.barh(s.rank, s.end - s.start, left=s.start, height=0.8, edgecolor="white",
                color=COLORS.get(s.action.kind, "gray"),
                alpha=1.0 - 0.45 * s.action.chunk / max(1, order.chunks - 1))
        ax.text((s.start + s.end) / 2, s.rank, _label(order, s.action), ha="center",
                va="center", fontsize=6, color="white")
    ax.set_yticks(range(order.ranks), [f"rank {r}" for r in range(order.ranks)])
    ax.invert_yaxis()
    ax.set_xlim(0, timeline.makespan)
    ax.set_xlabel("time")
    ax.set_title(f"{order.name}: P={order.ranks}, M={order.microbatches}"
                 + (f", V={order.chunks}" if order.chunks > 1 else "")
                 + f"; bubble {timeline.bubble():.1%}")
    kinds = [k for k in COLORS if any(s.action.kind == k for s in timeline.slots)]
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in kinds],
              labels=kinds, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
