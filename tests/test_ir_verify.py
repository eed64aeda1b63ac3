"""The IR verifier after every schedule directive (coconetc.ir.verify.py): every typed
program and every schedule of the examples and test programs verifies; a directive whose
rewrite breaks the program (a primitive monkeypatched to do it) is caught and named."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

import pytest

from coconetc.ir.nodes import Fusion, Ref
from coconetc.ir.types import REPLICATED
from coconetc.schedule.directives import Fuse, Split
from coconetc.ir.verify import IRInvalid, verify_program
from coconetc.sourcefile import load_file, load_source

APPLY = importlib.import_module("coconetc.schedule.apply")  # the module (the package exports apply())
REPO = Path(__file__).resolve().parents[1]
FILES = sorted([*(REPO / "examples").glob("*.ccn"), *(REPO / "tests" / "programs").glob("*.ccn")])
SRC = """program q(g: f32[N] local, w: f32[N] replicated, lr: f32) {
    g1 = allreduce(sum, g)
    w1 = update(w, w - lr * g1)
}
schedule zero for q {
    rs, ag = split(g1)
    agw = reorder(ag, w1)
    fuse(rs, w1, agw)
}
"""


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_every_program_and_schedule_verifies(path: Path) -> None:
    mod = load_file(path)
    for prog in mod.programs.values():
        verify_program(prog)
    for scheds in mod.schedules.values():
        for s in scheds.values():
            if s.ir is not None:
                verify_program(s.ir)


def _broken(monkeypatch, kind: type, corrupt) -> None:
    from coconetc import cache
    real = APPLY._APPLY[kind]
    monkeypatch.setitem(APPLY._APPLY, kind, lambda p, d: corrupt(real(p, d)))
    # (no record of an earlier run's load of the same text: the rewrite must run)
    monkeypatch.setattr(cache, "recall_parsed", lambda *args: None)
    monkeypatch.setattr(cache, "remember_parsed", lambda *args: None)


def _retype_stage(p, name, t):
    return dataclasses.replace(p, stages=tuple(dataclasses.replace(s, expr=dataclasses.replace(s.expr, type=t))
                                               if s.name == name else s for s in p.stages))


def _retype_ref(p, name, t):
    s = p.stage(name)
    expr = dataclasses.replace(s.expr, args=(dataclasses.replace(s.expr.args[0], type=t),))
    return dataclasses.replace(p, stages=tuple(dataclasses.replace(x, expr=expr) if x.name == name else x
                                               for x in p.stages))


@pytest.mark.parametrize("kind, corrupt, message", [
    (Split, lambda p: dataclasses.replace(p, stages=tuple(s for s in p.stages if s.name != "rs")),
     "stage 'ag' reads 'rs', which is not defined before it"),
    (Split, lambda p: _retype_ref(p, "ag", p.stage("ag").type),
     "stage 'ag' reads 'rs' as f32[N] replicated, but it is f32[N] sliced(0)"),
    (Split, lambda p: _retype_stage(p, "ag", dataclasses.replace(p.stage("ag").type, layout=p.stage("rs").type.layout)),
     "stage 'ag' is typed f32[N] sliced(0), but its operands give f32[N] replicated"),
    (Split, lambda p: dataclasses.replace(p, updates=(("g1", "w1"),)), "an update writes 'g1', which is not a parameter"),
    (Split, lambda p: dataclasses.replace(p, outputs=(("out", "g1"),)), "the output 'out' names 'g1', which is not defined"),
    (Fuse, lambda p: dataclasses.replace(p, fusions=p.fusions + (Fusion("f2", ("nowhere",)),)),
     "fusion 'f2' holds 'nowhere', which is not a stage"),
    (Fuse, lambda p: dataclasses.replace(p, fusions=p.fusions + (Fusion("f2", ("rs",)),)), "'rs' is in two fusions"),
], ids=["undefined", "ref-type", "stage-type", "update", "output", "fusion", "two-fusions"])
def test_a_broken_rewrite_is_caught_and_named(monkeypatch, kind, corrupt, message) -> None:
    _broken(monkeypatch, kind, corrupt)
    with pytest.raises(IRInvalid) as err:
        load_source(SRC, "q.ccn")
    name = "split at q.ccn:6:5" if kind is Split else "fuse at q.ccn:8:5"
    assert f"program q after {name}: {message}" in str(err.value)


def test_a_reference_of_the_wrong_type_is_caught() -> None:
    p = load_source(SRC, "q.ccn").programs["q"]
    w1 = p.stage("w1")
    bad = dataclasses.replace(w1.expr, args=(Ref("w", dataclasses.replace(p.param("w").type, layout=REPLICATED, dtype="f64")),) + w1.expr.args[1:])
    with pytest.raises(IRInvalid, match="reads 'w' as f64"):
        verify_program(dataclasses.replace(p, stages=tuple(dataclasses.replace(s, expr=bad) if s.name == "w1" else s
                                                          for s in p.stages)), "test")
