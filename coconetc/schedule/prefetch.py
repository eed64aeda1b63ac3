"""The directives about weight gathers: `prefetch(depth=d)` and `keep_gathered()`.

`prefetch(depth=d)`: each all-gather of a weight (coconetc/ir/gathers.py: a
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
its order, are prefetched the same way.

`keep_gathered()`, in a schedule of a derived program (`schedule s for grad(model)`): the
training cut that this schedule pairs with keeps the forward's gathered weights for the
backward instead of gathering them again (FSDP's reshard_after_forward=False: memory for
time): the forward `<p>_fwd_kept` returns them too, the backward `<p>_bwd_kept` reads them
(autodiff/saved.py, sourcefile.with_grads). The whole derived program keeps them within its
one call anyway, so the schedule is the program."""

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


@dataclass(frozen=True)
class KeepGathered:
    """keep_gathered()"""

    span: Span = field(compare=False)
    where: tuple[tuple[str, Span], ...] = field(default=(), compare=False, repr=False)

    def at(self, key: str) -> Span:
        return dict(self.where).get(key) or self.span


def keeps_gathered(directives) -> bool:
    """Does a schedule's directive list hold keep_gathered()?"""
    return any(isinstance(d, KeepGathered) for d in directives)


def check_keep(p: Program, d: KeepGathered) -> Program:
    """P unchanged: what the training cut keeps is with_grads' choice (sourcefile.py); where the
    directive may stand is the file's check (sourcefile._schedule: keep_refused)."""
    return p


def keep_refused(p: Program, directives, grad: bool) -> CompileError | None:
    """The error for a keep_gathered() that means nothing where it stands: in a schedule of a
    program itself (not of its derived program), twice, or where no weight is gathered."""
    keeps = [d for d in directives if isinstance(d, KeepGathered)]
    if not keeps:
        return None
    d = keeps[-1]
    if not grad:
        return CompileError.at(d.at("()"), f"keep_gathered(): a directive of a derived program's schedule "
                               f"(schedule ... for grad({p.name})): it chooses what the training cut keeps "
                               "between the forward and the backward")
    if len(keeps) > 1:
        return CompileError.at(d.at("()"), "keep_gathered(): one a schedule")
    if not weight_gathers(p):
        return CompileError.at(d.at("()"), f"keep_gathered(): {p.name} gathers no weight (an allgather of a "
                               "parameter, or of a layer of one): there is nothing to keep for the backward")
    return None
