"""The CUDA backend: one .cu source (all programs x schedules of a file) and its CMakeLists,
rendered from the same execution plans as the CPU backend (render.py), built with nvcc against
NCCL, cuBLAS and the CUDA runtime from the PyPI wheels (coconetc/toolchain/cuda_build.py)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import jinja2

from coconetc.version import __version__
from coconetc.codegen.base import Function
from coconetc.codegen.libs import Libs
from coconetc.codegen.naming import function_name
from coconetc.codegen.cuda.render import Unsupported, render, unsupported
from coconetc.sourcefile import SourceFile

DEFAULT_ARCHS = "80;90"

__all__ = ["CudaSources", "Unsupported", "generate", "problems", "unsupported", "emulation_problems",
           "DEFAULT_ARCHS"]


@dataclass(frozen=True)
class CudaSources:
    module: str
    cu: str
    cmake: str
    functions: dict[tuple[str, str], Function]


@cache
def _env() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


def problems(mod: SourceFile) -> dict[tuple[str, str], list[Unsupported]]:
    """(program, schedule) -> what of its plan the CUDA renderer does not implement yet."""
    out = {}
    for key in mod.variants():
        found = unsupported(mod.plans[key])
        if found:
            out[key] = found
    return out


def emulation_problems(mod: SourceFile) -> dict[tuple[str, str], str]:
    """(program, schedule) -> why the host emulation leaves it out: the plan's first gap on
    cuda-emulation (what the CUDA backend does not implement, or an extern operation, whose
    own CUDA code is not emulated)."""
    return {key: gaps[0].what for key in mod.variants() if (gaps := mod.plans[key].unsupported("cuda-emulation"))}


def generate(mod: SourceFile, module_name: str, archs: str = DEFAULT_ARCHS,
             skip_unsupported: bool = False, libs: Libs | None = None, emulate: bool = False) -> CudaSources:
    """The module's sources. skip_unsupported: leave out the (program, schedule)s the CUDA
    renderer cannot render yet (else the first one raises Unsupported). libs: for extern
    operations (headers, libraries). emulate: for the host emulation (toolchain/cuda_build.py:
    compile_emulated), leaving out what emulation_problems names."""
    file = Path(mod.file).name
    funcs = {}
    skip = emulation_problems(mod) if emulate else {}
    for key, p in mod.variants().items():
        plan = mod.plans[key]
        if (skip_unsupported and unsupported(plan)) or key in skip:
            continue
        if unsupported(plan):
            raise unsupported(plan)[0]
        funcs[key] = render(plan, function_name(*key), file, [pub for pub, _ in p.outputs])
    libs = libs or Libs.of(mod.file, bool(mod.externs) and not emulate)
    ctx = dict(version=__version__, file=file, module=module_name, functions=list(funcs.values()),
               source="module.cu", archs=archs, headers=[] if emulate else mod.extern_headers("cuda"), libs=libs)
    cu = _env().get_template("module.cu.j2").render(ctx)
    cmake = _env().get_template("CMakeLists.txt.j2").render(ctx)
    return CudaSources(module_name, cu, cmake, funcs)
