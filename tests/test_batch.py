"""Calls run as one batch whose reductions span them (coconetc/runtime/batch.py,
runtime_cpp/coconet/batch.h; DistributedOptimizer(across_groups=True)): two calls on parts A
and B of every schedule of adamw.ccn (norm), amax_scale.ccn (max) and scaled_adam.ccn (an
inf/NaN count and returned values) against one call on A ++ B, on 2 and 3 ranks
(tests/batch_worker.py under mpiexec). DistributedOptimizer's use of it is checked against
torch in test_torch_optimizer.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from rank_checks import build_cache, check, launch

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("batch_worker.py")
FILES = ("adamw.ccn", "amax_scale.ccn", "scaled_adam.ccn")


@pytest.fixture(scope="module")
def built(request):
    """The three files built once into the pytest cache (the ranks only import them)."""
    from coconetc.runtime.loader import compile_cpu
    from coconetc.sourcefile import load_file
    with build_cache(request):
        mods = {f: load_file(REPO / "examples" / f) for f in FILES}
        for mod in mods.values():
            compile_cpu(mod, log=lambda msg: None)
        yield mods


@pytest.mark.parametrize("ranks", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_batch_of_two_parts_computes_one_call_on_both(built, capfd, ranks):
    rc, lines, log = launch(capfd, WORKER, ranks)
    labels = []
    for f, mod in built.items():
        for (_, sched), p in mod.variants().items():
            labels += [f"{f}:{sched}:R{ranks}:{t}" for t, _ in p.updates]
            labels += [f"{f}:{sched}:R{ranks}:return{k}" for k in range(len(p.outputs))]
            if f != "adamw.ccn":
                labels.append(f"{f}:{sched}:R{ranks}:skipped")
    check(lines, log, labels)
    assert rc == 0, log
