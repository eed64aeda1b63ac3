"""Laying out a generated module, the same for both backends: one function per (program,
schedule) of the file, rendered by the backend's render(), then the backend's templates
(templates/<source>.j2 and templates/CMakeLists.txt.j2 beside its __init__.py) filled in."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path

import jinja2

from coconetc.codegen.base import Function
from coconetc.codegen.extern_libs import Libs
from coconetc.codegen.naming import function_name
from coconetc.plan.units import Plan
from coconetc.sourcefile import SourceFile
from coconetc.version import __version__

Render = Callable[[Plan, str, str, list[str]], Function]


@cache
def _env(folder: Path) -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(folder), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True)


def functions(mod: SourceFile, render: Render,
              leave_out: Callable[[tuple[str, str], Plan], bool] = lambda key, plan: False,
              ) -> dict[tuple[str, str], Function]:
    """(program, schedule) -> its function, for every variant of the file not left out."""
    file = Path(mod.file).name
    return {key: render(mod.plans[key], function_name(*key), file, [pub for pub, _ in p.outputs])
            for key, p in mod.variants().items() if not leave_out(key, mod.plans[key])}


def lay_out(templates: Path, source: str, mod: SourceFile, module_name: str, funcs: dict[tuple[str, str], Function],
            headers: list[str], libs: Libs, **extra: object) -> tuple[str, str]:
    """(the module's source, its CMakeLists) from the templates folder: `source` (module.cpp,
    module.cu) and CMakeLists.txt, each a .j2 template; extra: what the backend's templates
    read besides."""
    ctx = dict(version=__version__, file=Path(mod.file).name, module=module_name, functions=list(funcs.values()),
               source=source, headers=headers, libs=libs, **extra)
    env = _env(templates)
    return env.get_template(f"{source}.j2").render(ctx), env.get_template("CMakeLists.txt.j2").render(ctx)


def lay_out_units(templates: Path, source: str, mod: SourceFile, funcs: dict[tuple[str, str], Function],
                  headers: list[str], **extra: object) -> dict[str, str]:
    """Function name -> its own translation unit, from the template `source`.j2 (one function
    each, with the headers it includes); extra: what the template reads besides."""
    template = _env(templates).get_template(f"{source}.j2")
    file = Path(mod.file).name
    return {f.name: template.render(version=__version__, file=file, f=f, headers=headers, **extra)
            for f in funcs.values()}


def lay_out_file(templates: Path, source: str, file: str, **ctx: object) -> str:
    """The template `source`.j2 filled in with CTX, coconetc's version and FILE (the .ccn file's name)."""
    return _env(templates).get_template(f"{source}.j2").render(version=__version__, file=file, **ctx)
