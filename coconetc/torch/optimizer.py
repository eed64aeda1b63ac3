"""`DistributedOptimizer`: a `.ccn` optimizer step as a `torch.optim.Optimizer` (the package's
doc says what it does; docs/pytorch.md). Each parameter group's buffers (`_Group`: the flat
weights the parameters view, the flat gradient, the state in the schedule's layout, in shared
windows where the peers read them in place), the NCCL communicator of the CUDA backend, the
step, and checkpoints (state_dict / load_state_dict, the state gathered and sliced again)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from coconetc.runtime import batch, layout
from coconetc.torch.ops import profiled
from coconetc.torch.params import all_tensors, check_devices, numel, param_groups, param_names
from coconetc.torch.roles import Roles, function_of, plan_of, program_of


def _shared_copy(t: torch.Tensor, dtype: str, comm: Any) -> torch.Tensor:
    """A copy of the 1-d tensor t in a shared window over comm (coconetc.empty; collective)."""
    import coconetc
    out = coconetc.empty((t.numel(),), dtype, comm=comm, framework="torch")
    out.copy_(t)
    return out


def _node_copy(t: torch.Tensor, dtype: str, comm: Any) -> torch.Tensor:
    """The 1-d tensor t in one window for the ranks of comm on this node (shm.empty_node;
    collective), holding the values of the node's first rank (as DDP broadcasts rank 0's)."""
    from coconetc.runtime.node_ranks import node_comm
    from coconetc.runtime.shm import empty_node
    out = empty_node((t.numel(),), dtype, comm=comm, framework="torch")
    node = node_comm(comm)
    try:
        if node.Get_rank() == 0:
            out.copy_(t)
        node.Barrier()  # (every rank reads the values only when they are there)
    finally:
        node.Free()
    return out


class _Group:
    """One parameter group's buffers: the flat weights the parameters view (or the parameters
    themselves as segments), the flat gradient, the state in the schedule's layout, all on the
    backend's device (the parameters' CUDA device; the CPU for the CPU backend and under
    COCONET_CUDA_EMULATE=1)."""

    def __init__(self, opt: DistributedOptimizer, params: list[torch.Tensor]):
        roles = opt._roles
        want = getattr(torch, layout.TORCH_DTYPES[roles.dtype])
        dev = opt._device
        for p in params:
            if p.dtype != want or p.device != dev:
                raise ValueError(f"DistributedOptimizer: a parameter is {p.dtype} on {p.device}; "
                                 f"'{roles.weights}' is {roles.dtype} on {opt._device_words}")
        self.params = params
        self.numels = [p.numel() for p in params]
        self.n = sum(self.numels)
        self.steps = 0
        if roles.scattered:
            for p in params:
                if not p.is_contiguous():
                    p.data = p.data.contiguous()
            self.flat = None
        else:  # packed once; the parameters then view the flat buffer
            self.flat = torch.cat([p.detach().reshape(-1) for p in params]) if params else \
                torch.empty(0, dtype=want, device=dev)
            if opt._shared and opt._side.weights_in_window:  # the peers read this rank's part in place
                opt._everyone_here("a parameter group in shared memory", self.n)  # (sizes agreed first)
                self.flat = (_node_copy if opt._one_copy else _shared_copy)(self.flat, roles.dtype, opt._comm)
            for p, view in zip(params, self._views(self.flat)):
                p.data = view
        gdt = getattr(torch, layout.TORCH_DTYPES[roles.grad_dtype])
        self.gflat = torch.zeros(self.n, dtype=gdt, device=dev)
        if opt._shared and not roles.scattered:  # the gradient too: nothing staged
            self.gflat = opt._side.grad_window(opt, self.gflat, roles.grad_dtype)
        self.gviews = self._views(self.gflat)
        self.state = {q.name: opt._zeros(q.name, self.n) for q in roles.state}
        if roles.master is not None:  # the master weights start as the parameters' values
            self.reset_master(opt)

    def reset_master(self, opt: DistributedOptimizer) -> None:
        master = opt._roles.master
        assert self.flat is not None and master is not None
        t = self.state[master]
        t.copy_(self.flat[opt._index(master, self.n)].to(t.dtype))

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [v.view_as(p) for v, p in zip(flat.split(self.numels), self.params)]

    def gather_grads(self) -> None:
        """The gradients into the flat gradient buffer (nothing to do where autograd already
        accumulated into its views); a parameter without a gradient counts as zero."""
        stale = [(p, v) for p, v in zip(self.params, self.gviews) if p.grad is not v]
        if not stale:
            return
        given = [(p.grad, v) for p, v in stale if p.grad is not None]
        if given:
            torch._foreach_copy_([v for _, v in given], [g for g, _ in given])
        missing = [v for p, v in stale if p.grad is None]
        if missing:
            torch._foreach_zero_(missing)
        for p, v in stale:  # from now on autograd accumulates into the flat buffer
            p.grad = v

    def frozen(self, opt: DistributedOptimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The parameters the step must leave as they are (requires_grad=False: torch.optim
        skips them; the same on every rank, as the model is): (a view, its values before the
        step) for each one's weights and this rank's part of each state tensor, to put back
        after the step. Empty when nothing is frozen."""
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        at = 0
        for p, k in zip(self.params, self.numels):
            a, b = at, at + k
            at = b
            if p.requires_grad:
                continue
            views = [self.flat[a:b] if self.flat is not None else p.view(-1)]
            for name, t in self.state.items():
                index = opt._index(name, self.n)
                if len(index) != 1:  # (a state that is not one value per element)
                    continue
                lo, hi, _ = index[0].indices(self.n)  # this rank's part of it
                if max(a, lo) < min(b, hi):
                    views.append(t.view(-1)[max(a, lo) - lo:min(b, hi) - lo])
            out.extend((v, v.clone()) for v in views)
        return out

    def arguments(self, roles: Roles) -> dict[str, Any]:
        args: dict[str, Any]
        if roles.scattered:
            args = {roles.weights: [p.view(-1) for p in self.params],
                    roles.grads: list(self.gflat.split(self.numels))}
        else:
            args = {roles.weights: self.flat, roles.grads: self.gflat}
        for name, t in self.state.items():
            args[name] = list(t.split(self.numels)) if name in roles.segmented else t
        return args


class _Mpi:
    """How the CPU backend's optimizer communicates and shares its buffers: over an mpi4py
    communicator, the flat weights and gradient in shared-memory windows of the node's ranks."""

    weights_in_window = True  # the flat weights may be in a shared window (one copy a node: shared_weights)
    comm_words = "an mpi4py intra-communicator"

    def connect(self, params: list, source: str | Path, program: str | None, comm: Any,
                process_group: Any) -> tuple[Any, Any, int, int, torch.device, str]:
        """(the module function, the communicator, this rank, the ranks, the device, its words)."""
        from mpi4py import MPI

        from coconetc.runtime.nccl import NcclComm
        if process_group is not None or isinstance(comm, NcclComm):
            raise ValueError("DistributedOptimizer: the CPU backend communicates over MPI (comm= an "
                             "mpi4py communicator); process_group= and NCCL are for backend='cuda'")
        check_devices("DistributedOptimizer", "cpu", param_names(params))
        comm = MPI.COMM_WORLD if comm is None else comm
        return function_of(source, program), comm, comm.Get_rank(), comm.Get_size(), torch.device("cpu"), "the CPU"

    def shared_by_default(self, opt: DistributedOptimizer) -> bool:
        """In shared windows by default where every rank is on this node."""
        return opt._one_node()

    def grad_window(self, opt: DistributedOptimizer, gflat: torch.Tensor, dtype: str) -> torch.Tensor:
        return _shared_copy(gflat, dtype, opt._comm)

    def exchange(self, opt: DistributedOptimizer, mine: Any, label: str) -> list:
        from coconetc.runtime import agree
        return agree.exchange(opt._comm, mine, label, agree.timeout_s())

    def gather(self, opt: DistributedOptimizer, local: torch.Tensor, spans: list[slice], n: int) -> torch.Tensor:
        """Every rank's slice, in place in the whole tensor (MPI Allgatherv)."""
        full = torch.empty(n, dtype=local.dtype)
        item = local.element_size()
        starts = [sl.start * item for sl in spans]
        counts = [(sl.stop - sl.start) * item for sl in spans]
        assert counts[opt._rank] == local.numel() * item
        send = local.contiguous().view(torch.uint8).numpy() if local.numel() else np.empty(0, np.uint8)
        recv = full.view(torch.uint8).numpy() if n else np.empty(0, np.uint8)
        from mpi4py import MPI
        opt._comm.Allgatherv([send, MPI.BYTE], [recv, counts, starts, MPI.BYTE])
        return full


class _Nccl:
    """How the CUDA backend's optimizer communicates and shares its buffers: over the module's
    NCCL communicator (made over an mpi4py communicator or a torch.distributed group), the flat
    gradient in a window of it; checkpoints through the host."""

    weights_in_window = False
    comm_words = "an mpi4py intra-communicator or a coconetc.runtime.cuda.NcclComm"

    def connect(self, params: list, source: str | Path, program: str | None, comm: Any,
                process_group: Any) -> tuple[Any, Any, int, int, torch.device, str]:
        from coconetc.runtime.nccl import NcclComm
        check_devices("DistributedOptimizer", "cuda", param_names(params))
        fn = function_of(source, program, backend="cuda")
        comm = comm if isinstance(comm, NcclComm) else _nccl(fn.ext, comm, process_group)
        return fn, comm, comm.rank, comm.size, fn.backend.torch_device(), fn.backend.device_words()

    def shared_by_default(self, opt: DistributedOptimizer) -> bool:
        """The gradient in a window of the communicator wherever there are peers to read it."""
        return opt._size > 1

    def grad_window(self, opt: DistributedOptimizer, gflat: torch.Tensor, dtype: str) -> torch.Tensor:
        """In a window of the NCCL communicator: the symmetric kernel's peers read it in place."""
        from coconetc.runtime.symmetric_windows import window_empty
        return window_empty(opt._fn.ext, opt._comm, (gflat.numel(),), dtype).zero_()

    def exchange(self, opt: DistributedOptimizer, mine: Any, label: str) -> list:
        """Over the NCCL communicator's MPI communicator or torch.distributed group."""
        from coconetc.runtime import agree
        from coconetc.runtime.nccl import exchange
        return exchange(opt._comm, mine, label, agree.timeout_s())

    def gather(self, opt: DistributedOptimizer, local: torch.Tensor, spans: list[slice], n: int) -> torch.Tensor:
        """Every rank's slice copied to the host and exchanged over the NCCL communicator's MPI
        communicator or torch.distributed group (a checkpoint is not the hot path), the whole
        tensor back on this optimizer's device."""
        comm: Any = opt._comm
        mine = local.detach().cpu()
        parts: list[Any]
        if comm.size == 1:
            parts = [mine]
        elif comm.mpi is not None:
            parts = comm.mpi.allgather(mine)
        else:
            import torch.distributed as dist
            parts = [None] * comm.size
            dist.all_gather_object(parts, mine, group=comm.host_group or comm.group)
        for sl, part in zip(spans, parts):
            assert part.numel() == sl.stop - sl.start, (sl, part.shape)
        full = torch.cat(parts) if parts else torch.empty(0, dtype=local.dtype)
        assert full.numel() == n
        return full.to(opt._device)


# What differs between the backends' optimizers, one object each (DistributedOptimizer(backend=))
_SIDES: dict[str, _Mpi | _Nccl] = {"cpu": _Mpi(), "cuda": _Nccl()}

_NCCL: dict[tuple, Any] = {}


def _nccl(ext: Any, comm: Any, process_group: Any) -> Any:
    """The NCCL communicator (runtime/nccl.py: nccl_comm) over `comm` (mpi4py) or over a
    torch.distributed `process_group`, made once per module and communicator in this process
    (collective the first time: every rank constructs its optimizer together)."""
    from coconetc.runtime.backends import backend_for
    from coconetc.runtime.nccl import nccl_comm
    backend_for("cuda").before_communicator()  # (the emulated NCCL runs on MPI: initialized first)
    key = (id(ext), id(process_group) if process_group is not None else id(comm))
    if key not in _NCCL:
        _NCCL[key] = (nccl_comm(ext, comm, process_group=process_group), comm, process_group)
    return _NCCL[key][0]


_NOT_TRACED = ("coconetc DistributedOptimizer.step() runs a compiled coconet program that updates "
               "the flat parameter buffers in place and communicates (MPI/NCCL) outside PyTorch's "
               "view; torch.compile does not trace it: call opt.step() outside the compiled "
               "function (compile the model, or the forward and backward, and step after them; "
               "docs/pytorch.md, 'torch.compile and torch.export')")


class DistributedOptimizer(torch.optim.Optimizer):
    """A torch optimizer whose step is a compiled coconet program (see the module's doc)."""

    def __init__(self, params: Any, source: str | Path, *, program: str | None = None,
                 schedule: str = "default", comm: Any = None, weights: str = "w",
                 grads: str = "g", step: str | None = "step", shared_memory: bool | None = None,
                 shared_weights: bool | None = None,
                 backend: str | None = None, process_group: Any = None, master: str | None = None,
                 across_groups: bool = False, skipped: str | None = None,
                 feedback: dict[str, str] | None = None, **scalars: Any):
        params = param_groups(params)
        backend = self._settings(params, backend, shared_memory, across_groups)
        self._connect(params, source, program, comm, process_group)
        try:
            if schedule == "auto":  # the tuning cache's choice (of this backend) for this model's size, fixed now
                schedule = self._fn.resolve_schedule("auto", comm=self._comm,
                                                     **{self._fn_size(weights): numel(params)})
            program_of(self._fn, schedule)  # an unknown schedule raises, naming the known ones
        except ValueError as err:  # (named: the CUDA module's messages name only the program)
            raise ValueError(f"DistributedOptimizer({self._fn.name}): {err}") from None
        self._schedule = schedule
        self._roles = Roles(self._fn, schedule, weights, grads, step, scalars, master)
        self._skipped, self._feedback = self._roles.returned(skipped, feedback)
        self.outputs: list[dict[str, torch.Tensor]] = []
        if shared_memory is None:  # in place where it is safe: flat weights on one node (CPU), a flat gradient (CUDA)
            self._shared = not self._roles.scattered and self._side.shared_by_default(self)
        self._one_copy = self._node_weights(shared_weights, source, schedule)
        self._groups: list[_Group] = []
        defaults = {k: float(v) if isinstance(v, torch.Tensor) else v for k, v in scalars.items()}
        super().__init__(params, defaults)
        for g in self.param_groups:
            missing = [s for s in self._roles.scalars if s not in g]
            if missing:
                raise TypeError(f"DistributedOptimizer({self._fn.name}): no value for the "
                                f"scalar {missing[0]!r} (pass {missing[0]}=...)")

    @property
    def shared_memory(self) -> bool:
        """Whether the flat buffers are where the peers read them in place (shared_memory=): on
        the CPU backend the weights and gradients in shared windows, on the CUDA backend the
        gradient in a window of the NCCL communicator."""
        return self._shared

    @property
    def shared_weights(self) -> bool:
        """Whether the ranks of this node hold one copy of the weights (shared_weights=)."""
        return self._one_copy

    def _node_weights(self, asked: bool | None, source: str | Path, schedule: str) -> bool:
        """Whether the node's ranks hold one copy of the weights (shared_weights): where the
        weights are in shared memory and each rank writes only its own part of them in a step
        (plan.own_part_only), so the all-gather has nothing to copy; None: wherever so."""
        if asked is not None and not isinstance(asked, bool):
            raise TypeError(f"DistributedOptimizer: shared_weights must be None, True or False, got {asked!r}")
        if asked is False:
            return False
        why = ("the weights are not in shared memory (shared_memory=False, the CUDA backend, scattered "
               "weights, or ranks on several nodes)"
               if not self._shared or self._roles.scattered or not self._side.weights_in_window else
               f"schedule {schedule!r} does not write each rank's part of '{self._roles.weights}' alone "
               f"(a fused collective's all-gather into it does: `zero`)"
               if not plan_of(source, self._fn, schedule).own_part_only(self._roles.weights) else "")
        if asked and why:
            raise ValueError(f"DistributedOptimizer({self._fn.name}): shared_weights=True: {why}; "
                             f"leave shared_weights out to decide where it can")
        return not why

    def _settings(self, params: list, backend: str | None, shared_memory: bool | None,
                  across_groups: bool) -> str:
        """The backend (None: the parameters' device), shared_memory and across_groups checked."""
        if backend is not None and backend not in _SIDES:
            raise ValueError(f"DistributedOptimizer: backend must be {', '.join(map(repr, _SIDES))} or None "
                             f"(the parameters' device), got {backend!r}")
        if backend is None:
            backend = "cuda" if any(p.is_cuda for p in all_tensors(params)) else "cpu"
        self._backend = backend
        self._side = _SIDES[backend]
        if shared_memory is not None and not isinstance(shared_memory, bool):
            raise TypeError(f"DistributedOptimizer: shared_memory must be None, True or False, got {shared_memory!r}")
        self._shared = bool(shared_memory)
        if not isinstance(across_groups, bool):
            raise TypeError(f"DistributedOptimizer: across_groups must be True or False, got {across_groups!r}")
        self._across = across_groups
        return backend

    def _connect(self, params: list, source: str | Path, program: str | None, comm: Any,
                 process_group: Any) -> None:
        """The backend's module function, communicator and device; the parameters on that device."""
        from coconetc.runtime.nccl import NcclComm
        if comm is not None and not isinstance(comm, NcclComm):
            from mpi4py import MPI
            if not isinstance(comm, MPI.Intracomm):
                raise TypeError(f"DistributedOptimizer: comm must be {self._side.comm_words} "
                                f"(default MPI.COMM_WORLD), got {torch.typename(comm)}")
        (self._fn, self._comm, self._rank, self._size, self._device,
         self._device_words) = self._side.connect(params, source, program, comm, process_group)

    def _one_node(self) -> bool:
        """Whether every rank of the communicator shares this node's memory (collective: an
        exchange under the watchdog, so a rank that never constructs the optimizer ends the
        job instead of leaving the others waiting)."""
        from coconetc.runtime import agree, shm
        what = f"DistributedOptimizer({self._fn.name})"
        agree.exchange(self._comm, None, what, agree.timeout_s())
        return shm.one_node(self._comm)

    def _fn_size(self, weights: str) -> str:
        q = layout.param(program_of(self._fn, None), weights, "DistributedOptimizer")
        return str(q.type.shape[0]) if q.type.shape else "N"

    def _where(self, name: str, n: int) -> tuple[Any, list[int]]:
        p = self._roles.p
        what = f"DistributedOptimizer({self._fn.name})"
        q = layout.param(p, name, what)
        return q, layout.bind(p, q, {str(self._roles.size): n}, what)

    def _index(self, name: str, n: int, rank: int | None = None) -> tuple[slice, ...]:
        """The index of rank's (default: this rank's) part of state NAME in the whole tensor."""
        q, shape = self._where(name, n)
        return layout.local_index(q, shape, self._size, self._rank if rank is None else rank)

    def _zeros(self, name: str, n: int) -> torch.Tensor:
        """State NAME in this rank's layout under the schedule, zeros on the backend's device."""
        q, shape = self._where(name, n)
        return torch.zeros(layout.local_shape(q, shape, self._size, self._rank),
                           dtype=getattr(torch, layout.TORCH_DTYPES[q.type.dtype]), device=self._device)

    @property
    def schedule(self) -> str:
        """The schedule each step runs (the tuner's choice under schedule="auto")."""
        return self._schedule

    @property
    def backend(self) -> str:
        """"cpu" or "cuda" (the CUDA module; under COCONET_CUDA_EMULATE=1 its host emulation)."""
        return self._backend

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._groups.append(_Group(self, self.param_groups[-1]["params"]))

    @property
    def state_tensors(self) -> list[dict[str, torch.Tensor]]:
        """This rank's optimizer state, per parameter group: name -> tensor in the schedule's
        layout (under `slice(m, v)`, this rank's slice)."""
        return [dict(g.state) for g in self._groups]

    @torch.compiler.disable(reason=_NOT_TRACED)
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        returned: list[tuple[_Group, dict, Any]] = []
        frozen: list[tuple[torch.Tensor, torch.Tensor]] = []
        grad = torch.is_grad_enabled()
        torch.set_grad_enabled(False)  # (as torch.no_grad(), at half its cost: a step's host time counts)
        try:
            with batch.together() if self._across else contextlib.nullcontext():
                for group, opts in zip(self._groups, self.param_groups):
                    if group.n == 0:
                        continue
                    group.gather_grads()
                    frozen.extend(group.frozen(self))
                    group.steps += 1
                    args = group.arguments(self._roles)
                    for s in self._roles.scalars:
                        v = opts[s]
                        args[s] = v.item() if isinstance(v, torch.Tensor) else v
                    if self._roles.step is not None:
                        args[self._roles.step] = group.steps
                    with profiled(self._fn, self._schedule):
                        returned.append((group, opts, self._fn(schedule=self._schedule, comm=self._comm, **args)))
                    if group.flat is not None:  # the parameters view the flat buffer: bump them
                        torch.autograd.graph.increment_version(group.params)
            for view, before in frozen:  # (after a batch has run) the frozen parameters as they were
                view.copy_(before)
        finally:
            torch.set_grad_enabled(grad)
        self._returned(returned)
        return loss

    def _returned(self, returned: list[tuple[_Group, dict, Any]]) -> None:
        """The program's outputs of each group's call (after a batch, once it has run):
        `outputs`; a skipped step (skipped=) does not count; feedback= sets scalars."""
        names = self._roles.outputs
        self.outputs = []
        for group, opts, out in returned:
            values = out if isinstance(out, tuple) else () if out is None else (out,)
            got = {n: torch.as_tensor(v) for n, v in zip(names, values)}
            self.outputs.append(got)
            if self._skipped is not None and bool(got[self._skipped] != 0):
                group.steps -= 1  # as torch's GradScaler, which does not call step() then
            for scalar, output in self._feedback.items():
                opts[scalar] = got[output].item()

    # --- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The whole state on every rank (slices gathered), as torch optimizers lay it out:
        {"state": {param index: {"step": tensor, name: tensor shaped like the parameter}},
         "param_groups": [{scalar: value, ..., "params": [indices]}]}. The state tensors are on
        the optimizer's device (CPU tensors load on any backend)."""
        self._everyone_here("state_dict()")
        state: dict[int, dict[str, torch.Tensor]] = {}
        groups = []
        index = 0
        for group, opts in zip(self._groups, self.param_groups):
            full = {name: self._gather(name, t, group.n) for name, t in group.state.items()}
            idx = list(range(index, index + len(group.params)))
            index += len(group.params)
            if group.steps:
                parts = {name: f.split(group.numels) for name, f in full.items()}
                for k, (i, p) in enumerate(zip(idx, group.params)):
                    entry = {"step": torch.tensor(float(group.steps))}
                    entry.update({name: parts[name][k].view(p.shape).clone() for name in parts})
                    state[i] = entry
            groups.append({**{k: v for k, v in opts.items() if k != "params"}, "params": idx})
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state_dict() taken under any schedule, rank count and backend: the state is
        sliced again for this optimizer's schedule and this rank, and copied to its device.
        Everything is checked first (groups, parameters, every state tensor's name and shape,
        step counts, the scalars' types): a state dict that does not fit raises, naming what,
        and leaves the optimizer as it was."""
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("param_groups"), list) \
                or not isinstance(state_dict.get("state", {}), dict):
            raise ValueError("DistributedOptimizer.load_state_dict: expected a dict with 'param_groups' (a list) "
                             "and 'state' (a dict), as state_dict() returns")
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        for sg, group in zip(saved, self._groups):
            if not isinstance(sg, dict) or len(sg.get("params", ())) != len(group.params):
                raise ValueError("loaded state dict contains a parameter group that doesn't "
                                 "match the size of optimizer's group")
        states = {int(k): v for k, v in state_dict.get("state", {}).items()}
        loads = [self._check_group(g, sg, group, states) for g, (sg, group) in enumerate(zip(saved, self._groups))]
        for load, sg, group, opts in zip(loads, saved, self._groups, self.param_groups):
            steps, parts = load
            group.steps = steps
            for name, t in group.state.items():
                part = parts.get(name)
                if part is None:
                    t.zero_()
                else:
                    t.copy_(part)
            if self._roles.master is not None and self._roles.master not in parts:
                group.reset_master(self)  # no master weights saved: the parameters' values
            opts.update({k: v for k, v in sg.items() if k != "params"})

    def _check_group(self, g: int, sg: dict, group: _Group, states: dict[int, Any]) -> tuple[int, dict]:
        """Group g of a state dict checked against this optimizer's group: (its step count, this
        rank's part of each state tensor it holds, on the optimizer's device); raises, naming
        what does not fit, before anything is changed."""
        what = f"loaded state dict: param group {g}"
        for s in self._roles.scalars:
            v = sg.get(s)
            if s in sg and not (isinstance(v, torch.Tensor) and v.numel() == 1) and \
                    (isinstance(v, bool) or not isinstance(v, (int, float, np.number))):
                raise ValueError(f"{what}: scalar {s!r} is {v!r}; it must be a number")
        entries = [states.get(int(i)) for i in sg["params"]]
        if all(e is None for e in entries):
            return 0, {}
        if any(e is None for e in entries):
            raise ValueError("loaded state dict has state for only some parameters of a group")
        for i, e in zip(sg["params"], entries):
            if not isinstance(e, dict) or "step" not in e:
                raise ValueError(f"{what}: the state of parameter {i} has no 'step'")
        steps = {float(e["step"]) for e in entries}  # type: ignore[index]
        if len(steps) != 1:
            raise ValueError(f"loaded state dict: the parameters of a group are at different steps {sorted(steps)}")
        step = steps.pop()
        if step != int(step) or step < 0:
            raise ValueError(f"{what}: step {step} is not a step count")
        parts = {}
        for name, t in group.state.items():
            if name == self._roles.master and all(name not in e for e in entries):  # type: ignore[operator]
                continue  # a checkpoint without master weights: the parameters' values
            whole = torch.cat([self._saved_tensor(g, i, e, p, name, t)  # type: ignore[arg-type]
                               for i, e, p in zip(sg["params"], entries, group.params)]) \
                if group.params else t.new_empty(0)
            parts[name] = whole[self._index(name, group.n)].clone()
        return int(step), parts

    @staticmethod
    def _saved_tensor(g: int, i: Any, entry: dict, p: torch.Tensor, name: str, like: torch.Tensor) -> torch.Tensor:
        """State NAME of parameter i (of group g) in a state dict, flat, on like's device and
        dtype; missing, or shaped otherwise than the parameter, is a ValueError naming it."""
        v = entry.get(name)
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"loaded state dict: {name!r} of parameter {i} (param group {g}) is "
                             f"missing (its state has {', '.join(map(repr, entry)) or 'nothing'})")
        if tuple(v.shape) != tuple(p.shape):
            raise ValueError(f"loaded state dict: {name!r} of parameter {i} (param group {g}) is "
                             f"shaped {tuple(v.shape)}; the parameter is {tuple(p.shape)}")
        return v.reshape(-1).to(device=like.device, dtype=like.dtype)

    def _everyone_here(self, what: str, extra: Any = None) -> None:
        """Every rank of the communicator must be here (gathering the state is collective): a
        rank that is not makes the job end after COCONET_TIMEOUT, naming it, instead of hanging;
        ranks whose groups differ in size raise on every rank."""
        mine = ("coconetc.torch", what, [g.n for g in self._groups], extra)
        label = f"DistributedOptimizer.{what} ({self._fn.name}, schedule {self._schedule!r})"
        everyone = self._side.exchange(self, mine, label)
        bad = [r for r, x in enumerate(everyone) if x != mine]
        if bad:
            raise RuntimeError(f"{label}: rank {bad[0]} is not doing the same (it is at "
                               f"{everyone[bad[0]]!r}, this rank at {mine!r}); every rank must call "
                               f"{what} together, with the same parameter shapes")

    def _gather(self, name: str, local: torch.Tensor, n: int) -> torch.Tensor:
        """The whole tensor from every rank's slice (a copy of it when it is not sliced)."""
        if name not in self._roles.sliced:
            return local.clone()
        return self._side.gather(self, local, [self._index(name, n, r)[0] for r in range(self._size)], n)
