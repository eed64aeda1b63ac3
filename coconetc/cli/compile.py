"""`coconetc compile`: build a file's module (CPU or CUDA), or only write its sources."""

from __future__ import annotations

import click

from coconetc.cli.files import fail, load_ccn, no_program, parse_label
from coconetc.cli.options import lib_kwargs, lib_options
from coconetc.errors import CompileError
from coconetc.plan.label import DEFAULT
from coconetc.sourcefile import SourceFile


@click.command()
@click.argument("file", type=click.Path())
@click.option("--output", "-o", type=click.Path(), help="Directory for the sources and the build.")
@click.option("--backend", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--arch", default=None, metavar="ARCHS",
              help="cuda: the CUDA architectures, as CMake takes them (default: COCONET_CUDA_ARCHS, else 80;90).")
@click.option("--emit-only", is_flag=True, help="Only write module.cpp and CMakeLists.txt to --output "
              "(no build; for CMake's coconet_add_module).")
@click.option("--name", help="With --emit-only: the Python module's name (default: ccn_<file stem>).")
@click.option("--schedule", "-s", "schedules", multiple=True, metavar="NAME",
              help="With --emit-only: keep only these schedules (repeatable; the program itself is always in).")
@lib_options
def compile(file: str, output: str | None, backend: str, arch: str | None, emit_only: bool,  # noqa: A001
            name: str | None, schedules: tuple[str, ...], include_dirs: tuple[str, ...],
            library_dirs: tuple[str, ...], libraries: tuple[str, ...]) -> None:
    """Generate C++ for every program and schedule of FILE and build the extension module.

    --emit-only: only write the sources of a module named --name (with the chosen schedules) to
    --output, for a build system to compile (CMake's coconet_add_module)."""
    mod = load_ccn(file)
    if not mod.programs:
        fail(no_program(mod))
    _COMPILES[backend](file, mod, output, arch, emit_only, name, schedules,
                       lib_kwargs(include_dirs, library_dirs, libraries))


def _compile_cpu(file: str, mod: SourceFile, output: str | None, arch: str | None, emit_only: bool,
                 name: str | None, schedules: tuple[str, ...], libs: dict) -> None:
    """compile (--backend cpu): the module coconetc.load builds, or with --emit-only its sources."""
    from coconetc.runtime.tuned import with_tuned
    from coconetc.toolchain import BuildError, Options
    from coconetc.toolchain import compile as compile_file
    if emit_only or name or schedules:
        _emit(mod, file, output, emit_only, name, schedules, libs)
        return
    try:  # the module coconetc.load builds: with the schedules the tuner chose for the file
        art = compile_file(with_tuned(mod), "cpu", Options(out_dir=output, **libs))
    except (BuildError, CompileError) as err:
        fail(str(err))
    _built(file, art)


def _built(file: str, art) -> None:
    click.echo(f"{file}: built {art.path}")
    for (prog, sched), fn in art.sources.functions.items():
        click.echo(f"  {prog}(schedule={sched!r}): {fn.name}")


def _compile_cuda(file: str, mod: SourceFile, output: str | None, arch: str | None, emit_only: bool,
                  name: str | None, schedules: tuple[str, ...], libs: dict) -> None:
    """compile --backend cuda: module.cu + CMakeLists.txt (nvcc, NCCL/cuBLAS from the wheels),
    built unless --emit-only. What the CUDA renderer does not implement yet is left out and
    named (coconetc check --backend cuda says where)."""
    from coconetc.codegen.cuda import problems
    from coconetc.toolchain import BuildError, Options
    from coconetc.toolchain import compile as compile_file
    if emit_only and not output:
        fail("coconetc: --emit-only needs --output DIR")
    try:
        art = compile_file(mod, "cuda", Options(out_dir=output, archs=arch, build=not emit_only, **libs))
    except (BuildError, CompileError) as err:
        fail(str(err))
    for (prog, sched), errs in problems(mod).items():
        click.echo(f"  left out: {prog}(schedule={sched!r}): {errs[0].what}", err=True)
    if emit_only:
        written = art.write_sources(output or ".")
        click.echo(f"{file}: wrote {written[0]} and CMakeLists.txt")
        return
    _built(file, art)


def _emit(mod: SourceFile, file: str, output, emit_only: bool, name, schedules, libs: dict) -> None:
    """compile --emit-only: the sources of a module named NAME, for a build the caller runs."""
    from dataclasses import replace

    from coconetc.toolchain import Options, module_stem
    from coconetc.toolchain import compile as compile_file
    if not emit_only or not output:
        fail("coconetc: --name and --schedule go with --emit-only, which needs --output DIR")
    name = name or f"ccn_{module_stem(file)}"
    if not name.isidentifier():
        fail(f"coconetc: --name {name!r} is not a valid Python module name")
    known = {s for scheds in mod.schedules.values() for s in scheds}
    schedules = tuple(parse_label(s).name for s in schedules)  # labels: the algorithm is a call's choice
    unknown = sorted(set(schedules) - known - {DEFAULT})  # the program itself is always in
    if unknown:
        fail(f"coconetc: no schedule '{unknown[0]}' in {file} "
              f"(schedules: {', '.join(sorted(known)) or 'none'})")
    if schedules:
        mod = replace(mod, schedules={p: {s: x for s, x in scheds.items() if s in schedules}
                                      for p, scheds in mod.schedules.items()})
    try:
        art = compile_file(mod, "cpu", Options(out_dir=output, build=False, name=name, **libs))
    except CompileError as err:
        fail(err.render())
    written = art.write_sources(output)
    click.echo(f"{file}: wrote {written[0]} (module {name})")
    for (prog, sched), fn in art.sources.functions.items():
        click.echo(f"  {prog}(schedule={sched!r}): {fn.name}")


_COMPILES = {"cpu": _compile_cpu, "cuda": _compile_cuda}  # by --backend
