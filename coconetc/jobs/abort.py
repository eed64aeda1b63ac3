"""A rank that fails ends the whole job: its traceback is printed and MPI_Abort stops every
rank at once, so the others never wait in a collective for it."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from typing import Any


def stop_job_on_failure(body: Callable[[Any], int], label: str) -> int:
    """body(COMM_WORLD) on this rank; any exception but SystemExit is printed (as `LABEL rank
    R failed:` and the traceback) and aborts the whole job."""
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
