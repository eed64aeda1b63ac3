"""A schedule's prefetch(depth=d) in the plan (coconetc/schedule/prefetch.py): each all-gather of
a weight (coconetc/ir/gathers.py) that is a plain unit of its own (an allgather of a contiguous
source into a buffer: not gathered into a scattered parameter's segments, not chunked with its
matmul by an overlap, not part of a fused collective) is started by a StartGather unit `d`
weight gathers earlier, right after the unit where the (k-d)-th is waited for (the first d at
the start of the call), and waited for at its own place (its Collective marked `prefetched`).
What makes its source from the parameters (the layer a repeat takes of a stacked weight:
`index(w, l)`, a reshape) moves with the start. A gather stays where it is when a unit between
the two places would touch its result, or when its source is made by a unit that cannot move
(one that reads anything but parameters and such units' results).

On the CPU a started gather is an MPI_Iallgatherv on a channel of its own (runtime_cpp/coconet/
overlap.h start_allgather), tested after each unit until its wait, so that MPI moves it while the
program computes; the CUDA code gathers it at its wait (NCCL's collectives on the call's stream:
docs/sharded.md says so)."""

from __future__ import annotations

from dataclasses import replace

from coconetc.ir.expr import refs
from coconetc.plan.units import Buffer, Collective, Library, Loop, StartGather, Unit, _may_write, _touches, writes


def _reads(u: Loop | Library) -> set[str]:
    if isinstance(u, Library):
        return set(u.args)
    own = {i.name for i in u.items} | {x.name for x in u.lets}  # (a Let is computed by the loop itself)
    return ({r for i in u.items for r in refs(i.expr)} | {r for x in u.lets for r in refs(x.expr)}) - own


def _makers(units: list[Unit], before: int, name: str, buffers: dict[str, Buffer]) -> list[int] | None:
    """The indexes (ascending) of the units before BEFORE that make NAME from parameters alone
    (a chain of loops and library calls: the layer a repeat takes of a stacked weight, a
    reshape); [] when NAME is a parameter; None when something else makes it."""
    b = buffers.get(name)
    if b is None:
        return None
    if b.kind == "param":
        return []
    at = next((j for j in range(before - 1, -1, -1) if _may_write(units[j], name)), -1)
    u = units[at] if at >= 0 else None
    if not isinstance(u, (Loop, Library)) or writes(u) != {name}:
        return None
    chain = [at]
    for r in sorted(_reads(u)):
        more = _makers(units, at, r, buffers)
        if more is None:
            return None
        chain += more
    return sorted(set(chain))


def with_prefetch(units: list[Unit], buffers: dict[str, Buffer], depth: int, gathers: set[str]) -> list[Unit]:
    """UNITS with the weight gathers among GATHERS (stage names) started DEPTH gathers ahead."""
    if depth < 1:
        return units
    found = [i for i, u in enumerate(units) if isinstance(u, Collective) and u.op == "allgather"
             and u.dst in gathers and not u.into and not u.packed and not u.prefetched]
    starts: dict[int, list[tuple[list[int], StartGather]]] = {}
    moved: set[int] = set()
    waits: set[int] = set()
    for k, i in enumerate(found):
        g = units[i]
        assert isinstance(g, Collective)
        at = found[k - depth] if k >= depth else -1
        chain = _makers(units, i, g.src, buffers)
        if chain is None:
            continue
        chain = [j for j in chain if j > at and j not in moved]
        between = [j for j in range(at + 1, i) if j not in chain]
        if any(_touches(units[j], {g.dst}) or _may_write(units[j], g.src) for j in between):
            continue
        starts.setdefault(at, []).append((chain, StartGather(g, g.line)))
        moved.update(chain)
        waits.add(i)
    out: list[Unit] = []

    def place(at: int) -> None:
        for chain, s in starts.get(at, []):
            out.extend(units[j] for j in chain)
            out.append(s)
    place(-1)
    for j, u in enumerate(units):
        if j in waits:
            assert isinstance(u, Collective)
            out.append(replace(u, prefetched=True))
        elif j not in moved:
            out.append(u)
        place(j)
    return out
