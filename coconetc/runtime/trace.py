"""Traces: every call of a compiled module, written as a Chrome-trace/Perfetto JSON file per
rank (open it in https://ui.perfetto.dev or chrome://tracing).

Switched on for a block of code (`with coconetc.trace("traces/"):`) or for a whole process
(COCONET_TRACE=traces/ in the environment: every rank of an MPI job writes its own file when it
exits). Each call of a compiled module then records, on this rank's timeline (pid: the rank):

  * the call (`module.program[schedule]`, category "call": the compiled function's run, from
    after the argument checks and the ranks' agreement to its return);
  * each unit of the function's plan (category "unit": a loop, a GEMM, an attention call, a
    library call, a collective, a fused collective, an overlap), named as `coconetc show
    --format plan` names it, with its bytes moved and sent, its flops and its time by the cost
    model (coconetc/plan/cost.py) at the call's sizes in its args;
  * inside a unit (category "piece"): each chunk of an overlap (its producer, the start of its
    communication, its consumer, each wait for a chunk's communication) and of a fused
    collective (its computation), and each wait for communication.

A pipeline (coconetc.torch.pipeline) adds its own ranges (mark): each action of a step
(category "action", named as torch.profiler's ranges are, `PP:<stage><kind><micro-batch>`;
args: its pipeline, run (a step or an evaluation), stage, micro-batch, kind and work, its time
less its receives' waits) with the calls of its layers inside, and each wait for a message
(category "wait"); a sharded model (coconetc.torch.shard) its collectives' starts and copies
(category "shard") and their waits. The gaps between a rank's actions and its waits are its
idle time: `pipeline_bubbles` reads each run's bubble from the merged files (`coconetc
trace-merge` prints it).

The runtime marks the units in the generated code and the pieces in its headers (coconet/trace.h);
while tracing is off a mark costs one relaxed atomic load (bench/call_overhead.py measures it).
A CUDA module (also under the host emulation) records the same units, timed by CUDA events on
the call's stream, and its pieces (each NCCL call, each chunk of an overlap or a fused
collective) by events on their own streams (coconet/cuda/trace.cuh): each stream is a track of
its own (tid STREAM_TRACK + k), the call on the host thread's; taking a traced call's events
waits for its GPU work.

A trace never grows without bound: it keeps at most `max_events` events (default 1,000,000,
COCONET_TRACE_MAX_EVENTS; about 150 bytes each in the file); the events past it are counted in
the file's metadata ("dropped_events") and a warning says so once. A folder that cannot be
written gives one warning and the calls run untraced.

`merge(files, out)` (`coconetc trace-merge FOLDER`) joins the ranks' files into one."""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ENV_TRACE = "COCONET_TRACE"  # a folder: this process traces every call and writes its file there at exit
ENV_MAX_EVENTS = "COCONET_TRACE_MAX_EVENTS"
MAX_EVENTS = 1_000_000
FILE = "trace.rank{rank}.json"
STREAM_TRACK = 1000  # a CUDA module's events: the tid of its k-th stream is STREAM_TRACK + k (cuda/trace.cuh)


class Session:
    """One trace being recorded: its folder, its events (Chrome-trace dicts) and their limit."""

    def __init__(self, folder: str | os.PathLike, max_events: int):
        if max_events < 1:
            raise ValueError(f"coconetc.trace: max_events must be at least 1, got {max_events}")
        self.folder = Path(folder)
        self.max_events = max_events
        self.events: list[dict[str, Any]] = []
        self.dropped = 0
        self.ok = _writable(self.folder)
        self._names: dict[tuple[int, str], list[str]] = {}
        self._costs: dict[tuple, list[dict[str, float]]] = {}
        self.tracks: set[int] = set()  # the tids of a CUDA module's streams met (STREAM_TRACK on), named in the file
        self._warned = False

    def room(self) -> int:
        return max(0, self.max_events - len(self.events))

    def add(self, event: dict[str, Any]) -> None:
        if self.room() > 0:
            self.events.append(event)
        else:
            self.drop(1)

    def drop(self, n: int) -> None:
        self.dropped += n
        if n and not self._warned:
            self._warned = True
            warnings.warn(f"coconetc.trace: the trace holds its limit of {self.max_events} events; later "
                          f"events are counted, not kept (max_events=, {ENV_MAX_EVENTS})", stacklevel=3)

    def unit_names(self, fn: Any, schedule: str) -> list[str]:
        key = (id(fn), schedule)
        if key not in self._names:
            from coconetc.plan.units import title
            self._names[key] = [title(u) for u in _plan(fn, schedule).units]
        return self._names[key]

    def unit_costs(self, fn: Any, schedule: str, sizes: dict[str, int], ranks: int) -> list[dict[str, float]]:
        """Each unit's bytes, flops and predicted time by the cost model at these sizes."""
        key = (id(fn), schedule, tuple(sorted(sizes.items())), ranks)
        if key not in self._costs:
            from coconetc.plan.cost import cost
            try:
                parts = cost(_plan(fn, schedule), sizes, ranks).parts
            except Exception:  # noqa: BLE001 (a trace without the model's figures, not a failed call)
                parts = []
            self._costs[key] = [{"bytes_moved": c.moved, "bytes_sent": c.sent, "flops": c.flops,
                                 "predicted_us": c.seconds() * 1e6} for _, c in parts]
        return self._costs[key]

    def write(self) -> Path | None:
        """This rank's file (None when the folder cannot be written: one warning)."""
        if not self.ok:
            return None
        rank = _rank()
        doc = {"traceEvents": [*_metadata(rank, self.tracks), *self.events], "displayTimeUnit": "ms",
               "otherData": {"rank": rank, "dropped_events": self.dropped, "max_events": self.max_events,
                             "clock": "CLOCK_MONOTONIC, microseconds"}}
        path = self.folder / FILE.format(rank=rank)
        try:
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, path)
        except OSError as err:
            warnings.warn(f"coconetc.trace: cannot write {path}: {err}; no trace written", stacklevel=2)
            return None
        return path


_session: Session | None = None


def active() -> Session | None:
    """The trace being recorded (None: tracing is off)."""
    return _session


@contextmanager
def trace(folder: str | os.PathLike = "coconet_trace", max_events: int | None = None) -> Iterator[Session]:
    """Traces every call of a compiled module made inside the block; at its end each rank
    writes FOLDER/trace.rank<r>.json (see the module doc). Returns the Session (its `events`).
    Inside the block its calls are recorded there only, not in an enclosing block's trace or
    COCONET_TRACE's."""
    global _session
    outer = _session  # (COCONET_TRACE's, or an enclosing block's: it records again after this one)
    s = _session = Session(folder, max_events or _max_events())
    try:
        yield s
    finally:
        _session = outer
        s.write()


def _max_events() -> int:
    text = os.environ.get(ENV_MAX_EVENTS, "")
    try:
        return int(text) if text else MAX_EVENTS
    except ValueError:
        raise ValueError(f"{ENV_MAX_EVENTS}={text!r} is not a whole number of events") from None


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".probe.{os.getpid()}"
        probe.write_text("")
        probe.unlink()
        return True
    except OSError as err:
        warnings.warn(f"coconetc.trace: cannot write to {folder}: {err}; the calls run untraced", stacklevel=4)
        return False


def from_environment() -> None:
    """COCONET_TRACE=FOLDER: trace every call of this process, the file written at exit."""
    global _session
    folder = os.environ.get(ENV_TRACE)
    if folder and _session is None:
        s = _session = Session(folder, _max_events())
        atexit.register(_write_at_exit, s)


def _write_at_exit(s: Session) -> Path | None:
    """COCONET_TRACE's file of this process, where it traced a call: a process that made none
    (a script's launcher, whose ranks relaunch it under mpiexec) writes nothing, rather than
    an empty file over its rank 0's."""
    return s.write() if s.events or s.dropped else None


def _rank() -> int:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi.COMM_WORLD.Get_rank()
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def _metadata(rank: int, tracks: set[int]) -> list[dict[str, Any]]:
    return [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
            {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}},
            *({"name": "thread_name", "ph": "M", "pid": rank, "tid": k,
               "args": {"name": f"stream {k - STREAM_TRACK}"}} for k in sorted(tracks))]


def _plan(fn: Any, schedule: str) -> Any:
    return fn.whole()[0].plans[(fn.name, schedule)]  # the plan the generator rendered


def traced(fn: Any, call: Any, run: Any) -> Any:
    """RUN() (the module function of an agreed CALL of FN) with the units' marks on, its
    events added to the trace."""
    s = _session
    if s is None or not s.ok:
        return run()
    ext, rank = fn.ext, _rank()
    ext._trace_on(True, s.room())
    t0 = time.monotonic_ns()
    try:
        return run()
    finally:
        t1 = time.monotonic_ns()
        events, dropped = ext._trace_take()
        ext._trace_on(False, 0)
        s.drop(dropped)
        _add(s, fn, call, rank, t0, t1, events)


def _add(s: Session, fn: Any, call: Any, rank: int, t0: int, t1: int, events: list) -> None:
    schedule = call.label.name
    names = s.unit_names(fn, schedule)
    costs = s.unit_costs(fn, schedule, dict(call.sizes), call.ranks)
    tid = min((e[5] for e in events if e[5] < STREAM_TRACK), default=0)  # (a CUDA module's: all on streams)
    s.tracks.update(e[5] for e in events if e[5] >= STREAM_TRACK)
    s.add({"name": f"{fn.ext.__name__}.{fn.name}[{call.label}]", "cat": "call", "ph": "X", "pid": rank, "tid": tid,
           "ts": t0 / 1e3, "dur": (t1 - t0) / 1e3, "args": {"sizes": dict(call.sizes), "ranks": call.ranks}})
    for unit, chunk, what, a, b, thread in events:
        if what:
            name, cat = what, "piece"
            args: dict[str, Any] = {"unit": names[unit] if 0 <= unit < len(names) else None}
            if chunk >= 0:
                args["chunk"] = chunk
        else:
            name, cat = names[unit] if unit < len(names) else f"unit {unit}", "unit"
            args = {"unit_index": unit, **(costs[unit] if unit < len(costs) else {})}
        s.add({"name": name, "cat": cat, "ph": "X", "pid": rank, "tid": thread, "ts": a / 1e3, "dur": (b - a) / 1e3,
               "args": args})


def mark(name: str, cat: str, t0: int, t1: int, args: dict[str, Any]) -> None:
    """A range of this rank's timeline from T0 to T1 (time.monotonic_ns(), as the calls'),
    recorded while a trace is on, on the calls' track (a pipeline's action, a wait for a
    message); nothing while tracing is off."""
    s = _session
    if s is not None and s.ok:
        s.add({"name": name, "cat": cat, "ph": "X", "pid": _rank(), "tid": 0, "ts": t0 / 1e3, "dur": (t1 - t0) / 1e3,
               "args": args})


def pipeline_bubbles(events: Sequence[dict[str, Any]]) -> dict[tuple[int, int], float]:
    """Each pipeline step's bubble in EVENTS (the merged ranks' events): the idle fraction of
    its ranks, 1 - work / (ranks x makespan), work the actions' (category "action": their time
    less their receives' waits), the makespan from the step's first action's start to its last
    one's end over the ranks (their CLOCK_MONOTONIC: the ranks of one machine), as
    bench/pipeline.py measures it from Pipeline.events; by (pipeline, run): the process's count
    of its pipelines (made in the same order on every rank) and the pipeline's of its steps and
    evaluations."""
    steps: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in events:
        if e.get("cat") == "action":
            steps.setdefault((int(e["args"]["pipeline"]), int(e["args"]["run"])), []).append(e)
    from coconetc.pipeline.orders import idle_fraction
    return {k: idle_fraction(((e["ts"], e["ts"] + e["dur"], e["args"]["work_us"]) for e in evs),
                             len({e["pid"] for e in evs}))
            for k, evs in sorted(steps.items())}


def merge(files: Sequence[str | os.PathLike], out: str | os.PathLike) -> dict[str, Any]:
    """The ranks' trace files joined into one, OUT (each rank a process of its own, as written);
    returns what it wrote (the Chrome-trace document)."""
    events: list[dict[str, Any]] = []
    other: dict[str, Any] = {"ranks": [], "dropped_events": 0}
    for f in sorted(map(Path, files)):
        doc = json.loads(f.read_text())
        events += doc.get("traceEvents", [])
        data = doc.get("otherData", {})
        other["ranks"].append(data.get("rank"))
        other["dropped_events"] += int(data.get("dropped_events", 0))
    doc = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}
    Path(out).write_text(json.dumps(doc))
    return doc
