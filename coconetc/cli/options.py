"""Options more than one command takes, and what they mean: --backend and --emulate as a
target (and whether a GPU is here), the tuning records' --backend and --emulate, extern
operations' -I, -L and -l; and ranks started under mpiexec."""

from __future__ import annotations

import sys
from typing import NoReturn

import click

from coconetc.cli.files import fail
from coconetc.plan.targets import Target


def records_options(what: str):
    """--backend and --emulate of show and explain: the target whose tuning records they read."""
    def wrap(f):
        f = click.option("--emulate", is_flag=True,
                         help="With --backend cuda: the records `coconetc tune --backend cuda --emulate` "
                              "measured under the host emulation.")(f)
        return click.option("--backend", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
                            help=f"The backend whose tuning records to read: {what}.")(f)
    return wrap


def lib_options(f):
    """-I, -L, -l: what the file's extern operations need to build (docs/language.md)."""
    f = click.option("-l", "libraries", multiple=True, metavar="LIB",
                     help="Link this library (extern operations; repeatable).")(f)
    f = click.option("-L", "library_dirs", multiple=True, metavar="DIR",
                     help="Search DIR for libraries (extern operations; repeatable).")(f)
    return click.option("-I", "include_dirs", multiple=True, metavar="DIR",
                        help="Search DIR for extern operations' headers (repeatable; the .ccn "
                        "file's directory is searched too).")(f)


def lib_kwargs(include_dirs, library_dirs, libraries) -> dict:
    return dict(include_dirs=include_dirs, library_dirs=library_dirs, libraries=libraries)


def checked_target(command: str, backend: str, emulate: bool, emulated: str) -> Target:
    """The target of --backend and --emulate (Target.named), after the checks every command
    taking them makes: --emulate only with --backend cuda, and --backend cuda alone only where
    PyTorch sees a GPU (a GPU's records are keyed by its name); EMULATED says what --emulate
    would do instead."""
    from coconetc.runtime.backends import backend as backend_of
    if emulate and backend != "cuda":
        fail("coconetc: --emulate goes with --backend cuda")
    target = Target.named(backend, emulate)
    if backend_of(target).gpu and not gpu_here():
        fail(f"coconetc: {command} --backend cuda: no CUDA device here (PyTorch with CUDA sees none); "
              f"add --emulate to {emulated}")
    return target


def gpu_here() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def launch_ranks(ranks: int, argv: list[str], **hosts) -> NoReturn:
    """Runs `python ARGV` on R ranks (launch.mpiexec.run_python) and exits with its code; an
    mpiexec that cannot be started is an error message, not a traceback."""
    from coconetc.launch.mpiexec import run_python
    try:
        code = run_python(ranks, argv, **hosts)
    except (RuntimeError, OSError) as err:
        fail(f"coconetc: could not start {ranks} ranks: {err}")
    sys.exit(code)


def scalar_values(items: tuple[str, ...], p) -> dict:
    """--value NAME=NUMBER (run, explain --measure), each a scalar parameter of P and a number of
    its dtype; the name and the number checked here, before anything builds."""
    from coconetc.ir.arguments import scalar_from_text
    scalars = {q.name: q for q in p.params if q.scalar}
    out = {}
    for item in items:
        name, eq, text = item.partition("=")
        if not eq or not name.isidentifier():
            fail(f"coconetc: --value takes NAME=NUMBER, got {item!r}")
        if name not in scalars:
            fail(f"coconetc: --value {item}: {p.name} has no scalar parameter '{name}' "
                 f"(its scalar parameters: {', '.join(scalars) or 'none'})")
        try:
            out[name] = scalar_from_text(scalars[name], text)
        except (TypeError, ValueError) as err:
            fail(f"coconetc: --value {item}: {err}")
    return out


def value_args(values: dict) -> list[str]:
    """The ranks' worker's arguments for the values (coconetc.jobs.run --value)."""
    return [f"--value={k}={v!r}" for k, v in values.items()]
