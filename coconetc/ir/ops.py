"""The operation registry: one entry (an OpDef) per operation of the language, holding all
the compiler knows about it: its kind, parameters (with keyword defaults), typing rule, how it
commutes with slicing, its NumPy function, its C++ expression and its cost. The checker,
typing, printer, interpreter, schedule legality and the C++ expression emitter read it.

Adding a pointwise operation is one `register(OpDef(...))` here (or at run time, see
tests/test_registry.py); docs/operations.md says how. This module imports no interpreter and no
backend: the interpreter and the backends import it."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from coconetc.errors import Span
from coconetc.ir import reference as ref
from coconetc.ir import typerules as tr
from coconetc.ir.expr import Expr
from coconetc.ir.types import DTYPES, REDUCE_OPS, TType

# --- what an entry holds ---------------------------------------------------------------

KINDS = ("pointwise", "random", "index", "reduction", "tensor", "collective")
# tensor: runs as one library call (a plan Library unit: a runtime function of every backend,
# runtime_cpp/coconet/kernels.h, gemm.h, grad.h and their cuda/ mirrors; an extern one: its
# declared C++ function), its integer parameters in the unit's attrs
# index: element by element, a function of the element's position (causal), rendered by the
# backends' indexing (codegen/indexing.py) and computed by the interpreter itself

# How an operation commutes with slicing (what `reorder` needs to move it onto slices).
FREE = "free"  # elementwise: runs on a slice; replicated operands are read at the slice
PARTIAL = "partial"  # a reduction: per-slice partial results plus a cross-rank reduction
ROWS = "rows"  # only when the slice leaves the last dim whole (layernorm)
NEVER = "never"  # does not commute with slicing (matmul, conv2d, collectives)
DIMS = "dims"  # only along the dims listed in OpDef.slice_dims (an extern operation's choice)
SLICINGS = (FREE, PARTIAL, ROWS, NEVER, DIMS)

# How operands are brought to a common type, in the interpreter and in C++ alike.
TO_RESULT = "result"  # every operand is converted to the result's compute type
TO_COMMON = "common"  # comparisons: to the operands' common (strong) type
COND_FIRST = "cond"  # where: the first operand (a bool) as it is, the others to the result's
AS_IS = "as_is"  # cast: the operand as it is

class _Required:
    """The default of a parameter that has none (it must be given)."""

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()


@dataclass(frozen=True)
class Arg:
    """One parameter. kind 'value': an expression operand; 'word': a compile-time word from
    `choices` (a reduction op, a dtype, a direction); 'int': an integer literal >= `minimum`;
    'shape': a shape `[d, ...]` of size symbols and integers (reshape's; -1: inferred).
    A parameter with a default may be given by keyword (and is printed as one). literal: the
    dtype a number written for this value takes (layernorm's eps is an f32 even when written 1)."""

    name: str
    kind: str = "value"
    choices: tuple[str, ...] = ()
    default: Any = REQUIRED
    minimum: int = 0
    literal: str | None = None

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


@dataclass(frozen=True)
class Infix:
    """An operator written between its operands. prec: the grammar's level (0 comparisons,
    1 + -, 2 * /, 4 **; unary minus is 3); right: `atom ** unary` (binds to the right)."""

    symbol: str
    prec: int
    right: bool = False


ATOM = 9  # C++ precedence of a call or a name (higher binds tighter)


@dataclass(frozen=True)
class Cpp:
    """C++ computing one element: `template` with {0}, {1}, ... for the operands, {ct} for the
    result's compute type and {ctype} for its storage type. prec: the C++ precedence of the
    result (ATOM for a call); operand_prec[i]: the precedence operand i needs to go without
    parentheses (missing: 0, i.e. inside a call's parentheses)."""

    template: str
    prec: int = ATOM
    operand_prec: tuple[int, ...] = ()


@dataclass(frozen=True)
class Cost:
    """For a cost model. flops: per result element (inner: also per step of the contracted
    dim, K for matmul, C*KH*KW for conv2d); transcendental: exp/log/sqrt/erf calls per result
    element; comm: bytes each rank sends per byte of input (ring algorithms, the (R-1)/R
    factor left out). Memory traffic follows from the operand and result types."""

    flops: float = 1.0
    transcendental: float = 0.0
    inner: bool = False
    comm: float = 0.0


NONNEG = "nonneg"  # >= 0 whatever its arguments (booleans included)
FOLLOWS = "follows"  # >= 0 when the arguments Domain.of name are
EITHER = "either"  # >= 0 when any one argument is (max(a, b))
UNKNOWN = "unknown"  # no positive argument settles its sign (a difference, a negation, gelu ...)


@dataclass(frozen=True)
class Domain:
    """Where an operation is defined and what sign its result has, for drawing test inputs
    (oracle/inputs.py): positive: the value arguments it needs positive (sqrt's, a divisor, a
    power's base); result: NONNEG, FOLLOWS (of: the arguments it follows, None: every one),
    EITHER or UNKNOWN. An operation without one (an extern operation) is taken as defined only
    for positive arguments: every argument it reads is drawn positive. waived: when its
    positive arguments may take any sign after all (INTEGER_EXPONENT: a power whose exponent,
    argument 1, is an integer literal; NONZERO_DIVISOR: a divisor written where(v == 0, c, v)
    with a literal c != 0). square: when its result is >= 0 whatever its arguments
    (SAME_ARGUMENTS: x * x; EVEN_EXPONENT: x ** 2)."""

    positive: tuple[int, ...] = ()
    result: str = UNKNOWN
    of: tuple[int, ...] | None = None
    waived: str | None = None
    square: str | None = None


INTEGER_EXPONENT = "integer exponent"
NONZERO_DIVISOR = "nonzero divisor"
SAME_ARGUMENTS = "same arguments"
EVEN_EXPONENT = "even exponent"


ANY = Domain()  # defined for every value, its sign unknown
NONNEGATIVE = Domain(result=NONNEG)
ALL_FOLLOW = Domain(result=FOLLOWS)  # >= 0 when every argument is (a sum, a product, a GEMM)
FIRST_FOLLOWS = Domain(result=FOLLOWS, of=(0,))  # >= 0 when its first argument is (a copy, a collective)


@dataclass(frozen=True)
class Impl:
    """A backend's implementation of an extern operation: the header the generated module
    includes and the function it calls (docs/language.md, "Extern operations")."""

    header: str
    function: str


@dataclass(frozen=True)
class Extern:
    """What an `extern op` declaration adds to its OpDef. like: the operand whose shape and
    dtype the result has; reference: 'module:function' as written, resolved to a file or module
    (where); cpp/cuda: the implementations (None: that backend has none); decl: the declaration
    as .ccn text (the printer writes it before a program that calls the operation); file: the
    .ccn file that declared it; grads: the declared derivatives, (parameter, expression text)
    for each `grad_<p> = "..."` (coconetc/frontend/gradexpr.py; the derivation expands them)."""

    like: int
    reference: str
    where: str
    cpp: Impl | None
    cuda: Impl | None
    decl: str
    file: str = ""
    grads: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class OpDef:
    """An operation. `numpy`: the reference function of the operands' arrays (converted as
    `operands` says) and of the word/int parameters by keyword; for a reduction, the per-rank
    partial result, combined across ranks by `combine` (sum, or max/min for the max(x)/min(x)
    reductions) and then `finish`ed. numpy=None: the
    interpreter implements the operation itself (it needs ranks, segments or the RNG).
    `cpp`: the C++ expression of one element, for pointwise operations (None: the backend
    renders it: dropout needs the element's index, the others are not expressions)."""

    name: str
    kind: str
    params: tuple[Arg, ...]
    typing: tr.Rule = tr.pointwise_rule
    slicing: str = FREE
    numpy: Callable[..., Any] | None = None
    finish: Callable[[Any], Any] | None = None
    cpp: Cpp | None = None
    operands: str = TO_RESULT
    cost: Cost = field(default_factory=Cost)
    infix: Infix | None = None
    prefix: str | None = None  # a prefix operator (unary minus)
    fusable: bool = True  # may join a fused loop or fused collective
    doc: str = ""
    slice_dims: tuple[int, ...] = ()  # slicing DIMS: the dims a slice may cut
    extern: Extern | None = None  # declared by `extern op` in a .ccn file
    combine: str = "sum"  # a reduction: how the ranks' partial results combine (sum | max | min)
    written: str = ""  # the name a program writes, when not `name` (amax: max(x)); see called()
    traits: frozenset[str] = frozenset()  # what the planner and the backends know it as (TRAITS)
    domain: Domain | None = None  # its input domain and result sign (None: not known, as an extern's)

    @property
    def called(self) -> bool:
        """Written `name(args)` in a program (not an operator)."""
        return self.infix is None and self.prefix is None

    @property
    def values(self) -> tuple[Arg, ...]:
        return tuple(a for a in self.params if a.kind == "value")

    @property
    def settings(self) -> tuple[Arg, ...]:
        """The compile-time parameters (words and integers): the IR's attrs."""
        return tuple(a for a in self.params if a.kind != "value")

    def defaults(self) -> dict[str, Any]:
        return {a.name: a.default for a in self.params if not a.required}


# --- the registry ----------------------------------------------------------------------

REGISTRY: dict[str, OpDef] = {}
_CHANGES = [0]  # how many times REGISTRY has changed (typing_state)


def typing_state() -> tuple[int, object]:
    """What type_op's answers depend on besides its arguments: the registry (by the number of
    times it has changed) and the extern scope in force. An expression typed under one state
    types the same under an equal one (ir/rewrite.py retype remembers it)."""
    return _CHANGES[0], _SCOPE.get()


def register(d: OpDef) -> OpDef:
    if d.name in REGISTRY:
        raise ValueError(f"operation '{d.name}' is already registered")
    if d.kind not in KINDS or d.slicing not in SLICINGS:
        raise ValueError(f"operation '{d.name}': kind {d.kind!r} / slicing {d.slicing!r}")
    if d.kind == "pointwise" and (d.numpy is None or d.cpp is None):
        raise ValueError(f"pointwise operation '{d.name}' needs a numpy function and a Cpp template")
    REGISTRY[d.name] = d
    _CHANGES[0] += 1
    return d


# `extern op` declarations are the declaring file's own: two files (or two versions of one file)
# that declare the same name with different declarations each get an entry, the later one
# under a key of its own, NAME~K (`~` is no character of a .ccn name, so no program can write it),
# and the checker writes that key into the file's IR, so every later layer (the planner, the
# renderers, the interpreter, autodiff) finds the file's own entry by the name in the IR. While a
# file is checked (sourcefile.load_source) or an extern's derivative expanded, the names it wrote
# mean its own declarations (extern_scope). A declaration equal to an entry's (the same file
# loaded again, or the printer's text of it) replaces that entry. `shown` is how a key reads in
# messages and listings.
SEP = "~"
_SCOPE: ContextVar[Mapping[str, OpDef] | None] = ContextVar("coconet_extern_scope", default=None)
_SCOPES: dict[str, Mapping[str, OpDef]] = {}  # a registry key -> its declaring file's externs


def register_extern(d: OpDef, scope: Mapping[str, OpDef] | None = None) -> OpDef:
    """An `extern op` declaration's entry, by its name or, where another declaration holds the
    name, by a key of its own (see above); a built-in name is refused. SCOPE: the declaring
    file's externs (name as written -> entry), which its derivatives' expressions call."""
    old = REGISTRY.get(d.name)
    if old is not None and old.extern is None:
        raise ValueError(f"'{d.name}' is a built-in operation")
    key, k = d.name, 0
    while key in REGISTRY and not _same(REGISTRY[key], d):
        k += 1
        key = f"{d.name}{SEP}{k}"
    if REGISTRY.pop(key, None) is not None:
        _CHANGES[0] += 1
    entry = register(d if key == d.name else replace(d, name=key))
    if scope is not None:
        _SCOPES[key] = scope
    return entry


def _same(a: OpDef, b: OpDef) -> bool:
    """The same declaration (its text and where its reference was found), from any file."""
    return a.extern is not None and b.extern is not None and \
        (a.extern.decl, a.extern.where) == (b.extern.decl, b.extern.where)


@contextmanager
def extern_scope(externs: Mapping[str, OpDef]) -> Iterator[None]:
    """Inside the block, a name that EXTERNS holds (a file's declarations, by the names it
    wrote) means that entry, for get, called and arities."""
    token = _SCOPE.set(externs)
    try:
        yield
    finally:
        _SCOPE.reset(token)


def scope_of(key: str) -> Mapping[str, OpDef]:
    """The externs of the file that declared the entry KEY (for its derivatives)."""
    return _SCOPES.get(key, {})


def shown(name: str) -> str:
    """An operation's name as a program writes it (an extern's key without its ~K)."""
    return name.split(SEP, 1)[0]


def _scoped(name: str) -> OpDef | None:
    scope = _SCOPE.get()
    return scope.get(name) if scope else None


def unregister(name: str) -> None:
    del REGISTRY[name]
    _CHANGES[0] += 1


@contextmanager
def registered(d: OpDef) -> Iterator[OpDef]:
    """`with registered(OpDef(...)):` the operation exists inside the block only."""
    register(d)
    try:
        yield d
    finally:
        unregister(d.name)


# An operation's traits (OpDef.traits): what the planner and the backends treat alike.
GEMM = "gemm"  # C = A B (or with a transposed operand): a BLAS GEMM, with epilogues (plan/epilogue.py)
OVERLAPPED = "overlapped"  # a GEMM an overlap can cut into chunks of rows (ir/nodes.py Program.sum_terms)
ROWWISE = "rowwise"  # one row of the last dim at a time: a fused collective's row-wise phase (plan/fusion_legality.py)
RESIDUAL = "residual"  # a row-wise call that adds a residual to the row it writes (its epilogue)
TRAITS = (GEMM, OVERLAPPED, ROWWISE, RESIDUAL)


def has(name: str, trait: str) -> bool:
    """Whether operation NAME (registered; any other: False) has TRAIT."""
    d = _scoped(name) or REGISTRY.get(name)
    return d is not None and trait in d.traits


def get(name: str) -> OpDef:
    mine = _scoped(name)
    if mine is not None:
        return mine
    if name not in REGISTRY:
        raise KeyError(f"no operation '{name}' in the registry")
    return REGISTRY[name]


def called(name: str, nargs: int | None = None) -> OpDef | None:
    """The operation a program calls as `name(...)` with `nargs` arguments, if any. A name
    written for two operations (`max(x)`, the reduction amax, and `max(a, b)`, pointwise)
    is decided by the number of arguments: the one whose value parameters it fills."""
    mine = _scoped(name)
    if mine is not None:
        return mine
    if nargs is not None:
        for d in REGISTRY.values():
            if d.written == name and len(d.values) == nargs:
                return d
    own = REGISTRY.get(name)
    return own if own is not None and own.called and not own.written else None


def arities(name: str) -> tuple[int, ...]:
    """The numbers of arguments `name(...)` may take when the name is written for several
    operations (max: 1 or 2); () for any other name."""
    if _scoped(name) is not None:
        return ()
    out = sorted({len(d.values) for d in REGISTRY.values() if d.written == name and d.called}
                 | ({len(REGISTRY[name].values)} if name in REGISTRY else set()))
    return tuple(out) if any(d.written == name for d in REGISTRY.values()) else ()


def spelled(d: OpDef) -> str:
    """How a program writes a call of d."""
    return d.written or shown(d.name)


def infix(symbol: str) -> OpDef:
    return next(d for d in REGISTRY.values() if d.infix is not None and d.infix.symbol == symbol)


def prefix(symbol: str) -> OpDef:
    return next(d for d in REGISTRY.values() if d.prefix == symbol)


def names(*kinds: str) -> tuple[str, ...]:
    return tuple(n for n, d in REGISTRY.items() if d.kind in kinds)


def type_op(op: str, args: Sequence[Expr], attrs: dict[str, Any], span: Span) -> TType:
    """The type of `op(args)` by the operation's rule; raises TypeErr at span when the
    operation is ill-typed."""
    d = get(op)
    return d.typing(op, args, {**d.defaults(), **attrs}, span)


def attr(op: Any, name: str) -> Any:
    """An IR Op's attribute, or the registry's default for it."""
    return op.attr(name, get(op.op).defaults().get(name))


# --- the operations ----------------------------------------------------------------------

X = (Arg("x"),)
AB = (Arg("a"), Arg("b"))
OP = Arg("op", "word", REDUCE_OPS)
ROOT = Arg("root", "int")


def _unary(name: str, fn: Callable[..., Any], cpp: str, flops: float, trans: float, domain: Domain) -> None:
    rule = tr.float_valued if trans else tr.pointwise_rule  # transcendental: never an integer
    register(OpDef(name, "pointwise", X, rule, numpy=fn, cpp=Cpp(cpp + "({0})"),
                   cost=Cost(flops, trans), domain=domain))


def _binary(name: str, sym: str, prec: int, fn: Callable[..., Any], cpp_prec: int, domain: Domain,
            compare: bool = False) -> None:
    rule = tr.compare if compare else tr.pointwise_rule
    register(OpDef(name, "pointwise", AB, rule, numpy=fn, infix=Infix(sym, prec, sym == "**"),
                   cpp=Cpp(f"{{0}} {sym} {{1}}", cpp_prec, (cpp_prec, cpp_prec + 1)),
                   operands=TO_COMMON if compare else TO_RESULT, domain=domain))


def _function2(name: str, fn: Callable[..., Any], cpp: str, domain: Domain, flops: float = 1, trans: float = 0,
               infix: Infix | None = None) -> None:
    register(OpDef(name, "pointwise", AB, numpy=fn, cpp=Cpp(cpp + "<{ct}>({0}, {1})"),
                   infix=infix, cost=Cost(flops, trans), domain=domain))


_fn: Callable[..., Any]  # the loops below share their variables
for _name, _sym, _prec, _fn, _cprec, _dom in (
        ("add", "+", 1, np.add, 6, ALL_FOLLOW), ("sub", "-", 1, np.subtract, 6, ANY),
        ("mul", "*", 2, np.multiply, 7, Domain(result=FOLLOWS, square=SAME_ARGUMENTS)),
        ("div", "/", 2, ref.div, 7, Domain((1,), FOLLOWS, waived=NONZERO_DIVISOR))):
    _binary(_name, _sym, _prec, _fn, _cprec, _dom)
for _name, _sym, _fn, _cprec in (("lt", "<", np.less, 5), ("le", "<=", np.less_equal, 5),
                                 ("gt", ">", np.greater, 5), ("ge", ">=", np.greater_equal, 5),
                                 ("eq", "==", np.equal, 4), ("ne", "!=", np.not_equal, 4)):
    _binary(_name, _sym, 0, _fn, _cprec, NONNEGATIVE, compare=True)
_function2("pow", np.power, "coconet::power", Domain((0,), FOLLOWS, (0,), waived=INTEGER_EXPONENT, square=EVEN_EXPONENT),
           2, 2, infix=Infix("**", 4, right=True))
_function2("min", np.minimum, "coconet::minimum", ALL_FOLLOW)
_function2("max", np.maximum, "coconet::maximum", Domain(result=EITHER))
register(OpDef("neg", "pointwise", X, numpy=np.negative, prefix="-", cpp=Cpp("-{0}", 8, (8,)), domain=ANY))
for _name, _fn, _cpp, _flops, _trans, _dom in (
        ("sqrt", np.sqrt, "std::sqrt", 1, 1, Domain((0,), NONNEG)), ("rsqrt", ref.rsqrt, "coconet::rsqrt", 2, 1,
                                                                      Domain((0,), NONNEG)),
        ("exp", np.exp, "std::exp", 1, 1, NONNEGATIVE), ("log", np.log, "std::log", 1, 1, Domain((0,))),
        ("abs", np.abs, "std::abs", 1, 0, NONNEGATIVE), ("tanh", np.tanh, "std::tanh", 1, 1, ALL_FOLLOW),
        ("sigmoid", ref.sigmoid, "coconet::sigmoid", 3, 1, NONNEGATIVE),
        ("relu", ref.relu, "coconet::relu", 1, 0, NONNEGATIVE), ("gelu", ref.gelu, "coconet::gelu", 4, 1, ANY)):
    _unary(_name, _fn, _cpp, _flops, _trans, _dom)
register(OpDef("where", "pointwise", (Arg("cond"), Arg("a"), Arg("b")), tr.where, numpy=np.where,
               cpp=Cpp("(({0}) ? {ct}({1}) : {ct}({2}))"), operands=COND_FIRST,
               domain=Domain(result=FOLLOWS, of=(1, 2))))
register(OpDef("cast", "pointwise", (Arg("x"), Arg("dtype", "word", DTYPES)), tr.cast,
               numpy=ref.cast, cpp=Cpp("coconet::cast_to<{ctype}>({0})"), operands=AS_IS,
               cost=Cost(0), domain=FIRST_FOLLOWS))

register(OpDef("dropout", "random", (Arg("x"), Arg("p"), Arg("seed")), tr.dropout,
               cost=Cost(20), doc="the mask comes from the counter-based RNG (interp/rng.py)", domain=FIRST_FOLLOWS))

register(OpDef("causal", "index", (Arg("x"), Arg("diagonal", "int", default=0, minimum=-(2**62))), tr.causal,
               cost=Cost(1), fusable=False, domain=NONNEGATIVE,
               doc="true where the element's last index <= its second-last index + diagonal (torch.tril's "
                   "keep); x gives only the shape and layout: no mask is stored"))

register(OpDef("sum", "reduction", X, tr.reduction, PARTIAL, numpy=ref.sum_partial, domain=ALL_FOLLOW))
register(OpDef("norm", "reduction", X, tr.reduction, PARTIAL, numpy=ref.sumsq_partial,
               finish=np.sqrt, cost=Cost(2), domain=NONNEGATIVE))
register(OpDef("segment_norm", "reduction", X, tr.segment_norm, PARTIAL, cost=Cost(2), domain=NONNEGATIVE))
# max(x), min(x): the largest (smallest) element, NaN if any is NaN (as torch.amax); an empty
# slice's partial result is -inf (+inf), NumPy's `initial`. Written max/min with one argument.
register(OpDef("amax", "reduction", X, tr.extreme, PARTIAL, numpy=ref.max_partial, combine="max",
               written="max", domain=ALL_FOLLOW))
register(OpDef("amin", "reduction", X, tr.extreme, PARTIAL, numpy=ref.min_partial, combine="min",
               written="min", domain=ALL_FOLLOW))

register(OpDef("matmul", "tensor", AB, tr.matmul, NEVER, numpy=np.matmul, fusable=False,
               cost=Cost(2, inner=True), traits=frozenset({GEMM, OVERLAPPED}), domain=ALL_FOLLOW))
register(OpDef("layernorm", "tensor", (Arg("x"), Arg("gamma"), Arg("beta"), Arg("eps", literal="f32")),
               tr.layernorm, ROWS, numpy=ref.layernorm, cost=Cost(8, 1), traits=frozenset({ROWWISE}), domain=ANY))
register(OpDef("softmax", "tensor", X, tr.rowwise, ROWS, numpy=ref.softmax, fusable=False, cost=Cost(4, 1),
               doc="over the last dim, max subtracted; a fully masked (all -inf) row is zeros", domain=NONNEGATIVE))
register(OpDef("transpose", "tensor", (Arg("x"), Arg("dim0", "int"), Arg("dim1", "int")), tr.transpose, NEVER,
               numpy=ref.transpose, fusable=False, cost=Cost(0), doc="two dims swapped (a copy)",
               domain=FIRST_FOLLOWS))
register(OpDef("reshape", "tensor", (Arg("x"), Arg("shape", "shape")), tr.reshape, NEVER, fusable=False,
               cost=Cost(0), doc="one dim split, or adjacent dims merged (a copy); the interpreter's own "
                                 "(the local shape follows the slices)", domain=FIRST_FOLLOWS))
register(OpDef("index", "tensor", (Arg("x"), Arg("i", "int")), tr.index, NEVER, numpy=ref.index, fusable=False,
               cost=Cost(0), doc="x[i] along dim 0, an integer literal L (a layer of a stacked parameter: "
                                 "repeat); the stacked buffer's memory where the plan allows (Buffer.same_as), "
                                 "else a copy", domain=FIRST_FOLLOWS))
register(OpDef("conv2d", "tensor", (Arg("x"), Arg("w"), Arg("stride", "int", default=1, minimum=1),
                                    Arg("padding", "int", default=0)),
               tr.conv2d, NEVER, numpy=ref.conv2d, fusable=False, cost=Cost(2, inner=True), domain=ALL_FOLLOW))

_DIM = Arg("dim", "int", default=0)
for _name, _params, _comm in (
        ("allreduce", (OP, Arg("x")), 2.0), ("reducescatter", (OP, Arg("x"), _DIM), 1.0),
        ("allgather", X, 1.0), ("broadcast", (Arg("x"), ROOT), 1.0),
        ("reduce", (OP, Arg("x"), ROOT), 1.0), ("scatter", (Arg("x"), _DIM), 0.0),
        ("send", (Arg("x"), Arg("direction", "word", ("next", "prev"))), 1.0)):
    register(OpDef(_name, "collective", _params, tr.collective, FREE if _name == "send" else NEVER,
                   cost=Cost(0, comm=_comm), domain=FIRST_FOLLOWS))

# coconetc's own operations (autodiff/ops.py adds the derivatives' with register_built_in): what a
# warm load's record may take as given, unlike an operation registered at run time (runtime/warm.py)
BUILT_IN: dict[str, OpDef] = dict(REGISTRY)


def register_built_in(d: OpDef) -> OpDef:
    BUILT_IN[d.name] = register(d)
    return d


def added() -> list[str]:
    """The operations registered at run time: neither coconetc's own nor a file's `extern op`
    (which only the file that declares it may call)."""
    return sorted(n for n, d in REGISTRY.items() if d.extern is None and BUILT_IN.get(n) is not d)
