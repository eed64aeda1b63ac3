"""Run on R ranks by tests/test_fused_reductions.py: examples/scaled_adam.ccn compiled (CPU;
`emulate`: the CUDA module under the host emulation), the step skipped on inf/NaN under every
schedule, and taken (equal across schedules) without.

    python -m coconetc.cli launch -n R tests/fused_reductions_worker.py examples/scaled_adam.ccn [emulate]
Prints OK/FAIL lines on rank 0; exits non-zero on a failure."""

from __future__ import annotations

import faulthandler
import sys
import traceback

import numpy as np
from rank_checks import gathered_report


def main() -> int:
    emulate = len(sys.argv) > 2 and sys.argv[2] == "emulate"
    faulthandler.dump_traceback_later(400 if emulate else 100, exit=True)  # emulate: the module may be built
    from mpi4py import MPI

    import coconetc
    from coconetc.ir.slices import slice_range
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if emulate:  # the CUDA module under the host emulation
        from coconetc.runtime.cuda import load_emulated
        fn = load_emulated(sys.argv[1], log=lambda msg: None).programs["scaled_adam"]
    else:
        fn = coconetc.load(sys.argv[1], log=lambda msg: None).scaled_adam
    N = 3001
    lo, hi = slice_range(N, size, rank)
    rng = np.random.default_rng(7)  # the same on every rank: replicated values agree
    g_all = (rng.integers(-64, 64, (size, N)) / 16).astype(np.float16)  # sums exact in any order
    w0 = rng.standard_normal(N).astype(np.float32)
    m0 = rng.standard_normal(N).astype(np.float32) * 0.1
    v0 = np.abs(rng.standard_normal(N).astype(np.float32)) * 0.1
    scalars = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, step=3.0, scale=128.0)
    failures = 0

    def call(schedule: str, g: np.ndarray):
        sliced = schedule == "zero"
        part = (lambda a: a[lo:hi].copy()) if sliced else (lambda a: a.copy())
        w, m, v = part(w0), part(m0), (v0[lo:hi].copy() if sliced else v0.copy())
        w16 = w0.astype(np.float16)
        out = fn(g=g.copy(), w=w, w16=w16, m=m, v=v, **scalars, schedule=schedule)
        full = (lambda a: a) if not sliced else (lambda a: np.concatenate(comm.allgather(a)))
        return out, full(w), full(m), full(v), w16

    for what, poison in (("inf", np.inf), ("nan", np.nan), ("finite", None)):
        g = g_all[rank].copy()
        if poison is not None and rank == size - 1:
            g[N - 2] = poison  # in the last rank's slice of the reduced gradient
        results = {}
        for schedule in ("default", "rs_c_ag", "zero"):
            try:
                out, w, m, v, w16 = call(schedule, g)
                newscale, bad = (float(np.asarray(x)) for x in out)
                results[schedule] = (w, m, v, w16)
                if poison is not None:
                    assert bad > 0 and newscale == 64.0, (bad, newscale)
                    assert np.array_equal(w, w0) and np.array_equal(m, m0) and np.array_equal(v, v0)
                    assert np.array_equal(w16, w0.astype(np.float16))
                else:
                    assert bad == 0 and newscale == 128.0, (bad, newscale)
                    assert not np.array_equal(w, w0)
                why = ""
            except Exception:  # noqa: BLE001 - report, keep going
                why = f"rank {rank}: {traceback.format_exc()}"
            failures += gathered_report(comm, f"{what} {schedule}", why)
        if poison is None and len(results) == 3:
            ref = results["default"]
            for s in ("rs_c_ag", "zero"):
                same = all(np.allclose(a.astype(np.float32), b.astype(np.float32), rtol=1e-3, atol=1e-5)
                           for a, b in zip(ref, results[s]))
                if rank == 0:
                    print(f"{'OK' if same else 'FAIL'} finite {s} equals default", flush=True)
                failures += not same
    failures = comm.bcast(failures, root=0)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
