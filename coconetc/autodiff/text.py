"""A derived program's .ccn text read back: parsed and type-checked by the front end (not
planned: the backends do not render matmul_nt, matmul_tn and sum_lead yet, so
sourcefile.load_source, which plans every program, refuses it)."""

from __future__ import annotations

from coconetc.autodiff import ops as _gradops  # noqa: F401  (the derived programs' operations)
from coconetc.errors import CompileError
from coconetc.frontend.checker import check_program
from coconetc.frontend.defs import check_defs
from coconetc.frontend.parser import parse
from coconetc.ir.nodes import Program


def check_text(source: str, file: str = "<grad>") -> dict[str, Program]:
    """Every program of `source` (no extern declarations), parsed and checked."""
    tree = parse(source, file)
    scope, errors = check_defs(tree)
    if errors:
        raise CompileError(errors)
    return {prog.name: check_program(prog, scope) for prog in tree.programs}
