"""The parameters' parts on the ranks of an mpi4py communicator, below coconetc.torch.shard
(sharded.py): which part of a whole tensor a rank holds (coconet's rule, coconetc.ir.slices
.slice_range of one dim), each parameter's `Spec`, and `Parts`: the ranks agreeing before they
communicate (an error on any rank raised on every rank, naming it) and the collectives that move
parts and whole tensors (an all-gather of every part, the gradients' reduce-scatter and
all-reduce, a gather of one tensor, a scatter from one rank), each waited for under coconet's
watchdog (COCONET_TIMEOUT)."""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch

from coconetc.ir.slices import slice_range
from coconetc.torch.ops import ranged

T = TypeVar("T")
_ALIGN = 16  # bytes: every tensor's place in an exchanged buffer, so that views of it are aligned
_KEPT_TYPES = {c.__name__: c for c in (ValueError, TypeError, KeyError, RuntimeError, OSError,
                                       FileNotFoundError, PermissionError, IsADirectoryError)}
_REDUCE_DTYPES = {torch.float64: torch.float64}  # every other float is reduced in float32


def part_index(shape: tuple[int, ...], dim: int | None, ranks: int, rank: int) -> tuple[slice, ...]:
    """The index of rank's part of a whole tensor of SHAPE sharded along DIM (None: all of it)."""
    if dim is None:
        return tuple(slice(0, n) for n in shape)
    lo, hi = slice_range(shape[dim], ranks, rank)
    return tuple(slice(lo, hi) if d == dim else slice(0, n) for d, n in enumerate(shape))


def part_shape(shape: tuple[int, ...], dim: int | None, ranks: int, rank: int) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in part_index(shape, dim, ranks, rank))


@dataclass(frozen=True)
class Spec:
    """One parameter: its name (the first in module.named_parameters()), whole shape, the dim
    it is sharded along (None: kept whole on every rank) and dtype."""
    name: str
    shape: tuple[int, ...]
    dim: int | None
    dtype: torch.dtype

    def part(self, ranks: int, rank: int) -> tuple[int, ...]:
        return part_shape(self.shape, self.dim, ranks, rank)

    def nbytes(self, ranks: int, rank: int) -> int:
        return int(np.prod(self.part(ranks, rank))) * self.dtype.itemsize

    def key(self) -> tuple:
        return self.name, self.shape, self.dim, str(self.dtype)


def joined(comm: Any, parts: list[torch.Tensor], dims: list[int]) -> list[torch.Tensor]:
    """Each of PARTS joined with the other ranks' along its dim of DIMS, in rank order: the whole
    tensors whose slices the ranks of COMM (mpi4py) hold, each on its part's device (one
    all-gather of host copies; every rank passes as many parts, in the same order)."""
    every = comm.allgather([t.detach().cpu() for t in parts])
    return [torch.cat([got[i] for got in every], dim=d).to(t.device) for i, (t, d) in enumerate(zip(parts, dims))]


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def raised(label: str, failed: list[tuple[int, tuple]]) -> Exception:
    """The exception every rank raises when some ranks failed: the first failing rank's type
    (where it is a built-in one), its message and every failing rank named."""
    kinds = {x[1] for _, x in failed}
    cls = _KEPT_TYPES.get(failed[0][1][1], RuntimeError) if len(kinds) == 1 else RuntimeError
    text = "; ".join(f"rank {r} failed: {x[1]}: {x[2]}" for r, x in failed)
    return cls(f"{label}: {text}")


class Parts:
    """The ranks of COMM, the parameters' specs and this rank's parts (`_params`, filled by
    Sharded): what every collective of sharded parameters needs."""

    def __init__(self, comm: Any, reduce: str):
        self.comm, self.reduce = comm, reduce
        self.rank, self.ranks = comm.Get_rank(), comm.Get_size()
        self.specs: dict[str, Spec] = {}
        self._params: dict[str, torch.nn.Parameter] = {}  # name -> this rank's part
        self._gathering = False  # inside Sharded.gathered(): the parameters whole

    @property
    def sharded(self) -> list[str]:
        """The names of the sharded parameters (the others are kept whole on every rank)."""
        return [s.name for s in self.specs.values() if s.dim is not None]

    def dim(self, name: str) -> int | None:
        """The dim parameter NAME is sharded along (None: kept whole)."""
        return self._spec_of(name).dim

    def index(self, name: str, rank: int | None = None) -> tuple[slice, ...]:
        """The index of rank's (default: this rank's) part of parameter NAME's whole tensor:
        `whole[sharded.index(name)]` is what the rank holds."""
        s = self._spec_of(name)
        return part_index(s.shape, s.dim, self.ranks, self.rank if rank is None else rank)

    def local(self, name: str) -> torch.nn.Parameter:
        """This rank's part of parameter NAME: the Parameter the optimizer steps (a `.ccn`
        program's `sliced(d)` argument as it is)."""
        self._spec_of(name)
        return self._params[name]

    def _spec_of(self, name: str) -> Spec:
        if name not in self.specs:
            raise KeyError(f"coconetc.torch.Sharded: no parameter {name!r} (there are "
                           f"{', '.join(map(repr, self.specs))})")
        return self.specs[name]

    # --- agreeing before communicating ---------------------------------------------------------
    def _agree(self, what: str, local: Callable[[], T], check: bool = True,
               describe: Callable[[T], list[tuple]] | None = None,
               words: str = "parameters (name, shape, dim, dtype)") -> T:
        """local() on this rank (after the parts' check, unless not CHECK), then every rank's
        outcome exchanged under the watchdog: any rank's error raises on every rank, naming the
        rank; ranks whose description (DESCRIBE(local()), default the parameters' specs)
        differs raise on every rank, naming the first rank and item that differ from rank 0's."""
        from coconetc.runtime import agree
        label = f"coconetc.torch.Sharded.{what}"
        out: Any = None
        items: list[tuple] = []
        failure: Exception | None = None
        try:
            if check:
                self._check_shards()
            out = local()
            items = describe(out) if describe is not None else [s.key() for s in self.specs.values()]
            mine: tuple = ("ok", agree.digest(items))
        except Exception as err:  # noqa: BLE001 - any failure here is every rank's to know
            mine, failure = ("error", type(err).__name__, str(err)), err
        everyone = agree.exchange(self.comm, mine, label, agree.timeout_s())
        failed = [(r, x) for r, x in enumerate(everyone) if x[0] == "error"]
        if failed:
            raise raised(label, failed) from failure
        if any(x != mine for x in everyone):
            self._differ(label, items, words)
        return out

    def _check_shards(self) -> None:
        """Each parameter still this rank's part of its whole shape (a shard replaced by a
        tensor of another shape or dtype is refused here, naming it)."""
        if self._gathering:
            raise RuntimeError("not inside gathered(), where the parameters are whole (leave it first)")
        for s in self.specs.values():
            p = self._params[s.name]
            want = s.part(self.ranks, self.rank)
            if tuple(p.shape) != want or p.dtype != s.dtype:
                raise ValueError(f"parameter {s.name!r}: this rank holds a {p.dtype} tensor shaped "
                                 f"{tuple(p.shape)}; its part of the whole {tuple(s.shape)} "
                                 f"(dim {s.dim} on {self.ranks} ranks) is {s.dtype} shaped {want}")

    def full(self, name: str) -> torch.Tensor:
        """Parameter NAME's whole tensor, a new one on every rank (collective: every rank calls
        it together; DTensor.full_tensor())."""
        s = self._spec_of(name)
        self._agree(f"full({name!r})", lambda: None)
        whole = self._gathered_one(s, self._params[name], None)
        assert whole is not None
        return whole

    def _differ(self, label: str, mine: list[tuple], words: str) -> None:
        """Raises, on every rank, the same error naming the first rank whose items are not rank
        0's and the first item that differs."""
        from coconetc.runtime import agree
        everyone = agree.exchange(self.comm, mine, label, agree.timeout_s())
        for r, theirs in enumerate(everyone):
            if theirs != everyone[0]:
                diff = next((f"{b!r} on rank {r}, {a!r} on rank 0" for a, b in zip(everyone[0], theirs) if a != b),
                            f"{len(theirs)} on rank {r}, {len(everyone[0])} on rank 0")
                raise RuntimeError(f"{label}: rank {r} holds other {words} than rank 0 ({diff}); every rank "
                                   f"must shard the same model alike and call this together")

    def _wait(self, req: Any, what: str, comm: Any = None) -> None:
        """REQ (a request on COMM, default the handle's communicator) waited for under the watchdog."""
        from coconetc.runtime import agree
        from coconetc.runtime.watchdog import Watchdog
        comm = self.comm if comm is None else comm
        calls = agree.channel(comm) if self.ranks > 1 else None
        if calls is not None:
            calls.n += 1
        with ranged(f"coconet shard: wait for the {what}", "wait"):
            Watchdog(comm, f"coconetc.torch.Sharded.{what}", agree.timeout_s(), None,
                     calls.n if calls else 0).wait(req)

    # --- the collectives -----------------------------------------------------------------------
    def _whole(self, tensors: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> list[torch.Tensor]:
        """Every parameter's whole tensor from every rank's parts (one all-gather of bytes; the
        whole parameters returned as they are)."""
        from mpi4py import MPI
        specs = list(self.specs.values())
        cut = [s for s in specs if s.dim is not None]
        counts = [sum(_padded(s.nbytes(self.ranks, r)) for s in cut) for r in range(self.ranks)]
        displs = [sum(counts[:r]) for r in range(self.ranks)]
        send = torch.zeros(counts[self.rank], dtype=torch.uint8)
        at = 0
        for s, t in zip(specs, tensors):
            if s.dim is not None:
                n = s.nbytes(self.ranks, self.rank)
                send[at:at + n] = t.detach().contiguous().reshape(-1).view(torch.uint8)
                at += _padded(n)
        recv = torch.empty(sum(counts), dtype=torch.uint8)
        if cut:
            self._wait(self.comm.Iallgatherv([send.numpy(), MPI.BYTE], [recv.numpy(), counts, displs, MPI.BYTE]),
                       "all-gather of the shards")
        out, where = [], list(displs)
        for s, t in zip(specs, tensors):
            if s.dim is None:
                out.append(t.view_as(t))
                continue
            parts = []
            for r in range(self.ranks):
                n = s.nbytes(self.ranks, r)
                parts.append(recv[where[r]:where[r] + n].view(s.dtype).view(s.part(self.ranks, r)))
                where[r] += _padded(n)
            out.append(torch.cat(parts, dim=s.dim))
        return out

    def _gathered_one(self, s: Spec, part: torch.Tensor, root: int | None) -> torch.Tensor | None:
        """The whole tensor of which PART is this rank's part (sharded as parameter s, of PART's
        dtype) on every rank (root None) or on rank root alone."""
        from mpi4py import MPI
        part = part.detach()
        s = Spec(s.name, s.shape, s.dim, part.dtype)
        if s.dim is None:
            return part.clone()
        counts = [s.nbytes(self.ranks, r) for r in range(self.ranks)]
        displs = [sum(counts[:r]) for r in range(self.ranks)]
        recv = torch.empty(sum(counts), dtype=torch.uint8) if root in (None, self.rank) else None
        send = [part.contiguous().reshape(-1).view(torch.uint8).numpy(), MPI.BYTE]
        spec = [recv.numpy(), counts, displs, MPI.BYTE] if recv is not None else None
        if root is None:
            req = self.comm.Iallgatherv(send, spec)
        else:
            req = self.comm.Igatherv(send, spec, root=root)
        self._wait(req, f"gather of {s.name!r}")
        if recv is None:
            return None
        parts = [recv[d:d + c].clone().view(s.dtype).view(s.part(self.ranks, r))
                 for r, (d, c) in enumerate(zip(displs, counts))]
        return torch.cat(parts, dim=s.dim)

    def _scattered(self, wholes: dict[str, torch.Tensor], root: int) -> dict[str, torch.Tensor]:
        """Each rank's part of rank root's whole tensors (one scatter of bytes); the whole
        parameters' values too (a broadcast in the same scatter: every rank's part is all of it)."""
        from mpi4py import MPI
        specs = list(self.specs.values())
        counts = [sum(_padded(s.nbytes(self.ranks, r)) for s in specs) for r in range(self.ranks)]
        displs = [sum(counts[:r]) for r in range(self.ranks)]
        send = None
        if self.rank == root:
            send = torch.zeros(sum(counts), dtype=torch.uint8)
            for r in range(self.ranks):
                at = displs[r]
                for s in specs:
                    n = s.nbytes(self.ranks, r)
                    piece = wholes[s.name][part_index(s.shape, s.dim, self.ranks, r)]
                    send[at:at + n] = piece.contiguous().reshape(-1).view(torch.uint8)
                    at += _padded(n)
        recv = torch.empty(counts[self.rank], dtype=torch.uint8)
        spec = [send.numpy(), counts, displs, MPI.BYTE] if send is not None else None
        self._wait(self.comm.Iscatterv(spec, [recv.numpy(), MPI.BYTE], root=root), "scatter of the whole tensors")
        out, at = {}, 0
        for s in specs:
            n = s.nbytes(self.ranks, self.rank)
            out[s.name] = recv[at:at + n].view(s.dtype).view(s.part(self.ranks, self.rank))
            at += _padded(n)
        return out
