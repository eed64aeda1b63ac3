"""Held-out GPT-2 blocks (tests/programs/gpt_variants.ccn), written as a user of
docs/gpt_block.md and examples/gpt_block.ccn would write them (issue 39's held-out check):

- gpt_nobias / gpt_nobias_sp: nanoGPT's `bias=False` (no Linear bias; layernorms whose beta is
  `0.0 * ln_w`, or the literal `0.0` in gpt_nobias_sp);
- gpt_alt / gpt_alt_sp: with biases, written differently from the example (q scaled before the
  scores, heads split with `permute`, the scores named `att`, residuals `dropout(...) + x`);

all on B=2, S=7, H=24 with 6 heads of 4 (3 + 3 heads on 2 ranks, 2 + 2 + 2 on 3; the sequence of
7 in slices of 4 + 3 and 3 + 3 + 1; F = 40 cut 14 + 14 + 12).

- the interpreter's forward and derived-program gradients on 1, 2 and 3 ranks against a
  nanoGPT-style block written here in PyTorch (float64) and torch.autograd, and the derived
  programs' schedules giving the same gradients;
- every program and derived program under every schedule, compiled for the CPU, against the
  interpreter on 2 and 3 ranks (one MPI job per rank count, one module build; slow: the module
  of four programs and their derived programs under 23 schedules takes minutes to build here);
- a layernorm's beta computed from its gamma inside an overlapped fused collective (what the
  nobias blocks found).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
from rank_checks import joined, rank_parts, shared_file

import coconetc.autodiff  # noqa: F401  (registers the derived programs' operations)
from coconetc.autodiff import vjp
from coconetc.interp.interpreter import run
from coconetc.sourcefile import load_source
import rank_pool

torch = pytest.importorskip("torch")

FILE = Path(__file__).resolve().parent / "programs" / "gpt_variants.ccn"
B, S, H, NH, HD, F = 2, 7, 24, 6, 4, 40
SLICED = {"wq": 1, "wk": 1, "wv": 1, "w_fc": 1, "bq": 0, "bv": 0, "b_fc": 0, "wo": 0, "w_proj": 0}
SLICED_SP = {**SLICED, "x": 1, "y": 1, "d_y": 1}
LAYOUTS = {"gpt_nobias": SLICED, "gpt_nobias_sp": SLICED_SP, "gpt_alt": SLICED, "gpt_alt_sp": SLICED_SP}
PROGRAMS = list(LAYOUTS)
BIASES = ("ln1_b", "bq", "bv", "bo", "ln2_b", "b_fc", "b_proj")
# the schedules compiled (test_compiled_matches_interpreter): each program's and derived
# program's own, which hold the planner's paths these blocks found bugs in (a layernorm's beta
# inside a fused collective, its gather feeding a matmul), and `default`. The forward `fused`
# schedules are left out of the build (8 of its 47 units with their saving forwards): each is
# its `overlapped` without the overlap; the interpreter checks every schedule of the file against
# torch (test_gradients_match_autograd), and the example's `fused` are compiled by
# test_gpt_block.py and test_cpu_backend.py.
JOBS = {"gpt_nobias": ["default", "overlapped"], "gpt_nobias_grad": ["default", "overlapped"],
        "gpt_nobias_sp": ["default", "overlapped", "overlapped_both"],
        "gpt_nobias_sp_grad": ["default", "overlapped", "backward"],
        "gpt_alt": ["default", "overlapped"], "gpt_alt_grad": ["default", "overlapped"],
        "gpt_alt_sp": ["default", "overlapped", "overlapped_both"],
        "gpt_alt_sp_grad": ["default", "overlapped", "overlapped_both", "backward"]}


def _f64() -> str:
    return FILE.read_text().replace("f32", "f64")


def _weights(seed: int, bias: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = {"ln1_w": 1 + 0.3 * rng.standard_normal(H), "ln2_w": 1 + 0.3 * rng.standard_normal(H)}
    for k, shape in (("wq", (H, NH, HD)), ("wk", (H, NH, HD)), ("wv", (H, NH, HD)), ("wo", (NH, HD, H)),
                     ("w_fc", (H, F)), ("w_proj", (F, H))):
        w[k] = rng.standard_normal(shape) / math.sqrt(shape[0])
    if bias:
        for k, shape in (("ln1_b", (H,)), ("bq", (NH, HD)), ("bv", (NH, HD)), ("bo", (H,)), ("ln2_b", (H,)),
                         ("b_fc", (F,)), ("b_proj", (H,))):
            w[k] = 0.3 * rng.standard_normal(shape)
    return w


def _nanogpt(x, w: dict, bias: bool):
    """nanoGPT's Block (model.py) on the .ccn parameters in torch: c_attn one [H, 3 NH HD]
    weight (nanoGPT's c_attn.weight transposed), its key bias 0; layernorms without a bias when
    bias is False (nanoGPT's LayerNorm(bias=False))."""
    fn = torch.nn.functional
    b, t, _ = x.shape
    c_attn = torch.cat([w[k].reshape(H, NH * HD) for k in ("wq", "wk", "wv")], dim=1)
    c_attn_b = (torch.cat([w["bq"].reshape(-1), torch.zeros(NH * HD, dtype=x.dtype), w["bv"].reshape(-1)])
                if bias else None)
    qkv = fn.linear(fn.layer_norm(x, (H,), w["ln1_w"], w.get("ln1_b"), 1e-5), c_attn.T, c_attn_b)
    q, k, v = (z.view(b, t, NH, HD).transpose(1, 2) for z in qkv.split(NH * HD, dim=2))
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(HD))
    att = att.masked_fill(torch.tril(torch.ones(t, t, dtype=torch.bool)).logical_not(), float("-inf"))
    y = (torch.softmax(att, dim=-1) @ v).transpose(1, 2).contiguous().view(b, t, NH * HD)
    x = x + fn.linear(y, w["wo"].reshape(NH * HD, H).T, w.get("bo"))
    h = fn.gelu(fn.linear(fn.layer_norm(x, (H,), w["ln2_w"], w.get("ln2_b"), 1e-5), w["w_fc"].T, w.get("b_fc")))
    return x + fn.linear(h, w["w_proj"].T, w.get("b_proj"))




def _inputs(w: dict, x: np.ndarray, pdrop: float = 0.0) -> dict:
    return {"x": x, **w, "scale": 1.0 / math.sqrt(HD), "pdrop": pdrop, "seed": 99}


@pytest.mark.parametrize("program", PROGRAMS)
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_forward_matches_nanogpt(program, ranks):
    bias = "nobias" not in program
    w = _weights(0, bias)
    x = np.random.default_rng(1).standard_normal((B, S, H))
    want = _nanogpt(torch.tensor(x), {k: torch.tensor(v) for k, v in w.items()}, bias).numpy()
    mod, sliced = load_source(_f64()), LAYOUTS[program]
    res = run(mod.program(program), rank_parts(_inputs(w, x), ranks, sliced))
    np.testing.assert_allclose(joined(res, "y", sliced.get("y")), want, rtol=1e-12, atol=1e-12)
    one = run(mod.program(program), rank_parts(_inputs(w, x, 0.3), 1, sliced))[0].outputs["y"]
    for name, sc in mod.schedules[program].items():  # every schedule, with dropout on: the program's
        got = joined(run(sc.ir, rank_parts(_inputs(w, x, 0.3), ranks, sliced)), "y", sliced.get("y"))
        np.testing.assert_allclose(got, one, rtol=1e-12, atol=1e-12, err_msg=name)
        assert np.abs(got - want).max() > 0.1  # (dropout drops)


@pytest.mark.parametrize("program", PROGRAMS)
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_gradients_match_autograd(program, ranks):
    """Every parameter's gradient in its layout (the replicated ones the same on every rank, for
    the _sp programs summed over the ranks' rows), and the derived programs' schedules' the same."""
    bias = "nobias" not in program
    w = _weights(2, bias)
    rng = np.random.default_rng(3)
    x, dy = rng.standard_normal((B, S, H)), rng.standard_normal((B, S, H))
    tw = {k: torch.tensor(v, requires_grad=True) for k, v in w.items()}
    tx = torch.tensor(x, requires_grad=True)
    (_nanogpt(tx, tw, bias) * torch.tensor(dy)).sum().backward()
    mod, sliced = load_source(_f64()), LAYOUTS[program]
    g = vjp(mod.program(program))
    res = run(g, rank_parts({**_inputs(w, x), "d_y": dy}, ranks, sliced))
    got = {pub: joined(res, pub, sliced.get(pub[2:])) for pub, _ in g.outputs}
    assert set(got) == {"d_x", *(f"d_{k}" for k in w)}
    np.testing.assert_allclose(got["d_x"], tx.grad.numpy(), rtol=1e-9, atol=1e-12)
    for k in w:
        np.testing.assert_allclose(got[f"d_{k}"], tw[k].grad.numpy(), rtol=1e-9, atol=1e-12, err_msg=k)
    for name, sc in mod.schedules[f"{program}_grad"].items():
        sched = run(sc.ir, rank_parts({**_inputs(w, x), "d_y": dy}, ranks, sliced))
        for pub in got:
            np.testing.assert_allclose(joined(sched, pub, sliced.get(pub[2:])), got[pub], rtol=1e-12, atol=1e-14,
                                       err_msg=f"{name} {pub}")


# --- compiled, against the interpreter ----------------------------------------------------------


@pytest.fixture(scope="module")
def built(request):
    """The one module of the file with every program's derived program, holding JOBS' schedules
    only (the file's text without the others), built before the ranks start (so that they only
    load it). One path for every worker: a module is named and cached by its file."""
    import coconetc
    text = FILE.read_text()
    for head in re.findall(r"^schedule (\w+) for (?:grad\((\w+)\)|(\w+)) \{", text, flags=re.M):
        name, grad, fwd = head
        if name not in JOBS[f"{grad}_grad" if grad else fwd]:
            text = re.sub(rf"^schedule {name} for {re.escape(f'grad({grad})' if grad else fwd)} \{{.*?^\}}\n", "",
                          text, flags=re.M | re.S)
    f = shared_file(request, "gpt-variants", FILE.name, text)
    coconetc.load(f, log=lambda msg: None, grad=tuple(PROGRAMS))
    return f


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 3])
def test_compiled_matches_interpreter(built, ranks):
    """Every program and derived program under every schedule, compiled for the CPU (f32), against
    the interpreter on every rank, in one MPI job (tests/run_jobs_worker.py; random inputs, pdrop
    drawn in [0.05, 0.5])."""
    sizes = [f"--size={k}={v}" for k, v in dict(B=B, S=S, H=H, NH=NH, HD=HD, F=F).items()]
    argv, want = [str(Path(__file__).with_name("run_jobs_worker.py"))], []
    for program, schedules in JOBS.items():
        argv += [str(built), "--program", program, *(a for p in PROGRAMS for a in ("--grad-of", p)), "--reps", "1",
                 *sizes, *(f"--schedule={s}" for s in schedules), "--"]
        want += [f"{program} [{s}]" for s in schedules]
    rc, out, err = rank_pool.run(ranks, argv, timeout=900)
    log = f"--- stdout\n{out}\n--- stderr\n{err[-3000:]}"
    lines = [ln for ln in out.splitlines() if re.match(r"\S+ \[\w+\]: \d+ ranks:", ln)]
    assert rc == 0 and len(lines) == len(want), log
    for line, head in zip(lines, want):
        assert line.startswith(head) and line.endswith("matches the interpreter on every rank"), f"{line}\n{log}"


# --- a layernorm's beta computed from its gamma, inside a fused collective ----------------------
LN_BETA = """
program ln_beta(a: f64[B, R, K] sliced(2), m: f64[K, H] sliced(0), w: f64[H] replicated) {
    p = matmul(a, m)
    s = reducescatter(sum, p, dim=1)
    x1 = s + 1.0
    BETA
    return n
}

schedule overlapped for ln_beta {
    f = fuse(s, x1, n)
    overlap(p, f, chunks=2)
}
"""


@pytest.mark.parametrize("beta", ["b = 0.0 * w\n    n = layernorm(x1, w, b, 1e-5)",  # a stage between members
                                  "n = layernorm(x1, w, 0.0 * w, 1e-5)"])  # an expression in the call
def test_a_layernorm_beta_computed_from_gamma_is_computed_before_the_fused_collective(beta):
    """gpt_nobias's `0.0 * ln_w` beta: in the derived program a stage between the residual and
    the layernorm, which the overlapped fusion read before it was written (PlanInvalid); in the
    forward an expression of the call, which made the layernorm wait for every chunk (and an
    `overlap(n2, hm)` after it refused). Both are computed before the overlap, and the layernorm
    is the fusion's row-wise phase; the schedule computes what the program does."""
    from coconetc.plan.show import show as show_plan
    mod = load_source(LN_BETA.replace("BETA", beta))
    text = show_plan(mod.plans[("ln_beta", "overlapped")])
    units = text[text.index("units:"):]
    assert re.search(r"loop over f64\[H\] replicated: \w+ = 0\.0 \* w\n(.*\n)*.*overlap p = matmul", units), units
    assert re.search(r"per chunk \(rows\): n = layernorm\(x1, w, \w+, 1e-05\)", units), units
    rng = np.random.default_rng(4)
    inputs = {"a": rng.standard_normal((2, 4, 6)), "m": rng.standard_normal((6, 5)), "w": rng.standard_normal(5)}
    sliced = {"a": 2, "m": 0}
    want = np.concatenate([r.outputs["n"] for r in run(mod.program("ln_beta"), rank_parts(inputs, 2, sliced))], axis=1)
    got = np.concatenate([r.outputs["n"] for r in run(mod.schedule("ln_beta", "overlapped").ir,
                                                      rank_parts(inputs, 2, sliced))], axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_a_layernorm_without_a_bias_costs_no_beta_gradient():
    """`layernorm(x, w, 0.0, eps)` (nanoGPT's bias=False, torch's F.layer_norm with bias None) is
    `layernorm(x, w, 0.0 * w, eps)`, and the derived program adds nothing to w's gradient for the
    zeros: no beta gradient is computed, and under sequence parallelism none is all-reduced (the
    sequence-parallel block's derived program all-reduces its layernorm weights' gradients only).
    Its values and gradients match torch's layer_norm without a bias on 1 to 3 ranks."""
    src = ("program p(x: f64[T, H] sliced(0), w: f64[H] replicated) {\n"
           "    y = layernorm(x, w, 0.0, 1e-5)\n    return y\n}\n")
    mod = load_source(src)
    g = vjp(mod.program("p"))
    colls = sorted(s.name for s in g.stages if s.kind == "collective")
    assert colls == ["d_w"], colls
    rng = np.random.default_rng(5)
    x, w, dy = rng.standard_normal((7, 6)), rng.standard_normal(6), rng.standard_normal((7, 6))
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    ty = torch.nn.functional.layer_norm(tx, (6,), tw, None, 1e-5)
    (ty * torch.tensor(dy)).sum().backward()
    sliced = {"x": 0, "y": 0, "d_y": 0, "d_x": 0}
    for ranks in (1, 2, 3):
        fwd = run(mod.program("p"), rank_parts({"x": x, "w": w}, ranks, sliced))
        np.testing.assert_allclose(joined(fwd, "y", 0), ty.detach().numpy(), rtol=1e-10, atol=1e-12)
        res = run(g, rank_parts({"x": x, "w": w, "d_y": dy}, ranks, sliced))
        np.testing.assert_allclose(joined(res, "d_x", 0), tx.grad.numpy(), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(joined(res, "d_w", None), tw.grad.numpy(), rtol=1e-10, atol=1e-12)
    sp = vjp(load_source(_f64()).program("gpt_nobias_sp"))
    assert sorted(s.name for s in sp.stages if s.kind == "collective" and s.type.ndim == 1) == ["d_ln1_w", "d_ln2_w"]
