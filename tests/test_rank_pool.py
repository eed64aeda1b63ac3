"""The test pool of ranks (tests/rank_pool.py): a job leaves nothing behind that changes the
next job run on the same ranks."""

from __future__ import annotations

import rank_pool


def test_a_jobs_watchdog_does_not_end_a_later_job(tmp_path):
    """A worker arms faulthandler.dump_traceback_later against a hang and returns before it
    fires; the next job on the same ranks outlives that deadline."""
    arm, wait = tmp_path / "arm.py", tmp_path / "wait.py"
    arm.write_text("import faulthandler\nfaulthandler.dump_traceback_later(1, exit=True)\n")
    wait.write_text("import time\ntime.sleep(2.5)\nprint('outlived', flush=True)\n")
    assert rank_pool.run(2, [str(arm)], timeout=60)[0] == 0
    rc, out, err = rank_pool.run(2, [str(wait)], timeout=60)
    assert rc == 0 and out.count("outlived") == 2, (rc, out, err)
