"""`coconetc.load(file)`: compile (cached), import, and wrap the module so that each program is
a Python function taking keyword arguments named as in the program.

A call checks every argument on this rank (presence, type, dtype, rank, contiguity, buffers
that overlap, PyTorch autograd rules: coconetc/ir/arguments.py), then the ranks of the
communicator agree on the call (coconetc/runtime/agree.py: small non-blocking allgathers
under a watchdog): the function and schedule, groups, every scalar's value, the sizes bound
across ranks. Any error raises on every rank before any buffer is touched, and nobody is left
waiting in a collective. Nothing here imports the interpreter (coconetc/interp).

A call with the same buffers as one of the recent agreed calls (a training loop) takes the hot
path: the NumPy arrays or CPU tensors are compared with the remembered ones (identity, shape,
strides, dtype, flags or storage), the scalars packed with one struct, and the ranks exchange one 64-byte record (the
digest of the agreed configuration and the scalars' bits) over a persistent allgather; any
difference sends every rank through the full checks and exchange, which raise as above."""

from __future__ import annotations

import importlib.util
import struct
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from coconetc.toolchain import builder
from coconetc.codegen.cpu import Sources, generate
from coconetc.codegen.libs import Libs
from coconetc.codegen.naming import function_name
from coconetc.ir.storage import STORAGE
from coconetc.ir.slices import slice_range
from coconetc.ir.arguments import bind_sizes, check_param, describe, is_torch, overlapping
from coconetc.sourcefile import DEFAULT, SourceFile, add_schedules, load_file
from coconetc.errors import CompileError, Span
from coconetc.ir.nodes import Program
from coconetc.ir.types import eval_dim
from coconetc.runtime import agree, layout, shm

# A schedule label may name the algorithm of the call's fused collectives (and its all-reduces
# and all-gathers): "zero@p2p" point-to-point messages, "zero@shm" the node's shared-memory
# window (where every rank of the group is on one node; else point-to-point). Plain "zero": as
# COCONET_FUSED says (default: the window where it can). The autotuner measures both.
ALGORITHMS = {"p2p": 1, "shm": 2}


def split_algorithm(schedule: str | None) -> tuple[str, int]:
    """(the schedule's name, its CallArgs.fused code): "zero@p2p" -> ("zero", 1)."""
    name, at, algo = (schedule or DEFAULT).partition("@")
    if at and algo not in ALGORITHMS:
        raise ValueError(f"schedule {schedule!r}: unknown fused-collective algorithm {algo!r} "
                         f"(one of {', '.join(ALGORITHMS)})")
    return name, ALGORITHMS.get(algo, 0)


_PROBE = "ccn_module_name_placeholder"


def compile_module(path: str | Path, out_dir: str | Path | None = None, log=None, *,
                   include_dirs=(), library_dirs=(), libraries=()):
    """Generate and build FILE's module; returns (Module, Sources, path of the .so).
    include_dirs, library_dirs, libraries: for the file's extern operations (-I, -L, -l)."""
    builder.require_cpu_extra()
    mod = _with_tuned(load_file(path))
    if not mod.programs:
        raise CompileError.at(Span(str(path), 1, 1, 1, 1, mod.source),
                              "no program in this file: nothing to compile")
    libs = Libs.of(path, bool(mod.externs), include_dirs, library_dirs, libraries)
    stem = "".join(c if c.isalnum() else "_" for c in Path(path).stem)
    probe = generate(mod, _PROBE, libs)
    extra = libs.fingerprint(mod.extern_headers()) if libs != Libs() else ""
    key = builder.build_key(probe.cpp + probe.cmake, "cpu" + extra)
    name = f"ccn_{stem}_{key}"
    # the key hashes the sources under a placeholder name; name them without generating again
    src = replace(probe, module=name, cpp=probe.cpp.replace(_PROBE, name),
                  cmake=probe.cmake.replace(_PROBE, name))
    where = Path(out_dir) if out_dir else builder.cache_dir() / name
    so = builder.build(name, src.cpp, src.cmake, where, log)
    return mod, src, so


def _with_tuned(mod: SourceFile) -> SourceFile:
    """The file with the schedules the autotuner wrote and chose for it (tuning cache), so
    that schedule="auto" can run them; a stale record that no longer checks is left out."""
    from coconetc.tune import cache
    text = cache.tuned_schedules(mod.source)
    if not text:
        return mod
    try:
        return add_schedules(mod, text)
    except CompileError:
        return mod


def load(path: str | Path, log=None, *, include_dirs=(), library_dirs=(), libraries=()) -> CompiledModule:
    """Compile FILE (cached) and import it. include_dirs, library_dirs, libraries: where the
    headers and libraries of the file's extern operations are, and what to link (the file's
    own directory is searched for headers too)."""
    mod, src, so = compile_module(path, None, log, include_dirs=include_dirs,
                                  library_dirs=library_dirs, libraries=libraries)
    return CompiledModule(mod, src, import_extension(src.module, so))


def import_extension(name: str, so: Path) -> Any:
    """Imports a built extension module from its file (CPU or CUDA)."""
    spec = importlib.util.spec_from_file_location(name, so)
    assert spec is not None and spec.loader is not None, so
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    return ext


class CompiledModule:
    def __init__(self, mod: SourceFile, src: Sources, ext: Any):
        self.source_module, self.sources, self.ext = mod, src, ext
        self.programs: dict[str, ProgramFunction] = {}
        by_program: dict[str, dict[str, Program]] = {}
        for (prog, sched), ir in mod.variants().items():
            by_program.setdefault(prog, {})[sched] = ir
        for prog, scheds in by_program.items():
            fn = ProgramFunction(prog, scheds, ext, mod.source)
            fn.file = mod.file
            self.programs[prog] = fn
            setattr(self, prog, fn)

    def __repr__(self) -> str:
        return f"<coconet module {self.sources.module}: {', '.join(self.programs)}>"


_ERRORS = {"TypeError": TypeError, "ValueError": ValueError, "RuntimeError": RuntimeError}


@dataclass
class _Local:
    """One call on this rank: its checked arguments, the PyTorch tensors it updates, and what
    the other ranks are told (the call's description, or this rank's error)."""

    program: Program | None
    values: dict[str, Any]
    torch_updated: list[Any]
    torch_out: bool
    shared: tuple
    timeout: float = agree.DEFAULT_TIMEOUT
    fast: _Fast | None = None  # set when this call repeats the last one's buffers


@dataclass
class _Fast:
    """A recent call of a function on this thread (ProgramFunction._last), remembered so that a
    call with the same buffers (a training loop) skips the per-array checks and reuses the
    module's CallArgs: the
    key (the buffers' identity, shape, dtype, strides), the objects (kept alive so that their
    ids are not reused), what the checks returned, and the arguments built for the module."""

    key: tuple
    refs: list
    local: _Local
    shapes: dict
    scalars: list  # (name, is integer) of the scalar parameters, in order
    args: Any = None
    sizes: Any = None
    run: Any = None
    windows: int = 0
    # the agreed configuration: digest of every rank's description at the last full exchange
    # that this call's buffers took part in (set once that call ran); None until then
    config: bytes | None = None
    hot: _Hot | None = None  # the hot path's precomputed checks (NumPy arrays and scalars only)


@dataclass
class _Hot:
    """What the hot path (ProgramFunction.__call__ -> _hot_check) compares a call against: the
    communicator object and handle, the NumPy arrays (object, shape, strides, dtype) and CPU
    PyTorch tensors (also their storage), the scalars' names and how their bits are packed,
    the watchdog's label and COCONET_TIMEOUT as read."""

    comm: Any
    world: Any
    handle: int
    groups: int
    nkw: int
    arrays: tuple  # (name, array, shape, strides, dtype, writeable) each
    torch: tuple  # (name, tensor, shape, strides, dtype, data pointer, requires_grad) each
    torch_updated: tuple  # the tensors the call updates in place (their versions are bumped)
    grad_check: bool  # an updated tensor requires grad: only under torch.no_grad()
    torch_out: bool  # outputs are returned as tensors
    scalars: tuple  # (name, is integer) each, in parameter order
    pack: struct.Struct
    floats_only: bool
    what: str
    timeout_raw: Any
    limit: float
    channel: Any
    outputs: tuple  # (shape, dtype) of each output array


class ProgramFunction:
    def __init__(self, name: str, schedules: dict[str, Program], ext: Any, source: str = ""):
        self.name, self.schedules, self.ext = name, schedules, ext
        self.source = source  # the .ccn text (the tuning cache's key)
        self.file = "FILE"  # its path, for messages
        self._tuned: list | None = None  # the tuning cache's records of this program (schedule="auto")
        self._auto_memo: dict[tuple, str] = {}
        self._bound: list = []  # the last call's shapes and their sizes (see _agree)
        # the recent calls' buffers, by (thread, schedule, the tensor arguments' ids): a
        # training step calls a function for several parameter groups in turn (see _repeat)
        self._last: dict[tuple, _Fast] = {}
        self._tensors = tuple(q.name for q in schedules[DEFAULT].params if not q.scalar)
        self._extra_checked = False
        base = schedules[DEFAULT]
        self.__doc__ = (f"{name}({', '.join(q.name for q in base.params)}, *, schedule=None, "
                        f"comm=None, groups=1); schedules: {', '.join(schedules)}")

    def signature(self, schedule: str | None = None) -> dict[str, str]:
        """Parameter -> its type in this schedule's calling convention, e.g. 'f32[N] sliced(0)'."""
        p = self._program(schedule)
        return {q.name: q.type.dtype if q.scalar else str(q.type) + (" scattered" if q.scattered else "")
                for q in p.params}

    def resolve_schedule(self, schedule: str | None, *, comm: Any = None, groups: int = 1,
                         **sizes: int) -> str:
        """The schedule a call with SCHEDULE runs. A named one is itself; "auto" is the
        autotuner's overall choice for these sizes and ranks, read from its tuning cache
        through `coconetc.tune.cached_choice(fn, sizes, ranks, groups)` (it may take other
        parameter layouts than the program's: DistributedOptimizer allocates its state in the
        choice's layouts); without an entry this raises and says how to make one."""
        if schedule != "auto":
            self._program(schedule)
            return schedule or DEFAULT
        from coconetc import tune
        choose = getattr(tune, "cached_choice", None)
        ranks = layout.group_position(comm, None, None, groups)[0] * groups
        choice = choose(self, dict(sizes), ranks, groups) if choose is not None else None
        if choice is None:
            shown = ", ".join(f"{k}={v}" for k, v in sizes.items())
            raise ValueError(f"{self.name}(schedule='auto'): the tuning cache has no choice for "
                             f"{shown} on {ranks} ranks; run `coconetc tune` for these sizes "
                             f"first, or name a schedule ({', '.join(self.schedules)})")
        self._program(choice)
        return choice

    def _auto(self, comm: Any, groups: int, kwargs: dict) -> str:
        """schedule="auto" in a call: the tuner's fastest schedule whose calling convention
        (parameter layouts and local shapes at the tuned sizes) matches the arrays given, the
        program's own layouts first. None tuned: a ValueError with the command to run."""
        from coconetc.tune import cache
        size = comm.Get_size()
        gs = size // groups if groups >= 1 and size % groups == 0 else size
        rank = comm.Get_rank() % gs
        memo = (size, rank, groups, tuple((k, _shape(v)) for k, v in sorted(kwargs.items())))
        if memo in self._auto_memo:  # a training loop calls with the same shapes again and again
            return self._auto_memo[memo]
        if self._tuned is None:  # read once: the module holds the schedules tuned when it loaded
            self._tuned = cache.records(self.source, self.name)
        for rec in reversed(self._tuned):
            if rec.get("ranks") != size or rec.get("groups", 1) != groups:
                continue
            for label in rec.get("by_convention", {}).values():
                p = self.schedules.get(split_algorithm(label)[0])
                if p is not None and _shapes_match(p, kwargs, rec["sizes"], gs, rank):
                    self._auto_memo[memo] = label
                    return label
        raise ValueError(f"{self.name}(schedule='auto'): the tuning cache holds no schedule for "
                         f"these arrays on {size} ranks; run `{_tune_command(self, kwargs, size)}` "
                         f"first (and load the module again), or name a schedule "
                         f"({', '.join(self.schedules)})")

    # --- layout helpers (coconetc/runtime/layout.py) ---------------------------------------
    def local_shape(self, name: str, *, schedule: str | None = None, comm: Any = None,
                    rank: int | None = None, ranks: int | None = None, groups: int = 1,
                    **sizes: int) -> tuple[int, ...]:
        """This rank's shape of parameter NAME in SCHEDULE's calling convention for the given
        size symbols, e.g. `adam.local_shape("m", schedule="zero", N=1000)` (rank and group
        size from COMM (default COMM_WORLD) unless rank= and ranks= are given); () for a scalar."""
        q, shape, gs, r = self._where(name, schedule, comm, rank, ranks, groups, sizes, "local_shape")
        return layout.local_shape(q, shape, gs, r)

    def local_index(self, name: str, *, schedule: str | None = None, comm: Any = None,
                    rank: int | None = None, ranks: int | None = None, groups: int = 1,
                    **sizes: int) -> tuple[slice, ...]:
        """The index of this rank's part of NAME in the global array: `full[index]` is what this
        rank passes (the whole array unless NAME is sliced in SCHEDULE)."""
        q, shape, gs, r = self._where(name, schedule, comm, rank, ranks, groups, sizes, "local_index")
        return layout.local_index(q, shape, gs, r)

    def empty(self, name: str, *, framework: str = "numpy", **where: Any) -> Any:
        """An uninitialised NumPy array (framework="numpy") or torch tensor ("torch") of NAME's
        dtype and local shape; takes local_shape's keywords (schedule, comm, rank, ranks,
        groups, sizes)."""
        return layout.allocate(self.local_shape(name, **where), self._dtype(name, where),
                               framework, fill=False)

    def zeros(self, name: str, *, framework: str = "numpy", **where: Any) -> Any:
        """As `empty`, filled with zeros."""
        return layout.allocate(self.local_shape(name, **where), self._dtype(name, where),
                               framework, fill=True)

    def _dtype(self, name: str, where: dict) -> str:
        return layout.param(self._program(where.get("schedule")), name, self.name).type.dtype

    def _where(self, name, schedule, comm, rank, ranks, groups, sizes, what):
        p = self._program(schedule)
        what = f"{self.name}.{what}({name!r})"
        q = layout.param(p, name, what)
        shape = layout.bind(p, q, sizes, what)
        gs, r = layout.group_position(comm, rank, ranks, groups)
        return q, shape, gs, r

    def _program(self, schedule: str | None) -> Program:
        key = split_algorithm(schedule)[0]
        if key not in self.schedules:
            raise ValueError(f"{self.name}(): unknown schedule {schedule!r} "
                             f"(one of {', '.join(self.schedules)})")
        return self.schedules[key]

    def __call__(self, *, schedule: str | None = None, comm: Any = None, groups: int = 1, **kwargs):
        fast = self._last.get(_slot(self, schedule, kwargs))
        if fast is not None and fast.hot is not None and fast.config is not None \
                and fast.key[0] == schedule:
            # the hot path: the same NumPy buffers as an agreed call; one round of 64 bytes
            got = _hot_check(fast.hot, comm, groups, kwargs)
            if got is not None:
                hot, start = fast.hot, time.monotonic()
                if hot.channel.agreed(fast.config, got[1], groups, hot.what, hot.limit, start):
                    return _run_hot(fast, hot, got[0])
                return self._call(schedule, comm, groups, kwargs, start)
        return self._call(schedule, comm, groups, kwargs, None)

    def _call(self, schedule: str | None, comm: Any, groups: Any, kwargs: dict,
              counted: float | None):
        """A call (counted: the monotonic time of its entry when the hot path's round already
        ran and disagreed, so the full exchange follows at once)."""
        if not self._extra_checked:  # once: the module was imported, so the extra stays there
            builder.require_cpu_extra()
            self._extra_checked = True
        from mpi4py import MPI
        comm = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(comm, MPI.Comm) or comm.Is_inter():
            raise TypeError(f"{self.name}(): comm must be an mpi4py intra-communicator, "
                            f"got {type(comm).__name__}")
        local = None
        if schedule == "auto":  # an error is raised on every rank after the exchange, as any other
            try:
                schedule = self._auto(comm, groups, kwargs)
            except ValueError as err:
                local = _Local(None, {}, [], False, ("error", "ValueError", str(err)))
        if local is None:
            local = _repeat(self, schedule, groups, comm, kwargs) or \
                _check_local(self, schedule, groups, comm.Get_size(), kwargs)
        what = f"{self.ext.__name__}.{self.name}(schedule={schedule or DEFAULT!r})"
        sizes, segments, config = self._agree_call(comm, groups, local, what, counted)
        assert local.program is not None  # else _agree raised this rank's error
        if local.fast is None:
            _remember(self, schedule, groups, comm, kwargs, local, what)
        out = self._run(local.program, local.values, sizes, segments, comm, groups, schedule, local)
        if local.fast is not None:  # the next call with these buffers may take the hot path
            local.fast.config = config
        if local.torch_updated:
            import torch
            torch.autograd.graph.increment_version(local.torch_updated)
        if local.torch_out:
            out = [_as_torch(o) for o in out]
        return None if not out else out[0] if len(out) == 1 else tuple(out)

    def _agree_call(self, comm, groups, local: _Local, what: str, counted: float | None):
        """The ranks agree on the call (or all raise): first the record round of repeated calls
        (agree.Channel.agreed), unless the hot path ran it (counted), then, unless every rank
        repeats the same agreed call, the full exchange. Returns (sizes, segments, the digest
        of the agreed configuration)."""
        if counted is None and comm.Get_size() > 1:
            fast = local.fast
            config = fast.config if fast is not None and local.shared[0] == "ok" else None
            scal = agree.scalar_record(b"".join(b for _, _, b in local.shared[1][1])) if config else b""
            if agree.channel(comm).agreed(config, scal, groups, what, local.timeout, time.monotonic()):
                assert fast is not None
                return (*fast.sizes, config)
        everyone = agree.exchange(comm, local.shared, what, local.timeout,
                                  counted=comm.Get_size() > 1)
        sizes, segments = _agree(everyone, comm.Get_rank(), local.program, local.shared, self._bound)
        return sizes, segments, agree.digest([(item[1][0], item[1][2]) for item in everyone])

    def _run(self, p: Program, arrays: dict, sizes: dict, segments, comm, groups: int, schedule,
             local: _Local | None = None):
        from mpi4py import MPI
        fast = local.fast if local is not None else None
        if fast is not None and fast.args is not None and fast.sizes == (sizes, segments):
            return self._run_again(p, arrays, fast, sizes, comm, groups)
        args = self.ext.CallArgs()
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
        gs = comm.Get_size() // groups
        rank = comm.Get_rank() % gs
        outs = [np.empty(_local_shape(p.type_of(s), sizes,
                                      gs, rank), dtype=STORAGE[p.type_of(s).dtype])
                for _, s in p.outputs]
        args.tensors, args.seg_ptrs, args.seg_sizes = tensors, seg_ptrs, list(segments or ())
        args.outputs = [o.ctypes.data for o in outs]
        args.sizes = [sizes[s] for s in sorted(sizes)]
        scal = [q for q in p.params if q.scalar]
        args.scalars = [float(arrays[q.name]) if not q.type.dtype.startswith("i") else 0.0 for q in scal]
        args.iscalars = [int(arrays[q.name]) if q.type.dtype.startswith("i") else 0 for q in scal]
        args.comm, args.groups = MPI._handleof(comm), groups
        if shm.WINDOWS:  # buffers of coconetc.empty: the runtime may read them in place
            args.windows = shm.WINDOWS
        name, args.fused = split_algorithm(schedule)
        run = getattr(self.ext, function_name(self.name, name))
        if fast is not None:  # the next call with the same buffers reuses these arguments
            fast.args, fast.sizes, fast.run, fast.windows = args, (sizes, segments), run, len(shm.WINDOWS)
        run(args)
        return outs

    def _run_again(self, p: Program, arrays: dict, fast: _Fast, sizes: dict, comm, groups: int):
        """_run for the same buffers as the call that made `fast`: only scalars and outputs."""
        args = fast.args
        gs = comm.Get_size() // groups
        outs = [np.empty(_local_shape(p.type_of(s), sizes, gs, comm.Get_rank() % gs),
                         dtype=STORAGE[p.type_of(s).dtype]) for _, s in p.outputs]
        if outs:
            args.outputs = [o.ctypes.data for o in outs]
        args.scalars = [float(arrays[n]) if not i else 0.0 for n, i in fast.scalars]
        if any(i for _, i in fast.scalars):
            args.iscalars = [int(arrays[n]) if i else 0 for n, i in fast.scalars]
        if fast.windows != len(shm.WINDOWS):
            args.windows, fast.windows = shm.WINDOWS, len(shm.WINDOWS)
        fast.run(args)
        return outs


def _local_shape(t, sizes: dict, gs: int, rank: int) -> tuple[int, ...]:
    shape = [eval_dim(d, sizes) for d in t.shape]
    if t.layout.sliced:
        lo, hi = slice_range(shape[t.layout.dim], gs, rank)
        shape[t.layout.dim] = hi - lo
    return tuple(shape)


def _shape(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return tuple(_shape(x) for x in v)
    return tuple(getattr(v, "shape", ())) if hasattr(v, "shape") else None


def _shapes_match(p: Program, kwargs: dict, sizes: dict, gs: int, rank: int) -> bool:
    """Every tensor argument has p's local shape at these sizes on this rank."""
    try:
        for q in p.params:
            if q.scalar:
                continue
            v = kwargs.get(q.name)
            got = ((sum(int(np.prod(x.shape)) for x in v),) if isinstance(v, (list, tuple))
                   else tuple(getattr(v, "shape", ())))
            if got != _local_shape(q.type, sizes, gs, rank):
                return False
    except (KeyError, TypeError):
        return False
    return True


def _tune_command(fn: ProgramFunction, kwargs: dict, ranks: int) -> str:
    """`coconetc tune FILE --ranks R --size ...` with the sizes the program's own layouts
    read from these arrays (those of unsliced dims)."""
    p = fn.schedules[DEFAULT]
    sizes: dict[str, int] = {}
    for q in p.params:
        v = kwargs.get(q.name)
        if q.scalar or v is None:
            continue
        shape = ((sum(int(np.prod(x.shape)) for x in v),) if isinstance(v, (list, tuple))
                 else tuple(getattr(v, "shape", ())))
        for i, d in enumerate(q.type.shape):
            if isinstance(d, str) and i < len(shape) and not (q.type.layout.sliced and q.type.layout.dim == i):
                sizes.setdefault(d, int(shape[i]))
    shown = " ".join(f"--size {k}={v}" for k, v in sorted(sizes.items()))
    return f"coconetc tune {fn.file} --program {fn.name} --ranks {ranks} {shown}".rstrip()


def _as_torch(a: np.ndarray):
    import torch
    return torch.from_numpy(a)


# --- this rank's arguments -------------------------------------------------------------------
def _check_local(fn: ProgramFunction, schedule, groups, size: int, kwargs: dict) -> _Local:
    """This rank's arguments checked; `shared` is ("ok", description) or ("error", kind, text)."""
    timeout = agree.DEFAULT_TIMEOUT
    try:
        timeout = agree.timeout_s()
        p = fn._program(schedule)
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            raise ValueError(f"{fn.name}(): groups must be a positive integer, got {groups!r}")
        names = {q.name for q in p.params}
        extra = sorted(set(kwargs) - names)
        if extra:
            raise TypeError(f"{p.name}() got an unexpected keyword argument '{extra[0]}'")
        updated = {t for t, _ in p.updates}
        values: dict[str, Any] = {}
        for q in p.params:
            if q.name not in kwargs:
                raise TypeError(f"{p.name}() missing argument '{q.name}'")
            values[q.name] = check_param(q, kwargs[q.name], updated=q.name in updated, contiguous=True)
        both = overlapping(p, values)
        if both:
            raise ValueError(f"{p.name}(): {both[0]} and {both[1]} overlap in memory (the same "
                             "buffer, or views of one); pass separate arrays: the parameters of "
                             "a coconet program may not alias")
        torch_out = any(is_torch(v) or (isinstance(v, (list, tuple)) and any(map(is_torch, v)))
                        for v in kwargs.values())
        torch_updated = _torch_updates(p, kwargs, updated) if torch_out else []
        head = (fn.ext.__name__, fn.name, schedule or DEFAULT, groups, size)
        shapes = {k: v for k, v in describe(p, values).items() if k not in _scalar_names(p)}
        desc = (head, _scalar_bits(p, values), shapes)
        return _Local(p, values, torch_updated, torch_out, ("ok", desc), timeout)
    except (TypeError, ValueError, RuntimeError) as err:
        return _Local(None, {}, [], False, ("error", type(err).__name__, str(err)), timeout)


def _scalar_names(p: Program) -> frozenset[str]:
    return frozenset(q.name for q in p.params if q.scalar)


def _ident(v: Any) -> tuple | None:
    """What makes a buffer the same buffer as last call: its object, shape, dtype, strides (and
    data pointer, for a torch tensor, whose storage can be swapped); None for a value the fast
    path does not take (any other type)."""
    if type(v) is np.ndarray:
        return (id(v), v.shape, v.dtype, v.strides, v.flags.writeable)
    if is_torch(v):
        return (id(v), tuple(v.shape), v.dtype, v.stride(), v.data_ptr(), v.requires_grad, v.device.type)
    if isinstance(v, list):
        parts = tuple(_ident(x) for x in v)
        return None if None in parts else (id(v), len(v), parts)
    return None


def _key(fn: ProgramFunction, schedule, groups, comm, kwargs: dict, scalars: frozenset) -> tuple | None:
    idents = []
    for k, v in kwargs.items():
        if k in scalars:
            idents.append(k)
            continue
        i = _ident(v)
        if i is None:
            return None
        idents.append((k, i))
    return (schedule, groups, comm.py2f(), tuple(idents))


def _repeat(fn: ProgramFunction, schedule, groups, comm, kwargs: dict) -> _Local | None:
    """This rank's checked arguments without checking each buffer again, when the call passes
    the same buffers as one of this thread's recent calls of FN (only the scalars are checked); None
    otherwise (the full checks run)."""
    fast = fn._last.get(_slot(fn, schedule, kwargs))
    if fast is None or fast.local.program is None or fast.key[0] != schedule:
        return None
    p = fast.local.program
    if _key(fn, schedule, groups, comm, kwargs, _scalar_names(p)) != fast.key:
        return None
    values = dict(fast.local.values)
    try:
        for q in p.params:
            if q.scalar:
                values[q.name] = check_param(q, kwargs[q.name])
        torch_updated = _torch_updates(p, kwargs, {t for t, _ in p.updates}) if fast.local.torch_out else []
    except (TypeError, ValueError, RuntimeError):
        return None  # the full checks report it
    head = fast.local.shared[1][0]
    desc = (head, _scalar_bits(p, values), fast.shapes)
    return replace(fast.local, values=values, torch_updated=torch_updated, shared=("ok", desc),
                   timeout=agree.timeout_s(), fast=fast)


_RECENT = 64  # calls (sets of buffers) remembered per function


def _slot(fn: ProgramFunction, schedule, kwargs: dict) -> tuple:
    """Where fn._last keeps a call with these buffers."""
    return (threading.get_ident(), schedule, *map(id, map(kwargs.get, fn._tensors)))


def _remember(fn: ProgramFunction, schedule, groups, comm, kwargs: dict, local: _Local,
              what: str) -> None:
    """After a call whose checks passed everywhere: remember its buffers for _repeat (and,
    when every tensor is a NumPy array, for the hot path)."""
    p = local.program
    assert p is not None
    key = _key(fn, schedule, groups, comm, kwargs, _scalar_names(p))
    if key is None:
        return
    scalars = [(q.name, q.type.dtype.startswith("i")) for q in p.params if q.scalar]
    local.fast = _Fast(key, list(kwargs.values()), local, local.shared[1][2], scalars)
    slot = _slot(fn, schedule, kwargs)
    fn._last.pop(slot, None)
    fn._last[slot] = local.fast
    while len(fn._last) > _RECENT:  # the oldest first
        del fn._last[next(iter(fn._last))]
    tensors = [(q.name, kwargs[q.name]) for q in p.params if not q.scalar]
    arrays = [(k, v) for k, v in tensors if type(v) is np.ndarray]
    torches = [(k, v) for k, v in tensors if type(v) is not np.ndarray and is_torch(v)
               and hasattr(v, "data_ptr") and v.device.type == "cpu"]
    if len(arrays) + len(torches) == len(tensors) and \
            all(q.type.dtype in _PACK for q in p.params if q.scalar):
        from mpi4py import MPI
        gs = comm.Get_size() // groups
        outs = tuple((p.type_of(s), STORAGE[p.type_of(s).dtype]) for _, s in p.outputs)
        updated = {t for t, _ in p.updates}
        local.fast.hot = _Hot(
            comm=comm, world=MPI.COMM_WORLD, handle=comm.py2f(), groups=groups, nkw=len(kwargs),
            arrays=tuple((k, v, v.shape, v.strides, v.dtype, v.flags.writeable) for k, v in arrays),
            torch=tuple((k, v, tuple(v.shape), v.stride(), v.dtype, v.data_ptr(), v.requires_grad)
                        for k, v in torches),
            torch_updated=tuple(local.torch_updated),
            grad_check=any(v.requires_grad for k, v in torches if k in updated),
            torch_out=local.torch_out,
            scalars=tuple(scalars),
            pack=struct.Struct("<" + "".join(_PACK[q.type.dtype][1:] for q in p.params if q.scalar)),
            floats_only=not any(i for _, i in scalars), what=what,
            timeout_raw=agree.timeout_raw(), limit=local.timeout, channel=agree.channel(comm),
            outputs=(gs, comm.Get_rank() % gs, outs) if outs else ())


def _hot_check(hot: _Hot, comm, groups, kwargs: dict) -> tuple[list, bytes] | None:
    """The scalars (as the module takes them) and their record bits when the call passes the
    same arrays, unchanged, as the call `hot` was made for, on the same communicator and
    groups, with scalars of the plain Python types; None otherwise (the general path runs)."""
    if (comm if comm is not None else hot.world) is not hot.comm or hot.comm.py2f() != hot.handle \
            or type(groups) is not int or groups != hot.groups or len(kwargs) != hot.nkw \
            or agree.timeout_raw() != hot.timeout_raw:
        return None
    for name, a, shape, strides, dtype, writeable in hot.arrays:
        v = kwargs.get(name)
        if v is not a or v.shape != shape or v.strides != strides or v.dtype is not dtype \
                or v.flags.writeable != writeable:
            return None
    if hot.torch and not _hot_torch(hot, kwargs):
        return None
    vals: list = []
    try:
        return _hot_scalars(hot, kwargs, vals)
    except (OverflowError, struct.error):
        return None  # out of range: the general path rounds it as NumPy does, or says why


def _hot_scalars(hot: _Hot, kwargs: dict, vals: list) -> tuple[list, bytes] | None:
    for name, integer in hot.scalars:
        v: Any = kwargs.get(name)
        t = type(v)
        if t is float and not integer:
            vals.append(v)
        elif t is int:
            vals.append(v if integer else float(v))  # float(v) may overflow: caught below
        else:
            return None
    return vals, agree.scalar_record(hot.pack.pack(*vals))


def _hot_torch(hot: _Hot, kwargs: dict) -> bool:
    """The PyTorch tensors are those of the remembered call, unchanged (shape, strides, dtype,
    storage, requires_grad), and none that requires grad is updated with grad mode on (the
    general path raises for that)."""
    for name, t, shape, stride, dtype, ptr, grad in hot.torch:
        v = kwargs.get(name)
        if v is not t or v.shape != shape or v.stride() != stride or v.dtype is not dtype \
                or v.data_ptr() != ptr or v.requires_grad != grad:
            return False
    if hot.grad_check:
        import torch
        return not torch.is_grad_enabled()
    return True


def _run_hot(fast: _Fast, hot: _Hot, vals: list):
    """Runs the module function of an agreed repeated call (the hot path of __call__)."""
    args = fast.args
    if hot.floats_only:
        args.scalars = vals
    else:
        args.scalars = [0.0 if i else float(v) for v, (_, i) in zip(vals, hot.scalars)]
        args.iscalars = [int(v) if i else 0 for v, (_, i) in zip(vals, hot.scalars)]
    outs = None
    if hot.outputs:
        gs, rank, types = hot.outputs
        sizes = fast.sizes[0]
        outs = [np.empty(_local_shape(t, sizes, gs, rank), dtype=dt) for t, dt in types]
        args.outputs = [o.ctypes.data for o in outs]
    if fast.windows != len(shm.WINDOWS):
        args.windows, fast.windows = shm.WINDOWS, len(shm.WINDOWS)
    fast.run(args)
    if hot.torch_updated:
        import torch
        torch.autograd.graph.increment_version(hot.torch_updated)
    if outs and hot.torch_out:
        outs = [_as_torch(o) for o in outs]
    return None if not outs else outs[0] if len(outs) == 1 else tuple(outs)


def _torch_updates(p: Program, kwargs: dict, updated: set[str]) -> list[Any]:
    """The PyTorch tensors the call updates in place. Outside torch.no_grad() one that requires
    grad is refused, as PyTorch refuses an in-place operation on a leaf that requires grad;
    under no_grad their version counters are bumped after the call (as torch.optim does)."""
    found = []
    for q in p.params:
        if q.name not in updated:
            continue
        v = kwargs[q.name]
        found += [t for t in (v if isinstance(v, (list, tuple)) else [v]) if is_torch(t)]
    if not found:
        return []
    import torch
    for t in found:
        if t.requires_grad and torch.is_grad_enabled():
            name = next(q.name for q in p.params if q.name in updated and _holds(kwargs[q.name], t))
            kind = "a leaf Variable" if t.is_leaf else "a tensor"
            raise RuntimeError(f"'{name}': {kind} that requires grad is being used in an in-place "
                               f"operation ({p.name} updates '{name}' in place); call it under "
                               "torch.no_grad(), as optimizers do")
    return found


def _holds(v: Any, t: Any) -> bool:
    return v is t or (isinstance(v, (list, tuple)) and any(x is t for x in v))


_PACK = {"f16": "<e", "f32": "<f", "f64": "<d", "i32": "<i", "i64": "<q"}


def _bits(dtype: str, v: int | float) -> bytes:
    fmt = _PACK.get(dtype)
    if fmt is not None:
        try:
            return struct.pack(fmt, v)
        except (OverflowError, struct.error):  # beyond the dtype's range: as NumPy rounds it
            pass
    return np.asarray(v, STORAGE[dtype]).tobytes()


def _scalar_bits(p: Program, values: dict) -> tuple[tuple[str, Any, bytes], ...]:
    """Each scalar's name, value and bits in the parameter's dtype (what the ranks compare)."""
    return tuple((q.name, values[q.name], _bits(q.type.dtype, values[q.name]))
                 for q in p.params if q.scalar)


# --- what every rank was given ---------------------------------------------------------------
_HEAD = ("module", "function", "schedule", "groups", "communicator size")


def _agree(everyone: list, rank: int, p: Program | None, mine: tuple, cache: list):
    """Raises (the same on every rank) unless every rank's call is well-formed and agrees;
    returns (the size symbols, the segment sizes). `cache` holds the last call's shapes and
    what they bound (a training loop calls with the same shapes again and again)."""
    if mine[0] == "error":
        raise _ERRORS[mine[1]](mine[2])
    for r, item in enumerate(everyone):
        if item[0] == "error":
            raise ValueError(f"rank {r} was given bad arguments: {item[2]}")
    assert p is not None  # this rank's own error was raised above
    descs = [item[1] for item in everyone]
    first = descs[0][:2]
    if any(d[:2] != first for d in descs):  # rare: find what differs, to say so
        _disagreement(descs, rank, p)
    shapes = [d[2] for d in descs]
    groups = first[0][3]
    if cache and cache[0] is p and cache[1] == groups and cache[2] == shapes:
        return cache[3]
    bound = bind_sizes(p, shapes, groups)
    cache[:] = [p, groups, shapes, bound]
    return bound


def _disagreement(descs: list, rank: int, p: Program) -> None:
    for k, label in enumerate(_HEAD):
        bad = agree.differ([d[0][k] for d in descs])
        if bad:
            raise ValueError(f"{p.name}(): the ranks disagree on the {label}: {bad}")
    groups = descs[rank][0][3]
    gs = len(descs) // groups if len(descs) % groups == 0 else len(descs)
    for i, (name, _, _) in enumerate(descs[rank][1]):
        for g in range(0, len(descs), gs):
            bad = agree.differ([d[1][i] for d in descs[g:g + gs]], key=lambda nvb: nvb[2],
                               show=lambda nvb: nvb[1], first=g)
            if bad:
                raise ValueError(f"{p.name}(): scalar '{name}' differs between ranks ({bad}); "
                                 "a scalar must be the same on every rank of a group")
