"""Derived (vector-Jacobian) programs on the backends: the gradients of a Megatron MLP,
examples/tp_overlap.ccn's row_parallel and col_parallel, examples/layernorm.ccn's attn_out, a
broadcast bias (sum_lead), [.., 1]-shaped broadcasts (sum_keep) and convolutions in the style of
examples/conv2d.ccn (literal sizes), in f32 and f64 (some in f16 and bf16 too), derived by coconetc.autodiff.vjp, printed as
.ccn text, loaded back through coconetc.sourcefile (which plans them), compiled for the CPU
backend and run on 1, 2 and 3 ranks against the interpreter; one module of them (matmul_nt,
matmul_tn, sum_lead, sum_keep, mean_last, layernorm_dx, layernorm_dgamma, conv2d_dx, conv2d_dw) as the CUDA backend under the host
emulation. The programs of each backend share one file, so one build."""

from __future__ import annotations

import re
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

import coconetc.autodiff  # noqa: F401  (registers the derived programs' operations)
from coconetc.autodiff import vjp
from coconetc.ir import printer
from coconetc.plan.targets import Target
from coconetc.sourcefile import load_file, load_source
from coconetc.toolchain import probes

from rank_checks import ranks_run

REPO = Path(__file__).resolve().parents[1]
EX = REPO / "examples"
WORKER = str(Path(__file__).with_name("grad_backends_worker.py"))
SIZES = {"B": 2, "S": 5, "K": 7, "H": 6, "M": 5}  # the examples' size symbols (3 divides none)

# Programs in the style of the examples, each differentiated in every floating input.
PROGRAMS = """
program mlp(x: f32[B, S, H] replicated, w1: f32[H, 8] sliced(1), b1: f32[8] sliced(0),
            w2: f32[8, H] sliced(0), b2: f32[H] replicated) {
    h = gelu(matmul(x, w1) + b1)
    y = matmul(h, w2)
    s = allreduce(sum, y)
    out = s + b2
    return out
}

program bias_seq(x: f32[B, S, H] sliced(1), w: f32[H, K] replicated, b: f32[K] replicated) {
    y = relu(matmul(x, w) + b)
    return y
}

program scale_rows(x: f32[M, H] sliced(0), c: f32[1, H] replicated) {
    y = x * c
    return y
}

program scale(x: f32[M, H] replicated, s: f32[M, 1] replicated, c: f32[1, H] replicated) {
    y = x * s * c
    return y
}

program ln_eps(x: f32[M, H] sliced(0), gamma: f32[H] replicated, beta: f32[H] replicated, c: f32[1] replicated) {
    e = sum(c * c) + 0.001
    y = layernorm(x, gamma, beta, e)
    return y
}

program bias_rows(x: f32[M, H] sliced(0), b: f32[H] replicated) {
    y = relu(x * x + b)
    return y
}

program conv_dp(x: f32[5, 2, 5, 4] sliced(0), k: f32[3, 2, 3, 3] replicated, bias: f32[3, 1, 1] replicated) {
    y = conv2d(x, k, stride=1, padding=1)
    a = gelu(y + bias)
    full = allgather(a)
    return full
}

program conv_tp(x: f32[2, 5, 5, 4] sliced(1), k: f32[7, 5, 3, 3] sliced(1)) {
    part = conv2d(x, k, stride=2, padding=1)
    y = allreduce(sum, part)
    out = relu(y)
    return out
}
"""
EXAMPLES = [("tp_overlap.ccn", ("row_parallel", "col_parallel")), ("layernorm.ccn", ("attn_out",))]
OPS = {"matmul_nt", "matmul_tn", "sum_lead", "sum_keep", "mean_last", "layernorm_dx", "layernorm_dgamma", "conv2d_dx",
       "conv2d_dw"}
# every operation above, once (ln_eps: a differentiated eps keeps layernorm's backward in pieces, mean_last)
# (bias_rows: its bias gradient summed by the loop computing its input, no weight GEMM to fuse it
# in: plan/colsums.py on both backends)
EMULATED = ("mlp", "bias_seq", "scale_rows", "scale", "attn_out", "ln_eps", "conv_tp", "bias_rows")
# also in f16 and bf16 (built with the f32 ones): the widened GEMM path, 16-bit sums, and
# layernorm's backward (attn_out: layernorm_dx and layernorm_dgamma compute the row statistics in
# f32 inside the call, as the interpreter does; the pieces they replace stored a mean in f16/bf16
# where the interpreter kept it in f32, and h - mean's cancellation made that differ by 0.1 to 0.4,
# so attn_out was left out until then).
HALF = {"f16": ("mlp", "attn_out", "conv_tp", "bias_rows"), "bf16": ("mlp", "attn_out", "conv_tp")}


def _programs(dtype: str):
    """Every forward program in `dtype`."""
    sources = [PROGRAMS] + [(EX / f).read_text() for f, _ in EXAMPLES]
    wanted = {p for _, ps in EXAMPLES for p in ps} | set(re.findall(r"^program (\w+)", PROGRAMS, re.M))
    for src in sources:
        for name, p in load_source(src.replace("f32", dtype)).programs.items():
            if name in wanted:
                yield p


def grad_text(dtype: str, only: tuple[str, ...] | None = None) -> str:
    """The derived programs as one .ccn text (named <program>_grad_<dtype>)."""
    out = []
    for p in _programs(dtype):
        if only is None or p.name in only:
            g = vjp(p)
            out.append(printer.program(replace(g, name=f"{g.name}_{dtype}")))
    return "\n".join(out)


def test_derived_text_plans_with_every_added_operation():
    """The derived text loads through sourcefile.load_source (which plans every program) with a
    Library unit for each added operation and no gap on any target; together the programs use
    all nine operations."""
    from coconetc.plan.units import Library
    mod = load_source(grad_text("f32"), "<grad>")
    seen = set()
    for plan in mod.plans.values():
        assert not plan.gaps, plan.gaps
        seen |= {u.op for u in plan.units if isinstance(u, Library)}
    assert OPS <= seen, OPS - seen
    sl = [u for p in mod.plans.values() for u in p.units if isinstance(u, Library) and u.op == "sum_lead"]
    assert all(dict(u.attrs)["n"] >= 1 for u in sl)


def test_library_ops_are_rendered_by_every_backend():
    """The operations the planner makes Library units (kind "tensor", not extern) are exactly
    those both renderers lay out."""
    from coconetc.codegen import library_calls
    from coconetc.ir import ops
    library = {n for n in ops.names("tensor") if ops.get(n).extern is None}
    assert library == set(library_calls.OPS) | {"layernorm"}


def _write(tmp: Path, name: str, text: str) -> Path:
    f = tmp / name
    f.write_text(text)
    return f


def _launch(ranks: int, args: list[str], timeout: float = 600, **extra: str) -> subprocess.CompletedProcess:
    return ranks_run(ranks, [WORKER, *args], timeout, extra)


def _check(res: subprocess.CompletedProcess, programs: int) -> None:
    log = f"--- stdout\n{res.stdout}\n--- stderr\n{res.stderr[-4000:]}"
    assert res.returncode == 0, log
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(("MATCH", "MISMATCH"))]
    assert len(lines) == programs and all(ln.startswith("MATCH ") for ln in lines), log


def _sizes(**small: int) -> list[str]:
    return [f"{k}={v}" for k, v in {**SIZES, **small}.items()]


# the sliced symbols (bias_seq's S, scale_rows's M, row_parallel's K) at 2 on 3 ranks: one rank
# holds an empty slice (empty GEMM dims, empty sums)
EMPTY = {"S": 2, "M": 2, "K": 2}


@pytest.mark.slow  # every program in four dtypes: one build of about 40 s (quick: test_grad_schedules.py)
@pytest.mark.skipif(probes.missing_cpu_extra(), reason="needs the 'cpu' extra")
def test_cpu_backend_matches_interpreter(tmp_path_factory):
    """Every program in f32 and f64 (and HALF in f16 and bf16): one file, one build."""
    from coconetc.runtime.loader import compile_cpu
    text = "\n".join([grad_text("f32"), grad_text("f64"), *(grad_text(dt, progs) for dt, progs in HALF.items())])
    f = _write(tmp_path_factory.mktemp("grad"), "grads_cpu.ccn", text)
    mod = load_file(f)
    compile_cpu(mod, log=lambda msg: None)
    for ranks in (1, 2):
        _check(_launch(ranks, ["cpu", str(f), *_sizes()]), len(mod.programs))
    # on 3 ranks: the sizes above, then EMPTY's (one launch)
    _check(_launch(3, ["cpu", str(f), *_sizes(), "--", *_sizes(**EMPTY)]), 2 * len(mod.programs))


def _index_counts(out: str) -> tuple[int, int]:
    """(kernels launched with 32-bit indices, with 64-bit) of the worker's COUNTS line."""
    found = re.findall(r"^COUNTS index32=(\d+) index64=(\d+)$", out, re.MULTILINE)
    assert len(found) == 1, out
    return int(found[0][0]), int(found[0][1])


@pytest.mark.slow  # (the CPU backend's run of the same programs is in make test-quick)
@pytest.mark.skipif(probes.emulation_missing() is not None, reason=probes.emulation_missing() or "")
def test_cuda_emulation_matches_interpreter(tmp_path_factory):
    from coconetc import toolchain
    f = _write(tmp_path_factory.mktemp("grad"), "grads_cuda.ccn", grad_text("f32", EMULATED))
    mod = load_file(f)
    assert not mod.plans or all(not p.unsupported(Target.EMULATED) for p in mod.plans.values())
    toolchain.compile(mod, Target.EMULATED, toolchain.Options(log=lambda msg: None))
    # the kernels' indices: 32-bit where every index fits (on one rank), 64-bit where the limit
    # says none does (on three: COCONET_EMULATE_INDEX32_LIMIT=0 stands for sizes past 2^31)
    res = _launch(1, ["emulate", str(f), *_sizes()])
    _check(res, len(EMULATED))
    assert _index_counts(res.stdout)[0] >= 10 and _index_counts(res.stdout)[1] == 0, res.stdout
    res = _launch(3, ["emulate", str(f), *_sizes()], COCONET_EMULATE_INDEX32_LIMIT="0")
    _check(res, len(EMULATED))
    assert _index_counts(res.stdout)[0] == 0 and _index_counts(res.stdout)[1] >= 10, res.stdout
    _check(_launch(3, ["emulate", str(f), *_sizes(**EMPTY)]), len(EMULATED))
    # the column sums (a block a tile of 32 columns, 16 row lanes) over more than one tile and
    # more rows than lanes (B * S = 54 rows, H = 37 and M = 35 columns), the row means over 37
    _check(_launch(2, ["emulate", str(f), *_sizes(B=3, S=18, H=37, M=35)]), len(EMULATED))
