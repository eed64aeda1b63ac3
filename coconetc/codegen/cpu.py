"""The CPU backend: one C++ source (all programs x schedules of a file) and its CMakeLists."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import jinja2

from coconetc.version import __version__
from coconetc.toolchain.builder import Libs
from coconetc.codegen.render import Function, render
from coconetc.sourcefile import SourceFile
from coconetc.ir.nodes import Program

DEFAULT = "default"  # the name of the unscheduled program among its schedules


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


def function_name(program: str, schedule: str) -> str:
    return f"{program}__{schedule}"


def variants(mod: SourceFile) -> dict[tuple[str, str], Program]:
    """Every (program, schedule) that compiles to a function; the program itself as 'default'."""
    out = {}
    for name, prog in mod.programs.items():
        out[(name, DEFAULT)] = prog
        for sname, sched in mod.schedules[name].items():
            if sched.ir is not None:
                out[(name, sname)] = sched.ir
    return out


def extern_headers(mod: SourceFile, backend: str = "cpp") -> list[str]:
    """The headers of the file's extern operations, for one backend ('cpp' or 'cuda')."""
    impls = [getattr(d.extern, backend) for d in mod.externs.values() if d.extern is not None]
    return list(dict.fromkeys(i.header for i in impls if i is not None))


def generate(mod: SourceFile, module_name: str, libs: Libs | None = None) -> Sources:
    file = Path(mod.file).name
    funcs = {key: render(mod.plans[key], function_name(*key), file, [pub for pub, _ in p.outputs])
             for key, p in variants(mod).items()}
    libs = libs or Libs.of(mod.file, bool(mod.externs))
    ctx = dict(version=__version__, file=file, module=module_name, functions=list(funcs.values()),
               source="module.cpp", headers=extern_headers(mod), libs=libs)
    cpp = _env().get_template("module.cpp.j2").render(ctx)
    cmake = _env().get_template("CMakeLists.txt.j2").render(ctx)
    return Sources(module_name, cpp, cmake, funcs)
