"""DistributedOptimizer's program: its module function (of the CPU or the CUDA module), the
program and plan a schedule runs, and which of its parameters is what (weights, gradients,
step count, master weights, state, scalars), checked once against the schedule."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from coconetc.torch.params import FLOATS, load


def function_of(source, program: str | None, backend: str = "cpu") -> Any:
    mod = load(source, backend=backend)
    if program is None:
        if len(mod.programs) != 1:
            raise ValueError(f"DistributedOptimizer: {source} holds programs "
                             f"{', '.join(mod.programs)}; say which with program=")
        program = next(iter(mod.programs))
    if program not in mod.programs:
        raise ValueError(f"DistributedOptimizer: no program {program!r} in {source} "
                         f"(its programs: {', '.join(mod.programs)})")
    return mod.programs[program]


def plan_of(source: str | Path, fn: Any, schedule: str) -> Any:
    """The execution plan of a CPU module's function under a schedule label."""
    from coconetc.plan.label import parse
    return load(source).source_module.plans[(fn.name, parse(schedule).name)]


def program_of(fn: Any, schedule: str | None) -> Any:
    """The Program a schedule label runs, for a CPU or a CUDA module's function (an unknown
    schedule raises, naming the known ones)."""
    from coconetc.plan.label import parse
    return fn.program_of(parse(schedule))


class Roles:
    """Which parameter of the program is what, checked once against every schedule."""

    def __init__(self, fn: Any, schedule: str, weights: str, grads: str, step: str | None,
                 scalars: dict[str, Any], master: str | None = None):
        self.p = program_of(fn, schedule)
        what = f"DistributedOptimizer({fn.name})"
        q = {x.name: x for x in self.p.params}
        for role, name in (("weights", weights), ("grads", grads)):
            if name not in q or q[name].scalar:
                raise ValueError(f"{what}: {role}={name!r} must name a tensor parameter "
                                 f"(tensors: {', '.join(x.name for x in self.p.params if not x.scalar)})")
        if step == "step" and step not in q:
            step = None  # a program without a step count (SGD, momentum): the default names none
        if step is not None and (step not in q or not q[step].scalar):
            raise ValueError(f"{what}: step={step!r} must name a scalar parameter (or be None: "
                             "the program takes no step count)")
        if master is not None and (master not in q or q[master].scalar or master in (weights, grads)
                                   or q[master].type.dtype not in FLOATS):
            raise ValueError(f"{what}: master={master!r} must name a floating-point tensor parameter "
                             "other than the weights and gradients (the master weights)")
        self.weights, self.grads, self.step, self.master = weights, grads, step, master
        self.state = [x for x in self.p.params if not x.scalar and x.name not in (weights, grads)]
        self.scalars = [x.name for x in self.p.params if x.scalar and x.name != step]
        extra = sorted(set(scalars) - set(self.scalars))
        if extra:
            counted = f"; {step!r} is the step count" if step is not None else ""
            raise TypeError(f"{what}: unexpected keyword argument {extra[0]!r} (its scalars: "
                            f"{', '.join(self.scalars)}{counted})")
        for x in self.p.params:
            if x.scalar:
                continue
            if x.type.ndim != 1 or (x.type.layout.sliced and x.name in (weights, grads)):
                raise ValueError(f"{what}: '{x.name}' is {x.type}: the optimizer needs a program "
                                 "over flat 1-d tensors whose weights and gradients are not sliced")
        self.scattered = q[weights].scattered
        if master is not None and (self.scattered or q[master].scattered):
            raise ValueError(f"{what}: master={master!r}: master weights need flat (not scattered) weights")
        self.dtype = q[weights].type.dtype
        self.grad_dtype = q[grads].type.dtype
        self.size = q[weights].type.shape[0]
        if not isinstance(self.size, str):
            raise ValueError(f"{what}: '{weights}' is {q[weights].type}: its size must be a "
                             "symbol (N), bound to the number of elements of a parameter group")
        self.sliced = {x.name for x in self.state if x.type.layout.sliced}
        self.segmented = {x.name for x in self.state if x.scattered and not x.type.layout.sliced}
        self.outputs = [pub for pub, _ in self.p.outputs]
        self.what = what

    def returned(self, skipped: str | None, feedback: dict[str, str] | None) -> tuple[str | None, dict[str, str]]:
        """skipped= and feedback= checked: outputs of one element, scalars of the program."""
        def one(arg: str, name: Any) -> str:
            t = self.p.type_of(dict(self.p.outputs).get(name, "")) if name in self.outputs else None
            if t is None or t.shape:
                raise ValueError(f"{self.what}: {arg}={name!r} must name a 0-d output of the program "
                                 f"(its outputs: {', '.join(self.outputs) or 'none'})")
            return str(name)
        if skipped is not None:
            one("skipped", skipped)
        if feedback is not None and not isinstance(feedback, dict):
            raise TypeError(f"{self.what}: feedback must be a dict {{scalar: output}}, got {type(feedback).__name__}")
        feedback = dict(feedback or {})
        for scalar, output in feedback.items():
            if scalar not in self.scalars:
                raise ValueError(f"{self.what}: feedback={{{scalar!r}: ...}} must name a scalar of the "
                                 f"program (its scalars: {', '.join(self.scalars)})")
            one(f"feedback[{scalar!r}]", output)
        return skipped, feedback
