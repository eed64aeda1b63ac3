"""The abort path's notices (runtime/watchdog.py): the rank whose call failed tells its peers,
over a duplicate of the MPI communicator (tag ABORT_TAG) or in the torch.distributed group's
store, and their watchdogs poll for it."""

from __future__ import annotations

from typing import Any

ABORT_TAG = 31_003
_SENT: list = []  # the abort notices' requests (kept until the job ends)


class MpiNotices:
    """The abort path's notices over a duplicate of the MPI communicator (tag ABORT_TAG)."""

    def __init__(self, mpi: Any, rank: int, size: int):
        self.mpi, self.rank, self.size = mpi, rank, size

    def send(self, notice: tuple[int, str]) -> None:
        """To every other rank (non-blocking; their watchdogs receive it)."""
        for r in range(self.size):
            if r != self.rank:
                _SENT.append(self.mpi.isend(notice, dest=r, tag=ABORT_TAG))

    def poll(self) -> tuple[int, str] | None:
        from mpi4py import MPI
        st = MPI.Status()
        if self.mpi.Iprobe(source=MPI.ANY_SOURCE, tag=ABORT_TAG, status=st):
            return self.mpi.recv(source=st.Get_source(), tag=ABORT_TAG)
        return None


class StoreNotices:
    """The abort path's notices for a communicator made from a torch.distributed process group
    (no MPI): a key of the group's store (TCPStore under torchrun), named by a token rank 0 drew
    for this communicator, which the failing rank sets and the others' watchdogs check."""

    def __init__(self, store: Any, token: str, rank: int):
        self.store, self.key, self.rank = store, f"coconet/nccl_abort/{token}", rank

    def send(self, notice: tuple[int, str]) -> None:
        self.store.set(self.key, f"{notice[0]}\n{notice[1]}")

    def poll(self) -> tuple[int, str] | None:
        if not self.store.check([self.key]):
            return None
        r, why = self.store.get(self.key).decode().split("\n", 1)
        return int(r), why
