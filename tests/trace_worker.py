"""Traces on two ranks, run by tests/test_trace.py as

    mpiexec -n 2 python tests/trace_worker.py FOLDER

examples/tp_mlp.ccn's tp_mlp under `default` and `overlapped`, twice each, inside
coconetc.trace(FOLDER/full); then with max_events=4 (FOLDER/small); then into a folder that
cannot be written. Each rank checks its own file and prints "OK <check>" or "FAIL <check>:
<why>" lines through rank 0 (rank_checks.gathered_report)."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import numpy as np
from mpi4py import MPI

import coconetc
from rank_checks import gathered_report, traced_calls

comm = MPI.COMM_WORLD
R, r = comm.Get_size(), comm.Get_rank()
folder = Path(sys.argv[1])
mod = coconetc.load(Path(__file__).resolve().parents[1] / "examples" / "tp_mlp.ccn", log=lambda m: None)
B, S, H, F = 2, 8, 16, 32
rng = np.random.default_rng(0)
x = rng.standard_normal((B, S, H)).astype(np.float32)
w1 = rng.standard_normal((H, F)).astype(np.float32)[:, r * F // R:(r + 1) * F // R].copy()
b1 = rng.standard_normal(F).astype(np.float32)[r * F // R:(r + 1) * F // R].copy()
w2 = rng.standard_normal((F, H)).astype(np.float32)[r * F // R:(r + 1) * F // R].copy()
b2 = rng.standard_normal(H).astype(np.float32)
SCHEDULES = ("default", "overlapped")


def calls() -> dict[str, np.ndarray]:
    out = {}
    for sched in SCHEDULES:
        for _ in range(2):
            out[sched] = mod.tp_mlp(x=x, w1=w1, b1=b1, w2=w2, b2=b2, schedule=sched)
    return out


def report(label: str, check) -> None:
    try:
        check()
        why = ""
    except Exception as err:  # noqa: BLE001 (reported through rank 0)
        why = f"rank {r}: {type(err).__name__}: {err}"
    gathered_report(comm, label, why)


untraced = calls()
with coconetc.trace(folder / "full") as session:
    traced = calls()
comm.Barrier()


def same_results() -> None:
    for sched in SCHEDULES:
        np.testing.assert_array_equal(traced[sched], untraced[sched])


def units_as_planned() -> None:
    doc = json.loads((folder / "full" / f"trace.rank{r}.json").read_text())
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert doc["otherData"]["rank"] == r and doc["otherData"]["dropped_events"] == 0, doc["otherData"]
    assert all(e["pid"] == r for e in doc["traceEvents"])
    for _, sched, inside in traced_calls(events, "tp_mlp", SCHEDULES, mod.source_module.plans,
                                         {"B": B, "S": S, "H": H, "F": F}, R):
        pieces = [p for p in inside if p["cat"] == "piece"]
        if sched == "overlapped":  # overlap(p, s, chunks=2): each chunk produced and started; a wait
            for what in ("overlap: produce the chunk", "overlap: start the chunk's communication"):  # for one
                assert sorted(p["args"]["chunk"] for p in pieces if p["name"] == what) == [0, 1], (what, pieces)
            waits = [p["args"]["chunk"] for p in pieces if p["name"] == "overlap: wait for the chunk's communication"]
            assert set(waits) <= {0, 1} and len(set(waits)) == len(waits), pieces  # not done while testing
            assert all(p["args"]["unit"].startswith("overlap p -> s") for p in pieces), pieces
        else:
            assert not [p for p in pieces if p["name"].startswith("overlap")], pieces


def limited() -> None:
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with coconetc.trace(folder / "small", max_events=4) as s:
            calls()
    doc = json.loads((folder / "small" / f"trace.rank{r}.json").read_text())
    kept = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(kept) == 4 and len(s.events) == 4, kept
    assert doc["otherData"]["dropped_events"] > 0, doc["otherData"]
    assert len([w for w in said if "limit of 4 events" in str(w.message)]) == 1, [str(w.message) for w in said]


def unwritable() -> None:
    blocked = folder / f"a_file_{r}"
    blocked.write_text("")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with coconetc.trace(blocked / "sub"):
            got = calls()
    assert [str(w.message) for w in said if "coconetc.trace" in str(w.message)] and len(said) == 1, \
        [str(w.message) for w in said]
    for sched in SCHEDULES:
        np.testing.assert_array_equal(got[sched], untraced[sched])


report("same_results", same_results)
report("units_as_planned", units_as_planned)
report("limited", limited)
report("unwritable", unwritable)
