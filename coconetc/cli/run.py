"""`coconetc run`: run a program's schedules on random inputs, on the interpreter or compiled
(CPU, CUDA, the CUDA host emulation) on R ranks, and compare with the interpreter."""

from __future__ import annotations

import sys
import traceback
from typing import Any

import click
import numpy as np

from coconetc.cli.files import (DEBUG, base_name, check_sizes, fail, load_ccn, parse_label, parse_sizes, pick_program,
                                with_grad)
from coconetc.cli.options import gpu_here, launch_ranks, lib_kwargs, lib_options, scalar_values, value_args
from coconetc.errors import CompileError
from coconetc.plan.label import DEFAULT
from coconetc.plan.targets import Target
from coconetc.sourcefile import SourceFile


def _schedule_names(mod: SourceFile, name: str, schedule: str | None) -> list[str | None]:
    """The labels -s names (None: the program itself; 'default' means it too, as in a call)."""
    if schedule is None:
        return [None]
    if schedule != "all":
        label = parse_label(schedule)
        if label.default:
            return [str(label) if label.algorithm else None]
        try:
            mod.schedule(name, label.name)
        except KeyError as err:
            fail(f"coconetc: {err.args[0]}")
        return [str(label)]
    if not mod.schedules[name]:
        click.echo(f"{name}: no schedules to run")
    return list(mod.schedules[name])


def _save_path(save: str, schedule: str | None, several: bool) -> str:
    """With several schedules, one file each: out.npz -> out.zero.npz."""
    if not several:
        return save
    stem, dot, ext = save.rpartition(".")
    return f"{stem}.{schedule}.{ext}" if dot and ext == "npz" else f"{save}.{schedule}"


@click.command()
@click.argument("file", type=click.Path())
@click.option("--ranks", "-n", type=click.IntRange(1), default=2, show_default=True)
@click.option("--program", "-p", help="The program (default: the file's only program).")
@click.option("--schedule", "-s", help="A schedule to run and check, or 'all'.")
@click.option("--size", "sizes", multiple=True, metavar="NAME=INT", help="A size symbol, e.g. N=4096.")
@click.option("--groups", "-g", type=click.IntRange(1), default=1, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random inputs.")
@click.option("--value", "values", multiple=True, metavar="NAME=NUMBER",
              help="A scalar parameter's value instead of a random one (e.g. a dropout probability of 0).")
@click.option("--save", type=click.Path(), help="Write every rank's inputs and results (.npz).")
@click.option("--interp", is_flag=True, help="Run on the reference interpreter (simulated ranks).")
@click.option("--backend", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="The backend whose module runs (cuda: on this node's GPUs, one rank a GPU; "
                   "with --emulate, on the CPU).")
@click.option("--emulate", is_flag=True,
              help="With --backend cuda: run the generated CUDA code under the host emulation "
                   "(streams as threads, NCCL on MPI, stream races detected).")
@click.option("--grad", is_flag=True, help="Run the program's derived (vector-Jacobian) program "
              "(docs/autodiff.md); -s names a `schedule s for grad(p)` of the file.")
@lib_options
def run(file, ranks, program, schedule, sizes, groups, seed, values, save, interp, backend, emulate, grad,
        include_dirs, library_dirs, libraries) -> None:
    """Run a program (and check a schedule against it) on random inputs.

    Compiled (the default): builds the module, launches R ranks with mpiexec, compares every
    rank's results with the interpreter and prints timings. --interp: simulated ranks only.
    --backend cuda: the CUDA module on the node's GPUs (torch CUDA tensors, NCCL), compared the
    same way; with --emulate, under the host emulation (no GPU needed)."""
    if ranks % groups:
        fail(f"coconetc: {ranks} ranks do not form {groups} equal groups")
    if emulate and (backend != "cuda" or interp):
        fail("coconetc: --emulate goes with --backend cuda (and not with --interp)")
    from coconetc.oracle.inputs import size_symbols
    mod = load_ccn(file)
    grad_of: list[str] = []
    if grad:
        mod, name = with_grad(mod, pick_program(mod, program, None))
        grad_of = [mod.derived[name]]
    else:
        name = pick_program(mod, program, schedule)
    sz = parse_sizes(sizes, size_symbols(mod.programs[name]))
    from coconetc.oracle.inputs import DEFAULT_SIZE
    check_sizes(mod.programs[name], sz, DEFAULT_SIZE)
    scalars = scalar_values(values, mod.programs[name])
    parsed = mod  # the file as read (what the ranks load), before any tuned schedule is added
    names = [None] if schedule == "auto" else _schedule_names(mod, name, schedule)
    # the records of the target the schedules run on (`coconetc tune --backend cuda [--emulate]`
    # measures the CUDA module's, whose choice may be a schedule the tuner wrote for it alone)
    target = "cpu" if interp else Target.named(backend, emulate)
    if schedule == "auto" or any(_auto(mod, name, s) for s in names):
        mod, names = _resolve_auto(mod, name, names, ranks, groups, sz, explicit=schedule == "auto",
                                   target=target)
    from coconetc.runtime.backends import backend as backend_of
    if interp or not backend_of(target).algorithms:  # a CPU algorithm choice ("zero@p2p") means nothing there
        names = list(dict.fromkeys(base_name(s) for s in names))
    if not interp:  # (each exits)
        libs = lib_kwargs(include_dirs, library_dirs, libraries)
        _RUNS[target](parsed, mod, name, ([None] if schedule == "all" else []) + names, ranks, groups, sz,
                      seed, save, target, libs, grad_of, scalars)
    bad = False
    for s in names:
        path = _save_path(save, s, len(names) > 1) if save else None
        bad |= _run_one(mod, name, s, ranks, groups, sz, seed, path, scalars)
    sys.exit(1 if bad else 0)


def _resolve_auto(mod: SourceFile, name: str, names: list, ranks: int, groups: int, sizes: dict,
                  explicit: bool, target: str = "cpu") -> tuple[SourceFile, list]:
    """run: `auto` (-s auto, or the file's `schedule auto for P` among -s all) becomes the
    tuner's choice for these sizes, ranks and groups on this machine and TARGET (the tuning
    cache), the choice's schedule added to the module when the tuner wrote it; with no record
    it is skipped (-s auto: an error) naming the tune command to run."""
    from coconetc.sourcefile import add_schedules
    from coconetc.oracle.inputs import DEFAULT_SIZE, size_symbols
    from coconetc.runtime.auto import choice
    full = {k: sizes.get(k, DEFAULT_SIZE) for k in size_symbols(mod.programs[name])}
    keep = [] if explicit else [s for s in names if not _auto(mod, name, s)]
    try:
        chosen = choice(mod.source, mod.file, name, full, ranks, groups, target)
    except ValueError as err:
        if explicit:
            fail(f"coconetc: {name} [auto]: {err}")
        click.echo(f"{name} [auto]: skipped: {err}")
        return mod, keep
    if chosen.text:  # "auto_x@p2p": the schedule auto_x, which the tuner wrote
        mod = add_schedules(mod, chosen.text)
    shown = ", ".join(f"{k}={v}" for k, v in full.items())
    click.echo(f"{name} [auto]: the tuner's choice for {shown} on {ranks} ranks: {chosen.label}")
    label = None if chosen.label == DEFAULT else chosen.label
    return mod, keep if label in keep else keep + [label]


def _auto(mod: SourceFile, name: str, label: str | None) -> bool:
    """The label names the file's `schedule auto for P` (the tuner chooses)."""
    base = base_name(label)
    return base is not None and mod.schedule(name, base).auto


def _run_cuda(parsed: SourceFile, mod: SourceFile, name, names, ranks, groups, sizes, seed, save,
              target: str, libs: dict, grad_of: list[str], values: dict) -> None:
    """run --backend cuda [--emulate]: build the CUDA module (for the host emulation, or with
    nvcc for the GPUs) here, from the file as read (PARSED, what the ranks load), then the
    worker on R ranks; what the CUDA backend does not implement is named and left out."""
    from coconetc.codegen.cuda import emulation_problems, problems
    from coconetc.runtime.backends import backend as backend_of
    from coconetc.toolchain import BuildError, compile
    emulate = backend_of(target).emulated
    if backend_of(target).gpu and not gpu_here():
        fail("coconetc: run --backend cuda: no CUDA device here (PyTorch with CUDA sees none); "
              "add --emulate to run the generated CUDA code on the CPU")
    from coconetc.runtime.tuned import with_tuned
    try:  # what the ranks load (runtime/cuda.py): the file with the schedules tuned for this target
        compile(with_tuned(parsed, target), target)
    except (BuildError, CompileError) as err:
        fail(str(err))
    skip = emulation_problems(mod) if emulate else {k: e[0].what for k, e in problems(mod).items()}
    keep = []
    for s in names:
        if _auto(mod, name, s):
            continue
        why = skip.get((name, s or DEFAULT))
        if why:
            click.echo(f"{name} [{s or 'default'}]: skipped: {why} (--backend cuda)")
        else:
            keep.append(s)
    if not keep:
        sys.exit(0)
    argv = ["-m", "coconetc.jobs.run", mod.file, "--program", name, "--groups", str(groups),
            "--seed", str(seed), "--emulate-cuda" if emulate else "--cuda",
            *[f"--size={k}={v}" for k, v in sizes.items()], *value_args(values)]
    argv += [f"--schedule={s or 'default'}" for s in keep] + [f"--grad-of={g}" for g in grad_of]
    if save:
        argv += ["--save", save]
    launch_ranks(ranks, argv)


def _run_compiled(parsed: SourceFile, mod: SourceFile, name, names, ranks, groups, sizes, seed, save,
                  target: str, libs: dict, grad_of: list[str], values: dict) -> None:
    """Build in this process (progress on stderr) the module the ranks load (the file as read,
    PARSED, with its tuned schedules), then run the worker on R ranks."""
    from coconetc.runtime.loader import compile_cpu
    from coconetc.toolchain import BuildError
    try:
        compile_cpu(parsed, **libs)
    except (BuildError, CompileError) as err:
        fail(str(err))
    argv = ["-m", "coconetc.jobs.run", mod.file, "--program", name, "--groups", str(groups),
            "--seed", str(seed), *[f"--size={k}={v}" for k, v in sizes.items()], *value_args(values)]
    argv += [f"--{flag}={v}" for flag, key in (("include-dir", "include_dirs"), ("library-dir", "library_dirs"),
                                             ("library", "libraries")) for v in libs[key]]
    argv += [f"--schedule={s or DEFAULT}" for s in names if not _auto(mod, name, s)]
    argv += [f"--grad-of={g}" for g in grad_of]
    if save:
        argv += ["--save", save]
    launch_ranks(ranks, argv)


_RUNS: dict[str, Any] = {Target.CPU: _run_compiled, Target.CUDA: _run_cuda, Target.EMULATED: _run_cuda}  # by target


def _run_one(mod, name, schedule, ranks, groups, sizes, seed, save, values: dict) -> bool:
    from coconetc.oracle.inputs import DEFAULT_SIZE, size_symbols
    from coconetc.oracle.interpreted import run_interp, save_npz
    if schedule is not None and mod.schedule(name, schedule).auto:
        click.echo(f"{name} [auto]: skipped (the autotuner chooses: coconetc tune, then show -s auto)")
        return False
    try:
        rep = run_interp(mod, name, schedule, ranks, groups, sizes, seed, values)
    except (KeyError, ValueError, TypeError, MemoryError) as err:
        if DEBUG["on"]:
            traceback.print_exc()
        fail(f"coconetc: {err.args[0] if err.args else type(err).__name__}")
    shown = ", ".join(f"{k}={sizes.get(k, DEFAULT_SIZE)}" for k in size_symbols(mod.programs[name]))
    label = f"{name}" + (f" [{schedule}]" if schedule else "")
    click.echo(f"{label}: {ranks} ranks, {groups} group(s), {shown}: interpreted in {rep.seconds * 1e3:.1f} ms")
    r0 = rep.results[0]
    for kind, vals in (("output", r0.outputs), ("updated", r0.updates)):
        for k, v in vals.items():
            click.echo(f"  rank 0 {kind} {k}: {v.dtype}{list(v.shape)} mean {np.mean(v.astype(np.float64)) if v.size else 0:.6g}")
    if save:
        save_npz(save, rep)
        click.echo(f"  saved {save}")
    if schedule is None:
        return False
    if rep.problems:
        click.echo("  MISMATCH against the unscheduled program:", err=True)
        for prob in rep.problems[:20]:
            click.echo(f"    {prob}", err=True)
        return True
    click.echo("  matches the unscheduled program on every rank")
    return False
