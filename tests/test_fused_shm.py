"""The fused collective through MPI-3 shared memory (runtime_cpp/coconet/fused_shm.h) against
the point-to-point one, bit for bit, with the input staged or in coconetc.empty's window, on
COMM_WORLD and a sub-communicator (tests/fused_shm_worker.py under mpiexec); and
coconetc.empty itself on one rank."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from coconetc.launch.mpiexec import run_python

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("fused_shm_worker.py")


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 3])
def test_shm_path_matches_p2p(capfd, ranks: int):
    pytest.importorskip("mpi4py")
    import coconetc
    coconetc.load(REPO / "examples" / "adam.ccn", log=lambda msg: None)  # built before the ranks start
    rc = run_python(ranks, [str(WORKER), str(REPO / "examples" / "adam.ccn")], timeout=600)
    out, err = capfd.readouterr()
    assert rc == 0, out + err
    assert "ok" in out.split()
    assert "UCX" not in err


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_empty_is_a_writable_array(framework: str):
    pytest.importorskip("mpi4py")
    if framework == "torch":
        pytest.importorskip("torch")
    import coconetc
    from coconetc.runtime import shm
    before = len(shm.WINDOWS)
    a = coconetc.empty((3, 5), "f32", framework=framework)
    assert tuple(a.shape) == (3, 5)
    a[...] = 2
    assert float(a.sum()) == 30.0
    assert len(shm.WINDOWS) == before + 4
    b = coconetc.empty(0, "bf16")
    assert b.shape == (0,) and b.dtype == np.dtype(shm.STORAGE["bf16"])
    with pytest.raises(ValueError, match="unknown dtype"):
        coconetc.empty(3, "f8")
