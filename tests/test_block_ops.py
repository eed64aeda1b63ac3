"""The operations of a transformer block (issue 39, point 1): softmax, the causal condition, the
literal inf, transpose, reshape and batched matmul.

- the interpreter against NumPy written here, independently (masked entries, fully masked
  rows, slices over 2, 3 and 4 ranks whose offsets the causal condition must count, heads kept
  sliced through reshapes, batched matmuls in every layout);
- parsing and printing round trips; errors at their line and column; sizes that disagree and
  heads that do not divide among the ranks raising on every rank (interpreter and compiled);
- the derivatives (derived programs run by the interpreter) against torch.autograd, and a
  head-parallel causal attention against scaled_dot_product_attention;
- the forward and derived programs compiled for the CPU on 1 and 2 ranks (f16 and bf16 too), as
  CUDA under the host emulation and by nvcc, against the interpreter
  (tests/grad_backends_worker.py runs each program of a file on random inputs); the attention
  as a coconetc.torch.function on 2 ranks against one process of PyTorch."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import coconetc.autodiff  # noqa: F401  (registers the derived programs' operations)
from coconetc.autodiff import vjp
from coconetc.errors import CompileError
from coconetc.interp.interpreter import run
from coconetc.ir import printer
from coconetc.ir.slices import slice_range
from coconetc.launch import mpiexec
from coconetc.sourcefile import load_file, load_source
from coconetc.toolchain import probes

from rank_checks import ranks_run

WORKER = str(Path(__file__).with_name("grad_backends_worker.py"))

# Programs compiled by both backends (with their derived programs): every operation once.
BLOCK = """
program attn_mask(s: f32[B, H, S, S] sliced(1), c: f32[B, 1, S, 1] replicated) {
    m = where(causal(s), s, -inf)
    p = softmax(where(c > 1.0, m, -inf))
    q = p * 2.0 + softmax(where(causal(s, diagonal=-1), s * 0.5, -inf))
    return q
}

program seq_softmax(x: f32[B, S, T] sliced(1), w: f32[T, T] replicated) {
    y = softmax(where(causal(x), matmul(x, w), -inf))
    return y
}

program heads(x: f32[B, S, D] sliced(2), c: f32[B, S, D] sliced(2)) {
    q = transpose(reshape(x, [B, S, 2, -1]), 1, 2)
    k = transpose(q * 2.0, 2, 3)
    z = transpose(transpose(k, 2, 3), 1, 2)
    y = reshape(z, [B, S, D]) + c * x
    m = reshape(transpose(reshape(c, [B, S, 2, -1]), 0, 1), [S, B, D])
    return y, m
}

program attention(x: f32[B, S, D] replicated, wq: f32[D, D] sliced(1), wk: f32[D, D] sliced(1),
                  wv: f32[D, D] sliced(1), wo: f32[D, D] sliced(0)) {
    q = transpose(reshape(matmul(x, wq), [B, S, 2, -1]), 1, 2)
    k = transpose(reshape(matmul(x, wk), [B, S, 2, -1]), 1, 2)
    v = transpose(reshape(matmul(x, wv), [B, S, 2, -1]), 1, 2)
    s = matmul(q, transpose(k, 2, 3)) * 0.05
    p = softmax(where(causal(s), s, -inf))
    o = reshape(transpose(matmul(p, v), 1, 2), [B, S, D])
    part = matmul(o, wo)
    y = allreduce(sum, part)
    return y
}

program batched(a: f32[M, K] replicated, b: f32[H, K, N] sliced(0), c: f32[H, M, K] sliced(2),
                d: f32[H, K, N] sliced(1), e: f32[H, M, K] sliced(1), f: f32[H, K, N] replicated) {
    y = matmul(a, b)
    zp = matmul(c, d)
    z = allreduce(sum, zp)
    w = matmul(e, f)
    return y, z, w
}
"""
SIZES = {"B": 2, "H": 3, "S": 5, "T": 5, "D": 6, "M": 3, "K": 4, "N": 5}


def _interp(src: str, name: str, inputs: dict[str, np.ndarray], ranks: int, sliced: dict[str, int]) -> list:
    """Run program `name` on `ranks` simulated ranks, each parameter in `sliced` cut along its
    dim (the rest given whole), and return rank by rank results."""
    return _run_ir(load_source(src).program(name), inputs, ranks, sliced)


def _run_ir(p, inputs: dict[str, np.ndarray], ranks: int, sliced: dict[str, int]) -> list:
    per_rank = []
    for r in range(ranks):
        mine = {}
        for k, v in inputs.items():
            if k in sliced:
                d = sliced[k]
                lo, hi = slice_range(v.shape[d], ranks, r)
                v = np.take(v, np.arange(lo, hi), axis=d)
            mine[k] = v.copy() if isinstance(v, np.ndarray) else v
        per_rank.append(mine)
    return run(p, per_rank)


def _joined(results: list, out: str, dim: int | None) -> np.ndarray:
    parts = [r.outputs[out] for r in results]
    return parts[0] if dim is None else np.concatenate(parts, axis=dim)


# --- softmax ---------------------------------------------------------------------------------
def _softmax_rows(x: np.ndarray) -> np.ndarray:
    """Row by row in float64 over the entries that are not -inf; a fully masked row is zeros."""
    out = np.zeros(x.shape, dtype=np.float64)
    flat, res = x.reshape(-1, x.shape[-1]).astype(np.float64), out.reshape(-1, x.shape[-1])
    for i, row in enumerate(flat):
        keep = row != -np.inf
        if keep.any():
            e = np.exp(row[keep] - row[keep].max())
            res[i, keep] = e / e.sum()
    return out


SOFTMAX = """program sm(x: f32[R, C] sliced(0)) {
    y = softmax(x)
    return y
}
"""


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_softmax_matches_numpy_with_masked_entries_and_rows(ranks):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((7, 6)) * 30).astype(np.float32)  # large: exp without the max overflows
    x[1, 2:] = -np.inf
    x[4, :] = -np.inf  # a fully masked row: zeros
    x[5, 0] = 80.0
    y = _joined(_interp(SOFTMAX, "sm", {"x": x}, ranks, {"x": 0}), "y", 0)
    want = _softmax_rows(x)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-7)
    assert np.all(y[4] == 0) and np.all(y[1, 2:] == 0)
    np.testing.assert_allclose(y[[0, 1, 2, 3, 5, 6]].sum(axis=1), 1.0, rtol=1e-5)


def test_softmax_of_a_nan_row_is_nan_and_other_rows_are_untouched():
    x = np.array([[1.0, np.nan, 2.0], [0.0, 1.0, 2.0]], dtype=np.float32)
    y = _joined(_interp(SOFTMAX, "sm", {"x": x}, 1, {}), "y", None)
    assert np.isnan(y[0]).all()
    np.testing.assert_allclose(y[1], _softmax_rows(x[1:])[0], rtol=1e-6)


REORDER = """program rsm(x: f32[R, C] local) {
    g = allreduce(sum, x)
    y = softmax(where(causal(g), g, -inf)) * 2.0
    return y
}

schedule rows for rsm {
    rs, ag = split(g, dim=0)
    agy = reorder(ag, y)
}
"""


@pytest.mark.parametrize("ranks", [2, 3])
def test_reorder_moves_softmax_and_causal_onto_row_slices(ranks):
    mod = load_source(REORDER)
    rng = np.random.default_rng(8)
    xs = [{"x": rng.standard_normal((5, 4)).astype(np.float32)} for _ in range(ranks)]
    want = run(mod.program("rsm"), xs)[0].outputs["y"]
    got = run(mod.schedule("rsm", "rows").ir, xs)
    total = sum(x["x"] for x in xs)
    np.testing.assert_allclose(want, 2.0 * _softmax_rows(np.where(np.tri(5, 4, dtype=bool), total, -np.inf)),
                               rtol=1e-5, atol=1e-6)
    for r in got:
        np.testing.assert_allclose(r.outputs["y"], want, rtol=1e-6, atol=1e-7)


def test_reorder_refuses_a_slice_that_cuts_softmax_rows():
    src = REORDER.replace("split(g, dim=0)", "split(g, dim=1)")
    with pytest.raises(CompileError, match="softmax works on the last dim, which the slice would cut"):
        load_source(src)


# --- causal and inf --------------------------------------------------------------------------
CAUSAL = """program cm(s: f32[B, S, T] sliced(1)) {
    a = where(causal(s), s, -inf)
    b = where(causal(s, diagonal=-2), s, 0.0)
    c = where(causal(s, diagonal=1), 1.0, 2.0 * s)
    return a, b, c
}
"""


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_causal_counts_global_positions_of_a_sliced_sequence(ranks):
    rng = np.random.default_rng(1)
    s = rng.standard_normal((2, 7, 5)).astype(np.float32)
    res = _interp(CAUSAL, "cm", {"s": s}, ranks, {"s": 1})
    rows, cols = np.arange(7)[:, None], np.arange(5)[None, :]
    np.testing.assert_array_equal(_joined(res, "a", 1), np.where(cols <= rows, s, -np.inf))
    np.testing.assert_array_equal(_joined(res, "b", 1), np.where(cols <= rows - 2, s, 0.0))
    np.testing.assert_array_equal(_joined(res, "c", 1), np.where(cols <= rows + 1, 1.0, 2.0 * s))


def test_inf_prints_and_parses_back_and_a_parameter_named_inf_shadows_it():
    p = load_source(CAUSAL).program("cm")
    text = printer.program(p)
    assert "where(causal(s, diagonal=0), s, -inf)" in text and "causal(s, diagonal=-2)" in text
    assert printer.program(load_source(text).program("cm")) == text
    shadow = load_source("program p(inf: f32[N] replicated) {\n    y = inf * 2.0\n    return y\n}\n").program("p")
    got = run(shadow, [{"inf": np.array([1.0, 2.0], dtype=np.float32)}])[0].outputs["y"]
    np.testing.assert_array_equal(got, [2.0, 4.0])


# --- transpose and reshape ------------------------------------------------------------------
HEADS = """program hd(x: f32[B, S, H] sliced(2), y: f32[B, S, 4, E] sliced(2)) {
    q = transpose(reshape(x, [B, S, 4, -1]), 1, 2)
    kt = transpose(q, 2, 3)
    back = reshape(transpose(q, 1, 2), [B, S, H])
    merged = reshape(y, [B, S, -1])
    rows = reshape(transpose(x, 0, 1), [-1, H])
    return q, kt, back, merged, rows
}
"""


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_heads_split_and_merge_keep_the_slice_over_heads(ranks):
    rng = np.random.default_rng(4)
    B, S, H, E = 2, 3, 8, 5
    x = rng.standard_normal((B, S, H)).astype(np.float32)
    y = rng.standard_normal((B, S, 4, E)).astype(np.float32)
    p = load_source(HEADS).program("hd")
    assert [str(s.type.layout) for s in p.stages] == ["sliced(1)", "sliced(1)", "sliced(2)", "sliced(2)", "sliced(1)"]
    res = _interp(HEADS, "hd", {"x": x, "y": y}, ranks, {"x": 2, "y": 2})
    q = np.swapaxes(x.reshape(B, S, 4, H // 4), 1, 2)  # [B, heads, S, hd]
    np.testing.assert_array_equal(_joined(res, "q", 1), q)
    np.testing.assert_array_equal(_joined(res, "kt", 1), np.swapaxes(q, 2, 3))
    np.testing.assert_array_equal(_joined(res, "back", 2), x)
    np.testing.assert_array_equal(_joined(res, "merged", 2), y.reshape(B, S, 4 * E))
    np.testing.assert_array_equal(_joined(res, "rows", 1), np.swapaxes(x, 0, 1).reshape(S * B, H))


PERMUTE = """program pm(x: f32[A, B, C, D] sliced(1)) {
    y = permute(x, [2, 0, 3, 1])
    z = permute(x, [0, 1, 2, 3])
    return y, z
}
"""


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_permute_is_its_transposes_and_carries_the_slice(ranks):
    x = np.random.default_rng(9).standard_normal((2, 5, 4, 3)).astype(np.float32)
    p = load_source(PERMUTE).program("pm")
    assert str(p.stages[0].type) == "f32[C, A, D, B] sliced(3)"
    assert printer.expr(p.stages[0].expr) == "transpose(transpose(transpose(x, 0, 2), 1, 2), 2, 3)"
    res = _interp(PERMUTE, "pm", {"x": x}, ranks, {"x": 1})
    np.testing.assert_array_equal(_joined(res, "y", 3), np.transpose(x, (2, 0, 3, 1)))
    np.testing.assert_array_equal(_joined(res, "z", 1), x)


def test_heads_that_do_not_divide_among_the_ranks_raise_naming_the_line():
    x = np.zeros((2, 3, 12), dtype=np.float32)  # 4 heads of 3 over 3 ranks: slices of 4 columns
    y = np.zeros((2, 3, 4, 1), dtype=np.float32)
    with pytest.raises(ValueError, match=r"line 2, col 19: reshape of a dim of 12 sliced over 3 ranks into 4 x 3"):
        _interp(HEADS, "hd", {"x": x, "y": y}, 3, {"x": 2, "y": 2})
    bad = HEADS.replace("[B, S, H])", "[B, S, -1])").replace("[B, S, 4, -1]", "[B, S, 4, 2]")
    with pytest.raises(ValueError, match="the sizes disagree"):  # H = 12 is not 4 x 2
        _interp(bad, "hd", {"x": x, "y": y}, 1, {})


# --- batched matmul -------------------------------------------------------------------------
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_batched_matmul_matches_numpy_in_every_layout(ranks):
    rng = np.random.default_rng(6)
    H, M, K, N = 4, 3, 5, 2
    a, c, e = rng.standard_normal((M, K)), rng.standard_normal((H, M, K)), rng.standard_normal((H, M, K))
    b, d, f = (rng.standard_normal((H, K, N)) for _ in range(3))
    p = load_source(BLOCK).program("batched")
    assert [str(s.type.layout) for s in p.stages] == ["sliced(0)", "local", "replicated", "sliced(1)"]
    ins = {k: v.astype(np.float32) for k, v in dict(a=a, b=b, c=c, d=d, e=e, f=f).items()}
    res = _interp(BLOCK, "batched", ins, ranks, {"b": 0, "c": 2, "d": 1, "e": 1})
    tol = dict(rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_joined(res, "y", 0), np.einsum("mk,hkn->hmn", a, b), **tol)
    for r in res:  # the contracted dim's partial sums, all-reduced
        np.testing.assert_allclose(r.outputs["z"], np.einsum("hmk,hkn->hmn", c, d), **tol)
    np.testing.assert_allclose(_joined(res, "w", 1), np.einsum("hmk,hkn->hmn", e, f), **tol)


def test_attention_over_heads_matches_numpy_and_its_derivative_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    B, S, D = 2, 5, 6
    x, dy = rng.standard_normal((B, S, D)), rng.standard_normal((B, S, D))
    w = {k: rng.standard_normal((D, D)) for k in ("wq", "wk", "wv", "wo")}
    src = BLOCK.replace("f32", "f64").replace("* 0.05", "* 0.4")  # a peaked softmax: masks matter
    sliced = {"wq": 1, "wk": 1, "wv": 1, "wo": 0}
    y = _interp(src, "attention", {"x": x, **w}, 2, sliced)[0].outputs["y"]

    def heads(t):  # [B, S, D] -> [B, 2, S, D / 2]
        return t.reshape(B, S, 2, -1).transpose(1, 2)
    tx = torch.tensor(x, requires_grad=True)
    tw = {k: torch.tensor(v, requires_grad=True) for k, v in w.items()}
    q, k, v = (heads(tx @ tw[n]) for n in ("wq", "wk", "wv"))
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.4)
    ty = o.transpose(1, 2).reshape(B, S, D) @ tw["wo"]
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-10, atol=1e-12)
    (ty * torch.tensor(dy)).sum().backward()
    got = _grads(src, "attention", {"x": x, **w, "d_y": dy}, 2, sliced)
    np.testing.assert_allclose(got["d_x"], tx.grad.numpy(), rtol=1e-9, atol=1e-11)
    for n in w:
        np.testing.assert_allclose(got[f"d_{n}"], tw[n].grad.numpy(), rtol=1e-9, atol=1e-11)


def test_a_batched_matmul_overlaps_in_whole_batches():
    """A batched matmul as an overlap's producer: chunks along its batch dims only (each a
    strided-batched GEMM; tests/test_gather_matmul.py runs them compiled), never along M or N."""
    from coconetc.plan import plan_program
    from coconetc.plan.units import Overlap
    src = BLOCK + """
schedule ov for batched {
    overlap(zp, z, chunks=2)
}

schedule bad for batched {
    overlap(zp, z, chunks=2, dim=1)
}
"""
    with pytest.raises(CompileError) as err:
        load_source(src, "t.ccn")
    d = err.value.diagnostics[0]
    assert "cannot chunk along dim 1; chunkable dims: 0" in d.message, d.message
    mod = load_source(src.split("schedule bad")[0], "t.ccn")
    units = plan_program(mod.schedules["batched"]["ov"].ir, "ov").units
    assert [(u.producer, u.collective, u.dim) for u in units if isinstance(u, Overlap)] == [("zp", "z", 0)]


# --- errors at their line and column --------------------------------------------------------
@pytest.mark.parametrize("body, line, col, words", [
    ("    y = softmax(x)\n", 2, 17, "last dim, which this tensor has sliced"),
    ("    y = softmax(i)\n", 2, 17, "cast(x, f32) first"),
    ("    y = softmax(k)\n", 2, 17, "not a scalar"),
    ("    y = where(causal(v), v, 0.0)\n", 2, 22, "at least 2 dims"),
    ("    y = softmax(x < 1.0)\n", 2, 17, "condition of where"),
    ("    y = causal(u)\n", 2, 9, "condition of where"),
    ("    y = reshape(x, [-1])\n", 2, 17, "only the outermost dim (0) of the dims it merges"),
    ("    y = reshape(w, [4, 2, 2])\n", 2, 9, "3 = 3 elements cannot become 2 x 2 = 4"),
    ("    y = reshape(w, [5, 3])\n", 2, 9, "4 = 4 elements cannot become 5 = 5"),
    ("    y = reshape(u, [S, -1, -1])\n", 2, 9, "at most one dim may be -1"),
    ("    y = reshape(u, [S, nh, 2])\n", 2, 24, "unknown size 'nh'"),
    ("    y = reshape(u, S)\n", 2, 20, "shape must be written [d, ...]"),
    ("    y = reshape(w, [3, 4])\n", 2, 9, "splits one dim into adjacent dims or merges"),
    ("    y = transpose(u, 0, 2)\n", 2, 9, "transpose dim 2 is out of range"),
    ("    y = softmax([S, 2])\n", 2, 17, "not a value"),
    ("    y = permute(b3, [0, 2, 2])\n", 2, 21, "needs an order of the dims 0..2, each once; got [0, 2, 2]"),
    ("    y = permute(b3, [0, S, 1])\n", 2, 21, "dims must be written [d0, d1, ...] (integers)"),
    ("    y = permute(b3)\n", 2, 9, "permute() takes 2 arguments"),
    ("    y = matmul(b3, c3)\n", 2, 9, "needs equal batch dims, or a 2-d left operand broadcast"),
    ("    y = matmul(b3, b3)\n", 2, 9, "inner dims differ: 3 vs 4"),
    ("    y = matmul(d3, b3)\n", 2, 9, "batched matmul of sliced(0) x replicated has no tensor-parallel meaning"),
])
def test_errors_are_located(body, line, col, words):
    src = ("program p(x: f32[B, S] sliced(1), i: i32[B, S] replicated, k: f32, v: f32[S] replicated, "
           "u: f32[S, S] replicated, w: f32[4, 3] replicated, b3: f32[2, 4, 3] replicated, "
           "c3: f32[5, 3, 2] replicated, d3: f32[2, 5, 4] sliced(0)) {\n" + body + "    return y\n}\n")
    with pytest.raises(CompileError) as err:
        load_source(src, "t.ccn")
    d = err.value.diagnostics[0]
    assert (d.span.line, d.span.col) == (line, col), str(err.value)
    assert words in d.message, d.message


# --- derivatives against torch.autograd ----------------------------------------------------
def _grads(src: str, name: str, inputs: dict, ranks: int, sliced: dict[str, int]) -> dict[str, np.ndarray]:
    """The derived program of `name` run by the interpreter; its gradients joined over the ranks."""
    g = vjp(load_source(src).program(name))
    res = _run_ir(g, inputs, ranks, sliced)
    return {pub: _joined(res, pub, sliced.get(pub[2:])) for pub, _ in g.outputs}


def test_softmax_and_causal_derivatives_match_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    B, H, S = 2, 3, 5
    s = rng.standard_normal((B, H, S, S)).astype(np.float64)
    c = rng.uniform(0.5, 1.5, (B, 1, S, 1)).astype(np.float64)
    dq = rng.standard_normal((B, H, S, S)).astype(np.float64)
    src = BLOCK.replace("f32", "f64")
    got = _grads(src, "attn_mask", {"s": s, "c": c, "d_q": dq}, 2, {"s": 1, "d_q": 1})

    ts = torch.tensor(s, requires_grad=True)
    keep = torch.ones(S, S, dtype=torch.bool).tril()
    m = torch.where(keep, ts, -torch.inf)
    m2 = torch.where(torch.tensor(c) > 1.0, m, -torch.inf)
    full = m2.isneginf().all(dim=-1, keepdim=True)  # rows torch would make NaN: ours are zeros
    p = torch.where(full, 0.0, torch.softmax(torch.where(full, 0.0, m2), dim=-1))
    second = torch.where(torch.ones(S, S, dtype=torch.bool).tril(-1), ts * 0.5, -torch.inf)
    full2 = second.isneginf().all(dim=-1, keepdim=True)
    p2 = torch.where(full2, 0.0, torch.softmax(torch.where(full2, 0.0, second), dim=-1))
    q = p * 2.0 + p2
    (q * torch.tensor(dq)).sum().backward()
    assert full.any() and full2.any()  # both kinds of fully masked rows are exercised
    np.testing.assert_allclose(got["d_s"], ts.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(got["d_c"], np.zeros_like(c))


def test_softmax_derivative_of_a_sliced_batch_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((7, 6)) * 3
    dy = rng.standard_normal((7, 6))
    got = _grads(SOFTMAX.replace("f32", "f64"), "sm", {"x": x, "d_y": dy}, 3, {"x": 0, "d_y": 0})
    tx = torch.tensor(x, requires_grad=True)
    (torch.softmax(tx, dim=-1) * torch.tensor(dy)).sum().backward()
    np.testing.assert_allclose(got["d_x"], tx.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_transpose_and_reshape_derivatives_match_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    B, S, D = 2, 3, 8
    x, c, dy, dm = (rng.standard_normal(s) for s in ((B, S, D), (B, S, D), (B, S, D), (S, B, D)))
    got = _grads(BLOCK.replace("f32", "f64"), "heads", {"x": x, "c": c, "d_y": dy, "d_m": dm}, 2,
                 {"x": 2, "c": 2, "d_y": 2, "d_m": 2})
    tx, tc = torch.tensor(x, requires_grad=True), torch.tensor(c, requires_grad=True)
    q = tx.reshape(B, S, 2, -1).transpose(1, 2)
    k = (q * 2.0).transpose(2, 3)
    y = k.transpose(2, 3).transpose(1, 2).reshape(B, S, D) + tc * tx
    m = tc.reshape(B, S, 2, -1).transpose(0, 1).reshape(S, B, D)
    ((y * torch.tensor(dy)).sum() + (m * torch.tensor(dm)).sum()).backward()
    np.testing.assert_allclose(got["d_x"], tx.grad.numpy(), rtol=1e-12)
    np.testing.assert_allclose(got["d_c"], tc.grad.numpy(), rtol=1e-12)


# --- both backends against the interpreter ------------------------------------------------
def _block_text(programs: str = BLOCK) -> str:
    """The forward programs and their derived programs, one .ccn text."""
    mod = load_source(programs)
    texts = [printer.program(p) for p in mod.programs.values()]
    texts += [printer.program(replace(vjp(p), name=f"{p.name}_grad")) for p in mod.programs.values()]
    return "\n".join(texts)


def _launch(ranks: int, args: list[str], programs: int = 2 * len(load_source(BLOCK).programs)) -> None:
    res = ranks_run(ranks, [WORKER, *args])
    log = f"--- stdout\n{res.stdout}\n--- stderr\n{res.stderr[-4000:]}"
    assert res.returncode == 0, log
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(("MATCH", "MISMATCH"))]
    assert len(lines) == programs and all(ln.startswith("MATCH ") for ln in lines), log


def _sizes(**more: int) -> list[str]:
    return [f"{k}={v}" for k, v in {**SIZES, **more}.items()]


def _half_attention() -> str:
    """The attention program in f16 and bf16 (forward only: through the softmax's derivative a
    16-bit rounding of one ulp, where the backends' GEMMs add in another order than NumPy, grows
    past the f16 tolerance)."""
    p = load_source(BLOCK).program("attention")
    text = printer.program(p)
    return "\n".join(text.replace("f32", dt).replace("program attention(", f"program attention_{dt}(")
                     for dt in ("f16", "bf16"))


@pytest.mark.skipif(probes.missing_cpu_extra(), reason="needs the 'cpu' extra")
def test_cpu_backend_matches_interpreter(tmp_path):
    from coconetc.runtime.loader import compile_cpu
    f = tmp_path / "block_cpu.ccn"
    f.write_text(_block_text() + "\n" + _half_attention())
    compile_cpu(load_file(f), log=lambda msg: None)
    n = 2 * len(load_source(BLOCK).programs) + 2
    _launch(1, ["cpu", str(f), *_sizes()], n)
    _launch(2, ["cpu", str(f), *_sizes(), "--", *_sizes(H=1, S=1)], 2 * n)  # then a rank with an empty slice of heads


def _only(name: str) -> str:
    """Program NAME of BLOCK as it is written there, alone (its first line the file's first)."""
    start = BLOCK.index(f"program {name}(")
    end = BLOCK.find("\nprogram ", start)
    return BLOCK[start:] if end < 0 else BLOCK[start:end + 1]


RAISES = """
import sys
import numpy as np
from mpi4py import MPI
from coconetc.jobs.modules import load_cpu
from coconetc.oracle.inputs import random_inputs
mod = load_cpu(sys.argv[1])
comm = MPI.COMM_WORLD
ir = mod.source_module.programs["heads"]
inputs = random_inputs(ir, comm.Get_size(), 1, {"B": 2, "S": 3, "D": 6}, seed=0)
try:
    mod.programs["heads"](**inputs[comm.Get_rank()])
    print(f"rank {comm.Get_rank()} ran", flush=True)
except ValueError as err:
    print(f"rank {comm.Get_rank()} raised {err}", flush=True)
"""


@pytest.mark.skipif(probes.missing_cpu_extra(), reason="needs the 'cpu' extra")
def test_compiled_heads_that_do_not_divide_raise_on_every_rank(tmp_path):
    """2 heads of a dim of 6 over 4 ranks: each rank's slice of 2 columns is not whole heads."""
    from coconetc.runtime.loader import compile_cpu
    f = tmp_path / "heads.ccn"
    f.write_text(_only("heads"))  # the one program the ranks call: one unit to build
    compile_cpu(load_file(f), log=lambda msg: None)
    script = tmp_path / "raises.py"
    script.write_text(RAISES)
    cmd = mpiexec.command(4, [sys.executable, str(script), str(f)])
    res = subprocess.run(cmd, env=mpiexec.environment(4), capture_output=True, text=True, timeout=600)
    lines = sorted(ln for ln in res.stdout.splitlines() if ln.startswith("rank "))
    want = "raised reshape (heads.ccn:2): a dim of 6 sliced over 4 ranks into 2 x 3"
    assert len(lines) == 4 and all(want in ln for ln in lines), res.stdout + res.stderr[-3000:]


TORCH = """
import sys
import torch
from mpi4py import MPI
import coconetc.torch as ct
from coconetc.ir.slices import slice_range
comm = MPI.COMM_WORLD
r, R = comm.Get_rank(), comm.Get_size()
B, S, D = 2, 5, 6
g = torch.Generator().manual_seed(0)
x = torch.randn(B, S, D, generator=g, dtype=torch.float64)
w = {k: torch.randn(D, D, generator=g, dtype=torch.float64) for k in ("wq", "wk", "wv", "wo")}
dy = torch.randn(B, S, D, generator=g, dtype=torch.float64)
f = ct.function(sys.argv[1], "attention", backend=sys.argv[2])


def part(t, d):
    lo, hi = slice_range(t.shape[d], R, r)
    return t.narrow(d, lo, hi - lo).clone()


dims = {"wq": 1, "wk": 1, "wv": 1, "wo": 0}
mine = {k: part(v, dims[k]).requires_grad_() for k, v in w.items()}
xx = x.clone().requires_grad_()
y = f(x=xx, **mine)
(y * dy).sum().backward()
tx, tw = x.clone().requires_grad_(), {k: v.clone().requires_grad_() for k, v in w.items()}
q, k, v = ((tx @ tw[n]).reshape(B, S, 2, -1).transpose(1, 2) for n in ("wq", "wk", "wv"))
o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.05)
ty = o.transpose(1, 2).reshape(B, S, D) @ tw["wo"]
(ty * dy).sum().backward()
errs = [(y - ty).abs().max(), (xx.grad - tx.grad).abs().max()]
errs += [(mine[n].grad - part(tw[n].grad, dims[n])).abs().max() for n in w]
print(f"rank {r} max error {max(float(e) for e in errs):.3g}", flush=True)
"""


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.slow)])
def test_torch_function_of_the_attention_matches_torch_on_two_ranks(tmp_path, backend):
    """coconetc.torch.function over the head-parallel attention (the forward saving its values,
    the derived backward): outputs and every gradient in its layout against one process of
    torch's scaled_dot_product_attention and autograd (cuda: the CUDA module under the host
    emulation, CPU tensors standing for CUDA tensors)."""
    why = probes.missing_cpu_extra() if backend == "cpu" else probes.emulation_missing()
    if why:
        pytest.skip(why)
    f = tmp_path / "attention.ccn"
    f.write_text(_only("attention").replace("f32", "f64"))  # the program the function calls, alone
    script = tmp_path / "attention_torch.py"
    script.write_text(TORCH)
    env = mpiexec.environment(2) | ({"COCONET_CUDA_EMULATE": "1"} if backend == "cuda" else {})
    cmd = mpiexec.command(2, [sys.executable, str(script), str(f), backend])
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    lines = [ln.split() for ln in res.stdout.splitlines() if ln.startswith("rank ")]
    assert len(lines) == 2 and all(float(ln[-1]) < 1e-10 for ln in lines), res.stdout + res.stderr[-3000:]


@pytest.mark.slow  # (the CPU backend's run of the same programs is in make test-quick)
@pytest.mark.skipif(probes.emulation_missing() is not None, reason=probes.emulation_missing() or "")
def test_cuda_emulation_matches_interpreter(tmp_path):
    from coconetc import toolchain
    f = tmp_path / "block_cuda.ccn"
    f.write_text(_block_text())
    mod = load_file(f)
    assert all(not p.unsupported("cuda-emulated") for p in mod.plans.values())
    toolchain.compile(mod, "cuda-emulated", toolchain.Options(log=lambda msg: None))
    # rows longer than a block's threads, then a rank with an empty slice of heads (one launch)
    _launch(2, ["emulate", str(f), *_sizes(T=300, S=300, H=2, B=1), "--", *_sizes(H=1, S=1)],
            4 * len(load_source(BLOCK).programs))


@pytest.mark.slow
def test_cuda_module_compiles_and_links_with_nvcc(tmp_path):
    """The real CUDA module (not the emulation) of every program: nvcc compiles the kernels."""
    from coconetc import toolchain
    why = probes.cuda_missing()
    if why:
        pytest.skip(why)
    f = tmp_path / "block_nvcc.ccn"
    f.write_text(_block_text())
    so = toolchain.compile(load_file(f), "cuda", toolchain.Options(archs="90", log=lambda m: None)).path
    assert so is not None and so.exists()
