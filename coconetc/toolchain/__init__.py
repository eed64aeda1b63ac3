"""The toolchain: from a checked file to a built extension module, and the only place that runs
CMake, nvcc or the C++ compiler.

    compiler.py   compile(source_file, backend, options) -> Artifact; module naming and keys
    artifacts.py  built modules on disk: verified by a manifest, written atomically, locked
    commands.py   the compiler commands (CMake + mpicxx, CMake + nvcc, the host emulation)
    probes.py     the tools and wheels found here, the compiler's own hash, BuildError

compiler.py (and with it the code generators and jinja2) is imported when one of its names is
first asked for, not with the package: a warm `coconetc.load` (runtime/warm.py) reads
artifacts.py and probes.py only."""

from typing import TYPE_CHECKING, Any

from coconetc.toolchain.probes import BuildError

if TYPE_CHECKING:
    from coconetc.toolchain.compiler import Artifact, Options, compile, module_stem, runtime

__all__ = ["Artifact", "BuildError", "Options", "compile", "module_stem", "runtime"]
_COMPILER = {"Artifact", "Options", "compile", "module_stem", "runtime"}


def __getattr__(name: str) -> Any:
    if name not in _COMPILER:
        raise AttributeError(f"module 'coconetc.toolchain' has no attribute {name!r}")
    from coconetc.toolchain import compiler
    return getattr(compiler, name)
