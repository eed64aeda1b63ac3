"""A derived program's .ccn text read back, and whether the text says what the IR does: parsed and
type-checked by the front end (`check_text`, not planned). `sourcefile.load_source` also reads it
(after `import coconetc.autodiff`, which registers the operations it uses) and plans it for the
backends, which run every operation a derived program adds."""

from __future__ import annotations

from collections.abc import Iterator

from coconetc.autodiff import ops as _gradops  # noqa: F401  (the derived programs' operations)
from coconetc.errors import CompileError
from coconetc.frontend.checker import check_program
from coconetc.frontend.defs import check_defs
from coconetc.frontend.parser import parse
from coconetc.ir import ops
from coconetc.ir.nodes import Expr, Op, Program


def check_text(source: str, file: str = "<grad>") -> dict[str, Program]:
    """Every program of `source` (no extern declarations), parsed and checked."""
    tree = parse(source, file)
    scope, errors = check_defs(tree)
    if errors:
        raise CompileError(errors)
    return {prog.name: check_program(prog, scope) for prog in tree.programs}


def unfaithful_sites(p: Program) -> list[str]:
    """The random operations whose RNG site (the `site` attribute, `stage#k`: LANGUAGE.md
    section 2) is not the one the front end gives the same text: a dropout's derivative
    reuses the forward's mask, and a dropout hoisted out of its stage keeps its site. Their
    printed text would draw other masks; the IR is right."""
    bad = []
    for s in p.stages:
        randoms = [n for n in _post_order(s.expr) if isinstance(n, Op) and ops.get(n.op).kind == "random"]
        bad += [f"{s.name}: {n.op} at site {n.attr('site')}" for k, n in enumerate(randoms)
                if n.attr("site") != f"{s.name}#{k}"]
    return bad


def _post_order(e: Expr) -> Iterator[Expr]:
    """The checker's order of sites: operands (left to right) before their operation."""
    if isinstance(e, Op):
        for a in e.args:
            yield from _post_order(a)
    yield e
