"""The execution plan: one checked plan per (program, schedule) that every backend renders."""

from coconetc.plan.chunking import PlanError
from coconetc.plan.planner import execution_order, plan_program
from coconetc.plan.units import Plan

__all__ = ["Plan", "PlanError", "execution_order", "plan_program"]
