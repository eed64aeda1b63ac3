"""In an MPI job of more than one rank, an uncaught exception on one rank must stop the job:
otherwise that rank's interpreter finalizes MPI at exit while the others wait for ever in a
collective it will never join. Importing coconetc installs this hook (as `python -m mpi4py`
does): it prints the exception as usual, then calls MPI_Abort.

Whether this is an MPI job is read from the launcher's environment (Open MPI, MPICH/Hydra,
PMI/PMIx, MVAPICH), so a plain `import coconetc` imports no MPI."""

from __future__ import annotations

import os
import sys

SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE")


def world_size_from_env() -> int:
    for var in SIZE_VARS:
        raw = os.environ.get(var, "")
        if raw.isdigit():
            return int(raw)
    return 1


def _abort_hook(previous):
    def hook(kind, value, tb):
        previous(kind, value, tb)
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
            return  # MPI never started here: the launcher sees this process exit non-zero
        rank = mpi.COMM_WORLD.Get_rank()
        note = (f"coconet: uncaught {kind.__name__} on rank {rank}: aborting the MPI job "
                "(MPI_Abort) so that the other ranks do not wait for ever\n")
        out = sys.stderr
        kept = getattr(out, "getvalue", None)
        if kept is not None and sys.__stderr__ is not None and out is not sys.__stderr__:
            # a hook installed after this one (torch.distributed.init_process_group's, which
            # prefixes "[rankN]: ") collects the traceback in memory to print it after this
            # hook returns, which it never does: print it now, or the job ends without it
            out = sys.__stderr__
            out.write(kept())
        out.write(note)
        out.flush()
        mpi.COMM_WORLD.Abort(1)

    hook.coconet_abort = True  # type: ignore[attr-defined]
    return hook


def install() -> bool:
    """Installs the hook in a job of more than one rank (once); returns whether it is there."""
    if world_size_from_env() <= 1:
        return False
    if not getattr(sys.excepthook, "coconet_abort", False):
        sys.excepthook = _abort_hook(sys.excepthook)
    return True


def quiet_osc_ucx() -> None:
    """Open MPI 5 queries its UCX one-sided component for every MPI window and, on a machine
    without a UCX network, prints an error each time; coconet's windows are shared memory
    (osc/sm), so leave that component out unless the user chose the components."""
    os.environ.setdefault("OMPI_MCA_osc", "^ucx")
