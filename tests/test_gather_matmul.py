"""overlap(collective, matmul) the other way (issue 39, point 2: async-TP's all-gather-matmul,
the sequence-parallel column-parallel layer): an allgather or a broadcast whose result a matmul
reads, each chunk multiplied as soon as it has arrived while the next is in flight.

- the plan prints each way of cutting it (rows in place, pieces of every rank's slice, packed);
- bad schedules are located errors whose advice leads somewhere;
- the derived program of a sequence-parallel MLP reduce-scatters the input gradient of its
  all-gathered input (Megatron's backward) and matches torch.autograd, on 1 to 3 ranks;
- every program of tests/programs/gather_matmul.ccn under every schedule (the derived one's
  too), compiled for the CPU on 2 and 3 ranks (uneven slices; tiny sizes with empty chunks and a
  rank holding nothing) and as CUDA under the host emulation, against the interpreter; the CUDA
  module compiled and linked by nvcc;
- a batched matmul as the producer of an overlap (the usual way): chunks of whole batches;
- a weight sliced over the ranks and gathered where it is used (FSDP: the matmul's right
  operand), cut along its rows; its derived program's weight gradient (matmul_tn) overlapped
  with its reduce-scatter;
- a model of such layers (a repeat) whose weight gathers a schedule's prefetch(depth=d) starts d
  gathers ahead (the compiled runs above, each schedule: fsdp_model); bad prefetches are
  located errors."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import coconetc.autodiff  # noqa: F401  (registers the derived programs' operations)
from coconetc import toolchain
from coconetc.autodiff import vjp
from coconetc.errors import CompileError
from coconetc.interp.interpreter import run
from coconetc.ir.slices import slice_range
from coconetc.sourcefile import load_file, load_source
from coconetc.toolchain import probes
import rank_pool

FILE = Path(__file__).resolve().parent / "programs" / "gather_matmul.ccn"
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sharded_mlp.ccn"
RUN_JOBS = Path(__file__).with_name("run_jobs_worker.py")
COCONETC = str(Path(sys.executable).parent / "coconetc")
PROGRAMS = {"sp": ["default", "rows"], "tok": ["default", "pieces"], "four": ["default", "packed"],
            "bc": ["default", "rows"], "spmlp": ["default", "both"], "spmlp_grad": ["default", "both"],
            "defer": ["default", "ov"], "bmm": ["default", "rows", "packed"], "fed": ["default", "both"],
            "fed_grad": ["default", "both"], "qk_grad": ["default", "sum"], "rowsum": ["default", "sum"],
            "fsdp": ["default", "pieces", "cols"], "fsdp_grad": ["default", "both", "cols"], "fsdp_cols": ["default", "rows"],
            "fsdp_cols_grad": ["default", "both"], "bcw": ["default", "rows"],
            "fsdp_model": ["default", "next", "one", "ov"], "fsdp_model_grad": ["default", "next"],
            "fsdp_adam": ["default", "fused"]}
SIZES = {  # ranks -> sizes: uneven slices on 2 and 3 ranks; on 3, chunks and slices that are empty
    2: dict(B=3, S=5, H=4, F=6, T=7, C=5, G=3, M=3, K=5, N=4),
    3: dict(B=1, S=2, H=3, F=4, T=2, C=2, G=1, M=2, K=2, N=3),
}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([COCONETC, *args], capture_output=True, text=True, timeout=600)


def test_the_plan_shows_how_each_gather_is_cut():
    want = {("sp", "rows"): "overlap g = allgather(x) in 2 chunks along dim 0 (rows in place) -> y = matmul(g, w) "
                            "per chunk, as it arrives",
            ("tok", "pieces"): "in 3 chunks along dim 0 (piece i of every rank's slice, in place)",
            ("four", "packed"): "in 2 chunks along dim 2 (each chunk packed)",
            ("bc", "rows"): "overlap g = broadcast(x, root=1) in 3 chunks along dim 0 (rows in place)",
            ("spmlp_grad", "both"): "overlap g_allgather2 = allgather(d_y) in 2 chunks along dim 0 (rows in place) -> "
                                    "g_h = matmul_nt(g_allgather2, w2) per chunk",
            ("fed", "both"): "then m = matmul(g, w) per chunk, as its rows of g are gathered (chunk i while chunk "
                             "i+1's fused collective is in flight)",
            ("fed_grad", "both"): "then d_o = matmul_nt(g_allgather2, wo) per chunk, as its rows of g_allgather2 are "
                                  "gathered",
            ("qk_grad", "sum"): "overlap g_g_part3 = matmul_nt(g_b, w2) + matmul_nt(g_a, w1) in 2 chunks along dim 0 "
                                "(rows in place) -> d_x = reducescatter(sum, g_g_part3) per chunk",
            ("rowsum", "sum"): "overlap s = matmul(h1, w1) + matmul(h2, w2) in 3 chunks along dim 0 (rows in place) -> "
                               "y = allreduce(sum, s) per chunk",
            ("fsdp", "pieces"): "overlap wg = allgather(w) in 2 chunks along dim 0 (piece i of every rank's slice, in "
                                "place) -> y = matmul(x, wg) per chunk, as it arrives\n          per chunk: y += "
                                "x[..., the chunk's columns] x (the chunk's rows of wg) (the first chunk writes it); wg "
                                "is whole only after chunk 2",
            ("fsdp", "cols"): "overlap wg = allgather(w) in 2 chunks along dim 1 (each chunk packed) -> y = matmul(x, wg) "
                              "per chunk, as it arrives\n          per chunk: the chunk's columns of y = x x (the chunk's "
                              "columns of wg); wg is whole only after chunk 2",
            ("fsdp_grad", "cols"): "per chunk: d_x += d_y[..., the chunk's columns] x (the chunk's columns of wg)^T (the "
                                   "first chunk writes it); wg is whole only after chunk 3",
            ("fsdp_cols", "rows"): "overlap wg = allgather(w) in 3 chunks along dim 0 (rows in place) -> y = matmul(x, wg)",
            ("bcw", "rows"): "overlap wg = broadcast(w, root=1) in 3 chunks along dim 0 (rows in place) -> y = matmul(x, wg)",
            ("fsdp_grad", "both"): "per chunk: the chunk's columns of d_x = d_y x (the chunk's rows of wg)^T; wg is "
                                   "whole only after chunk 2",
            ("fsdp_cols_grad", "both"): "overlap g_wg_part = matmul_tn(x, d_y) in 2 chunks along dim 0 (rows in place) "
                                        "-> d_w = reducescatter(sum, g_wg_part) per chunk"}
    from coconetc.plan.show import show as show_plan
    mod = load_file(FILE)  # (the derived programs too: the file schedules them)
    for (prog, sched), text in want.items():
        got = show_plan(mod.plans[(prog, sched)])
        assert text in got, got
    res = _cli("show", str(FILE), "-p", "fsdp", "--grad", "-s", "both", "--format", "plan")  # as a user asks
    assert res.returncode == 0 and want[("fsdp_grad", "both")] in res.stdout, res.stdout + res.stderr


def _starts_and_waits(plan) -> list[tuple[str, str]]:
    from coconetc.plan.units import Collective, StartGather
    return [("start", u.gather.dst) if isinstance(u, StartGather) else ("wait" if u.prefetched else "gather", u.dst)
            for u in plan.units if isinstance(u, StartGather) or isinstance(u, Collective) and u.op == "allgather"]


def test_prefetch_starts_each_weight_gather_depth_gathers_ahead():
    """prefetch(depth=d): the k-th weight gather starts right after the (k-d)-th is waited for
    (the first d at the start), what makes its source (the layer's index of the stacked weight)
    moved with it, and is waited for where it stood; a gather overlapped with its matmul is left
    to the overlap; the derived program's gathers too."""
    mod = load_file(FILE)
    gathers = [f"y__l{k}__w{j}g" for k in range(3) for j in (1, 2)]

    def expected(depth: int, skip: tuple[str, ...] = ()) -> list[tuple[str, str]]:
        mine = [g for g in gathers if g not in skip]
        out = [("start", g) for g in mine[:depth]]
        for g in gathers:
            if g in skip:  # (a GatherMatmul unit: no gather of its own)
                continue
            out.append(("wait", g))
            i = mine.index(g)
            if i + depth < len(mine):
                out.append(("start", mine[i + depth]))
        return out
    assert _starts_and_waits(mod.plans[("fsdp_model", "one")]) == expected(1)
    assert _starts_and_waits(mod.plans[("fsdp_model", "next")]) == expected(2)
    assert _starts_and_waits(mod.plans[("fsdp_model_grad", "next")]) == expected(2)
    assert _starts_and_waits(mod.plans[("fsdp_model", "ov")]) == expected(3, skip=("y__l1__w1g",))
    assert all(kind == "gather" for kind, _ in _starts_and_waits(mod.plans[("fsdp_model", "default")]))
    plan = mod.plans[("fsdp_model", "one")]
    names = [getattr(u, "dst", "") for u in plan.units]
    from coconetc.plan.units import StartGather
    starts = [i for i, u in enumerate(plan.units) if isinstance(u, StartGather)]
    for i in starts:  # the layer's weight is taken from the stacked one before its gather starts
        assert plan.units[i].gather.src in names[:i], (plan.units[i], names[:i])
    assert names[starts[2] - 1] == "y__l1__w1", names  # (moved there: a layer ahead of its own)
    from coconetc.plan.show import show as show_plan
    text = show_plan(plan)
    assert "start y__l1__w1g = allgather(y__l1__w1) (prefetch: in flight until its wait below)" in text, text
    assert "collective y__l1__w1g = allgather(y__l1__w1) (prefetched: waits for its start above)" in text, text


PREFETCH_BAD = """
program q(x: f32[T, K] sliced(0), w: f32[K, N] sliced(0), u: f32[K, N] replicated) {
    wg = allgather(w)
    y = matmul(x, wg)
    return y
}
program r(x: f32[T, K] sliced(0), u: f32[K, N] replicated) {
    y = matmul(x, u)
    return y
}
"""


@pytest.mark.parametrize("directive, where, message", [
    ("prefetch(depth=0)", "0)", "prefetch()'s depth must be an integer >= 1"),
    ("prefetch(depth=2)\n    prefetch(depth=1)", "prefetch(depth=1)", "q's schedule already prefetches (depth=2)"),
    ("prefetch(wg, depth=1)", "prefetch(wg", "prefetch() takes no stage names"),
    ("prefetch(depth=1, chunks=2)", "chunks=2)", "prefetch() has no argument 'chunks'"),
])
def test_bad_prefetches_are_located_errors(directive, where, message):
    _refused_at(PREFETCH_BAD, directive, where, message)


def test_a_program_without_weight_gathers_cannot_prefetch():
    src = PREFETCH_BAD + "schedule s for r {\n    prefetch(depth=1)\n}\n"
    with pytest.raises(CompileError) as err:
        load_source(src, "t.ccn")
    d = err.value.diagnostics[0]
    assert "prefetch(): r gathers no weight to start early" in d.message, d.message
    assert src.splitlines()[d.span.line - 1][d.span.col - 1:].startswith("prefetch"), d.span


@pytest.mark.parametrize("target, directive, where, message", [
    ("q", "keep_gathered()", "keep_gathered", "a directive of a derived program's schedule (schedule ... for grad(q))"),
    ("grad(q)", "keep_gathered()\n    keep_gathered()", "keep_gathered", "keep_gathered(): one a schedule"),
    ("grad(r)", "keep_gathered()", "keep_gathered", "r_grad gathers no weight"),
    ("grad(q)", "keep_gathered(wg)", "keep_gathered(wg", "keep_gathered() takes no names"),
    ("grad(q)", "keep_gathered(depth=1)", "depth=1", "keep_gathered() has no argument 'depth'"),
])
def test_bad_keep_gathered_are_located_errors(target, directive, where, message):
    _refused_at(PREFETCH_BAD, directive, where, message, target)


BAD = """
program q(x: f32[B, S, H] sliced(1), w: f32[H, F] sliced(1), v: f32[F, H] sliced(0), u: f32[H, F] local) {
    g = allgather(x)
    y = matmul(g, w)
    h = gelu(matmul(g, w))
    z = matmul(y, v)
    r = allreduce(sum, u)
    return y, h, z, r
}
"""


@pytest.mark.parametrize("directive, where, message", [
    ("overlap(g, h, chunks=2)", "h", "must be a matmul stage (or a derived program's matmul_nt) that reads it: give "
     "the matmul a stage of its own (m = matmul(g, w)) and overlap(g, m, ...)"),
    ("overlap(g, z, chunks=2)", "z", "'z' does not read it as an operand"),
    ("overlap(g, y, chunks=2, dim=2)", "2)", "cannot chunk 'g' along dim 2 (the contracted dim, chunkable dims: 0)"),
    ("overlap(g, y, chunks=2, dim=1)", "1)", "cannot chunk 'g' along dim 1 (the gathered dim (other than 0), "
     "chunkable dims: 0)"),
    ("overlap(r, y, chunks=2)", "r", "the producer must be a matmul stage (or a derived program's matmul_nt or matmul_tn), a sum "
     "of such stages that nothing else reads, or an allgather or a broadcast whose result a matmul reads"),
])
def test_bad_overlaps_are_located_errors(directive, where, message):
    _refused_at(BAD, directive, where, message)


WEIGHTS = """
program q(x: f32[T, K] sliced(0), w: f32[K, N] sliced(1), v: f32[G, K, N] sliced(1), u: f32[N, T] replicated) {
    wg = allgather(w)
    y = matmul(x, wg)
    vg = allgather(v)
    z = matmul(x, vg)
    wg2 = allgather(w)
    e = matmul(wg2, u)
    return y, z, e
}
"""


@pytest.mark.parametrize("directive, where, message, good", [
    ("overlap(wg, y, chunks=2, dim=1)", "1)", "cannot chunk 'wg' along dim 1 (the dim it gathers, other than 0): a "
     "gathered right operand is cut along its rows (dim 0), each chunk multiplied as it arrives: "
     "overlap(wg, y, chunks=2)", "overlap(wg, y, chunks=2)"),
    ("overlap(vg, z, chunks=2)", "z", "a batched matmul (a batched right operand) cannot be overlapped yet: remove "
     "this overlap", None),
    ("overlap(wg, e, chunks=2)", "e", "'e' does not read it as an operand", None),
])
def test_a_gathered_weight_is_cut_along_its_rows_only(directive, where, message, good):
    """A weight gathered where it is used (the matmul's right operand: FSDP) sliced along its
    columns is cut along its rows only; its columns are refused, located, with the directive
    that is accepted."""
    _refused_at(WEIGHTS, directive, where, message)
    if good is not None:
        from coconetc.plan.show import show as show_plan
        ok = load_source(WEIGHTS + f"schedule s for q {{\n    {good}\n}}\n", "t.ccn")
        assert "overlap wg = allgather(w) in 2 chunks along dim 0 (rows in place)" in \
            show_plan(ok.plans[("q", "s")])


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_the_derived_fsdp_layer_gathers_and_reduce_scatters_and_matches_numpy(ranks):
    """grad(fsdp) (interpreted): the weight is gathered again for d_x = d_y w^T and its gradient
    x^T d_y reduce-scattered back to the ranks' slices; against NumPy, on 1 to 3 ranks (uneven
    slices; on 3 a rank holding no row of w)."""
    mod = load_source(FILE.read_text().replace("f32", "f64"), "g.ccn")
    grad = vjp(mod.programs["fsdp"])
    ops = [s.expr.op for s in grad.stages if hasattr(s.expr, "op")]
    assert ops.count("allgather") == 1 and ops.count("reducescatter") == 1 and "allreduce" not in ops, ops
    T, K, N = 5, 2, 3
    rng = np.random.default_rng(ranks)
    x, w, d_y = rng.standard_normal((T, K)), rng.standard_normal((K, N)), rng.standard_normal((T, N))
    cut = lambda a, r: a[slice(*slice_range(a.shape[0], ranks, r))].copy()  # noqa: E731
    res = run(grad, [{"x": cut(x, r), "w": cut(w, r), "d_y": cut(d_y, r)} for r in range(ranks)])
    np.testing.assert_allclose(np.concatenate([r.outputs["d_x"] for r in res]), d_y @ w.T, rtol=1e-12)
    np.testing.assert_allclose(np.concatenate([r.outputs["d_w"] for r in res]), x.T @ d_y, rtol=1e-12)
    fwd = run(mod.programs["fsdp"], [{"x": cut(x, r), "w": cut(w, r)} for r in range(ranks)])
    np.testing.assert_allclose(np.concatenate([r.outputs["y"] for r in fwd]), x @ w, rtol=1e-12)


def test_gathered_weights_share_memory_once_their_readers_have_run():
    """A gathered weight is held in the memory of an earlier one of its type whose last reader
    has run (Buffer.reuses): without prefetch each layer reuses the first layer's; with the
    next layer's gathers in flight (depth 2) every other layer; the plan shows where each is
    made and last read."""
    mod = load_file(FILE)

    def reuses(sched: str) -> dict[str, str]:
        return {b.name: b.reuses for b in mod.plans[("fsdp_model", sched)].buffers if b.reuses}
    first = {"y__l1__w1g": "y__l0__w1g", "y__l2__w1g": "y__l0__w1g", "y__l1__w2g": "y__l0__w2g",
             "y__l2__w2g": "y__l0__w2g"}
    assert reuses("default") == first
    assert reuses("one") == first  # (layer l+1's gathers start after layer l's last use of its own)
    assert reuses("next") == {"y__l2__w1g": "y__l0__w1g", "y__l2__w2g": "y__l0__w2g"}
    assert reuses("ov") == {}  # (depth 3: every gather starts before the one 3 back has been read)
    from coconetc.plan.show import show as show_plan
    text = show_plan(mod.plans[("fsdp_model", "next")])
    assert "y__l2__w1g   f32[K, N] replicated         scratch (in y__l0__w1g's memory: gathered after its last " \
           "reader)" in text, text
    assert "  y__l0__w1g   start allgather y__l0__w1g (prefetch) (L199) -> matmul y__l0__hm (L200)" in text, text


def test_a_stacked_weights_gradient_is_made_in_its_rows():
    """The derived program of the model (a repeat over stacked weights) makes each layer's
    reduce-scattered weight gradient straight into its row of the stacked gradient (the output):
    no unindex, no sum, no stacked-size scratch (plan/targets.py, assembled_stacks); the
    compiled runs above check the values."""
    from coconetc.plan import plan_program
    from coconetc.plan.units import Library, Loop
    mod = load_source(FILE.read_text(), "g.ccn")
    plan = plan_program(vjp(mod.programs["fsdp_model"]))
    rows = {b.name: (b.same_as, b.same_at) for b in plan.buffers if b.same_at is not None and not plan.is_index(b.name)}
    assert rows == {f"g_y__l{k}__w{j}": (f"d_w{j}", k) for k in range(3) for j in (1, 2)}, rows
    assert not [u for u in plan.units if isinstance(u, Library) and u.op == "unindex"]
    assert not [u for u in plan.units if isinstance(u, Loop) and u.type.ndim == 3], "a sum of stacked gradients"
    stacked = [b.name for b in plan.buffers if b.kind == "scratch" and b.type.ndim == 3]
    assert stacked == [], stacked


def test_keep_gathered_pairs_the_cut_that_keeps_the_gathered_weights():
    """examples/sharded_mlp.ccn's `kept` schedule of grad(sharded_model) (keep_gathered()): the
    cut it pairs with saves every gathered weight and its backward gathers none; the default
    schedule pairs the cut that gathers them again; forward then backward of the kept cut give
    the derived program's gradients (the interpreter, 2 ranks, f64)."""
    from coconetc.autodiff.saved import pairing
    from coconetc.plan.label import DEFAULT
    from coconetc.sourcefile import with_grads
    mod = with_grads(load_source(EXAMPLE.read_text().replace("f32", "f64"), "sharded_mlp.ccn"), ["sharded_model"])
    kept = pairing(mod.programs, mod.schedules, "sharded_model", "sharded_model_grad", DEFAULT, "kept", DEFAULT)
    again = pairing(mod.programs, mod.schedules, "sharded_model", "sharded_model_grad", DEFAULT, DEFAULT, DEFAULT)
    assert (kept.forward, kept.backward) == ("sharded_model_fwd_kept", "sharded_model_bwd_kept"), kept
    assert (again.forward, again.backward) == ("sharded_model_fwd", "sharded_model_bwd"), again
    gathered = {f"y__l{k}__w{j}g" for k in range(3) for j in (1, 2)}
    assert gathered <= set(kept.saved) and not gathered & set(again.saved), (kept.saved, again.saved)
    fwd, bwd, grad = (mod.programs[n] for n in ("sharded_model_fwd_kept", "sharded_model_bwd_kept", "sharded_model_grad"))
    assert not [st for st in bwd.stages if getattr(st.expr, "op", "") == "allgather"]
    assert "kept" in mod.schedules["sharded_model_bwd_kept"] and "kept" not in mod.schedules["sharded_model_bwd"]
    _cut_equals_the_derived_program(fwd, bwd, grad, kept.saved, 5, 3, 4)


def test_the_training_cut_gathers_the_weights_again_and_equals_the_derived_program():
    """The derived program cut for training (autodiff/saved.py) saves no gathered weight: the
    backward gathers each again, the last layer's first, and its schedule's prefetch starts
    those gathers ahead; forward then backward give the derived program's gradients (the
    interpreter, 2 ranks, uneven slices)."""
    from coconetc.sourcefile import with_grads
    mod = with_grads(load_source(FILE.read_text().replace("f32", "f64"), "g.ccn"), ["fsdp_model"])
    fwd, bwd, grad = (mod.programs[f"fsdp_model{s}"] for s in ("_fwd", "_bwd", "_grad"))
    saved = [pub.removeprefix("saved_") for pub, _ in fwd.outputs[1:]]
    assert saved and not [s for s in saved if s.endswith(("w1g", "w2g", "__w1", "__w2"))], saved
    gathers = [s.name for s in bwd.stages if getattr(s.expr, "op", "") == "allgather"]
    assert sorted(gathers) == sorted(f"y__l{k}__w{j}g" for k in range(3) for j in (1, 2)), gathers
    plan = load_file(FILE)
    waits = [w for kind, w in _starts_and_waits(with_grads(plan, ["fsdp_model"]).plans[("fsdp_model_bwd", "next")])
             if kind == "wait"]
    assert waits == [f"y__l{k}__w{j}g" for k in (2, 1, 0) for j in (2, 1)], waits
    _cut_equals_the_derived_program(fwd, bwd, grad, saved, 5, 3, 4)


def _cut_equals_the_derived_program(fwd, bwd, grad, saved, rows: int, k: int, n: int, ranks: int = 2) -> None:
    """A model of 3 layers' training cut (x: [rows, k] and d_y sliced(0), w1: [3, k, n] and w2:
    [3, n, k] sliced(1)): FWD then BWD (given the SAVED values) give GRAD's gradients, under the
    interpreter on RANKS ranks (uneven slices), in f64."""
    rng = np.random.default_rng(3)
    whole = {"x": rng.standard_normal((rows, k)), "w1": rng.standard_normal((3, k, n)) * 0.5,
             "w2": rng.standard_normal((3, n, k)) * 0.5, "d_y": rng.standard_normal((rows, k))}
    dims = {"x": 0, "w1": 1, "w2": 1, "d_y": 0}

    def part(name: str, r: int):
        lo, hi = slice_range(whole[name].shape[dims[name]], ranks, r)
        return np.ascontiguousarray(np.take(whole[name], range(lo, hi), axis=dims[name]))
    f = run(fwd, [{n: part(n, r) for n in ("x", "w1", "w2")} for r in range(ranks)])
    got = run(bwd, [{**{n: part(n, r) for n in dims}, **{s: f[r].outputs[f"saved_{s}"] for s in saved}}
                    for r in range(ranks)])
    want = run(grad, [{n: part(n, r) for n in dims} for r in range(ranks)])
    for r in range(ranks):
        for pub in want[r].outputs:
            np.testing.assert_allclose(got[r].outputs[pub], want[r].outputs[pub], rtol=1e-12, atol=1e-13,
                                       err_msg=f"{pub} on rank {r}")



@pytest.mark.parametrize("ranks", [2, 3])
def test_adamw_inside_the_backward_matches_torch(ranks):
    """examples/sharded_mlp.ccn's sharded_adamw (it calls sharded_mlp's derived program by name,
    then AdamW on each rank's slices) under its in_backward schedule (each update fused into its
    gradient's reduce-scatter, placed right after the GEMM that makes the gradient), two steps
    under the interpreter in f64, the second clipped by the first's norm: against torch.autograd
    and torch.optim.AdamW on the whole weights, and torch's total gradient norm."""
    torch = pytest.importorskip("torch")
    mod = load_source(EXAMPLE.read_text().replace("f32", "f64"), "sharded_mlp.ccn")
    prog = mod.schedule("sharded_adamw", "in_backward").ir
    order = [u.name if hasattr(u, "members") else getattr(u, "dst", "") for u in mod.plans[("sharded_adamw",
                                                                                            "in_backward")].units]
    assert order.index("upd2") == order.index("d_x__g_w2g_part") + 1, order  # w2's update before w1's backward
    assert order.index("upd1") == order.index("d_x__g_w1g_part") + 1, order
    B, H, F = 7, 5, 6
    rng = np.random.default_rng(ranks)
    x, d_y = rng.standard_normal((B, H)), rng.standard_normal((B, H))
    w1, w2 = rng.standard_normal((H, F)) * 0.5, rng.standard_normal((F, H)) * 0.5
    hp = dict(lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8, wd=0.1)
    tw1, tw2 = (torch.tensor(w, requires_grad=True) for w in (w1, w2))
    opt = torch.optim.AdamW([tw1, tw2], lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                            weight_decay=hp["wd"])
    cut = lambda a, r: a[slice(*slice_range(a.shape[0], ranks, r))].copy()  # noqa: E731
    state = [{"w1": cut(w1, r), "w2": cut(w2, r), **{k: np.zeros_like(cut(a, r)) for k, a in
                                                      (("m1", w1), ("v1", w1), ("m2", w2), ("v2", w2))}}
             for r in range(ranks)]
    clip, maxnorm = 1.0, 0.5
    for step in (1, 2):
        tx = torch.tensor(x, requires_grad=True)
        y = torch.nn.functional.gelu(tx @ tw1) @ tw2
        opt.zero_grad()
        y.backward(torch.tensor(d_y))
        norm = torch.nn.utils.clip_grad_norm_([tw1, tw2], float("inf")).item()
        for t in (tw1, tw2):
            t.grad.mul_(clip)  # the factor from the previous step's norm
        opt.step()
        res = run(prog, [{**state[r], "x": cut(x, r), "d_y": cut(d_y, r), "clip": clip, "step": float(step), **hp}
                         for r in range(ranks)])
        np.testing.assert_allclose(np.concatenate([r.outputs["d_x"] for r in res]), tx.grad.numpy(), rtol=1e-10)
        assert all(abs(float(r.outputs["gnorm"]) - norm) <= 1e-10 * norm for r in res), (norm, res[0].outputs)
        for r in range(ranks):
            state[r].update({k: res[r].updates[k] for k in state[r]})
        for name, t in (("w1", tw1), ("w2", tw2)):
            got = {k: np.concatenate([state[r][k] for r in range(ranks)]) for k in (name, "m" + name[1], "v" + name[1])}
            np.testing.assert_allclose(got[name], t.detach().numpy(), rtol=1e-10, err_msg=f"{name}, step {step}")
            np.testing.assert_allclose(got["m" + name[1]], opt.state[t]["exp_avg"].numpy(), rtol=1e-10)
            np.testing.assert_allclose(got["v" + name[1]], opt.state[t]["exp_avg_sq"].numpy(), rtol=1e-10)
        clip = min(maxnorm / (norm + 1e-6), 1.0)
    assert clip < 1.0  # (the second step was clipped)


def _refused_at(program: str, directive: str, where: str, message: str, target: str = "q") -> None:
    """`schedule s for TARGET { DIRECTIVE }` after PROGRAM is refused with MESSAGE at WHERE."""
    src = program + f"schedule s for {target} {{\n    {directive}\n}}\n"
    with pytest.raises(CompileError) as err:
        load_source(src, "t.ccn")
    d = err.value.diagnostics[0]
    assert message in d.message, d.message
    line = src.splitlines()[d.span.line - 1]
    assert line[d.span.col - 1:].startswith(where), (line, d.span)


SUMS = """
program q(h: f32[T, F] sliced(1), w1: f32[F, H] sliced(0), w2: f32[F, H] sliced(0)) {
    p1 = matmul(h, w1)
    p2 = matmul(h, w2)
    s = p1 + p2
    y = allreduce(sum, s)
    p3 = matmul(h, w1)
    p4 = matmul(h, w2)
    k = p3 * 2.0
    s2 = p3 + p4
    z = allreduce(sum, s2)
    return y, k, z
}
"""


@pytest.mark.parametrize("directive, where, message, good", [
    ("overlap(s, y, chunks=2, dim=1)", "1)", "a sum of matmuls ('s') is chunked along its rows (dim 0) only: "
     "overlap(s, y, chunks=2)", "overlap(s, y, chunks=2)"),
    ("overlap(s2, z, chunks=2)", "s2", "a sum of such stages that nothing else reads", None),  # k reads p3
])
def test_a_sum_of_matmuls_overlaps_along_its_rows_only(directive, where, message, good):
    """A producer that is a sum of GEMM stages (Program.summed_gemms) is chunked along dim 0, and
    only where nothing else reads its terms (they are computed inside the overlap, into its rows).
    The advice is accepted."""
    _refused_at(SUMS, directive, where, message)
    if good is not None:
        from coconetc.plan.show import show as show_plan
        ok = load_source(SUMS + f"schedule s for q {{\n    {good}\n}}\n", "t.ccn")
        assert "overlap s = matmul(h, w1) + matmul(h, w2) in 2 chunks along dim 0" in show_plan(ok.plans[("q", "s")])


def test_a_gather_or_matmul_overlapped_twice_is_refused():
    src = BAD + "schedule s for q {\n    overlap(g, y, chunks=2)\n    overlap(g, y, chunks=3)\n}\n"
    with pytest.raises(CompileError) as err:
        load_source(src, "t.ccn")
    d = err.value.diagnostics[0]
    assert "'y' is already overlapped" in d.message and d.span.line == src.count("\n", 0, src.index("chunks=3")) + 1


def test_a_reader_between_the_gather_and_its_late_matmul_is_a_located_plan_error(tmp_path):
    f = tmp_path / "late.ccn"
    f.write_text("""program late(x: f32[T, H] sliced(0), u: f32[H, F] local) {
    g = allgather(x)
    w = allreduce(sum, u)
    k = g * 2
    y = matmul(g, w)
    return y, k
}
schedule ov for late {
    overlap(g, y, chunks=2)
}
""")
    res = _cli("check", str(f))
    assert res.returncode != 0
    assert f"{f}:9:5: error: overlap: 'k' reads 'g' before 'y' can start" in res.stderr, res.stderr
    assert "compute them before 'g'" in res.stderr


# --- the derived program: an all-gather's transpose is a reduce-scatter ---------------------------
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_the_derived_sequence_parallel_mlp_reduce_scatters_and_matches_autograd(ranks):
    torch = pytest.importorskip("torch")
    src = FILE.read_text().replace("f32", "f64")
    mod = load_source(src, "g.ccn")
    grad = vjp(mod.programs["spmlp"])
    ops = [s.expr.op for s in grad.stages if hasattr(s.expr, "op")]
    assert ops.count("reducescatter") == 1 and "scatter" not in ops and "allreduce" not in ops, ops
    B, S, H, F = 2, 7, 4, 6
    rng = np.random.default_rng(ranks)
    full = {"x": rng.standard_normal((B, S, H)), "w1": rng.standard_normal((H, F)),
            "w2": rng.standard_normal((F, H)), "d_y": rng.standard_normal((B, S, H))}
    dims = {"x": 1, "w1": 1, "w2": 0, "d_y": 1}
    per_rank = []
    for r in range(ranks):
        per_rank.append({k: np.take(v, np.arange(*slice_range(v.shape[dims[k]], ranks, r)), axis=dims[k]).copy()
                         for k, v in full.items()})
    res = run(grad, per_rank)
    t = {k: torch.tensor(v, requires_grad=k != "d_y") for k, v in full.items()}
    y = torch.nn.functional.gelu(t["x"] @ t["w1"]) @ t["w2"]
    (y * t["d_y"]).sum().backward()
    for k, out in (("x", "d_x"), ("w1", "d_w1"), ("w2", "d_w2")):
        got = np.concatenate([r.outputs[out] for r in res], axis=dims[k])
        np.testing.assert_allclose(got, t[k].grad.numpy(), rtol=1e-10, atol=1e-12)


# --- compiled, against the interpreter -----------------------------------------------------------
# Every job loads the one module that holds every derived program the jobs run (a module for each
# --grad-of alone would be six builds of the same file).
GRADS = tuple(p.removesuffix("_grad") for p in PROGRAMS if p.endswith("_grad"))


def _jobs(ranks: int, *extra: str) -> tuple[list[str], list[str]]:
    sizes = [f"--size={k}={v}" for k, v in SIZES[ranks].items()]
    argv, want = [str(RUN_JOBS)], []
    grad = [f"--grad-of={g}" for g in GRADS]
    for prog, scheds in PROGRAMS.items():
        mine = [s for s in sizes if s.split("=")[1] in _symbols(prog)]
        argv += [str(FILE), "--program", prog, "--reps", "1", *grad, *extra, *(f"--schedule={s}" for s in scheds),
                 *mine, "--"]
        want += [f"{prog} [{s}]" for s in scheds]
    return argv, want


def _symbols(prog: str) -> set[str]:
    """The size symbols of a program's signature (a derived program: its program's)."""
    m = re.search(rf"^program {prog.removesuffix('_grad')}\((.*?)\)\s*\{{", FILE.read_text(), re.M | re.S)
    assert m, prog
    return set(re.findall(r"\b([A-Z])\b", m.group(1)))


def _check(ranks: int, argv: list[str], want: list[str]) -> None:
    rc, out, err = rank_pool.run(ranks, argv, timeout=900)
    log = f"--- stdout\n{out[-4000:]}\n--- stderr\n{err[-4000:]}"
    assert rc == 0, log
    lines = [ln for ln in out.splitlines() if "ranks: " in ln and " [" in ln]
    assert len(lines) == len(want), log
    for line, head in zip(lines, want):
        assert line.startswith(head) and line.endswith("matches the interpreter on every rank"), f"{line}\n{log}"


@pytest.mark.slow  # its 41 functions' units: about a minute of builds (the plans and proofs are quick)
@pytest.mark.skipif(probes.missing_cpu_extra(), reason="needs the 'cpu' extra")
def test_cpu_matches_interpreter(request):
    import coconetc
    coconetc.load(FILE, log=lambda msg: None, grad=GRADS)  # built once; the ranks import it
    for ranks in (2, 3):
        _check(ranks, *_jobs(ranks))


@pytest.mark.slow  # (the CPU backend's run of the same programs is in make test-quick)
@pytest.mark.skipif(probes.emulation_missing() is not None, reason=probes.emulation_missing() or "")
def test_cuda_emulation_matches_interpreter(request):
    from coconetc.runtime.cuda import load_emulated
    load_emulated(FILE, log=lambda msg: None, grad=GRADS)
    for ranks in (2, 3):
        argv, want = _jobs(ranks, "--emulate-cuda")
        _check(ranks, argv, [w + " (CUDA, host emulation)" for w in want])


@pytest.mark.slow
def test_compiles_and_links_with_nvcc():
    why = probes.cuda_missing()
    if why:
        pytest.skip(why)
    so = toolchain.compile(load_file(FILE), "cuda", toolchain.Options(archs="90", log=lambda m: None)).path
    assert so is not None and so.exists()


def test_the_autotuner_writes_gather_overlaps():
    """The tuner's space (tune/space.py) holds overlap(<gather>, <matmul>, chunks=k) for k in
    2, 4, 8, each planned before it is kept."""
    from coconetc.schedule.directives import OverlapD
    from coconetc.tune.space import generate
    got = dict(generate(load_file(FILE).programs["spmlp"]))
    for k in (2, 4, 8):
        assert OverlapD("g", "m", k, None, None) in got[f"auto_overlap{k}"], got  # (spans do not compare)


RSAG = """
program rsag(x: f32[B, S, H] sliced(1), u: f32[B, S, H] local, w: f32[H, F] sliced(1), v: f32[F, H] sliced(0)) {
    r = reducescatter(sum, u, dim=1)
    z = r + x
    g = allgather(z)
    m = matmul(g, w)
    p = matmul(m, v)
    t = reducescatter(sum, p, dim=1)
    q = t * 2
    return q
}
"""


def test_a_fuse_of_an_overlapped_stage_is_refused_with_advice_that_is_accepted():
    """A fuse written after an overlap that names one of its members (the usual way): the
    overlap is written on the fusion. A fused all-gather overlapped with its matmul, the fusion
    not overlapped with a matmul that makes its input: leave the gather out. Following the advice
    is accepted."""
    cases = [("overlap(p, t, chunks=2)\n    f = fuse(t, q)", "'t' is already overlapped",
              "f = fuse(t, q) and then overlap(p, f, chunks=2)", "f = fuse(t, q)\n    overlap(p, f, chunks=2)", "fuse("),
             ("overlap(g, m, chunks=2)\n    f = fuse(r, z, g)", "only inside the fusion's own overlap",
              "remove overlap(g, m, chunks=2), or leave 'g' out of 'f'", "overlap(g, m, chunks=2)\n    f = fuse(r, z)",
              "overlap(")]
    for bad, why, advice, good, at in cases:
        src = RSAG + f"schedule s for rsag {{\n    {bad}\n}}\n"
        with pytest.raises(CompileError) as err:
            load_source(src, "t.ccn")
        d = err.value.diagnostics[0]
        assert why in d.message and advice in d.message, d.message
        assert d.span.line == src.count("\n", 0, src.index(at)) + 1
        load_source(RSAG + f"schedule s for rsag {{\n    {good}\n}}\n", "t.ccn")


@pytest.mark.parametrize("bad, message, good", [
    ("f = fuse(at, x1, n, g)\n    overlap(g, m, chunks=2)",
     "'g' is gathered by the fused collective 'f', which takes it chunk for chunk to 'm' only inside the fusion's own "
     "overlap: overlap the fusion with the matmul that makes its input, with the same chunks: overlap(ap, f, chunks=2)",
     "f = fuse(at, x1, n, g)\n    overlap(g, m, chunks=2)\n    overlap(ap, f, chunks=2)"),
    ("f = fuse(at, x1, n, g)\n    overlap(ap, f, chunks=2)\n    overlap(g, m, chunks=3)",
     "'g' is gathered by the fused collective 'f' in the 2 blocks of rows (dim 0) of its overlap with 'ap', and 'm' "
     "multiplies it block for block: overlap(g, m, chunks=2)",
     "f = fuse(at, x1, n, g)\n    overlap(ap, f, chunks=2)\n    overlap(g, m, chunks=2)"),
])
def test_a_fused_gather_feeds_its_matmul_only_block_for_block(bad, message, good):
    """A fused collective's all-gather overlapped with the matmul that reads it (fed): refused at
    that overlap, located, where the fusion is not overlapped with its producer or its blocks
    differ; the advice, followed, is accepted and plans the matmul inside the fusion's overlap."""
    src = FILE.read_text()
    head = src[src.index("program fed("):src.index("schedule both for fed")]
    with pytest.raises(CompileError) as err:
        load_source(head + f"schedule s for fed {{\n    {bad}\n}}\n", "t.ccn")
    d = err.value.diagnostics[0]
    assert message in d.message, d.message
    text = head + f"schedule s for fed {{\n    {bad}\n}}\n"
    assert text.splitlines()[d.span.line - 1].strip().startswith("overlap(g, m"), d.span
    from coconetc.plan.show import show as show_plan
    mod = load_source(head + f"schedule s for fed {{\n    {good}\n}}\n", "t.ccn")
    assert "then m = matmul(g, w) per chunk" in show_plan(mod.plans[("fed", "s")])
