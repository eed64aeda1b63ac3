"""A batch of calls (coconetc/runtime/batch.py: the calls of DistributedOptimizer(across_groups=
True)) against one call on the concatenation, run by tests/test_batch.py as

    mpiexec -n R python tests/batch_worker.py [cuda]

(cuda: the CUDA modules under the host emulation, COCONET_CUDA_EMULATE=1, set by the test,
every schedule they have; the labels start with "cuda:").

For a program whose tensors are all [N] and whose reductions are over all of N, two calls on
parts A and B run as one batch compute what one call on A ++ B computes: each reduction (sum,
norm, max, min) is taken over both. Every schedule of examples/adamw.ccn (norm),
examples/amax_scale.ccn (max) and examples/scaled_adam.ccn (an inf/NaN count, returned values),
with an inf in B's gradient for the last two, and a NaN for amax_scale.ccn+nan (both parts must
skip: the max is NaN over both). Rank 0 prints
"OK <label> <max |difference|>" or "FAIL <label>: ..." for every updated tensor and return."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

import coconetc
from coconetc.jobs.abort import stop_job_on_failure
from coconetc.plan.label import parse
from coconetc.runtime import batch

EX = Path(__file__).resolve().parents[1] / "examples"
comm = MPI.COMM_WORLD
rank, R = comm.Get_rank(), comm.Get_size()
SCALARS = dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.1, step=3.0, maxnorm=0.5,
               beta=0.9, clip=0.7, scale=2.0)
SIZES = (1001, 523)
failures: list[str] = []


def fulls(p, n: int, seed: int, inf: float | None) -> dict[str, np.ndarray]:
    """Every tensor parameter's whole value (a gradient: this rank's own; inf: a value, inf or
    NaN, put in the last rank's)."""
    out = {}
    for q in p.params:
        if q.scalar:
            continue
        rng = np.random.default_rng(seed + (1000 * rank if q.name == "g" else 0))
        if q.name == "g":
            x = rng.standard_normal(n) * 0.1
            if inf is not None and rank == R - 1:
                x[n // 2] = inf
        elif q.name.startswith("w"):
            x = rng.uniform(0.5, 1.5, n)
        elif q.name == "v":
            x = rng.uniform(0.0, 0.01, n)
        else:
            x = rng.standard_normal(n) * 0.01
        out[q.name] = x
    return out


def run(fn, layout, schedule: str, parts: list[dict[str, np.ndarray]], together: bool) -> list:
    """Calls fn on each part (this rank's slices of it, as the CPU module `layout` lays them
    out); the updated tensors whole, the returns."""
    p = fn.program_of(parse(schedule))
    calls = []
    for full in parts:
        n = len(full["g"])
        args = {}
        for q in p.params:
            if q.scalar:
                args[q.name] = SCALARS[q.name]
                continue
            local = full[q.name][layout.local_index(q.name, schedule=schedule, N=n)]
            args[q.name] = np.ascontiguousarray(local.astype(layout.zeros(q.name, schedule=schedule, N=n).dtype))
        calls.append(args)
    with batch.together() if together else contextlib.nullcontext():
        outs = [fn(schedule=schedule, **args) for args in calls]
    result = []
    for full, args, out in zip(parts, calls, outs):
        n = len(full["g"])
        got = {}
        for t, _ in p.updates:
            whole = np.zeros(n)
            for idx, x in comm.allgather((layout.local_index(t, schedule=schedule, N=n), args[t])):
                whole[idx] = x
            got[t] = whole
        rets = out if isinstance(out, tuple) else (out,) if out is not None else ()
        result.append((got, [float(np.asarray(r)) for r in rets]))
    return result


def check(label: str, a: np.ndarray, b: np.ndarray, tol: float) -> None:
    d = float(np.max(np.abs(a - b))) if a.size else 0.0
    same_nan = bool(np.array_equal(np.isnan(a), np.isnan(b)))
    if d <= tol and same_nan:
        if rank == 0:
            print(f"OK {label} {d:.3g}", flush=True)
    else:
        failures.append(label)
        if rank == 0:
            print(f"FAIL {label}: max |difference| {d:.3g} > {tol:.3g}", flush=True)


def main(comm) -> int:
    backend = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    tag = "cuda:" if backend == "cuda" else ""
    for name, inf in (("adamw.ccn", None), ("amax_scale.ccn", np.inf), ("amax_scale.ccn+nan", np.nan),
                      ("scaled_adam.ccn", np.inf)):
        file = name.split("+")[0]
        layout = next(iter(coconetc.load(EX / file, log=lambda m: None).programs.values()))
        fn = next(iter(coconetc.load(EX / file, log=lambda m: None, backend=backend).programs.values()))
        for schedule in sorted(fn.schedules):
            p = fn.program_of(parse(schedule))
            a, b = fulls(p, SIZES[0], 1, None), fulls(p, SIZES[1], 2, inf)
            both = {k: np.concatenate([a[k], b[k]]) for k in a}
            parts = run(fn, layout, schedule, [a, b], together=True)
            (whole, rets), = run(fn, layout, schedule, [both], together=False)
            tol = 2e-3 if file == "scaled_adam.ccn" else 1e-6  # f16 copies: one rounding apart at most
            for t in whole:
                got = np.concatenate([parts[0][0][t], parts[1][0][t]])
                check(f"{tag}{name}:{schedule}:R{R}:{t}", got, whole[t], tol)
            for k, r in enumerate(rets):
                check(f"{tag}{name}:{schedule}:R{R}:return{k}", np.array([parts[0][1][k], parts[1][1][k]]),
                      np.array([r, r]), 1e-6)
            if inf is not None:  # the inf (NaN) in B's gradient skipped A's step too: A's weights kept their values
                check(f"{tag}{name}:{schedule}:R{R}:skipped", parts[0][0]["w"], a["w"].astype(np.float32), 0.0)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(stop_job_on_failure(main, "batch_worker"))
