"""Schedules of derived programs (`schedule s for grad(p)`) that overlap the input gradient's
matmul_nt with its collective (docs/autodiff.md, "Scheduling the backward pass"): every chunking
the checker allows (leading dims: row blocks of a; the last dim: row blocks of b, a GEMM with b
transposed), into an all-reduce, into the reduce-scatter of a split all-reduce and into a fused
collective (a matmul_nt written out), on the
interpreter, compiled for the CPU backend and as the CUDA backend under the host emulation, on
1, 2 and 3 ranks (F = 7: uneven blocks), each equal to the interpreter; an overlap that cannot
be is an error at its directive."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from rank_checks import run_jobs

import coconetc.autodiff  # noqa: F401  (registers the derived programs' operations)
from coconetc.errors import CompileError
from coconetc.oracle.interpreted import run_interp
from coconetc.plan.show import show as show_plan
from coconetc.sourcefile import load_source
from coconetc.toolchain import probes

# tp (3-d, Megatron's MLP as in examples/tp_mlp.ccn) and col (2-d: the result's last dim is 1):
# the backward of each is d_x = allreduce(sum, g_x_part), g_x_part = matmul_nt(..., w1 or w)
SRC = """
program tp(x: f32[B, S, H] replicated, w1: f32[H, F] sliced(1), b1: f32[F] sliced(0),
           w2: f32[F, H] sliced(0), b2: f32[H] replicated) {
    a = matmul(x, w1)
    h = gelu(a + b1)
    p = matmul(h, w2)
    s = allreduce(sum, p)
    y = s + b2
    return y
}

program col(x: f32[S, H] replicated, w: f32[H, F] sliced(1)) {
    y = relu(matmul(x, w))
    return y
}

# matmul_nt written out (as in a derived program's text), its all-reduce split and fused with
# the bias: the overlap feeds rows of dim 0 into the fused collective (CUDA: cuda/fused.py's
# block of rows, along S and along H, the last dim)
program nt(g: f32[B, S, F] sliced(2), w: f32[H, F] sliced(1), b: f32[H] replicated) {
    y = matmul_nt(g, w)
    s = allreduce(sum, y)
    out = s + b
    return out
}
schedule fused_s for nt {
    rs, ag = split(s, dim=1)
    agout = reorder(ag, out)
    f = fuse(rs, out, agout)
    overlap(y, f, chunks=2, dim=0)
}
schedule fused_h for nt {
    rs, ag = split(s, dim=2)
    agout = reorder(ag, out)
    f = fuse(rs, out, agout)
    overlap(y, f, chunks=2, dim=0)
}

schedule ar0 for grad(tp) {
    overlap(g_x_part, d_x, chunks=2, dim=0)
}
schedule ar1 for grad(tp) {
    overlap(g_x_part, d_x, chunks=3, dim=1)
}
schedule ar2 for grad(tp) {
    overlap(g_x_part, d_x, chunks=2, dim=2)
}
schedule rs0 for grad(tp) {
    rs, ag = split(d_x, dim=1)
    overlap(g_x_part, rs, chunks=2, dim=0)
}
schedule rs2 for grad(tp) {
    rs, ag = split(d_x, dim=1)
    overlap(g_x_part, rs, chunks=3, dim=2)
}
schedule rows for grad(col) {
    overlap(g_x_part, d_x, chunks=2, dim=0)
}
schedule last for grad(col) {
    overlap(g_x_part, d_x, chunks=3, dim=1)
}
"""
SCHEDULES = {"tp_grad": ["ar0", "ar1", "ar2", "rs0", "rs2"], "col_grad": ["rows", "last"], "nt": ["fused_s", "fused_h"]}
SIZES = {"tp": {"B": 2, "S": 5, "H": 4, "F": 7}, "col": {"S": 5, "H": 4, "F": 7}, "nt": {"B": 2, "S": 5, "H": 4, "F": 7}}
MATCHES = "matches the interpreter on every rank"


@pytest.fixture(scope="module")
def mod():
    return load_source(SRC, "grad_sched.ccn")


def test_plan_names_the_gemm(mod):
    for prog, names in SCHEDULES.items():
        for s in names:
            text = show_plan(mod.plans[(prog, s)])
            assert "= matmul_nt(" in text.split(" overlap ", 1)[1], text


@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("prog", sorted(SCHEDULES))
def test_interpreter_schedules_match_the_program(mod, prog, ranks):
    for s in SCHEDULES[prog]:
        rep = run_interp(mod, prog, s, ranks, 1, SIZES[prog.removesuffix("_grad")], seed=ranks)
        assert rep.problems == [], (s, rep.problems)


# one module for every launch: the file with the derived programs of both (`coconetc run --grad`
# builds the file with one program's; the CPU case on 1 rank runs that command too)
GRAD_OF = ["--grad-of", "tp", "--grad-of", "col"]


def _run(path: Path, ranks: int, backend: list[str]) -> str:
    """Every schedule of SCHEDULES in one launch on RANKS ranks: the jobs `coconetc run -p P
    [--grad] -s all` runs (the program, then each schedule), one after the other
    (rank_checks.run_jobs)."""
    return run_jobs(ranks, [[str(path), "--program", name, *GRAD_OF, *backend,
                             *(f"--schedule={s}" for s in ("default", *scheds)),
                             *(f"--size={k}={v}" for k, v in SIZES[name.removesuffix("_grad")].items())]
                            for name, scheds in SCHEDULES.items()])


def _check(out: str) -> None:
    """A line per program and schedule, each matching the interpreter, and no other result."""
    results = [x for x in out.splitlines() if re.match(r"\w+ \[\w+\]", x)]
    assert len(results) == sum(1 + len(s) for s in SCHEDULES.values()), out
    for name, scheds in SCHEDULES.items():
        for s in ("default", *scheds):
            line = next((x for x in results if x.startswith(f"{name} [{s}]")), "")
            assert MATCHES in line, (name, s, out)


@pytest.fixture(scope="module")
def ccn(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("grad_sched") / "grad_sched.ccn"
    p.write_text(SRC)
    return p


@pytest.mark.skipif(probes.missing_cpu_extra(), reason="needs the 'cpu' extra")
@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow), 3])  # quick: 1 and 3 (uneven)
def test_cpu_backend_matches_interpreter(ccn, ranks):
    _check(_run(ccn, ranks, []))
    if ranks == 1:  # and the user's command for a derived program's schedules (its units built already)
        r = subprocess.run([sys.executable, "-c", "from coconetc.cli import main; main()", "run", str(ccn), "-p", "col",
                            "--grad", "-s", "all", "--ranks", "1", *(f"--size={k}={v}" for k, v in SIZES["col"].items())],
                           capture_output=True, text=True, timeout=900)
        lines = [x for x in r.stdout.splitlines() if x.startswith("col_grad [")]
        assert r.returncode == 0 and len(lines) == 3 and all(MATCHES in x for x in lines), r.stdout + r.stderr


@pytest.mark.slow  # (the CPU backend's check of the same schedules stays quick)
@pytest.mark.skipif(probes.emulation_missing() is not None, reason=probes.emulation_missing() or "")
@pytest.mark.parametrize("ranks", [1, 3])
def test_cuda_emulation_matches_interpreter(ccn, ranks):
    out = _run(ccn, ranks, ["--emulate-cuda"])
    assert "skipped" not in out, out
    _check(out)


BAD = [
    # the reduce-scatter cuts dim 1: the chunks cannot cut it too
    ("rs, ag = split(d_x, dim=1)\n    overlap(g_x_part, rs, chunks=2, dim=1)", "cannot chunk along dim 1"),
    # a matmul_tn (the weight gradient) overlaps only with a collective that reads it
    ("overlap(d_w1, d_x, chunks=2)", "does not read 'd_w1' directly"),
    # g_h = matmul_nt(d_y, w2) feeds no collective
    ("overlap(g_h, d_x, chunks=2)", "does not read 'g_h' directly"),
]


@pytest.mark.parametrize("body, fragment", BAD, ids=["dim_scattered", "matmul_tn", "not_read"])
def test_illegal_overlap_of_matmul_nt_is_located(body, fragment):
    base = SRC.split("schedule ar0")[0]
    src = base + "schedule bad for grad(tp) {\n    " + body + "\n}\n"
    with pytest.raises(CompileError) as e:
        load_source(src, "bad.ccn")
    line = base.count("\n") + 1 + body.count("\n") + 1  # the overlap directive's line
    d = next((d for d in e.value.diagnostics if fragment in d.message), None)
    assert d is not None, e.value.render()
    assert d.span.line == line and d.span.col > 1, e.value.render()
