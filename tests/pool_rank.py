"""One rank of a tests/rank_pool.py pool: connects to the test process's socket, then runs each
job it is sent (`python ARGV` as runpy runs a script, its stdout and stderr to files of this
rank's) and answers `DONE <exit code>`. A failed job ends this rank: the pool does not outlive
a job that may have left another rank in a collective. What a job leaves behind in the process
is undone before the next: its environment, path and directory, and a watchdog it armed
(faulthandler.dump_traceback_later), which would otherwise end a later job at its deadline.

    python pool_rank.py SOCKET"""

from __future__ import annotations

import faulthandler
import json
import os
import runpy
import socket
import sys
import traceback

from mpi4py import MPI

MPI_VARS = ("OMPI_", "PMIX_", "PRTE_", "OPAL_", "PMI_")  # set by mpiexec for each rank


def run_job(job: dict, rank: int) -> int:
    argv, out = job["argv"], job["out"]
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fo, fe = open(f"{out}.rank{rank}.out", "w"), open(f"{out}.rank{rank}.err", "w")
    os.dup2(fo.fileno(), 1)
    os.dup2(fe.fileno(), 2)
    env, path, cwd = dict(os.environ), list(sys.path), os.getcwd()
    os.environ.clear()  # the caller's environment, this rank's MPI variables kept
    os.environ.update({k: v for k, v in job["env"].items() if not k.startswith(MPI_VARS)})
    os.environ.update({k: v for k, v in env.items() if k.startswith(MPI_VARS)})
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    os.chdir(job["cwd"])
    rc = 0
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            rc = 0
        elif isinstance(e.code, int):
            rc = e.code
        else:
            print(e.code, file=sys.stderr)
            rc = 1
    except BaseException:  # noqa: BLE001 - reported as the job's failure
        traceback.print_exc()
        rc = 1
    finally:
        faulthandler.cancel_dump_traceback_later()
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        fo.close()
        fe.close()
        os.environ.clear()
        os.environ.update(env)
        sys.path[:] = path
        os.chdir(cwd)
    return rc


def main() -> int:
    rank = MPI.COMM_WORLD.Get_rank()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sys.argv[1])
    s.sendall(f"{rank}\n".encode())
    jobs = s.makefile("r")
    for line in jobs:
        rc = run_job(json.loads(line), rank)
        s.sendall(f"DONE {rc}\n".encode())
        if rc:
            MPI.COMM_WORLD.Abort(rc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
