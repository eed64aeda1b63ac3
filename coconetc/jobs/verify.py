"""One call of a compiled program on every rank, checked against the interpreter: each rank
calls with its own copy of its inputs (the schedule's calling convention, from
coconetc.oracle.inputs), rank 0 gathers every rank's results, runs the interpreter and
compares within each dtype's tolerance (coconetc.oracle.compare)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from coconetc.interp.interpreter import Result
from coconetc.ir.nodes import Program
from coconetc.oracle.compare import RankResults, check_compiled
from coconetc.oracle.inputs import joined

MATCHES = "matches the interpreter on every rank"
MISMATCH = "MISMATCH"


@dataclass
class Verified:
    """What rank 0 found (problems: the same on every rank); got: the compiled run as
    interpreter Results (rank 0 only, empty elsewhere)."""

    problems: list[str]
    got: list[Result] = field(default_factory=list)

    @property
    def status(self) -> str:
        return MISMATCH if self.problems else MATCHES


def call_results(ir: Program, out: Any, args: Mapping[str, Any]) -> RankResults:
    """This rank's results of one call of `ir`: the returned outputs by public name and the
    updated parameters (scattered ones joined), copied."""
    outs = out if isinstance(out, tuple) else (out,) if out is not None else ()
    outputs = {pub: np.asarray(v) for (pub, _), v in zip(ir.outputs, outs)}
    updates = {t: np.asarray(joined(args[t])).copy() for t, _ in ir.updates}
    return outputs, updates


def verify_results(comm: Any, mine: RankResults, ir: Program, inputs: Sequence[Mapping[str, Any]],
                   groups: int = 1, ref: Callable[[], Sequence[Result]] | None = None,
                   src: Program | None = None) -> Verified:
    """Every rank's results gathered on rank 0 and checked there against the interpreter's run
    of `ir` on `inputs` (every rank's, ir's calling convention), or against ref() (rank 0 only),
    a run of `src`, the program ir was scheduled from. Every rank gets the problems."""
    gathered = comm.gather(mine, root=0)
    problems: list[str] = []
    got: list[Result] = []
    if comm.Get_rank() == 0:
        problems, got = check_compiled(gathered, ir, inputs, groups, None if ref is None else ref(), src)
    return Verified(comm.bcast(problems, root=0), got)


def verify_call(comm: Any, fn: Callable[..., Any], ir: Program, inputs: Sequence[Mapping[str, Any]], /,
                groups: int = 1, ref: Callable[[], Sequence[Result]] | None = None,
                src: Program | None = None, **call: Any) -> Verified:
    """fn(groups=groups, **call, **this rank's inputs) on a copy of this rank's inputs, every
    rank's results checked against the interpreter (verify_results). `comm` is where the
    results are gathered; the call's own communicator, if any, is `call`'s `comm`."""
    mine = copy.deepcopy(dict(inputs[comm.Get_rank()]))
    out = fn(groups=groups, **call, **mine)
    return verify_results(comm, call_results(ir, out, mine), ir, inputs, groups, ref, src)


def print_problems(problems: Sequence[str], most: int = 20) -> None:
    for p in problems[:most]:
        print(f"    {p}", flush=True)
