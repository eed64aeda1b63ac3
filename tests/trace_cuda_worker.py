"""A CUDA module's trace under the host emulation, on two ranks, run by tests/test_trace.py as

    mpiexec -n 2 python tests/trace_cuda_worker.py FOLDER

examples/tp_overlap.ccn's row_parallel (its emulated module, as tests/test_cuda_emulate.py builds
it) under `default` (a GEMM, then an all-reduce) and `seq_chunks` (an overlap of 2 chunks), twice
each, inside coconetc.trace(FOLDER). Each rank checks its own file and prints "OK <check>" or
"FAIL <check>: <why>" lines through rank 0 (rank_checks.gathered_report)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

import coconetc
from coconetc.plan.units import title
from coconetc.runtime.cuda import load_emulated
from coconetc.runtime.trace import STREAM_TRACK
from rank_checks import gathered_report, traced_calls

comm = MPI.COMM_WORLD
R, r = comm.Get_size(), comm.Get_rank()
folder = Path(sys.argv[1])
mod = load_emulated(Path(__file__).resolve().parents[1] / "examples" / "tp_overlap.ccn", log=lambda m: None)
B, S, K, H = 2, 4, 8, 6
rng = np.random.default_rng(0)
x = rng.standard_normal((B, S, K)).astype(np.float32)[:, :, r * K // R:(r + 1) * K // R].copy()
w = rng.standard_normal((K, H)).astype(np.float32)[r * K // R:(r + 1) * K // R].copy()
SCHEDULES = ("default", "seq_chunks")


def calls() -> dict[str, np.ndarray]:
    out = {}
    for sched in SCHEDULES:
        for _ in range(2):
            out[sched] = mod.row_parallel(x=x, w=w, schedule=sched)
    return out


untraced = calls()
with coconetc.trace(folder):
    traced = calls()
comm.Barrier()


def units_timed_on_the_streams() -> None:
    for sched in SCHEDULES:
        np.testing.assert_array_equal(traced[sched], untraced[sched])
    doc = json.loads((folder / f"trace.rank{r}.json").read_text())
    assert doc["otherData"]["rank"] == r and doc["otherData"]["dropped_events"] == 0, doc["otherData"]
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    named = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    plans = mod.source_module.plans
    for e, sched, inside in traced_calls(events, "row_parallel", SCHEDULES, plans, {"B": B, "S": S, "K": K, "H": H}, R):
        plan = plans[("row_parallel", sched)]
        units = [u for u in inside if u["cat"] == "unit"]  # (inside the call: the emulated call synchronizes)
        call_stream = {u["tid"] for u in units}
        assert len(call_stream) == 1 and min(call_stream) >= STREAM_TRACK and e["tid"] < STREAM_TRACK, (units, e)
        assert all(t in named for t in {p["tid"] for p in inside}), named
        pieces = [p for p in inside if p["cat"] == "piece"]
        nccl = [p for p in pieces if p["name"] == "NCCL allreduce"]
        if sched == "default":  # the all-reduce unit's NCCL call
            assert [p["args"]["unit"] for p in nccl] == ["allreduce s"], pieces
        else:  # each chunk's GEMM on the call's stream, its all-reduce on the comm stream
            for what, on_call_stream in (("overlap: produce the chunk", True),
                                         ("overlap: communicate the chunk", False)):
                got = [p for p in pieces if p["name"] == what]
                assert sorted(p["args"]["chunk"] for p in got) == [0, 1], (what, pieces)
                assert all((p["tid"] in call_stream) == on_call_stream and p["dur"] > 0 for p in got), (what, got)
            assert len(nccl) == 2 and not {p["tid"] for p in nccl} & call_stream, pieces
            assert all(p["args"]["unit"] == title(plan.units[0]) for p in pieces), pieces


try:
    units_timed_on_the_streams()
    why = ""
except Exception as err:  # noqa: BLE001 (reported through rank 0)
    why = f"rank {r}: {type(err).__name__}: {err}"
gathered_report(comm, "units_timed_on_the_streams", why)
