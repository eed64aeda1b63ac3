"""MPI's own collectives between the ranks of one node, against a copy of the same bytes: what
the cost model's per-algorithm rates rest on (coconetc/plan/cost.py, Machine; docs/performance.md).

Run: python bench/collectives.py [--ranks 2] [--sizes 12,16,20,22] [--reps 9]
It relaunches itself under mpiexec; rank 0 prints, per size (log2 of the f32 elements), each
collective's median time (the slowest rank's, interleaved repetitions: bench/common.py) and
its input's bytes per second, and writes bench/results/collectives.json. Open MPI's
MPI_Reduce_scatter is the slow one here (quiet, 2 ranks: 1.8 to 2.8 GB/s of its input at 4 to
16 MiB, where a copy runs at 10 to 14 GB/s and MPI_Allgather at 8 to 12; under load 0.4): the CPU runtime runs reduce-scatters of 16 KiB and more through the
node's shared window instead (runtime_cpp/coconet/fused_shm.h), and the model counts MPI's at
Machine.mpi_reduce_scatter_bw where it still runs (small messages, a label's @p2p)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402


def _calls(comm, n: int) -> dict:
    """Each collective (and the copy) of n f32 elements, as a call without arguments."""
    x = np.ones(n, np.float32)
    y = np.empty(n, np.float32)
    s = np.empty(n // comm.Get_size(), np.float32)
    return {
        "copy (NumPy)": lambda: np.copyto(y, x),
        "MPI_Allreduce": lambda: comm.Allreduce(x, y),
        "MPI_Reduce_scatter": lambda: comm.Reduce_scatter_block(x, s),
        "MPI_Allgather": lambda: comm.Allgather(s, y),
        "MPI_Bcast": lambda: comm.Bcast(y, root=0),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--sizes", default="12,16,20,22", help="log2 of the f32 elements, comma-separated")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not common.in_mpi_job():
        return common.relaunch(args.ranks, __file__, [])
    comm = common.setup_rank()
    R = comm.Get_size()
    results = {}
    for size in common.sizes_arg(args.sizes):
        n = (size // R) * R
        t = common.timed_all(comm, _calls(comm, n), common.reps_for(n, args.reps))
        results[n] = {name: {"seconds": v, "input_Bps": n * 4 / v} for name, v in t.items()}
    if comm.Get_rank() == 0:
        for n, r in results.items():
            print(f"\nf32 N = {n}, {R} ranks ({n * 4} bytes)")
            print(f"{'collective':20s} {'ms':>10s} {'GB/s of the input':>18s}")
            for name, v in r.items():
                print(f"{name:20s} {v['seconds'] * 1e3:10.3f} {v['input_Bps'] / 1e9:18.2f}")
        out = Path(args.json) if args.json else HERE / "results" / "collectives.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"ranks": R, "sizes": {str(n): r for n, r in results.items()}}, indent=2))
        print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
