"""The coconetc command: check, show, run --interp. User errors come out as diagnostics with
a caret and no Python traceback; --debug adds the traceback; run exits non-zero when a
schedule's results differ from the program's."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import rank_pool
from click.testing import CliRunner, Result

from coconetc import cli
from coconetc.sourcefile import SourceFile, ScheduleIR, load_file, load_source
from coconetc.oracle.interpreted import run_interp
from coconetc.ir import printer

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").glob("*.ccn"))
COCONETC = REPO / ".venv" / "bin" / "coconetc"
SCHEDULES = [(f, p, s) for f in EXAMPLES for p, scheds in load_file(f).schedules.items()
             for s, x in scheds.items() if not x.auto]

BROKEN = """\
program sgd(g: f32[N] local, w: f32[N] replicated, lr: f32) {
    g1 = allreduce(sum, g)
    w1 = update(w, w - lr * g2)
    h = g1 + undefined_thing
}
"""


def invoke(*args: str | Path) -> Result:
    return CliRunner().invoke(cli.main, [str(a) for a in args])


def clean_error(res: Result, *needles: str) -> None:
    """Exit 1, the message on stderr, no traceback anywhere."""
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output
    assert not isinstance(res.exception, Exception) or isinstance(res.exception, SystemExit)
    for n in needles:
        assert n in res.stderr, res.stderr


@pytest.fixture
def broken(tmp_path: Path) -> Path:
    path = tmp_path / "broken.ccn"
    path.write_text(BROKEN)
    return path


# ---- check ----

@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_check_example(path: Path) -> None:
    res = invoke("check", path)
    assert res.exit_code == 0, res.output
    assert f"{path}: ok" in res.stdout


def test_check_several_files_one_broken(broken: Path) -> None:
    res = invoke("check", REPO / "examples" / "sgd.ccn", broken)
    assert res.exit_code == 1
    assert "sgd.ccn: ok" in res.stdout
    assert f"{broken}:3:" in res.stderr


def test_check_broken_file_reports_every_error_with_a_caret(broken: Path) -> None:
    res = invoke("check", broken)
    clean_error(res, f"{broken}:3:29: error: unknown name 'g2'", f"{broken}:4:14: error: unknown name 'undefined_thing'")
    lines = res.stderr.splitlines()
    i = lines.index(f"{broken}:3:29: error: unknown name 'g2'")
    assert lines[i + 1] == "        w1 = update(w, w - lr * g2)"
    assert lines[i + 2] == "    " + " " * 28 + "^^"


def test_check_debug_shows_the_traceback(broken: Path) -> None:
    res = invoke("--debug", "check", broken)
    assert res.exit_code == 1
    assert "Traceback (most recent call last)" in res.stderr
    assert "CompileError" in res.stderr
    assert f"{broken}:3:29: error:" in res.stderr


def test_show_debug_shows_the_traceback(broken: Path) -> None:
    res = invoke("--debug", "show", broken)
    assert res.exit_code == 1 and "Traceback" in res.stderr


def test_check_missing_file(tmp_path: Path) -> None:
    clean_error(invoke("check", tmp_path / "nope.ccn"), "cannot read", "nope.ccn")


def test_subprocess_check_broken_file_has_no_traceback(broken: Path) -> None:
    proc = subprocess.run([COCONETC, "check", broken], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert f"{broken}:3:29: error: unknown name 'g2'" in proc.stderr
    assert "^^" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_subprocess_run_interp(tmp_path: Path) -> None:
    out = tmp_path / "out.npz"
    proc = subprocess.run([COCONETC, "run", REPO / "examples" / "adam.ccn", "--ranks", "3", "-s", "zero",
                           "--interp", "--save", out], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "matches the unscheduled program on every rank" in proc.stdout
    assert out.exists()


def test_version() -> None:
    res = invoke("--version")
    assert res.exit_code == 0 and "0.1.0" in res.output


# ---- show ----

def test_show_text_is_the_printed_program() -> None:
    path = REPO / "examples" / "sgd.ccn"
    res = invoke("show", path)
    assert res.exit_code == 0
    assert res.stdout == printer.program(load_file(path).programs["sgd"])


def test_show_schedule_text() -> None:
    path = REPO / "examples" / "adam.ccn"
    res = invoke("show", path, "--schedule", "zero")
    assert res.exit_code == 0, res.output
    assert res.stdout == printer.program(load_file(path).schedule("adam", "zero").ir)
    assert "m: f32[N] sliced(0)" in res.stdout and "schedule printed for adam {" in res.stdout


def test_show_dot_with_schedule() -> None:
    from test_printer import check_dot
    res = invoke("show", REPO / "examples" / "mlp_out.ccn", "-s", "overlapped", "--format", "dot")
    assert res.exit_code == 0, res.output
    g = check_dot(res.stdout)
    assert "cluster_f" in g.clusters and ("y", "rs") in g.edges


def test_show_picks_the_program_that_owns_the_schedule() -> None:
    res = invoke("show", REPO / "examples" / "conv2d.ccn", "-s", "rs_c_ag")
    assert res.exit_code == 0 and "program conv_tp(" in res.stdout


@pytest.mark.parametrize(("args", "needle"), [
    (("-s", "nope"), "no schedule 'nope' for program 'adam'"),
    (("-p", "nope"), "no program 'nope'"),
    (("-s", "all"), "no schedule 'all'"),
], ids=["schedule", "program", "all"])
def test_show_unknown_names(args: tuple[str, ...], needle: str) -> None:
    clean_error(invoke("show", REPO / "examples" / "adam.ccn", *args), needle)


def test_show_after_each_pass_of_the_planner() -> None:
    """--after NAME: the plan as that pass left it. tp_mlp's overlapped schedule: the GELU loop
    becomes the first GEMM's epilogue in `epilogues` (not before), and after the last pass the
    plan is the file's plan; --after without --format plan says to add it."""
    from coconetc.plan.planner import PASS_NAMES
    from coconetc.plan.show import show as show_plan
    path = REPO / "examples" / "tp_mlp.ccn"
    out = {}
    for name in PASS_NAMES:
        res = invoke("show", path, "-p", "tp_mlp", "-s", "overlapped", "--format", "plan", "--after", name)
        assert res.exit_code == 0, res.output
        out[name] = res.stdout
    epilogue = "epilogue gelu_bias(b1) -> h"
    assert epilogue not in out["lower"] and epilogue in out["epilogues"], out["epilogues"]
    assert out["verify"] == show_plan(load_file(path).plans[("tp_mlp", "overlapped")])
    clean_error(invoke("show", path, "-p", "tp_mlp", "--after", "lower"), "add --format plan")
    assert invoke("show", path, "-p", "tp_mlp", "--after", "nope", "--format", "plan").exit_code == 2


def test_show_auto_schedule_is_a_clean_error() -> None:
    clean_error(invoke("show", REPO / "examples" / "sgd.ccn", "-s", "auto"), "autotuner")


def test_show_needs_a_program_in_a_file_with_several() -> None:
    clean_error(invoke("show", REPO / "examples" / "conv2d.ccn"), "holds 2 programs", "--program")


# ---- run --interp ----

@pytest.mark.parametrize(("path", "prog", "sched"), SCHEDULES,
                         ids=[f"{f.stem}.{p}.{s}" for f, p, s in SCHEDULES])
def test_run_every_schedule_matches(path: Path, prog: str, sched: str) -> None:
    # the pipeline stage needs two groups (of 3 ranks) to send anything that is not zeros
    ranks = ("--ranks", "6", "--groups", "2") if path.stem == "pipeline" else ("--ranks", "3")
    # gpt_block's heads: 3 ranks hold whole heads of the merged NH * HD columns when HD = 1
    sizes = ("--size", "HD=1") if path.stem in ("gpt_block", "gpt_pipeline") else ()
    res = invoke("run", path, "-p", prog, *ranks, *sizes, "--schedule", sched, "--interp")
    assert res.exit_code == 0, res.output
    assert "matches the unscheduled program on every rank" in res.stdout
    assert "MISMATCH" not in res.output


def test_run_unscheduled() -> None:
    res = invoke("run", REPO / "examples" / "sgd.ccn", "--interp")
    assert res.exit_code == 0, res.output
    assert "sgd: 2 ranks, 1 group(s), N=10" in res.stdout and "matches" not in res.stdout


def test_run_schedule_all() -> None:
    res = invoke("run", REPO / "examples" / "adam.ccn", "--ranks", "3", "-s", "all", "--interp")
    assert res.exit_code == 0, res.output
    assert res.stdout.count("matches the unscheduled program on every rank") == 3
    for s in ("rs_c_ag", "zero", "fused"):
        assert f"adam [{s}]: 3 ranks" in res.stdout


def test_run_schedule_all_skips_auto() -> None:
    res = invoke("run", REPO / "examples" / "sgd.ccn", "-s", "all", "--interp")
    assert res.exit_code == 0, res.output
    assert "sgd [auto]: skipped" in res.stdout and res.stdout.count("matches") == 2


@pytest.mark.parametrize("label", ["default", "fused", "fused@p2p"])
def test_run_schedule_label_means_what_a_call_means(label: str) -> None:
    """-s takes a schedule label as a call does: 'default' is the program itself (as -s all,
    the Python API and DistributedOptimizer call it), 'fused@p2p' the schedule fused (its
    algorithm only matters to the compiled CPU module)."""
    res = invoke("run", REPO / "examples" / "sgd.ccn", "-s", label, "--interp")
    assert res.exit_code == 0, res.output
    if label == "default":
        assert "sgd: 2 ranks, 1 group(s), N=10" in res.stdout and "matches" not in res.stdout
    else:
        assert "sgd [fused]: 2 ranks" in res.stdout and "matches the unscheduled program" in res.stdout


def test_run_unknown_algorithm_is_a_clean_error() -> None:
    clean_error(invoke("run", REPO / "examples" / "sgd.ccn", "-s", "fused@nope", "--interp"),
                "unknown fused-collective algorithm 'nope'")


def test_run_compiled_schedule_default_and_an_algorithm() -> None:
    """Compiled, on 2 ranks: --schedule default runs the program itself, fused@p2p the
    schedule fused with point-to-point collectives, each compared with the interpreter."""
    import subprocess
    import sys
    exe = Path(sys.executable).parent / "coconetc"
    for label, shown in (("default", "default"), ("fused@p2p", "fused@p2p")):
        res = subprocess.run([str(exe), "run", str(REPO / "examples" / "sgd.ccn"), "--ranks", "2",
                              "--schedule", label, "--size", "N=13"],
                             capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stdout + res.stderr
        assert f"sgd [{shown}]: 2 ranks" in res.stdout, res.stdout
        assert res.stdout.count("matches the interpreter on every rank") == 1, res.stdout


def test_run_schedule_all_without_schedules() -> None:
    res = invoke("run", REPO / "examples" / "conv2d.ccn", "-p", "conv_layer", "-s", "all", "--interp")
    assert res.exit_code == 0, res.output
    assert "conv_layer: no schedules to run" in res.stdout


def test_run_groups_pipeline() -> None:
    res = invoke("run", REPO / "examples" / "pipeline.ccn", "--ranks", "4", "--groups", "2",
                 "-s", "sliced_p2p", "--interp")
    assert res.exit_code == 0, res.output
    assert "4 ranks, 2 group(s)" in res.stdout and "matches" in res.stdout


def test_run_groups_must_divide_ranks() -> None:
    clean_error(invoke("run", REPO / "examples" / "pipeline.ccn", "--ranks", "3", "--groups", "2",
                       "--interp"), "3 ranks do not form 2 equal groups")


def test_run_size(tmp_path: Path) -> None:
    out = tmp_path / "o.npz"
    res = invoke("run", REPO / "examples" / "sgd.ccn", "--ranks", "3", "-s", "rs_c_ag", "--size", "N=13",
                 "--interp", "--save", out)
    assert res.exit_code == 0, res.output
    assert "N=13" in res.stdout and "float32[13]" in res.stdout and "matches" in res.stdout
    with np.load(out) as z:
        assert z["r0.out.w"].shape == (13,) and z["r0.in.g"].shape == (13,)


@pytest.mark.parametrize("item", ["N=abc", "N", "N=", "=13", "N=-1", "N=1.5", "M=13"])
def test_run_bad_size_is_a_clean_error(item: str) -> None:
    clean_error(invoke("run", REPO / "examples" / "sgd.ccn", "--size", item, "--interp"), "--size")


def test_run_unknown_size_symbol_names_the_known_ones() -> None:
    res = invoke("run", REPO / "examples" / "sgd.ccn", "--size", "M=13", "--interp")
    clean_error(res, "no size symbol 'M'", "size symbols: N")


def test_run_size_too_large_is_a_clean_error() -> None:
    clean_error(invoke("run", REPO / "examples" / "sgd.ccn", "--size", f"N={10**15}", "--interp"),
                "coconetc:")


@pytest.mark.parametrize(("args", "needle"), [
    (("-s", "nope"), "no schedule 'nope' for program 'adam' (schedules: rs_c_ag, zero, fused)"),
    (("-p", "nope"), "no program 'nope'"),
    (("-p", "nope", "-s", "all"), "no program 'nope'"),
], ids=["schedule", "program", "program-all"])
def test_run_unknown_names(args: tuple[str, ...], needle: str) -> None:
    clean_error(invoke("run", REPO / "examples" / "adam.ccn", *args, "--interp"), needle)


def test_run_compiled_on_mpi_ranks() -> None:
    """Without --interp: build, launch 2 ranks with mpiexec, compare with the interpreter."""
    import subprocess
    import sys
    exe = Path(sys.executable).parent / "coconetc"
    res = subprocess.run([str(exe), "run", str(REPO / "examples" / "sgd.ccn"), "--ranks", "2",
                          "--schedule", "all", "--size", "N=13"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    for sched in ("default", "fused", "rs_c_ag"):
        assert f"sgd [{sched}]: 2 ranks" in res.stdout
    assert res.stdout.count("matches the interpreter on every rank") == 3


def test_run_broken_file(broken: Path) -> None:
    clean_error(invoke("run", broken, "--interp"), f"{broken}:3:29: error:")


# ---- run --save ----

def test_save_keys_and_values(tmp_path: Path) -> None:
    """lamb: every parameter as input, updated parameters as outputs, segments of scattered ones."""
    path, out = REPO / "examples" / "lamb.ccn", tmp_path / "lamb.npz"
    res = invoke("run", path, "--ranks", "2", "--interp", "--save", out, "--seed", "7")
    assert res.exit_code == 0, res.output
    prog = load_file(path).programs["lamb"]
    want = {f"r{r}.in.{q.name}" for r in range(2) for q in prog.params}
    want |= {f"r{r}.out.{t}" for r in range(2) for t in ("w", "m", "v")}
    want |= {f"r{r}.seg.{t}" for r in range(2) for t in ("g", "w", "m", "v")}
    ref = run_interp(load_file(path), "lamb", None, 2, seed=7)
    with np.load(out) as z:
        assert set(z.files) == want
        np.testing.assert_array_equal(z["r0.out.w"], ref.results[0].updates["w"])
        np.testing.assert_array_equal(z["r1.out.m"], ref.results[1].updates["m"])
        assert z["r0.seg.g"].sum() == 10 and len(z["r0.seg.g"]) > 1
        np.testing.assert_array_equal(z["r0.seg.g"], z["r0.seg.w"])


def test_run_value_gives_a_scalar(tmp_path: Path) -> None:
    """run --value NAME=NUMBER: that scalar on every rank, every other input as drawn without it;
    a bad one refused before anything runs, as explain --measure's (the same parse)."""
    path, out = REPO / "examples" / "lamb.ccn", tmp_path / "lamb.npz"
    res = invoke("run", path, "--ranks", "2", "--interp", "--save", out, "--seed", "7", "--value", "step=3")
    assert res.exit_code == 0, res.output
    ref = run_interp(load_file(path), "lamb", None, 2, seed=7)
    with np.load(out) as z:
        assert z["r0.in.step"] == z["r1.in.step"] == 3.0 != ref.inputs[0]["step"]
        np.testing.assert_array_equal(z["r1.in.g"], np.concatenate(ref.inputs[1]["g"]))
        assert z["r0.in.lr"] == ref.inputs[0]["lr"]
    res = invoke("run", path, "--interp", "--value", "lr=fast")
    assert res.exit_code != 0 and "--value lr=fast: 'lr' must be a number (f32), got 'fast'" in res.output, res.output


def test_save_scheduled_zero(tmp_path: Path) -> None:
    """After slice(m, v) the sliced state comes in and goes out as this rank's slice."""
    out = tmp_path / "z.npz"
    res = invoke("run", REPO / "examples" / "lamb.ccn", "--ranks", "2", "-s", "zero", "--interp",
                 "--save", out)
    assert res.exit_code == 0, res.output
    with np.load(out) as z:
        assert z["r0.in.m"].shape == (5,) and z["r0.out.m"].shape == (5,)
        assert z["r0.out.w"].shape == (10,)
        assert "r0.seg.g" in z.files and "r0.seg.m" not in z.files


def test_save_outputs_by_public_name(tmp_path: Path) -> None:
    out = tmp_path / "m.npz"
    res = invoke("run", REPO / "examples" / "mlp_out.ccn", "-s", "overlapped", "--interp", "--save", out)
    assert res.exit_code == 0, res.output
    with np.load(out) as z:
        assert {"r0.out.out", "r1.out.out", "r0.in.x", "r1.in.seed"} <= set(z.files)
        assert not any(".seg." in k for k in z.files)


def test_save_with_schedule_all_writes_one_file_each(tmp_path: Path) -> None:
    res = invoke("run", REPO / "examples" / "sgd.ccn", "-s", "all", "--interp", "--save", tmp_path / "s.npz")
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.fused.npz", "s.rs_c_ag.npz"]


# ---- run: a schedule whose results differ makes the command fail ----

WRONG_SGD = """\
program sgd(g: f32[N] local, w: f32[N] replicated, lr: f32) {
    g1 = allreduce(sum, g)
    w1 = update(w, w + lr * g1)
}
"""


def _with_wrong_schedule(path: Path, name: str) -> SourceFile:
    """The real module, except that schedule `name` computes w + lr * g instead of w - lr * g."""
    mod = load_file(path)
    wrong = load_source(WRONG_SGD).programs["sgd"]
    sched = mod.schedules["sgd"][name]
    mod.schedules["sgd"][name] = dataclasses.replace(sched, ir=wrong)
    assert isinstance(mod.schedules["sgd"][name], ScheduleIR)
    return mod


@pytest.mark.parametrize("which", ["fused", "all"])
def test_run_mismatch_exits_nonzero(monkeypatch: pytest.MonkeyPatch, which: str) -> None:
    path = REPO / "examples" / "sgd.ccn"
    monkeypatch.setattr(cli.files, "load_file", lambda _: _with_wrong_schedule(path, "fused"))  # (what run reads)
    res = invoke("run", path, "-s", which, "--interp")
    assert res.exit_code == 1, res.output
    assert "MISMATCH against the unscheduled program" in res.stderr
    assert "rank 0 updated 'w': max abs difference" in res.stderr
    assert "Traceback" not in res.output
    if which == "all":  # the good schedule still runs and matches
        assert "sgd [rs_c_ag]" in res.stdout and "matches the unscheduled" in res.stdout


def test_run_mismatch_from_a_perturbed_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter returns a wrong value for the scheduled run only."""
    from coconetc.oracle import interpreted
    real = interpreted.run

    def perturbed(p, inputs, groups=1):
        results = real(p, inputs, groups)
        if p.stage("g1") is None:  # the scheduled program (g1 was split)
            results[1].updates["w"] = results[1].updates["w"] + 1
        return results

    monkeypatch.setattr(interpreted, "run", perturbed)
    res = invoke("run", REPO / "examples" / "sgd.ccn", "-s", "rs_c_ag", "--interp")
    assert res.exit_code == 1, res.output
    assert "rank 1 updated 'w'" in res.stderr and "rank 0 updated" not in res.stderr


PLAN_REFUSALS = {
    # a fused consumer is chunked along dim 0 only: refused at the overlap, by check itself
    "overlap_fused_dim1": ("""\
program p(x: f32[B, S, K] sliced(2), w: f32[K, H] sliced(0), b: f32[H] replicated) {
    y = matmul(x, w)
    s = allreduce(sum, y)
    out = s + b
    return out
}
schedule o for p {
    rs, ag = split(s, dim=2)
    ago = reorder(ag, out)
    f = fuse(rs, out, ago)
    overlap(y, f, chunks=2, dim=1)
}
""", "11:5: error: overlap: a fused consumer is chunked along dim 0 of 'y' into an allreduce or a reducescatter "
        "along another dim; here dim=1 into reducescatter along dim 2: chunk it along dim 0: "
        "overlap(y, f, chunks=2, dim=0)"),
    # a fusion with nothing to compute on a chunk as it arrives (nor a reduction of the chunks
    # to accumulate, as w - g1 / norm(g1) would give): an error, not a silent fallback
    "fuse_nothing_per_chunk": ("""\
program q(g: f32[N] local, w: f32[N] replicated) {
    g1 = allreduce(sum, g)
    w1 = update(w, w - g1)
}
schedule f for q {
    rs, ag = split(g1)
    fuse(rs, ag)
}
""", "7:5: error: fuse: nothing to compute inside the collective: it holds no computation"),
    # an allgather alone cannot carry a computation
    "fuse_allgather_only": ("""\
program q(g: f32[N] local, w: f32[N] replicated) {
    g1 = allreduce(sum, g)
    w1 = update(w, w - g1)
}
schedule f for q {
    rs, ag = split(g1)
    agw = reorder(ag, w1)
    fuse(w1, agw)
}
""", "8:5: error: fuse: a fused collective reduces chunk by chunk"),
    # computations that cannot share one loop
    "fuse_other_elements": ("""\
program q(a: f32[N] replicated, b: f32[M] replicated) {
    x = a * 2
    y = b + 1
    return x, y
}
schedule f for q {
    fuse(x, y)
}
""", "7:5: error: fuse: 'y' cannot share one loop with 'x'"),
}


@pytest.mark.parametrize("case", sorted(PLAN_REFUSALS))
def test_check_reports_what_no_backend_runs(tmp_path: Path, case: str) -> None:
    """A schedule the plan cannot run as asked is refused by `check` (and so by compile and
    run), at the directive's line and column: never run differently under its name."""
    text, where = PLAN_REFUSALS[case]
    src = tmp_path / "p.ccn"
    src.write_text(text)
    clean_error(invoke("check", src), f"{src}:{where}")
    clean_error(invoke("check", "--backend", "cpu", src), f"{src}:{where}")
    clean_error(invoke("compile", src, "-o", tmp_path / "out"), f"{src}:{where}")


# ---- files with no program, sizes that overflow (issue 8) ----
@pytest.mark.parametrize("command", ["check", "compile", "run", "show"])
@pytest.mark.parametrize("text", ["", "# only a comment\n\n"])
def test_file_without_a_program_is_an_error(tmp_path: Path, command: str, text: str) -> None:
    path = tmp_path / "empty.ccn"
    path.write_text(text)
    res = invoke(command, path)
    clean_error(res, f"{path}:1:1: error: no program in this file")


@pytest.mark.parametrize("size, needle", [
    ("N=4611686018427387904", "adam.ccn:2:14: error: with N=4611686018427387904, 'g' (f32[N] local) "
                              "is too large: 4611686018427387904 elements of f32 (18446744073709551616 bytes)"),
    ("N=99999999999999999999999", "a size must fit int64"),
])
def test_size_that_overflows_is_caught_before_allocation(size: str, needle: str) -> None:
    for extra in ((), ("--interp",)):
        res = invoke("run", REPO / "examples" / "adam.ccn", "--size", size, *extra)
        clean_error(res, needle)


def test_size_overflow_in_a_stage_is_located_at_the_stage(tmp_path: Path) -> None:
    path = tmp_path / "outer.ccn"
    path.write_text("program p(x: f32[N, 1] local, y: f32[1, N] local) {\n    z = matmul(x, y)\n"
                    "    return z\n}\n")
    res = invoke("run", path, "--interp", "--size", "N=3037000500")
    clean_error(res, f"{path}:2:5: error: with N=3037000500, 'z' (f32[N, N] local) is too large")


# ---- launch ----

def test_launch_runs_a_python_script_on_every_rank(tmp_path: Path) -> None:
    import sys
    script = tmp_path / "hello.py"
    script.write_text("import sys\nfrom mpi4py import MPI\nc = MPI.COMM_WORLD\n"
                      "print(f'rank {c.Get_rank()} of {c.Get_size()} args {sys.argv[1:]}')\n"
                      "sys.exit(3 if '--fail' in sys.argv and c.Get_rank() == 1 else 0)\n")
    exe = Path(sys.executable).parent / "coconetc"
    res = subprocess.run([str(exe), "launch", "-n", "2", str(script), "--x", "1"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    for r in (0, 1):
        assert f"rank {r} of 2 args ['--x', '1']" in res.stdout
    res = subprocess.run([str(exe), "launch", "-n", "2", str(script), "--fail"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode != 0, res.stdout + res.stderr


def test_launch_with_an_mpiexec_that_is_not_there_says_so(tmp_path: Path) -> None:
    """COCONET_MPIEXEC naming no program: launch and run say which and what to do (no traceback)."""
    import os
    script = tmp_path / "hello.py"
    script.write_text("print('never')\n")
    exe = Path(sys.executable).parent / "coconetc"
    env = {**os.environ, "COCONET_MPIEXEC": str(tmp_path / "nope")}
    for argv in (["launch", "-n", "2", str(script)], ["run", str(REPO / "examples" / "adam.ccn"), "--ranks", "2"]):
        res = subprocess.run([str(exe), *argv], capture_output=True, text=True, timeout=300, env=env)
        assert res.returncode == 1, res.stdout + res.stderr
        assert "Traceback" not in res.stderr and "never" not in res.stdout
        assert f"could not start 2 ranks: coconetc: COCONET_MPIEXEC='{tmp_path / 'nope'}' is not an executable " \
               "file: unset it" in res.stderr, res.stderr


def test_launch_command_line_names_the_hosts(tmp_path: Path) -> None:
    """--hostfile / --host reach mpiexec's command line (Open MPI's spelling, or hydra's -f /
    -hosts), before the program; without them the command names no host."""
    from coconetc.launch import mpiexec
    plain = mpiexec.command(4, ["python", "train.py"])
    assert plain[:3] == [mpiexec.mpiexec(), "-n", "4"] and plain[-2:] == ["python", "train.py"]
    assert not {"--hostfile", "--host", "-f", "-hosts"} & set(plain)
    hosts = tmp_path / "hosts"
    cmd = mpiexec.command(16, ["python", "train.py"], hostfile=str(hosts), hosts="n1:8,n2:8")
    openmpi = mpiexec._is_open_mpi()
    hf, h = ("--hostfile", "--host") if openmpi else ("-f", "-hosts")
    assert cmd[cmd.index(hf) + 1] == str(hosts) and cmd[cmd.index(h) + 1] == "n1:8,n2:8"
    assert cmd.index(hf) < cmd.index("python") and cmd[-2:] == ["python", "train.py"]
    assert "-n" in cmd and cmd[cmd.index("-n") + 1] == "16"


def test_a_rank_knows_when_its_machine_has_more_ranks_than_cores(monkeypatch) -> None:
    """oversubscribed(): the launcher's count of this machine's ranks (Open MPI's or MPICH's
    variable) against the cores; no count, no oversubscription (a pipeline's waiting ranks then
    sleep between polls: coconetc.torch.pipeline)."""
    from coconetc.launch import mpiexec
    monkeypatch.setattr(mpiexec.os, "cpu_count", lambda: 2)
    for var in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        monkeypatch.delenv(var, raising=False)
    assert not mpiexec.oversubscribed()
    for var in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        monkeypatch.setenv(var, "2")
        assert not mpiexec.oversubscribed()
        monkeypatch.setenv(var, "3")
        assert mpiexec.oversubscribed()
        monkeypatch.delenv(var)


def test_launch_passes_the_hosts_on(tmp_path: Path, monkeypatch) -> None:
    """coconetc launch --hostfile F --host H: run_python gets them (and the script's own
    arguments stay the script's); a missing hostfile or an empty host name is a clean error."""
    from coconetc.launch import mpiexec
    seen = {}

    def fake(ranks, args, timeout=None, hostfile=None, hosts=None):
        seen.update(ranks=ranks, args=args, hostfile=hostfile, hosts=hosts)
        return 0

    monkeypatch.setattr(mpiexec, "run_python", fake)
    script = tmp_path / "train.py"
    script.write_text("")
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=2\n")
    res = invoke("launch", "-n", "4", "--hostfile", hosts, "--host", "a,b", script, "--host", "x")
    assert res.exit_code == 0, res.output
    assert seen == dict(ranks=4, args=[str(script), "--host", "x"], hostfile=str(hosts), hosts="a,b")
    res = invoke("launch", "--hostfile", tmp_path / "nope", script)
    assert res.exit_code == 2 and "nope" in res.output
    # `coconetc launch -n 2 python train.py ARGS`, as one writes it for mpiexec: the same run
    for python in ("python", "python3", sys.executable):
        seen.clear()
        res = invoke("launch", "-n", "2", python, script, "--x", "1")
        assert res.exit_code == 0, res.output
        assert seen["args"] == [str(script), "--x", "1"], (python, seen)
    for missing in (tmp_path / "nope.py", "python"):  # a missing script; `python` with no script
        res = invoke("launch", missing)
        assert res.exit_code == 2 and "does not exist" in res.output, res.output
    clean_error(invoke("launch", "--host", "a,,b", script), "an empty host name")


def test_launch_on_a_hostfile_of_this_machine(tmp_path: Path) -> None:
    """A hostfile naming this machine runs the ranks for real."""
    import sys
    from coconetc.launch import mpiexec
    if not mpiexec._is_open_mpi():
        pytest.skip("the hostfile syntax here is Open MPI's")
    script = tmp_path / "hello.py"
    script.write_text("from mpi4py import MPI\nc = MPI.COMM_WORLD\nprint(f'rank {c.Get_rank()} of {c.Get_size()}')\n")
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=2\n")
    exe = Path(sys.executable).parent / "coconetc"
    res = subprocess.run([str(exe), "launch", "-n", "2", "--hostfile", str(hosts), str(script)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "rank 0 of 2" in res.stdout and "rank 1 of 2" in res.stdout


def test_ranks_of_this_machine_leave_out_the_network_transport(monkeypatch) -> None:
    """Ranks started on this machine run without Open MPI's libfabric transport (btl ofi, about a
    second of each rank's MPI_Init spent probing networks); ranks on hosts keep every transport,
    and a user's own OMPI_MCA_btl is kept."""
    from coconetc.launch import mpiexec
    if not mpiexec._is_open_mpi():
        pytest.skip("an Open MPI setting")
    monkeypatch.delenv("OMPI_MCA_btl", raising=False)
    assert mpiexec.environment(2)["OMPI_MCA_btl"] == "^ofi"
    assert "OMPI_MCA_btl" not in mpiexec.environment(2, local=False)
    monkeypatch.setenv("OMPI_MCA_btl", "self,tcp")
    assert mpiexec.environment(2)["OMPI_MCA_btl"] == "self,tcp"


def test_every_job_has_its_own_shared_memory_segments(monkeypatch, tmp_path) -> None:
    """Open MPI names a job's shared-memory segments by a 16-bit hash of the job: each job
    started here (and this process, imported coconetc outside a job) gets a directory of its
    own, a new job a new one even where a parent coconet process set its own; a user's is kept;
    a rank of a job keeps the job's; the directory goes when the job ends. Two ranks started
    with a user's see each other's segments there."""
    from coconetc.launch import mpiexec
    from coconetc.runtime import hooks
    if not mpiexec._is_open_mpi():
        pytest.skip("an Open MPI setting")
    mine = os.environ[mpiexec.SEGMENTS]  # (set at import: the pytest worker is no rank)
    one, two = (mpiexec.environment(2)[mpiexec.SEGMENTS] for _ in range(2))
    assert len({mine, one, two}) == 3 and all(Path(d).is_dir() for d in (mine, one, two))
    mpiexec.release({mpiexec.SEGMENTS: one})  # (the job ended: its directory goes now)
    assert not Path(one).exists() and Path(two).is_dir()
    for kept in (mpiexec.environment(2, local=False), mpiexec.environment(2, segments=False)):
        assert kept[mpiexec.SEGMENTS] == mine
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    hooks.own_segments()  # (a rank: the job's directory kept)
    assert os.environ[mpiexec.SEGMENTS] == mine
    monkeypatch.setenv(mpiexec.SEGMENTS, str(tmp_path))
    assert mpiexec.environment(2)[mpiexec.SEGMENTS] == str(tmp_path)
    res = rank_pool.fresh(2, ["-c", "import os; from mpi4py import MPI; MPI.COMM_WORLD.Barrier(); "
                          "print(sorted(os.listdir(os.environ['OMPI_MCA_btl_sm_backing_directory'])))"], timeout=120)
    assert res[0] == 0, res
    assert res[1].count("sm_segment.") == 4 and tmp_path.is_dir(), res  # (a user's directory stays)


@pytest.mark.parametrize("label, plan", [("default", "default"), ("zero", "zero"), ("zero@p2p", "zero")])
def test_show_takes_schedule_labels(label: str, plan: str) -> None:
    """show -s takes a schedule label as run and a call do: 'default' is the program itself,
    'zero@p2p' the schedule zero (the algorithm is a call's choice; the plan lists both)."""
    res = invoke("show", REPO / "examples" / "adam.ccn", "-s", label, "--format", "plan")
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith(f"plan adam [{plan}]\n"), res.stdout
    text = invoke("show", REPO / "examples" / "adam.ccn", "-s", label)
    want = invoke("show", REPO / "examples" / "adam.ccn", *([] if plan == "default" else ["-s", plan]))
    assert text.exit_code == 0 and text.stdout == want.stdout


def test_show_unknown_algorithm_is_a_clean_error() -> None:
    clean_error(invoke("show", REPO / "examples" / "adam.ccn", "-s", "zero@nope"),
                "unknown fused-collective algorithm 'nope'")
