"""Warm loads (coconetc/runtime/warm.py): a file loaded before is neither parsed nor planned
again, and in a fresh process neither the front end (lark) nor the code generators (jinja2)
are imported; any change to what the load depends on, an operation registered at run time, or a
module that is no longer whole, loads it in full; a record that cannot be read is ignored."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import coconetc
from coconetc import sourcefile
from coconetc.ir import ops
from coconetc.runtime import loader, warm

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def sgd(tmp_path, request):
    """examples/sgd.ccn with its program named after the test (its own module, which the test may
    break without touching the module other tests, on other workers, load at the same time)."""
    path = tmp_path / "sgd.ccn"
    path.write_text((REPO / "examples" / "sgd.ccn").read_text().replace("sgd", PROGRAM[request.node.name]))
    yield path


PROGRAM = {"test_second_load_reads_the_record": "sgd_warm",
           "test_warm_load_in_a_fresh_process_imports_no_front_end_or_generator": "sgd_warm", "test_what_the_load_depends_on_changes": "sgd_changed",
           "test_a_module_no_longer_whole_or_a_bad_record_loads_in_full": "sgd_broken"}


def _counted(monkeypatch, name: str) -> list[str]:
    """The files sourcefile's function NAME is called on from now on (load_source: the files the
    loader loads; parse: the texts the front end parses)."""
    seen: list[str] = []
    real = getattr(sourcefile, name)

    def counted(text, file="<string>"):
        seen.append(file)
        return real(text, file)
    monkeypatch.setattr(sourcefile, name, counted)
    return seen


def _parses(monkeypatch) -> list[str]:
    return _counted(monkeypatch, "load_source")


def _step(mod) -> np.ndarray:
    g, w = np.arange(6, dtype=np.float32), np.ones(6, dtype=np.float32)
    (fn,) = mod.programs.values()
    fn(g=g, w=w, lr=np.float32(0.5))
    return w


def test_second_load_reads_the_record(sgd, monkeypatch):
    first = coconetc.load(sgd, log=lambda msg: None)
    seen = _parses(monkeypatch)
    again = coconetc.load(sgd, log=lambda msg: None)
    assert seen == []  # neither parsed nor planned: the record
    assert sorted(again.programs) == sorted(first.programs)
    assert sorted(again.sgd_warm.schedules) == sorted(first.sgd_warm.schedules) == ["default", "fused", "rs_c_ag"]
    np.testing.assert_array_equal(_step(again), _step(first))
    np.testing.assert_allclose(_step(again), 1 - 0.5 * np.arange(6, dtype=np.float32))
    # what a warm load read gives the whole file and sources back when asked for
    assert again.source_module.programs == first.source_module.programs
    assert again.sources.cpp == first.sources.cpp and again.sources.module == first.ext.__name__


FRESH = """
import json, sys
import numpy as np
import coconetc
mod = coconetc.load(sys.argv[1], log=print)  # a build would log
w = np.ones(6, dtype=np.float32)
mod.sgd_warm(g=np.arange(6, dtype=np.float32), w=w, lr=np.float32(0.5))
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("lark", "jinja2", "ml_dtypes") or m.startswith((
    "coconetc.codegen", "coconetc.frontend", "coconetc.sourcefile", "coconetc.schedule", "coconetc.autodiff",
    "coconetc.plan.planner", "coconetc.toolchain.compiler", "coconetc.interp", "coconetc.tune")))
print(json.dumps({"heavy": heavy, "w": w.tolist(), "schedules": sorted(mod.sgd_warm.schedules)}))
"""


def test_warm_load_in_a_fresh_process_imports_no_front_end_or_generator(sgd):
    """A warm load, and a call, in a fresh process import neither the parser (lark) nor the code
    generators (jinja2, coconetc.codegen) nor the rest of the front half: the record holds what
    the calls read; nor ml_dtypes, which only bf16 values need (ir/storage.py)."""
    warm.python_hash.cache_clear()  # the record under the sources as they are now, as the
    warm.compiler_hash.cache_clear()  # fresh process will hash them (they may have been edited since)
    coconetc.load(sgd, log=lambda msg: None)
    res = subprocess.run([sys.executable, "-c", FRESH, str(sgd)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert len(lines) == 1, res.stdout  # nothing logged: nothing built
    got = json.loads(lines[0])
    assert got["heavy"] == []
    assert got["schedules"] == ["default", "fused", "rs_c_ag"]
    np.testing.assert_allclose(got["w"], 1 - 0.5 * np.arange(6, dtype=np.float32))


CHECK = """
import sys
import numpy as np
from coconetc.oracle import compare
a = np.linspace(0, 1, 5, dtype=np.float32)
assert compare._diff("w", a, a.copy()) == []
assert compare._diff("w", a, a + 1) != []
print(sorted(m for m in sys.modules if m.split(".")[0] == "ml_dtypes"))
"""


def test_checking_a_result_imports_no_ml_dtypes_unless_it_is_bf16():
    """Every rank of `coconetc run` checks its results against the interpreter's: an f32 result's
    check finds its dtype's tolerance without making bf16's NumPy dtype, whose import (ml_dtypes,
    most of a second) each rank paid. A bf16 result is still checked with bf16's tolerance."""
    res = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "[]"
    import ml_dtypes

    from coconetc.ir.storage import STORAGE
    from coconetc.oracle import compare
    b = np.linspace(0, 1, 5).astype(ml_dtypes.bfloat16)
    assert STORAGE.name_of(b.dtype) == "bf16" and STORAGE.name_of(np.dtype(np.float16)) == "f16"
    assert compare._diff("w", b, b.copy()) == [] and compare._diff("w", b, b + 1) != []


def test_what_the_load_depends_on_changes(sgd, monkeypatch):
    coconetc.load(sgd, log=lambda msg: None)
    seen = _parses(monkeypatch)
    sgd.write_text(sgd.read_text() + "\n")  # another text
    coconetc.load(sgd, log=lambda msg: None)
    assert seen == [str(sgd)]
    coconetc.load(sgd, log=lambda msg: None, include_dirs=[str(sgd.parent)])  # other options
    assert seen == [str(sgd)] * 2
    twice = ops.OpDef("twice_here", "pointwise", (ops.Arg("x"),), numpy=lambda x: 2 * x, cpp=ops.Cpp("2 * {0}"))
    with ops.registered(twice):  # an operation of this process's own: the registry is not in the key
        coconetc.load(sgd, log=lambda msg: None)
    assert seen == [str(sgd)] * 3
    coconetc.load(sgd, log=lambda msg: None)
    assert seen == [str(sgd)] * 3


def test_a_module_no_longer_whole_or_a_bad_record_loads_in_full(sgd, monkeypatch):
    first = coconetc.load(sgd, log=lambda msg: None)
    so = Path(first.ext.__file__)
    text = sgd.read_text()
    record = next(p for p in (warm.cache_dir().absolute() / warm.FOLDER).iterdir()
                  if p.stem == warm.key(sgd, text, loader.tuned_schedules(text), ((), (), (), ())))
    seen = _parses(monkeypatch)
    record.write_bytes(b"not a pickle")
    coconetc.load(sgd, log=lambda msg: None)
    assert seen == [str(sgd)]
    (so.parent.parent / "manifest.json").unlink()  # not whole (a build that died before its manifest)
    mod = coconetc.load(sgd, log=lambda msg: None)
    assert seen == [str(sgd)] * 2
    np.testing.assert_allclose(_step(mod), 1 - 0.5 * np.arange(6, dtype=np.float32))


# --- parsed files (coconetc/cache.py) -----------------------------------------------------------
MAIN = 'from "inner.ccn" import inner\n\nprogram outer(x: f32[N] replicated) {\n    y = inner(x)\n    return y\n}\n'
INNER = "program inner(x: f32[N] replicated) {\n    y = x * SCALE\n    return y\n}\n"


def test_a_file_parsed_once_loads_from_its_record_until_it_or_an_import_changes(tmp_path, monkeypatch):
    """The second load of the same text (in any process: the record is a file) parses nothing
    and gives the same programs and plans; an edit of the file or of a file it imports, or a
    broken record, parses again; a file that does not check is never remembered (its error is
    raised every time)."""
    from coconetc.cache import ENV_CACHE, PARSED, cache_dir
    from coconetc.errors import CompileError
    from coconetc.interp.interpreter import run
    from coconetc.plan.show import show
    monkeypatch.setenv(ENV_CACHE, str(tmp_path / "cache"))  # records of its own, which it breaks
    (tmp_path / "inner.ccn").write_text(INNER.replace("SCALE", "2.0"))
    main = tmp_path / "main.ccn"
    main.write_text(MAIN)
    first = sourcefile.load_file(main)
    seen = _counted(monkeypatch, "parse")
    again = sourcefile.load_file(main)
    assert seen == [] and again is not first
    assert show(again.plans[("outer", "default")]) == show(first.plans[("outer", "default")])
    x = np.arange(5, dtype=np.float32)
    assert run(again.program("outer"), [{"x": x}])[0].outputs["y"].tolist() == (2 * x).tolist()

    (tmp_path / "inner.ccn").write_text(INNER.replace("SCALE", "3.0"))  # the import changed
    edited = sourcefile.load_file(main)
    assert seen.count(str(main)) == 1 and run(edited.program("outer"), [{"x": x}])[0].outputs["y"].tolist() == (3 * x).tolist()
    main.write_text(MAIN + "\n")  # the file changed
    sourcefile.load_file(main)
    assert seen.count(str(main)) == 2
    for rec in (cache_dir() / PARSED).glob("*.pickle"):  # broken records: parsed again, and rewritten
        rec.write_bytes(rec.read_bytes()[:50])
    assert sourcefile.load_file(main).programs.keys() == first.programs.keys() and seen.count(str(main)) == 3
    sourcefile.load_file(main)
    assert seen.count(str(main)) == 3

    bad = tmp_path / "bad.ccn"
    bad.write_text("program bad(x: f32[N] replicated) {\n    y = nowhere(x)\n    return y\n}\n")
    for _ in range(2):
        with pytest.raises(CompileError, match="nowhere"):
            sourcefile.load_file(bad)
    assert seen.count(str(bad)) == 2
