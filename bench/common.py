"""What the benchmark scripts share: relaunching under mpiexec, timing (median of repetitions,
the slowest rank: coconetc.jobs.timing, shared with the rank programs), torch.distributed (gloo) started inside an mpiexec job, the copy bandwidth
for rooflines, the table, the JSON and the PNG plot.

Figures are ratios measured side by side in one run (docs/performance.md): every variant of
a table runs in the same processes, one after the other, at every size."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def example_in_dtype(name: str, dtype: str, written: str) -> Path:
    """examples/NAME with every `written` dtype replaced by DTYPE, in the temp directory (the
    example itself when they are the same); rewritten only when its text changes."""
    src = ROOT / "examples" / name
    if dtype == written:
        return src
    out = Path(tempfile.gettempdir()) / f"coconet_bench_{Path(name).stem}_{dtype}.ccn"
    text = src.read_text().replace(written, dtype)
    if not out.exists() or out.read_text() != text:
        out.write_text(text)
    return out


def in_mpi_job() -> bool:
    return "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ


def relaunch(ranks: int, script: str, ccn_files: list[str]) -> int:
    """Builds the modules once (before the ranks start), then runs SCRIPT on RANKS ranks."""
    import coconetc
    for f in ccn_files:
        coconetc.load(ROOT / "examples" / f)
    from coconetc.launch.mpiexec import run_python
    return run_python(ranks, [script, *sys.argv[1:]])


def setup_rank() -> Any:
    """COMM_WORLD, with one thread per rank for coconet, PyTorch and BLAS (ranks = cores)."""
    os.environ.setdefault("COCONET_THREADS", "1")
    from mpi4py import MPI
    import torch
    torch.set_num_threads(1)
    return MPI.COMM_WORLD


def timed(comm, fn: Callable[[], Any], reps: int, warmup: int = 2) -> float:
    """Median over REPS calls of the time from a barrier to the barrier after the call (so the
    slowest rank's), in seconds, and the maximum of that median over the ranks."""
    return timed_all(comm, {"": fn}, reps, warmup)[""]


def timed_all(comm, fns: dict[Any, Callable[[], Any]], reps: int, warmup: int = 2) -> dict[Any, float]:
    """timed() for every variant, interleaved: repetition k runs every variant once, so a burst
    of load from other processes on a shared machine hits them all alike (coconetc.jobs.timing,
    which the rank programs of `coconetc run` and `coconetc tune` time with); the first WARMUP
    rounds are not counted."""
    from coconetc.jobs.timing import slowest_medians, timed_rounds
    calls = {k: (lambda fn=fn: fn) for k, fn in fns.items()}
    return slowest_medians(comm, timed_rounds(comm, calls, reps, warmup, barrier_after=True))


def reps_for(n: int, reps: int) -> int:
    """More repetitions for small sizes (same total work), at most 50x."""
    big = 1 << 22
    return reps if n >= big else min(reps * 50, reps * max(1, big // max(n, 1)))


def gloo(comm, backend: str = "gloo") -> Any:
    """torch.distributed's process group (gloo; or nccl, one GPU a rank) over the ranks of the
    mpiexec job (a rendezvous file in /tmp named by rank 0)."""
    import torch.distributed as dist
    if dist.is_initialized():
        return dist
    name = None
    if comm.Get_rank() == 0:
        fd, name = tempfile.mkstemp(prefix="coconet_bench_gloo_")
        os.close(fd)
        os.unlink(name)
    name = comm.bcast(name, root=0)
    dist.init_process_group(backend, init_method=f"file://{name}", rank=comm.Get_rank(),
                            world_size=comm.Get_size())
    return dist


def copy_bandwidth(comm, n_bytes: int, reps: int) -> float:
    """Bytes per second one rank moves through memory in a NumPy copy (read + write), every
    rank copying at once, the best of REPS (the roofline is what the machine can do): the
    memory roofline's denominator, measured in this run."""
    import numpy as np
    from mpi4py import MPI
    n = max(n_bytes // 4, 1 << 22)  # at least 16 MiB: out of cache
    src, dst = np.ones(n, np.float32), np.empty(n, np.float32)
    best = float("inf")
    for _ in range(reps + 1):
        comm.Barrier()
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / comm.allreduce(best, op=MPI.MAX)


def model_bytes(ccn: Path | str, program: str, schedules: list[str], sizes: dict[str, int],
                ranks: int) -> dict[str, float]:
    """Bytes one rank moves through memory under each schedule, from the cost model over the
    schedule's execution plan (coconetc/tune/cost.py: what the plan reads and writes, the
    collectives' traffic included): the memory roofline's numerator."""
    from coconetc.sourcefile import load_file
    from coconetc.tune.cost import cost
    mod = load_file(ccn)
    return {s: cost(mod.plans[(program, s)], sizes, ranks).moved for s in schedules}


def report(title: str, name: str, results: dict[int, dict[str, Any]], best_baseline: list[str],
           meta: dict, json_path: str | None) -> None:
    """Prints one table per size (milliseconds and speed-up against the best of
    `best_baseline`), writes the JSON (the largest size's figures at the top level, every size
    under "sizes") and a PNG plot of speed-up against size next to it."""
    for n, r in sorted(results.items()):
        rows = [(k, v) for k, v in r["baselines"].items()] + [(f"coconet {k}", v) for k, v in r["coconet"].items()]
        if r.get("roofline"):
            rows.append(("memory roofline of the best schedule", r["roofline"]))
        ref = min(r["baselines"][b] for b in best_baseline if b in r["baselines"])
        width = max(len(k) for k, _ in rows)
        print(f"\n{title}, N = {n} (2^{n.bit_length() - 1})" if n & (n - 1) == 0 else f"\n{title}, {n}")
        print(f"{'variant':{width}s} {'ms':>10s} {'vs best baseline':>17s}")
        for k, v in rows:
            print(f"{k:{width}s} {v * 1e3:10.3f} {ref / v:17.2f}")
        if r.get("roofline"):
            best = min(r["coconet"].values())
            print(f"best schedule at {100 * r['roofline'] / best:.0f}% of the memory roofline")
    top = results[max(results)]
    doc = {**top, "sizes": {str(n): r for n, r in sorted(results.items())}, **meta}
    out = Path(json_path) if json_path else HERE / "results" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    print(f"\nwrote {out}")
    plot(title, results, best_baseline, out.with_suffix(".png"))


def plot(title: str, results: dict[int, dict[str, Any]], best_baseline: list[str], path: Path) -> None:
    """Speed-up of every variant against the best baseline, by size (needs matplotlib: the
    optional `bench` extra)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plot")
        return
    sizes = sorted(results)
    fig, ax = plt.subplots(figsize=(10, 4.2))
    ref = [min(results[n]["baselines"][b] for b in best_baseline if b in results[n]["baselines"]) for n in sizes]
    labels = list(results[sizes[0]]["baselines"]) + [f"coconet {k}" for k in results[sizes[0]]["coconet"]]
    for label in labels:
        kind, key = ("coconet", label[8:]) if label.startswith("coconet ") else ("baselines", label)
        ys = [ref[i] / results[n][kind][key] for i, n in enumerate(sizes)]
        ax.plot(sizes, ys, marker="o", linestyle="-" if kind == "coconet" else "--", label=label)
    if all(results[n].get("roofline") for n in sizes):
        ax.plot(sizes, [ref[i] / results[n]["roofline"] for i, n in enumerate(sizes)], color="black",
                linestyle=":", label="memory roofline")
    if len(sizes) > 1:
        ax.set_xscale("log", base=2)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("elements")
    ax.set_ylabel("speed-up vs best baseline")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def sizes_arg(text: str) -> list[int]:
    """'16,18,20' -> [2^16, 2^18, 2^20]; a number above 64 is taken as itself."""
    out = []
    for part in text.split(","):
        k = int(part)
        out.append(1 << k if k <= 64 else k)
    return out
