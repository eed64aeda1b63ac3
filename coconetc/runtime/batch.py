"""Calls of one module function run as one step whose reductions span them
(runtime_cpp/coconet/turns.h; the CPU's batch.h, CUDA's cuda/batch.cuh): inside `together()`, a
module call (CPU or CUDA) is checked and agreed with the other ranks as always, but its module
function does not run yet; when the block ends,
the calls collected run as one batch, in which every `sum`/`norm` of the program is taken over
all of them (each call stops at a reduction until every call has left its partial result).
DistributedOptimizer(across_groups=True) calls its program once per parameter group this way,
so that a clipping norm is the norm of every group's gradient, as
`torch.nn.utils.clip_grad_norm_(model.parameters())` computes it. The arrays a call returns
inside the block hold their values once the block has ended."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

class _Local(threading.local):
    pending: list | None = None  # the calls held inside together() on this thread (a class
    # default, so that reading it where it was never set is an attribute read, not a failed one)


_local = _Local()


def invoke(ext: Any, run: Any, args: Any, around: Any = None) -> None:
    """Runs the function `run` of the module `ext` on `args` now, or, inside together(), at
    its end. around: None, or a function that runs its argument (a function of no arguments:
    the call, or the batch's calls together) as the module's calls must run (the emulated CUDA
    module's abort path and synchronization)."""
    pending = _local.pending
    if pending is not None:
        pending.append((ext, run, args, around))
    elif around is None:
        run(args)
    else:
        around(lambda: run(args))


def collecting() -> bool:
    """Inside together() on this thread: module calls are held until the block ends."""
    return _local.pending is not None


@contextmanager
def together() -> Iterator[None]:
    """The module calls made in the block (on this thread) run as one batch at its end; if the
    block raises, none of them runs."""
    if _local.pending is not None:
        raise RuntimeError("coconetc: together() blocks do not nest")
    _local.pending = []
    try:
        yield
        calls = _local.pending
    finally:
        _local.pending = None
    run_all(calls)


def run_all(calls: list[tuple[Any, Any, Any, Any]]) -> None:
    if not calls:
        return
    names = {(id(ext), ext.__name__, run.__name__) for ext, run, _, _ in calls}
    if len(names) != 1:
        raise ValueError(f"coconetc: the calls of one batch must be of one function of one module "
                         f"(got {', '.join(sorted(m + '.' + n for _, m, n in names))})")
    ext, run, args, around = calls[0]
    if len(calls) == 1:
        def go() -> None:
            run(args)
    else:
        def go() -> None:
            ext._batch(run.__name__, [a for _, _, a, _ in calls])
    if around is None:
        go()
    else:
        around(go)
