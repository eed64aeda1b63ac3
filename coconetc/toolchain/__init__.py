"""The toolchain: from a checked file to a built extension module, and the only place that runs
CMake, nvcc or the C++ compiler.

    compiler.py   compile(source_file, backend, options) -> Artifact; module naming and keys
    artifacts.py  built modules on disk: verified by a manifest, written atomically, locked
    commands.py   the compiler commands (CMake + mpicxx, CMake + nvcc, the host emulation)
    probes.py     the tools and wheels found here, the compiler's own hash, BuildError"""

from coconetc.toolchain.compiler import Artifact, Options, compile, runtime, module_stem
from coconetc.toolchain.probes import BuildError

__all__ = ["Artifact", "BuildError", "Options", "compile", "module_stem", "runtime"]
