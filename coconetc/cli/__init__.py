"""The coconetc command: check, show, run, compile, launch, tune, explain, trace-merge. User errors print as
diagnostics, without a Python traceback (--debug shows it).

A file per command (check.py, show.py, run.py, compile.py, launch.py, tune.py, explain.py, trace.py),
and what they share: files.py (the .ccn file a command reads: loaded, its program, schedule
labels, sizes, failing with a message) and options.py (the options several commands take:
--backend and --emulate as a target, the tuning records' backend, -I/-L/-l, ranks under
mpiexec). `main` is the console entry point (pyproject.toml: `coconetc = "coconetc.cli:main"`)."""

from __future__ import annotations

import click

from coconetc.cli import check, compile, explain, launch, run, show, trace, tune
from coconetc.cli.files import DEBUG

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show Python tracebacks for errors.")
@click.version_option(package_name="coconet")
def main(debug: bool) -> None:
    """coconet: compile distributed ML programs with checked schedules."""
    DEBUG["on"] = debug


for _command in (check.check, show.show, run.run, compile.compile, launch.launch, tune.tune, explain.explain,
                 trace.trace_merge):
    main.add_command(_command)
