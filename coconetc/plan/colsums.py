"""Column sums fused with the pointwise loop that produces their input (issue 40 point 2).

In a derived program a bias gradient `db = sum_lead(g, n)` (the sum over every leading dim of g)
often reads a g that a pointwise loop has just written (gelu's backward: `g_h_add = g_h * ...`,
then `d_b1 = sum_lead(g_h_add, 2)`). The loop can add each row's values into the column sums as
it computes them, so g is not read a second time. The rule, in one place (colsum_of):

- the unit is a Library sum_lead(G, n) with n = G's dims - 1, its result 1-d (scratch or output),
  G not a scattered parameter's segments;
- an earlier top-level Loop over exactly G's type computes G as one of its items, stores no
  scattered segments and reads none, is not the epilogue of a GEMM fused on the CPU and not
  part of a CPU attention call;
- no unit between them writes G or reads or writes the sum.

Where (ColSum.on): the CPU always (codegen/cpu/loops.py: blocks of rows, each block's partial
sums in the compute type, added in block order: deterministic whatever the threads); CUDA where
the weight-gradient GEMM does not produce the sum already (plan/epilogue.py's bgrad, fused on
cuda: its GEMM reads G anyway) and it is the loop's only column sum there (cuda/grad.cuh
colsum_rows: a block a range of rows, its threads striding the columns, per-block partial sums
added in block order; one element at a time, no vector path). A backend that runs the sum in the
loop renders the sum_lead unit as nothing."""

from __future__ import annotations

from dataclasses import replace

from coconetc.plan.units import Buffer, ColSum, Library, Loop, Unit, _may_write, _touches

ON = ("cpu", "cuda")  # the backends that can add a loop's column sums (a benchmark may narrow it)


def colsum_of(units: list[Unit], i: int, buffers: dict[str, Buffer], skip: set[int]) -> int:
    """For units[i] a sum_lead the rule above accepts: the index of the loop that computes its
    sums; -1 otherwise. skip: loops that may not take one (a CPU attention call's members)."""
    u = units[i]
    if not (isinstance(u, Library) and u.op == "sum_lead"):
        return -1
    g, db = u.args[0], u.dst
    gt = buffers[g].type
    if dict(u.attrs).get("n") != gt.ndim - 1 or gt.ndim < 2 or buffers[db].type.ndim != 1 \
            or buffers[g].kind == "segments" or buffers[db].kind not in ("scratch", "output"):
        return -1
    for j in range(i - 1, -1, -1):
        v = units[j]
        if isinstance(v, Loop) and any(it.name == g for it in v.items):
            return j if _takes(units, j, gt, buffers, skip) else -1
        if _touches(v, {db}) or _may_write(v, g):
            return -1
    return -1


def _takes(units: list[Unit], j: int, gt, buffers: dict[str, Buffer], skip: set[int]) -> bool:
    loop = units[j]
    assert isinstance(loop, Loop)
    if loop.type != gt or loop.seg_dst or j in skip:
        return False
    prev = units[j - 1] if j else None
    if isinstance(prev, Library) and prev.epilogue and "cpu" in prev.fused and prev.epilogue.kind != "bgrad":
        return False  # rendered inside its GEMM's blocks (codegen/cpu/loops.py render_epilogue)
    from coconetc.ir.expr import refs
    read = {n for it in loop.items for n in refs(it.expr)}
    return not any(buffers[n].kind == "segments" for n in read if n in buffers)


def with_colsums(units: list[Unit], buffers: dict[str, Buffer], skip: set[int]) -> list[Unit]:
    """UNITS with each sum_lead the rule accepts carried by its loop (Loop.colsums)."""
    out = list(units)
    gemm = {u.epilogue.value for u in units if isinstance(u, Library) and u.epilogue and u.epilogue.kind == "bgrad"
            and "cuda" in u.fused}  # sums a GEMM's BGRADA epilogue produces on cuda
    for i in range(len(out)):
        j = colsum_of(out, i, buffers, skip)
        if j >= 0:
            u, loop = out[i], out[j]
            assert isinstance(u, Library) and isinstance(loop, Loop)
            on = tuple(b for b in ON if b == "cpu" or b == "cuda" and u.dst not in gemm and
                       not any("cuda" in c.on for c in loop.colsums))
            out[j] = replace(loop, colsums=(*loop.colsums, ColSum(u.args[0], u.dst, on)))
    return out


def fused_sums(units, backend: str) -> set[str]:
    """The sums (sum_lead results) the loops of UNITS compute on BACKEND."""
    return {c.dst for u in units if isinstance(u, Loop) for c in u.colsums if backend in c.on}
