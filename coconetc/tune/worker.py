"""What every rank runs for `coconetc tune`: each candidate schedule of the (augmented) file
timed on the same random inputs (one warm-up round, then --reps rounds of one call of each
schedule; the median of each rank's calls, the slowest rank's median counted), then for each calling convention the fastest
schedule checked once against the interpreter (the next fastest if it does not match).
Rank 0 prints `PROGRESS i n label seconds` lines for the tuner's progress bar and writes the
results as JSON to --out. A rank that fails stops the whole job (MPI Abort)."""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time


def _args(argv):
    ap = argparse.ArgumentParser(prog="coconetc-tune-worker")
    ap.add_argument("file")
    ap.add_argument("--program", required=True)
    ap.add_argument("--schedule", action="append", default=[])
    ap.add_argument("--size", action="append", default=[])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--include-dir", action="append", default=[])
    return ap.parse_args(argv)


def main(argv=None) -> int:
    from coconetc.launch.worker import stop_job_on_failure
    return stop_job_on_failure(lambda comm: _main(_args(argv), comm), "coconetc tune")


def _main(a, comm) -> int:
    import coconetc
    from coconetc.oracle.core import random_inputs
    from coconetc.tune.space import convention
    sizes = {k: int(v) for k, v in (s.split("=") for s in a.size)}
    mod = coconetc.load(a.file, log=lambda msg: None, include_dirs=a.include_dir)
    fn = mod.programs[a.program]
    base = mod.source_module.programs[a.program]
    inputs = random_inputs(base, comm.Get_size(), 1, sizes, a.seed)
    measured = _time_all(fn, a.schedule, base, inputs, comm, a.reps)
    conv = {label: convention(fn._program(label), base) for label in a.schedule}
    verified: dict[str, list[str]] = {}
    ref: list = []  # the unscheduled program's results (rank 0, computed once)
    by_conv: dict[str, str] = {}
    for c in sorted(set(conv.values()), key=lambda c: (c != "", c)):
        for label in sorted((x for x in a.schedule if conv[x] == c), key=measured.__getitem__):
            verified[label] = _verify(fn, label, base, inputs, comm, ref)
            if not verified[label]:
                by_conv[c] = label
                break
    ok = list(by_conv.values())
    choice = min(ok, key=measured.__getitem__) if ok else None
    if comm.Get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump({"measured": measured, "conventions": conv, "problems": verified,
                       "by_convention": by_conv, "choice": choice}, f, indent=1)
    return 0 if choice is not None else 1


def _time_all(fn, labels: list[str], base, inputs, comm, reps: int) -> dict[str, float]:
    """Round-robin: one call of every schedule per round (the first round warms up), so that
    a change in the machine's load touches every schedule alike; the median of each rank's
    calls, the slowest rank's median counted."""
    from coconetc.oracle.core import adapt_inputs
    rank = comm.Get_rank()
    mine = {x: adapt_inputs(inputs, base, fn._program(x))[rank] for x in labels}
    times: dict[str, list[float]] = {x: [] for x in labels}
    total, done = len(labels) * (max(1, reps) + 1), 0
    for k in range(max(1, reps) + 1):
        for label in labels:
            args = copy.deepcopy(mine[label])
            comm.Barrier()
            t0 = time.perf_counter()
            fn(schedule=label, **args)
            if k:  # the first round warms up (caches, pages, the communicator's buffers)
                times[label].append(time.perf_counter() - t0)
            done += 1
            if rank == 0:
                last = times[label][-1] if times[label] else 0.0
                print(f"PROGRESS {done} {total} {label} {last!r}", flush=True)
    return {x: comm.allreduce(statistics.median(t), op=_max()) for x, t in times.items()}


def _verify(fn, label, base, inputs, comm, ref: list) -> list[str]:
    """The differences between this schedule's results and the interpreter's run of the
    unscheduled program (rank 0 checks; every rank gets the answer)."""
    from coconetc.oracle.core import adapt_inputs, compare
    from coconetc.interp.interpreter import Result, run
    from coconetc.launch.worker import _result
    ir = fn._program(label)
    s_inputs = adapt_inputs(inputs, base, ir)
    mine = copy.deepcopy(s_inputs[comm.Get_rank()])
    out = fn(schedule=label, **mine)
    gathered = comm.gather(_result(ir, out, mine), root=0)
    problems: list[str] = []
    if comm.Get_rank() == 0:
        if not ref:
            ref.extend(run(base, inputs, 1))
        got = [Result(o, u, ref[r].segments) for r, (o, u) in enumerate(gathered)]
        problems = compare(ref, got, base, ir, 1)
    return comm.bcast(problems, root=0)


def _max():
    from mpi4py import MPI
    return MPI.MAX


if __name__ == "__main__":
    sys.exit(main())
