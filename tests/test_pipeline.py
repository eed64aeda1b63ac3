"""coconetc.torch.pipeline's bad input and faults, on 2 ranks (its orders: test_pipeline_orders.py;
training in every order against one process: test_train_gpt.py; the docs' script: test_docs.py):
each refusal on every rank before any message between the stages, naming the value, and the
pipeline usable after it; a rank that fails mid-step ends the job, named, instead of leaving
the other waiting for its gradient."""

from __future__ import annotations

from pathlib import Path

import pytest

from coconetc.toolchain import probes
from tests import rank_checks

pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(probes.missing_cpu_extra(), reason="needs the 'cpu' extra")

WORKER = Path(__file__).with_name("pipeline_worker.py")


def test_bad_input_is_refused_on_every_rank(capfd) -> None:
    rc, lines, log = rank_checks.launch(capfd, WORKER, 2, "refusals", timeout=300)
    assert rc == 0, log
    said: dict[str, list[str]] = {}
    for ln in lines:
        name, _, msg = ln.partition(" ")
        said.setdefault(name, []).append(msg)
    assert all(len(said[c]) == 2 and all(m.startswith("ok: ") for m in said[c])
               for c in ("batch", "empty", "loss", "chunks", "target")), log
    assert "does not divide into microbatches=4" in said["batch"][0] and "6 rows" in said["batch"][0], log
    assert "rank 0 refused" in said["batch"][1] and "6 rows" in said["batch"][1], log  # the last stage: told
    assert any("virtual stage 1 (rank 1, chunk 0) has no layers" in m for m in said["empty"]), log
    assert all("needs loss_fn=" in m for m in said["loss"]), log
    assert all("interleaved" in m for m in said["chunks"]), log
    assert any("needs target=" in m for m in said["target"]), log
    assert len(said["step"]) == 2 and float(said["step"][0 if "sent" in said["step"][1] else 1][4:]) > 0, log


def test_a_rank_that_fails_mid_step_ends_the_job(capfd) -> None:
    rc, _, log = rank_checks.launch(capfd, WORKER, 2, "dies", timeout=120)
    assert rc not in (0, 124), log  # ended, and not by the timeout
    assert "ZeroDivisionError" in log and "rank 1" in log, log
