"""Custom operations (docs/language.md, "Defined operations" and "Extern operations"):
`op NAME(params) = expr` through the checker, the interpreter (against NumPy written here),
every schedule, fusion and the compiled CPU backend on 2 and 3 ranks; `extern op` with a
Python reference and a C++ library linked with -I/-L/-l; the located errors of both."""

from __future__ import annotations

import re

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from coconetc.sourcefile import load_file, load_source
from coconetc.errors import CompileError
from coconetc.interp.interpreter import run
from coconetc.ir import ops
from coconetc.ir.nodes import Op, walk
from coconetc.plan.units import Fused

REPO = Path(__file__).resolve().parents[1]
CUSTOM = REPO / "tests" / "programs" / "custom_ops.ccn"
COCONETC = str(Path(sys.executable).parent / "coconetc")


# --- NumPy, written independently of the compiler ------------------------------------------

def np_gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))


def np_train(gs, w, m, lr):
    """custom_ops.ccn's train: the new m, the new w and n, from every rank's g."""
    g1 = np.sum(gs, axis=0, dtype=np.float64)
    m1 = m + 0.1 * (g1 - m)
    u = m1 + 0.25 * (np_gelu_tanh(m1) - m1)
    w1 = w - lr * np.clip(u, -1.0, 1.0)
    return m1, w1, np.sqrt(np.sum(w1 * w1) / 4.0)


def _train_inputs(ranks: int, n: int, seed: int = 3):
    rng = np.random.default_rng(seed)
    gs = [rng.standard_normal(n).astype(np.float32) for _ in range(ranks)]
    w, m = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    lr = np.float32(0.3)
    return gs, w, m, lr


def _close(got, want, what):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5, atol=2e-5, err_msg=what)


# --- defined operations: checker, interpreter, schedules -------------------------------------

def test_definitions_expand_into_builtin_operations():
    mod = load_file(CUSTOM)
    p = mod.programs["train"]
    names = {n.op for s in p.stages for n in walk(s.expr) if isinstance(n, Op)}
    assert names <= set(ops.REGISTRY) and "tanh" in names and "sum" in names
    assert not {"lerp", "gelu_tanh", "clip", "step", "rms"} & set(ops.REGISTRY)  # file scope only
    assert p.stage("w1").type == p.param("w").type  # typed from the call's operands


@pytest.mark.parametrize("ranks", [2, 3])
def test_interpreter_runs_every_schedule_as_numpy(ranks):
    mod = load_file(CUSTOM)
    gs, w, m, lr = _train_inputs(ranks, 11)
    m1, w1, n = np_train(gs, w.astype(np.float64), m.astype(np.float64), float(lr))
    for sched in ("default", "rs_c_ag", "fused"):
        ir = mod.programs["train"] if sched == "default" else mod.schedule("train", sched).ir
        inputs = [dict(g=gs[r].copy(), w=w.copy(), m=m.copy(), lr=lr) for r in range(ranks)]
        for r, res in enumerate(run(ir, inputs)):
            _close(res.updates["m"], m1, f"{sched} rank {r} m")
            _close(res.updates["w"], w1, f"{sched} rank {r} w")
            _close(res.outputs["n"], n, f"{sched} rank {r} n")


def test_a_pointwise_definition_runs_inside_the_fused_collective():
    mod = load_file(CUSTOM)
    fused = [u for u in mod.plans[("train", "fused")].units if isinstance(u, Fused)]
    assert len(fused) == 1
    inside = {n.op for ph in fused[0].phases for it in ph.items for n in walk(it.expr) if isinstance(n, Op)}
    assert {"tanh", "min", "max"} <= inside  # gelu_tanh and clip, chunk by chunk


def test_parameters_take_their_types_from_the_call_with_broadcasting():
    src = textwrap.dedent("""\
        op affine(x, a, b) = a * x + b
        op both(x, a) = affine(x, a, a) - affine(a, x, 1)
        program p(x: f32[B, H] local, a: f32[H] replicated, d: f64[H] replicated) {
            s = allreduce(sum, x)
            y = both(s, a)
            z = affine(d, 2, 0.5)
            return y, z
        }
        """)
    p = load_source(src, "bc.ccn").programs["p"]
    assert p.stage("y").type.shape == ("B", "H") and p.stage("z").type.dtype == "f64"
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((3, 4)).astype(np.float32) for _ in range(2)]
    a, d = rng.standard_normal(4).astype(np.float32), rng.standard_normal(4)
    s = xs[0].astype(np.float64) + xs[1]
    want_y = (a * s + a) - (s * a + 1)
    res = run(p, [dict(x=x, a=a, d=d) for x in xs])
    for r in res:
        _close(r.outputs["y"], want_y, "y")
        _close(r.outputs["z"], 2 * d + 0.5, "z")


def test_a_definition_with_a_reduction_moves_onto_slices():
    src = textwrap.dedent("""\
        op meansq(x, n) = sum(x * x) / n
        op normalize(x, n) = x / sqrt(meansq(x, n) + 1e-6)
        program p(g: f32[N] local) {
            s = allreduce(sum, g)
            y = normalize(s, 7.0)
            return y
        }
        schedule sl for p {
            rs, ag = split(s)
            agy = reorder(ag, y)
        }
        """)
    mod = load_source(src, "red.ccn")
    rng = np.random.default_rng(1)
    gs = [rng.standard_normal(7).astype(np.float32) for _ in range(3)]
    s = np.sum(gs, axis=0, dtype=np.float64)
    want = s / np.sqrt(np.sum(s * s) / 7.0 + 1e-6)
    for ir in (mod.programs["p"], mod.schedule("p", "sl").ir):
        for r in run(ir, [dict(g=g) for g in gs]):
            _close(r.outputs["y"], want, "y")


# --- located errors --------------------------------------------------------------------------

PROGRAM = "program p(x: f32[N] local) {\n    s = allreduce(sum, x)\n    y = %s\n    return y\n}\n"


def _error(src: str):
    with pytest.raises(CompileError) as info:
        load_source(src, "bad.ccn")
    return info.value.diagnostics


@pytest.mark.parametrize(("defs", "call", "line", "col", "needle"), [
    ("op lerp(a, b, t) = a + t * (b - a)\n", "lerp(s, s)", 4, 9, "lerp() takes 3 arguments"),
    ("op lerp(a, b, t) = a + t * (b - a)\n", "lerp(s, s, 1, 2)", 4, 9, "got 4"),
    ("op f(a) = a * y\n", "f(s)", 1, 15, "unknown name 'y' in the body of 'f'"),
    ("op f(a) = a\nop g(a) = nosuch(a) + f(a)\n", "g(s)", 2, 11, "unknown operation 'nosuch'"),
    ("op f(a) = f(a) + 1\n", "f(s)", 1, 4, "operation 'f' is recursive (f -> f)"),
    ("op f(a) = g(a)\nop g(a) = 2 * f(a)\n", "f(s)", 1, 4, "recursive (f -> g -> f)"),
    ("op f(a) = allreduce(sum, a)\n", "f(s)", 1, 11, "communicates"),
    ("op sqrt(a) = a\n", "s", 1, 4, "'sqrt' is a built-in operation"),
    ("op f(a) = a\nop f(b) = b\n", "f(s)", 2, 4, "defined twice"),
    ("op f(a, a) = a\n", "s", 1, 4, "parameter 'a' of 'f' is declared twice"),
    ("op f(a) = sqrt(a, a)\n", "f(s)", 1, 19, "sqrt() takes at most 1 argument"),
    ("op f(a, b) = a + b\n", "f(s, b=1, c=2)", 4, 9, "f() takes 2 arguments"),
])
def test_errors_are_located(defs, call, line, col, needle):
    diags = _error(defs + PROGRAM % call)
    first = diags[0]
    assert (first.span.line, first.span.col) == (line, col) and needle in first.message, diags


def test_a_type_error_in_a_body_is_reported_at_the_call():
    src = "op mix(a, b) = a + b\nprogram p(x: f32[N] local, y: f32[M] local) {\n    z = mix(x, y)\n    return z\n}\n"
    (d,) = _error(src)
    assert (d.span.line, d.span.col) == (3, 9)
    assert "do not broadcast" in d.message and "line 1" in d.message


def test_mutual_recursion_is_reported_at_each_definition_once_and_calls_are_skipped():
    src = "op f(a) = g(a)\nop g(a) = f(a)\n" + PROGRAM % "f(s) + g(s)"
    assert [(d.span.line, d.span.col) for d in _error(src)] == [(1, 4), (2, 4)]


def test_op_stays_a_name_outside_definitions():
    src = "program p(x: f32[N] local) {\n    op = reducescatter(op=sum, x=x)\n    return op\n}\n"
    assert load_source(src, "soft.ccn").programs["p"].stage("op") is not None


# --- extern operations ----------------------------------------------------------------------

REF = """\
import numpy as np

def scale_rows(x, w):
    return x * w / (1.0 + np.abs(x).sum(axis=-1, keepdims=True))
"""
HEADER = """\
#pragma once
#include <cstdint>
void scale_rows(const float* x, const float* w, float* y, int64_t rows, int64_t cols);
"""
LIBRARY = """\
#include "scale_rows.h"
#include <cmath>
void scale_rows(const float* x, const float* w, float* y, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    double s = 0;
    for (int64_t c = 0; c < cols; ++c) s += std::fabs(x[r * cols + c]);
    for (int64_t c = 0; c < cols; ++c) y[r * cols + c] = float(x[r * cols + c] * w[c] / (1.0 + s));
  }
}
"""
EXTERN = """\
extern op scale_rows(x, w) {{
    type = x
    slicing = {slicing}
    reference = "{reference}"
    cpp = "scale_rows.h", "scale_rows"
}}
op shifted(x, w) = scale_rows(x, w) + 1
program layer(y: f32[B, H] local, w: f32[H] replicated) {{
    s = allreduce(sum, y)
    h = shifted(s, w) * 2
    return h
}}
schedule rows for layer {{
    rs, ag = split(s)
    agh = reorder(ag, h)
}}
"""


def np_scale_rows(x, w):
    return x * w / (1.0 + np.abs(x).sum(axis=-1, keepdims=True))


def _extern_file(tmp_path: Path, slicing="dims(0)", reference="myref:scale_rows", body=EXTERN) -> Path:
    (tmp_path / "myref.py").write_text(REF)
    f = tmp_path / "ext.ccn"
    f.write_text(body.format(slicing=slicing, reference=reference))
    return f


def test_extern_operation_runs_its_reference_in_every_schedule(tmp_path):
    mod = load_file(_extern_file(tmp_path))
    entry = mod.externs["scale_rows"]
    assert ops.get("scale_rows") is entry and entry.extern is not None and entry.slice_dims == (0,)
    rng = np.random.default_rng(2)
    ys = [rng.standard_normal((5, 3)).astype(np.float32) for _ in range(2)]
    w = rng.standard_normal(3).astype(np.float32)
    want = (np_scale_rows(ys[0] + ys[1].astype(np.float64), w) + 1) * 2
    for ir in (mod.programs["layer"], mod.schedule("layer", "rows").ir):
        for r in run(ir, [dict(y=y, w=w) for y in ys]):
            _close(r.outputs["h"], want, "h")


def test_extern_slicing_is_checked_by_reorder(tmp_path):
    body = EXTERN.replace("rs, ag = split(s)", "rs, ag = split(s, dim=1)")
    for slicing, needle in (("dims(0)", "only along dim 0, not dim 1"), ("rows", "works on the last dim"),
                            ("none", "does not commute"), ("free", "not cut by the slice")):
        with pytest.raises(CompileError) as info:
            load_file(_extern_file(tmp_path, slicing, body=body))
        d = info.value.diagnostics[0]
        assert d.span.line == 15 and needle in d.message, (slicing, d.message)
    # along dim 0 (rows) every slicing but none moves it
    for slicing in ("dims(0)", "rows", "free"):
        assert load_file(_extern_file(tmp_path, slicing)).schedule("layer", "rows").ir


@pytest.mark.parametrize(("change", "line", "needle"), [
    (("myref:scale_rows", "nomodule:scale_rows"), 4, "cannot import the reference module 'nomodule'"),
    (("myref:scale_rows", "myref:nofunction"), 4, "has no function 'nofunction'"),
    (("myref:scale_rows", "missing/file.py:f"), 4, "no file"),
    (("myref:scale_rows", "myref"), 4, "must be 'module:function'"),
    (("type = x", "type = z"), 2, "names the parameter"),
    (("slicing = dims(0)", "slicing = sideways"), 3, "slicing is one of"),
    (("slicing = dims(0)", "colour = dims(0)"), 3, "unknown setting 'colour'"),
    (('    cpp = "scale_rows.h", "scale_rows"\n', ""), 1, "needs 'cpp = ...'"),
    (('"scale_rows.h", "scale_rows"', '"scale_rows.h", "not a name"'), 5, "not a C++ function name"),
    (("h = shifted(s, w) * 2", "h = scale_rows(s) * 2"), 10, "missing its argument 'w'"),
    (("extern op scale_rows(x, w)", "extern op sqrt(x, w)"), 1, "'sqrt' is a built-in operation"),
])
def test_extern_misuse_is_located(tmp_path, change, line, needle):
    f = _extern_file(tmp_path)
    f.write_text(f.read_text().replace(*change))
    with pytest.raises(CompileError) as info:
        load_file(f)
    d = info.value.diagnostics[0]
    assert d.span.line == line and needle in d.message, info.value.diagnostics


def test_an_extern_declared_in_another_file_is_unknown_here(tmp_path):
    load_file(_extern_file(tmp_path))
    src = "program p(x: f32[B, H] local, w: f32[H] replicated) {\n    y = scale_rows(x, w)\n    return y\n}\n"
    (d,) = _error(src)
    assert (d.span.line, d.span.col) == (2, 9) and "unknown operation 'scale_rows'" in d.message


def test_cuda_renderer_refuses_an_extern_without_a_cuda_implementation(tmp_path):
    from coconetc.codegen.cuda import problems
    mod = load_file(_extern_file(tmp_path))
    found = problems(mod)
    assert set(found) == {("layer", "default"), ("layer", "rows")}
    assert all("declares no cuda implementation" in errs[0].what for errs in found.values())


# --- compiled: the CPU backend on 2 and 3 ranks -------------------------------------------------

def _saved(path: Path) -> dict[int, dict[str, np.ndarray]]:
    out: dict[int, dict[str, np.ndarray]] = {}
    with np.load(path) as z:
        for k in z.files:
            r, rest = k.split(".", 1)
            out.setdefault(int(r[1:]), {})[rest] = z[k]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 3])
def test_compiled_defined_ops_match_numpy_in_every_schedule(tmp_path, ranks):
    save = tmp_path / "res.npz"
    res = subprocess.run([COCONETC, "run", str(CUSTOM), "--ranks", str(ranks), "-s", "all", "--size", "N=23",
                          "--save", str(save)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("matches the interpreter on every rank") == 3, res.stdout
    for sched in ("default", "rs_c_ag", "fused"):
        got = _saved(tmp_path / f"res.{sched}.npz")
        gs = [got[r]["in.g"] for r in range(ranks)]
        m1, w1, n = np_train(gs, got[0]["in.w"].astype(np.float64), got[0]["in.m"].astype(np.float64),
                             float(got[0]["in.lr"]))
        for r in range(ranks):
            _close(got[r]["out.m"], m1, f"{sched} rank {r} m")
            _close(got[r]["out.w"], w1, f"{sched} rank {r} w")
            _close(got[r]["out.n"], n, f"{sched} rank {r} n")


@pytest.mark.slow
def test_compiled_extern_links_a_library_with_include_and_library_dirs(tmp_path):
    inc, lib = tmp_path / "include", tmp_path / "lib"
    inc.mkdir()
    lib.mkdir()
    (inc / "scale_rows.h").write_text(HEADER)
    (tmp_path / "scale_rows.cpp").write_text(LIBRARY)
    subprocess.run(["c++", "-O2", "-shared", "-fPIC", f"-I{inc}", str(tmp_path / "scale_rows.cpp"),
                    "-o", str(lib / "libscalerows.so")], check=True)
    f = _extern_file(tmp_path)
    save = tmp_path / "res.npz"
    res = subprocess.run([COCONETC, "run", str(f), "--ranks", "2", "-s", "all", "--size", "B=5", "--size", "H=3",
                          "-I", str(inc), "-L", str(lib), "-l", "scalerows", "--save", str(save)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("matches the interpreter on every rank") == 2, res.stdout
    got = _saved(tmp_path / "res.rows.npz")
    s = got[0]["in.y"].astype(np.float64) + got[1]["in.y"]
    for r in range(2):
        _close(got[r]["out.h"], (np_scale_rows(s, got[0]["in.w"]) + 1) * 2, f"rank {r}")
    # without the library the build fails and says so
    res = subprocess.run([COCONETC, "compile", str(f), "-o", str(tmp_path / "nolib")],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode != 0 and "scale_rows" in res.stdout + res.stderr


@pytest.mark.slow
def test_the_extern_example_runs_every_schedule_compiled():
    res = subprocess.run([COCONETC, "run", str(REPO / "examples" / "extern_ops.ccn"), "--ranks", "2",
                          "--schedule", "all"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("matches the interpreter on every rank") == 3, res.stdout


def _doc_block(title: str) -> str:
    """The first fenced block under the section TITLE of docs/language.md (```text or not)."""
    text = (REPO / "docs" / "language.md").read_text().split(f"## {title}\n", 1)[1]
    m = re.search(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)
    assert m, title
    return m.group(1)


def test_the_examples_of_docs_language_md_check():
    defined = _doc_block("Defined operations")
    prog = ("program p(g: f32[N] local, w: f32[N] replicated, lr: f32) {\n    g1 = allreduce(sum, g)\n"
            "    w1 = update(w, step(w, g1, lr) + rms(g1, 2.0))\n}\n")
    assert load_source(defined + prog, "doc.ccn").programs["p"]
    extern = _doc_block("Extern operations")
    prog = ("program q(x: f32[B, H] local, w: f32[H] replicated) {\n    s = allreduce(sum, x)\n"
            "    y = rmsnorm(s, w, 1e-5)\n    return y\n}\n")
    mod = load_source(extern + prog, str(REPO / "examples" / "doc.ccn"))  # the reference beside it
    assert mod.externs["rmsnorm"].extern.cuda.function == "cclib::rmsnorm_cuda"


def test_an_expansion_that_grows_too_large_is_an_error_at_the_call():
    """Each level doubles the expression: an error (not an hour of expanding) at the call."""
    defs = "op f0(x) = x + 1\n" + "".join(f"op f{i}(x) = f{i - 1}(x) * f{i - 1}(x)\n" for i in range(1, 40))
    (d,) = _error(defs + "program p(g: f32[N] local) {\n    y = f39(g)\n    return y\n}\n")
    assert (d.span.line, d.span.col) == (42, 9) and "split it into several stages" in d.message


def test_build_inputs_reach_cmake_and_the_cache_key(tmp_path):
    from coconetc.codegen.extern_libs import Libs
    from coconetc.codegen.cpu import generate
    f = _extern_file(tmp_path)
    (tmp_path / "scale_rows.h").write_text(HEADER)
    libs = Libs.of(f, True, [tmp_path / "inc"], [tmp_path / "lib"], ["scalerows"])
    assert libs.include_dirs == (str(tmp_path / "inc"), str(tmp_path))  # the .ccn's own dir too
    src = generate(load_file(f), "m", libs)
    assert '#include "scale_rows.h"' in src.cpp and "scale_rows(v_" in src.cpp
    for line in (f'target_include_directories(m PRIVATE "{tmp_path / "inc"}")',
                 f'target_link_directories(m PRIVATE "{tmp_path / "lib"}")',
                 'target_link_libraries(m PRIVATE "scalerows")'):
        assert line in src.cmake
    before = libs.fingerprint(["scale_rows.h"])
    (tmp_path / "scale_rows.h").write_text(HEADER + "// edited\n")
    assert libs.fingerprint(["scale_rows.h"]) != before  # an edited header rebuilds the module


def test_the_cuda_renderer_calls_the_extern_host_function_on_the_stream():
    from coconetc.codegen.cuda import generate as cuda_generate
    from coconetc.codegen.cuda import problems
    mod = load_file(REPO / "examples" / "extern_ops.ccn")
    assert not problems(mod)
    src = cuda_generate(mod, "m")
    assert '#include "rmsnorm.cuh"' in src.cu
    assert "cclib::rmsnorm_cuda(v_rs, v_g, static_cast<float>(1e-05), v_t0_h, " in src.cu
    assert src.cu.count(", stream);") >= 3 and str(REPO / "examples") in src.cmake


# --- one name, two declarations: each file gets its own --------------------------------------
SCOPED = """
extern op boost(x) {{
    type = x
    slicing = free
    reference = "ref:boost"
    cpp = "boost.h", "lib::boost"
    grad_x = "helper(g) + g"
}}

extern op helper(x) {{
    type = x
    slicing = free
    reference = "ref:helper"
    cpp = "boost.h", "lib::helper"
}}

program scaled(x: f32[N] replicated) {{
    y = boost(x)
    return y
}}
"""


def _declaring(tmp_path: Path, name: str, k: int) -> Path:
    """A file declaring boost(x) = K x, whose derivative K g is written helper(g) + g with its
    own helper(x) = (K - 1) x: another file's boost or helper would give other values."""
    d = tmp_path / name
    d.mkdir()
    (d / "ref.py").write_text(f"def boost(x):\n    return x * {k}\n\n\ndef helper(x):\n    return x * {k - 1}\n")
    (d / "boost.h").write_text("")
    (d / "boost.ccn").write_text(SCOPED.format())
    return d / "boost.ccn"


@pytest.mark.parametrize("order", ["a_first", "b_first"])
def test_two_files_declaring_one_extern_name_each_get_their_own(tmp_path, order):
    """Two files that declare `extern op boost` (and the `helper` its derivative calls)
    differently, loaded in one process in either order: each file's program and derived
    program compute with its own declarations, whichever was loaded last; each prints and
    names the operation as written."""
    from coconetc.ir.printer import program as print_program
    from coconetc.sourcefile import with_grads
    files = {"a": _declaring(tmp_path, "a", 2), "b": _declaring(tmp_path, "b", 5)}
    names = ("a", "b") if order == "a_first" else ("b", "a")
    mods = {n: with_grads(load_file(files[n]), ["scaled"]) for n in names}
    x = np.arange(4, dtype=np.float32)
    for n, k in (("a", 2.0), ("b", 5.0)):
        [res] = run(mods[n].programs["scaled"], [{"x": x}])
        np.testing.assert_array_equal(res.outputs["y"], k * x, err_msg=n)
        grad = mods[n].programs["scaled_grad"]
        cot = next(q.name for q in grad.params if q.name != "x")
        [res] = run(grad, [{"x": x, cot: np.ones(4, np.float32)}])
        np.testing.assert_array_equal(res.outputs["d_x"], np.full(4, k, np.float32), err_msg=n)
        text = print_program(mods[n].programs["scaled"])
        assert "y = boost(x)" in text and "~" not in text, text
