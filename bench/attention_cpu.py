"""The CPU runtime's fused causal attention (runtime_cpp/coconet/attention.h) against PyTorch, one
thread, f32: forward + backward at batch B x H heads, S x S scores, head dim 64, median of 5
after one warm-up.

  * coconet: bench/attention_cpu.cpp built with a CPU module's flags (-O3 -march=native
    -fno-math-errno) against the CPU modules' BLAS (MKL on an Intel CPU, else OpenBLAS), the forward saving p (or s, or p and a,
    or s and a) for the backward, or saving p for a backward that reads it as a backward program's
    input (every entry of it, and A = p: a GPT block's backward program); with and without dropout;
  * torch pieces: q @ k^T * scale, masked_fill(-inf), softmax, @ v, and their backward;
  * torch SDPA: F.scaled_dot_product_attention(is_causal=True);
  * torch's six full GEMMs of forward + backward alone (q k^T, p v, g v^T, dS k, dS^T q, p^T g),
    the work the pieces do in GEMMs.

Run: python bench/attention_cpu.py [--b 8] [--heads 8] [--s 512]"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def build() -> Path:
    """bench/attention_cpu.cpp compiled into the temp directory, against the BLAS the CPU modules
    link here (probes.blas_libraries: MKL on an Intel CPU, else OpenBLAS)."""
    from coconetc.codegen.cpu import CXX_FLAGS
    from coconetc.toolchain import probes

    libs, macros = probes.blas_libraries()
    rpaths = sorted({f"-Wl,-rpath,{Path(lib).parent}" for lib in libs if not lib.startswith("-")})
    exe = Path(tempfile.gettempdir()) / "coconet_bench_attention_cpu"
    cmd = [os.environ.get("CXX", "g++"), *CXX_FLAGS, "-std=c++17", "-DCOCONET_NO_MPI",
           *(f"-D{m}" for m in macros), f"-I{ROOT / 'runtime_cpp'}", str(HERE / "attention_cpu.cpp"),
           *libs, *rpaths, "-o", str(exe)]
    subprocess.run(cmd, check=True)
    return exe


def ours(exe: Path, drop: float, mode: int, s: int, batch: int) -> str:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    out = subprocess.run([str(exe), str(drop), str(mode), str(s), str(batch)], check=True,
                         capture_output=True, text=True, env=env)
    return out.stdout.strip()


def median_ms(f, reps: int = 6) -> float:
    times = []
    for rep in range(reps):
        t0 = time.perf_counter()
        f()
        if rep:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def torch_rows(b: int, h: int, s: int) -> list[tuple[str, float]]:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    q, k, v, go = (torch.rand(b, h, s, 64, generator=gen) * 2 - 1 for _ in range(4))
    keep = torch.ones(s, s, dtype=torch.bool).tril()
    scale = 64 ** -0.5

    def pieces(q, k, v):
        sc = (q @ k.transpose(-1, -2) * scale).masked_fill(~keep, float("-inf"))
        return torch.softmax(sc, -1) @ v

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    def fwd_bwd(f):
        def run():
            qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
            f(qq, kk, vv).backward(go)
        return run

    def gemms():
        p = q @ k.transpose(-1, -2)
        ds = go @ v.transpose(-1, -2)
        return p @ v, ds @ k, ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ go

    return [("torch pieces fwd+bwd", median_ms(fwd_bwd(pieces))),
            ("torch SDPA is_causal fwd+bwd", median_ms(fwd_bwd(sdpa))),
            ("torch six full GEMMs alone", median_ms(gemms))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--b", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--s", type=int, default=512)
    args = ap.parse_args()
    exe = build()
    print(f"batch {args.b} x {args.heads} heads, S = {args.s}, head dim 64, f32, one thread")
    for drop, mode in ((0.0, 0), (0.0, 4), (0.0, 1), (0.0, 2), (0.0, 3), (0.1, 0), (0.1, 2), (0.1, 3)):
        print("coconet fused", ours(exe, drop, mode, args.s, args.b * args.heads))
    for name, ms in torch_rows(args.b, args.heads, args.s):
        print(f"{name}: {ms:.1f} ms (median of 5)")


if __name__ == "__main__":
    main()
