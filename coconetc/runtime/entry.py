"""A call's one entry, for every backend (the CPU module, the CUDA module, the CUDA module under
the host emulation): "auto" resolved to the tuner's choice (auto.for_call), the label parsed,
this rank's arguments checked (the backend's check, runtime/checks.py) and described (call.py),
or, for a call that passes the same buffers as a recent one (fastpath.RecentCall), only its
scalars checked; then, at more than one rank, the round of 64-byte records, which ends the
agreement when every rank repeats an agreed call with the same scalars, else one exchange with
every rank of the communicator under the watchdog (agree.py), so that a wrong argument on any
rank, or ranks that disagree on the schedule, groups, a scalar's bits or a shape, raise the same
error on every rank before anything runs; then the call is remembered for the next with its
buffers. What differs between the backends (the communicator's transport, the tensor checks,
the windows a CUDA call's tensors lie in, how a call is remembered) is the backend object's
(backends.py). Returns a `Call`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from coconetc.ir.arguments import check_param, is_torch
from coconetc.ir.nodes import Program
from coconetc.plan.label import DEFAULT, ScheduleLabel, parse
from coconetc.runtime import agree, auto
from coconetc.runtime.call import agreed, check_groups, description, tensor_shapes, torch_updates
from coconetc.runtime.fastpath import RecentCall


@dataclass(frozen=True)
class Call:
    """A call every rank agreed on: what the module function is called with."""

    label: ScheduleLabel
    program: Program
    values: dict[str, Any]  # this rank's checked arguments (the tensors too, unless `repeated`)
    sizes: dict[str, int]  # the size symbols bound across the ranks
    segments: Any  # the segment sizes of the scattered parameters
    ranks: int  # the communicator's size
    what: str  # how errors name the call: module.function(schedule='label')
    config: bytes | None  # the digest of the agreed configuration (None: taken from `recent`)
    in_place: frozenset = frozenset()  # the tensor parameters in a window on every rank (CUDA)
    recent: RecentCall | None = None  # the remembered call this one took or made (None: not remembered)
    repeated: bool = False  # it reuses recent's module arguments (values holds its scalars only)
    torch_updated: tuple = ()  # the torch tensors it updates in place (their versions are bumped)
    torch_out: bool = False  # its outputs are returned as torch tensors


_new = object.__new__


def _made(label: ScheduleLabel, program: Program, values: dict[str, Any], sizes: dict[str, int], segments: Any,
          ranks: int, what: str, config: bytes | None, in_place: frozenset, recent: RecentCall | None,
          repeated: bool, torch_updated: tuple, torch_out: bool) -> Call:
    """Call(...) made in one step (a call's entry makes one per call and its host time counts:
    the frozen dataclass's __init__ sets each of its 13 fields through object.__setattr__, about
    1 us here; the instance is the same)."""
    c = _new(Call)
    c.__dict__.update(label=label, program=program, values=values, sizes=sizes, segments=segments, ranks=ranks,
                      what=what, config=config, in_place=in_place, recent=recent, repeated=repeated,
                      torch_updated=torch_updated, torch_out=torch_out)
    return c


def call_name(fn: Any, schedule: str) -> str:
    """How errors name a call: module.function(schedule='label')."""
    return f"{fn.ext.__name__}.{fn.name}(schedule={schedule!r})"


def enter(fn: Any, backend: Any, schedule: str | None, comm: Any, groups: Any, kwargs: dict, *,
          extra: tuple = (), counted: bool = False) -> Call:
    """FN's call (a ProgramFunction or CudaProgram) on COMM, checked, agreed and remembered by
    BACKEND's rules (extra: what else a repeat must share with the call it repeats, and the
    backend's check reads: the CUDA module's device and stream). counted: the hot path's
    record round already ran (and disagreed): the full exchange follows at once."""
    size = backend.size(comm)
    what = call_name(fn, schedule or DEFAULT)
    p: Program | None = None
    label: ScheduleLabel | None = None
    values: dict[str, Any] = {}
    timeout = agree.DEFAULT_TIMEOUT
    torch_updated: list = []
    torch_out = False
    rec = None
    try:
        rec = backend.repeated(fn, schedule, comm, groups, kwargs, extra)
        if rec is not None:  # values: the scalars only (the tensors are the remembered call's)
            label, p, what, timeout, torch_out = rec.label, rec.program, rec.what, rec.timeout, rec.torch_out
            values = {q.name: check_param(q, kwargs[q.name]) for q in rec.scalars}
            if torch_out:
                torch_updated = torch_updates(p, kwargs, {t for t, _ in p.updates})
            if size == 1 and rec.config is not None:  # nothing to agree: what its agreement bound
                backend.refuse(comm, what)
                return _made(label, p, values, rec.sizes, rec.segments, 1, what, None, rec.in_place, rec,
                            rec.args is not None, tuple(torch_updated), torch_out)
            mine: tuple = ("ok", description(rec.head, p, values, rec.shapes), rec.windowed)
        else:
            timeout = agree.timeout_s()
            if schedule == "auto":
                schedule = auto.for_call(fn, comm, groups, kwargs)
            what = call_name(fn, schedule or DEFAULT)
            label = parse(schedule)
            p = fn.program_of(label)
            backend.map_function(fn, label)
            check_groups(fn.name, groups)
            values = backend.check(p, kwargs, extra)
            if backend.torch_tensors and any(is_torch(v) or (isinstance(v, (list, tuple)) and any(map(is_torch, v)))
                                             for v in kwargs.values()):
                torch_out = True
                torch_updated = torch_updates(p, kwargs, {t for t, _ in p.updates})
            head = (fn.ext.__name__, fn.name, str(label), groups, size)
            mine = ("ok", description(head, p, values, tensor_shapes(p, values)),
                    backend.windowed(fn.ext, comm, groups, p, values))
    except (TypeError, ValueError, RuntimeError) as err:
        mine = ("error", type(err).__name__, str(err))
    backend.refuse(comm, what)
    if size > 1 and not counted:  # first the round of 64-byte records: enough when every rank repeats
        config = rec.config if rec is not None and mine[0] == "ok" else None
        scal = agree.scalar_record(b"".join(b for _, _, b in mine[1][1])) if config else b""
        if backend.record_round(comm, config, scal, groups, what, timeout):
            assert rec is not None and p is not None and label is not None
            return _made(label, p, values, rec.sizes, rec.segments, size, what, None, rec.in_place, rec,
                        rec.args is not None, tuple(torch_updated), torch_out)
    everyone = backend.exchange(comm, mine, what, timeout)
    sizes, segments = agreed(everyone, backend.rank(comm), p, mine, fn._bound)
    assert p is not None and label is not None  # else agreed() raised this rank's error
    in_place = frozenset(mine[2]).intersection(*(item[2] for item in everyone))
    config = agree.digest([(item[1][0], item[1][2], item[2]) for item in everyone])
    if rec is not None:  # what this full agreement bound, for the next repeat
        again = rec.args is not None and rec.sizes == sizes and rec.segments == segments
        if not again:  # its buffers bound anew: checked as they were when it was remembered
            values = {**backend.check(p, kwargs, extra, tensors_only=True), **values}
        rec.sizes, rec.segments, rec.in_place = sizes, segments, in_place
        return _made(label, p, values, sizes, segments, len(everyone), what, config, in_place, rec, again,
                    tuple(torch_updated), torch_out)
    rec = backend.remember(fn, schedule, comm, groups, kwargs, extra, label, what, p, values, mine, timeout,
                           torch_out)
    if rec is not None:
        rec.sizes, rec.segments, rec.in_place = sizes, segments, in_place
    return _made(label, p, values, sizes, segments, len(everyone), what, config, in_place, rec, False,
                tuple(torch_updated), torch_out)
