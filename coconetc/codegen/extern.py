"""An extern operation's call (docs/language.md, "Extern operations"), the same in both
backends but for the function named and the arguments appended (CUDA: the stream)."""

from __future__ import annotations

from coconetc.codegen.base import Writer, prod
from coconetc.codegen.emit import COMPUTE, literal
from coconetc.ir import ops
from coconetc.plan.units import Library

_prod = prod


def extern_call(r: Writer, u: Library, function: str, extra: tuple[str, ...] = ()) -> str:
    """An extern operation's call (docs/language.md, "Extern operations"): each tensor
    operand as a pointer to this rank's elements, each 0-d operand as a value of the result's
    compute type, then the result's pointer and its local shape as rows x last dim."""
    t = r.types[u.dst]
    ct = COMPUTE[t.dtype]
    consts, names = dict(dict(u.attrs)["consts"]), iter(u.args)  # type: ignore[call-overload]
    args = []
    for i in range(len(ops.get(u.op).params)):
        if i in consts:
            args.append(f"static_cast<{ct}>({literal(consts[i], 'f64')})")
            continue
        a = next(names)
        scalar = r.types[a].ndim == 0
        args.append(f"static_cast<{ct}>(coconet::to_compute(v_{a}[0]))" if scalar else f"v_{a}")
    dims = r.ldims(t)
    rows, cols = (_prod(dims[:-1]), dims[-1]) if dims else ("int64_t(1)", "int64_t(1)")
    return f"{function}({', '.join([*args, f'v_{u.dst}', rows, cols, *extra])})"
