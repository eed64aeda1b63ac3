"""`coconetc explain`: why the tuner (or its cost model) ranks each schedule as it does."""

from __future__ import annotations

import click

from coconetc.cli.files import fail, load_ccn, no_program, parse_sizes, pick_program
from coconetc.cli.options import checked_target, records_options, scalar_values, value_args


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
                  "(on cuda the CPU cost model's times do not apply and are not shown); with -s, on "
                  "cuda: the schedule's kernels against their bounds (needs no GPU)")
@click.option("--bandwidth", type=click.FloatRange(min=0, min_open=True), metavar="GB/s",
              help="The kernel listing's copy bandwidth (default: the --machine JSON's, else an H100 SXM's "
                   "3350; an H200's is 4800).")
@click.option("--peak", type=click.FloatRange(min=0, min_open=True), metavar="TFLOP/s",
              help="The kernel listing's peak for every dtype (default: the --machine JSON's, else an "
                   "H100/H200's dense peak by dtype: f32 and f64 67, bf16 and f16 989).")
@click.option("--machine", type=click.Path(dir_okay=False), metavar="JSON",
              help="The rates measured on a GPU (bench/cuda_gpu_check.py --kernels writes machine.json: "
                   "bandwidth_gbps, peak_tflops by dtype).")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="json: the kernel listing as JSON (with --backend cuda -s S), or --measure's table.")
@click.option("--measure", is_flag=True,
              help="Run the schedule (-s, with every size given) on --ranks ranks, traced, and print each "
                   "unit's measured time beside the cost model's and its bound (CPU backend).")
@click.option("--reps", type=click.IntRange(2), default=6, show_default=True,
              help="--measure's calls (the first is a warm-up, left out).")
@click.option("--value", "values", multiple=True, metavar="NAME=NUMBER",
              help="--measure: a scalar parameter's value (default: random, as `coconetc run`'s inputs; "
                   "e.g. a dropout probability of 0 to time a block without dropout).")
@click.option("--chart", type=click.Path(dir_okay=False), metavar="PNG",
              help="With -s naming a pipeline schedule: draw its timeline to this PNG too (needs matplotlib).")
def explain(file, program, schedule, ranks, sizes, nodes, backend, emulate, bandwidth, peak, machine, fmt,
            measure, reps, values, chart) -> None:
    """The cost model's view of each schedule: bytes moved through memory, bytes sent per rank,
    passes over memory, kernel launches and plan units, the modelled time (the CPU backend's:
    left out for --backend cuda), and the measured time where the tuning cache has one for
    these sizes and ranks on the backend.

    \b
    With --backend cuda and -s SCHEDULE (not auto; no GPU needed, --emulate
    alike): the schedule's kernel listing. Each plan unit in launch order:
    the kernels its generated code launches, named as a profiler shows them
    (coconet_gen::FUNC(...)::{lambda(SIG)#K}), or the library it calls
    (cublas, nccl, memcpy, runtime); the bytes it reads and writes and its
    flops (the cost model's, per rank); its bound, max(bytes / bandwidth,
    flops / peak). --format json prints it for bench/cuda_gpu_check.py
    --kernels, which measures each unit on a GPU against its bound
    (docs/cuda.md, "Every kernel against its bound").

    With -s naming a pipeline schedule (docs/pipeline.md): also each virtual stage's modelled
    forward and backward on one micro-batch (--ranks: a stage's ranks), the timeline, the
    bubble and each rank's peak micro-batches held; --chart PNG draws the timeline."""
    from coconetc.tune import explain as ex
    if measure:
        return _measure(file, program, schedule, ranks, sizes, nodes, backend, emulate, fmt, reps, values)
    _refuse_values(values)
    listing = backend == "cuda" and schedule is not None and schedule != "auto"
    if fmt == "json" and not listing:
        fail("coconetc: explain --format json is the kernel listing: give --backend cuda -s SCHEDULE")
    if (bandwidth or peak or machine) and not listing:
        fail("coconetc: --bandwidth, --peak and --machine are the kernel listing's: give --backend cuda -s SCHEDULE")
    if listing and not emulate:
        from coconetc.cli.options import gpu_here
        from coconetc.plan.targets import Target
        target = Target.named(backend, emulate)
        records = gpu_here()
    else:
        target = checked_target("explain", backend, emulate, "read the records measured under the host emulation")
        records = True
    mod = load_ccn(file)
    if not mod.programs:
        fail(no_program(mod))
    names = [pick_program(mod, program, schedule)] if program or (schedule and len(mod.programs) > 1) \
        else list(mod.programs)
    every = sorted({k for n in names for k in ex.symbols(mod, n)})
    given = parse_sizes(sizes, every)  # each program takes the sizes of its own symbols
    docs = []
    for i, name in enumerate(names):
        try:
            mine = {k: v for k, v in given.items() if k in ex.symbols(mod, name)}
            if listing:
                doc = ex.kernel_listing(mod, name, schedule, ranks, mine, target, bandwidth, peak, machine, records)
                docs.append(doc)
                text = ex.kernel_table(doc) if fmt == "text" else ""
            else:
                text = ex.explain(mod, name, schedule, ranks, mine, nodes, target)
                if schedule is not None and schedule != "auto" and target.facts.modelled:
                    more = ex.pipeline_text(mod, name, schedule, ranks, mine, chart=chart)
                    text += "\n" + more if more else ""
            if text:
                click.echo(("\n" if i else "") + text, nl=False)
        except ex.ExplainError as err:
            fail(f"coconetc: {err}")
    if fmt == "json":
        import json
        click.echo(json.dumps(docs[0] if len(docs) == 1 else docs, indent=1))


def _measure(file, program, schedule, ranks, sizes, nodes, backend, emulate, fmt, reps, values=()) -> None:
    """explain --measure: the schedule built and run on RANKS ranks (`coconetc run`'s rank
    program, without comparing its results: `coconetc run` does that), every call traced (COCONET_TRACE,
    docs/tracing.md); each unit's measured time beside the model's (tune/explain.py)."""
    import json
    import tempfile
    from pathlib import Path

    from coconetc.launch.mpiexec import run_python
    from coconetc.runtime.loader import compile_cpu
    from coconetc.toolchain import BuildError
    from coconetc.tune import explain as ex
    if backend != "cpu" or emulate or nodes != 1:
        fail("coconetc: explain --measure runs the CPU backend on one node (no --backend cuda, --emulate, --nodes)")
    if schedule is None or schedule == "auto":
        fail("coconetc: explain --measure runs one schedule: give -s SCHEDULE (a name, not auto)")
    mod = load_ccn(file)
    if not mod.programs:
        fail(no_program(mod))
    name = pick_program(mod, program, schedule)
    need = ex.symbols(mod, name)
    given = parse_sizes(sizes, need)
    missing = [k for k in need if k not in given]
    if missing:
        fail(f"coconetc: explain --measure runs the program: give every size ({' '.join(f'--size {k}=INT' for k in missing)})")
    scalars = scalar_values(values, mod.programs[name])
    try:
        ex._labels(mod, name, schedule, None)  # an unknown schedule: its error, naming the known ones
        compile_cpu(mod)
    except ex.ExplainError as err:
        fail(f"coconetc: {err}")
    except BuildError as err:
        fail(str(err))
    with tempfile.TemporaryDirectory(prefix="coconet_measure_") as folder:
        argv = ["-m", "coconetc.jobs.run", mod.file, "--program", name, f"--schedule={schedule}",
                f"--reps={reps}", "--no-check", *[f"--size={k}={v}" for k, v in given.items()],
                *value_args(scalars), *(["--quiet"] if fmt == "json" else [])]
        code = run_python(ranks, argv, env={"COCONET_TRACE": folder})
        if code != 0:
            fail(f"coconetc: explain --measure: the ranks failed (exit code {code})")
        traces = [json.loads(p.read_text()) for p in sorted(Path(folder).glob("trace.rank*.json"))]
    try:
        m = ex.measured_units(mod, name, schedule, ranks, given, traces)
    except ex.ExplainError as err:
        fail(f"coconetc: {err}")
    click.echo(json.dumps(m, indent=1) if fmt == "json" else ex.units_table(m), nl=fmt == "json")


def _refuse_values(values: tuple[str, ...]) -> None:
    if values:
        fail("coconetc: --value goes with --measure (the values of the measured calls)")
