"""GEMM epilogues on CUDA (issue 40 point 1, plan/epilogue.py Library.fused): a matmul whose plan
fuses its epilogue on CUDA is one cublasLtMatmul (runtime_cpp/coconet/cuda/blas.cuh
matmul_epilogue: CUBLASLT_EPILOGUE_BIAS, the residual as C with beta = 1, the scale as alpha),
gelu_bias the GEMM then its kernel (cuBLASLt's GELU is the tanh approximation, the language's the
exact one). Checked here without a GPU: the generated code, the programs of
tests/programs/epilogues.ccn under the host emulation (cuBLASLt on the CPU GEMM,
emulate_blas.h) against the interpreter at 2 ranks, and the module built by nvcc for sm_80 and
sm_90 where nvcc is installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from rank_checks import ranks_run

from coconetc import toolchain
from coconetc.sourcefile import load_file
from coconetc.toolchain import compiler, probes

REPO = Path(__file__).resolve().parents[1]
EPILOGUES = REPO / "tests" / "programs" / "epilogues.ccn"
WORKER = str(Path(__file__).with_name("cuda_emulate_worker.py"))
FUSED = {"bias": "v_b, nullptr, 1.0f", "bias_k": "v_b, nullptr, 1.0f", "linear": "v_b, nullptr, 1.0f", "bias_rows": "v_b, nullptr, 1.0f", "residual": "nullptr, v_r, 1.0f",
         "scale": "nullptr, nullptr, float(coconet::to_compute(v_k[0]))", "scale_literal": "nullptr, nullptr, float(0.5)"}


def _function(cu: str, program: str) -> str:
    lo = cu.index(f"// program {program}, schedule default")
    hi = cu.find("// program ", lo + 1)
    return cu[lo:hi if hi > 0 else len(cu)]


def test_the_cuda_code_is_one_cublaslt_matmul_where_the_plan_fuses():
    from coconetc.codegen.cuda import generate
    cu = generate(load_file(EPILOGUES), compiler.PROBE, skip_unsupported=True, emulate=True).cu
    for program, args in FUSED.items():
        f = _function(cu, program)
        # y written by the GEMM; where cuBLASLt refuses it (false), the GEMM into the scratch a, then y's kernel
        assert "if (!coconet::cuda::matmul_epilogue<float>(v_x, v_w, v_y, " in f and f"{args}, stream)) {{" in f, f
        fallback = f[f.index("if (!coconet::cuda::matmul_epilogue"):f.index("// kernel y: the epilogue")]
        assert "coconet::cuda::matmul<float>(v_x, v_w, v_a, " in fallback and "launch_threads" in fallback, f
        assert "kernel: y (" not in f, f
    assert "S_B * S_M, int64_t(5), int64_t(7), v_b" in _function(cu, "bias_rows")  # [B, M, 5] x [5, 7]: B*M rows
    b16 = _function(cu, "bias_bf16")  # bf16: the bias and the residual
    assert "matmul_epilogue<coconet::bfloat16>(v_x, v_w, v_y, S_M, int64_t(5), int64_t(7), v_b, nullptr, 1.0f" in b16, b16
    assert "matmul_epilogue<coconet::bfloat16>(v_x, v_w, v_z, S_M, int64_t(5), int64_t(7), nullptr, v_r, 1.0f" in b16, b16
    g = _function(cu, "gelu_bias")
    assert "matmul_epilogue" not in g and "coconet::cuda::matmul<float>(v_x, v_w, v_a," in g and "kernel: y" in g


@pytest.mark.slow  # the quick set checks the generated calls (above) and the plan (test_epilogue_plan)
def test_the_epilogues_match_the_interpreter_under_the_emulation(request):
    """Every program of epilogues.ccn, emulated, against the interpreter at 2 ranks (bias: w's
    columns and the bias sliced over the ranks, so each rank's bias is its slice), M = 9; f32,
    and bf16 (bias, residual) at the interpreter's bf16 tolerance; again with every
    cublasLtMatmul refused (COCONET_EMULATE_NO_CUBLASLT: the GEMM, then the loop); then bias_k at
    K = 0 (one rank, the module built already: matmul_epilogue's GEMM over zeros)."""
    why = probes.emulation_missing()
    if why:
        pytest.skip(why)
    toolchain.compile(load_file(EPILOGUES), "cuda-emulated", toolchain.Options(log=lambda msg: None))
    res = ranks_run(2, [WORKER, "match", "9", "0", str(EPILOGUES)])
    refused = ranks_run(2, [WORKER, "match", "9", "0", str(EPILOGUES)], env={"COCONET_EMULATE_NO_CUBLASLT": "1"})
    k0 = subprocess.run([str(Path(sys.executable).parent / "coconetc"), "run", str(EPILOGUES), "-p", "bias_k",
                         "--backend", "cuda", "--emulate", "--ranks", "1", "--size", "M=3", "--size", "K=0"],
                        capture_output=True, text=True, timeout=600)
    log = f"--- stdout\n{res.stdout}\n--- stderr\n{res.stderr[-4000:]}"
    assert res.returncode == 0, log
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(("MATCH", "MISMATCH"))]
    assert len(lines) == 9 and all(ln.startswith("MATCH ") for ln in lines), log
    # every cublasLtMatmul refused (as a GPU's cuBLASLt refuses a GEMM it has no algorithm for): the unfused paths
    log = f"--- stdout\n{refused.stdout}\n--- stderr\n{refused.stderr[-4000:]}"
    lines = [ln for ln in refused.stdout.splitlines() if ln.startswith(("MATCH", "MISMATCH"))]
    assert refused.returncode == 0 and len(lines) == 9 and all(ln.startswith("MATCH ") for ln in lines), log
    assert k0.returncode == 0 and "matches the interpreter on every rank" in k0.stdout, k0.stdout + k0.stderr[-4000:]
    assert "compiling" not in k0.stderr, k0.stderr  # the module of the match run


@pytest.mark.slow  # the quick set checks the generated calls (above) and the plan (test_epilogue_plan)
def test_the_bias_gradient_is_the_weight_gradients_epilogue_under_the_emulation(request):
    """linear's derived program on CUDA: d_b = sum_lead(d_y) computed by the cublasLtMatmul of
    d_w = matmul_tn(x, d_y) (CUBLASLT_EPILOGUE_BGRADA; the plan's bgrad epilogue), emulated at 2
    ranks (w's columns and b sliced) against the interpreter, and at M = 0 (the unfused pair); the
    CPU keeps the sum_lead."""
    from coconetc.codegen.cuda import generate
    from coconetc.sourcefile import with_grads
    mod = with_grads(load_file(EPILOGUES), ["linear"])
    f = _function(generate(mod, compiler.PROBE, skip_unsupported=True, emulate=True).cu, "linear_grad")
    assert "matmul_tn_bgrad<float>(v_x, v_d_y, v_d_w, S_B * S_M, int64_t(5), " in f and ", v_d_b, ctx);" in f, f
    assert "coconet::cuda::sum_lead" not in f and "d_b: the bias-gradient epilogue" in f, f
    why = probes.emulation_missing()
    if why:
        pytest.skip(why)
    for m in ("3", "0"):  # M = 0: no rows, matmul_tn_bgrad's unfused pair (zeros)
        res = subprocess.run([str(Path(sys.executable).parent / "coconetc"), "run", str(EPILOGUES), "-p", "linear",
                              "--grad", "--backend", "cuda", "--emulate", "--ranks", "2", "--size", f"M={m}", "--size", "B=2"],
                             capture_output=True, text=True, timeout=600)
        assert res.returncode == 0 and "matches the interpreter on every rank" in res.stdout, \
            m + res.stdout + res.stderr[-4000:]


@pytest.mark.slow
def test_the_epilogues_build_with_nvcc_for_sm80_and_sm90(tmp_path):
    why = probes.cuda_missing()
    if why:
        pytest.skip(why)
    """Built whole for sm_90 (host code against the wheels' cuBLASLt, linked with the binding the
    other sm_90 builds share) and its device code compiled for sm_80 too (nvcc --cubin with the
    build's options): a build for "80;90" would compile the binding for that pair again, for no
    code of the module's."""
    from coconetc.sourcefile import with_grads
    from coconetc.toolchain import commands
    mod = with_grads(load_file(EPILOGUES), ["linear"])  # matmul_tn_bgrad too
    art = toolchain.compile(mod, "cuda", toolchain.Options(archs="90", log=lambda m: None))
    so = art.path
    assert so is not None and so.exists()
    ldd = subprocess.run(["ldd", str(so)], capture_output=True, text=True).stdout
    assert "libcublasLt.so" in ldd and "not found" not in ldd, ldd
    (cu,) = [f for f in art.write_sources(tmp_path) if f.name == "module.cu"]
    cubin = tmp_path / "module.sm_80.cubin"
    res = subprocess.run([*commands.cuda_flags("80-real"), "--cubin", "-o", str(cubin), str(cu)],
                         capture_output=True, text=True)
    assert res.returncode == 0 and cubin.stat().st_size > 0, res.stdout[-3000:] + res.stderr[-3000:]
