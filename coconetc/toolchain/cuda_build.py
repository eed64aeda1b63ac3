"""Builds of CUDA modules (codegen/cuda): nvcc through CMake, against NCCL, cuBLAS and the CUDA
runtime from the PyPI wheels (nvidia-nccl-cu13, nvidia-cublas, nvidia-cuda-runtime), cached by
a hash of the compiler, the generated source, the architectures and the toolchain, like the
CPU builds (builder.py)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

from coconetc.toolchain.builder import BuildError, build_locked, cache_dir, compiler_hash
from coconetc.paths import runtime_dir

ENV_NVCC = "COCONET_NVCC"  # the nvcc to use (default: CUDACXX, PATH, /usr/local/cuda/bin/nvcc)
_PROBE = "ccn_cuda_module_name_placeholder"


@dataclass(frozen=True)
class CudaToolchain:
    cmake: str
    nvcc: str
    pybind11_dir: str
    nccl_include: str
    nccl_libdir: str
    cuda_include: str
    cuda_libdir: str

    def key(self) -> str:
        return "|".join([*map(str, self.__dict__.values()), sys.version, sysconfig.get_platform()])


def find_nvcc() -> str | None:
    for c in (os.environ.get(ENV_NVCC), os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if c and Path(c).exists():
            return c
    return None


def wheel_dirs() -> tuple[Path, Path] | None:
    """(nvidia/nccl, nvidia/cu13) of the installed wheels, or None."""
    try:
        import nvidia  # namespace package of the NVIDIA wheels (untyped: see pyproject)
    except ImportError:
        return None
    for root in map(Path, nvidia.__path__):
        nccl, cu = root / "nccl", root / "cu13"
        if (nccl / "lib" / "libnccl.so.2").exists() and (cu / "lib" / "libcublas.so.13").exists() \
                and (cu / "lib" / "libcudart.so.13").exists():
            return nccl, cu
    return None


def missing() -> str | None:
    """Why CUDA modules cannot be built here (None: they can)."""
    if find_nvcc() is None:
        return "no nvcc (set COCONET_NVCC or install the CUDA toolkit)"
    if wheel_dirs() is None:
        return "no NCCL/cuBLAS/CUDA runtime wheels (pip install 'coconet[cuda]')"
    try:
        import pybind11  # noqa: F401
    except ImportError:
        return "no pybind11 (pip install 'coconet[cuda]')"
    return None


@cache
def toolchain() -> CudaToolchain:
    why = missing()
    if why:
        raise BuildError(f"coconetc: cannot build CUDA modules: {why}")
    import pybind11
    nccl, cu = wheel_dirs()  # type: ignore[misc]
    cmake = str(Path(sys.executable).parent / "cmake")
    if not Path(cmake).exists():
        cmake = shutil.which("cmake") or ""
    if not cmake:
        raise BuildError("coconetc: cannot find 'cmake' (pip install 'coconet[cuda]')")
    return CudaToolchain(cmake, str(find_nvcc()), pybind11.get_cmake_dir(), str(nccl / "include"),
                         str(nccl / "lib"), str(cu / "include"), str(cu / "lib"))


@cache
def cuda_hash() -> str:
    h = hashlib.sha256(compiler_hash().encode())
    for f in sorted(runtime_dir().rglob("*.cuh")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def build_key(source: str, options: str) -> str:
    h = hashlib.sha256()
    for part in (cuda_hash(), source, options, toolchain().key()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def compile_cuda(path: str | Path, out_dir: str | Path | None = None, archs: str | None = None,
                 skip_unsupported: bool = False, build: bool = True, log=None, *,
                 include_dirs=(), library_dirs=(), libraries=()):
    """Generate FILE's CUDA module and build it (cached); returns (SourceFile, CudaSources,
    path of the .so or None when build is False). include_dirs, library_dirs, libraries: for
    the file's extern operations."""
    from coconetc.codegen.libs import Libs
    from coconetc.codegen.cuda import DEFAULT_ARCHS, generate
    from coconetc.sourcefile import load_file
    mod = load_file(path)
    archs = archs or DEFAULT_ARCHS
    stem = "".join(c if c.isalnum() else "_" for c in Path(path).stem)
    libs = Libs.of(path, bool(mod.externs), include_dirs, library_dirs, libraries)
    probe = generate(mod, _PROBE, archs, skip_unsupported, libs)
    if not build:
        return mod, probe, None
    extra = libs.fingerprint(mod.extern_headers("cuda")) if libs != Libs() else ""
    key = build_key(probe.cu + probe.cmake, f"cuda|{archs}{extra}")
    name = f"ccn_cuda_{stem}_{key}"
    src = replace(probe, module=name, cu=probe.cu.replace(_PROBE, name), cmake=probe.cmake.replace(_PROBE, name))
    where = Path(out_dir) if out_dir else cache_dir() / name
    return mod, src, build_module(name, src.cu, src.cmake, where, log)


def write_sources(src, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "module.cu").write_text(src.cu)
    (out_dir / "CMakeLists.txt").write_text(src.cmake)


def build_module(module: str, cu: str, cmake: str, out_dir: Path, log=None) -> Path:
    return build_locked(module, {"module.cu": cu, "CMakeLists.txt": cmake}, out_dir, _run, log)


def _blas_headers(tc: CudaToolchain, out_dir: Path) -> Path:
    """Only the cuBLAS headers of the wheel (its CUDA runtime headers may be newer than nvcc's)."""
    inc = out_dir / "cublas_include"
    inc.mkdir(exist_ok=True)
    for f in Path(tc.cuda_include).glob("cublas*.h"):
        link = inc / f.name
        if not link.exists():
            link.symlink_to(f)
    return inc


def _run(out_dir: Path, log) -> None:
    tc = toolchain()
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    configure = [tc.cmake, "-S", str(out_dir), "-B", str(out_dir / "build"), "-DCMAKE_BUILD_TYPE=Release",
                 f"-DCMAKE_CUDA_COMPILER={tc.nvcc}", f"-Dpybind11_DIR={tc.pybind11_dir}",
                 f"-DPython3_EXECUTABLE={sys.executable}", f"-DCOCONET_RUNTIME={runtime_dir()}",
                 f"-DCOCONET_NCCL_INCLUDE={tc.nccl_include}", f"-DCOCONET_NCCL_LIBDIR={tc.nccl_libdir}",
                 f"-DCOCONET_CUDA_INCLUDE={_blas_headers(tc, out_dir)}", f"-DCOCONET_CUDA_LIBDIR={tc.cuda_libdir}"]
    jobs = os.environ.get("COCONET_BUILD_JOBS", str(min(2, os.cpu_count() or 1)))
    steps = [("configuring", configure), ("compiling", [tc.cmake, "--build", str(out_dir / "build"), "-j", jobs])]
    for what, cmd in steps:
        say(f"coconetc: {what} {out_dir / 'module.cu'}")
        verbose = os.environ.get("COCONET_VERBOSE") == "1"
        res = subprocess.run(cmd, capture_output=not verbose, text=True)
        if res.returncode != 0:
            output = ((res.stdout or "") + (res.stderr or ""))[-6000:]
            raise BuildError(f"coconetc: {what} failed for {out_dir / 'module.cu'}\n{output}")


# ---- host emulation (coconetc run --backend cuda --emulate) -------------------------------------

def emulation_missing() -> str | None:
    """Why the emulated CUDA module cannot be built here (None: it can)."""
    from coconetc.toolchain.builder import _missing_cpu_extra
    gone = _missing_cpu_extra()
    if gone:
        return f"the host emulation needs the 'cpu' extra (missing: {', '.join(gone)})"
    return None


def compile_emulated(path: str | Path, out_dir: str | Path | None = None, log=None):
    """FILE's CUDA module (the same module.cu nvcc builds) compiled by the MPI C++ compiler with
    -DCOCONET_EMULATE (runtime_cpp/coconet/cuda/emulate.h: streams as threads, NCCL on MPI,
    cuBLAS on the CPU GEMM), cached like the other builds. Leaves out what the CUDA renderer does
    not implement and programs with extern operations (their own CUDA code is not emulated).
    Returns (SourceFile, CudaSources, path of the .so)."""
    from coconetc.codegen.cuda import generate
    from coconetc.sourcefile import load_file
    mod = load_file(path)
    probe = generate(mod, _PROBE, skip_unsupported=True, emulate=True)
    name, so = build_emulated(probe.cu, Path(path).stem, out_dir, log=log)
    return mod, replace(probe, module=name, cu=probe.cu.replace(_PROBE, name), cmake=""), so


def build_emulated(cu: str, stem: str = "module", out_dir: str | Path | None = None,
                   runtime: str | Path | None = None, log=None) -> tuple[str, Path]:
    """Build a generated module.cu (its module named by the placeholder of generate()) for the
    host emulation; runtime: another copy of runtime_cpp/ (tests edit it). Returns (module
    name, path of the .so), cached by a hash of everything that goes in."""
    from coconetc.toolchain import builder
    why = emulation_missing()
    if why:
        raise BuildError(f"coconetc: cannot build the emulated CUDA module: {why}")
    rt = Path(runtime) if runtime else runtime_dir()
    h = hashlib.sha256()
    headers = [f.read_bytes().decode() for f in sorted([*rt.rglob("*.h"), *rt.rglob("*.cuh")])]
    for part in (compiler_hash(), *headers, cu, builder.toolchain().mpicxx, sys.version, sysconfig.get_platform(),
                 "emulate"):
        h.update(part.encode())
        h.update(b"\0")
    stem = "".join(c if c.isalnum() else "_" for c in stem)
    name = f"ccn_emu_{stem}_{h.hexdigest()[:16]}"
    where = Path(out_dir) if out_dir else cache_dir() / name
    so = build_locked(name, {"module.cu": cu.replace(_PROBE, name)}, where,
                      lambda d, lg: _run_emulated(name, d, lg, rt), log)
    return name, so


def _run_emulated(name: str, out_dir: Path, log, runtime: Path) -> None:
    import pybind11
    from coconetc.toolchain import builder
    tc = builder.toolchain()
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    blas_dir = str(Path(tc.blas_lib).parent)
    (out_dir / "build").mkdir(exist_ok=True)
    so = out_dir / "build" / f"{name}.so"
    cmd = [tc.mpicxx, "-std=c++17", "-O1", "-fPIC", "-shared", "-pthread", "-DCOCONET_EMULATE", "-x", "c++",
           str(out_dir / "module.cu"), "-x", "none", f"-I{runtime}", f"-I{pybind11.get_include()}",
           f"-I{sysconfig.get_paths()['include']}", f"-L{blas_dir}", f"-l:{Path(tc.blas_lib).name}",
           f"-Wl,-rpath,{blas_dir}", "-o", str(so)]
    say(f"coconetc: compiling {out_dir / 'module.cu'} (host emulation)")
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        output = ((res.stdout or "") + (res.stderr or ""))[-6000:]
        raise BuildError(f"coconetc: compiling the emulated module failed for {out_dir / 'module.cu'}\n{output}")
