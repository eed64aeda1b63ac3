"""The backends a loaded module runs on, as objects that own what differs between them: the CPU
(NumPy arrays or CPU tensors, an mpi4py communicator), CUDA (PyTorch CUDA tensors, an NcclComm)
and CUDA under the host emulation (NumPy arrays or CPU tensors standing for device memory, an
NcclComm over MPI). Each says how a call's arguments are checked (checks.py, with its own check
of one buffer), how a buffer's address is read and an output made, how the ranks of its
communicator exchange and agree (agree.py over MPI; nccl.py over an NcclComm), which tensors
lie in a window read in place, how a call is remembered for the next with the same buffers
(fastpath.RecentCall), and, for the code above the runtime (coconetc.torch, the CLI), which
device its tensors live on and which toolchain target builds it. The call's one entry
(entry.py) asks it; nothing else branches on the backend's name.

`backend("cpu" | "cuda" | "cuda-emulated")` is the object; `backend_for(name)` is the one a
user's backend= means here: "cuda" is the emulated one under COCONET_CUDA_EMULATE=1
(emulation.py)."""

from __future__ import annotations

import time
import weakref
from typing import Any

import numpy as np

from coconetc.ir.arguments import from_torch, is_torch
from coconetc.ir.nodes import Param, Program
from coconetc.ir.storage import STORAGE
from coconetc.plan.label import ScheduleLabel
from coconetc.plan.targets import Target
from coconetc.runtime import agree, batch, fastpath, marshal, nccl
from coconetc.runtime.call import check_replicated
from coconetc.runtime.checks import checked_arguments, cpu_buffer, device_span, host_span, per_part
from coconetc.runtime.emulation import EMULATE, emulating
from coconetc.runtime.fastpath import RecentCall, held, same
from coconetc.runtime.layout import TORCH_DTYPES
from coconetc.runtime.watchdog import refuse_aborted


class Backend:
    """What a backend does its own way (the CPU's; CudaBackend and EmulatedBackend override)."""

    name = "cpu"
    target = Target.CPU  # the toolchain's target (and which tuning records schedule="auto" reads)

    # --- the target's facts (plan/targets.py Facts: their one home) -----------------------------
    device = property(lambda self: self.target.facts.device)
    emulated = property(lambda self: self.target.facts.emulated)
    torch_tensors = property(lambda self: self.target.facts.torch_tensors)
    noun = property(lambda self: self.target.facts.noun)
    tag = property(lambda self: self.target.facts.tag)
    gpu = property(lambda self: self.target.facts.gpu)
    algorithms = property(lambda self: self.target.facts.algorithms)
    schedules_left_out = property(lambda self: self.target.facts.schedules_left_out)

    # --- for the code above the runtime (coconetc.torch, the CLI) -------------------------------
    def torch_device(self) -> Any:
        """The torch.device its tensors live on."""
        import torch
        return torch.device("cpu")

    def device_words(self) -> str:
        """Where its tensors live, in words."""
        return "the CPU"

    def device_error(self, what: str, name: str, device: Any) -> str:
        """Why a tensor NAME on DEVICE is refused (it is not on self.device)."""
        return f"{what}: '{name}' is on {device}; the {self.name} backend takes CPU tensors"

    def before_communicator(self) -> None:
        """What runs before a communicator of this backend is made."""

    def communicator(self, mod: Any, comm: Any, process_group: Any = None) -> Any:
        """The communicator a module of this backend calls on, over COMM (mpi4py; the CUDA
        backends': or the torch.distributed PROCESS_GROUP)."""
        return comm

    def map_function(self, fn: Any, label: ScheduleLabel) -> None:
        """Maps the shared object of LABEL's function now, among the call's checks (a CPU module
        that coconetc built maps each unit on its first call: runtime_cpp/coconet/bind.cpp), so
        that a unit missing or failing to load raises RuntimeError on every rank after the
        exchange, not on this rank alone inside the call. A module without units (CMake, CUDA)
        has nothing to map."""
        map_unit = getattr(fn.ext, "_map", None)
        if map_unit is not None:
            map_unit(fn.function_name(label.name))

    # --- a call's arguments ------------------------------------------------------------------
    def check(self, p: Program, kwargs: dict, extra: tuple = (), *, tensors_only: bool = False) -> dict:
        """This rank's arguments checked (checks.py); extra: the call's (device, stream) on CUDA."""
        return checked_arguments(p, kwargs, cpu_buffer, host_span, self.noun, tensors_only=tensors_only)

    def ptr(self, v: Any) -> int:
        """A checked buffer's address."""
        return marshal.host_ptr(v)

    def output(self, shape: tuple[int, ...], dtype: str) -> Any:
        """A new output of the call."""
        return marshal.numpy_empty(shape, dtype)

    # --- the ranks of a call's communicator ------------------------------------------------------
    def size(self, comm: Any) -> int:
        return comm.Get_size()

    def rank(self, comm: Any) -> int:
        return comm.Get_rank()

    def refuse(self, comm: Any, what: str) -> None:
        """Raises if COMM can take no call (an aborted NCCL communicator)."""

    def record_round(self, comm: Any, config: bytes | None, scalars: bytes, groups: int, what: str,
                     timeout: float) -> bool:
        """The repeated calls' round of 64-byte records (agree.Channel.agreed)."""
        return agree.channel(comm).agreed(config, scalars, groups, what, timeout, time.monotonic())

    def exchange(self, comm: Any, mine: Any, what: str, timeout: float) -> list:
        """Every rank's description of the call, under the watchdog (the round counted it)."""
        return agree.exchange(comm, mine, what, timeout, counted=True)

    def windowed(self, ext: Any, comm: Any, groups: int, p: Program, values: dict) -> tuple[str, ...]:
        """The tensor parameters in a window of COMM that the module reads in place."""
        return ()

    # --- recent calls --------------------------------------------------------------------------
    def repeated(self, fn: Any, schedule: str | None, comm: Any, groups: Any, kwargs: dict,
                 extra: tuple) -> RecentCall | None:
        """The remembered call these arguments repeat (the same buffers, unchanged), if any."""
        return fastpath.recall(fn, schedule, groups, comm, kwargs)

    def remember(self, fn: Any, schedule: str | None, comm: Any, groups: int, kwargs: dict, extra: tuple,
                 label: ScheduleLabel, what: str, p: Program, values: dict, mine: tuple, timeout: float,
                 torch_out: bool) -> RecentCall | None:
        """After a call agreed on every rank: remember it for the next with the same buffers."""
        return fastpath.remember(fn, schedule, groups, comm, kwargs, p, label, what, mine[1][0], mine[1][2],
                                 timeout, torch_out)


class CudaBackend(Backend):
    name = "cuda"
    target = Target.CUDA

    def torch_device(self) -> Any:
        import torch
        return torch.device("cuda", torch.cuda.current_device())

    def device_words(self) -> str:
        return str(self.torch_device())

    def device_error(self, what: str, name: str, device: Any) -> str:
        return (f"{what}: '{name}' is on {device}; the CUDA backend takes CUDA tensors "
                f"(or set {EMULATE}=1 to run the CUDA module under the host emulation with CPU tensors)")

    def communicator(self, mod: Any, comm: Any, process_group: Any = None) -> Any:
        return nccl.nccl_comm(mod.ext, comm, process_group=process_group)

    def check(self, p: Program, kwargs: dict, extra: tuple = (), *, tensors_only: bool = False) -> dict:
        if not tensors_only:
            _check_stream(extra[1] if extra else None)
        return checked_arguments(p, kwargs, _CUDA_PARAM, device_span, self.noun, tensors_only=tensors_only)

    def ptr(self, v: Any) -> int:
        return marshal.device_ptr(v)

    def size(self, comm: Any) -> int:
        return comm.size

    def rank(self, comm: Any) -> int:
        return comm.rank

    def refuse(self, comm: Any, what: str) -> None:
        refuse_aborted(comm, what)

    def record_round(self, comm, config, scalars, groups, what, timeout) -> bool:
        return nccl.agree_record(comm, config, scalars, groups, what, timeout)

    def exchange(self, comm: Any, mine: Any, what: str, timeout: float) -> list:
        return nccl.exchange(comm, mine, what, timeout, counted=True)

    def windowed(self, ext: Any, comm: Any, groups: int, p: Program, values: dict) -> tuple[str, ...]:
        """Those whose value lies in a window of COMM that the module's symmetric kernel reads in
        place (window_index, symmetric.cuh): where they are on every rank, the kernel's own window
        needs no room to stage them. None at one rank, with groups (the windows are the whole
        communicator's) or before any window_empty on COMM (then no call to ask)."""
        if comm.size == 1 or groups != 1 or not comm.windows:
            return ()
        return tuple(q.name for q in p.params if not q.scalar and not isinstance(values[q.name], list)
                     and ext.window_index(comm.handle, self.ptr(values[q.name]), values[q.name].nbytes) >= 0)

    def repeated(self, fn, schedule, comm, groups, kwargs, extra) -> RecentCall | None:
        """Never for "auto", which the full checks resolve, under COCONET_CHECK_REPLICATED,
        whose digests are of each call's values, nor inside a batch, which holds each call's own
        arguments until it ends."""
        if not fn.recent or schedule == "auto" or batch.collecting():
            return None  # (COCONET_CHECK_REPLICATED on: no call was remembered)
        try:
            rec = fn.recent.get(_slot(fn, schedule, comm, groups, kwargs, extra))
        except TypeError:  # an unhashable stream= (the checks refuse it, on every rank)
            return None
        if rec is None or rec.args is None or rec.comm() is not comm or comm.windows != rec.windows \
                or rec.key != (len(kwargs),) or agree.timeout_raw() != rec.timeout_raw \
                or not same(rec.buffers, kwargs):
            return None
        if rec.grad_check:
            import torch
            if torch.is_grad_enabled():
                return None  # the full checks raise
        return rec

    def remember(self, fn, schedule, comm, groups, kwargs, extra, label, what, p, values, mine, timeout,
                 torch_out) -> RecentCall | None:
        if schedule == "auto" or check_replicated() or batch.collecting():
            return None
        tensors = [q.name for q in p.params if not q.scalar]
        if any(isinstance(values[n], list) for n in tensors):
            return None  # a list of segments: not remembered
        try:
            slot = _slot(fn, schedule, comm, groups, kwargs, extra)
        except TypeError:  # an unhashable EXTRA
            return None
        buffers = held(kwargs, fn.recent.names)
        if buffers is None:
            return None
        grad = any(getattr(kwargs[t], "requires_grad", False) for t, _ in p.updates)
        rec = RecentCall((len(kwargs),), buffers, p, label, what, mine[1][0], mine[1][2],
                         tuple(q for q in p.params if q.scalar), agree.timeout_raw(), timeout, grad_check=grad,
                         comm=weakref.ref(comm), windows=comm.windows, windowed=mine[2],
                         ptrs={n: self.ptr(values[n]) for n in tensors})
        fn.recent.put(slot, rec)
        return rec


class EmulatedBackend(CudaBackend):
    """The CUDA module built for the host: NumPy arrays (or CPU tensors) stand for device memory."""

    name = Target.EMULATED.value
    target = Target.EMULATED

    def torch_device(self) -> Any:
        import torch
        return torch.device("cpu")

    def device_words(self) -> str:
        return "the CPU (the CUDA module under the host emulation)"

    def device_error(self, what: str, name: str, device: Any) -> str:
        return (f"{what}: '{name}' is on {device}; the cuda backend takes CPU tensors "
                f"({EMULATE}=1: the host emulation takes CPU tensors)")

    def before_communicator(self) -> None:
        """The emulated NCCL runs on MPI: initialized by mpi4py before the module's first call."""
        from mpi4py import MPI  # noqa: F401

    def communicator(self, mod: Any, comm: Any, process_group: Any = None) -> Any:
        return mod.comm(comm)

    def check(self, p: Program, kwargs: dict, extra: tuple = (), *, tensors_only: bool = False) -> dict:
        return checked_arguments(p, kwargs, _EMULATED_PARAM, host_span, self.noun, tensors_only=tensors_only)

    def ptr(self, v: Any) -> int:
        return marshal.host_ptr(v)

    def output(self, shape: tuple[int, ...], dtype: str) -> Any:
        return np.zeros(shape, dtype=STORAGE[dtype])


def _slot(fn: Any, schedule: str | None, comm: Any, groups: int, kwargs: dict, extra: tuple) -> tuple:
    """Where a CUDA program's `recent` keeps a call: beside the thread, schedule and buffers, the
    groups, communicator and EXTRA (hashing EXTRA may raise TypeError)."""
    return fn.recent.slot(schedule, kwargs, type(groups), groups, id(comm), extra)


# --- the checks of one buffer that differ ----------------------------------------------------------
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


_CUDA_PARAM, _EMULATED_PARAM = per_part(_check_tensor), per_part(_checked_array)

BACKENDS: dict[str, Backend] = {b.name: b for b in (Backend(), CudaBackend(), EmulatedBackend())}


def backend(name: str) -> Backend:
    """The backend named NAME ("cpu", "cuda", "cuda-emulated")."""
    return BACKENDS[Target.named(name).value]


def backend_for(name: str) -> Backend:
    """The backend a user's backend=NAME runs on here: "cuda" under COCONET_CUDA_EMULATE=1 is
    the host emulation (emulation.py)."""
    return BACKENDS[Target.named(name, emulating()).value]
