"""`coconetc tune`: measure a program's schedules at given sizes and record the fastest."""

from __future__ import annotations

import math

import click

from coconetc.cli.files import check_sizes, fail, load_ccn, parse_sizes, pick_program
from coconetc.cli.options import checked_target
from coconetc.errors import CompileError


@click.command()
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
    target = checked_target("tune", backend, emulate, "measure the generated CUDA code on the CPU")
    if keep is None:
        keep = tuner.KEEP if target.facts.modelled else math.inf  # (pruned by the cost model's times)
    mod = load_ccn(file)
    name = pick_program(mod, program, None)
    known = size_symbols(mod.programs[name])
    sz = parse_sizes(sizes, known)
    missing = [k for k in known if k not in sz]
    if missing:
        fail(f"coconetc: tune needs every size symbol: add {' '.join(f'--size {k}=INT' for k in missing)}")
    check_sizes(mod.programs[name], sz, 0)
    try:
        rec = tuner.tune(mod, name, sz, ranks, reps=reps, keep=keep, echo=lambda m: click.echo(m, err=True),
                         target=target)
    except (tuner.TuneError, BuildError) as err:
        fail(str(err))
    except CompileError as err:
        fail(err.render())
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
