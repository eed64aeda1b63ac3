"""The BLAS the CPU modules link, chosen by measurement: single-precision GEMMs at the shapes a
GPT block and a pipeline micro-batch run (tokens x H by H x 3H, 4H and their transposes, as a
forward and a backward compute them), one thread, through each BLAS coconet can link (MKL from
the `mkl` wheel, OpenBLAS from scipy-openblas32, called as the runtime calls them: CBLAS,
row-major) and torch.matmul (what the PyTorch baselines run), interleaved repetition by
repetition, medians.

Run: python bench/blas.py [--reps 9] [--json PATH]
Prints a table of GFLOP/s and the time ratios against torch.matmul per shape, and the ratio of
the total times; writes bench/results/blas.json (or PATH)."""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
# (M, K, N): M tokens; GPT-2 blocks of H = 256 and 1024 split over 2 ranks (qkv, proj, fc, fc2),
# at 8 x 512 tokens (the block bench) and at a pipeline micro-batch's 1 and 2 x 128
SHAPES = [(m, k, n) for m in (128, 256, 1024) for k, n in ((256, 384), (128, 256), (256, 512), (512, 256))] + \
    [(4096, 1024, 1536), (4096, 512, 1024), (4096, 1024, 2048), (4096, 2048, 1024)]
TRANS = ((False, False), (False, True), (True, False))  # A B, A B^T (a forward), A^T B (a weight gradient)


def _libraries() -> dict[str, ctypes.CDLL]:
    """Each BLAS the toolchain can link, loaded (MKL only where its wheel is installed)."""
    from coconetc.toolchain import probes
    out = {}
    mkl = probes.mkl_libs()
    if mkl:  # its single dynamic library (the same kernels as the libraries the modules link), sequential
        out["mkl"] = ctypes.CDLL(str(sorted(Path(mkl[0]).parent.glob("libmkl_rt.so*"))[0]))
        out["mkl"].MKL_Set_Threading_Layer(1)  # MKL_THREADING_SEQUENTIAL, before any other call
    out["openblas"] = ctypes.CDLL(probes.openblas_lib())
    return out


def _sgemm(lib: ctypes.CDLL):
    f = getattr(lib, "cblas_sgemm", None) or lib.scipy_cblas_sgemm
    p = ctypes.c_void_p
    f.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, p, ctypes.c_int, p, ctypes.c_int, ctypes.c_float, p, ctypes.c_int]
    return f


def _runs(m: int, k: int, n: int, ta: bool, tb: bool, gemms: dict, rng: np.random.Generator) -> dict:
    """One call of C[M, N] = op(A) op(B) (TA, TB: transposed) through torch.matmul and each BLAS."""
    import torch
    x = rng.standard_normal((k, m) if ta else (m, k), dtype=np.float32)
    y = rng.standard_normal((n, k) if tb else (k, n), dtype=np.float32)
    out = np.empty((m, n), np.float32)
    xt, yt, ot = torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(out)
    xa, ya = (xt.t() if ta else xt), (yt.t() if tb else yt)
    runs = {"torch": lambda: torch.matmul(xa, ya, out=ot)}
    for name, f in gemms.items():
        runs[name] = (lambda f=f: f(101, 112 if ta else 111, 112 if tb else 111, m, n, k, 1.0, x.ctypes.data,
                                     x.shape[1], y.ctypes.data, y.shape[1], 0.0, out.ctypes.data, n))
    return runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--json", default=str(HERE / "results" / "blas.json"))
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    torch.set_num_threads(1)
    libs = _libraries()
    libs["openblas"].scipy_openblas_set_num_threads(1)
    gemms = {name: _sgemm(lib) for name, lib in libs.items()}
    rng = np.random.default_rng(0)
    rows, totals = [], dict.fromkeys(["torch", *gemms], 0.0)
    print(f"sgemm, one thread, GFLOP/s (medians of {a.reps}); ratio: time / torch.matmul's")
    print("| M, K, N | op | torch | " + " | ".join(gemms) + " | " + " | ".join(f"{g} / torch" for g in gemms) + " |")
    print("| --- | --- | ---: |" + " ---: |" * (2 * len(gemms)))
    for m, k, n in SHAPES:
        for ta, tb in TRANS:
            runs = _runs(m, k, n, ta, tb, gemms, rng)
            inner = max(3, int(1e9 / (2 * m * n * k)))
            times: dict[str, list[float]] = {v: [] for v in runs}
            for run in runs.values():
                run()
                run()
            for _ in range(a.reps):
                for v, run in runs.items():
                    t0 = time.perf_counter()
                    for _ in range(inner):
                        run()
                    times[v].append((time.perf_counter() - t0) / inner)
            med = {v: statistics.median(t) for v, t in times.items()}
            for v in med:
                totals[v] += med[v]
            op = ("A^T" if ta else "A") + (" B^T" if tb else " B")
            rows.append({"m": m, "k": k, "n": n, "op": op, "seconds": med})
            print(f"| {m}, {k}, {n} | {op} | " + " | ".join(f"{2 * m * n * k / med[v] / 1e9:.1f}" for v in med)
                  + " | " + " | ".join(f"{med[g] / med['torch']:.3f}" for g in gemms) + " |", flush=True)
    ratios = {g: totals[g] / totals["torch"] for g in gemms}
    print("total time / torch.matmul's: " + ", ".join(f"{g} {r:.3f}" for g, r in ratios.items()))
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({"bench": "blas", "reps": a.reps, "rows": rows, "total_ratio": ratios},
                                       indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
