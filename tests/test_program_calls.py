"""Calls of programs and repeat over layers (docs/language.md, "Calling programs", "Repeating a
program over layers"): tests/programs/model.ccn's two-layer model, written with repeat and with
two calls, against NumPy written here; its derived program against finite differences and
against the two calls' per-layer gradients; compiled (CPU, and CUDA under the host emulation)
against the interpreter; examples/gpt_block.ccn's gpt_block_sp repeated over 2 layers in f64
against the block run twice, and compiled; each error at its line and column."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
from rank_checks import joined, rank_parts, run_jobs, shared_file

import coconetc.autodiff  # noqa: F401  (registers the derived programs' operations)
from coconetc.autodiff import vjp
from coconetc.errors import CompileError
from coconetc.interp.interpreter import run
from coconetc.ir.layers import layer_ranges
from coconetc.ir.nodes import Op, walk
from coconetc.sourcefile import load_source

HERE = Path(__file__).parent
MODEL = HERE / "programs" / "model.ccn"
B, H, F = 3, 4, 6
SLICED = {"w1": 2, "b1": 1, "w2": 1}  # the stacked parameters: dim 0 the layers
SLICED_CALLS = {"w1a": 1, "b1a": 0, "w2a": 0, "w1b": 1, "b1b": 0, "w2b": 0}


@pytest.fixture(scope="module")
def mod():
    return load_source(MODEL.read_text(), str(MODEL))


def _inputs(seed: int = 0, p: float = 0.0) -> dict:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((B, H)), "w1": rng.standard_normal((2, H, F)) / 2,
            "b1": rng.standard_normal((2, F)), "w2": rng.standard_normal((2, F, H)) / 2,
            "g": 1 + rng.standard_normal((2, H)) / 4, "scale": 0.7, "p": p, "seed": 7}


def _calls_inputs(a: dict) -> dict:
    """The model's inputs as model_calls takes them: layer 0's as *a, layer 1's as *b."""
    out = {k: a[k] for k in ("x", "scale", "p", "seed")}
    for k in ("w1", "b1", "w2", "g"):
        out[k + "a"], out[k + "b"] = a[k][0], a[k][1]
    return out


def _numpy_model(a: dict) -> np.ndarray:
    """Two layers of blk, in NumPy (dropout off): gelu exact, layernorm over the last dim."""
    erf = np.vectorize(math.erf)
    y = a["x"]
    for layer in range(2):
        t = y @ a["w1"][layer] + a["b1"][layer]
        h = t * 0.5 * (1 + erf(t / math.sqrt(2)))
        r = y + (h @ a["w2"][layer]) * a["scale"]
        mu, var = r.mean(-1, keepdims=True), r.var(-1, keepdims=True)
        y = (r - mu) / np.sqrt(var + 1e-5) * a["g"][layer]
    return y


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_model_matches_numpy(mod, ranks):
    a = _inputs()
    want = _numpy_model(a)
    got = joined(run(mod.program("model"), rank_parts(a, ranks, SLICED)), "y", None)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    calls = joined(run(mod.program("model_calls"), rank_parts(_calls_inputs(a), ranks, SLICED_CALLS)), "y", None)
    np.testing.assert_allclose(calls, want, rtol=1e-12, atol=1e-12)


def test_the_stages_are_named_by_call_and_layer(mod):
    """y__l<l>__<stage> for repeat (the per-layer parameters first), y0__<stage> for a call; the
    layers' ranges; each dropout its own site (its own mask), a view (no copy) of each layer."""
    p = mod.program("model")
    names = [s.name for s in p.stages]
    assert names == ["y__l0__w1", "y__l0__b1", "y__l0__w2", "y__l0__g", "y__l0__h", "y__l0__o", "y__l0__s", "y__l0__y",
                     "y__l1__w1", "y__l1__b1", "y__l1__w2", "y__l1__g", "y__l1__h", "y__l1__o", "y__l1__s", "y"]
    assert layer_ranges(p, "y") == [(0, 8), (8, 16)]
    sites = [n.attr("site") for s in p.stages for n in walk(s.expr) if isinstance(n, Op) and n.op == "dropout"]
    assert sites == ["y__l0__y#0", "y#0"]
    calls = [s.name for s in mod.program("model_calls").stages]
    assert calls == ["y0__h", "y0__o", "y0__s", "y0", "y__h", "y__o", "y__s", "y"]
    views = {b.name: (b.same_as, b.same_at) for b in mod.plans[("model", "default")].buffers if b.same_as}
    assert views == {f"y__l{k}__{w}": (w, k) for k in range(2) for w in ("w1", "b1", "w2", "g")}


@pytest.mark.parametrize("ranks", [1, 2])
def test_gradients_match_finite_differences_and_the_calls(mod, ranks):
    """The derived program of the repeated model: each stacked gradient equals the two calls'
    per-layer gradients stacked, and a directional derivative equals finite differences."""
    a = _inputs(1)
    dy = np.random.default_rng(2).standard_normal((B, H))
    g = vjp(mod.program("model"))
    res = run(g, rank_parts({**a, "d_y": dy}, ranks, SLICED))
    got = {k: joined(res, f"d_{k}", SLICED.get(k)) for k in ("x", "w1", "b1", "w2", "g")}
    gc = vjp(mod.program("model_calls"))
    rc = run(gc, rank_parts({**_calls_inputs(a), "d_y": dy}, ranks, SLICED_CALLS))
    for k in ("w1", "b1", "w2", "g"):
        per_layer = [joined(rc, f"d_{k}{s}", SLICED_CALLS.get(k + s)) for s in "ab"]
        np.testing.assert_allclose(got[k], np.stack(per_layer), rtol=1e-10, atol=1e-12, err_msg=k)
    if ranks > 1:
        return
    rng = np.random.default_rng(3)
    for k in ("x", "w1", "b1", "w2", "g"):
        v = rng.standard_normal(a[k].shape)
        eps = 1e-6
        loss = [float((_numpy_model({**a, k: a[k] + s * eps * v}) * dy).sum()) for s in (1, -1)]
        np.testing.assert_allclose((got[k] * v).sum(), (loss[0] - loss[1]) / (2 * eps), rtol=1e-6, err_msg=k)


@pytest.mark.parametrize("backend", ["cpu", pytest.param("emulate", marks=pytest.mark.slow)])
def test_compiled_against_the_interpreter(backend):
    """The repeated model, its derived program (and on the CPU the two calls), compiled, against
    the interpreter on 2 ranks (random inputs, dropout included): on the CPU, and the CUDA code
    under the host emulation (one launch each)."""
    sizes = [f"--size={k}={v}" for k, v in dict(B=B, H=H, F=F).items()]
    progs = ("model", "model_grad", "model_calls") if backend == "cpu" else ("model", "model_grad")
    extra = ["--emulate-cuda"] if backend == "emulate" else []
    scheds = {"model": ["default", "split0"]}
    out = run_jobs(2, [[str(MODEL), "--program", p, "--grad-of", "model", "--reps", "1", *sizes, *extra,
                        *(f"--schedule={s}" for s in scheds.get(p, ["default"]))] for p in progs])
    label = r" \(CUDA, host emulation\)" if extra else ""
    for p in progs:
        for s in scheds.get(p, ["default"]):
            assert re.search(rf"^{p} \[{s}\]{label}: 2 ranks: .* matches the interpreter on every rank", out, re.M), out


def test_printed_programs_read_back(mod):
    """The inlined program (index included), its schedule and its derived program (unindex)
    print as text that checks back to the same stages."""
    from coconetc.autodiff.text import check_text
    from coconetc.ir.printer import program as printed
    for p in (mod.program("model"), mod.schedule("model", "split0").ir, vjp(mod.program("model"))):
        assert check_text(printed(p))[p.name].stages == p.stages, p.name


def test_the_schedule_computes_the_program(mod):
    a = _inputs(5, p=0.3)
    for ranks in (1, 2):
        want = joined(run(mod.program("model"), rank_parts(a, ranks, SLICED)), "y", None)
        got = joined(run(mod.schedule("model", "split0").ir, rank_parts(a, ranks, SLICED)), "y", None)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


# --- gpt_block_sp repeated over 2 layers (f64: the f32 block has a known small mismatch) ---------
GPT = HERE.parent / "examples" / "gpt_block.ccn"
GB, GS, GH, GNH = 2, 5, 8, 4
GDIMS = dict(B=GB, S=GS, H=GH, NH=GNH, HD=GH // GNH, F=4 * GH)
STACKED = {"ln1_w": None, "ln1_b": None, "wq": 1, "bq": 0, "wk": 1, "wv": 1, "bv": 0, "wo": 0, "bo": None,
           "ln2_w": None, "ln2_b": None, "w_fc": 1, "b_fc": 0, "w_proj": 0, "b_proj": None}


def _gpt_text() -> str:
    """gpt_block_sp alone (f64), and gpt2: it repeated over 2 layers of stacked parameters."""
    src = GPT.read_text().replace("f32", "f64")
    prog = load_source(src).program("gpt_block_sp")
    lines = src.splitlines()
    block = "\n".join(lines[prog.span.line - 1:prog.span.end_line])
    shapes = {p.name: p.type for p in prog.params}
    params = ["x: f64[B, S, H] sliced(1)"]
    for k, d in STACKED.items():
        lay = f"sliced({d + 1})" if d is not None else "replicated"
        params.append(f"{k}: f64[2, {', '.join(map(str, shapes[k].shape))}] {lay}")
    params += ["scale: f64", "pdrop: f64", "seed: i64"]
    args = ", ".join(["x", *STACKED, "scale", "pdrop", "seed"])
    return (f"{block}\n\nprogram gpt2({', '.join(params)}) {{\n"
            f"    y = repeat(gpt_block_sp, {args})\n    return y\n}}\n")


@pytest.fixture(scope="module")
def gpt_file(request) -> Path:
    return shared_file(request, "program-calls", "gpt2.ccn", _gpt_text())


def test_gpt_block_repeated_is_the_block_twice(gpt_file):
    """On 2 ranks (S = 5: uneven slices), dropout off: gpt2 equals gpt_block_sp run twice with
    each layer's parameters (the interpreter)."""
    m = load_source(gpt_file.read_text())
    rng = np.random.default_rng(4)
    shapes = {p.name: tuple(int(GDIMS.get(d, d)) for d in p.type.shape) for p in m.program("gpt2").params
              if not p.scalar}
    a = {k: rng.standard_normal(s) / 2 for k, s in shapes.items()}
    a.update(scale=1 / math.sqrt(GH // GNH), pdrop=0.0, seed=3)
    sliced = {"x": 1, "y": 1, **{k: d + 1 for k, d in STACKED.items() if d is not None}}
    got = joined(run(m.program("gpt2"), rank_parts(a, 2, sliced)), "y", 1)
    one = {"x": 1, "y": 1, **{k: d for k, d in STACKED.items() if d is not None}}
    y = a["x"]
    for layer in range(2):
        args = {**a, "x": y, **{k: a[k][layer] for k in STACKED}}
        y = joined(run(m.program("gpt_block_sp"), rank_parts(args, 2, one)), "y", 1)
    np.testing.assert_allclose(got, y, rtol=1e-12, atol=1e-12)


@pytest.mark.slow  # a build of its own (about 30 s cold); test_compiled_against_the_interpreter compiles the same paths
def test_gpt_block_repeated_compiled_on_2_ranks(gpt_file):
    """gpt2 compiled (CPU) against the interpreter on 2 ranks, random inputs with dropout."""
    sizes = [f"--size={k}={v}" for k, v in GDIMS.items()]
    out = run_jobs(2, [[str(gpt_file), "--program", "gpt2", "--reps", "1", *sizes]])
    assert re.search(r"^gpt2 \[default\]: 2 ranks: .* matches the interpreter on every rank", out, re.M), out


# --- errors, each at its line and column ---------------------------------------------------------
BLK = """program f(x: f32[N] replicated, w: f32[N] replicated, s: f32) {
    t = x * w
    y = t + s
    return y
}
"""
ERRORS = [
    ("argument count", "program g(x: f32[N] replicated) {\n    y = f(x, x, 1.0, x)\n    return y\n}\n",
     8, 22, "takes at most 3 arguments, got 4"),
    ("missing argument", "program g(x: f32[N] replicated) {\n    y = f(x, x)\n    return y\n}\n",
     8, 9, "missing its argument 's'"),
    ("layout", "program g(x: f32[N] sliced, w: f32[N] replicated) {\n    y = f(x, w, 1.0)\n    return y\n}\n",
     8, 11, "'x' is f32[N] replicated; the argument is sliced(0)"),
    ("size symbol", "program g(x: f32[N] replicated, w: f32[M] replicated) {\n    y = f(x, w, 1.0)\n    return y\n}\n",
     8, 14, "size 'N' is N by an earlier argument, M here"),
    ("direct recursion", "program g(x: f32[N] replicated) {\n    y = g(x)\n    return y\n}\n",
     8, 9, "recursive call: g -> g"),
    ("indirect recursion", "program g(x: f32[N] replicated) {\n    y = h(x)\n    return y\n}\n"
     "program h(x: f32[N] replicated) {\n    y = g(x)\n    return y\n}\n",
     8, 9, "recursive call: g -> h -> g"),
    ("nested call", "program g(x: f32[N] replicated) {\n    y = relu(f(x, x, 1.0))\n    return y\n}\n",
     8, 14, "must be the whole right-hand side"),
    ("names taken", "program g(x: f32[N] replicated) {\n    y__t = x\n    y = f(x, x, 1.0)\n    return y\n}\n",
     9, 9, "names a stage 'y__t', which is already defined"),
    ("later name", "program g(x: f32[N] replicated) {\n    z = f(x, x, 1.0)\n    z__t = x\n    return z\n}\n",
     9, 5, "'z__t' is already defined (a stage of the call of f at line 8)"),
    ("returns", "program g(x: f32[N] replicated) {\n    a, b = f(x, x, 1.0)\n    return a\n}\n",
     8, 12, "f() returns 1 value (y); 2 names given"),
    ("symbolic layers", "program g(x: f32[N] replicated, w: f32[L, N] replicated) {\n"
     "    y = repeat(f, x, w, 1.0)\n    return y\n}\n",
     8, 22, "'L', a size symbol; write it as an integer literal"),
    ("no stacked argument", "program g(x: f32[N] replicated) {\n    y = repeat(f, x, x, 1.0)\n    return y\n}\n",
     8, 9, "needs a stacked argument"),
    ("carried layout", "program k(x: f32[N] sliced, w: f32[N] replicated) {\n    y = allgather(x * w)\n    return y\n}\n"
     "program g(x: f32[N] sliced, w: f32[2, N] replicated) {\n    y = repeat(k, x, w)\n    return y\n}\n",
     12, 9, "a layer's result must be the next layer's input"),
    ("update", "program k(x: f32[N] replicated, w: f32[N] replicated) {\n    w1 = update(w, x)\n    return x\n}\n"
     "program g(x: f32[N] replicated) {\n    y = k(x, x)\n    return y\n}\n",
     12, 9, "a called program may not update its parameters"),
    ("own derived program", "program g(x: f32[N] replicated) {\n    y = exp(x)\n    d = g_grad(x, y)\n"
     "    return y\n}\n", 9, 9, "recursive call: g -> g_grad (the derived program of 'g')"),
    ("random derived program", "program k(x: f32[N] replicated, seed: i64) {\n    y = dropout(x, 0.5, seed)\n"
     "    return y\n}\nprogram g(x: f32[N] replicated) {\n    d = k_grad(x, 1, x)\n    return d\n}\n",
     12, 9, "draws random numbers (dropout)"),
]


@pytest.mark.parametrize("source,line,col,fragment", [c[1:] for c in ERRORS], ids=[c[0] for c in ERRORS])
def test_call_errors_at_line_and_column(source, line, col, fragment):
    with pytest.raises(CompileError) as e:
        load_source(BLK + "\n" + source)
    found = [(d.span.line, d.span.col, d.message) for d in e.value.diagnostics]
    assert any((d.span.line, d.span.col) == (line, col) and fragment in d.message for d in e.value.diagnostics), found


def test_a_program_calls_a_derived_program_by_its_name():
    """`f_grad(...)` and `f_bwd(...)` in a program (the derived program of f and the backward of
    its training cut, by the names the file gives them) are inlined as any call: the
    interpreter's results against NumPy, whichever of f and its caller comes first."""
    f = BLK.replace("y = t + s", "y = exp(t) + s")
    g = ("program g(x: f64[N] replicated, w: f64[N] replicated, d: f64[N] replicated) {\n"
         "    d_x, d_w = f_grad(x, w, 1.5, d)\n    b_x, b_w = f_bwd(x, w, 1.5, x * w, d)\n"
         "    z = d_x * d_w + b_x - b_w\n    return z\n}\n")
    rng = np.random.default_rng(0)
    x, w, d = (rng.standard_normal(5) for _ in range(3))
    gx, gw = d * np.exp(x * w) * w, d * np.exp(x * w) * x
    outer = ("program k(x: f64[N] replicated, w: f64[N] replicated, d: f64[N] replicated) {\n"
             "    z = g(x, w, d)\n    return z\n}\n")  # (g's derived calls inlined through k, defined before g)
    for text in (f + g, g + f, outer + g + f):
        mod = load_source(text.replace("f32", "f64"))
        for name in ("g", "k") if text.startswith(outer) else ("g",):
            [res] = run(mod.programs[name], [{"x": x, "w": w, "d": d}])
            np.testing.assert_allclose(res.outputs["z"], gx * gw + gx - gw, rtol=1e-13)
    assert [s.name for s in mod.programs["g"].stages][:2] == ["d_x__t", "d_x__y_exp"]  # (named by the call)


def test_stacked_dims_that_disagree():
    src = BLK + ("\nprogram g(x: f32[N] replicated, w: f32[2, N] replicated, v: f32[3, N] replicated) {\n"
                 "    y = repeat(f, x, w, 1.0)\n    return y\n}\n"
                 "program k(x: f32[N] replicated, w: f32[N] replicated, v: f32[N] replicated) {\n"
                 "    y = x * w * v\n    return y\n}\n"
                 "program h(x: f32[N] replicated, w: f32[2, N] replicated, v: f32[3, N] replicated) {\n"
                 "    y = repeat(k, x, w, v)\n    return y\n}\n")
    with pytest.raises(CompileError) as e:
        load_source(src)
    assert [(d.span.line, d.span.col) for d in e.value.diagnostics] == [(16, 25)], e.value.render()
    assert "the argument for 'v' stacks 3 layers, the one for 'w' 2" in e.value.diagnostics[0].message


def test_the_language_reference_shows_the_tested_example():
    doc = (HERE.parent / "docs" / "language.md").read_text()
    assert MODEL.read_text().split("\n", 3)[3] in doc


def test_the_backward_recomputes_the_layers_of_the_stacked_parameters(mod):
    """The derived program cut at the saved values (autodiff/saved.py): the layers index(w, l)
    are recomputed by the backward (views of w), not saved; forward then backward give the
    derived program's gradients."""
    from coconetc.sourcefile import with_grads
    m = with_grads(mod, ["model"])
    fwd, bwd = m.program("model_fwd"), m.program("model_bwd")
    saved = [pub.removeprefix("saved_") for pub, _ in fwd.outputs[1:]]
    assert saved and not [s for s in saved if re.fullmatch(r"y__l\d__(w1|b1|w2|g)", s)], saved
    a, dy = _inputs(6), np.random.default_rng(7).standard_normal((B, H))
    f = run(fwd, rank_parts(a, 2, SLICED))
    parts = rank_parts({**a, "d_y": dy}, 2, SLICED)
    for r, res in enumerate(f):
        parts[r].update({s: res.outputs[f"saved_{s}"] for s in saved})
    got, want = run(bwd, parts), run(m.program("model_grad"), rank_parts({**a, "d_y": dy}, 2, SLICED))
    for pub, _ in m.program("model_grad").outputs:
        k = pub.removeprefix("d_")
        np.testing.assert_allclose(joined(got, pub, SLICED.get(k)), joined(want, pub, SLICED.get(k)), rtol=1e-12,
                                   atol=1e-14, err_msg=pub)


def test_a_stacked_weight_of_more_than_2_dims_gets_its_gradient_made_in_its_rows():
    """examples/gpt_pipeline.ccn's derived program: each layer's q, k, v and o weight gradient
    is `reshape(matmul_tn(x, g))` ([H, NH * HD] read as [H, NH, HD]); the GEMM's result is made
    straight into its row of the stacked gradient, the reshape a view of it (plan/targets.py,
    assembled_stacks): no unindex, no sum of stacked buffers for them. (tests/test_train_gpt.py's
    --from-schedule run compiles these rows and trains against one process.)"""
    from coconetc.plan import plan_program
    from coconetc.plan.units import Library
    from coconetc.sourcefile import load_file
    plan = plan_program(vjp(load_file(HERE.parent / "examples" / "gpt_pipeline.ccn").program("gpt")))
    bufs = {b.name: b for b in plan.buffers}
    for w, made in (("wq", "q_reshape"), ("wk", "k_reshape"), ("wv", "v_reshape"), ("wo", "ap_reshape")):
        for k in range(4):
            got = bufs[f"g_y__l{k}__{made}"]
            assert (got.same_as, got.same_at) == (f"d_{w}", k), got
            assert bufs[f"g_y__l{k}__{w}"].same_as == got.name  # the [H, NH, HD] reshape: a view of it
    unindexed = [u.args[0] for u in plan.units if isinstance(u, Library) and u.op == "unindex"]
    assert not [n for n in unindexed if re.search(r"__(wq|wk|wv|wo|bq|bv)$", n)], unindexed
    # its accumulating cut (what a pipeline's stage runs after its first micro-batch): each
    # weight gradient's GEMM adds into its row of the accumulator (beta = 1, every backend,
    # plan/targets.py accumulated_in_place), no loop adds a stacked gradient into it
    from coconetc.autodiff.saved import acc_name, bwd_name
    from coconetc.plan.units import Loop
    from coconetc.sourcefile import with_grads
    acc = with_grads(load_file(HERE.parent / "examples" / "gpt_pipeline.ccn"), ["gpt:x+acc"]).plans[
        (acc_name(bwd_name("gpt")), "default")]
    bufs = {b.name: b for b in acc.buffers}
    gemms = {u.dst: u for u in acc.units if isinstance(u, Library) and u.op == "matmul_tn"}
    for w, made in (("wq", "q_reshape"), ("wo", "ap_reshape"), ("w_fc", "w_fc"), ("w_proj", "w_proj")):
        for k in range(4):
            g = f"g_y__l{k}__{made}"
            assert gemms[g].accumulate and (bufs[g].same_as, bufs[g].same_at) == (f"d_{w}_acc", k), bufs[g]
        assert bufs[f"d_{w}_acc"].kind == "alias" and f"d_{w}" not in bufs
    summed = [it.name for u in acc.units if isinstance(u, Loop) for it in u.items if it.name.startswith("d_w")]
    assert summed == [], summed


# --- programs imported from another file ---------------------------------------------------------
BLOCK_FILE = """program blk(x: f64[B, H] replicated, w: f64[H, H] replicated) {
    y = x + matmul(x, w)
    return y
}

program twice(x: f64[B, H] replicated, w: f64[H, H] replicated) {
    a = blk(x, w)
    y = blk(a, w)
    return y
}
"""


def test_an_imported_program_is_called_as_the_files_own(tmp_path) -> None:
    """`from "other.ccn" import p`: p (and what it calls there) inlined; the other file's
    programs are not this file's."""
    import numpy as np

    from coconetc.interp.interpreter import run
    from coconetc.sourcefile import load_file
    (tmp_path / "blocks.ccn").write_text(BLOCK_FILE)
    (tmp_path / "model.ccn").write_text('from "blocks.ccn" import twice\n\n'
                                        "program model(x: f64[B, H] replicated, w: f64[H, H] replicated) {\n"
                                        "    y = twice(x, w)\n    return y\n}\n")
    mod = load_file(tmp_path / "model.ccn")
    assert list(mod.programs) == ["model"]
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((2, 3)), rng.standard_normal((3, 3))
    got = run(mod.programs["model"], [{"x": x, "w": w}])[0].outputs["y"]
    a = x + x @ w
    np.testing.assert_allclose(got, a + a @ w, rtol=1e-12)


@pytest.mark.parametrize("line, other, at, says", [
    ('from "nowhere.ccn" import blk', None, '"nowhere.ccn"', "no file 'nowhere.ccn' to import from"),
    ('from "blocks.ccn" import blk, nope', BLOCK_FILE, "nope", "blocks.ccn has no program 'nope' (its programs: blk, twice)"),
    ('from "blocks.ccn" import twice', BLOCK_FILE, "twice", "program 'blk' (imported from blocks.ccn, which twice calls) "
                                                            "is defined in this file too"),
    ('from "blocks.ccn" import blk', "op sq(x) = x * x\n" + BLOCK_FILE, '"blocks.ccn"', "declares operations"),
])
def test_a_bad_import_is_located(tmp_path, line: str, other: str | None, at: str, says: str) -> None:
    from coconetc.errors import CompileError
    from coconetc.sourcefile import load_file
    if other is not None:
        (tmp_path / "blocks.ccn").write_text(other)
    text = (line + "\n\nprogram blk(x: f64[N] local) {\n    y = x + x\n    return y\n}\n"
            if "twice" in line and "nope" not in line else line + "\n")
    (tmp_path / "model.ccn").write_text(text)
    with pytest.raises(CompileError) as err:
        load_file(tmp_path / "model.ccn")
    d = err.value.diagnostics[0]
    assert says in d.message, d.message
    assert (d.span.line, d.span.col) == (1, line.index(at) + 1), (d.span, d.message)
