"""The CUDA backend: one .cu source (all programs x schedules of a file) and its CMakeLists,
rendered from the same execution plans as the CPU backend (render.py), built with nvcc against
NCCL, cuBLAS and the CUDA runtime from the PyPI wheels (coconetc/build/cuda_build.py)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import jinja2

from coconetc import __version__
from coconetc.codegen.base import Function
from coconetc.build.builder import Libs
from coconetc.codegen.cpu import extern_headers, function_name, variants
from coconetc.codegen.cuda.render import Unsupported, render, unsupported
from coconetc.driver import SourceFile

DEFAULT_ARCHS = "80;90"

__all__ = ["CudaSources", "Unsupported", "generate", "problems", "unsupported", "DEFAULT_ARCHS"]


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
    for key in variants(mod):
        found = unsupported(mod.plans[key])
        if found:
            out[key] = found
    return out


def generate(mod: SourceFile, module_name: str, archs: str = DEFAULT_ARCHS,
             skip_unsupported: bool = False, libs: Libs | None = None) -> CudaSources:
    """The module's sources. skip_unsupported: leave out the (program, schedule)s the CUDA
    renderer cannot render yet (else the first one raises Unsupported). libs: for extern
    operations (headers, libraries)."""
    file = Path(mod.file).name
    funcs = {}
    for key, p in variants(mod).items():
        plan = mod.plans[key]
        if skip_unsupported and unsupported(plan):
            continue
        funcs[key] = render(plan, function_name(*key), file, [pub for pub, _ in p.outputs])
    libs = libs or Libs.of(mod.file, bool(mod.externs))
    ctx = dict(version=__version__, file=file, module=module_name, functions=list(funcs.values()),
               source="module.cu", archs=archs, headers=extern_headers(mod, "cuda"), libs=libs)
    cu = _env().get_template("module.cu.j2").render(ctx)
    cmake = _env().get_template("CMakeLists.txt.j2").render(ctx)
    return CudaSources(module_name, cu, cmake, funcs)
