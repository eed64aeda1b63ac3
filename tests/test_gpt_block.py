"""examples/gpt_block.ccn, a GPT-2 block tensor-parallel over heads and MLP columns (gpt_block)
and the same with Megatron's sequence parallelism (gpt_block_sp: x and y sliced along the
sequence) (issue 39, points 3 and 6; docs/gpt_block.md), against an independent PyTorch block
written as nanoGPT writes it (model.py's LayerNorm, CausalSelfAttention, MLP and Block; one
process, float64):

- the interpreter's forward of both programs on 1, 2 and 4 ranks (4, 2 and 1 heads a rank; the
  sequence of 5 in slices of 5, 3 + 2 and 2 + 2 + 1 + 0) and their derived programs' gradients
  (every parameter, in its layout; the replicated layernorm weights' gradients of gpt_block_sp,
  made from sequence slices, summed over the ranks) against torch and torch.autograd;
- every schedule against the program with dropout on (the masks the same on every number of
  ranks, and gpt_block_sp's the same as gpt_block's), and dropout actually dropping;
- the forward and derived programs of both under every schedule (the example's `grad(...)`
  schedules for the derived ones), in f64 as CUDA under the host emulation against the
  interpreter (random inputs with pdrop in [0.05, 0.5]; the compiled CPU module runs the f32
  example in tests/test_cpu_backend.py's matrix);
- both blocks as coconetc.torch.functions on 2 ranks against one process of the nanoGPT block
  (outputs and every gradient), and a sequence slice of the wrong length raising naming 'x' on
  every rank;
- bad input: heads that do not divide among the ranks, a sequence slice that does not match the
  group, a causal mask of the wrong shape, a reshape whose sizes disagree."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from rank_checks import joined, rank_parts, shared_file

import coconetc.autodiff  # noqa: F401  (registers the derived programs' operations)
from coconetc.autodiff import vjp
from coconetc.errors import CompileError
from coconetc.interp.interpreter import run
from coconetc.ir.slices import slice_range
from coconetc.launch import mpiexec
from coconetc.sourcefile import load_source
from coconetc.toolchain import probes
import rank_pool

torch = pytest.importorskip("torch")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gpt_block.ccn"
B, S, H, NH = 2, 5, 8, 4  # 4 heads of HD = 2
HD, F = H // NH, 4 * H
# the dim each tensor parameter is sliced along (the others are replicated)
SLICED = {"wq": 1, "wk": 1, "wv": 1, "w_fc": 1, "bq": 0, "bv": 0, "b_fc": 0, "wo": 0, "w_proj": 0}
# gpt_block_sp: the same, and the block's input, output and their gradients sliced along S
SLICED_SP = {**SLICED, "x": 1, "y": 1, "d_y": 1}
LAYOUTS = {"gpt_block": SLICED, "gpt_block_sp": SLICED_SP}
PROGRAMS = list(LAYOUTS)


# --- nanoGPT's block (model.py), written here independently -------------------------------------
class LayerNorm(torch.nn.Module):
    def __init__(self, ndim):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(ndim))
        self.bias = torch.nn.Parameter(torch.zeros(ndim))

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(torch.nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.c_attn = torch.nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = torch.nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        mask = torch.tril(torch.ones(t, t, dtype=x.dtype)).view(1, 1, t, t)
        att = torch.softmax(att.masked_fill(mask == 0, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.c_proj(y)


class MLP(torch.nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc = torch.nn.Linear(n_embd, 4 * n_embd)
        self.gelu = torch.nn.GELU()
        self.c_proj = torch.nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(torch.nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1, self.attn = LayerNorm(n_embd), CausalSelfAttention(n_embd, n_head)
        self.ln_2, self.mlp = LayerNorm(n_embd), MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def _block(seed: int = 0) -> Block:
    torch.manual_seed(seed)
    blk = Block(H, NH).double()
    with torch.no_grad():  # layernorms away from 1 and 0, so their weights matter
        for ln in (blk.ln_1, blk.ln_2):
            ln.weight.add_(0.3 * torch.randn(H, dtype=torch.float64))
            ln.bias.add_(0.3 * torch.randn(H, dtype=torch.float64))
    return blk


# the .ccn parameters as views of nanoGPT's (Linear.weight is [out, in]: transposed; a head's
# columns [NH, HD]); c_attn's key bias, c_attn.bias[H:2 * H], changes nothing and is left out
def _heads(t):
    return t.reshape(*t.shape[:-1], NH, HD)


PARAMS = {
    "ln1_w": lambda b: b.ln_1.weight, "ln1_b": lambda b: b.ln_1.bias,
    "wq": lambda b: _heads(b.attn.c_attn.weight[:H].T), "bq": lambda b: _heads(b.attn.c_attn.bias[:H]),
    "wk": lambda b: _heads(b.attn.c_attn.weight[H:2 * H].T),
    "wv": lambda b: _heads(b.attn.c_attn.weight[2 * H:].T), "bv": lambda b: _heads(b.attn.c_attn.bias[2 * H:]),
    "wo": lambda b: b.attn.c_proj.weight.T.reshape(NH, HD, H), "bo": lambda b: b.attn.c_proj.bias,
    "ln2_w": lambda b: b.ln_2.weight, "ln2_b": lambda b: b.ln_2.bias,
    "w_fc": lambda b: b.mlp.c_fc.weight.T, "b_fc": lambda b: b.mlp.c_fc.bias,
    "w_proj": lambda b: b.mlp.c_proj.weight.T, "b_proj": lambda b: b.mlp.c_proj.bias,
}


def _weights(blk: Block) -> dict[str, np.ndarray]:
    return {k: f(blk).detach().numpy().copy() for k, f in PARAMS.items()}


def _grad_of(blk: Block, name: str) -> np.ndarray:
    """The gradient of the .ccn parameter `name`: the matching part of the nanoGPT one."""
    views = {"wq": ("attn.c_attn.weight", slice(0, H)), "wk": ("attn.c_attn.weight", slice(H, 2 * H)),
             "wv": ("attn.c_attn.weight", slice(2 * H, 3 * H)), "bq": ("attn.c_attn.bias", slice(0, H)),
             "bv": ("attn.c_attn.bias", slice(2 * H, 3 * H))}
    names = {"ln1_w": "ln_1.weight", "ln1_b": "ln_1.bias", "wo": "attn.c_proj.weight",
             "bo": "attn.c_proj.bias", "ln2_w": "ln_2.weight", "ln2_b": "ln_2.bias",
             "w_fc": "mlp.c_fc.weight", "b_fc": "mlp.c_fc.bias", "w_proj": "mlp.c_proj.weight",
             "b_proj": "mlp.c_proj.bias"}
    params = dict(blk.named_parameters())
    if name in views:
        full, rows = views[name]
        g = params[full].grad[rows]
    else:
        g = params[names[name]].grad
    return (g.T if g.ndim == 2 else g).reshape(PARAMS[name](blk).shape).numpy().copy()


# --- the interpreter on R simulated ranks ----------------------------------------------------
# every schedule of each program and its derived program (compiled: each job's)
JOBS = {"gpt_block": ["default", "fused", "overlapped"], "gpt_block_grad": ["default", "overlapped"],
        "gpt_block_sp": ["default", "fused", "overlapped", "overlapped_both"],
        "gpt_block_sp_grad": ["default", "overlapped", "backward", "overlapped_both"]}


def _f64() -> str:
    """The example in f64."""
    return EXAMPLE.read_text().replace("f32", "f64")



def _run(p, inputs: dict, ranks: int, sliced: dict[str, int] = SLICED) -> list:
    return run(p, rank_parts(inputs, ranks, sliced))



def _inputs(blk: Block, x: np.ndarray, pdrop: float = 0.0) -> dict:
    return {"x": x, **_weights(blk), "scale": 1.0 / math.sqrt(HD), "pdrop": pdrop, "seed": 1234}


@pytest.mark.parametrize("program", PROGRAMS)
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_forward_matches_nanogpt(program, ranks):
    """(nanoGPT's key bias, random here, is not in the block: the same result without it.)
    gpt_block_sp on 2 and 4 ranks: S = 5 in uneven slices (3 + 2; 2 + 2 + 1 + 0)."""
    blk = _block()
    x = np.random.default_rng(0).standard_normal((B, S, H))
    want = blk(torch.tensor(x)).detach().numpy()
    assert np.abs(blk.attn.c_attn.bias[H:2 * H].detach().numpy()).min() > 1e-3
    res = _run(load_source(_f64()).program(program), _inputs(blk, x), ranks, LAYOUTS[program])
    if program == "gpt_block_sp":  # each rank's rows of y only
        assert [r.outputs["y"].shape[1] for r in res] == [slice_range(S, ranks, i)[1] - slice_range(S, ranks, i)[0]
                                                          for i in range(ranks)]
    np.testing.assert_allclose(joined(res, "y", LAYOUTS[program].get("y")), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("program", PROGRAMS)
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_gradients_match_autograd(program, ranks):
    """Every gradient in its parameter's layout; the replicated ones (the layernorms' weights,
    the c_proj biases) the same on every rank (_joined checks it), which for gpt_block_sp, whose
    ranks see only their rows of the sequence, is the derived program's sum over the ranks."""
    blk = _block(1)
    rng = np.random.default_rng(1)
    x, dy = rng.standard_normal((B, S, H)), rng.standard_normal((B, S, H))
    tx = torch.tensor(x, requires_grad=True)
    (blk(tx) * torch.tensor(dy)).sum().backward()
    mod, sliced = load_source(_f64()), LAYOUTS[program]
    g = vjp(mod.program(program))
    res = _run(g, {**_inputs(blk, x), "d_y": dy}, ranks, sliced)
    got = {pub: joined(res, pub, sliced.get(pub[2:])) for pub, _ in g.outputs}
    sched = _run(mod.schedule(f"{program}_grad", "overlapped").ir, {**_inputs(blk, x), "d_y": dy}, ranks, sliced)
    for pub, _ in g.outputs:  # the derived program's schedule: the same gradients
        np.testing.assert_allclose(joined(sched, pub, sliced.get(pub[2:])), got[pub], rtol=1e-12, atol=1e-14)
    assert set(got) == {"d_x", *(f"d_{k}" for k in PARAMS)}
    np.testing.assert_allclose(got["d_x"], tx.grad.numpy(), rtol=1e-9, atol=1e-12)
    for k in PARAMS:
        np.testing.assert_allclose(got[f"d_{k}"], _grad_of(blk, k), rtol=1e-9, atol=1e-12, err_msg=k)
    # the key bias the block leaves out: torch's gradient of it is 0 but for rounding
    assert np.abs(blk.attn.c_attn.bias.grad[H:2 * H].numpy()).max() < 1e-12
    if program == "gpt_block_sp" and ranks > 1:  # one rank's rows alone give another gradient
        part = np.zeros_like(dy)
        part[:, :slice_range(S, ranks, 0)[1]] = dy[:, :slice_range(S, ranks, 0)[1]]
        blk.zero_grad()
        (blk(torch.tensor(x)) * torch.tensor(part)).sum().backward()
        assert np.abs(_grad_of(blk, "ln2_w") - got["d_ln2_w"]).max() > 1e-3


def test_schedules_match_the_program_with_dropout():
    """pdrop = 0.3 (attention, and both residual branches): every schedule of both programs on
    1, 2 and 4 ranks gives gpt_block's result on 1 rank (the masks depend on the stage and the
    global indices only, and gpt_block_sp's stages of dropout are gpt_block's), and the dropout
    drops (the result differs from pdrop = 0)."""
    mod = load_source(_f64())
    blk = _block(2)
    x = np.random.default_rng(2).standard_normal((B, S, H))
    one = _run(mod.program("gpt_block"), _inputs(blk, x, 0.3), 1)[0].outputs["y"]
    undropped = blk(torch.tensor(x)).detach().numpy()
    assert np.abs(one - undropped).max() > 0.1
    for program, sliced in LAYOUTS.items():
        assert set(mod.schedules[program]) == set(JOBS[program][1:])
        for ranks in (1, 2, 4):
            for name, ir in (("program", mod.program(program)),
                             *((n, sc.ir) for n, sc in mod.schedules[program].items())):
                got = joined(_run(ir, _inputs(blk, x, 0.3), ranks, sliced), "y", sliced.get("y"))
                np.testing.assert_allclose(got, one, rtol=1e-12, atol=1e-12, err_msg=f"{program} {name} R={ranks}")


def test_sp_schedules_fuse_the_layernorm_and_its_allgather_into_the_reduce_scatter():
    """gpt_block_sp's schedules as the plan runs them: attention's reduce-scatter, x1, ln_2 and
    the all-gather of n2 one fused collective (under `overlapped`, inside the overlap of the
    matmul that feeds it), the MLP's reduce-scatter fused with y; in the derived program's
    schedules, the reduce-scatter of g_n2s fused with ln_2's backward (layernorm_dx), the
    dropout's and the all-gather of g_x1_add."""
    mod = load_source(EXAMPLE.read_text())
    from coconetc.plan.show import show as show_plan
    fused = show_plan(mod.plans[("gpt_block_sp", "fused")])
    assert re.search(r"fused f1: at = reducescatter\(sum, ap\)( along dim 1)? chunk by chunk", fused)
    assert "per chunk (rows): n2s (register) = layernorm(x1, ln2_w, ln2_b, 1e-05)" in fused
    assert "per chunk: n2 = allgather(n2s) as each piece is computed" in fused
    assert "per chunk (pointwise): y = x1 + dropout(mt + b_proj" in fused
    over = re.sub(r"\bt\d+_", "t_", show_plan(mod.plans[("gpt_block_sp", "overlapped")]))  # temporaries' numbers
    assert "overlap ap = matmul(o, t_ap) in 2 chunks along dim 0 (rows in place) -> fused f1 per chunk" in over
    assert "overlap mp = matmul(h, w_proj) in 2 chunks along dim 0 (rows in place) -> fused f2 per chunk" in over
    # inside the overlap too, each block's chunks of whole rows are layernormed and gathered as
    # they arrive (nothing waits for the last block)
    inside = over[over.index("fused f1"):over.index("library hm = matmul(n2, w_fc)")]
    assert "per chunk (rows): n2s (register) = layernorm(x1, ln2_w, ln2_b, 1e-05)" in inside, inside
    assert "per chunk: n2 = allgather(n2s) as each piece is computed" in inside and "after all chunks" not in inside
    # the derived program's mirror: ln_2's backward (the residual's gradient added) a row-wise
    # phase of the reduce-scatter of g_n2s, then the dropout's backward and the all-gather that
    # attention's c_proj backward reads, overlapped with the matmul_nt that makes g_n2_part
    for grad in ("overlapped", "backward"):
        text = show_plan(mod.plans[("gpt_block_sp_grad", grad)])
        f3 = text[text.index("-> fused f3 per chunk"):text.index("library g_o = matmul_nt(g_allgather4")]
        for line in ("overlap g_n2_part = matmul_nt(g_h_add, w_fc) in 2 chunks along dim 0 (rows in place) -> fused f3",
                     "per chunk (rows): g_x1 = d_y + layernorm_dx(x1, ln2_w, g_n2s, 1e-05)",
                     "per chunk (pointwise): g_x1_add = dropout(g_x1,",
                     "per chunk: g_allgather4 = allgather(g_x1_add) as each piece is computed"):
            assert line in (text if line.startswith("overlap") else f3), f"{grad}: {line}\n{text}"
        assert "after all chunks" not in f3, f3
    both = re.sub(r"\bt\d+_", "t_", show_plan(mod.plans[("gpt_block_sp", "overlapped_both")]))
    for line in ("overlap n1 = allgather(n1s) in 2 chunks along dim 0 (rows in place) -> qm = matmul(n1, t_qm) "
                 "per chunk, as it arrives",
                 "overlap ap = matmul(o, t_ap) in 2 chunks along dim 0 (rows in place) -> fused f1 per chunk",
                 "per chunk: n2 = allgather(n2s) as each piece is computed",
                 "then hm = matmul(n2, w_fc) per chunk, as its rows of n2 are gathered (chunk i while chunk i+1's "
                 "fused collective is in flight)",
                 "overlap mp = matmul(h, w_proj) in 2 chunks along dim 0 (rows in place) -> fused f2 per chunk"):
        assert line in both, line
    # every collective overlapped with a matmul: no collective, fused collective or matmul of
    # the block's linear layers left on its own
    grad = show_plan(mod.plans[("gpt_block_sp_grad", "overlapped_both")])
    for line in ("then hm = matmul(n2, w_fc) per chunk", "then g_o = matmul_nt(g_allgather4, ap_reshape) per chunk",
                 "overlap g_n1_part4 = matmul_nt(g_v_add, v_reshape) + matmul_nt(g_k_matmul, k_reshape) + "
                 "matmul_nt(g_q_add, qm_reshape) in 2 chunks along dim 0 (rows in place) -> "
                 "g_n1s = reducescatter(sum, g_n1_part4) per chunk"):
        assert line in grad, line
    from coconetc.plan.units import Collective, Fused, Library
    units = mod.plans[("gpt_block_sp", "overlapped_both")].units
    assert not [u for u in units if isinstance(u, (Collective, Fused))], both
    assert not [u for u in units if isinstance(u, Library) and u.dst in ("qm", "ap", "hm", "mp")], both
    # and in the derived program, forward and backward, but the all-reduces of the replicated
    # parameters' gradients ([H] each: Megatron's too): attention's input gradient is the sum of
    # q's, k's and v's, whose GEMMs add into each block's rows (no buffer of their own)
    plan = mod.plans[("gpt_block_sp_grad", "overlapped_both")]
    alone = {u.dst if isinstance(u, Collective) else u.collective for u in plan.units
             if isinstance(u, (Collective, Fused))}
    assert alone == {"d_b_proj", "d_ln2_w", "d_ln2_b", "d_bo", "d_ln1_w", "d_ln1_b"}, grad
    assert not {"g_n1_part", "g_n1_part2", "g_n1_part3"} & {b.name for b in plan.buffers}, grad


# --- compiled, against the interpreter ----------------------------------------------------------


@pytest.fixture(scope="module")
def f64_file(request) -> Path:
    """The f64 example at one path for every compiled test here (a module is
    named and cached by its file): the CPU jobs, the CUDA emulation and coconetc.torch.function
    load the same modules, one for each program with its derived programs."""
    return shared_file(request, "gpt-block-f64", "gpt_block.ccn", _f64())


def _run_jobs(f: Path, ranks: int, *extra: str) -> None:
    """Every program of JOBS under its schedules, compiled, against the interpreter on every
    rank, in one MPI job (tests/run_jobs_worker.py: coconetc.jobs.run's jobs in turn, each on
    random inputs whose pdrop is drawn in [0.05, 0.5]). Every job loads the one module of the
    file with both programs' derived programs (--grad-of each), built once."""
    sizes = [f"--size={k}={v}" for k, v in dict(B=B, S=S, H=H, NH=NH, HD=HD, F=F).items()]
    argv, want = [str(Path(__file__).with_name("run_jobs_worker.py"))], []
    for program, schedules in JOBS.items():
        argv += [str(f), "--program", program, *(a for p in PROGRAMS for a in ("--grad-of", p)), "--reps", "1", *extra,
                 *sizes, *(f"--schedule={s}" for s in schedules), "--"]
        want += [f"{program} [{s}]" for s in schedules]
    rc, out, err = rank_pool.run(ranks, argv, timeout=900)
    log = f"--- stdout\n{out}\n--- stderr\n{err[-3000:]}"
    lines = [ln for ln in out.splitlines() if re.match(r"\S+ \[\w+\]( \(CUDA, host emulation\))?: \d+ ranks:", ln)]
    assert rc == 0 and len(lines) == len(want), log
    for line, head in zip(lines, want):
        assert line.startswith(head) and line.endswith("matches the interpreter on every rank"), f"{line}\n{log}"


@pytest.mark.slow
@pytest.mark.skipif(probes.emulation_missing() is not None, reason=probes.emulation_missing() or "")
def test_cuda_emulation_matches_interpreter(f64_file):
    """Both programs and their derived programs under every schedule, as CUDA under the host
    emulation on 2 ranks (test_cuda_emulate's example-wide run leaves gpt_block out; the CPU
    backend runs the f32 example on 1 to 4 ranks in test_cpu_backend's matrix)."""
    from coconetc.runtime.cuda import load_emulated
    load_emulated(f64_file, log=lambda msg: None, grad=PROGRAMS)
    _run_jobs(f64_file, 2, "--emulate-cuda")


# --- through coconetc.torch.function on 2 ranks -------------------------------------------------
TORCH = """
import math, sys
import torch
from mpi4py import MPI
import coconetc.torch as ct
from coconetc.ir.slices import slice_range
sys.path.insert(0, sys.argv[2])
from test_gpt_block import B, S, H, HD, LAYOUTS, PARAMS, _block, _grad_of
comm = MPI.COMM_WORLD
r, R = comm.Get_rank(), comm.Get_size()
blk = _block(3)
g = torch.Generator().manual_seed(0)
x = torch.randn(B, S, H, generator=g, dtype=torch.float64)
dy = torch.randn(B, S, H, generator=g, dtype=torch.float64)
tx = x.clone().requires_grad_()
ty = blk(tx)
(ty * dy).sum().backward()


def part(t, k, sliced):
    if k in sliced:
        lo, hi = slice_range(t.shape[sliced[k]], R, r)
        t = t.narrow(sliced[k], lo, hi - lo)
    return t.clone(memory_format=torch.contiguous_format)


for program, sliced in LAYOUTS.items():
    # gpt_block_sp: `backward`, which applies to the cut backward (gpt_block_sp_bwd after
    # gpt_block_sp_fwd); gpt_block's `overlapped` applies to its gpt_block_bwd
    grad = {"gpt_block": "overlapped", "gpt_block_sp": "backward"}[program]
    f = ct.function(sys.argv[1], program, schedule="overlapped", grad_schedule=grad)
    mine = {k: part(v(blk).detach(), k, sliced).requires_grad_() for k, v in PARAMS.items()}
    xx = part(x, "x", sliced).requires_grad_()
    y = f(x=xx, **mine, scale=1.0 / math.sqrt(HD), pdrop=0.0, seed=7)
    (y * part(dy, "y", sliced)).sum().backward()  # gpt_block_sp: each rank's rows of the loss
    errs = [float((y.detach() - part(ty.detach(), "y", sliced)).abs().max()), float((xx.grad - part(tx.grad, "x", sliced)).abs().max())]
    errs += [float((mine[k].grad - part(torch.tensor(_grad_of(blk, k)), k, sliced)).abs().max()) for k in PARAMS]
    print(f"{program} rank {r} max error {max(errs):.3g}", flush=True)

# a sequence slice that does not match the group: rank 0 passes 2 rows of x and rank 1 its 3
# (the group's slices of S = 5 rows are 3 and 2); every rank raises, naming x
bad = x.narrow(1, 0, 2) if r == 0 else x.narrow(1, 2, 3)
with torch.no_grad():
    try:
        f(x=bad.contiguous(), **mine, scale=1.0 / math.sqrt(HD), pdrop=0.0, seed=7)
        print(f"bad rank {r} ran", flush=True)
    except ValueError as err:
        print(f"bad rank {r} raised {err}", flush=True)
"""


@pytest.mark.slow  # (make test runs it; test-quick's attention through coconetc.torch.function: test_block_ops)
@pytest.mark.skipif(probes.missing_cpu_extra(), reason="needs the 'cpu' extra")
def test_torch_function_matches_nanogpt_on_two_ranks(f64_file, tmp_path):
    """Both blocks (f64) as coconetc.torch.functions, the compiled forward under `overlapped`
    and the compiled backward under the example's grad schedules (gpt_block's `overlapped`,
    gpt_block_sp's `backward`, each on the cut backward the forward's saved values feed): outputs and every
    gradient in its layout against one process of the nanoGPT block and autograd (gpt_block_sp:
    x, y and their gradients this rank's rows of the sequence; the replicated weights' gradients
    whole on every rank). Then gpt_block_sp called with a sequence slice of the wrong length."""
    import coconetc
    for program in PROGRAMS:  # built here (or already, by the CPU test), so that the ranks only import
        coconetc.load(f64_file, log=lambda msg: None, grad=(program,))
    script = tmp_path / "gpt_block_torch.py"
    script.write_text(TORCH)
    cmd = mpiexec.command(2, [sys.executable, str(script), str(f64_file), str(Path(__file__).parent)])
    res = subprocess.run(cmd, env=mpiexec.environment(2), capture_output=True, text=True, timeout=900)
    log = res.stdout + res.stderr[-3000:]
    lines = [ln.split() for ln in res.stdout.splitlines() if " rank " in ln and " max error " in ln]
    assert sorted(ln[0] for ln in lines) == sorted(PROGRAMS * 2), log
    assert all(float(ln[-1]) < 1e-10 for ln in lines), log
    bad = sorted(ln for ln in res.stdout.splitlines() if ln.startswith("bad rank "))
    assert len(bad) == 2 and all(" raised 'x' on rank 0: dim 1 must be 3 (f64[B, S, H] sliced(1)" in ln
                                 for ln in bad), log


def test_show_grad_prints_the_derived_program():
    res = subprocess.run([str(Path(sys.executable).parent / "coconetc"), "show", "--grad", "-p", "gpt_block",
                          str(EXAMPLE)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    # hm (c_fc's product) is a stage, so the forward keeps it and the backward adds the bias again
    # (a loop) instead of computing the GEMM again for gelu's derivative
    # and a = dropout(p) is drawn again from p (the attention call does it as it goes)
    assert lines[0] == ("# saved by the forward (gpt_block_fwd returns them): n1, q, k, v, p, o, x1, n2, hm, h; "
                        "recomputed by the backward (gpt_block_bwd): q_reshape, k_reshape, v_reshape, s_transpose, "
                        "a, ap_reshape, h_add")
    # each layernorm's backward: two operations reading the forward's input (saved: x1) and the
    # cotangent, the row statistics recomputed inside them
    assert "    g_x1 = d_y + layernorm_dx(x1, ln2_w, g_n2, 1e-05)" in lines
    assert "    d_ln2_w = layernorm_dgamma(x1, g_n2, 1e-05)" in lines
    assert "    d_ln1_w = layernorm_dgamma(x, g_n1, 1e-05)" in lines
    assert lines[1] == "program gpt_block_grad("
    # the forward's first all-reduce (x1 is read by the backward), then the two of the backward:
    # c_fc's input gradient, and q's, k's and v's partial input gradients added first (Megatron's
    # one all-reduce for its fused qkv)
    assert [ln.strip() for ln in lines if " = allreduce(sum, " in ln] == [
        "at = allreduce(sum, ap)", "g_n2 = allreduce(sum, g_n2_part)", "g_n1 = allreduce(sum, g_n1_part4)"]
    assert "    g_n1_part4 = g_n1_part + g_n1_part2 + g_n1_part3" in lines
    assert ("    return d_x, d_ln1_w, d_ln1_b, d_wq, d_bq, d_wk, d_wv, d_bv, d_wo, d_bo, d_ln2_w, d_ln2_b, "
            "d_w_fc, d_b_fc, d_w_proj, d_b_proj") in lines


def test_show_grad_prints_the_sequence_parallel_derived_program():
    """gpt_block_sp's derived program: Megatron's conjugates (the backward of each reduce-scatter an
    all-gather, of the MLP's all-gather a reduce-scatter), and the replicated parameters'
    gradients, each made from this rank's rows, summed over the ranks."""
    exe = str(Path(sys.executable).parent / "coconetc")
    res = subprocess.run([exe, "show", "--grad", "-p", "gpt_block_sp", str(EXAMPLE)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == ("# saved by the forward (gpt_block_sp_fwd returns them): n1, q, k, v, p, o, x1, n2, hm, "
                        "h; recomputed by the backward (gpt_block_sp_bwd): qm_reshape, k_reshape, v_reshape, "
                        "s_transpose, a, ap_reshape, h_add")
    collectives = [ln.strip() for ln in lines if re.search(r" = (allreduce|reducescatter|allgather|scatter)\(", ln)]
    assert collectives == [
        "n1 = allgather(n1s)", "at = reducescatter(sum, ap, dim=1)", "n2 = allgather(n2s)",
        "d_b_proj = allreduce(sum, g_b_proj_part)", "g_allgather2 = allgather(g_y_add)",
        "g_n2s = reducescatter(sum, g_n2_part, dim=1)",
        "d_ln2_w = allreduce(sum, g_ln2_w_part)", "d_ln2_b = allreduce(sum, g_ln2_b_part)",
        "d_bo = allreduce(sum, g_bo_part)", "g_allgather4 = allgather(g_x1_add)",
        # attention's input gradient: q's, k's and v's partial sums added, one reduce-scatter
        "g_n1s = reducescatter(sum, g_n1_part4, dim=1)",
        "d_ln1_w = allreduce(sum, g_ln1_w_part)", "d_ln1_b = allreduce(sum, g_ln1_b_part)"]
    assert "    d_y: f32[B, S, H] sliced(1)," in lines
    # without -p: each program's derived program in turn, the text of a file that checks
    res = subprocess.run([exe, "show", "--grad", str(EXAMPLE)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    both = res.stdout.splitlines()
    assert [ln for ln in both if ln.startswith("program ")] == ["program gpt_block_grad(", "program gpt_block_sp_grad("]
    assert both[both.index("program gpt_block_sp_grad(") - 1:] == lines
    mod = load_source(res.stdout, "derived.ccn")
    assert set(mod.programs) == {"gpt_block_grad", "gpt_block_sp_grad"}


# --- bad input (issue 39 point 6) ---------------------------------------------------------------
def _line(text: str) -> int:
    """The line of gpt_block_sp's that starts with TEXT (1-based)."""
    lines = EXAMPLE.read_text().splitlines()
    return lines.index(text, lines.index(next(ln for ln in lines if ln.startswith("program gpt_block_sp(")))) + 1


@pytest.mark.parametrize("program", PROGRAMS)
def test_heads_that_do_not_split_evenly_raise_naming_the_reshape(program):
    """4 heads of 2 on 3 ranks: a rank's 2 heads (4 columns) are not its slice of the 8 merged
    columns (3). (With heads of 1 they run, 2, 2 and 0 a rank: tests/test_cpu_backend.py.)"""
    blk = _block()
    x = np.random.default_rng(0).standard_normal((B, S, H))
    p = load_source(_f64()).program(program)
    if program == "gpt_block_sp":  # the first reshape that runs: wq's heads merged, in qm's stage
        line, col = _line("    qm = matmul(n1, reshape(wq, [H, -1]))                     # column-parallel: a stage of its own,"), 21
    else:  # the split of the heads' columns, in q's
        line, col = EXAMPLE.read_text().splitlines().index(
            "    q = transpose(reshape(matmul(n1, reshape(wq, [H, -1])) + reshape(bq, [-1]),") + 1, 19
    with pytest.raises(ValueError, match=rf"line {line}, col {col}: reshape of a dim of 8 sliced over 3 ranks into 4 x 2"):
        _run(p, _inputs(blk, x), 3, LAYOUTS[program])


def test_a_sequence_slice_that_does_not_match_the_group_names_x():
    """gpt_block_sp on 2 ranks whose x slices hold 2 and 3 rows: the group's slices of S = 5 are
    3 and 2 (the compiled module on 2 ranks: test_torch_function_matches_nanogpt_on_two_ranks)."""
    blk = _block()
    x = np.random.default_rng(0).standard_normal((B, S, H))
    parts = rank_parts(_inputs(blk, x), 2, SLICED_SP)
    parts[0]["x"], parts[1]["x"] = x[:, :2].copy(), x[:, 2:].copy()
    p = load_source(_f64()).program("gpt_block_sp")
    with pytest.raises(ValueError, match=r"'x' on rank 0: dim 1 must be 3 \(f64\[B, S, H\] sliced\(1\), 2 ranks"):
        run(p, parts)


@pytest.mark.parametrize("mask, col", [("causal(q)", 17), ("causal(x)", 17), ("causal(transpose(s, 1, 2))", 17)])
def test_a_causal_mask_of_the_wrong_shape_is_located(mask, col):
    """The mask written on the wrong operand (q: [B, NH, S, HD]; the block's input [B, S, H];
    the scores with heads and rows swapped): an error at the where, naming both shapes."""
    src = EXAMPLE.read_text()
    head, sp = src.split("program gpt_block_sp(", 1)
    bad = head + "program gpt_block_sp(" + sp.replace("where(causal(s), s, -inf)", f"where({mask}, s, -inf)", 1)
    with pytest.raises(CompileError) as err:
        load_source(bad, "gpt_block.ccn")
    d = err.value.diagnostics[0]
    assert (d.span.line, d.span.col) == (_line("    p = softmax(where(causal(s), s, -inf))"), col)
    assert "shapes do not broadcast" in d.message and "vs [B, NH, S, S]" in d.message, d.message


def test_a_reshape_whose_sizes_disagree_names_its_line():
    """nanoGPT's `.view(b, t, c)` written as reshape(..., [B, S, H]) (and c_proj's rows as
    [H, H]): the heads merged into H columns, which NH * HD (4 heads of 1 here) is not: a
    ValueError naming the line, on every number of ranks, before anything is computed from it."""
    src = _f64()
    head, sp = src.split("program gpt_block_sp(", 1)
    old = "    o = reshape(transpose(matmul(a, v), 1, 2), [B, S, -1])"
    sp = sp.replace(old, old.replace("-1]", "H]"), 1).replace("reshape(wo, [-1, H])", "reshape(wo, [H, H])", 1)
    bad = head + "program gpt_block_sp(" + sp
    blk = _block()
    inputs = _inputs(blk, np.random.default_rng(0).standard_normal((B, S, H)))
    for k in ("wq", "wk", "wv", "bq", "bv", "wo"):  # one column of each head: HD = 1
        inputs[k] = np.ascontiguousarray(inputs[k][..., :1, :] if k == "wo" else inputs[k][..., :1])
    p = load_source(bad, "gpt_block.ccn").program("gpt_block_sp")
    for ranks in (1, 2):
        with pytest.raises(ValueError, match=rf"line {_line(old)}, col 9: reshape of \[2, 5, 4, 1\] \(40 elements\) into \[2, 5, 8\] \(80\): the sizes disagree"):
            _run(p, inputs, ranks, SLICED_SP)
