"""Shared fixtures: the example files, each loaded (parsed, checked, scheduled) once."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from coconetc.sourcefile import SourceFile, load_file

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@cache
def _load(name: str) -> SourceFile:
    return load_file(EXAMPLES / name)


@pytest.fixture(scope="session")
def example():
    """example("adam.ccn") -> the loaded SourceFile (cached for the session)."""
    return _load
