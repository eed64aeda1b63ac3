"""Traces (coconetc.trace, COCONET_TRACE; coconetc/runtime/trace.py, runtime_cpp/coconet/trace.h):
a Chrome-trace/Perfetto file per rank whose units are the plan's, in its order, with the cost
model's bytes and flops; each chunk of an overlap; the ranks' files merged; a limit on events
and an unwritable folder each giving one warning while the calls still run; tracing leaves the
results as they are; a CUDA module's units and pieces timed by CUDA events on its streams (under
the host emulation)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from coconetc.cli import main
from rank_checks import check, launch

WORKER = Path(__file__).with_name("trace_worker.py")
CUDA_WORKER = Path(__file__).with_name("trace_cuda_worker.py")
REPO = Path(__file__).resolve().parents[1]


def test_a_trace_holds_the_plans_units_and_the_overlaps_chunks(capfd, tmp_path):
    rc, lines, log = launch(capfd, WORKER, 2, str(tmp_path))
    assert rc == 0, log
    check(lines, log, ["same_results", "units_as_planned", "limited", "unwritable"])
    res = CliRunner().invoke(main, ["trace-merge", str(tmp_path / "full")])
    assert res.exit_code == 0, res.output
    merged = json.loads((tmp_path / "full" / "trace.json").read_text())
    assert {e["pid"] for e in merged["traceEvents"]} == {0, 1}
    assert merged["otherData"] == {"ranks": [0, 1], "dropped_events": 0}
    res = CliRunner().invoke(main, ["trace-merge", str(tmp_path)])  # no rank files there
    assert res.exit_code != 0 and "no trace.rank<r>.json" in res.output


def test_an_emulated_cuda_modules_units_are_timed_on_its_streams(capfd, tmp_path):
    """The emulated CUDA module of tp_overlap.ccn (built once, before the ranks start) traced on
    2 ranks: its units as planned, with the model's figures and positive times from the CUDA
    events on the call's stream; the NCCL calls and the overlap's chunks as pieces on their
    streams (tests/trace_cuda_worker.py)."""
    from coconetc import toolchain
    from coconetc.sourcefile import load_file
    from coconetc.toolchain import probes
    if (why := probes.emulation_missing()) is not None:
        pytest.skip(why)
    toolchain.compile(load_file(REPO / "examples" / "tp_overlap.ccn"), "cuda-emulated",
                      toolchain.Options(log=lambda msg: None))
    rc, lines, log = launch(capfd, CUDA_WORKER, 2, str(tmp_path))
    assert rc == 0, log
    check(lines, log, ["units_timed_on_the_streams"])


ONE = """
import numpy as np, coconetc
mod = coconetc.load("sgd.ccn", log=lambda m: None)  # (the example that ships: none is here)
w = np.ones(6, np.float32)
mod.sgd(g=np.arange(6, dtype=np.float32), w=w, lr=np.float32(0.5))
print(w.tolist())
"""


def test_coconet_trace_in_the_environment_traces_the_process(tmp_path):
    """COCONET_TRACE=FOLDER: the process's calls traced, its file written when it exits."""
    env = {**os.environ, "COCONET_TRACE": str(tmp_path / "t")}
    res = subprocess.run([sys.executable, "-c", ONE], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout.splitlines()[-1]) == [1.0, 0.5, 0.0, -0.5, -1.0, -1.5]
    doc = json.loads((tmp_path / "t" / "trace.rank0.json").read_text())
    names = [e["name"] for e in doc["traceEvents"] if e["ph"] == "X"]
    assert names[0].endswith(".sgd[default]") and len(names) > 1, names


def test_a_process_that_made_no_call_leaves_the_ranks_files(tmp_path):
    """COCONET_TRACE's write at exit: a process that traced no call (a bench script's launcher,
    which relaunches itself under mpiexec and exits after its ranks) writes no file, so rank 0's
    stays as rank 0 wrote it; one that traced a call writes its own."""
    from coconetc.runtime import trace as tr
    kept = tmp_path / tr.FILE.format(rank=0)
    kept.write_text("rank 0's")
    idle = tr.Session(tmp_path, 10)
    assert tr._write_at_exit(idle) is None and kept.read_text() == "rank 0's"
    idle.add({"name": "a call", "ph": "X"})
    assert tr._write_at_exit(idle) == kept and json.loads(kept.read_text())["traceEvents"][-1]["name"] == "a call"


def test_explain_measure_prints_each_unit_measured_against_the_model(tmp_path):
    """`coconetc explain --measure`: the schedule run traced on the ranks; a row per unit of the
    plan with its measured, predicted and bound times, and the model's error for the call."""
    from coconetc.plan.units import title
    from coconetc.sourcefile import load_file
    sgd = REPO / "examples" / "sgd.ccn"
    res = CliRunner().invoke(main, ["explain", str(sgd), "-s", "fused", "--measure", "--size", "N=4099", "-n", "2",
                                    "--reps", "3", "--format", "json", "--value", "lr=0.25"])
    assert res.exit_code == 0, res.output
    m = json.loads(res.stdout)  # (JSON alone: the ranks print nothing of their own; the build speaks on stderr)
    plan = load_file(sgd).plans[("sgd", "fused")]
    assert [r["unit"] for r in m["units"]] == [title(u) for u in plan.units]
    assert m["calls"] == 2 and all(r["measured_s"] > 0 for r in m["units"]), m
    assert m["predicted_over_measured"] == m["predicted_s"] / m["measured_s"]
    for args, said in ((["-s", "fused"], "give every size (--size N=INT)"),
                       (["--size", "N=8"], "give -s SCHEDULE"),
                       (["-s", "nope", "--size", "N=8"], "no schedule 'nope'"),
                       (["-s", "fused", "--size", "N=8", "--value", "x=1"],
                        "sgd has no scalar parameter 'x' (its scalar parameters: lr)"),
                       (["-s", "fused", "--size", "N=8", "--value", "lr=fast"], "'lr' must be a number (f32), got 'fast'"),
                       (["-s", "fused", "--size", "N=8", "--value", "lr"], "--value takes NAME=NUMBER")):
        res = CliRunner().invoke(main, ["explain", str(sgd), "--measure", *args])
        assert res.exit_code != 0 and said in res.output, res.output
    res = CliRunner().invoke(main, ["explain", str(sgd), "--value", "lr=0.25"])
    assert res.exit_code != 0 and "--value goes with --measure" in res.output, res.output
    # what the ranks do with a --value: the scalar as given, every other input as drawn without it
    from coconetc.jobs.run import given_values
    from coconetc.oracle.inputs import random_inputs
    p = load_file(REPO / "examples" / "residual_dropout.ccn").programs["f1"]
    given = given_values(p, ["seed=3"])
    assert given == {"seed": 3} and type(given["seed"]) is int
    drawn, fixed = (random_inputs(p, 2, sizes={"B": 2, "S": 3, "H": 4}, seed=1, typical=True, values=v)
                    for v in (None, given))
    for a, b in zip(drawn, fixed):
        assert b["seed"] == 3 and a["seed"] != 3
        assert all(np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k]
                   for k in a if k not in given)


def test_explain_measure_gives_what_runs_as_one_a_row():
    """Units the CPU runs as one (an attention core's members, a GEMM and its epilogue loop, a
    layernorm_dx and the weight and bias gradients it computes) are
    one row of explain --measure: the time the trace gives their last mark (the others are
    empty), against the sum of their predictions; a reshape held in its source's memory is
    predicted free. A made-up trace of gpt_block's plan: each unit's mark 1 us + its index."""
    from coconetc.plan.cost import cost
    from coconetc.plan.units import Library, title
    from coconetc.sourcefile import load_file
    from coconetc.tune import explain as ex
    mod = load_file(REPO / "examples" / "gpt_block.ccn")
    plan = mod.plans[("gpt_block", "default")]
    sizes = {"B": 2, "S": 16, "H": 32, "NH": 2, "HD": 16, "F": 128}
    n = len(plan.units)
    events = [{"ph": "X", "cat": "call", "ts": 0.0, "dur": 1e6}] + \
        [{"ph": "X", "cat": "unit", "ts": 1.0 + i, "dur": 1.0 + i, "args": {"unit_index": i}} for i in range(n)]
    m = ex.measured_units(mod, "gpt_block", "default", 1, sizes, [{"traceEvents": events}])
    rows = {r["unit"]: r for r in m["units"]}
    assert sorted(k for r in m["units"] for k in r["units"]) == list(range(n))  # each unit in one row
    (att,) = plan.attention
    call = rows[f"attention forward call (units {att.members[0]}-{att.members[-1]})"]
    parts = cost(plan, sizes, 1).parts
    assert call["units"] == list(att.members) and len(att.members) > 2
    assert call["measured_s"] == pytest.approx(sum(1e-6 * (1 + k) for k in att.members))
    assert call["predicted_s"] == pytest.approx(sum(parts[k][1].seconds() for k in att.members))
    gemm = next(i for i, u in enumerate(plan.units) if title(u) == "matmul hm")
    assert plan.units[gemm].epilogue is not None and "cpu" in plan.units[gemm].fused
    fused = rows["matmul hm + epilogue loop: h"]
    assert fused["units"] == [gemm, gemm + 1] and fused["measured_s"] == pytest.approx(1e-6 * (2 * gemm + 3))
    views = [i for i, u in enumerate(plan.units) if isinstance(u, Library) and u.op == "reshape"]
    assert views and all(parts[i][1].seconds() == 0 for i in views)
    # a layernorm_dx and the dgamma and dbeta it computes (plan/lngrads.py): one row, with its epilogue
    from coconetc.sourcefile import with_grads
    grad = with_grads(mod, ["gpt_block"])
    plan = grad.plans[("gpt_block_grad", "default")]
    events = [{"ph": "X", "cat": "call", "ts": 0.0, "dur": 1e6}] + \
        [{"ph": "X", "cat": "unit", "ts": 1.0 + i, "dur": 1.0, "args": {"unit_index": i}} for i in range(len(plan.units))]
    rows = {r["unit"]: r for r in ex.measured_units(grad, "gpt_block_grad", "default", 1, sizes, [{"traceEvents": events}])["units"]}
    dx = next(i for i, u in enumerate(plan.units) if isinstance(u, Library) and u.dst == "t0_g_x1")
    row = rows["layernorm_dx t0_g_x1 + epilogue loop: g_x1 + layernorm_dgamma d_ln2_w + sum_lead d_ln2_b"]
    assert row["units"][:2] == [dx, dx + 1] and len(row["units"]) == 4 and row["measured_s"] == pytest.approx(4e-6)
