"""One process, several threads: a GPT-2 block's forward and backward at one rank, coconet
(examples/gpt_block.ccn's `gpt_block` as a pipeline layer: its derived forward and backward
programs, coconetc.torch.pipeline.Layer) against nanoGPT's `Block` in torch eager (autograd,
`scaled_dot_product_attention`), the same weights, at B in --batches, S=128, H=256, 4 heads
(the pipeline bench's layer, bench/pipeline.py), f32.

Each thread count T in --threads runs in a process of its own (coconet's threads are read once,
at the first call: COCONET_THREADS=T; torch.set_num_threads(T)), the two sides interleaved,
medians of --reps steps after two warm-up steps. What it shows: with T > 1, coconet's generated
loops run on its own loop threads, which sleep between loops (runtime_cpp/coconet/loop_pool.h),
beside the BLAS library's threads (OpenMP's workers spun between loops, and took the cores the
GEMMs needed next: docs/performance.md).

With --cold, each step reads and writes 64 MiB between its forward and its backward (untimed),
so the backward finds its saved values, weights and gradients in memory, not in the caches, as
in a pipeline, where a micro-batch's backward runs long after its forward.

Run: python bench/block_threads.py [--threads 1,2] [--batches 1,2,4,8] [--reps 20] [--cold] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
H, NH, S = 256, 4, 128


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def median_ms(fn, reps: int) -> tuple[float, float, float]:
    """Medians in ms of FN()'s steps, its forwards and its backwards (FN returns the forward's and
    the backward's seconds), after two warm-up calls."""
    fn()
    fn()
    parts = [fn() for _ in range(reps)]
    return tuple(statistics.median(p) * 1e3 for p in ([f + b for f, b in parts], [f for f, _ in parts],
                                                        [b for _, b in parts]))  # type: ignore[return-value]


def one(threads: int, batches: list[int], reps: int, cold: bool = False) -> dict:
    """In this process (COCONET_THREADS already set): each batch's medians, coconet and torch;
    COLD: the caches flushed between each forward and its backward (64 MiB read and written)."""
    import coconetc  # noqa: F401  (before MPI starts: this process's shared-memory segment in a folder of its own)
    import torch
    torch.set_num_threads(threads)
    from mpi4py import MPI

    import nanogpt
    from coconetc.paths import source_path
    from coconetc.torch.gpt import block_parameters
    from coconetc.torch.pipeline import Block
    block = Block(source_path("gpt_block.ccn"), "gpt_block", comm=MPI.COMM_SELF)
    torch.manual_seed(0)
    ref = nanogpt.Block(nanogpt.GPTConfig(block_size=S, vocab_size=512, n_layer=1, n_head=NH, n_embd=H, dropout=0.0))
    ws = {k: v.clone().contiguous().requires_grad_(True) for k, v in block_parameters(ref, NH).items()}
    layer = block.layer(ws, scale=1 / math.sqrt(H // NH), pdrop=0.0, seed=0)
    junk = torch.ones(1 << 24)  # 64 MiB

    def between() -> None:
        if cold:
            junk.add_(1.0)
    out = {}
    for b in batches:
        x, dy = torch.randn(b, S, H), torch.randn(b, S, H)
        xt = x.clone().requires_grad_(True)
        y = layer.forward(0, x)
        dx = layer.backward(0, dy, False)
        y_ref = ref(xt)
        y_ref.backward(dy)
        err = max(float((y - y_ref).abs().max()), float((dx - xt.grad).abs().max()))
        if not err < 1e-4:
            raise SystemExit(f"B={b}: coconet's block differs from nanoGPT's by {err:.3g}")

        def coconet_step(x=x, dy=dy) -> tuple[float, float]:
            t0 = time.perf_counter()
            layer.forward(0, x)
            t1 = time.perf_counter()
            between()
            t2 = time.perf_counter()
            layer.backward(0, dy, False)
            return t1 - t0, time.perf_counter() - t2

        def torch_step(xt=xt, dy=dy) -> tuple[float, float]:
            t0 = time.perf_counter()
            y = ref(xt)
            t1 = time.perf_counter()
            between()
            t2 = time.perf_counter()
            y.backward(dy)
            return t1 - t0, time.perf_counter() - t2
        cc, tt = [], []
        for _ in range(3):  # (interleaved, a third of the reps each time)
            cc.append(median_ms(coconet_step, max(1, reps // 3)))
            tt.append(median_ms(torch_step, max(1, reps // 3)))
        out[b] = {"max_difference": err}
        for side, runs in (("coconet", cc), ("torch", tt)):
            for i, part in enumerate(("ms", "forward_ms", "backward_ms")):
                out[b][f"{side}_{part}"] = statistics.median(r[i] for r in runs)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=ints, default=[1, 2])
    ap.add_argument("--batches", type=ints, default=[1, 2, 4, 8])
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--cold", action="store_true", help="flush the caches between each forward and its backward")
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # (a child: this thread count)
    a = ap.parse_args()
    if a.one is not None:
        print(json.dumps(one(a.one, a.batches, a.reps, a.cold)))
        return 0
    results = {}
    for t in a.threads:
        env = {**os.environ, "COCONET_THREADS": str(t), "OMP_NUM_THREADS": str(t)}
        proc = subprocess.run([sys.executable, __file__, "--one", str(t), "--batches", ",".join(map(str, a.batches)),
                               "--reps", str(a.reps), *(["--cold"] if a.cold else [])], env=env, capture_output=True,
                              text=True)
        if proc.returncode:
            print(proc.stdout + proc.stderr, file=sys.stderr)
            return proc.returncode
        results[t] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\nGPT-2 block forward + backward at one rank, S={S}, H={H}, {NH} heads, f32; medians of {a.reps} "
          f"steps, ms (forward / backward: the medians of each){'; the caches flushed before each backward' if a.cold else ''}\n")
    print("| threads | B | coconet | torch eager | speed-up (torch / coconet) | coconet F / B | torch F / B "
          "| speed-up F / B |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for t, rows in results.items():
        for b, r in rows.items():
            print(f"| {t} | {b} | {r['coconet_ms']:.2f} | {r['torch_ms']:.2f} | {r['torch_ms'] / r['coconet_ms']:.2f}x "
                  f"| {r['coconet_forward_ms']:.2f} / {r['coconet_backward_ms']:.2f} "
                  f"| {r['torch_forward_ms']:.2f} / {r['torch_backward_ms']:.2f} "
                  f"| {r['torch_forward_ms'] / r['coconet_forward_ms']:.2f}x / "
                  f"{r['torch_backward_ms'] / r['coconet_backward_ms']:.2f}x |")
    if a.json:
        Path(a.json).write_text(json.dumps({"S": S, "H": H, "heads": NH, "reps": a.reps, "cold": a.cold, "cpus": os.cpu_count(),
                                            "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
