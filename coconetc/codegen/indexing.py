"""Element indexing, the same in the CPU loops and the CUDA kernels: where a loop over the
elements of a result of type t reads each operand (the same index, a slice of a replicated
operand, broadcasting through the element's coordinates c0.., a piece of a scattered segment),
whether the loop needs those coordinates, and dropout at the element's global index.

Conventions: i is the element's index in this rank's part, off this rank's slice offset, c<k>
and L<k> the element's coordinates and the local extents (in scope where needs_coords says so)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from coconetc.codegen.base import Writer, prod
from coconetc.codegen.emit import COMPUTE, emit, literal
from coconetc.ir.nodes import Const, Expr, Op, Ref, walk
from coconetc.ir.rng_keys import site_key
from coconetc.ir.types import TType
from coconetc.plan.vectors import read_kind

_prod = prod


@dataclass(frozen=True)
class Access:
    """How a loop over the elements of a result reads an operand without coordinates: `kind`
    is "scalar" (element 0: a constant or a 0-d value), "segments" (a scattered operand, read
    piece by piece) or "linear" (element i, plus `offset`: a replicated operand of a slice read
    at the slice's start)."""

    kind: str
    offset: str = ""

    @property
    def index(self) -> str:
        """The element's index expression (scalar and linear accesses)."""
        assert self.kind != "segments", self
        return "0" if self.kind == "scalar" else f"i + {self.offset}" if self.offset else "i"


SCALAR, SEGMENTS, LINEAR = Access("scalar"), Access("segments"), Access("linear")


class Indexing:
    """segment: how an element of a scattered operand x is read in the backend's piece loop
    ({x}: its name), e.g. "p_{x}.ptrs[s][a0 + j]" (CPU) or "sp_{x}[q]" (CUDA)."""

    def __init__(self, w: Writer, segment: str):
        self.w = w
        self.segment = segment
        self.rates: list[str] | None = None  # inside unswitch_dropout: the rates of the dropouts rendered
        self.rate_zero = False  # render a dropout as its input (its rate is 0: unswitch_dropout)

    def unswitch_dropout(self, pad: str, render: Callable[[], None]) -> None:
        """What render() emits (loops over elements), and, where it renders a dropout whose rate is
        not a constant, a second copy first for when every such rate is 0 at run time, each
        dropout there its input: x * 1 at every element, which is what the dropout computes then,
        without drawing its numbers (torch's dropout at p = 0 is a copy; the draws cost 2.8 ns
        an element vectorized here, 12 not). RENDER runs twice: it declares nothing used after it."""
        start, outer = len(self.w.lines), self.rates
        rates: list[str] = []
        self.rates = rates
        try:
            with self.w.saved_consts():
                render()
            if not rates:
                return
            drawn = self.w.lines[start:]
            del self.w.lines[start:]
            self.rate_zero = True
            with self.w.saved_consts():
                self.w.emit(f"{pad}if ({' && '.join(f'{r} == 0.0' for r in rates)}) {{  // dropout at rate 0: its input")
                render()
        finally:
            self.rates, self.rate_zero = outer, False
        self.w.emit(f"{pad}}} else {{")
        self.w.lines += drawn
        self.w.emit(f"{pad}}}")

    def needs_coords(self, t: TType, exprs: list[Expr], skip: set[str]) -> bool:
        """Do these expressions, computed per element of t, need the element's coordinates (an
        operand, other than those named in skip, read other than by i; dropout at a global
        index that is not i plus an offset)?"""
        refs = [r for e in exprs for r in walk(e) if isinstance(r, Ref) and r.name not in skip]
        ops = [x.op for e in exprs for x in walk(e) if isinstance(x, Op)]
        return any(self.access(r, t) is None for r in refs) or "causal" in ops or (
            "dropout" in ops and self.simple_global_index(t) is None)

    def extents(self, t: TType) -> list[str]:
        """The local extent L<k> of each dim of t (the coordinates' bounds)."""
        return [f"const int64_t L{k} = {d};" for k, d in enumerate(self.w.ldims(t))]

    def loop_head(self, t: TType, coords: bool) -> list[str]:
        """What a loop's block opens with: this rank's slice offset and, when the body needs
        coordinates, the extents."""
        return [f"const int64_t off = {self.w.offset(t)};  // this rank's slice offset", "(void)off;",
                *(self.extents(t) if coords else [])]

    def access(self, r: Ref, t: TType) -> Access | None:
        """How an operand is read when no coordinates are needed, else None."""
        if r.name in self.w.consts:
            return SCALAR
        if r.name in self.w.scattered:
            return SEGMENTS
        kind = read_kind(r.type, t)
        if kind == "offset":
            return Access("linear", f"off * {_prod(self.w.gdims(t)[1:])}")
        return None if kind is None else SCALAR if kind == "scalar" else LINEAR

    def loader(self, t: TType):
        """load(ref) for emit(): the operand's element, in its compute type."""
        def load(r: Ref) -> str:
            if r.name in self.w.consts:
                return self.w.consts[r.name]
            acc = self.access(r, t)
            if acc is SEGMENTS:
                return f"coconet::to_compute({self.segment.format(x=r.name)})"
            idx = self.generic_index(r.type, t) if acc is None else acc.index
            return f"coconet::to_compute(v_{r.name}[{idx}])"
        return load

    def generic_index(self, rt: TType, t: TType) -> str:
        """Index of an operand element from the result's coordinates c0.. (broadcasting, and
        a replicated operand of a sliced result read at the slice)."""
        shift = t.ndim - rt.ndim
        ld = self.w.ldims(rt)
        terms = []
        for k in range(rt.ndim):
            if rt.shape[k] == 1:
                continue
            coord = f"c{k + shift}"
            if t.layout.sliced and t.layout.dim == k + shift and not rt.layout.sliced:
                coord = f"({coord} + off)"
            terms.append(f"{coord} * {_prod(ld[k + 1:])}")
        return " + ".join(terms) or "0"

    def simple_global_index(self, t: TType) -> str | None:
        """The element's global index without its coordinates, or None when it needs them."""
        if not t.layout.sliced:
            return "i"
        if t.layout.dim == 0:
            return f"(i + off * {_prod(self.w.gdims(t)[1:])})"
        return None

    def extra(self, t: TType, load=None):
        """Renders dropout (it needs the element's global index) and causal (the element's
        position); `load` as for emit()."""
        load = load or self.loader(t)

        def extra(op: Op) -> str:
            if op.op == "causal":
                return self.causal(op, t)
            assert op.op == "dropout", op.op
            x, p, seed = op.args
            gidx = self.simple_global_index(t) or self.global_index(t)
            xs = emit(x, load, extra)
            ps = literal(p.value, "f64") if isinstance(p, Const) else f"double({emit(p, load)})"
            if not isinstance(p, Const) and self.rates is not None:
                if ps not in self.rates:
                    self.rates.append(ps)
                if self.rate_zero:
                    return f"({xs})"
            seeds = f"int64_t({emit(seed, load)})"
            key = site_key(op.attr("site"))
            return (f"coconet::dropout<{COMPUTE[t.dtype]}>({xs}, {ps}, {seeds}, {key}u /* "
                    f"{op.attr('site')} */, static_cast<uint64_t>({gidx}))")
        return extra

    def causal(self, op: Op, t: TType) -> str:
        """causal(x, diagonal) at the element of t (the coordinates c<k> in scope): the global
        positions of its last two dims (t's last two, broadcasting aligns them; a size-1 dim of
        the condition's own shape is position 0) compared."""
        n, own = t.ndim, op.type.shape
        pos = []
        for k, size in ((n - 2, own[-2]), (n - 1, own[-1])):
            pos.append("int64_t(0)" if size == 1 else f"(c{k} + off)" if t.layout.sliced and t.layout.dim == k
                       else f"c{k}")
        diag = int(op.attr("diagonal", 0))
        return f"({pos[1]} <= {pos[0]} + int64_t({diag}))"

    def global_index(self, t: TType) -> str:
        g = self.w.gdims(t)
        terms = []
        for k in range(t.ndim):
            coord = f"c{k}" if k != t.layout.dim else f"(c{k} + off)"
            terms.append(f"{coord} * {_prod(g[k + 1:])}")
        return " + ".join(terms) or "0"


def coord_lines(dims: range, var: str = "c", decl: str = "const int64_t ", ext: str = "L{k}") -> list[str]:
    """The coordinates c<k> (var<k>, declared with decl), k in dims (highest first), divided out
    of `rest` by the extents (ext: the text of extent k, the L<k> in scope by default)."""
    return [f"{decl}{var}0 = rest;" if k == 0 else
            f"{decl}{var}{k} = rest % {ext.format(k=k)}; rest /= {ext.format(k=k)};" for k in reversed(dims)]
