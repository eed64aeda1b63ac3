"""`coconetc.runtime_cuda.load(file)`: compile a file with the CUDA backend (cached), import the
module and wrap it: each program is a Python function taking PyTorch CUDA tensors by keyword
(named as in the program), updating parameters in place and returning new output tensors.

Communicators: `nccl_comm(module, mpi_comm)` makes an NCCL communicator from an MPI one
(ncclGetUniqueId on rank 0, broadcast over MPI, ncclCommInitRank); without MPI (or with
`mpi_comm=None` and no mpi4py) it makes a one-rank communicator from a locally made id.

A call checks on this rank, before anything runs: presence, dtype, device (the current CUDA
device), rank, contiguity; then the shapes of all ranks are exchanged over MPI (when there is an
MPI communicator) and bound to the program (common/validate.py), so sizes bound across ranks are
checked identically everywhere. Kernels and collectives run on the given CUDA stream (default:
PyTorch's current stream); the call returns without synchronizing."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from coconetc.codegen.cpu import DEFAULT, function_name, variants
from coconetc.common.slices import slice_range
from coconetc.common.validate import bind_sizes
from coconetc.ir.nodes import Param, Program
from coconetc.ir.types import eval_dim

TORCH_DTYPES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64",
                "i32": "int32", "i64": "int64"}


@dataclass
class NcclComm:
    """An NCCL communicator (handle) with its MPI communicator (None: a one-rank job)."""

    handle: int
    size: int
    rank: int
    mpi: Any = None


def nccl_comm(ext: Any, mpi_comm: Any = None) -> NcclComm:
    """An NCCL communicator over the ranks of mpi_comm (default: MPI.COMM_WORLD when mpi4py
    works, else one rank). Every rank of mpi_comm must call this together."""
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


def load(path: str | Path, archs: str | None = None, log=None, *, include_dirs=(), library_dirs=(),
         libraries=()) -> CudaModule:
    """include_dirs, library_dirs, libraries: for the file's extern operations (as coconetc.load)."""
    from coconetc.build.cuda_build import compile_cuda
    from coconetc.runtime.loader import import_extension
    mod, src, so = compile_cuda(path, None, archs, skip_unsupported=True, log=log, include_dirs=include_dirs,
                                library_dirs=library_dirs, libraries=libraries)
    return CudaModule(mod, src, import_extension(src.module, so))


class CudaModule:
    def __init__(self, mod: Any, src: Any, ext: Any):
        self.source_module, self.sources, self.ext = mod, src, ext
        self.programs: dict[str, CudaProgram] = {}
        by_program: dict[str, dict[str, Program]] = {}
        for (prog, sched), ir in variants(mod).items():
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

    def __call__(self, *, schedule: str | None = None, comm: NcclComm | None = None, groups: int = 1,
                 stream: Any = None, **kwargs):
        import torch
        key = schedule or DEFAULT
        if key not in self.schedules:
            raise ValueError(f"{self.name}: no schedule '{key}' in the CUDA module "
                             f"(have {sorted(self.schedules)}; `coconetc check --backend cuda` says why)")
        p = self.schedules[key]
        if comm is None:
            raise ValueError("pass comm=coconetc.runtime_cuda.nccl_comm(module.ext, mpi_comm)")
        local = _check_local(p, kwargs)
        shapes = _describe(p, local)
        everyone = comm.mpi.allgather(shapes) if comm.mpi is not None and comm.size > 1 else [shapes]
        sizes, segments = bind_sizes(p, everyone, groups)
        group_size = len(everyone) // groups
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
        args.sizes = [sizes[s] for s in sorted(sizes)]
        scal = [q for q in p.params if q.scalar]
        args.scalars = [float(local[q.name]) if not q.type.dtype.startswith("i") else 0.0 for q in scal]
        args.iscalars = [int(local[q.name]) if q.type.dtype.startswith("i") else 0 for q in scal]
        st: Any = stream if stream is not None else torch.cuda.current_stream()
        args.stream = int(getattr(st, "cuda_stream", st))
        args.comm, args.groups = comm.handle, groups
        getattr(self.ext, function_name(self.name, key))(args)
        return None if not outs else outs[0] if len(outs) == 1 else tuple(outs)


def _local_shape(t, sizes: dict, gs: int, rank: int) -> tuple[int, ...]:
    shape = [eval_dim(d, sizes) for d in t.shape]
    if t.layout.sliced:
        lo, hi = slice_range(shape[t.layout.dim], gs, rank)
        shape[t.layout.dim] = hi - lo
    return tuple(shape)


def _check_tensor(q: Param, v: Any, updated: bool) -> Any:
    import torch
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"'{q.name}' must be a PyTorch CUDA tensor ({q.type}), got {type(v).__name__}")
    if v.device.type != "cuda" or v.device.index != torch.cuda.current_device():
        raise ValueError(f"'{q.name}' is on {v.device}; this module runs on cuda:{torch.cuda.current_device()}")
    if v.dtype != getattr(torch, TORCH_DTYPES[q.type.dtype]):
        raise TypeError(f"'{q.name}' must have dtype {q.type.dtype}, got {v.dtype}")
    if not v.is_contiguous():
        raise ValueError(f"'{q.name}' is not contiguous; pass .contiguous()")
    if v.dim() != q.type.ndim:
        raise ValueError(f"'{q.name}' must be {q.type.ndim}-d ({q.type}), got shape {tuple(v.shape)}")
    if updated and v.requires_grad and v.is_leaf:
        raise ValueError(f"'{q.name}' is updated in place but requires grad")
    return v


def _check_local(p: Program, kwargs: dict) -> dict:
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
            if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
                v = v.item()
            if isinstance(v, bool) or not isinstance(v, (int, float, np.number)):
                raise TypeError(f"'{q.name}' must be a number ({q.type.dtype}), got {type(v).__name__}")
            out[q.name] = v
        elif q.scattered:  # a list of 1-D segments (or one tensor: one segment)
            out[q.name] = [_check_tensor(q, x, q.name in updated) for x in (v if isinstance(v, (list, tuple)) else [v])]
        else:
            out[q.name] = _check_tensor(q, v, q.name in updated)
    return out


def _describe(p: Program, values: dict) -> dict:
    return {q.name: values[q.name] if q.scalar else [tuple(x.shape) for x in values[q.name]]
            if isinstance(values[q.name], list) else tuple(values[q.name].shape) for q in p.params}




# ---- host emulation ----------------------------------------------------------------------------------

def load_emulated(path: str | Path, log=None) -> EmulatedModule:
    """FILE's CUDA module built for the host emulation (build/cuda_build.py: compile_emulated):
    the generated CUDA code run on the CPU, NCCL on MPI. Programs take NumPy arrays (host memory
    stands for device memory), update parameters in place and return new NumPy outputs; every
    call synchronizes and raises if the emulation found a stream race."""
    from coconetc.build.cuda_build import compile_emulated
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
        from coconetc.common.dtypes import STORAGE
        key = schedule or DEFAULT
        if key not in self.schedules:
            raise ValueError(f"{self.name}: no schedule '{key}' in the emulated CUDA module (have "
                             f"{sorted(self.schedules)}; `coconetc check --backend cuda` says why)")
        p = self.schedules[key]
        comm = comm or self.owner.comm()
        local = _check_local_numpy(p, kwargs)
        shapes = _describe(p, local)
        everyone = comm.mpi.allgather(shapes) if comm.mpi is not None and comm.size > 1 else [shapes]
        sizes, segments = bind_sizes(p, everyone, groups)
        group_size = len(everyone) // groups
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
        args.sizes = [sizes[s] for s in sorted(sizes)]
        scal = [q for q in p.params if q.scalar]
        args.scalars = [float(local[q.name]) if not q.type.dtype.startswith("i") else 0.0 for q in scal]
        args.iscalars = [int(local[q.name]) if q.type.dtype.startswith("i") else 0 for q in scal]
        args.stream = 0
        args.comm, args.groups = comm.handle, groups
        getattr(self.ext, function_name(self.name, key))(args)
        self.ext.synchronize()
        return None if not outs else outs[0] if len(outs) == 1 else tuple(outs)


def _check_array(q: Param, v: Any) -> None:
    from coconetc.common.dtypes import STORAGE
    if not isinstance(v, np.ndarray):
        raise TypeError(f"'{q.name}' must be a NumPy array ({q.type}), got {type(v).__name__}")
    if v.dtype != STORAGE[q.type.dtype]:
        raise TypeError(f"'{q.name}' must have dtype {q.type.dtype}, got {v.dtype}")
    if not v.flags.c_contiguous or not v.flags.writeable:
        raise ValueError(f"'{q.name}' must be a C-contiguous writeable array")
    if v.ndim != q.type.ndim:
        raise ValueError(f"'{q.name}' must be {q.type.ndim}-d ({q.type}), got shape {v.shape}")


def _check_local_numpy(p: Program, kwargs: dict) -> dict:
    extra = sorted(set(kwargs) - {q.name for q in p.params})
    if extra:
        raise TypeError(f"{p.name}() got an unexpected keyword argument '{extra[0]}'")
    out: dict[str, Any] = {}
    for q in p.params:
        if q.name not in kwargs:
            raise TypeError(f"{p.name}() missing argument '{q.name}'")
        v = kwargs[q.name]
        if q.scalar:
            if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
                v = v.item()
            if isinstance(v, bool) or not isinstance(v, (int, float, np.number)):
                raise TypeError(f"'{q.name}' must be a number ({q.type.dtype}), got {type(v).__name__}")
        elif q.scattered:  # a list of 1-D segments (or one array: one segment)
            if not isinstance(v, list):
                v = [v]
            for x in v:
                _check_array(q, x)
        else:
            _check_array(q, v)
        out[q.name] = v
    from coconetc.common.validate import overlapping
    both = overlapping(p, out)
    if both:
        raise ValueError(f"{p.name}(): {both[0]} and {both[1]} overlap in memory; pass separate arrays")
    return out
