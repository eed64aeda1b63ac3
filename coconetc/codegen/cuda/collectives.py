"""Collectives of the CUDA renderer: the coconet::cuda:: call of each kind (NCCL on the call's
stream), dispatched by codegen/dispatch.py. A scattered source is read piece by piece of its
segments, one NCCL call (or copy) per piece, grouped, into the contiguous result: the plan's
packed temporary is not needed (never filled)."""

from __future__ import annotations

from coconetc.codegen import dispatch
from coconetc.codegen.base import Writer
from coconetc.codegen.dispatch import Operands
from coconetc.plan.units import Collective

NCCL_OP = {"sum": "ncclSum", "avg": "ncclAvg", "prod": "ncclProd", "max": "ncclMax", "min": "ncclMin"}


def _into(a: Operands) -> str:
    return (f"coconet::cuda::allgather<{a.ct}>(v_{a.x}, p_{a.u.into}, {a.total}, ctx);"
            f"  // straight into {a.u.into}'s segments")


def _next(a: Operands) -> str:
    return "true" if a.u.direction == "next" else "false"


CALLS: dispatch.Calls = {
    ("into", False): _into,
    ("allreduce", False): lambda a: f"coconet::cuda::allreduce<{a.ct}>({a.op}, v_{a.x}, v_{a.dst}, {a.n}, ctx);",
    ("reducescatter", False): lambda a: (f"coconet::cuda::reduce_scatter<{a.ct}>({a.op}, v_{a.x}, v_{a.dst}, "
                                         f"{a.split}, ctx);"),
    ("allgather", False): lambda a: f"coconet::cuda::allgather<{a.ct}>(v_{a.x}, v_{a.dst}, {a.join}, ctx);",
    ("scatter", False): lambda a: f"coconet::cuda::scatter_copy<{a.ct}>(v_{a.x}, v_{a.dst}, {a.split}, ctx);",
    ("broadcast", False): lambda a: f"coconet::cuda::broadcast<{a.ct}>(v_{a.x}, v_{a.dst}, {a.n}, {a.u.root}, ctx);",
    ("reduce", False): lambda a: f"coconet::cuda::reduce<{a.ct}>({a.op}, v_{a.x}, v_{a.dst}, {a.n}, {a.u.root}, ctx);",
    ("send", False): lambda a: f"coconet::cuda::send_shift<{a.ct}>(v_{a.x}, v_{a.dst}, {a.n}, {_next(a)}, ctx);",
    # a scattered source, piece by piece of its segments (an allgather of one: support.py)
    ("allreduce", True): lambda a: f"coconet::cuda::allreduce<{a.ct}>({a.op}, p_{a.x}, v_{a.dst}, ctx);",
    ("reducescatter", True): lambda a: f"coconet::cuda::reduce_scatter<{a.ct}>({a.op}, p_{a.x}, v_{a.dst}, {a.n}, ctx);",
    ("broadcast", True): lambda a: f"coconet::cuda::broadcast<{a.ct}>(p_{a.x}, v_{a.dst}, {a.n}, {a.u.root}, ctx);",
    ("reduce", True): lambda a: f"coconet::cuda::reduce<{a.ct}>({a.op}, p_{a.x}, v_{a.dst}, {a.n}, {a.u.root}, ctx);",
    ("scatter", True): lambda a: f"coconet::cuda::scatter_copy<{a.ct}>(p_{a.x}, v_{a.dst}, {a.n}, ctx);",
    ("send", True): lambda a: f"coconet::cuda::send_shift<{a.ct}>(p_{a.x}, v_{a.dst}, {a.n}, {_next(a)}, ctx);",
}


def collective(w: Writer, u: Collective) -> None:
    dispatch.collective(w, u, CALLS, NCCL_OP)
