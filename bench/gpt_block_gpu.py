"""Forward + backward of the GPT-2 block (examples/gpt_block.ccn, program gpt_block) at one rank
on one GPU, against the same block in torch eager, side by side in one run:

  * torch eager, SDPA          the block in PyTorch with F.scaled_dot_product_attention(is_causal=True)
                               (what a PyTorch user runs; on a GPU a flash kernel that skips the
                               masked half of the scores)
  * torch eager                the block's own attention arithmetic: the whole S x S scores, the
                               causal mask, softmax, probabilities times v (nanoGPT's explicit path)
  * coconet gpt_block          coconetc.torch.function(backend="cuda"): the compiled forward under
                               each schedule named, the compiled derived backward
  * GEMMs alone                every matmul of the forward and backward, nothing else (the bound
                               the fused layer works towards)

At one rank the block's collectives are identities, so what differs is the computation: the
kernels fusion saves, the attention core, the host work per call. The issue's target (issue 40):
coconet at least 1.0x torch eager with SDPA.

One step: the block's forward on x (requiring its gradient, as a layer inside a model) and every
weight, then backward(dy); dropout 0 in every variant. Before timing, every variant's y and dx
are checked against the first's (relative 1e-3 in f32, 2e-2 in bf16). Times: medians over
--reps steps after a warm-up, each step timed to a CUDA synchronize.

Run: python bench/gpt_block_gpu.py [--dtype f32|bf16] [--b 8] [--s 512] [--h 1024] [--heads 16]
     [--schedules default] [--reps 10] [--json PATH]
bench/cuda_gpu_run.sh runs it on a GPU. Without a GPU, under COCONET_CUDA_EMULATE=1,
the CUDA module runs on the host emulation with CPU tensors (a check of the script at small
sizes: --b 1 --s 16 --h 32 --heads 2; its times mean nothing)."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import gpt_block as cpu_bench  # noqa: E402  (the block's weights and GEMMs, as the CPU benchmark has them)

PROGRAM = "gpt_block"


def torch_block(hd: int, sdpa: bool):
    """block(x, **w) -> y: the block in PyTorch at one rank (gpt_block.ccn's parameters)."""
    import torch.nn.functional as F
    scale = 1.0 / math.sqrt(hd)

    def block(x, ln1_w, ln1_b, wq, bq, wk, wv, bv, wo, bo, ln2_w, ln2_b, w_fc, b_fc, w_proj, b_proj):
        H = x.shape[-1]
        n1 = F.layer_norm(x, (H,), ln1_w, ln1_b, 1e-5)

        def heads(t):  # [B, S, nh * hd] -> [B, nh, S, hd]
            return t.view(*t.shape[:2], -1, hd).transpose(1, 2)
        q = heads(n1 @ wq.reshape(H, -1) + bq.reshape(-1))
        k = heads(n1 @ wk.reshape(H, -1))
        v = heads(n1 @ wv.reshape(H, -1) + bv.reshape(-1))
        o = cpu_bench.attention(q, k, v, scale, sdpa)
        x1 = x + o.transpose(1, 2).reshape(*x.shape[:2], -1) @ wo.reshape(-1, H) + bo
        n2 = F.layer_norm(x1, (H,), ln2_w, ln2_b, 1e-5)
        return x1 + F.gelu(n2 @ w_fc + b_fc) @ w_proj + b_proj
    return block


def variants(a: argparse.Namespace, dev: Any, dt: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each variant's step (forward + backward, to a synchronize on a GPU) and check (its y and
    dx), by label."""
    import torch

    import coconetc.torch as ct
    gpu = dev.type == "cuda"
    path = common.example_in_dtype("gpt_block.ccn", a.dtype, "f32")
    hd = a.h // a.heads
    full = cpu_bench.weights(a)
    gen = torch.Generator().manual_seed(2)
    x0, dy = (torch.randn(a.b, a.s, a.h, generator=gen).to(dev, dt) for _ in range(2))
    scalars = {"scale": 1.0 / math.sqrt(hd), "pdrop": 0.0, "seed": 1}
    steps: dict[str, Any] = {}
    checks: dict[str, Any] = {}

    def add(label: str, forward) -> None:
        x = x0.clone().requires_grad_(True)
        ws = {k: v.to(dev, dt).requires_grad_(True) for k, v in full.items()}

        def step():
            x.grad = None
            for w in ws.values():
                w.grad = None
            y = forward(x, ws)
            y.backward(dy)
            if gpu:
                torch.cuda.synchronize()
            return y
        steps[label] = step
        checks[label] = lambda: (step().detach().float(), x.grad.float())

    sdpa, eager = torch_block(hd, True), torch_block(hd, False)
    add("torch eager, SDPA", lambda x, ws: sdpa(x, **ws))
    add("torch eager", lambda x, ws: eager(x, **ws))
    for s in a.schedules.split(","):
        fn = ct.function(path, PROGRAM, schedule=s, backend="cuda")
        add(f"coconet gpt_block {s}", lambda x, ws, fn=fn: fn(x=x, **ws, **scalars))
    gemms = cpu_bench.gemms_alone({k: v.to(dev, dt) for k, v in full.items()}, a, 1)

    def gemm_step():
        gemms()
        if gpu:
            torch.cuda.synchronize()
    steps["GEMMs alone"] = gemm_step
    return steps, checks


def check(checks: dict[str, Any], tol: float) -> None:
    """Every variant's y and dx against the first's (relative to its largest element)."""
    ref = None
    for label, fn in checks.items():
        y, dx = fn()
        if ref is None:
            ref = (y, dx)
            continue
        for name, got, want in (("y", y, ref[0]), ("dx", dx, ref[1])):
            err = float((got - want).abs().max() / want.abs().max())
            if err > tol:
                raise SystemExit(f"{label}: {name} differs from the first variant's by {err:.2e} (relative)")


def run(a: argparse.Namespace) -> dict[str, Any]:
    import torch
    gpu = torch.cuda.is_available()
    dev = torch.device("cuda" if gpu else "cpu")  # (no GPU: the host emulation, CPU tensors)
    steps, checks = variants(a, dev, {"f32": torch.float32, "bf16": torch.bfloat16}[a.dtype])
    check(checks, 2e-2 if a.dtype == "bf16" else 1e-3)
    times: dict[str, list[float]] = {k: [] for k in steps}
    for rep in range(a.reps + 1):  # interleaved: a burst hits every variant alike; the first round warms up
        for label, step in steps.items():
            t0 = time.perf_counter()
            step()
            if rep:
                times[label].append(time.perf_counter() - t0)
    return {"times": {k: statistics.median(v) for k, v in times.items()},
            "device": torch.cuda.get_device_name() if gpu else "host emulation (COCONET_CUDA_EMULATE=1)",
            "shape": {"B": a.b, "S": a.s, "H": a.h, "NH": a.heads, "HD": a.h // a.heads, "F": a.ffn * a.h}}


def report(res: dict[str, Any], a: argparse.Namespace) -> None:
    times = res["times"]
    sdpa, bound = times["torch eager, SDPA"], times["GEMMs alone"]
    sh = res["shape"]
    print(f"\ngpt_block forward + backward at one rank, {a.dtype}, {res['device']}, "
          + " ".join(f"{k}={v}" for k, v in sh.items()) + f"; median of {a.reps} steps")
    width = max(map(len, times)) + 2
    print(f"{'variant':{width}s} {'ms':>9s} {'SDPA / this':>12s} {'GEMMs alone / this':>19s}")
    ratios = {}
    for k, v in times.items():
        ratios[k] = {"vs_torch_sdpa": sdpa / v, "gemm_fraction": bound / v}
        print(f"{'  ' + k:{width}s} {v * 1e3:9.3f} {sdpa / v:12.2f} {bound / v:19.2f}")
    out = Path(a.json) if a.json else common.HERE / "results" / f"gpt_block_gpu_{a.dtype}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"dtype": a.dtype, "reps": a.reps, **res, "ratios": ratios}, indent=2))
    print(f"\nwrote {out}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=("f32", "bf16"), default="f32")
    cpu_bench.shape_arguments(ap)
    ap.add_argument("--schedules", default="default", help="gpt_block's forward schedules to time, comma-separated")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    cpu_bench.checked_shape(a)
    common.setup_rank()
    report(run(a), a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
