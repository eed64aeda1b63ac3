"""`coconetc.runtime.cuda.load(file)`: compile a file with the CUDA backend (cached), import the
module and wrap it: each program is a Python function taking PyTorch CUDA tensors by keyword
(named as in the program), updating parameters in place and returning new output tensors.

A call checks on this rank, before anything runs: presence, dtype, device (the current CUDA
device), rank, contiguity; then the shapes of all ranks are exchanged over MPI (when there is an
MPI communicator) and bound to the program (ir/arguments.py), so sizes bound across ranks are
checked identically everywhere. A call with the same tensors as a recent one (a training loop's
step) checks only its scalars on this rank, and the ranks exchange 64-byte records, not their
descriptions, while every rank repeats an agreed call (RecentCall). With a process group, the
exchange goes over the group, or over a gloo group of its ranks where the group's object
collectives would go through the GPU (nccl.py: _host_group). Kernels and collectives run on the
given CUDA stream (default: PyTorch's current stream); the call returns without synchronizing.

Beside this file, each a job of the CUDA runtime: nccl.py (the NCCL communicators,
`nccl_comm`, and what every rank of one says), abort_notices.py and watchdog.py (the abort
path), symmetric_windows.py (`window_empty`), emulation.py (COCONET_CUDA_EMULATE). The call's
entry is entry.py's, its checks the backend's (backends.py: CudaBackend, EmulatedBackend). This
file holds the module and the emulated module; `nccl_comm`,
`NcclComm`, `window_empty`, `EMULATE` and `emulating` are importable from here as before."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from coconetc.codegen.naming import function_name
from coconetc.ir.arguments import is_torch
from coconetc.ir.nodes import Program
from coconetc.plan.label import ScheduleLabel
from coconetc.plan.targets import Target
from coconetc.runtime import marshal, programs, trace
from coconetc.runtime.backends import BACKENDS, backend_for
from coconetc.runtime.emulation import EMULATE, emulating
from coconetc.runtime.entry import Call, enter
from coconetc.runtime.fastpath import Recent
from coconetc.runtime.layout import TORCH_DTYPES
from coconetc.runtime.loader import import_extension
from coconetc.runtime.nccl import NcclComm, nccl_comm
from coconetc.runtime.symmetric_windows import window_empty
from coconetc.runtime.tuned import with_tuned
from coconetc.runtime.watchdog import guarded
from coconetc.sourcefile import load_file, with_grads
from coconetc.toolchain import Artifact, Options, compile

__all__ = ["EMULATE", "CudaModule", "CudaProgram", "EmulatedModule", "EmulatedProgram", "NcclComm", "emulating",
           "fused_trial_calls", "load", "load_emulated", "nccl_comm", "window_empty"]


def fused_trial_calls(ext: Any) -> int:
    """How many first calls at a size of a function of the CUDA module EXT are auto's trials of
    its fused units, alternating their two algorithms (symmetric.cuh: kTrialCalls, which the
    module exports); 0 for another module. What is timed after them and the call after them
    (which reads their times and decides) is the algorithm auto keeps."""
    return int(getattr(ext, "fused_trial_calls", 0))


def load(path: str | Path, archs: str | None = None, log=None, *, include_dirs=(), library_dirs=(),
         libraries=(), grad=()) -> CudaModule:
    """include_dirs, library_dirs, libraries: for the file's extern operations; grad: programs
    whose derived programs the module holds too (as coconetc.load). Under COCONET_CUDA_EMULATE=1
    the module is built for the host emulation (backends.backend_for). The schedules `coconetc tune
    --backend cuda` wrote and chose for the file on this GPU are built in (runtime/tuned.py),
    so that schedule="auto" can run them."""
    if backend_for("cuda").emulated:
        if include_dirs or library_dirs or libraries:
            raise ValueError(f"{EMULATE}=1: the host emulation builds no extern operations' libraries; "
                             "unset it to build them for the GPU")
        return load_emulated(path, log, grad=grad)
    art = compile(with_tuned(with_grads(load_file(path), grad), "cuda"), "cuda",
                  Options(archs=archs, log=log, include_dirs=include_dirs, library_dirs=library_dirs,
                          libraries=libraries))
    return CudaModule.of(art)


class CudaModule:
    backend = BACKENDS["cuda"]  # what differs between the backends (runtime/backends.py)
    target = backend.target  # the toolchain's target: which tuning records schedule="auto" reads

    @classmethod
    def of(cls, art: Artifact):
        """The built module of ART imported and wrapped."""
        assert art.path is not None, art
        return cls(art.source_file, art.sources, import_extension(art.module, art.path))

    def __init__(self, mod: Any, src: Any, ext: Any):
        self.source_module, self.sources, self.ext = mod, src, ext

        def make(prog: str, scheds: dict[str, Program]) -> CudaProgram:
            fn = self._function(prog, scheds, ext)
            fn.source, fn.file, fn.target = mod.source, mod.file, self.target
            fn.whole = lambda: (mod, src)  # (a trace names the plan's units)
            return fn
        implemented = {k: ir for k, ir in mod.variants().items() if k in src.functions}  # by the CUDA renderer
        self.programs: dict[str, CudaProgram] = programs.bind(self, implemented, make)
        self._comm: NcclComm | None = None

    def _function(self, name: str, schedules: dict[str, Program], ext: Any) -> CudaProgram:
        """The wrapper of one program's functions (the emulated module's takes NumPy arrays)."""
        return CudaProgram(name, schedules, ext)

    def comm(self, mpi_comm: Any = None) -> NcclComm:
        """This module's default communicator (made on first use)."""
        if self._comm is None:
            self._comm = nccl_comm(self.ext, mpi_comm)
        return self._comm

    def empty(self, shape: int | tuple[int, ...], dtype: str = "f32", *, comm: NcclComm | None = None) -> Any:
        """A tensor that this module's fused collectives read in place on the ranks of COMM
        (default: the module's communicator); see window_empty. Collective over COMM."""
        return window_empty(self.ext, comm or self.comm(), shape, dtype)


class CudaProgram:
    backend = CudaModule.backend

    def __init__(self, name: str, schedules: dict[str, Program], ext: Any):
        self.name, self.schedules, self.ext = name, schedules, ext
        self._bound: list = []  # the last call's shapes and the sizes they bound
        # schedule="auto" (runtime/auto.py): the records measured on this target
        self.source, self.file, self.target = "", "FILE", "cuda"
        self.tuned: list | None = None
        self.whole: Callable[[], tuple[Any, Any]] | None = None  # (SourceFile, sources): a trace names the units
        self.auto_memo: dict[tuple, str] = {}
        # the recent agreed calls (RecentCall), by their buffers (fastpath.Recent)
        self.recent = Recent(tuple(q.name for q in next(iter(schedules.values())).params if not q.scalar))

    def resolve_schedule(self, schedule: str | None, *, comm: Any = None, groups: int = 1,
                         **sizes: int) -> str:
        """The schedule a call with SCHEDULE runs: a named one is itself; "auto" the choice of
        `coconetc tune --backend cuda` for these sizes on the ranks of COMM (an NcclComm) on
        this GPU (runtime/programs.py: resolve, as the CPU module's)."""
        return programs.resolve(self, schedule, comm, groups, sizes)

    def program_of(self, label: ScheduleLabel) -> Program:
        return programs.program_of(self, label)

    def function_name(self, schedule: str) -> str:
        """The module function of SCHEDULE (as the generator names it)."""
        return function_name(self.name, schedule)

    def __call__(self, *, schedule: str | None = None, comm: NcclComm | None = None, groups: int = 1,
                 stream: Any = None, **kwargs):
        import torch
        if comm is None:
            raise ValueError("pass comm=coconetc.runtime.cuda.nccl_comm(module.ext, mpi_comm)")
        try:
            current: int | None = torch.cuda.current_device()
        except RuntimeError:  # no usable device here: the checks raise it, on every rank
            current = None
        call = enter(self, self.backend, schedule, comm, groups, kwargs, extra=(current, stream))

        def make(shape, dtype):
            dev = torch.device("cuda", torch.cuda.current_device() if current is None else current)
            return torch.empty(shape, dtype=getattr(torch, TORCH_DTYPES[dtype]), device=dev)
        handle = _stream_handle(stream, current)

        def around(go) -> None:  # the call (or a batch of calls, batch.py) guarded, its work timed: no host sync
            guarded(self.ext, comm, call.what, go, handle)
        return marshal.returned(_run(self, call, comm, groups, make, handle, around))


def _stream_handle(stream: Any, current: int | None) -> int:
    """The cudaStream_t a call runs on: `stream=` (checked: a torch.cuda.Stream or a raw int),
    else PyTorch's current stream of the current device, read as torch's compiled code reads it
    (torch._C._cuda_getCurrentRawStream, which Inductor's generated code imports), without
    making a torch.cuda.Stream object: a training step's host time counts."""
    if stream is not None:
        return int(getattr(stream, "cuda_stream", stream))
    import torch
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None and current is not None:
        return int(raw(current))
    return int(torch.cuda.current_stream().cuda_stream)


def _run(fn: CudaProgram, call: Call, comm: NcclComm, groups: int, make, stream: int, around: Any) -> list:
    """The module function with the call's arguments (runtime/programs.py: run, as the CPU
    module's) on STREAM, now or, inside batch.together(), with the batch's other calls at its
    end (around: how it runs, batch.invoke); returns the outputs made by `make`. Tensors the
    module reads in place (call.in_place) are given by address, a repeat's from its record."""
    rec = call.recent

    def extra(args: Any, fresh: bool) -> None:
        if fresh:
            args.in_place = [fn.backend.ptr(call.values[name]) for name in sorted(call.in_place)]
        else:
            assert rec is not None
            args.in_place = [rec.ptrs[name] for name in sorted(call.in_place)]
        args.stream = stream
        args.comm, args.groups = comm.handle, groups
    gs = call.ranks // groups
    if trace.active() is not None:  # the units timed on the GPU by CUDA events (coconet/cuda/trace.cuh)
        outs = trace.traced(fn, call, lambda: programs.run(fn, call, gs, comm.rank % gs, make, extra, around))
    else:
        outs = programs.run(fn, call, gs, comm.rank % gs, make, extra, around)
    if rec is not None and call.config is not None:  # the next call with these buffers repeats it
        rec.config = call.config
    return outs


# ---- host emulation ----------------------------------------------------------------------------------

def load_emulated(path: str | Path, log=None, *, grad=()) -> EmulatedModule:
    """FILE's CUDA module built for the host emulation (toolchain: compile(..., "cuda-emulated")):
    the generated CUDA code run on the CPU, NCCL on MPI. Programs take NumPy arrays (host memory
    stands for device memory), update parameters in place and return new NumPy outputs; every
    call synchronizes and raises if the emulation found a stream race."""
    # MPI started by mpi4py before the module loads (the emulated NCCL starts it itself when
    # nobody has): mpi4py finalizes only what it initialized, so a script that never imported
    # mpi4py would otherwise end without MPI_Finalize, which mpiexec reports as a failed rank
    from mpi4py import MPI  # noqa: F401
    return EmulatedModule.of(compile(with_tuned(with_grads(load_file(path), grad), Target.EMULATED),
                                     Target.EMULATED, Options(log=log)))


class EmulatedModule(CudaModule):
    backend = BACKENDS[Target.EMULATED.value]
    target = backend.target

    def _function(self, name: str, schedules: dict[str, Program], ext: Any) -> CudaProgram:
        return EmulatedProgram(name, schedules, ext, self)


class EmulatedProgram(CudaProgram):
    backend = EmulatedModule.backend

    def __init__(self, name: str, schedules: dict[str, Program], ext: Any, owner: EmulatedModule):
        super().__init__(name, schedules, ext)
        self.owner = owner

    def __call__(self, *, schedule: str | None = None, comm: NcclComm | None = None, groups: int = 1,
                 stream: Any = None, **kwargs):
        comm = comm or self.owner.comm()
        call = enter(self, self.backend, schedule, comm, groups, kwargs)

        def around(go) -> None:  # the call (or a batch of calls, batch.py) guarded, its work timed, synchronized
            guarded(self.ext, comm, call.what, go, 0, self.ext.synchronize)
        outs = _run(self, call, comm, groups, self.backend.output, 0, around)
        if outs and any(is_torch(v) or (isinstance(v, (list, tuple)) and any(map(is_torch, v)))
                        for v in kwargs.values()):  # CPU tensors standing for CUDA tensors: tensors out
            outs = [marshal.as_torch(o) for o in outs]
        return marshal.returned(outs)
