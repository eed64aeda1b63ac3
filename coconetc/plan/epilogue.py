"""GEMM epilogues (issue 40 point 1): when a matmul's one consumer is the pointwise loop right
after it computing bias, gelu(+ bias), residual or scale of the matmul's result, the plan
marks the matmul's Library unit with that epilogue (Library.epilogue), so that a backend can
have the GEMM write the finished value.

The rule, in one place (epilogue_of):
- the unit is a Library matmul, matmul_nt or matmul_tn writing a scratch buffer (not a
  parameter, an output or an update's source), or a matmul writing an output (a saving
  forward's saved product, handed back as well);
- the next unit is a Loop over exactly the matmul's result type (shape and layout) with one
  stored item, and no other unit of the plan reads or writes the matmul's result;
- the item's expression is one of, with R the matmul's result read exactly once:
    R + b, b + R           b a vector of R's last dim, held like R's last dim  -> bias(b)
    gelu(R + b), gelu(b + R)                                                   -> gelu_bias(b)
    R + r, r + R           r of R's type                                       -> residual(r)
    R * s, s * R           s a scalar (a parameter, a let or a literal)        -> scale(s)
The epilogue (units.Epilogue) is KIND of OPERAND, its value ITEM, the loop's value.
Where the epilogue is fused is decided here too (fused_on, Library.fused), and the renderers
only read it:
- cpu: a matmul whose right operand is 2-d (one GEMM over the rows of every leading dim of
  the left), the loop of at least 2 dims, writing no scattered parameter's segments and reading
  none: one blocked pass (codegen/cpu/loops.py render_epilogue), which writes the matmul's
  result whole too (so an output result is fused there: gpt_block_fwd's saved hm); a
  residual whose loop updates that parameter in place (`update(a, a + matmul(x, w))`,
  accumulates) is one GEMM with beta = 1 into it instead, and so is a matmul_tn's (an
  accumulating backward's weight gradient, autodiff/saved.py accumulating);
- cuda: the same matmuls in f32, f16 or bf16, with the epilogue bias, residual or scale by a
  literal or a scalar parameter (its value on the host): one cublasLtMatmul (cuda/blas.cuh
  matmul_epilogue: CUBLASLT_EPILOGUE_BIAS, beta = 1 with C the residual, alpha the scale; where
  cuBLASLt refuses it at run time, the GEMM and then the loop, as unfused); not an output
  result (cuBLASLt writes the loop's value only).
  gelu_bias is not fused on CUDA: cuBLASLt's GELU is the tanh approximation, the language's
  gelu is the exact x * Phi(x) (runtime_cpp/coconet/pointwise.h), so the loop runs after the GEMM;
elsewhere (batched matmuls, matmul_nt/tn) the loop runs after the GEMM.

A layernorm's input gradient (a derived program's layernorm_dx) takes the residual epilogue too,
the cotangent of the residual added (`g_x1 = d_y + layernorm_dx(x1, ...)`, a pre-layernorm
block's backward): the same rule with layernorm_dx in place of the matmul and residual(r) the
only kind; fused on cpu and cuda (grad.h / cuda/grad.cuh layernorm_dx with `add`: each row's
dx rounded to its type and r added as the loop adds it, so the result is the loop's bit for bit),
unless the loop writes or reads a scattered parameter's segments.

In a derived program, the bias gradient (bgrad, bgrad_of): a sum_lead(G) over every leading dim
of G, and a later matmul_tn(X, G) (the weight gradient, its GEMM summing over the same rows),
with no unit between them writing G or touching the sum: the matmul_tn carries
"bgrad(G) -> DB", fused on cuda only (one cublasLtMatmul with CUBLASLT_EPILOGUE_BGRADA, grad.cuh
matmul_tn_bgrad; the sum_lead then renders as nothing); f32/f16/bf16. The CPU keeps the two."""

from __future__ import annotations

from dataclasses import replace

from coconetc.ir import ops as registry
from coconetc.ir.nodes import Const, Expr, Op, Ref, refs
from coconetc.ir.printer import expr as printed
from coconetc.ir.types import TType
from coconetc.ir.dtypes import TABLE
from coconetc.plan.units import Buffer, Epilogue, Library, Loop, Unit, _may_write, _touches



def carries(op: str) -> bool:
    """Whether a Library unit of OP may carry an epilogue: a GEMM, or a row-wise call that
    adds a residual (ops.RESIDUAL: layernorm_dx)."""
    return registry.has(op, registry.GEMM) or registry.has(op, registry.RESIDUAL)


def residual_only(op: str) -> bool:
    """A row-wise call whose only epilogue is the residual (the call writes the loop's value)."""
    return registry.has(op, registry.RESIDUAL)

BACKENDS = ("cpu", "cuda")
CUDA_DTYPES = tuple(n for n, d in TABLE.items() if d.is_float and d.compute == "f32")  # the cuBLAS path's types


def fused_loop(units: tuple[Unit, ...] | list[Unit], u: Library) -> Loop | None:
    """The loop whose epilogue matmul U applies (the unit after it), or None where U is not one
    of UNITS (inside an overlap or a fused collective, where with_epilogues sets none)."""
    i = next((k for k, v in enumerate(units) if v is u), -1)
    if i < 0:
        return None
    loop = units[i + 1]
    assert isinstance(loop, Loop), loop
    return loop


def epilogue_of(units: tuple[Unit, ...] | list[Unit], i: int,
                buffers: dict[str, Buffer]) -> tuple[Epilogue | None, str]:
    """The epilogue units[i] carries (None when none) and, when none, why not."""
    u = units[i]
    if not (isinstance(u, Library) and carries(u.op)):
        return None, "not a matmul"
    r = u.dst
    if buffers[r].kind != "scratch" and not (buffers[r].kind == "output" and u.op == "matmul"):
        return None, f"'{r}' is not a scratch value but a {buffers[r].kind}"
    if i + 1 >= len(units) or not isinstance(units[i + 1], Loop):
        return None, f"the unit after '{r}' is not a pointwise loop"
    loop = units[i + 1]
    assert isinstance(loop, Loop)
    t = buffers[r].type
    if loop.type != t:
        return None, f"the loop after '{r}' runs over {loop.type}, not over {t}"
    if len(loop.items) != 1 or not loop.items[0].store:
        return None, f"the loop after '{r}' computes {len(loop.items)} values"
    if any(_touches(v, {r}) for j, v in enumerate(units) if j not in (i, i + 1)):
        return None, f"'{r}' is read elsewhere"
    item = loop.items[0]
    found = _match(item.expr, r, t, buffers)
    if residual_only(u.op) and (found is None or found[0] != "residual"):
        return None, f"the loop computes {item.name} from '{r}' as no residual"
    if found is None:
        return None, f"the loop computes {item.name} from '{r}' as none of bias, gelu_bias, residual, scale"
    kind, operand = found
    for let in loop.lets:  # a scalar operand the loop reads as a let: name what it holds
        if operand == let.name:
            operand = printed(let.expr)
    return Epilogue(kind, operand, item.name), ""


def _reshapes_first(units: list[Unit]) -> list[Unit]:
    """UNITS with each reshape that sits between a matmul and the loop after it moved before
    the matmul, where neither reads what the other writes: the loop is then the unit after the
    matmul, and may be its epilogue (`matmul(x, w) + reshape(b, [-1])`: the reshape of the
    bias, which reads a parameter and no result of the matmul)."""
    out = list(units)
    for i in range(len(out) - 2):
        u, r, loop = out[i], out[i + 1], out[i + 2]
        if isinstance(u, Library) and carries(u.op) and isinstance(r, Library) and r.op == "reshape" \
                and isinstance(loop, Loop) and not _touches(r, {u.dst}) and not _touches(u, {r.dst}):
            out[i], out[i + 1] = r, u
    return out


def with_epilogues(units: list[Unit], buffers: dict[str, Buffer]) -> list[Unit]:
    """UNITS with each matmul's epilogue set (the top-level units; inside an overlap or a fused
    collective, none), a reshape between a matmul and its loop moved before it
    (_reshapes_first)."""
    units = _reshapes_first(units)
    out = list(units)
    for i, u in enumerate(units):
        if isinstance(u, Library) and carries(u.op):
            epi, _ = epilogue_of(units, i, buffers)
            if epi is not None:
                loop = units[i + 1]
                assert isinstance(loop, Loop)
                out[i] = replace(u, epilogue=epi, fused=fused_on(u, epi, loop, buffers))
    for i, u in enumerate(out):
        j = bgrad_of(out, i, buffers)
        if j >= 0:
            m = out[j]
            assert isinstance(m, Library) and isinstance(u, Library)
            out[j] = replace(m, epilogue=Epilogue("bgrad", u.args[0], u.dst), fused=("cuda",))
    return out


def bgrad_of(units: list[Unit], i: int, buffers: dict[str, Buffer]) -> int:
    """For units[i] a sum_lead(G) over every leading dim of G: the index of the later
    matmul_tn(X, G) that can produce that sum as its bias-gradient epilogue, or -1."""
    u = units[i]
    if not (isinstance(u, Library) and u.op == "sum_lead"):
        return -1
    g, db = u.args[0], u.dst
    gt = buffers[g].type
    if gt.dtype not in CUDA_DTYPES or dict(u.attrs).get("n") != gt.ndim - 1 or buffers[db].type.ndim != 1 \
            or buffers[g].kind == "segments" or buffers[db].kind not in ("scratch", "output"):
        return -1
    for j in range(i + 1, len(units)):
        v = units[j]
        if isinstance(v, Library) and v.op == "matmul_tn" and v.args[1] == g and v.epilogue is None \
                and buffers[v.args[0]].kind != "segments" and buffers[v.dst].type.dtype == gt.dtype:
            return j
        if _touches(v, {db}) or _may_write(v, g):
            return -1
    return -1


def accumulates(u: Library, loop: Loop, buffers: dict[str, Buffer]) -> bool:
    """Whether U's residual epilogue adds the GEMM into its residual in place: the loop's value
    is an update of the residual parameter computed in its memory (`a1 = update(a, a +
    matmul(x, w))`, a sum accumulated over calls): the CPU then runs one GEMM with beta = 1 into
    it (gemm.h matmul_acc; grad.h matmul_tn_acc, an accumulating backward's weight
    gradients), and neither the GEMM's result nor the loop is written."""
    epi = u.epilogue
    if epi is None or epi.kind != "residual" or u.op not in ("matmul", "matmul_tn") \
            or loop.seg_dst or (u.op == "matmul" and buffers[u.args[1]].type.ndim != 2):
        return False
    dst, acc = buffers[loop.items[0].name], buffers.get(epi.operand)
    return dst.kind == "alias" and dst.of == epi.operand and acc is not None and acc.kind == "param"


def fused_on(u: Library, epilogue: Epilogue, loop: Loop, buffers: dict[str, Buffer]) -> tuple[str, ...]:
    """The backends (BACKENDS) that apply EPILOGUE, the epilogue of matmul U, in its GEMM (the
    rule in the module's docstring); LOOP: the loop after U."""
    if u.op == "matmul_tn" and accumulates(replace(u, epilogue=epilogue), loop, buffers):
        return ("cpu",)  # (CUDA: the GEMM, then the loop)
    if residual_only(u.op):
        item = loop.items[0]
        segs = any(buffers[n].kind == "segments" for n in refs(item.expr) if n != item.name and n in buffers)
        out = buffers[item.name].kind in ("scratch", "output")  # (not an alias of x or g's memory)
        return () if loop.seg_dst or segs or not out else BACKENDS
    if u.op != "matmul" or buffers[u.args[1]].type.ndim != 2 or loop.seg_dst or loop.type.ndim < 2:
        return ()
    item = loop.items[0]
    if any(buffers[n].kind == "segments" for n in refs(item.expr) if n != item.name and n in buffers):
        return ()
    kind, operand = epilogue.kind, epilogue.operand
    on = ["cpu"]
    cuda_kind = kind in ("bias", "residual") or kind == "scale" and (
        _number(operand) or operand in buffers and buffers[operand].kind == "scalar")
    if buffers[u.dst].kind == "scratch" and loop.type.dtype in CUDA_DTYPES and cuda_kind:
        on.append("cuda")
    return tuple(on)


def _number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def _operand(e: Expr, r: str) -> Expr | None:
    """For a binary op reading Ref r as one side: the other side."""
    if not isinstance(e, Op) or len(e.args) != 2:
        return None
    a, b = e.args
    if isinstance(a, Ref) and a.name == r and not _reads(b, r):
        return b
    if isinstance(b, Ref) and b.name == r and not _reads(a, r):
        return a
    return None


def _reads(e: Expr, r: str) -> bool:
    return r in refs(e)


def _bias(o: Expr | None, t: TType, buffers: dict[str, Buffer]) -> str:
    if not isinstance(o, Ref) or o.name not in buffers:
        return ""
    bt = buffers[o.name].type
    if bt.ndim != 1 or t.ndim < 1 or bt.shape[0] != t.shape[-1] or bt.dtype != t.dtype:
        return ""
    last_sliced = t.layout.sliced and t.layout.dim == t.ndim - 1
    if last_sliced != bt.layout.sliced:
        return ""  # the bias must be held as R's columns are
    return o.name


def _match(e: Expr, r: str, t: TType, buffers: dict[str, Buffer]) -> tuple[str, str] | None:
    """(KIND, OPERAND) of the epilogue E computes from R, or None."""
    if isinstance(e, Op) and e.op == "gelu" and len(e.args) == 1 and isinstance(e.args[0], Op) \
            and e.args[0].op == "add":
        b = _bias(_operand(e.args[0], r), t, buffers)
        return ("gelu_bias", b) if b else None
    if not isinstance(e, Op):
        return None
    o = _operand(e, r)
    if o is None:
        return None
    if e.op == "add":
        b = _bias(o, t, buffers)
        if b:
            return "bias", b
        if isinstance(o, Ref) and o.name in buffers and buffers[o.name].type == t:
            return "residual", o.name
        return None
    if e.op == "mul":
        if isinstance(o, Const):
            return "scale", str(o.value)
        if isinstance(o, Ref) and o.type.ndim == 0:
            return "scale", o.name
    return None
