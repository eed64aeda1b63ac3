"""The CUDA backend: one .cu source (all programs x schedules of a file) and its CMakeLists,
rendered from the same execution plans as the CPU backend (each function by render.py, the
module laid out by codegen/module.py), built with nvcc against NCCL, cuBLAS and the CUDA runtime
from the PyPI wheels (coconetc/toolchain)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from coconetc.codegen.base import Function
from coconetc.codegen.cuda.render import render
from coconetc.codegen.extern_libs import Libs
from coconetc.codegen.module import functions, lay_out
from coconetc.codegen.cuda.support import Unsupported, emulation_problems, problems, unsupported
from coconetc.plan.units import Plan
from coconetc.sourcefile import SourceFile

DEFAULT_ARCHS = "80;90"
TEMPLATES = Path(__file__).parent / "templates"
# nvcc's options for every module and its binding (the CMakeLists templates read them, and the
# toolchain's nvcc command lines): besides the architectures, CMake's Release options and -fPIC
NVCC_OPTIONS = ("--extended-lambda", "--expt-relaxed-constexpr", "-O3")
ENV_ARCHS = "COCONET_CUDA_ARCHS"  # the architectures when a build names none (as TORCH_CUDA_ARCH_LIST)


def default_archs() -> str:
    """The CUDA architectures a build that names none compiles for: COCONET_CUDA_ARCHS, or 80;90."""
    return os.environ.get(ENV_ARCHS) or DEFAULT_ARCHS


__all__ = ["CudaSources", "Unsupported", "generate", "problems", "unsupported", "emulation_problems",
           "DEFAULT_ARCHS", "NVCC_OPTIONS", "default_archs"]


@dataclass(frozen=True)
class CudaSources:
    module: str
    cu: str
    cmake: str
    functions: dict[tuple[str, str], Function]


def generate(mod: SourceFile, module_name: str, archs: str = DEFAULT_ARCHS,
             skip_unsupported: bool = False, libs: Libs | None = None, emulate: bool = False) -> CudaSources:
    """The module's sources. skip_unsupported: leave out the (program, schedule)s the CUDA
    renderer cannot render yet (else the first one raises Unsupported). libs: for extern
    operations (headers, libraries). emulate: for the host emulation (the toolchain's
    cuda-emulated backend), leaving out what emulation_problems names."""
    skip = emulation_problems(mod) if emulate else {}

    def leave_out(key: tuple[str, str], plan: Plan) -> bool:
        if (skip_unsupported and unsupported(plan)) or key in skip:
            return True
        if unsupported(plan):
            raise unsupported(plan)[0]
        return False
    funcs = functions(mod, render, leave_out)
    libs = libs or Libs.of(mod.file, bool(mod.externs) and not emulate)
    cu, cmake = lay_out(TEMPLATES, "module.cu", mod, module_name, funcs,
                        [] if emulate else mod.extern_headers("cuda"), libs, archs=archs,
                        nvcc_options=" ".join(NVCC_OPTIONS))
    return CudaSources(module_name, cu, cmake, funcs)
