"""Schedules: directive records (directives.py) and the pure, legality-checked rewrites that
apply them to a typed program (primitives.py, fusion.py)."""

from coconetc.schedule.apply import apply, apply_all
from coconetc.schedule.directives import Directive, from_ast

__all__ = ["Directive", "apply", "apply_all", "from_ast"]
