"""The CPU backend: one C++ source (all programs x schedules of a file) and its CMakeLists."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import jinja2

from coconetc.version import __version__
from coconetc.codegen.libs import Libs
from coconetc.codegen.naming import function_name
from coconetc.codegen.cpu.render import Function, render
from coconetc.sourcefile import SourceFile


@dataclass(frozen=True)
class Sources:
    module: str
    cpp: str
    cmake: str
    functions: dict[tuple[str, str], Function]  # (program, schedule) -> lowered function


@cache
def _env() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


def generate(mod: SourceFile, module_name: str, libs: Libs | None = None) -> Sources:
    file = Path(mod.file).name
    funcs = {key: render(mod.plans[key], function_name(*key), file, [pub for pub, _ in p.outputs])
             for key, p in mod.variants().items()}
    libs = libs or Libs.of(mod.file, bool(mod.externs))
    ctx = dict(version=__version__, file=file, module=module_name, functions=list(funcs.values()),
               source="module.cpp", headers=mod.extern_headers(), libs=libs)
    cpp = _env().get_template("module.cpp.j2").render(ctx)
    cmake = _env().get_template("CMakeLists.txt.j2").render(ctx)
    return Sources(module_name, cpp, cmake, funcs)
