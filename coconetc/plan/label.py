"""A schedule label, as a call, the CLI and the tuner name a schedule: `zero` or `zero@p2p`.

The part before `@` is the schedule's name (`default`: the program itself, unscheduled); the
part after it, when there is one, the algorithm of the call's fused collectives (and its
all-reduces, reduce-scatters and all-gathers) on the CPU backend: `p2p` point-to-point messages, `shm` the
node's shared-memory window (where every rank of the group is on one node; else
point-to-point). Without it the runtime does as COCONET_FUSED says (default: the window where
it can); the autotuner measures both. Parsed once, here, for every entry point."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

DEFAULT = "default"  # the name of the unscheduled program among its schedules
ALGORITHMS = {"p2p": 1, "shm": 2}  # algorithm -> its code in the module's CallArgs.fused


@dataclass(frozen=True)
class ScheduleLabel:
    name: str = DEFAULT
    algorithm: str = ""  # "" (as COCONET_FUSED says) or one of ALGORITHMS

    @property
    def code(self) -> int:
        """The algorithm as the generated module takes it (CallArgs.fused; 0: not chosen)."""
        return ALGORITHMS.get(self.algorithm, 0)

    @property
    def default(self) -> bool:
        return self.name == DEFAULT

    def with_algorithm(self, algorithm: str) -> ScheduleLabel:
        return parse(f"{self.name}@{algorithm}")

    def __str__(self) -> str:
        return f"{self.name}@{self.algorithm}" if self.algorithm else self.name


@lru_cache(maxsize=256)
def parse(label: str | None) -> ScheduleLabel:
    """"zero@p2p" -> ScheduleLabel("zero", "p2p"); None or "" -> the program itself. A
    ValueError names an unknown algorithm."""
    if label is not None and not isinstance(label, str):
        raise TypeError(f"schedule must be a string, got {type(label).__name__}")
    name, at, algo = (label or DEFAULT).partition("@")
    if at and algo not in ALGORITHMS:
        raise ValueError(f"schedule {label!r}: unknown fused-collective algorithm {algo!r} "
                         f"(one of {', '.join(ALGORITHMS)})")
    return ScheduleLabel(name or DEFAULT, algo)


def schedule_name(label: str | None) -> str:
    """A label's schedule name: "zero@p2p" -> "zero" (a label the tuner wrote itself)."""
    return parse(label).name
