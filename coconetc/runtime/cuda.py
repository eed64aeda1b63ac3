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
path), symmetric_windows.py (`window_empty`), emulation.py (COCONET_CUDA_EMULATE). This file
holds the call's entry and checks, the module, and the emulated module; `nccl_comm`,
`NcclComm`, `window_empty`, `EMULATE` and `emulating` are importable from here as before."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import numpy as np

from coconetc.codegen.naming import function_name
from coconetc.ir.arguments import check_param, from_torch, is_torch
from coconetc.ir.nodes import Param, Program
from coconetc.ir.storage import STORAGE
from coconetc.plan.label import ScheduleLabel, parse
from coconetc.plan.targets import Target
from coconetc.runtime import agree, auto, batch, marshal
from coconetc.runtime.call import agreed, check_groups, check_replicated, description, tensor_shapes
from coconetc.runtime.checks import checked_arguments, device_span, host_span, per_part
from coconetc.runtime.emulation import EMULATE, emulating
from coconetc.runtime.fastpath import Recent, RecentCall, held, same
from coconetc.runtime.layout import TORCH_DTYPES
from coconetc.runtime.loader import import_extension
from coconetc.runtime.nccl import NcclComm, agree_record, exchange, nccl_comm
from coconetc.runtime.symmetric_windows import window_empty
from coconetc.runtime.tuned import with_tuned
from coconetc.runtime.watchdog import guarded, refuse_aborted
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
    the module is built for the host emulation (emulating()). The schedules `coconetc tune
    --backend cuda` wrote and chose for the file on this GPU are built in (runtime/tuned.py),
    so that schedule="auto" can run them."""
    if emulating():
        if include_dirs or library_dirs or libraries:
            raise ValueError(f"{EMULATE}=1: the host emulation builds no extern operations' libraries; "
                             "unset it to build them for the GPU")
        return load_emulated(path, log, grad=grad)
    art = compile(with_tuned(with_grads(load_file(path), grad), "cuda"), "cuda",
                  Options(archs=archs, log=log, include_dirs=include_dirs, library_dirs=library_dirs,
                          libraries=libraries))
    return CudaModule.of(art)


class CudaModule:
    target = "cuda"  # the toolchain's target: which tuning records schedule="auto" reads

    @classmethod
    def of(cls, art: Artifact):
        """The built module of ART imported and wrapped."""
        assert art.path is not None, art
        return cls(art.source_file, art.sources, import_extension(art.module, art.path))

    def __init__(self, mod: Any, src: Any, ext: Any):
        self.source_module, self.sources, self.ext = mod, src, ext
        self.programs: dict[str, CudaProgram] = {}
        by_program: dict[str, dict[str, Program]] = {}
        for (prog, sched), ir in mod.variants().items():
            if (prog, sched) in src.functions:  # what the CUDA renderer implements
                by_program.setdefault(prog, {})[sched] = ir
        for prog, scheds in by_program.items():
            fn = self._function(prog, scheds, ext)
            fn.source, fn.file, fn.target = mod.source, mod.file, self.target
            self.programs[prog] = fn
            setattr(self, prog, fn)
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
    def __init__(self, name: str, schedules: dict[str, Program], ext: Any):
        self.name, self.schedules, self.ext = name, schedules, ext
        self._bound: list = []  # the last call's shapes and the sizes they bound
        # schedule="auto" (runtime/auto.py): the records measured on this target
        self.source, self.file, self.target = "", "FILE", "cuda"
        self.tuned: list | None = None
        self.auto_memo: dict[tuple, str] = {}
        # the recent agreed calls (RecentCall), by their buffers (fastpath.Recent)
        self.recent = Recent(tuple(q.name for q in next(iter(schedules.values())).params if not q.scalar))

    def resolve_schedule(self, schedule: str | None, *, comm: Any = None, groups: int = 1,
                         **sizes: int) -> str:
        """The schedule a call with SCHEDULE runs: a named one is itself; "auto" the choice of
        `coconetc tune --backend cuda` for these sizes on the ranks of COMM (an NcclComm) on
        this GPU (as the CPU module's resolve_schedule)."""
        if schedule != "auto":
            self.program_of(parse(schedule))
            return schedule or "default"
        choice = auto.overall(self, comm, groups, sizes)
        self.program_of(parse(choice))
        return choice

    def program_of(self, label: ScheduleLabel) -> Program:
        """The program a schedule label runs. A fused-collective algorithm ("zero@p2p") is a
        choice of the CPU runtime: the CUDA module's collectives are chosen when it is compiled."""
        if label.algorithm:
            raise ValueError(f"{self.name}: schedule {str(label)!r}: the fused-collective algorithm "
                             f"'@{label.algorithm}' is a choice of the CPU backend; call the CUDA "
                             f"module with schedule={label.name!r}")
        if label.name not in self.schedules:
            raise ValueError(f"{self.name}: no schedule '{label.name}' in the CUDA module (have "
                             f"{sorted(self.schedules)}; `coconetc check --backend cuda` says why)")
        return self.schedules[label.name]

    def __call__(self, *, schedule: str | None = None, comm: NcclComm | None = None, groups: int = 1,
                 stream: Any = None, **kwargs):
        import torch
        if comm is None:
            raise ValueError("pass comm=coconetc.runtime.cuda.nccl_comm(module.ext, mpi_comm)")
        try:
            current: int | None = torch.cuda.current_device()
        except RuntimeError:  # no usable device here: the checks raise it, on every rank
            current = None
        label, p, local, sizes, ranks, segments, in_place, rep, repeated = _enter(
            self, schedule, comm, groups, lambda p: _check_local(p, kwargs, stream), kwargs, marshal.device_ptr,
            (current, stream))
        def make(shape, dtype):
            dev = torch.device("cuda", torch.cuda.current_device() if current is None else current)
            return torch.empty(shape, dtype=getattr(torch, TORCH_DTYPES[dtype]), device=dev)
        handle = _stream_handle(stream, current)
        what = rep.what if rep is not None else _call_name(self, label)

        def around(go) -> None:  # the call (or a batch of calls, batch.py) guarded, its work timed: no host sync
            guarded(self.ext, comm, what, go, handle)
        return marshal.returned(_run(self, label, p, local, sizes, segments, comm, groups, ranks,
                                     marshal.device_ptr, make, handle, around, in_place, rep, repeated))


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


def _run(fn: CudaProgram, label: ScheduleLabel, p: Program, local: dict, sizes: dict, segments,
         comm: NcclComm, groups: int, ranks: int, ptr, make, stream: int, around: Any = None,
         in_place: frozenset = frozenset(), rep: RecentCall | None = None, repeated: bool = False) -> list:
    """The module function with the call's arguments (marshal.py, as the CPU runtime lays them
    out) on STREAM, now or, inside batch.together(), with the batch's other calls at its end
    (around: how it runs, batch.invoke); returns the outputs made by `make`. in_place: the
    tensor parameters every rank has in a window (_enter). rep, repeated: the RecentCall that
    _enter took (repeated: this call reuses its module arguments) or made (this call's are kept
    in it for the next)."""
    gs = ranks // groups
    if repeated:
        assert rep is not None and rep.args is not None
        args, run = rep.args, rep.run
        args.in_place = [rep.ptrs[name] for name in sorted(in_place)]
    else:
        args, run = fn.ext.CallArgs(), getattr(fn.ext, function_name(fn.name, label.name))
        marshal.tensors(args, p, local, segments, ptr)
        args.in_place = [ptr(local[name]) for name in sorted(in_place)]
        if rep is not None:
            rep.args, rep.run = args, run
    outs = marshal.outputs(p, sizes, gs, comm.rank % gs, make) if p.outputs else []
    args.outputs = [ptr(o) for o in outs]
    marshal.scalars(args, p, local, sizes)
    args.stream = stream
    args.comm, args.groups = comm.handle, groups
    batch.invoke(fn.ext, run, args, around)
    return outs


def _call_name(fn: CudaProgram, label: ScheduleLabel) -> str:
    """How errors name a call: module.function(schedule='label')."""
    return f"{fn.ext.__name__}.{fn.name}(schedule={str(label)!r})"


def _slot(fn: CudaProgram, schedule: str | None, comm: NcclComm, groups: int, kwargs: dict,
          extra: tuple) -> tuple:
    """Where CudaProgram.recent keeps a call: beside the thread, schedule and buffers, the
    groups, communicator and EXTRA (hashing EXTRA may raise TypeError)."""
    return fn.recent.slot(schedule, kwargs, type(groups), groups, id(comm), extra)


def _repeated(fn: CudaProgram, schedule: str | None, comm: NcclComm, groups: int, kwargs: dict,
              extra: tuple) -> RecentCall | None:
    """The remembered call these arguments repeat, if any (never for "auto", which the full
    checks resolve, under COCONET_CHECK_REPLICATED, whose digests are of each call's values,
    nor inside a batch, which holds each call's own arguments until it ends)."""
    if not fn.recent or schedule == "auto" or batch.collecting():
        return None  # (COCONET_CHECK_REPLICATED on: no call was remembered)
    try:
        rep = fn.recent.get(_slot(fn, schedule, comm, groups, kwargs, extra))
    except TypeError:  # an unhashable stream= (the checks refuse it, on every rank)
        return None
    if rep is None or rep.args is None or rep.comm() is not comm or comm.windows != rep.windows \
            or rep.key != (len(kwargs),) or agree.timeout_raw() != rep.timeout_raw or not same(rep.buffers, kwargs):
        return None
    if rep.grad_check:
        import torch
        if torch.is_grad_enabled():
            return None  # the full checks raise
    return rep


def _remember(fn: CudaProgram, schedule: str | None, comm: NcclComm, groups: int, kwargs: dict, extra: tuple,
              label: ScheduleLabel, what: str, p: Program, local: dict, head: tuple, mine: tuple, ptr,
              timeout: float, sizes: dict, segments: Any) -> RecentCall | None:
    """After a call agreed on every rank: remember it for the next with the same buffers (its
    module function and arguments are added by _run)."""
    if schedule == "auto" or check_replicated() or batch.collecting():
        return None
    tensors = [q.name for q in p.params if not q.scalar]
    if any(isinstance(local[n], list) for n in tensors):
        return None  # a list of segments: not remembered
    try:
        slot = _slot(fn, schedule, comm, groups, kwargs, extra)
    except TypeError:  # an unhashable EXTRA
        return None
    buffers = held(kwargs, fn.recent.names)
    if buffers is None:
        return None
    grad = any(getattr(kwargs[t], "requires_grad", False) for t, _ in p.updates)
    rep = RecentCall((len(kwargs),), buffers, p, label, what, head, mine[1][2],
                     tuple(q for q in p.params if q.scalar), agree.timeout_raw(), timeout, grad_check=grad,
                     comm=weakref.ref(comm), windows=comm.windows, windowed=mine[2],
                     ptrs={n: ptr(local[n]) for n in tensors}, sizes=sizes, segments=segments)
    fn.recent.put(slot, rep)
    return rep


def _enter(fn: CudaProgram, schedule: str | None, comm: NcclComm, groups: int, check,
           kwargs: dict, ptr, extra: tuple = ()) -> tuple:
    """A call's entry, as the CPU runtime's (call.py): "auto" resolved to the tuner's choice for
    these arrays (auto.for_call), the label parsed, this rank's arguments
    checked (`check(program)`), then (at more than one rank) the round of 64-byte records,
    which ends the agreement when every rank repeats an agreed call with the same scalars
    (RecentCall), else one exchange with every rank of the communicator under the watchdog
    (agree.py), so a wrong argument on any rank, or ranks that disagree on the schedule,
    groups, a scalar's bits or a shape (or, under COCONET_CHECK_REPLICATED, a replicated
    tensor's value: call.value_digest, which copies a CUDA tensor to the host after
    synchronizing the device) raise the same error on every rank before anything runs, and a
    rank that never arrives ends the job. The exchange also carries which tensor arguments
    lie in a window of the communicator (window_empty) on this rank (ptr: a tensor's
    address). Returns (label, program, this rank's checked values, size symbols, ranks, the
    segment sizes of scattered parameters, the tensor parameters in a window on every rank,
    the RecentCall this call took or made (or None), and whether it took it: a call with the same
    buffers as a recent one (extra: what else it must share with it, the device and stream)
    checks only its scalars here, and its `local` holds only them)."""
    what = f"{fn.ext.__name__}.{fn.name}(schedule={schedule!r})"
    p: Program | None = None
    label = None
    local: dict[str, Any] = {}
    timeout = agree.DEFAULT_TIMEOUT
    head: tuple = ()
    rep = None
    try:
        rep = _repeated(fn, schedule, comm, groups, kwargs, extra)
        if rep is not None:  # local: the scalars only (the tensors' addresses are rep's)
            label, p, head, timeout = rep.label, rep.program, rep.head, rep.timeout
            local = {q.name: check_param(q, kwargs[q.name]) for q in rep.scalars}
            what = rep.what
            if comm.size == 1:  # nothing to agree: what the remembered call's agreement bound
                refuse_aborted(comm, what)
                return label, p, local, rep.sizes, 1, rep.segments, frozenset(), rep, True
            mine: tuple = ("ok", description(head, p, local, rep.shapes), rep.windowed)
        else:
            timeout = agree.timeout_s()
            if schedule == "auto":
                schedule = auto.for_call(fn, comm, groups, kwargs)
            label = parse(schedule)
            what = _call_name(fn, label)
            p = fn.program_of(label)
            check_groups(fn.name, groups)
            local = check(p)
            head = (fn.ext.__name__, fn.name, str(label), groups, comm.size)
            mine = ("ok", description(head, p, local, tensor_shapes(p, local)),
                    _windowed(fn.ext, comm, groups, p, local, ptr))
    except (TypeError, ValueError, RuntimeError) as err:
        mine = ("error", type(err).__name__, str(err))
    refuse_aborted(comm, what)
    if comm.size > 1:  # first the round of 64-byte records: enough when every rank repeats an agreed call
        config = rep.config if rep is not None and mine[0] == "ok" else None
        scal = agree.scalar_record(b"".join(b for _, _, b in mine[1][1])) if config else b""
        if agree_record(comm, config, scal, groups, what, timeout):
            assert rep is not None and p is not None and label is not None
            return label, p, local, rep.sizes, comm.size, rep.segments, rep.in_place, rep, True
    everyone = exchange(comm, mine, what, timeout, counted=True)
    sizes, segments = agreed(everyone, comm.rank, p, mine, fn._bound)
    assert p is not None and label is not None  # else agreed() raised this rank's error
    in_place = frozenset(mine[2]).intersection(*(item[2] for item in everyone))
    config = agree.digest([(item[1][0], item[1][2], item[2]) for item in everyone])
    if rep is not None:  # what this full agreement bound, for the next repeat
        rep.config, rep.in_place, rep.sizes, rep.segments = config, in_place, sizes, segments
        return label, p, local, sizes, len(everyone), segments, in_place, rep, True
    rep = _remember(fn, schedule, comm, groups, kwargs, extra, label, what, p, local, head, mine, ptr, timeout,
                    sizes, segments)
    if rep is not None:
        rep.config, rep.in_place = config, in_place
    return label, p, local, sizes, len(everyone), segments, in_place, rep, False


def _windowed(ext: Any, comm: NcclComm, groups: int, p: Program, values: dict, ptr) -> tuple[str, ...]:
    """The tensor parameters whose value lies in a window of COMM that the module's symmetric
    kernel reads in place (window_index, symmetric.cuh): where they are on every rank, the
    kernel's own window needs no room to stage them. None at one rank, with groups (the windows
    are the whole communicator's) or before any window_empty on COMM (then no call to ask)."""
    if comm.size == 1 or groups != 1 or not comm.windows:
        return ()
    return tuple(q.name for q in p.params if not q.scalar and not isinstance(values[q.name], list)
                 and ext.window_index(comm.handle, ptr(values[q.name]), values[q.name].nbytes) >= 0)


def _as_tensor(q: Param, v: Any) -> Any:
    """A PyTorch CUDA tensor, or a zero-copy torch view of anything that exposes
    `__cuda_array_interface__` (CuPy, Numba) or DLPack (JAX, CuPy), so updates reach the
    caller's buffer."""
    import torch
    if isinstance(v, torch.Tensor):
        return v
    try:
        if hasattr(v, "__cuda_array_interface__"):
            return torch.as_tensor(v, device="cuda")
        if hasattr(v, "__dlpack__"):
            return torch.from_dlpack(v)
    except Exception as err:  # a foreign array torch cannot view
        raise TypeError(f"'{q.name}': cannot view {type(v).__name__} as a CUDA tensor ({err})") from None
    raise TypeError(f"'{q.name}' must be a CUDA tensor ({q.type}: a PyTorch CUDA tensor, or an array "
                    f"with __cuda_array_interface__ or DLPack), got {type(v).__name__}")


def _check_tensor(q: Param, v: Any, updated: bool) -> Any:
    import torch
    if is_torch(v) and getattr(v, "device", None) is not None and v.device.type == "cpu":
        raise ValueError(f"'{q.name}' is a CPU tensor; the CUDA backend takes CUDA tensors "
                         f"(or set {EMULATE}=1 to run the CUDA module under the host emulation with CPU tensors)")
    v = _as_tensor(q, v)
    if v.device.type != "cuda" or v.device.index != torch.cuda.current_device():
        raise ValueError(f"'{q.name}' is on {v.device}; this module runs on cuda:{torch.cuda.current_device()}")
    if v.dtype != getattr(torch, TORCH_DTYPES[q.type.dtype]):
        raise TypeError(f"'{q.name}' must have dtype {q.type.dtype}, got {v.dtype}")
    if not v.is_contiguous():
        raise ValueError(f"'{q.name}' is not contiguous; pass .contiguous()")
    if updated and v.requires_grad and torch.is_grad_enabled():
        kind = "a leaf Variable" if v.is_leaf else "a tensor"
        raise RuntimeError(f"'{q.name}': {kind} that requires grad is being used in an in-place "
                           "operation; call it under torch.no_grad(), as optimizers do")
    return v


def _check_stream(stream: Any) -> None:
    """stream=: None (PyTorch's current stream), a torch.cuda.Stream of the current device, or
    a raw cudaStream_t as an int."""
    import torch
    if stream is None or (isinstance(stream, int) and not isinstance(stream, bool)):
        return
    if not isinstance(stream, torch.cuda.Stream):
        raise TypeError(f"stream must be a torch.cuda.Stream or a cudaStream_t int, got {type(stream).__name__}")
    if stream.device.index != torch.cuda.current_device():
        raise ValueError(f"stream is on {stream.device}; this module runs on cuda:{torch.cuda.current_device()}")


def _check_local(p: Program, kwargs: dict, stream: Any = None) -> dict:
    _check_stream(stream)
    return checked_arguments(p, kwargs, _CUDA_PARAM, device_span, "tensors")


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
    target = Target.EMULATED

    def _function(self, name: str, schedules: dict[str, Program], ext: Any) -> CudaProgram:
        return EmulatedProgram(name, schedules, ext, self)


class EmulatedProgram(CudaProgram):
    def __init__(self, name: str, schedules: dict[str, Program], ext: Any, owner: EmulatedModule):
        super().__init__(name, schedules, ext)
        self.owner = owner

    def __call__(self, *, schedule: str | None = None, comm: NcclComm | None = None, groups: int = 1,
                 stream: Any = None, **kwargs):
        comm = comm or self.owner.comm()
        label, p, local, sizes, ranks, segments, in_place, rep, repeated = _enter(
            self, schedule, comm, groups, lambda p: _check_local_numpy(p, kwargs), kwargs, marshal.host_ptr)
        what = rep.what if rep is not None else _call_name(self, label)

        def around(go) -> None:  # the call (or a batch of calls, batch.py) guarded, its work timed, synchronized
            guarded(self.ext, comm, what, go, 0, self.ext.synchronize)
        outs = _run(self, label, p, local, sizes, segments, comm, groups, ranks, marshal.host_ptr,
                    _numpy_zeros, 0, around, in_place, rep, repeated)
        if outs and any(is_torch(v) or (isinstance(v, (list, tuple)) and any(map(is_torch, v)))
                        for v in kwargs.values()):  # CPU tensors standing for CUDA tensors: tensors out
            outs = [marshal.as_torch(o) for o in outs]
        return marshal.returned(outs)


def _numpy_zeros(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    return np.zeros(shape, dtype=STORAGE[dtype])


def _checked_array(q: Param, v: Any, updated: bool) -> Any:
    if is_torch(v) and getattr(v, "device", None) is not None:  # a CPU tensor for a CUDA one
        if v.device.type != "cpu":
            raise ValueError(f"'{q.name}' is on {v.device}; the host emulation takes CPU tensors")
        if not v.is_contiguous():
            raise ValueError(f"'{q.name}' is not contiguous; pass .contiguous()")
        v = from_torch(q, v, True)
    if not isinstance(v, np.ndarray):
        raise TypeError(f"'{q.name}' must be a NumPy array ({q.type}), got {type(v).__name__}")
    if v.dtype != STORAGE[q.type.dtype]:
        raise TypeError(f"'{q.name}' must have dtype {q.type.dtype}, got {v.dtype}")
    if not v.flags.c_contiguous or not v.flags.writeable:
        raise ValueError(f"'{q.name}' must be a C-contiguous writeable array")
    return v


def _check_local_numpy(p: Program, kwargs: dict) -> dict:
    return checked_arguments(p, kwargs, _EMULATED_PARAM, host_span, "arrays")


_CUDA_PARAM, _EMULATED_PARAM = per_part(_check_tensor), per_part(_checked_array)
