"""Every kernel against its bound (issue 40 point 3), without a GPU: `coconetc explain --backend
cuda -s S --format json` lists each unit's kernels, bytes, flops and bound, checked here against
values computed from the program's sizes by hand; and the GPU script's Python parts
(bench/cuda_gpu_check.py --kernels-dry, bench/cuda_gpu_report.py) run on a fabricated profiler
trace, checked for the kernels each unit is given and measured / bound."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from coconetc.cli import main

ROOT = Path(__file__).resolve().parent.parent
F32 = 4  # bytes


def listing(file: str, program: str, schedule: str, ranks: int, sizes: dict, *extra: str) -> dict:
    args = ["explain", str(ROOT / "examples" / file), "-p", program, "--backend", "cuda", "-s", schedule,
            "-n", str(ranks), "--format", "json", *extra]
    for k, v in sizes.items():
        args += ["--size", f"{k}={v}"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def bound(nbytes: float, flops: float, gbps: float, tflops: float) -> float:
    return max(nbytes / (gbps * 1e9), flops / (tflops * 1e12))


def _function(module_cu: str, fn: str) -> str:
    """The body of function FN in a generated module.cu."""
    start = module_cu.index(f"void {fn}(")
    end = module_cu.find("\n}\n", start)
    return module_cu[start:end]


def test_tp_mlp_listing_bytes_flops_bound():
    B, S, H, F, R = 2, 8, 16, 32, 2
    bw, peak = 1000.0, 0.001  # GB/s, TFLOP/s: the GEMMs compute-bound, the pointwise kernels memory-bound
    doc = listing("tp_mlp.ccn", "tp_mlp", "default", R, dict(B=B, S=S, H=H, F=F),
                  "--bandwidth", str(bw), "--peak", str(peak))
    units = {u["what"]: u for u in doc["kernels"]}
    assert [u["what"] for u in doc["kernels"]] == ["matmul a", "kernel: h", "matmul p", "allreduce s (NCCL)",
                                                   "kernel: y"]
    f = F // R  # this rank's columns of w1, rows of w2
    # a = matmul(x, w1): x[B,S,H] and w1[H,F/R] read, a[B,S,F/R] written; 2*M*N*K flops
    a = units["matmul a"]
    assert a["read"] == (B * S * H + H * f) * F32
    assert a["written"] == B * S * f * F32
    assert a["flops"] == 2 * (B * S) * f * H
    assert a["bound_s"] == pytest.approx(bound(a["read"] + a["written"], 2 * B * S * f * H, bw, peak))
    assert a["limit"] == "compute" and a["libraries"] == ["cublas"] and a["kernels"] == []
    # p = matmul(h, w2): h[B,S,F/R], w2[F/R,H] -> p[B,S,H], K = F/R
    p = units["matmul p"]
    assert (p["read"], p["written"], p["flops"]) == ((B * S * f + f * H) * F32, B * S * H * F32, 2 * B * S * H * f)
    # h = gelu(a + b1): a[B,S,F/R] and b1[F/R] read once, h written
    h = units["kernel: h"]
    assert (h["read"], h["written"], h["flops"]) == ((B * S * f + f) * F32, B * S * f * F32, 0)
    assert h["bound_s"] == pytest.approx(((B * S * f + f) + B * S * f) * F32 / (bw * 1e9))
    assert h["limit"] == "memory" and h["libraries"] == []
    y = units["kernel: y"]  # y = s + b2, all replicated
    assert (y["read"], y["written"]) == ((B * S * H + H) * F32, B * S * H * F32)
    assert doc["bound_s"] == pytest.approx(sum(u["bound_s"] for u in doc["kernels"]))
    # the kernels as the generated code names them: the function's extended lambdas in order
    fn = "tp_mlp__default"
    assert doc["function"] == fn
    lam = f"coconet_gen::{fn}(coconet::cuda::CallArgs const&)::{{lambda(auto:1 const&)#"  # generic: int32 or int64
    assert h["kernels"] == [lam + "1}"] and y["kernels"] == [lam + "2}"]
    body = _function((ROOT / "tests/golden/code/tp_mlp/module.cu").read_text(), fn)
    assert len(re.findall(r"\[=\] __device__ \(const auto& th\)", body)) == 2


def test_adam_listing_bytes_and_bound():
    N, R = 1000, 2
    doc = listing("adam.ccn", "adam", "default", R, dict(N=N))
    assert doc["bandwidth_gbps"] == 3350.0 and doc["peak_tflops"]["f32"] == 67.0  # the documented defaults
    ar, k = doc["kernels"]
    # the update kernel reads g1, w, m, v and writes m, v, w in place (mh, vh stay in registers)
    assert (k["read"], k["written"], k["flops"]) == (4 * N * F32, 3 * N * F32, 0)
    assert k["bound_s"] == pytest.approx(7 * N * F32 / 3350e9)
    assert k["kernels"] == ["coconet_gen::adam__default(coconet::cuda::CallArgs const&)::"
                            "{lambda(auto:1 const&)#1}"]
    # the all-reduce: its input, what it receives (2 (R-1)/R of it) and its output
    assert (ar["read"], ar["written"]) == (N * F32 + 2 * (R - 1) / R * N * F32, N * F32)
    assert "nccl" in ar["libraries"] and ar["kernels"] == []


def test_machine_json_and_errors(tmp_path):
    (tmp_path / "m.json").write_text(json.dumps({"device": "X", "bandwidth_gbps": 2000, "peak_tflops": {"f32": 50}}))
    doc = listing("adam.ccn", "adam", "default", 1, dict(N=1000), "--machine", str(tmp_path / "m.json"))
    k = doc["kernels"][1]
    assert doc["bandwidth_gbps"] == 2000 and k["bound_s"] == pytest.approx(7 * 1000 * F32 / 2000e9)
    r = CliRunner().invoke(main, ["explain", str(ROOT / "examples/adam.ccn"), "--backend", "cuda", "-s", "zero"])
    assert r.exit_code == 1 and "--size N=INT" in r.output
    r = CliRunner().invoke(main, ["explain", str(ROOT / "examples/adam.ccn"), "--format", "json"])
    assert r.exit_code == 1 and "--backend cuda -s SCHEDULE" in r.output
    (tmp_path / "bad.json").write_text("[1")
    r = CliRunner().invoke(main, ["explain", str(ROOT / "examples/adam.ccn"), "--backend", "cuda", "-s", "zero",
                                  "--size", "N=8", "--machine", str(tmp_path / "bad.json")])
    assert r.exit_code == 1 and "not a machine JSON" in r.output


def _kernel(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": 7}}


def _lambda(fn: str, k: int) -> str:
    lam = f"coconet_gen::{fn}(coconet::cuda::CallArgs const&)::{{lambda(auto:1 const&)#{k}}}"  # as nvcc names it
    return f"void coconet::cuda::threads_kernel<4, int, {lam}>(int, bool, {lam})"


GEMM = "sm90_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize128x128x8_stage3_warpsize2x2x1_ffma_aligna4_alignc4"


def test_gpu_script_dry_run_and_report(tmp_path):
    sizes_tp, sizes_adam = dict(B=8, S=512, H=1024, F=4096), dict(N=1 << 24)
    bw = 4000.0
    tp_trace = [_kernel(GEMM, 10, 600.0), _kernel(_lambda("tp_mlp__default", 1), 700, 40.0),
                _kernel("void at::native::unrolled_elementwise_kernel<x>()", 750, 3.0),  # no unit's
                _kernel(GEMM, 800, 610.0), _kernel("Memcpy DtoD (Device -> Device)", 1500, 11.0, "gpu_memcpy"),
                _kernel(_lambda("tp_mlp__default", 2), 1600, 12.0)]
    adam_trace = [_kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 0, 50.0)]
    traces = {"device": "fabricated", "bandwidth_gbps": bw, "peak_tflops": {"f32": 60.0},
              "runs": [dict(file="tp_mlp.ccn", program="tp_mlp", schedule="default", sizes=sizes_tp, call_s=0.0013,
                            trace={"traceEvents": tp_trace}),
                       dict(file="adam.ccn", program="adam", schedule="default", sizes=sizes_adam,
                            trace={"traceEvents": adam_trace}),
                       dict(file="adam.ccn", program="adam", schedule="nope", sizes=sizes_adam, trace=[])]}
    (tmp_path / "traces.json").write_text(json.dumps(traces))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(ROOT / "bench/cuda_gpu_check.py"), "--kernels-dry",
                        str(tmp_path / "traces.json"), "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    doc = json.loads((out / "cuda_gpu_check.json").read_text())["kernels"]
    tp, adam, bad = doc["runs"]
    B, S, H, F = 8, 512, 1024, 4096
    units = {u["what"]: u for u in tp["units"]}
    h_bound = (2 * B * S * F + F) * F32 / (bw * 1e9)  # a and b1 read, h written (R = 1)
    assert units["kernel: h"]["measured_s"] == pytest.approx(40e-6)
    assert units["kernel: h"]["ratio"] == pytest.approx(40e-6 / h_bound)
    a_bound = max((B * S * H + H * F + B * S * F) * F32 / (bw * 1e9), 2 * B * S * F * H / 60e12)
    assert units["matmul a"]["bound_s"] == pytest.approx(a_bound)
    assert units["matmul a"]["measured_s"] == pytest.approx(600e-6) and units["matmul p"]["measured_s"] == pytest.approx(610e-6)
    assert units["allreduce s (NCCL)"]["matched"] == ["Memcpy DtoD (Device -> Device)"]  # one rank: NCCL copies
    assert units["kernel: y"]["measured_s"] == pytest.approx(12e-6)
    assert [e["name"] for e in tp["unlisted"]] == ["void at::native::unrolled_elementwise_kernel<x>()"]
    assert tp["unmatched_units"] == []
    assert tp["measured_s"] == pytest.approx((600 + 40 + 3 + 610 + 11 + 12) * 1e-6)
    # adam: the update kernel is missing from the trace: reported, not fatal
    au = {u["what"]: u for u in adam["units"]}
    assert au["allreduce g1 (NCCL)"]["measured_s"] == pytest.approx(50e-6)
    assert adam["unmatched_units"] == [1] and au["kernel: m1, v1, mh, vh, w1"]["measured_s"] is None
    assert "no schedule 'nope'" in bad["error"]
    assert "measured / bound" in r.stdout and "NO MATCH" in r.stdout
    # the run's report reads the step's JSON
    steps = tmp_path / "steps"
    steps.mkdir()
    (steps / "kernels.json").write_text((out / "cuda_gpu_check.json").read_text())
    (steps / "steps.tsv").write_text("kernels\t0\t61\n")
    r = subprocess.run([sys.executable, str(ROOT / "bench/cuda_gpu_report.py"), str(steps)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    md = (steps / "gpu_run.md").read_text()
    assert "Every kernel against its bound" in md and "not in the report" not in md
    assert f"{40e-6 / h_bound:.2f}x" in md


def test_derived_gemm_flops():
    """matmul_tn contracts a's leading dims (the weight gradients), matmul_nt a's last dim."""
    B, S, H, F, R = 2, 4, 8, 32, 2
    doc = listing("tp_mlp.ccn", "tp_mlp_grad", "default", R, dict(B=B, S=S, H=H, F=F))
    units = {u["what"]: u for u in doc["kernels"]}
    f = F // R
    assert units["matmul_tn d_w1"]["flops"] == 2 * H * f * (B * S)  # x^T [H, B*S] @ g_h_add [B*S, F/R]
    assert units["matmul_tn d_w2"]["flops"] == 2 * f * H * (B * S)  # h^T @ d_y
    assert units["matmul_nt g_h"]["flops"] == 2 * (B * S) * f * H  # d_y [B*S, H] @ w2^T [H, F/R]
    assert units["matmul_tn d_w1"]["written"] == H * f * F32


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adam.ccn", "tp_mlp.ccn"])
def test_listing_names_are_the_modules_kernels(name):
    """The listing's kernel names are the device kernels nvcc makes of the module (its symbols,
    demangled as a profiler shows them), both ways: every name listed is a kernel of the module,
    and every generated kernel of the module is listed (the module as test_cuda_backend's nvcc
    test builds it: one build, cached)."""
    import shutil

    from coconetc import toolchain
    from coconetc.sourcefile import load_file
    from coconetc.toolchain import probes
    from coconetc.tune import explain as ex
    from test_cuda_backend import ARCHS
    why = probes.cuda_missing() or ("no c++filt" if shutil.which("c++filt") is None else "")
    if why:
        pytest.skip(why)
    mod = load_file(ROOT / "examples" / name)
    so = toolchain.compile(mod, "cuda", toolchain.Options(archs=ARCHS, log=lambda m: None)).path
    mangled = sorted({m.decode() for m in re.findall(rb"_ZN7coconet4cuda\w+", so.read_bytes())})
    demangled = subprocess.run(["c++filt"], input="\n".join(mangled), capture_output=True, text=True).stdout
    kernels = {ex.lambda_key(line) for line in demangled.splitlines()
               if line.startswith("void coconet::cuda::") and "__nv_dl" not in line and "device_stub" not in line}
    kernels.discard(None)
    assert len(kernels) >= 4, demangled[-2000:]  # adam: 6, tp_mlp: dozens
    listed = set()
    sizes = {k: 64 for k in ("B", "S", "H", "F", "N")}
    for (program, schedule) in mod.variants():
        doc = ex.kernel_listing(mod, program, schedule, 1, {k: sizes[k] for k in ex.symbols(mod, program)}, "cuda",
                                records=False)
        listed |= {ex.lambda_key(k) for u in doc["kernels"] for k in u["kernels"]}
    assert listed == kernels, (sorted(listed - kernels, key=str), sorted(kernels - listed, key=str))


def test_gpu_script_profiles_every_schedule(monkeypatch, tmp_path):
    """profile_runs' glue without a GPU: the module, the profiler and the device timing faked;
    every schedule of the program called with its own inputs and profiled once, the trace kept
    to its device events, and the runs matched to their listings."""
    import torch

    from coconetc.runtime import cuda as runtime_cuda
    from coconetc.sourcefile import load_file
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import cuda_gpu_check as gc
    src = load_file(ROOT / "examples" / "adam.ccn")
    called: list[tuple[str, tuple]] = []

    class Fn:
        schedules = {s: src.variants()[("adam", s)] for p, s in src.variants() if p == "adam"}

        def __call__(self, schedule, comm, **args):
            called.append((schedule, tuple(sorted(args))))

    class Module:
        programs = {"adam": Fn()}
        source_module = src
        ext = object()

        def comm(self):
            return None

    class Profile:
        def __init__(self, activities):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def export_chrome_trace(self, path):
            events = [{"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 0, "dur": 5},
                      {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", "ts": 1,
                       "dur": 7}]
            Path(path).write_text(json.dumps({"traceEvents": events}))

    monkeypatch.setattr(gc, "KERNEL_RUNS", [("adam.ccn", "adam", {"N": 64})])
    monkeypatch.setattr(runtime_cuda, "load", lambda *a, **k: Module())
    monkeypatch.setattr(torch.profiler, "profile", Profile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(gc, "_torch", lambda v: v)
    monkeypatch.setattr(gc.common, "device_timed", lambda fn, reps, warmup=3: (fn(), 2e-3)[1])
    runs = gc.profile_runs("90", tmp_path)
    scheds = list(Fn.schedules)
    assert [r["schedule"] for r in runs] == scheds and all("error" not in r for r in runs), runs
    assert {s for s, _ in called} == set(scheds) and len(called) == 2 * len(scheds)  # timed once, profiled once
    assert all(args == ("beta1", "beta2", "eps", "g", "lr", "m", "step", "v", "w") for _, args in called)
    assert all([e["cat"] for e in r["trace"]["traceEvents"]] == ["kernel"] for r in runs)
    (tmp_path / "machine.json").write_text(json.dumps({"bandwidth_gbps": 1000.0}))
    doc = gc.measured_runs(runs, str(tmp_path / "machine.json"), "fake")
    by = {m["schedule"]: m for m in doc["runs"]}
    assert by["default"]["units"][0]["measured_s"] == pytest.approx(7e-6)  # the all-reduce's NCCL kernel
    assert by["default"]["unmatched_units"] == [1] and by["default"]["call_s"] == 2e-3
    # past its budget no new program is profiled: named, not run
    assert gc.profile_runs("90", tmp_path, budget=1e-9)[0]["error"].startswith("skipped")


def test_listing_shows_the_recorded_call_time(tmp_path, monkeypatch):
    """With a tuning record of the backend at these sizes, the listing gives the call's
    measured time beside the bound (a hand-written record, in a tuning file of the test's own)."""
    from coconetc.plan.targets import Target
    from coconetc.runtime import tuned
    from coconetc.sourcefile import load_file
    monkeypatch.setenv(tuned.ENV_TUNING, str(tmp_path / "tuning.json"))
    mod = load_file(ROOT / "examples" / "adam.ccn")
    rec = {"file": str(ROOT / "examples/adam.ccn"), "program": "adam", "sizes": {"N": 64}, "ranks": 2, "groups": 1,
           "machine": tuned.machine(Target.EMULATED), "target": Target.EMULATED, "time": 1.0,
           "measured": {"default": 9e-3, "zero": 7e-3}, "choice": "zero", "by_convention": {"": "zero"},
           "conventions": {}, "generated": [], "schedules": {}, "modelled": {}}
    tuned.store(tuned.key(mod.source, "adam", {"N": 64}, 2, target=Target.EMULATED), rec)
    doc = listing("adam.ccn", "adam", "zero", 2, {"N": 64}, "--emulate")
    assert doc["measured_s"] == 7e-3
    res = CliRunner().invoke(main, ["explain", str(ROOT / "examples/adam.ccn"), "--backend", "cuda", "--emulate",
                                    "-s", "zero", "-n", "2", "--size", "N=64"])
    assert res.exit_code == 0 and res.output.splitlines()[-1].endswith("the call measured 7.00 ms (tuning cache)")
    assert listing("adam.ccn", "adam", "zero", 2, {"N": 128}, "--emulate")["measured_s"] is None


def test_report_reads_the_gpt_block_table(tmp_path):
    """bench/cuda_gpu_report.py renders bench/gpt_block_gpu.py's JSON (the keys it writes: each
    variant's median time and its ratios to torch with SDPA and to the GEMMs alone)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpt_block_gpu as gbg
    times = {"torch eager, SDPA": 0.004, "torch eager": 0.005, "coconet gpt_block default": 0.0032,
             "GEMMs alone": 0.002}
    a = type("A", (), {"json": str(tmp_path / "steps" / "gpt_block_bf16.json"), "dtype": "bf16", "reps": 3})()
    (tmp_path / "steps").mkdir()
    gbg.report({"times": times, "device": "fabricated", "shape": {"B": 8, "S": 512}}, a)
    (tmp_path / "steps" / "steps.tsv").write_text("gpt_block_bf16\t0\t40\n")
    r = subprocess.run([sys.executable, str(ROOT / "bench/cuda_gpu_report.py"), str(tmp_path / "steps")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    md = (tmp_path / "steps" / "gpu_run.md").read_text()
    assert "gpt_block forward + backward at one rank, bf16" in md and "not in the report" not in md
    assert f"| coconet gpt_block default | 3.200 | {0.004 / 0.0032:.2f} | {0.002 / 0.0032:.2f} |" in md
