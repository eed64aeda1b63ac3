"""Cross-rank argument errors of a compiled module, run by tests/test_cpu_backend.py as

    mpiexec -n 2 python tests/cpu_calls_worker.py examples/adam.ccn

Every check calls `mod.adam(...)` on both ranks with arguments that are wrong on one rank or on
every rank, and checks that each rank raises the right exception (the rank with the bad
argument its own TypeError/ValueError naming the parameter, the others a ValueError naming the
rank), that nobody hangs in a collective, and that no input array was touched. Afterwards a
correct call must still work and match the interpreter (the ranks are not out of step).

Rank 0 prints one line per check, "OK <check>" or "FAIL <check>: <why>", and the job exits
0 when every check passed."""

from __future__ import annotations

import copy
import faulthandler
import sys
import traceback

import numpy as np

import cpu_reliability_worker  # beside this file (sys.path[0] for a script)

N = 13  # two ranks: m and v slices of 7 and 6 elements


def _snapshot(args: dict) -> dict:
    return {k: copy.deepcopy(v) for k, v in args.items()}


def _inputs(rank: int, size: int, schedule: str) -> dict:
    """This rank's correct arguments for adam[schedule] (g differs per rank, the rest not)."""
    from coconetc.ir.slices import slice_range
    rng = np.random.default_rng(1234)
    full = {k: rng.uniform(0.5, 1.5, N).astype(np.float32) for k in ("w", "m", "v")}
    g = np.random.default_rng(rank).uniform(0.5, 1.5, N).astype(np.float32)
    args = dict(g=g, **full, lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, step=3.0)
    if schedule == "zero":
        lo, hi = slice_range(N, size, rank)
        args["m"] = np.ascontiguousarray(full["m"][lo:hi])
        args["v"] = np.ascontiguousarray(full["v"][lo:hi])
    return args


def _expect(fn, rank, args, want_type, *needles, schedule="zero", groups=1) -> str | None:
    """None if the call raised want_type with every needle in its message and left the inputs
    as they were; else what went wrong (the check of cpu_reliability_worker.py)."""
    return cpu_reliability_worker._expect(fn, rank, args, want_type, needles, schedule, groups)


def check_full_m_everywhere(fn, rank, size):
    """(a) zero schedule: every rank passes the full-size m instead of its slice."""
    args = _inputs(rank, size, "zero")
    args["m"] = _inputs(rank, size, "default")["m"]
    return _expect(fn, rank, args, ValueError, "'m'")


def check_wrong_slice_on_rank0(fn, rank, size):
    """Rank 0 passes a 6-element slice of m, rank 1 a 7-element one: the sizes add up to N but
    the partition is wrong; both ranks must say so."""
    args = _inputs(rank, size, "zero")
    args["m"] = np.ones(6 if rank == 0 else 7, np.float32)
    return _expect(fn, rank, args, ValueError, "'m'")


def check_dtype_on_rank1(fn, rank, size):
    """(b) only rank 1 passes a float64 g: rank 1 raises TypeError naming 'g', rank 0 a
    ValueError naming rank 1."""
    args = _inputs(rank, size, "zero")
    if rank == 1:
        args["g"] = args["g"].astype(np.float64)
        return _expect(fn, rank, args, TypeError, "'g'")
    return _expect(fn, rank, args, ValueError, "rank 1")


def check_missing_on_rank0(fn, rank, size):
    """Only rank 0 forgets v."""
    args = _inputs(rank, size, "zero")
    if rank == 0:
        del args["v"]
        return _expect(fn, rank, args, TypeError, "'v'")
    return _expect(fn, rank, args, ValueError, "rank 0")


def check_replicated_size_differs(fn, rank, size):
    """Rank 1's g and w have 12 elements, rank 0's 13: consistent on rank 1 alone, not across."""
    args = _inputs(rank, size, "default")
    if rank == 1:
        args["g"], args["w"] = args["g"][:12].copy(), args["w"][:12].copy()
        args["m"], args["v"] = args["m"][:12].copy(), args["v"][:12].copy()
    return _expect(fn, rank, args, ValueError, "rank 1", schedule="default")


def check_bad_groups(fn, rank, size):
    """groups=3 on 2 ranks."""
    return _expect(fn, rank, _inputs(rank, size, "zero"), ValueError, "3", groups=3)


def check_still_in_step(fn, rank, size, comm, program):
    """After all those errors a correct call works on every rank and matches the interpreter."""
    from coconetc.oracle.compare import compare
    from coconetc.interp.interpreter import Result, run
    problems = []
    for sched in ("zero", "default"):
        mine = _inputs(rank, size, sched)
        everyone = comm.allgather(_snapshot(mine))
        out = fn(schedule=sched, **mine)
        if out is not None:
            return f"rank {rank}: adam returned {out!r}, expected None"
        got = Result({}, {t: mine[t] for t in ("w", "m", "v")}, None)
        gathered = comm.gather(got, root=0)
        if rank == 0:
            ir = fn._program(sched)
            ref = run(ir, everyone)
            problems += [f"[{sched}] {p}" for p in compare(ref, gathered, ir, ir)]
    problems = comm.bcast(problems, root=0)
    return "; ".join(problems[:5]) or None


CHECKS = [check_full_m_everywhere, check_wrong_slice_on_rank0, check_dtype_on_rank1,
          check_missing_on_rank0, check_replicated_size_differs, check_bad_groups]


def main() -> int:
    faulthandler.dump_traceback_later(100, exit=True)  # a hang shows where it is
    from mpi4py import MPI

    import coconetc
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size != 2:
        print(f"FAIL setup: run on 2 ranks, not {size}", flush=True)
        return 1
    fn = coconetc.load(sys.argv[1], log=lambda msg: None).adam
    failures = 0
    for check in [*CHECKS, check_still_in_step]:
        try:
            extra = (comm, "adam") if check is check_still_in_step else ()
            why = check(fn, rank, size, *extra)
        except Exception:  # noqa: BLE001 - report, keep going
            why = f"rank {rank}: {traceback.format_exc()}"
        whys = comm.gather(why, root=0)
        if rank == 0:
            bad = [w for w in whys if w]
            name = check.__name__.removeprefix("check_")
            print(f"FAIL {name}: {' | '.join(bad)}" if bad else f"OK {name}", flush=True)
            failures += bool(bad)
    failures = comm.bcast(failures, root=0)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
