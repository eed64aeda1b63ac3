"""The coconetc command: check, show, run, compile, launch, tune, explain. User errors print as diagnostics, without a
Python traceback (--debug shows it)."""

from __future__ import annotations

import math
import sys
from typing import NoReturn
import traceback

import click
import numpy as np

from coconetc.plan.label import DEFAULT, ScheduleLabel, parse
from coconetc.plan.targets import Target
from coconetc.sourcefile import SourceFile, load_file
from coconetc.ir.limits import INT64_MAX, too_big
from coconetc.errors import CompileError, Span

_DEBUG = {"on": False}


def _fail(message: str) -> NoReturn:
    click.echo(message, err=True)
    sys.exit(1)


def _launch(ranks: int, argv: list[str], **hosts) -> NoReturn:
    """Runs `python ARGV` on R ranks (launch.mpiexec.run_python) and exits with its code; an
    mpiexec that cannot be started is an error message, not a traceback."""
    from coconetc.launch.mpiexec import run_python
    try:
        code = run_python(ranks, argv, **hosts)
    except (RuntimeError, OSError) as err:
        _fail(f"coconetc: could not start {ranks} ranks: {err}")
    sys.exit(code)


def _load(path: str) -> SourceFile:
    try:
        return load_file(path)
    except CompileError as err:
        if _DEBUG["on"]:
            traceback.print_exc()
        _fail(err.render())
    except OSError as err:
        _fail(f"coconetc: cannot read {path}: {err.strerror}")
    raise AssertionError


def _no_program(mod: SourceFile) -> str:
    return CompileError.at(Span(mod.file, 1, 1, 1, 1, mod.source),
                           "no program in this file: nothing to check, run or compile").render()


def _with_grad(mod: SourceFile, name: str) -> tuple[SourceFile, str]:
    """--grad: the file with NAME's derived programs, and the name of its derived program."""
    from coconetc.sourcefile import grad_name, with_grads
    if name in mod.derived:
        _fail(f"coconetc: '{name}' is a derived program already; use --grad -p {mod.derived[name]}")
    try:
        return with_grads(mod, [name]), grad_name(name)
    except CompileError as err:
        _fail(err.render())
    raise AssertionError


def _pick_program(mod: SourceFile, program: str | None, schedule: str | None) -> str:
    if not mod.programs:
        _fail(_no_program(mod))
    if program is None and schedule not in (None, "all") and len(mod.programs) > 1:
        owners = [p for p, s in mod.schedules.items() if _label(schedule).name in s]
        if len(owners) == 1:
            return owners[0]
    try:
        return mod.program(program).name
    except KeyError as err:
        _fail(f"coconetc: {err.args[0]}")
    raise AssertionError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show Python tracebacks for errors.")
@click.version_option(package_name="coconet")
def main(debug: bool) -> None:
    """coconet: compile distributed ML programs with checked schedules."""
    _DEBUG["on"] = debug


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path())
@click.option("--backend", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="The backend whose limits to check (the plan's limits hold for every backend; "
                   "and each plan says which of its units a backend does not implement yet).")
def check(files: tuple[str, ...], backend: str) -> None:
    """Parse and type-check FILES, apply every schedule and plan it; print all errors.

    What this accepts, the backend runs: a schedule no backend can run as asked is reported
    here, at its directive's line and column."""
    failed = False
    for f in files:
        try:
            mod = load_file(f)
        except CompileError as err:
            if _DEBUG["on"]:
                traceback.print_exc()
            click.echo(err.render(), err=True)
            failed = True
            continue
        except OSError as err:
            click.echo(f"coconetc: cannot read {f}: {err.strerror}", err=True)
            failed = True
            continue
        if not mod.programs:
            click.echo(_no_program(mod), err=True)
            failed = True
            continue
        if _target_problems(mod, backend):
            failed = True
            continue
        n = sum(len(s) for s in mod.schedules.values())
        click.echo(f"{f}: ok ({len(mod.programs)} programs: {', '.join(mod.programs)}; {n} schedules)")
    sys.exit(1 if failed else 0)


def _target_problems(mod: SourceFile, backend: str) -> bool:
    """check --backend X: each plan unit X does not implement (the plan's decision, which X's
    generator reads too), located at the directive that asked for it (or the stage)."""
    from coconetc.plan.targets import diagnostics
    found = [d for key in mod.variants() for d in diagnostics(mod.plans[key], backend)]
    if found:
        click.echo(CompileError(found).render(), err=True)
    return bool(found)


def _records_options(what: str):
    """--backend and --emulate of show and explain: the target whose tuning records they read."""
    def wrap(f):
        f = click.option("--emulate", is_flag=True,
                         help="With --backend cuda: the records `coconetc tune --backend cuda --emulate` "
                              "measured under the host emulation.")(f)
        return click.option("--backend", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
                            help=f"The backend whose tuning records to read: {what}.")(f)
    return wrap


@main.command()
@click.argument("file", type=click.Path())
@click.option("--program", "-p", help="The program (default: the file's only program).")
@click.option("--schedule", "-s", help="Show the program after this schedule.")
@click.option("--format", "fmt", type=click.Choice(["text", "dot", "plan"]), default="text")
@click.option("--grad", is_flag=True, help="Show the program's derived vector-Jacobian program (docs/autodiff.md).")
@click.option("--wrt", help="With --grad: the inputs to differentiate, comma-separated (default: every "
              "floating tensor parameter).")
@_records_options("-s auto shows the choice of the records measured on that backend (the plan "
                  "itself is every backend's)")
def show(file: str, program: str | None, schedule: str | None, fmt: str, grad: bool, wrt: str | None,
         backend: str, emulate: bool) -> None:
    """Print a program's IR as .ccn text, its stage graph as Graphviz dot, or its execution
    plan (what every backend runs: buffers, then one unit a line with its .ccn line)."""
    from coconetc.ir import printer
    target = _checked_target("show", backend, emulate, "read the records measured under the host emulation")
    mod = _load(file)
    if grad or wrt is not None:
        _show_grad(mod, _pick_program(mod, program, None), schedule, fmt, wrt)
        return
    name = _pick_program(mod, program, schedule)
    ir = mod.programs[name]
    if schedule == "auto":  # with or without `schedule auto for P` in the file
        _show_auto(mod, name, fmt, target)
        return
    label = _label(schedule) if schedule else parse(None)  # -s zero@p2p: the schedule zero
    if not label.default:
        try:
            sched = mod.schedule(name, label.name)
        except KeyError as err:
            _fail(f"coconetc: {err.args[0]}")
        if sched.ir is None:
            _show_auto(mod, name, fmt, target)
            return
        ir = sched.ir
    if fmt == "plan":
        from coconetc.plan.show import show as show_plan
        click.echo(show_plan(mod.plans[(name, label.name)]), nl=False)
        return
    click.echo(printer.dot(ir) if fmt == "dot" else printer.program(ir), nl=False)


def _show_grad(mod: SourceFile, name: str, schedule: str | None, fmt: str, wrt: str | None) -> None:
    """show --grad: the derived program of the program (text, dot or plan), under one of the
    file's `schedule s for grad(p)` with -s; what the forward saves as a comment."""
    from coconetc.autodiff.saved import split
    from coconetc.autodiff.text import unfaithful_sites
    from coconetc.autodiff.vjp import recomputed
    from coconetc.ir import printer
    from coconetc.sourcefile import grad_name
    if name in mod.derived:
        _fail(f"coconetc: '{name}' is a derived program already; show --grad -p {mod.derived[name]}")
    ir, plan, full = _derived(mod, name, schedule, fmt, wrt)
    if fmt == "plan":
        from coconetc.plan.show import show as show_plan
        assert plan is not None
        click.echo(show_plan(plan), nl=False)
        return
    bad = unfaithful_sites(ir)
    if bad and fmt == "text":
        _fail("coconetc: the derived program reuses the forward's dropout masks, which .ccn text cannot say yet "
              f"(the RNG site of a dropout is its stage's name): {'; '.join(bad)} (--format dot or plan shows it)")
    if fmt == "dot":
        click.echo(printer.dot(ir), nl=False)
        return
    if full is not None:
        cut = split(mod.programs[name], full.programs[grad_name(name)])  # the cut of the unscheduled one
        click.echo(f"# saved by the forward ({name}_fwd returns them): {', '.join(cut.saved) or 'none'}; "
                   f"recomputed by the backward ({name}_bwd): {', '.join(cut.recomputed) or 'none'}")
    else:
        click.echo(f"# the forward values the backward reads: {', '.join(recomputed(ir, mod.programs[name])) or 'none'}")
    click.echo(printer.program(ir), nl=False)


def _derived(mod: SourceFile, name: str, schedule: str | None, fmt: str, wrt: str | None):
    """show --grad's program: (the derived IR, its plan, the file with its derived programs;
    the last two None with --wrt, which derives with respect to some inputs only)."""
    from coconetc.autodiff.vjp import vjp
    from coconetc.sourcefile import grad_name, with_grads
    try:
        if wrt is not None:
            if schedule is not None or fmt == "plan":
                _fail("coconetc: show --grad --wrt derives with respect to some inputs only; the file's "
                      "derived program (its schedules and plans) is with respect to every floating tensor "
                      "input: drop --wrt")
            return vjp(mod.programs[name], [w.strip() for w in wrt.split(",") if w.strip()]), None, None
        full, gname = with_grads(mod, [name]), grad_name(name)
        label = _label(schedule) if schedule else parse(None)
        if label.default:
            return full.programs[gname], full.plans[(gname, DEFAULT)], full
        try:
            scheduled = full.schedule(gname, label.name).ir
        except KeyError as err:
            _fail(f"coconetc: {err.args[0]} (write one as `schedule {label.name} for grad({name}) {{ ... }}`)")
        if scheduled is None:
            _fail(f"coconetc: schedule auto for grad({name}): the autotuner chooses (coconetc tune)")
        return scheduled, full.plans[(gname, label.name)], full
    except CompileError as err:
        _fail(err.render())
    raise AssertionError


def _show_auto(mod: SourceFile, name: str, fmt: str, target: str = "cpu") -> None:
    """show -s auto: the autotuner's newest choice for the program on this machine's TARGET (the
    records `coconetc tune` measured there), as the schedule block (text), its plan or its
    stage graph."""
    from coconetc.sourcefile import add_schedules
    from coconetc.ir import printer
    from coconetc.oracle.inputs import size_symbols
    from coconetc.runtime import tuned as cache
    recs = cache.records(mod.source, name, target)
    if not recs:
        cmd = cache.tune_command(mod.file, name, "R", dict.fromkeys(size_symbols(mod.programs[name]), "INT"), target)
        _fail(f"coconetc: the autotuner has no choice for '{name}' in {mod.file}{cache.MEASURED_ON[target]}; "
              f"run `{cmd}` first")
    rec = recs[-1]
    choice, text = rec["choice"], rec["schedules"].get(rec["choice"], "")
    label = parse(choice).name  # "zero@p2p": zero, with point-to-point fused collectives
    if text:
        mod = add_schedules(mod, text)
    if fmt == "plan":
        from coconetc.plan.show import show as show_plan
        click.echo(show_plan(mod.plans[(name, label)]), nl=False)
        return
    ir = mod.programs[name] if label == "default" else mod.schedule(name, label).ir
    if fmt == "dot":
        assert ir is not None
        click.echo(printer.dot(ir), nl=False)
        return
    shown = ", ".join(f"{k}={v}" for k, v in rec["sizes"].items())
    click.echo(f"# schedule auto for {name}: the tuner's choice for {shown} on {rec['ranks']} ranks"
               f"{cache.MEASURED_ON[target]} ({rec['measured'][choice] * 1e3:.3f} ms): {choice}"
               + (" (its fused collectives point-to-point: call it as schedule=" + repr(choice) + ")"
                  if choice != label else ""))
    click.echo(text or f"# (the program itself, unscheduled)\n{printer.program(mod.programs[name])}", nl=False)


def _sizes(items: tuple[str, ...], known: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        if not value.isdigit() or not name.isidentifier():
            _fail(f"coconetc: --size takes NAME=INT, got {item!r}")
        if name not in known:
            _fail(f"coconetc: --size {item}: the program has no size symbol '{name}' "
                  f"(size symbols: {', '.join(known) or 'none'})")
        out[name] = int(value)
        if out[name] > INT64_MAX:
            _fail(f"coconetc: --size {item}: a size must fit int64 (at most {INT64_MAX})")
    return out


def _check_sizes(p, sizes: dict[str, int], default: int) -> None:
    """Every tensor of the program, at these sizes, fits int64 in elements and bytes; else a
    located error at the parameter or stage that does not."""
    from coconetc.oracle.inputs import size_symbols
    from coconetc.ir.types import eval_dim
    env = {s: sizes.get(s, default) for s in size_symbols(p)}
    shown = ", ".join(f"{k}={v}" for k, v in env.items())
    for item in (*p.params, *p.stages):
        t = item.type
        if not t.shape:
            continue
        big = too_big((eval_dim(d, env) for d in t.shape), t.dtype)
        if big:
            _fail(CompileError.at(item.span, f"with {shown}, '{item.name}' ({t}) is too large: "
                                  f"{big}").render())


def _label(schedule: str) -> ScheduleLabel:
    """A schedule label as given (-s zero, -s zero@p2p, -s default), parsed once."""
    try:
        return parse(schedule)
    except (TypeError, ValueError) as err:
        _fail(f"coconetc: {err}")
    raise AssertionError


def _base(label: str | None) -> str | None:
    """The schedule a label runs, None for the program itself ("default")."""
    name = None if label is None else parse(label).name
    return None if name == DEFAULT else name


def _schedule_names(mod: SourceFile, name: str, schedule: str | None) -> list[str | None]:
    """The labels -s names (None: the program itself; 'default' means it too, as in a call)."""
    if schedule is None:
        return [None]
    if schedule != "all":
        label = _label(schedule)
        if label.default:
            return [str(label) if label.algorithm else None]
        try:
            mod.schedule(name, label.name)
        except KeyError as err:
            _fail(f"coconetc: {err.args[0]}")
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


def _lib_options(f):
    """-I, -L, -l: what the file's extern operations need to build (docs/language.md)."""
    f = click.option("-l", "libraries", multiple=True, metavar="LIB",
                     help="Link this library (extern operations; repeatable).")(f)
    f = click.option("-L", "library_dirs", multiple=True, metavar="DIR",
                     help="Search DIR for libraries (extern operations; repeatable).")(f)
    return click.option("-I", "include_dirs", multiple=True, metavar="DIR",
                        help="Search DIR for extern operations' headers (repeatable; the .ccn "
                        "file's directory is searched too).")(f)


def _libs(include_dirs, library_dirs, libraries) -> dict:
    return dict(include_dirs=include_dirs, library_dirs=library_dirs, libraries=libraries)


@main.command()
@click.argument("file", type=click.Path())
@click.option("--ranks", "-n", type=click.IntRange(1), default=2, show_default=True)
@click.option("--program", "-p", help="The program (default: the file's only program).")
@click.option("--schedule", "-s", help="A schedule to run and check, or 'all'.")
@click.option("--size", "sizes", multiple=True, metavar="NAME=INT", help="A size symbol, e.g. N=4096.")
@click.option("--groups", "-g", type=click.IntRange(1), default=1, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random inputs.")
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
@_lib_options
def run(file, ranks, program, schedule, sizes, groups, seed, save, interp, backend, emulate, grad, include_dirs,
        library_dirs, libraries) -> None:
    """Run a program (and check a schedule against it) on random inputs.

    Compiled (the default): builds the module, launches R ranks with mpiexec, compares every
    rank's results with the interpreter and prints timings. --interp: simulated ranks only.
    --backend cuda: the CUDA module on the node's GPUs (torch CUDA tensors, NCCL), compared the
    same way; with --emulate, under the host emulation (no GPU needed)."""
    if ranks % groups:
        _fail(f"coconetc: {ranks} ranks do not form {groups} equal groups")
    if emulate and (backend != "cuda" or interp):
        _fail("coconetc: --emulate goes with --backend cuda (and not with --interp)")
    from coconetc.oracle.inputs import size_symbols
    mod = _load(file)
    grad_of: list[str] = []
    if grad:
        mod, name = _with_grad(mod, _pick_program(mod, program, None))
        grad_of = [mod.derived[name]]
    else:
        name = _pick_program(mod, program, schedule)
    sz = _sizes(sizes, size_symbols(mod.programs[name]))
    from coconetc.oracle.inputs import DEFAULT_SIZE
    _check_sizes(mod.programs[name], sz, DEFAULT_SIZE)
    parsed = mod  # the file as read (what the ranks load), before any tuned schedule is added
    names = [None] if schedule == "auto" else _schedule_names(mod, name, schedule)
    # the records of the target the schedules run on (`coconetc tune --backend cuda [--emulate]`
    # measures the CUDA module's, whose choice may be a schedule the tuner wrote for it alone)
    target = "cpu" if interp else _target(backend, emulate)
    if schedule == "auto" or any(_auto(mod, name, s) for s in names):
        mod, names = _resolve_auto(mod, name, names, ranks, groups, sz, explicit=schedule == "auto",
                                   target=target)
    if interp or backend == "cuda":  # a CPU algorithm choice ("zero@p2p") means nothing there
        names = list(dict.fromkeys(_base(s) for s in names))
    if backend == "cuda" and not interp:
        _run_cuda(parsed, mod, name, ([None] if schedule == "all" else []) + names, ranks, groups, sz, seed,
                  save, emulate, grad_of)
    if not interp:
        libs = _libs(include_dirs, library_dirs, libraries)
        _run_compiled(parsed, mod, name, ([None] if schedule == "all" else []) + names, ranks, groups, sz,
                      seed, save, libs, grad_of)
    bad = False
    for s in names:
        path = _save_path(save, s, len(names) > 1) if save else None
        bad |= _run_one(mod, name, s, ranks, groups, sz, seed, path)
    sys.exit(1 if bad else 0)


def _resolve_auto(mod: SourceFile, name: str, names: list, ranks: int, groups: int, sizes: dict,
                  explicit: bool, target: str = "cpu") -> tuple[SourceFile, list]:
    """run: `auto` (-s auto, or the file's `schedule auto for P` among -s all) becomes the
    tuner's choice for these sizes, ranks and groups on this machine and TARGET (the tuning
    cache), the choice's schedule added to the module when the tuner wrote it; with no record
    it is skipped (-s auto: an error) naming the tune command to run."""
    from coconetc.sourcefile import add_schedules
    from coconetc.oracle.inputs import DEFAULT_SIZE, size_symbols
    from coconetc.runtime import tuned as cache
    full = {k: sizes.get(k, DEFAULT_SIZE) for k in size_symbols(mod.programs[name])}
    rec = cache.lookup(mod.source, name, full, ranks, groups, target)
    shown = ", ".join(f"{k}={v}" for k, v in full.items())
    keep = [] if explicit else [s for s in names if not _auto(mod, name, s)]
    if rec is None:
        what = (f"no tuning record for {shown} on {ranks} ranks"
                + (f" in {groups} groups" if groups > 1 else "") + f"{cache.MEASURED_ON[target]}; run "
                f"`{cache.tune_command(mod.file, name, ranks, full, target)}` first")
        if explicit:
            _fail(f"coconetc: {name} [auto]: {what}")
        click.echo(f"{name} [auto]: skipped: {what}")
        return mod, keep
    label, text = rec["choice"], rec["schedules"].get(rec["choice"], "")
    if label in rec.get("generated", []) and text:  # "auto_x@p2p": the schedule auto_x
        mod = add_schedules(mod, text)
    click.echo(f"{name} [auto]: the tuner's choice for {shown} on {ranks} ranks: {label}")
    chosen = None if label == DEFAULT else label
    return mod, keep if chosen in keep else keep + [chosen]


def _auto(mod: SourceFile, name: str, label: str | None) -> bool:
    """The label names the file's `schedule auto for P` (the tuner chooses)."""
    base = _base(label)
    return base is not None and mod.schedule(name, base).auto


def _run_cuda(parsed: SourceFile, mod: SourceFile, name, names, ranks, groups, sizes, seed, save,
              emulate: bool, grad_of: list[str]) -> None:
    """run --backend cuda [--emulate]: build the CUDA module (for the host emulation, or with
    nvcc for the GPUs) here, from the file as read (PARSED, what the ranks load), then the
    worker on R ranks; what the CUDA backend does not implement is named and left out."""
    from coconetc.codegen.cuda import emulation_problems, problems
    from coconetc.toolchain import BuildError, compile
    if not emulate and not _gpu_here():
        _fail("coconetc: run --backend cuda: no CUDA device here (PyTorch with CUDA sees none); "
              "add --emulate to run the generated CUDA code on the CPU")
    from coconetc.runtime.tuned import with_tuned
    target = _target("cuda", emulate)
    try:  # what the ranks load (runtime/cuda.py): the file with the schedules tuned for this target
        compile(with_tuned(parsed, target), target)
    except (BuildError, CompileError) as err:
        _fail(str(err))
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
            *[f"--size={k}={v}" for k, v in sizes.items()]]
    argv += [f"--schedule={s or 'default'}" for s in keep] + [f"--grad-of={g}" for g in grad_of]
    if save:
        argv += ["--save", save]
    _launch(ranks, argv)


def _target(backend: str, emulate: bool) -> str:
    """The toolchain's target of --backend and --emulate: cpu, cuda or cuda-emulated."""
    return Target.CPU if backend != "cuda" else Target.EMULATED if emulate else Target.CUDA


def _checked_target(command: str, backend: str, emulate: bool, emulated: str) -> str:
    """_target, after the checks every command taking --backend/--emulate makes: --emulate only
    with --backend cuda, and --backend cuda alone only where PyTorch sees a GPU (a GPU's
    records are keyed by its name); EMULATED says what --emulate would do instead."""
    if emulate and backend != "cuda":
        _fail("coconetc: --emulate goes with --backend cuda")
    if backend == "cuda" and not emulate and not _gpu_here():
        _fail(f"coconetc: {command} --backend cuda: no CUDA device here (PyTorch with CUDA sees none); "
              f"add --emulate to {emulated}")
    return _target(backend, emulate)


def _gpu_here() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _run_compiled(parsed: SourceFile, mod: SourceFile, name, names, ranks, groups, sizes, seed, save,
                  libs: dict, grad_of: list[str]) -> None:
    """Build in this process (progress on stderr) the module the ranks load (the file as read,
    PARSED, with its tuned schedules), then run the worker on R ranks."""
    from coconetc.runtime.loader import compile_cpu
    from coconetc.toolchain import BuildError
    try:
        compile_cpu(parsed, **libs)
    except (BuildError, CompileError) as err:
        _fail(str(err))
    argv = ["-m", "coconetc.jobs.run", mod.file, "--program", name, "--groups", str(groups),
            "--seed", str(seed), *[f"--size={k}={v}" for k, v in sizes.items()]]
    argv += [f"--{flag}={v}" for flag, key in (("include-dir", "include_dirs"), ("library-dir", "library_dirs"),
                                             ("library", "libraries")) for v in libs[key]]
    argv += [f"--schedule={s or DEFAULT}" for s in names if not _auto(mod, name, s)]
    argv += [f"--grad-of={g}" for g in grad_of]
    if save:
        argv += ["--save", save]
    _launch(ranks, argv)


@main.command()
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
@_lib_options
def compile(file: str, output: str | None, backend: str, arch: str | None, emit_only: bool,  # noqa: A001
            name: str | None, schedules: tuple[str, ...], include_dirs: tuple[str, ...],
            library_dirs: tuple[str, ...], libraries: tuple[str, ...]) -> None:
    """Generate C++ for every program and schedule of FILE and build the extension module.

    --emit-only: only write the sources of a module named --name (with the chosen schedules) to
    --output, for a build system to compile (CMake's coconet_add_module)."""
    from coconetc.runtime.tuned import with_tuned
    from coconetc.toolchain import BuildError, Options
    from coconetc.toolchain import compile as compile_file
    mod = _load(file)
    if not mod.programs:
        _fail(_no_program(mod))
    libs = _libs(include_dirs, library_dirs, libraries)
    if backend == "cuda":
        _compile_cuda(file, mod, output, arch, emit_only, libs)
        return
    if emit_only or name or schedules:
        _emit(mod, file, output, emit_only, name, schedules, libs)
        return
    try:  # the module coconetc.load builds: with the schedules the tuner chose for the file
        art = compile_file(with_tuned(mod), "cpu", Options(out_dir=output, **libs))
    except (BuildError, CompileError) as err:
        _fail(str(err))
    _built(file, art)


def _built(file: str, art) -> None:
    click.echo(f"{file}: built {art.path}")
    for (prog, sched), fn in art.sources.functions.items():
        click.echo(f"  {prog}(schedule={sched!r}): {fn.name}")


def _compile_cuda(file: str, mod: SourceFile, output: str | None, arch: str | None, emit_only: bool,
                  libs: dict) -> None:
    """compile --backend cuda: module.cu + CMakeLists.txt (nvcc, NCCL/cuBLAS from the wheels),
    built unless --emit-only. What the CUDA renderer does not implement yet is left out and
    named (coconetc check --backend cuda says where)."""
    from coconetc.codegen.cuda import problems
    from coconetc.toolchain import BuildError, Options
    from coconetc.toolchain import compile as compile_file
    if emit_only and not output:
        _fail("coconetc: --emit-only needs --output DIR")
    try:
        art = compile_file(mod, "cuda", Options(out_dir=output, archs=arch, build=not emit_only, **libs))
    except (BuildError, CompileError) as err:
        _fail(str(err))
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
        _fail("coconetc: --name and --schedule go with --emit-only, which needs --output DIR")
    name = name or f"ccn_{module_stem(file)}"
    if not name.isidentifier():
        _fail(f"coconetc: --name {name!r} is not a valid Python module name")
    known = {s for scheds in mod.schedules.values() for s in scheds}
    schedules = tuple(_label(s).name for s in schedules)  # labels: the algorithm is a call's choice
    unknown = sorted(set(schedules) - known - {DEFAULT})  # the program itself is always in
    if unknown:
        _fail(f"coconetc: no schedule '{unknown[0]}' in {file} "
              f"(schedules: {', '.join(sorted(known)) or 'none'})")
    if schedules:
        mod = replace(mod, schedules={p: {s: x for s, x in scheds.items() if s in schedules}
                                      for p, scheds in mod.schedules.items()})
    try:
        art = compile_file(mod, "cpu", Options(out_dir=output, build=False, name=name, **libs))
    except CompileError as err:
        _fail(err.render())
    written = art.write_sources(output)
    click.echo(f"{file}: wrote {written[0]} (module {name})")
    for (prog, sched), fn in art.sources.functions.items():
        click.echo(f"  {prog}(schedule={sched!r}): {fn.name}")


def _run_one(mod, name, schedule, ranks, groups, sizes, seed, save) -> bool:
    from coconetc.oracle.inputs import DEFAULT_SIZE, size_symbols
    from coconetc.oracle.interpreted import run_interp, save_npz
    if schedule is not None and mod.schedule(name, schedule).auto:
        click.echo(f"{name} [auto]: skipped (the autotuner chooses: coconetc tune, then show -s auto)")
        return False
    try:
        rep = run_interp(mod, name, schedule, ranks, groups, sizes, seed)
    except (KeyError, ValueError, TypeError, MemoryError) as err:
        if _DEBUG["on"]:
            traceback.print_exc()
        _fail(f"coconetc: {err.args[0] if err.args else type(err).__name__}")
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


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--ranks", "-n", type=click.IntRange(1), default=2, show_default=True)
@click.option("--hostfile", type=click.Path(exists=True, dir_okay=False),
              help="Run the ranks on the hosts this file lists (mpiexec's hostfile; docs/cluster.md).")
@click.option("--host", "hosts", metavar="H1,H2",
              help="Run the ranks on these hosts (comma-separated, HOST:SLOTS allowed; mpiexec's --host).")
@click.argument("script")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def launch(ranks: int, hostfile: str | None, hosts: str | None, script: str, args: tuple[str, ...]) -> None:
    """Run `python SCRIPT ARGS...` on R MPI ranks (the mpiexec installed beside Python, with the
    flags Open MPI needs as root or with more ranks than cores), e.g. a training script that
    uses coconetc.torch.DistributedOptimizer; on this machine, or on the hosts of --hostfile /
    --host (the script and Python at the same path on every host). Exits non-zero if any rank
    failed. A leading `python` (`coconetc launch -n 2 python train.py`, as with mpiexec) is
    accepted: the script runs under this Python either way."""
    import re
    from pathlib import Path

    if args and re.fullmatch(r"python[0-9.]*", Path(script).name):  # an interpreter, not a script
        script, args = args[0], args[1:]
    if not Path(script).exists():
        raise click.BadParameter(f"File {script!r} does not exist.", param_hint="'SCRIPT'")
    if not Path(script).is_file():
        raise click.BadParameter(f"File {script!r} is a directory.", param_hint="'SCRIPT'")
    if hosts is not None and not all(h.strip() for h in hosts.split(",")):
        _fail(f"coconetc: launch --host {hosts!r}: an empty host name (write H1,H2 or H1:SLOTS,H2:SLOTS)")
    _launch(ranks, [script, *args], hostfile=hostfile, hosts=hosts)


@main.command()
@click.argument("file", type=click.Path())
@click.option("--ranks", "-n", type=click.IntRange(1), default=2, show_default=True)
@click.option("--program", "-p", help="The program (default: the file's only program).")
@click.option("--size", "sizes", multiple=True, metavar="NAME=INT", help="Every size symbol, e.g. N=4194304.")
@click.option("--reps", type=click.IntRange(1), default=5, show_default=True,
              help="Timed calls per schedule (after one warm-up); the median counts.")
@click.option("--keep", type=float, default=None,
              help="Measure a generated schedule only if its modelled time is at most KEEP x the best "
                   "(default: 2 on the CPU; on CUDA every one: the cost model is the CPU backend's).")
@click.option("--json", "json_path", type=click.Path(), help="Write the measurements and the choice here.")
@click.option("--backend", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="The backend whose module is measured (cuda: on this node's GPUs, one rank a GPU; "
                   "with --emulate, under the host emulation). schedule=\"auto\" reads the choice "
                   "on the backend that measured it.")
@click.option("--emulate", is_flag=True,
              help="With --backend cuda: measure the generated CUDA code under the host emulation "
                   "(the path, not a GPU's times; its choice serves COCONET_CUDA_EMULATE=1).")
def tune(file, ranks, program, sizes, reps, keep, json_path, backend, emulate) -> None:
    """Choose the fastest schedule of a program at these sizes on R ranks (schedule="auto").

    Measures the file's schedules and the ones the tuner writes itself (split, reorder, slice,
    fuse, overlap), pruned with the cost model, checks the winner against the interpreter and
    stores it in the tuning cache (docs/performance.md)."""
    from coconetc.oracle.inputs import size_symbols
    from coconetc.toolchain import BuildError
    from coconetc.tune import tuner
    target = _checked_target("tune", backend, emulate, "measure the generated CUDA code on the CPU")
    if keep is None:
        keep = tuner.KEEP if target == "cpu" else math.inf
    mod = _load(file)
    name = _pick_program(mod, program, None)
    known = size_symbols(mod.programs[name])
    sz = _sizes(sizes, known)
    missing = [k for k in known if k not in sz]
    if missing:
        _fail(f"coconetc: tune needs every size symbol: add {' '.join(f'--size {k}=INT' for k in missing)}")
    _check_sizes(mod.programs[name], sz, 0)
    try:
        rec = tuner.tune(mod, name, sz, ranks, reps=reps, keep=keep, echo=lambda m: click.echo(m, err=True),
                         target=target)
    except (tuner.TuneError, BuildError) as err:
        _fail(str(err))
    except CompileError as err:
        _fail(err.render())
    click.echo(tuner.table(rec), nl=False)
    hand = tuner.best_handwritten(rec)
    if hand is not None:
        ratio = rec["measured"][rec["choice"]] / rec["measured"][hand]
        click.echo(f"choice {rec['choice']}: {ratio:.3f}x the time of the best hand-written schedule ({hand})")
    if json_path:
        import json
        keys = ("measured", "choice", "generated", "schedules", "modelled", "by_convention",
                "conventions", "sizes", "ranks", "target", "machine")
        with open(json_path, "w") as f:
            json.dump({k: rec[k] for k in keys}, f, indent=1)
        click.echo(f"wrote {json_path}")


@main.command()
@click.argument("file", type=click.Path())
@click.option("--program", "-p", help="Only this program (default: every program).")
@click.option("--schedule", "-s", help="Only this schedule ('auto': the tuner's choice).")
@click.option("--ranks", "-n", type=click.IntRange(1), default=2, show_default=True)
@click.option("--size", "sizes", multiple=True, metavar="NAME=INT",
              help="A size symbol (default: the sizes the program was last tuned at).")
@click.option("--nodes", type=click.IntRange(1), default=1, show_default=True,
              help="The ranks on this many nodes (equal shares): the model's bytes across the network "
                   "(docs/cluster.md); measured times are shown for one node only.")
@_records_options("the measured times, the tuner's choice and its schedules are those measured there "
                  "(on cuda the CPU cost model's times do not apply and are not shown)")
def explain(file, program, schedule, ranks, sizes, nodes, backend, emulate) -> None:
    """The cost model's view of each schedule: bytes moved through memory, bytes sent per rank,
    passes over memory, kernel launches and plan units, the modelled time (the CPU backend's:
    left out for --backend cuda), and the measured time where the tuning cache has one for
    these sizes and ranks on the backend."""
    from coconetc.tune import explain as ex
    target = _checked_target("explain", backend, emulate, "read the records measured under the host emulation")
    mod = _load(file)
    if not mod.programs:
        _fail(_no_program(mod))
    names = [_pick_program(mod, program, schedule)] if program or (schedule and len(mod.programs) > 1) \
        else list(mod.programs)
    every = sorted({k for n in names for k in ex.symbols(mod, n)})
    given = _sizes(sizes, every)  # each program takes the sizes of its own symbols
    for i, name in enumerate(names):
        try:
            mine = {k: v for k, v in given.items() if k in ex.symbols(mod, name)}
            text = ex.explain(mod, name, schedule, ranks, mine, nodes, target)
            click.echo(("\n" if i else "") + text, nl=False)
        except ex.ExplainError as err:
            _fail(f"coconetc: {err}")
