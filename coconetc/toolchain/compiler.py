"""`compile(source_file, backend, options) -> Artifact`: the one way from a checked .ccn file
(an already parsed SourceFile) to a built Python extension module, for every backend:

    cpu            C++ and MPI (codegen.cpu), built with CMake and mpicxx
    cuda           CUDA, NCCL, cuBLAS (codegen.cuda), built with CMake and nvcc
    cuda-emulated  the same module.cu compiled as C++ for the host emulation

A module is named `<prefix>_<file stem>_<key>`, the key a hash of the generated sources (under
a placeholder name), the options, the compiler (probes.py) and the tools, so a module is built
once per content (artifacts.py: cached, verified, written atomically)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from coconetc.codegen import cpu, cuda
from coconetc.codegen.extern_libs import Libs
from coconetc.errors import CompileError, Span
from coconetc.paths import runtime_dir
from coconetc.plan.targets import TARGETS, Target
from coconetc.sourcefile import SourceFile
from coconetc.toolchain import artifacts, commands
from coconetc.toolchain.probes import (BuildError, cache_dir, compiler_hash, cuda_hash, cuda_toolchain, headers_key,
                                       emulation_missing, require_cpu_extra, toolchain)

PROBE = "ccn_module_name_placeholder"  # the module's name while its key is computed


def _absolute(dirs) -> tuple[str, ...]:
    return tuple(str(Path(d).absolute()) for d in dirs)


@dataclass(frozen=True)
class Options:
    """How to compile. Every path is made absolute here, once (a relative path given on the
    command line means the same in CMake's build folder). out_dir: where the sources and the
    build go (None: the cache, COCONET_CACHE). name: the module's name (only with
    build=False, for a build system to compile; default: the hashed name). archs: CUDA
    architectures (default codegen.cuda.default_archs(): COCONET_CUDA_ARCHS or 80;90). include_dirs, library_dirs,
    libraries: for the file's extern operations (-I, -L, -l)."""

    out_dir: str | Path | None = None
    build: bool = True
    name: str | None = None
    archs: str | None = None
    include_dirs: tuple[str, ...] = ()
    library_dirs: tuple[str, ...] = ()
    libraries: tuple[str, ...] = ()
    log: Callable[[str], None] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalized once, at construction
        set_(self, "out_dir", None if self.out_dir is None else Path(self.out_dir).absolute())
        set_(self, "include_dirs", _absolute(self.include_dirs))
        set_(self, "library_dirs", _absolute(self.library_dirs))
        set_(self, "libraries", tuple(self.libraries))


@dataclass(frozen=True)
class Artifact:
    """A compiled file: the SourceFile, the generated sources (their `module` is the module's
    name, `functions` each (program, schedule)'s function), the folder and the built .so
    (None when not built)."""

    source_file: SourceFile
    backend: str
    sources: Any
    directory: Path | None
    path: Path | None

    @property
    def module(self) -> str:
        return self.sources.module

    def write_sources(self, out_dir: str | Path) -> list[Path]:
        """The module's sources written to OUT_DIR (for a build system to compile)."""
        out = Path(out_dir)
        files = _files(self.backend, self.sources)
        for name, text in files.items():
            artifacts.write_atomic(out / name, text)
        return [out / name for name in files]


def identifier(text: str) -> str:
    """TEXT as part of a Python module name: "my-model" -> "my_model"."""
    return "".join(c if c.isalnum() else "_" for c in text)


def module_stem(file: str | Path) -> str:
    """A file's stem as part of a Python module name: "my-model.ccn" -> "my_model"."""
    return identifier(Path(file).stem)


def _files(backend: str, src: Any) -> dict[str, str]:
    return WAYS[backend].files(src)


def _named(src: Any, name: str) -> Any:
    """The sources under the module's name instead of the placeholder (no second generation)."""
    fields = [k for k in ("table", "cu", "cmake") if hasattr(src, k)]  # a CPU unit never names its module
    return replace(src, module=name, **{k: getattr(src, k).replace(PROBE, name) for k in fields})


def compile(mod: SourceFile, backend: str = "cpu", options: Options | None = None) -> Artifact:  # noqa: A001
    """MOD's module for BACKEND: generated, and built unless options.build is False (cached
    by content; a cached module is checked before it is used and built again if it is not
    whole). Raises CompileError for the file, BuildError for the build."""
    o = options or Options()
    if backend not in TARGETS:
        raise ValueError(f"backend must be one of {', '.join(TARGETS)}, got {backend!r}")
    if o.name is not None and o.build:
        raise ValueError("Options.name goes with build=False (a built module is named by its key)")
    if not mod.programs:
        raise CompileError.at(Span(mod.file, 1, 1, 1, 1, mod.source), "no program in this file: nothing to compile")
    way = WAYS[backend]
    if way.cpu_extra and o.build:
        require_cpu_extra()
    libs = Libs.of(mod.file, bool(mod.externs), o.include_dirs, o.library_dirs, o.libraries)
    src = way.generate(mod, o, libs, o.name or PROBE)
    if not o.build:
        return Artifact(mod, backend, _named(src, o.name or f"{Target(backend).facts.prefix}_{module_stem(mod.file)}"),
                        None if o.out_dir is None else Path(o.out_dir), None)
    parts, libs_key = _compiler(backend, o), _libs_key(mod, backend, libs)  # once: the emulation's reads the runtime files it includes
    key = artifacts.content_key([*parts, *_files(backend, src).values(), libs_key])
    name = f"{Target(backend).facts.prefix}_{module_stem(mod.file)}_{key}"
    src = _named(src, name)
    return _build(mod, backend, src, o, way.command(name, src, parts, o, libs, libs_key))


def _compiler(backend: str, o: Options) -> list[str]:
    """What the key holds besides the sources: the compiler, the tools, the options."""
    return WAYS[backend].key(o)


def _emulated_key(o: Options) -> list[str]:
    why = emulation_missing()
    if why:
        raise BuildError(f"coconetc: cannot build the emulated CUDA module: {why}")
    return _emulated_parts(runtime_dir())


@dataclass(frozen=True)
class Way:
    """How the toolchain builds one target's module: its sources generated, the files written,
    what its cache key holds besides them (the compiler, the tools, the options), the build's
    commands, and the language of the extern operations' headers (None: none are built)."""

    generate: Callable[[SourceFile, Options, Libs, str], Any]
    files: Callable[[Any], dict[str, str]]
    key: Callable[[Options], list[str]]
    command: Callable[[str, Any, list[str], Options, Libs, str], artifacts.Run]
    externs: str | None
    cpu_extra: bool = False  # it links the CPU runtime's Python extra (mpi4py, ...)


def _archs(o: Options) -> str:
    return o.archs or cuda.default_archs()


WAYS: dict[str, Way] = {
    Target.CPU: Way(
        generate=lambda mod, o, libs, name: cpu.generate(mod, name, libs),
        files=lambda src: {"module.cpp": src.cpp, "CMakeLists.txt": src.cmake},
        key=lambda o: [compiler_hash(), *commands.cpu_key()],
        command=lambda name, src, parts, o, libs, libs_key: commands.cpu_units(name, src, libs, libs_key),
        externs="cpp", cpu_extra=True),
    Target.CUDA: Way(
        generate=lambda mod, o, libs, name: cuda.generate(mod, name, _archs(o), True, libs),
        files=lambda src: {"module.cu": src.cu, "CMakeLists.txt": src.cmake},
        key=lambda o: [cuda_hash(), f"cuda|{_archs(o)}|{os.environ.get('CUDAFLAGS', '')}", cuda_toolchain().key()],
        command=lambda name, src, parts, o, libs, libs_key: commands.cuda_module(name, parts, _archs(o), libs),
        externs="cuda"),
    Target.EMULATED: Way(
        generate=lambda mod, o, libs, name: cuda.generate(mod, name, skip_unsupported=True, emulate=True),
        files=lambda src: {"module.cu": src.cu},
        key=_emulated_key,
        command=lambda name, src, parts, o, libs, libs_key: commands.emulated(name, runtime_dir(), parts),
        externs=None),
}


# what an emulated module, its binding and its library include of the runtime (module.cu.j2's
# includes, the binding's and the library's sources themselves): their key holds these files and
# what they include, no other
EMULATED_INCLUDES = ('#include "coconet/cuda/runtime.cuh"\n#include "coconet/entries.h"\n#include "coconet/cuda/bind.cu"\n'
                     '#include "coconet/cuda/emulate.cpp"\n')


def _emulated_parts(runtime: Path) -> list[str]:
    return [headers_key(EMULATED_INCLUDES, runtime=runtime), toolchain().key(), f"emulate|{os.environ.get('CXXFLAGS', '')}"]


def _libs_key(mod: SourceFile, backend: str, libs: Libs) -> str:
    lang = WAYS[backend].externs
    if libs == Libs() or lang is None:
        return ""
    return libs.fingerprint(mod.extern_headers(lang))


def _build(mod: SourceFile, backend: str, src: Any, o: Options, run: artifacts.Run) -> Artifact:
    where = Path(o.out_dir) if o.out_dir else cache_dir().absolute() / src.module
    so = artifacts.build(src.module, _files(backend, src), where, run, o.log)
    return Artifact(mod, backend, src, where, so)


def build_emulated(cu: str, stem: str = "module", out_dir: str | Path | None = None,
                   runtime: str | Path | None = None, log=None, installed_binding: bool = False,
                   defines: tuple[str, ...] = ()) -> tuple[str, Path]:
    """A generated module.cu (its module named PROBE) built for the host emulation against
    RUNTIME (another copy of runtime_cpp/: tests edit it). installed_binding: link the binding
    and the emulation library compiled against the installed runtime (once per machine), not
    ones of RUNTIME's own, where RUNTIME's edits are to code only the module itself compiles
    (its templates; not a COCONET_EMU function, which the library holds). defines: NAME=VALUE
    macros for the module, its binding and its library (the runtime's compile-time switches:
    COCONET_EMULATE_SYM_THREADS),
    so that a variant is built once into the cache, as any module is. Returns (module name, .so
    path), cached by a hash of everything that goes in."""
    why = emulation_missing()
    if why:
        raise BuildError(f"coconetc: cannot build the emulated CUDA module: {why}")
    rt = Path(runtime).absolute() if runtime else runtime_dir()
    parts = _emulated_parts(rt)
    binding = (runtime_dir(), _emulated_parts(runtime_dir())) if installed_binding else None
    key = artifacts.content_key([*parts, cu, *(binding[1] if binding else []), *defines])
    name = f"{Target.EMULATED.facts.prefix}_{identifier(stem)}_{key}"
    where = Path(out_dir).absolute() if out_dir else cache_dir().absolute() / name
    so = artifacts.build(name, {"module.cu": cu.replace(PROBE, name)}, where,
                         commands.emulated(name, rt, parts, binding, defines), log)
    return name, so


def runtime(log=None) -> list[Path]:
    """The compiled part of the CPU runtime (the Python binding, the runtime's instantiations),
    compiled now if it is not yet (once per machine: every later module only links it). For a
    test session or a benchmark that times module builds."""
    require_cpu_extra()
    return commands.cpu_runtime(log)
