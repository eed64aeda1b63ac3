"""NCCL communicators of the CUDA runtime: `nccl_comm(module, mpi_comm)` makes one from an MPI
communicator (ncclGetUniqueId on rank 0, broadcast over MPI, ncclCommInitRank) or from a
torch.distributed process group (its store carries the abort notices; its agreement goes over
the group, or over a gloo group of its ranks where the group's object collectives would go
through the GPU: _host_group); without MPI (or with `mpi_comm=None` and no mpi4py) a one-rank
communicator from a locally made id. `exchange` and `agree_record`: what every rank of one
says, over MPI under the watchdog or over the process group."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from coconetc.runtime import agree
from coconetc.runtime.abort_notices import MpiNotices, StoreNotices
from coconetc.runtime.emulation import EMULATE, emulating


@dataclass
class NcclComm:
    """An NCCL communicator (handle) with the MPI communicator or torch.distributed process
    group it was made from (neither: a one-rank job)."""

    handle: int
    size: int
    rank: int
    mpi: Any = None
    group: Any = None  # a torch.distributed ProcessGroup (None: mpi, or one rank)
    notices: Any = None  # where the abort path's notices go (MpiNotices, StoreNotices; guarded)
    aborted: str | None = None  # why the communicator was aborted (then unusable)
    windows: int = 0  # window_empty buffers made on it (none: no call asks where its tensors are)
    host_group: Any = None  # the group calls agree over (_host_group): `group`, or a gloo group of its ranks


def nccl_comm(ext: Any, mpi_comm: Any = None, *, process_group: Any = None) -> NcclComm:
    """An NCCL communicator over the ranks of mpi_comm (default: MPI.COMM_WORLD when mpi4py
    works, else one rank), or over the ranks of an initialized torch.distributed process group
    (`process_group=`, e.g. `torch.distributed.group.WORLD` under torchrun): rank 0 makes the
    NCCL id, the group broadcasts it. Every rank of the group must call this together."""
    if process_group is not None:
        import uuid
        import torch.distributed as dist
        size, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        if size > 1 and emulating():
            _emulated_group_check(size)
        box: list[Any] = [(ext.nccl_unique_id(), uuid.uuid4().hex) if rank == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(process_group, 0), group=process_group)
        uid, token = box[0]
        notices = StoreNotices(dist.distributed_c10d._get_default_store(), token, rank) if size > 1 else None
        host = _host_group(process_group, size)
        return NcclComm(ext.nccl_comm_init(uid, size, rank), size, rank, None, process_group, notices,
                        host_group=host)
    if mpi_comm is None:
        try:
            from mpi4py import MPI
            mpi_comm = MPI.COMM_WORLD
        except Exception:  # no usable MPI: a one-rank communicator
            mpi_comm = None
    if mpi_comm is None or mpi_comm.Get_size() == 1:
        uid = ext.nccl_unique_id()
        return NcclComm(ext.nccl_comm_init(uid, 1, 0), 1, 0, mpi_comm)
    rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
    uid = mpi_comm.bcast(ext.nccl_unique_id() if rank == 0 else None, root=0)
    return NcclComm(ext.nccl_comm_init(uid, size, rank), size, rank, mpi_comm,
                    notices=MpiNotices(mpi_comm.Dup(), rank, size))


def _object_device(process_group: Any) -> str:
    """Where torch.distributed's object collectives on the group move their bytes: "cpu" for
    gloo (or a group with a CPU backend beside its NCCL one), else the group's device."""
    import torch.distributed as dist
    try:
        return str(dist.distributed_c10d._get_object_coll_device(process_group))
    except (AttributeError, ValueError):  # a torch without the helper
        return "cpu" if dist.get_backend(process_group) == "gloo" else "cuda"


def _host_group(process_group: Any, size: int) -> Any:
    """The group every call's agreement is exchanged over (exchange): the process group itself
    where its object collectives run on the host, else (an NCCL group, as torchrun's default
    `init_process_group("nccl")`) a gloo group of the same ranks, made here, once: an object
    collective over an NCCL group goes through the device and waits for it (all_gather_object
    reads the gathered sizes back with .item()), which would synchronize the host with the GPU
    on every step. Made by the group's ranks alone (use_local_synchronization), as they call
    nccl_comm together; its timeout is COCONET_TIMEOUT's, so a rank that stops calling ends
    the others' exchanges within the watchdog's time."""
    import datetime

    import torch.distributed as dist
    if size == 1 or _object_device(process_group) == "cpu":
        return process_group
    limit = agree.timeout_s()  # 0: no limit of coconet's (torch's default then)
    return dist.new_group(dist.get_process_group_ranks(process_group), backend="gloo",
                          timeout=datetime.timedelta(seconds=limit) if limit else None,
                          use_local_synchronization=True)


def _emulated_group_check(size: int) -> None:
    """Under the host emulation the NCCL communicator of a process group of `size` ranks is
    MPI_COMM_WORLD (emulate.h, ncclCommInitRank): the processes must be one MPI job of that size.
    Under torchrun each process is an MPI job of its own (a singleton), which emulate.h refused
    only as 'an NCCL communicator is MPI_COMM_WORLD or one rank'; say what to run instead. The
    same on every rank of the group (each sees its own world's size), so all raise together."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD.Get_size()
    if world != size:
        why = " (under torchrun each process is an MPI job of its own)" if world == 1 else ""
        raise ValueError(
            f"{EMULATE}=1: the emulated NCCL runs on MPI, so a process group's ranks must be all the "
            f"ranks of the MPI job; this group has {size} and MPI_COMM_WORLD {world}{why}: launch the "
            f"script under mpiexec, `{EMULATE}=1 coconetc launch -n {size} python SCRIPT`, and there "
            f"leave out process_group= (the communicator is made from MPI_COMM_WORLD) or pass a "
            f"group of every rank (docs/pytorch.md, 'Without a GPU: the host emulation')")


def exchange(comm: NcclComm, mine: Any, what: str, timeout: float, *, counted: bool = False) -> list[Any]:
    """Every rank's `mine`: over MPI under the watchdog (runtime/agree.py; counted: the call
    was counted by its record round), or over the torch.distributed group's host group
    (_host_group; its own timeout applies)."""
    if comm.size == 1:
        return [mine]
    if comm.mpi is not None:
        return agree.exchange(comm.mpi, mine, what, timeout, counted=counted)
    import torch.distributed as dist
    everyone: list[Any] = [None] * comm.size
    dist.all_gather_object(everyone, mine, group=comm.host_group or comm.group)
    return everyone


def agree_record(comm: NcclComm, config: bytes | None, scalars: bytes, groups: int, what: str,
                  timeout: float) -> bool:
    """A call's record round (agree.Channel.agreed: True on every rank when every rank repeats
    a call agreed with the same configuration digest, with the same scalar bits per group;
    else False on every rank, and the full exchange follows): over MPI under the watchdog, or
    as one all_gather of 64 bytes a rank over the process group's host group (where the full
    exchange is an all_gather_object: two all_gathers and pickling)."""
    if comm.mpi is not None:
        return agree.channel(comm.mpi).agreed(config, scalars, groups, what, timeout, time.monotonic())
    import torch
    import torch.distributed as dist

    def allgather(send: bytearray) -> bytes:
        parts = [torch.empty(len(send), dtype=torch.uint8) for _ in range(comm.size)]
        dist.all_gather(parts, torch.frombuffer(send, dtype=torch.uint8), group=comm.host_group or comm.group)
        return b"".join(t.numpy().tobytes() for t in parts)
    return agree.agreed_over(allgather, config, scalars, comm.size, groups)
