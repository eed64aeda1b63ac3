"""The module a rank program calls: the CPU module (coconetc.load), the CUDA module under the
host emulation, the CUDA module on this node's GPUs (NumPy in and out, like the CPU one), or
an extension built elsewhere (by CMake's coconet_add_module) wrapped with coconetc's calling
convention."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np


def quiet(msg: str) -> None:
    """A build log that prints nothing (the ranks load what was built before they started)."""


def load_cpu(file: str, include_dirs=(), library_dirs=(), libraries=(), grad=()) -> Any:
    import coconetc
    return coconetc.load(file, log=quiet, include_dirs=include_dirs, library_dirs=library_dirs,
                         libraries=libraries, grad=tuple(grad))


def load_emulated(file: str, grad=()) -> Any:
    from coconetc.runtime.cuda import load_emulated as load
    return load(file, log=quiet, grad=tuple(grad))


def load_extension(so: str, file: str) -> Any:
    """The extension module built at SO from FILE (not coconetc's cached build), its programs
    called as coconetc's (keyword arguments, argument checks, every schedule of FILE listed)."""
    from coconetc.codegen.naming import function_name
    from coconetc.runtime.loader import CompiledModule, import_extension
    from coconetc.sourcefile import load_file
    ext = import_extension(Path(so).name.split(".")[0], Path(so))
    mod = load_file(file)
    # (no generated sources here: the module's name, and its functions as the generator names them)
    sources: Any = SimpleNamespace(module=ext.__name__, functions={
        k: SimpleNamespace(name=function_name(*k)) for k in mod.variants()})
    return CompiledModule(mod, sources, ext)


class GpuFunction:
    """A CUDA module's program called like the CPU one: NumPy inputs copied to this rank's
    GPU, results (and updated parameters) copied back after the stream is synchronized."""

    def __init__(self, fn: Any, comm: Any):
        self.fn, self.comm, self.schedules = fn, comm, fn.schedules

    def __call__(self, schedule=None, groups=1, **kwargs):
        import torch
        dev = self.on_device(kwargs)
        out = self.fn(schedule=schedule, groups=groups, comm=self.comm, **dev)
        torch.cuda.synchronize()
        for k, v in kwargs.items():
            if isinstance(v, np.ndarray):
                v[...] = dev[k].cpu().numpy()
        outs = out if isinstance(out, tuple) else (out,) if out is not None else ()
        got = tuple(o.cpu().numpy() for o in outs)
        return None if not got else got[0] if len(got) == 1 else got

    @staticmethod
    def on_device(kwargs: dict) -> dict:
        """The NumPy arrays among KWARGS copied to this rank's GPU (the rest as given)."""
        import torch
        return {k: torch.from_numpy(np.ascontiguousarray(v)).cuda() if isinstance(v, np.ndarray) else v
                for k, v in kwargs.items()}

    def synced(self, schedule: str, kwargs: dict):
        """A call of SCHEDULE on copies of KWARGS already on the GPU, returning when the GPU is
        done (what a timing measures: no copy to or from the host inside it)."""
        import torch
        dev = self.on_device(kwargs)
        torch.cuda.synchronize()

        def call():
            out = self.fn(schedule=schedule, comm=self.comm, **dev)
            torch.cuda.synchronize()
            return out
        return call


def load_for(a: Any, comm: Any) -> Any:
    """The module a rank program's command line asks for (args.py): --emulate-cuda, --cuda, or
    the CPU module."""
    if a.emulate_cuda:
        return load_emulated(a.file, a.grad_of)
    if a.cuda:
        return load_on_gpu(a.file, comm, a.grad_of)
    return load_cpu(a.file, a.include_dir, a.library_dir, a.library, a.grad_of)


def load_on_gpu(file: str, comm: Any, grad=()) -> Any:
    """FILE's CUDA module on a GPU (this rank's node-local rank modulo the GPUs), with an NCCL
    communicator over COMM; its programs wrapped as GpuFunction."""
    import torch

    import coconetc
    from coconetc.runtime.node_ranks import node_comm
    if not torch.cuda.is_available():
        raise SystemExit("coconetc run --backend cuda: no CUDA device here (use --emulate)")
    node = node_comm(comm)
    local = node.Get_rank()
    node.Free()
    torch.cuda.set_device(local % torch.cuda.device_count())
    mod = coconetc.load(file, backend="cuda", log=quiet, grad=tuple(grad))
    nccl = mod.comm(comm)
    for name, fn in list(mod.programs.items()):
        mod.programs[name] = GpuFunction(fn, nccl)
    return mod
