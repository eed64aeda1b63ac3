"""A derived program's .ccn text read back, and whether the text says what the IR does: parsed and
type-checked by the front end (`check_text`, not planned). `sourcefile.load_source` also reads it
(after `import coconetc.autodiff`, which registers the operations it uses) and plans it for the
backends, which run every operation a derived program adds."""

from __future__ import annotations

from coconetc.autodiff import ops as _gradops  # noqa: F401  (the derived programs' operations)
from coconetc.errors import CompileError
from coconetc.frontend.checker import check_program
from coconetc.frontend.defs import check_defs, programs_of
from coconetc.frontend.parser import parse
from coconetc.ir import ops
from coconetc.ir.nodes import Op, Program, walk


def check_text(source: str, file: str = "<grad>") -> dict[str, Program]:
    """Every program of `source`, parsed and checked. Its extern declarations (the printer
    writes those a program calls, and those their derivatives call) resolve through the
    registry entries already loaded; their derivatives are checked again."""
    tree = parse(source, file)
    scope, errors = check_defs(tree)
    if errors:
        raise CompileError(errors)
    scope.programs = programs_of(tree)
    # each declaration the text holds is the entry the printer wrote it from (ops.py: one name
    # may have several entries, one per declaration)
    externs = {e.name: d for e in tree.externs for d in ops.REGISTRY.values()
               if d.extern is not None and ops.shown(d.name) == e.name and d.extern.decl in source}
    with ops.extern_scope(externs):
        return {prog.name: check_program(prog, scope) for prog in tree.programs}


def unfaithful_sites(p: Program) -> list[str]:
    """The random operations whose RNG site (the `site` attribute, `stage#k`: docs/language.md,
    "Operations") printed text cannot say. A dropout's derivative reuses the forward's mask, and
    a dropout hoisted out of its stage keeps its site: the printer writes such a site as
    `site=NAME, draw=k` (docs/language.md, "Operations"), which says any `NAME#k` with
    NAME a name; so this lists only sites of another form (none the front end makes)."""
    bad = []
    for s in p.stages:
        for n in walk(s.expr):
            if isinstance(n, Op) and ops.get(n.op).kind == "random":
                name, _, k = str(n.attr("site")).rpartition("#")
                if not (name.isidentifier() and k.isdigit()):
                    bad.append(f"{s.name}: {n.op} at site {n.attr('site')}")
    return bad
