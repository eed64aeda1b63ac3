"""The CPU backend: one C++ unit per (program, schedule) of a file, the module's table of them
and its CMakeLists, each function rendered by render.py, the module laid out by
codegen/module.py. coconetc's own builds compile each unit on its own into a shared object
cached by content (toolchain/commands.py: cpu_units), so a new schedule compiles one unit, and
link the module from a lazy table of them (lazy_table: each unit mapped on its function's first
call, coconet/entries.h); `module.cpp` is the units and the linked table in one file (the same
text), for a build system to compile with the compiled runtime (runtime_cpp/coconet/bind.cpp
and runtime.cpp)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from coconetc.codegen.base import Function
from coconetc.codegen.cpu.render import render
from coconetc.codegen.extern_libs import Libs
from coconetc.codegen.module import functions, lay_out, lay_out_file, lay_out_units
from coconetc.sourcefile import SourceFile

# The compile options of a CPU module's units and of its binding (CMakeLists.txt.j2 renders them
# for a CMake build; toolchain/commands.py passes them to mpicxx). -fno-trapping-math: a loop
# whose division or vector call sits under a select (GELU's erf clamp, its gradient's x == 0
# case) is if-converted and vectorized with AVX2 too, not only with AVX-512's masks (GCC will
# not compute a division that may trap on a path that did not ask for it; coconet reads no
# floating-point exception flags): the GELU epilogue of 262k floats 0.90 -> 0.17 ms, its
# backward 1.25 -> 0.21 ms, one AVX2 core.
CXX_FLAGS = ("-O3", "-DNDEBUG", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-Wall", "-Wno-unused-variable",
             "-Wno-unused-but-set-variable")
TEMPLATES = Path(__file__).parent / "templates"
UNIT_SYMBOL = "coconet_unit_"  # + the function's name: its extern "C" name in its unit's shared object


@dataclass(frozen=True)
class Sources:
    module: str
    table: str  # the module's table of its functions (coconet/entries.h) and its PyInit
    units: dict[str, str]  # function name -> its translation unit
    cmake: str
    functions: dict[tuple[str, str], Function]  # (program, schedule) -> lowered function
    file: str = ""  # the .ccn file's name (the tables' docstring)

    @property
    def cpp(self) -> str:
        """module.cpp: every unit and the table, one translation unit (what a CMake build compiles)."""
        return "".join([*self.units.values(), self.table])


def generate(mod: SourceFile, module_name: str, libs: Libs | None = None) -> Sources:
    funcs = functions(mod, render)
    libs = libs or Libs.of(mod.file, bool(mod.externs))
    table, cmake = lay_out(TEMPLATES, "module.cpp", mod, module_name, funcs, mod.extern_headers(), libs,
                           cxx_flags=" ".join(CXX_FLAGS))
    units = lay_out_units(TEMPLATES, "unit.cpp", mod, funcs, mod.extern_headers(), symbol_prefix=UNIT_SYMBOL)
    return Sources(module_name, table, units, cmake, funcs, Path(mod.file).name)


def lazy_table(src: Sources, unit_files: dict[str, str]) -> str:
    """The module's lazy table (coconet/entries.h): each function (name -> the path of its unit's
    shared object) mapped by the binding on its first call."""
    return lay_out_file(TEMPLATES, "lazy_table.cpp", src.file, module=src.module, units=list(unit_files.items()),
                        symbol_prefix=UNIT_SYMBOL)
