"""Causal attention as one call (plan/attention.py): which chains of pieces the plan runs as one
CPU call (forward and backward), what the call writes, and the chains it leaves as they are.
The compiled results against the interpreter: tests/test_block_ops.py (the attention programs
and their derived programs on 1 and 2 ranks), tests/test_gpt_block.py and the CPU matrix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from coconetc.launch import mpiexec
from coconetc.plan import plan_program
from coconetc.plan.show import show
from coconetc.plan.units import Library, Loop
from coconetc.sourcefile import load_file, load_source, with_grads
from coconetc.toolchain import probes

REPO = Path(__file__).resolve().parents[1]
WORKER = str(Path(__file__).with_name("grad_backends_worker.py"))

HEAD = ("program p(q: f32[B, H, M, D] sliced(1), k: f32[B, H, N, D] sliced(1), v: f32[B, H, N, E] sliced(1), "
        "c: f32, pdrop: f32, seed: i64) {\n")
CORE = """    s = matmul(q, transpose(k, 2, 3)) * c
    a = dropout(softmax(where(causal(s, diagonal=1), s, -inf)), pdrop, seed)
    o = matmul(a, v)
"""


def _plans(src: str):
    mod = with_grads(load_source(src, "p.ccn"), ["p"])
    return {n: mod.plans[(n, "default")] for n in ("p", "p_grad", "p_fwd", "p_bwd")}


def _names(plan, a) -> list[str]:
    out = []
    for i in a.members:
        u = plan.units[i]
        out += [it.name for it in u.items] if isinstance(u, Loop) else [u.dst] if isinstance(u, Library) else []
    return out


def test_the_forward_and_the_backward_are_one_call_each():
    plans = _plans(HEAD + CORE + "    return o\n}\n")
    (f,) = plans["p"].attention
    assert (f.kind, f.q, f.k, f.v, f.o, f.diagonal, f.scale, f.drop_p, f.seed) == \
        ("forward", "q", "k", "v", "o", 1, "c", "pdrop", "seed")
    assert (f.s, f.w, f.p, f.a) == ("", "", "", "")  # nothing else reads them: not written
    assert f.fused == ("cpu",) and f.members[-1] == max(f.members)
    # the saving forward writes what it saves whole; the backward computes P again from S
    (ff,) = plans["p_fwd"].attention
    assert (ff.s, ff.a) == ("s", "a")
    (b,) = plans["p_bwd"].attention
    assert (b.kind, b.q, b.k, b.v, b.s_in, b.p_in, b.a_in, b.diagonal, b.scale, b.drop_p) == \
        ("backward", "q", "k", "v", "s", "", "a", 1, "c", "pdrop")
    assert (b.dq, b.dk, b.dv) == ("d_q", "d_k", "d_v")
    assert b.a_whole  # the saved a is an input: its masked entries are read as the pieces read them
    assert {"a_where", "a_softmax", "g_a", "g_rows", "g_s_matmul"} <= set(_names(plans["p_bwd"], b))
    # the whole derived program (which does not compute o): the backward reads the softmax its
    # forward values computed, as they are, and draws A = dropout(P) again (a_in ""): a is not written
    (bg,) = plans["p_grad"].attention
    assert (bg.kind, bg.p_in, bg.s_in, bg.a_in, bg.a_whole) == ("backward", "a_softmax", "", "", False)
    assert "a" in _names(plans["p_grad"], bg)
    text = show(plans["p_bwd"])
    assert "attention:\n  backward d_q, d_k, d_v = attention_grad(q, k, v, d_o; scores s, dropout result a (every entry)" in text
    assert "(cpu: one call at the last unit, the masked half of the scores skipped; cuda: the units one by one)" in text


def test_the_example_blocks_forward_and_backward():
    mod = with_grads(load_source((REPO / "examples" / "gpt_block.ccn").read_text(), "gpt_block.ccn"),
                     ["gpt_block", "gpt_block_sp"])
    for prog in ("gpt_block", "gpt_block_sp"):
        for sched in ("default", "fused", "overlapped"):
            (f,) = mod.plans[(prog, sched)].attention
            assert f.kind == "forward" and f.drop_p == "pdrop", (prog, sched)
        (b,) = mod.plans[(f"{prog}_bwd", "default")].attention
        assert b.kind == "backward", prog
        # a = dropout(p) of the block's own p: the forward saves p alone, the call draws a's
        # mask again (autodiff/saved.py, _dropout_of_own)
        saved = [q.name for q in mod.programs[f"{prog}_bwd"].params]
        assert "p" in saved and "a" not in saved and (b.p_in, b.a_in) == ("p", ""), (prog, saved)
        kinds = [a.kind for a in mod.plans[(f"{prog}_grad", "default")].attention]
        assert kinds == ["forward", "backward"], prog


def test_the_transposed_keys_only_the_calls_read_are_not_computed_on_the_cpu():
    """T = transpose(k, 2, 3) (the scores' right operand) is read by the forward's matmul and, in
    the derived program, by the backward's dq matmul (transpose(T)); both calls read k itself.
    Where only members of the calls read T, T joins the first chain that reads it: the derived
    program's forward, the backward program's (which computes T again for it) backward."""
    mod = with_grads(load_source((REPO / "examples" / "gpt_block.ccn").read_text(), "gpt_block.ccn"),
                     ["gpt_block"])
    grad = mod.plans[("gpt_block_grad", "overlapped")]
    f, b = grad.attention
    assert "s_transpose" in _names(grad, f) and "s_transpose" not in _names(grad, b)
    assert "t4_g_q" in _names(grad, b)  # transpose(T): the backward's own
    bwd = mod.plans[("gpt_block_bwd", "overlapped")]
    (b,) = bwd.attention
    assert "s_transpose" in _names(bwd, b) and b.members[-1] == max(b.members)
    assert "replaces s_transpose, a, t1_g_a, g_a," in show(bwd)  # (a: the call draws it again)
    assert "softmax p (every entry), the dropout result drawn again from it;" in show(bwd)
    # a transpose another unit reads as well stays a unit of its own
    src = HEAD + CORE.replace("transpose(k, 2, 3)", "kt") + "    y = kt * c\n    return o, y\n}\n"
    src = src.replace("    s = matmul", "    kt = transpose(k, 2, 3)\n    s = matmul")
    plan = _plans(src)["p"]
    (f,) = plan.attention
    assert "s" in _names(plan, f) and "kt" not in _names(plan, f)


def test_without_scale_dropout_or_the_same_lengths():
    src = HEAD + """    s = matmul(q, transpose(k, 2, 3))
    o = matmul(softmax(where(causal(s), s, -inf)), v)
    return o
}
"""
    plans = _plans(src)
    (f,) = plans["p"].attention
    assert (f.scale, f.drop_p, f.diagonal) == ("", "", 0)
    (b,) = plans["p_bwd"].attention
    assert (b.a_in, b.a_whole) == ("", False)  # a is P itself, which the call computes again


READS_S0 = """    s0 = matmul(q, transpose(k, 2, 3))
    s = s0 * c
    t = s0 * 2.0
    a = dropout(softmax(where(causal(s, diagonal=1), s, -inf)), pdrop, seed)
    o = matmul(a, v)
    return o, t
}
"""


def test_chains_left_as_they_are():
    cases = {
        "another reads the unscaled scores, which the call does not write": READS_S0,
        "masked with 0, not -inf": CORE.replace("-inf", "0.0") + "    return o\n}\n",
        "a condition that is not causal": CORE.replace("causal(s, diagonal=1)", "s > 0.0") + "    return o\n}\n",
    }
    for what, body in cases.items():
        plan = plan_program(load_source(HEAD + body, "p.ccn").programs["p"])
        assert plan.attention == (), what


def test_rows_sliced_across_the_ranks_or_f16_are_left_as_they_are():
    sliced_rows = HEAD.replace("q: f32[B, H, M, D] sliced(1)", "q: f32[B, H, M, D] sliced(2)") \
        .replace("sliced(1), v", "replicated, v").replace("v: f32[B, H, N, E] sliced(1)", "v: f32[B, H, N, E] replicated")
    plan = plan_program(load_source(sliced_rows + CORE + "    return o\n}\n", "p.ccn").programs["p"])
    assert plan.attention == ()
    half = (HEAD + CORE + "    return o\n}\n").replace("f32[", "f16[")
    plan = plan_program(load_source(half, "p.ccn").programs["p"])
    assert plan.attention == ()


# --- compiled for the CPU against the interpreter ------------------------------------------------
VARIANTS = HEAD + CORE + "    return o\n}\n" + """
program whole(q: f64[B, H, M, D] replicated, k: f64[B, H, N, D] replicated, v: f64[B, H, N, E] replicated) {
    s = matmul(q, transpose(k, 2, 3)) / 4.0
    pr = softmax(where(causal(s, diagonal=-1), s, -inf))
    o = matmul(pr, v)
    return o
}

program own(q: f32[B, H, M, D] sliced(1), k: f32[B, H, N, D] sliced(1), v: f32[B, H, N, E] sliced(1),
            c: f32, pdrop: f32, seed: i64) {
    s = matmul(q, transpose(k, 2, 3)) * c
    pr = softmax(where(causal(s, diagonal=1), s, -inf))
    a = dropout(pr, pdrop, seed)
    o = matmul(a, v)
    return o
}
"""


def _variants_text() -> str:
    """The programs above, their derived programs and those cut at the saved values (the
    saving forward and the backward that reads s and a)."""
    from dataclasses import replace

    from coconetc.autodiff import vjp
    from coconetc.autodiff.saved import split
    from coconetc.ir import printer
    mod = load_source(VARIANTS, "variants.ccn")
    texts = []
    for p in mod.programs.values():
        g = replace(vjp(p), name=f"{p.name}_grad")
        cut = split(p, g)
        texts += [printer.program(x) for x in (p, g, cut.forward, cut.backward)]
    return "\n".join(texts)


@pytest.mark.slow  # (test-quick compiles the attention of tests/test_block_ops.py, forward and derived)
@pytest.mark.skipif(probes.missing_cpu_extra(), reason="needs the 'cpu' extra")
def test_compiled_attention_matches_the_interpreter(tmp_path):
    """Scale by a scalar, dropout, diagonal 1, M != N and D != E on heads sliced over 2 ranks
    (uneven: 3 heads); f64 divided by a number, without dropout, at diagonal -1 (a first row all
    masked), its softmax a stage (saved by the forward in place of the scores); the softmax a
    stage under dropout (the forward saves it alone, the backward's call draws the dropout's
    result again from the random saved softmax, its masked entries included, as the pieces do);
    each with its derived, saving-forward and backward programs (the backward on random saved
    values: the call must read them as the pieces do)."""
    from coconetc.runtime.loader import compile_cpu
    f = tmp_path / "attention_cpu.ccn"
    f.write_text(_variants_text())
    mod = load_file(f)
    calls = {n: pl.attention for (n, _), pl in mod.plans.items()}
    assert all(calls[n] for n in ("p", "p_grad", "p_fwd", "p_bwd", "whole", "whole_grad", "whole_fwd", "whole_bwd"))
    assert {a.scale for a in calls["whole"] + calls["whole_bwd"]} == {"1/4.0"}  # a division by the scale
    # the softmax a stage: its saving forward keeps it, not s, and the backward reads it whole
    (wb,) = calls["whole_bwd"]
    assert (wb.s_in, wb.p_in, wb.a_in, wb.p_whole, wb.a_whole) == ("", "pr", "pr", True, True)
    (ob,) = calls["own_bwd"]
    assert (ob.s_in, ob.p_in, ob.a_in, ob.p_whole, ob.drop_p) == ("", "pr", "", True, "pdrop")
    compile_cpu(load_file(f), log=lambda msg: None)
    for ranks in (1, 2):
        cmd = mpiexec.command(ranks, [sys.executable, WORKER, "cpu", str(f), "B=2", "H=3", "M=5", "N=7", "D=3", "E=2"])
        res = subprocess.run(cmd, env=mpiexec.environment(ranks), capture_output=True, text=True, timeout=600)
        log = f"--- stdout\n{res.stdout}\n--- stderr\n{res.stderr[-4000:]}"
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith(("MATCH", "MISMATCH"))]
        assert res.returncode == 0 and len(lines) == 12 and all(ln.startswith("MATCH ") for ln in lines), log
