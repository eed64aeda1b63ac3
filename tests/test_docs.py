"""The README and the tutorial (docs/tutorial/*.md) run exactly as written, so they cannot drift
from the code.

Each fenced block is run by its info string, in the order of the page, from a temporary
directory outside the checkout, with the `coconetc` of this Python first on PATH:

- ```sh: run by `bash -e` (a failing command fails the block);
- ```python (or ```python NAME, saved as NAME for the blocks after it): written to a file and
  run by this Python (one process: a job of one rank);
- ```ccn NAME: a whole .ccn file, written to NAME and checked (`coconetc check NAME`);
- ```text: not run. Every such block is listed in EXEMPT below, with why; any other is an error.

Each tutorial page runs in a directory of its own, given the files it reads from earlier pages
(EARLIER: page 4 runs the adam.ccn of page 1), so that the pages run side by side. Builds go to
the pytest cache that the other tests share (COCONET_CACHE): page 1 writes examples/adam.ccn byte
for byte, so the modules other tests build from it (CPU, and CUDA under the host emulation) are
reused, and the README's sgd.ccn is the one page 3 writes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
TUTORIAL = sorted((REPO / "docs" / "tutorial").glob("[0-9][0-9]_*.md"))
PAGES = [README, *TUTORIAL]

FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)

# The blocks that do not run (fenced ```text), exactly, and why.
EXEMPT = {
    ("README.md", "make demo    # set-up, then compile examples/adam.ccn and run it and all its schedules on 4 MPI ranks\n"
                  "make test    # set-up, then lint and the whole test suite\n"):
        "make test would run this test again (recursion); both create and install into the checkout's "
        ".venv, which is not the reader's directory. test_readme_make_targets_exist checks the targets.",
    ("README.md", "pip install '.[cpu]'\n"):
        "an install into this virtualenv; tests/test_install.py installs into a fresh one and runs from elsewhere",
    ("01_data_parallel_optimizer.md", "pip install '.[cpu]'\n"):
        "the same install as the README's",
}


def blocks(page: Path) -> list[tuple[str, str, str]]:
    """(kind, argument, text) of every fenced block of the page, in order."""
    found = []
    for m in FENCE.finditer(page.read_text()):
        info = m.group(1).split()
        found.append((info[0] if info else "", " ".join(info[1:]), m.group(2)))
    return found


@pytest.fixture
def doc_env(request, tmp_path: Path) -> dict[str, str]:
    """The environment a reader has: this virtualenv's `coconetc` first on PATH; builds cached where
    the other tests cache theirs (COCONET_CACHE, also set here for anything they start)."""
    cache = str(request.config.cache.mkdir("coconet-build"))
    os.environ["COCONET_CACHE"] = cache
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, "COCONET_CACHE": cache}


def _run_block(page: Path, i: int, kind: str, arg: str, text: str, cwd: Path, env: dict[str, str]) -> None:
    if kind == "sh":
        cmd = ["bash", "-e", "-c", text]
    elif kind == "python":
        script = cwd / (arg or f"_{page.stem}_block{i}.py")  # ```python NAME: saved as NAME, for later blocks
        script.write_text(text)
        cmd = [sys.executable, script.name]
    elif kind == "ccn":
        assert arg, f"{page.name}, block {i}: a ```ccn block names its file (```ccn sgd.ccn)"
        (cwd / arg).write_text(text)
        cmd = ["coconetc", "check", arg]
    else:
        assert kind == "text" and (page.name, text) in EXEMPT, (
            f"{page.name}, block {i} (```{kind}) is neither run nor listed in EXEMPT:\n{text}")
        return
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, (f"{page.name}, block {i} (```{kind}) failed with {res.returncode}:\n{text}\n"
                                 f"--- stdout\n{res.stdout[-4000:]}\n--- stderr\n{res.stderr[-4000:]}")


def _run_pages(pages: list[Path], cwd: Path, env: dict[str, str]) -> None:
    assert cwd.resolve() != REPO and REPO not in cwd.resolve().parents
    for page in pages:
        for i, (kind, arg, text) in enumerate(blocks(page)):
            _run_block(page, i, kind, arg, text, cwd, env)


def test_readme_runs_as_written(tmp_path: Path, doc_env: dict[str, str]) -> None:
    _run_pages([README], tmp_path, doc_env)


# What a page reads that an earlier page wrote (the rest of each page is its own): page 4 runs
# page 1's adam.ccn, which is examples/adam.ccn byte for byte (test_tutorial_page[1] checks).
EARLIER = {"04_gpus_and_clusters.md": {"adam.ccn": REPO / "examples" / "adam.ccn"}}


@pytest.mark.slow
@pytest.mark.parametrize("page", [1, 2, 3, 4, 5])
def test_tutorial_page_runs_as_written(page: int, tmp_path: Path, doc_env: dict[str, str]) -> None:
    """Each page of the tutorial in a directory of its own, with what it reads from earlier
    pages (EARLIER), so that the pages run side by side on the test workers."""
    assert [p.name for p in TUTORIAL] == ["01_data_parallel_optimizer.md", "02_tensor_parallel_layer.md",
                                          "03_schedules_plan_proofs.md", "04_gpus_and_clusters.md",
                                          "05_your_nanogpt_block.md"]
    doc = TUTORIAL[page - 1]
    for name, src in EARLIER.get(doc.name, {}).items():
        (tmp_path / name).write_bytes(src.read_bytes())
    _run_pages([doc], tmp_path, doc_env)
    if page == 1:  # what page 4 (and the modules other tests build) take as page 1's file
        assert (tmp_path / "adam.ccn").read_bytes() == EARLIER["04_gpus_and_clusters.md"]["adam.ccn"].read_bytes()


def test_every_block_is_run_or_listed_exempt() -> None:
    """No block is silently skipped: an unknown kind, or a ```text block not in EXEMPT, fails here
    (without running anything), and every EXEMPT entry is still on its page."""
    seen = set()
    for page in PAGES:
        for i, (kind, _, text) in enumerate(blocks(page)):
            assert kind in ("sh", "python", "ccn", "text"), f"{page.name}, block {i}: ```{kind}"
            if kind == "text":
                assert (page.name, text) in EXEMPT, f"{page.name}, block {i} is not run:\n{text}"
                seen.add((page.name, text))
    assert seen == set(EXEMPT)


def test_readme_make_targets_exist() -> None:
    """The README's two commands name real targets (`make -n` prints their commands, runs none)."""
    res = subprocess.run(["make", "-n", "-C", str(REPO), "demo", "test"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "coconetc run examples/adam.ccn --ranks 4 --schedule all" in res.stdout
    assert "pytest" in res.stdout


def test_readme_is_short() -> None:
    assert len(README.read_text().splitlines()) < 150


def test_relative_links_resolve() -> None:
    """Every relative link of the README, the tutorial, language.md and design.md names a file
    that exists."""
    docs = REPO / "docs"
    for page in [*PAGES, docs / "language.md", docs / "design.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.name}: broken link {target}"


def test_the_tracing_page_runs_as_written(tmp_path: Path, doc_env: dict[str, str]) -> None:
    """docs/tracing.md: a run on 2 ranks under COCONET_TRACE, its files merged; a traced block;
    the files it says are there."""
    _run_pages([REPO / "docs" / "tracing.md"], tmp_path, doc_env)
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == ["trace.json", "trace.rank0.json",
                                                                       "trace.rank1.json"]
    assert [p.name for p in (tmp_path / "traces_block").iterdir()] == ["trace.rank0.json"]


def test_the_pipeline_page_runs_as_written(tmp_path: Path, doc_env: dict[str, str]) -> None:
    """docs/pipeline.md: the orders' timelines; two layers trained in a pipeline, on 1 and on 2
    ranks, checked against one process by the script itself."""
    _run_pages([REPO / "docs" / "pipeline.md"], tmp_path, doc_env)


# A repository path in backticks: under a top-level directory, or a top-level file.
NAMED_PATH = re.compile(r"`((?:coconetc|runtime_cpp|tests|examples|bench|docs|grammar|cmake|\.ci)/[\w./-]*"
                        r"|Makefile|pyproject\.toml|README\.md|CMakeLists\.txt)(?::[\w.]+)?[`:\s]")


def test_named_paths_exist() -> None:
    """Every repository path docs/architecture.md and docs/layout.md name in backticks
    (`coconetc/plan/units.py`, `runtime_cpp/coconet/trace.h`, `examples/adam.ccn`, ...) exists, so
    a page cannot go on naming a file that is gone. A path with a glob or a placeholder is skipped."""
    missing = []
    for page in ("architecture.md", "layout.md"):
        for path in NAMED_PATH.findall((REPO / "docs" / page).read_text()):
            path = path.rstrip(".,;")
            if any(c in path for c in "*{<"):
                continue
            if not (REPO / path).exists():
                missing.append(f"{page}: {path}")
    assert not missing, "\n".join(missing)
