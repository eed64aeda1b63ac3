"""The CPU backend: one C++ source (all programs x schedules of a file) and its CMakeLists,
each function rendered by render.py, the module laid out by codegen/module.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from coconetc.codegen.base import Function
from coconetc.codegen.cpu.render import render
from coconetc.codegen.libs import Libs
from coconetc.codegen.module import functions, lay_out
from coconetc.sourcefile import SourceFile


@dataclass(frozen=True)
class Sources:
    module: str
    cpp: str
    cmake: str
    functions: dict[tuple[str, str], Function]  # (program, schedule) -> lowered function


def generate(mod: SourceFile, module_name: str, libs: Libs | None = None) -> Sources:
    funcs = functions(mod, render)
    libs = libs or Libs.of(mod.file, bool(mod.externs))
    cpp, cmake = lay_out(Path(__file__).parent / "templates", "module.cpp", mod, module_name, funcs,
                         mod.extern_headers(), libs)
    return Sources(module_name, cpp, cmake, funcs)
