"""The `prefetch(depth=d)` directive: each all-gather of a weight (coconetc/ir/gathers.py: a
parameter sliced over the data-parallel ranks, gathered where it is used) starts `d` weight
gathers ahead of its place, so that it is in flight while the program computes what comes
before it (FSDP's and ZeRO-3's prefetch of the next layer's weights), and is waited for where it
stood (docs/sharded.md, "Prefetching the next layers' weights").

    schedule prefetched for model {
        prefetch(depth=2)
    }

Counted in gathers, in program order: the k-th weight gather starts right after the (k-d)-th
has been waited for (the first d at the call's start), so at most d are in flight while the
program computes. A layer whose block gathers g weights prefetches the next layer's at depth g. It changes nothing the program computes (a weight's gather reads only the
parameter), so the schedule is the program; the plan places the starts (plan/prefetch.py) and
shows them. In a derived program (`schedule ... for grad(model)`) the backward's gathers, in
its order, are prefetched the same way."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from coconetc.errors import CompileError, Span
from coconetc.ir.gathers import weight_gathers
from coconetc.ir.nodes import Program


@dataclass(frozen=True)
class Prefetch:
    """prefetch(depth=d)"""

    depth: int
    span: Span = field(compare=False)
    where: tuple[tuple[str, Span], ...] = field(default=(), compare=False, repr=False)

    def at(self, key: str) -> Span:
        return dict(self.where).get(key) or self.span


def check(p: Program, d: Prefetch) -> Program:
    """P with D's depth, or an error at D: a second prefetch, or nothing to prefetch."""
    if p.prefetch:
        raise CompileError.at(d.at("()"), f"prefetch(): {p.name}'s schedule already prefetches "
                              f"(depth={p.prefetch}); one prefetch a schedule")
    if not weight_gathers(p):
        raise CompileError.at(d.at("()"), f"prefetch(): {p.name} gathers no weight to start early (an "
                              "allgather of a parameter, or of a layer of one: allgather(w), with w a "
                              "parameter sliced over the ranks)")
    return replace(p, prefetch=d.depth)
