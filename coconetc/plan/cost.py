"""The cost model: a pure function of an execution plan (coconetc/plan), the size symbols and
the group size R. It reads what the plan decided (which values stay in registers, which loops
are one pass, what a fused collective computes per chunk) and counts, per rank:

    moved   bytes through memory (reads + writes of buffers; registers and scalars are free)
    sent    bytes this rank sends (the receiver writes as many: `received` = `sent`)
    passes  sweeps over memory (a loop, a reduction, a GEMM, a copy: 1; an allreduce: 2,
            its reduce-scatter and its all-gather phase; any other collective: 1; a fused
            collective: 1, the chunks are reduced, computed and gathered in one sweep)
    launches units started (a loop, GEMM, collective, copy: 1; a reduction: 1, 2 when its
            input is sliced (the partial results are all-reduced); a fused collective: 1 plus
            what runs after its chunks; an overlap: chunks x (GEMM + its collective))
    flops   arithmetic of the library operations (2*M*N*K for a matmul)
    written the part of `moved` that is written (a loop's stored items, a library operation's
            result, a copy's or a collective's output, a reduction's result); the rest is read.
            `coconetc explain --backend cuda -s S` lists each unit's read and written bytes
            and flops beside its bound (tune/explain.py kernels())

With n = the bytes of a collective's input on this rank, N its full (gathered) size and the
ring / pairwise factor f = (R-1)/R (ops.Cost.comm holds the factor in front of f):

    allreduce      sent 2 f n       moved n + n + sent     (in, out, received)
    reducescatter  sent f n         moved n + n/R + sent
    allgather      sent f N         moved N/R + N + sent   (in place, its source a view inside
                                                            its result: N - N/R + sent)
    broadcast      sent f n         moved n + n + sent     (pipelined ring)
    reduce         sent f n         moved n + n + sent
    scatter        sent 0           moved n/R
    send           sent n           moved n + n + sent     (to the neighbouring group)
    fused          its reducescatter (or allreduce) as above, without writing the reduced
                   value unless the plan keeps it, + its per-chunk loop over the slice + the
                   all-gather's received part f N (this rank's part is written by the loop)

Over several nodes (cost(..., nodes=M), M nodes of L = R/M ranks; docs/cluster.md) the model
has two levels: `net` counts the bytes of `sent` that leave the node. A fused collective and an
allreduce run hierarchically (fused_shm.h): within the node (L-1)/L of the input and of the
gathered value, across nodes (M-1)/M of 1/L of them; any other collective (and a fused
collective inside an overlap, which goes point to point) sends to every rank alike, so
(R-L)/(R-1) of what it sends crosses the network.

Each collective is costed as the algorithm that runs it (`Cost.algorithm`, shown by `coconetc
explain` per unit), chosen as the CPU runtime chooses (collectives.h, fused_shm.h): on one node,
an all-reduce, a reduce-scatter or an all-gather of one row (sliced along its first dim) of
WINDOW_MIN_BYTES or more, and every fused collective, goes through the node's shared window
("window"); over several nodes the all-reduce, the reduce-scatter, the all-gather and the fused
collective run "hierarchical"; the rest, and everything under a label's @p2p (window=False), runs MPI's own
collective ("mpi") or point-to-point messages ("p2p", a fused collective). Their bytes count
alike, except MPI's reduce-scatter: Open MPI's measured 4 to 8 times slower than a copy of its
bytes on one node (`bench/collectives.py`), so what it sends counts at
Machine.mpi_reduce_scatter_bw.

A reshape or an index held in its source's memory (Buffer.same_as: no copy, plan/targets.py)
costs nothing: nothing runs.

A loop over E elements (this rank's part of its type) reads each memory operand once
(min(E, that operand's elements): a replicated operand of a sliced loop is read at the slice)
and writes each stored item once: E * bytes per element.

The modelled time, for ranking schedules before measuring them, is

    t = moved / mem_bw + (sent - net - slow) / link_bw + net / net_bw + slow / mpi_reduce_scatter_bw
        + flops / flop_rate + launches * launch_s

less, for each overlap of k chunks, (1 - 1/k) x the shorter of its GEMM's and its
communication's time (that part runs under the other), with a Machine's constants (defaults: one CPU rank with its neighbour busy; Machine(...)
for another machine). It is a ranking aid, not a prediction: `coconetc explain` prints it
beside the measured time the tuning cache holds."""

from __future__ import annotations

from dataclasses import dataclass, field

from coconetc.ir.slices import slice_range
from coconetc.ir import ops
from coconetc.ir.nodes import Ref, walk
from coconetc.ir.types import BITS, TType, eval_dim
from coconetc.plan.units import (Buffer, Collective, Copy, Fused, GatherMatmul, Item, Library, Loop, Overlap,
                                 Plan, Reduce, Require, StartGather, Unit)

_NO_MEMORY = ("register", "scalar")


@dataclass(frozen=True)
class Machine:
    """Rough per-rank rates (bytes/s, flop/s, s per unit started)."""

    mem_bw: float = 18e9
    link_bw: float = 6e9    # between the ranks of a node
    net_bw: float = 3e9     # between nodes, per rank (a 100 Gb/s link shared by 4 ranks)
    flop_rate: float = 150e9  # one core's f32 GEMMs with MKL (bench/blas.py: 150-170 GFLOP/s)
    launch_s: float = 5e-6
    # Open MPI's MPI_Reduce_scatter between the ranks of a node, per byte sent (bench/collectives.py,
    # quiet, 2 ranks: 4 MiB in 1.5 ms, 16 MiB in 9.5 ms, half of it sent: 0.9 to 1.4 GB/s, where
    # a copy of the input runs at 10 to 14 GB/s; under load it fell to 0.2)
    mpi_reduce_scatter_bw: float = 1.0e9


# A collective of this many bytes or more goes through the node's shared window (the C++
# runtime's kShmAllreduceMinBytes, fused_shm.h).
WINDOW_MIN_BYTES = 1 << 14


@dataclass
class Cost:
    moved: float = 0.0
    sent: float = 0.0
    net: float = 0.0  # the part of `sent` that leaves the node (0 on one node)
    slow: float = 0.0  # the part of `sent` through MPI's reduce-scatter (Machine.mpi_reduce_scatter_bw)
    algorithm: str = ""  # a collective's: "window", "hierarchical", "mpi" or "p2p" (module doc)
    passes: int = 0
    launches: int = 0
    flops: float = 0.0
    written: float = 0.0  # the part of `moved` written (the module doc)
    units: int = 0
    parts: list[tuple[Unit, Cost]] = field(default_factory=list)  # per top-level unit
    # overlaps: (the GEMM's cost, its communication's cost, chunks); see seconds()
    pipelines: list[tuple[Cost, Cost, int]] = field(default_factory=list)

    def add(self, other: Cost) -> None:
        self.moved += other.moved
        self.sent += other.sent
        self.net += other.net
        self.slow += other.slow
        self.passes += other.passes
        self.launches += other.launches
        self.flops += other.flops
        self.written += other.written
        self.pipelines += other.pipelines

    def seconds(self, m: Machine | None = None) -> float:
        """The sum of the terms, less what each overlap hides: with k chunks, all but one
        chunk of the shorter of its GEMM and its communication run under the other."""
        m = m or Machine()
        t = (self.moved / m.mem_bw + (self.sent - self.net - self.slow) / m.link_bw + self.net / m.net_bw
             + self.slow / m.mpi_reduce_scatter_bw + self.flops / m.flop_rate + self.launches * m.launch_s)
        for gemm, comm, k in self.pipelines:
            hidden = min(gemm.seconds(m), comm.seconds(m)) * (1 - 1 / max(1, k))
            t -= hidden
        return t


def cost(plan: Plan, sizes: dict[str, int], ranks: int, nodes: int = 1, window: bool = True) -> Cost:
    """The plan's cost on one rank of a group of RANKS at these sizes (see the module doc), the
    ranks on NODES nodes of RANKS/NODES ranks each (ValueError unless NODES divides RANKS);
    WINDOW False: the collectives kept off the shared window (a label's @p2p)."""
    if nodes < 1 or ranks % nodes:
        raise ValueError(f"{nodes} nodes do not hold {ranks} ranks evenly")
    c = _Counter(plan, sizes, ranks, nodes, window)
    total = Cost(units=len(plan.units))
    for u in plan.units:
        part = c.unit(u)
        total.add(part)
        total.parts.append((u, part))
    return total


class _Counter:
    def __init__(self, plan: Plan, sizes: dict[str, int], ranks: int, nodes: int = 1, window: bool = True):
        self.plan, self.sizes, self.R = plan, sizes, max(1, ranks)
        self.f = (self.R - 1) / self.R
        self.M = nodes
        self.L = self.R // nodes
        self.window = window and self.R > 1
        # the share of a flat collective's messages that leave the node
        self.off_node = (self.R - self.L) / (self.R - 1) if self.M > 1 else 0.0

    def hierarchical(self, reduced: float, gathered: float) -> tuple[float, float]:
        """(sent, net) of a hierarchical collective over M > 1 nodes that reduces REDUCED bytes
        and gathers GATHERED bytes (either may be 0; see the module doc)."""
        within = (self.L - 1) / self.L
        across = (self.M - 1) / self.M / self.L
        net = across * (reduced + gathered)
        return within * (reduced + gathered) + net, net

    # --- sizes ---------------------------------------------------------------------------
    def elements(self, t: TType, whole: bool = False) -> int:
        """Elements of t on this rank (the largest part, rank 0's, when t is sliced)."""
        n = 1
        for i, d in enumerate(t.shape):
            k = eval_dim(d, self.sizes)
            if t.layout.sliced and i == t.layout.dim and not whole:
                lo, hi = slice_range(k, self.R, 0)
                k = hi - lo
            n *= k
        return n

    def nbytes(self, t: TType, whole: bool = False) -> float:
        return self.elements(t, whole) * BITS[t.dtype] / 8

    def buffer(self, name: str) -> Buffer | None:
        try:
            return self.plan.buffer(name)
        except KeyError:
            return None  # a Let (scalar computed before a loop)

    def _held(self, dst: str, src: str) -> bool:
        """DST is held in SRC's memory or SRC in DST's (Buffer.same_as: a reshape or an index
        that needs no copy, plan/targets.py)."""
        d, s = self.buffer(dst), self.buffer(src)
        return (d is not None and d.same_as == src) or (s is not None and s.same_as == dst)

    # --- units ---------------------------------------------------------------------------
    def unit(self, u: Unit) -> Cost:
        if isinstance(u, Loop):
            return self.loop(u.type, u.items, Cost(passes=1, launches=1))
        if isinstance(u, Reduce):
            return self.reduce(u)
        if isinstance(u, Library):
            return self.library(u)
        if isinstance(u, Collective):
            return self.collective(u.op, u.src, u.dst)
        if isinstance(u, Fused):
            return self.fused(u)
        if isinstance(u, Overlap):
            return self.overlap(u)
        if isinstance(u, GatherMatmul):
            return self.gather_matmul(u)
        if isinstance(u, StartGather):  # (its transfer is counted at its wait, the prefetched Collective)
            return Cost()
        if isinstance(u, Copy):
            b = self.buffer(u.src)
            n = self.nbytes(b.type) if b is not None else 0.0
            return Cost(moved=2 * n, written=n, passes=1, launches=1)
        assert isinstance(u, Require)
        return Cost()

    def loop(self, t: TType, items: tuple[Item, ...], c: Cost) -> Cost:
        """Each memory operand read once, each stored item written once, over t's elements."""
        n = self.elements(t)
        computed: set[str] = set()
        read: set[str] = set()
        for it in items:
            for node in walk(it.expr):
                if isinstance(node, Ref) and node.name not in computed:
                    read.add(node.name)
            computed.add(it.name)
            if it.store:
                c.moved += n * BITS[it.expr.type.dtype] / 8
                c.written += n * BITS[it.expr.type.dtype] / 8
        for name in sorted(read):
            b = self.buffer(name)
            if b is not None and b.kind not in _NO_MEMORY:
                c.moved += min(n, self.elements(b.type)) * BITS[b.type.dtype] / 8
        return c

    def reduce(self, u: Reduce) -> Cost:
        src, dst = self.buffer(u.src), self.buffer(u.dst)
        c = Cost(passes=1, launches=2 if u.cross_rank else 1)
        c.moved = (self.nbytes(src.type) if src is not None else 0.0)
        out = self.nbytes(dst.type) if dst is not None else 8.0
        c.moved += out
        c.written += out
        if u.cross_rank:
            c.sent = 2 * self.f * out
            c.net = self.off_node * c.sent
        return c

    def library(self, u: Library) -> Cost:
        if u.op in ("reshape", "index") and self._held(u.dst, u.args[0]):
            return Cost()  # a view: the result is read in its source's memory, nothing runs
        c = Cost(passes=1, launches=1)
        for a in (*u.args, u.dst):
            b = self.buffer(a)
            if b is not None and b.kind not in _NO_MEMORY:
                c.moved += self.nbytes(b.type)
        dst = self.buffer(u.dst)
        if dst is not None and dst.kind not in _NO_MEMORY:
            c.written = self.nbytes(dst.type)
        d = ops.get(u.op).cost
        out = self.elements(dst.type) if dst is not None else 0
        inner = 1
        first = self.buffer(u.args[0]) if u.args else None
        if d.inner and first is not None and first.type.shape:
            rows = self._rows(first.type)
            # contracted: a's last dim (matmul, matmul_nt); matmul_tn and layernorm_dgamma sum over
            # a's leading dims
            inner = rows if u.op in ("matmul_tn", "layernorm_dgamma") else self.elements(first.type) // max(1, rows)
        c.flops = d.flops * out * inner
        return c

    def _rows(self, t: TType) -> int:
        """Elements of t before its last dim (the rows of a matmul operand)."""
        last = eval_dim(t.shape[-1], self.sizes)
        if t.layout.sliced and t.layout.dim == t.ndim - 1:
            lo, hi = slice_range(last, self.R, 0)
            last = hi - lo
        return self.elements(t) // max(1, last)

    def algorithm(self, op: str, whole: TType | None, flat: bool = False) -> str:
        """The algorithm the CPU runtime runs a plain collective with (see the module doc); WHOLE
        the full-size tensor it reduces or gathers, FLAT an overlap's task."""
        if flat or not self.window or whole is None or op not in ("allreduce", "reducescatter", "allgather"):
            return "mpi"
        if self.nbytes(whole, whole=True) < WINDOW_MIN_BYTES:
            return "mpi"
        if self.M > 1:
            return "hierarchical"
        if op == "allgather" and whole.layout.sliced and any(
                eval_dim(d, self.sizes) != 1 for d in whole.shape[:whole.layout.dim]):
            return "mpi"  # rows of slices: MPI_Allgatherv
        return "window"

    def collective(self, op: str, src: str, dst: str, flat: bool = False) -> Cost:
        """FLAT: an overlap's task (MPI's own collective, never hierarchical)."""
        sb, db = self.buffer(src), self.buffer(dst)
        n_in = self.nbytes(sb.type) if sb is not None else 0.0
        n_out = self.nbytes(db.type) if db is not None else n_in
        whole = db.type if op == "allgather" and db is not None else (sb.type if sb is not None else None)
        algo = self.algorithm(op, whole, flat)
        factor = ops.get(op).cost.comm
        if op == "send":
            sent = n_in
        elif op == "allgather":
            sent = factor * self.f * n_out
        else:
            sent = factor * self.f * n_in
        if op == "scatter":
            return Cost(moved=n_out, written=n_out, passes=1, launches=1)
        net = sent if op == "send" and self.M > 1 else self.off_node * sent
        if algo == "hierarchical":  # fused_shm.h
            sent, net = (self.hierarchical(0.0, n_out) if op == "allgather"
                         else self.hierarchical(n_in, n_in if op == "allreduce" else 0.0))
        slow = sent - net if op == "reducescatter" and algo == "mpi" else 0.0
        moved, written = n_in + n_out + sent, n_out
        if op == "allgather" and sb is not None and sb.kind == "view" and sb.of == dst:
            moved, written = n_out - n_in + sent, n_out - n_in  # in place: this rank's part is computed where it lies
        return Cost(moved=moved, sent=sent, net=net, slow=slow, written=written,
                    passes=2 if op == "allreduce" else 1, launches=1, algorithm=algo)

    def fused(self, u: Fused, flat: bool = False) -> Cost:
        """FLAT: point to point over every rank (an overlap's task), not hierarchically."""
        src = self.buffer(u.src)
        n_in = self.nbytes(src.type) if src is not None else 0.0
        sent = ops.get(u.op).cost.comm * self.f * n_in
        g = self.buffer(u.gather) if u.gather else None
        whole = self.nbytes(g.type) if g is not None else 0.0
        hier = self.M > 1 and not flat and self.window
        if hier:  # the allreduce form gathers the reduced value itself
            sent, net = self.hierarchical(n_in, n_in if u.op == "allreduce" else 0.0)
        else:
            net = self.off_node * sent
        algo = "hierarchical" if hier else ("window" if self.window and not flat and self.M == 1 else "p2p")
        c = Cost(moved=n_in + sent, sent=sent, net=net, passes=1, launches=1, algorithm=algo)
        if u.store_reduced:
            c.moved += self.nbytes(u.type)
            c.written += self.nbytes(u.type)
        for ph in u.phases:
            self.loop(u.type, ph.items, c)
        if u.gather:
            gs, gn = self.hierarchical(0.0, whole) if hier else (self.f * whole, self.off_node * self.f * whole)
            c.sent += gs
            c.net += gn
            c.moved += gs
            c.written += gs
        for a in u.after:
            c.add(self.unit(a))
        return c

    def gather_matmul(self, u: GatherMatmul) -> Cost:
        """The gather's chunks flat (point to point, as an overlap's), each hidden behind the
        previous chunk's GEMM."""
        gemm = self.library(Library(u.consumer, u.gemm, (u.a, u.b)))
        return _pipelined(gemm, self.collective(u.gather.op, u.gather.src, u.gather.dst, flat=True), u.chunks)

    def overlap(self, u: Overlap) -> Cost:
        gemm = self.library(Library(u.producer, u.gemm, (u.a, u.b)))
        for t in u.terms:  # a sum of GEMMs: each adds its product to the producer's rows
            gemm.add(self.library(Library(u.producer, t.gemm, (t.a, t.b))))
        comm = (self.fused(u.fused, flat=True) if u.fused is not None
                else self.collective(u.op, u.producer, u.collective, flat=True))
        if u.then is not None:  # the fed matmul hides the next block's communication too
            gemm.add(self.library(Library(u.then.consumer, u.then.gemm, (u.then.a, u.then.b))))
        return _pipelined(gemm, comm, u.chunks)


def _pipelined(gemm: Cost, comm: Cost, chunks: int) -> Cost:
    """An overlap (either way): its GEMM and its communication, each chunk's launches, and the
    pipeline whose hidden part seconds() takes off."""
    return Cost(moved=gemm.moved + comm.moved, sent=comm.sent, net=comm.net, flops=gemm.flops,
                written=gemm.written + comm.written,
                passes=gemm.passes + comm.passes, launches=chunks * (gemm.launches + comm.launches),
                pipelines=[(gemm, comm, chunks)])
