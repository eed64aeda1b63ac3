"""A loaded module and its functions: `CompiledModule` holds one `ProgramFunction` per program,
a Python function taking keyword arguments named as in the program (CPU backend: NumPy arrays
or CPU tensors). A call runs its entry (call.py: check this rank's arguments, agree across
ranks under the watchdog), then the module function with its arguments laid out (marshal.py);
a call that repeats a recent call's buffers takes the hot path (fastpath.py). The layout
helpers (local_shape, local_index, empty, zeros) come from layout.py; schedule="auto" from
auto.py. Nothing here imports the interpreter or the tuner."""

from __future__ import annotations

import time
from typing import Any


from coconetc.codegen.naming import function_name
from coconetc.ir.nodes import Program
from coconetc.plan.label import DEFAULT, ScheduleLabel, parse
from coconetc.runtime import agree, auto, batch, layout, marshal, shm
from coconetc.runtime.call import Local, agreed, check_local, check_replicated, failed
from coconetc.runtime.checks import checked_arguments, cpu_buffer, host_span
from coconetc.runtime.fastpath import Recent, RecentCall, hot_check, remember, repeat, run_hot
from coconetc.runtime.marshal import as_torch, returned
from coconetc.sourcefile import SourceFile
from coconetc.toolchain.probes import require_cpu_extra


class CompiledModule:
    def __init__(self, mod: SourceFile, src: Any, ext: Any):
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


class ProgramFunction:
    def __init__(self, name: str, schedules: dict[str, Program], ext: Any, source: str = ""):
        self.name, self.schedules, self.ext = name, schedules, ext
        self.source = source  # the .ccn text (the tuning cache's key)
        self.file = "FILE"  # its path, for messages
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
        (runtime/tuned.py: cached_choice; it may take other parameter layouts than the
        program's: DistributedOptimizer allocates its state in the choice's layouts); without
        an entry this raises and says how to make one."""
        if schedule != "auto":
            self._program(schedule)
            return schedule or DEFAULT
        choice = auto.overall(self, comm, groups, sizes)
        self._program(choice)
        return choice

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
        p = self.schedules.get(label.name)
        if p is None:
            raise ValueError(f"{self.name}(): unknown schedule {str(label)!r} "
                             f"(one of {', '.join(self.schedules)})")
        return p

    def __call__(self, *, schedule: str | None = None, comm: Any = None, groups: int = 1, **kwargs):
        fast = self.recent.get(self.recent.slot(schedule, kwargs))
        if fast is not None and fast.hot is not None and fast.config is not None:
            # the hot path: the same NumPy buffers as an agreed call; one round of 64 bytes
            got = hot_check(fast.hot, comm, groups, kwargs)
            if got is not None:
                hot, start = fast.hot, time.monotonic()
                if hot.channel.agreed(fast.config, got[1], groups, hot.what, hot.limit, start):
                    return run_hot(self.ext, fast, hot, got[0], kwargs)
                return self._call(schedule, comm, groups, kwargs, start)
        return self._call(schedule, comm, groups, kwargs, None)

    def _call(self, schedule: str | None, comm: Any, groups: Any, kwargs: dict,
              counted: float | None):
        """A call (counted: the monotonic time of its entry when the hot path's round already
        ran and disagreed, so the full exchange follows at once). The label is parsed once,
        here; any error is raised on every rank after the exchange, as any other."""
        if not self._extra_checked:  # once: the module was imported, so the extra stays there
            require_cpu_extra()
            self._extra_checked = True
        from mpi4py import MPI
        comm = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(comm, MPI.Comm) or comm.Is_inter():
            raise TypeError(f"{self.name}(): comm must be an mpi4py intra-communicator, "
                            f"got {type(comm).__name__}")
        local = label = None
        try:
            if schedule == "auto":
                schedule = auto.for_call(self, comm, groups, kwargs)
            label = parse(schedule)
        except (TypeError, ValueError) as err:
            local = failed(err)
        if label is not None:
            local = repeat(self, schedule, groups, comm, kwargs) or \
                check_local(self, label, groups, comm.Get_size(), kwargs)
        assert local is not None
        what = f"{self.ext.__name__}.{self.name}(schedule={schedule or DEFAULT!r})"
        sizes, segments, config = self._agree_call(comm, groups, local, what, counted)
        assert local.program is not None and label is not None  # else agreed() raised this rank's error
        if local.fast is None:
            remember(self, schedule, groups, comm, kwargs, local, label, what)
        out = self._run(local.program, local.values, sizes, segments, comm, groups, label, local, kwargs)
        if local.fast is not None:  # the next call with these buffers may take the hot path
            local.fast.config = config
        if local.torch_updated:
            import torch
            torch.autograd.graph.increment_version(local.torch_updated)
        if local.torch_out:
            out = [as_torch(o) for o in out]
        return returned(out)

    def _agree_call(self, comm, groups, local: Local, what: str, counted: float | None):
        """The ranks agree on the call (or all raise): first the record round of repeated calls
        (agree.Channel.agreed), unless the hot path ran it (counted), then, unless every rank
        repeats the same agreed call, the full exchange. Returns (sizes, segments, the digest
        of the agreed configuration). Under COCONET_CHECK_REPLICATED this rank asks for the full
        exchange (the record round has no room for the digests)."""
        if counted is None and comm.Get_size() > 1:
            fast = local.fast
            config = fast.config if fast is not None and local.shared[0] == "ok" \
                and not check_replicated() else None
            scal = agree.scalar_record(b"".join(b for _, _, b in local.shared[1][1])) if config else b""
            if agree.channel(comm).agreed(config, scal, groups, what, local.timeout, time.monotonic()):
                assert fast is not None
                return fast.sizes, fast.segments, config
        everyone = agree.exchange(comm, local.shared, what, local.timeout,
                                  counted=comm.Get_size() > 1)
        sizes, segments = agreed(everyone, comm.Get_rank(), local.program, local.shared, self._bound)
        return sizes, segments, agree.digest([(item[1][0], item[1][2]) for item in everyone])

    def _run(self, p: Program, arrays: dict, sizes: dict, segments, comm, groups: int,
             label: ScheduleLabel, local: Local | None = None, kwargs: dict | None = None):
        from mpi4py import MPI
        fast = local.fast if local is not None else None
        if fast is not None and fast.args is not None and fast.sizes == sizes and fast.segments == segments:
            return self._run_again(p, arrays, fast, sizes, comm, groups)
        if len(arrays) < len(p.params):  # a repeated call (fastpath.repeat) bound anew: its buffers
            assert kwargs is not None  # (the remembered call keeps none), checked as they were
            arrays = {**checked_arguments(p, kwargs, cpu_buffer, host_span, "arrays", tensors_only=True), **arrays}
        args = self.ext.CallArgs()
        marshal.tensors(args, p, arrays, segments, marshal.host_ptr)
        gs = comm.Get_size() // groups
        outs = marshal.outputs(p, sizes, gs, comm.Get_rank() % gs, marshal.numpy_empty)
        args.outputs = [o.ctypes.data for o in outs]
        marshal.scalars(args, p, arrays, sizes)
        args.comm, args.groups = MPI._handleof(comm), groups
        if shm.WINDOWS:  # buffers of coconetc.empty: the runtime may read them in place
            args.windows = shm.WINDOWS
        args.fused = label.code
        run = getattr(self.ext, function_name(self.name, label.name))
        if fast is not None:  # the next call with the same buffers reuses these arguments
            fast.args, fast.sizes, fast.segments, fast.run, fast.windows = args, sizes, segments, run, len(shm.WINDOWS)
        batch.invoke(self.ext, run, args)
        return outs

    def _run_again(self, p: Program, arrays: dict, fast: RecentCall, sizes: dict, comm, groups: int):
        """_run for the same buffers as the call that made `fast`: only scalars and outputs."""
        args = fast.args
        gs = comm.Get_size() // groups
        outs = marshal.outputs(p, sizes, gs, comm.Get_rank() % gs, marshal.numpy_empty)
        if outs:
            args.outputs = [o.ctypes.data for o in outs]
        args.scalars = [float(arrays[n]) if not i else 0.0 for n, i in fast.kinds]
        if any(i for _, i in fast.kinds):
            args.iscalars = [int(arrays[n]) if i else 0 for n, i in fast.kinds]
        if fast.windows != len(shm.WINDOWS):
            args.windows, fast.windows = shm.WINDOWS, len(shm.WINDOWS)
        batch.invoke(self.ext, fast.run, args)
        return outs
