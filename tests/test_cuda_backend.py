"""The CUDA backend without a GPU: the renderer's text, what `check --backend cuda` reports, and
every example's CUDA module compiled and linked by nvcc against the NCCL/cuBLAS/CUDA runtime
wheels (cached by content hash, so a second run only imports nothing and checks the cache).
Running the modules needs a GPU: bench/cuda_gpu_check.py does that (docs/cuda.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from coconetc import toolchain
from coconetc.paths import runtime_dir
from coconetc.toolchain import probes
from coconetc.codegen.cuda import Unsupported, generate, problems
from coconetc.sourcefile import load_file
from coconetc.plan import plan_program

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.ccn"))
VECTOR_OPS = Path(__file__).with_name("programs") / "vector_ops.ccn"
ARCHS = "90"  # one architecture keeps the builds short; the default is 80;90


def test_sgd_fused_renders_a_chunk_pipeline_and_nccl(example):
    src = generate(example("sgd.ccn"), "m")
    fused = src.functions[("sgd", "fused")].body
    text = "\n".join(fused)
    assert "coconet::cuda::pipeline<float>" in text
    assert "reduce_chunk<float>(ncclSum, v_g" in text
    assert "gather_chunk<float>(v_agw" in text
    assert "for (const auto j : th.elements())" in text  # the chunk's kernel (its index type the launch's)
    default = "\n".join(src.functions[("sgd", "default")].body)
    assert "coconet::cuda::allreduce<float>(ncclSum, v_g" in default
    assert "coconet::cuda::launch_threads<4>(" in default


def _operands(line: str) -> str:
    """An element line with each operand read (v_x[index] on the element path, in_x[u] in a
    vector lane) written <x>."""
    return re.sub(r"\b(?:v_(\w+)\[[^\[\]]*\]|in_(\w+)\[u\])", lambda m: f"<{m[1] or m[2]}>", line)


def test_fused_symmetric_branch_runs_the_pipeline_element_math(example):
    """A fused reduce-scatter along dim 0 renders a run-time choice: the symmetric kernel
    (runtime symmetric.cuh), whose per-thread function is the pipeline chunk kernel's, rendered by
    the same code: the Lets once per thread before the elements, the same vector lanes (the
    reduced vector from th.vreduce instead of a load from the chunk buffer) and the same element
    lines (the reduced value red_v from th.reduce instead of red[j]), the gathered value stored
    in this rank's window too (th.out); or else the pipeline. Other fused units render the
    pipeline only."""
    def lines(text: str, starts: tuple[str, ...]) -> list[str]:
        return [ln.strip() for ln in text.splitlines() if ln.strip().startswith(starts)]
    for file, prog, sched, ct in [("sgd.ccn", "sgd", "fused", "float"), ("adam.ccn", "adam", "zero", "float"),
                                  ("mixed_adam.ccn", "mixed_adam", "zero", "coconet::half"),
                                  ("clipped_sgd.ccn", "clipped_sgd", "fused", "float")]:
        text = "\n".join(generate(example(file), "m").functions[(prog, sched)].body)
        sym, pipe = text.split("} else  // the chunked pipeline on the host API")
        sym, pipe = sym.split("// [")[-1], pipe.split("coconet::cuda::pipeline<")[0]  # this unit's
        assert re.search(r'choice_fused0 = coconet::cuda::choose_fused\(ctx, "\w+", "fused0", S_N \* int64_t\(1\)\);',
                         sym)
        assert "if (choice_fused0.symmetric) {" in sym and "coconet::cuda::fused_done(choice_fused0, ctx);" in text
        assert f"coconet::cuda::fused_symmetric<{ct}, {ct}, 4>(ncclSum, v_g" in sym
        assert f"[=] __device__ (const coconet::cuda::SymThread<{ct}, {ct}, 4>& th) {{" in sym
        assert f"auto reduce_to = [&](int64_t k, {ct}* red)" in pipe
        s_lets, s_rest = sym.split("th.vectors()")
        s_lanes, s_elements = s_rest.split("th.elements()")
        p_lets, p_rest = pipe.split("th.vectors()")
        p_lanes, p_elements = p_rest.split("th.elements()")
        lets = lines(p_lets.split("[=] __device__")[-1], ("const float k",))
        assert lines(s_lets.split("[=] __device__")[-1], ("const float k",)) == lets  # once per thread
        assert "const auto in_rs = th.vreduce(i0);" in s_lanes and "in_rs = coconet::cuda::load<4>(red + j0);" in p_lanes
        lane = lines(p_lanes, ("const float x_", "out_"))
        assert lane and lines(s_lanes, ("const float x_", "out_")) == lane
        math = [ln for ln in lines(s_elements, ("const float x_", "v_", "th.out[")) if not ln.startswith("th.out[")]
        assert math and math == [ln.replace("red[j]", "red_v") for ln in lines(p_elements, ("const float x_", "v_"))]
        assert f"const {ct} red_v = th.reduce(i);" in s_elements
        # the gathered value into this rank's window too, where that is not the item's own buffer (R = 1)
        gathered = [ln for ln in lines(s_elements, ("if (static_cast<const void*>(th.out) != static_cast<const void*>(v_",))
                    if ") th.out[i] = coconet::from_compute<" in ln]
        assert len(gathered) == (0 if prog == "clipped_sgd" else 1), sym
        assert not lines(s_elements, ("th.out[",)), sym  # never unguarded
    keep = "\n".join(generate(example("clipped_sgd.ccn"), "m").functions[("clipped_sgd", "fused")].body)
    assert "fused_symmetric<float, float, 4>(ncclSum, v_g, S_N, int64_t(1), static_cast<float*>(nullptr), v_rs," in keep
    for file, prog, sched in [("residual_dropout.ccn", "f1", "fused"), ("lamb.ccn", "lamb", "zero"),
                              ("layernorm.ccn", "attn_out", "fused"), ("mlp_out.ccn", "mlp_out", "overlapped")]:
        text = "\n".join(generate(example(file), "m", skip_unsupported=True).functions[(prog, sched)].body)
        assert "choose_fused" not in text and "coconet::cuda::pipeline<" in text


def test_loops_use_the_shared_element_emitter(example):
    """The kernel body is the CPU loop's element math (codegen/emit.py): on the element path the
    same text (the CPU loop's operands read through its local copies, l_x: Writer.closure_locals);
    in the vector path's lanes the same text but for the operands, read from the vector loaded
    (in_x[u]) instead of memory (v_x[i])."""
    from coconetc.codegen.cpu.render import render as render_cpu
    mod = example("adam.ccn")
    p = mod.programs["adam"]
    cpu = "\n".join(render_cpu(plan_program(p, "default"), "f", "adam.ccn", []).body)
    assert "const auto l_v_m = v_m;" in cpu
    cpu = re.sub(r"\bl_(?=v_|k\d+_)", "", cpu)
    cuda = "\n".join(generate(mod, "m").functions[("adam", "default")].body)
    vec, elem = cuda.split("th.elements()")
    lanes = [ln.strip() for ln in vec.splitlines() if ln.strip().startswith("const float x_")]
    math = [ln.strip() for ln in elem.splitlines() if ln.strip().startswith("const float x_")]
    assert len(math) == 5 and all(m in cpu for m in math)
    assert len(lanes) == 5 and "in_m[u]" in lanes[0]
    assert [_operands(ln) for ln in lanes] == [_operands(m) for m in math]


def test_pointwise_kernels_hoist_lets_and_vectorize(example):
    """Lets once per thread, before its elements; a vector path of 16 bytes of the widest type
    (f32: 4, f16: 8, f16 with f32: 4), taken when every operand pointer is aligned, a broadcast
    operand read per lane through its coordinates (divided out once a vector, stepped by each
    lane); none where a value is stored at its gathered
    place."""
    text = "\n".join(generate(example("adam.ccn"), "m").functions[("adam", "default")].body)
    head = text[text.index("launch_threads<4>(S_N, coconet::cuda::aligned<4>(v_m, v_g1, v_v, v_w, v_m1, v_v1, v_w1)"):]
    assert head.index("k4_mh = 1.0f - coconet::power") < head.index("th.vectors()") < head.index("th.elements()")
    assert head.count("coconet::power") == 2  # computed once per thread, not per element
    assert "coconet::cuda::load<4>(v_m + i0)" in head and "coconet::cuda::store<4>(v_w1 + i0, out_w1)" in head
    zero = "\n".join(generate(example("adam.ccn"), "m").functions[("adam", "zero")].body)
    assert "aligned<4>(v_m + lo, red, v_v + lo, v_w + off * int64_t(1) + lo" in zero  # the chunk kernel
    mixed = "\n".join(generate(example("mixed_adam.ccn"), "m").functions[("mixed_adam", "default")].body)
    assert "launch_threads<4>" in mixed and "load<4>(v_g1 + i0)" in mixed  # f16 gradient, f32 state
    mlp = generate(example("mlp_out.ccn"), "m", skip_unsupported=True).functions
    default = "\n".join(mlp[("mlp_out", "default")].body)  # f16 x and r as vectors, the broadcast bias per lane
    lanes = default[default.index("launch_threads<8>"):default.index("th.elements()")]
    assert "aligned<8>(v_s, v_r, v_out)" in lanes and "v_b[c2 * int64_t(1)]" in lanes
    # the bias's coordinate divided out once a vector, then stepped lane by lane (no division in the lanes)
    once, each = lanes.split("COCONET_UNROLL")
    assert "cv2 = rest % L2;" in once and "%" not in each and "const int64_t c2 = cv2;" in each
    assert "if (++cv2 == L2) cv2 = 0;" in each
    assert "launch_threads<1>(" in "\n".join(mlp[("mlp_out", "overlapped")].body)  # stored at its gathered place
    drop = "\n".join(generate(load_file(str(VECTOR_OPS)), "m").functions[("drop16", "default")].body)
    assert "launch_threads<8>" in drop and "static_cast<uint64_t>(i)" in drop.split("th.elements()")[0]  # lanes
    lamb = "\n".join(generate(example("lamb.ccn"), "m").functions[("lamb", "default")].body)
    assert "load<4>(sp_m + q0)" in lamb  # a piece of a scattered tensor


def test_one_rank_fused_collective_reads_its_source(example):
    """At R = 1 a fused collective's chunks read the source directly: no chunk buffers, no
    reduction (coconet::cuda::pipeline's source); a scattered source keeps the general way."""
    text = "\n".join(generate(example("adam.ccn"), "m").functions[("adam", "fused")].body)
    assert "const int64_t nred_fused0 = comm.size == 1 ? 0 : ch_fused0;" in text
    assert "chunk_elems(comm.size == 1 ? most_fused0 : 0)" in text
    assert "return v_g + base_fused0 + k * ch_fused0;" in text and "reduce_to, compute, gather, source);" in text
    lamb = "\n".join(generate(example("lamb.ccn"), "m").functions[("lamb", "zero")].body)
    assert "gather, source);" not in lamb and "chunk_elems()" in lamb


def test_dropout_uses_the_philox_rng_at_the_global_index(example):
    text = "\n".join(generate(example("residual_dropout.ccn"), "m", skip_unsupported=True)
                     .functions[("f1", "default")].body)
    assert "coconet::dropout<" in text


def test_matmul_is_cublas_and_collectives_are_nccl(example):
    src = generate(example("mlp_out.ccn"), "m", skip_unsupported=True)
    text = "\n".join(src.functions[("mlp_out", "default")].body)
    assert "coconet::cuda::matmul<coconet::half>" in text
    assert "coconet::cuda::allreduce<coconet::half>(ncclSum" in text
    assert "cublasGemmEx" in (Path(runtime_dir()) / "coconet" / "cuda" / "blas.cuh").read_text()


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
    from coconetc.sourcefile import load_file
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
    assert ("u.ccn:6:5: error: p (schedule default): an allgather of a sliced scattered tensor ('x') is not in the "
            "CUDA backend yet (--backend cuda)\n        a = allgather(x)\n        ^^^^") in res.stderr
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
def test_the_emitted_cmake_project_builds(tmp_path):
    """What `compile --backend cuda --emit-only` writes (module.cu and CMakeLists.txt, which
    compiles the binding in) configures and builds with CMake and nvcc, as a user's build would;
    coconetc's own builds run nvcc directly with the same options."""
    why = probes.cuda_missing()
    if why:
        print(f"skipped: {why}")
        pytest.skip(why)
    from coconetc.toolchain import commands
    src = tmp_path / "src"
    res = subprocess.run([str(Path(sys.executable).parent / "coconetc"), "compile", "--backend", "cuda", "--emit-only",
                          "-o", str(src), str(EXAMPLES[0].parent / "sgd.ccn")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    commands.cmake_cuda(src, tmp_path / "build", None, f"-DCMAKE_CUDA_ARCHITECTURES={ARCHS}")
    so = sorted((tmp_path / "build").glob("*.so"))
    assert len(so) == 1, list((tmp_path / "build").iterdir())
    ldd = subprocess.run(["ldd", str(so[0])], capture_output=True, text=True).stdout
    assert "libnccl.so.2" in ldd and "not found" not in ldd, ldd


# sgd.ccn is built the other way: by CMake from what --emit-only writes (the test above)
DIRECT = [p for p in EXAMPLES if p.name != "sgd.ccn"]
# Built whole (host code and device code by nvcc, linked against the wheels): the symmetric-memory
# optimizer (adam), bf16 (mixed_adam_bf16) and the tensor-parallel MLP with cuBLAS (tp_mlp, which
# test_gpu_script reads too). The other examples' device code goes through nvcc alone
# (test_every_examples_device_code_compiles_with_nvcc, a third of a whole build): their host
# code is what the host emulation compiles and runs (test_cuda_emulate.py), and the runtime's
# calls of CUDA, NCCL and cuBLAS are compiled here and by the other whole builds (test_cuda_gaps,
# test_gather_matmul, test_block_ops, test_epilogue_cuda, the CMake project above).
WHOLE = [p for p in DIRECT if p.name in ("adam.ccn", "mixed_adam_bf16.ccn", "tp_mlp.ccn")]


@pytest.mark.slow
@pytest.mark.parametrize("path", WHOLE, ids=[p.name for p in WHOLE])
def test_examples_compile_and_link_with_nvcc(path):
    why = probes.cuda_missing()
    if why:
        print(f"skipped: {why}")
        pytest.skip(why)
    so = toolchain.compile(load_file(path), "cuda", toolchain.Options(archs=ARCHS, log=lambda m: None)).path
    assert so is not None and so.exists()
    # linked against the wheels' NCCL (and cuBLAS where a matmul is used), resolvable without a GPU
    ldd = subprocess.run(["ldd", str(so)], capture_output=True, text=True).stdout
    assert "libnccl.so.2" in ldd and "not found" not in ldd, ldd


# (not gpt_pipeline.ccn: its device code is gpt_block.ccn's block four times over, once per
# schedule; gpt_block.ccn's compile covers it; a pipeline schedule's stage programs run under the
# CUDA emulation in test_pipeline.py; nor sharded_mlp.ccn: its overlaps are test_gather_matmul.py's
# fsdp programs, compiled there)
DEVICE = [p for p in DIRECT if p not in WHOLE and p.name not in ("gpt_pipeline.ccn", "sharded_mlp.ccn")]


@pytest.mark.slow
def test_every_examples_device_code_compiles_with_nvcc(tmp_path):
    """Each example's module.cu through nvcc with the build's options, device code only (--cubin:
    every kernel and every __device__ function it calls compiled for sm_90, the host code parsed
    by nvcc's front end for the device side only). One nvcc run for all of them: a translation
    unit that includes each module.cu in turn (the runtime's headers once; each module's
    namespace and entry table renamed, so that no two define one name), which spares nvcc's
    fixed cost (the headers' parse, about 3 s an example) once per example; an error names the
    module.cu it is in."""
    why = probes.cuda_missing()
    if why:
        print(f"skipped: {why}")
        pytest.skip(why)
    from coconetc.toolchain import commands
    unit, kernels = [], []
    for k, path in enumerate(DEVICE):
        art = toolchain.compile(load_file(path), "cuda", toolchain.Options(build=False, archs=ARCHS))
        (cu,) = [f for f in art.write_sources(tmp_path / path.stem) if f.name == "module.cu"]
        kernels += [k] if "coconet::cuda::launch_" in cu.read_text() else []  # kernels of its own (lambdas)
        unit += [f"#define coconet_gen coconet_gen_{k}", f"#define coconet_module_entries coconet_module_entries_{k}",
                 f'#include "{cu}"', "#undef coconet_gen", "#undef coconet_module_entries"]
    (tmp_path / "examples.cu").write_text("\n".join(unit) + "\n")
    headers = (str(DEVICE[0].parent),)  # (extern_ops.ccn's own headers, as a build searches the file's folder)
    cmd = [*commands.cuda_flags(f"{ARCHS}-real", headers), "--cubin", "-o", str(tmp_path / "examples.cubin"),
           str(tmp_path / "examples.cu")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    failed = sorted({m[1] for m in re.finditer(rf"{re.escape(str(tmp_path))}/(\w+)/module\.cu", res.stderr)})
    assert res.returncode == 0, f"{failed}:\n" + res.stdout[-3000:] + res.stderr[-3000:]
    # every example's own kernels are in the one cubin: their lambdas' mangled names hold its
    # namespace (N14coconet_gen_13...: the length fixes the name)
    cubin = (tmp_path / "examples.cubin").read_bytes()
    assert len(kernels) >= len(DEVICE) - 2, kernels
    assert [DEVICE[k].name for k in kernels if f"N{len(f'coconet_gen_{k}')}coconet_gen_{k}".encode() not in cubin] == []


@pytest.mark.slow
def test_the_symmetric_kernel_keeps_no_stack_frame(tmp_path):
    """ptxas's report of the symmetric-memory kernel (adam zero and fused, sm_90): no local memory.
    Its caller windows inside the SymThread the kernel modifies, indexed at run time, once made
    every thread copy a 632-byte frame into local memory before any work
    (docs/results/cuda_gpu_symmetric_kernel_2026-11-24_28.md). The
    module's device code only (nvcc --cubin with the build's options: no host compile, no
    binding, no link; the build itself is test_examples_compile_and_link_with_nvcc's)."""
    why = probes.cuda_missing()
    if why:
        print(f"skipped: {why}")
        pytest.skip(why)
    from coconetc.toolchain import commands
    art = toolchain.compile(load_file(EXAMPLES[0].parent / "adam.ccn"), "cuda", toolchain.Options(build=False, archs=ARCHS))
    (cu,) = [f for f in art.write_sources(tmp_path) if f.name == "module.cu"]
    cmd = [*commands.cuda_flags(f"{ARCHS}-real"), "-Xptxas", "-v", "--cubin", "-o", str(tmp_path / "module.cubin"), str(cu)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    text = res.stdout + res.stderr
    # per kernel: "Function properties for <mangled>", then "N bytes stack frame, M bytes spill stores"
    entries = re.findall(r"Function properties for (\w+)\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores", text)
    sym = [(frame, spills) for name, frame, spills in entries if "fused_symmetric_kernel" in name]
    assert len(sym) == 2, (len(entries), text[-2000:])  # zero's and fused's
    assert all(frame == "0" and spills == "0" for frame, spills in sym), sym
