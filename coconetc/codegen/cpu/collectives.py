"""Collectives of the CPU backend: the coconet:: call of each kind (collectives.h, over the
group's MPI communicator or its shared window), dispatched by codegen/dispatch.py. A scattered
source is read segment by segment by an all-reduce or a reduce-scatter; the plan packs it for
the others."""

from __future__ import annotations

from coconetc.codegen import dispatch
from coconetc.codegen.base import Writer, prod
from coconetc.codegen.dispatch import Operands
from coconetc.codegen.emit import CTYPE, REDUCE_OP
from coconetc.plan.units import Collective


def _into(a: Operands) -> str:
    return f"coconet::allgather(v_{a.x}, p_{a.u.into}, comm);  // straight into {a.u.into}'s segments"


def _send(a: Operands) -> str:
    d = "coconet::Direction::next" if a.u.direction == "next" else "coconet::Direction::prev"
    return f"coconet::send_shift(v_{a.x}, v_{a.dst}, {a.n}, {d}, comm);"


_CONTIGUOUS: dispatch.Calls = {
    ("allreduce", False): lambda a: f"coconet::allreduce({a.op}, v_{a.x}, v_{a.dst}, {a.n}, comm);",
    ("reducescatter", False): lambda a: f"coconet::reduce_scatter({a.op}, v_{a.x}, v_{a.dst}, {a.split}, comm);",
    ("allgather", False): lambda a: f"coconet::allgather(v_{a.x}, v_{a.dst}, {a.join}, comm);",
    ("scatter", False): lambda a: f"coconet::scatter_copy(v_{a.x}, v_{a.dst}, {a.split}, comm);",
    ("broadcast", False): lambda a: f"coconet::broadcast(v_{a.x}, v_{a.dst}, {a.n}, {a.u.root}, comm);",
    ("reduce", False): lambda a: f"coconet::reduce({a.op}, v_{a.x}, v_{a.dst}, {a.n}, {a.u.root}, comm);",
    ("send", False): _send,
}
CALLS: dispatch.Calls = {
    ("into", False): _into,
    **_CONTIGUOUS,
    # a scattered source: the reductions read its segments; the others as they are
    ("allreduce", True): lambda a: (f"coconet::allreduce({a.op}, p_{a.x}, coconet::Segments<{a.ct}>::one(v_{a.dst}, "
                                    f"{a.n}), comm);"),
    ("reducescatter", True): lambda a: f"coconet::reduce_scatter({a.op}, p_{a.x}, v_{a.dst}, comm);",
    **{(op, True): call for (op, _), call in _CONTIGUOUS.items() if op not in ("allreduce", "reducescatter")},
}


def start_allgather(w: Writer, u: Collective) -> str:
    """The start of an allgather as a non-blocking task (overlap.h start_allgather), on channel 1."""
    a = Operands(w, u, u.src, False, "")
    return f"coconet::start_allgather(v_{a.x}, v_{a.dst}, {a.join}, comm, 1);"


def collective(w: Writer, u: Collective) -> None:
    """One collective; a source the plan packs (u.packed) is copied out of its segments first."""
    if u.packed:
        xt = w.types[u.src]
        w.emit(f"coconet::copy_out(coconet::Segments<const {CTYPE[xt.dtype]}>(p_{u.src}), 0, "
               f"{prod(w.ldims(xt))}, v_{u.packed});")
    dispatch.collective(w, u, CALLS, REDUCE_OP, u.packed)
