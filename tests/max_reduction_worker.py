"""Run on R ranks by tests/test_max_reduction.py: the `mm` program of that test (max(g1),
min(g1 * w), norm(g1) of an all-reduced gradient) compiled for the CPU (`emulate`: for CUDA,
under the host emulation), every schedule (the plain one, split and reordered, and the fused
one) against NumPy, with a NaN, an inf and a -inf in one rank's gradient and with finite values
(exact: the gradients are multiples of 1/16).

    coconetc launch -n R tests/max_reduction_worker.py FILE N [emulate]
Prints OK/FAIL lines on rank 0; exits non-zero on a failure."""

from __future__ import annotations

import faulthandler
import sys
import traceback

import numpy as np
from rank_checks import gathered_report


def main() -> int:
    faulthandler.dump_traceback_later(200, exit=True)
    from mpi4py import MPI

    import coconetc
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if len(sys.argv) > 3 and sys.argv[3] == "emulate":  # the CUDA module under the host emulation
        from coconetc.runtime.cuda import load_emulated
        fn = load_emulated(sys.argv[1], log=lambda msg: None).programs["mm"]
    else:
        fn = coconetc.load(sys.argv[1], log=lambda msg: None).mm
    N = int(sys.argv[2])
    rng = np.random.default_rng(11)  # the same on every rank: replicated values agree
    g_all = (rng.integers(-64, 64, (size, N)) / 16).astype(np.float32)
    w0 = (rng.integers(-8, 8, N) / 4).astype(np.float32)
    failures = 0
    for what, poison in (("finite", None), ("nan", np.nan), ("inf", np.inf), ("-inf", -np.inf)):
        g = g_all.copy()
        if poison is not None:
            g[size - 1, N - 1] = poison  # in the last rank's slice of the reduced gradient
        g1 = g.sum(axis=0, dtype=np.float32)
        want = (np.max(g1), np.min(g1 * w0))
        for schedule in ("default", "plain", "fused"):
            try:
                hi, lo = (float(np.asarray(x)) for x in fn(g=g[rank].copy(), w=w0.copy(), lr=0.5, schedule=schedule))
                np.testing.assert_array_equal(np.array([hi, lo]), np.array(want, dtype=np.float64))
                why = ""
            except Exception:  # noqa: BLE001 - report, keep going
                why = f"rank {rank}: {traceback.format_exc()}"
            failures += gathered_report(comm, f"{what} {schedule}", why)
    failures = comm.bcast(failures, root=0)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
