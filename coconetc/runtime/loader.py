"""`coconetc.load(file)`: compile (cached), import, and wrap the module so that each program is
a Python function taking keyword arguments named as in the program.

A call checks every argument on this rank (presence, type, dtype, rank, contiguity), then all
ranks exchange what they were given (one small allgather), so that sizes bound across ranks
(sliced dims) are checked identically everywhere and every rank raises the same error if any
rank's arguments are wrong: no buffer is touched and nobody is left waiting in a collective."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from coconetc.build import builder
from coconetc.codegen.cpu import DEFAULT, Sources, function_name, generate, variants
from coconetc.driver import Module, load_file
from coconetc.interp.bind import bind
from coconetc.interp.values import STORAGE, slice_range
from coconetc.ir.nodes import Param, Program
from coconetc.ir.types import eval_dim


_PROBE = "ccn_module_name_placeholder"


def compile_module(path: str | Path, out_dir: str | Path | None = None, log=None):
    """Generate and build FILE's module; returns (Module, Sources, path of the .so)."""
    mod = load_file(path)
    stem = "".join(c if c.isalnum() else "_" for c in Path(path).stem)
    probe = generate(mod, _PROBE)
    key = builder.build_key(probe.cpp + probe.cmake, "cpu")
    name = f"ccn_{stem}_{key}"
    # the key hashes the sources under a placeholder name; name them without generating again
    src = replace(probe, module=name, cpp=probe.cpp.replace(_PROBE, name),
                  cmake=probe.cmake.replace(_PROBE, name))
    where = Path(out_dir) if out_dir else builder.cache_dir() / name
    so = builder.build(name, src.cpp, src.cmake, where, log)
    return mod, src, so


def load(path: str | Path, log=None) -> CompiledModule:
    """Compile FILE (cached) and import it."""
    mod, src, so = compile_module(path, None, log)
    spec = importlib.util.spec_from_file_location(src.module, so)
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    return CompiledModule(mod, src, ext)


class CompiledModule:
    def __init__(self, mod: Module, src: Sources, ext: Any):
        self.source_module, self.sources, self.ext = mod, src, ext
        self.programs: dict[str, ProgramFunction] = {}
        by_program: dict[str, dict[str, Program]] = {}
        for (prog, sched), ir in variants(mod).items():
            by_program.setdefault(prog, {})[sched] = ir
        for prog, scheds in by_program.items():
            fn = ProgramFunction(prog, scheds, ext)
            self.programs[prog] = fn
            setattr(self, prog, fn)

    def __repr__(self) -> str:
        return f"<coconet module {self.sources.module}: {', '.join(self.programs)}>"


@dataclass
class _Local:
    """What one rank was given: shapes and segment sizes (exchanged), or its error."""

    shapes: dict[str, Any]
    error: tuple[str, str] | None = None


class ProgramFunction:
    def __init__(self, name: str, schedules: dict[str, Program], ext: Any):
        self.name, self.schedules, self.ext = name, schedules, ext
        base = schedules[DEFAULT]
        self.__doc__ = (f"{name}({', '.join(q.name for q in base.params)}, *, schedule=None, "
                        f"comm=None, groups=1); schedules: {', '.join(schedules)}")

    def signature(self, schedule: str | None = None) -> dict[str, str]:
        """Parameter -> its type in this schedule's calling convention, e.g. 'f32[N] sliced(0)'."""
        p = self._program(schedule)
        return {q.name: q.type.dtype if q.scalar else str(q.type) + (" scattered" if q.scattered else "")
                for q in p.params}

    def _program(self, schedule: str | None) -> Program:
        key = schedule or DEFAULT
        if key not in self.schedules:
            raise ValueError(f"{self.name}(): unknown schedule {schedule!r} "
                             f"(one of {', '.join(self.schedules)})")
        return self.schedules[key]

    def __call__(self, *, schedule: str | None = None, comm: Any = None, groups: int = 1, **kwargs):
        from mpi4py import MPI
        comm = MPI.COMM_WORLD if comm is None else comm
        p = self._program(schedule)
        local = _check_local(p, kwargs)
        everyone = comm.allgather(_describe(p, local.shapes) if local.error is None else local.error)
        _raise_first_error(everyone, comm.Get_rank(), local)
        arrays = local.shapes
        b = bind(p, [_dummies(p, d) for d in everyone], groups)
        return self._run(p, arrays, b, comm, groups, schedule)

    def _run(self, p: Program, arrays: dict, b, comm, groups: int, schedule):
        from mpi4py import MPI
        args = self.ext.CallArgs()
        seg_sizes = list(b.segments or ())
        tensors, seg_ptrs = [], []
        for q in p.params:
            if q.scalar:
                continue
            v = arrays[q.name]
            if isinstance(v, list):
                tensors.append(0)
                seg_ptrs.append([x.ctypes.data for x in v])
            else:
                tensors.append(v.ctypes.data)
                seg_ptrs.append([])
        rank = comm.Get_rank() % b.group_size
        outs = [np.empty(_local_shape(p.stage(s).type if p.stage(s) else p.param(s).type, b.sizes,
                                      b.group_size, rank), dtype=STORAGE[p.type_of(s).dtype])
                for _, s in p.outputs]
        args.tensors, args.seg_ptrs, args.seg_sizes = tensors, seg_ptrs, seg_sizes
        args.outputs = [o.ctypes.data for o in outs]
        args.sizes = [b.sizes[s] for s in sorted(b.sizes)]
        scal = [q for q in p.params if q.scalar]
        args.scalars = [float(arrays[q.name]) if not q.type.dtype.startswith("i") else 0.0 for q in scal]
        args.iscalars = [int(arrays[q.name]) if q.type.dtype.startswith("i") else 0 for q in scal]
        args.comm, args.groups = MPI._handleof(comm), groups
        getattr(self.ext, function_name(self.name, schedule or DEFAULT))(args)
        outs = [_as_torch(o) if arrays.get("__torch__") else o for o in outs]
        return None if not outs else outs[0] if len(outs) == 1 else tuple(outs)


def _local_shape(t, sizes: dict, gs: int, rank: int) -> tuple[int, ...]:
    shape = [eval_dim(d, sizes) for d in t.shape]
    if t.layout.sliced:
        lo, hi = slice_range(shape[t.layout.dim], gs, rank)
        shape[t.layout.dim] = hi - lo
    return tuple(shape)


def _as_torch(a: np.ndarray):
    import torch
    return torch.from_numpy(a)


def _to_numpy(q: Param, v: Any, updated: bool) -> np.ndarray:
    """A NumPy view (never a copy) of an array or a CPU tensor, checked."""
    if type(v).__module__.startswith("torch"):
        if v.device.type != "cpu":
            raise ValueError(f"'{q.name}' is on {v.device}; this module runs on the CPU")
        if not v.is_contiguous():
            raise ValueError(f"'{q.name}' is not contiguous; pass .contiguous()")
        v = v.detach().numpy()
    if not isinstance(v, np.ndarray):
        raise TypeError(f"'{q.name}' must be a NumPy array or a PyTorch tensor ({q.type}), "
                        f"got {type(v).__name__}")
    if v.dtype != STORAGE[q.type.dtype]:
        raise TypeError(f"'{q.name}' must have dtype {q.type.dtype}, got {v.dtype}")
    if not v.flags.c_contiguous:
        raise ValueError(f"'{q.name}' is not contiguous (C order); pass np.ascontiguousarray(...)")
    if updated and not v.flags.writeable:
        raise ValueError(f"'{q.name}' is updated in place but is read-only")
    return v


def _check_param(p: Program, q: Param, v: Any, updated: set[str]) -> Any:
    if q.scalar:
        if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, (int, float, np.number)):
            raise TypeError(f"'{q.name}' must be a number ({q.type.dtype}), got {type(v).__name__}")
        return v
    if q.scattered and isinstance(v, (list, tuple)):
        parts = [_to_numpy(q, x, q.name in updated) for x in v]
        for x in parts:
            if x.ndim != 1:
                raise ValueError(f"'{q.name}': every segment must be 1-d, got shape {x.shape}")
        return parts
    a = _to_numpy(q, v, q.name in updated)
    if a.ndim != q.type.ndim:
        raise ValueError(f"'{q.name}' must be {q.type.ndim}-d ({q.type}), got shape {a.shape}")
    return [a] if q.scattered else a


def _check_local(p: Program, kwargs: dict) -> _Local:
    try:
        names = {q.name for q in p.params}
        extra = sorted(set(kwargs) - names)
        if extra:
            raise TypeError(f"{p.name}() got an unexpected keyword argument '{extra[0]}'")
        updated = {t for t, _ in p.updates}
        values: dict[str, Any] = {}
        for q in p.params:
            if q.name not in kwargs:
                raise TypeError(f"{p.name}() missing argument '{q.name}'")
            values[q.name] = _check_param(p, q, kwargs[q.name], updated)
        values["__torch__"] = any(type(v).__module__.startswith("torch") for v in kwargs.values())
        return _Local(values)
    except (TypeError, ValueError) as err:
        return _Local({}, (type(err).__name__, str(err)))


def _raise_first_error(everyone: list, rank: int, local: _Local) -> None:
    if local.error is not None:
        kind, msg = local.error
        raise {"TypeError": TypeError, "ValueError": ValueError}[kind](msg)
    for r, item in enumerate(everyone):
        if isinstance(item, tuple):
            raise ValueError(f"rank {r} was given bad arguments: {item[1]}")


def _describe(p: Program, values: dict) -> dict:
    """What the other ranks need to know of this rank's arguments: shapes, not data."""
    out: dict[str, Any] = {}
    for q in p.params:
        v = values[q.name]
        out[q.name] = v if q.scalar else [x.shape for x in v] if isinstance(v, list) else v.shape
    return out


def _dummies(p: Program, desc: dict) -> dict:
    """Zero-cost stand-ins with another rank's shapes, for the cross-rank size checks."""
    out: dict[str, Any] = {}
    for q in p.params:
        v, dt = desc[q.name], STORAGE[q.type.dtype]
        if q.scalar:
            out[q.name] = v
        elif isinstance(v, list):
            out[q.name] = [np.broadcast_to(np.zeros((), dt), s) for s in v]
        else:
            out[q.name] = np.broadcast_to(np.zeros((), dt), v)
    return out
