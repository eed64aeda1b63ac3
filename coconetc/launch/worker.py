"""What every rank runs for `coconetc run` (without --interp): the compiled module on the same
random inputs as the interpreter, timed, with every rank's results compared with the
interpreter on rank 0. A rank that fails stops the whole job at once (MPI Abort)."""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import traceback
from typing import Any

import numpy as np


def _args(argv):
    ap = argparse.ArgumentParser(prog="coconetc-worker")
    ap.add_argument("file")
    ap.add_argument("--program", required=True)
    ap.add_argument("--schedule", action="append", default=[])
    ap.add_argument("--size", action="append", default=[])
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--save")
    ap.add_argument("--include-dir", action="append", default=[])
    ap.add_argument("--library-dir", action="append", default=[])
    ap.add_argument("--library", action="append", default=[])
    ap.add_argument("--emulate-cuda", action="store_true",
                    help="the CUDA module under the host emulation instead of the CPU module")
    ap.add_argument("--cuda", action="store_true",
                    help="the CUDA module on this node's GPUs (one rank a GPU), torch CUDA tensors")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    return stop_job_on_failure(lambda comm: _main(_args(argv), comm), "coconetc")


def stop_job_on_failure(body, label: str) -> int:
    """body(COMM_WORLD) on this rank; any exception but SystemExit is printed and aborts the
    whole job (MPI_Abort), so the other ranks never wait for this one."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    try:
        return body(comm)
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - any failure must stop every rank
        sys.stderr.write(f"{label} rank {comm.Get_rank()} failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        comm.Abort(1)
        return 1


def _main(a, comm) -> int:
    import coconetc
    from coconetc.oracle.core import adapt_inputs, compare, random_inputs
    from coconetc.interp.interpreter import Result, run
    from coconetc.oracle.session import save_results
    sizes = {k: int(v) for k, v in (s.split("=") for s in a.size)}
    if a.emulate_cuda:
        from coconetc.runtime.cuda import load_emulated
        mod = load_emulated(a.file, log=lambda msg: None)
    elif a.cuda:
        mod = _on_gpu(a.file, comm)
    else:
        mod = coconetc.load(a.file, log=lambda msg: None, include_dirs=a.include_dir,
                            library_dirs=a.library_dir, libraries=a.library)
    fn: Any = mod.programs[a.program]
    base = mod.source_module.programs[a.program]
    rank, R = comm.Get_rank(), comm.Get_size()
    inputs = random_inputs(base, R, a.groups, sizes, a.seed)
    bad = 0
    for sched in a.schedule or [None]:
        ir = fn.schedules[sched or "default"] if a.emulate_cuda or a.cuda else fn._program(sched)
        s_inputs = adapt_inputs(inputs, base, ir, a.groups)
        times, res = [], None
        for _ in range(max(1, a.reps)):
            mine = copy.deepcopy(s_inputs[rank])
            comm.Barrier()
            t0 = time.perf_counter()
            out = fn(schedule=sched, groups=a.groups, **mine)
            times.append(time.perf_counter() - t0)
            if res is None:
                res = _result(ir, out, mine)
        t = comm.reduce(statistics.median(times), op=_max(), root=0)
        gathered = comm.gather(res, root=0)
        if rank == 0:
            ref = run(ir, s_inputs, a.groups)
            got = [Result(o, u, ref[r].segments) for r, (o, u) in enumerate(gathered)]
            problems = compare(ref, got, ir, ir, a.groups)
            label = f"{a.program} [{sched or 'default'}]" + (" (CUDA, host emulation)" if a.emulate_cuda else
                                                              " (CUDA)" if a.cuda else "")
            status = "matches the interpreter on every rank" if not problems else "MISMATCH"
            print(f"{label}: {R} ranks: {t * 1e3:.3f} ms (median of {a.reps}): {status}", flush=True)
            for prob in problems[:20]:
                print(f"    {prob}", flush=True)
            bad += bool(problems)
            if a.save:  # one file per schedule when several run, as `run --interp` does
                path = a.save if len(a.schedule) <= 1 else a.save.replace(".npz", f".{sched or 'default'}.npz")
                save_results(path, s_inputs, got)
    bad = comm.bcast(bad, root=0)
    return 1 if bad else 0


class _GpuFunction:
    """A CUDA module's program called like the CPU one: NumPy inputs copied to this rank's
    GPU, results (and updated parameters) copied back after the stream is synchronized."""

    def __init__(self, fn: Any, comm: Any):
        self.fn, self.comm, self.schedules = fn, comm, fn.schedules

    def __call__(self, schedule=None, groups=1, **kwargs):
        import torch
        dev = {k: torch.from_numpy(np.ascontiguousarray(v)).cuda() if isinstance(v, np.ndarray) else v
               for k, v in kwargs.items()}
        out = self.fn(schedule=schedule, groups=groups, comm=self.comm, **dev)
        torch.cuda.synchronize()
        for k, v in kwargs.items():
            if isinstance(v, np.ndarray):
                v[...] = dev[k].cpu().numpy()
        outs = out if isinstance(out, tuple) else (out,) if out is not None else ()
        got = tuple(o.cpu().numpy() for o in outs)
        return None if not got else got[0] if len(got) == 1 else got


def _on_gpu(file: str, comm: Any) -> Any:
    """FILE's CUDA module on GPU (this rank's node-local rank modulo the GPUs), with an NCCL
    communicator over COMM_WORLD; its programs wrapped as _GpuFunction."""
    import torch
    from mpi4py import MPI

    from coconetc.runtime.cuda import load
    if not torch.cuda.is_available():
        raise SystemExit("coconetc run --backend cuda: no CUDA device here (use --emulate)")
    local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    torch.cuda.set_device(local % torch.cuda.device_count())
    mod = load(file, log=lambda msg: None)
    nccl = mod.comm(comm)
    for name, fn in list(mod.programs.items()):
        mod.programs[name] = _GpuFunction(fn, nccl)  # type: ignore[assignment]
    return mod


def _max():
    from mpi4py import MPI
    return MPI.MAX


def _result(ir, out, args):
    from coconetc.oracle.core import joined
    outs = out if isinstance(out, tuple) else (out,) if out is not None else ()
    outputs = {pub: np.asarray(v) for (pub, _), v in zip(ir.outputs, outs)}
    updates = {t: np.asarray(joined(args[t])).copy() for t, _ in ir.updates}
    return outputs, updates


if __name__ == "__main__":
    sys.exit(main())
