"""A random operation's RNG site in .ccn text: `dropout(x, p, seed, site=NAME, draw=k)` draws
the mask of stage NAME's k-th draw (docs/language.md, "Random operations"). The printer writes
it where a site is not the stage's own next draw, so derived programs (whose dropout reuses the
forward's mask) print, read back (coconetc.autodiff.text.check_text) to the same sites and run
under the interpreter to the same values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from coconetc.autodiff import vjp
from coconetc.autodiff.text import check_text, unfaithful_sites
from coconetc.errors import CompileError
from coconetc.interp.interpreter import run
from coconetc.ir import ops, printer
from coconetc.ir.expr import Op, walk
from coconetc.ir.nodes import Program
from coconetc.ir.slices import take_slice
from coconetc.sourcefile import load_file, load_source

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _sites(p: Program) -> list[tuple[str, str]]:
    return [(s.name, str(n.attr("site"))) for s in p.stages for n in walk(s.expr)
            if isinstance(n, Op) and ops.get(n.op).kind == "random"]


def _args(p: Program, sizes: dict[str, int], ranks: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out: list[dict] = [{} for _ in range(ranks)]
    for q in p.params:
        if q.scalar:
            v = int(rng.integers(0, 1 << 40)) if q.type.dtype.startswith("i") else float(rng.uniform(0.5, 2))
            for a in out:
                a[q.name] = v
            continue
        shape = tuple(sizes[d] if isinstance(d, str) else d for d in q.type.shape)
        dt = {"f16": np.float16, "bf16": np.float32}.get(q.type.dtype, np.dtype(q.type.dtype.replace("f", "float")))
        whole = rng.standard_normal(shape).astype(dt)
        for r, a in enumerate(out):
            if q.type.layout.kind == "local":
                a[q.name] = rng.standard_normal(shape).astype(dt)
            elif q.type.layout.sliced:
                d = q.type.layout.dim
                a[q.name] = np.ascontiguousarray(take_slice(whole, d, shape[d], ranks, r))
            else:
                a[q.name] = whole
    return out


def _same_text_and_values(g: Program, sizes: dict[str, int], ranks: int) -> None:
    text = printer.program(g)
    again = check_text(text)[g.name]
    assert _sites(again) == _sites(g)
    assert printer.program(again) == text
    args = _args(g, sizes, ranks)
    for a, b in zip(run(g, args), run(again, args)):
        for k in a.outputs:
            np.testing.assert_allclose(np.asarray(b.outputs[k], np.float64), np.asarray(a.outputs[k], np.float64),
                                       rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("file, name", [("residual_dropout.ccn", "f1"), ("mlp_out.ccn", "mlp_out")])
def test_derived_examples_print_and_read_back(file: str, name: str, ranks: int) -> None:
    p = load_file(EXAMPLES / file).program(name)
    g = vjp(p)
    assert not unfaithful_sites(g)
    assert "site=" in printer.program(g)
    _same_text_and_values(g, {"B": 2, "S": 4, "H": 4, "K": 4}, ranks)


@pytest.mark.parametrize("ranks", [1, 2])
def test_several_draws_in_one_stage(ranks: int) -> None:
    """Two dropouts in one stage (draws #0 and #1), one nested in the other: the derived
    program's dropouts name both, draw=1 included."""
    src = """program p(x: f64[B, H] local, v: f64[B, H] local, seed: i64) {
    y = dropout(dropout(x, 0.2, seed) * v, 0.4, seed) + dropout(v, 0.3, seed)
    return y
}"""
    g = vjp(load_source(src).program("p"))
    text = printer.program(g)
    assert "site=y, draw=1)" in text and "site=y, draw=2)" in text
    _same_text_and_values(g, {"B": 3, "H": 5}, ranks)


# --- the syntax -----------------------------------------------------------------------------------
def _program(body: str) -> str:
    return f"program p(x: f64[N] local, seed: i64) {{\n{body}\n}}"


def test_site_repeats_another_stage_mask() -> None:
    p = load_source(_program("""    a = dropout(x, 0.5, seed) + dropout(x, 0.5, seed)
    b = dropout(x, 0.5, seed, site=a)
    c = dropout(x, 0.5, seed, site=a, draw=1)
    d = dropout(x, 0.5, seed, draw=0)
    e = dropout(x, 0.5, seed, site=a) + dropout(x, 0.5, seed)
    return a, b, c, d, e""")).program("p")
    assert _sites(p) == [("a", "a#0"), ("a", "a#1"), ("b", "a#0"), ("c", "a#1"), ("d", "d#0"),
                         ("e", "a#0"), ("e", "e#0")]  # a written site is not one of the stage's draws
    res = run(p, [{"x": np.ones(64), "seed": 7}])[0].outputs
    np.testing.assert_array_equal(res["b"] + res["c"], res["a"])
    assert not np.array_equal(res["b"], res["c"])
    text = printer.program(p)
    assert "b = dropout(x, 0.5, seed, site=a)\n" in text and "site=a, draw=1)" in text
    assert "d = dropout(x, 0.5, seed)\n" in text  # its own stage's first draw: no keywords
    assert _sites(check_text(text)["p"]) == _sites(p)


def test_site_in_a_defined_operation() -> None:
    src = "op drop_as(v, s) = dropout(v, 0.5, s, site=a)\n" + _program(
        "    a = dropout(x, 0.5, seed)\n    b = drop_as(x, seed)\n    return a, b")
    p = load_source(src).program("p")
    assert _sites(p) == [("a", "a#0"), ("b", "a#0")]


@pytest.mark.parametrize("call, message", [
    ("dropout(x, 0.5, seed, site=1)", "site must be a stage's name"),
    ("dropout(x, 0.5, seed, site=a + a)", "site must be a stage's name"),
    ("dropout(x, 0.5, seed, site=a, draw=-1)", "draw must not be negative"),
    ("dropout(x, 0.5, seed, site=a, draw=x)", "draw must be an integer literal"),
    ("dropout(x, 0.5, seed, site=a, site=a)", "got 'site' twice"),
    ("dropout(x, 0.5, seed, where=a)", "has no argument 'where'"),
    ("exp(x, site=a)", "has no argument 'site'"),
])
def test_site_errors(call: str, message: str) -> None:
    src = _program(f"    a = dropout(x, 0.5, seed)\n    b = {call}\n    return b")
    with pytest.raises(CompileError, match=message) as err:
        load_source(src)
    assert err.value.diagnostics[0].span.line == 3


def test_site_error_in_a_defined_operation() -> None:
    src = "op f(v, s) = dropout(v, 0.5, s, site=a, site=b)\n" + _program("    b = f(x, seed)\n    return b")
    with pytest.raises(CompileError, match="got 'site' twice") as err:
        load_source(src)
    assert err.value.diagnostics[0].span.line == 1


@pytest.mark.parametrize("file, name", [("residual_dropout.ccn", "f1"), ("mlp_out.ccn", "mlp_out")])
def test_show_grad_prints_dropout_programs(file: str, name: str) -> None:
    from click.testing import CliRunner

    from coconetc.cli import main
    out = CliRunner().invoke(main, ["show", str(EXAMPLES / file), "-p", name, "--grad"])
    assert out.exit_code == 0, out.output
    head, _, text = out.output.partition("\n")  # the first line says what the forward saves
    assert head.startswith("# saved by the forward"), head
    assert text == printer.program(vjp(load_file(EXAMPLES / file).program(name)))
    assert name + "_grad" in check_text(out.output)
