"""The reduction table both backends index: per reduction of the plan (Reduce.op: sum, norm,
segment_norm, max, min) its partial's initial value, how a run of elements becomes a partial,
how two partials combine, and how the combined partial is finished, each as the C++ the
renderers write (cpu/render.py and cpu/fused.py: the CPU runtime's kernels.h and batch.h;
cuda/render.py and cuda/fused.py: runtime.cuh). Partials are doubles on both backends.

A new reduction is a row here; a renderer asks its row, never the reduction's name."""

from __future__ import annotations

from dataclasses import dataclass

from coconetc.codegen.emit import cbool


@dataclass(frozen=True)
class Reduction:
    op: str
    identity: str  # the partial before any element (a C++ double)
    partial: str  # the partial of a run of elements: the CPU runtime's function (kernels.h)
    combine: str  # two partials a, b into a (a C++ statement)
    finish: str  # the result from the combined partial p (in double)
    squares: bool = False  # the partial sums the elements' squares (the CUDA functions' flag)
    per_segment: bool = False  # one partial per segment of the scattered parameters

    @property
    def extreme(self) -> bool:
        """Combined as the largest across ranks and a batch's calls (batch.h: reduce_extremes;
        runtime.cuh: an ncclMax), NaN propagating; else summed."""
        return "extreme_step" in self.combine

    @property
    def sign(self) -> str:
        """The sign a partial is combined across ranks with: a min as the max of its negation."""
        return "-" if self.op == "min" else ""

    def accumulate(self, a: str, b: str) -> str:
        """The statement adding partial b to partial a."""
        return self.combine.format(a=a, b=b)

    def finished(self, p: str) -> str:
        return self.finish.format(p=p)

    def cuda(self, what: str, T: str) -> str:
        """The CUDA runtime's function (runtime.cuh) that does `what` (reduce: a whole value,
        partial: a chunk added to an accumulator, finish: the accumulator to the 0-d result)
        for this reduction over elements of type T."""
        if self.extreme:
            return f"{what}_extreme<{T}, {cbool(self.op == 'max')}>"
        return f"{what}_sum<{T}, {cbool(self.squares)}>"


def _extreme(op: str, first: str, of: str) -> Reduction:
    step = f"{{a}} = coconet::extreme_step<{cbool(op == 'max')}>({{a}}, {{b}})"
    return Reduction(op, first, of, step, "{p}")


REDUCTIONS = {r.op: r for r in (
    Reduction("sum", "0.0", "sum_of", "{a} += {b}", "{p}"),
    Reduction("norm", "0.0", "sumsq_of", "{a} += {b}", "std::sqrt({p})", squares=True),
    # each segment's sqrt, at each element of the result: the runtime's segment_norm_finish
    # (CPU) and segment_norm_fill (CUDA)
    Reduction("segment_norm", "0.0", "sumsq_of", "{a} += {b}", "std::sqrt({p})", squares=True, per_segment=True),
    _extreme("max", "-HUGE_VAL", "max_of"),  # no element yet
    _extreme("min", "HUGE_VAL", "min_of"),
)}


def reduction(op: str) -> Reduction:
    return REDUCTIONS[op]
