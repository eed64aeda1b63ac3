"""Warm loads: what `coconetc.load` made of a file remembered under the build cache, so that
loading the same file again reads one record instead of parsing, checking, planning and
generating it once more (torch.compile's FX graph cache and JAX's persistent compilation cache
do the same for their graphs).

A record holds what the module's calls read (module.Exports: the IR each (program, schedule)
runs and its function's name), the module's name and its .so, and, as pickled bytes read only
when `source_module` or `sources` is asked for, the whole Artifact (the checked, scheduled and
planned SourceFile and the generated sources). Reading a record imports the IR's modules and
nothing of the front end, the planner, the code generators or jinja2: a warm load costs the
runtime's own imports and the extension's (tests/test_warm_load.py checks it in a fresh process).

A record's key is everything the load depends on: coconetc's version and Python sources, the
runtime headers and templates (compiler_hash), the toolchain (probes.toolchain_fingerprint) and CXXFLAGS, the file's path and
text, the load's options and the schedules the autotuner chose for the file on this machine. A
file with extern operations is not remembered (its headers live outside the key), and a process
that registered operations of its own (ir/ops.py: added) neither reads nor writes records (the
registry is not in the key either). A record is
used only while its module is whole (the manifest's checksum); otherwise the load runs in full
and writes the record again. A record that cannot be read is ignored the same way."""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coconetc.cache import python_hash
from coconetc.ir import ops
from coconetc.runtime.module import Exports
from coconetc.toolchain import artifacts
from coconetc.toolchain.probes import cache_dir, compiler_hash, toolchain_fingerprint

if TYPE_CHECKING:  # (imported on the cold path only)
    from coconetc.sourcefile import SourceFile
    from coconetc.toolchain.compiler import Artifact

FOLDER = "loads"


@dataclass(frozen=True)
class Record:
    """A remembered load: the module's exports, its name, folder and .so, and the whole
    Artifact pickled (unpickled by `whole`, on demand)."""

    exports: Exports
    module: str
    directory: Path
    path: Path
    artifact: bytes

    def whole(self) -> tuple[SourceFile, Any]:
        """The SourceFile and the generated sources (this imports the modules of the plan, the
        schedule directives and the code generators' records)."""
        art = pickle.loads(self.artifact)
        return art.source_file, art.sources


def key(path: Path, text: str, tuned: str, options: tuple[Any, ...]) -> str:
    """The record's name for FILE (read as TEXT) with TUNED (the autotuner's schedules for it)
    loaded with OPTIONS."""
    return artifacts.content_key([python_hash(), compiler_hash(), toolchain_fingerprint(), os.environ.get("CXXFLAGS", ""),
                                  str(path), str(path.absolute()), text, tuned, repr(options)])


def _record(k: str) -> Path:
    return cache_dir().absolute() / FOLDER / f"{k}.pickle"


def recall(k: str) -> Record | None:
    """The record remembered under K, if there is one and its module is still whole."""
    if ops.added():
        return None
    try:
        rec = pickle.loads(_record(k).read_bytes())
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError):
        return None
    if not isinstance(rec, Record):
        return None
    return rec if artifacts.verified(rec.directory, rec.module) == rec.path else None


def remember(k: str, art: Artifact) -> None:
    """ART under K (an atomic write: a reader sees the whole record or none)."""
    if art.source_file.externs or ops.added() or art.path is None or art.directory is None:
        return
    rec = Record(Exports.of(art.source_file, art.sources), art.module, art.directory, art.path,
                 pickle.dumps(art, protocol=pickle.HIGHEST_PROTOCOL))
    artifacts.write_atomic(_record(k), pickle.dumps(rec, protocol=pickle.HIGHEST_PROTOCOL))
