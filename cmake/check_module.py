"""Check a module built by CMake's coconet_add_module against coconetc's reference interpreter.

Run under mpiexec (every rank runs this script):

    mpiexec -n 2 python check_module.py build/sgd_mod.cpython-*.so examples/sgd.ccn --size N=17

Every rank imports the built extension (not coconetc's cached build), wraps it with coconetc's
calling convention (keyword arguments, argument checks), calls every program and every schedule
the module holds on the same random inputs as `coconetc run`, and rank 0 compares all ranks'
results with the interpreter. --expect lists the schedules the module must hold (per program,
'default' being the program itself), to check a SCHEDULES restriction. Exit 0 when everything
matches; a failing rank aborts the job."""

from __future__ import annotations

import argparse
import copy
import importlib.util
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

import numpy as np


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


def _import(path: str):
    name = Path(path).name.split(".")[0]
    spec = importlib.util.spec_from_file_location(name, path)
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    return ext


def _check(a, comm) -> int:
    from coconetc.runtime.loader import CompiledModule
    from coconetc.codegen.naming import function_name
    from coconetc.sourcefile import load_file
    from coconetc.oracle.core import adapt_inputs, compare, joined, random_inputs
    from coconetc.interp.interpreter import Result, run

    ext = _import(a.module)
    source = load_file(a.file)
    mod = CompiledModule(source, SimpleNamespace(module=ext.__name__), ext)
    sizes = {k: int(v) for k, v in (s.split("=") for s in a.size)}
    rank, R = comm.Get_rank(), comm.Get_size()
    held: dict[str, list[str]] = {}
    for prog, sched in source.variants():
        if hasattr(ext, function_name(prog, sched)):
            held.setdefault(prog, []).append(sched)
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
            s_inputs = adapt_inputs(inputs, base, ir, a.groups)
            mine = copy.deepcopy(s_inputs[rank])
            out = fn(schedule=sched, groups=a.groups, **mine)
            outs = out if isinstance(out, tuple) else (out,) if out is not None else ()
            res = ({pub: np.asarray(v) for (pub, _), v in zip(ir.outputs, outs)},
                   {t: np.asarray(joined(mine[t])).copy() for t, _ in ir.updates})
            gathered = comm.gather(res, root=0)
            if rank == 0:
                ref = run(ir, s_inputs, a.groups)
                got = [Result(o, u, ref[r].segments) for r, (o, u) in enumerate(gathered)]
                problems = compare(ref, got, ir, ir, a.groups)
                status = "MISMATCH" if problems else "matches the interpreter on every rank"
                print(f"{ext.__name__}.{prog} [{sched}]: {R} ranks, {sizes or 'default sizes'}: {status}",
                      flush=True)
                for prob in problems[:20]:
                    print(f"    {prob}", flush=True)
                bad += bool(problems)
    return comm.bcast(bad, root=0)


def main(argv=None) -> int:
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    try:
        return 1 if _check(_args(argv), comm) else 0
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - any failure must stop every rank, not hang the others
        sys.stderr.write(f"check_module rank {comm.Get_rank()} failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        comm.Abort(1)
        return 1


if __name__ == "__main__":
    sys.exit(main())
