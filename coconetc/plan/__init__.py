"""The execution plan: one checked plan per (program, schedule) that every backend renders.

The names below are imported when first asked for, not with the package: a warm coconetc.load
(runtime/warm.py) reads plan/label.py and plan/targets.py without the planner."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coconetc.plan.fusion_legality import PlanError
    from coconetc.plan.planner import execution_order, plan_program
    from coconetc.plan.targets import TARGETS, Target
    from coconetc.plan.units import Gap, Plan

__all__ = ["Gap", "Plan", "PlanError", "TARGETS", "Target", "execution_order", "plan_program"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'coconetc.plan' has no attribute {name!r}")
    import coconetc.plan.fusion_legality
    import coconetc.plan.planner
    import coconetc.plan.targets
    import coconetc.plan.units
    homes = (coconetc.plan.fusion_legality, coconetc.plan.planner, coconetc.plan.targets, coconetc.plan.units)
    return next(getattr(m, name) for m in homes if hasattr(m, name))
