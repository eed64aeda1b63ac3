"""The fixed cost of one call of a compiled module: examples/adam.ccn at N = 1, so that the
time is the Python side (argument checks, the cross-rank agreement at the call's entry, the
watchdog) plus the runtime's own collectives, not the arithmetic: calls with the same buffers
each time (an optimizer's step: the hot path) and with new buffers of the same shapes (a layer
called with each step's activations: the warm path).

Run: python bench/call_overhead.py [--ranks 2] [--reps 2000]
It relaunches itself under mpiexec; rank 0 prints a table of medians and minimums over
batches of 10 calls (microseconds per call, the slowest rank) and writes
bench/results/call_overhead.json. For a before/after comparison, run it once with this tree
and once with PYTHONPATH pointing at another checkout (the table names the coconetc it
imported). References measured in the same run: an mpi4py allgather of a
small dict (what a pickled exchange costs) and an MPI barrier. Two rows time a layer of
examples/gpt_block.ccn at tiny sizes (H = 16) as a pipeline stage calls it
(coconetc.torch.pipeline's Layer: its forward, then its backward adding into .grad, 17 and 23
tensors a call, new activations each time), the second with an input that requires grad every
other call (kinds that alternate, as where a stage's first layer takes a tensor that requires
grad and the others do not). The last two rows are the default schedule's calls again under
`coconetc.trace` (tracing on)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ADAM = HERE.parent / "examples" / "adam.ccn"
GPT_BLOCK = HERE.parent / "examples" / "gpt_block.ccn"


def _run_python():
    try:
        from coconetc.launch.mpiexec import run_python
    except ImportError:  # an older checkout (before the launcher moved)
        from coconetc.toolchain.launch import run_python  # type: ignore[no-redef]
    return run_python


def _per_call(comm, fn, reps: int, batch: int = 10) -> tuple[float, float]:
    """(median, minimum) over batches of `batch` back-to-back calls of the time per call, the
    slowest rank's, in seconds. On a loaded machine the minimum is the batch least disturbed
    by other processes (ranks that wait for each other suffer most from being descheduled)."""
    from mpi4py import MPI
    for _ in range(20):
        fn()
    times = []
    for _ in range(max(1, reps // batch)):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        times.append((time.perf_counter() - t0) / batch)
    return (comm.allreduce(statistics.median(times), op=MPI.MAX),
            comm.allreduce(min(times), op=MPI.MAX))


def _adam(mod, sched: str, comm, n: int):
    R, r = comm.Get_size(), comm.Get_rank()
    c = -(-n // R)
    mine = max(0, min(n, (r + 1) * c) - min(n, r * c))
    arrays = {k: np.ones(n, np.float32) for k in "gwmv"}
    if sched == "zero":
        arrays["m"], arrays["v"] = np.ones(mine, np.float32), np.ones(mine, np.float32)
    args = dict(**arrays, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, step=1.0)
    return lambda: mod.adam(schedule=sched, **args)


def _adam_new(mod, comm, n: int, torch_tensors: bool):
    """adam(default) with new buffers of the same shapes each call (a layer called with each
    step's activations): the sets of buffers made beforehand, more than a function remembers."""
    make = (lambda: __import__("torch").ones(n)) if torch_tensors else (lambda: np.ones(n, np.float32))
    sets = [{k: make() for k in "gwmv"} for _ in range(100)]
    it = iter(range(1 << 62))
    return lambda: mod.adam(**sets[next(it) % len(sets)], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, step=1.0)


def _layer(alternate: bool):
    """A gpt_block layer's forward and backward (one rank: COMM_SELF), as a pipeline calls
    them, at B=1, T=4, H=16, 2 heads; ALTERNATE: every other input requires grad."""
    import torch
    from mpi4py import MPI

    from coconetc.torch.pipeline import Block
    H, NH, F, T = 16, 2, 64, 4
    shapes = {"ln1_w": [H], "ln1_b": [H], "wq": [H, NH, H // NH], "bq": [NH, H // NH],
              "wk": [H, NH, H // NH], "wv": [H, NH, H // NH], "bv": [NH, H // NH],
              "wo": [NH, H // NH, H], "bo": [H], "ln2_w": [H], "ln2_b": [H],
              "w_fc": [H, F], "b_fc": [F], "w_proj": [F, H], "b_proj": [H]}
    g = torch.Generator().manual_seed(0)
    block = Block(GPT_BLOCK, "gpt_block", comm=MPI.COMM_SELF)
    layer = block.layer(block.parts({n: torch.randn(*s, generator=g) * 0.1 for n, s in shapes.items()}),
                        scale=(H // NH) ** -0.5, pdrop=0.0, seed=0)
    x, dy = torch.randn(1, T, H, generator=g), torch.randn(1, T, H, generator=g)
    it = iter(range(1 << 62))

    def step() -> None:
        h = x.clone().requires_grad_(alternate and next(it) % 2 == 1)
        layer.forward(0, h)
        layer.backward(0, dy, False)
    return step


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--n", type=int, default=1)
    ap.add_argument("--out", default="call_overhead")
    a = ap.parse_args()
    if "OMPI_COMM_WORLD_SIZE" not in os.environ and "PMI_SIZE" not in os.environ:
        import coconetc
        coconetc.load(ADAM)  # build once, before the ranks start
        coconetc.load(GPT_BLOCK, grad=("gpt_block:x",))
        return _run_python()(a.ranks, [__file__, *sys.argv[1:]])
    os.environ.setdefault("COCONET_THREADS", "1")
    import coconetc
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    mod = coconetc.load(ADAM, log=lambda msg: None)
    small = {"shapes": {k: (a.n,) for k in "gwmv"}, "scalars": [1e-3, 0.9, 0.999, 1e-8, 1.0]}
    rows = [("mpi4py allgather of a small dict", _per_call(comm, lambda: comm.allgather(small), a.reps)),
            ("MPI barrier", _per_call(comm, comm.Barrier, a.reps))]
    for sched in ("default", "zero", "fused"):
        rows.append((f"adam(schedule={sched!r}), N = {a.n}", _per_call(comm, _adam(mod, sched, comm, a.n), a.reps)))
    rows.append((f"adam(), N = {a.n}, new arrays each call", _per_call(comm, _adam_new(mod, comm, a.n, False), a.reps)))
    try:
        rows.append((f"adam(), N = {a.n}, new CPU tensors each call",
                     _per_call(comm, _adam_new(mod, comm, a.n, True), a.reps)))
        rows.append(("a pipeline layer (gpt_block, H = 16): forward + backward, new activations",
                     _per_call(comm, _layer(False), a.reps)))
        rows.append(("the same, every other input requiring grad", _per_call(comm, _layer(True), a.reps)))
    except ImportError:
        pass
    # the same two calls traced (docs/tracing.md): each call's units recorded and kept, the
    # files written into a folder of this rank's own when the block ends, then removed
    folder = tempfile.mkdtemp(prefix="coconet-trace-")
    try:
        with coconetc.trace(folder):
            rows.append((f"adam(schedule='default'), N = {a.n}, traced",
                         _per_call(comm, _adam(mod, "default", comm, a.n), a.reps)))
            rows.append((f"adam(), N = {a.n}, new arrays each call, traced",
                         _per_call(comm, _adam_new(mod, comm, a.n, False), a.reps)))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if comm.Get_rank() == 0:
        where = str(Path(coconetc.__file__).resolve().parent.parent)
        width = max(len(n) for n, _ in rows)
        print(f"call overhead: {comm.Get_size()} ranks, median per call of the slowest rank, "
              f"{a.reps} calls each; coconetc from {where}")
        print(f"{'':{width}s} {'median':>10s} {'min':>10s}")
        for label, (med, best) in rows:
            print(f"{label:{width}s} {med * 1e6:10.1f} {best * 1e6:10.1f} us")
        out = HERE / "results"
        out.mkdir(exist_ok=True)
        (out / f"{a.out}.json").write_text(json.dumps(
            {"ranks": comm.Get_size(), "reps": a.reps, "n": a.n, "coconetc": where,
             "seconds_median_min": dict(rows)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
