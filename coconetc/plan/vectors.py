"""How a pointwise pass reads its operands, and the CUDA kernels' vector width: decisions of the
plan that both the code generators and `show --format plan` ask for.

A loop over the elements of a result of type t reads an operand of type rt

- at element 0 ("scalar": a 0-d value),
- at the element's own index i ("linear": same shape, same layout or neither sliced),
- at i plus this rank's slice offset ("offset": a replicated operand read by a result sliced
  along dim 0), or
- through the element's coordinates (`read_kind` None: broadcasting, and slices along other
  dims).

A scattered operand is read piece by piece, and a Let (a scalar computed before the loop) by
name; neither is decided here.

The CUDA kernel of a pointwise pass (a Loop, a fused collective's chunk kernel for one phase,
its one-kernel symmetric path) also has a vector path when every value it stores is stored at
the element's own index: V elements at a time, one VECTOR_BYTES load or store per operand read
or stored at the element's index (scattered pieces included), V being VECTOR_BYTES over the
widest of those operands' element sizes (4 for f32, 8 for bf16). Operands read through the
coordinates or as scalars are read per element in both paths, and a kernel that reads and stores
no operand at the element's index has only the element path (width 0). The host takes the
vector path at run time only where every one of those pointers is aligned for V of its
elements (codegen/cuda/loops.py)."""

from __future__ import annotations

from collections.abc import Iterable

from coconetc.ir.limits import ITEMSIZE
from coconetc.ir.nodes import Ref, walk
from coconetc.ir.types import TType
from coconetc.plan.units import Fused, Item, Let, Loop, Phase, Plan

VECTOR_BYTES = 16  # one aligned 16-byte load or store (int4/float4) per operand and group of lanes


def read_kind(rt: TType, t: TType) -> str | None:
    """How a loop over the elements of t (this rank's part) reads an operand of type rt:
    "scalar", "linear", "offset", or None (through the element's coordinates)."""
    if rt.ndim == 0:
        return "scalar"
    if rt.shape != t.shape:
        return None
    if rt.layout == t.layout or (not rt.layout.sliced and not t.layout.sliced):
        return "linear"
    if not rt.layout.sliced and t.layout.sliced and t.layout.dim == 0:
        return "offset"
    return None


def _width(plan: Plan, t: TType, items: Iterable[Item], lets: Iterable[Let], chunked: str = "",
           stores: Iterable[str] = ()) -> int:
    """The vector width of one kernel over the elements of t computing `items` (lets: the
    scalars it reads by name; chunked: a fused collective's reduced value, read from its chunk
    buffer at the element's index; stores: values stored at the element's index besides the
    stored items)."""
    items = tuple(items)
    named = {x.name for x in lets}
    inside = {i.name for i in items}
    scattered = {b.name for b in plan.buffers if b.kind == "segments"}
    sizes: list[int] = []
    seen: set[str] = set()
    for r in (r for i in items for r in walk(i.expr) if isinstance(r, Ref)):
        if r.name in named or r.name in seen or (r.name in inside and r.name != chunked):
            continue
        if r.name != chunked and r.name not in scattered and read_kind(r.type, t) in (None, "scalar"):
            continue
        seen.add(r.name)
        sizes.append(ITEMSIZE[r.type.dtype])
    sizes += [ITEMSIZE[plan.buffer(i.name).type.dtype] for i in items if i.store]
    sizes += [ITEMSIZE[plan.buffer(name).type.dtype] for name in stores]
    return VECTOR_BYTES // max(sizes) if sizes else 0


def loop_width(plan: Plan, u: Loop) -> int:
    """A Loop's kernel (its single item stored into seg_dst's pieces where it has one)."""
    if u.seg_dst:
        assert len(u.items) == 1, u
        return _width(plan, u.type, (Item(u.items[0].name, u.items[0].expr, False),), u.lets,
                      stores=(u.items[0].name,))
    return _width(plan, u.type, u.items, u.lets)


def phase_width(plan: Plan, u: Fused, ph: Phase) -> int:
    """The chunk kernel of a pointwise phase of a fused collective (the pipeline path). A
    reduce-scatter along a dim other than 0 that gathers stores the gathered value at its global
    place in the gathered buffer: that kernel has only the element path."""
    assert ph.kind == "pointwise", ph
    if u.gather and u.dim != 0 and any(i.name == u.gathered for i in ph.items):
        return 0
    return _width(plan, u.type, ph.items, u.lets, chunked=u.collective)


def symmetric_width(plan: Plan, u: Fused) -> int:
    """The one kernel of a fused collective's symmetric path: every phase's items."""
    return _width(plan, u.type, (i for ph in u.phases for i in ph.items), u.lets, chunked=u.collective)
