"""What every rank runs for `coconetc run` (without --interp): the compiled module on the same
random inputs as the interpreter, timed, with every rank's results compared with the
interpreter on rank 0. A rank that fails stops the whole job at once (MPI Abort).

    python -m coconetc.jobs.run FILE --program P [--schedule S]... [--size N=INT]..."""

from __future__ import annotations

import copy
import functools
import sys
from typing import Any

from coconetc.ir.arguments import scalar_from_text
from coconetc.jobs import args
from coconetc.jobs.abort import stop_job_on_failure
from coconetc.jobs.modules import load_for
from coconetc.jobs.timing import slowest_median, timed_rounds
from coconetc.jobs.verify import call_results, print_problems, verify_results
from coconetc.oracle.inputs import adapt_inputs, random_inputs
from coconetc.oracle.npz import save_results


def _args(argv):
    ap = args.parser("coconetc-worker", reps=3)
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--save")
    ap.add_argument("--no-check", action="store_true",
                    help="time the calls without comparing the results with the interpreter (explain --measure)")
    ap.add_argument("--quiet", action="store_true", help="print nothing (explain --measure --format json)")
    ap.add_argument("--value", action="append", default=[],
                    help="NAME=NUMBER: a scalar parameter's value instead of a random one (run, explain --measure)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    return stop_job_on_failure(lambda comm: _main(_args(argv), comm), "coconetc")


def _main(a, comm) -> int:
    sizes = {k: int(v) for k, v in (s.split("=") for s in a.size)}
    mod = load_for(a, comm)
    fn: Any = mod.programs[a.program]
    base = mod.source_module.programs[a.program]
    inputs = random_inputs(base, comm.Get_size(), a.groups, sizes, a.seed, typical=True,
                           values=given_values(base, a.value))
    bad = 0
    for sched in a.schedule or [None]:
        bad += _run_one(a, comm, fn, base, inputs, sched)
    return 1 if bad else 0


def given_values(p, items) -> dict[str, Any]:
    """The --value NAME=NUMBER items the command line handed over (cli/options.py scalar_values
    checked them there) as P's scalar arguments, parsed again on this rank."""
    scalars = {q.name: q for q in p.params if q.scalar}
    return {k: scalar_from_text(scalars[k], v) for k, v in (x.split("=", 1) for x in items)}


def _run_one(a, comm, fn, base, inputs, sched: str | None) -> bool:
    """One schedule: --reps calls timed, the first call's results checked; True on a mismatch."""
    rank, R = comm.Get_rank(), comm.Get_size()
    ir = fn.schedules[sched or "default"] if a.emulate_cuda or a.cuda else fn._program(sched)
    s_inputs = adapt_inputs(inputs, base, ir, a.groups)
    last: dict[str, Any] = {}  # the arguments of the latest call, the first call's results

    def prepare():
        last["args"] = copy.deepcopy(s_inputs[rank])
        return functools.partial(fn, schedule=sched, groups=a.groups, **last["args"])

    def seen(key, k, seconds, out):
        if k == 0:
            last["results"] = call_results(ir, out, last["args"])

    times = timed_rounds(comm, {sched: prepare}, max(1, a.reps), seen=seen)[sched]
    t = slowest_median(comm, times)
    if a.no_check:
        if rank == 0 and not a.quiet:
            print(f"{a.program} [{sched or 'default'}]: {R} ranks: {t * 1e3:.3f} ms (median of {a.reps}): "
                  "not checked", flush=True)
        return False
    checked = verify_results(comm, last["results"], ir, s_inputs, a.groups)
    if rank == 0:
        label = f"{a.program} [{sched or 'default'}]" + (" (CUDA, host emulation)" if a.emulate_cuda else
                                                          " (CUDA)" if a.cuda else "")
        print(f"{label}: {R} ranks: {t * 1e3:.3f} ms (median of {a.reps}): {checked.status}", flush=True)
        print_problems(checked.problems)
        if a.save:  # one file per schedule when several run, as `run --interp` does
            path = a.save if len(a.schedule) <= 1 else a.save.replace(".npz", f".{sched or 'default'}.npz")
            save_results(path, s_inputs, checked.got)
    return bool(checked.problems)


if __name__ == "__main__":
    sys.exit(main())
