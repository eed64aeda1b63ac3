"""Several `coconetc.jobs.run` jobs in one MPI job (tests/test_cpu_backend.py): each argument
group (groups separated by `--`) in turn, as `python -m coconetc.jobs.run GROUP` runs it, so that
the ranks start, import and load once for many programs. Exit code 1 when any job mismatched;
a job that raises stops every rank (as it would alone).

    python run_jobs_worker.py FILE --program P [--schedule S]... [--size N=INT]... -- FILE ..."""

from __future__ import annotations

import sys

from coconetc.jobs import run
from coconetc.jobs.abort import stop_job_on_failure


def jobs(argv: list[str]) -> list[list[str]]:
    out: list[list[str]] = [[]]
    for a in argv:
        if a == "--":
            out.append([])
        else:
            out[-1].append(a)
    return [j for j in out if j]


def main(comm) -> int:
    bad = [run._main(run._args(job), comm) for job in jobs(sys.argv[1:])]
    return 1 if any(bad) else 0


if __name__ == "__main__":
    sys.exit(stop_job_on_failure(main, "run_jobs_worker"))
