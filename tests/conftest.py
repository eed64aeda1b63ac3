"""Shared fixtures: the example files, each loaded (parsed, checked, scheduled) once."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from coconetc.driver import Module, load_file

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@cache
def _load(name: str) -> Module:
    return load_file(EXAMPLES / name)


@pytest.fixture(scope="session")
def example():
    """example("adam.ccn") -> the loaded Module (cached for the session)."""
    return _load
