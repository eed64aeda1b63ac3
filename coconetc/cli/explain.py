"""`coconetc explain`: why the tuner (or its cost model) ranks each schedule as it does."""

from __future__ import annotations

import click

from coconetc.cli.files import fail, load_ccn, no_program, parse_sizes, pick_program
from coconetc.cli.options import checked_target, records_options


@click.command()
@click.argument("file", type=click.Path())
@click.option("--program", "-p", help="Only this program (default: every program).")
@click.option("--schedule", "-s", help="Only this schedule ('auto': the tuner's choice).")
@click.option("--ranks", "-n", type=click.IntRange(1), default=2, show_default=True)
@click.option("--size", "sizes", multiple=True, metavar="NAME=INT",
              help="A size symbol (default: the sizes the program was last tuned at).")
@click.option("--nodes", type=click.IntRange(1), default=1, show_default=True,
              help="The ranks on this many nodes (equal shares): the model's bytes across the network "
                   "(docs/cluster.md); measured times are shown for one node only.")
@records_options("the measured times, the tuner's choice and its schedules are those measured there "
                  "(on cuda the CPU cost model's times do not apply and are not shown)")
def explain(file, program, schedule, ranks, sizes, nodes, backend, emulate) -> None:
    """The cost model's view of each schedule: bytes moved through memory, bytes sent per rank,
    passes over memory, kernel launches and plan units, the modelled time (the CPU backend's:
    left out for --backend cuda), and the measured time where the tuning cache has one for
    these sizes and ranks on the backend."""
    from coconetc.tune import explain as ex
    target = checked_target("explain", backend, emulate, "read the records measured under the host emulation")
    mod = load_ccn(file)
    if not mod.programs:
        fail(no_program(mod))
    names = [pick_program(mod, program, schedule)] if program or (schedule and len(mod.programs) > 1) \
        else list(mod.programs)
    every = sorted({k for n in names for k in ex.symbols(mod, n)})
    given = parse_sizes(sizes, every)  # each program takes the sizes of its own symbols
    for i, name in enumerate(names):
        try:
            mine = {k: v for k, v in given.items() if k in ex.symbols(mod, name)}
            text = ex.explain(mod, name, schedule, ranks, mine, nodes, target)
            click.echo(("\n" if i else "") + text, nl=False)
        except ex.ExplainError as err:
            fail(f"coconetc: {err}")
