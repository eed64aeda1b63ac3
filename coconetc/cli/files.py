"""The .ccn file a command reads: loaded, its errors printed as diagnostics and the command
failed without a Python traceback (--debug shows it); its program, schedule labels, derived
programs (--grad) and size symbols (--size)."""

from __future__ import annotations

import sys
import traceback
from typing import NoReturn

import click

from coconetc.errors import CompileError, Span
from coconetc.ir.limits import INT64_MAX, too_big
from coconetc.plan.label import DEFAULT, ScheduleLabel, parse
from coconetc.sourcefile import SourceFile, load_file


DEBUG = {"on": False}


def fail(message: str) -> NoReturn:
    click.echo(message, err=True)
    sys.exit(1)


def load_ccn(path: str) -> SourceFile:
    """The file PATH names (a bare name with no such file here: the example of that name that
    ships with coconet, paths.source_path), loaded; a message and exit 1 if it cannot be."""
    from coconetc.paths import source_path
    try:
        return load_file(source_path(path))
    except CompileError as err:
        if DEBUG["on"]:
            traceback.print_exc()
        fail(err.render())
    except OSError as err:
        fail(f"coconetc: cannot read {path}: {err.strerror}")
    raise AssertionError


def no_program(mod: SourceFile) -> str:
    return CompileError.at(Span(mod.file, 1, 1, 1, 1, mod.source),
                           "no program in this file: nothing to check, run or compile").render()


def with_grad(mod: SourceFile, name: str) -> tuple[SourceFile, str]:
    """--grad: the file with NAME's derived programs, and the name of its derived program."""
    from coconetc.sourcefile import grad_name, with_grads
    if name in mod.derived:
        fail(f"coconetc: '{name}' is a derived program already; use --grad -p {mod.derived[name]}")
    try:
        return with_grads(mod, [name]), grad_name(name)
    except CompileError as err:
        fail(err.render())
    raise AssertionError


def pick_program(mod: SourceFile, program: str | None, schedule: str | None) -> str:
    if not mod.programs:
        fail(no_program(mod))
    if program is None and schedule not in (None, "all") and len(mod.programs) > 1:
        owners = [p for p, s in mod.schedules.items() if parse_label(schedule).name in s]
        if len(owners) == 1:
            return owners[0]
    try:
        return mod.program(program).name
    except KeyError as err:
        fail(f"coconetc: {err.args[0]}")
    raise AssertionError


def parse_label(schedule: str) -> ScheduleLabel:
    """A schedule label as given (-s zero, -s zero@p2p, -s default), parsed once."""
    try:
        return parse(schedule)
    except (TypeError, ValueError) as err:
        fail(f"coconetc: {err}")
    raise AssertionError


def base_name(label: str | None) -> str | None:
    """The schedule a label runs, None for the program itself ("default")."""
    name = None if label is None else parse(label).name
    return None if name == DEFAULT else name


def parse_sizes(items: tuple[str, ...], known: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        if not value.isdigit() or not name.isidentifier():
            fail(f"coconetc: --size takes NAME=INT, got {item!r}")
        if name not in known:
            fail(f"coconetc: --size {item}: the program has no size symbol '{name}' "
                  f"(size symbols: {', '.join(known) or 'none'})")
        out[name] = int(value)
        if out[name] > INT64_MAX:
            fail(f"coconetc: --size {item}: a size must fit int64 (at most {INT64_MAX})")
    return out


def check_sizes(p, sizes: dict[str, int], default: int) -> None:
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
            fail(CompileError.at(item.span, f"with {shown}, '{item.name}' ({t}) is too large: "
                                  f"{big}").render())
