"""The execution plan: one checked plan per (program, schedule) that every backend renders."""

from coconetc.plan.fusion_legality import PlanError
from coconetc.plan.planner import execution_order, plan_program
from coconetc.plan.targets import TARGETS, Target
from coconetc.plan.units import Gap, Plan

__all__ = ["Gap", "Plan", "PlanError", "TARGETS", "Target", "execution_order", "plan_program"]
