"""What the benchmark scripts share: relaunching under mpiexec, timing (median of repetitions,
the slowest rank: coconetc.jobs.timing, shared with the rank programs), torch.distributed (gloo) started inside an mpiexec job, the STREAM bandwidth and
the least bytes a step moves for the memory roofline (a bound), the table, the JSON and the PNG plot.

Figures are ratios measured side by side in one run (docs/performance.md): every variant of
a table runs in the same processes, one after the other, at every size."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
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


def relaunch(ranks: int, script: str, ccn_files: list[str], backend: str = "cpu") -> int:
    """Builds the modules once (before the ranks start; BACKEND's: "cuda" under
    COCONET_CUDA_EMULATE=1 is the host emulation's), then runs SCRIPT on RANKS ranks."""
    import coconetc
    for f in ccn_files:
        coconetc.load(ROOT / "examples" / f, backend=backend)
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


def attempt(fn: Callable[[], Any]) -> Any:
    """FN's value, or the exception it raised (a module that fails to build fails its rows, not
    the run)."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001
        return err


def one_rank_group(backend: str) -> Any:
    """A one-rank torch.distributed process group (BACKEND: nccl on a GPU, gloo without one),
    its rendezvous a file in a fresh temporary folder: the communicator of a one-process run."""
    import torch.distributed as dist
    folder = tempfile.mkdtemp(prefix="coconet_bench_pg_")
    atexit.register(shutil.rmtree, folder, True)
    dist.init_process_group(backend, init_method=f"file://{folder}/rendezvous", rank=0, world_size=1)
    return dist.group.WORLD


def optimizer_step(src: Path, comm, g, w, hp: dict, shared_memory: bool | None = None,
                   shared_weights: bool | None = None) -> tuple[Callable[[], Any], Any]:
    """coconetc.torch.DistributedOptimizer under zero on one flat parameter of n elements (what a
    PyTorch user writes; SHARED_MEMORY and SHARED_WEIGHTS as its arguments, None their default:
    on one node the flat weights and gradient in shared windows, one copy of the weights for
    the node), its gradient set once (from the second step on p.grad is a view of the
    optimizer's flat gradient, as when autograd accumulates into it). Returns (step, the
    weights: a NumPy view of the optimizer's flat buffer); step.shared_weights says whether the
    node holds one copy of the weights."""
    import torch
    from coconetc.torch import DistributedOptimizer
    p = torch.nn.Parameter(torch.from_numpy(w.copy()))
    opt = DistributedOptimizer([p], src, schedule="zero", comm=comm, shared_memory=shared_memory,
                               shared_weights=shared_weights, **hp)

    def step() -> None:
        opt.step()
    p.grad = torch.from_numpy(g.copy())
    step.shared_weights = opt.shared_weights  # type: ignore[attr-defined]  (for the roofline's bytes)
    return step, p.detach().numpy()


def device_timed(fn: Callable[[], Any], reps: int, warmup: int = 3) -> float:
    """Median over REPS calls of FN, in seconds, after WARMUP calls: on a GPU each call between
    two CUDA events (the GPU's time of the work the call queued, the Python call included when
    the GPU waits for it); without one (the host emulation) the host's time of each call."""
    import statistics

    import torch
    for _ in range(warmup):
        fn()
    times = []
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def host_timed(fn: Callable[[], Any], reps: int, warmup: int = 0) -> float:
    """Median over REPS calls of FN, after WARMUP calls, of the host's time from the call to its
    return (on a GPU: to its work queued; the device is synchronized between calls, untimed):
    what a step costs the host, which the GPU waits for where nothing else is queued ahead of it."""
    import statistics

    import torch
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    sync()
    return statistics.median(times)


def device_copy_bandwidth(nbytes: int, reps: int = 10) -> float:
    """The device's copy bandwidth in bytes moved (read + written) per second: the best of REPS
    timed torch copy_ calls moving NBYTES in all (NBYTES / 2 read, NBYTES / 2 written), on the
    current CUDA device (on the CPU without one)."""
    import torch
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    half = max(nbytes // 2, 1)
    src = torch.ones(half, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    def copy() -> Any:
        return dst.copy_(src)
    best = min(device_timed(copy, 1, warmup=1 if k == 0 else 0) for k in range(reps))
    return 2 * half / best


def reps_for(n: int, reps: int) -> int:
    """More repetitions for small sizes (same total work), at most 50x."""
    big = 1 << 22
    return reps if n >= big else min(reps * 50, reps * max(1, big // max(n, 1)))


def gloo(comm, backend: str = "gloo") -> Any:
    """torch.distributed's process group (gloo; or nccl, one GPU a rank) over the ranks of the
    mpiexec job (a TCP store on a port rank 0 found free)."""
    import torch.distributed as dist
    if dist.is_initialized():
        return dist
    name = None
    if comm.Get_rank() == 0:  # (a TCP store on a free port: a file store stays in /tmp unless the group is destroyed)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            name = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    name = comm.bcast(name, root=0)
    dist.init_process_group(backend, init_method=name, rank=comm.Get_rank(),
                            world_size=comm.Get_size())
    return dist


def rank_slice(comm, n: int) -> tuple[int, int, list[int], list[int]]:
    """This rank's part [lo, hi) of n elements under slice(...) (rank r holds
    [r E, (r + 1) E), E = ceil(n / R), clipped to n), and every rank's counts and offsets (for
    mpi4py's Reduce_scatter / Allgatherv)."""
    R, e = comm.Get_size(), -(-n // comm.Get_size())
    displs = [min(n, r * e) for r in range(R)]
    counts = [min(n, (r + 1) * e) - displs[r] for r in range(R)]
    r = comm.Get_rank()
    return displs[r], displs[r] + counts[r], counts, displs


_STREAM: dict[int, float] = {}
STREAM_ARRAY_BYTES = 64 << 20  # each of the triad's three arrays, per rank (192 MiB a kernel a rank:
# out of this machine's last-level cache, which keeps a 96 MiB array in place but not a 128 MiB one)


def stream_bandwidth(comm, array_bytes: int = STREAM_ARRAY_BYTES, reps: int = 10) -> float:
    """The memory bandwidth one rank gets with every rank streaming at once, measured as STREAM
    does: the triad a = b + s c (torch.add(b, c, alpha=s, out=a): one pass, 12 bytes an f32
    element: b and c read, a written; write-allocate traffic not counted, as STREAM does not)
    and the copy a = b (8 bytes); and the same two in place, b += s c (12 bytes) and b *= s
    (8 bytes), whose writes go to lines just read (no write-allocate traffic at all: the
    optimizer steps update their state and weights this way, so a bound without them is no
    bound for those steps); on arrays of ARRAY_BYTES each in every rank (by default
    64 MiB, far out of cache; the in-place kernels on as many bytes as the triad's three), all ranks starting together after a barrier; each repetition's
    time is the slowest rank's (REPS of them, more for small arrays, up to 200), and the result
    is the best repetition of the best kernel, in
    bytes per second per rank. Measured again at every call; the best over the calls of the
    process at that array size is returned (a burst of load during one measurement must not
    lower the bound's bandwidth)."""
    import torch
    from mpi4py import MPI
    n = max(array_bytes // 4, 1024)
    # small arrays: more repetitions (the same total time), so that one of them runs unpreempted
    reps = max(reps, min(200, reps * STREAM_ARRAY_BYTES // max(array_bytes, 1)))
    a, b, c = torch.empty(n), torch.ones(n), torch.full((n,), 2.0)
    # the in-place kernels on as many bytes as the triad's three arrays (one array of 3 n, two of
    # 3 n / 2): a kernel on fewer bytes would run in a cache the triad's arrays do not fit in
    x, y = torch.ones(3 * n), torch.full((3 * n // 2,), 2.0)
    x2 = x[:3 * n // 2]
    kernels = {"triad": (lambda: torch.add(b, c, alpha=3.0, out=a), 12 * n),
               "copy": (lambda: a.copy_(b), 8 * n),
               "triad in place": (lambda: x2.add_(y, alpha=0.5), 12 * (3 * n // 2)),
               "scale in place": (lambda: x.mul_(1.0001), 8 * 3 * n)}
    best = 0.0
    for fn, nbytes in kernels.values():
        fn()  # first touch
        for _ in range(reps):
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            t = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            best = max(best, nbytes / t)
    _STREAM[array_bytes] = max(best, _STREAM.get(array_bytes, 0.0))
    return _STREAM[array_bytes]


def best_stream() -> float:
    """The best out-of-cache STREAM bandwidth measured so far in this process (no measuring:
    for rank 0's report)."""
    return _STREAM.get(STREAM_ARRAY_BYTES, 0.0)


def bound_bandwidth(comm, footprint_bytes: int, reps: int = 10, measure: bool = True) -> float:
    """The bandwidth a step whose working set is FOOTPRINT_BYTES per rank can at best reach:
    the larger of the out-of-cache STREAM bandwidth and STREAM on three arrays holding that
    working set (when it fits in a cache, the cache's bandwidth, which a repeated step reaches
    too): so that a bound made with it is a bound at every size. MEASURE=False: the best
    measured so far in this process (no collective: for rank 0's report)."""
    small = max(footprint_bytes // 3, 4096)
    sizes = [STREAM_ARRAY_BYTES] + ([small] if small < STREAM_ARRAY_BYTES else [])
    if measure:
        for b in sizes:
            stream_bandwidth(comm, b, reps)
    return max(_STREAM.get(b, 0.0) for b in sizes)


def min_bytes(n: int, ranks: int, *, grads: int = 1, weights: int = 1, state: int = 2,
              state_sliced: bool, kept: int = 0, elem: int = 4, weights_shared: bool = False) -> int:
    """The least bytes one rank must move through memory in a data-parallel optimizer step over
    n elements (f32: ELEM = 4), whatever the schedule, given the calling convention; what does
    not fit in any cache must go through memory at least once:
    - each gradient: every rank's copy read once (the rank reduces its slice E = ceil(n / R) of
      all R copies: R E = n elements read per rank);
    - each weight tensor: its slice read once, the updated tensor written whole (every rank's
      copy is replicated); with WEIGHTS_SHARED (one copy for the node's ranks,
      DistributedOptimizer's shared_weights) its slice written only;
    - each state tensor (Adam's m, v): sliced, its slice read and written; replicated, its
      slice read and the whole written;
    - KEPT values of a slice that must be stored and read back between two passes (a global
      norm of the reduced gradient, needed before the first update: the reduced slice written
      and read once, 2 E; reading the gradients a second time instead costs n >= 2 E).
    Registers and scalars are free; messages between ranks on one node are memory traffic
    already counted (the reads of the peers' gradients, the writes of the gathered weights)."""
    e = -(-n // ranks)
    moved = grads * n + weights * (2 * e if weights_shared else e + n) + state * (2 * e if state_sliced else e + n) + kept * 2 * e
    return moved * elem


def rooflines(comm, n: int, conventions: dict[str, dict[str, Any]], footprint_bytes: int,
              reps: int = 10) -> dict[str, Any]:
    """The memory roofline of each schedule at N elements: min_bytes(n, R, **its convention)
    over bound_bandwidth(FOOTPRINT_BYTES): a time no honest run can beat. Returns the entries
    of a size's result: "roofline" (the least over the schedules), "roofline_by_schedule",
    "bytes_by_schedule", "bandwidth_Bps"."""
    bw = bound_bandwidth(comm, footprint_bytes, reps)
    nbytes = {s: min_bytes(n, comm.Get_size(), **kw) for s, kw in conventions.items()}
    roof = {s: b / bw for s, b in nbytes.items()}
    return {"roofline": min(roof.values()), "roofline_by_schedule": roof, "bytes_by_schedule": nbytes,
            "bandwidth_Bps": bw, "footprint_bytes": footprint_bytes}


def final_rooflines(results: dict[int, dict[str, Any]]) -> None:
    """The rooflines of every size again with the best bandwidth measured in the whole run
    (every size measures it anew: a later, quieter measurement raises every size's bound)."""
    for r in results.values():
        if "bytes_by_schedule" in r:
            bw = bound_bandwidth(None, r["footprint_bytes"], measure=False)
            r["roofline_by_schedule"] = {s: b / bw for s, b in r["bytes_by_schedule"].items()}
            r["roofline"], r["bandwidth_Bps"] = min(r["roofline_by_schedule"].values()), bw


ROOFLINE_NOTE = ("a bound: the least bytes each schedule's calling convention must move "
                 "(bench/common.py min_bytes) over the STREAM bandwidth (triad and copy, also in place, every rank at "
                 "once, best of the repetitions; bench/common.py stream_bandwidth), measured in this run")


def report(title: str, name: str, results: dict[int, dict[str, Any]], best_baseline: list[str],
           meta: dict, json_path: str | None) -> None:
    """Prints one table per size (milliseconds and speed-up against the best of
    `best_baseline`), writes the JSON (the largest size's figures at the top level, every size
    under "sizes") and a PNG plot of speed-up against size next to it."""
    final_rooflines(results)
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
            bounded = r.get("roofline_by_schedule") or r["coconet"]
            best = min(v for k, v in r["coconet"].items() if k in bounded)
            print(f"best schedule at {100 * r['roofline'] / best:.0f}% of the memory roofline (a bound: "
                  f"the least bytes over the STREAM bandwidth, {r.get('bandwidth_Bps', 0) / 1e9:.1f} GB/s a rank)")
        if r.get("roofline_by_schedule"):
            print("each schedule's time at its own bound: " + ", ".join(
                f"{k} {100 * b / r['coconet'][k]:.0f}%" for k, b in r["roofline_by_schedule"].items()
                if k in r["coconet"]))
            over = [k for k, b in r["roofline_by_schedule"].items() if k in r["coconet"] and r["coconet"][k] < b]
            if over:
                print(f"WARNING: {', '.join(over)} beat the bound: every STREAM measurement of this run was "
                      "disturbed (other processes on the cores), so its bandwidth is too low; measure on a "
                      "quiet machine")
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
