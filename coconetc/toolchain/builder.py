"""CMake builds of generated modules, cached by a hash of the compiler, the source, the
options and the toolchain. Safe when several ranks ask for the same module at once (a file
lock: one builds, the others wait and import)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from typing import Any
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from coconetc.paths import runtime_dir


ENV_CACHE = "COCONET_CACHE"  # where built modules live (default ~/.cache/coconet)
ENV_VERBOSE = "COCONET_VERBOSE"  # 1: show cmake's output while building


class BuildError(RuntimeError):
    pass


@dataclass(frozen=True)
class Toolchain:
    cmake: str
    mpicxx: str
    pybind11_dir: str
    blas_include: str
    blas_lib: str

    def key(self) -> str:
        return "|".join([*map(str, self.__dict__.values()), sys.version, sysconfig.get_platform()])


def _bin(name: str) -> str:
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        raise BuildError(f"coconetc: cannot find '{name}' (install the cpu extra: pip install 'coconet[cpu]')")
    return found


@cache
def toolchain() -> Toolchain:
    require_cpu_extra()
    import pybind11
    import scipy_openblas32 as blas
    libdir = Path(blas.get_lib_dir())
    libs = sorted(libdir.glob("libscipy_openblas*.so*")) or sorted(libdir.glob("*openblas*"))
    if not libs:
        raise BuildError(f"coconetc: no OpenBLAS library in {libdir}")
    return Toolchain(_bin("cmake"), _bin("mpicxx"), pybind11.get_cmake_dir(), blas.get_include_dir(),
                     str(libs[0]))


@cache
def compiler_hash() -> str:
    """The part of the compiler a build depends on besides the generated text (which the key
    hashes itself): its version, its templates and the runtime headers the source includes."""
    from coconetc.version import __version__
    h = hashlib.sha256(__version__.encode())
    pkg = Path(__file__).resolve().parent.parent
    files = sorted([*pkg.rglob("*.j2"), *runtime_dir().rglob("*.h")])
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def cache_dir() -> Path:
    return Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "coconet")


def build_key(source: str, options: str) -> str:
    h = hashlib.sha256()
    for part in (compiler_hash(), source, options, toolchain().key()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def build(module: str, cpp: str, cmake: str, out_dir: Path, log=None) -> Path:
    """Write the sources to out_dir and build; returns the path of the extension module."""
    return build_locked(module, {"module.cpp": cpp, "CMakeLists.txt": cmake}, out_dir, _run_cmake, log)


def build_locked(module: str, files: dict[str, str], out_dir: Path,
                 run: Callable[[Path, Any], None], log=None) -> Path:
    """Under a file lock (several ranks may load at once): the module already built in
    out_dir, or the files written and `run(out_dir, log)` building it (any backend)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        built = _find_module(out_dir, module)
        if built is not None:
            return built
        for name, text in files.items():
            (out_dir / name).write_text(text)
        run(out_dir, log)
        built = _find_module(out_dir, module)
        if built is None:
            raise BuildError(f"coconetc: the build finished but made no module in {out_dir}")
        return built


def _find_module(out_dir: Path, module: str) -> Path | None:
    hits = sorted((out_dir / "build").glob(f"{module}*.so")) if (out_dir / "build").exists() else []
    return hits[0] if hits else None


def _run_cmake(out_dir: Path, log) -> None:
    tc = toolchain()
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    configure = [tc.cmake, "-S", str(out_dir), "-B", str(out_dir / "build"), "-DCMAKE_BUILD_TYPE=Release",
                 f"-Dpybind11_DIR={tc.pybind11_dir}", f"-DMPI_CXX_COMPILER={tc.mpicxx}",
                 f"-DPython3_EXECUTABLE={sys.executable}", f"-DCOCONET_RUNTIME={runtime_dir()}",
                 f"-DCOCONET_BLAS_INCLUDE={tc.blas_include}", f"-DCOCONET_BLAS_LIB={tc.blas_lib}",
                 f"-DCOCONET_BLAS_LIBDIR={Path(tc.blas_lib).parent}"]
    steps = [("configuring", configure),
             ("compiling", [tc.cmake, "--build", str(out_dir / "build"), "-j", str(os.cpu_count() or 1)])]
    for what, cmd in steps:
        say(f"coconetc: {what} {out_dir / 'module.cpp'}")
        verbose = os.environ.get(ENV_VERBOSE) == "1"
        res = subprocess.run(cmd, capture_output=not verbose, text=True)
        if res.returncode != 0:
            output = ((res.stdout or "") + (res.stderr or ""))[-6000:]
            raise BuildError(f"coconetc: {what} failed for {out_dir / 'module.cpp'}\n{output}")


CPU_EXTRA = ("pybind11", "mpi4py", "scipy_openblas32")  # what pip install 'coconet[cpu]' brings


@cache
def _missing_cpu_extra() -> tuple[str, ...]:
    import importlib.util
    return tuple(m for m in CPU_EXTRA if importlib.util.find_spec(m) is None)


def require_cpu_extra() -> None:
    """Building or calling a CPU module needs the `cpu` extra: say so, not 'No module named'."""
    missing = _missing_cpu_extra()
    if missing:
        raise BuildError(f"coconetc: the CPU backend needs the 'cpu' extra, which is not installed "
                         f"(missing: {', '.join(missing)}); install it with: "
                         "pip install 'coconet[cpu]'")
