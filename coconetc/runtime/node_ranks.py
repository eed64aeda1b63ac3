"""Which ranks share a node, the Python side of runtime_cpp/coconet/comm.h's node_comm: the
ranks of a communicator that share memory (MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)) and,
with COCONET_SIMULATE_NODES=K in the environment, also the same one of K simulated nodes of
consecutive ranks (rank // (size // K)), which never share memory: tests on one machine run
the paths for groups that span several nodes (docs/cluster.md)."""

from __future__ import annotations

import os
from typing import Any

ENV_SIMULATE_NODES = "COCONET_SIMULATE_NODES"


def simulated_nodes(size: int) -> int:
    """K of COCONET_SIMULATE_NODES for a communicator of SIZE ranks (0 when unset); ValueError
    unless K is an integer >= 1 that divides SIZE (the C++ runtime says the same)."""
    env = os.environ.get(ENV_SIMULATE_NODES, "")
    if not env:
        return 0
    try:
        k = int(env)
    except ValueError:
        k = 0
    if k < 1:
        raise ValueError(f"{ENV_SIMULATE_NODES}={env}: the number of simulated nodes must be an integer >= 1")
    if size % k:
        raise ValueError(f"{ENV_SIMULATE_NODES}={env} does not divide the {size} ranks of the communicator "
                         "into equal nodes")
    return k


def node_comm(comm: Any) -> Any:
    """The ranks of the mpi4py communicator COMM on this rank's node, in COMM's order
    (collective over COMM)."""
    from mpi4py import MPI
    k = simulated_nodes(comm.Get_size())  # (raises on every rank alike, before communicating)
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED)
    if not k:
        return shared
    node = shared.Split(comm.Get_rank() // (comm.Get_size() // k), shared.Get_rank())
    shared.Free()
    return node
