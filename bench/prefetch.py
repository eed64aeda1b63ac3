"""A model of sharded layers with and without prefetched weight gathers, side by side in one run:
examples/sharded_mlp.ccn's `sharded_model` (three layers, each gathering its two weights where it
uses them: FSDP) under the default schedule (each gather at its place, blocking) and under
`prefetched` (prefetch(depth=2): each gather started two gathers ahead, a non-blocking MPI
all-gather tested after each unit), f32, at each size of --sizes (B,H,F), forward only and the
derived program (forward and backward), on --ranks ranks, one thread a rank.

Per size: the median of --reps calls (the slowest rank's, interleaved rounds: bench/common.py
timed_all) of each schedule, and default / prefetched.

Run: python bench/prefetch.py [--ranks 2] [--sizes 256,1024,2048:512,1024,4096] [--reps 9] [--json PATH]
It relaunches itself on --ranks ranks; rank 0 prints the table."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from common import ROOT, in_mpi_job, relaunch, setup_rank, timed_all

FILE = "sharded_mlp.ccn"


def sizes(text: str) -> list[tuple[int, int, int]]:
    out = []
    for part in text.split(":"):
        b, h, f = (int(v) for v in part.split(","))
        out.append((b, h, f))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--sizes", type=sizes, default=sizes("256,1024,2048:512,1024,4096"))
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not in_mpi_job():
        import coconetc
        coconetc.load(ROOT / "examples" / FILE, grad=("sharded_model",))
        return relaunch(a.ranks, __file__, [])
    comm = setup_rank()
    import coconetc
    from coconetc.ir.slices import slice_range
    mod = coconetc.load(ROOT / "examples" / FILE, grad=("sharded_model",), log=lambda m: None)
    R, r = comm.Get_size(), comm.Get_rank()
    rows = []
    for b, h, f in a.sizes:
        rng = np.random.default_rng(r)

        def part(n: int) -> int:
            lo, hi = slice_range(n, R, r)
            return hi - lo
        x = (rng.standard_normal((part(b), h)) * 0.1).astype(np.float32)
        w1 = (rng.standard_normal((3, part(h), f)) * 0.02).astype(np.float32)
        w2 = (rng.standard_normal((3, part(f), h)) * 0.02).astype(np.float32)
        dy = rng.standard_normal((part(b), h)).astype(np.float32)
        fns = {}
        args = dict(x=x, w1=w1, w2=w2)
        for s in ("default", "prefetched"):
            fns[("forward", s)] = lambda s=s, a=args: mod.sharded_model(schedule=s, **a)
            fns[("forward + backward", s)] = lambda s=s, a=args, dy=dy: mod.sharded_model_grad(schedule=s, **a, d_y=dy)
        got = timed_all(comm, fns, a.reps)
        for what in ("forward", "forward + backward"):
            d, p = got[(what, "default")], got[(what, "prefetched")]
            rows.append({"B": b, "H": h, "F": f, "what": what, "default_s": d, "prefetched_s": p, "ratio": d / p})
    if r == 0:
        print(f"\nsharded_model (examples/{FILE}): 3 layers, weights sliced over {R} ranks, f32; median of {a.reps} "
              "calls, the slowest rank, ms\n")
        print("| B | H | F | call | default (gathers at their place) | prefetched (depth 2) | default / prefetched |")
        print("| ---: | ---: | ---: | --- | ---: | ---: | ---: |")
        for x in rows:
            print(f"| {x['B']} | {x['H']} | {x['F']} | {x['what']} | {x['default_s'] * 1e3:.2f} | "
                  f"{x['prefetched_s'] * 1e3:.2f} | {x['ratio']:.2f}x |")
        if a.json:
            Path(a.json).write_text(json.dumps({"ranks": R, "reps": a.reps, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
