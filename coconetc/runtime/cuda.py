"""`coconetc.runtime.cuda.load(file)`: compile a file with the CUDA backend (cached), import the
module and wrap it: each program is a Python function taking PyTorch CUDA tensors by keyword
(named as in the program), updating parameters in place and returning new output tensors.

Communicators: `nccl_comm(module, mpi_comm)` makes an NCCL communicator from an MPI one
(ncclGetUniqueId on rank 0, broadcast over MPI, ncclCommInitRank); without MPI (or with
`mpi_comm=None` and no mpi4py) it makes a one-rank communicator from a locally made id.

A call checks on this rank, before anything runs: presence, dtype, device (the current CUDA
device), rank, contiguity; then the shapes of all ranks are exchanged over MPI (when there is an
MPI communicator) and bound to the program (ir/arguments.py), so sizes bound across ranks are
checked identically everywhere. Kernels and collectives run on the given CUDA stream (default:
PyTorch's current stream); the call returns without synchronizing."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from coconetc.codegen.naming import function_name
from coconetc.ir.slices import slice_range
from coconetc.ir.nodes import Param, Program
from coconetc.sourcefile import DEFAULT
from coconetc.ir.types import eval_dim

TORCH_DTYPES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64",
                "i32": "int32", "i64": "int64"}


@dataclass
class NcclComm:
    """An NCCL communicator (handle) with the MPI communicator or torch.distributed process
    group it was made from (neither: a one-rank job)."""

    handle: int
    size: int
    rank: int
    mpi: Any = None
    group: Any = None  # a torch.distributed ProcessGroup (None: mpi, or one rank)


def nccl_comm(ext: Any, mpi_comm: Any = None, *, process_group: Any = None) -> NcclComm:
    """An NCCL communicator over the ranks of mpi_comm (default: MPI.COMM_WORLD when mpi4py
    works, else one rank), or over the ranks of an initialized torch.distributed process group
    (`process_group=`, e.g. `torch.distributed.group.WORLD` under torchrun): rank 0 makes the
    NCCL id, the group broadcasts it. Every rank of the group must call this together."""
    if process_group is not None:
        import torch.distributed as dist
        size, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        box = [ext.nccl_unique_id() if rank == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(process_group, 0), group=process_group)
        return NcclComm(ext.nccl_comm_init(box[0], size, rank), size, rank, None, process_group)
    if mpi_comm is None:
        try:
            from mpi4py import MPI
            mpi_comm = MPI.COMM_WORLD
        except Exception:  # no usable MPI: a one-rank communicator
            mpi_comm = None
    if mpi_comm is None or mpi_comm.Get_size() == 1:
        uid = ext.nccl_unique_id()
        return NcclComm(ext.nccl_comm_init(uid, 1, 0), 1, 0, mpi_comm)
    rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
    uid = mpi_comm.bcast(ext.nccl_unique_id() if rank == 0 else None, root=0)
    return NcclComm(ext.nccl_comm_init(uid, size, rank), size, rank, mpi_comm)


def _exchange(comm: NcclComm, mine: Any, what: str, timeout: float) -> list[Any]:
    """Every rank's `mine`: over MPI under the watchdog (runtime/agree.py), or over the
    torch.distributed group (its own timeout applies)."""
    from coconetc.runtime import agree
    if comm.size == 1:
        return [mine]
    if comm.mpi is not None:
        return agree.exchange(comm.mpi, mine, what, timeout)
    import torch.distributed as dist
    everyone: list[Any] = [None] * comm.size
    dist.all_gather_object(everyone, mine, group=comm.group)
    return everyone


def load(path: str | Path, archs: str | None = None, log=None, *, include_dirs=(), library_dirs=(),
         libraries=()) -> CudaModule:
    """include_dirs, library_dirs, libraries: for the file's extern operations (as coconetc.load)."""
    from coconetc.toolchain.cuda_build import compile_cuda
    from coconetc.runtime.loader import import_extension
    mod, src, so = compile_cuda(path, None, archs, skip_unsupported=True, log=log, include_dirs=include_dirs,
                                library_dirs=library_dirs, libraries=libraries)
    return CudaModule(mod, src, import_extension(src.module, so))


class CudaModule:
    def __init__(self, mod: Any, src: Any, ext: Any):
        self.source_module, self.sources, self.ext = mod, src, ext
        self.programs: dict[str, CudaProgram] = {}
        by_program: dict[str, dict[str, Program]] = {}
        for (prog, sched), ir in mod.variants().items():
            if (prog, sched) in src.functions:  # what the CUDA renderer implements
                by_program.setdefault(prog, {})[sched] = ir
        for prog, scheds in by_program.items():
            self.programs[prog] = CudaProgram(prog, scheds, ext)
            setattr(self, prog, self.programs[prog])
        self._comm: NcclComm | None = None

    def comm(self, mpi_comm: Any = None) -> NcclComm:
        """This module's default communicator (made on first use)."""
        if self._comm is None:
            self._comm = nccl_comm(self.ext, mpi_comm)
        return self._comm


class CudaProgram:
    def __init__(self, name: str, schedules: dict[str, Program], ext: Any):
        self.name, self.schedules, self.ext = name, schedules, ext
        self._bound: list = []  # the last call's shapes and the sizes they bound

    def __call__(self, *, schedule: str | None = None, comm: NcclComm | None = None, groups: int = 1,
                 stream: Any = None, **kwargs):
        import torch
        key = schedule or DEFAULT
        if comm is None:
            raise ValueError("pass comm=coconetc.runtime.cuda.nccl_comm(module.ext, mpi_comm)")
        p, local, sizes, ranks, segments = _enter(self, key, comm, groups, lambda p: _check_local(p, kwargs, stream))
        group_size = ranks // groups
        rank = comm.rank % group_size
        dev = torch.device("cuda", torch.cuda.current_device())
        args = self.ext.CallArgs()
        tensors = [local[q.name] for q in p.params if not q.scalar]
        args.tensors = [0 if isinstance(v, list) else v.data_ptr() for v in tensors]
        args.seg_ptrs = [[x.data_ptr() for x in v] if isinstance(v, list) else [] for v in tensors]
        args.seg_sizes = list(segments or ())
        outs = []
        for _, s in p.outputs:
            t = p.type_of(s)
            outs.append(torch.empty(_local_shape(t, sizes, group_size, rank),
                                    dtype=getattr(torch, TORCH_DTYPES[t.dtype]), device=dev))
        args.outputs = [o.data_ptr() for o in outs]
        _fill_args(args, p, local, sizes)
        st: Any = stream if stream is not None else torch.cuda.current_stream()
        args.stream = int(getattr(st, "cuda_stream", st))
        args.comm, args.groups = comm.handle, groups
        getattr(self.ext, function_name(self.name, key))(args)
        return None if not outs else outs[0] if len(outs) == 1 else tuple(outs)


def _enter(fn: CudaProgram, key: str, comm: NcclComm, groups: int, check) -> tuple:
    """A call's entry, as the CPU loader's (runtime/loader.py): this rank's arguments checked
    (`check(program)`), then one exchange with every rank of the communicator under the
    watchdog (runtime/agree.py), so a wrong argument on any rank, or ranks that disagree on the
    schedule, groups, a scalar's bits or a shape, raise the same error on every rank before
    anything runs, and a rank that never arrives ends the job. Returns (program, this rank's
    checked values, size symbols, ranks, the segment sizes of scattered parameters)."""
    from coconetc.runtime import agree
    from coconetc.runtime.loader import _agree, _scalar_bits
    what = f"{fn.ext.__name__}.{fn.name}(schedule={key!r})"
    p: Program | None = None
    local: dict[str, Any] = {}
    timeout = agree.DEFAULT_TIMEOUT
    try:
        timeout = agree.timeout_s()
        if key not in fn.schedules:
            raise ValueError(f"{fn.name}: no schedule '{key}' in the CUDA module (have "
                             f"{sorted(fn.schedules)}; `coconetc check --backend cuda` says why)")
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            raise ValueError(f"{fn.name}(): groups must be a positive integer, got {groups!r}")
        p = fn.schedules[key]
        local = check(p)
        head = (fn.ext.__name__, fn.name, key, groups, comm.size)
        mine: tuple = ("ok", (head, _scalar_bits(p, local), _describe(p, local)))
    except (TypeError, ValueError, RuntimeError) as err:
        mine = ("error", type(err).__name__, str(err))
    everyone = _exchange(comm, mine, what, timeout)
    sizes, segments = _agree(everyone, comm.rank, p, mine, fn._bound)
    assert p is not None  # else _agree raised this rank's error
    return p, local, sizes, len(everyone), segments


def _fill_args(args: Any, p: Program, local: dict, sizes: dict) -> None:
    args.sizes = [sizes[s] for s in sorted(sizes)]
    scal = [q for q in p.params if q.scalar]
    args.scalars = [float(local[q.name]) if not q.type.dtype.startswith("i") else 0.0 for q in scal]
    args.iscalars = [int(local[q.name]) if q.type.dtype.startswith("i") else 0 for q in scal]


def _local_shape(t, sizes: dict, gs: int, rank: int) -> tuple[int, ...]:
    shape = [eval_dim(d, sizes) for d in t.shape]
    if t.layout.sliced:
        lo, hi = slice_range(shape[t.layout.dim], gs, rank)
        shape[t.layout.dim] = hi - lo
    return tuple(shape)


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
    v = _as_tensor(q, v)
    if v.device.type != "cuda" or v.device.index != torch.cuda.current_device():
        raise ValueError(f"'{q.name}' is on {v.device}; this module runs on cuda:{torch.cuda.current_device()}")
    if v.dtype != getattr(torch, TORCH_DTYPES[q.type.dtype]):
        raise TypeError(f"'{q.name}' must have dtype {q.type.dtype}, got {v.dtype}")
    if not v.is_contiguous():
        raise ValueError(f"'{q.name}' is not contiguous; pass .contiguous()")
    if v.dim() != q.type.ndim:
        raise ValueError(f"'{q.name}' must be {q.type.ndim}-d ({q.type}), got shape {tuple(v.shape)}")
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


def _arguments(p: Program, kwargs: dict, tensor) -> dict:
    """Names and scalars checked; each tensor, or each segment of a scattered one (a list of
    1-D arrays, or one array: one segment), through `tensor(param, value, updated)`."""
    extra = sorted(set(kwargs) - {q.name for q in p.params})
    if extra:
        raise TypeError(f"{p.name}() got an unexpected keyword argument '{extra[0]}'")
    updated = {t for t, _ in p.updates}
    out: dict[str, Any] = {}
    for q in p.params:
        if q.name not in kwargs:
            raise TypeError(f"{p.name}() missing argument '{q.name}'")
        v = kwargs[q.name]
        if q.scalar:
            out[q.name] = _scalar(q, v)
        elif q.scattered:
            out[q.name] = [tensor(q, x, q.name in updated) for x in (v if isinstance(v, (list, tuple)) else [v])]
        else:
            out[q.name] = tensor(q, v, q.name in updated)
    return out


def _check_local(p: Program, kwargs: dict, stream: Any = None) -> dict:
    _check_stream(stream)
    out = _arguments(p, kwargs, _check_tensor)
    _no_aliases(p, out)
    return out


def _no_aliases(p: Program, values: dict) -> None:
    """Two tensor parameters whose device memory overlaps (the same tensor, or views of one)."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), q.name)
                   for q in p.params if not q.scalar
                   for t in (values[q.name] if isinstance(values[q.name], list) else [values[q.name]]) if t.numel())
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"{p.name}(): '{a}' and '{b}' overlap in memory (the same buffer, or "
                             "views of one); pass separate tensors")


def _scalar(q: Param, v: Any) -> Any:
    if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, (int, float, np.number)):
        raise TypeError(f"'{q.name}' must be a number ({q.type.dtype}), got {type(v).__name__}")
    return v


def _describe(p: Program, values: dict) -> dict:
    return {q.name: values[q.name] if q.scalar else [tuple(x.shape) for x in values[q.name]]
            if isinstance(values[q.name], list) else tuple(values[q.name].shape) for q in p.params}




# ---- host emulation ----------------------------------------------------------------------------------

def load_emulated(path: str | Path, log=None) -> EmulatedModule:
    """FILE's CUDA module built for the host emulation (toolchain/cuda_build.py: compile_emulated):
    the generated CUDA code run on the CPU, NCCL on MPI. Programs take NumPy arrays (host memory
    stands for device memory), update parameters in place and return new NumPy outputs; every
    call synchronizes and raises if the emulation found a stream race."""
    from coconetc.toolchain.cuda_build import compile_emulated
    from coconetc.runtime.loader import import_extension
    mod, src, so = compile_emulated(path, log=log)
    return EmulatedModule(mod, src, import_extension(src.module, so))


class EmulatedModule(CudaModule):
    def __init__(self, mod: Any, src: Any, ext: Any):
        super().__init__(mod, src, ext)
        for name, prog in list(self.programs.items()):
            self.programs[name] = EmulatedProgram(prog.name, prog.schedules, ext, self)
            setattr(self, name, self.programs[name])


class EmulatedProgram(CudaProgram):
    def __init__(self, name: str, schedules: dict[str, Program], ext: Any, owner: EmulatedModule):
        super().__init__(name, schedules, ext)
        self.owner = owner

    def __call__(self, *, schedule: str | None = None, comm: NcclComm | None = None, groups: int = 1,
                 stream: Any = None, **kwargs):
        from coconetc.ir.storage import STORAGE
        key = schedule or DEFAULT
        comm = comm or self.owner.comm()
        p, local, sizes, ranks, segments = _enter(self, key, comm, groups, lambda p: _check_local_numpy(p, kwargs))
        group_size = ranks // groups
        rank = comm.rank % group_size
        args = self.ext.CallArgs()
        tensors = [local[q.name] for q in p.params if not q.scalar]
        args.tensors = [0 if isinstance(v, list) else v.ctypes.data for v in tensors]
        args.seg_ptrs = [[x.ctypes.data for x in v] if isinstance(v, list) else [] for v in tensors]
        args.seg_sizes = list(segments or ())
        outs = []
        for _, s in p.outputs:
            t = p.type_of(s)
            outs.append(np.zeros(_local_shape(t, sizes, group_size, rank), dtype=STORAGE[t.dtype]))
        args.outputs = [o.ctypes.data for o in outs]
        _fill_args(args, p, local, sizes)
        args.stream = 0
        args.comm, args.groups = comm.handle, groups
        getattr(self.ext, function_name(self.name, key))(args)
        self.ext.synchronize()
        return None if not outs else outs[0] if len(outs) == 1 else tuple(outs)


def _checked_array(q: Param, v: Any, updated: bool) -> Any:
    from coconetc.ir.storage import STORAGE
    if not isinstance(v, np.ndarray):
        raise TypeError(f"'{q.name}' must be a NumPy array ({q.type}), got {type(v).__name__}")
    if v.dtype != STORAGE[q.type.dtype]:
        raise TypeError(f"'{q.name}' must have dtype {q.type.dtype}, got {v.dtype}")
    if not v.flags.c_contiguous or not v.flags.writeable:
        raise ValueError(f"'{q.name}' must be a C-contiguous writeable array")
    if v.ndim != q.type.ndim:
        raise ValueError(f"'{q.name}' must be {q.type.ndim}-d ({q.type}), got shape {v.shape}")
    return v


def _check_local_numpy(p: Program, kwargs: dict) -> dict:
    out = _arguments(p, kwargs, _checked_array)
    from coconetc.ir.arguments import overlapping
    both = overlapping(p, out)
    if both:
        raise ValueError(f"{p.name}(): {both[0]} and {both[1]} overlap in memory; pass separate arrays")
    return out
