"""The compiler commands: the MPI C++ compiler (CPU modules, the host emulation of a CUDA module)
and CMake with nvcc (CUDA modules). The only place in coconetc that starts a compiler. Each
builds the sources in `src` into the build folder `build` (absolute paths both).

A CPU module that coconetc builds (cpu_units) is loaded in pieces: each unit (one per program x
schedule x dtype) is a shared object of its own, cached by content (the units not cached yet
compiled together in a few translation units: _units), and the module's .so holds
only a lazy table and the Python binding, which map a unit (dlopen, dlsym) on its function's
first call; importing the module maps none of them. The runtime's state must stay one per
process (communicators and their cache, shared windows, the thread counts and BLAS threads,
the batch a thread runs in, the counters tests read): it lives in one shared library compiled
once per machine, libccnrt-<key>.so in the objects cache (runtime_cpp/coconet/runtime.cpp),
which the module and every unit link by run path, so the dynamic loader maps it once and all
reach the one instance (runtime_cpp/coconet/state.h lists the state and says how the headers
declare it). The other way, the module exporting the state to the units, would need the units
linked against one module (they are shared between modules) or loaded RTLD_GLOBAL (a symbol
clash between modules); a library of its own keeps each unit independent of the module that maps
it. `coconetc compile --emit-only` and CMake builds stay one translation unit (module.cpp, a
linked table, runtime.cpp compiled into the module)."""

from __future__ import annotations

import fcntl
import functools
import os
import shlex
import subprocess
import sys
import sysconfig
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from coconetc.codegen import cpu, cuda
from coconetc.codegen.extern_libs import Libs
from coconetc.paths import runtime_dir
from coconetc.toolchain import artifacts, probes
from coconetc.toolchain.probes import (ENV_BUILD_JOBS, ENV_VERBOSE, BuildError, cache_dir, cuda_toolchain,
                                       toolchain, vector_math)

Log = Callable[[str], None]
T = TypeVar("T")


def say(log: Log | None) -> Log:
    return log or (lambda msg: print(msg + "\n", end="", file=sys.stderr, flush=True))  # one write: builds run side by side


def _steps(steps: list[tuple[str, list[str]]], source: Path, log: Log | None, quiet: bool = False) -> None:
    for what, cmd in steps:
        say(log)(f"coconetc: {what} {source}")
        verbose = os.environ.get(ENV_VERBOSE) == "1" and not quiet
        res = subprocess.run(cmd, capture_output=not verbose, text=True)
        if res.returncode != 0:
            output = ((res.stdout or "") + (res.stderr or ""))[-6000:]
            raise BuildError(f"coconetc: {what} failed for {source}\n{output}")


def _cpu_flags(include_dirs: tuple[str, ...] = ()) -> list[str]:
    """mpicxx's options for a CPU module's units and its binding (as CMakeLists.txt.j2's), then
    CXXFLAGS from the environment, as CMake reads it (-O1 there builds faster than the -O3 here:
    the tests build so)."""
    tc = toolchain()
    return ["-std=c++17", *cpu.CXX_FLAGS, "-fPIC", "-fvisibility=hidden", "-fopenmp", "-pthread",
            *(["-DCOCONET_VECTOR_MATH"] if vector_math() else []),
            *(f"-D{d}" for d in tc.blas_defines), f"-I{runtime_dir()}", f"-I{tc.blas_include}",
            *(f"-I{d}" for d in include_dirs),
            *shlex.split(os.environ.get("CXXFLAGS", ""))]


def _libraries(libs: Libs) -> list[str]:
    """The extern operations' libraries on a link line: a file as it is, a name as -lNAME."""
    return [lib if Path(lib).is_file() else f"-l{lib}" for lib in libs.libraries]


def _python_includes() -> list[str]:
    import pybind11
    return [f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}"]


def _objects_dir() -> Path:
    return cache_dir().absolute() / "objects"


def _compiled(cmd: list[str], what: str, log: Log | None) -> Callable[[Path, Path], None]:
    """compile_(source, object) for artifacts.cached_object: CMD then -c SOURCE -o OBJECT."""
    def go(source: Path, obj: Path) -> None:
        _steps([(what, [*cmd, "-c", str(source), "-o", str(obj)])], source, log, quiet=True)
    return go


def _in_parallel(jobs: Sequence[Callable[[], T]]) -> list[T]:
    """Runs the compile jobs side by side, one per core; the first error raises."""
    if len(jobs) <= 1:
        return [job() for job in jobs]
    with ThreadPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda job: job(), jobs))


def cpu_key() -> list[str]:
    """What the key of every CPU object holds besides its text, its command and the runtime files
    it includes (probes.headers_key): the options from the environment and the tools."""
    return [f"cpu|{os.environ.get('CXXFLAGS', '')}", toolchain().key()]


def _runtime_source(name: str) -> tuple[str, str]:
    """A source file of the CPU runtime (coconet/NAME): its text, and the key of the runtime
    files it includes."""
    source = runtime_dir() / "coconet" / name
    text = source.read_text()
    return text, probes.headers_key(text, source.parent)


def cpu_runtime(log: Log | None) -> list[Path]:
    """The compiled part of the CPU runtime, once per machine (its key: the runtime files it
    includes, the tools, Python and pybind11): the Python binding (coconet/bind.cpp), an
    object every CPU module links, and the runtime library (coconet/runtime.cpp: the process's
    state and the collectives' instantiations, coconet/state.h), libccnrt-<key>.so, which every
    module and every unit links."""
    tc = toolchain()
    cmd = [tc.mpicxx, *_cpu_flags(), *_python_includes()]
    text, headers = _runtime_source("bind.cpp")
    binding = functools.partial(artifacts.cached_object, _objects_dir(),
                                artifacts.content_key([*cpu_key(), headers, *cmd, text, "bind.cpp"]), ".cpp", text,
                                _compiled(cmd, "compiling the Python binding (once per machine)", log))
    return _in_parallel([binding, functools.partial(_runtime_library, log)])


def _runtime_library(log: Log | None) -> Path:
    tc = toolchain()
    text, headers = _runtime_source("runtime.cpp")
    return _library("libccnrt", "runtime.cpp", text, [tc.mpicxx, *_cpu_flags(), "-shared"], [*cpu_key(), headers],
                    "compiling the runtime (once per machine)", log)


def _library(prefix: str, name: str, text: str, cmd: list[str], key_parts: list[str], what: str,
             log: Log | None) -> Path:
    """A runtime library: TEXT (the source NAME) compiled by CMD into <PREFIX>-<key>.so in the
    objects cache, linked with the BLAS library and named by its key (its soname), once per
    content (key_parts: what else it depends on)."""
    key = f"{prefix}-{artifacts.content_key([*key_parts, *cmd, *_blas(), text, name])}"

    def go(source: Path, lib: Path) -> None:
        _steps([(what, [*cmd, str(source), "-x", "none", *_blas(), "-o", str(lib), f"-Wl,-soname,{key}.so"])],
               source, log, quiet=True)
    return artifacts.cached_object(_objects_dir(), key, ".cpp", text, go, product=".so")


def _blas(vector: bool = True) -> list[str]:
    """Linking the BLAS libraries (a run path to their folders), and glibc's vector math library
    where the units use it (probes.vector_math; VECTOR false: not)."""
    libs = [Path(lib) for lib in toolchain().blas_libs if not lib.startswith("-")]
    dirs = list(dict.fromkeys(str(lib.parent) for lib in libs))
    return [*(f"-L{d}" for d in dirs), *(f"-l:{lib.name}" for lib in libs),
            *(lib for lib in toolchain().blas_libs if lib.startswith("-")), *(f"-Wl,-rpath,{d}" for d in dirs),
            *(["-lmvec"] if vector and vector_math() else [])]


def _runtime_link(library: Path) -> list[str]:
    """Linking a runtime library (the CPU runtime's or the emulation's; a run path to the objects cache)."""
    return [f"-L{library.parent}", f"-l:{library.name}", f"-Wl,-rpath,{library.parent}"]


UNIT_HEADER = '#include "coconet/module.h"'  # what a unit includes of the runtime (precompiled)


def cpu_header(log: Log | None) -> Path:
    """The folder of coconet/module.h precompiled (GCC's module.h.gch) with the units' options,
    once per machine: put first on the include path, it spares every unit parsing the runtime,
    MPI and the standard library (about a third of a unit's compile). A unit compiled with other
    options finds the header itself (GCC skips a precompiled header that does not fit)."""
    tc = toolchain()
    cmd = [tc.mpicxx, *_cpu_flags(), "-DCOCONET_LINKS_RUNTIME=", "-Wno-pragma-once-outside-header"]
    header = runtime_dir() / "coconet" / "module.h"
    folder = _objects_dir() / f"pch-{artifacts.content_key([*cpu_key(), probes.headers_key(UNIT_HEADER), *cmd])}"

    def go(_: Path, out: Path) -> None:
        _steps([("precompiling (once per machine)", [*cmd, "-c", "-x", "c++-header", str(header), "-o", str(out)])],
               header, log, quiet=True)
    artifacts.cached_object(folder / "coconet", "module.h", ".options", " ".join(cmd), go, product=".gch")
    return folder


def cpu_units(name: str, src: cpu.Sources, libs: Libs, libs_key: str) -> artifacts.Run:
    """A CPU module NAME built from its units (src.units: function name -> translation unit):
    each with a shared object of its own, cached by content (_units: a new or changed schedule
    compiles and links one; a unit two modules share is built once),
    and NAME.so: the module's lazy table of them (cpu.lazy_table) and the binding, which map a
    unit on its function's first call (runtime_cpp/coconet/entries.h). The module and every unit
    link the runtime library (cpu_runtime), so the process holds one runtime state however many
    units it maps (runtime_cpp/coconet/state.h). The units' shared objects are listed in
    UNITS_FILE of the build folder and the runtime library in LIBRARIES_FILE, for the module's
    manifest (artifacts.py). Each object's key: its text and command, the runtime files it
    includes (probes.headers_key: an edited header rebuilds the units that include it, not every
    unit), cpu_key(), and libs_key: the extern libraries' (their headers, for the units)."""
    def run(out: Path, build: Path, log: Log | None) -> None:
        tc = toolchain()
        # (on a first build, the precompiled header beside the binding and the runtime library)
        built: list[Any] = _in_parallel([functools.partial(cpu_runtime, log), functools.partial(cpu_header, log)])
        (binding, library), header = built
        cmd = [tc.mpicxx, f"-I{header}", *_cpu_flags(libs.include_dirs)]
        link = [*_runtime_link(library), *_blas(), "-Wl,--no-undefined", *(f"-L{d}" for d in libs.library_dirs),
                *(f"-Wl,-rpath,{d}" for d in libs.library_dirs), *_libraries(libs)]
        units = {fn: str(so) for fn, so in _units(src.units, [*cpu_key(), libs_key], cmd, link, log).items()}
        build.mkdir(parents=True, exist_ok=True)
        artifacts.write_atomic(build / "table.cpp", cpu.lazy_table(src, units))
        artifacts.write_atomic(build / artifacts.UNITS_FILE, "\n".join(units.values()))
        artifacts.write_atomic(build / artifacts.LIBRARIES_FILE, str(library))
        module = [*cmd, "-shared", str(build / "table.cpp"), str(binding), "-o", str(build / f"{name}.so"),
                  *_runtime_link(library), *_blas(), "-Wl,-Bsymbolic-functions"]
        _steps([("linking", module)], out / "module.cpp", log, quiet=True)
    return run


UNITS_PER_BATCH = 4  # the fewest units a batch holds, where more than one batch is compiled


def _units(texts: dict[str, str], key_parts: list[str], cmd: list[str], link: list[str],
           log: Log | None) -> dict[str, Path]:
    """The shared object of each unit (function name -> its text in TEXTS), cached by content:
    unit-<key>.so in the objects cache, KEY from its text, CMD, LINK (the libraries), KEY_PARTS
    and the runtime files it includes (probes.headers_key). The units not cached yet are compiled
    together, in as few translation units (batches) as keep the cores busy, at least
    UNITS_PER_BATCH a batch: a compile of each would load the precompiled runtime and
    instantiate its templates again, most of a small unit's compile (20 units: 18 s of CPU one
    by one, 4 s as one). Each unit's shared object is linked from its batch's object (a
    temporary file) alone: only the unit's function exported (a version script) and the rest
    of the batch dropped (--gc-sections), so a call maps its own unit's code and no other."""
    objects = _objects_dir()
    keys = {fn: artifacts.content_key([*key_parts, probes.headers_key(text), *cmd, text, *link])
            for fn, text in texts.items()}
    out = {fn: objects / f"unit-{k}.so" for fn, k in keys.items()}
    missing = [fn for fn in texts if not artifacts.whole(out[fn])]
    cut = {fn: _prologue(texts[fn]) for fn in missing}
    by_prologue: dict[str, list[str]] = {}  # (a batch's units include the same headers)
    for fn in missing:
        by_prologue.setdefault(cut[fn][0], []).append(fn)
    cores = int(os.environ.get(ENV_BUILD_JOBS, os.cpu_count() or 1))
    batches = []
    for fns in by_prologue.values():
        n = max(1, min(cores, len(fns) // UNITS_PER_BATCH))
        batches += [fns[i::n] for i in range(n)]

    def build(fns: list[str]) -> None:
        key = artifacts.content_key(["batch", *cmd, *sorted(keys[fn] for fn in fns)])
        with open(objects / f".batch-{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            fns = [fn for fn in fns if not artifacts.whole(out[fn])]  # (another process may have built them)
            if not fns:
                return
            parts = [f"// units {', '.join(fns)}, compiled as one (coconetc.toolchain.commands._units)",
                     cut[fns[0]][0]]
            for fn in fns:
                source = objects / f"{keys[fn]}.cpp"
                artifacts.write_atomic(source, texts[fn])
                body, at = cut[fn][1:]
                parts += [f'#line {at + 1} "{source}"', body]
            src, obj = (objects / f".batch-{key}.{os.getpid()}{ext}" for ext in (".cpp", ".o"))
            try:
                src.write_text("\n".join(parts) + "\n")
                _compiled([*cmd, "-ffunction-sections", "-fdata-sections"], f"compiling {', '.join(fns)}", log)(src, obj)
                for fn in fns:
                    _unit_so(fn, keys[fn], obj, cmd, link, log)
                src.unlink()  # (kept where the compiler failed: its errors name the units' own files)
            finally:
                obj.unlink(missing_ok=True)
    _in_parallel([functools.partial(build, fns) for fns in batches])
    return out


def _prologue(text: str) -> tuple[str, str, int]:
    """A unit's TEXT cut after its comments, defines and includes: (those lines, the rest, the
    number of lines before the rest)."""
    lines = text.split("\n")
    n = 0
    while n < len(lines) and (not lines[n].strip() or lines[n].startswith(("//", "#define", "#include"))):
        n += 1
    return "\n".join(ln for ln in lines[:n] if not ln.startswith("//")), "\n".join(lines[n:]), n


def _unit_so(fn: str, key: str, obj: Path, cmd: list[str], link: list[str], log: Log | None) -> Path:
    """unit-KEY.so: unit FN's function linked from OBJ (its batch's object), the other units'
    functions local and dropped."""
    objects = _objects_dir()
    script = objects / f"unit-{key}.map"
    artifacts.write_atomic(script, f"{{ global: {cpu.UNIT_SYMBOL}{fn}; local: *; }};\n")
    line = [*cmd, "-shared", str(obj), *link, "-Wl,--gc-sections", f"-Wl,--version-script={script}"]

    def go(_: Path, so: Path) -> None:
        _steps([(f"linking {fn}", [*line, "-o", str(so)])], obj, log, quiet=True)
    return artifacts.cached_object(objects, f"unit-{key}", ".link", " ".join(line), go, product=".so")


def _blas_headers(include: str, build: Path) -> Path:
    """Only the cuBLAS headers of the wheel (its CUDA runtime headers may be newer than nvcc's),
    linked into a folder of the (absolute) build folder."""
    inc = build / "cublas_include"
    inc.mkdir(parents=True, exist_ok=True)
    for f in Path(include).glob("cublas*.h"):
        try:
            (inc / f.name).symlink_to(f)
        except FileExistsError:  # made before (or by another process just now)
            pass
    return inc


def cmake_cuda(src: Path, build: Path, log: Log | None, *extra: str) -> None:
    """Configures and builds the CUDA project in src (CMake and nvcc, against NCCL, cuBLAS and
    the CUDA runtime of the wheels); extra: more -D options (the test of what
    `compile --backend cuda --emit-only` writes)."""
    tc = cuda_toolchain()
    assert src.is_absolute() and build.is_absolute(), (src, build)  # CMake reads -D paths from its build dir
    configure = [tc.cmake, "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                 f"-DCMAKE_CUDA_COMPILER={tc.nvcc}", f"-Dpybind11_DIR={tc.pybind11_dir}",
                 f"-DPython3_EXECUTABLE={sys.executable}", f"-DCOCONET_RUNTIME={runtime_dir()}",
                 f"-DCOCONET_NCCL_INCLUDE={tc.nccl_include}", f"-DCOCONET_NCCL_LIBDIR={tc.nccl_libdir}",
                 f"-DCOCONET_CUDA_INCLUDE={_blas_headers(tc.cuda_include, build)}",
                 f"-DCOCONET_CUDA_LIBDIR={tc.cuda_libdir}", *extra]
    jobs = os.environ.get(ENV_BUILD_JOBS, str(min(2, os.cpu_count() or 1)))
    compile_ = [tc.cmake, "--build", str(build), "-j", jobs]
    _steps([("configuring", configure), ("compiling", compile_)], src / "CMakeLists.txt", log)


def _gencode(archs: str) -> list[str]:
    """nvcc's options for ARCHS, a CMake CUDA_ARCHITECTURES list ("80;90", "90-real",
    "90-virtual", "native", "all", "all-major")."""
    out = []
    for a in filter(None, archs.split(";")):
        if a in ("native", "all", "all-major"):
            out.append(f"-arch={a}")
        elif a.endswith("-real"):
            out.append(f"--generate-code=arch=compute_{a[:-5]},code=[sm_{a[:-5]}]")
        elif a.endswith("-virtual"):
            out.append(f"--generate-code=arch=compute_{a[:-8]},code=[compute_{a[:-8]}]")
        else:
            out.append(f"--generate-code=arch=compute_{a},code=[compute_{a},sm_{a}]")
    return out


def cuda_flags(archs: str, include_dirs: tuple[str, ...] = ()) -> list[str]:
    """nvcc's command for a CUDA module's and its binding's sources (what CMakeLists.txt.j2's
    Release build runs, with CUDAFLAGS from the environment as CMake reads it)."""
    tc = cuda_toolchain()
    return [tc.nvcc, "-O3", "-DNDEBUG", "-std=c++17", *_gencode(archs), "-Xcompiler=-fPIC",
            "-Xcompiler=-fvisibility=hidden", *cuda.NVCC_OPTIONS, *shlex.split(os.environ.get("CUDAFLAGS", "")),
            f"-I{runtime_dir()}", f"-I{tc.nccl_include}", f"-I{_blas_headers(tc.cuda_include, _objects_dir())}",
            *(f"-I{d}" for d in include_dirs)]


def cuda_binding(key_parts: list[str], archs: str, log: Log | None) -> Path:
    """The CUDA modules' Python binding (runtime_cpp/coconet/cuda/bind.cu) compiled once per
    machine and architectures: an object every module links."""
    text = (runtime_dir() / "coconet" / "cuda" / "bind.cu").read_text()
    cmd = [*cuda_flags(archs), *(x for d in _python_includes() for x in ("-isystem", d[2:])), "-x", "cu"]
    return artifacts.cached_object(_objects_dir(), artifacts.content_key([*key_parts, *cmd, text, "bind"]), ".cu", text,
                                   _compiled(cmd, "compiling the CUDA Python binding (once per machine)", log))


def cuda_module(name: str, key_parts: list[str], archs: str, libs: Libs) -> artifacts.Run:
    """A CUDA module named NAME: module.cu compiled by nvcc (against NCCL, cuBLAS and the CUDA
    runtime of the wheels) and linked with the binding compiled once (cuda_binding; key_parts:
    what it depends on) into NAME.so."""
    def run(src: Path, build: Path, log: Log | None) -> None:
        tc = cuda_toolchain()
        binding = cuda_binding(key_parts, archs, log)
        build.mkdir(parents=True, exist_ok=True)
        obj = build / "module.o"
        cmd = [*cuda_flags(archs, libs.include_dirs), "-c", str(src / "module.cu"), "-o", str(obj)]
        libdirs = [tc.nccl_libdir, tc.cuda_libdir, *libs.library_dirs]
        link = [tc.nvcc, "-shared", "--cudart=none", *_gencode(archs), str(obj), str(binding), "-o",
                str(build / f"{name}.so"), "-Xlinker=-Bsymbolic-functions", *(f"-L{d}" for d in libdirs),
                *(f"-Xlinker=-rpath,{d}" for d in libdirs), "-l:libnccl.so.2", "-l:libcublas.so.13",
                "-l:libcublasLt.so.13", "-l:libcudart.so.13",
                *_libraries(libs)]
        _steps([("compiling", cmd), ("linking", link)], src / "module.cu", log)
    return run


def emulated(name: str, runtime: Path, key_parts: list[str],
             binding: tuple[Path, list[str]] | None = None, defines: tuple[str, ...] = ()) -> artifacts.Run:
    """The host emulation of a CUDA module named NAME: module.cu compiled as C++ with
    -DCOCONET_EMULATE against RUNTIME (a copy of runtime_cpp/), linked with its binding
    (runtime/coconet/cuda/bind.cu, compiled the same way once per runtime: its key is
    key_parts, which hash RUNTIME's headers) and its emulation library (_emulation_library).
    binding: (runtime, key_parts) to compile the binding and the library against instead (a copy
    edited only where the module's own code reads it). defines: NAME=VALUE macros for the module,
    its binding and its library (the runtime's compile-time switches, such as
    COCONET_EMULATE_SYM_THREADS: a binding and a library are compiled once for each set)."""
    def run(src: Path, build: Path, log: Log | None) -> None:
        bind_rt, bind_parts = binding or (runtime, key_parts)
        text = (bind_rt / "coconet" / "cuda" / "bind.cu").read_text()
        flags = [f"-D{d}" for d in defines]
        bind_cmd = [*_emulated_flags(bind_rt), *flags, *_python_includes(), "-x", "c++"]
        bound = artifacts.cached_object(_objects_dir(), artifacts.content_key([*bind_parts, *bind_cmd, text, "bind"]),
                                        ".cu", text, _compiled(bind_cmd, "compiling the emulation's Python binding "
                                                               "(once per machine)", log))
        library = _emulation_library(bind_rt, bind_parts, flags, log)
        build.mkdir(parents=True, exist_ok=True)
        # the installed runtime's headers precompiled (an edited copy's are not: GCC would take a
        # precompiled header found first on the path whatever the copy's headers say), and not
        # where a define changes what they declare
        pch = [f"-I{emulated_header(key_parts, log)}"] if runtime == runtime_dir() and not defines else []
        compiler, *options = _emulated_flags(runtime)  # the header's folder first on the include path
        cmd = [compiler, *pch, *options, *flags, "-shared", "-x", "c++",
               str(src / "module.cu"), "-x", "none", str(bound), *_runtime_link(library),
               *_blas(vector=False), "-Wl,-Bsymbolic-functions",
               "-o", str(build / f"{name}.so")]
        _steps([("compiling (host emulation)", cmd)], src / "module.cu", log, quiet=True)
    return run


def _emulation_library(runtime: Path, key_parts: list[str], flags: list[str], log: Log | None) -> Path:
    """The emulation library of RUNTIME with FLAGS (coconet/cuda/emulate.cpp: the emulation's
    functions and state, emulate_types.h's COCONET_EMU), libccnemu-<key>.so in the objects cache,
    compiled once per runtime and set of defines, as the binding is: every emulated module links
    it by run path, so a process holds one emulation whatever modules it loads."""
    text = (runtime / "coconet" / "cuda" / "emulate.cpp").read_text()
    return _library("libccnemu", "emulate.cpp", text, [*_emulated_flags(runtime), *flags, "-shared", "-x", "c++"],
                    key_parts, "compiling the host emulation (once per machine)", log)


def emulated_header(key_parts: list[str], log: Log | None) -> Path:
    """The folder of coconet/cuda/runtime.cuh precompiled for the host emulation (GCC's
    runtime.cuh.gch) with the emulation's options, once per machine (key_parts hash the runtime's
    headers): put first on the include path, it spares every emulated module parsing the
    emulation and the standard library (about a third of a small module's compile: sgd.ccn's
    3.6 s of compiler time become 2.4 s at -O0). A module compiled with other options finds the
    header itself (GCC skips a precompiled header that does not fit)."""
    cmd = [*_emulated_flags(runtime_dir()), "-Wno-pragma-once-outside-header"]
    header = runtime_dir() / "coconet" / "cuda" / "runtime.cuh"
    folder = _objects_dir() / f"pch-emulate-{artifacts.content_key([*key_parts, *cmd])}"

    def go(_: Path, out: Path) -> None:
        _steps([("precompiling the emulation (once per machine)",
                 [*cmd, "-c", "-x", "c++-header", str(header), "-o", str(out)])], header, log, quiet=True)
    artifacts.cached_object(folder / "coconet" / "cuda", "runtime.cuh", ".options", " ".join(cmd), go, product=".gch")
    return folder


def _emulated_flags(runtime: Path) -> list[str]:
    """mpicxx's options for the host emulation: -O1, the headers as a module includes them (the
    emulation's own functions declared only: COCONET_EMULATE_LINKS, emulate_types.h), then
    CXXFLAGS from the environment (as for a CPU module's units; the tests build at -O0)."""
    tc = toolchain()
    return [tc.mpicxx, "-std=c++17", "-O1", "-fPIC", "-pthread", "-DCOCONET_EMULATE", "-DCOCONET_EMULATE_LINKS",
            *(f"-D{d}" for d in tc.blas_defines), f"-I{runtime}",
            *shlex.split(os.environ.get("CXXFLAGS", ""))]
