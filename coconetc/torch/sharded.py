"""A model's parameters kept sharded over the data-parallel ranks between steps (as FSDP2's
`fully_shard` and DeepSpeed's ZeRO-3 keep them), in coconet's slicing convention: a rank holds
`slice_range(n, R, rank)` of each sharded parameter's dim `d` (coconetc.ir.slices), exactly the
part a `.ccn` program's `sliced(d)` parameter takes, so a shard is passed to a program as it is.

    sharded = coconetc.torch.shard(model, min_numel=1024)   # in place; every rank together
    opt = torch.optim.AdamW(model.parameters())             # it steps this rank's shards
    loss_fn(model(x), y).backward(); opt.step()             # forward gathers, backward reduce-scatters
                                                            # (a unit at a time: units.py)
    sharded.save("ckpt.pt")                                 # whole tensors, any rank count loads it

Each `Sharded` call that communicates (shard, a forward, full, gathered, state_dict,
load_state_dict, optim_state_dict, load_optim_state_dict, save, load) first runs its checks and
local work on every rank, then the ranks exchange what each found (coconetc.runtime.agree,
under its watchdog): an error on any rank raises on every rank, naming the rank and the
parameter, before any buffer changes; a rank that does not arrive ends the job after
COCONET_TIMEOUT, naming it. A backward does not agree first: its collectives are waited for
under the same watchdog, as all are (parts.py: mpi4py's non-blocking collectives). The
optimizer's whole state is optim_state.py's; docs/sharded_torch.md is the user's page."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from coconetc.torch import optim_state
from coconetc.torch.parts import Parts, Spec, part_index
from coconetc.torch.units import Unit, Units


class Sharded(Parts):
    """The handle of a module whose parameters `shard()` sharded: see the module's doc and
    docs/sharded_torch.md."""

    def __init__(self, module: torch.nn.Module, *, comm: Any = None, dim: int = 0,
                 dims: dict[str, int] | None = None, params: list[str] | None = None,
                 min_numel: int = 0, reduce: str = "avg", units: list[str] | None = None,
                 reshard_after_forward: bool = True, prefetch: int = 1):
        from mpi4py import MPI
        if comm is None:
            comm = MPI.COMM_WORLD
        if not isinstance(comm, MPI.Intracomm):
            raise TypeError(f"coconetc.torch.shard: comm must be an mpi4py intra-communicator "
                            f"(default MPI.COMM_WORLD), got {torch.typename(comm)}")
        if reduce not in ("avg", "sum"):
            raise ValueError(f"coconetc.torch.shard: reduce must be 'avg' (as DDP and FSDP) or 'sum', got {reduce!r}")
        if isinstance(getattr(module, "_coconet_sharded", None), Sharded):
            raise ValueError("coconetc.torch.shard: the module is sharded already (its Sharded handle: "
                             "module._coconet_sharded)")
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            raise ValueError(f"coconetc.torch.shard: prefetch must be an int >= 0 (units gathered ahead), got {prefetch!r}")
        if units is not None and (isinstance(units, str) or not all(isinstance(u, str) for u in units)):
            raise TypeError(f"coconetc.torch.shard: units must be a list of submodule names, got {units!r}")
        super().__init__(comm, reduce)
        self.module = module
        self._owners: dict[str, list[tuple[torch.nn.Module, str]]] = {}
        self._keys: dict[str, str] = {}  # state_dict key -> parameter name (tied ones: several keys)
        plan: dict[str, list[str]] = {}

        def local() -> dict[str, Spec]:
            specs = self._specs(dim, dims, params, min_numel)
            plan.update(self._plan(units))
            return specs
        self.specs = self._agree("shard()", local, check=False,
                                 describe=lambda specs: [s.key() for s in specs.values()] +
                                 [("unit", u, *ns) for u, ns in plan.items()])
        mods = dict(module.named_modules())
        self.units = Units(self, [Unit(u, mods[u], ns, comm.Dup()) for u, ns in plan.items()],
                           bool(reshard_after_forward), prefetch)
        with torch.no_grad():
            for s in self.specs.values():
                p = self._params[s.name]
                p.data = p.data[part_index(s.shape, s.dim, self.ranks, self.rank)].clone()
                p.grad = None
        object.__setattr__(module, "_coconet_sharded", self)
        self._hooks = [module.register_forward_pre_hook(self._before_forward),
                       module.register_forward_hook(self._after_forward, always_call=True)]
        for u in self.units.units[1:]:
            self._hooks += [u.module.register_forward_pre_hook(lambda m, a, u=u: self._before_unit(u)),
                            u.module.register_forward_hook(lambda m, a, o, u=u: self._after_unit(u, o),
                                                           always_call=True)]

    # --- what is sharded ------------------------------------------------------------------------
    def _specs(self, dim: int, dims: dict[str, int] | None, params: list[str] | None,
               min_numel: int) -> dict[str, Spec]:
        seen: dict[int, str] = {}  # id of a parameter -> its name (the first of a tied one's)
        for owner_name, owner in self.module.named_modules(remove_duplicate=False):
            for attr, p in owner._parameters.items():
                if p is None:
                    continue
                key = f"{owner_name}.{attr}" if owner_name else attr
                name = seen.setdefault(id(p), key)
                if name == key:
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
        return Spec(name, tuple(p.shape), dim, p.dtype)

    def _plan(self, units: list[str] | None) -> dict[str, list[str]]:
        """Unit name ("" the root) -> the names of the parameters it gathers: each parameter
        goes to the deepest unit holding every module that owns it (the root where none does).
        UNITS None: each child of the first nn.ModuleList (in named_modules() order)."""
        mods = dict(self.module.named_modules())
        if units is None:
            first = next((n for n, m in mods.items() if isinstance(m, torch.nn.ModuleList) and n), None)
            units = [f"{first}.{c}" for c, _ in mods[first].named_children()] if first is not None else []
        for u in units:
            if u not in mods or u == "":
                raise ValueError(f"coconetc.torch.shard: units: the module has no submodule {u!r}")
            if isinstance(mods[u], (torch.nn.ModuleList, torch.nn.ModuleDict)):
                raise ValueError(f"coconetc.torch.shard: units: {u!r} is a {type(mods[u]).__name__}, whose "
                                 f"forward never runs (its hooks would not gather): name its children")
        if len(set(units)) != len(units):
            raise ValueError(f"coconetc.torch.shard: units: a submodule named twice in {units!r}")
        owner_names = {id(m): n for n, m in self.module.named_modules(remove_duplicate=False)}

        def unit_of(mod: torch.nn.Module) -> str:
            n = owner_names[id(mod)]
            within = [u for u in units if n == u or n.startswith(u + ".")]
            return max(within, key=len) if within else ""
        plan: dict[str, list[str]] = {"": [], **{u: [] for u in units}}
        for name, owners in self._owners.items():
            homes = {unit_of(owner) for owner, _ in owners}
            plan[homes.pop() if len(homes) == 1 else ""].append(name)
        return plan

    # --- forward and backward ------------------------------------------------------------------
    def _agree(self, *args: Any, **kwargs: Any) -> Any:
        if hasattr(self, "units"):
            self.units.flush()  # (the last backward's reductions, if a caller bypassed its end)
        return super()._agree(*args, **kwargs)

    def _put(self, u: Unit, tensors: list[torch.Tensor] | None) -> None:
        """U's parameters on their owning modules: TENSORS (whole, for its forward) or the parts."""
        for i, name in enumerate(u.names):
            for owner, attr in self._owners[name]:
                owner._parameters[attr] = self._params[name] if tensors is None else tensors[i]  # type: ignore[assignment]

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self._gathering:  # inside gathered(): the whole tensors are already there
            return
        self._agree("forward", lambda: None)
        self._before_unit(self.units.root)

    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._gathering:
            return
        self._after_unit(self.units.root, output)
        return None

    def _before_unit(self, u: Unit) -> None:
        if not self._gathering:
            self._put(u, self.units.before(u))

    def _after_unit(self, u: Unit, output: Any) -> None:
        if not self._gathering:
            self._put(u, None)
            self.units.after(u, output)

    # --- whole tensors on demand ---------------------------------------------------------------
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
            whole = self._gathered_one(self.specs[name], self._params[name], root)
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

    def optim_state_dict(self, optimizer: torch.optim.Optimizer, rank0_only: bool = True) -> dict[str, Any]:
        """OPTIMIZER's state (a torch optimizer stepping this module's parameters) with whole
        tensors, keyed by parameter name: {"state": {name: {...}}, "param_groups": [{...,
        "params": [names]}]}; on rank 0 only ({} elsewhere) or on every rank (coconetc/torch/
        optim_state.py). Collective."""
        return optim_state.optim_state_dict(self, optimizer, rank0_only)

    def load_optim_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        """Loads a whole optimizer state (optim_state_dict() on any number of ranks), given on
        every rank, into OPTIMIZER, each rank keeping its part; checked and agreed first.
        Collective."""
        optim_state.load_optim_state_dict(self, optimizer, state_dict)

    def adamw_in_backward(self, params: Any = None, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                          eps: float = 1e-8, weight_decay: float = 1e-2,
                          shared_memory: bool = False) -> torch.optim.Optimizer:
        """From now on every backward also steps the module with AdamW (torch.optim.AdamW's
        arguments and update), each unit's parameters as soon as its gradients are made: the
        sharded ones inside the reduce-scatter of their gradients (examples/adamw_sharded.ccn,
        one fused collective a unit), the whole ones after their all-reduce. No gradient is
        stored (.grad stays None) and there is nothing left to step after the backward.
        PARAMS: the module's parameters to step, or param groups (dicts, as torch.optim's
        first argument: nanoGPT's two, with and without weight decay); default every
        trainable parameter in one group. Returns the optimizer that holds AdamW's state and
        hyperparameters (change a group's lr between steps, or give it to a learning-rate
        scheduler; pass it to save/load/optim_state_dict); its step() does nothing. No
        global-norm clipping: see docs/sharded_torch.md. The trainable parameters must be
        float32. SHARED_MEMORY: the fused collectives through a shared-memory window (ranks on
        one machine; the window stays, twice the largest unit's gradient on every rank, and its
        peers' pages mapped) instead of point-to-point messages (the default: the least memory,
        and as fast on the CPU: docs/sharded_torch.md). Collective."""
        from coconetc.torch.in_backward import AdamWInBackward, check_parameters

        def local() -> AdamWInBackward:
            if self.units.in_backward is not None:
                raise ValueError("adamw_in_backward() was called already: change the returned optimizer's "
                                 "param_groups (each group's lr, betas, eps, weight_decay) instead")
            if not isinstance(shared_memory, bool):
                raise TypeError(f"adamw_in_backward: shared_memory must be True or False, got {shared_memory!r}")
            check_parameters(self.units)
            return AdamWInBackward(self.units, params, lr, betas, eps, weight_decay, shared_memory)
        opt = self._agree("adamw_in_backward()", local)
        self.units.in_backward = opt
        return opt

    def save(self, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None) -> None:
        """state_dict() (and, with OPTIMIZER, {"model": state_dict(), "optimizer":
        optim_state_dict(optimizer)}) written by rank 0 with torch.save to a temporary file in
        the same directory, then renamed to PATH (atomic: PATH is the old file or the whole new
        one, never half of one). A failure on rank 0 raises on every rank. Collective."""
        path = Path(path)
        whole: dict[str, Any] = self.state_dict(rank0_only=True)
        if optimizer is not None:
            whole = {"model": whole, "optimizer": self.optim_state_dict(optimizer)}
        self._agree(f"save({str(path)!r})", lambda: _write(whole, path) if self.rank == 0 else None)

    def load(self, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None) -> None:
        """A checkpoint save() wrote (on any number of ranks), read by every rank (memory-mapped:
        a rank reads little more than its part) and loaded as load_state_dict() (and, with
        OPTIMIZER, load_optim_state_dict()) do: every rank checks all of it before the ranks
        agree and anything changes. A file missing or unreadable on any rank raises on every
        rank, naming the rank. Collective."""
        def read() -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
            whole = torch.load(Path(path), map_location="cpu", weights_only=True, mmap=True)
            paired = isinstance(whole, dict) and set(whole) == {"model", "optimizer"} and \
                "model" not in self._expected()
            if optimizer is not None and not paired:
                raise ValueError(f"{str(path)!r} holds no optimizer state (saved without optimizer=)")
            model = whole["model"] if paired else whole
            return self._parts_of(model), \
                optim_state.local_state(self, optimizer, whole["optimizer"]) if optimizer is not None else None
        parts, local = self._agree(f"load({str(path)!r})", read)
        self._copy(parts)
        if optimizer is not None and local is not None:
            optimizer.load_state_dict(local)


def _write(whole: dict[str, Any], path: Path) -> None:
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
          params: list[str] | None = None, min_numel: int = 0, reduce: str = "avg",
          units: list[str] | None = None, reshard_after_forward: bool = True, prefetch: int = 1) -> Sharded:
    """Keeps MODULE's parameters sharded over the ranks of COMM (mpi4py, default COMM_WORLD), in
    place: each parameter named in PARAMS (default all) with at least MIN_NUMEL elements becomes
    this rank's part of dim DIMS.get(name, DIM); the others stay whole on every rank. Every rank
    calls it with the same module (the same shapes and the same values: each keeps its part of
    its own values). Returns the module's `Sharded` handle. From then on a forward of MODULE
    gathers the whole parameters and its backward reduce-scatters their gradients to the parts
    (REDUCE "avg", as DDP and FSDP, or "sum"), the whole parameters' gradients all-reduced.

    The parameters are gathered a unit at a time (units.py): UNITS names submodules (default
    each child of the first nn.ModuleList, as nanoGPT's blocks; [] the whole module as one),
    the root's remaining parameters one more unit. A unit's whole tensors exist while it runs;
    RESHARD_AFTER_FORWARD=False keeps them from its forward to the end of its backward instead
    of gathering again. PREFETCH: how many units ahead the forward (and the backward, behind)
    starts gathering. A unit's gradients' reduce-scatter starts as its backward ends and is
    waited for at the end of the backward."""
    return Sharded(module, comm=comm, dim=dim, dims=dims, params=params, min_numel=min_numel, reduce=reduce,
                   units=units, reshard_after_forward=reshard_after_forward, prefetch=prefetch)
