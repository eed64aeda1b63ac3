"""Causal attention as one call (issue 39 point 5): the attention core a transformer block writes
from pieces, found in the plan, so that the CPU computes it a block of rows at a time and skips
the masked half of the scores (runtime_cpp/coconet/attention.h). The pieces stay the program;
only where they run changes, and only on the backends in `Attention.fused` (the CPU): the
others run the units one by one, as the plan lists them.

The forward (attention_fwd), anchored at a softmax:

    T  = transpose(K, -2, -1)           S0 = matmul(Q, T)            Q [.., M, D], K [.., N, D]
    S  = S0 * c  (or c * S0, S0 / c, or none)   c a number or a scalar
    W  = where(causal(S, d), S, -inf)   P  = softmax(W)
    A  = dropout(P, p, seed)  (or none) O  = matmul(A, V)            V [.., N, E], O [.., M, E]

The backward (attention_bwd), anchored at the row sums of the softmax's derivative, as
autodiff/vjp.py derives the forward (G the cotangent of O):

    GA = matmul(G, transpose(V))        GAS = dropout(GA, p, seed, site=A's)  (or GA)
    R  = sum_keep(GAS * P, last dim)    GSM = where(causal(S, d), P * (GAS - R), 0) * c  (or no c)
    GQ = matmul(GSM, transpose(T))      GK = transpose(matmul(transpose(Q), GSM))
    GV = matmul(transpose(A), G)        P recomputed from the stored S where only the chain reads it,
                                        or a parameter (a backward program's saved softmax)

The rule, in one place (find): the units are top-level and the values held in memory (a
parameter, scratch or an output; never a view, an alias or segments); Q, K, V (and G) share
their leading dims (no broadcast) and one layout whose slicing, if any, is of a leading dim (the
scores' rows and columns are whole on every rank); f32 or f64. Each member unit computes only
chain values (a loop all of whose items are the chain's), and no other unit reads a chain value
but those the call writes whole: the forward's S, W, P, A (a masked element as the pieces leave
it) and O; the backward's GQ, GK, GV. The call runs at the place of the chain's last unit, and no
other unit between the chain's first and last touches a chain value.

The backward reads the stored S only where the mask keeps an element (the pieces read S only
through the mask). A stored A or P that is a parameter may have nonzero masked elements (the
forward leaves them 0, but a backward program's inputs are anyone's): dv then reads all of A
(a_whole), and a block of rows whose masked elements of P are not all 0 gets the row sums over
its whole rows (p_whole), as the pieces read them. A P the forward wrote costs one read of its
masked elements."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from coconetc.ir.expr import Const, Expr, Op, Ref, refs
from coconetc.plan.units import Attention, Buffer, Library, Loop, Unit, _touches

DTYPES = ("f32", "f64")
MEMORY = ("param", "scratch", "output")


class _Defs:
    """Where each value of the top-level units comes from: a Library unit, or an item of a
    loop (expanded through the loop's items and lets, so that the same arithmetic reads the
    same however the planner cut it into loops)."""

    def __init__(self, units: tuple[Unit, ...] | list[Unit], buffers: dict[str, Buffer]):
        self.units, self.buffers = units, buffers
        self.lib: dict[str, int] = {}
        self.item: dict[str, tuple[int, Expr]] = {}
        for i, u in enumerate(units):
            if isinstance(u, Library):
                self.lib[u.dst] = i
            elif isinstance(u, Loop) and not u.seg_dst:
                lets = {x.name: x.expr for x in u.lets}
                for it in u.items:
                    self.item[it.name] = (i, _subst(it.expr, lets))

    def value(self, name: str, seen: set[str] | None = None) -> Expr:
        """NAME's expression over Library results, parameters and scalars (SEEN collects the
        loop items expanded)."""
        if name in self.item:
            if seen is not None:
                seen.add(name)
            return self.expand(self.item[name][1], seen)
        return Ref(name, self.buffers[name].type)

    def expand(self, e: Expr, seen: set[str] | None = None) -> Expr:
        if isinstance(e, Ref):
            return self.value(e.name, seen) if e.name in self.item else e
        if isinstance(e, Op) and e.op != "causal":  # causal's operand gives only its shape
            return Op(e.op, tuple(self.expand(a, seen) for a in e.args), e.type, e.attrs)
        return e

    def library(self, name: str, op: str) -> Library | None:
        i = self.lib.get(name, -1)
        u = self.units[i] if i >= 0 else None
        return u if isinstance(u, Library) and u.op == op else None

    def swapped(self, name: str) -> str:
        """X where NAME = transpose(X) of the last two dims, else ""."""
        u = self.library(name, "transpose")
        n = self.buffers[name].type.ndim
        if u is None or sorted(int(v) for k, v in u.attrs if k in ("dim0", "dim1")) != [n - 2, n - 1]:  # type: ignore[call-overload]
            return ""
        return u.args[0]

    def index(self, name: str) -> int:
        return self.lib[name] if name in self.lib else self.item[name][0]


def _subst(e: Expr, env: dict[str, Expr]) -> Expr:
    if isinstance(e, Ref):
        return env.get(e.name, e)
    if isinstance(e, Op):
        return Op(e.op, tuple(_subst(a, env) for a in e.args), e.type, e.attrs)
    return e


def _scalar(e: Expr, buffers: dict[str, Buffer]) -> str:
    """A number's text or a scalar buffer's name ("" for anything else)."""
    if isinstance(e, Const):
        return repr(float(e.value)) if isinstance(e.value, float) else str(e.value)
    if isinstance(e, Ref) and e.name in buffers and buffers[e.name].kind == "scalar":
        return e.name
    return ""


def _ref(e: Expr) -> str:
    return e.name if isinstance(e, Ref) else ""


def _scaled(e: Expr, buffers: dict[str, Buffer]) -> tuple[Expr, str]:
    """(X, scale) for X * c, c * X or X / c with c a number or a scalar (the scale "1/c" for a
    division); (e, "") otherwise."""
    if isinstance(e, Op) and e.op in ("mul", "div") and len(e.args) == 2:
        a, b = e.args
        for x, c in ((a, b), (b, a)) if e.op == "mul" else ((a, b),):
            s = _scalar(c, buffers)
            if s and c.type.ndim == 0 and x.type.ndim > 0:
                return x, s if e.op == "mul" else f"1/{s}"
    return e, ""


def _dropped(e: Expr, buffers: dict[str, Buffer]) -> tuple[Expr, tuple[str, str, str]] | None:
    """(X, (p, seed, site)) for dropout(X, p, seed); (e, ("", "", "")) otherwise; None for a
    dropout whose p or seed is not a number or a scalar."""
    if isinstance(e, Op) and e.op == "dropout":
        x, p, seed = e.args
        ps, ss = _scalar(p, buffers), _scalar(seed, buffers)
        if not ps or not ss:
            return None
        return x, (ps, ss, str(e.attr("site")))
    return e, ("", "", "")


def _masked(e: Expr, fill: float) -> tuple[Expr, Expr, int] | None:
    """(the causal operand, the kept value, diagonal) for where(causal(Y, d), X, fill)."""
    if not (isinstance(e, Op) and e.op == "where"):
        return None
    c, x, f = e.args
    if not (isinstance(c, Op) and c.op == "causal" and isinstance(f, Const) and float(f.value) == fill):
        return None
    return c.args[0], x, int(c.attr("diagonal", 0))


@dataclass
class _Chain:
    """The units and values of one match: `results` the values the call always writes,
    `allowed` those it may write too where other units read them."""

    d: _Defs
    results: set[str]
    allowed: set[str]
    members: set[int] = field(default_factory=set)
    values: set[str] = field(default_factory=set)  # every value the members compute

    def add(self, *names: str) -> None:
        for n in names:
            self.values.add(n)
            self.members.add(self.d.index(n))

    def copy(self) -> _Chain:
        """The same match, to grow without changing this one."""
        return _Chain(self.d, set(self.results), set(self.allowed), set(self.members), set(self.values))

    def only_read_by_chain(self, name: str, *but: int) -> bool:
        """Whether no unit other than the members and BUT touches NAME."""
        return not any(_touches(u, {name}) for j, u in enumerate(self.d.units) if j not in self.members and j not in but)

    def written(self) -> set[str] | None:
        """The values the call writes (the results and every chain value another unit reads or
        an output hands back), or None where the rule of the module's docstring fails."""
        units, buffers = self.d.units, self.d.buffers
        for i in self.members:  # a member loop computes only chain values
            u = units[i]
            if isinstance(u, Loop) and any(it.name not in self.values for it in u.items):
                return None
        if any(n in buffers and buffers[n].kind not in (*MEMORY, "register") for n in self.values):
            return None
        read = {n for n in self.values if buffers[n].kind == "output" or not self.only_read_by_chain(n)}
        if read - self.results - self.allowed:
            return None
        lo, hi = min(self.members), max(self.members)
        if any(lo < j < hi and j not in self.members and _touches(u, self.values) for j, u in enumerate(units)):
            return None
        out = read | self.results
        return out if all(buffers[n].kind in ("scratch", "output") for n in out) else None


def _shapes(d: _Defs, q: str, k: str, v: str, scores: str) -> bool:
    """Q [.., M, D], K [.., N, D], V [.., N, E], scores [.., M, N]: the same leading dims and
    layout, sliced (if at all) along a leading dim, in f32 or f64."""
    ts = [d.buffers[n].type for n in (q, k, v, scores)]
    tq, tk, tv, tsc = ts
    n = tq.ndim
    if n < 3 or any(t.ndim != n for t in ts) or len({t.shape[:-2] for t in ts}) != 1:
        return False
    if tq.shape[-1] != tk.shape[-1] or tk.shape[-2] != tv.shape[-2] or tsc.shape[-2:] != (tq.shape[-2], tk.shape[-2]):
        return False
    if len({t.layout for t in ts}) != 1 or (tsc.layout.sliced and tsc.layout.dim >= n - 2):
        return False
    if any(t.dtype != tq.dtype for t in ts) or tq.dtype not in DTYPES:
        return False
    return all(d.buffers[x].kind in MEMORY for x in (q, k, v))


def _scores(d: _Defs, w: str, seen: set[str]) -> tuple[str, Expr, str, int] | None:
    """For W = where(causal(S, d), S, -inf), S = S0 * c (or S0) and S0 = matmul(Q, K^T):
    (S0, S's expression, c, d)."""
    if w not in d.item:
        return None
    m = _masked(d.value(w, seen), float("-inf"))
    if m is None or m[0].type.shape != m[1].type.shape:
        return None  # (a condition of another shape broadcasts: not the scores' own positions)
    _, x, diagonal = m
    s0e, scale = _scaled(x, d.buffers)
    s0 = _ref(s0e)
    mm = d.library(s0, "matmul") if s0 else None
    if mm is None or not d.swapped(mm.args[1]):
        return None
    return s0, x, scale, diagonal


def _forward(d: _Defs, ip: int) -> Attention | None:
    pu = d.units[ip]
    assert isinstance(pu, Library) and pu.op == "softmax"
    p, w = pu.dst, pu.args[0]
    seen: set[str] = set()
    found = _scores(d, w, seen)
    if found is None:
        return None
    s0, x, scale, diagonal = found
    mm = d.library(s0, "matmul")
    assert mm is not None
    q, t = mm.args
    k = d.swapped(t)
    s = next((n for n in seen if n != w and d.value(n) == x), s0 if not scale else "")
    for j, u in enumerate(d.units):  # the matmul by V that reads P, or A = dropout(P)
        if not (isinstance(u, Library) and u.op == "matmul" and j > ip):
            continue
        a = u.args[0]
        dropped = _dropped(d.value(a), d.buffers) if a != p else (Ref(p, d.buffers[p].type), ("", "", ""))
        if dropped is None or _ref(dropped[0]) != p:
            continue
        v, o = u.args[1], u.dst
        if not _shapes(d, q, k, v, s0):
            return None
        ch = _Chain(d, {o}, {s, w, p, a} - {""})
        ch.add(s0, w, p, o, a, *seen)
        if ch.only_read_by_chain(t, d.lib[t]):
            ch.add(t)
        out = ch.written()
        if out is None:
            return None
        drop_p, seed, site = dropped[1]
        return Attention("forward", tuple(sorted(ch.members)), q, k, v, s0, diagonal, scale, drop_p, seed, site,
                         o=o, s=s if s in out else "", w=w if w in out else "",
                         p=p if p in out else "", a=a if a != p and a in out else "")
    return None


def _softmax_grad(d: _Defs, x: str, seen: set[str]) -> tuple[Expr, str, Expr, str, str, tuple[str, str, str]] | None:
    """For X = GAS * P (or P * GAS), P a softmax or a parameter (a backward program's saved
    softmax), GAS = dropout(GA) (or GA), GA = matmul(G, transpose(V)): (P's reference, P, GAS's
    expression, GA, V, the dropout)."""
    xe = d.value(x, seen)
    if not (isinstance(xe, Op) and xe.op == "mul"):
        return None
    sides = [(pe, ge) for pe, ge in (xe.args, xe.args[::-1])
             if _ref(pe) and (d.library(_ref(pe), "softmax") or d.buffers[_ref(pe)].kind == "param")]
    if not sides:
        return None
    pe, gase = sides[0]
    dropped = _dropped(gase, d.buffers)
    ga = _ref(dropped[0]) if dropped is not None else ""
    gau = d.library(ga, "matmul") if ga else None
    if dropped is None or gau is None or not d.swapped(gau.args[1]):
        return None
    return pe, _ref(pe), gase, ga, d.swapped(gau.args[1]), dropped[1]


def _backward(d: _Defs, ir: int) -> Attention | None:
    ru = d.units[ir]
    assert isinstance(ru, Library) and ru.op == "sum_keep"
    r, x = ru.dst, ru.args[0]
    seen: set[str] = set()
    if dict(ru.attrs).get("dim") != d.buffers[x].type.ndim - 1 or x not in d.item:
        return None
    found = _softmax_grad(d, x, seen)
    if found is None:
        return None
    pe, p, gase, ga, v, drop = found
    for u in d.units:  # GQ = matmul(GSM, transpose(..)), GSM the loop item that reads R
        if not (isinstance(u, Library) and u.op == "matmul" and u.args[0] in d.item and d.swapped(u.args[1])):
            continue
        gsm, gseen = u.args[0], set(seen)
        ge = d.value(gsm, gseen)
        inner, scale = _scaled(ge, d.buffers)
        m = _masked(inner, 0.0)
        if r not in refs(ge) or m is None or m[0].type.shape != inner.type.shape:
            continue
        _, kept, diagonal = m
        want = Op("mul", (pe, Op("sub", (gase, Ref(r, d.buffers[r].type)), kept.type)), kept.type)
        if _same(kept, want):
            ch = _Chain(d, set(), set())
            ch.add(ga, r, gsm, *gseen)
            return _backward_tail(d, ch, gsm, ga, p, v, (scale, diagonal, drop))
    return None


def _same(a: Expr, b: Expr) -> bool:
    """a == b up to the order of a product's or a sum's operands (references by name)."""
    if isinstance(a, Op) and isinstance(b, Op):
        if a.op != b.op or a.attrs != b.attrs or len(a.args) != len(b.args):
            return False
        if all(_same(x, y) for x, y in zip(a.args, b.args)):
            return True
        return a.op in ("mul", "add") and _same(a.args[0], b.args[1]) and _same(a.args[1], b.args[0])
    if isinstance(a, Ref) and isinstance(b, Ref):
        return a.name == b.name
    return a == b


def _grad_matmuls(d: _Defs, gsm: str, g: str, ga: str) -> dict[str, str]:
    """The matmuls of the backward that read GSM or G: GQ = GSM x transpose(T) (K = T's
    transposed source), GST = transpose(Q) x GSM and GK its transpose, GV = transpose(A) x G."""
    f: dict[str, str] = {}
    for u in d.units:
        if not (isinstance(u, Library) and u.op == "matmul"):
            continue
        if u.args[0] == gsm and d.swapped(u.args[1]):
            f.update(gq=u.dst, tk=u.args[1], k=d.swapped(d.swapped(u.args[1])))
        elif u.args[1] == gsm and d.swapped(u.args[0]):
            f.update(gst=u.dst, tq=u.args[0], q=d.swapped(u.args[0]))
        elif u.args[1] == g and d.swapped(u.args[0]) and u.dst != ga:
            f.update(gv=u.dst, ta=u.args[0], a=d.swapped(u.args[0]))
    for u in d.units:
        if f.get("gst") and isinstance(u, Library) and u.args[0] == f["gst"] and d.swapped(u.dst) == f["gst"]:
            f["gk"] = u.dst
    return f


def _backward_tail(d: _Defs, ch: _Chain, gsm: str, ga: str, p: str, v: str,
                   how: tuple[str, int, tuple[str, str, str]]) -> Attention | None:
    gau = d.library(ga, "matmul")
    assert gau is not None
    g, tv = gau.args
    f = _grad_matmuls(d, gsm, g, ga)
    if not all(f.get(n) for n in ("gq", "k", "gk", "gv", "q", "a")):
        return None
    qt, vt, gt = (d.buffers[n].type for n in (f["q"], v, g))
    if not _shapes(d, f["q"], f["k"], v, p) or d.buffers[f["a"]].type != d.buffers[p].type or d.buffers[g].kind not in MEMORY \
            or (gt.shape, gt.layout, gt.dtype) != ((*qt.shape[:-1], vt.shape[-1]), qt.layout, qt.dtype):
        return None
    ch.results = {f["gq"], f["gk"], f["gv"]}
    ch.add(f["gq"], f["gst"], f["gk"], f["gv"])
    for t in (tv, f["tq"], f["ta"], f["tk"]):  # the transposed copies only the chain reads
        if ch.only_read_by_chain(t, d.lib[t]):
            ch.add(t)
    s_in, p_in, p_whole = "", p, d.buffers[p].kind == "param"  # a saved P: masked entries not known to be 0
    w = "" if p_whole else d.units[d.lib[p]].args[0]  # type: ignore[union-attr]
    wm = _masked(d.item[w][1], float("-inf")) if w in d.item else None
    if not p_whole and (wm is None or wm[2] != how[1] or wm[0].type.shape != d.buffers[p].type.shape):
        return None  # P is not the softmax of the scores masked alike: its masked entries may not be 0
    if wm is not None and ch.only_read_by_chain(p, d.lib[p]) and ch.only_read_by_chain(w, d.item[w][0], d.lib[p]) \
            and isinstance(wm[1], Ref) and d.buffers[wm[1].name].kind in MEMORY:
        again = ch.copy()
        again.add(w, p)
        if again.written() is not None:  # (W's loop may compute other values too: then P is read)
            s_in, p_in, ch = wm[1].name, "", again  # P computed again from the stored scores
    if ch.written() is None:
        return None
    a = f["a"]
    dropped = _dropped(d.value(a), d.buffers) if a in d.item else None
    made = a == p or dropped is not None and _ref(dropped[0]) == p
    scale, diagonal, (drop_p, seed, site) = how
    a_in = "" if a == p and not p_whole else a  # (a saved P is its own A: dv reads it whole)
    if a != p and made and dropped is not None and dropped[1] == how[2] and ch.only_read_by_chain(a, d.item[a][0]):
        again = ch.copy()
        again.add(a)
        if again.written() is not None:  # A = dropout(P) with GA's mask, computed again by the call (a backward
            a_in, ch = "", again          # program's, autodiff/saved.py): a is not written
    return Attention("backward", tuple(sorted(ch.members)), f["q"], f["k"], v, p, diagonal, scale, drop_p, seed,
                     site, g=g, s_in=s_in, p_in=p_in, a_in=a_in, a_whole=bool(a_in) and (not made or p_whole),
                     p_whole=p_whole,
                     dq=f["gq"], dk=f["gk"], dv=f["gv"])


def find(units: tuple[Unit, ...] | list[Unit], buffers: dict[str, Buffer]) -> tuple[Attention, ...]:
    """The attention chains of UNITS (the top-level units of a plan), none sharing a unit."""
    d = _Defs(units, buffers)
    found: list[Attention] = []
    taken: set[int] = set()
    for i, u in enumerate(units):
        if not isinstance(u, Library) or u.op not in ("softmax", "sum_keep"):
            continue
        att = _forward(d, i) if u.op == "softmax" else _backward(d, i)
        if att is not None and not taken & set(att.members):
            found.append(att)
            taken |= set(att.members)
    return _with_dead_transposes(d, found, taken)


def unwritten(units: tuple[Unit, ...] | list[Unit], buffers: dict[str, Buffer], a: Attention) -> set[str]:
    """The scratch values of A's chain that its call neither writes nor reads (the scores, the
    masked scores, a dropout's result the call computes as it goes): only A's members touch them,
    so where A runs as one call they need no memory."""
    named = {a.q, a.k, a.v, a.g, a.o, a.s, a.w, a.p, a.a, a.s_in, a.p_in, a.a_in, a.dq, a.dk, a.dv}
    members = set(a.members)
    inner: set[str] = set()
    for i in members:
        u = units[i]
        inner |= {it.name for it in u.items} if isinstance(u, Loop) else {u.dst} if isinstance(u, Library) else set()
    return {n for n in inner - named if n in buffers and buffers[n].kind == "scratch"
            and not any(_touches(u, {n}) for j, u in enumerate(units) if j not in members)}


def _with_dead_transposes(d: _Defs, found: list[Attention], taken: set[int]) -> tuple[Attention, ...]:
    """The chains with each transposed copy of the last two dims (T = transpose(K), a scratch
    value) that only members of chains read, across chains: the forward's T read by the
    forward's and the backward's call (a derived program), or T recomputed by a backward
    program for its call alone. The calls read K itself, so T is computed for nobody where
    they run: it joins the first chain that reads it (`replaces` in the plan)."""
    out = list(found)
    for j, u in enumerate(d.units):
        if j in taken or not isinstance(u, Library) or not d.swapped(u.dst) or d.buffers[u.dst].kind != "scratch":
            continue
        readers = [i for i, v in enumerate(d.units) if i != j and _touches(v, {u.dst})]
        chains = {i: k for k, a in enumerate(out) if "cpu" in a.fused for i in a.members}
        if readers and all(i in chains for i in readers):
            k = chains[readers[0]]
            out[k] = replace(out[k], members=tuple(sorted((*out[k].members, j))))
            taken.add(j)
    return tuple(out)
