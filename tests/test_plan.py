"""The execution plan: golden plans of every example's program and schedule (what
`coconetc show --format plan` prints), stable across runs; the verifier catches broken plans;
what the planner refuses is located at the directive.

Golden plans live in tests/golden_plans/. After an intended change to the planner, regenerate
them and read the diff:

    COCONET_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_plan.py
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from coconetc.sourcefile import SourceFile, load_source
from coconetc.errors import CompileError
from coconetc.plan import plan_program
from coconetc.plan.show import show
from coconetc.ir.nodes import Ref
from coconetc.plan.units import Fused, Item, Loop
from coconetc.plan.verify import PlanInvalid, verify

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").glob("*.ccn"))
GOLDEN = Path(__file__).resolve().parent / "golden_plans"
UPDATE = os.environ.get("COCONET_UPDATE_GOLDEN") == "1"


@cache
def _module(path: Path) -> SourceFile:
    return load_source(path.read_text(), str(path.relative_to(REPO)))


def _cases() -> list[tuple[Path, str, str]]:
    out = []
    for f in EXAMPLES:
        mod = _module(f)
        for prog, scheds in mod.schedules.items():
            out.append((f, prog, "default"))
            out += [(f, prog, s) for s, x in scheds.items() if not x.auto]
    return out


CASES = _cases()
IDS = [f"{f.stem}.{p}.{s}" for f, p, s in CASES]


def _plan_text(path: Path, prog: str, sched: str) -> str:
    mod = _module(path)
    ir = mod.programs[prog] if sched == "default" else mod.schedule(prog, sched).ir
    return show(plan_program(ir, sched))


@pytest.mark.parametrize(("path", "prog", "sched"), CASES, ids=IDS)
def test_golden_plan(path: Path, prog: str, sched: str) -> None:
    text = _plan_text(path, prog, sched)
    assert text.startswith(f"plan {prog} [{sched}]\nbuffers:\n") and "\nunits:\n  " in text
    golden = GOLDEN / f"{path.stem}.{prog}.{sched}.plan"
    if UPDATE:
        GOLDEN.mkdir(exist_ok=True)
        golden.write_text(text)
        return
    assert golden.exists(), f"{golden} is missing; generate it with COCONET_UPDATE_GOLDEN=1"
    want = golden.read_text()
    if want != text:
        diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True)))
        pytest.fail(f"the plan differs from {golden} (COCONET_UPDATE_GOLDEN=1 rewrites it):\n{diff}")


def test_no_stale_golden_plans() -> None:
    wanted = {f"{i}.plan" for i in IDS}
    stale = sorted(p.name for p in GOLDEN.glob("*") if p.name not in wanted)
    assert not stale, f"golden plans of no example schedule: {stale}"


def test_show_plan_is_stable_across_runs() -> None:
    """Two processes with different hash seeds print the same plans (no set or dict order
    leaks into a plan)."""
    outs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        res = subprocess.run([sys.executable, "-c", "from coconetc.cli import main; main()", "show", str(REPO / "examples" / "lamb.ccn"),
                              "-s", "zero", "--format", "plan"], capture_output=True, text=True, env=env,
                             cwd=REPO, check=True)
        outs.append(res.stdout)
    assert outs[0] == outs[1] and "fused fused0" in outs[0]


# --- the verifier ----------------------------------------------------------------------------
def _plan(name: str, prog: str, sched: str):
    mod = _module(REPO / "examples" / name)
    return plan_program(mod.schedule(prog, sched).ir, sched)


def test_verifier_catches_a_read_before_write() -> None:
    plan = _plan("adam.ccn", "adam", "rs_c_ag")
    units = list(plan.units)
    first_loop = next(i for i, u in enumerate(units) if isinstance(u, Loop))
    units.insert(0, units.pop(first_loop))  # the loop before the reducescatter it reads
    with pytest.raises(PlanInvalid, match="reads 'rs' before it is written"):
        verify(dataclasses.replace(plan, units=tuple(units)))


def test_verifier_catches_a_register_read_elsewhere() -> None:
    plan = _plan("adam.ccn", "adam", "zero")
    bufs = tuple(dataclasses.replace(b, kind="register") if b.name == "m1" else b for b in plan.buffers)
    fused = plan.units[0]
    assert isinstance(fused, Fused)
    # a later unit reading m1, which now never reaches memory
    t = plan.buffer("m1").type
    bad = dataclasses.replace(plan, buffers=bufs, units=plan.units + (Loop(t, (Item("v1", Ref("m1", t)),)),))
    with pytest.raises(PlanInvalid, match="register"):
        verify(bad)


def test_verifier_catches_a_slice_not_held() -> None:
    plan = _plan("adam.ccn", "adam", "rs_c_ag")
    units = tuple(dataclasses.replace(u, type=plan.buffer("w").type) if isinstance(u, Loop) else u
                  for u in plan.units)  # the sliced update loop run over full-size elements
    with pytest.raises(PlanInvalid):
        verify(dataclasses.replace(plan, units=units))


def test_every_example_plan_verifies() -> None:
    for path, prog, sched in CASES:
        mod = _module(path)
        ir = mod.programs[prog] if sched == "default" else mod.schedule(prog, sched).ir
        verify(plan_program(ir, sched))


def test_plan_errors_are_compile_errors() -> None:
    src = ("program q(g: f32[N] local, w: f32[N] replicated) {\n    g1 = allreduce(sum, g)\n"
           "    w1 = update(w, w - g1)\n}\nschedule f for q {\n    rs, ag = split(g1)\n"
           "    agw = reorder(ag, w1)\n    fuse(w1, agw)\n}\n")
    with pytest.raises(CompileError) as err:
        load_source(src, "q.ccn")
    d = err.value.diagnostics[0]
    assert (d.span.line, d.span.col) == (8, 5)


def test_verifier_catches_a_fused_unit_without_a_strategy() -> None:
    plan = _plan("adam.ccn", "adam", "zero")
    fused = plan.units[0]
    assert isinstance(fused, Fused)
    bare = dataclasses.replace(fused, strategies=fused.strategies[:1])
    with pytest.raises(PlanInvalid, match="no strategy for each target"):
        verify(dataclasses.replace(plan, units=(bare,) + plan.units[1:]))


def test_sliced_operand_broadcast_along_a_size_1_dim_plans():
    """A sliced [M, 1] operand read by a loop over [M, H] sliced the same way (layernorm's
    statistics in a derived program): every rank holds the elements it reads."""
    from coconetc.sourcefile import load_source
    src = ("program p(s: f32[M, 1] sliced(0), x: f32[M, H] sliced(0)) {\n"
           "    y = x * s\n    return y\n}\n")
    load_source(src)  # plans (the plan verifier ran)
    bad = src.replace("s: f32[M, 1] sliced(0)", "s: f32[1, H] sliced(1)").replace("sliced(0))", "sliced(0))")
    import pytest
    from coconetc.errors import CompileError
    with pytest.raises(CompileError):
        load_source(bad)  # sliced along another dim: the checker refuses it


VECTOR_SRC = """
program vec(a: f32[N] replicated, b: bf16[N] replicated, c: bf16[N] replicated, d: f64[N] replicated,
            r: f32[M, N] replicated, s: f32[N] replicated, k: f32) {
    x = a * k
    y = b + c
    z = d * 2.0
    u = r + s
    v = b * k
    return x, y, z, u, v
}
"""


def test_the_plan_decides_each_cuda_kernels_vector_width():
    """The CUDA vector width is the plan's (plan/vectors.py), printed by show and obeyed by the
    CUDA generator: 16 bytes over the widest operand read or stored at the element's index (a
    broadcast operand or a scalar is read per element and does not count)."""
    from coconetc.codegen import cuda
    from coconetc.plan.vectors import loop_width
    mod = load_source(VECTOR_SRC, "vec.ccn")
    plan = mod.plans[("vec", "default")]
    loops = {u.items[0].name: u for u in plan.units if isinstance(u, Loop)}
    # the widest element size of each loop's operands and result, by hand: f32 4, bf16 2, f64 8
    want = {"x": 16 // 4, "y": 16 // 2, "z": 16 // 8, "u": 16 // 4, "v": 16 // 2}
    assert {name: loop_width(plan, u) for name, u in loops.items()} == want
    text = show(plan)
    for name, width in want.items():
        at = text.splitlines().index(next(ln for ln in text.splitlines() if f": {name} = " in ln))
        assert text.splitlines()[at + 1].strip() == f"on cuda: vectors of {width} elements"
    cu = cuda.generate(mod, "vec", skip_unsupported=True, emulate=True).cu
    launched = sorted(int(x.split(">")[0]) for x in cu.split("launch_threads<")[1:])
    assert launched == sorted(want.values())
