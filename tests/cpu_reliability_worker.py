"""Call-time reliability of a compiled module on several ranks, run by
tests/test_call_reliability.py as

    mpiexec -n R python tests/cpu_reliability_worker.py MODE FILE...

MODE calls  (2 ranks, adam.ccn): wrong calls that used to hang or give silent wrong results
            (scalars, schedules or groups that differ between ranks, aliased buffers, PyTorch
            tensors that require grad) raise on every rank, naming what differs, and leave every
            buffer as it was; a call under torch.no_grad() works and bumps version counters.
            Rank 0 prints "OK <check>" or "FAIL <check>: <why>" per check.
MODE comm   (3 ranks, any files): every program and schedule on ranks {0, 1} of a split
            communicator (rank 2 meanwhile calls nothing) and on a duplicate of COMM_WORLD,
            against the interpreter. Prints "OK comm <label>" per (file, program, schedule,
            communicator).
MODE crash  (2 ranks): rank 1 raises an uncaught exception while rank 0 waits in a call: the
            exception hook that `import coconetc` installs must abort the job.
MODE crash_torch  (2 ranks): the same after torch.distributed.init_process_group (gloo), whose
            own exception hook prints the traceback only after the hooks it wraps return.
MODE stall  (2 ranks): rank 1 never arrives at the second call: the watchdog (COCONET_TIMEOUT)
            must abort the job and name rank 1."""

from __future__ import annotations

import copy
import sys
import time
import traceback

import numpy as np

N = 13


def _inputs(rank: int, size: int, schedule: str) -> dict:
    from coconetc.ir.slices import slice_range
    rng = np.random.default_rng(1234)
    full = {k: rng.uniform(0.5, 1.5, N).astype(np.float32) for k in ("w", "m", "v")}
    g = np.random.default_rng(rank).uniform(0.5, 1.5, N).astype(np.float32)
    args = dict(g=g, **full, lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, step=3.0)
    if schedule == "zero":
        lo, hi = slice_range(N, size, rank)
        args["m"] = np.ascontiguousarray(full["m"][lo:hi])
        args["v"] = np.ascontiguousarray(full["v"][lo:hi])
    return args


def _arrays(args: dict) -> dict:
    out = {}
    for k, v in args.items():
        if isinstance(v, np.ndarray):
            out[k] = v.copy()
        elif type(v).__module__.startswith("torch"):
            out[k] = v.detach().numpy().copy()
    return out


def _expect(call, rank, args, want_type, needles, schedule="zero", groups=1) -> str | None:
    """None if call(...) raised want_type naming every needle and left every buffer as it was."""
    before = _arrays(args)
    try:
        call(schedule=schedule, groups=groups, **args)
    except Exception as err:  # noqa: BLE001 - we check what it is
        msg = f"{type(err).__name__}: {err}"
        if type(err) is not want_type:
            return f"rank {rank} raised {msg}, expected {want_type.__name__}"
        missing = [n for n in needles if n not in str(err)]
        if missing:
            return f"rank {rank}: {msg!r} does not mention {missing}"
    else:
        return f"rank {rank} did not raise (expected {want_type.__name__})"
    after = _arrays(args)
    changed = [k for k in before if not np.array_equal(before[k], after[k], equal_nan=True)]
    return f"rank {rank}: {changed} modified by a call that failed" if changed else None


# --- MODE calls ------------------------------------------------------------------------------
def check_scalar_differs(fn, rank, size, comm):
    args = _inputs(rank, size, "zero")
    args["lr"] = 0.01 if rank == 0 else 0.02
    return _expect(fn, rank, args, ValueError, ["'lr'", "rank 0", "rank 1", "0.02"])


def check_scalar_differs_in_last_bit(fn, rank, size, comm):
    args = _inputs(rank, size, "zero")
    args["eps"] = float(np.nextafter(np.float32(1e-8), np.float32(1))) if rank == 1 else 1e-8
    return _expect(fn, rank, args, ValueError, ["'eps'", "rank 1"])


def check_schedule_differs(fn, rank, size, comm):
    sched = "zero" if rank == 0 else "fused"
    return _expect(fn, rank, _inputs(rank, size, sched), ValueError, ["schedule", "'zero'", "'fused'"],
                   schedule=sched)


def check_groups_differ(fn, rank, size, comm):
    return _expect(fn, rank, _inputs(rank, size, "default"), ValueError, ["groups", "rank 1"],
                   schedule="default", groups=1 + rank)


def check_same_buffer_twice(fn, rank, size, comm):
    args = _inputs(rank, size, "default")
    args["v"] = args["m"]
    return _expect(fn, rank, args, ValueError, ["'m'", "'v'", "overlap"], schedule="default")


def check_view_of_another(fn, rank, size, comm):
    args = _inputs(rank, size, "default")
    args["v"] = args["w"].view()
    return _expect(fn, rank, args, ValueError, ["'w'", "'v'", "overlap"], schedule="default")


def check_alias_on_rank1_only(fn, rank, size, comm):
    args = _inputs(rank, size, "zero")
    if rank == 1:
        buf = np.ones(2 * N, np.float32)
        args["w"], args["g"] = buf[:N], buf[N - 1:2 * N - 1]  # overlap by one element
        return _expect(fn, rank, args, ValueError, ["'g'", "'w'", "overlap"])
    return _expect(fn, rank, args, ValueError, ["rank 1", "overlap"])


def check_torch_views_alias(fn, rank, size, comm):
    import torch
    args = _inputs(rank, size, "default")
    t = torch.from_numpy(np.concatenate([args["m"], args["v"]]))
    args["m"], args["v"] = t[:N], t[N - 3:2 * N - 3]
    return _expect(fn, rank, args, ValueError, ["'m'", "'v'"], schedule="default")


def check_leaf_requires_grad(fn, rank, size, comm):
    import torch
    args = _inputs(rank, size, "zero")
    args["w"] = torch.from_numpy(args["w"]).requires_grad_()
    return _expect(fn, rank, args, RuntimeError, ["'w'", "leaf Variable", "requires grad",
                                                   "in-place", "no_grad"])


def check_no_grad_updates_and_bumps_version(fn, rank, size, comm):
    import torch

    from coconetc.interp.interpreter import Result, run
    from coconetc.oracle.compare import compare
    args = _inputs(rank, size, "zero")
    everyone = comm.allgather(copy.deepcopy(args))
    w = torch.from_numpy(args["w"]).requires_grad_()
    m = torch.from_numpy(args["m"])
    versions = (w._version, m._version)
    loss = (w * w).sum()  # saves w for backward: a stale w must be detected
    with torch.no_grad():
        fn(schedule="zero", **{**args, "w": w, "m": m})
    if not (w._version > versions[0] and m._version > versions[1]):
        return f"rank {rank}: versions {versions} -> {(w._version, m._version)}: not bumped"
    try:
        loss.backward()
    except RuntimeError as err:
        if "modified by an inplace operation" not in str(err):
            return f"rank {rank}: backward raised {err}"
    else:
        return f"rank {rank}: backward used the stale w without noticing"
    got = Result({}, {"w": w.detach().numpy().copy(), "m": m.numpy().copy(), "v": args["v"]}, None)
    gathered = comm.gather(got, root=0)
    problems = []
    if rank == 0:
        ir = fn._program("zero")
        problems = compare(run(ir, everyone), gathered, ir, ir)
    problems = comm.bcast(problems, root=0)
    return "; ".join(problems[:3]) or None


def check_still_in_step(fn, rank, size, comm):
    from coconetc.interp.interpreter import Result, run
    from coconetc.oracle.compare import compare
    problems = []
    for sched in ("zero", "default", "fused"):
        mine = _inputs(rank, size, sched)
        everyone = comm.allgather(copy.deepcopy(mine))
        fn(schedule=sched, **mine)
        gathered = comm.gather(Result({}, {t: mine[t] for t in ("w", "m", "v")}, None), root=0)
        if rank == 0:
            ir = fn._program(sched)
            problems += [f"[{sched}] {p}" for p in compare(run(ir, everyone), gathered, ir, ir)]
    problems = comm.bcast(problems, root=0)
    return "; ".join(problems[:5]) or None


def check_repeated_call_scalar_differs(fn, rank, size, comm):
    """Calls with the same buffers agree in one small round (the hot path); a scalar that then
    differs on one rank still raises on every rank, naming it, and leaves every buffer alone;
    the next good call with those buffers runs."""
    args = _inputs(rank, size, "zero")
    for _ in range(3):
        fn(schedule="zero", **args)
    if not any(f.config is not None and f.hot is not None for f in fn.recent.values()):
        return f"rank {rank}: the repeated calls did not take the hot path"
    for lr in (0.02, float(np.nextafter(np.float32(0.01), np.float32(1)))):
        why = _expect(fn, rank, {**args, "lr": lr if rank == 1 else 0.01}, ValueError,
                      ["'lr'", "differs", "rank 1"])
        if why:
            return why
    fn(schedule="zero", **args)
    return None


def check_warm_call_alias_on_rank1_only(fn, rank, size, comm):
    """After an agreed call, new buffers of the same shapes take the warm path (fastpath.py);
    where rank 1's overlap, every rank raises, naming rank 1, and touches nothing; then new
    buffers on every rank compute what the interpreter does."""
    fn(schedule="zero", **_inputs(rank, size, "zero"))
    why = check_alias_on_rank1_only(fn, rank, size, comm)
    if why:
        return why
    if not fn.recent.warm:
        return f"rank {rank}: no call was remembered for the warm path"
    return check_still_in_step(fn, rank, size, comm)


CALL_CHECKS = [check_scalar_differs, check_scalar_differs_in_last_bit, check_schedule_differs,
               check_groups_differ, check_same_buffer_twice, check_view_of_another,
               check_alias_on_rank1_only, check_torch_views_alias, check_leaf_requires_grad,
               check_no_grad_updates_and_bumps_version, check_still_in_step,
               check_repeated_call_scalar_differs, check_warm_call_alias_on_rank1_only]


def mode_calls(comm, files) -> int:
    import coconetc
    rank, size = comm.Get_rank(), comm.Get_size()
    fn = coconetc.load(files[0], log=lambda msg: None).adam
    failures = 0
    for check in CALL_CHECKS:
        try:
            why = check(fn, rank, size, comm)
        except Exception:  # noqa: BLE001 - report, keep going
            why = f"rank {rank}: {traceback.format_exc()}"
        whys = comm.gather(why, root=0)
        if rank == 0:
            bad = [w for w in whys if w]
            name = check.__name__.removeprefix("check_")
            print(f"FAIL {name}: {' | '.join(bad)}" if bad else f"OK {name}", flush=True)
            failures += bool(bad)
    return comm.bcast(failures, root=0)


# --- MODE comm -------------------------------------------------------------------------------
def mode_comm(comm, files) -> int:
    import coconetc
    rank = comm.Get_rank()
    split = comm.Split(0 if rank < 2 else 1, rank)
    dup = comm.Dup()
    failures = 0
    for f in files:
        mod = coconetc.load(f, log=lambda msg: None)
        for prog, fn in mod.programs.items():
            base = fn.schedules["default"]
            for sched, ir in fn.schedules.items():
                for label, sub in (("split", split), ("dup", dup)):
                    groups = 2 if "pipeline" in f else 1
                    # skipped: rank 2 (alone in its part of the split) calls nothing on it, so
                    # ranks 0 and 1 call the module without it (a collective over COMM_WORLD
                    # inside the module would hang them); communicators that cannot form the groups
                    problems = None
                    if sub.Get_size() % groups == 0 and not (label == "split" and rank >= 2):
                        try:
                            problems = _run_comm(sub, fn, base, ir, sched, groups)
                        except Exception:  # noqa: BLE001
                            problems = [traceback.format_exc()]
                    bad = [p for b in comm.allgather(problems) if b for p in b]
                    ran = problems is not None
                    name = f"{f.rsplit('/', 1)[-1]}:{prog}[{sched}]:{label}:{sub.Get_size()}"
                    if rank == 0 and (ran or bad):
                        print(f"FAIL comm {name}: {bad[:3]}" if bad else f"OK comm {name}",
                              flush=True)
                    failures += bool(bad)
    split.Free()
    dup.Free()
    return failures


def _run_comm(sub, fn, base, ir, sched, groups):
    """One call on the communicator `sub` against the interpreter: the problems, on sub's
    rank 0 (the others: [])."""
    from coconetc.jobs.verify import verify_call
    from coconetc.oracle.inputs import adapt_inputs, random_inputs
    inputs = adapt_inputs(random_inputs(base, sub.Get_size(), groups, {}, seed=5), base, ir, groups)
    problems = verify_call(sub, fn, ir, inputs, groups, schedule=sched, comm=sub).problems
    return problems if sub.Get_rank() == 0 else []


# --- MODE crash and MODE stall ----------------------------------------------------------------
def mode_crash(comm, files) -> int:
    import coconetc
    fn = coconetc.load(files[0], log=lambda msg: None).adam
    rank, size = comm.Get_rank(), comm.Get_size()
    fn(schedule="zero", **_inputs(rank, size, "zero"))
    print(f"FIRST CALL DONE {rank}", flush=True)
    if rank == 1:
        raise KeyError("deliberate failure on rank 1")
    fn(schedule="zero", **_inputs(rank, size, "zero"))  # rank 1 never comes
    print("RANK 0 WAS NOT STOPPED", flush=True)
    return 0


def mode_crash_torch(comm, files) -> int:
    """As crash, under torch.distributed: init_process_group wraps the exception hook (its
    traceback collected in memory, then printed with "[rankN]: "), so the abort must print it."""
    import os

    import torch.distributed as dist

    import coconetc  # noqa: F401  (first, as a script would: its hook is the one torch's wraps)
    port = comm.bcast(_free_port() if comm.Get_rank() == 0 else None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=comm.Get_rank(), world_size=comm.Get_size())
    return mode_crash(comm, files)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mode_stall(comm, files) -> int:
    import coconetc
    fn = coconetc.load(files[0], log=lambda msg: None).adam
    rank, size = comm.Get_rank(), comm.Get_size()
    fn(schedule="zero", **_inputs(rank, size, "zero"))
    print(f"FIRST CALL DONE {rank}", flush=True)
    if rank == 1:
        time.sleep(120)  # busy elsewhere: never arrives
        return 0
    fn(schedule="zero", **_inputs(rank, size, "zero"))
    print("RANK 0 WAS NOT STOPPED", flush=True)
    return 0


def main() -> int:
    from mpi4py import MPI
    mode, files = sys.argv[1], sys.argv[2:]
    comm = MPI.COMM_WORLD
    return 1 if {"calls": mode_calls, "comm": mode_comm, "crash": mode_crash, "crash_torch": mode_crash_torch,
                 "stall": mode_stall}[mode](comm, files) else 0


if __name__ == "__main__":
    sys.exit(main())
