"""A loaded module and its functions: `CompiledModule` holds one `ProgramFunction` per program,
a Python function taking keyword arguments named as in the program (CPU backend: NumPy arrays
or CPU tensors). A call runs its entry (entry.py: check this rank's arguments, agree across
ranks under the watchdog), then the module function with its arguments laid out (marshal.py);
a call that repeats a recent call's buffers takes the hot path (fastpath.py). The layout
helpers (local_shape, local_index, empty, zeros) come from layout.py; schedule="auto" from
auto.py. Nothing here imports the interpreter or the tuner."""

from __future__ import annotations

import time
from _thread import get_ident
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from coconetc.ir.nodes import Program
from coconetc.plan.label import DEFAULT, ScheduleLabel, parse
from coconetc.runtime import layout, marshal, programs, shm, trace
from coconetc.runtime.backends import BACKENDS
from coconetc.runtime.entry import Call, enter
from coconetc.runtime.fastpath import Recent, hot_check, run_hot, run_warm, warm_check
from coconetc.runtime.marshal import as_torch, returned
from coconetc.toolchain.probes import require_cpu_extra

trace.from_environment()  # COCONET_TRACE=FOLDER: every call of this process traced

if TYPE_CHECKING:  # (the front half is not imported to call a module: runtime/warm.py)
    from coconetc.sourcefile import SourceFile

CPU = BACKENDS["cpu"]


@dataclass(frozen=True)
class Exports:
    """What a module's calls read of its file and its generated sources, and nothing else (a
    warm load's record holds this, runtime/warm.py): the file's path and text, the IR each
    (program, schedule) runs, and the name of its function in the module."""

    file: str
    source: str
    variants: dict[tuple[str, str], Program]
    functions: dict[tuple[str, str], str]

    @classmethod
    def of(cls, mod: SourceFile, src: Any) -> Exports:
        """MOD's exports, as SRC (the generated sources) named its functions."""
        return cls(mod.file, mod.source, mod.variants(), {k: f.name for k, f in src.functions.items()})


class CompiledModule:
    backend = CPU  # what differs between the backends (runtime/backends.py)

    def __init__(self, mod: SourceFile, src: Any, ext: Any):
        """MOD built as EXT from SRC (the generated sources: `module`, `functions`)."""
        self._init(Exports.of(mod, src), src.module, ext, lambda: (mod, src))

    @classmethod
    def remembered(cls, exports: Exports, name: str, ext: Any,
                   whole: Callable[[], tuple[SourceFile, Any]]) -> CompiledModule:
        """Module NAME (EXT) made from what a warm load read; `whole()` gives its SourceFile
        and generated sources when `source_module` or `sources` is first asked for."""
        self = cls.__new__(cls)
        self._init(exports, name, ext, whole)
        return self

    def _init(self, exports: Exports, name: str, ext: Any, whole: Callable[[], tuple[SourceFile, Any]]) -> None:
        self._name, self.ext, self._whole = name, ext, whole
        self._made: tuple[SourceFile, Any] | None = None

        def make(prog: str, scheds: dict[str, Program]) -> ProgramFunction:
            fn = ProgramFunction(prog, scheds, ext, {s: exports.functions[(prog, s)] for s in scheds},
                                 exports.source)
            fn.file = exports.file
            fn.whole = self._parts  # (a trace names the plan's units)
            return fn
        self.programs: dict[str, ProgramFunction] = programs.bind(self, exports.variants, make)

    def _parts(self) -> tuple[SourceFile, Any]:
        if self._made is None:
            self._made = self._whole()
        return self._made

    @property
    def source_module(self) -> SourceFile:
        """The checked, scheduled and planned file."""
        return self._parts()[0]

    @property
    def sources(self) -> Any:
        """The generated sources (codegen.cpu.Sources)."""
        return self._parts()[1]

    def __repr__(self) -> str:
        return f"<coconet module {self._name}: {', '.join(self.programs)}>"


class ProgramFunction:
    backend = CPU

    def __init__(self, name: str, schedules: dict[str, Program], ext: Any, functions: dict[str, str],
                 source: str = ""):
        self.name, self.schedules, self.ext = name, schedules, ext
        self.functions = functions  # schedule -> its function in the module (as the generator named it)
        self.source = source  # the .ccn text (the tuning cache's key)
        self.file = "FILE"  # its path, for messages
        self.whole: Callable[[], tuple[Any, Any]] | None = None  # (SourceFile, sources), on demand
        self.tuned: list | None = None  # the tuning records of this program (schedule="auto")
        self.auto_memo: dict[tuple, str] = {}
        self._bound: list = []  # the last call's shapes and their sizes (see call.agreed)
        # the recent agreed calls (fastpath.RecentCall), by their buffers (fastpath.repeat)
        self.recent = Recent(tuple(q.name for q in schedules[DEFAULT].params if not q.scalar))
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
        autotuner's overall choice for these sizes and ranks, read from the tuning records
        (runtime/auto.py; it may take other parameter layouts than the program's:
        DistributedOptimizer allocates its state in the choice's layouts); without an entry
        this raises and says how to make one (runtime/programs.py: resolve)."""
        return programs.resolve(self, schedule, comm, groups, sizes)

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
        """The program SCHEDULE (a label: "zero", "zero@p2p", None for "default") runs."""
        return self.program_of(parse(schedule))

    def program_of(self, label: ScheduleLabel) -> Program:
        return programs.program_of(self, label)

    def __call__(self, *, schedule: str | None = None, comm: Any = None, groups: int = 1, **kwargs):
        slot = self.recent.slot(schedule, kwargs)
        fast = self.recent.get(slot)
        if fast is not None and fast.hot is not None and fast.config is not None and trace.active() is None:
            # the hot path: the same NumPy buffers as an agreed call; one round of 64 bytes
            got = hot_check(fast.hot, comm, groups, kwargs)
            if got is not None:
                hot, start = fast.hot, time.monotonic()
                if hot.channel.agreed(fast.config, got[1], groups, hot.what, hot.limit, start):
                    return run_hot(self.ext, fast, hot, got[0], kwargs)
                return self._call(schedule, comm, groups, kwargs, True)
        warms = self.recent.warm.get((get_ident(), schedule, tuple(kwargs)), ())
        for warm in warms if trace.active() is None else ():
            # the warm path: new buffers like an agreed call's (the first of the remembered
            # kinds they are like); the same round of 64 bytes. The same buffers twice in a row
            # (a training loop's) go the full way once, which remembers them for the hot path
            hot = warm.hot
            if hot is None or warm.config is None or warm.run is None:
                continue
            new = warm_check(hot, comm, groups, kwargs)
            if new is None:
                continue
            if self.recent.warm_again(slot, kwargs):
                return self._call(schedule, comm, groups, kwargs, False)
            if hot.channel.agreed(warm.config, new[2], groups, hot.what, hot.limit, time.monotonic()):
                return run_warm(self.ext, warm, hot, new[0], new[1], kwargs)
            return self._call(schedule, comm, groups, kwargs, True)
        return self._call(schedule, comm, groups, kwargs, False)

    def _call(self, schedule: str | None, comm: Any, groups: Any, kwargs: dict, counted: bool):
        """A call through the one entry (entry.py; counted: the hot path's record round already
        ran and disagreed, so the full exchange follows at once). The label is parsed once,
        there; any error is raised on every rank after the exchange, as any other."""
        if not self._extra_checked:  # once: the module was imported, so the extra stays there
            require_cpu_extra()
            self._extra_checked = True
        from mpi4py import MPI
        comm = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(comm, MPI.Comm) or comm.Is_inter():
            raise TypeError(f"{self.name}(): comm must be an mpi4py intra-communicator, "
                            f"got {type(comm).__name__}")
        call = enter(self, CPU, schedule, comm, groups, kwargs, counted=counted)
        out = self._run(call, comm, groups)
        if call.recent is not None and call.config is not None:  # the next call with these
            call.recent.config = call.config  # buffers may take the hot path
        if call.torch_updated:
            import torch
            torch.autograd.graph.increment_version(list(call.torch_updated))
        if call.torch_out:
            out = [as_torch(o) for o in out]
        return returned(out)

    def function_name(self, schedule: str) -> str:
        """The module function of SCHEDULE (as the generator named it)."""
        return self.functions[schedule]

    def _run(self, call: Call, comm, groups: int):
        from mpi4py import MPI
        rec = call.recent

        def extra(args: Any, fresh: bool) -> None:
            n = len(shm.WINDOWS)  # buffers of coconetc.empty: the runtime may read them in place
            if (fresh and n) or (not fresh and rec is not None and rec.windows != n):
                args.windows = shm.WINDOWS
            if rec is not None:
                rec.windows = n
            if fresh:
                args.comm, args.groups, args.fused = MPI._handleof(comm), groups, call.label.code
        gs = comm.Get_size() // groups
        if trace.active() is not None:
            return trace.traced(self, call, lambda: programs.run(self, call, gs, comm.Get_rank() % gs,
                                                                 marshal.numpy_empty, extra))
        return programs.run(self, call, gs, comm.Get_rank() % gs, marshal.numpy_empty, extra)
