"""The reductions max(x) and min(x) (the IR's amax/amin; issue 20): one argument reduces, two
are the pointwise max(a, b)/min(a, b). The largest (smallest) element as a 0-d value of x's
dtype, NaN when any element is NaN (as torch.amax), -inf (+inf) as the partial result of an
empty slice (NumPy's `initial`); a sliced x's partial results combine across the ranks.

- parse and print round trip, located errors (0 or 3 arguments, an integer tensor);
- the interpreter against NumPy (negative values, NaN, inf, sliced over 2 and 3 ranks, an
  empty slice);
- reorder and fuse: examples/amax_scale.ccn and the `mm` program here, compiled for the CPU on
  2 and 3 ranks with sizes they do not divide and several chunks, against the interpreter, and
  with NaN/inf gradients against NumPy (tests/max_reduction_worker.py); the same under the CUDA
  emulation;
- the derivative (the cotangent to the arg-max elements, split among ties) against finite
  differences and torch.autograd (torch.amax/amin)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from rank_checks import run_jobs

from coconetc.autodiff.text import check_text
from coconetc.errors import CompileError
from coconetc.interp.interpreter import run
from coconetc.ir import printer
from coconetc.ir.slices import take_slice
from coconetc.plan.show import show
from coconetc.plan.units import Fused, Reduce
from coconetc.sourcefile import load_source
from coconetc.toolchain import probes
import rank_pool

REPO = Path(__file__).resolve().parents[1]
EX = REPO / "examples"

MM = """program mm(g: f32[N] local, w: f32[N] replicated, lr: f32) {
    g1 = allreduce(sum, g)
    hi = max(g1)
    lo = min(g1 * w)
    n = norm(g1)
    w1 = update(w, w - lr * (hi - lo) / (n + 1.0) * g1)
    return hi, lo
}

schedule plain for mm {
    rs, ag = split(g1)
    agw = reorder(ag, hi, lo, n, w1)
}

schedule fused for mm {
    rs, ag = split(g1)
    agw = reorder(ag, hi, lo, n, w1)
    fuse(rs, hi, lo, n, w1, agw)
}
"""


# --- front end -------------------------------------------------------------------------------
def test_arity_decides_and_printing_round_trips():
    src = """program p(x: f32[N] sliced(0), y: f32[N] sliced(0), u: f32[N] local) {
    a = max(x)
    b = min(x * y) + max(x, y)
    c = max(min(u), min(u, 2.0))
    return a, b, c
}
"""
    p = load_source(src).program("p")
    ops = {s.name: s.expr for s in p.stages}
    assert ops["a"].op == "amax" and ops["a"].type.shape == () and str(ops["a"].type.layout) == "replicated"
    assert str(ops["c"].type.layout) == "local"
    text = printer.program(p)
    assert "a = max(x)" in text and "min(x * y) + max(x, y)" in text and "max(min(u), min(u, 2.0))" in text
    again = check_text(text)["p"]
    assert printer.program(again) == text


def _error(src: str) -> tuple[int, int, str]:
    with pytest.raises(CompileError) as e:
        load_source(src, "t.ccn")
    d = e.value.diagnostics[0]
    return d.span.line, d.span.col, d.message


@pytest.mark.parametrize("call,col,words", [
    ("max()", 9, "max() takes 1 (max(x)) or 2 (max(a, b)) arguments, got 0"),
    ("min(x, x, x)", 19, "min() takes 1 (min(x)) or 2 (min(a, b)) arguments, got 3"),
    ("1.0 + max(x, x, x, x)", 25, "got 4"),
    ("max(i)", 9, "max(x) of an i32 tensor: the reduction needs a floating-point dtype"),
])
def test_located_errors(call, col, words):
    src = f"program p(x: f32[N] local, i: i32[N] local) {{\n    a = {call}\n    return a\n}}\n"
    line, c, msg = _error(src)
    assert (line, c) == (2, col), msg
    assert words in msg


def test_errors_in_a_definition_body():
    src = "op big(a, b) = max(a, b, a)\nprogram p(x: f32[N] local) {\n    a = big(x, x)\n    return a\n}\n"
    line, col, msg = _error(src)
    assert (line, col) == (1, 26) and "max() takes 1" in msg


# --- interpreter -------------------------------------------------------------------------------
PROG = """program p(x: f32[N] LAYOUT, y: f64[N] LAYOUT) {
    a = max(x)
    b = min(x)
    c = max(y * -1.0)
    d = min(abs(y))
    return a, b, c, d
}"""


def _interp(layout: str, x: np.ndarray, y: np.ndarray, ranks: int) -> list:
    p = load_source(PROG.replace("LAYOUT", layout)).program("p")
    n = x.shape[0]
    if layout == "sliced(0)":
        inputs = [{"x": take_slice(x, 0, n, ranks, r), "y": take_slice(y, 0, n, ranks, r)} for r in range(ranks)]
    else:
        inputs = [{"x": x, "y": y}] * ranks
    return [[np.asarray(r.outputs[k]) for k in "abcd"] for r in run(p, inputs)]


def _numpy(x: np.ndarray, y: np.ndarray) -> list:
    return [np.max(x), np.min(x), np.max(y * -1.0), np.min(np.abs(y))]


@pytest.mark.parametrize("layout", ["replicated", "sliced(0)"])
@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("n", [2, 7])
@pytest.mark.parametrize("poison", [None, np.nan, np.inf, -np.inf])
def test_interpreter_against_numpy(layout, ranks, n, poison):
    rng = np.random.default_rng(n * 10 + ranks)
    x = (rng.standard_normal(n) - 3.0).astype(np.float32)  # all negative: no 0 identity hides
    y = rng.standard_normal(n)
    if poison is not None:
        x[n - 1] = poison  # in the last rank's slice
        y[0] = poison
    want = _numpy(x, y)
    for r, got in enumerate(_interp(layout, x, y, ranks)):
        for k, (a, b) in enumerate(zip(got, want)):
            assert a.shape == () and a.dtype == (np.float32 if k < 2 else np.float64)
            np.testing.assert_array_equal(a, b, err_msg=f"rank {r}, output {'abcd'[k]}")


def test_an_empty_slice_is_the_identity():
    """N=2 over 3 ranks: rank 2's slice is empty, its partial results -inf/+inf."""
    from coconetc.ir.reference import max_partial, min_partial
    assert max_partial(np.zeros(0, np.float32)) == -np.inf and min_partial(np.zeros(0)) == np.inf
    x = np.array([-5.0, -7.0], np.float32)
    for got in _interp("sliced(0)", x, x.astype(np.float64), 3):
        assert float(got[0]) == -5.0 and float(got[1]) == -7.0


# --- schedules and plan --------------------------------------------------------------------------
def test_reorder_adds_the_cross_rank_combine_and_fuse_accumulates_per_chunk():
    mod = load_source(MM)
    plan = mod.plans[("mm", "plain")]
    reduces = {u.dst: (u.op, u.cross_rank) for u in plan.units if isinstance(u, Reduce)}
    assert reduces == {"hi": ("max", True), "lo": ("min", True), "n": ("norm", True)}
    assert "reduce hi = max(rs) + max across ranks" in show(plan)
    fplan = mod.plans[("mm", "fused")]
    f = next(u for u in fplan.units if isinstance(u, Fused))
    assert set(f.partials) == {"hi", "lo", "n"}
    text = show(fplan)
    assert "hi max= partial max(rs); lo min= partial min(t0_lo); n += partial norm(rs)" in text
    assert "one allreduce(max) of the partial maxima (minima negated) of hi, lo" in text


def test_interpreted_schedules_equal_the_program():
    for file, prog, sizes in ((None, "mm", {"N": 13}), (EX / "amax_scale.ccn", "amax_scale", {"N": 13})):
        mod = load_source(MM) if file is None else load_source(file.read_text(), str(file))
        rng = np.random.default_rng(3)
        for ranks in (1, 2, 3):
            base = None
            for sched, p in ((s, q) for (n, s), q in mod.variants().items() if n == prog):
                inputs = []
                full = {q.name: (float(rng.uniform(0.1, 1.0)) if q.scalar else
                                 [rng.standard_normal(sizes["N"]).astype(np.float32) for _ in range(ranks)]
                                 if str(q.type.layout) == "local" else
                                 rng.standard_normal(sizes["N"]).astype(np.float32))
                        for q in mod.program(prog).params}
                if base is None:
                    base = full
                full = base
                for r in range(ranks):
                    d = {}
                    for q in p.params:
                        v = full[q.name]
                        d[q.name] = (v[r] if isinstance(v, list) else
                                     take_slice(v, 0, sizes["N"], ranks, r) if q.type.layout.sliced else v)
                    inputs.append(d)
                res = run(p, inputs)
                outs = {k: np.asarray(v) for k, v in res[0].outputs.items()}
                if sched == "default":
                    want = outs
                else:
                    for k in want:
                        np.testing.assert_allclose(outs[k], want[k], rtol=1e-5, err_msg=f"{prog} {sched} {k}")


# --- compiled ---------------------------------------------------------------------------------------
def _cli(args: list[str], env: dict | None = None, timeout: int = 600) -> str:
    res = subprocess.run([sys.executable, "-c", "from coconetc.cli import main; main()", *args],
                         capture_output=True, text=True, timeout=timeout, cwd=REPO,
                         env={**os.environ, **(env or {})})
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


@pytest.fixture(scope="module")
def mm_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("maxred") / "mm.ccn"
    path.write_text(MM)
    return path


@pytest.mark.parametrize("algo", ["shm", pytest.param("p2p", marks=pytest.mark.slow)])
def test_compiled_schedules_equal_the_interpreter(mm_file, algo):
    """Several chunks (of 256 elements), N that 2 and 3 do not divide."""
    env = {"COCONET_CHUNK": "256", **({"COCONET_FUSED": "p2p"} if algo == "p2p" else {})}
    cases = ((mm_file, "mm", ("default", "plain", "fused")),
             (EX / "amax_scale.ccn", "amax_scale", ("default", "rs_a_ag", "zero")))
    for ranks in (2, 3):  # both files in one launch (`coconetc run FILE -s all`'s jobs)
        out = run_jobs(ranks, [[str(file), "--program", prog, "--size=N=2003", *(f"--schedule={s}" for s in scheds)]
                               for file, prog, scheds in cases], env)
        for _, prog, scheds in cases:
            for s in scheds:
                assert re.search(rf"^{prog} \[{s}\]: {ranks} ranks: .* matches the interpreter on every rank", out,
                                 re.M), out


SCATTERED = """program sc(g: f32[N] local scattered, w: f32[N] replicated scattered, lr: f32) {
    g1 = allreduce(sum, g)
    a = max(w)
    b = min(g1 * w)
    w1 = update(w, w - lr * (a - b) * g1)
    return a, b
}

schedule zero for sc {
    rs, ag = split(g1)
    agw = reorder(ag, b, w1)
}
"""


def test_compiled_scattered_parameters(tmp_path):
    """max of a scattered parameter (its segments), min of a sliced value read from them."""
    path = tmp_path / "sc.ccn"
    path.write_text(SCATTERED)
    for ranks in (1, 3):
        out = _cli(["run", str(path), "-s", "all", "--ranks", str(ranks), "--size", "N=1001"])
        assert out.count("matches the interpreter on every rank") == 2, out


@pytest.mark.parametrize("ranks,n", [(2, 1001), (3, 2)])
def test_compiled_nan_and_inf_against_numpy(mm_file, ranks, n):
    """NaN propagates through the cross-rank combine (plain and fused), inf and -inf are values;
    N=2 on 3 ranks leaves one rank an empty slice (its partial result the identity)."""
    rc, out, _ = rank_pool.run(ranks, [str(Path(__file__).with_name("max_reduction_worker.py")), str(mm_file), str(n)],
                               timeout=400)
    assert rc == 0 and out.count("OK ") == 12, out


@pytest.mark.slow  # its CPU twin, test_compiled_schedules_equal_the_interpreter[shm], is quick
@pytest.mark.skipif(probes.emulation_missing() is not None, reason=probes.emulation_missing() or "")
def test_cuda_emulation_equals_the_interpreter_and_numpy(mm_file):
    """Several blocks of the two-pass kernel (N=1001), then NaN/inf through ncclMax on 3 ranks,
    one of them with an empty slice."""
    out = _cli(["run", str(mm_file), "-s", "all", "--ranks", "2", "--size", "N=1001", "--backend", "cuda", "--emulate"])
    for s in ("default", "plain", "fused"):
        assert re.search(rf"mm \[{s}\] \(CUDA, host emulation\): 2 ranks: .* matches the interpreter", out), out
    rc, out, _ = rank_pool.run(3, [str(Path(__file__).with_name("max_reduction_worker.py")), str(mm_file), "2",
                                   "emulate"], timeout=600)
    assert rc == 0 and out.count("OK ") == 12, out


# --- the derivative ---------------------------------------------------------------------------------
GRAD = """program p(x: f64[N, H] LAYOUT, w: f64[N, H] replicated) {
    a = max(x * w)
    b = min(x)
    out = a * b + max(x - w) * 3.0
    return out
}"""


@pytest.mark.parametrize("layout,ranks", [("local", 2), ("replicated", 2), ("sliced(0)", 2), ("sliced(0)", 3),
                                          ("sliced(1)", 3)])
def test_derivative_against_finite_differences(layout, ranks):
    from test_autodiff import check
    check(GRAD.replace("LAYOUT", layout), {"N": 4, "H": 3}, ranks)


TIES = """program ties(x: f64[N, H] sliced(0), u: f64[N, H] local) {
    a = max(x * 2.0)
    b = min(x)
    k = allreduce(sum, max(u) + min(u * u))
    return a, b, k
}"""


def _ties_ref(v: dict, R: int, G: int) -> dict:
    from test_autodiff_torch import _groups
    x = v["x"]
    per_rank = [u.amax() + (u * u).amin() for u in v["u"]]
    return {"a": (x * 2.0).amax(), "b": x.amin(), "k": [sum(m) for m in _groups(per_rank, R, G)]}


def _make_ties(vals: dict) -> None:
    """The maximum and the minimum of x each twice (in the first and the last row: two ranks'
    slices), u's maximum twice on every rank."""
    x = vals["x"]
    top, bottom = x.max() + 1.0, x.min() - 1.0
    x[0, 0] = x[-1, -1] = top
    x[0, 1] = x[-1, 0] = bottom
    for u in vals["u"]:
        u[0, 0] = u[1, 1] = np.abs(u).max() + 1.0


@pytest.mark.parametrize("ranks,groups", [(1, 1), (2, 1), (3, 1), (4, 2)])
def test_ties_split_evenly_as_torch_amax(ranks, groups):
    pytest.importorskip("torch")
    from test_autodiff_torch import Case, compare
    compare(Case(TIES, {"N": 4, "H": 3}, _ties_ref, prepare=_make_ties, configs=((ranks, groups),)), ranks, groups)
