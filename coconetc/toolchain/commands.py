"""The compiler commands: CMake (CPU modules, CUDA modules with nvcc) and the MPI C++ compiler
(the host emulation of a CUDA module). The only place in coconetc that starts a compiler. Each
builds the sources in `src` into the build folder `build` (absolute paths both)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

from coconetc.paths import runtime_dir
from coconetc.toolchain.probes import ENV_BUILD_JOBS, ENV_VERBOSE, BuildError, cuda_toolchain, toolchain

Log = Callable[[str], None]


def say(log: Log | None) -> Log:
    return log or (lambda msg: print(msg, file=sys.stderr, flush=True))


def _steps(steps: list[tuple[str, list[str]]], source: Path, log: Log | None, quiet: bool = False) -> None:
    for what, cmd in steps:
        say(log)(f"coconetc: {what} {source}")
        verbose = os.environ.get(ENV_VERBOSE) == "1" and not quiet
        res = subprocess.run(cmd, capture_output=not verbose, text=True)
        if res.returncode != 0:
            output = ((res.stdout or "") + (res.stderr or ""))[-6000:]
            raise BuildError(f"coconetc: {what} failed for {source}\n{output}")


def cmake_cpu(src: Path, build: Path, log: Log | None) -> None:
    """A CPU module: module.cpp and CMakeLists.txt in src, built with CMake and mpicxx."""
    tc = toolchain()
    configure = [tc.cmake, "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                 f"-Dpybind11_DIR={tc.pybind11_dir}", f"-DMPI_CXX_COMPILER={tc.mpicxx}",
                 f"-DPython3_EXECUTABLE={sys.executable}", f"-DCOCONET_RUNTIME={runtime_dir()}",
                 f"-DCOCONET_BLAS_INCLUDE={tc.blas_include}", f"-DCOCONET_BLAS_LIB={tc.blas_lib}",
                 f"-DCOCONET_BLAS_LIBDIR={Path(tc.blas_lib).parent}"]
    compile_ = [tc.cmake, "--build", str(build), "-j", str(os.cpu_count() or 1)]
    _steps([("configuring", configure), ("compiling", compile_)], src / "module.cpp", log)


def _blas_headers(include: str, build: Path) -> Path:
    """Only the cuBLAS headers of the wheel (its CUDA runtime headers may be newer than nvcc's),
    linked into a folder of the (absolute) build folder."""
    inc = build / "cublas_include"
    inc.mkdir(parents=True, exist_ok=True)
    for f in Path(include).glob("cublas*.h"):
        link = inc / f.name
        if not link.exists():
            link.symlink_to(f)
    return inc


def cmake_cuda(src: Path, build: Path, log: Log | None) -> None:
    """A CUDA module: module.cu and CMakeLists.txt in src, built with CMake and nvcc against
    NCCL, cuBLAS and the CUDA runtime of the wheels."""
    tc = cuda_toolchain()
    assert src.is_absolute() and build.is_absolute(), (src, build)  # CMake reads -D paths from its build dir
    configure = [tc.cmake, "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                 f"-DCMAKE_CUDA_COMPILER={tc.nvcc}", f"-Dpybind11_DIR={tc.pybind11_dir}",
                 f"-DPython3_EXECUTABLE={sys.executable}", f"-DCOCONET_RUNTIME={runtime_dir()}",
                 f"-DCOCONET_NCCL_INCLUDE={tc.nccl_include}", f"-DCOCONET_NCCL_LIBDIR={tc.nccl_libdir}",
                 f"-DCOCONET_CUDA_INCLUDE={_blas_headers(tc.cuda_include, build)}",
                 f"-DCOCONET_CUDA_LIBDIR={tc.cuda_libdir}"]
    jobs = os.environ.get(ENV_BUILD_JOBS, str(min(2, os.cpu_count() or 1)))
    compile_ = [tc.cmake, "--build", str(build), "-j", jobs]
    _steps([("configuring", configure), ("compiling", compile_)], src / "module.cu", log)


def emulated(name: str, runtime: Path) -> Callable[[Path, Path, Log | None], None]:
    """The host emulation of a CUDA module named NAME (module.cu compiled as C++ with
    -DCOCONET_EMULATE against RUNTIME, a copy of runtime_cpp/)."""
    def run(src: Path, build: Path, log: Log | None) -> None:
        import pybind11
        tc = toolchain()
        blas_dir = str(Path(tc.blas_lib).parent)
        build.mkdir(parents=True, exist_ok=True)
        cmd = [tc.mpicxx, "-std=c++17", "-O1", "-fPIC", "-shared", "-pthread", "-DCOCONET_EMULATE", "-x", "c++",
               str(src / "module.cu"), "-x", "none", f"-I{runtime}", f"-I{pybind11.get_include()}",
               f"-I{sysconfig.get_paths()['include']}", f"-L{blas_dir}", f"-l:{Path(tc.blas_lib).name}",
               f"-Wl,-rpath,{blas_dir}", "-o", str(build / f"{name}.so")]
        _steps([("compiling (host emulation)", cmd)], src / "module.cu", log, quiet=True)
    return run
