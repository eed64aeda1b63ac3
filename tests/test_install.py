"""A real, non-editable install into a fresh virtualenv works from anywhere: the grammar (and
the C++ runtime headers) ship as package data. One install; it takes a minute or so."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _copy_sources(dst: Path) -> None:
    """The files a commit of the work tree would hold (tracked, or new and not ignored), as a
    fresh clone has them: no build/ or *.egg-info/ left behind in the repository, and no
    empty directories (git keeps none), so a package directory without files shows up."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, names):
        if (REPO / name).is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dst / name)


def _run(*cmd: str | Path, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """The checkout's files installed (`pip install SRC[cpu]`, not editable) into a fresh
    virtualenv, the sources removed after: (the venv, a work directory outside both holding
    adam.ccn)."""
    tmp = tmp_path_factory.mktemp("install")
    src, venv, work = tmp / "src", tmp / "venv", tmp / "work"
    _copy_sources(src)
    work.mkdir()
    _run(sys.executable, "-m", "venv", venv, cwd=tmp)
    _run(venv / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check", f"{src}[cpu]", cwd=tmp)
    shutil.rmtree(src)  # the installed package must not lean on the source tree
    shutil.copy(REPO / "examples" / "adam.ccn", work / "adam.ccn")
    return venv, work


@pytest.mark.slow
def test_pip_install_and_check_from_elsewhere(installed: tuple[Path, Path]) -> None:
    venv, work = installed
    py, coconetc = venv / "bin" / "python", venv / "bin" / "coconetc"
    where = _run(py, "-c", "import coconetc, coconetc.paths as p; print(coconetc.__file__); "
                 "print(p.grammar_file()); print(p.runtime_dir()); print(p.source_path('adamw.ccn'))",
                 cwd=work).stdout.split()
    site = str(venv)
    assert all(w.startswith(site) for w in where), where
    assert (Path(where[1])).is_file() and any((Path(where[2]) / "coconet").glob("*.h"))
    # the example programs ship: a pip user passes AdamW's by its name
    assert Path(where[3]).name == "adamw.ccn" and "program adamw" in Path(where[3]).read_text()

    res = subprocess.run([coconetc, "check", "adam.ccn"], cwd=work, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "adam.ccn: ok (1 programs: adam; 3 schedules)" in res.stdout
    res = _run(coconetc, "run", "adam.ccn", "--ranks", "3", "-s", "zero", "--interp", cwd=work, timeout=120)
    assert "matches the unscheduled program on every rank" in res.stdout


@pytest.mark.slow
def test_the_installed_package_compiles_as_a_user_builds(installed: tuple[Path, Path], tmp_path: Path) -> None:
    """The compiled path from the install: templates and C++ runtime headers ship too (a build
    cache of its own), built as a user's is, with the default options (the other tests build
    at -O0: conftest.py)."""
    venv, work = installed
    env = {**{k: v for k, v in os.environ.items() if k != "CXXFLAGS"}, "COCONET_CACHE": str(tmp_path / "cache")}
    res = subprocess.run([venv / "bin" / "coconetc", "run", "adam.ccn", "--ranks", "2", "-s", "zero", "--size", "N=11"],
                         cwd=work, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "adam [zero]: 2 ranks" in res.stdout and "matches the interpreter on every rank" in res.stdout


def test_every_package_is_listed_in_pyproject() -> None:
    """A new folder of Python modules under coconetc/ is shipped: pyproject's explicit package
    list names it (coconetc.plan was once forgotten, and only the slow install test saw it)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "coconetc").rglob("__init__.py")}
    missing = sorted(found - listed)
    assert not missing, f"packages missing from pyproject.toml: {missing}"


def test_a_bare_name_finds_a_shipped_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """coconetc.load("adamw.ccn") and DistributedOptimizer(params, "adamw.ccn") from a directory
    with no such file take the example that ships with coconet (paths.source_path); a file of
    that name here, or a path with a directory, is taken as it is."""
    from coconetc.paths import source_path
    monkeypatch.chdir(tmp_path)
    shipped = REPO / "examples" / "adamw.ccn"
    assert source_path("adamw.ccn") == shipped and source_path("adamw") == shipped
    assert source_path("nowhere.ccn") == Path("nowhere.ccn")
    assert source_path("sub/adamw.ccn") == Path("sub/adamw.ccn")
    (tmp_path / "adamw.ccn").write_text("mine")
    assert source_path("adamw.ccn") == Path("adamw.ccn")
