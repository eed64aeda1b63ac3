"""Starting R ranks with the mpiexec that comes with the installed MPI, without making users
remember --allow-run-as-root (Open MPI as root) or --oversubscribe (more ranks than cores), on
this machine or on the hosts of a hostfile or a host list (docs/cluster.md)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

from coconetc.runtime.hooks import SEGMENTS, new_segments, ours, release

ENV_MPIEXEC = "COCONET_MPIEXEC"  # an mpiexec to use instead of the one beside python


@cache
def mpiexec() -> str:
    here = Path(sys.executable).parent / "mpiexec"
    named = os.environ.get(ENV_MPIEXEC)
    found = named or (str(here) if here.exists() else shutil.which("mpiexec"))
    if not found:
        raise RuntimeError(f"coconetc: no mpiexec found ({_install_cpu()} brings Open MPI)")
    if not os.access(found, os.X_OK) or os.path.isdir(found):
        if named:
            raise RuntimeError(f"coconetc: {ENV_MPIEXEC}={found!r} is not an executable file: unset it to use "
                               "the mpiexec beside python or on the PATH")
        raise RuntimeError(f"coconetc: the mpiexec beside python, {found!r}, is not an executable file "
                           f"(reinstall: {_install_cpu()}; or name another in COCONET_MPIEXEC)")
    return found


def _install_cpu() -> str:
    from coconetc.paths import install_command  # (a leaf too; only when there is an error to say)
    return install_command("cpu")


@cache
def _is_open_mpi() -> bool:
    out = subprocess.run([mpiexec(), "--version"], capture_output=True, text=True).stdout
    return "Open MPI" in out or "OpenRTE" in out


def command(ranks: int, argv: list[str], hostfile: str | None = None, hosts: str | None = None) -> list[str]:
    """The mpiexec command line that runs ARGV on R ranks, on the hosts of HOSTFILE or HOSTS
    ("h1,h2" or "h1:4,h2:4", slots after a colon) when given (Open MPI: --hostfile / --host;
    MPICH's hydra: -f / -hosts)."""
    cmd = [mpiexec(), "-n", str(ranks)]
    openmpi = _is_open_mpi()
    if hostfile:
        cmd += ["--hostfile" if openmpi else "-f", hostfile]
    if hosts:
        cmd += ["--host" if openmpi else "-hosts", hosts]
    if openmpi:
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        cmd.append("--oversubscribe")
    return cmd + argv


# Open MPI's settings for ranks that are all on this machine: they talk over shared memory, and
# libfabric's transport (btl ofi) spends about 1 s of each rank's MPI_Init probing networks.
ONE_MACHINE = {"OMPI_MCA_btl": "^ofi"}


def environment(ranks: int, local: bool = True, segments: bool = True) -> dict[str, str]:
    """os.environ plus what Open MPI needs to run R ranks on this machine (LOCAL: on this
    machine only; with hosts given the ranks spread over them and this machine's cores say
    nothing about theirs). SEGMENTS: a new job's, with a shared-memory directory of its own
    (False: for ranks already started)."""
    env = dict(os.environ)
    if _is_open_mpi():
        if local and segments and ours(env):
            env[SEGMENTS] = new_segments()
        env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
        env.setdefault("PRTE_MCA_rmaps_default_mapping_policy", ":oversubscribe")
        env.setdefault("OMPI_MCA_osc", "^ucx")  # see coconetc.runtime.hooks.quiet_osc_ucx
        if local and more_than_cores(ranks):  # waiting ranks must yield
            env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
        if local:
            for k, v in ONE_MACHINE.items():
                env.setdefault(k, v)
    return env


def more_than_cores(ranks: int) -> bool:
    """Whether RANKS ranks on this machine outnumber its cores: then a rank that waits must
    leave its core to a rank that computes."""
    return ranks > (os.cpu_count() or 1)


def oversubscribed() -> bool:
    """Whether this rank's job runs more ranks on this machine than it has cores, as the
    launcher told the rank (Open MPI: OMPI_COMM_WORLD_LOCAL_SIZE; MPICH: MPI_LOCALNRANKS);
    False where neither says."""
    local = os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE") or os.environ.get("MPI_LOCALNRANKS")
    return local is not None and local.isdigit() and more_than_cores(int(local))


def run_python(ranks: int, args: list[str], timeout: float | None = None, hostfile: str | None = None,
               hosts: str | None = None, env: dict[str, str] | None = None) -> int:
    """Run `python ARGS` on R ranks (on the hosts of HOSTFILE or HOSTS when given; ENV added to
    their environment); returns the exit code (non-zero if any rank failed)."""
    env = {**environment(ranks, local=not (hostfile or hosts)), **(env or {})}
    cmd = command(ranks, [sys.executable, *args], hostfile=hostfile, hosts=hosts)
    try:
        return subprocess.run(cmd, env=env, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"coconetc: ranks did not finish in {timeout} s; stopped", file=sys.stderr)
        return 124
    finally:
        release(env)
