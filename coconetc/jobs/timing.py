"""Timing on ranks: calls timed in interleaved rounds (each round calls every variant once, so
a burst of load from other processes touches every variant alike), each call started at a
barrier; a variant's time is the median of its repetitions, the slowest rank's median."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

K = TypeVar("K")
# calls[key]() prepares one call (copies its arguments, outside the timing) and returns it
Prepare = Callable[[], Callable[[], Any]]
Seen = Callable[[K, int, float, Any], None]


def timed_rounds(comm: Any, calls: Mapping[K, Prepare], reps: int, warmup: int = 0,
                 barrier_after: bool = False, seen: Seen | None = None) -> dict[K, list[float]]:
    """warmup + reps rounds; in each, every call once, in order: prepared, a barrier, then the
    call timed (up to the barrier after it with barrier_after, so every rank times the slowest
    rank's call). The first `warmup` rounds are not recorded. seen(key, round, seconds,
    result) after each call (the round counts the warm-up rounds)."""
    times: dict[K, list[float]] = {k: [] for k in calls}
    for k in range(warmup + reps):
        for key, prepare in calls.items():
            call = prepare()
            comm.Barrier()
            t0 = time.perf_counter()
            out = call()
            if barrier_after:
                comm.Barrier()
            seconds = time.perf_counter() - t0
            if k >= warmup:
                times[key].append(seconds)
            if seen is not None:
                seen(key, k, seconds, out)
    return times


def slowest(comm: Any, seconds: float) -> float:
    """The largest of every rank's value (every rank gets it)."""
    from mpi4py import MPI
    return comm.allreduce(seconds, op=MPI.MAX)


def slowest_median(comm: Any, times: Sequence[float]) -> float:
    """The median of this rank's times, the largest over the ranks."""
    return slowest(comm, statistics.median(times))


def slowest_medians(comm: Any, times: Mapping[K, Sequence[float]]) -> dict[K, float]:
    return {k: slowest_median(comm, v) for k, v in times.items()}
