"""schedule="auto": the schedule the autotuner chose, read from the tuning records
(tuned.py), never from the tuner itself. In a call (`for_call`): the fastest tuned schedule
whose calling convention matches the arrays given; for a size set (`overall`,
`fn.resolve_schedule("auto", ...)`): the tuner's overall choice. FN is a program of a module
built for fn.target ("cpu" unless it says otherwise): it reads the records measured there;
COMM an mpi4py communicator or the CUDA module's NCCL one (runtime/nccl.py: NcclComm)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from coconetc.ir.nodes import Program
from coconetc.plan.label import DEFAULT, parse
from coconetc.plan.targets import Target
from coconetc.runtime import layout, tuned
from coconetc.runtime.marshal import local_shape


@dataclass(frozen=True)
class Chosen:
    """The tuner's overall choice for a program at some sizes, ranks and groups on a target:
    its label ("zero", "auto_x@p2p"), and the .ccn text of the schedule when the tuner wrote
    it (it must be added to the file to run)."""

    label: str
    text: str = ""


def choice(source: str, file: str, program: str, sizes: dict[str, int], ranks: int, groups: int = 1,
           target: str = "cpu") -> Chosen:
    """The tuner's overall choice (tuned.py's records, never the tuner itself): the one home of
    `auto` for a size set, which fn.resolve_schedule (through `overall`) and `coconetc run -s
    auto` both ask. None recorded: a ValueError naming the `coconetc tune` command that makes
    one."""
    rec = tuned.lookup(source, program, dict(sizes), ranks, groups, target)
    if rec is None:
        shown = ", ".join(f"{k}={v}" for k, v in sizes.items())
        raise ValueError(f"the tuning cache has no choice for {shown} on {ranks} ranks"
                         + (f" in {groups} groups" if groups > 1 else "") + f"{Target(target).facts.measured_on}; run "
                         f"`{tuned.tune_command(file, program, ranks, dict(sizes), target)}` first")
    label = rec["choice"]
    text = rec["schedules"].get(label, "") if label in rec.get("generated", []) else ""
    return Chosen(label, text)


def overall(fn: Any, comm: Any, groups: int, sizes: dict) -> str:
    """The tuner's overall choice for FN at these sizes on the communicator's ranks; without
    one a ValueError says how to make one."""
    size, rank = _position(comm)
    ranks = layout.group_position(None, rank, size, groups)[0] * groups
    try:
        return choice(getattr(fn, "source", ""), fn.file, fn.name, dict(sizes), ranks, groups,
                      getattr(fn, "target", "cpu")).label
    except ValueError as err:
        raise ValueError(f"{fn.name}(schedule='auto'): {err}, or name a schedule ({', '.join(fn.schedules)})") from None


def _position(comm: Any) -> tuple[int, int]:
    """(ranks, this rank) of an mpi4py communicator (None: COMM_WORLD) or an NcclComm."""
    if comm is None:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
    if hasattr(comm, "Get_size"):
        return comm.Get_size(), comm.Get_rank()
    return comm.size, comm.rank


def _on(fn: Any) -> str:
    return Target(getattr(fn, "target", "cpu")).facts.measured_on


def _command(fn: Any, ranks: int, sizes: dict[str, int]) -> str:
    """The `coconetc tune` command that measures FN at SIZES on RANKS on fn's target."""
    return tuned.tune_command(fn.file, fn.name, ranks, sizes, getattr(fn, "target", "cpu"))


def for_call(fn: Any, comm: Any, groups: int, kwargs: dict) -> str:
    """schedule="auto" in a call: the tuner's fastest schedule whose calling convention
    (parameter layouts and local shapes at the tuned sizes) matches the arrays given, the
    program's own layouts first. None tuned: a ValueError with the command to run."""
    size, rank = _position(comm)
    gs = size // groups if groups >= 1 and size % groups == 0 else size
    rank %= gs
    memo = (size, rank, groups, tuple((k, _shape(v)) for k, v in sorted(kwargs.items())))
    if memo in fn.auto_memo:  # a training loop calls with the same shapes again and again
        return fn.auto_memo[memo]
    if fn.tuned is None:  # read once: the module holds the schedules tuned when it loaded
        fn.tuned = tuned.records(fn.source, fn.name, getattr(fn, "target", "cpu"))
    for rec in reversed(fn.tuned):
        if rec.get("ranks") != size or rec.get("groups", 1) != groups:
            continue
        for label in rec.get("by_convention", {}).values():
            p = fn.schedules.get(parse(label).name)
            if p is not None and _shapes_match(p, kwargs, rec["sizes"], gs, rank):
                fn.auto_memo[memo] = label
                return label
    raise ValueError(f"{fn.name}(schedule='auto'): the tuning cache holds no schedule for "
                     f"these arrays on {size} ranks{_on(fn)}; run `{_tune_command(fn, kwargs, size)}` "
                     f"first (and load the module again), or name a schedule "
                     f"({', '.join(fn.schedules)})")


def _shape(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return tuple(_shape(x) for x in v)
    return tuple(getattr(v, "shape", ())) if hasattr(v, "shape") else None


def _shapes_match(p: Program, kwargs: dict, sizes: dict, gs: int, rank: int) -> bool:
    """Every tensor argument has p's local shape at these sizes on this rank."""
    try:
        for q in p.params:
            if q.scalar:
                continue
            v = kwargs.get(q.name)
            got = ((sum(int(np.prod(x.shape)) for x in v),) if isinstance(v, (list, tuple))
                   else tuple(getattr(v, "shape", ())))
            if got != local_shape(q.type, sizes, gs, rank):
                return False
    except (KeyError, TypeError):
        return False
    return True


def _tune_command(fn: Any, kwargs: dict, ranks: int) -> str:
    """`coconetc tune FILE --ranks R --size ...` with the sizes the program's own layouts
    read from these arrays (those of unsliced dims)."""
    p = fn.schedules[DEFAULT]
    sizes: dict[str, int] = {}
    for q in p.params:
        v = kwargs.get(q.name)
        if q.scalar or v is None:
            continue
        shape = ((sum(int(np.prod(x.shape)) for x in v),) if isinstance(v, (list, tuple))
                 else tuple(getattr(v, "shape", ())))
        for i, d in enumerate(q.type.shape):
            if isinstance(d, str) and i < len(shape) and not (q.type.layout.sliced and q.type.layout.dim == i):
                sizes.setdefault(d, int(shape[i]))
    return _command(fn, ranks, dict(sorted(sizes.items())))
