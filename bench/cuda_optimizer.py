"""coconetc.torch.DistributedOptimizer on CUDA parameters against PyTorch's own optimizers, side
by side in one run, at every size (default 2^20, 2^22, 2^24, 2^26, 2^28 elements) and dtype.
One flat torch.nn.Parameter of N elements (uniform in [0.5, 1.5)), its gradient set directly
(standard normal), as a training step leaves it:

  table adam_f32    torch.optim.Adam(fused=True)  against  DistributedOptimizer(examples/adam.ccn)
                    under every schedule the CUDA module has (default, rs_c_ag, zero, fused)
  table adamw_f32   torch.nn.utils.clip_grad_norm_ + torch.optim.AdamW(fused=True)  against
                    DistributedOptimizer(examples/adamw.ccn), default and zero (the global norm
                    inside the fused collective)
  table mixed_bf16  bf16 parameters and gradients, f32 master weights and state: the torch ways
                    users run it, "f32 master copy" (the gradient cast to an f32 master's grad,
                    Adam(fused=True) on the master, the master copied back to the bf16 weights;
                    the baseline) and "Adam(fused=True) on the bf16 parameters" (bf16 state: not
                    the same step, for reference), against DistributedOptimizer(
                    examples/mixed_adam_bf16.ccn, weights="w16", master="w", scale=1), under every
                    schedule it has (default, zero)

Each row: the median of CUDA-event-timed step() calls after warm-ups (--reps, default 20; 10 at
2^26 and 5 at 2^28 and above, after 3, resp. 2, warm-ups; common.device_timed), the bytes per
element the step must move (Adam: g, w, m, v read, w, m, v written, 28 in f32; AdamW with the
global norm: 32, g read once more for the norm; mixed: g and w16 2 each, w, m, v 4 each read and
written, 28; torch's Adam on bf16 parameters: 14, its state being bf16), the fraction of the
device copy bandwidth that makes (a torch copy_ moving the same bytes, timed in the same run,
best of 10: common.device_copy_bandwidth), the time over the table's torch baseline, the max
|difference| of the weights from torch's after 3 steps from the same state and gradient
(mixed: also of the f32 master weights, where the optimizer holds them whole), and the GPU memory
the optimizer holds: free device memory (torch.cuda.mem_get_info, after emptying torch's cache)
before constructing it and after its first step, the parameter and its gradient already made
(the module allocates with cudaMalloc, not through torch's allocator, so torch's own counters
would miss its buffers); torch's allocator's part of it is reported beside it (a buffer the
module keeps between calls, as the symmetric kernel's window, is counted where it is first made
or grown; each file's NCCL communicator is made beforehand by a small warm-up optimizer). Variants run one
after the other, each freed before the next; a size whose estimated peak does not fit in the
free memory is skipped (said so in the table and the JSON); a variant that raises is reported
as an error row and the others go on.

The communicator (R = 1 on one GPU; NCCL refuses two ranks on one GPU): `process_group=` a
one-rank torch.distributed NCCL group (init_method a file:// in a temp directory, world_size 1):
the torchrun path, no MPI. --emulate (sets COCONET_CUDA_EMULATE=1): the CUDA modules built for the
host emulation with CPU tensors in place of CUDA tensors, relaunched under mpiexec on --ranks R
(default 2; bench/common.py relaunch) with MPI's COMM_WORLD as the communicator; each rank's
gradient is the gradient / R, so the sum over the ranks is what the torch baselines step with
(they do not communicate); timings there are the host's and mean nothing: it checks the script
(and the optimizer against torch) without a GPU, at small sizes (--sizes 10,12).

Run: python bench/cuda_optimizer.py [--sizes 20,22,24,26,28] [--tables adam_f32,adamw_f32,mixed_bf16]
                                    [--reps 20] [--json PATH]
     COCONET_CUDA_EMULATE=1 python bench/cuda_optimizer.py --emulate --sizes 10,12 [--ranks 2] --json PATH
Prints one markdown table (rank 0) and writes the JSON (bench/results/cuda_optimizer.json unless
--json): "rows" (one per table, size and variant), "skipped", "copy_bandwidth_Bps" (per size and
byte count), the device, torch, the communicator. bench/cuda_gpu_run.sh runs it on a GPU and
bench/cuda_gpu_report.py folds its JSON into the run's report (its table: `markdown`)."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any
from collections.abc import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from adam_step import HP  # noqa: E402  (Adam's hyper-parameters, as the CPU bench)

EX = common.ROOT / "examples"
FILES = {"adam_f32": "adam.ccn", "adamw_f32": "adamw.ccn", "mixed_bf16": "mixed_adam_bf16.ccn"}
ADAMW_HP = dict(HP, wd=0.1, maxnorm=1.0)
CHECK_STEPS = 3
TITLES = {"adam_f32": "Adam, f32", "adamw_f32": "AdamW + global-norm clipping (max norm 1), f32",
          "mixed_bf16": "Adam, bf16 parameters and gradients, f32 master weights and state"}
BASELINE = {"adam_f32": "torch.optim.Adam(fused=True)",
            "adamw_f32": "torch clip_grad_norm_ + AdamW(fused=True)",
            "mixed_bf16": "torch f32 master copy + Adam(fused=True)"}
BF16_DIRECT = "torch Adam(fused=True) on the bf16 parameters (bf16 state)"
# the peak bytes an element while a variant runs (parameter, gradient, the reference weights,
# the shared gradient, the optimizer's flat copies, state and scratch, the copy while packing)
PEAK_BYTES = {"adam_f32": 44, "adamw_f32": 44, "mixed_bf16": 40}


class Variant:
    """One row: LABEL, the bytes an element its step must move, and MAKE(p) -> (step, master):
    the step of an optimizer made on the parameter p (its gradient set), and a function giving
    the f32 master weights (None where there are none, or not whole on this rank)."""

    def __init__(self, label: str, nbytes: int, make: Callable[[Any], tuple[Callable[[], Any], Any]],
                 schedule: str | None = None):
        self.label, self.nbytes, self.make, self.schedule = label, nbytes, make, schedule


def _torch_adam(params, cls=None, **extra):
    import torch
    cls = cls or torch.optim.Adam
    return cls(params, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"], fused=True, **extra)


def _ours(table: str, schedule: str, comm_kw: dict, **kw) -> Callable:
    """DistributedOptimizer on the table's file under SCHEDULE (KW: its roles and scalars)."""
    from coconetc.torch import DistributedOptimizer

    def make(p):
        opt = DistributedOptimizer([p], str(EX / FILES[table]), schedule=schedule, backend="cuda", **comm_kw, **kw)

        def master():  # the f32 master weights, where this rank holds them whole
            w = opt.state_tensors[0]["w"]
            return w if w.numel() == p.numel() else None
        return opt.step, master if "master" in kw else None
    return make


def _torch_adamw(p):
    import torch
    opt = _torch_adam([p], torch.optim.AdamW, weight_decay=ADAMW_HP["wd"])

    def step():
        torch.nn.utils.clip_grad_norm_([p], ADAMW_HP["maxnorm"])
        opt.step()
    return step, None


def _torch_master_copy(p):
    """What users run for bf16 without coconet: an f32 master copy and its Adam."""
    import torch
    master = torch.nn.Parameter(p.detach().float())
    master.grad = torch.zeros_like(master)
    opt = _torch_adam([master])

    def step():
        with torch.no_grad():
            master.grad.copy_(p.grad)
            opt.step()
            p.copy_(master)
    return step, lambda: master.detach()


def variants(table: str, schedules: list[str], comm_kw: dict) -> list[Variant]:
    """The table's torch baseline(s) first, then DistributedOptimizer under each schedule."""
    if table == "adam_f32":
        return [Variant(BASELINE[table], 28, lambda p: (_torch_adam([p]).step, None))] + \
            [Variant(f"DistributedOptimizer(adam.ccn) [{s}]", 28, _ours(table, s, comm_kw, **HP), s)
             for s in schedules]
    if table == "adamw_f32":
        return [Variant(BASELINE[table], 32, _torch_adamw)] + \
            [Variant(f"DistributedOptimizer(adamw.ccn) [{s}]", 32, _ours(table, s, comm_kw, **ADAMW_HP), s)
             for s in schedules]
    return [Variant(BASELINE[table], 28, _torch_master_copy),
            Variant(BF16_DIRECT, 14, lambda p: (_torch_adam([p]).step, None))] + \
        [Variant(f'DistributedOptimizer(mixed_adam_bf16.ccn, master="w") [{s}]', 28,
                 _ours(table, s, comm_kw, weights="w16", master="w", scale=1.0, **HP), s) for s in schedules]


def _free() -> int | None:
    """Free device memory after emptying torch's cache (None without a GPU)."""
    import torch
    gc.collect()
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def _sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reps_at(n: int, reps: int) -> tuple[int, int]:
    """(repetitions, warm-ups) at N elements: fewer for the largest sizes."""
    if n >= 1 << 28:
        return max(3, reps // 4), 2
    if n >= 1 << 26:
        return max(3, reps // 2), 3
    return reps, 3


def run_table(table: str, n: int, vs: list[Variant], ranks: int, reps: int, dev: str,
              copy_bw: dict[int, float]) -> list[dict]:
    """Every variant of TABLE at N elements, one after the other (each freed before the next)."""
    import torch

    from coconetc.runtime.cuda import fused_trial_calls
    for nb in sorted({v.nbytes * n for v in vs} - set(copy_bw)):  # before anything else is allocated
        copy_bw[nb] = common.device_copy_bandwidth(nb)
        _free()
    dt = torch.bfloat16 if table == "mixed_bf16" else torch.float32
    gen = torch.Generator(device=dev).manual_seed(0)
    w0 = torch.empty(n, device=dev).uniform_(0.5, 1.5, generator=gen).to(dt)
    G = torch.randn(n, device=dev, generator=gen).to(dt)  # the gradient summed over the ranks
    mine = G if ranks == 1 else G / ranks  # this rank's (exact for R a power of 2)
    reps_n, warm = reps_at(n, reps)
    rows: list[dict] = []
    ref: dict[str, Any] = {}
    for v in vs:
        row: dict[str, Any] = dict(table=table, n=n, dtype="bf16" if table == "mixed_bf16" else "f32",
                                   variant=v.label, schedule=v.schedule, bytes_per_element=v.nbytes,
                                   baseline=BASELINE[table], reps=reps_n, warmup=warm)
        rows.append(row)
        p = step = master = None
        try:
            p = torch.nn.Parameter(w0.clone())
            p.grad = (G if v.schedule is None else mine).clone()  # torch's steps do not communicate
            free0 = _free()
            alloc0 = torch.cuda.memory_allocated() if dev == "cuda" else None
            step, master = v.make(p)
            step()
            if free0 is not None:
                alloc1 = torch.cuda.memory_allocated()
                row["gpu_bytes_held"] = free0 - _free()
                row["torch_allocator_bytes_held"] = alloc1 - alloc0
            for _ in range(CHECK_STEPS - 1):  # the same gradient every step: the state from one step on
                with torch.no_grad():
                    p.grad.copy_(G if v.schedule is None else mine)
                step()
            _sync()
            w = p.detach().float()
            mw = master() if master else None
            if v.label == BASELINE[table]:
                ref = {"w": w.clone(), "master": None if mw is None else mw.float().clone()}
            if ref:
                row["max_abs_diff_vs_torch"] = float((w - ref["w"]).abs().max())
                if mw is not None and ref["master"] is not None:
                    row["max_abs_diff_master_vs_torch"] = float((mw.float() - ref["master"]).abs().max())
            del w, mw
            owner = getattr(step, "__self__", None)  # DistributedOptimizer.step: past its module's trials
            trials = fused_trial_calls(owner._fn.ext) if hasattr(owner, "_fn") else 0
            t = common.device_timed(step, reps_n, max(warm, trials + 1 - CHECK_STEPS))  # (+1: the deciding call)
            row["seconds"] = t
            row["host_seconds"] = common.host_timed(step, reps_n)
            nb = v.nbytes * n
            row["copy_bandwidth_Bps"] = copy_bw[nb]
            row["fraction_of_copy_bandwidth"] = nb / t / copy_bw[nb]
        except Exception:  # noqa: BLE001 - a failing variant is a row; the others go on
            row["error"] = traceback.format_exc()[-1500:]
            print(f"{table} N={n} {v.label}: ERROR\n{row['error']}", file=sys.stderr, flush=True)
        finally:
            del p, step, master
            _free()
    base = next((r.get("seconds") for r in rows if r["variant"] == BASELINE[table]), None)
    for r in rows:
        if base and r.get("seconds"):
            r["vs_baseline"] = r["seconds"] / base
    return rows


def _fmt(x: Any, spec: str, none: str = "") -> str:
    return none if x is None else format(x, spec)


def markdown(doc: dict) -> str:
    """The optimizer's tables (one per table, every size), skipped sizes and errors below."""
    lines = []
    head = f"{doc.get('device', '?')}, torch {doc.get('torch', '?')}, R = {doc.get('ranks', '?')}"
    if doc.get("emulated"):
        head += ": times mean nothing"
    for table in TITLES:
        rows = [r for r in doc.get("rows", []) if r["table"] == table]
        skipped = [s for s in doc.get("skipped", []) if s["table"] == table]
        if not rows and not skipped:
            continue
        lines += [f"\n### DistributedOptimizer vs torch: {TITLES[table]} ({head})\n",
                  f"Baseline: {BASELINE[table]}. ms: median of CUDA-event-timed step() calls; "
                  "% copy: the step's bytes over its time, of the device copy bandwidth; "
                  "max |dw|: weights against the baseline's after 3 steps (master: the f32 master "
                  "weights); MiB held: device memory the optimizer holds after its first step; "
                  "host us: median host time of a step() call to its return (the device synchronized "
                  "between calls), which an idle GPU waits for.\n",
                  "| N | variant | ms | x baseline | B/elem | % copy | max abs dw | MiB held | host us |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in rows:
            n = r["n"]
            size = f"2^{n.bit_length() - 1}" if n & (n - 1) == 0 else str(n)
            if r.get("error"):
                last = r["error"].strip().splitlines()[-1][:200].replace("|", "/")
                lines.append(f"| {size} | {r['variant']} | ERROR: {last} | | | | | | |")
                continue
            diff = _fmt(r.get("max_abs_diff_vs_torch"), ".2g")
            if r.get("max_abs_diff_master_vs_torch") is not None:
                diff += f" (master {r['max_abs_diff_master_vs_torch']:.2g})"
            held = r.get("gpu_bytes_held")
            ms = _fmt(r.get("seconds") and r["seconds"] * 1e3, ".4g")
            lines.append(f"| {size} | {r['variant']} | {ms} | "
                         f"{_fmt(r.get('vs_baseline'), '.2f')} | {r['bytes_per_element']} | "
                         f"{_fmt(r.get('fraction_of_copy_bandwidth') and 100 * r['fraction_of_copy_bandwidth'], '.0f')} | "
                         f"{diff} | {_fmt(held and held / 2**20, '.0f')} | "
                         f"{_fmt(r.get('host_seconds') and r['host_seconds'] * 1e6, '.0f')} |")
        for s in skipped:
            lines.append(f"\nskipped: {table} at N = {s['n']}: {s['why']}")
    return "\n".join(lines) + "\n"


def schedules_of(table: str, only: list[str] | None) -> list[str]:
    import coconetc
    mod = coconetc.load(EX / FILES[table], backend="cuda", log=lambda m: None)
    fn = next(iter(mod.programs.values()))
    have = list(fn.schedules)
    return [s for s in have if s in only] if only else have


def communicator(emulate: bool) -> tuple[dict, str, int, int]:
    """(DistributedOptimizer's communicator keywords, their description, rank, ranks)."""
    if emulate:
        comm = common.setup_rank()
        return {"comm": comm}, f"MPI COMM_WORLD (emulated NCCL), {comm.Get_size()} ranks", comm.Get_rank(), comm.Get_size()
    try:
        return {"process_group": common.one_rank_group("nccl")}, "process_group= a one-rank torch.distributed NCCL group", 0, 1
    except Exception as err:  # noqa: BLE001 - the one-rank NCCL communicator without a group
        print(f"torch.distributed NCCL group failed ({err}); comm= the default one-rank communicator",
              file=sys.stderr, flush=True)
        return {}, f"the default one-rank NCCL communicator (NCCL process group failed: {err})", 0, 1


def build_modules() -> float:
    """Every table's module built at once (nvcc side by side; all of them, so that a later run
    for the other tables finds them in the cache) before anything is timed; the seconds taken."""
    from concurrent.futures import ThreadPoolExecutor
    import coconetc
    t0 = time.time()
    every = list(FILES.values())
    with ThreadPoolExecutor(len(every)) as ex:
        list(ex.map(lambda f: common.attempt(lambda: coconetc.load(EX / f, backend="cuda", log=lambda m: None)), every))
    print(f"built {', '.join(every)} in {time.time() - t0:.0f} s", flush=True)
    return time.time() - t0


def prepare(tables: list[str], only: list[str] | None, comm_kw: dict, dev: str, doc: dict) -> list:
    """[(table, its variants)] for the tables whose module loads; a warm-up optimizer at a small
    size under the first schedule of each: the module's NCCL communicator (one per module) is
    made there, not in the first measured construction. A table that fails is an error row."""
    import torch
    plan: list[tuple[str, list[Variant]]] = []
    for table in tables:
        try:
            scheds = schedules_of(table, only or (["default", "zero"] if table == "adamw_f32" else None))
            vs = variants(table, scheds, comm_kw)
            p = torch.nn.Parameter(torch.ones(1024, device=dev, dtype=torch.bfloat16 if table == "mixed_bf16" else None))
            p.grad = torch.zeros_like(p)
            next(v for v in vs if v.schedule).make(p)[0]()
            _sync()
            plan.append((table, vs))
        except Exception:  # noqa: BLE001
            err = traceback.format_exc()[-1500:]
            print(f"{table}: ERROR\n{err}", file=sys.stderr, flush=True)
            doc["rows"].append(dict(table=table, n=0, variant="(setup)", bytes_per_element=0, error=err))
    return plan


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="20,22,24,26,28", help="exponents of 2 (or sizes), comma-separated")
    ap.add_argument("--tables", default=",".join(FILES), help="which tables: " + ", ".join(FILES))
    ap.add_argument("--schedules", default=None, help="only these schedules (default: every one the module has; "
                    "adamw: default,zero)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--emulate", action="store_true",
                    help="the host emulation under mpiexec (COCONET_CUDA_EMULATE=1, CPU tensors, MPI's comm)")
    ap.add_argument("--ranks", type=int, default=2, help="--emulate: ranks")
    a = ap.parse_args()
    tables = a.tables.split(",")
    if a.emulate:
        os.environ["COCONET_CUDA_EMULATE"] = "1"
        if not common.in_mpi_job():
            return common.relaunch(a.ranks, __file__, [FILES[t] for t in tables], backend="cuda")
    import torch
    if not a.emulate and not torch.cuda.is_available():
        print("cuda_optimizer.py: no CUDA device here (torch.cuda.is_available() is False); "
              "without one: --emulate", file=sys.stderr)
        return 2
    if not a.emulate:
        torch.cuda.set_device(0)
    build_s = None if a.emulate else build_modules()
    dev = "cpu" if a.emulate else "cuda"
    comm_kw, comm_words, rank, ranks = communicator(a.emulate)
    doc: dict[str, Any] = {"device": "the host emulation" if a.emulate else torch.cuda.get_device_name(),
                           "torch": torch.__version__, "ranks": ranks, "emulated": a.emulate,
                           "communicator": comm_words, "sizes": [], "rows": [], "skipped": [],
                           "copy_bandwidth_Bps": {}, "check_steps": CHECK_STEPS,
                           "build_seconds": build_s}
    out = Path(a.json) if a.json else common.HERE / "results" / "cuda_optimizer.json"
    plan = prepare(tables, a.schedules.split(",") if a.schedules else None, comm_kw, dev, doc)
    for n in common.sizes_arg(a.sizes):
        doc["sizes"].append(n)
        copy_bw: dict[int, float] = {}
        doc["copy_bandwidth_Bps"][str(n)] = copy_bw
        for table, vs in plan:
            free = _free()
            need = PEAK_BYTES[table] * n
            if free is not None and need > 0.9 * free:
                why = f"needs about {need / 2**30:.1f} GiB at its peak, {free / 2**30:.1f} GiB free"
                doc["skipped"].append(dict(table=table, n=n, why=why))
                print(f"skipped {table} at N = {n}: {why}", flush=True)
                continue
            t0 = time.time()
            doc["rows"] += run_table(table, n, vs, ranks, a.reps, dev, copy_bw)
            if rank == 0:  # written after every table: a step stopped at its time limit keeps what ran
                print(f"{table} N = {n}: {time.time() - t0:.1f} s", flush=True)
                save(doc, out)
    if rank == 0:
        print(markdown(doc), flush=True)
        save(doc, out)
        print(f"wrote {out}")
    if "process_group" in comm_kw:
        import torch.distributed as dist
        common.attempt(dist.destroy_process_group)
    return 1 if any(r.get("error") for r in doc["rows"]) else 0


def save(doc: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(out)


if __name__ == "__main__":
    sys.exit(main())
