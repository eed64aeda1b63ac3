"""apply(program, directive) -> program: dispatch to one pure function per directive;
apply_all verifies the program after each directive (ir/verify.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from coconetc.ir.nodes import Program
from coconetc.schedule.directives import Directive, Fuse, OverlapD, Reorder, Slice, Split
from coconetc.schedule.each_layer import WORD
from coconetc.schedule.fusion import fuse, overlap
from coconetc.schedule.pipeline import Pipeline, check as pipeline
from coconetc.schedule.prefetch import KeepGathered, Prefetch, check as prefetch, check_keep
from coconetc.schedule.primitives import reorder, slice_params, split
from coconetc.ir.verify import verify_program

_APPLY: dict[type, Callable[[Program, Any], Program]] = {Split: split, Reorder: reorder, Slice: slice_params, Fuse: fuse,
                                                         OverlapD: overlap, Pipeline: pipeline, Prefetch: prefetch,
                                                         KeepGathered: check_keep}
_NAME = {cls: WORD[cls.__name__] for cls in _APPLY}


def apply(p: Program, d: Directive) -> Program:
    return _APPLY[type(d)](p, d)


def apply_all(p: Program, directives: Iterable[Directive]) -> Program:
    """The program after each directive in turn, verified after each one."""
    for d in directives:
        p = verify_program(apply(p, d), f"{_NAME[type(d)]} at {d.span!r}")
    return p
