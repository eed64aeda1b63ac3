"""What every rank runs for `coconetc tune`: each candidate schedule of the (augmented) file
timed on the same random inputs (one warm-up round, for a CUDA module one more for each of
auto's trial calls of its fused units, then --reps rounds of one call of each schedule; the
median of each rank's calls, the slowest rank's median counted), then for each calling
convention the fastest schedule checked once against the interpreter (the next fastest if it
does not match). Rank 0 prints `PROGRESS i n label seconds` lines for the
tuner's progress bar and writes the results as JSON to --out. A rank that fails stops the
whole job (MPI Abort). With --cuda the CUDA module runs on this node's GPUs: each call's inputs
are copied to the GPU before it and the call is timed up to the GPU's end of it
(torch.cuda.synchronize); with --emulate-cuda, under the host emulation (which synchronizes).

    python -m coconetc.jobs.tune FILE --program P --out JSON --schedule LABEL... [--size N=INT]...
        [--cuda | --emulate-cuda]"""

from __future__ import annotations

import copy
import functools
import json
import sys

from coconetc.jobs import args
from coconetc.jobs.abort import stop_job_on_failure
from coconetc.jobs.modules import load_for
from coconetc.jobs.timing import slowest_medians, timed_rounds
from coconetc.jobs.verify import verify_call
from coconetc.interp.interpreter import run
from coconetc.oracle.inputs import adapt_inputs, random_inputs
from coconetc.runtime.cuda import fused_trial_calls
from coconetc.tune.space import convention


def _args(argv):
    ap = args.parser("coconetc-tune-worker", reps=5)
    ap.add_argument("--out", required=True)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    return stop_job_on_failure(lambda comm: _main(_args(argv), comm), "coconetc tune")


def _main(a, comm) -> int:
    sizes = {k: int(v) for k, v in (s.split("=") for s in a.size)}
    mod = load_for(a, comm)
    fn, base = mod.programs[a.program], mod.source_module.programs[a.program]
    inputs = random_inputs(base, comm.Get_size(), 1, sizes, a.seed, typical=True)
    measured = _time_all(fn, a.schedule, base, inputs, comm, a.reps, a.cuda)
    conv = {label: convention(_ir(fn, label), base) for label in a.schedule}
    verified: dict[str, list[str]] = {}
    ref = functools.cache(lambda: run(base, inputs, 1))  # the unscheduled program's results (rank 0, once)
    by_conv: dict[str, str] = {}
    for c in sorted(set(conv.values()), key=lambda c: (c != "", c)):
        for label in sorted((x for x in a.schedule if conv[x] == c), key=measured.__getitem__):
            ir = _ir(fn, label)
            verified[label] = verify_call(comm, fn, ir, adapt_inputs(inputs, base, ir), 1, ref, base,
                                          schedule=label).problems
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


def _ir(fn, label: str):
    """The program LABEL runs (a CUDA module's schedules carry no CPU algorithm: a name)."""
    return fn._program(label) if hasattr(fn, "_program") else fn.schedules[label]


def _time_all(fn, labels: list[str], base, inputs, comm, reps: int, gpu: bool) -> dict[str, float]:
    """Round-robin: one call of every schedule per round (the first round warms up: caches,
    pages, the communicator's buffers), so that a change in the machine's load touches every
    schedule alike; the median of each rank's calls, the slowest rank's median counted."""
    rank = comm.Get_rank()
    mine = {x: adapt_inputs(inputs, base, _ir(fn, x))[rank] for x in labels}
    calls = {x: functools.partial(_prepare, fn, x, mine[x], gpu) for x in labels}
    done = [0]

    def progress(label, k, seconds, out):
        done[0] += 1
        if rank == 0:
            print(f"PROGRESS {done[0]} {total} {label} {seconds if k >= warmup else 0.0!r}", flush=True)

    # a CUDA module's first calls at a size try both algorithms of its fused units (auto's
    # trials: the module's fused_trial_calls): the warm-up rounds take every schedule past them
    warmup = 1 + fused_trial_calls(getattr(getattr(fn, "fn", fn), "ext", None))
    total = len(labels) * (max(1, reps) + warmup)
    times = timed_rounds(comm, calls, max(1, reps), warmup=warmup, seen=progress)
    return slowest_medians(comm, times)


def _prepare(fn, label: str, args: dict, gpu: bool):
    if gpu:  # (modules.GpuFunction) the copies to the GPU made here, outside the timing
        return fn.synced(label, copy.deepcopy(args))
    return functools.partial(fn, schedule=label, **copy.deepcopy(args))


if __name__ == "__main__":
    sys.exit(main())
