"""One argument checker for every backend: a call's keyword arguments against the program's
parameters on this rank, before anything is exchanged. The names first (check_names), each
scalar as the interpreter takes it (ir/arguments.py: check_param), each tensor (or each
segment of a scattered one) by the backend's own check of one buffer (what differs: a NumPy
array or CPU tensor, a CUDA tensor, a CPU tensor standing for a CUDA one), then buffers that
overlap (one message, every backend). Errors name the parameter."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from coconetc.ir.arguments import check_param
from coconetc.ir.nodes import Param, Program

# (parameter, value, whether the call updates it) -> the buffer the module reads
TensorCheck = Callable[[Param, Any, bool], Any]
# a checked buffer -> (its first byte's address, its size in bytes)
Span = Callable[[Any], tuple[int, int]]


def check_names(p: Program, kwargs: dict) -> None:
    """The call names every parameter and nothing else (every backend: a TypeError as Python's)."""
    extra = sorted(set(kwargs) - {q.name for q in p.params})
    if extra:
        raise TypeError(f"{p.name}() got an unexpected keyword argument '{extra[0]}'")
    for q in p.params:
        if q.name not in kwargs:
            raise TypeError(f"{p.name}() missing argument '{q.name}'")


def checked_arguments(p: Program, kwargs: dict, tensor: TensorCheck, span: Span, noun: str, *,
                      tensors_only: bool = False) -> dict[str, Any]:
    """Each argument of a call of P checked: names, scalars (check_param: a Python int or float),
    tensors through TENSOR (a parameter's whole value: per_part makes one of a check of one
    buffer), then no two buffers overlap (SPAN reads a buffer's bytes; NOUN names what to pass
    instead, "arrays" or "tensors"). tensors_only: the tensor arguments alone, not compared for
    overlaps (a repeated call's buffers bound anew: they were checked when it was remembered)."""
    if not tensors_only:
        check_names(p, kwargs)
    updated = {t for t, _ in p.updates}
    out: dict[str, Any] = {}
    for q in p.params:
        if q.scalar:
            if not tensors_only:
                out[q.name] = check_param(q, kwargs[q.name])
        else:
            out[q.name] = tensor(q, kwargs[q.name], q.name in updated)
    if not tensors_only:
        no_aliases(p, out, span, noun)
    return out


def per_part(check: TensorCheck) -> TensorCheck:
    """A parameter's check made of CHECK, a check of one buffer: a scattered parameter takes a
    list of 1-d segments (or one buffer: one segment), any other one buffer of the parameter's
    rank (as ir/arguments.py's check_param, whose messages these are)."""
    def param(q: Param, v: Any, updated: bool) -> Any:
        if q.scattered and isinstance(v, (list, tuple)):
            parts = [check(q, x, updated) for x in v]
            for x in parts:
                if len(x.shape) != 1:
                    raise ValueError(f"'{q.name}': every segment must be 1-d, got shape {tuple(x.shape)}")
            return parts
        a = check(q, v, updated)
        if len(a.shape) != q.type.ndim:
            raise ValueError(f"'{q.name}' must be {q.type.ndim}-d ({q.type}), got shape {tuple(a.shape)}")
        return [a] if q.scattered else a
    return param


def overlapping(p: Program, values: dict, span: Span) -> tuple[str, str] | None:
    """Two parameters (or segments) whose memory overlaps, by name ("'g'", "'x' (segment 1)");
    None if none do. The buffers are contiguous (checked), so their byte ranges are exact."""
    spans = []
    for q in p.params:
        if q.scalar:
            continue
        v = values[q.name]
        parts = v if isinstance(v, list) else [v]
        for k, a in enumerate(parts):
            start, size = span(a)
            if size:
                spans.append((start, start + size, f"'{q.name}'" + (f" (segment {k})" if len(parts) > 1 else "")))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            return a, b
    return None


def no_aliases(p: Program, values: dict, span: Span, noun: str) -> None:
    """Raises if two buffers of the call overlap (the same buffer, or views of one)."""
    both = overlapping(p, values, span)
    if both:
        raise ValueError(f"{p.name}(): {both[0]} and {both[1]} overlap in memory (the same buffer, or "
                         f"views of one); pass separate {noun}: the parameters of a coconet program "
                         "may not alias")


def host_span(a: Any) -> tuple[int, int]:
    """A NumPy array's bytes."""
    return a.__array_interface__["data"][0], a.nbytes


def device_span(t: Any) -> tuple[int, int]:
    """A torch tensor's bytes."""
    return t.data_ptr(), t.numel() * t.element_size()


def cpu_buffer(q: Param, v: Any, updated: bool) -> Any:
    """The CPU module's check of a parameter's value (check_param: a NumPy array, or a view of
    a CPU tensor, C-contiguous; writeable when updated; segments for a scattered one)."""
    return check_param(q, v, updated=updated, contiguous=True)
