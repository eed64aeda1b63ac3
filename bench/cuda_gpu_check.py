"""On a machine with a GPU (R = 1): compile every example with the CUDA backend, run every
program and schedule the CUDA backend implements on random inputs, compare with the
interpreter; then time the generated Adam step (schedules default, zero, fused; f32,
N = 2^26) against torch.optim.Adam(fused=True), and the device copy bandwidth, in one run.

Run: python bench/cuda_gpu_check.py [--n 67108864] [--archs 90] [--out DIR]
Prints two tables (markdown) and writes DIR/cuda_gpu_check.json. torch's allocations are
aligned, so the pointwise kernels take their vector path; --skip-bench --misalign runs the
examples again with every tensor one element off (their element path)."""

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
    a = ap.parse_args()
    global ODD, MISALIGN
    ODD, MISALIGN = a.odd, a.misalign
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
