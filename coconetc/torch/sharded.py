"""A model's parameters kept sharded over the data-parallel ranks between steps (as FSDP2's
`fully_shard` and DeepSpeed's ZeRO-3 keep them), in coconet's slicing convention: a rank holds
`slice_range(n, R, rank)` of each sharded parameter's dim `d` (coconetc.ir.slices), exactly the
part a `.ccn` program's `sliced(d)` parameter takes, so a shard is passed to a program as it is.

    sharded = coconetc.torch.shard(model, min_numel=1024)   # in place; every rank together
    opt = torch.optim.AdamW(model.parameters())             # it steps this rank's shards
    loss_fn(model(x), y).backward(); opt.step()             # forward gathers, backward reduce-scatters
    sharded.save("ckpt.pt")                                 # whole tensors, any rank count loads it

Each `Sharded` method that communicates (shard, a forward, full, gathered, state_dict,
load_state_dict, save, load) first runs its checks and local work on every rank, then the ranks
exchange what each found (coconetc.runtime.agree, under its watchdog): an error on any rank
raises on every rank, naming the rank and the parameter, before any buffer changes; a rank that
does not arrive ends the job after COCONET_TIMEOUT, naming it. The collectives are mpi4py's
non-blocking ones, waited for under the same watchdog. docs/sharded_torch.md is the user's page."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from coconetc.ir.slices import slice_range

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


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _raised(label: str, failed: list[tuple[int, tuple]]) -> Exception:
    """The exception every rank raises when some ranks failed: the first failing rank's type
    (where it is a built-in one), its message and every failing rank named."""
    kinds = {x[1] for _, x in failed}
    cls = _KEPT_TYPES.get(failed[0][1][1], RuntimeError) if len(kinds) == 1 else RuntimeError
    text = "; ".join(f"rank {r} failed: {x[1]}: {x[2]}" for r, x in failed)
    return cls(f"{label}: {text}")


class _Gather(torch.autograd.Function):
    """Forward: the whole tensors of every parameter (the sharded ones all-gathered, the whole
    ones as they are). Backward: the sharded ones' gradients reduce-scattered to their shards,
    the whole ones' all-reduced; one call for all parameters, in the same place on every rank."""

    @staticmethod
    def forward(ctx: Any, sharded: Sharded, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.sharded = sharded
        return tuple(sharded._whole(tensors))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        return (None, *ctx.sharded._reduced(grads))


class Sharded:
    """The handle of a module whose parameters `shard()` sharded: see the module's doc and
    docs/sharded_torch.md."""

    def __init__(self, module: torch.nn.Module, *, comm: Any = None, dim: int = 0,
                 dims: dict[str, int] | None = None, params: list[str] | None = None,
                 min_numel: int = 0, reduce: str = "avg"):
        from mpi4py import MPI
        if comm is None:
            comm = MPI.COMM_WORLD
        if not isinstance(comm, MPI.Intracomm):
            raise TypeError(f"coconetc.torch.shard: comm must be an mpi4py intra-communicator "
                            f"(default MPI.COMM_WORLD), got {torch.typename(comm)}")
        if reduce not in ("avg", "sum"):
            raise ValueError(f"coconetc.torch.shard: reduce must be 'avg' (as DDP and FSDP) or 'sum', got {reduce!r}")
        self.module, self.comm, self.reduce = module, comm, reduce
        self.rank, self.ranks = comm.Get_rank(), comm.Get_size()
        self._params: dict[str, torch.nn.Parameter] = {}
        self._owners: dict[str, list[tuple[torch.nn.Module, str]]] = {}
        self._keys: dict[str, str] = {}  # state_dict key -> parameter name (tied ones: several keys)
        self._shards: dict[str, torch.Tensor] = {}
        self._gathering = False
        self.specs = self._agree("shard()", lambda: self._specs(dim, dims, params, min_numel), check=False)
        with torch.no_grad():
            for s in self.specs.values():
                p = self._params[s.name]
                p.data = p.data[part_index(s.shape, s.dim, self.ranks, self.rank)].clone()
                p.grad = None
        self._hooks = [module.register_forward_pre_hook(self._before_forward),
                       module.register_forward_hook(self._after_forward, always_call=True)]

    # --- what is sharded ------------------------------------------------------------------------
    def _specs(self, dim: int, dims: dict[str, int] | None, params: list[str] | None,
               min_numel: int) -> dict[str, Spec]:
        for owner_name, owner in self.module.named_modules(remove_duplicate=False):
            for attr, p in owner._parameters.items():
                if p is None:
                    continue
                name = next((n for n, q in self._params.items() if q is p), None)
                key = f"{owner_name}.{attr}" if owner_name else attr
                if name is None:
                    name = key
                    self._params[name] = p
                    self._owners[name] = []
                if (owner, attr) not in self._owners[name]:
                    self._owners[name].append((owner, attr))
                self._keys[key] = name
        dims = dict(dims or {})
        chosen = set(self._params) if params is None else set(params)
        for n in [*dims, *chosen]:
            if n not in self._params:
                raise ValueError(f"coconetc.torch.shard: the module has no parameter {n!r} "
                                 f"(it has {', '.join(map(repr, self._params)) or 'none'})")
        return {n: self._spec(n, p, dims.get(n, dim) if n in chosen and p.numel() >= min_numel else None)
                for n, p in self._params.items()}

    def _spec(self, name: str, p: torch.Tensor, dim: int | None) -> Spec:
        if p.device.type != "cpu":
            raise ValueError(f"coconetc.torch.shard: parameter {name!r} is on {p.device}; sharded "
                             f"parameters are CPU tensors (communicated over MPI)")
        if dim is not None and p.dim() == 0:
            dim = None  # a 0-d parameter has no dim to shard
        if dim is not None:
            if not -p.dim() <= dim < p.dim():
                raise ValueError(f"coconetc.torch.shard: parameter {name!r} is shaped {tuple(p.shape)}: "
                                 f"it has no dim {dim}")
            dim %= p.dim()
            if not p.is_floating_point():
                raise ValueError(f"coconetc.torch.shard: parameter {name!r} is {p.dtype}; only floating-point "
                                 f"parameters are sharded (their gradients are reduced)")
        return Spec(name, tuple(p.shape), dim, p.dtype)

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
    def _agree(self, what: str, local: Callable[[], T], check: bool = True) -> T:
        """local() on this rank (after the shards' check), then every rank's outcome exchanged
        under the watchdog: any rank's error raises on every rank, naming the rank; ranks whose
        parameters differ raise on every rank, naming the first that differs."""
        from coconetc.runtime import agree
        label = f"coconetc.torch.Sharded.{what}"
        out: Any = None
        try:
            if check:
                self._check_shards()
            out = local()
            mine: tuple = ("ok", agree.digest([s.key() for s in self.specs.values()]) if check else
                           agree.digest([s.key() for s in out.values()]))
        except Exception as err:  # noqa: BLE001 - any failure here is every rank's to know
            mine = ("error", type(err).__name__, str(err))
            failure: Exception | None = err
        else:
            failure = None
        everyone = agree.exchange(self.comm, mine, label, agree.timeout_s())
        failed = [(r, x) for r, x in enumerate(everyone) if x[0] == "error"]
        if failed:
            raise _raised(label, failed) from failure
        if any(x != mine for x in everyone):
            specs = out if not check else self.specs
            self._differ(label, [s.key() for s in specs.values()])
        return out

    def _differ(self, label: str, mine: list[tuple]) -> None:
        """Raises, on every rank, the same error naming the first rank whose parameters are not
        rank 0's and the first that differs."""
        from coconetc.runtime import agree
        everyone = agree.exchange(self.comm, mine, label, agree.timeout_s())
        for r, theirs in enumerate(everyone):
            if theirs != everyone[0]:
                diff = next((f"{b!r} on rank {r}, {a!r} on rank 0" for a, b in zip(everyone[0], theirs) if a != b),
                            f"{len(theirs)} parameters on rank {r}, {len(everyone[0])} on rank 0")
                raise RuntimeError(f"{label}: rank {r} holds other parameters than rank 0 (name, shape, "
                                   f"dim, dtype: {diff}); every rank must shard the same model alike")

    def _check_shards(self) -> None:
        """Each parameter still this rank's part of its whole shape (a shard replaced by a
        tensor of another shape or dtype is refused here, naming it)."""
        for s in self.specs.values():
            p = self._params[s.name]
            want = s.part(self.ranks, self.rank)
            if tuple(p.shape) != want or p.dtype != s.dtype:
                raise ValueError(f"parameter {s.name!r}: this rank holds a {p.dtype} tensor shaped "
                                 f"{tuple(p.shape)}; its part of the whole {tuple(s.shape)} "
                                 f"(dim {s.dim} on {self.ranks} ranks) is {s.dtype} shaped {want}")

    def _wait(self, req: Any, what: str) -> None:
        from coconetc.runtime import agree
        from coconetc.runtime.watchdog import Watchdog
        calls = agree.channel(self.comm) if self.ranks > 1 else None
        if calls is not None:
            calls.n += 1
        Watchdog(self.comm, f"coconetc.torch.Sharded.{what}", agree.timeout_s(), None,
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

    def _reduced(self, grads: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor]:
        """The whole gradients (None: zero) reduced across the ranks (summed, or averaged): each
        sharded one reduce-scattered to this rank's part, each whole one all-reduced; in float32
        (float64 for float64 parameters), one collective of each kind per such dtype."""
        specs = list(self.specs.values())
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, s in enumerate(specs):
            by_dtype.setdefault(_REDUCE_DTYPES.get(s.dtype, torch.float32), []).append(i)
        out: dict[int, torch.Tensor] = {}
        for rdt, idx in by_dtype.items():
            given = {i: grads[i] for i in idx}
            whole = {i: torch.zeros(specs[i].shape, dtype=rdt) if g is None else g.to(rdt) for i, g in given.items()}
            out.update(self._reduce_scatter({i: g for i, g in whole.items() if specs[i].dim is not None}, rdt))
            out.update(self._all_reduce({i: g for i, g in whole.items() if specs[i].dim is None}))
        scale = 1 / self.ranks if self.reduce == "avg" else 1
        return [(out[i] * scale if scale != 1 else out[i]).to(s.dtype) for i, s in enumerate(specs)]

    def _reduce_scatter(self, grads: dict[int, torch.Tensor], rdt: torch.dtype) -> dict[int, torch.Tensor]:
        """Parameter i's whole gradient summed over the ranks, this rank's part of it, for each i."""
        from mpi4py import MPI
        if not grads:
            return {}
        specs = list(self.specs.values())
        blocks = [g[part_index(specs[i].shape, specs[i].dim, self.ranks, r)].reshape(-1)
                  for r in range(self.ranks) for i, g in grads.items()]
        send = torch.cat(blocks)
        counts = [sum(int(np.prod(specs[i].part(self.ranks, r))) for i in grads) for r in range(self.ranks)]
        recv = torch.empty(counts[self.rank], dtype=rdt)
        self._wait(self.comm.Ireduce_scatter(send.numpy(), recv.numpy(), counts, MPI.SUM),
                   "reduce-scatter of the gradients")
        out, at = {}, 0
        for i in grads:
            shape = specs[i].part(self.ranks, self.rank)
            n = int(np.prod(shape))
            out[i] = recv[at:at + n].view(shape)
            at += n
        return out

    def _all_reduce(self, grads: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Parameter i's whole gradient summed over the ranks, for each i."""
        from mpi4py import MPI
        if not grads:
            return {}
        flat = torch.cat([g.reshape(-1) for g in grads.values()])
        self._wait(self.comm.Iallreduce(MPI.IN_PLACE, flat.numpy(), MPI.SUM),
                   "all-reduce of the whole parameters' gradients")
        out, at = {}, 0
        for i, g in grads.items():
            out[i] = flat[at:at + g.numel()].view(g.shape)
            at += g.numel()
        return out

    def _gathered_one(self, s: Spec, root: int | None) -> torch.Tensor | None:
        """Parameter s's whole tensor on every rank (root None) or on rank root alone."""
        from mpi4py import MPI
        part = self._params[s.name].detach()
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

    # --- forward and backward ------------------------------------------------------------------
    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self._gathering:  # inside gathered(): the whole tensors are already there
            return
        tensors = [self._params[n] for n in self.specs]
        self._agree("forward", lambda: None)
        wholes = _Gather.apply(self, *tensors)
        for name, w in zip(self.specs, wholes):
            for owner, attr in self._owners[name]:
                owner._parameters[attr] = w  # (a plain tensor for this forward; put back after it)

    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._gathering:
            return
        for name, p in self._params.items():
            for owner, attr in self._owners[name]:
                owner._parameters[attr] = p
        return None

    # --- whole tensors on demand ---------------------------------------------------------------
    def full(self, name: str) -> torch.Tensor:
        """Parameter NAME's whole tensor, a new one on every rank (collective: every rank calls
        it together; DTensor.full_tensor())."""
        s = self._spec_of(name)
        self._agree(f"full({name!r})", lambda: None)
        whole = self._gathered_one(s, None)
        assert whole is not None
        return whole

    @contextlib.contextmanager
    def gathered(self, modifier_rank: int | None = None) -> Iterator[None]:
        """Inside: every parameter of the module whole on every rank (the same Parameter
        objects, their data the whole tensors; DeepSpeed's GatheredParameters, FSDP2's
        unshard()); on exit each is this rank's part again and the whole tensors are freed.
        modifier_rank=None: what is written to them inside is dropped; a rank: that rank's
        whole values are kept, each rank taking its part of them. Collective on entry and exit;
        meant for no-grad work (inspection, initialisation, evaluation): the gradients are set
        aside inside and put back on exit."""
        if self._gathering:
            raise RuntimeError("coconetc.torch.Sharded.gathered(): already inside gathered()")
        if modifier_rank is not None and not 0 <= modifier_rank < self.ranks:
            raise ValueError(f"coconetc.torch.Sharded.gathered(): modifier_rank {modifier_rank} is not a "
                             f"rank of the communicator (0 to {self.ranks - 1})")
        self._agree(f"gathered(modifier_rank={modifier_rank})", lambda: None)
        parts = {n: (p.data, p.grad) for n, p in self._params.items()}
        with torch.no_grad():
            wholes = self._whole([p.detach() for p in self._params.values()])
        self._gathering = True
        failed: Exception | None = None
        try:
            for (n, p), w in zip(self._params.items(), wholes):
                p.data, p.grad = (w.clone() if self.specs[n].dim is None else w), None
            yield
        except Exception as err:
            failed = err
            raise
        finally:
            self._gathering = False
            self._release(parts, modifier_rank, failed)

    def _release(self, parts: dict[str, tuple[torch.Tensor, Any]], modifier_rank: int | None,
                 failed: Exception | None) -> None:
        """gathered()'s exit: the parts back (from modifier_rank's whole values, where given)."""
        wholes = {n: p.data for n, p in self._params.items()}
        for n, p in self._params.items():
            p.data, p.grad = parts[n]
        what = f"gathered(modifier_rank={modifier_rank}) on exit"
        try:
            self._agree(what, lambda: self._raise(failed))
        except Exception:
            if failed is None:
                raise
            return  # (this rank's own exception goes on)
        if modifier_rank is not None:
            new = self._scattered(wholes, modifier_rank)
            with torch.no_grad():
                for n, p in self._params.items():
                    p.data.copy_(new[n])

    @staticmethod
    def _raise(err: Exception | None) -> None:
        if err is not None:
            raise err

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

    # --- checkpoints ---------------------------------------------------------------------------
    def state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The module's state dict with every tensor whole (the keys and shapes of the module
        before it was sharded: an unsharded copy of it loads it), gathered one parameter at a
        time. rank0_only=True (default): on rank 0 only, every other rank gets {} (a large
        model's whole tensors on one rank; FSDP's full state dict with rank0_only);
        False: on every rank. Collective."""
        self._agree("state_dict()", lambda: None)
        out = {}
        root = 0 if rank0_only else None
        for key, t in self.module.state_dict().items():
            name = self._keys.get(key)
            if name is None:
                out[key] = t.clone()  # a buffer: the same on every rank
                continue
            whole = self._gathered_one(self.specs[name], root)
            if whole is not None:
                out[key] = whole
        return out if root in (None, self.rank) else {}

    def _expected(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The state dict's keys, whole shapes and dtypes."""
        out = {}
        for key, t in self.module.state_dict().items():
            name = self._keys.get(key)
            s = self.specs[name] if name is not None else None
            out[key] = (s.shape, s.dtype) if s is not None else (tuple(t.shape), t.dtype)
        return out

    def _parts_of(self, state_dict: Any) -> dict[str, torch.Tensor]:
        """This rank's part of every tensor of a whole state dict (views of it), checked first:
        every key present, none extra, each a tensor of the whole shape and the dtype."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"expected a dict of whole tensors (as state_dict() returns), got "
                            f"{type(state_dict).__name__}")
        want = self._expected()
        missing = [k for k in want if k not in state_dict]
        extra = [k for k in state_dict if k not in want]
        if missing or extra:
            raise ValueError("the checkpoint does not fit the module: "
                             + "; ".join(([f"missing {', '.join(map(repr, missing))}"] if missing else []) +
                                         ([f"unexpected {', '.join(map(repr, extra))}"] if extra else [])))
        out = {}
        for key, (shape, dtype) in want.items():
            v = state_dict[key]
            if not isinstance(v, torch.Tensor):
                raise ValueError(f"{key!r} is a {type(v).__name__}, not a tensor")
            if tuple(v.shape) != shape or v.dtype != dtype:
                raise ValueError(f"{key!r} is {v.dtype} shaped {tuple(v.shape)}; the module's whole "
                                 f"{key!r} is {dtype} shaped {shape}")
            name = self._keys.get(key)
            out[key] = v[self.index(name)] if name is not None else v
        return out

    def _copy(self, parts: dict[str, torch.Tensor]) -> None:
        targets = self.module.state_dict(keep_vars=True)
        with torch.no_grad():
            for key, part in parts.items():
                targets[key].copy_(part)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Loads whole tensors (state_dict() of any rank count, or an unsharded module's
        state_dict()), given on every rank: each rank keeps its part. Every rank checks them
        first (every key, none extra, each whole shape and dtype) and the ranks agree: a state
        dict that does not fit on any rank raises on every rank, naming the key (and the rank),
        and nothing is changed. Collective."""
        self._copy(self._agree("load_state_dict()", lambda: self._parts_of(state_dict)))

    def save(self, path: str | os.PathLike) -> None:
        """state_dict() written by rank 0 with torch.save to a temporary file in the same
        directory, then renamed to PATH (atomic: PATH is the old file or the whole new one,
        never half of one). A failure on rank 0 raises on every rank. Collective."""
        path = Path(path)
        whole = self.state_dict(rank0_only=True)
        self._agree(f"save({str(path)!r})", lambda: _write(whole, path) if self.rank == 0 else None)

    def load(self, path: str | os.PathLike) -> None:
        """A checkpoint save() wrote (on any number of ranks), read by every rank (memory-mapped:
        a rank reads little more than its part) and loaded as load_state_dict() does. A file
        missing or unreadable on any rank raises on every rank, naming the rank. Collective."""
        def read() -> dict[str, torch.Tensor]:
            return self._parts_of(torch.load(Path(path), map_location="cpu", weights_only=True, mmap=True))
        self._copy(self._agree(f"load({str(path)!r})", read))


def _write(whole: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(whole, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def shard(module: torch.nn.Module, *, comm: Any = None, dim: int = 0, dims: dict[str, int] | None = None,
          params: list[str] | None = None, min_numel: int = 0, reduce: str = "avg") -> Sharded:
    """Keeps MODULE's parameters sharded over the ranks of COMM (mpi4py, default COMM_WORLD), in
    place: each parameter named in PARAMS (default all) with at least MIN_NUMEL elements becomes
    this rank's part of dim DIMS.get(name, DIM); the others stay whole on every rank. Every rank
    calls it with the same module (the same shapes and the same values: each keeps its part of
    its own values). Returns the module's `Sharded` handle. From then on a forward of MODULE
    gathers the whole parameters and its backward reduce-scatters their gradients to the parts
    (REDUCE "avg", as DDP and FSDP, or "sum"), the whole parameters' gradients all-reduced."""
    return Sharded(module, comm=comm, dim=dim, dims=dims, params=params, min_numel=min_numel, reduce=reduce)
