"""The cache's ground floor: where it lives (COCONET_CACHE), how a file in it is written (whole
or not at all), the hash of coconetc's own Python sources that every record made by them is
keyed on, and the parsed-file records.

Parsed files: `load_source` (sourcefile.py) remembers what it made of a text (the checked,
scheduled and planned SourceFile, pickled) under `parsed/<key>.pickle`, the key holding
coconetc's version and Python sources, the file's name and text and the text of every file it
imports; a later load of the same text (another process, another rank, another test worker)
reads the record instead of parsing, checking and planning again. A file that declares extern
operations is not remembered, and a process that registered operations of its own neither
reads nor writes records (neither is in the key). A record that cannot be read is ignored."""

from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

from coconetc.version import __version__

ENV_CACHE = "COCONET_CACHE"  # where built modules and records live (default ~/.cache/coconet)
PARSED = "parsed"


def cache_dir() -> Path:
    return Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "coconet")


def write_atomic(path: Path, data: str | bytes) -> None:
    """PATH's contents replaced at once (a temporary file beside it, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o644)  # as an ordinary file (mkstemp makes it private)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def content_key(parts: list[str]) -> str:
    """A short hash of PARTS (a cache key: what a build's or a record's contents depend on)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


@cache
def python_hash() -> str:
    """coconetc's version and own Python sources (the parser, the checker, the planner and the
    generators decide what a load makes)."""
    h = hashlib.sha256(__version__.encode())
    pkg = Path(__file__).resolve().parent
    for f in sorted(pkg.rglob("*.py")):
        h.update(str(f.relative_to(pkg)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _parsed(file: str, text: str, imported: list[str]) -> Path:
    key = content_key([python_hash(), file, str(Path(file).absolute()), text, *imported])
    return cache_dir().absolute() / PARSED / f"{key}.pickle"


def recall_parsed(file: str, text: str, imported: list[str]) -> Any:
    """The SourceFile remembered for FILE's TEXT (IMPORTED: the texts of the files it imports),
    or None."""
    try:
        return pickle.loads(_parsed(file, text, imported).read_bytes())
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError):
        return None


def remember_parsed(file: str, text: str, imported: list[str], mod: Any) -> None:
    try:
        write_atomic(_parsed(file, text, imported), pickle.dumps(mod, protocol=pickle.HIGHEST_PROTOCOL))
    except OSError:  # a cache that cannot be written costs the next load a parse, nothing else
        pass
