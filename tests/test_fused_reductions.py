"""Reductions inside a fused collective (sum, norm, segment_norm over the reduced slice,
non-finite tests written with `where`): accumulated chunk by chunk, combined in one small
all-reduce, the phase that reads them on the slice after it (examples/adamw.ccn,
examples/scaled_adam.ccn, examples/lamb.ccn's zero and zero_w).

- the plan shows the phases (per chunk, accumulated, the all-reduce of the partials, after);
- every schedule of the examples equals its program: interpreted on 1-3 ranks, and compiled
  (CPU, both fused algorithms: the shared window and point to point) on 1-3 ranks;
- on CUDA the partial results are accumulated per chunk too (the plan says so, the rendered
  pipeline does it), and under the host emulation, in small chunks, every schedule equals the
  interpreter (the pipeline and the symmetric kernel; a row-wise phase), the loss-scaled step is
  skipped on inf/NaN and max/min propagate NaN and inf;
- every refusal of a fusion says what would make it legal, and following the advice gives a
  fusion that is accepted (never another refusal of it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
from rank_checks import run_jobs

from coconetc.codegen.cuda import generate
from coconetc.errors import CompileError
from coconetc.plan.show import show
from coconetc.plan.units import Fused, Overlap, Reduce
from coconetc.sourcefile import SourceFile, load_source
from coconetc.toolchain import probes
import rank_pool

REPO = Path(__file__).resolve().parents[1]
EX = REPO / "examples"
CASES = [("adamw.ccn", "adamw", ("rs_c_ag", "sliced", "zero")),
         ("scaled_adam.ccn", "scaled_adam", ("rs_c_ag", "zero")),
         ("lamb.ccn", "lamb", ("rs_c_ag", "zero", "zero_w"))]
FUSED = [("adamw.ccn", "adamw", "zero", {"t0_c": "norm"}),
         ("scaled_adam.ccn", "scaled_adam", "zero", {"bad": "sum"}),
         ("lamb.ccn", "lamb", "zero", {"t0_w1": "segment_norm", "t1_w1": "segment_norm"}),
         ("lamb.ccn", "lamb", "zero_w", {"t0_w1": "segment_norm", "t1_w1": "segment_norm"})]


@cache
def _file(name: str) -> SourceFile:
    path = EX / name
    return load_source(path.read_text(), str(path))


# --- the plan ------------------------------------------------------------------------------------
@pytest.mark.parametrize("file,prog,sched,partials", FUSED, ids=lambda x: x if isinstance(x, str) else "")
def test_plan_accumulates_reductions_per_chunk(file, prog, sched, partials):
    plan = _file(file).plans[(prog, sched)]
    fused = [u for u in plan.units if isinstance(u, Fused)]
    assert len(fused) == 1
    f = fused[0]
    reduces = {a.dst: a.op for a in f.after if isinstance(a, Reduce) and a.dst in f.partials}
    assert reduces == partials
    assert f.on("cpu").partials == "per chunk" and f.on("cuda").partials == "per chunk"
    text = show(plan)
    assert "per chunk (accumulated): " in text
    assert "after all chunks: one allreduce(sum) of the partial results of" in text
    assert "after the reductions (on this rank's slice):" in text
    assert not plan.unsupported("cpu")


def test_adamw_plan_phases():
    """AdamW with clipping, fused: phase A keeps the reduced chunk and accumulates its sum of
    squares; one all-reduce; phase B (c, then the update on the slice); the gather of w."""
    text = show(_file("adamw.ccn").plans[("adamw", "zero")])
    lines = [ln.strip() for ln in text.splitlines()]
    at = lines.index("per chunk (pointwise): rs = rs (on cuda: vectors of 4 elements)")
    assert lines[at + 1] == "per chunk (accumulated): t0_c += partial norm(rs)"
    assert lines[at + 2].startswith("after all chunks: one allreduce(sum) of the partial results of t0_c")
    assert lines[at + 3] == "after the reductions (on this rank's slice):"
    assert "c = k0_c with k0_c = min(maxnorm / (t0_c + 1e-06), 1.0)" in lines[at + 4]
    assert "collective agw = allgather(w1)" in lines[at + 8]  # (each loop's line and its vector width)


def test_nonfinite_test_joins_the_chunk_loop():
    """sum(where(abs(gf) < 3e38, 0, 1)): the where is computed on each chunk (phase A, stored
    for the reduction), its sum accumulated there."""
    f = next(u for u in _file("scaled_adam.ccn").plans[("scaled_adam", "zero")].units if isinstance(u, Fused))
    names = [i.name for p in f.phases for i in p.items]
    assert names == ["gf", "t0_bad"] and f.partials == ("bad",)


# --- equal to the program ----------------------------------------------------------------------
def _run(args: list[str], env: dict | None = None, timeout: int = 600) -> str:
    res = subprocess.run([sys.executable, "-c", "from coconetc.cli import main; main()", *args],
                         capture_output=True, text=True, timeout=timeout, cwd=REPO,
                         env={**os.environ, **(env or {})})
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


@pytest.mark.parametrize("file,prog,scheds", CASES, ids=[c[0] for c in CASES])
def test_interpreted_schedules_equal_the_program(file, prog, scheds):
    for ranks in (1, 2, 3):
        out = _run(["run", str(EX / file), "-s", "all", "--interp", "--ranks", str(ranks), "--size", "N=13"])
        for s in scheds:
            assert f"{prog} [{s}]: {ranks} ranks" in out
        assert out.count("matches the unscheduled program on every rank") == len(scheds)


def _jobs(ranks: int, cases, sizes: list[str], env: dict[str, str], backend: tuple[str, ...] = ()) -> str:
    """Every schedule of each case's file, as `coconetc run FILE -s all` runs them (the program,
    then each schedule), in one launch on RANKS ranks (rank_checks.run_jobs), ENV set."""
    return run_jobs(ranks, [[str(EX / file), "--program", prog, *backend, *sizes,
                             *(f"--schedule={s}" for s in ("default", *scheds))] for file, prog, scheds in cases], env)


@pytest.mark.parametrize("algo", ["shm", pytest.param("p2p", marks=pytest.mark.slow)])
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_compiled_schedules_equal_the_interpreter(ranks, algo):
    """Several chunks (chunks of 256 elements), slices that 2 and 3 do not divide; every case's
    file in one launch."""
    env = {"COCONET_CHUNK": "256", **({"COCONET_FUSED": "p2p"} if algo == "p2p" else {})}
    out = _jobs(ranks, CASES, ["--size=N=2003"], env)
    for _, prog, scheds in CASES:
        for s in ("default", *scheds):
            assert re.search(rf"^{prog} \[{s}\]: {ranks} ranks: .* matches the interpreter on every rank", out, re.M), out


# --- CUDA: the partial results accumulated per chunk (tested under the host emulation) ------------------
PER_CHUNK = [*FUSED, ("amax_scale.ccn", "amax_scale", "zero", {"a": "max"}),
             ("clipped_sgd.ccn", "clipped_sgd", "fused", {"t0_w1": "norm"})]


@pytest.mark.parametrize("file,prog,sched,partials", PER_CHUNK, ids=lambda x: x if isinstance(x, str) else "")
def test_cuda_plan_says_per_chunk(file, prog, sched, partials):
    """cuda's strategy accumulates per chunk; the plan says so, and says that the symmetric
    kernel (no chunks) accumulates over the slice it kept, after it."""
    plan = _file(file).plans[(prog, sched)]
    f = next(u for u in plan.units if isinstance(u, Fused))
    assert f.on("cuda").partials == "per chunk"
    assert {r.dst: r.op for r in f.accumulated("cuda")} == partials == {r.dst: r.op for r in f.accumulated("cpu")}
    line = next(ln.strip() for ln in show(plan).splitlines() if ln.strip().startswith("on cuda:"))
    symmetric = "symmetric" in f.on("cuda").algorithms
    assert ("; reductions per chunk (after the symmetric kernel: over the slice it kept)" in line) == symmetric, line
    assert "; reductions per chunk" in line and "after the chunks" not in line, line


def test_cuda_renders_the_accumulation_in_the_chunk_pipeline():
    """The rendered CUDA: each chunk's partial result after its kernel (inside the pipeline's
    compute callback, reading the reduced chunk or the value the phase stored), one combine
    after the pipeline, then the finish; the reductions are no Reduce units after the chunks."""
    for file, prog, sched, calls in [
            ("adamw.ccn", "adamw", "zero", ["partial_sum<float, true>(red, hi - lo, pa_fused0.sum(0), ctx);",
                                            "finish_sum<float, true>(pa_fused0.sum(0), v_t0_c, ctx);"]),
            ("scaled_adam.ccn", "scaled_adam", "zero",
             ["partial_sum<float, false>(v_t0_bad + lo, hi - lo, pa_fused0.sum(0), ctx);",
              "finish_sum<float, false>(pa_fused0.sum(0), v_bad, ctx);"]),
            ("amax_scale.ccn", "amax_scale", "zero",
             ["partial_extreme<float, true>(v_t0_a + lo, hi - lo, pa_fused0.extreme(0), ctx, pa_fused0.parts());",
              "finish_extreme<float, true>(pa_fused0.extreme(0), v_a, ctx);"]),
            ("lamb.ccn", "lamb", "zero_w",
             ["segment_partial<float>(v_w + lo, hi - lo, off + lo, seg_starts, pa_fused0.sum(0), ctx);",
              "segment_partial<float>(v_r + lo, hi - lo, off + lo, seg_starts, "
              "pa_fused0.sum(int64_t(seg_starts.size() - 1)), ctx);",
              "segment_norm_fill<float>(pa_fused0.sum(0), v_t0_w1,"])]:
        text = "\n".join(generate(_file(file), "m").functions[(prog, sched)].body)
        compute = text.index("auto compute = [&]")
        pipeline = text.index("coconet::cuda::pipeline<")
        combine = text.index("coconet::cuda::combine(pa_fused0, ctx);")
        assert text.index("coconet::cuda::partials(") < compute < pipeline < combine
        accumulate, finish = calls[:-1], calls[-1]
        for call in accumulate:  # in the chunk callback (and, with a symmetric kernel, after it)
            assert compute < text.rindex(call) < pipeline, (file, call)
        assert text.index(finish) > combine, (file, finish)
        assert "reduce_sum<" not in text[compute:] and "reduce_extreme<" not in text[compute:], file
        assert "segment_norm<" not in text[compute:], file


EMU_CASES = [*CASES, ("amax_scale.ccn", "amax_scale", ("rs_a_ag", "zero")), ("clipped_sgd.ccn", "clipped_sgd", ("fused",))]


# layernorm's backward as a derived program writes it (g_x1 = d_y + layernorm_dx(x1, ln2_w, g_n2s,
# eps) in examples/gpt_block.ccn's grad(gpt_block_sp)): a row-wise phase of the fused
# reduce-scatter, the expression around layernorm_dx computed on each element of the row
LN_DX = """program lnd(y: f32[B, S, H] local, x: f32[B, S, H] sliced(1), gamma: f32[H] replicated,
            d: f32[B, S, H] sliced(1), seed: i64) {
    g = reducescatter(sum, y, dim=1)
    gx = d + layernorm_dx(x, gamma, g, 1e-5)
    gd = dropout(gx, 0.25, seed)
    a = allgather(gd)
    return a, gx
}

schedule fused for lnd {
    f = fuse(g, gx, gd, a)
}
"""
LN_DX_SIZES = ["--size", "B=2", "--size", "S=5", "--size", "H=3"]


def test_a_row_wise_phase_holds_layernorm_dx():
    """The fused reduce-scatter computes layernorm_dx (and what is added to it) on each chunk's
    whole rows as they arrive, the dropout on the chunk, and gathers it piece by piece."""
    import coconetc.autodiff  # noqa: F401  (registers layernorm_dx)
    f = next(u for u in _load(LN_DX).plans[("lnd", "fused")].units if isinstance(u, Fused))
    assert [p.kind for p in f.phases] == ["rows", "pointwise"] and str(f.rows) == "H"
    assert f.gather == "a" and f.after == ()
    text = show(_load(LN_DX).plans[("lnd", "fused")])
    assert "per chunk (rows): gx = d + layernorm_dx(x, gamma, g, 1e-05)" in text, text


@pytest.mark.slow
@pytest.mark.skipif(probes.emulation_missing() is not None, reason=probes.emulation_missing() or "")
def test_layernorm_dx_in_a_row_wise_phase_equals_the_interpreter(tmp_path):
    """LN_DX compiled, in chunks of 4 elements (rounded up to 2 rows of 3), S = 5 (uneven slices:
    3 + 2 on 2 ranks, 2 + 2 + 1 on 3): CPU on 2 and 3 ranks, CUDA under the host emulation on 3,
    against the interpreter."""
    path = tmp_path / "lnd.ccn"
    path.write_text(LN_DX)
    for ranks in (2, 3):
        out = _run(["run", str(path), "-s", "all", "--ranks", str(ranks), *LN_DX_SIZES], {"COCONET_CHUNK": "4"})
        assert out.count("matches the interpreter on every rank") == 2, out
    out = _run(["run", str(path), "-s", "all", "--backend", "cuda", "--emulate", "--ranks", "3", *LN_DX_SIZES],
               {"COCONET_CUDA_CHUNK": "4"})
    assert out.count("matches the interpreter on every rank") == 2, out


@pytest.mark.slow
@pytest.mark.skipif(probes.emulation_missing() is not None, reason=probes.emulation_missing() or "")
@pytest.mark.parametrize("algo", ["pipeline", "auto"])
@pytest.mark.parametrize("ranks", [1, 3])
def test_cuda_per_chunk_equals_the_interpreter(ranks, algo):
    """The CUDA module under the host emulation, chunks of 5 elements (N = 23: several chunks,
    uneven slices at 2 and 3 ranks, a last chunk shorter than the others): every schedule of
    every file of EMU_CASES (one launch) matches the interpreter on 1 and 3 ranks (clipped_sgd:
    the reduced slice kept, no gather); `pipeline` forces the chunk pipeline, `auto` runs the
    symmetric kernel where it may (its first call, the first of auto's measured trials). Not on
    2 ranks: 3 has uneven slices too, and the CPU cases run on 2."""
    env = {"COCONET_CUDA_CHUNK": "5", "COCONET_CUDA_FUSED": algo}
    out = _jobs(ranks, EMU_CASES, ["--size=N=23"], env, ("--emulate-cuda",))
    for _, prog, scheds in EMU_CASES:
        for s in ("default", *scheds):
            assert re.search(rf"^{prog} \[{s}\] \(CUDA, host emulation\): {ranks} ranks: .* matches the interpreter "
                             "on every rank", out, re.M), out


TRUST = """program trust(g: f32[N] local, w: f32[N] replicated, lr: f32) {
    g1 = allreduce(avg, g)
    r = g1 + 0.01 * w
    ratio = norm(w) / (norm(r) + 1e-6)
    w1 = update(w, w - lr * ratio * r - 1e-4 * (max(w) - min(w)) - 1e-6 * sum(w))
}
schedule zero for trust {
    rs, ag = split(g1)
    agw = reorder(ag, r, ratio, w1)
    fuse(rs, r, ratio, w1, agw)
}
"""


def test_reductions_of_a_replicated_parameter_are_accumulated_over_the_slices():
    """norm, max, min, sum of the replicated (not scattered) weights inside a fused collective:
    each rank accumulates its slice's part as the chunks pass (instead of reading all of w
    after them), and the partial results are combined across ranks with the others."""
    f = next(u for u in _load(TRUST).plans[("trust", "zero")].units if isinstance(u, Fused))
    got = sorted((r.op, r.src) for r in f.accumulated("cpu"))
    assert got == [("max", "w"), ("min", "w"), ("norm", "r"), ("norm", "w"), ("sum", "w")], got
    assert not [a for a in f.after if isinstance(a, Reduce) and a.dst not in f.partials]


@pytest.mark.parametrize("algo", ["shm", pytest.param("p2p", marks=pytest.mark.slow)])
def test_reductions_of_a_replicated_parameter_equal_the_interpreter(algo, tmp_path):
    """Chunks of 256 elements, N = 2003 (uneven slices), 1 to 3 ranks, both CPU algorithms."""
    path = tmp_path / "trust.ccn"
    path.write_text(TRUST)
    env = {"COCONET_CHUNK": "256", **({"COCONET_FUSED": "p2p"} if algo == "p2p" else {})}
    for ranks in (1, 2, 3):
        out = _run(["run", str(path), "-s", "zero", "--ranks", str(ranks), "--size", "N=2003"], env)
        assert f"trust [zero]: {ranks} ranks" in out and "matches the interpreter on every rank" in out, out


@pytest.mark.slow
@pytest.mark.skipif(probes.emulation_missing() is not None, reason=probes.emulation_missing() or "")
@pytest.mark.parametrize("algo", ["pipeline", "auto"])
def test_cuda_reductions_of_a_replicated_parameter_equal_the_interpreter(algo, tmp_path):
    """The same on CUDA under the host emulation: chunks of 5 elements, N = 23, 1 to 3 ranks,
    the chunk pipeline and (auto) the symmetric kernel, which accumulates after its kernel."""
    path = tmp_path / "trust.ccn"
    path.write_text(TRUST)
    for ranks in (1, 2, 3):
        out = _run(["run", str(path), "-s", "zero", "--backend", "cuda", "--emulate", "--ranks", str(ranks),
                    "--size", "N=23"], {"COCONET_CUDA_CHUNK": "5", "COCONET_CUDA_FUSED": algo})
        assert "matches the interpreter on every rank" in out, out


OVERLAPPED = """program tp_amax(x: f32[B, S, K] sliced(2), w: f32[K, H] sliced(0), b: f32[H] replicated) {
    y = matmul(x, w)
    s = allreduce(sum, y)
    o = s + b
    a = max(abs(o))
    q = o / a
    n = norm(o)
    t = sum(o) - min(o)
    return q, a, n, t
}
schedule overlapped for tp_amax {
    rs, ag = split(s, dim=1)
    agq = reorder(ag, o, a, q, n, t)
    f = fuse(rs, o, a, q, n, t, agq)
    overlap(y, f, chunks=3)
}
"""
OVERLAPPED_SIZES = ["--size", "B=4", "--size", "S=9", "--size", "K=6", "--size", "H=5"]


def test_an_overlaps_fused_collective_accumulates_its_reductions_per_chunk():
    """A tensor-parallel matmul overlapped with its fused reduce-scatter (an FP8-style amax of
    the output, its norm, sum and min): every block's chunks add to the same partial results,
    combined once after the last block, before the phase that reads them (on both targets);
    the CUDA accumulators are made before the first block and combined on the call's stream
    after the side stream has joined it."""
    plan = _load(OVERLAPPED).plans[("tp_amax", "overlapped")]
    ov = next(u for u in plan.units if isinstance(u, Overlap))
    f = ov.fused
    assert f is not None
    for target in ("cpu", "cuda"):
        got = sorted((r.op, r.src) for r in f.accumulated(target))
        assert got == [("max", "t0_a"), ("min", "o"), ("norm", "o"), ("sum", "o")], (target, got)
    assert not [a for a in f.after if isinstance(a, Reduce) and a.dst not in f.partials]
    text = "\n".join(generate(_load(OVERLAPPED), "m").functions[("tp_amax", "overlapped")].body)
    made, blocks = text.index("coconet::cuda::partials("), text.index("for (int ob = 0;")
    accumulate = text.index("partial_extreme<float, true>(v_t0_a + lo, hi - lo, pa_f.extreme(")
    join = text.rindex("coconet::cuda::join(sctx.stream, ctx.stream")
    assert made < blocks < accumulate < join < text.index("coconet::cuda::combine(pa_f, ctx);")


def test_an_overlaps_fused_reductions_equal_the_interpreter(tmp_path):
    """CPU, point to point (an overlap's tasks), chunks of 7 elements inside 3 blocks of rows,
    S = 9 (uneven slices), 1 to 3 ranks, and 4 ranks as 2 simulated nodes."""
    path = tmp_path / "tp_amax.ccn"
    path.write_text(OVERLAPPED)
    for ranks, nodes in ((1, 1), (2, 1), (3, 1), (4, 2)):
        out = _run(["run", str(path), "-s", "overlapped", "--ranks", str(ranks), *OVERLAPPED_SIZES],
                   {"COCONET_CHUNK": "7", "COCONET_SIMULATE_NODES": str(nodes)})
        assert f"tp_amax [overlapped]: {ranks} ranks" in out and "matches the interpreter on every rank" in out, out


OVERLAP_ROWS = """program proj_ln(o: f32[B, S, K] sliced(2), w: f32[K, H] sliced(0), x: f32[B, S, H] sliced(1),
                g: f32[H] replicated, b: f32[H] replicated) {
    p = matmul(o, w)
    t = reducescatter(sum, p, dim=1)
    x1 = x + t
    ns = layernorm(x1, g, b, 1e-5)
    n = allgather(ns)
    return n
}
schedule overlapped for proj_ln {
    f = fuse(t, x1, ns, n)
    overlap(p, f, chunks=2)
}
"""


def test_an_overlaps_row_wise_phase_computes_whole_rows(tmp_path):
    """An overlap's fused collective with a layernorm (gpt_block_sp's `overlapped`), rows of
    H = 24 elements, which do not divide the 2^15 elements a task computes between two MPI
    progress calls: the pieces are whole rows (each rank's 1380 rows of a block are 33,120
    elements; pieces of 2^15 cut row 1365, whose layernorm read and wrote past its piece)."""
    path = tmp_path / "proj_ln.ccn"
    path.write_text(OVERLAP_ROWS)
    out = _run(["run", str(path), "-s", "overlapped", "--ranks", "2", "--size", "B=2", "--size", "S=2760",
                "--size", "H=24"], timeout=180)  # (the bug wrote past its buffers: a rank could spin)
    assert "proj_ln [overlapped]: 2 ranks" in out and "matches the interpreter on every rank" in out, out


@pytest.mark.slow
@pytest.mark.skipif(probes.emulation_missing() is not None, reason=probes.emulation_missing() or "")
def test_cuda_an_overlaps_fused_reductions_equal_the_interpreter(tmp_path):
    """The same on CUDA under the host emulation (chunks of 4 elements, 1 to 3 ranks)."""
    path = tmp_path / "tp_amax.ccn"
    path.write_text(OVERLAPPED)
    for ranks in (1, 2, 3):
        out = _run(["run", str(path), "-s", "overlapped", "--backend", "cuda", "--emulate", "--ranks", str(ranks),
                    *OVERLAPPED_SIZES], {"COCONET_CUDA_CHUNK": "4"})
        assert "matches the interpreter on every rank" in out, out


ROWS = """program lnn(y: f32[B, S, H] local, gamma: f32[H] replicated, beta: f32[H] replicated, c: f32) {
    s = allreduce(sum, y)
    out = layernorm(s, gamma, beta, 1e-5)
    a = max(abs(out))
    n = norm(out)
    z = out * (c / (n + 1e-6)) + a
    return z
}

schedule fused for lnn {
    rs, ag = split(s, dim=1)
    agz = reorder(ag, out, a, n, z)
    fuse(rs, out, a, n, z, agz)
}
"""


@pytest.mark.slow
@pytest.mark.skipif(probes.emulation_missing() is not None, reason=probes.emulation_missing() or "")
def test_cuda_per_chunk_after_a_row_wise_phase(tmp_path):
    """A row-wise phase (layernorm, chunks of whole rows, sliced along dim 1) whose value's max
    and norm are accumulated per chunk on cuda, under the host emulation: chunks of 4 elements
    (rounded up to 2 rows of 3), S = 5 (uneven slices), R = 1, 2, 3, against the interpreter."""
    path = tmp_path / "rows.ccn"
    path.write_text(ROWS)
    f = next(u for u in _load(ROWS).plans[("lnn", "fused")].units if isinstance(u, Fused))
    assert [p.kind for p in f.phases] == ["rows", "pointwise"] and f.on("cuda").partials == "per chunk"
    assert {r.dst: r.op for r in f.accumulated("cuda")} == {"a": "max", "n": "norm"}
    for ranks in (1, 2, 3):
        out = _run(["run", str(path), "-s", "all", "--backend", "cuda", "--emulate", "--ranks", str(ranks),
                    "--size", "B=2", "--size", "S=5", "--size", "H=3"], {"COCONET_CUDA_CHUNK": "4"})
        assert out.count("matches the interpreter on every rank") == 2, out


@pytest.mark.slow
@pytest.mark.skipif(probes.emulation_missing() is not None, reason=probes.emulation_missing() or "")
@pytest.mark.parametrize("algo", ["pipeline", "auto"])
@pytest.mark.parametrize("ranks", [1, 3])  # 3: uneven and empty slices; the CPU's cases run on 2
def test_cuda_per_chunk_nonfinite_skip_and_nan_max(ranks, algo, monkeypatch, tmp_path):
    """Under the host emulation, in chunks of 64 elements: scaled_adam's step is skipped on an
    inf or a NaN in one rank's gradient under every schedule (the non-finite count accumulated
    per chunk), and taken, equal across schedules, without (tests/fused_reductions_worker.py);
    max and min of the reduced gradient with a NaN, an inf, a -inf against NumPy
    (tests/max_reduction_worker.py, N = 1001; on 3 ranks also N = 2: a rank with an empty slice,
    its partial result -inf/+inf)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_max_reduction import MM
    monkeypatch.setenv("COCONET_CUDA_CHUNK", "64")
    monkeypatch.setenv("COCONET_CUDA_FUSED", algo)
    rc, out, _ = rank_pool.run(ranks, [str(Path(__file__).with_name("fused_reductions_worker.py")),
                                       str(EX / "scaled_adam.ccn"), "emulate"], timeout=600)
    assert rc == 0 and out.count("OK ") == 11, out
    mm = tmp_path / "mm.ccn"
    mm.write_text(MM)
    for n in (1001, 2) if ranks == 3 else (1001,):
        rc, out, _ = rank_pool.run(ranks, [str(Path(__file__).with_name("max_reduction_worker.py")), str(mm), str(n),
                                           "emulate"], timeout=600)
        assert rc == 0 and out.count("OK ") == 12, out


# --- refusals lead somewhere ---------------------------------------------------------------------
ADAMW = """
program adamw(g: f32[N] local, w: f32[N] replicated, m: f32[N] replicated, v: f32[N] replicated,
              lr: f32, beta1: f32, beta2: f32, eps: f32, step: f32, maxnorm: f32) {
    g1 = allreduce(sum, g)
    c = min(maxnorm / (norm(g1) + 1e-6), 1.0)
    m1 = update(m, beta1 * m + (1 - beta1) * c * g1)
    v1 = update(v, beta2 * v + (1 - beta2) * (c * g1) * (c * g1))
    mh = m1 / (1 - beta1 ** step)
    vh = v1 / (1 - beta2 ** step)
    w1 = update(w, w - lr * mh / (sqrt(vh) + eps))
}
schedule s for adamw {
    rs, ag = split(g1)
    agm, agv, agw = reorder(ag, c, m1, v1, mh, vh, w1)
    slice(m, v)
    FUSE
}
"""
TWO = """
program two(g: f32[N] local, h: f32[N] local, w: f32[N] replicated) {
    g1 = allreduce(sum, g)
    h1 = allreduce(sum, h)
    w1 = update(w, w - g1 - h1)
}
schedule s for two {
    rs, ag = split(g1)
    agw = reorder(ag, w1)
    FUSE
}
"""
MLP = """
program mlp_out(x: f16[B, S, K] sliced(2), w: f16[K, H] sliced(0), b: f16[H] replicated,
                r: f16[B, S, H] replicated, seed: i64) {
    y = matmul(x, w)
    s = allreduce(sum, y)
    out = dropout(s + b, 0.1, seed) + r
    return out
}
schedule s for mlp_out {
    rs, ag = split(s, dim=1)
    ago = reorder(ag, out)
    FUSE
}
"""
LOOPS = """
program loops(x: f32[N] replicated, y: f32[N] replicated) {
    a = x * 2
    c = x + 1
    t = a + 1
    n = norm(a)
    b = a * n + t
    return b, c
}
schedule s for loops {
    FUSE
}
"""
SGD = """
program sgd(g: f32[N] local, w: f32[N] replicated, lr: f32) {
    g1 = allreduce(sum, g)
    w1 = update(w, w - lr * g1)
}
schedule s for sgd {
    rs, ag = split(g1)
    agw = reorder(ag, w1)
    FUSE
}
"""
SPLIT = """
program sgd(g: f32[N] local, w: f32[N] replicated, lr: f32) {
    g1 = allreduce(sum, g)
    h = g1 * 2
    w1 = update(w, w - lr * g1)
    return h
}
schedule s for sgd {
    rs, ag = split(g1)
    agh, agw = reorder(ag, h, w1)
    FUSE
}
"""
SCALED = """
program ls(g: f16[N] local, w: f32[N] replicated, m: f32[N] replicated, v: f32[N] replicated,
           lr: f32, beta1: f32, eps: f32, scale: f32, maxnorm: f32) {
    g1 = allreduce(sum, g)
    gf = cast(g1, f32) / scale
    bad = sum(where(abs(gf) < 3.0e38, 0.0, 1.0))
    c = min(maxnorm / (norm(gf) + 1e-6), 1.0)
    m1 = update(m, where(bad > 0, m, beta1 * m + (1 - beta1) * c * gf))
    v1 = update(v, where(bad > 0, v, v + c * c * gf * gf))
    w1 = update(w, where(bad > 0, w, w - lr * m1 / (sqrt(v1) + eps)))
}
schedule s for ls {
    rs, ag = split(g1)
    REORDER
    slice(m, v)
    FUSE
}
"""
REFUSED = [  # (program, a refused fuse directive, what the message says)
    (ADAMW, "fuse(rs, m1, v1, mh, vh, w1, agw)", "reads the fusion and the fusion reads it"),
    (TWO, "fuse(rs, h1, w1, agw)", "at most one collective"),
    (MLP, "f = fuse(y, rs, out, ago)", "matmul cannot be fused"),
    (LOOPS, "fuse(a, c, b)", "reads the fusion and the fusion reads it"),
    (LOOPS, "fuse(a, b)", "reads the fusion and the fusion reads it"),
    (LOOPS, "fuse(a, c, n)", "cannot share one loop"),
    (LOOPS, "fuse(a, n, t)", "cannot share one loop"),
    (SGD, "fuse(w1, agw)", "needs a reducescatter or an allreduce"),
    (SGD, "fuse(rs, agw)", "reads the fusion and the fusion reads it"),
    (SPLIT.replace("agh, agw = reorder(ag, h, w1)", ""), "fuse(rs, ag)", "nothing to compute inside the collective"),
    (SPLIT, "fuse(rs, agw)", "reads the fusion and the fusion reads it"),
    (SPLIT, "fuse(agh, rs, agw)", "at most one collective"),
    # split without reorder: the stages read the all-gathered value; the advice reorders first
    (ADAMW.replace("    agm, agv, agw = reorder(ag, c, m1, v1, mh, vh, w1)\n    slice(m, v)\n", ""),
     "fuse(rs, c, m1, v1, mh, vh, w1, ag)", "reads the all-gathered 'ag'"),
    (ADAMW.replace("    agm, agv, agw = reorder(ag, c, m1, v1, mh, vh, w1)\n    slice(m, v)\n", ""),
     "fuse(rs, m1, v1, ag)", "'c' reads the all-gathered 'ag'"),  # c between: moved too
    (SGD.replace("    agw = reorder(ag, w1)\n", ""), "fuse(rs, w1, ag)", "reads the all-gathered 'ag'"),
    (SGD.replace("    agw = reorder(ag, w1)\n", ""), "fuse(rs, w1)", "reads the all-gathered 'ag'"),
    # a reorder that left the clipping factor reading the all-gathered value: moved too
    (ADAMW.replace("reorder(ag, c, m1,", "reorder(ag, m1,"), "fuse(rs, m1, v1, mh, vh, w1, agw)",
     "'c' reads the all-gathered 'ag'"),
    (ADAMW.replace("reorder(ag, c, m1,", "reorder(ag, m1,").replace("slice(m, v)", "slice(m, v, w)"),
     "fuse(rs, m1, v1, mh, vh, w1)", "'c' reads the all-gathered 'ag'"),
    # the inf/NaN count and the norm read the allgather of a member (gf): moved onto the slices
    (SCALED.replace("REORDER", "aggf, agm, agv, agw = reorder(ag, gf, m1, v1, w1)"), "fuse(rs, gf, m1, v1, w1, agw)",
     "'bad' reads the all-gathered 'aggf'"),
]

# the advice at the end of a refusal: a fuse directive, or a reorder then a fuse directive
ADVICE = re.compile(r"(?:: ((?:[\w, ]+ = )?reorder\([^()]*\)); )?((?:\w+ = )?fuse\([^()]*\))\s*$")


def _advised(message: str, indent: str) -> str | None:
    """The directive(s) the message's advice says to write instead of the refused one (None:
    'remove this fuse directive')."""
    m = ADVICE.search(message.splitlines()[0])
    if m is None:
        assert message.splitlines()[0].endswith("remove this fuse directive"), message
        return None
    return (f"{m[1]}\n{indent}" if m[1] else "") + m[2]


def _load(text: str) -> SourceFile:
    return load_source(text, "advice.ccn")


def _follow(text: str, directive: str, message: str) -> str:
    """The program with the advice of `message` applied to `directive`."""
    return text.replace(directive, _advised(message, "    ") or "")


@pytest.mark.parametrize("case", range(len(REFUSED)))
def test_refusal_advice_leads_to_an_accepted_fusion(case):
    program, directive, what = REFUSED[case]
    text = program.replace("FUSE", directive)
    with pytest.raises(CompileError) as e:
        _load(text)
    message = str(e.value)
    assert what in message, message
    assert "fuse" in message.splitlines()[0]
    fixed = _follow(text, directive, message)
    assert fixed != text
    _load(fixed)  # accepted: no refusal of the fusion, nor of anything else


def test_a_reorder_refused_for_its_names_leads_to_an_accepted_fusion():
    """Too few names for a reorder whose values other stages still read whole (the inf/NaN
    count and the norm of gf): the advice moves those readers too; the fuse refused after it
    says what to add; following both gives one fused collective with the two reductions."""
    text = SCALED.replace("REORDER", "agm, agv, agw = reorder(ag, gf, m1, v1, w1)").replace(
        "FUSE", "fuse(rs, gf, m1, v1, w1, agw)")
    with pytest.raises(CompileError) as e:
        _load(text)
    advised = re.search(r"onto the slices too: (agm, agv, agw = reorder\([^()]*\))$", str(e.value).splitlines()[0])
    assert advised is not None, str(e.value)
    text = text.replace("agm, agv, agw = reorder(ag, gf, m1, v1, w1)", advised[1])
    with pytest.raises(CompileError) as e:
        _load(text)
    assert "add 'bad', 'c' to the fusion" in str(e.value), str(e.value)
    mod = _load(_follow(text, "fuse(rs, gf, m1, v1, w1, agw)", str(e.value)))
    fused = [u for u in mod.plans[("ls", "s")].units if isinstance(u, Fused)]
    assert len(fused) == 1 and len(fused[0].partials) == 2


def test_adamw_clipping_fuses_with_c():
    """The issue's circle: the advice adds c, and the fusion with c is one fused collective."""
    text = ADAMW.replace("FUSE", "fuse(rs, m1, v1, mh, vh, w1, agw)")
    with pytest.raises(CompileError, match=re.escape("add 'c' to the fusion: fuse(rs, c, m1, v1, mh, vh, w1, agw)")):
        _load(text)
    mod = _load(ADAMW.replace("FUSE", "fuse(rs, c, m1, v1, mh, vh, w1, agw)"))
    fused = [u for u in mod.plans[("adamw", "s")].units if isinstance(u, Fused)]
    assert len(fused) == 1 and fused[0].partials == ("t0_c",)


def test_update_after_a_waiting_reader_waits_too():
    """m1 could run on each chunk, but k (which waits for the norm) reads the old m, and m1
    writes m in place: m1 waits with it (phase B), so k reads m before m1 writes it."""
    text = """
program e(g: f32[N] local, w: f32[N] replicated, m: f32[N] replicated, lr: f32) {
    g1 = allreduce(sum, g)
    c = norm(g1)
    k = c * m * g1
    m1 = update(m, m * 0.5 + g1)
    w1 = update(w, w - lr * k)
}
schedule z for e {
    rs, ag = split(g1)
    agm, agw = reorder(ag, c, k, m1, w1)
    slice(m)
    fuse(rs, c, k, m1, w1, agw)
}
"""
    f = next(u for u in _load(text).plans[("e", "z")].units if isinstance(u, Fused))
    assert [i.name for p in f.phases for i in p.items] == ["rs"] and f.partials == ("c",)
    path = Path(__file__).resolve().parent / "programs" / "fused_update_waits.ccn"
    assert path.read_text() == text.lstrip()
    out = _run(["run", str(path), "-s", "all", "--ranks", "2", "--size", "N=1001"], {"COCONET_CHUNK": "128"})
    assert out.count("matches the interpreter on every rank") == 2, out


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_loss_scaled_step_is_skipped_on_inf_and_nan(ranks):
    """examples/scaled_adam.ccn compiled: an inf or a NaN in one rank's gradient skips the step
    under every schedule (m, v, w and w16 unchanged, the scale halved); finite gradients take it,
    the schedules agree (tests/fused_reductions_worker.py)."""
    rc, out, _ = rank_pool.run(ranks, [str(Path(__file__).with_name("fused_reductions_worker.py")),
                                       str(EX / "scaled_adam.ccn")], timeout=400)
    assert rc == 0 and out.count("OK ") == 11, out


def _other_refusals() -> list[tuple[str, str]]:
    """Every refused fuse of tests/test_errors.py and tests/test_cli.py: (id, program)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import test_cli
    import test_errors
    out = [(c[0], c[1]) for c in test_errors.CASES if c[0].startswith("fuse") or c[-1].startswith("fuse")]
    out += [(k, text) for k, (text, where) in test_cli.PLAN_REFUSALS.items() if "error: fuse" in where]
    return out


@pytest.mark.parametrize("case", _other_refusals(), ids=lambda c: c[0])
def test_every_fuse_refusal_of_the_test_suite_leads_somewhere(case):
    """The same for the refusals other tests check: the advice, applied to the fuse directive
    at the error's line, gives a file with no refusal."""
    _, text = case
    with pytest.raises(CompileError) as e:
        _load(text)
    d = e.value.diagnostics[0]
    message = d.message
    lines = text.splitlines(keepends=True)
    line = lines[d.span.line - 1]
    indent = line[:len(line) - len(line.lstrip())]
    advised = _advised(message, indent)
    lines[d.span.line - 1] = (indent + advised + "\n") if advised else "\n"
    _load("".join(lines))
