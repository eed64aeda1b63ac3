"""Calls run as one batch whose reductions span them (coconetc/runtime/batch.py,
runtime_cpp/coconet/batch.h; DistributedOptimizer(across_groups=True)): two calls on parts A
and B of every schedule of adamw.ccn (norm), amax_scale.ccn (max) and scaled_adam.ccn (an
inf/NaN count and returned values) against one call on A ++ B, on 2 and 3 ranks
(tests/batch_worker.py under mpiexec); the same for the CUDA modules under the host emulation
(runtime_cpp/coconet/cuda/batch.cuh: the partial results in device memory). DistributedOptimizer's use of it is checked against
torch in test_torch_optimizer.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from rank_checks import check, launch

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("batch_worker.py")
FILES = ("adamw.ccn", "amax_scale.ccn", "scaled_adam.ccn")


@pytest.fixture(scope="module")
def built(request):
    """The three files built once into the pytest cache (the ranks only import them)."""
    from coconetc.runtime.loader import compile_cpu
    from coconetc.sourcefile import load_file
    mods = {f: load_file(REPO / "examples" / f) for f in FILES}
    for mod in mods.values():
        compile_cpu(mod, log=lambda msg: None)
    yield mods


@pytest.fixture(scope="module")
def built_cuda(request, built):
    """The three files' CUDA modules built for the host emulation (COCONET_CUDA_EMULATE=1 for
    this process and the ranks it starts, while the module's tests run); their schedules."""
    import os

    import coconetc
    from coconetc.runtime.cuda import EMULATE
    saved = os.environ.get(EMULATE)
    os.environ[EMULATE] = "1"
    schedules = {f: set(next(iter(coconetc.load(REPO / "examples" / f, log=lambda msg: None,
                                                 backend="cuda").programs.values())).schedules)
                 for f in FILES}
    yield schedules
    if saved is None:
        os.environ.pop(EMULATE, None)
    else:
        os.environ[EMULATE] = saved


def _labels(built, ranks: int, tag: str = "", schedules=None) -> list[str]:
    labels = []
    for f, mod in built.items():
        for (_, sched), p in mod.variants().items():
            if schedules is not None and sched not in schedules[f]:
                continue
            for name in (f, f + "+nan") if f == "amax_scale.ccn" else (f,):
                labels += [f"{tag}{name}:{sched}:R{ranks}:{t}" for t, _ in p.updates]
                labels += [f"{tag}{name}:{sched}:R{ranks}:return{k}" for k in range(len(p.outputs))]
                if f != "adamw.ccn":
                    labels.append(f"{tag}{name}:{sched}:R{ranks}:skipped")
    return labels


@pytest.mark.parametrize("ranks", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_batch_of_two_parts_computes_one_call_on_both(built, capfd, ranks):
    rc, lines, log = launch(capfd, WORKER, ranks)
    check(lines, log, _labels(built, ranks))
    assert rc == 0, log


@pytest.mark.slow  # (make test runs it; test-quick's batches: the CPU modules' above)
@pytest.mark.parametrize("ranks", [2, 3])
def test_a_batch_of_cuda_calls_computes_one_call_on_both(built, built_cuda, capfd, ranks):
    """The CUDA modules (emulated), every schedule they have: sums and norms (whole, and in a
    fused collective's partial results), max with an inf and with a NaN (the NaN flag combined
    across the calls), the f16 inf/NaN count."""
    rc, lines, log = launch(capfd, WORKER, ranks, "cuda")
    labels = _labels(built, ranks, "cuda:", built_cuda)
    assert len(labels) > 40, labels
    check(lines, log, labels)
    assert rc == 0, log
