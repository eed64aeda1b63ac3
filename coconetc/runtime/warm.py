"""Warm loads: what `coconetc.load` made of a file (its checked, scheduled and planned SourceFile,
the generated sources and the built module's path) remembered under the build cache, so that
loading the same file again reads one record instead of parsing, checking, planning and
generating it once more (torch.compile's FX graph cache and JAX's persistent compilation cache
do the same for their graphs).

A record's key is everything the load depends on: coconetc's version and Python sources, the
runtime headers and templates (compiler_hash), the toolchain and CXXFLAGS, the file's path and text, the
load's options and the schedules the autotuner chose for the file on this machine. A file with
extern operations is not remembered (its headers live outside the key). A record is used only
while its module is whole (the manifest's checksum); otherwise the load runs in full and writes
the record again. A record that cannot be read is ignored the same way."""

from __future__ import annotations

import hashlib
import os
import pickle
from functools import cache
from pathlib import Path
from typing import Any

from coconetc.toolchain import Artifact, artifacts
from coconetc.toolchain.probes import cache_dir, compiler_hash, toolchain
from coconetc.version import __version__

FOLDER = "loads"


@cache
def _python_hash() -> str:
    """coconetc's own Python sources (the parser, the checker, the planner and the generators
    decide what a load makes)."""
    h = hashlib.sha256(__version__.encode())
    pkg = Path(__file__).resolve().parent.parent
    for f in sorted(pkg.rglob("*.py")):
        h.update(str(f.relative_to(pkg)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def key(path: Path, text: str, tuned: str, options: tuple[Any, ...]) -> str:
    """The record's name for FILE (read as TEXT) with TUNED (the autotuner's schedules for it)
    loaded with OPTIONS."""
    return artifacts.content_key([_python_hash(), compiler_hash(), toolchain().key(), os.environ.get("CXXFLAGS", ""),
                                  str(path), str(path.absolute()), text, tuned, repr(options)])


def _record(k: str) -> Path:
    return cache_dir().absolute() / FOLDER / f"{k}.pickle"


def recall(k: str) -> Artifact | None:
    """The artifact remembered under K, if there is one and its module is still whole."""
    try:
        art = pickle.loads(_record(k).read_bytes())
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError):
        return None
    if not isinstance(art, Artifact) or art.directory is None or art.path is None:
        return None
    return art if artifacts.verified(art.directory, art.module) == art.path else None


def remember(k: str, art: Artifact) -> None:
    """ART under K (an atomic write: a reader sees the whole record or none)."""
    if art.source_file.externs or art.path is None:
        return
    artifacts.write_atomic(_record(k), pickle.dumps(art, protocol=pickle.HIGHEST_PROTOCOL))
