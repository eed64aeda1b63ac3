"""`coconetc trace-merge FOLDER`: the ranks' trace files (coconetc.trace, COCONET_TRACE) joined
into one Chrome-trace/Perfetto file, every rank a process of its own; where they hold a
pipeline's actions, each run's bubble."""

from __future__ import annotations

import statistics
from pathlib import Path

import click

from coconetc.runtime.trace import FILE, merge, pipeline_bubbles


@click.command("trace-merge")
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="The merged file (default: FOLDER/trace.json).")
def trace_merge(folder: str, output: str | None) -> None:
    """Join the ranks' traces in FOLDER (trace.rank<r>.json) into one file."""
    files = sorted(Path(folder).glob(FILE.format(rank="*")))
    if not files:
        raise click.ClickException(f"no {FILE.format(rank='<r>')} in {folder}: run with coconetc.trace({folder!r}) "
                                   f"or COCONET_TRACE={folder} first")
    out = Path(output or Path(folder) / "trace.json")
    doc = merge(files, out)
    click.echo(f"{out}: {len(files)} ranks")
    by_pipeline: dict[int, list[tuple[int, float]]] = {}
    for (p, k), b in pipeline_bubbles(doc["traceEvents"]).items():
        by_pipeline.setdefault(p, []).append((k, b))
    for p, steps in by_pipeline.items():  # a pipeline's runs: each one's idle fraction of its ranks
        click.echo(f"pipeline {p}: {len(steps)} runs (its steps and evaluations), bubble (the ranks' idle fraction "
                   "of each run) " + ", ".join(f"run {k} {b:.3f}" for k, b in steps[:10])
                   + (", ..." if len(steps) > 10 else "")
                   + f"; median {statistics.median(b for _, b in steps):.3f}")
