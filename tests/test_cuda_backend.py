"""The CUDA backend without a GPU: the renderer's text, what `check --backend cuda` reports, and
every example's CUDA module compiled and linked by nvcc against the NCCL/cuBLAS/CUDA runtime
wheels (cached by content hash, so a second run only imports nothing and checks the cache).
Running the modules needs a GPU: bench/cuda_gpu_check.py does that (docs/cuda.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from coconetc.build import cuda_build
from coconetc.codegen.cuda import Unsupported, generate, problems
from coconetc.plan import plan_program

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.ccn"))
ARCHS = "90"  # one architecture keeps the builds short; the default is 80;90


def test_sgd_fused_renders_a_chunk_pipeline_and_nccl(example):
    src = generate(example("sgd.ccn"), "m")
    fused = src.functions[("sgd", "fused")].body
    text = "\n".join(fused)
    assert "coconet::cuda::pipeline<float>" in text
    assert "reduce_chunk<float>(ncclSum, v_g" in text
    assert "gather_chunk<float>(v_agw" in text
    assert "[=] __device__ (int64_t j)" in text  # the chunk's kernel
    default = "\n".join(src.functions[("sgd", "default")].body)
    assert "coconet::cuda::allreduce<float>(ncclSum, v_g" in default
    assert "coconet::cuda::launch(" in default


def test_loops_use_the_shared_element_emitter(example):
    """The kernel body is the CPU loop's element math (codegen/emit.py): same text."""
    from coconetc.codegen.render import render as render_cpu
    mod = example("adam.ccn")
    p = mod.programs["adam"]
    cpu = "\n".join(render_cpu(plan_program(p, "default"), "f", "adam.ccn", []).body)
    cuda = "\n".join(generate(mod, "m").functions[("adam", "default")].body)
    math = [ln.strip() for ln in cuda.splitlines() if ln.strip().startswith("const float x_")]
    assert math and all(m in cpu for m in math)


def test_dropout_uses_the_philox_rng_at_the_global_index(example):
    text = "\n".join(generate(example("residual_dropout.ccn"), "m", skip_unsupported=True)
                     .functions[("f1", "default")].body)
    assert "coconet::dropout<" in text


def test_matmul_is_cublas_and_collectives_are_nccl(example):
    src = generate(example("mlp_out.ccn"), "m", skip_unsupported=True)
    text = "\n".join(src.functions[("mlp_out", "default")].body)
    assert "coconet::cuda::matmul<coconet::half>" in text
    assert "coconet::cuda::allreduce<coconet::half>(ncclSum" in text
    assert "cublasGemmEx" in (Path(cuda_build.runtime_dir()) / "coconet" / "cuda" / "runtime.cuh").read_text()


# What the CUDA renderer does not do yet (every example is in it now): an allgather of a sliced
# scattered tensor (which the CPU backend does not build either); the other program is rendered.
UNSUPPORTED = """program q(x: f32[N] replicated scattered) {
    a = broadcast(x, 0)
    return a
}
program p(x: f32[N] sliced(0) scattered) {
    a = allgather(x)
    return a
}
"""


def test_unsupported_units_are_reported_not_rendered(tmp_path):
    from coconetc.driver import load_file
    path = tmp_path / "u.ccn"
    path.write_text(UNSUPPORTED)
    mod = load_file(str(path))
    found = problems(mod)
    assert set(found) == {("p", "default")}
    assert found[("p", "default")][0].line == 6
    with pytest.raises(Unsupported, match="an allgather of a sliced scattered tensor"):
        generate(mod, "m")
    assert ("q", "default") in generate(mod, "m", skip_unsupported=True).functions


def test_every_example_is_in_the_cuda_backend(example):
    for path in EXAMPLES:
        assert not problems(example(path.name)), path.name


def test_overlap_chunks_on_two_streams(example):
    src = generate(example("tp_overlap.ccn"), "m")
    rows = "\n".join(generate(example("mlp_out.ccn"), "m", skip_unsupported=True)
                     .functions[("mlp_out", "overlap_ar")].body)
    assert "coconet::cuda::join(ctx.stream, ctx.comm_stream" in rows  # the chunk's event
    assert "allreduce<coconet::half>(ncclSum, v_y + r.begin" in rows and "cctx);" in rows
    packed = "\n".join(src.functions[("row_parallel", "rs_seq")].body)
    assert "reduce_scatter<float>(ncclSum, P, Q" in packed and "unpack<float>(Q, v_rs" in packed


def test_check_backend_cuda_reports_at_the_directive(tmp_path):
    path = tmp_path / "u.ccn"
    path.write_text(UNSUPPORTED)
    res = subprocess.run([str(Path(sys.executable).parent / "coconetc"), "check", "--backend", "cuda",
                          str(path)], capture_output=True, text=True)
    assert res.returncode == 1
    assert ("u.ccn:6: error: p (schedule default): an allgather of a sliced scattered tensor ('x') is not in the "
            "CUDA backend yet") in res.stderr
    ok = subprocess.run([str(Path(sys.executable).parent / "coconetc"), "check", "--backend", "cuda",
                         str(EXAMPLES[0].parent / "adam.ccn")], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr


def test_emit_only_writes_the_cuda_sources(tmp_path):
    res = subprocess.run([str(Path(sys.executable).parent / "coconetc"), "compile", "--backend", "cuda",
                          "--emit-only", "-o", str(tmp_path), str(EXAMPLES[0].parent / "sgd.ccn")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    cmake = (tmp_path / "CMakeLists.txt").read_text()
    assert "LANGUAGES CXX CUDA" in cmake and "-l:libnccl.so.2" in cmake and "80;90" in cmake
    assert "ncclSum" in (tmp_path / "module.cu").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_compiles_and_links_with_nvcc(path):
    why = cuda_build.missing()
    if why:
        print(f"skipped: {why}")
        pytest.skip(why)
    _, src, so = cuda_build.compile_cuda(path, None, ARCHS, skip_unsupported=True, log=lambda m: None)
    assert so is not None and so.exists()
    # linked against the wheels' NCCL (and cuBLAS where a matmul is used), resolvable without a GPU
    ldd = subprocess.run(["ldd", str(so)], capture_output=True, text=True).stdout
    assert "libnccl.so.2" in ldd and "not found" not in ldd, ldd
