"""In an MPI job of more than one rank, an uncaught exception on one rank must stop the job:
otherwise that rank's interpreter finalizes MPI at exit while the others wait for ever in a
collective it will never join. Importing coconetc installs this hook (as `python -m mpi4py`
does): it prints the exception as usual, then calls MPI_Abort.

Whether this is an MPI job is read from the launcher's environment (Open MPI, MPICH/Hydra,
PMI/PMIx, MVAPICH), so a plain `import coconetc` imports no MPI. The Open MPI settings a process
needs before MPI starts are here too (quiet_osc_ucx, own_segments), and the shared-memory
directories of the jobs coconetc.launch starts (new_segments, release)."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

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


# Open MPI names a job's shared-memory segments (btl/sm's files, in /dev/shm) by a 16-bit hash of
# the job's name, so two jobs on one machine now and then name theirs alike, attach each other's
# and crash (two jobs at once, in mca_btl_sm_poll_handle_frag); and a process that starts MPI
# alone (a singleton: `python train.py`) leaves its segment behind. Each job coconet starts here,
# and each process that imports coconetc outside a job, gets a directory of its own for them,
# removed when the process that made it exits. A directory the user names is kept.
SEGMENTS = "OMPI_MCA_btl_sm_backing_directory"
_PREFIX = "coconet-mpi-"
_made: dict[str, int] = {}  # the directories made, and the process that made each (a fork's parent)


def ours(env) -> bool:
    """Whether ENV's segment directory is unset or one coconet made (here or in a parent)."""
    return os.path.basename(env.get(SEGMENTS, _PREFIX)).startswith(_PREFIX)


def new_segments() -> str:
    """A new segment directory (in /dev/shm where it can be written), removed at exit."""
    shm = "/dev/shm"
    d = tempfile.mkdtemp(prefix=_PREFIX, dir=shm if os.access(shm, os.W_OK) else None)
    _made[d] = os.getpid()
    return d


@atexit.register
def _remove_made() -> None:
    for d, pid in list(_made.items()):
        if pid == os.getpid():  # (a forked child that exits leaves its parent's alone)
            shutil.rmtree(d, ignore_errors=True)


def release(env: dict[str, str]) -> None:
    """The job started in ENV has ended: its segment directory, if this process made it, goes now
    (not at exit)."""
    d = env.get(SEGMENTS)
    if d is not None and _made.get(d) == os.getpid():
        del _made[d]
        shutil.rmtree(d, ignore_errors=True)


def own_segments() -> None:
    """This process's segment directory, if it starts MPI as a singleton (not a rank of a job:
    every rank of a job must share one). Read at MPI_Init: coconetc/__init__.py calls it."""
    if not any(v in os.environ for v in SIZE_VARS) and ours(os.environ):
        os.environ[SEGMENTS] = new_segments()
