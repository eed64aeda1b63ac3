"""`coconetc check`: parse, type-check, schedule and plan files; print every error."""

from __future__ import annotations

import sys
import traceback

import click

from coconetc.cli.files import DEBUG, no_program
from coconetc.errors import CompileError
from coconetc.sourcefile import SourceFile, load_file


@click.command()
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
            if DEBUG["on"]:
                traceback.print_exc()
            click.echo(err.render(), err=True)
            failed = True
            continue
        except OSError as err:
            click.echo(f"coconetc: cannot read {f}: {err.strerror}", err=True)
            failed = True
            continue
        if not mod.programs:
            click.echo(no_program(mod), err=True)
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
