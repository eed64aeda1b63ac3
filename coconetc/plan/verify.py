"""The plan verifier, run on every plan the planner makes: each value is written before it is
read (a value kept in a register is read only inside the unit that computes it), every
collective's sizes match its input and output, no loop reads elements of a sliced value
that its rank does not hold, and each fused collective has a strategy for each target. A
failure is a compiler bug (PlanInvalid), never a user error."""

from __future__ import annotations

from collections.abc import Iterable

from coconetc.ir.nodes import Expr, Ref, walk
from coconetc.ir.types import TType
from coconetc.plan.units import (Collective, Copy, Fused, GatherMatmul, Item, Let, Library, Loop, Overlap, Plan,
                                 Reduce, Require, StartGather, Unit)


class PlanInvalid(AssertionError):
    """The planner produced an inconsistent plan (a bug in coconetc, not in the program)."""


def verify(plan: Plan) -> Plan:
    _Verifier(plan).run()
    return plan


def _refs(e: Expr) -> list[str]:
    return [n.name for n in walk(e) if isinstance(n, Ref)]


class _Verifier:
    def __init__(self, plan: Plan):
        self.plan = plan
        self.bufs = {b.name: b for b in plan.buffers}
        self.written = {b.name for b in plan.buffers if b.kind in ("param", "segments", "scalar")}
        self.lets: set[str] = set()
        self.started: set[str] = set()  # the gathers a StartGather started (a prefetch)
        self.rows: dict[str, set[int]] = {}  # a stacked gradient's rows made so far

    def fail(self, what: str) -> None:
        raise PlanInvalid(f"plan {self.plan.program} [{self.plan.schedule}]: {what}")

    def run(self) -> None:
        for u in self.plan.units:
            self.unit(u)

    def type(self, name: str) -> TType:
        if name not in self.bufs:
            self.fail(f"'{name}' has no buffer")
        return self.bufs[name].type

    def read(self, names: Iterable[str], unit: str, local: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        for n in names:
            if n in self.lets or n in local:
                continue
            if self.type(n) and self.bufs[n].kind == "register":
                self.fail(f"{unit} reads '{n}', which lives only in a register of another unit")
            if n not in self.written:
                self.fail(f"{unit} reads '{n}' before it is written")

    def write(self, names: Iterable[str]) -> None:
        for n in names:
            self.type(n)
            self.written.add(n)
            b = self.bufs[n]
            if b.same_as and b.same_at is not None and not self.plan.is_index(n):  # a layer's gradient in its row
                rows = self.rows.setdefault(b.same_as, set())
                rows.add(b.same_at)
                if len(rows) == self.bufs[b.same_as].type.shape[0]:
                    self.written.add(b.same_as)  # (every row made: plan/targets.py, assembled_stacks)

    def unit(self, u: Unit) -> None:
        if isinstance(u, Loop):
            self.items(u.items, u.lets, u.type, f"the loop at line {u.line}")
        elif isinstance(u, (Reduce, Copy)):
            self.read([u.src], f"{type(u).__name__.lower()} {u.dst}")
            if isinstance(u, Reduce) or u.what == "update":
                self.write([u.dst])
        elif isinstance(u, Library):
            self.read(u.args, f"{u.op} {u.dst}")
            self.write([u.dst])
        elif isinstance(u, StartGather):  # its source read here; its result written at its wait
            self.read([u.gather.src], f"the start of {u.gather.op} {u.gather.dst}")
            self.started.add(u.gather.dst)
        elif isinstance(u, Collective):
            if u.prefetched and u.dst not in self.started:
                self.fail(f"{u.op} {u.dst} waits for a start that no unit before it made")
            self.read([u.src], f"{u.op} {u.dst}")
            self.collective(u.op, self.type(u.src), self.type(u.dst), u.dst)
            self.write([u.dst] + ([u.packed] if u.packed else []))
        elif isinstance(u, Fused):
            self.fused(u)
        elif isinstance(u, Overlap):
            self.overlap(u)
        elif isinstance(u, GatherMatmul):
            self.unit(u.gather)
            self.gather_matmul(u)
        else:
            assert isinstance(u, Require)

    def items(self, items: tuple[Item, ...], lets: tuple[Let, ...], t: TType, where: str,
              local: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        for k in lets:
            self.read(_refs(k.expr), where, local)
            self.lets.add(k.name)
        inside = set(local)
        for it in items:
            self.read(_refs(it.expr), where, inside)
            for r in (n for n in walk(it.expr) if isinstance(n, Ref) and n.name not in self.lets):
                self.held(r, t, where)
            if self.type(it.name).shape != t.shape:
                self.fail(f"{where} computes '{it.name}' ({self.type(it.name)}) over {t}")
            inside.add(it.name)
        self.write(it.name for it in items if self.bufs[it.name].kind != "register")

    def held(self, r: Ref, t: TType, where: str) -> None:
        """A loop over t reads operand r at its own elements: a sliced operand must be sliced
        the same way (a replicated one is read at the slice, which every rank holds)."""
        rt, shift = r.type, t.ndim - r.type.ndim
        aligned = (shift >= 0 and t.layout.sliced and t.layout.dim == rt.layout.dim + shift
                   and rt.shape[rt.layout.dim] == t.shape[t.layout.dim]
                   and all(a == b or a == 1 for a, b in zip(rt.shape, t.shape[shift:])))  # broadcast size-1 dims
        if rt.layout.sliced and not aligned:
            self.fail(f"{where} reads '{r.name}' ({rt}) over {t}: elements this rank does not hold")

    def collective(self, op: str, src: TType, dst: TType, name: str) -> None:
        if src.dtype != dst.dtype or (op != "send" and src.shape != dst.shape):
            self.fail(f"{op} {name}: {src} in, {dst} out: sizes do not match")
        want = {"allreduce": "replicated", "reducescatter": "sliced", "allgather": "replicated",
                "scatter": "sliced"}.get(op)
        if want and dst.layout.kind != want:
            self.fail(f"{op} {name}: {src.layout} in, {dst.layout} out")

    def fused(self, u: Fused) -> None:
        where = f"fused {u.name}"
        if sorted(s.target for s in u.strategies) != ["cpu", "cuda"]:
            self.fail(f"{where} has no strategy for each target: {[s.target for s in u.strategies]}")
        self.read([u.src], where)
        op = "allreduce" if u.op == "allreduce" else "reducescatter"
        self.collective(op, self.type(u.src), u.type, u.collective)
        local = {u.collective}
        for k in u.lets:  # declared at the top of the chunk callback
            self.read(_refs(k.expr), where)
            self.lets.add(k.name)
        self.items_fused(u, local, where)
        if u.gather:
            self.collective("allgather", self.type(u.gathered), self.type(u.gather), u.gather)
            self.write([u.gather])
        if u.store_reduced:
            self.write([u.collective])
        for a in u.after:
            if isinstance(a, Reduce) and a.dst in u.partials and a.src in local:
                self.write([a.dst])  # accumulated from each chunk as it passes (Fused.partials)
            else:
                self.unit(a)

    def items_fused(self, u: Fused, local: set[str], where: str) -> None:
        for ph in u.phases:
            if ph.kind == "rows":
                it = ph.items[0]
                self.read(_refs(it.expr), where, local)
                local.add(it.name)
                if self.bufs[it.name].kind != "register":
                    self.write([it.name])
            else:
                self.items(ph.items, (), u.type, where, local)
                local |= {it.name for it in ph.items}

    def gather_matmul(self, u: GatherMatmul) -> None:
        self.read([u.a, u.b], f"overlap {u.gather.dst} -> {u.consumer}")
        g = self.type(u.gather.dst)
        if g.layout.sliced or (u.right and g.ndim != 2) or u.dim >= g.ndim - (0 if u.right else 1):
            self.fail(f"overlap {u.gather.dst} -> {u.consumer}: chunks along dim {u.dim} of {g}")
        self.write([u.consumer])

    def overlap(self, u: Overlap) -> None:
        where = f"overlap {u.producer}"
        self.read([n for t in u.gemms for n in (t.a, t.b)], where)
        if u.terms and not u.direct:
            self.fail(f"{where}: a sum of GEMMs in chunks that are not rows in place")
        if u.keep_producer:
            self.write([u.producer])
        else:
            self.written.add(u.producer)
        if u.fused is not None:
            self.fused(u.fused)
        else:
            self.collective(u.op, self.type(u.producer), self.type(u.collective), u.collective)
            self.write([u.collective])
        if u.then is not None:  # its gather is the fused collective's
            if u.fused is None or u.fused.gather != u.then.a or not u.direct or u.then.chunks != u.chunks \
                    or u.then.dim != 0 or self.type(u.then.a).shape[0] != self.type(u.producer).shape[0]:
                self.fail(f"overlap {u.producer}: its fused collective does not gather {u.then.a} block for block")
            self.gather_matmul(u.then)
        if not u.keep_producer:
            self.written.discard(u.producer)
