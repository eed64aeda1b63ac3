"""The plan's per-target pass (coconetc/plan/targets.py): what a target does not implement is a
located fact of the plan, so `coconetc check --backend cuda` and the CUDA generator agree by
construction (on every example and test program, and on held-out programs written here, one
per unsupported case); each fused collective's algorithms and chunking and each buffer's
placement are plan fields the renderers read."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from coconetc.cli import main
from coconetc.codegen.cuda import Unsupported, emulation_problems, generate
from coconetc.codegen.cuda.render import render
from coconetc.errors import CompileError
from coconetc.plan import plan_program
from coconetc.plan.targets import Target, decide
from coconetc.plan.units import Fused, Overlap, Reduce
from coconetc.plan.show import show
from coconetc.sourcefile import SourceFile, load_file, load_source

REPO = Path(__file__).resolve().parents[1]
FILES = sorted([*(REPO / "examples").glob("*.ccn"), *(REPO / "tests" / "programs").glob("*.ccn")])

# (its own name: the examples' extern_ops.ccn declares 'rmsnorm' with derivatives, and a later
# declaration of a name replaces an earlier one in the process: docs/language.md)
RMSNORM = '''extern op rms_plain(x, w, eps) {
    type = x
    slicing = rows
    reference = "rmsnorm_ref:rmsnorm"
    cpp = "rmsnorm.h", "cclib::rmsnorm"
    cuda = "rmsnorm.cuh", "cclib::rmsnorm_cuda"
}
'''
HELD_OUT = {  # name: (source, {(program, schedule): (line, col, what)})
    "scattered_gather": ('''program ok(g: f32[N] local) {
    s = allreduce(sum, g)
    return s
}
program p(x: f32[N] sliced(0) scattered, y: f32[N] replicated) {
    a = allgather(x)
    b = a + y
    return b
}
schedule twice for p {
    f = fuse(b)
}
''', {("p", "default"): (6, 5, "an allgather of a sliced scattered tensor ('x')"),
      ("p", "twice"): (6, 5, "an allgather of a sliced scattered tensor ('x')")}),
    "no_cuda_extern": ('''extern op myscale(x, a) {
    type = x
    slicing = rows
    reference = "myscale_ref:myscale"
    cpp = "myscale.h", "ns::myscale"
}
program p(x: f32[N] replicated, r: f32[N] replicated) {
    y = myscale(x, 2.0) + r
    return y
}
''', {("p", "default"): (8, 5, "extern operation 'myscale' declares no cuda implementation")}),
    "computed_scalar_extern": (RMSNORM + '''program p(x: f32[B, H] local, g: f32[H] replicated) {
    s = allreduce(sum, x)
    h = rms_plain(s, g, norm(x)) + 1
    return h
}
schedule rows for p {
    rs, ag = split(s)
    agh = reorder(ag, h)
}
''', {("p", "default"): (10, 5, "a computed 0-d operand ('t0_h') of extern operation 'rms_plain'"),
      ("p", "rows"): (10, 5, "a computed 0-d operand ('t0_h') of extern operation 'rms_plain'")}),
}


def _held_out(tmp_path: Path, name: str) -> SourceFile:
    (tmp_path / "myscale_ref.py").write_text("def myscale(x, a):\n    return x * a\n")
    (tmp_path / "rmsnorm_ref.py").write_text((REPO / "examples" / "rmsnorm_ref.py").read_text())
    path = tmp_path / f"{name}.ccn"
    path.write_text(HELD_OUT[name][0])
    return load_file(path)


def _reported(mod: SourceFile) -> set[tuple[str, str]]:
    """The (program, schedule)s `coconetc check --backend cuda` reports."""
    res = CliRunner().invoke(main, ["check", "--backend", "cuda", mod.file])
    found = set(re.findall(r": error: (\w+) \(schedule (\w+)\): .* \(--backend cuda\)", res.output))
    assert res.exit_code == (1 if found else 0), res.output
    return found


def _left_out(mod: SourceFile, emulate: bool = False) -> set[tuple[str, str]]:
    """The (program, schedule)s the CUDA generator leaves out."""
    kept = generate(mod, "m", skip_unsupported=True, emulate=emulate).functions
    return set(mod.variants()) - set(kept)


@pytest.mark.parametrize("path", FILES, ids=[f"{p.parent.name}/{p.name}" for p in FILES])
def test_check_backend_cuda_and_the_generator_agree(path: Path) -> None:
    mod = load_file(path)
    assert _reported(mod) == _left_out(mod)
    assert set(emulation_problems(mod)) == _left_out(mod, emulate=True)


@pytest.mark.parametrize("name", sorted(HELD_OUT))
def test_held_out_gaps_are_located_and_left_out(tmp_path: Path, name: str) -> None:
    mod = _held_out(tmp_path, name)
    want = HELD_OUT[name][1]
    assert _reported(mod) == _left_out(mod) == set(want)
    out = CliRunner().invoke(main, ["check", "--backend", "cuda", mod.file]).output
    for (prog, sched), (line, col, what) in want.items():
        assert f"{name}.ccn:{line}:{col}: error: {prog} (schedule {sched}): {what}" in out, out
    assert CliRunner().invoke(main, ["check", "--backend", "cpu", mod.file]).exit_code == 0
    key = next(iter(want))
    with pytest.raises(Unsupported, match=re.escape(want[key][2])):
        generate(mod, "m")  # not left out when asked for everything: the generator says why


def test_plan_program_for_a_target_raises_located(tmp_path: Path) -> None:
    mod = _held_out(tmp_path, "scattered_gather")
    ir = mod.programs["p"]
    assert plan_program(ir, target="cpu").unsupported("cuda")
    with pytest.raises(CompileError) as err:
        plan_program(ir, target="cuda")
    d = err.value.diagnostics[0]
    assert (d.span.line, d.span.col) == (6, 5) and "(--backend cuda)" in d.message


def test_the_renderer_asserts_on_a_gap(tmp_path: Path) -> None:
    """A renderer handed a unit its target does not implement is a bug, not a user error."""
    mod = _held_out(tmp_path, "scattered_gather")
    with pytest.raises(AssertionError):
        render(mod.plans[("p", "default")], "f", "x.ccn", ["b"])


def test_a_reduction_changing_dtype_is_a_cuda_gap(example) -> None:
    """(Was a raise at render time, which check --backend cuda did not see.)"""
    plan = example("lamb.ccn").plans[("lamb", "default")]
    red = next(u for u in plan.units if isinstance(u, Reduce))
    bufs = tuple(dataclasses.replace(b, type=dataclasses.replace(b.type, dtype="f64")) if b.name == red.dst else b
                 for b in plan.buffers)
    gaps = decide(dataclasses.replace(plan, buffers=bufs)).unsupported("cuda")
    assert [g.what for g in gaps] == ["a reduction whose result dtype differs from its input's"]
    assert not plan.unsupported("cuda")


def test_the_emulation_leaves_out_extern_operations(example) -> None:
    mod = example("extern_ops.ccn")
    assert not any(p.unsupported("cuda") for p in mod.plans.values())
    assert all(p.unsupported(Target.EMULATED) for p in mod.plans.values())


def _fused(mod: SourceFile, prog: str, sched: str) -> Fused:
    u = mod.plans[(prog, sched)].units
    f = next(x.fused if isinstance(x, Overlap) else x for x in u if isinstance(x, (Fused, Overlap)))
    assert f is not None
    return f


def test_fused_algorithms_and_chunking_are_plan_fields(example) -> None:
    sgd = _fused(example("sgd.ccn"), "sgd", "fused")
    assert sgd.on("cuda").algorithms == ("pipeline", "symmetric")
    assert sgd.on("cpu").algorithms == ("p2p", "shm")
    assert sgd.on("cuda").chunking.whole_alone and sgd.on("cpu").chunking.elems == "default"
    ln = _fused(example("layernorm.ccn"), "attn_out", "fused")
    assert ln.on("cuda").algorithms == ("pipeline",)  # a row-wise phase: no symmetric kernel
    assert ln.on("cuda").chunking.rows == "H" and ln.on("cpu").chunking.progress_rows
    ov = _fused(example("mlp_out.ccn"), "mlp_out", "overlapped")
    assert ov.on("cpu").algorithms == ("p2p",) and ov.on("cpu").chunking.elems == "task"
    assert ov.on("cuda").algorithms == ("pipeline",)


def test_buffer_placement_is_a_plan_field(example) -> None:
    plan = example("mlp_out.ccn").plans[("mlp_out", "fused")]
    assert plan.buffer("y").kind == "scratch" and plan.buffer("y").shared  # a fused collective reads it
    assert not any(b.shared for b in example("sgd.ccn").plans[("sgd", "default")].buffers)
    mod = load_file(REPO / "tests" / "programs" / "cuda_scattered_collectives.ccn")
    bc = mod.plans[("bc", "default")]
    assert bc.buffer("t0_x").unallocated == ("cuda", Target.EMULATED)  # the broadcast reads the segments
    assert all(not b.unallocated for b in bc.buffers if b.name != "t0_x")
    cu = generate(mod, "m", skip_unsupported=True).cu
    assert "// t0_x: not needed, the collective reads the segments piece by piece" in cu


def test_renderers_read_the_chunking(example) -> None:
    """The CPU overlap task's chunk and the CUDA chunks' source come from Fused.strategies."""
    from coconetc.codegen.cpu import generate as cpu_generate
    cpp = cpu_generate(example("mlp_out.ccn"), "m").cpp
    assert "coconet::overlap_task_chunk_elems(count, comm.size)" in cpp  # Chunking("task")
    plan = example("mlp_out.ccn").plans[("mlp_out", "fused")]
    f = next(u for u in plan.units if isinstance(u, Fused))
    no_whole = dataclasses.replace(f.on("cuda"), chunking=dataclasses.replace(f.on("cuda").chunking,
                                                                              whole_alone=False))
    f2 = dataclasses.replace(f, strategies=(f.on("cpu"), no_whole))
    plan2 = dataclasses.replace(plan, units=tuple(f2 if u is f else u for u in plan.units))
    body = "\n".join(render(plan2, "fn", "mlp_out.ccn", ["out"]).body)
    assert "auto source" not in body and "comm.size == 1 ? most_" not in body
    assert "auto source" in "\n".join(render(plan, "fn", "mlp_out.ccn", ["out"]).body)


def test_show_plan_prints_every_decision(example) -> None:
    res = CliRunner().invoke(main, ["show", str(REPO / "examples" / "mlp_out.ccn"), "-s", "fused",
                                    "--format", "plan"])
    assert res.exit_code == 0, res.output
    assert "scratch in the group's shared window" in res.output
    assert "on cpu: p2p | shm" in res.output and "on cuda: pipeline" in res.output
    assert "chunks of COCONET_CHUNK elements (default 2^16)" in res.output  # as module.h computes them
    assert "chunks of COCONET_CUDA_CHUNK elements (default 2^22)" in res.output  # as cuda/runtime.cuh does
    assert "targets:\n  cpu             every unit\n  cuda            every unit\n" in res.output


@pytest.mark.parametrize("name", sorted(HELD_OUT))
def test_check_and_compile_emit_only_agree(tmp_path: Path, name: str) -> None:
    """The CLI's two views: what `check --backend cuda` reports is what `compile --backend cuda
    --emit-only` names as left out, and the module.cu it writes holds every other function."""
    mod = _held_out(tmp_path, name)
    res = CliRunner().invoke(main, ["compile", "--backend", "cuda", "--emit-only", "-o", str(tmp_path / "out"),
                                    mod.file])
    assert res.exit_code == 0, res.output
    left = set(re.findall(r"left out: (\w+)\(schedule='(\w+)'\)", res.output))
    assert left == _reported(mod) == set(HELD_OUT[name][1])
    cu = (tmp_path / "out" / "module.cu").read_text()
    for prog, sched in set(mod.variants()) - left:
        assert f"program {prog}, schedule {sched} " in cu, (prog, sched)


def test_show_plan_names_what_a_target_does_not_implement(tmp_path: Path) -> None:
    mod = _held_out(tmp_path, "computed_scalar_extern")
    res = CliRunner().invoke(main, ["show", mod.file, "-s", "rows", "--format", "plan"])
    assert res.exit_code == 0, res.output
    tail = res.output.split("targets:\n")[1]
    assert tail.startswith("  cpu             every unit\n  cuda            not:\n    L10   a computed 0-d operand")
    assert "  cuda-emulated   not:\n" in tail and "an extern operation's own CUDA code is not run" in tail



def test_a_reshape_is_held_in_its_sources_memory_where_nothing_else_can_write_it() -> None:
    """Buffer.same_as (targets._reshape_views): a reshape of a scratch value or of a parameter
    nothing updates is its source's memory; one whose result a collective reads (it may need
    the group's window), one of a parameter updated in place, and an output are copies."""
    text = """program p(x: f32[M, K] replicated, w: f32[K, N] replicated, u: f32[N] replicated, lr: f32) {
    m = matmul(x, w)
    t = reshape(m, [-1])
    a = t * 2.0
    cm = reshape(m, [-1])
    c = allreduce(sum, cm)
    wv = reshape(w, [-1])
    b = wv * 3.0
    uv = reshape(u, [1, N])
    g = uv * 2.0
    u1 = update(u, u - lr * reshape(g, [N]))
    o = reshape(a, [M, N])
    return o, c, b
}
"""
    plan = plan_program(load_source(text, "p.ccn").programs["p"])
    same = {b.name: b.same_as for b in plan.buffers if b.same_as}
    assert same.get("t") == "m" and same.get("wv") == "w", same
    assert not {"cm", "uv", "o"} & set(same), same
    assert "(the memory of m: a reshape, no copy)" in show(plan)


def test_an_allreduce_is_its_sources_memory_at_one_rank_where_no_unit_writes_either_after_it() -> None:
    """Buffer.one_rank_as (targets.one_rank_results): at one rank an all-reduce of a computed
    value, or of a parameter nothing updates, is one memory with its result, and the call copies
    nothing, on the CPU and CUDA: a scratch result is its source's memory, an output holds its
    source; not an all-reduce of a parameter updated in place. (Compiled, every example runs on
    one rank against the interpreter in test_cpu_backend.py, and the CUDA emulation's in
    test_cuda_emulate.py: gpt_block's, tp_mlp's and adam's all-reduces are such.)"""
    text = """program p(x: f32[N] replicated, y: f32[N] replicated, w: f32[N] replicated) {
    a = x * 2.0
    s = allreduce(sum, a)
    t = s + a
    q = allreduce(max, y)
    c = allreduce(sum, w)
    r = t * q + c
    w1 = update(w, w * 0.5)
    o = allreduce(sum, r)
    return o, t
}
"""
    plan = plan_program(load_source(text, "p.ccn").programs["p"])
    assert {b.name: b.one_rank_as for b in plan.buffers if b.one_rank_as} == {"s": "a", "q": "y", "r": "o"}
    assert "(at one rank: a's memory, the all-reduce copies nothing)" in show(plan)
    from coconetc.codegen.cpu import generate as cpu_generate
    code = cpu_generate(load_source(text, "p.ccn"), "m").cpp
    assert "float* const v_s = comm.size == 1 ? v_a : coconet::scratch<float," in code
    assert "float* const v_r = comm.size == 1 ? v_o : coconet::shared_scratch<float," in code
    assert code.count("if (comm.size > 1)  // one rank: the result is the source") == 3
    cu = generate(load_source(text, "p.ccn"), "m").cu
    assert "float* const v_q = comm.size == 1 ? v_y : coconet::cuda::scratch<float>(" in cu
    assert cu.count("if (comm.size > 1)  // one rank: the result is the source") == 3
