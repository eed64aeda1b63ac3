"""Starting R ranks with the mpiexec that comes with the installed MPI, without making users
remember --allow-run-as-root (Open MPI as root) or --oversubscribe (more ranks than cores)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

ENV_MPIEXEC = "COCONET_MPIEXEC"  # an mpiexec to use instead of the one beside python


@cache
def mpiexec() -> str:
    here = Path(sys.executable).parent / "mpiexec"
    found = os.environ.get(ENV_MPIEXEC) or (str(here) if here.exists() else shutil.which("mpiexec"))
    if not found:
        raise RuntimeError("coconetc: no mpiexec found (pip install 'coconet[cpu]' brings Open MPI)")
    return found


@cache
def _is_open_mpi() -> bool:
    out = subprocess.run([mpiexec(), "--version"], capture_output=True, text=True).stdout
    return "Open MPI" in out or "OpenRTE" in out


def command(ranks: int, argv: list[str]) -> list[str]:
    cmd = [mpiexec(), "-n", str(ranks)]
    if _is_open_mpi():
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        cmd.append("--oversubscribe")
    return cmd + argv


def environment(ranks: int) -> dict[str, str]:
    """os.environ plus what Open MPI needs to run R ranks on this machine."""
    env = dict(os.environ)
    if _is_open_mpi():
        env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
        env.setdefault("PRTE_MCA_rmaps_default_mapping_policy", ":oversubscribe")
        env.setdefault("OMPI_MCA_osc", "^ucx")  # see coconetc.runtime.hooks.quiet_osc_ucx
        if ranks > (os.cpu_count() or 1):  # more ranks than cores: waiting ranks must yield
            env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    return env


def run_python(ranks: int, args: list[str], timeout: float | None = None) -> int:
    """Run `python ARGS` on R ranks; returns the exit code (non-zero if any rank failed)."""
    env = environment(ranks)
    cmd = command(ranks, [sys.executable, *args])
    try:
        return subprocess.run(cmd, env=env, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"coconetc: ranks did not finish in {timeout} s; stopped", file=sys.stderr)
        return 124
