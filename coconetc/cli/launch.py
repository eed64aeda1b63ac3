"""`coconetc launch`: run a Python script on R ranks (mpiexec, on this machine or hosts)."""

from __future__ import annotations

import click

from coconetc.cli.files import fail
from coconetc.cli.options import launch_ranks


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
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
        fail(f"coconetc: launch --host {hosts!r}: an empty host name (write H1,H2 or H1:SLOTS,H2:SLOTS)")
    launch_ranks(ranks, [script, *args], hostfile=hostfile, hosts=hosts)
