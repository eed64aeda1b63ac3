"""CMake support: `coconetc compile --emit-only` (what coconet_add_module runs)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from coconetc import cli

REPO = Path(__file__).resolve().parents[1]
SGD = REPO / "examples" / "sgd.ccn"


# ---- coconetc compile --emit-only ----

def _invoke(*args):
    return CliRunner().invoke(cli.main, [str(a) for a in args])


def test_emit_only_writes_sources_named_and_restricted(tmp_path: Path):
    res = _invoke("compile", SGD, "-o", tmp_path, "--emit-only", "--name", "my_sgd", "-s", "fused")
    assert res.exit_code == 0, res.output
    cpp = (tmp_path / "module.cpp").read_text()
    assert "PYBIND11_MODULE(my_sgd, m)" in cpp
    assert "sgd__default" in cpp and "sgd__fused" in cpp and "sgd__rs_c_ag" not in cpp
    assert "project(my_sgd" in (tmp_path / "CMakeLists.txt").read_text()
    assert not (tmp_path / "build").exists()  # nothing was built
    assert "sgd(schedule='fused'): sgd__fused" in res.output


def test_emit_only_all_schedules_by_default(tmp_path: Path):
    res = _invoke("compile", SGD, "-o", tmp_path, "--emit-only")
    assert res.exit_code == 0, res.output
    cpp = (tmp_path / "module.cpp").read_text()
    assert "PYBIND11_MODULE(ccn_sgd, m)" in cpp
    assert all(f"sgd__{s}" in cpp for s in ("default", "fused", "rs_c_ag"))


@pytest.mark.parametrize("args, message", [
    (["--emit-only", "-s", "nope"], "no schedule 'nope'"),
    (["--emit-only", "--name", "not-a-name"], "not a valid Python module name"),
    (["--name", "x"], "go with --emit-only"),
])
def test_emit_only_errors(tmp_path: Path, args, message):
    res = _invoke("compile", SGD, "-o", tmp_path, *args)
    assert res.exit_code == 1 and message in res.stderr, res.output
    assert "Traceback" not in res.output


def test_emit_only_needs_output():
    res = _invoke("compile", SGD, "--emit-only")
    assert res.exit_code == 1 and "needs --output" in res.stderr
