"""Extern operations with declared derivatives (`grad_<p> = "expr"`, docs/language.md "Extern
operations"): the derived programs against central finite differences in f64 under the
interpreter (tests/test_autodiff.py's `check`, which also prints the derived program, reads it
back and runs it again), and the located errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_autodiff import check

from coconetc.autodiff import vjp
from coconetc.errors import CompileError
from coconetc.ir import printer
from coconetc.sourcefile import load_file, load_source

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _mp_layer_f64() -> str:
    """examples/extern_ops.ccn in f64, its reference found by path (the text is not in examples/)."""
    src = (EXAMPLES / "extern_ops.ccn").read_text().replace("f32", "f64")
    return src.replace('"rmsnorm_ref:', f'"{EXAMPLES / "rmsnorm_ref.py"}:')


@pytest.mark.parametrize("ranks", [1, 2])
def test_mp_layer_through_rmsnorm(ranks: int) -> None:
    g = check(_mp_layer_f64(), {"B": 3, "K": 4, "H": 5}, ranks, name="mp_layer")
    text = printer.program(g)
    # rmsnorm's derivative calls rmsnorm_dx, declared with it
    assert "g_s = rmsnorm_dx(" in text and "extern op rmsnorm_dx(" in text


# ext_softplus's derivative calls another extern operation (ext_sigm); ext_sigm's own uses y, its result
OPS = '''import numpy as np


def ext_softplus(x):
    return np.logaddexp(0.0, x)


def ext_sigm(x):
    return 1.0 / (1.0 + np.exp(-x))


def ext_mulrow(x, v):
    return x * v
'''

SRC = '''extern op ext_softplus(x) {
    type = x
    slicing = free
    reference = "OPS:ext_softplus"
    cpp = "myops.h", "my::ext_softplus"
    grad_x = "g * ext_sigm(x)"
}

extern op ext_sigm(x) {
    type = x
    slicing = free
    reference = "OPS:ext_sigm"
    cpp = "myops.h", "my::ext_sigm"
    grad_x = "g * y * (1 - y)"
}

extern op ext_mulrow(x, v) {
    type = x
    slicing = rows
    reference = "OPS:ext_mulrow"
    cpp = "myops.h", "my::ext_mulrow"
    grad_x = "g * v"
    grad_v = "g * x"
}

program p(x: f64[B, H] LX, v: f64[H] replicated, w: f64[H, C] replicated) {
    a = ext_softplus(ext_mulrow(x, v)) + ext_sigm(x)
    b = matmul(a, w)
    c = tanh(b)
    return c
}
'''


@pytest.fixture
def ops_file(tmp_path: Path) -> Path:
    f = tmp_path / "myops.py"
    f.write_text(OPS)
    return f


@pytest.mark.parametrize("layout", ["replicated", "local", "sliced(0)"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_extern_derivative_calls_another_extern(ops_file: Path, layout: str, ranks: int) -> None:
    src = SRC.replace("OPS:", f"{ops_file}:").replace("LX", layout)
    g = check(src, {"B": 4, "H": 3, "C": 4}, ranks, name="p")
    text = printer.program(g)
    # the printed derived program declares ext_sigm too: ext_softplus's derivative calls it
    assert "extern op ext_sigm(x)" in text and "extern op ext_softplus(x)" in text


def test_printed_declaration_keeps_its_derivatives(ops_file: Path) -> None:
    from coconetc.autodiff.text import check_text
    src = SRC.replace("OPS:", f"{ops_file}:").replace("LX", "replicated")
    p = load_source(src).program("p")
    text = printer.program(p)
    assert 'grad_x = "g * ext_sigm(x)"' in text and 'grad_v = "g * x"' in text
    again = check_text(text)["p"]
    assert printer.program(vjp(again)) == printer.program(vjp(p))


# --- errors -------------------------------------------------------------------------------------
def test_missing_derivative_is_a_located_error(ops_file: Path) -> None:
    src = SRC.replace("OPS:", f"{ops_file}:").replace("LX", "replicated").replace('    grad_v = "g * x"\n', "")
    p = load_source(src).program("p")
    vjp(p, ["x", "w"])  # v's derivative is not needed
    with pytest.raises(CompileError) as err:
        vjp(p)
    d = err.value.diagnostics[0]
    assert "'ext_mulrow' has no derivative for its operand 'v'" in d.message
    assert 'grad_v = "..."' in d.message
    line = "    a = ext_softplus(ext_mulrow(x, v)) + ext_sigm(x)"
    assert (d.span.line, d.span.col) == (src.splitlines().index(line) + 1, line.index("ext_mulrow(") + 1)


@pytest.mark.parametrize("grad, message", [
    ("where(g, g, y)", "the derivative grad_x of 'ext_mulrow' (where(g, g, y)): where's condition"),
    ("matmul(g, g)", "matmul"),
])
def test_a_derivative_that_does_not_type_is_an_error_at_the_call(ops_file: Path, grad: str, message: str) -> None:
    src = SRC.replace("OPS:", f"{ops_file}:").replace("LX", "replicated")
    src = src.replace('grad_x = "g * v"', f'grad_x = "{grad}"')
    p = load_source(src).program("p")
    with pytest.raises(CompileError) as err:
        vjp(p)
    d = err.value.diagnostics[0]
    assert message in d.message and "ext_mulrow" in d.message, d.message
    assert d.span.line == src.splitlines().index("    a = ext_softplus(ext_mulrow(x, v)) + ext_sigm(x)") + 1


def test_which_contribution_shapes_fit_an_operand() -> None:
    from coconetc.autodiff.extern import _fits
    assert _fits(("B", "H"), ("B", "H")) and _fits(("B", "H"), ("H",)) and _fits((), ("B", "H"))
    assert _fits(("H",), ("B", "H")) and _fits(("B", "H"), ("B", 1)) and _fits(("S", "B", "H"), ("H",))
    assert not _fits(("B", "H"), ("B", "K")) and not _fits(("K",), ("B", "H")) and not _fits(("B", 1), ("B", "H"))


def test_extern_without_any_derivative_names_the_operand() -> None:
    src = (EXAMPLES / "extern_ops.ccn").read_text()
    src = "\n".join(line for line in src.splitlines() if "grad_" not in line)
    p = load_source(src, str(EXAMPLES / "extern_ops.ccn")).program("mp_layer")
    with pytest.raises(CompileError, match="'rmsnorm' has no derivative for its operand 'x'") as err:
        vjp(p)
    assert err.value.diagnostics[0].span.line == src.splitlines().index(
        "    h = residual(rmsnorm(s, g, 1e-5), r, 0.5)") + 1


BAD = [
    ('grad_x = "g * q"', "unknown name 'q' in ext_softplus's grad_x", 'q"'),
    ('grad_x = "rsqrt(x, g)"', "rsqrt() takes at most 1 argument, got 2", 'g)"'),
    ('grad_x = "ext_mulrow(g)"', "ext_mulrow() is missing its argument 'v'", 'ext_mulrow(g)'),
    ('grad_x = "nope(g)"', "unknown operation 'nope' in ext_softplus's grad_x", 'nope'),
    ('grad_x = "g * "', "ends too early", '"'),
    ('grad_x = "g * (x"', "'(' is never closed (found the end of the string)", '('),
    ('grad_x = "allreduce(sum, g)"', "communicates", 'allreduce'),
    ('grad_x = "dropout(g, 0.1, g)"', "draws random numbers", 'dropout'),
    ('grad_x = "twice(g)"', "'twice' is a defined operation", 'twice'),
    ('grad_z = "g"', "'z' is not a parameter of 'ext_softplus'", 'grad_z'),
    ('grad_x = g', "'grad_x' takes one string", 'grad_x'),
]


@pytest.mark.parametrize("setting, message, at", BAD)
def test_bad_derivative_is_an_error_at_its_place(ops_file: Path, setting: str, message: str, at: str) -> None:
    src = "op twice(a) = a * 2\n" + SRC.replace("OPS:", f"{ops_file}:").replace("LX", "replicated")
    src = src.replace('grad_x = "g * ext_sigm(x)"', setting, 1)
    with pytest.raises(CompileError) as err:
        load_source(src)
    hits = [d for d in err.value.diagnostics if message in d.message]
    assert hits, err.value.render()
    line = next(i for i, text in enumerate(src.splitlines(), 1) if setting in text)
    assert (hits[0].span.line, hits[0].span.col) == (line, src.splitlines()[line - 1].rindex(at) + 1), err.value.render()


def test_example_checks() -> None:
    mod = load_file(EXAMPLES / "extern_ops.ccn")
    ext = mod.externs["rmsnorm"].extern
    assert ext is not None and [p for p, _ in ext.grads] == ["x", "w"]


# --- the example's rmsnorm_dx compiled: the C++ library function against its Python reference ------
@pytest.mark.slow
def test_rmsnorm_dx_compiled_matches_its_reference(tmp_path: Path) -> None:
    decls = (EXAMPLES / "extern_ops.ccn").read_text().split("op residual")[0]
    decls = decls.replace('"rmsnorm_ref:', f'"{EXAMPLES / "rmsnorm_ref.py"}:')
    f = tmp_path / "dx.ccn"
    f.write_text(decls + """
program backward(g: f32[B, H] sliced(0), x: f32[B, H] sliced(0), w: f32[H] replicated) {
    dx = rmsnorm_dx(g, x, w, 1e-5) + rmsnorm(x, w, 1e-5)
    return dx
}
""")
    coconetc = str(Path(sys.executable).with_name("coconetc"))
    res = subprocess.run([coconetc, "run", str(f), "--ranks", "2", "--size", "B=5", "--size", "H=7",
                          "-I", str(EXAMPLES)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "matches the interpreter on every rank" in res.stdout, res.stdout
