"""Pointwise kernels of the CUDA renderer (its loops, as cpu/loops.py is the CPU's): a Loop, a
piece of a scattered loop, or a fused collective's chunk becomes one
coconet::cuda::launch_threads kernel (runtime.cuh) whose lambda runs once per thread: the Lets
first, then the thread's elements (grid-stride).

When every memory operand is read or stored contiguously by the loop variable (plus a slice or
chunk offset), the kernel also has a vector path: V elements at a time (16 bytes of the widest
operand type), one aligned vector load or store per operand, the element math of each of the V
lanes unrolled; the host takes it at run time only when every operand pointer is aligned for V
of its elements (coconet::cuda::aligned), and the elements past the last whole group of V, or
all of them otherwise, take the one-element path. Both paths use the element math of
codegen/emit.py, the CPU loops' text, and the operand indexing of codegen/indexing.py; the
vector lanes read an operand as in_<x>[u] where the element path reads v_<x>[index]. An operand
read through the element's coordinates (broadcasting) is read per lane, the coordinates divided
out of the index once a vector and stepped lane by lane; a kernel that stores a gathered value at
its global place has only the element path."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from coconetc.codegen import pointwise
from coconetc.codegen.base import Writer, prod as _prod
from coconetc.codegen.cuda.notes import Notes
from coconetc.codegen.emit import COMPUTE, CTYPE
from coconetc.codegen.indexing import Indexing, coord_lines
from coconetc.ir.nodes import Expr, Ref, walk
from coconetc.ir.types import TType
from coconetc.plan.units import ColSum, Let, Loop
from coconetc.plan.vectors import loop_width

Items = pointwise.Items
Outs = dict[str, list[tuple[str, str | None]]]  # value -> [(element path's target, vector pointer or None)]


@dataclass
class Kernel:
    """How a kernel's elements are indexed. `var` is the loop variable over [0, n); `defs`
    define the element's other indices from it (i, the rank's local element, for one); element
    i of a buffer is at pointer + i_base + var. regs: values read from a chunk buffer, name ->
    (the element path's text, the buffer's pointer at var = 0). outs: extra stores, name ->
    [(the element path's target, its pointer at var = 0, or None: not contiguous)]."""
    n: str
    var: str = "i"
    defs: tuple[str, ...] = ()
    i_base: str = ""
    regs: dict[str, tuple[str, str]] = field(default_factory=dict)
    outs: Outs = field(default_factory=dict)
    # the symmetric kernel's (fused.py): lines the element path defines after `defs` (a reduced
    # value read once per element); per value in regs read by a call instead of a vector load,
    # that function (given the group's first element); pointers the launcher sets and checks itself
    # (left out of the kernel's aligned<V> check; as an extra store target, one that may be the
    # item's own pointer, so its store, vector or element, is skipped where it is: th.out at R = 1)
    elem_defs: tuple[str, ...] = ()
    vloads: dict[str, str] = field(default_factory=dict)
    own: tuple[str, ...] = ()


def _plus(ptr: str, base: str) -> str:
    return f"{ptr} + {base}" if base else ptr


def _indices(defs: tuple[str, ...], body: list[str]) -> list[str]:
    """The index definitions (`const int64_t i = ...;`), each one nothing after it uses
    followed by a (void) of it."""
    out = []
    for k, line in enumerate(defs):
        name = line.split()[2]
        out.append(line)
        if not re.search(rf"\b{name}\b", " ".join((*defs[k + 1:], *body))):
            out.append(f"(void){name};")
    return out


class CudaKernels:
    def __init__(self, w: Writer, idx: Indexing, notes: Notes):
        self.w = w
        self.idx, self.notes = idx, notes

    def kernel(self, t: TType, k: Kernel, lets: tuple[Let, ...], items: Items, coords: bool, width: int, ind: str,
               launch: Callable[[int, str], str] | None = None) -> None:
        """The launch of one pointwise kernel (the caller has declared its accesses), with a
        vector path of `width` elements where the plan gives it one (plan/vectors.py; 0: none).
        launch(V, whether every operand is aligned): the text that opens the per-thread lambda
        (default: a launch_threads<V> over k.n; the symmetric kernel's is fused_symmetric<..., V>)."""
        let_lines = pointwise.lets(self.w, lets)
        outs: Outs = {name: [(f"v_{name}[i]", _plus(f"v_{name}", k.i_base))] if stored else []
                      for name, _, stored in items}
        for name, targets in k.outs.items():
            if name in outs:
                outs[name] = outs[name] + targets
        vec = self._vector_operands(t, k, items, outs, width)
        if launch is None:
            def launch(V: int, ok: str) -> str:
                return (f"coconet::cuda::launch_threads<{V}>({k.n}, {ok}, stream, "
                        f"[=] __device__ (const auto& th) {{")  # th: a Thread<V, I>, I int32_t or int64_t
        if vec is None:
            self.w.emit(f"{ind}{launch(1, 'false')}")
        else:
            V, ptrs = vec
            checked = ", ".join(p for name, p in ptrs.items() if name not in k.vloads and p not in k.own)
            self.w.emit(f"{ind}{launch(V, f'coconet::cuda::aligned<{V}>({checked})')}")
        for line in let_lines:
            self.w.emit(f"{ind}  {line}")
        if vec is not None:
            self._vector_loop(t, k, items, outs, coords, *vec, ind + "  ")
        self.w.emit(f"{ind}  for (const auto {k.var} : th.elements()) {{"
                  + ("  // past the last whole vector, or all when not aligned" if vec else ""))
        load = self.idx.loader(t)
        local = {name: text for name, (text, _) in k.regs.items()}
        # an extra target that may be the item's own (k.own: th.out at R = 1) is stored after the
        # body, only where it is not, as the vector loop stores it
        own = {name: [(tgt, p) for n, (tgt, p) in enumerate(targets) if n and p in k.own]
               for name, targets in outs.items()}
        plain = {name: [x for x in targets if x not in own[name]] for name, targets in outs.items()}
        body = self.body(t, items, local, load, plain, lambda target, name: target)
        for name, extra in own.items():
            if not extra:
                continue
            first = plain[name][0][1]
            body += [f"if (static_cast<const void*>({p}) != static_cast<const void*>({first})) "
                     f"{tgt} = coconet::from_compute<{CTYPE[self.w.types[name].dtype]}>(x_{name});"
                     for tgt, p in extra]
        body = self.with_coords(t, coords, body)
        for line in (*_indices((*k.defs, *k.elem_defs), body), *body):
            self.w.emit(f"{ind}    {line}")
        self.w.emit(f"{ind}  }}")
        self.w.emit(f"{ind}}});")

    def with_coords(self, t: TType, coords: bool, body: list[str]) -> list[str]:
        """The body, after the element's coordinates c0.. from i (the L<k> in scope) when it
        needs them (those it does not use (void)-ed), divided out in i's type (int32_t where the
        launch chose it: every extent is below the element count)."""
        if not coords:
            return body
        out = ["auto rest = i;", *coord_lines(range(t.ndim), ext="decltype(rest)(L{k})")]
        out += [f"(void)c{d};" for d in range(t.ndim) if not re.search(rf"\bc{d}\b", " ".join(body))]
        return out + (["(void)rest;"] if t.ndim == 0 else []) + body

    @staticmethod
    def _lane_coords(t: TType, body: list[str], defs: tuple[str, ...]) -> tuple[list[str], list[str]]:
        """(lines before the lanes, each lane's body) for a vector whose lanes need coordinates:
        the first lane's coordinates divided out of its index once (cv<k>), then each lane reads
        them and steps them to the next element (the last dim's, carried into the dims before it
        as far as the lowest one the body uses), where the element path divides per element.
        The lanes' indices are consecutive (defs: the index i = the loop variable plus a base)."""
        used = [d for d in range(t.ndim) if re.search(rf"\bc{d}\b", " ".join(body))]
        if not used:
            return [], body
        low, last = used[0], t.ndim - 1
        dims = range(low, last + 1)
        head = [f"int64_t {', '.join(f'cv{d} = 0' for d in reversed(dims))};  // the first lane's coordinates, "
                "stepped by each lane", "{", *(f"  {line}" for line in defs), "  int64_t rest = i;",
                *(f"  {line}" for line in coord_lines(dims, var="cv", decl="")), "  (void)rest;", "}"]
        step = f"++cv{low};" if low == 0 else f"if (++cv{low} == L{low}) cv{low} = 0;"
        for d in range(low + 1, last + 1):
            step = f"if (++cv{d} == L{d}) {{ cv{d} = 0; {step} }}"
        return head, [*(f"const int64_t c{d} = cv{d};" for d in used), *body, step]

    def _vector_operands(self, t: TType, k: Kernel, items: Items, outs: Outs,
                         width: int) -> tuple[int, dict[str, str]] | None:
        """(width, pointer at var = 0 of each operand read or stored `width` elements at a
        time), or None when the plan gives the kernel no vector path (width 0). The operands
        are those plan/vectors.py counts: a 0-d operand, and one read through the element's
        coordinates (broadcast), are read per element in both paths."""
        if not width:
            return None
        inside = {name for name, _, _ in items}
        ptrs: dict[str, str] = {}
        for r in (r for _, e, _ in items for r in walk(e) if isinstance(r, Ref)):
            if r.name in self.w.consts or r.name in ptrs or (r.name in inside and r.name not in k.regs):
                continue  # (a value in regs may be read before an item of its name: the kept reduced value)
            if r.name in k.vloads:
                ptr = ""  # read by k.vloads[name], not loaded from a pointer
            elif r.name in k.regs:
                ptr = k.regs[r.name][1]
            else:
                acc = self.idx.access(r, t)
                if acc is None or acc.kind == "scalar":  # (None: through the coordinates, per element)
                    continue
                if acc.kind == "segments":
                    ptr = f"sp_{r.name}"
                else:
                    ptr = _plus(f"v_{r.name}" + (f" + {acc.offset}" if acc.offset else ""), k.i_base)
            ptrs[r.name] = ptr
        for name, targets in outs.items():
            for n, (_, p) in enumerate(targets):
                assert p is not None, f"the plan gives a kernel storing {name} out of place a vector path"
                ptrs[f"out {name}" + (f" {n}" if n else "")] = p
        assert ptrs, "the plan gives a kernel with no operand at the element's index a vector path"
        return width, ptrs

    def _vector_loop(self, t: TType, k: Kernel, items: Items, outs: Outs, coords: bool,
                     V: int, ptrs: dict[str, str], ind: str) -> None:
        """Whole groups of V elements: each operand loaded as one vector, the element math of
        the V lanes unrolled, each stored value written as one vector."""
        v0 = f"{k.var}0"
        self.w.emit(f"{ind}for (const auto {v0} : th.vectors()) {{  // {V} elements at a time, one aligned vector "
                  "load or store per operand")
        for name, ptr in ptrs.items():
            if name in k.vloads:
                self.w.emit(f"{ind}  const auto in_{name} = {k.vloads[name]}({v0});")
            elif not name.startswith("out "):
                self.w.emit(f"{ind}  const auto in_{name} = coconet::cuda::load<{V}>({ptr} + {v0});")
        stored = [name for name, targets in outs.items() if targets]
        by_type: dict[str, list[str]] = {}
        for s in stored:
            by_type.setdefault(CTYPE[self.w.types[s].dtype], []).append(f"out_{s}")
        for ct, names in by_type.items():
            self.w.emit(f"{ind}  coconet::cuda::Vec<{ct}, {V}> {', '.join(names)};")
        base = self.idx.loader(t)

        def load(r: Ref) -> str:
            if r.name not in self.w.consts and r.name in ptrs:
                return f"coconet::to_compute(in_{r.name}[u])"
            return base(r)
        first = {name: targets[:1] for name, targets in outs.items()}  # each lane's value once (stored to each target)
        body = self.body(t, items, {}, load, first, lambda target, name: f"out_{name}[u]")
        if coords:
            head, body = self._lane_coords(t, body, (f"const int64_t {k.var} = {v0};", *k.defs))
            for line in head:
                self.w.emit(f"{ind}  {line}")
        self.w.emit(f"{ind}  COCONET_UNROLL")
        self.w.emit(f"{ind}  for (int u = 0; u < {V}; ++u) {{")
        for line in (*_indices((f"const auto {k.var} = {v0} + u;", *k.defs), body), *body):
            self.w.emit(f"{ind}    {line}")
        self.w.emit(f"{ind}  }}")
        for line in self._vector_stores(k, outs, stored, V, ptrs, v0):
            self.w.emit(f"{ind}  {line}")
        self.w.emit(f"{ind}}}")

    @staticmethod
    def _vector_stores(k: Kernel, outs: Outs, stored: list[str], V: int, ptrs: dict[str, str], v0: str) -> list[str]:
        """Each stored value's vector written to each of its targets."""
        out = []
        for s in stored:
            for n in range(len(outs[s])):
                ptr = ptrs[f"out {s}" + (f" {n}" if n else "")]
                store = f"coconet::cuda::store<{V}>({ptr} + {v0}, out_{s});"
                if n and ptr in k.own:  # (the symmetric kernel's th.out: at R = 1 where the gathered
                    # value is computed in place, the item's own store, which it need not repeat)
                    own = ptrs[f"out {s}"]
                    store = f"if (static_cast<const void*>({ptr}) != static_cast<const void*>({own})) {store}"
                out.append(store)
        return out

    def body(self, t: TType, items: Items, regs: dict[str, str], base, outs, target) -> list[str]:
        """The element math of every item over t (codegen/pointwise.py: values), stored where
        outs says (target(element path's target, name): the text written to)."""
        return pointwise.values(self.idx, items, regs, lambda name: (t, base),
                                lambda name: [target(tgt, name) for tgt, _ in outs.get(name, [])])

    def render_loop(self, u: Loop) -> None:
        """A Loop unit: one kernel, or one per piece of the scattered tensors it reads or stores."""
        sums = [c for c in u.colsums if "cuda" in c.on]
        if sums:
            self._colsum_loop(u, sums[0])
            return
        self._loop(u.type, u.lets, [(i.name, i.expr, i.store) for i in u.items], loop_width(self.w.plan, u),
                   u.seg_dst)

    def _loop(self, t: TType, lets: tuple[Let, ...], items: list[tuple[str, Expr, bool]], width: int,
              seg_dst: str = "") -> None:
        regs = {name for name, _, _ in items}
        segs = sorted({r.name for _, e, _ in items for r in walk(e)
                       if isinstance(r, Ref) and r.name in self.w.scattered and r.name not in regs} | ({seg_dst} - {""}))
        if segs:
            self._seg_loop(t, lets, items, width, seg_dst, segs)
            return
        with self.w.saved_consts():
            n = _prod(self.w.ldims(t))
            coords = self.idx.needs_coords(t, [e for _, e, _ in items], {name for name, _, _ in items})
            self._loop_head(t, coords)
            self.notes.access(t, items, lets, "0", n, {}, "  ")
            self.kernel(t, Kernel(n), lets, items, coords, width, "  ")
            self.w.emit("}")

    def _colsum_loop(self, u: Loop, c: ColSum) -> None:
        """A loop that also adds up the column sums of one of its values (Loop.colsums,
        plan/colsums.py): coconet::cuda::colsum_rows (grad.cuh) calls the lambda once per element
        (the Lets, the element math and the stores of the element path), which returns the value
        summed; one element at a time (no vector path)."""
        t = u.type
        items = [(i.name, i.expr, i.store) for i in u.items]
        with self.w.saved_consts():
            ld = self.w.ldims(t)
            n = _prod(ld)
            coords = self.idx.needs_coords(t, [e for _, e, _ in items], {name for name, _, _ in items})
            self._loop_head(t, coords)
            self.notes.access(t, items, u.lets, "0", n, {}, "  ")
            ct = COMPUTE[self.w.types[c.value].dtype]
            self.w.emit(f"  coconet::cuda::colsum_rows<{ct}>(({n}) / std::max<int64_t>(1, {ld[-1]}), {ld[-1]}, "
                        f"v_{c.dst}, stream, [=] __device__ (const int64_t i, const int64_t col) -> {ct} {{"
                        f"  // and {c.dst} = the column sums of {c.value}")
            for line in pointwise.lets(self.w, u.lets):
                self.w.emit(f"    {line}")
            outs = {name: [(f"v_{name}[i]", None)] for name, _, stored in items if stored}
            body = self.body(t, items, {}, self.idx.loader(t), outs, lambda target, name: target)
            body = self.with_coords(t, coords, body) + ["(void)col;", f"return x_{c.value};"]
            for line in body:
                self.w.emit(f"    {line}")
            self.w.emit("  });")
            self.w.emit("}")

    def _loop_head(self, t: TType, coords: bool) -> None:
        """A loop's block opens as the CPU loop's (codegen/indexing.py: loop_head)."""
        self.w.emit("{")
        for line in self.idx.loop_head(t, coords):
            self.w.emit(f"  {line}")

    def _seg_loop(self, t: TType, lets: tuple[Let, ...], items: list[tuple[str, Expr, bool]], width: int,
                  seg_dst: str, segs: list[str]) -> None:
        """A loop reading (or, seg_dst, storing into) scattered tensors: one kernel per piece of
        this rank's logical range inside one segment (as the CPU loop's pieces), each scattered
        operand read through its piece's pointer sp_<x>[q]; element i = pc.offset + q."""
        with self.w.saved_consts():
            n = _prod(self.w.ldims(t))
            coords = self.idx.needs_coords(t, [e for _, e, _ in items], {name for name, _, _ in items})
            if seg_dst:  # the single item is stored into seg_dst's segments, not into a buffer of its own
                assert len(items) == 1, items
                items = [(items[0][0], items[0][1], False)]
            self._loop_head(t, coords)
            self.w.emit(f"  for (const coconet::Piece& pc : coconet::pieces(seg_starts, off, off + {n})) {{")
            self.w.emit("  const int64_t b0 = pc.offset;")
            for x in segs:
                self.w.emit(f"  {CTYPE[self.w.types[x].dtype]}* const sp_{x} = p_{x}.at(pc);")
            self.notes.access(t, items, lets, "b0", "b0 + pc.size", {}, "  ",
                              (f"COCONET_W(sp_{seg_dst}, 0, pc.size)",) if seg_dst else ())
            outs: Outs = {items[0][0]: [(f"sp_{seg_dst}[q]", f"sp_{seg_dst}")]} if seg_dst else {}
            self.kernel(t, Kernel("pc.size", "q", ("const int64_t i = b0 + q;",), "b0", outs=outs), lets, items, coords, width,
                        "  ")
            self.w.emit("  }")
            self.w.emit("}")
