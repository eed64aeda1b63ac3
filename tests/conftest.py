"""Shared fixtures: the example files, each loaded (parsed, checked, scheduled) once."""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

import pytest

from coconetc.launch import mpiexec
from coconetc.sourcefile import SourceFile, load_file

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# The tests build their modules at -O0 (CXXFLAGS, read as CMake reads it, after the default -O3:
# toolchain/commands.py; the host emulation's too), in about half the compiler time of -O1 and a
# third of -O3's; what a module computes does not depend on it (no -ffast-math), and the tests'
# sizes are small (their GEMMs are the BLAS library's). tests/test_install.py builds as a user
# does, with the defaults. A CXXFLAGS of the caller's is kept.
os.environ.setdefault("CXXFLAGS", "-O0")

# Every MPI process the tests start is on this machine: Open MPI's settings for that
# (mpiexec.ONE_MACHINE, which mpiexec.environment gives the ranks it starts on one machine) for
# the rest too: a test process's own MPI, and the docs' mpiexec commands.
for _k, _v in mpiexec.ONE_MACHINE.items():
    os.environ.setdefault(_k, _v)


def pytest_configure(config):
    """Every test, and every rank or process it starts, builds into one cache, the session's
    .pytest_cache/d/coconet-build (never the user's COCONET_CACHE): a module one test built,
    and the runtime compiled once per machine, are there for the others."""
    from coconetc.toolchain import probes
    os.environ[probes.ENV_CACHE] = str(config.cache.mkdir("coconet-build"))


def pytest_collection_modifyitems(items):
    """The files run longest first (tests/durations.json; a file it does not list, as one of
    the median), each file's tests together and in their order: the last tests to run are the
    short ones, so the two workers end together."""
    import durations
    seconds = durations.load()
    median = sorted(seconds.values())[len(seconds) // 2] if seconds else 0.0
    items.sort(key=lambda item: -seconds.get(item.path.name, median))


@cache
def _load(name: str) -> SourceFile:
    return load_file(EXAMPLES / name)


@pytest.fixture(scope="session")
def example():
    """example("adam.ccn") -> the loaded SourceFile (cached for the session)."""
    return _load
