"""What the CUDA renderer tells the host emulation's race detection (runtime_cpp/coconet/cuda:
COCONET_PARAM, COCONET_BUFFER, COCONET_ACCESS; nothing under nvcc): each buffer's name and
extent, and the element ranges each kernel reads and writes. The CPU backend has no emulation,
so it has no such file."""

from __future__ import annotations

from coconetc.codegen.base import Writer
from coconetc.codegen.indexing import SCALAR, Indexing
from coconetc.ir.nodes import Expr, Ref, walk
from coconetc.ir.types import TType
from coconetc.plan.units import Let


class Notes:
    def __init__(self, w: Writer, idx: Indexing):
        self.w = w
        self.idx = idx

    def name(self, ptr: str, n: str, name: str, caller: bool = False) -> None:
        """The buffer's name for the host emulation's race reports (nothing under nvcc).
        caller: a parameter or output, produced on the call's stream before the call."""
        if caller:
            self.w.emit(f'COCONET_PARAM({ptr}, size_t({n}) * sizeof(*{ptr}), "{name}", stream);')
        else:
            self.w.emit(f'COCONET_BUFFER({ptr}, size_t({n}) * sizeof(*{ptr}), "{name}");')

    def access(self, t: TType, items: list[tuple[str, Expr, bool]], lets: tuple[Let, ...], lo: str, hi: str,
                     regs: dict[str, str], indent: str, extra: tuple[str, ...] = (), runs: str = "") -> None:
        """COCONET_ACCESS before a kernel: the element ranges it reads and writes, for the host
        emulation's race detection (expands to nothing under nvcc). Element i of the loop is
        i in [lo, hi); an operand indexed other than by i is read whole."""
        inside = {name for name, _, _ in items} | set(regs)
        spans: dict[str, str] = {}
        refs = [r for _, e, _ in items for r in walk(e) if isinstance(r, Ref)]
        refs += [r for k in lets for r in walk(k.expr) if isinstance(r, Ref)]
        for r in refs:
            if r.name in inside or r.name in self.w.consts or r.name in spans:
                continue
            kind = self.w.buffers[r.name].kind if r.name in self.w.buffers else None
            if kind in (None, "scalar", "register"):  # a Let, a scalar on the host, a value in registers
                continue
            acc = self.idx.access(r, t) if any(r is x for _, e, _ in items for x in walk(e)) else SCALAR
            if acc is None:
                spans[r.name] = f"COCONET_RA(v_{r.name})"
            elif acc.kind == "segments":  # this piece of a segment (a kernel per piece)
                spans[r.name] = f"COCONET_R(sp_{r.name}, 0, pc.size)"
            elif acc.kind == "scalar":
                spans[r.name] = f"COCONET_R(v_{r.name}, 0, 1)"
            elif acc.offset:
                spans[r.name] = f"COCONET_R(v_{r.name}, {acc.offset} + {lo}, {acc.offset} + {hi})"
            else:
                spans[r.name] = f"COCONET_R(v_{r.name}, {lo}, {hi})"
        out = list(spans.values())
        out += [f"COCONET_R({ptr.split('[')[0].split('(')[-1]}, 0, {hi} - ({lo}))" for ptr in regs.values()]
        out += [f"COCONET_W(v_{name}, {lo}, {hi})" for name, _, stored in items if stored]
        out += extra
        if runs:  # and the spans the runtime lists (a chunk's runs in a gathered value)
            self.w.emit(f"{indent}COCONET_ACCESS_RUNS({runs}, {', '.join(out)});")
        else:
            self.w.emit(f"{indent}COCONET_ACCESS({', '.join(out)});")
