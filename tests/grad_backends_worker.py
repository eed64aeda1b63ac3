"""What each rank runs for tests/test_grad_backends.py (under mpiexec): every program of a file of
derived (vector-Jacobian) programs, compiled for the CPU backend or the CUDA backend under the
host emulation (already built by the test), called once on random inputs and compared with the
interpreter on rank 0.

    cpu FILE [SYM=N]... [-- SYM=N...]...       the CPU module (coconetc.load)
    emulate FILE [SYM=N]... [-- SYM=N...]...   the CUDA module under the host emulation
(SYM=N: the size of a size symbol in every program that has it; each set of sizes after a `--`
runs every program again, in the same launch)

Prints `MATCH <program>` or `MISMATCH <program> <problems>` per program and set of sizes (rank 0);
under the emulation then `COUNTS index32=N index64=M`: rank 0's kernels launched with 32- and
64-bit indices in this launch (over every set)."""

from __future__ import annotations

import sys

import coconetc.autodiff  # noqa: F401  (registers the derived programs' operations)
from coconetc.jobs.abort import stop_job_on_failure
from coconetc.jobs.modules import load_cpu, load_emulated
from coconetc.jobs.verify import verify_call
from coconetc.oracle.inputs import random_inputs


def main(comm) -> int:
    backend, file = sys.argv[1], sys.argv[2]
    sets: list[dict[str, int]] = [{}]
    for a in sys.argv[3:]:
        if a == "--":
            sets.append({})
        else:
            k, v = a.split("=")
            sets[-1][k] = int(v)
    mod = load_emulated(file) if backend == "emulate" else load_cpu(file)
    rank, R = comm.Get_rank(), comm.Get_size()
    # the counts are the process's (a pool rank may have run this module before): this launch's
    # are the difference
    before = mod.ext.emulation_counts() if backend == "emulate" else None
    bad = 0
    for sizes in sets:
        for name, fn in mod.programs.items():
            ir = mod.source_module.programs[name]
            inputs = random_inputs(ir, R, 1, sizes, seed=3)
            problems = verify_call(comm, fn, ir, inputs).problems
            if rank == 0:
                print(f"MATCH {name}" if not problems else f"MISMATCH {name} {problems[:4]}", flush=True)
            bad += bool(problems)
    if backend == "emulate" and rank == 0:
        c = {k: v - before[k] for k, v in mod.ext.emulation_counts().items()}
        print(f"COUNTS index32={c['index32_kernels']} index64={c['index64_kernels']}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(stop_job_on_failure(main, "grad_backends_worker"))
