"""What the CUDA renderer implements: the units of a plan it cannot render yet, one entry per
unit (`unsupported`, which `coconetc check --backend cuda` reports at the directive), per
(program, schedule) of a file (`problems`), and what the host emulation leaves out besides
(`emulation_problems`). The CPU backend renders every plan, so it has no such file."""

from __future__ import annotations

from coconetc.ir import ops
from coconetc.ir.nodes import Op, Ref
from coconetc.plan.units import Collective, Fused, Library, Overlap, Plan, Unit
from coconetc.sourcefile import SourceFile


class Unsupported(Exception):
    """A plan unit the CUDA renderer does not implement yet (line: its .ccn line)."""

    def __init__(self, line: int, what: str):
        super().__init__(what)
        self.line, self.what = line, what


def unsupported(plan: Plan) -> list[Unsupported]:
    """What of this plan the CUDA renderer cannot render yet, one entry per unit."""
    out: list[Unsupported] = []
    kinds = {b.name: b.kind for b in plan.buffers}
    ndims = {b.name: b.type.ndim for b in plan.buffers}
    scattered = {b.name for b in plan.buffers if b.kind == "segments"}

    def unit(u: Unit) -> None:
        if isinstance(u, Overlap) and u.fused is not None:
            f = u.fused
            if not u.direct or (f.op == "reducescatter" and f.type.layout.dim == 0) or f.src != u.producer:
                out.append(Unsupported(u.line, "overlap into a fused collective other than an all-reduce or a "
                                               "reduce-scatter along a dim other than 0 fed by rows of the matmul "
                                               "is not in the CUDA backend yet"))
            else:
                unit(f)
        elif isinstance(u, Library) and ops.get(u.op).extern is not None:
            out.extend(_extern_problems(u, kinds, ndims))
        elif isinstance(u, Collective) and u.src in scattered and u.op == "allgather":  # (the CPU's neither)
            out.append(Unsupported(u.line, f"an allgather of a sliced scattered tensor ('{u.src}') is not in the "
                                           "CUDA backend yet"))
        elif isinstance(u, Fused):
            out.extend(_fused_problems(u, kinds))
            for a in u.after:
                unit(a)
    for u in plan.units:
        unit(u)
    return out


def _units(units: tuple[Unit, ...]) -> list[Unit]:
    """The units and those that run after a fused collective's chunks, in order."""
    return [x for u in units for x in [u, *(_units(u.after) if isinstance(u, Fused) else [])]]


def _extern_problems(u: Library, kinds: dict[str, str], ndims: dict[str, int]) -> list[Unsupported]:
    ext = ops.get(u.op).extern
    assert ext is not None
    if ext.cuda is None:
        return [Unsupported(u.line, f"extern operation '{u.op}' declares no cuda implementation "
                                    "('cuda = \"header\", \"function\"')")]
    computed = [a for a in u.args if ndims.get(a) == 0 and kinds.get(a) != "scalar"]
    if computed:
        return [Unsupported(u.line, f"a computed 0-d operand ('{computed[0]}') of extern operation "
                                    f"'{u.op}' is not in the CUDA backend yet (it lives on the device)")]
    return []


def _fused_problems(u: Fused, kinds: dict[str, str]) -> list[Unsupported]:
    for p in u.phases:
        if p.kind != "rows":
            continue
        x = p.items[0].expr.args[0] if isinstance(p.items[0].expr, Op) else None
        if (not isinstance(x, Ref) or (x.name != u.collective and kinds.get(x.name) in (None, "register"))
                or u.type.layout.dim == u.type.ndim - 1):
            return [Unsupported(u.line, "a row-wise phase reading a value kept in registers, or sliced along "
                                        "its rows, is not in the CUDA backend yet")]
    if kinds.get(u.collective) not in ("register", "scratch", "output", "alias"):
        return [Unsupported(u.line, f"a fused collective whose reduced value is '{kinds.get(u.collective)}' is "
                                    "not in the CUDA backend yet")]
    return []


def problems(mod: SourceFile) -> dict[tuple[str, str], list[Unsupported]]:
    """(program, schedule) -> what of its plan the CUDA renderer does not implement yet."""
    out = {}
    for key in mod.variants():
        found = unsupported(mod.plans[key])
        if found:
            out[key] = found
    return out


def emulation_problems(mod: SourceFile) -> dict[tuple[str, str], str]:
    """(program, schedule) -> why the host emulation leaves it out: what the CUDA renderer does
    not implement, or an extern operation (its own CUDA code is not emulated)."""
    out = {key: errs[0].what for key, errs in problems(mod).items()}
    for key in mod.variants():
        if key not in out and any(isinstance(u, Library) and ops.get(u.op).extern is not None
                                  for u in _units(mod.plans[key].units)):
            out[key] = "an extern operation's own CUDA code is not run under the host emulation"
    return out
