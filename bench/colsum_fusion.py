"""Column sums fused with the pointwise loop that produces their input (coconetc/plan/colsums.py),
on the CPU: the derived backward of examples/tp_mlp.ccn (tp_mlp_grad: d_b1 summed by gelu's
backward loop) and of examples/gpt_block.ccn (gpt_block_grad: d_b_proj, d_b_fc and d_bo summed by
their loops), each built twice from the same compiler, side by side in one run on R ranks:

  * fused      the plan as it is (`coconetc show FILE -p P --grad --format plan`: "column sums")
  * unfused    the same plan with plan/colsums.ON = () (the sum_lead after the loop, as before)

Both are checked against each other (the same gradients to f32 rounding: the sums' order differs)
before timing. The rest of
the backward (GEMMs, collectives) is the same in both, so the difference is the pass the fusion
saves: the sum_lead's read of g.
Run: python bench/colsum_fusion.py [--ranks 2] [--reps 10] [--json PATH]"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

# (file, derived program, sizes): MLP-shaped, where the bias gradients' inputs are large next to
# the GEMMs (H small against B * S and F)
CASES = [("tp_mlp.ccn", "tp_mlp_grad", {"B": 8, "S": 512, "H": 64, "F": 4096}),
         ("gpt_block.ccn", "gpt_block_grad", {"B": 4, "S": 256, "H": 256, "NH": 4, "HD": 64, "F": 4096})]


def build(file: str, fused: bool, log=None):
    """The CPU module of FILE with its derived programs, the column sums fused or not."""
    from coconetc import sourcefile
    from coconetc.plan import colsums
    from coconetc.runtime.loader import compile_cpu, wrap
    path = common.ROOT / "examples" / file
    keep = colsums.ON
    colsums.ON = keep if fused else ()
    try:
        return wrap(compile_cpu(sourcefile.load_source(path.read_text(), str(path)), log))
    finally:
        colsums.ON = keep


def run_case(comm, file: str, prog: str, sizes: dict[str, int], reps: int) -> dict:
    from coconetc.oracle.inputs import random_inputs
    mods = {k: build(file, k == "fused") for k in ("fused", "unfused")}
    ir = mods["fused"].source_module.programs[prog]
    args = random_inputs(ir, comm.Get_size(), 1, sizes, seed=1)[comm.Get_rank()]
    fns = {k: (lambda m=m: m.programs[prog](**args)) for k, m in mods.items()}
    outs = {k: fn() for k, fn in fns.items()}
    for a, b in zip(outs["fused"], outs["unfused"]):  # f32 sums of thousands of rows in another order
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4 * float(np.abs(b).max(initial=1.0)))
    t = common.timed_all(comm, fns, reps)
    return {"sizes": sizes, "seconds": t, "unfused_over_fused": t["unfused"] / t["fused"]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not common.in_mpi_job():
        for file, _, _ in CASES:  # build both variants once, before the ranks start
            for fused in (True, False):
                build(file, fused, log=print)
        from coconetc.launch.mpiexec import run_python
        return run_python(a.ranks, [__file__, *sys.argv[1:]])
    comm = common.setup_rank()
    results = {prog: run_case(comm, file, prog, sizes, a.reps) for file, prog, sizes in CASES}
    if comm.Get_rank() == 0:
        print(f"column sums fused with their loop, CPU, {comm.Get_size()} ranks, f32, medians of {a.reps} "
              "(the slowest rank's)")
        print(f"{'program':<16} {'sizes':<44} {'fused ms':>9} {'unfused ms':>11} {'unfused/fused':>14}")
        for prog, r in results.items():
            sz = ", ".join(f"{k}={v}" for k, v in r["sizes"].items())
            print(f"{prog:<16} {sz:<44} {r['seconds']['fused'] * 1e3:>9.2f} {r['seconds']['unfused'] * 1e3:>11.2f} "
                  f"{r['unfused_over_fused']:>14.3f}")
        if a.json:
            Path(a.json).write_text(json.dumps({"ranks": comm.Get_size(), "reps": a.reps, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
