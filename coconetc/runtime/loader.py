"""`coconetc.load(file)`: read the file once, add the schedules the autotuner chose for it
(tuned.py), compile it through the toolchain (cached; a partial or corrupt cached module is
built again), import the extension and wrap it (module.py): each program a Python function
taking keyword arguments named as in the program.

A call checks every argument on this rank, then the ranks of the communicator agree on the
call (call.py, agree.py), so any error raises on every rank before any buffer is touched and
nobody is left waiting in a collective; a call with the same buffers as a recent agreed call
takes the hot path (fastpath.py). Nothing in the runtime imports the interpreter or the
tuner."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coconetc.paths import imported_texts
from coconetc.runtime import warm
from coconetc.runtime.module import CompiledModule, ProgramFunction
from coconetc.runtime.tuned import tuned_schedules, with_tuned
from coconetc.toolchain.probes import require_cpu_extra

if TYPE_CHECKING:  # the front half and the compiler: imported on the cold path only (warm.py)
    from coconetc.sourcefile import SourceFile
    from coconetc.toolchain.compiler import Artifact

__all__ = ["CompiledModule", "ProgramFunction", "compile_cpu", "import_extension", "load"]


def compile_cpu(mod: SourceFile, log=None, **libs: Any) -> Artifact:
    """MOD with its tuned schedules, compiled for the CPU backend: the module coconetc.load
    imports (what `coconetc run` builds before it starts the ranks, so that they find it
    built). libs: include_dirs, library_dirs, libraries for extern operations."""
    from coconetc.toolchain.compiler import Options, compile
    require_cpu_extra()
    return compile(with_tuned(mod), "cpu", Options(log=log, **libs))


def load(path: str | Path, log=None, *, include_dirs=(), library_dirs=(), libraries=(), grad=()) -> CompiledModule:
    """Compile FILE (cached) and import it. include_dirs, library_dirs, libraries: where the
    headers and libraries of the file's extern operations are, and what to link (the file's
    own directory is searched for headers too). grad: programs whose derived programs
    (`<p>_grad`, docs/autodiff.md) the module holds too. A file loaded before with the same
    text and options is not parsed, planned or generated again, and the front half and the
    code generators are not imported (warm.py)."""
    require_cpu_extra()  # (a remembered load needs it as much as a build)
    path = Path(path)
    text = path.read_text()
    options = (tuple(map(str, include_dirs)), tuple(map(str, library_dirs)), tuple(map(str, libraries)), tuple(grad))
    # the programs it imports are part of its module
    deps = "".join(imported_texts(path, text))
    key = warm.key(path, text + deps, tuned_schedules(text), options)
    rec = warm.recall(key)
    if rec is not None:
        return CompiledModule.remembered(rec.exports, rec.module, import_extension(rec.module, rec.path), rec.whole)
    from coconetc import sourcefile
    art = compile_cpu(sourcefile.with_grads(sourcefile.load_source(text, str(path)), grad), log,
                      include_dirs=include_dirs, library_dirs=library_dirs, libraries=libraries)
    warm.remember(key, art)
    return wrap(art)


def wrap(art: Artifact) -> CompiledModule:
    assert art.path is not None, art
    return CompiledModule(art.source_file, art.sources, import_extension(art.module, art.path))


def import_extension(name: str, so: Path) -> Any:
    """Imports a built extension module from its file (CPU or CUDA)."""
    spec = importlib.util.spec_from_file_location(name, so)
    assert spec is not None and spec.loader is not None, so
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    return ext
