"""Where the data that ships with the compiler lives: the grammar and the C++ runtime.

An installed coconetc carries them as package data (coconetc/grammar, coconetc/runtime_cpp,
mapped from the repository's top-level grammar/ and runtime_cpp/ by pyproject.toml); a source
checkout (or an editable install) finds them at the top of the repository."""

from __future__ import annotations

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
