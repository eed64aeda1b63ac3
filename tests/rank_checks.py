"""What the tests that run a worker script on R MPI ranks share: the launch (on the pool of R
ranks, tests/rank_pool.py), the worker's report lines ("OK <label> ..." / "FAIL <label>: <why>",
printed by rank 0), and several `coconetc run` jobs in one launch (run_jobs). Every module is
built into the session's build cache (conftest.py), so the ranks only import what a fixture
built."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from coconetc.launch.mpiexec import run_python

import rank_pool


def shared_file(request, folder: str, name: str, text: str) -> Path:
    """TEXT at one path for every pytest worker (pytest's cache folder FOLDER, file NAME): a module
    is named and cached by its file, so every test and every rank loading it builds it once.
    Written atomically, and only when it differs (another worker may be writing the same text)."""
    f = request.config.cache.mkdir(folder) / name
    if not f.exists() or f.read_text() != text:
        tmp = f.with_name(f"{f.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, f)
    return f


def launch(capfd, worker: Path, ranks: int, *args: str, timeout: float = 500,
           env: dict[str, str] | None = None) -> tuple[int, list[str], str]:
    """Run `python WORKER ARGS` on R ranks: (exit code, stdout lines, a log for assertion
    messages). On the process's pool of R ranks (tests/rank_pool.py); with ENV (added to the
    ranks' environment before they start) on ranks of its own."""
    if env is None:
        rc, out, err = rank_pool.run(ranks, [str(worker), *args], timeout)
    else:
        rc = run_python(ranks, [str(worker), *args], timeout=timeout, env=env)
        out, err = capfd.readouterr()
    return rc, out.splitlines(), f"--- stdout\n{out}\n--- stderr\n{err[-4000:]}"


def ranks_run(ranks: int, argv: list[str], timeout: float = 600,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python ARGV` on R ranks, answered as subprocess.run(capture_output=True, text=True)
    answers: on the process's pool of R ranks, or with ENV (added to the environment the ranks
    start in: the runtime reads some variables once) on ranks of its own."""
    args = [str(a) for a in argv]
    if not env:
        return rank_pool.completed(ranks, args, timeout)
    rc, out, err = rank_pool.fresh(ranks, args, timeout, env)
    return subprocess.CompletedProcess([sys.executable, *args], rc, out, err)


RUN_JOBS = Path(__file__).with_name("run_jobs_worker.py")


def run_jobs(ranks: int, jobs: Sequence[Sequence[str]], env: dict[str, str] | None = None,
             timeout: float | None = None) -> str:
    """JOBS (each the arguments of `python -m coconetc.jobs.run`: FILE --program P --schedule S...,
    what `coconetc run` starts on its ranks) one after the other in one launch on RANKS ranks
    (tests/run_jobs_worker.py), ENV added to the environment; the output (asserted exit code 0).
    Its result lines are `coconetc run`'s: "<program> [<schedule>]: R ranks: ...: <status>".
    The ranks build a module not built yet (one of them; the others wait for it): TIMEOUT
    (default 600 s a job, as the tests gave each `coconetc run`) covers that."""
    argv = [str(RUN_JOBS)]
    for job in jobs:
        argv += [*job, "--"]
    res = ranks_run(ranks, argv, timeout or 600 * len(jobs), env)
    rc, out, err = res.returncode, res.stdout, res.stderr
    assert rc == 0, out + err
    return out + err


def check(lines: list[str], log: str, labels: list[str], prefix: bool = False) -> None:
    """No FAIL line, and an OK line for every label (or for a label starting with it)."""
    assert not [ln for ln in lines if ln.startswith("FAIL")], log
    ok = [ln.split()[1] for ln in lines if ln.startswith("OK ")]
    for label in labels:
        found = any(k.startswith(label) for k in ok) if prefix else label in ok
        assert found, f"{label} missing\n{log}"


def gathered_report(comm, label: str, why: str) -> bool:
    """In a worker: every rank's reason for failing `label` ("" for none) gathered on rank 0,
    which prints "OK <label>" or "FAIL <label>: <each reason>"; True on rank 0 if any failed."""
    whys = comm.gather(why, root=0)
    if comm.Get_rank() != 0:
        return False
    errs = [x for x in whys if x]
    print(f"FAIL {label}: {' | '.join(errs)}" if errs else f"OK {label}", flush=True)
    return bool(errs)


def traced_calls(events: list[dict], program: str, schedules: Sequence[str], plans, sizes: dict[str, int],
                 ranks: int) -> list[tuple[dict, str, list[dict]]]:
    """In a trace worker: the trace's complete events (EVENTS) hold a call of PROGRAM under each
    of SCHEDULES twice, in order, and each call's unit events are its plan's units (PLANS:
    (program, schedule) -> Plan) by name, with the cost model's flops and bytes at SIZES on
    RANKS ranks, positive durations, inside the call. Returns each call: (its event, its
    schedule, the other events inside it)."""
    from coconetc.plan.cost import cost
    from coconetc.plan.units import title
    made = [e for e in events if e["cat"] == "call"]
    assert [e["name"].split(".")[-1] for e in made] == [f"{program}[{s}]" for s in schedules for _ in range(2)], made
    out = []
    for e in made:
        sched = e["name"].split("[")[1][:-1]
        plan = plans[(program, sched)]
        inside = [u for u in events if u["cat"] != "call" and e["ts"] <= u["ts"] <= e["ts"] + e["dur"]]
        units = [u for u in inside if u["cat"] == "unit"]
        assert [u["name"] for u in units] == [title(u) for u in plan.units], (sched, units)
        for u, (_, c) in zip(units, cost(plan, sizes, ranks).parts):
            assert u["args"]["flops"] == c.flops and u["args"]["bytes_moved"] == c.moved, (u, c)
            assert u["args"]["predicted_us"] > 0 and u["dur"] > 0, u
            assert u["ts"] + u["dur"] <= e["ts"] + e["dur"] + 1, (u, e)
        out.append((e, sched, inside))
    return out


def symmetric_window_bytes(staged: int, most: int, out: int) -> int:
    """The emulated symmetric kernel's window as COCONET_CUDA_FUSED_TRACE prints it (symmetric.cuh,
    fused_symmetric): the 256-byte head and STAGED bytes of room to stage the input, rounded up to
    256, then the largest slice, MOST elements of OUT bytes, in whole 4096-byte units (the
    emulated NCCL_WIN_REQUIRED_ALIGNMENT)."""
    return -(-((256 + staged + 255) // 256 * 256 + most * out) // 4096) * 4096


def rank_parts(inputs: dict, ranks: int, sliced: dict[str, int]) -> list[dict]:
    """Each rank's arguments for the interpreter: the slices (the language's partition rule)
    of the parameters sliced along the dim `sliced` names, the rest whole."""
    import numpy as np

    from coconetc.ir.slices import slice_range
    per_rank = []
    for r in range(ranks):
        mine = {}
        for k, v in inputs.items():
            if k in sliced:
                lo, hi = slice_range(v.shape[sliced[k]], ranks, r)
                v = np.take(v, np.arange(lo, hi), axis=sliced[k])
            mine[k] = v.copy() if isinstance(v, np.ndarray) else v
        per_rank.append(mine)
    return per_rank


def joined(results: list, out: str, dim: int | None):
    """Output `out` of every rank's interpreter result, whole: concatenated along `dim`, or
    (a replicated result, dim None) checked the same on every rank."""
    import numpy as np
    parts = [r.outputs[out] for r in results]
    if dim is None:
        for q in parts[1:]:
            np.testing.assert_array_equal(q, parts[0])
        return parts[0]
    return np.concatenate(parts, axis=dim)
