"""Built modules on disk, written so that nobody ever loads half of one.

A module's folder holds its sources, `build/<module>*.so` and `manifest.json` (the .so's file
name, size and sha256, and those of the shared objects it maps when called: its units' and the
runtime library, which live in the objects cache: toolchain/commands.py cpu_units), written
last. A module counts as built only when its manifest is there and the .so, its units and the
runtime library match it; anything else (a build that died, a truncated or edited .so or unit,
a unit deleted, a folder from an older coconetc) is built again (a shared object that does not
match is removed first, so that the build makes it again).

Everything else the cache reuses between builds (cached_object: a unit's object and shared
object, the Python bindings' objects, the runtime library, the precompiled header) is kept with
a record of its size and sha256 beside it (`<file>.sum`), written after the file; an object
whose record is missing or does not match is compiled again, never linked or loaded as found. A build runs in a fresh temporary folder beside the
module's; the .so is renamed into place, then the manifest (each an atomic rename). Ranks on one
node that ask for the same module at once take a file lock: one builds, the others wait and
load what it built; ranks that share no lock (other nodes) each build in their own temporary
folder, and the renames leave one complete module."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coconetc.cache import content_key as content_key, write_atomic  # (content_key: the builds' callers find it here)
from coconetc.toolchain.probes import BuildError

MANIFEST = "manifest.json"
UNITS_FILE = "units.txt"  # a build's list of the units' shared objects (absolute paths, one a line)
LIBRARIES_FILE = "libraries.txt"  # the other shared objects its module maps (the runtime library), likewise
SUM = ".sum"  # beside a cached object: "<size> <sha256>" of it
STALE_S = 24 * 3600  # a temporary build folder this old was left by a build that was killed
Run = Callable[[Path, Path, Any], None]  # (source folder, build folder, log): builds the module


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


_SEEN: dict[Path, tuple[int, int, str]] = {}  # path -> (size, mtime_ns, sha256) hashed by this process


def _digest(path: Path) -> tuple[int, str]:
    """PATH's (size, sha256), hashed once per process while its size and mtime stay the same (a
    module's build checks the 100 MB precompiled header, every unit's object and the runtime
    library). Raises OSError."""
    st = path.stat()
    seen = _SEEN.get(path)
    if seen is None or seen[:2] != (st.st_size, st.st_mtime_ns):
        seen = _SEEN[path] = (st.st_size, st.st_mtime_ns, _sha256(path))
    return st.st_size, seen[2]


def _matches(path: Path, size: int, sha256: str) -> bool:
    try:
        return path.stat().st_size == size and _digest(path) == (size, sha256)
    except OSError:
        return False


def _record(path: Path) -> dict[str, Any]:
    size, sha256 = _digest(path)
    return {"path": str(path), "size": size, "sha256": sha256}


def verified(out_dir: Path, module: str) -> Path | None:
    """The module's .so when its manifest is there and the file and its units match it (name,
    size, sha256); None otherwise (not built, or partial or corrupt: build it again)."""
    try:
        m = json.loads((out_dir / MANIFEST).read_text())
        so = out_dir / "build" / m["so"]
        if m.get("module") != module or not _matches(so, m["size"], m["sha256"]):
            return None
        if not all(_matches(Path(u["path"]), u["size"], u["sha256"]) for u in _mapped(m)):
            return None
        return so
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _mapped(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The records of the shared objects a module maps besides its own .so."""
    return [*manifest.get("units", []), *manifest.get("libraries", [])]


def _drop_broken_units(out_dir: Path) -> None:
    """Removes the shared objects of the module's manifest that do not match it (truncated,
    edited), so that the build makes them again instead of finding them in the objects cache."""
    try:
        for u in _mapped(json.loads((out_dir / MANIFEST).read_text())):
            if not _matches(Path(u["path"]), u["size"], u["sha256"]):
                Path(u["path"]).unlink(missing_ok=True)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass


def build(module: str, files: dict[str, str], out_dir: Path, run: Run, log=None) -> Path:
    """MODULE built from FILES (name -> text) in OUT_DIR (absolute) by `run`, or the module
    already built there; returns the path of its .so."""
    assert out_dir.is_absolute(), out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    so = verified(out_dir, module)
    if so is not None:
        return so
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        so = verified(out_dir, module)  # built by whoever held the lock before us
        if so is not None:
            return so
        _drop_broken_units(out_dir)
        (out_dir / MANIFEST).unlink(missing_ok=True)
        _sweep(out_dir)
        for name, text in files.items():
            write_atomic(out_dir / name, text)
        return _build_fresh(module, out_dir, run, log)


def _sweep(out_dir: Path) -> None:
    """Removes the temporary build folders that builds killed long ago left behind."""
    for d in out_dir.glob(".build-*"):
        try:
            if d.stat().st_mtime < time.time() - STALE_S:
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass


def _build_fresh(module: str, out_dir: Path, run: Run, log) -> Path:
    tmp = Path(tempfile.mkdtemp(dir=out_dir, prefix=".build-"))
    try:
        run(out_dir, tmp, log)
        hits = sorted(tmp.glob(f"{module}*.so"))
        if not hits:
            raise BuildError(f"coconetc: the build finished but made no module in {out_dir}")
        final = out_dir / "build" / hits[0].name
        final.parent.mkdir(exist_ok=True)
        os.replace(hits[0], final)
        listed = {f: (tmp / f).read_text().split() if (tmp / f).exists() else [] for f in (UNITS_FILE, LIBRARIES_FILE)}
        manifest = {"module": module, "so": final.name, "size": final.stat().st_size, "sha256": _sha256(final),
                    "units": [_record(Path(u)) for u in listed[UNITS_FILE]],
                    "libraries": [_record(Path(u)) for u in listed[LIBRARIES_FILE]]}
        write_atomic(out_dir / MANIFEST, json.dumps(manifest, indent=1))
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def cached_object(folder: Path, key: str, suffix: str, text: str, compile_: Callable[[Path, Path], None],
                  product: str = ".o") -> Path:
    """The object file compiled from TEXT (a translation unit; KEY: a hash of it and of everything
    else its object depends on), kept in FOLDER as <key>.o (or <key><product>) beside its source
    <key><suffix>: built once per content, under a lock so that processes asking at once compile
    it once; written under a temporary name and renamed, so a partial object is never seen.
    compile_(source, object) runs the compiler. An object is reused only while it matches the
    record of its size and sha256 written beside it after it (<key><product>.sum); one that does
    not (truncated, edited, or from a build killed between the two) is compiled again."""
    obj = folder / f"{key}{product}"
    if whole(obj):
        return obj
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if whole(obj):  # compiled by whoever held the lock before us
            return obj
        src = folder / f"{key}{suffix}"
        write_atomic(src, text)
        tmp = folder / f".{key}.{os.getpid()}{product}"
        try:
            compile_(src, tmp)
            os.replace(tmp, obj)
        finally:
            tmp.unlink(missing_ok=True)
        write_atomic(_sum_path(obj), "{} {}\n".format(*_digest(obj)))
    return obj


def _sum_path(obj: Path) -> Path:
    return obj.with_name(obj.name + SUM)


def whole(obj: Path) -> bool:
    """OBJ is there and matches the record beside it."""
    try:
        size, sha256 = _sum_path(obj).read_text().split()
        return _matches(obj, int(size), sha256)
    except (OSError, ValueError):
        return False
