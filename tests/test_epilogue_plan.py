"""GEMM epilogues in the plan (issue 40 point 1, plan/epilogue.py): which matmuls carry which
epilogue, and which do not and why."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from coconetc.plan import plan_program
from coconetc.plan.epilogue import bgrad_of, epilogue_of
from coconetc.plan.show import show
from coconetc.plan.units import Library
from coconetc.sourcefile import load_source

REPO = Path(__file__).resolve().parents[1]


def _plan(src: str, prog: str = "p", sched: str = "default"):
    mod = load_source(src, "p.ccn")
    ir = mod.programs[prog] if sched == "default" else mod.schedule(prog, sched).ir
    return plan_program(ir, sched)


def _epilogues(plan) -> dict[str, str]:
    return {u.dst: str(u.epilogue or "") for u in plan.units if isinstance(u, Library) and u.op.startswith("matmul")}


def _why(plan, dst: str) -> str:
    units = plan.units
    i = next(i for i, u in enumerate(units) if isinstance(u, Library) and u.dst == dst)
    epi, why = epilogue_of(units, i, {b.name: b for b in plan.buffers})
    assert epi is None
    return why


def test_tp_mlp_first_matmul_carries_gelu_bias_and_the_second_none():
    mod = load_source((REPO / "examples" / "tp_mlp.ccn").read_text(), "examples/tp_mlp.ccn")
    plan = plan_program(mod.programs["tp_mlp"], "default")
    assert _epilogues(plan) == {"a": "gelu_bias(b1) -> h", "p": ""}
    # p's consumer is the allreduce, not a loop
    assert _why(plan, "p") == "the unit after 'p' is not a pointwise loop"
    assert "epilogue gelu_bias(b1) -> h" in show(plan)


HEAD = "program p(x: f32[M, K] replicated, w: f32[K, N] replicated, b: f32[N] replicated, " \
       "r: f32[M, N] replicated, c: f32[M] replicated, k: f32) {\n    a = matmul(x, w)\n"


def test_each_kind_of_epilogue():
    for body, want in (("y = a + b", "bias(b) -> y"), ("y = b + a", "bias(b) -> y"),
                       ("y = gelu(a + b)", "gelu_bias(b) -> y"), ("y = a + r", "residual(r) -> y"),
                       ("y = a * k", "scale(k) -> y"), ("y = 2.0 * a", "scale(2.0) -> y")):
        plan = _plan(HEAD + f"    {body}\n    return y\n}}\n")
        assert _epilogues(plan) == {"a": want}, body


def test_no_epilogue_and_why():
    none_of = "the loop computes y from 'a' as none of bias, gelu_bias, residual, scale"
    cases = (
        ("y = a - b\n    return y", none_of),
        ("y = gelu(a)\n    return y", none_of),
        ("y = a * a\n    return y", none_of),
        ("y = a + b\n    z = a * k\n    return y, z", "the loop after 'a' computes 2 values"),
        ("y = a + b\n    z = matmul(a, w2)\n    return y, z", "'a' is read elsewhere"),
    )
    for body, why in cases:
        src = HEAD.replace("k: f32)", "w2: f32[N, K] replicated, k: f32)") + f"    {body}\n}}\n"
        plan = _plan(src)
        assert _epilogues(plan)["a"] == "", body
        assert _why(plan, "a") == why, body


def test_an_output_product_is_fused_on_the_cpu_only():
    """A matmul whose result is handed back too (a saving forward's saved product: gpt_block_fwd's
    hm): the CPU's blocked pass writes the product whole and the loop's value, so it fuses the
    epilogue there; cuBLASLt writes the loop's value only, so CUDA runs the loop after the GEMM."""
    plan = _plan(HEAD + "    y = a + b\n    return y, a\n}\n")
    u = _matmul(plan)
    assert (str(u.epilogue), u.fused) == ("bias(b) -> y", ("cpu",))
    assert "epilogue bias(b) -> y (cpu: fused in the GEMM; cuda: the loop runs after the GEMM)" in show(plan)
    from coconetc.sourcefile import with_grads
    mod = with_grads(load_source((REPO / "examples" / "gpt_block.ccn").read_text(), "gpt_block.ccn"), ["gpt_block"])
    u = _matmul(mod.plans[("gpt_block_fwd", "overlapped")], "hm")
    assert (str(u.epilogue), u.fused) == ("gelu_bias(b_fc) -> h", ("cpu",))


def test_a_bias_held_unlike_the_columns_is_no_epilogue():
    src = ("program p(x: f32[M, K] replicated, w: f32[K, N] sliced(1), b: f32[N] replicated) {\n"
           "    a = matmul(x, w)\n    y = a + b\n    return y\n}\n")
    plan = _plan(src)
    assert _epilogues(plan) == {"a": ""}


def _matmul(plan, dst: str = "a") -> Library:
    return next(u for u in plan.units if isinstance(u, Library) and u.dst == dst)


def test_where_each_epilogue_is_fused_is_the_plans():
    """Library.fused: the CPU fuses every epilogue of a matmul of a 2-d right operand; CUDA (one
    cublasLtMatmul) bias, residual and scale by a literal or a scalar parameter in f32/f16/bf16,
    not gelu_bias (cuBLASLt's GELU is the tanh approximation, the language's the exact one), not
    f64; `show` prints the decision."""
    both = ("cpu", "cuda")
    cases = (("y = a + b", both), ("y = gelu(a + b)", ("cpu",)), ("y = a + r", both), ("y = a * k", both),
             ("y = 2.0 * a", both))
    for dtype in ("f32", "bf16", "f64"):
        for body, want in cases:
            plan = _plan(HEAD.replace("f32", dtype) + f"    {body}\n    return y\n}}\n")
            u = _matmul(plan)
            assert u.fused == (want if dtype != "f64" else ("cpu",)), (dtype, body)
            cuda = "fused in the GEMM" if "cuda" in u.fused else "the loop runs after the GEMM"
            assert f"epilogue {u.epilogue} (cpu: fused in the GEMM; cuda: {cuda})" in show(plan), (dtype, body)


def test_a_batched_matmul_carries_its_epilogue_fused_nowhere():
    src = ("program p(x: f32[B, M, K] replicated, w: f32[B, K, N] replicated, b: f32[N] replicated) {\n"
           "    a = matmul(x, w)\n    y = a + b\n    return y\n}\n")
    u = _matmul(_plan(src))
    assert (str(u.epilogue), u.fused) == ("bias(b) -> y", ())
    assert "(cpu: the loop runs after the GEMM; cuda: the loop runs after the GEMM)" in show(_plan(src))


def test_the_bias_gradient_is_the_weight_gradients_epilogue_on_cuda():
    """In tp_mlp's derived program each sum_lead (a bias gradient) is the bgrad epilogue of the
    later matmul_tn over the same gradient (the weight gradient), fused on CUDA only; a sum that
    a unit between them reads is not."""
    from coconetc.sourcefile import with_grads
    mod = with_grads(load_source((REPO / "examples" / "tp_mlp.ccn").read_text(), "examples/tp_mlp.ccn"), ["tp_mlp"])
    plan = plan_program(mod.programs["tp_mlp_grad"], "default")
    tn = {u.dst: (str(u.epilogue), u.fused) for u in plan.units if isinstance(u, Library) and u.op == "matmul_tn"}
    assert tn == {"d_w2": ("bgrad(d_y) -> d_b2", ("cuda",)), "d_w1": ("bgrad(g_h_add) -> d_b1", ("cuda",))}
    assert "epilogue bgrad(d_y) -> d_b2 (cpu: the sum_lead runs on its own; cuda: fused in the GEMM)" in show(plan)
    units = [replace(u, epilogue=None, fused=()) if isinstance(u, Library) else u for u in plan.units]  # as planned
    buffers = {b.name: b for b in plan.buffers}
    i = next(k for k, u in enumerate(units) if isinstance(u, Library) and u.dst == "d_b1")
    j = bgrad_of(units, i, buffers)
    assert isinstance(units[j], Library) and units[j].dst == "d_w1", units[j]
    units.insert(i + 1, Library("z", "mean_last", ("d_b1",)))  # reads the sum before the matmul_tn
    assert bgrad_of(units, i, buffers) == -1


BLOCKED = """program q(x: f32[M, K] replicated, w: f32[K, N] sliced(1), b: f32[N] sliced(0),
          w2: f32[N, K] sliced(0), r: f32[M, K] replicated) {
    a = matmul(x, w)
    h = gelu(a + b)
    p = matmul(h, w2)
    y = p + r
    return y
}
"""


def test_cpu_epilogue_of_an_output_product_matches_the_interpreter(tmp_path):
    """The blocked pass when the product is handed back too (both outputs compared): M = 2500
    rows of N = 2100 columns, three blocks."""
    src = BLOCKED.replace("    p = matmul(h, w2)\n    y = p + r\n    return y", "    return h, a")
    plan = _plan(src, "q")
    assert (str(_matmul(plan).epilogue), _matmul(plan).fused) == ("gelu_bias(b) -> h", ("cpu",))
    _run_blocks(tmp_path, src)


def _run_blocks(tmp_path, src: str) -> None:
    """SRC's program q compiled for the CPU and run on 1 rank at M = 2500, K = 5, N = 2100 (three
    blocks of rows, the last one partial) against the interpreter (coconetc run)."""
    import subprocess
    import sys
    f = tmp_path / "q.ccn"
    f.write_text(src)
    out = subprocess.run([sys.executable, "-c", "from coconetc.cli import main; main()", "run", str(f), "--ranks", "1",
                          "--size", "M=2500", "--size", "K=5", "--size", "N=2100"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "matches the interpreter on every rank" in out.stdout, out.stdout + out.stderr


@pytest.mark.slow  # the CPU epilogue's quick check is the output product's
def test_cpu_epilogue_over_blocks_of_rows_matches_the_interpreter(tmp_path):
    """The CPU renders a's gelu_bias as the GEMM over blocks of rows with the epilogue after
    each block (p, local partial sums, and r, replicated, are of different types: no residual
    epilogue, and the loop runs on its own): N = 2100 columns of f32 make
    1024-row blocks (the least: 8 MiB would be 998 rows), M = 2500 rows three blocks, the last
    one partial; compiled against the interpreter (coconetc run, 1 rank)."""
    plan = _plan(BLOCKED, "q")
    assert _epilogues(plan) == {"a": "gelu_bias(b) -> h", "p": ""}
    _run_blocks(tmp_path, BLOCKED)


ACC = ("program q(x: f32[M, K] replicated, w: f32[K, N] replicated, a: f32[M, N] replicated) {\n"
       "    d = matmul(x, w)\n    a1 = update(a, a + d)\n}\n")


def test_a_product_added_into_its_parameter_in_place_is_one_gemm_with_beta_1(tmp_path):
    """`update(a, a + matmul(x, w))` (a sum accumulated over calls, a gradient's): the residual
    epilogue's loop writes a in place, so the CPU runs one GEMM with beta = 1 into a (gemm.h
    matmul_acc), the product never written; compiled against the interpreter at three blocks'
    worth of rows (coconetc run, 1 rank)."""
    from coconetc.plan.epilogue import accumulates, fused_loop
    plan = _plan(ACC, "q")
    m = _matmul(plan, "d")
    assert (str(m.epilogue), m.fused) == ("residual(a) -> a1", ("cpu", "cuda"))
    buffers = {b.name: b for b in plan.buffers}
    loop = fused_loop(plan.units, m)
    assert loop is not None and accumulates(m, loop, buffers)
    # not where the sum is a new value (returned, not an update of a)
    other = _plan(ACC.replace("a1 = update(a, a + d)", "a1 = a + d\n    return a1"), "q")
    om = _matmul(other, "d")
    ol = fused_loop(other.units, om)
    assert ol is not None and not accumulates(om, ol, {b.name: b for b in other.buffers})
    _run_blocks(tmp_path, ACC)


LN = ("program p(x: f32[M, H] replicated, gamma: f32[H] replicated, beta: f32[H] replicated) {\n"
      "    y = x + layernorm(x, gamma, beta, 1e-5)\n    return y\n}\n")


def test_layernorm_dx_carries_the_residual_added_after_it():
    """A pre-layernorm residual's backward, d_x = d_y + layernorm_dx(x, gamma, d_y): the row-wise
    call writes d_x, d_y added to each row (grad.h / cuda/grad.cuh layernorm_dx's `add`), on both
    targets; any other loop after it (here a product) runs on its own. Compiled against the
    interpreter: tests/test_grad_backends.py (layernorm.ccn's attn_out, CPU and CUDA emulated)
    and tests/test_gpt_block.py."""
    from coconetc.ir.nodes import Op
    from coconetc.plan.units import Item, Loop
    from coconetc.sourcefile import with_grads
    plan = with_grads(load_source(LN, "p.ccn"), ["p"]).plans[("p_grad", "default")]
    u = _matmul(plan, "t0_d_x")
    assert (u.op, str(u.epilogue), u.fused) == ("layernorm_dx", "residual(d_y) -> d_x", ("cpu", "cuda"))
    assert "epilogue residual(d_y) -> d_x (cpu: fused in the call; cuda: fused in the call)" in show(plan)
    units = [replace(v, epilogue=None, fused=()) if isinstance(v, Library) else v for v in plan.units]
    i = units.index(next(v for v in units if isinstance(v, Library) and v.dst == "t0_d_x"))
    loop = units[i + 1]
    assert isinstance(loop, Loop) and isinstance(loop.items[0].expr, Op)
    buffers = {b.name: b for b in plan.buffers}
    epi, why = epilogue_of(units, i, buffers)
    assert (str(epi), why) == ("residual(d_y) -> d_x", "")
    units[i + 1] = replace(loop, items=(Item("d_x", replace(loop.items[0].expr, op="mul")),))
    assert epilogue_of(units, i, buffers) == (None, "the loop computes d_x from 't0_d_x' as no residual")


def test_layernorm_dx_carries_its_layernorms_weight_and_bias_gradients():
    """plan/lngrads.py: the layernorm_dx call computes the later layernorm_dgamma of the same x and
    g and the sum_lead of g (on the CPU, one pass: grad.h layernorm_dx_grads, which
    runtime_cpp/tests/test_gemm.cpp checks bit for bit against the three calls); not when a unit
    between writes g. Compiled against the interpreter: tests/test_grad_backends.py (layernorm.ccn's
    attn_out, whose plan carries them too) and tests/test_gpt_block.py."""
    from coconetc.plan.lngrads import carried, grads_of
    from coconetc.plan.units import Item, LayernormGrads, Loop
    from coconetc.sourcefile import with_grads
    plan = with_grads(load_source(LN, "p.ccn"), ["p"]).plans[("p_grad", "default")]
    assert _matmul(plan, "t0_d_x").grads == LayernormGrads("d_gamma", "d_beta", ("cpu",))
    assert carried(plan.units, "cpu") == {"d_gamma": "t0_d_x", "d_beta": "t0_d_x"} and not carried(plan.units, "cuda")
    assert "also dgamma d_gamma and dbeta d_beta (cpu: in this call; cuda: their calls on their own)" in show(plan)
    units = [replace(v, grads=None) if isinstance(v, Library) else v for v in plan.units]
    i = units.index(next(v for v in units if isinstance(v, Library) and v.dst == "t0_d_x"))
    buffers = {b.name: b for b in plan.buffers}
    loop = units[i + 1]
    assert isinstance(loop, Loop)
    units[i + 1] = replace(loop, items=(*loop.items, Item("d_y", loop.items[0].expr)))  # g written in between
    assert grads_of(units, i, buffers) is None
    mod = load_source((REPO / "examples" / "layernorm.ccn").read_text(), "examples/layernorm.ccn")
    grad = with_grads(mod, ["attn_out"]).plans[("attn_out_grad", "default")]
    assert any(isinstance(u, Library) and u.grads and u.grads.dgamma and u.grads.dbeta for u in grad.units)
