"""The operation registry (coconetc/ir/ops.py) is the one home of what the compiler knows about
an operation: a pointwise operation registered at run time (softplus, here only) parses, checks,
prints, interprets, moves with reorder and renders as C++ without touching any other file.
Also: what the registry promises its readers."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from coconetc.codegen.emit import emit
from coconetc.sourcefile import load_source
from coconetc.errors import CompileError
from coconetc.interp.interpreter import run
from coconetc.ir import ops, printer
from coconetc.ir.nodes import POINTWISE, Op

SOFTPLUS = ops.OpDef("softplus", "pointwise", (ops.Arg("x"),),
                     numpy=lambda x: np.log1p(np.exp(x)),
                     cpp=ops.Cpp("std::log1p(std::exp({0}))"), cost=ops.Cost(2, 2))

SOURCE = """
program sp(g: f32[N] local, b: f32[N] replicated) {
    s = allreduce(sum, g)
    y = softplus(s + b) * 2
    return y
}

schedule moved for sp {
    rs, ag = split(s)
    agy = reorder(ag, y)
}
"""


@pytest.fixture
def softplus():
    with ops.registered(SOFTPLUS) as d:
        yield d


def _inputs(ranks: int, n: int) -> tuple[list[dict], np.ndarray]:
    rng = np.random.default_rng(7)
    gs = [rng.standard_normal(n).astype(np.float32) for _ in range(ranks)]
    b = rng.standard_normal(n).astype(np.float32)
    want = 2 * np.log1p(np.exp(np.sum([g.astype(np.float64) for g in gs], axis=0) + b))
    return [{"g": g, "b": b} for g in gs], want


def test_new_pointwise_op_goes_all_the_way(softplus):
    mod = load_source(SOURCE, "sp.ccn")
    prog = mod.program("sp")
    y = prog.stage("y")
    assert "softplus" in POINTWISE and y.kind == "compute"
    assert str(y.type) == "f32[N] replicated"
    for ranks in (1, 3):
        inputs, want = _inputs(ranks, 7)
        for ir in (prog, mod.schedule("sp", "moved").ir):
            for res in run(ir, inputs):
                np.testing.assert_allclose(res.outputs["y"], want, rtol=1e-5)
    # reorder moved softplus onto the slices, with its allgather after it
    moved = mod.schedule("sp", "moved").ir
    assert str(moved.stage("y").type) == "f32[N] sliced(0)"
    assert moved.stage("agy").expr.op == "allgather"
    # printing and re-parsing gives the same program
    text = printer.program(prog)
    assert "    y = softplus(s + b) * 2\n" in text
    assert load_source(text).program("sp") == prog
    # the shared C++ emitter renders it from the registry's template
    code = emit(y.expr, lambda r: f"v_{r.name}[i]")
    assert code == "std::log1p(std::exp(v_s[i] + v_b[i])) * 2.0f"


def test_registered_only_while_registered(softplus):
    ops.unregister("softplus")
    try:
        assert "softplus" not in POINTWISE
        with pytest.raises(CompileError, match="unknown operation 'softplus'"):
            load_source(SOURCE)
    finally:
        ops.register(softplus)


def test_registry_refuses_incomplete_or_duplicate_entries():
    with pytest.raises(ValueError, match="already registered"):
        ops.register(ops.get("add"))
    with pytest.raises(ValueError, match="needs a numpy function and a Cpp template"):
        ops.register(dataclasses.replace(SOFTPLUS, cpp=None))
    assert "softplus" not in ops.REGISTRY


def test_the_registry_holds_the_facts_once():
    conv = ops.get("conv2d")
    assert conv.defaults() == {"stride": 1, "padding": 0}
    assert [a.name for a in conv.settings] == ["stride", "padding"]
    assert ops.infix("**").name == "pow" and ops.prefix("-").name == "neg"
    assert ops.called("add") is None and ops.called("min") is ops.get("min")
    slicing = {n: d.slicing for n, d in ops.REGISTRY.items()}
    assert slicing["send"] == ops.FREE and slicing["allreduce"] == ops.NEVER
    assert slicing["layernorm"] == ops.ROWS and slicing["norm"] == ops.PARTIAL
    for d in ops.REGISTRY.values():
        if d.kind == "pointwise":
            assert d.numpy is not None and d.cpp is not None, d.name
        assert d.cost.flops >= 0 and d.cost.comm >= 0


def test_conv2d_defaults_are_filled_in_from_the_registry():
    mod = load_source("""
program c(x: f32[N, C, H, W] replicated, w: f32[O, C, 3, 3] replicated) {
    y = conv2d(x, w, padding=1)
    return y
}
""")
    y = mod.program("c").stage("y").expr
    assert isinstance(y, Op) and dict(y.attrs) == {"padding": 1, "stride": 1}
    assert printer.expr(y) == "conv2d(x, w, stride=1, padding=1)"


def test_the_registry_imports_no_interpreter_and_no_backend():
    """The interpreter and the backends import the registry, never the other way round."""
    code = ("import sys, coconetc.ir.ops, coconetc.ir.nodes, coconetc.frontend.checker; "
            "print(sorted(m for m in sys.modules if m.startswith(('coconetc.interp', "
            "'coconetc.codegen', 'coconetc.toolchain'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_retype_types_again_after_the_registry_changes(softplus):
    """retype (ir/rewrite.py) returns an expression it typed as it is when read again with the
    same types; an operation registered again with another rule is typed by the new rule."""
    from coconetc.ir.rewrite import retype
    from coconetc.ir.typerules import TypeErr
    prog = load_source(SOURCE).program("sp")
    env = {n: prog.type_of(n) for n in ("s", "b")}.__getitem__
    typed = retype(prog.stage("y").expr, env)
    assert typed == prog.stage("y").expr and retype(typed, env) is typed

    def refused(op, args, attrs, span):
        raise TypeErr(span, "softplus: refused by its new rule")
    ops.unregister("softplus")
    try:
        ops.register(dataclasses.replace(SOFTPLUS, typing=refused))
        with pytest.raises(TypeErr, match="refused by its new rule"):
            retype(typed, env)
    finally:
        ops.unregister("softplus")
        ops.register(softplus)
