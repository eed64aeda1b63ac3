"""The execution plan: what runs where, decided once for every backend.

A Plan is the buffers a program's function uses and the ordered units it runs. Units name
values (parameters, stages, temporaries) and say nothing about C++ or CUDA: a backend renders
each unit (templates or small emit functions) and decides nothing of its own.

Values are addressed by name; a Buffer says where a value's elements live on this rank:

    param     a tensor parameter (this rank's part, as the caller passed it)
    segments  a scattered parameter still in its caller's segments
    scalar    a scalar parameter (a 0-d value)
    output    a returned stage, written straight into the array handed back to the caller
    alias     a stage whose elements are written into the parameter it updates (in place)
    scratch   a buffer of the function's own, kept across calls
    register  a value that never reaches memory (lives in a register of its loop)
    chunks    an overlapped matmul's result that exists only as packed chunks
    view      a stage computed in place inside the full-size buffer of the allgather `of`
    into      a stage stored straight into the segments of the scattered parameter `of`

A scratch buffer is private to its rank, or `shared`: in the group's shared window where the
collectives use one (a fused collective or an all-reduce reads it there in place). `unallocated`
names the targets that give a buffer no memory at all (cuda: the packed copy of a scattered
parameter, whose collective reads the segments piece by piece instead).

The per-target facts (plan/targets.py) are fields too: each fused collective's `strategies`
(algorithms and chunking per target), each buffer's placement (`shared`, `unallocated`) and the
plan's `gaps` (what a target does not implement).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from coconetc.errors import NOWHERE, Span
from coconetc.ir.nodes import Expr
from coconetc.ir.ops import shown
from coconetc.ir.types import Dim, TType


@dataclass(frozen=True)
class Buffer:
    name: str
    type: TType  # global type; its layout says which part of it this rank holds
    kind: str  # one of the kinds above
    of: str = ""  # alias/into: the parameter; output: the public name; view: the allgather
    line: int = 0  # the .ccn line of the stage (0: parameters and temporaries)
    shared: bool = False  # scratch: in the group's shared window, not private to the rank
    unallocated: tuple[str, ...] = ()  # the targets that give it no memory (plan/targets.py)
    same_as: str = ""  # scratch: a reshape's result held in its source's memory, no copy (plan/targets.py)
    same_at: int | None = None  # with same_as: an index's row i of its source (its memory from i * this buffer's size)
    reuses: str = ""  # scratch: an all-gathered value held in an earlier one's memory, whose last reader has run (plan/targets.py)
    one_rank_as: str = ""  # scratch: an all-reduce's result or source held in the other's memory where the group is one rank (plan/targets.py)

    @property
    def private(self) -> bool:
        """Memory of this rank's own on every target: not in the group's shared window, and
        allocated everywhere (what a decision to place a value in another's memory needs)."""
        return not self.shared and not self.unallocated


@dataclass(frozen=True)
class Let:
    """A scalar computed once before a loop (beta1 ** step, ...); loops read it by name."""

    name: str
    expr: Expr


@dataclass(frozen=True)
class Item:
    """One value of a loop: expr over the loop's elements; `store`: written to its buffer."""

    name: str
    expr: Expr
    store: bool = True


@dataclass(frozen=True)
class ColSum:
    """dst = sum_lead(value): the column sums (over every leading dim) of one of a loop's items,
    accumulated by the loop as it computes the item, on the backends `on` (plan/colsums.py);
    elsewhere the sum_lead unit computes dst on its own."""

    value: str
    dst: str
    on: tuple[str, ...]


@dataclass(frozen=True)
class Loop:
    """Pointwise work over the elements of `type` (this rank's part): one pass computing
    every item, intermediates in registers. seg_dst: the single item is stored into that
    scattered parameter's segments. colsums: column sums of items the loop also computes."""

    type: TType
    items: tuple[Item, ...]
    lets: tuple[Let, ...] = ()
    seg_dst: str = ""
    line: int = 0
    colsums: tuple[ColSum, ...] = ()


@dataclass(frozen=True)
class Reduce:
    """dst (0-d, or per element for segment_norm) = op over src; cross_rank: src is sliced,
    so the partial results of the ranks are summed (max, min: their largest, smallest)."""

    dst: str
    op: str  # sum | norm | segment_norm | max | min (the language's max(x), min(x))
    src: str
    cross_rank: bool
    line: int = 0


@dataclass(frozen=True)
class Epilogue:
    """What a GEMM (or a row-wise call) applies to the value it writes before storing it
    (plan/epilogue.py): KIND (bias, gelu_bias, residual, scale, bgrad) of OPERAND (a buffer, or a
    scalar's text), the finished value VALUE. Printed as "KIND(OPERAND) -> VALUE"."""

    kind: str
    operand: str
    value: str

    def __str__(self) -> str:
        return f"{self.kind}({self.operand}) -> {self.value}"


@dataclass(frozen=True)
class Library:
    """A library operation (an operation of kind "tensor", ir/ops.py KINDS): matmul (GEMM), layernorm, conv2d, and a derived
    program's matmul_nt, matmul_tn, sum_lead, sum_keep, mean_last, conv2d_dx, conv2d_dw; or an
    extern operation. args: value names, or a Let name for a scalar operand; attrs: the
    operation's settings (integer parameters: stride, padding, n, dim; layernorm's literal eps).
    epilogue: a matmul's fused consumer (plan/epilogue.py), or None;
    fused: the backends ("cpu", "cuda") whose code applies that epilogue in the GEMM (the loop
    after it then renders as nothing); on the others the loop runs after the GEMM.
    accumulate: a matmul_tn that adds its product into dst (beta = 1) on every backend, dst a
    place in a parameter an accumulating backward updates (plan/targets.py accumulated_in_place)."""

    dst: str
    op: str
    args: tuple[str, ...]
    attrs: tuple[tuple[str, object], ...] = ()
    line: int = 0
    epilogue: Epilogue | None = None
    fused: tuple[str, ...] = ()
    grads: LayernormGrads | None = None
    accumulate: bool = False


@dataclass(frozen=True)
class LayernormGrads:
    """A layernorm_dx call that also computes its layernorm's weight and bias gradients
    (plan/lngrads.py): dgamma, the result of a later layernorm_dgamma of the same x, g and eps,
    and dbeta, of a later sum_lead of the same g ("" where there is none), on the backends `on`
    (in one pass over x and g); elsewhere those units compute them on their own."""

    dgamma: str
    dbeta: str
    on: tuple[str, ...]


@dataclass(frozen=True)
class Collective:
    """dst = op(src) over the group's communicator. reduce: the reduction; root, direction:
    broadcast/reduce and send settings; into: an allgather written straight into the segments
    of this scattered parameter; packed: a scattered src first copied into this temporary."""

    dst: str
    op: str
    src: str
    reduce: str = ""
    root: int = 0
    direction: str = ""
    into: str = ""
    packed: str = ""
    line: int = 0
    prefetched: bool = False  # started earlier (a StartGather): here it is waited for


@dataclass(frozen=True)
class StartGather:
    """The start of a weight's all-gather (a schedule's prefetch(depth=d), plan/prefetch.py):
    `gather`, a plain allgather of a parameter's slice (or of a layer of one), started here
    without blocking and waited for at its own place (the Collective there is `prefetched`).
    Between the two no unit writes its source or touches its result."""

    gather: Collective
    line: int = 0


@dataclass(frozen=True)
class Copy:
    """An update not done in place (dst: the parameter) or a parameter returned (dst: the
    public output name)."""

    dst: str
    src: str
    what: str  # update | output


@dataclass(frozen=True)
class Require:
    """A check of the call's group before anything runs (a root must be a rank)."""

    op: str
    root: int


@dataclass(frozen=True)
class Phase:
    """Work on one chunk of a fused collective: pointwise items in one loop over the chunk,
    or a row-wise operation (layernorm) over the chunk's whole rows."""

    kind: str  # pointwise | rows
    items: tuple[Item, ...]


class Choice(str, Enum):
    """One of a decision's values: equal to its text, printed as it (plan/show.py, the tuner's
    labels), so the plan's decisions are named values rather than bare strings."""

    def __str__(self) -> str:  # (enum.StrEnum from Python 3.11)
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Algorithm(Choice):
    """A fused collective's algorithm on one target (Strategy.algorithms)."""

    P2P = "p2p"  # cpu: point-to-point messages between the ranks of the group
    SHM = "shm"  # cpu: the group's shared-memory window, every rank on one node
    PIPELINE = "pipeline"  # cuda: NCCL calls and chunk kernels on two streams
    SYMMETRIC = "symmetric"  # cuda: one kernel over symmetric memory (symmetric.cuh)


class ChunkElems(Choice):
    """Where a fused collective's chunk size comes from (Chunking.elems)."""

    DEFAULT = "default"  # the target's default chunk (its environment knob sets it)
    TASK = "task"  # an overlap task's share of its rows


class Partials(Choice):
    """When a fused collective's reductions over values of the chunk are accumulated."""

    NONE = ""
    PER_CHUNK = "per chunk"
    AFTER_CHUNKS = "after the chunks"


class GatherAfter(Choice):
    """How phase B's closing allgather runs with the loops before it (Fused.gather_after)."""

    NONE = ""
    PER_PIECE = "per piece"  # each piece sent as soon as the loops compute it
    AFTER_LOOP = "after the loop"


class GatherChunks(Choice):
    """How an overlap the other way cuts its gather (GatherMatmul.how)."""

    ROWS = "rows"
    PIECES = "pieces"
    PACKED = "packed"


@dataclass(frozen=True)
class Chunking:
    """How one target cuts a fused collective into chunks: chunks of `elems` elements (the
    target's default chunk, which its environment knob sets: 'default'; or an overlap task's
    share of its rows: 'task'), rounded up to whole rows of `rows` elements (a row-wise phase);
    `progress_rows`: the progress pieces are whole rows too (CPU); `whole_alone`: on one rank
    the whole part is one chunk (CUDA: each chunk kernel reads the source itself, nothing to
    overlap)."""

    elems: ChunkElems = ChunkElems.DEFAULT
    rows: Dim | None = None
    progress_rows: bool = False
    whole_alone: bool = False


@dataclass(frozen=True)
class Strategy:
    """How one target runs a fused collective: `algorithms` it may run, the first always
    possible, each later one chosen when the call runs where the group or the run time allows
    it (cpu: p2p | shm; cuda: pipeline | symmetric); `chunking` its chunks."""

    target: str
    algorithms: tuple[Algorithm, ...]
    chunking: Chunking
    partials: Partials = Partials.NONE  # Fused.partials: per chunk (both targets now) | after the chunks
    gather_after: GatherAfter = GatherAfter.NONE  # Fused.gather_after


@dataclass(frozen=True)
class Fused:
    """A fused collective: `collective` (a reducescatter or an allreduce) reduces src chunk by
    chunk; each chunk's phases run as soon as it arrives; `gather` (an allgather of the value
    `gathered`) sends each computed piece to the other ranks at once. `rows`: chunks hold whole
    rows of this many elements (a row-wise phase). `store_reduced`: the reduced value is also
    kept (something after the chunks reads it). `after`: the fusion's stages that need every
    chunk first (a norm, a segment_norm, and what reads them), run when the chunks are done.
    `partials`: the reductions of `after` (Reduce units, by dst) over values of the chunk: phase
    A accumulates each one's partial result chunk by chunk as the chunks arrive (where the
    target's Strategy.partials is "per chunk": cpu and cuda), one small all-reduce combines them
    across the group, and the rest of `after` (phase B: what reads them, on this rank's slice)
    runs then; under "after the chunks" (no target chooses it now; both renderers take it) they
    run as the Reduce units they are, over the stored values.
    `gather_after`: `after` ends with loops over this rank's slice and the allgather (this
    name) of a value of the last one: where Strategy.gather_after is "per piece" (cpu), the run
    of loops over the slice's elements just before the allgather computes piece by piece (the
    reduce-scatter's chunks), and each piece is sent to the other ranks as soon as it is
    computed (phase B overlapped with the all-gather); otherwise they run one after the other."""

    name: str
    members: tuple[str, ...]
    collective: str
    op: str  # reducescatter | allreduce
    reduce: str
    src: str
    type: TType  # the collective's result
    phases: tuple[Phase, ...]
    lets: tuple[Let, ...] = ()
    gather: str = ""
    gathered: str = ""
    rows: Dim | None = None
    store_reduced: bool = False
    after: tuple[Unit, ...] = ()
    line: int = 0
    strategies: tuple[Strategy, ...] = ()  # one per target (plan/targets.py)
    partials: tuple[str, ...] = ()  # the Reduce units of `after` accumulated chunk by chunk
    gather_after: str = ""  # the allgather closing `after` that goes piece by piece with its loop
    piece_loops: int = 0  # how many loops of phase B just before gather_after run piece by piece with it

    @property
    def dim(self) -> int:
        """The dim its chunks cut: the one the reduce-scatter's result is sliced along (an
        all-reduce: 0, its value taken as one run of elements)."""
        return self.type.layout.dim if self.op == "reducescatter" else 0

    def on(self, target: str) -> Strategy:
        """This fused collective's algorithms and chunking on one target."""
        return next(s for s in self.strategies if s.target == target)

    def accumulated(self, target: str) -> list[Reduce]:
        """The Reduce units of `after` that target accumulates chunk by chunk (its
        Strategy.partials is "per chunk"); the rest of `after` runs when they are combined."""
        if self.on(target).partials != "per chunk":
            return []
        return [a for a in self.after if isinstance(a, Reduce) and a.dst in self.partials]


@dataclass(frozen=True)
class Overlap:
    """The GEMM `producer` = a x b (`gemm` "matmul"; "matmul_nt": a x b^T, a derived program's
    input gradient) computed in `chunks` chunks along `dim` of its result; each chunk's
    communication (`collective`, or the fused collective `fused`) starts as soon as the chunk is
    computed, while the next chunk computes. direct: chunks along dim 0 are contiguous rows of
    every buffer; otherwise each chunk is packed for its collective and its result unpacked into
    place. A chunk along a leading dim reads a block of a's rows; along the last dim, a block of
    b's columns (matmul) or rows (matmul_nt). then: the matmul that reads the fused
    collective's gathered value (overlap(g, y) with g in the fusion: async-TP's all-gather-matmul
    after a fused reduce-scatter), chunk i's rows of it multiplied as soon as chunk i's fused
    collective is done, while chunk i+1's is in flight (direct chunks along dim 0 only: chunk
    i's rows of the gathered value are chunk i's rows of the producer). terms: where the
    producer is a sum of GEMMs (Program.summed_gemms), the GEMMs after the first (gemm, a, b),
    each added into the chunk's rows of the producer (beta = 1) after the first wrote them
    (direct chunks only)."""

    producer: str
    a: str
    b: str
    collective: str
    op: str
    reduce: str
    chunks: int
    dim: int
    direct: bool
    fused: Fused | None = None
    keep_producer: bool = True  # the producer's full value is read later
    line: int = 0
    gemm: str = "matmul"  # the producer's operation: matmul or matmul_nt
    then: GatherMatmul | None = None  # the matmul fed by the fused collective's gather, chunk by chunk
    terms: tuple[Term, ...] = ()  # the further GEMMs of a producer that is their sum

    @property
    def gemms(self) -> tuple[Term, ...]:
        """Every GEMM of a chunk, in order: the producer's (a sum's first) and its terms."""
        return (Term(self.gemm, self.a, self.b), *self.terms)


@dataclass(frozen=True)
class Term:
    """A GEMM of an overlap's producer that is a sum of GEMMs, after the first: gemm(a, b)
    (matmul or matmul_nt, b 2-d) added into the producer's rows of each chunk."""

    gemm: str
    a: str
    b: str


@dataclass(frozen=True)
class GatherMatmul:
    """overlap() the other way (async-TP's all-gather-matmul): the collective `gather` (an
    allgather or a broadcast of gather.src into gather.dst) runs in `chunks` chunks along `dim`
    of its result, and the consumer = gemm(gather.dst, other) (`gemm` "matmul"; "matmul_nt": a x
    b^T) multiplies each chunk's rows as soon as the chunk has arrived, while the next chunk
    is in flight. The gathered value is stored whole (other stages may read it). how:
      rows    dim 0, not the gathered dim: chunk i is rows r_i of the source, of the gathered
              value and of the consumer, each contiguous (no copy)
      pieces  dim 0 is the dim an allgather gathers: chunk i is piece i of every rank's slice
              (rows of the slice), gathered straight into place; one GEMM per rank's piece
      packed  another leading dim: each chunk packed for its collective and unpacked into place
    right: the gathered value is the consumer's RIGHT operand (a weight sliced over the ranks
    and gathered where it is used: FSDP, ZeRO-3), consumer = gemm(other, gather.dst), 2-d, cut
    along its rows (dim 0: rows or pieces) or its columns (dim 1: packed). A chunk r of the dim
    the consumer contracts (a matmul's rows of dst, a matmul_nt's columns) adds its product
    into the consumer (the first chunk writes it, the others accumulate, beta = 1: accumulates);
    a chunk of the other dim writes the consumer's columns r.
    """

    gather: Collective
    consumer: str
    other: str  # the consumer's other operand
    chunks: int
    dim: int
    how: GatherChunks
    gemm: str = "matmul"
    line: int = 0
    right: bool = False

    @property
    def a(self) -> str:
        """The GEMM's left operand: the gathered value (right: the other operand)."""
        return self.other if self.right else self.gather.dst

    @property
    def b(self) -> str:
        """The GEMM's right operand: the other operand (right: the gathered value)."""
        return self.gather.dst if self.right else self.other

    @property
    def accumulates(self) -> bool:
        """Each chunk adds to the whole consumer (a gathered right operand cut along the dim
        the consumer contracts: a matmul's dim 0, a matmul_nt's dim 1)."""
        return self.right and self.dim == (0 if self.gemm == "matmul" else 1)


Unit = Loop | Reduce | Library | Collective | Copy | Require | Fused | Overlap | GatherMatmul | StartGather


@dataclass(frozen=True)
class Attention:
    """A causal attention core written from pieces (plan/attention.py has the rule): the
    units at `members` (indexes into Plan.units) computed by one call on the backends in
    `fused` (the CPU: runtime_cpp/coconet/attention.h), at the place of the last member; the
    other backends run the members as they are. kind: forward (o = dropout(softmax(mask(scale *
    q k^T))) v) or backward (dq, dk, dv from the cotangent g). scores: a [.., M, N] value of the
    chain (its type gives the sizes and the layout); diagonal: causal's; scale, drop_p, seed: a
    number, a scalar buffer, or "" (none), the scale also "1/X" (a division by X); site: the
    dropout's. The forward writes o, and s, w,
    p, a (the scaled scores, masked scores, softmax and dropout) where others read them ("":
    not written); the backward reads g, s_in (the stored scores, "" where it reads p_in, the
    softmax) and a_in (the dropout's result; "" where it is P itself: the call uses P), and writes
    dq, dk, dv; a_whole: a_in is not computed in the same program from P (a backward program's
    saved a, an input), so its masked entries may be nonzero and dv reads every one (the pieces'
    transpose(a) x g does); p_whole: p_in is such an input too (a backward program's saved
    softmax), so the row sums of dP * P read every entry of its rows where a masked one is
    not 0 (the pieces' sum_keep does)."""

    kind: str
    members: tuple[int, ...]
    q: str
    k: str
    v: str
    scores: str
    diagonal: int
    scale: str
    drop_p: str
    seed: str
    site: str
    o: str = ""
    s: str = ""
    w: str = ""
    p: str = ""
    a: str = ""
    g: str = ""
    s_in: str = ""
    p_in: str = ""
    a_in: str = ""
    a_whole: bool = False
    p_whole: bool = False
    dq: str = ""
    dk: str = ""
    dv: str = ""
    fused: tuple[str, ...] = ("cpu",)


@dataclass(frozen=True)
class Gap:
    """A unit that `target` does not implement: `what`, at .ccn `line` (`span`: the directive
    that asked for it, or the stage)."""

    target: str
    line: int
    what: str
    span: Span = field(default=NOWHERE, compare=False)


@dataclass(frozen=True)
class Plan:
    program: str
    schedule: str
    params: tuple[str, ...]  # in call order: tensors (scattered too) and scalars
    buffers: tuple[Buffer, ...]
    units: tuple[Unit, ...]
    gaps: tuple[Gap, ...] = ()  # per target, what it does not implement (plan/targets.py)
    attention: tuple[Attention, ...] = ()  # causal attention cores run as one call (plan/attention.py)

    def unsupported(self, target: str) -> tuple[Gap, ...]:
        """What of this plan `target` does not implement (empty: it runs all of it)."""
        return tuple(g for g in self.gaps if g.target == target)

    def buffer(self, name: str) -> Buffer:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(name)

    def is_index(self, name: str) -> bool:
        """Is NAME an index's result (Buffer.same_at: a row of its source, read in place), not a
        layer's gradient made in its row of a stacked gradient (plan/targets.py, assembled_stacks)?"""
        return any(isinstance(u, Library) and u.op == "index" and u.dst == name for u in self.units)

    def own_part_only(self, param: str) -> bool:
        """Whether each rank writes only its own part of PARAM (the rest arriving through one
        fused collective's all-gather into it, in place) and reads no other part of it, in
        one call: then the ranks of a node may hold one copy of PARAM, every rank's part
        written in place by its owner, the gather's copies left out (DistributedOptimizer's
        weights, runtime/shm.py: empty_node). Conservative: anything else that touches
        PARAM (or a value stored in it) answers False."""
        names = {param}
        while True:  # the values stored in PARAM: its aliases and the views inside them
            more = {b.name for b in self.buffers if b.kind in ("alias", "view") and b.of in names} - names
            if not more:
                break
            names |= more
        ptype = self.buffer(param).type
        fused = [u for u in self.units if isinstance(u, Fused) and (u.gather or u.gather_after) in names]
        if len(fused) != 1 or fused[0].src in names:
            return False
        f = fused[0]
        for u in self.units:
            if u is not f and _touches(u, names):
                return False
        for ph in f.phases:
            if any(_item_touches(i, names) for i in ph.items) and (ph.kind != "pointwise" or f.type.shape != ptype.shape):
                return False
        for a in f.after:
            if isinstance(a, Collective) and a.op == "allgather" and a.dst == f.gather_after:
                continue
            if not _touches(a, names):
                continue
            if not isinstance(a, Loop) or a.type.layout.kind != "sliced" or a.type.shape != ptype.shape:
                return False
        return True


def _item_touches(i: Item, names: set[str]) -> bool:
    from coconetc.ir.expr import refs
    return i.name in names or bool(names.intersection(refs(i.expr)))


def writes(u: Unit) -> set[str] | None:
    """The buffers unit U writes, where the unit says exactly: a loop its stored items and its
    column sums; a library call its dst and the layernorm gradients it carries; a collective
    its dst and the segments it writes into or the temporary it packs into; a copy or a
    reduction its dst; a prefetch start its gather's. None for a fused collective, an overlap
    or an overlapped gather, which may write anything they touch."""
    if isinstance(u, Loop):
        return {i.name for i in u.items if i.store} | {c.dst for c in u.colsums}
    if isinstance(u, Library):
        return {u.dst, *((u.grads.dgamma, u.grads.dbeta) if u.grads else ())} - {""}
    if isinstance(u, Collective):
        return {u.dst, u.into, u.packed} - {""}
    if isinstance(u, (Copy, Reduce)):
        return {u.dst}
    if isinstance(u, StartGather):
        return writes(u.gather)
    if isinstance(u, (Fused, Overlap, GatherMatmul)):
        return None
    return set()


def _may_write(u: Unit, name: str) -> bool:
    """Whether unit U may write NAME: it is one of those it writes (writes), or, for a unit
    that does not say exactly, it touches NAME."""
    w = writes(u)
    return _touches(u, {name}) if w is None else name in w


def _touches(u: Unit, names: set[str]) -> bool:
    """Whether unit U reads or writes any of NAMES (a fused collective or an overlap: anywhere
    inside it)."""
    from coconetc.ir.expr import refs
    if isinstance(u, Loop):
        return any(_item_touches(i, names) for i in u.items) or \
            any(names.intersection(refs(x.expr)) for x in u.lets) or any(c.dst in names for c in u.colsums)
    if isinstance(u, Reduce):
        return bool({u.dst, u.src} & names)
    if isinstance(u, Library):
        return bool({u.dst, *u.args, *((u.grads.dgamma, u.grads.dbeta) if u.grads else ())} & names)
    if isinstance(u, Collective):
        return bool({u.dst, u.src, u.into, u.packed} & names)
    if isinstance(u, Copy):
        return bool({u.dst, u.src} & names)
    if isinstance(u, Fused):
        return bool({u.src, u.collective, u.gather, u.gathered, u.gather_after} & names) or \
            any(_item_touches(i, names) for ph in u.phases for i in ph.items) or \
            any(_touches(a, names) for a in u.after)
    if isinstance(u, Overlap):
        return bool({u.producer, u.collective, *(n for t in u.gemms for n in (t.a, t.b))} & names) or \
            (u.fused is not None and _touches(u.fused, names)) or (u.then is not None and _touches(u.then, names))
    if isinstance(u, GatherMatmul):
        return bool({u.gather.src, u.gather.dst, u.consumer, u.other} & names)
    if isinstance(u, StartGather):
        return _touches(u.gather, names)
    return False


def title(u: Unit, loop: str = "loop", collective: str = "") -> str:
    """What a unit is, in a line: its comment in the generated code (codegen/dispatch.py; loop,
    collective: the backend's words) and its name in a trace (coconetc/runtime/trace.py)."""
    if isinstance(u, Loop):
        return f"{loop}: {', '.join(i.name for i in u.items)}"
    if isinstance(u, Reduce):
        return f"reduce {u.dst} = {u.op}({u.src})"
    if isinstance(u, Library):
        return f"{shown(u.op)} {u.dst}"
    if isinstance(u, Collective):
        return f"{u.op} {u.dst}{collective}" + (" (prefetched: its wait)" if u.prefetched else "")
    if isinstance(u, StartGather):
        return f"start {u.gather.op} {u.gather.dst}{collective} (prefetch)"
    if isinstance(u, Copy):
        return f"copy {u.src} -> {u.dst} ({u.what})"
    if isinstance(u, Require):
        return f"require {u.op} root {u.root}"
    if isinstance(u, Fused):
        return f"fused collective {u.name}: {', '.join(u.members)}"
    if isinstance(u, GatherMatmul):
        return f"overlap {u.gather.op} {u.gather.dst} -> {u.consumer}: {u.chunks} chunks along dim {u.dim} ({u.how})"
    assert isinstance(u, Overlap)
    return f"overlap {u.producer} -> {u.collective}: {u.chunks} chunks along dim {u.dim}"
