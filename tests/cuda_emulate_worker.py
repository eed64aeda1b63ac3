"""What each rank runs for tests/test_cuda_emulate.py (under mpiexec): the CUDA modules of the
examples under the host emulation (coconetc.runtime.cuda.load_emulated, already built by the
test), compared with the interpreter; dropout masks compared with the CPU backend; or one call
of a module whose stream waits were edited (the race tests).

    match SIZE GROUPS FILE...   every (program, schedule) of each file's emulated module
                                (GROUPS 0: one group, the pipeline example one stage a group)
    dropout FILE PROGRAM SCHED...   masks of the emulated and the CPU module, bit for bit
    race FILE PROGRAM SCHED SO NAME SIZE    one call of a prebuilt module; reports a race
    vector SIZE OFF FILE...     as match, every array placed at a 64-byte boundary (OFF 0: aligned
                                for 16-byte vectors) or one element past it (OFF 1), printing each
                                call's counts of kernels on the vector path and vector accesses
                                (FILE@N: that file at size N)
    check SIZES SPEC...         calls of prebuilt modules (SPEC: FILE|PROGRAM|SCHED|SO|NAME, in
                                turn) against the interpreter (SIZES: comma-separated, a call each)
    inplace SIZE WHO FILE:PROGRAM:SCHED:PARAM...   PARAM in a window_empty buffer on the ranks WHO
                                names ("all" or "0,2"), two calls each, against the interpreter
    wrong FILE      sgd.ccn's calls that are wrong on one rank only: every rank must raise
    torchpg FILE    the NCCL communicator made from a torch.distributed (gloo) process group
"""

from __future__ import annotations

import copy
import sys

import numpy as np
from mpi4py import MPI

from coconetc.jobs.abort import stop_job_on_failure
from coconetc.jobs.verify import call_results, verify_call, verify_results
from coconetc.oracle.inputs import adapt_inputs, random_inputs, size_symbols

comm = MPI.COMM_WORLD
rank, R = comm.Get_rank(), comm.Get_size()


def groups_for(prog: str, groups: int = 0) -> int:
    if groups:
        return groups
    if prog == "stage":  # send between groups: one stage per group
        return 2 if R % 2 == 0 else R
    return 1


def sizes_of(p, size: int) -> dict[str, int]:
    return {s: size for s in size_symbols(p)}


def match(size: int, groups: int, files: list[str]) -> int:
    from coconetc.runtime.cuda import load_emulated
    bad = 0
    for f in files:
        mod = load_emulated(f, log=lambda msg: None)
        for name, prog in mod.programs.items():
            base = mod.source_module.programs[name]
            g = groups_for(name, groups)
            inputs = random_inputs(base, R, g, sizes_of(base, size), seed=1)
            for sched, ir in prog.schedules.items():
                problems = verify_call(comm, prog, ir, adapt_inputs(inputs, base, ir, g), g,
                                       schedule=sched).problems
                if rank == 0:
                    print(f"{'MATCH' if not problems else 'MISMATCH'} {f} {name} {sched} R={R} size={size} "
                          f"groups={g} {problems[:3]}", flush=True)
                bad += bool(problems)
    return bad


def placed(a, shift: int):
    """A copy of array a whose data starts `shift` bytes past a 64-byte boundary (lists: each)."""
    if isinstance(a, list):
        return [placed(x, shift) for x in a]
    if not isinstance(a, np.ndarray):
        return a
    buf = np.empty(a.nbytes + 128, np.uint8)
    start = (-buf.ctypes.data) % 64 + shift
    out = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def vector(size: int, shift: int, files: list[str]) -> int:
    """Every (program, schedule) with its arrays placed at a 64-byte boundary or (shift 1) one
    element past it,
    against the interpreter; each call's counts of pointwise kernels on the vector path and on
    the element path and of vector accesses (the module's emulation_counts())."""
    from coconetc.runtime.cuda import load_emulated
    bad = 0
    for spec in files:
        f, _, n = spec.partition("@")
        mod = load_emulated(f, log=lambda msg: None)
        for name, prog in mod.programs.items():
            base = mod.source_module.programs[name]
            inputs = random_inputs(base, R, 1, sizes_of(base, int(n or size)), seed=4)
            for sched, ir in prog.schedules.items():
                s_inputs = adapt_inputs(inputs, base, ir, 1)
                mine = {k: placed(v, shift and getattr(v, "itemsize", 0)) for k, v in s_inputs[rank].items()}
                before = mod.ext.emulation_counts()
                out = prog(schedule=sched, **mine)
                after = mod.ext.emulation_counts()
                counts = " ".join(f"{k}={after[k] - before[k]}" for k in sorted(after))
                print(f"COUNTS {f} {name} {sched} rank={rank} shift={shift} {counts}", flush=True)
                problems = verify_results(comm, call_results(ir, out, mine), ir, s_inputs).problems
                if rank == 0:
                    print(f"{'MATCH' if not problems else 'MISMATCH'} {f} {name} {sched} R={R} size={n or size} "
                          f"shift={shift} {problems[:3]}", flush=True)
                bad += bool(problems)
    return bad


def dropout(file: str, prog: str, scheds: list[str]) -> int:
    """The output h = dropout(...) (* 2) + r equals r exactly where an element was dropped."""
    import coconetc
    from coconetc.runtime.cuda import load_emulated
    emu = load_emulated(file, log=lambda msg: None)
    cpu = coconetc.load(file, log=lambda msg: None)
    base = emu.source_module.programs[prog]
    inputs = random_inputs(base, R, 1, sizes_of(base, 12), seed=3)
    bad = 0
    for sched in scheds:
        ir = emu.programs[prog].schedules[sched]
        mine = adapt_inputs(inputs, base, ir)[rank]
        a = emu.programs[prog](schedule=sched, **copy.deepcopy(mine))
        b = cpu.programs[prog](schedule=None if sched == "default" else sched, **copy.deepcopy(mine))
        r = np.asarray(mine["r"])
        ma, mb = np.asarray(a) == r, np.asarray(b) == r
        same = bool(np.array_equal(ma, mb))
        dropped = int(ma.sum())
        print(f"DROPOUT {prog} {sched} rank {rank}: masks {'identical' if same else 'DIFFER'} "
              f"({dropped} of {ma.size} dropped)", flush=True)
        bad += (not same) or dropped == 0 or dropped == ma.size
    return comm.allreduce(bad)


def race(file: str, prog: str, sched: str, so: str, name: str, size: int) -> int:
    from coconetc.codegen.cuda import generate
    from coconetc.sourcefile import load_file
    from coconetc.runtime.loader import import_extension
    from coconetc.runtime.cuda import EmulatedModule
    mod = load_file(file)
    src = generate(mod, name, skip_unsupported=True, emulate=True)
    emu = EmulatedModule(mod, src, import_extension(name, so))
    base = mod.programs[prog]
    ir = emu.programs[prog].schedules[sched]
    inputs = adapt_inputs(random_inputs(base, R, 1, sizes_of(base, size), seed=2), base, ir)
    try:
        emu.programs[prog](schedule=sched, **inputs[rank])
    except RuntimeError as e:
        print(f"RANK {rank}: {e}", flush=True)
        sys.stdout.flush()
        comm.Abort(3)
    comm.Barrier()
    print(f"RANK {rank}: ok", flush=True)
    return 0


def check(sizes: str, specs: list[str]) -> int:
    """Calls of prebuilt (edited) modules, each SPEC (FILE|PROGRAM|SCHED|SO|NAME) in turn, one
    call a size (SIZES: comma-separated), compared with the interpreter."""
    from coconetc.codegen.cuda import generate
    from coconetc.sourcefile import load_file
    from coconetc.runtime.loader import import_extension
    from coconetc.runtime.cuda import EmulatedModule
    for spec in specs:
        file, prog, sched, so, name = spec.split("|")
        mod = load_file(file)
        emu = EmulatedModule(mod, generate(mod, name, skip_unsupported=True, emulate=True), import_extension(name, so))
        base = mod.programs[prog]
        ir = emu.programs[prog].schedules[sched]
        for size in (int(x) for x in sizes.split(",")):
            inputs = adapt_inputs(random_inputs(base, R, 1, sizes_of(base, size), seed=2), base, ir)
            problems = verify_call(comm, emu.programs[prog], ir, inputs, schedule=sched).problems
            if rank == 0:
                print(f"{'MATCH' if not problems else 'MISMATCH'} {file} {prog} {sched} R={R} size={size} "
                      f"{problems[:3]}", flush=True)
    return 0


def inplace(size: int, who: str, specs: list[str]) -> int:
    """Each FILE:PROGRAM:SCHED:PARAM call with PARAM (the fused collective's input) in a window of
    the communicator (the module's empty(): window_empty) on the ranks WHO names ("all", or a
    comma-separated list: the others pass an ordinary array), against the interpreter; printed
    per call: which ranks read it in place is in the trace (COCONET_CUDA_FUSED_TRACE)."""
    from coconetc.runtime.cuda import load_emulated
    bad = 0
    mine_too = who == "all" or str(rank) in who.split(",")
    probe = load_emulated(specs[0].split(":")[0], log=lambda msg: None)
    try:  # shapes that differ by rank: refused on every rank, before anything is allocated
        probe.empty((3 + rank,), "f32")
        raise AssertionError(f"rank {rank}: no error for window_empty shapes that differ")
    except ValueError as err:
        assert "every rank must ask for the same shape" in str(err), str(err)
    for spec in specs:
        f, prog_name, sched, param = spec.split(":")
        mod = load_emulated(f, log=lambda msg: None)
        prog = mod.programs[prog_name]
        base = mod.source_module.programs[prog_name]
        ir = prog.schedules[sched]
        inputs = adapt_inputs(random_inputs(base, R, 1, sizes_of(base, size), seed=5), base, ir, 1)
        mine = {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in inputs[rank].items()}
        q = ir.param(param)
        assert q is not None, (spec, "no such parameter")
        win = mod.empty(mine[param].shape, q.type.dtype).numpy()
        if mine_too:
            win[...] = mine[param]
            mine[param] = win
        for call in range(2):  # the second call: the window's SymInput written again
            before = {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in mine.items()}
            out = prog(schedule=sched, **mine)
            problems = verify_results(comm, call_results(ir, out, mine), ir,
                                      [before if r == rank else inputs[r] for r in range(R)]).problems
            if call == 0:
                for k, v in inputs[rank].items():  # the next call's inputs: as the first's
                    if isinstance(v, np.ndarray):
                        mine[k][...] = v
            if rank == 0:
                print(f"{'MATCH' if not problems else 'MISMATCH'} {f} {prog_name} {sched} R={R} size={size} "
                      f"who={who} call={call} {problems[:3]}", flush=True)
            bad += bool(problems)
    return bad


def wrong(file: str) -> int:
    """Each call is wrong on rank 1 only (or differs between the ranks); every rank must raise
    the same kind of error, naming the parameter, and leave w as it was; then a right call runs."""
    from coconetc.runtime.cuda import load_emulated
    mod = load_emulated(file, log=lambda msg: None)
    n = 7
    g, w = np.full(n, float(rank + 1), np.float32), np.ones(n, np.float32)
    mine = rank == 1
    cases = [("'w' must have dtype f32", dict(g=g, w=w.astype(np.float64) if mine else w, lr=0.5)),
             ("scalar 'lr' differs", dict(g=g, w=w, lr=0.25 if mine else 0.5)),
             ("overlap in memory", dict(g=g, w=g if mine else w, lr=0.5)),
             ("dim 0", dict(g=g[:5] if mine else g, w=w, lr=0.5))]
    for needle, kwargs in cases:
        try:
            mod.sgd(**kwargs)
        except (TypeError, ValueError) as err:
            assert needle in str(err), (needle, str(err))
            assert (w == 1).all(), w
            print(f"RANK {rank}: raised: {err}", flush=True)
            continue
        raise AssertionError(f"rank {rank}: no error for {needle}")
    try:
        mod.sgd(g=g, w=w, lr=0.5, schedule="fused" if mine else "default")
        raise AssertionError(f"rank {rank}: no error for different schedules")
    except ValueError as err:
        assert "schedule" in str(err), str(err)
    mod.sgd(g=g, w=w, lr=0.5)
    assert np.allclose(w, 1 - 0.5 * sum(range(1, R + 1))), w
    repeats(mod, g, w)
    print(f"RANK {rank}: ok", flush=True)
    return 0


def repeats(mod, g, w, **comm_kw) -> None:
    """Calls that repeat an agreed one (the same buffers on every rank) agree by one round of
    64-byte records, without the full exchange, and stay right; a scalar that differs on
    rank 1 still raises on every rank, leaving w as it was; a rank that passes new buffers
    sends every rank through the full exchange."""
    from coconetc.runtime import nccl
    full = []
    exchange = nccl.exchange  # (what a call's entry, entry.enter, exchanges with: backends.CudaBackend)

    def counted(*a, **k):
        full.append(1)
        return exchange(*a, **k)
    nccl.exchange = counted
    try:
        want = w.copy()
        for lr in (0.5, 0.25, 0.125):
            mod.sgd(g=g, w=w, lr=lr, schedule="fused", **comm_kw)
            want -= np.float32(lr) * np.float32(sum(range(1, R + 1)))
            assert np.allclose(w, want), (lr, w, want)
        assert len(full) <= 1, f"rank {rank}: {len(full)} full exchanges for repeated calls"  # (the first may)
        before, n = w.copy(), len(full)
        try:
            mod.sgd(g=g, w=w, lr=0.75 if rank == 1 else 0.5, schedule="fused", **comm_kw)
            raise AssertionError(f"rank {rank}: no error for a repeated call's scalar that differs")
        except ValueError as err:
            assert "scalar 'lr' differs" in str(err), str(err)
        assert np.array_equal(w, before) and len(full) == n + 1, (w, before, full)
        g2 = g.copy() if rank == 1 else g  # new buffers on rank 1 only
        mod.sgd(g=g2, w=w, lr=0.5, schedule="fused", **comm_kw)
        assert np.allclose(w, before - np.float32(0.5) * np.float32(sum(range(1, R + 1)))), w
        assert len(full) == n + 2, full
    finally:
        nccl.exchange = exchange
    print(f"RANK {rank}: repeats ok", flush=True)


def torchpg(file: str) -> int:
    """nccl_comm(process_group=...): the id broadcast over the torch.distributed group, the
    call's agreement over it too (a wrong scalar on rank 1 raises on both), then sgd matches."""
    import os

    import torch.distributed as dist

    from coconetc.runtime.cuda import load_emulated, nccl_comm
    port = comm.bcast(29500 + (os.getpid() % 2000) if rank == 0 else None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=R)
    mod = load_emulated(file, log=lambda msg: None)
    c = nccl_comm(mod.ext, process_group=dist.group.WORLD)
    assert (c.size, c.rank, c.mpi) == (R, rank, None), c
    n = 9
    g, w = np.full(n, float(rank + 1), np.float32), np.ones(n, np.float32)
    try:
        mod.sgd(g=g, w=w, lr=0.25 if rank == 1 else 0.5, comm=c)
        raise AssertionError("no error for a scalar that differs")
    except ValueError as err:
        assert "scalar 'lr' differs" in str(err), str(err)
    mod.sgd(g=g, w=w, lr=0.5, comm=c, schedule="fused")
    assert np.allclose(w, 1 - 0.5 * sum(range(1, R + 1))), w
    repeats(mod, g, w, comm=c)
    dist.destroy_process_group()
    print(f"RANK {rank}: ok", flush=True)
    return 0


def main(argv: list[str]) -> int:
    mode = argv[0]
    if mode == "torchpg":
        return torchpg(argv[1])
    if mode == "wrong":
        return wrong(argv[1])
    if mode == "match":
        return match(int(argv[1]), int(argv[2]), argv[3:])
    if mode == "vector":
        return vector(int(argv[1]), int(argv[2]), argv[3:])
    if mode == "dropout":
        return dropout(argv[1], argv[2], argv[3:])
    if mode == "inplace":
        return inplace(int(argv[1]), argv[2], argv[3:])
    if mode == "check":
        return check(argv[1], argv[2:])
    assert mode == "race", mode
    return race(argv[1], argv[2], argv[3], argv[4], argv[5], int(argv[6]))


if __name__ == "__main__":  # a failing rank stops the job
    sys.exit(stop_job_on_failure(lambda comm: 1 if main(sys.argv[1:]) else 0, "cuda_emulate_worker"))
