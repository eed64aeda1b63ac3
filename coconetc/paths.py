"""Where the data that ships with the compiler lives: the grammar, the C++ runtime and the
example programs.

An installed coconetc carries them as package data (coconetc/grammar, coconetc/runtime_cpp,
coconetc/examples, mapped from the repository's top-level grammar/, runtime_cpp/ and
examples/ by pyproject.toml); a source checkout (or an editable install) finds them at the top
of the repository."""

from __future__ import annotations

import re
from pathlib import Path

_PKG = Path(__file__).resolve().parent


def _data_dir(name: str) -> Path:
    for candidate in (_PKG / name, _PKG.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"coconetc: cannot find its {name}/ directory (broken install?)")


def grammar_file() -> Path:
    return _data_dir("grammar") / "coconet.lark"


def runtime_dir() -> Path:
    return _data_dir("runtime_cpp")


def examples_dir() -> Path:
    return _data_dir("examples")


def source_path(path: str | Path) -> Path:
    """The .ccn file PATH names: PATH itself, or, where no such file is here and PATH is a bare
    name ("adamw.ccn" or "adamw"), the example program of that name that ships with coconet
    (examples/: the optimizers adam, adamw, lamb, ..., the layers tp_mlp, gpt_block, ...), so
    that `coconetc.load("adamw.ccn")` or `DistributedOptimizer(params, "adamw.ccn", ...)` works
    after a pip install, from any directory."""
    p = Path(path)
    if p.exists() or len(p.parts) != 1:
        return p
    try:
        shipped = examples_dir() / (p.name if p.suffix == ".ccn" else f"{p.name}.ccn")
    except FileNotFoundError:  # an install without its examples
        return p
    return shipped if shipped.is_file() else p


def install_command(extra: str) -> str:
    """The pip command that installs what the EXTRA of coconet's package (pyproject.toml's
    optional dependencies: "cpu", "cuda", ...) brings, package by package, read from the
    installed package's metadata: it works wherever coconet was installed from (a checkout, a
    wheel), unlike `pip install 'coconet[cpu]'`, which asks a registry that has no coconet."""
    import re
    from importlib import metadata
    try:
        reqs = metadata.requires("coconet") or []
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return f"pip install '.[{extra}]' (in a coconet checkout)"
    mine = [r.split(";")[0].strip() for r in reqs
            if re.search(rf"""extra\s*==\s*["']{re.escape(extra)}["']""", r.partition(";")[2])]
    return "pip install " + " ".join(f"'{r}'" for r in mine) if mine else f"pip install '.[{extra}]'"


_IMPORT = re.compile(r'^[ \t]*from[ \t]+"([^"\n]*)"[ \t]+import\b', re.M)


def import_path(importer: str | Path, name: str) -> Path:
    """The file `from "NAME" import ...` in the .ccn file IMPORTER names: NAME relative to
    IMPORTER's folder (the working directory for a text that is no file, "<string>"), or a
    shipped example by its bare name (source_path)."""
    base = Path(importer).parent if Path(importer).is_file() else Path.cwd()
    here = base / name
    return here if here.exists() else source_path(name)


def imported_files(importer: str | Path, text: str) -> list[Path]:
    """The files TEXT (the .ccn file IMPORTER) imports programs from, directly (what a cache of
    its module must key on besides its own text)."""
    return [import_path(importer, m) for m in _IMPORT.findall(text)]


def imported_texts(importer: str | Path, text: str) -> list[str]:
    """The texts of the files TEXT imports from ("" for one that is missing: its load fails, and
    names it), what a cache of its load keys on besides TEXT."""
    return [f.read_text() if f.is_file() else "" for f in imported_files(importer, text)]
