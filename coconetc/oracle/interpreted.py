"""One interpreted run of a program or one of its schedules on random inputs, checked
against the unscheduled program: what `coconetc run --interp` does, and what tests call."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from coconetc.sourcefile import SourceFile
from coconetc.interp.interpreter import Result, run
from coconetc.ir.nodes import Program
from coconetc.oracle.compare import compare, widened_run
from coconetc.oracle.inputs import adapt_inputs, random_inputs
from coconetc.oracle.npz import save_results


@dataclass
class Report:
    program: Program
    schedule: str | None
    inputs: list[dict[str, Any]]
    results: list[Result]
    seconds: float
    problems: list[str] = field(default_factory=list)


def run_interp(mod: SourceFile, program: str, schedule: str | None, ranks: int, groups: int = 1,
               sizes: Mapping[str, int] | None = None, seed: int = 0,
               values: Mapping[str, Any] | None = None) -> Report:
    """PROGRAM and SCHEDULE run by the interpreter on random inputs (VALUES: scalars given
    instead of drawn), the schedule's results compared with the program's."""
    base = mod.programs[program]
    inputs = random_inputs(base, ranks, groups, sizes, seed, values=values)
    t0 = time.perf_counter()
    ref = run(base, inputs, groups)
    seconds = time.perf_counter() - t0
    if schedule is None:
        return Report(base, None, inputs, ref, seconds)
    sched = mod.schedule(program, schedule)
    if sched.ir is None:
        raise KeyError(f"schedule '{schedule}' is 'auto': the autotuner picks a schedule; run a named one")
    s_inputs = adapt_inputs(inputs, base, sched.ir, groups)
    t0 = time.perf_counter()
    got = run(sched.ir, s_inputs, groups)
    seconds = time.perf_counter() - t0
    return Report(sched.ir, schedule, s_inputs, got, seconds, compare(ref, got, base, sched.ir, groups,
                                                                          widened_run(sched.ir, s_inputs, groups)))


def save_npz(path: str, rep: Report) -> None:
    """The inputs and results of an interpreted run (oracle/npz.py: the file's layout)."""
    save_results(path, rep.inputs, rep.results)
