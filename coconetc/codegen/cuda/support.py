"""What the CUDA backend implements, as the plan decided it (plan/targets.py: a plan's gaps on
the `cuda` and `cuda-emulated` targets): per plan (`unsupported`, which `coconetc check
--backend cuda` reports at the directive too), per (program, schedule) of a file
(`problems`), and what the host emulation leaves out besides (`emulation_problems`). Nothing
is decided here; the CPU backend renders every plan, so it has no such file."""

from __future__ import annotations

from coconetc.plan.targets import Target
from coconetc.plan.units import Plan
from coconetc.sourcefile import SourceFile


class Unsupported(Exception):
    """A plan unit the CUDA backend does not implement yet (line: its .ccn line)."""

    def __init__(self, line: int, what: str):
        super().__init__(what)
        self.line, self.what = line, what


def unsupported(plan: Plan) -> list[Unsupported]:
    """What of this plan the CUDA backend does not implement, one entry per unit: the plan's
    own decision (plan/targets.py), which `coconetc check --backend cuda` reports too."""
    return [Unsupported(g.line, g.what) for g in plan.unsupported(Target.CUDA)]


def problems(mod: SourceFile) -> dict[tuple[str, str], list[Unsupported]]:
    """(program, schedule) -> what of its plan the CUDA backend does not implement yet."""
    out = {}
    for key in mod.variants():
        found = unsupported(mod.plans[key])
        if found:
            out[key] = found
    return out


def emulation_problems(mod: SourceFile) -> dict[tuple[str, str], str]:
    """(program, schedule) -> why the host emulation leaves it out: the plan's first gap on
    cuda-emulated (what the CUDA backend does not implement, or an extern operation, whose
    own CUDA code is not emulated)."""
    return {key: gaps[0].what for key in mod.variants() if (gaps := mod.plans[key].unsupported(Target.EMULATED))}
