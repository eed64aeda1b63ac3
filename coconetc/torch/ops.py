"""coconet calls as PyTorch operators (docs/pytorch.md, "torch.compile and torch.export"): each
distinct differentiable program call (`coconetc.torch.function` / `Module`) is a pair of
`torch.library` custom operators in the namespace `coconet`:

    coconet::<program>_<schedule>_<grad schedule>_<backend>_<hash>           the forward
    coconet::<program>_<schedule>_<grad schedule>_<backend>_<hash>_backward  the derived program

The forward op's arguments are the program's parameters in its order and by its names
(tensors as `Tensor`, scalars as `float` or `int`), its results the program's outputs followed
by the values the forward keeps for the backward (`Differentiable.saved`); the backward op's are
the derived program's (the parameters, the saved values, the cotangents `d_<output>`) and its
results the gradients `d_<x>` of the floating-point tensor parameters. The forward op's
autograd formula (torch.library.register_autograd) calls the backward op; the fake
implementations make each result's local shape from the scheduled program's types at the sizes
the arguments bind (this rank's slice of a sliced dim), so `torch.compile` and `torch.export`
trace through a coconet call without running it.

The hash covers what makes two calls differ: the .ccn file's text, the program, both schedules,
the backend (and the host emulation), the group count and the communicator (COMM_WORLD, or the
n-th other communicator or process group this process used). A second Differentiable with the
same key shares the first one's operators (and its loaded module functions). Nothing here
imports the rest of coconetc.torch: the Differentiable is an argument (duck-typed: see `Call`)."""

from __future__ import annotations

import contextlib
import hashlib
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from coconetc.ir.arguments import check_param
from coconetc.ir.dtypes import TABLE
from coconetc.ir.nodes import Program
from coconetc.ir.slices import slice_range
from coconetc.ir.types import dim_symbols, eval_dim
from coconetc.plan.label import parse
from coconetc.runtime import trace as _trace

NAMESPACE = "coconet"
TORCH_DTYPES = {n: getattr(torch, d.torch) for n, d in TABLE.items()}


@dataclass
class Ops:
    """The two operators of one key, and the Differentiable that runs them (the first one
    made with that key)."""

    name: str  # the forward op's name in the namespace (the backward's: name + "_backward")
    f: Any  # the Differentiable
    backend: str
    forward: Any  # torch.library CustomOpDef
    backward: Any


_OPS: dict[tuple, Ops] = {}  # key -> its operators
BY_NAME: dict[str, Ops] = {}  # the forward op's name -> its operators (a Differentiable keeps the name:
# it stays copyable, copy.deepcopy(model), and its copies call the same operators)
_COMMS: list[Any] = []  # the communicators (and process groups) other than COMM_WORLD, by first use


def _comm_tag(f: Any) -> str:
    comm = f.comm if f.comm is not None else f.process_group
    if f.comm is not None:
        from mpi4py import MPI
        if comm is MPI.COMM_WORLD:
            return "world"
    for i, c in enumerate(_COMMS):
        if c is comm:
            return f"comm{i + 1}"
    _COMMS.append(comm)
    return f"comm{len(_COMMS)}"


def _word(s: str) -> str:
    return re.sub(r"\W", "_", s)


def ops_for(f: Any, backend: str) -> Ops:
    """The operators of Differentiable F's calls on BACKEND, registered on first use."""
    from coconetc.runtime.backends import backend_for
    b = backend_for(backend)  # (under COCONET_CUDA_EMULATE=1, "cuda" is the emulated one)
    text = Path(f.source).read_bytes()
    key = (hashlib.sha256(text).hexdigest(), f.name, f.schedule, f.grad_schedule, b.name, f.groups, _comm_tag(f))
    ops = _OPS.get(key)
    if ops is None:
        digest = hashlib.sha256(repr(key).encode()).hexdigest()[:10]
        name = "_".join(_word(s) for s in (f.name, f.schedule, f.grad_schedule, b.tag)) + f"_{digest}"
        ops = _register(name, f, backend)
        _OPS[key] = BY_NAME[name] = ops
    return ops


def _schema(p: Program, results: int) -> str:
    args = ", ".join(f"{_scalar_type(q.type.dtype) if q.scalar else 'Tensor'} {q.name}" for q in p.params)
    out = "Tensor" if results == 1 else "(" + ", ".join(["Tensor"] * results) + ")"
    return f"({args}) -> {out}"


def _scalar_type(dtype: str) -> str:
    return "int" if dtype.startswith("i") else "float"


def schema(f: Any) -> tuple[str, str]:
    """The (forward, backward) operator schemas of Differentiable F (no module is built)."""
    return (_schema(f.program, len(f.outputs) + len(f.saved)),
            _schema(f.back, len(f.back.outputs)))


@contextlib.contextmanager
def ranged(name: str, cat: str, args: dict[str, Any] | None = None) -> Iterator[None]:
    """NAME as a range of torch.profiler's trace while a profiler records, and of coconet's own
    (category CAT, with ARGS as they are when the block ends, so the block may add to them:
    coconetc.runtime.trace.mark) while coconetc.trace records; nothing otherwise. The work
    coconetc.torch does outside compiled calls: a pipeline's actions and waits, a sharded
    model's collectives and theirs."""
    profiling = torch.autograd.profiler._is_profiler_enabled
    tracing = _trace.active() is not None
    if not profiling and not tracing:
        yield
        return
    t0 = time.monotonic_ns()
    try:
        with torch.profiler.record_function(name) if profiling else contextlib.nullcontext():
            yield
    finally:
        if tracing:
            _trace.mark(name, cat, t0, time.monotonic_ns(), args or {})


def profiled(fn: Any, schedule: str) -> Any:
    """A range `coconet <program>[<schedule>]` around a call in torch.profiler's trace while a
    profiler records (nothing otherwise: no cost to a call that is not profiled); the units
    inside the call are in coconetc.trace's files (docs/tracing.md)."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(f"coconet {fn.name}[{schedule}]")
    return contextlib.nullcontext()


def _register(name: str, f: Any, backend: str) -> Ops:
    p, back = f.program, f.back
    names = [q.name for q in p.params]
    bnames = [q.name for q in back.params]
    n_out = len(f.outputs)
    fwd_schema, bwd_schema = schema(f)
    updated = tuple(sorted({t for t, _ in p.updates}))
    bupdated = tuple(sorted({t for t, _ in back.updates}))

    def forward_impl(*args: Any) -> Any:
        fwd, _, comm = f._functions(backend)
        kwargs = {n: a.detach() if isinstance(a, torch.Tensor) else a for n, a in zip(names, args)}
        with profiled(fwd, f.schedule):
            return fwd(schedule=f.schedule, comm=comm, groups=f.groups, **kwargs)

    def backward_impl(*args: Any) -> Any:
        _, bwd, comm = f._functions(backend)
        kwargs = {n: a.detach() if isinstance(a, torch.Tensor) else a for n, a in zip(bnames, args)}
        for c in f.cotangents:
            kwargs[c] = kwargs[c].contiguous()
        with profiled(bwd, f.grad_schedule):
            return bwd(schedule=f.grad_schedule, comm=comm, groups=f.groups, **kwargs)

    fwd_op = torch.library.custom_op(f"{NAMESPACE}::{name}", forward_impl, mutates_args=updated,
                                     schema=fwd_schema)
    bwd_op = torch.library.custom_op(f"{NAMESPACE}::{name}_backward", backward_impl,
                                     mutates_args=bupdated, schema=bwd_schema)

    def forward_fake(*args: Any) -> Any:
        fwd, _, _ = f._functions(backend)
        return _fake(fwd.program_of(parse(f.schedule)), dict(zip(names, args)), f)

    def backward_fake(*args: Any) -> Any:
        _, bwd, _ = f._functions(backend)
        return _fake(bwd.program_of(parse(f.grad_schedule)), dict(zip(bnames, args)), f)

    fwd_op.register_fake(forward_fake)
    bwd_op.register_fake(backward_fake)

    tensor_at = [i for i, q in enumerate(p.params) if not q.scalar]

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        outs = output if isinstance(output, tuple) else (output,)
        ctx.save_for_backward(*(inputs[i] for i in tensor_at), *outs[n_out:])
        ctx.scalars = {q.name: v for q, v in zip(p.params, inputs) if q.scalar}
        ctx.shapes = [(o.shape, o.dtype, o.device) for o in outs[:n_out]]
        ctx.mark_non_differentiable(*outs[n_out:], *[o for o in outs[:n_out] if not o.is_floating_point()])
        ctx.set_materialize_grads(False)

    def backward(ctx: Any, *grads: Any) -> Any:
        saved = ctx.saved_tensors
        values: dict[str, Any] = dict(zip(f.tensors, saved[:len(f.tensors)]))
        values.update(zip(f.saved, saved[len(f.tensors):]))
        values.update(ctx.scalars)
        for c, g, (shape, dtype, device) in zip(f.cotangents, grads, ctx.shapes):
            # an output left out of the loss: a zero cotangent (as autograd.Function's materialized grads)
            values[c] = torch.zeros(shape, dtype=dtype, device=device) if g is None else g
        d = bwd_op(*(values[q] for q in bnames))
        ds = d if isinstance(d, tuple) else (d,)
        result: list[torch.Tensor | None] = []
        for k, q in enumerate(p.params):
            i = None if q.scalar else f.wrt.get(q.name)
            result.append(ds[i] if i is not None and ctx.needs_input_grad[k] else None)
        return tuple(result)

    fwd_op.register_autograd(backward, setup_context=setup_context)
    return Ops(name, f, backend, fwd_op, bwd_op)


def scalar_arg(q: Any, v: Any) -> tuple[bool, Any]:
    """(True, the value as the op's float or int argument), or (False, v) where the runtime
    refuses it (its error is then raised by the module call itself, on every rank after the
    ranks' agreement, as before operators). While torch.compile traces, V (a Python number or a
    symbolic one) goes to the operator as it is: the schema types it, and the module call checks
    the value when the compiled code runs."""
    if torch.compiler.is_compiling():
        return True, v
    try:
        return True, check_param(q, v)
    except (TypeError, ValueError):
        return False, v


def _fake(p: Program, args: dict[str, Any], f: Any) -> Any:
    """Empty tensors shaped as P's results (this rank's part), from the arguments' shapes."""
    gs, r = f._position()
    known: dict[str, Any] = {}  # a size symbol's whole value
    mine: dict[str, Any] = {}  # this rank's part of a size symbol sliced in some argument
    device = None
    for q in p.params:
        if q.scalar:
            continue
        t = args[q.name]
        device = device or t.device
        if t.dim() != q.type.ndim:
            raise ValueError(f"{p.name}(): '{q.name}' must be {q.type.ndim}-d ({q.type}), got shape {tuple(t.shape)}")
        for axis, d in enumerate(q.type.shape):
            if isinstance(d, str):
                sliced = q.type.layout.sliced and q.type.layout.dim == axis
                (mine if sliced and gs > 1 else known).setdefault(d, t.shape[axis])
    results = []
    for _, s in p.outputs:
        t = p.type_of(s)
        shape = []
        for axis, d in enumerate(t.shape):
            sliced = t.layout.sliced and t.layout.dim == axis
            if sliced and isinstance(d, str) and d in mine:
                shape.append(mine[d])
                continue
            missing = sorted(dim_symbols(d) - set(known))
            if missing:
                raise ValueError(f"{p.name}(): the size {missing[0]} of output '{s}' ({t}) is known on this "
                                 "rank only as its slice of a sliced parameter; torch.compile/export of this "
                                 "call needs it whole (a replicated or local parameter of that size)")
            n = eval_dim(d, known)
            if sliced:
                lo, hi = slice_range(n, gs, r)
                n = hi - lo
            shape.append(n)
        results.append(torch.empty(shape, dtype=TORCH_DTYPES[t.dtype], device=device))
    return results[0] if len(results) == 1 else tuple(results)
