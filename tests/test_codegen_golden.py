"""Goldens of generated code: the C++ (CPU backend) and CUDA sources every example generates,
each of its programs under each of its schedules (and "default"), with the derived programs
`<p>_grad`, `<p>_fwd`, `<p>_bwd` of each program the example schedules `for grad(p)`, as
`coconetc.load(..., grad=...)` and `coconetc.torch` build them. A refactor that changes no output
proves it here; a change to the generated code shows as a diff to read.

Golden files live in tests/golden/code/<example>/, one folder per example:
  <function>.cpp       each CPU unit (one function per (program, schedule), compiled on its own)
  table.cpp            the CPU module's table of its functions (module.cpp = units + table)
  CMakeLists.txt       the CPU module's CMakeLists (coconet_add_module, --emit-only)
  module.cu            the CUDA module (every function the CUDA backend renders)
  CMakeLists.cuda.txt  its CMakeLists
  module.emulated.cu   the CUDA module for the host emulation, only where it is not module.cu
The compiler's version and the repository's path are written as <version> and <repo>. Nothing
is compiled. After an intended change to the generated code, regenerate them and read the diff:

    COCONET_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_codegen_golden.py
"""

from __future__ import annotations

import difflib
import os
import shutil
from functools import cache
from pathlib import Path

import pytest

from coconetc.codegen import cpu, cuda
from coconetc.sourcefile import SourceFile, load_file, with_grads
from coconetc.version import __version__

REPO = Path(__file__).resolve().parents[1]
# (not a tuner's temporary copy; nor gpt_pipeline.ccn, whose code is gpt_block.ccn's block four
# times over, once per schedule: gpt_block's golden holds it, and its plans are golden in test_plan)
EXAMPLES = sorted(p for p in (REPO / "examples").glob("*.ccn") if not p.name.startswith(".")
                  and p.name != "gpt_pipeline.ccn")
GOLDEN = Path(__file__).resolve().parent / "golden" / "code"
UPDATE = os.environ.get("COCONET_UPDATE_GOLDEN") == "1"
IDS = [p.stem for p in EXAMPLES]


def _with_grads(path: Path) -> SourceFile:
    """The example, with the derived programs of each program it schedules for grad(p)."""
    mod = load_file(path)  # an absolute path, as coconetc.load passes it (extern headers' directory)
    return with_grads(mod, sorted(set(mod.derived.values())))


def _normal(text: str) -> str:
    return text.replace(f"coconetc {__version__} ", "coconetc <version> ").replace(str(REPO), "<repo>")


@cache
def generated(path: Path) -> dict[str, str]:
    """File name -> its text, as the toolchain generates them (toolchain/compiler.py: _generate)."""
    mod, name = _with_grads(path), path.stem
    src = cpu.generate(mod, name)
    out = {f"{f}.cpp": text for f, text in src.units.items()}
    out |= {"table.cpp": src.table, "CMakeLists.txt": src.cmake}
    cu = cuda.generate(mod, name, cuda.DEFAULT_ARCHS, skip_unsupported=True)
    out |= {"module.cu": cu.cu, "CMakeLists.cuda.txt": cu.cmake}
    emulated = cuda.generate(mod, name, skip_unsupported=True, emulate=True).cu
    if emulated != cu.cu:
        out["module.emulated.cu"] = emulated
    return {f: _normal(text) for f, text in out.items()}


def _diff(folder: Path, name: str, text: str) -> str:
    path = folder / name
    if not path.exists():
        return f"{path} is missing"
    want = path.read_text()
    if want == text:
        return ""
    return "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True),
                                        f"{name} (golden)", f"{name} (now)"))


@pytest.mark.parametrize("path", EXAMPLES, ids=IDS)
def test_generated_code_matches_golden(path: Path) -> None:
    files, folder = generated(path), GOLDEN / path.stem
    if UPDATE:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for name, text in files.items():
            (folder / name).write_text(text)
        return
    diffs = [d for name, text in files.items() if (d := _diff(folder, name, text))]
    diffs += [f"{p} is generated no more" for p in sorted(folder.glob("*")) if p.name not in files]
    if diffs:
        pytest.fail(f"generated code differs from {folder} (COCONET_UPDATE_GOLDEN=1 rewrites it):\n"
                    + "\n".join(diffs))


def test_generated_code_covers_every_variant() -> None:
    """Each (program, schedule) of each example is a CPU unit of its golden (and the CUDA module
    renders the same functions); a grad schedule's program is there with its _fwd and _bwd."""
    for path in EXAMPLES:
        mod, files = _with_grads(path), generated(path)
        names = {f"{p}__{s}" for p, s in mod.variants()}
        assert names == {f[:-4] for f in files if f.endswith(".cpp") and f != "table.cpp"}, path
        assert all(f"void {n}(" in files["module.cu"] for n in names), path
    assert {"tp_mlp_fwd__overlapped.cpp", "tp_mlp_bwd__overlapped.cpp",
            "tp_block_grad__fused.cpp"} <= set(generated(REPO / "examples" / "tp_mlp.ccn"))


def test_no_stale_golden_code() -> None:
    stale = sorted(p.name for p in GOLDEN.glob("*") if p.name not in IDS)
    if UPDATE:
        for name in stale:
            shutil.rmtree(GOLDEN / name)
        return
    assert not stale, f"golden code of no example (COCONET_UPDATE_GOLDEN=1 deletes it): {stale}"
