"""What the toolchain finds on this machine: the C++ (MPI) and CUDA build tools, the wheels
they build against, and the hashes of the compiler parts a build depends on. Nothing here runs
a compiler (commands.py does)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from coconetc.cache import ENV_CACHE as ENV_CACHE, cache_dir as cache_dir  # (their home: the toolchain's callers find them here)
from coconetc.paths import install_command, runtime_dir

ENV_VERBOSE = "COCONET_VERBOSE"  # 1: show cmake's output while building
ENV_NVCC = "COCONET_NVCC"  # the nvcc to use (default: CUDACXX, PATH, /usr/local/cuda/bin/nvcc)
ENV_BUILD_JOBS = "COCONET_BUILD_JOBS"  # parallel jobs of a CUDA build (default 2)
ENV_BLAS = "COCONET_BLAS"  # mkl or openblas: the CPU modules' BLAS (default: MKL on Intel CPUs where installed)
CPU_EXTRA = ("pybind11", "mpi4py", "scipy_openblas32")  # the modules the 'cpu' extra brings (pyproject.toml)
MKL_LIBS = ("libmkl_intel_lp64", "libmkl_gnu_thread", "libmkl_core")  # MKL's BLAS on GNU OpenMP, in link order


class BuildError(RuntimeError):
    pass


def _platform() -> list[str]:
    return [sys.version, sysconfig.get_platform()]


def tools_key(tools: object) -> str:
    """A toolchain's part of a cache key: every tool's path and the platform."""
    return "|".join([*map(str, tools.__dict__.values()), *_platform()])


@dataclass(frozen=True)
class Toolchain:
    """The CPU builds' tools: CMake, the MPI C++ compiler, pybind11 and the BLAS: its libraries
    (files, and linker options such as -lgomp, in link order) and the macros that make
    runtime_cpp/coconet/gemm.h call it."""

    cmake: str
    mpicxx: str
    pybind11_dir: str
    blas_include: str
    blas_libs: tuple[str, ...]
    blas_defines: tuple[str, ...]

    def key(self) -> str:
        return tools_key(self)


@dataclass(frozen=True)
class CudaToolchain:
    """The CUDA builds' tools: CMake, nvcc, pybind11, NCCL and cuBLAS/CUDA runtime wheels."""

    cmake: str
    nvcc: str
    pybind11_dir: str
    nccl_include: str
    nccl_libdir: str
    cuda_include: str
    cuda_libdir: str

    def key(self) -> str:
        return tools_key(self)


def _bin(name: str, extra: str = "cpu") -> str:
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        raise BuildError(f"coconetc: cannot find '{name}' (install the {extra} extra: {install_command(extra)})")
    return found


@cache
def mkl_libs() -> tuple[str, ...]:
    """MKL's libraries from the `mkl` wheel (MKL_LIBS' files, in link order), or () where that
    wheel is not installed (or lacks one of them)."""
    import importlib.metadata
    try:
        dist = importlib.metadata.distribution("mkl")
    except importlib.metadata.PackageNotFoundError:
        return ()
    found = {Path(str(f)).name.split(".so")[0]: str(dist.locate_file(f)) for f in dist.files or ()
             if ".so" in Path(str(f)).name}
    return tuple(str(Path(found[n]).resolve()) for n in MKL_LIBS) if all(n in found for n in MKL_LIBS) else ()


@cache
def cpu_info(field: str) -> str:
    """The first value of FIELD in /proc/cpuinfo ("vendor_id", "model name"), "" where there is
    none (or no such file)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""
    found = re.search(rf"^{re.escape(field)}\s*:(.*)$", text, re.M)
    return found.group(1).strip() if found else ""


def cpu_vendor() -> str:
    """The CPU's vendor as the kernel names it (GenuineIntel, AuthenticAMD), "" where unknown: the
    default BLAS follows it (blas_libraries)."""
    return cpu_info("vendor_id")


def blas_libraries() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The BLAS the CPU modules link: (its libraries, gemm.h's macros for it). On an Intel CPU, MKL
    where the `mkl` wheel is installed (the cpu extra installs it on x86-64: torch's own BLAS,
    there from 5% faster than OpenBLAS at a GPT block's GEMM shapes to 28% at a pipeline
    micro-batch's, docs/results/cpu_2026-12-05_blas.md); on other CPUs (AMD's), and where MKL is
    not installed, OpenBLAS (scipy-openblas32: on an AMD EPYC as fast as MKL at 128 to 1024 tokens
    and 3% to 33% faster at 4096, docs/results/cpu_2026-12-05_blas_amd.md). COCONET_BLAS=openblas
    or =mkl chooses."""
    want = os.environ.get(ENV_BLAS, "").strip().lower()
    if want not in ("", "mkl", "openblas"):
        raise BuildError(f"coconetc: {ENV_BLAS}={want!r}: expected 'mkl' or 'openblas' (or unset: MKL on an "
                         "Intel CPU where installed)")
    if want == "mkl" or (not want and cpu_vendor() == "GenuineIntel"):
        mkl = mkl_libs()
        if mkl:  # its GNU OpenMP layer names libgomp's symbols without needing the library
            return (*mkl, "-lgomp"), ("COCONET_BLAS_MKL",)
        if want == "mkl":
            raise BuildError(f"coconetc: {ENV_BLAS}=mkl but MKL's wheel is not installed (pip install mkl), or "
                             f"unset {ENV_BLAS} to use OpenBLAS")
    return (openblas_lib(),), ()


def openblas_lib() -> str:
    """OpenBLAS's shared library in the scipy-openblas32 wheel; a BuildError where it has none."""
    import scipy_openblas32 as blas
    libdir = Path(blas.get_lib_dir())
    libs = sorted(libdir.glob("libscipy_openblas*.so*")) or sorted(libdir.glob("*openblas*"))
    if not libs:
        raise BuildError(f"coconetc: no OpenBLAS library in {libdir}")
    return str(libs[0])


@cache
def toolchain() -> Toolchain:
    require_cpu_extra()
    import pybind11
    import scipy_openblas32 as blas
    libs, defines = blas_libraries()
    return Toolchain(_bin("cmake"), _bin("mpicxx"), pybind11.get_cmake_dir(), blas.get_include_dir(), libs, defines)


@cache
def toolchain_fingerprint() -> str:
    """What toolchain() would find, found without importing the wheels (a warm load's key,
    runtime/warm.py, where importing them costs more than the rest of the key): the tools'
    paths, where each wheel of the cpu extra is and when its __init__ was written (the
    Toolchain's CMake folder, headers and library lie in these wheels' folders, which an
    install rewrites), MKL's libraries and when they were written, COCONET_BLAS, the CPU's vendor
    and the platform.
    It changes when a tool is found elsewhere or a wheel is installed again or elsewhere, which
    is when toolchain().key() changes (short of a library copied by hand into a wheel's folder)."""
    require_cpu_extra()
    parts = [_bin("cmake"), _bin("mpicxx"), *_platform(), os.environ.get(ENV_BLAS, ""), cpu_vendor(),
             *(f"{lib}:{os.stat(lib).st_mtime_ns}" for lib in mkl_libs())]
    for name in CPU_EXTRA:
        origin = importlib.util.find_spec(name).origin  # type: ignore[union-attr]
        parts += [str(origin), str(os.stat(origin).st_mtime_ns) if origin else ""]
    return "|".join(parts)


@cache
def missing_cpu_extra() -> tuple[str, ...]:
    return tuple(m for m in CPU_EXTRA if importlib.util.find_spec(m) is None)


def require_cpu_extra() -> None:
    """Building or calling a CPU module needs the `cpu` extra: say so, not 'No module named'."""
    missing = missing_cpu_extra()
    if missing:
        raise BuildError(f"coconetc: the CPU backend needs the 'cpu' extra, which is not installed "
                         f"(missing: {', '.join(missing)}); install it with: {install_command('cpu')}")


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


def cuda_missing() -> str | None:
    """Why CUDA modules cannot be built here (None: they can)."""
    if find_nvcc() is None:
        return "no nvcc (set COCONET_NVCC or install the CUDA toolkit)"
    if wheel_dirs() is None:
        return f"no NCCL/cuBLAS/CUDA runtime wheels ({install_command('cuda')})"
    if importlib.util.find_spec("pybind11") is None:
        return f"no pybind11 ({install_command('cuda')})"
    return None


@cache
def cuda_toolchain() -> CudaToolchain:
    why = cuda_missing()
    if why:
        raise BuildError(f"coconetc: cannot build CUDA modules: {why}")
    import pybind11
    nccl, cu = wheel_dirs()  # type: ignore[misc]
    return CudaToolchain(_bin("cmake", "cuda"), str(find_nvcc()), pybind11.get_cmake_dir(),
                         str(nccl / "include"), str(nccl / "lib"), str(cu / "include"), str(cu / "lib"))


def emulation_missing() -> str | None:
    """Why the emulated CUDA module cannot be built here (None: it can)."""
    gone = missing_cpu_extra()
    if gone:
        return f"the host emulation needs the 'cpu' extra (missing: {', '.join(gone)})"
    return None


def _hash_files(h, files) -> None:
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())


_QUOTED_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.M)


def included(text: str, here: Path | None = None, runtime: Path | None = None) -> list[Path]:
    """The runtime's files that TEXT includes with #include "...", directly or through one
    another, each found where the compiler looks: next to the including file (HERE for TEXT),
    then in the runtime folder RUNTIME (its -I; default runtime_dir()). Every #include counts,
    whatever #if it sits under: the list may be longer than what the compiler reads, never
    shorter. <...> headers are the toolchain's (its key)."""
    root = (runtime or runtime_dir()).resolve()
    seen: set[Path] = set()
    todo = [(text, here)]
    while todo:
        body, folder = todo.pop()
        for name in _QUOTED_INCLUDE.findall(body):
            found = next((f for f in (*([folder / name] if folder else []), root / name) if f.is_file()), None)
            if found is not None and (found := found.resolve()) not in seen:
                seen.add(found)
                todo.append((found.read_text(), found.parent))
    return sorted(seen)


def headers_key(text: str, here: Path | None = None, runtime: Path | None = None) -> str:
    """A hash of what TEXT includes of the runtime (included), as compiler_hash hashes files.
    A compiled object's cache key holds it, so that an edit of a header rebuilds the objects
    that include it, and only those."""
    h = hashlib.sha256()
    _hash_files(h, included(text, here, runtime))
    return h.hexdigest()


@cache
def compiler_hash() -> str:
    """The part of the compiler a build depends on besides the generated text (which the key
    hashes itself): its version, its templates, the runtime headers the source includes and
    the binding it links (coconet/bind.cpp)."""
    from coconetc.version import __version__
    h = hashlib.sha256(__version__.encode())
    pkg = Path(__file__).resolve().parent.parent
    _hash_files(h, sorted([*pkg.rglob("*.j2"), *runtime_dir().rglob("*.h"), *(runtime_dir() / "coconet").rglob("*.cpp")]))
    return h.hexdigest()


@cache
def vector_math() -> bool:
    """Whether glibc's vector math library (libmvec) is there to link, on x86-64 Linux: the CPU
    builds then give the generated loops' float exp, log and tanh its vector versions
    (COCONET_VECTOR_MATH, runtime_cpp/coconet/module.h), so such a loop vectorizes."""
    import platform
    import subprocess
    if not sys.platform.startswith("linux") or platform.machine() != "x86_64":
        return False
    try:
        out = subprocess.run([toolchain().mpicxx, "-print-file-name=libmvec.so"], capture_output=True, text=True,
                             timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return False
    return os.path.isabs(out) and os.path.exists(out)


@cache
def cuda_hash() -> str:
    """compiler_hash, the CUDA runtime headers and the CUDA binding (coconet/cuda/bind.cu)."""
    h = hashlib.sha256(compiler_hash().encode())
    _hash_files(h, sorted([*runtime_dir().rglob("*.cuh"), *(runtime_dir() / "coconet").rglob("*.cu")]))
    return h.hexdigest()
