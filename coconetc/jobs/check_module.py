"""Check a module built by CMake's coconet_add_module against coconetc's reference interpreter
(what cmake/check_module.py runs). Under mpiexec (every rank runs this):

    mpiexec -n 2 python -m coconetc.jobs.check_module build/sgd_mod.cpython-*.so examples/sgd.ccn --size N=17

Every rank imports the built extension (not coconetc's cached build), wraps it with coconetc's
calling convention (keyword arguments, argument checks), calls every program and every schedule
the module holds on the same random inputs as `coconetc run`, and rank 0 compares all ranks'
results with the interpreter. --expect lists the schedules the module must hold (per program,
'default' being the program itself), to check a SCHEDULES restriction. Exit 0 when everything
matches; a failing rank aborts the job."""

from __future__ import annotations

import argparse
import sys

from coconetc.codegen.naming import function_name
from coconetc.jobs.abort import stop_job_on_failure
from coconetc.jobs.modules import load_extension
from coconetc.jobs.verify import print_problems, verify_call
from coconetc.oracle.inputs import adapt_inputs, random_inputs


def _args(argv):
    ap = argparse.ArgumentParser(prog="check_module")
    ap.add_argument("module", help="the built extension module (.so)")
    ap.add_argument("file", help="the .ccn file it was generated from")
    ap.add_argument("--program", action="append", default=[], help="only these programs (default: all)")
    ap.add_argument("--size", action="append", default=[], metavar="NAME=INT")
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--expect", help="comma-separated schedules the module must hold, e.g. default,fused")
    return ap.parse_args(argv)


def _held(mod) -> dict[str, list[str]]:
    """The schedules of each program that the extension holds (SCHEDULES may leave some out)."""
    held: dict[str, list[str]] = {}
    for prog, sched in mod.source_module.variants():
        if hasattr(mod.ext, function_name(prog, sched)):
            held.setdefault(prog, []).append(sched)
    return held


def _check(a, comm) -> int:
    mod = load_extension(a.module, a.file)
    name, source = mod.ext.__name__, mod.source_module
    sizes = {k: int(v) for k, v in (s.split("=") for s in a.size)}
    rank, R = comm.Get_rank(), comm.Get_size()
    held = _held(mod)
    bad = 0
    for prog in a.program or list(source.programs):
        scheds = held.get(prog, [])
        if a.expect is not None and sorted(scheds) != sorted(a.expect.split(",")):
            if rank == 0:
                print(f"{prog}: the module holds schedules {scheds}, expected {a.expect.split(',')}")
            bad += 1
        fn, base = mod.programs[prog], source.programs[prog]
        inputs = random_inputs(base, R, a.groups, sizes, a.seed)
        for sched in scheds:
            ir = fn._program(sched)
            checked = verify_call(comm, fn, ir, adapt_inputs(inputs, base, ir, a.groups), a.groups,
                                  schedule=sched)
            if rank == 0:
                print(f"{name}.{prog} [{sched}]: {R} ranks, {sizes or 'default sizes'}: {checked.status}",
                      flush=True)
                print_problems(checked.problems)
            bad += bool(checked.problems)
    return bad


def main(argv=None) -> int:
    return stop_job_on_failure(lambda comm: 1 if _check(_args(argv), comm) else 0, "check_module")


if __name__ == "__main__":
    sys.exit(main())
