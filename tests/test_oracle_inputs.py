"""The random inputs every check against the interpreter feeds (coconetc/oracle/inputs.py): each
tensor drawn positive only where an operation's domain needs it, a dropout's probability at
most 0.5; and the comparison's allowance for elements that are sums of cancelling terms, and
for results as accurate as the interpreter's against an f64 run (coconetc/oracle/compare.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import coconetc.autodiff  # noqa: F401  (registers the derived programs' operations)
from coconetc.autodiff import vjp
from coconetc.autodiff.vjp import default_wrt
from coconetc.interp.interpreter import Result, run
from coconetc.ir import ops
from coconetc.oracle.compare import compare, widened_run
from coconetc.oracle.inputs import dropout_probabilities, positive_params, random_inputs
from coconetc.sourcefile import load_file, load_source

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

DOMAINS = """
program domains(a: f32[N], b: f32[N], c: f32[N], d: f32[N], e: f32[N], f: f32[N], p: f32, seed: i64) {
    s = sqrt(a * a + 1e-6)         # a square and a positive literal: any a
    l = log(b + 1.0)               # b must be positive (b + 1 settles with b)
    q = c / (d - e)                # a difference: no input settles it, so d and e, not c
    g = dropout(f, p, seed) ** 3   # an odd power is any sign: f free
    y = s + l + q + g
    return y
}
"""


def test_positive_only_where_a_domain_needs_it():
    p = load_source(DOMAINS).program("domains")
    assert positive_params(p) == {"b", "d", "e"}
    assert dropout_probabilities(p) == {"p"}
    adam = load_file(EXAMPLES / "adam.ccn").program("adam")
    assert positive_params(adam) == {"g", "v"}  # v under sqrt; g squared into it past a (1 - beta2)
    gpt = load_file(EXAMPLES / "gpt_block.ccn").program("gpt_block")
    assert positive_params(gpt) == set()  # layernorm, softmax: defined for every value
    # the derived program: layernorm's rsqrt(mean(xc * xc) + eps), gelu's guarded x / x
    assert positive_params(vjp(gpt, default_wrt(gpt))) == set()


EXTERN = """
extern op twice(x) {
    type = x
    reference = "numpy:negative"
    cpp = "twice.h", "twice"
}
program uses(a: f32[N], b: f32[N]) {
    y = twice(a - b) + sqrt(a * a)
    return y
}
"""


def test_the_domain_is_the_operations_definition():
    """Every built-in operation (the derived programs' too) says where it is defined and what sign
    its result has (OpDef.domain); an extern operation says nothing, so every input its
    arguments read is drawn positive."""
    assert [n for n, d in ops.BUILT_IN.items() if d.domain is None] == []
    assert ops.get("sqrt").domain == ops.Domain((0,), ops.NONNEG) and ops.get("sub").domain == ops.ANY
    p = load_source(EXTERN).program("uses")
    assert positive_params(p) == {"a", "b"}  # a - b, read by twice: both; sqrt(a * a): none


def test_inputs_are_drawn_by_what_they_reach():
    p = load_source(DOMAINS).program("domains")
    args = random_inputs(p, 1, sizes={"N": 400}, seed=3)[0]
    for name in ("b", "d", "e"):
        assert 0.5 <= args[name].min() and args[name].max() <= 1.5, name
    for name in ("a", "c", "f"):
        assert -1.0 <= args[name].min() < -0.5 and 0.5 < args[name].max() <= 1.0, name
    ps = [random_inputs(p, 1, sizes={"N": 2}, seed=s)[0]["p"] for s in range(40)]
    assert 0.05 <= min(ps) and max(ps) <= 0.5 and max(ps) > 0.3


def test_timing_inputs_keep_a_blocks_sums_near_one():
    """typical=True (coconetc run, tune, explain --measure): a tensor of two or more dims is
    divided by the square root of its first dim; vectors and integers are drawn as before. The
    GPT block's GELU inputs then stay where its derivative is a normal float (with U(-1, 1)
    weights at H = 1024 they reach |x| = 13, where x exp(-x^2/2) is subnormal)."""
    block = load_file(EXAMPLES / "gpt_block.ccn").program("gpt_block")
    sizes = {"B": 2, "S": 8, "H": 1024, "NH": 16, "HD": 64, "F": 4096}
    plain, typical = (random_inputs(block, 1, sizes=sizes, seed=1, typical=t)[0] for t in (False, True))
    assert np.allclose(typical["w_fc"], plain["w_fc"] / 32.0) and np.allclose(typical["x"], plain["x"] / np.sqrt(2))
    assert np.array_equal(typical["b_fc"], plain["b_fc"]) and typical["scale"] == plain["scale"]
    n2 = np.random.default_rng(0).standard_normal((16, 1024)).astype(np.float32)  # a layernorm's output
    hm = n2 @ typical["w_fc"]
    assert np.abs(hm).max() < 5 < np.abs(n2 @ plain["w_fc"]).max()


def _results(v: np.ndarray) -> list[Result]:
    return [Result({"y": v}, {}, {})]


def test_compare_allows_a_few_ulps_of_the_largest_element():
    """An element that is a small sum of large cancelling terms carries their rounding: a few
    ulps of the tensor's largest element pass on every element; more does not."""
    p = load_source("program id(x: f32[N]) {\n    y = x + 0.0\n    return y\n}\n").program("id")
    want = np.array([1000.0, 1e-3, -2.0], np.float32)
    ulp = float(np.finfo(np.float32).eps) * 1000.0
    near = want.copy()
    near[1] += np.float32(8 * ulp)  # 8 ulps of 1000 on an element of 1e-3: a relative 1.0
    assert compare(_results(want), _results(near), p, p) == []
    far = want.copy()
    far[1] += np.float32(40 * ulp)
    problems = compare(_results(want), _results(far), p, p)
    assert len(problems) == 1 and "'y'" in problems[0]


def test_compare_takes_a_result_as_accurate_as_the_interpreters():
    """Past the tolerance, a result still matches when an f64 run of the program (the exact
    result, to f32's eye) finds it no more than 4 times as far off as the interpreter's own;
    further off, or with no f64 run, it is a mismatch naming both errors."""
    p = load_source("program id(x: f32[N]) {\n    y = x + 0.0\n    return y\n}\n").program("id")
    exact = np.array([1000.0, 1e-3, -2.0])
    ulp = float(np.finfo(np.float32).eps) * 1000.0
    want = (exact + [0.0, 50 * ulp, 0.0]).astype(np.float32)  # the interpreter 50 ulps of 1000 off

    def got(ulps: float) -> list[Result]:
        return _results((exact + [0.0, ulps * ulp, 0.0]).astype(np.float32))

    def run_exact() -> list[Result]:
        return [Result({"y": exact}, {}, {})]
    assert compare(_results(want), got(-60), p, p)  # 110 ulps apart: past the tolerance alone
    assert compare(_results(want), got(-60), p, p, exact=run_exact) == []
    far = compare(_results(want), got(-400), p, p, exact=run_exact)
    assert len(far) == 1 and "from an f64 run" in far[0] and "the interpreter's own" in far[0], far
    assert compare(_results(want), got(-60), p, p, exact=lambda: None)
    assert compare(_results(want), _results(want.astype(np.float64)), p, p, exact=run_exact)  # (another dtype)


def test_the_widened_run_is_the_program_in_f64():
    """widened_run runs the program with every float type, cast and input widened to f64: the
    GPT block's (dropout drawn alike) is its f32 run to f32's accuracy; an f64 program has none."""
    gpt = load_file(EXAMPLES / "gpt_block.ccn").program("gpt_block")
    inputs = random_inputs(gpt, 2, sizes=dict(B=1, S=8, H=16, NH=2, HD=8, F=32))
    f32 = run(gpt, inputs)[0].outputs["y"]
    f64 = widened_run(gpt, inputs)()[0].outputs["y"]
    assert f64.dtype == np.float64 and 0 < np.abs(f64 - f32).max() < 1e-5 * np.abs(f64).max()
    p64 = load_source("program id(x: f64[N]) {\n    y = x + 0.0\n    return y\n}\n").program("id")
    assert widened_run(p64, [{"x": np.ones(3)}])() is None
