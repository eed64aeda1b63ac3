"""Groups over several nodes (docs/cluster.md): with COCONET_SIMULATE_NODES=K the ranks form K
simulated nodes of consecutive ranks that never share memory, and the fused collectives and
all-reduces run hierarchically (runtime_cpp/coconet/fused_shm.h, fused_rs_compute_ag_hier):
compiled results against the interpreter (`coconetc run`), against the flat point-to-point path
with the hierarchical path seen to run (tests/nodes_worker.py, the module's _hier_runs), with
several ranks per node and with one (MPI only); and a bad COCONET_SIMULATE_NODES is a clear
error in the C++ runtime and in Python alike."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from coconetc.runtime import node_ranks as nodes
from rank_checks import check, launch

REPO = Path(__file__).resolve().parents[1]
EXE = Path(sys.executable).parent / "coconetc"
WORKER = Path(__file__).with_name("nodes_worker.py")


def _run(args: list[str], k: int) -> str:
    res = subprocess.run([str(EXE), "run", *args], capture_output=True, text=True, timeout=600,
                         env={**os.environ, nodes.ENV_SIMULATE_NODES: str(k)})
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


@pytest.mark.parametrize("file,scheds", [("adam.ccn", 4), ("adamw.ccn", 1)])
def test_schedules_over_two_nodes_match_the_interpreter(file: str, scheds: int):
    """4 ranks as 2 nodes of 2, N = 4099 (uneven slices): adam's default (hierarchical
    all-reduce), rs_c_ag, zero and fused; adamw's zero (a norm accumulated inside the fused
    collective, then the clipped update and its gather)."""
    pytest.importorskip("mpi4py")
    args = [str(REPO / "examples" / file), "--ranks", "4", "--size", "N=4099",
            *(["-s", "all"] if scheds > 1 else ["-s", "zero"])]
    out = _run(args, 2)
    assert out.count("matches the interpreter on every rank") == scheds, out


@pytest.mark.parametrize("ranks,k", [(4, 2), (2, 2)], ids=["2 nodes of 2", "2 nodes of 1"])
def test_hierarchical_path_runs_and_matches_point_to_point(capfd, ranks: int, k: int):
    pytest.importorskip("mpi4py")
    import coconetc
    coconetc.load(REPO / "examples" / "adam.ccn", log=lambda msg: None)  # built before the ranks start
    os.environ[nodes.ENV_SIMULATE_NODES] = str(k)
    try:
        rc, lines, log = launch(capfd, WORKER, ranks, str(REPO / "examples" / "adam.ccn"), timeout=300)
    finally:
        del os.environ[nodes.ENV_SIMULATE_NODES]
    check(lines, log, ["nodes"])
    assert rc == 0, log


@pytest.mark.parametrize("value,needle", [("3", "does not divide the 1 ranks"), ("0", "integer >= 1"),
                                          ("two", "integer >= 1")])
def test_bad_simulated_nodes_is_a_clear_error(monkeypatch, value: str, needle: str):
    """The C++ runtime (a module call on a fresh communicator) and the Python helper refuse it
    with the same words, before communicating; unset, one rank is one node."""
    MPI = pytest.importorskip("mpi4py.MPI")
    import coconetc
    fn = coconetc.load(REPO / "examples" / "adam.ccn", log=lambda msg: None).adam
    n = 5
    arrays = {k: np.ones(n, np.float32) for k in "gwmv"}
    monkeypatch.setenv(nodes.ENV_SIMULATE_NODES, value)
    comm = MPI.COMM_WORLD.Dup()  # (a Comm cached for COMM_WORLD would not look again)
    try:
        with pytest.raises(ValueError, match=f"COCONET_SIMULATE_NODES={value}.*{needle}"):
            fn(comm=comm, **arrays, lr=1.0, beta1=0.9, beta2=0.9, eps=1e-8, step=1.0)
        assert np.all(arrays["w"] == 1)
        with pytest.raises(ValueError, match=f"COCONET_SIMULATE_NODES={value}.*{needle}"):
            nodes.node_comm(comm)
        monkeypatch.delenv(nodes.ENV_SIMULATE_NODES)
        assert nodes.simulated_nodes(4) == 0
        node = nodes.node_comm(comm)
        assert node.Get_size() == 1
        node.Free()
    finally:
        comm.Free()


def test_cost_model_has_two_levels():
    """The cost model over M nodes (coconetc/plan/cost.py): adam zero's fused collective and
    default's all-reduce send (M-1)/M of 1/L of the input and of the gathered w across the
    network (hierarchically), none on one node, all of what they send with one rank per node;
    so do rs_c_ag's reduce-scatter and all-gathers (of the input, of the gathered value), while
    under @p2p (flat) an all-gather sends (R-L)/(R-1) of its messages off the node; the network's
    bytes cost more time; explain --nodes prints them, and refuses nodes that do not divide."""
    from click.testing import CliRunner

    from coconetc import cli
    from coconetc.sourcefile import load_file
    from coconetc.plan.cost import cost
    mod = load_file(REPO / "examples" / "adam.ccn")
    n, R = 1 << 20, 4
    nb = 4.0 * n
    z = {m: cost(mod.plans[("adam", "zero")], {"N": n}, R, m) for m in (1, 2, 4)}
    assert z[1].net == 0 and z[2].net == pytest.approx(0.5 / 2 * 2 * nb)
    assert z[4].net == pytest.approx(z[4].sent) and z[4].sent == pytest.approx(0.75 * 2 * nb)
    assert z[1].seconds() < z[2].seconds() < z[4].seconds()
    d = cost(mod.plans[("adam", "default")], {"N": n}, R, 2)
    assert d.net == pytest.approx(0.5 / 2 * 2 * nb)
    parts = [p for _, p in cost(mod.plans[("adam", "rs_c_ag")], {"N": n}, R, 2).parts]
    rs, agm = parts[0], parts[2]  # a hierarchical reduce-scatter and all-gather
    assert rs.net == pytest.approx(0.5 / 2 * nb) and rs.sent == pytest.approx(0.5 * nb + 0.5 / 2 * nb)
    assert agm.net == pytest.approx(0.5 / 2 * nb) and agm.sent == pytest.approx(0.5 * nb + 0.5 / 2 * nb)
    flat = [p for _, p in cost(mod.plans[("adam", "rs_c_ag")], {"N": n}, R, 2, window=False).parts]
    assert flat[2].net == pytest.approx(2 / 3 * flat[2].sent) and flat[2].sent == pytest.approx(0.75 * nb)
    with pytest.raises(ValueError, match="3 nodes do not hold 4 ranks"):
        cost(mod.plans[("adam", "zero")], {"N": n}, R, 3)
    res = CliRunner().invoke(cli.main, ["explain", str(REPO / "examples" / "adam.ccn"), "--ranks", "4",
                                        "--nodes", "2", "--size", f"N={n}"])
    assert res.exit_code == 0, res.output
    assert "on 4 ranks over 2 nodes" in res.output and "net/rank" in res.output
    res = CliRunner().invoke(cli.main, ["explain", str(REPO / "examples" / "adam.ccn"), "--ranks", "4",
                                        "--nodes", "3", "--size", f"N={n}"])
    assert res.exit_code == 1 and "--nodes 3 does not divide the 4 ranks" in res.output
