"""coconet: a language and compiler for distributed ML programs in which computation and
communication are both first-class."""

from coconetc.errors import CompileError, Diagnostic, ScheduleError, Span
from coconetc.version import __version__

# In an MPI job of several ranks, an uncaught exception aborts the job instead of leaving the
# other ranks waiting (coconetc/runtime/hooks.py; nothing MPI is imported here).
from coconetc.runtime import hooks as _hooks  # noqa: E402

_hooks.install()
# Open MPI 5's UCX one-sided component prints an error at every window creation on a machine
# without a UCX network; the fused collectives' shared-memory windows (runtime_cpp/coconet/
# fused_shm.h) use osc/sm. Read at MPI_Init, so it only helps when MPI starts after this import
# (coconetc's launcher sets it for the ranks it starts).
_hooks.quiet_osc_ucx()
# A process that starts MPI alone keeps its shared-memory segment in a directory of its own,
# removed at exit (coconetc/runtime/hooks.py, SEGMENTS).
_hooks.own_segments()
__all__ = ["CompileError", "Diagnostic", "ScheduleError", "Span", "__version__", "empty", "empty_cache", "load",
           "trace"]


def load(path, log=None, *, backend="cpu", include_dirs=(), library_dirs=(), libraries=(), archs=None, grad=()):
    """Compile a .ccn file (cached) and import it: one function per program.
    backend: "cpu" (C++ and MPI; NumPy arrays or CPU tensors) or "cuda" (CUDA, NCCL, cuBLAS;
    PyTorch CUDA tensors, see coconetc.runtime.cuda; `archs` as nvcc's, default COCONET_CUDA_ARCHS or "80;90").
    include_dirs, library_dirs, libraries: where the headers and libraries of the file's extern
    operations are and what to link (as `coconetc compile -I -L -l`; the file's own directory
    is searched for headers too). grad: the names of programs (or one name) whose derived
    programs the module holds too: `<p>_grad`, `<p>_fwd`, `<p>_bwd` (docs/autodiff.md); "p:x"
    also `<p>_bwd_input` and `<p>_bwd_weight`, the backward cut at the gradient of input x (a
    pipeline's zero-bubble B and W: docs/pipeline.md).
    With COCONET_CUDA_EMULATE=1, backend="cuda" builds for the host emulation (CPU tensors).
    PATH may name an example program that ships with coconet by its file name alone (no such
    file here): "adamw.ccn", "lamb.ccn", "tp_mlp.ccn" (coconetc.paths.examples_dir())."""
    from coconetc.paths import source_path
    path = source_path(path)  # a bare name may be an example's that ships with coconet
    grad = (grad,) if isinstance(grad, str) else tuple(grad)
    if backend == "cuda":
        from coconetc.runtime.cuda import load as _load_cuda
        return _load_cuda(path, archs, log, include_dirs=include_dirs, library_dirs=library_dirs,
                          libraries=libraries, grad=grad)
    if backend != "cpu" or archs is not None:
        raise ValueError(f"coconetc.load: backend must be 'cpu' or 'cuda' (archs only with cuda), "
                         f"got backend={backend!r}, archs={archs!r}")
    from coconetc.runtime.loader import load as _load
    return _load(path, log, include_dirs=include_dirs, library_dirs=library_dirs, libraries=libraries,
                 grad=grad)


def empty(shape, dtype="f32", *, comm=None, framework="numpy"):
    """An uninitialised NumPy array (or torch tensor, framework="torch") in MPI-3 shared memory
    over the ranks of COMM (default COMM_WORLD) on this node: a fused collective reads such a
    buffer in place instead of copying it (coconetc/runtime/shm.py). Collective over COMM."""
    from coconetc.runtime.shm import empty as _empty
    return _empty(shape, dtype, comm=comm, framework=framework)


def empty_cache():
    """Give the host memory kept from dead outputs of CPU calls back to the system (as
    torch.cuda.empty_cache() does PyTorch's cached device memory); returns the bytes released.
    Outputs still alive are untouched and return their memory to the cache when they die
    (docs/cpu_backend.md, "Kept output memory")."""
    from coconetc.runtime.host_blocks import release
    return release()


def trace(folder="coconet_trace", max_events=None):
    """A context manager: every call of a compiled module inside the block is traced, and at its
    end each rank writes FOLDER/trace.rank<r>.json, a Chrome-trace/Perfetto file (each call, each
    unit of its plan with its bytes, flops and predicted time, each chunk of an overlap or a
    fused collective, each wait). COCONET_TRACE=FOLDER traces a whole process instead. At most
    max_events events are kept (default 1,000,000, COCONET_TRACE_MAX_EVENTS). docs/tracing.md."""
    from coconetc.runtime.trace import trace as _trace
    return _trace(folder, max_events)
