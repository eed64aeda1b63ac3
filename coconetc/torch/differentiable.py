"""`function`: a `.ccn` program as a differentiable torch function, its forward the compiled
program and its backward the compiled derived program (docs/autodiff.md), each call a pair of
torch.library custom operators (ops.py)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from coconetc.runtime import layout
from coconetc.torch import ops as torch_ops
from coconetc.torch.params import FLOATS, bind, check_devices, load


def function(source: str | Path, program: str | None = None, *, schedule: str = "default",
             grad_schedule: str = "default", comm: Any = None, groups: int = 1,
             backend: str | None = None, process_group: Any = None) -> Differentiable:
    """PROGRAM of the .ccn file SOURCE as a differentiable function: `f(**tensors_and_scalars)`
    runs the compiled forward (under `schedule`) and returns the program's outputs (a tuple when
    it returns several) as tensors whose backward pass runs the compiled derived program (under
    `grad_schedule`, a `schedule s for grad(program)` of the file; docs/autodiff.md).

    Every tensor argument is this rank's part in the program's layout (replicated: the full
    tensor; sliced: this rank's slice; local: its own); after `backward()` its `.grad` holds the
    gradient in the same layout (a replicated input's gradient is the full gradient, the same
    on every rank). A replicated output's gradient must be the same on every rank (every rank
    computes the same loss from it). Scalars (Python numbers) get no gradient. Every rank of
    `comm` (default COMM_WORLD) calls f, and backward, together; `groups` as in a module call
    (a pipeline: groups of consecutive ranks, `send(x, next)` between them).

    backend: "cpu" (CPU tensors), "cuda" (CUDA tensors of the current device, forward and
    backward on the current stream, NCCL made from `comm` or from a torch.distributed
    `process_group`), or None: each call follows its tensors' device. With
    COCONET_CUDA_EMULATE=1, backend="cuda" runs the CUDA module under the host emulation and
    takes CPU tensors in their place."""
    return Differentiable(source, program, schedule, grad_schedule, comm, groups, backend, process_group)


class Differentiable:
    """The callable `function` returns (see there). `saved`: the values the forward keeps for
    the backward (autodiff/saved.py; empty when the schedules do not apply to the programs cut
    there, and the backward then computes the forward values again); `recomputed`: the forward
    values the backward computes."""

    def __init__(self, source: str | Path, program: str | None, schedule: str, grad_schedule: str,
                 comm: Any, groups: int = 1, backend: str | None = None, process_group: Any = None):
        from coconetc.autodiff.saved import pairing, uncut
        from coconetc.autodiff.vjp import cotangent_params
        from coconetc.plan.label import DEFAULT
        from coconetc.sourcefile import grad_name, load_file, with_grads
        what = "coconetc.torch.function"
        if backend not in (None, "cpu", "cuda"):
            raise ValueError(f"{what}: backend must be 'cpu', 'cuda' or None (the tensors' device), got {backend!r}")
        from coconetc.paths import source_path
        source = source_path(source)  # a bare name may be a shipped example's ("gpt_block.ccn")
        if not Path(source).exists():
            raise FileNotFoundError(f"{what}: no such .ccn file: {source}")
        sf = load_file(source)
        if program is None:
            own = [n for n in sf.programs if n not in sf.derived]
            if len(own) != 1:
                raise ValueError(f"{what}: {source} holds programs {', '.join(own)}; say which with program=")
            program = own[0]
        sf.program(program)  # a KeyError naming the file's programs
        sf = with_grads(sf, [program])
        gname = grad_name(program)
        for name, s in ((program, schedule), (gname, grad_schedule)):
            if s != DEFAULT:
                sf.schedule(name, s)  # a KeyError naming the known ones
        self.source, self.name = source, program
        self.schedule, self.grad_schedule = schedule, grad_schedule
        self.groups, self.backend, self.process_group = groups, backend, process_group
        if comm is None and process_group is None:
            from mpi4py import MPI
            comm = MPI.COMM_WORLD
        self.comm = comm
        p, g = sf.programs[program], sf.programs[gname]
        self.program = p
        self.tensors = [q.name for q in p.params if not q.scalar]
        self.scalars = [q.name for q in p.params if q.scalar]
        self.outputs = [pub for pub, _ in p.outputs]
        self.cotangents = cotangent_params(g, p)
        # the derived program's outputs d_<x> in the order of its wrt: x's position among the tensors
        wrt = [q.name for q in p.params if not q.scalar and q.type.dtype in FLOATS]
        self.wrt = {x: i for i, x in enumerate(wrt)}
        # the forward keeps the saved values where both schedules apply to the programs cut
        # there; otherwise the backward is the whole derived program (autodiff/saved.py)
        pair = pairing(sf.programs, sf.schedules, program, gname, schedule, grad_schedule, DEFAULT)
        if not pair.cut:  # (slower, but what the schedules say: a warning, once per function)
            warnings.warn(f"{what}: {uncut(sf.schedules, program, gname, schedule, grad_schedule, DEFAULT)}",
                          stacklevel=3)
        self.fwd_program, self.bwd_program = pair.forward, pair.backward
        self.back = sf.programs[pair.backward]  # the backward's program (its operator's signature: ops.py)
        self.saved, self.recomputed = pair.saved, pair.recomputed
        self._impl: dict[str, Any] = {}
        # its calls' torch.library operators, one pair per backend it may run on (made here, not
        # while torch.compile traces a call)
        self._ops = {b: torch_ops.ops_for(self, b).name for b in ((backend,) if backend else ("cpu", "cuda"))}
        self.__doc__ = f"{p.name}({', '.join(q.name for q in p.params)}) -> {', '.join(self.outputs)}"

    def _functions(self, backend: str) -> tuple[Any, Any, Any]:
        """(forward, backward, communicator) of the backend's module, loaded once."""
        if backend not in self._impl:
            if backend == "cpu":
                if self.comm is None:
                    raise ValueError(f"{self.name}: the CPU backend communicates over MPI; pass comm= "
                                     "(process_group= is for backend='cuda')")
                mod = load(self.source, (self.name,), "coconetc.torch.function")
                comm = self.comm
            else:
                mod = load(self.source, (self.name,), "coconetc.torch.function", backend="cuda")
                comm = mod.backend.communicator(mod, self.comm, self.process_group)
            fwd, bwd = mod.programs[self.fwd_program], mod.programs[self.bwd_program]
            for fn, s in ((fwd, self.schedule), (bwd, self.grad_schedule)):
                if s not in fn.schedules:
                    raise ValueError(f"{self.name}: the {backend} module has no schedule {s!r} of "
                                     f"{fn.name} (`coconetc check --backend {backend}` says why)")
            self._impl[backend] = (fwd, bwd, comm)
        return self._impl[backend]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        what = f"{self.program.name}()"
        kwargs = bind(what, [q.name for q in self.program.params], args, kwargs)
        unknown = sorted(set(kwargs) - set(self.tensors) - set(self.scalars))
        if unknown:
            raise TypeError(f"{what}: unexpected keyword argument {unknown[0]!r} (its parameters: "
                            f"{', '.join(q.name for q in self.program.params)})")
        missing = [n for n in self.tensors + self.scalars if n not in kwargs]
        if missing:
            raise TypeError(f"{what}: missing argument {missing[0]!r}")
        for n in self.tensors:
            if not isinstance(kwargs[n], torch.Tensor):
                raise TypeError(f"{what}: {n!r} must be a torch tensor, got {type(kwargs[n]).__name__}")
        backend = self.backend or ("cuda" if any(kwargs[n].is_cuda for n in self.tensors) else "cpu")
        check_devices(what, backend, {n: kwargs[n] for n in self.tensors})
        scalars = {n: kwargs[n].item() if isinstance(kwargs[n], torch.Tensor) else kwargs[n] for n in self.scalars}
        call: dict[str, Any] = {**{n: kwargs[n] for n in self.tensors}, **scalars}
        fits = True
        for q in self.program.params:  # scalars as the operator's float or int arguments
            if q.scalar:
                ok, call[q.name] = torch_ops.scalar_arg(q, call[q.name])
                fits = fits and ok
        if not fits:  # a scalar the runtime refuses: the call raises its error, on every rank
            fwd, _, comm = self._functions(backend)
            fwd(schedule=self.schedule, comm=comm, groups=self.groups, **call)
        out = torch_ops.BY_NAME[self._ops[backend]].forward(*(call[q.name] for q in self.program.params))
        outs = out if isinstance(out, tuple) else (out,)
        outs = outs[:len(self.outputs)]  # (the saved values after them stay with autograd)
        return outs[0] if len(outs) == 1 else outs

    def operators(self, backend: str = "cpu") -> tuple[Any, Any]:
        """The (forward, backward) `torch.library` custom operators (CustomOpDef) of this
        function's calls on BACKEND (docs/pytorch.md, "torch.compile and torch.export")."""
        ops = torch_ops.BY_NAME[self._ops[backend]]
        return ops.forward, ops.backward

    def _position(self) -> tuple[int, int]:
        """(ranks per group, this rank's index in its group)."""
        if self.comm is not None:
            return layout.group_position(self.comm, None, None, self.groups)
        import torch.distributed as dist
        pg = self.process_group
        return layout.group_position(None, dist.get_rank(pg), dist.get_world_size(pg), self.groups)
