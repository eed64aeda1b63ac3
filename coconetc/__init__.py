"""coconet: a language and compiler for distributed ML programs in which computation and
communication are both first-class."""

from coconetc.errors import CompileError, Diagnostic, ScheduleError, Span

__version__ = "0.1.0"

# In an MPI job of several ranks, an uncaught exception aborts the job instead of leaving the
# other ranks waiting (coconetc/runtime/hooks.py; nothing MPI is imported here).
from coconetc.runtime import hooks as _hooks  # noqa: E402

_hooks.install()
__all__ = ["CompileError", "Diagnostic", "ScheduleError", "Span", "__version__", "load"]


def load(path, log=None):
    """Compile a .ccn file for the CPU (cached) and import it: one function per program."""
    from coconetc.runtime.loader import load as _load
    return _load(path, log)
