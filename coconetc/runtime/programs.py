"""A built module's functions, one per program: what both backends' modules (module.py's
CompiledModule, cuda.py's CudaModule) make of their variants, and how each program's
function resolves a schedule label, in one place."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from coconetc.ir.nodes import Program
from coconetc.plan.label import DEFAULT, ScheduleLabel, parse
from coconetc.runtime import auto, batch, marshal
from coconetc.runtime.entry import Call


def bind(module: Any, variants: Mapping[tuple[str, str], Program],
         make: Callable[[str, dict[str, Program]], Any]) -> dict[str, Any]:
    """The module's functions by program, each also an attribute of MODULE: make(program,
    {schedule: its IR}) for each program among the (program, schedule) variants, in their order."""
    by_program: dict[str, dict[str, Program]] = {}
    for (prog, sched), ir in variants.items():
        by_program.setdefault(prog, {})[sched] = ir
    functions = {prog: make(prog, scheds) for prog, scheds in by_program.items()}
    for prog, fn in functions.items():
        setattr(module, prog, fn)
    return functions


def resolve(fn: Any, schedule: str | None, comm: Any, groups: int, sizes: dict[str, int]) -> str:
    """The schedule a call of FN (a program's function of either backend) with SCHEDULE runs:
    a named one is itself (an unknown one raises, fn.program_of's error); "auto" the tuner's
    overall choice for these sizes on the ranks of COMM (runtime/auto.py), read from the
    records of fn's target; without one this raises and says how to make one."""
    if schedule != "auto":
        fn.program_of(parse(schedule))
        return schedule or DEFAULT
    choice = auto.overall(fn, comm, groups, sizes)
    fn.program_of(parse(choice))
    return choice


def program_of(fn: Any, label: ScheduleLabel) -> Program:
    """The program a schedule label runs on FN's backend (an unknown one raises, naming the
    known ones). A fused-collective algorithm ("zero@p2p") is a choice of the backends that
    choose per call (the CPU's); the CUDA module's collectives are chosen when it is compiled."""
    if label.algorithm and not fn.backend.algorithms:
        raise ValueError(f"{fn.name}(): schedule {str(label)!r}: the fused-collective algorithm "
                         f"'@{label.algorithm}' is a choice of the CPU backend; call it with schedule={label.name!r}")
    p = fn.schedules.get(label.name)
    if p is None:
        raise ValueError(f"{fn.name}(): unknown schedule {str(label)!r} (one of {', '.join(fn.schedules)})"
                         f"{fn.backend.schedules_left_out}")
    return p


def run(fn: Any, call: Call, gs: int, rank: int, make: Callable[[tuple[int, ...], str], Any],
        extra: Callable[[Any, bool], None], around: Any = None) -> list:
    """FN's module function with CALL's arguments, laid out as both backends' modules take them
    (marshal.py): a call that repeats a remembered one (call.repeated) reuses the arguments its
    record keeps (only the outputs and scalars set again); another marshals its tensors (the
    backend object's pointers) and, remembered, keeps them in its record for the next. The
    outputs are made by make(local shape, dtype) (GS ranks a group, this rank's index RANK);
    extra(args, fresh) sets what the backend adds (its communicator, windows, stream); around:
    how batch.invoke runs it. Returns the outputs."""
    p, rec, ptr = call.program, call.recent, fn.backend.ptr
    if call.repeated:
        assert rec is not None and rec.args is not None
        args, go = rec.args, rec.run
    else:
        args, go = fn.ext.CallArgs(), getattr(fn.ext, fn.function_name(call.label.name))
        marshal.tensors(args, p, call.values, call.segments, ptr)
        if rec is not None:  # the next call with the same buffers reuses these arguments
            rec.args, rec.run = args, go
    outs = marshal.outputs(p, call.sizes, gs, rank, make)
    args.outputs = [ptr(o) for o in outs]
    marshal.scalars(args, p, call.values, call.sizes)
    extra(args, not call.repeated)
    batch.invoke(fn.ext, go, args, around)
    return outs
