"""On a machine with a GPU (R = 1): compile every example with the CUDA backend, run every
program and schedule the CUDA backend implements on random inputs, compare with the
interpreter; then time the generated Adam step (schedules default, zero, fused; f32,
N = 2^26) against torch.optim.Adam(fused=True), and the device copy bandwidth, in one run.

Run: python bench/cuda_gpu_check.py [--n 67108864] [--archs 90] [--out DIR]
Prints two tables (markdown) and writes DIR/cuda_gpu_check.json. torch's allocations are
aligned, so the pointwise kernels take their vector path; --skip-bench --misalign runs the
examples again with every tensor one element off (their element path).

--kernels (every kernel against its bound, docs/cuda.md): the device's copy bandwidth (a
1 GiB device-to-device copy) into DIR/machine.json, then for every schedule of KERNEL_RUNS one
call profiled (torch.profiler, CUDA activity) after its warm-up, its kernels matched to
`coconetc explain --backend cuda -s S --format json` (coconetc/tune/explain.py: kernel_listing
at the measured bandwidth, match_kernels) and measured / bound printed per unit; the JSON gets
"kernels". A unit no kernel matched, and a kernel no unit takes, are reported, never fatal.
--kernels-dry TRACES does the same without a GPU from a JSON of recorded (or fabricated)
traces: {"device", "bandwidth_gbps", "runs": [{"file", "program", "schedule", "sizes",
"trace": a Chrome trace}]} (tests/test_gpu_script.py)."""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ROOT = common.ROOT
ODD = 11  # the second size of every symbol (--odd)
MISALIGN = False  # --misalign: every tensor one element past its allocation's start


def _torch(v):
    import torch
    if isinstance(v, (list, tuple)):  # a scattered parameter: one tensor per segment
        return [_torch(x) for x in v]
    if isinstance(v, np.ndarray):
        a = torch.from_numpy(np.ascontiguousarray(v).view(np.uint16) if v.dtype.name == "bfloat16" else v)
        if MISALIGN:  # not 16-byte aligned: the pointwise kernels take their element path
            return torch.empty(a.numel() + 1, dtype=a.dtype, device="cuda")[1:].view(a.shape).copy_(a)
        return a.cuda()
    return v


def _np(t, dtype):
    if isinstance(t, list):
        return [_np(x, dtype) for x in t]
    a = t.detach().cpu()
    import torch
    if a.dtype == torch.bfloat16:
        return a.view(torch.uint16).numpy().view(dtype)
    return a.numpy()


def check_examples(archs: str) -> list[dict]:
    import torch
    from coconetc.oracle.compare import compare
    from coconetc.oracle.inputs import adapt_inputs, joined, random_inputs
    from coconetc.interp.interpreter import Result, run
    from coconetc.interp.values import STORAGE
    from coconetc.runtime import cuda as runtime_cuda
    from coconetc.codegen.cuda import problems as cuda_problems
    from concurrent.futures import ThreadPoolExecutor
    from coconetc.sourcefile import load_file
    from coconetc.toolchain import Options, compile
    files = sorted((ROOT / "examples").glob("*.ccn"))
    with ThreadPoolExecutor(8) as ex:  # one nvcc per module: build them side by side
        list(ex.map(lambda f: common.attempt(lambda: compile(load_file(f), "cuda", Options(archs=archs, log=lambda m: None))), files))
    rows = []
    for f in files:
        t0 = time.time()
        try:
            mod = runtime_cuda.load(f, archs=archs, log=lambda m: None)
        except Exception as e:  # noqa: BLE001
            rows.append(dict(file=f.name, program="*", schedule="*", status="BUILD FAILED", detail=str(e)[-800:]))
            continue
        build_s = time.time() - t0
        comm = mod.comm()
        for (prog, sched), errs in cuda_problems(mod.source_module).items():
            rows.append(dict(file=f.name, program=prog, schedule=sched, status="not in CUDA backend",
                             detail=errs[0].what))
        for prog, fn in mod.programs.items():
            base = mod.source_module.programs[prog]
            for sched, ir in fn.schedules.items():
                for k, sizes in enumerate((None, "odd")):
                    try:
                        from coconetc.oracle.inputs import size_symbols
                        sz = None if sizes is None else {s: ODD for s in size_symbols(base)}
                        inputs = adapt_inputs(random_inputs(base, 1, 1, sz, seed=7 + k), base, ir)
                        ref = run(ir, copy.deepcopy(inputs))
                        args = {q.name: _torch(inputs[0][q.name]) for q in ir.params}
                        for q in ir.params:
                            if not q.scalar and q.type.dtype == "bf16":
                                v = args[q.name]
                                args[q.name] = [x.view(torch.bfloat16) for x in v] if isinstance(v, list) \
                                    else v.view(torch.bfloat16)
                        out = fn(schedule=sched, comm=comm, **args)
                        torch.cuda.synchronize()
                        outs = out if isinstance(out, tuple) else (out,) if out is not None else ()
                        got = Result({pub: _np(v, STORAGE[ir.type_of(s).dtype]) for (pub, s), v in zip(ir.outputs, outs)},
                                     {t: joined(_np(args[t], STORAGE[ir.type_of(t).dtype])) for t, _ in ir.updates}, None)
                        diffs = compare(ref, [got], ir, ir)
                        rows.append(dict(file=f.name, program=prog, schedule=sched, sizes=sizes or "default",
                                         status="match" if not diffs else "MISMATCH", detail="; ".join(diffs[:3]),
                                         build_s=round(build_s, 1)))
                    except Exception:  # noqa: BLE001
                        rows.append(dict(file=f.name, program=prog, schedule=sched, sizes=sizes or "default",
                                         status="ERROR", detail=(traceback.format_exc()[-600:])))
    return rows


def bench(n: int, archs: str, reps: int) -> list[dict]:
    import torch
    from coconetc.runtime import cuda as runtime_cuda
    rows = []
    src = torch.empty(n, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    t = common.device_timed(lambda: dst.copy_(src), reps)
    bw = 2 * n * 4 / t
    rows.append(dict(what="device copy (torch copy_, f32)", ms=t * 1e3, gbps=bw / 1e9))
    g = torch.randn(n, device="cuda")
    w0 = torch.randn(n, device="cuda")
    # baseline: torch fused Adam (no collective at R = 1)
    wt = w0.clone().requires_grad_(False)
    p = torch.nn.Parameter(wt)
    p.grad = g.clone()
    opt = torch.optim.Adam([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, fused=True)
    t_base = common.device_timed(lambda: opt.step(), reps)
    # Adam reads g, w, m, v and writes w, m, v: 7 x 4 bytes per element
    rows.append(dict(what="torch.optim.Adam(fused=True)", ms=t_base * 1e3, gbps=7 * 4 * n / t_base / 1e9))
    mod = runtime_cuda.load(ROOT / "examples" / "adam.ccn", archs=archs, log=lambda m: None)
    comm = mod.comm()
    for sched in ("default", "rs_c_ag", "zero", "fused"):
        if sched not in mod.adam.schedules:
            continue
        w, m, v = w0.clone(), torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
        gg = g.clone()
        def call(sched=sched, gg=gg, w=w, m=m, v=v):
            mod.adam(schedule=sched, comm=comm, g=gg, w=w, m=m, v=v, lr=1e-3, beta1=0.9, beta2=0.999,
                     eps=1e-8, step=1.0)
        t = common.device_timed(call, reps, warmup=max(3, runtime_cuda.fused_trial_calls(mod.ext) + 1))  # (+1: the deciding call)
        rows.append(dict(what=f"coconet adam [{sched}] (CUDA, NCCL R=1)", ms=t * 1e3, gbps=7 * 4 * n / t / 1e9))
    # one step of each from the same state: the generated fused step against torch's
    for sched in ("fused", "zero"):
        w, m, v = w0.clone(), torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
        mod.adam(schedule=sched, comm=comm, g=g.clone(), w=w, m=m, v=v, lr=1e-3, beta1=0.9, beta2=0.999,
                 eps=1e-8, step=1.0)
        p2 = torch.nn.Parameter(w0.clone())
        p2.grad = g.clone()
        torch.optim.Adam([p2], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, fused=True).step()
        torch.cuda.synchronize()
        rows.append(dict(what=f"max |w - torch's w| after one step [{sched}]",
                         ms=float((w - p2.detach()).abs().max()), gbps=0.0))
    for r in rows:
        r["vs_torch"] = r["ms"] / (t_base * 1e3)
        r["vs_copy_roofline"] = r["ms"] / (7 * 4 * n / bw * 1e3)
    return rows


# what --kernels profiles: (example, program, sizes), every schedule of the program (about a minute)
TP = {"B": 8, "S": 512, "H": 1024, "F": 4096}
KERNEL_RUNS = [("adam.ccn", "adam", {"N": 1 << 24}), ("adamw.ccn", "adamw", {"N": 1 << 24}),
               ("mixed_adam_bf16.ccn", "mixed_adam_bf16", {"N": 1 << 24}), ("lamb.ccn", "lamb", {"N": 1 << 24}),
               ("clipped_sgd.ccn", "clipped_sgd", {"N": 1 << 24}), ("tp_mlp.ccn", "tp_mlp", TP),
               ("tp_mlp.ccn", "tp_mlp_grad", TP), ("layernorm.ccn", "attn_out", {"B": 8, "S": 512, "H": 1024})]


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 10) -> float:
    """The device's copy bandwidth in bytes/s: a device-to-device copy of NBYTES (read + written)."""
    import torch
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    t = common.device_timed(lambda: dst.copy_(src), reps)
    return 2 * nbytes / t


def measured_runs(runs: list[dict], machine: str, device: str) -> dict:
    """Each run ({file, program, schedule, sizes, trace, call_s}) matched to its kernel listing
    at the rates of MACHINE (a machine JSON); a run that cannot be listed is kept with its error."""
    from coconetc.sourcefile import load_file
    from coconetc.tune import explain as ex
    mods: dict = {}
    out = []
    for r in runs:
        try:
            mod = mods.get(r["file"]) or mods.setdefault(r["file"], load_file(ROOT / "examples" / r["file"]))
            listing = ex.kernel_listing(mod, r["program"], r["schedule"], 1, r["sizes"], "cuda", machine=machine,
                                        records=False)
            m = ex.match_kernels(listing, ex.trace_kernels(r["trace"]))
            m.update(file=r["file"], call_s=r.get("call_s"))
        except Exception as err:  # noqa: BLE001 - one run's failure is reported, the others go on
            m = dict(file=r.get("file"), program=r.get("program"), schedule=r.get("schedule"),
                     error=f"{type(err).__name__}: {err}"[-600:])
        out.append(m)
    doc = json.loads(Path(machine).read_text())
    return {"device": device, "bandwidth_gbps": doc.get("bandwidth_gbps"), "peak_tflops": doc.get("peak_tflops"),
            "runs": out}


class _Stop(BaseException):  # not caught by a run's `except Exception`
    """SIGTERM (the run script's `timeout`): stop profiling, report what was measured."""


def _stop(signum, frame):
    raise _Stop()


def profile_runs(archs: str, tmp: Path, only: str = "", budget: float = 0.0) -> list[dict]:
    """One profiled call of every schedule of KERNEL_RUNS (after its warm-up: auto's trial
    calls of a fused collective and the deciding one), its Chrome trace and the call's time
    (CUDA events, median of 5). Past BUDGET seconds (0: none), or on SIGTERM, the runs not
    made are named and the ones made returned."""
    import signal
    before = signal.signal(signal.SIGTERM, _stop)
    runs: list[dict] = []
    t_start = time.time()
    try:
        _profile_runs(archs, tmp, only, budget, t_start, runs)
    except _Stop:
        runs.append(dict(file="*", program="*", schedule="*", sizes={},
                         error=f"stopped by SIGTERM after {time.time() - t_start:.0f} s (the step's time limit)"))
    finally:
        signal.signal(signal.SIGTERM, before)
    return runs


def _profile_runs(archs: str, tmp: Path, only: str, budget: float, t_start: float, runs: list[dict]) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from coconetc.oracle.inputs import adapt_inputs, random_inputs
    from coconetc.runtime import cuda as runtime_cuda
    for file, prog, sizes in KERNEL_RUNS:
        if only and only not in (file, prog):
            continue
        if budget and time.time() - t_start > budget:
            runs.append(dict(file=file, program=prog, schedule="*", sizes=sizes,
                             error=f"skipped: the budget of {budget:.0f} s (--kernels-budget) is spent"))
            continue
        try:
            mod = runtime_cuda.load(ROOT / "examples" / file, archs=archs, log=lambda m: None)
            fn, base = mod.programs[prog], mod.source_module.programs[prog]
            drawn = random_inputs(base, 1, 1, sizes, seed=3)  # once per program (seconds at 2^24)
            comm = mod.comm()
        except Exception as err:  # noqa: BLE001
            runs.append(dict(file=file, program=prog, schedule="*", sizes=sizes, error=f"{type(err).__name__}: {err}"[-600:]))
            continue
        for sched, ir in fn.schedules.items():
            t0 = time.time()
            try:
                inputs = adapt_inputs(drawn, base, ir)
                args = {q.name: _torch(inputs[0][q.name]) for q in ir.params}
                for q in ir.params:
                    if not q.scalar and q.type.dtype == "bf16":
                        v = args[q.name]
                        args[q.name] = [x.view(torch.bfloat16) for x in v] if isinstance(v, list) else v.view(torch.bfloat16)

                def call(sched=sched, args=args, fn=fn, comm=comm):
                    fn(schedule=sched, comm=comm, **args)
                call_s = common.device_timed(call, 5, warmup=runtime_cuda.fused_trial_calls(mod.ext) + 2)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    call()
                    torch.cuda.synchronize()
                path = tmp / f"trace_{prog}_{sched}.json"
                prof.export_chrome_trace(str(path))
                trace = json.loads(path.read_text())
                path.unlink()
                runs.append(dict(file=file, program=prog, schedule=sched, sizes=sizes, call_s=call_s,
                                 trace={"traceEvents": [e for e in trace.get("traceEvents", [])
                                                        if str(e.get("cat", "")).lower() in ("kernel", "gpu_memcpy", "gpu_memset")]}))
            except Exception as err:  # noqa: BLE001
                runs.append(dict(file=file, program=prog, schedule=sched, sizes=sizes,
                                 error=f"{type(err).__name__}: {err}"[-600:]))
            print(f"profiled {prog} [{sched}] in {time.time() - t0:.1f} s", flush=True)
            args = {}
            torch.cuda.empty_cache()


def kernels_report(doc: dict) -> str:
    """The markdown of --kernels: per schedule, each unit's measured / bound."""
    from coconetc.tune import explain as ex
    bw = doc.get("bandwidth_gbps")
    lines = [f"## Every kernel against its bound ({doc.get('device', '')}; copy bandwidth "
             f"{bw:.0f} GB/s measured, peak by dtype {doc.get('peak_tflops')} TFLOP/s)" if bw else
             "## Every kernel against its bound", "",
             "| program | schedule | call (events) | kernels (sum) | bound | kernels / bound | units not matched | kernels not listed |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for m in doc["runs"]:
        if "error" in m:
            lines.append(f"| {m.get('program')} | {m.get('schedule')} | ERROR: {str(m['error']).replace('|', '/')[:200]} | | | | | |")
            continue
        call = f"{m['call_s'] * 1e6:.1f} us" if m.get("call_s") else "-"
        lines.append(f"| {m['program']} | {m['schedule']} | {call} | {m['measured_s'] * 1e6:.1f} us | "
                     f"{m['bound_s'] * 1e6:.1f} us | {m['ratio']:.2f}x | {len(m['unmatched_units'])} | {len(m['unlisted'])} |"
                     if m["ratio"] is not None else f"| {m['program']} | {m['schedule']} | {call} | | | | | |")
    for m in doc["runs"]:
        if "error" not in m:
            lines += ex.measured_table(m)
    return "\n".join(lines) + "\n"


def kernels(a, out: Path) -> dict:
    """--kernels (on the GPU) or --kernels-dry TRACES: the measured runs, printed and returned."""
    import tempfile
    tmp = Path(tempfile.mkdtemp())
    machine = out / "machine.json"
    if a.kernels_dry:
        from coconetc.tune.explain import PEAK_TFLOPS
        given = json.loads(Path(a.kernels_dry).read_text())
        device, runs = given.get("device", "recorded"), given["runs"]
        machine.write_text(json.dumps({"device": device, "bandwidth_gbps": given["bandwidth_gbps"],
                                       "peak_tflops": {**PEAK_TFLOPS, **(given.get("peak_tflops") or {})}}))
    else:
        import torch
        from coconetc.tune.explain import PEAK_TFLOPS
        device = torch.cuda.get_device_name()
        bw = copy_bandwidth()
        torch.cuda.empty_cache()
        print(f"copy bandwidth: {bw / 1e9:.0f} GB/s (1 GiB device to device)", flush=True)
        machine.write_text(json.dumps({"device": device, "bandwidth_gbps": bw / 1e9, "peak_tflops": PEAK_TFLOPS}))
        runs = profile_runs(a.archs, tmp, a.kernels_only, a.kernels_budget)
    doc = measured_runs([r for r in runs if "error" not in r], str(machine), device)
    doc["runs"] += [r for r in runs if "error" in r]
    print(kernels_report(doc), flush=True)
    return doc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1 << 26)
    ap.add_argument("--archs", default="90")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=".")
    ap.add_argument("--skip-examples", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--odd", type=int, default=11, help="the second size of every size symbol")
    ap.add_argument("--misalign", action="store_true",
                    help="every tensor one element past its allocation's start (the kernels' element path)")
    ap.add_argument("--kernels", action="store_true",
                    help="only: every kernel of KERNEL_RUNS' schedules against its bound (torch.profiler)")
    ap.add_argument("--kernels-only", default="", metavar="NAME", help="with --kernels: one example file or program")
    ap.add_argument("--kernels-dry", metavar="TRACES", help="--kernels from recorded traces, without a GPU")
    ap.add_argument("--kernels-budget", type=float, default=90.0, metavar="S",
                    help="with --kernels: profile no new program past S seconds (0: no limit)")
    a = ap.parse_args()
    global ODD, MISALIGN
    ODD, MISALIGN = a.odd, a.misalign
    if a.kernels or a.kernels_dry:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        doc = kernels(a, out)
        (out / "cuda_gpu_check.json").write_text(json.dumps({"kernels": doc}, indent=1))
        return
    import torch
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    res: dict = {}
    if not a.skip_examples:
        rows = check_examples(a.archs)
        res["examples"] = rows
        print("\n| file | program | schedule | sizes | result | detail |\n| --- | --- | --- | --- | --- | --- |")
        for r in rows:
            print(f"| {r['file']} | {r['program']} | {r['schedule']} | {r.get('sizes', '')} | {r['status']} | "
                  f"{r['detail'][:300].replace(chr(10), ' ')} |", flush=True)
    if a.skip_bench:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "cuda_gpu_check.json").write_text(json.dumps(res, indent=1))
        return
    b = bench(a.n, a.archs, a.reps)
    res["bench"] = b
    print(f"\n| N = {a.n} | median ms | GB/s (7x4 B/elem) | x torch fused Adam | x copy roofline |\n| --- | --- | --- | --- | --- |")
    for r in b:
        print(f"| {r['what']} | {r['ms']:.4g} | {r['gbps']:.0f} | {r['vs_torch']:.2f} | {r['vs_copy_roofline']:.2f} |")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "cuda_gpu_check.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    sys.exit(main())
