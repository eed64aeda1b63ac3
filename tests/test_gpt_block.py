"""examples/gpt_block.ccn, a GPT-2 block tensor-parallel over heads and MLP columns (issue 39,
point 3; docs/gpt_block.md), against an independent PyTorch block written as nanoGPT writes it
(model.py's LayerNorm, CausalSelfAttention, MLP and Block; one process, float64):

- the interpreter's forward on 1, 2 and 4 ranks (4, 2 and 1 heads a rank) and its derived
  program's gradients (every parameter, in its layout) against torch and torch.autograd;
- every schedule against the program with dropout on (the masks the same on every number of
  ranks), and dropout actually dropping;
- the forward and derived programs under every schedule (GRAD_SCHEDULE's for the derived one),
  compiled for the CPU on 1 and 2 ranks and as CUDA under the host emulation, against the
  interpreter (`coconetc run -s all`, whose random inputs draw pdrop in [0.05, 0.95]);
- the block as a coconetc.torch.function on 2 ranks against one process of the nanoGPT block
  (outputs and every gradient)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import coconetc.autodiff  # noqa: F401  (registers the derived programs' operations)
from coconetc.autodiff import vjp
from coconetc.interp.interpreter import run
from coconetc.ir.slices import slice_range
from coconetc.launch import mpiexec
from coconetc.sourcefile import load_source
from coconetc.toolchain import probes

torch = pytest.importorskip("torch")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gpt_block.ccn"
B, S, H, NH = 2, 5, 8, 4  # 4 heads of HD = 2
HD, F = H // NH, 4 * H
# the dim each tensor parameter is sliced along (the others are replicated)
SLICED = {"wq": 1, "wk": 1, "wv": 1, "w_fc": 1, "bq": 0, "bv": 0, "b_fc": 0, "wo": 0, "w_proj": 0}


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
# A schedule of the derived program: its four backward collectives are the all-reduces of the
# column-parallel matmuls' input gradients (Megatron's f in the backward), g_n2 (c_fc's) and g_n1,
# g_n12, g_n14 (v's, k's, q's); each matmul_nt that makes the partial sums runs in 2 chunks along
# S, each chunk all-reduced while the next multiplies. (Not in the example: in f32 the derived
# program's attention gradients, through three dropouts of p up to 0.95, differ from the
# interpreter's by more than the example-wide tests' f32 tolerance; docs/gpt_block.md.)
GRAD_SCHEDULE = """
schedule overlapped for grad(gpt_block) {
    overlap(g_n2_part, g_n2, chunks=2, dim=1)
    overlap(g_n1_part, g_n1, chunks=2, dim=1)
    overlap(g_n1_part2, g_n12, chunks=2, dim=1)
    overlap(g_n1_part3, g_n14, chunks=2, dim=1)
}
"""


def _f64() -> str:
    """The example in f64, with the derived program's schedule."""
    return EXAMPLE.read_text().replace("f32", "f64") + GRAD_SCHEDULE


def _run(p, inputs: dict, ranks: int) -> list:
    per_rank = []
    for r in range(ranks):
        mine = {}
        for k, v in inputs.items():
            if k in SLICED:
                dim = SLICED[k]
                lo, hi = slice_range(v.shape[dim], ranks, r)
                v = np.take(v, np.arange(lo, hi), axis=dim)
            mine[k] = v.copy() if isinstance(v, np.ndarray) else v
        per_rank.append(mine)
    return run(p, per_rank)


def _joined(results: list, out: str, dim: int | None) -> np.ndarray:
    parts = [r.outputs[out] for r in results]
    if dim is None:
        for q in parts[1:]:  # a replicated result: the same on every rank
            np.testing.assert_array_equal(q, parts[0])
        return parts[0]
    return np.concatenate(parts, axis=dim)


def _inputs(blk: Block, x: np.ndarray, pdrop: float = 0.0) -> dict:
    return {"x": x, **_weights(blk), "scale": 1.0 / math.sqrt(HD), "pdrop": pdrop, "seed": 1234}


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_forward_matches_nanogpt(ranks):
    """(nanoGPT's key bias, random here, is not in the block: the same result without it)"""
    blk = _block()
    x = np.random.default_rng(0).standard_normal((B, S, H))
    want = blk(torch.tensor(x)).detach().numpy()
    assert np.abs(blk.attn.c_attn.bias[H:2 * H].detach().numpy()).min() > 1e-3
    res = _run(load_source(_f64()).program("gpt_block"), _inputs(blk, x), ranks)
    np.testing.assert_allclose(_joined(res, "y", None), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_gradients_match_autograd(ranks):
    blk = _block(1)
    rng = np.random.default_rng(1)
    x, dy = rng.standard_normal((B, S, H)), rng.standard_normal((B, S, H))
    tx = torch.tensor(x, requires_grad=True)
    (blk(tx) * torch.tensor(dy)).sum().backward()
    mod = load_source(_f64())
    g = vjp(mod.program("gpt_block"))
    res = _run(g, {**_inputs(blk, x), "d_y": dy}, ranks)
    got = {pub: _joined(res, pub, SLICED.get(pub[2:])) for pub, _ in g.outputs}
    sched = _run(mod.schedule("gpt_block_grad", "overlapped").ir, {**_inputs(blk, x), "d_y": dy}, ranks)
    for pub, _ in g.outputs:  # the derived program's schedule: the same gradients
        np.testing.assert_allclose(_joined(sched, pub, SLICED.get(pub[2:])), got[pub], rtol=1e-12, atol=1e-14)
    assert set(got) == {"d_x", *(f"d_{k}" for k in PARAMS)}
    np.testing.assert_allclose(got["d_x"], tx.grad.numpy(), rtol=1e-9, atol=1e-12)
    for k in PARAMS:
        np.testing.assert_allclose(got[f"d_{k}"], _grad_of(blk, k), rtol=1e-9, atol=1e-12, err_msg=k)
    # the key bias the block leaves out: torch's gradient of it is 0 but for rounding
    assert np.abs(blk.attn.c_attn.bias.grad[H:2 * H].numpy()).max() < 1e-12


def test_schedules_match_the_program_with_dropout():
    """pdrop = 0.3 (attention, and both residual branches): every schedule on 2 and 4 ranks
    gives the program's result on 1 rank (the masks depend on global indices only), and the
    dropout drops (the result differs from pdrop = 0)."""
    mod = load_source(_f64())
    blk = _block(2)
    x = np.random.default_rng(2).standard_normal((B, S, H))
    one = _run(mod.program("gpt_block"), _inputs(blk, x, 0.3), 1)[0].outputs["y"]
    undropped = blk(torch.tensor(x)).detach().numpy()
    assert np.abs(one - undropped).max() > 0.1
    assert set(mod.schedules["gpt_block"]) >= {"fused", "overlapped"}
    for ranks in (2, 4):
        np.testing.assert_allclose(_joined(_run(mod.program("gpt_block"), _inputs(blk, x, 0.3), ranks), "y", None),
                                   one, rtol=1e-12, atol=1e-12)
        for name, sched in mod.schedules["gpt_block"].items():
            got = _run(sched.ir, _inputs(blk, x, 0.3), ranks)
            np.testing.assert_allclose(_joined(got, "y", None), one, rtol=1e-12, atol=1e-12, err_msg=name)


# --- compiled, against the interpreter ----------------------------------------------------------
@pytest.fixture(scope="module")
def cache(request):
    """The session's build cache (as tests/test_cpu_backend.py), so the ranks only import."""
    old = os.environ.get(probes.ENV_CACHE)
    os.environ[probes.ENV_CACHE] = str(request.config.cache.mkdir("coconet-build"))
    yield
    if old is None:
        os.environ.pop(probes.ENV_CACHE, None)
    else:
        os.environ[probes.ENV_CACHE] = old


def _run_all(f: Path, ranks: int, *extra: str) -> None:
    """`coconetc run F -s all` of the forward and of the derived program (`--grad`): every
    schedule, compiled, against the interpreter on every rank."""
    exe = str(Path(sys.executable).parent / "coconetc")
    sizes = [a for k, v in dict(B=B, S=S, H=H, NH=NH, HD=HD, F=F).items() for a in ("--size", f"{k}={v}")]
    for grad, schedules in (([], ["default", "fused", "overlapped"]), (["--grad"], ["default", "overlapped"])):
        res = subprocess.run([exe, "run", str(f), "-p", "gpt_block", *grad, "-s", "all", "--ranks", str(ranks),
                              *sizes, *extra], capture_output=True, text=True, timeout=600)
        ok = [ln.split(" [")[1].split("]")[0] for ln in res.stdout.splitlines()
              if ln.endswith("matches the interpreter on every rank")]
        assert res.returncode == 0 and ok == schedules, res.stdout + res.stderr[-3000:]


@pytest.mark.skipif(probes.missing_cpu_extra(), reason="needs the 'cpu' extra")
def test_cpu_backend_matches_interpreter(cache, tmp_path):
    """f64: the random inputs draw pdrop up to 0.95, and three dropouts scaling by up to 20
    each take the f32 derived program past the f32 tolerance (tests/test_cpu_backend.py runs
    the f32 forward and its schedules)."""
    f = tmp_path / "gpt_block_cpu.ccn"
    f.write_text(_f64())
    for ranks in (1, 2):
        _run_all(f, ranks)


@pytest.mark.skipif(probes.emulation_missing() is not None, reason=probes.emulation_missing() or "")
def test_cuda_emulation_matches_interpreter(cache, tmp_path):
    f = tmp_path / "gpt_block_cuda.ccn"
    f.write_text(_f64())
    _run_all(f, 2, "--backend", "cuda", "--emulate")


# --- through coconetc.torch.function on 2 ranks -------------------------------------------------
TORCH = """
import math, sys
import numpy as np
import torch
from mpi4py import MPI
import coconetc.torch as ct
from coconetc.ir.slices import slice_range
sys.path.insert(0, sys.argv[3])
from test_gpt_block import B, S, H, HD, PARAMS, SLICED, _block, _grad_of
comm = MPI.COMM_WORLD
r, R = comm.Get_rank(), comm.Get_size()
blk = _block(3)
g = torch.Generator().manual_seed(0)
x = torch.randn(B, S, H, generator=g, dtype=torch.float64)
dy = torch.randn(B, S, H, generator=g, dtype=torch.float64)
f = ct.function(sys.argv[1], "gpt_block", schedule=sys.argv[2], grad_schedule=sys.argv[2])


def part(t, k):
    if k in SLICED:
        lo, hi = slice_range(t.shape[SLICED[k]], R, r)
        t = t.narrow(SLICED[k], lo, hi - lo)
    return t.clone(memory_format=torch.contiguous_format)


mine = {k: part(v(blk).detach(), k).requires_grad_() for k, v in PARAMS.items()}
xx = x.clone().requires_grad_()
y = f(x=xx, **mine, scale=1.0 / math.sqrt(HD), pdrop=0.0, seed=7)
(y * dy).sum().backward()
tx = x.clone().requires_grad_()
ty = blk(tx)
(ty * dy).sum().backward()
errs = [float((y - ty).abs().max()), float((xx.grad - tx.grad).abs().max())]
errs += [float((mine[k].grad - part(torch.tensor(_grad_of(blk, k)), k)).abs().max()) for k in PARAMS]
print(f"rank {r} max error {max(errs):.3g}", flush=True)
"""


@pytest.mark.skipif(probes.missing_cpu_extra(), reason="needs the 'cpu' extra")
def test_torch_function_matches_nanogpt_on_two_ranks(cache, tmp_path):
    """The block (f64) as a coconetc.torch.function, the compiled forward under `overlapped` and
    the compiled derived backward under GRAD_SCHEDULE's `overlapped`: outputs and every gradient in its layout against one process
    of the nanoGPT block and autograd."""
    f = tmp_path / "gpt_block.ccn"
    f.write_text(_f64())
    script = tmp_path / "gpt_block_torch.py"
    script.write_text(TORCH)
    cmd = mpiexec.command(2, [sys.executable, str(script), str(f), "overlapped", str(Path(__file__).parent)])
    res = subprocess.run(cmd, env=mpiexec.environment(2), capture_output=True, text=True, timeout=900)
    lines = [ln.split() for ln in res.stdout.splitlines() if ln.startswith("rank ")]
    assert len(lines) == 2 and all(float(ln[-1]) < 1e-10 for ln in lines), res.stdout + res.stderr[-3000:]


def test_show_grad_prints_the_derived_program():
    res = subprocess.run([str(Path(sys.executable).parent / "coconetc"), "show", "--grad", str(EXAMPLE)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == ("# saved by the forward (gpt_block_fwd returns them): n1, q, k, v, s, a, o, x1, n2, h; "
                        "recomputed by the backward (gpt_block_bwd): q_reshape, k_reshape, v_reshape, s_transpose, "
                        "a_where, a_softmax, ap_reshape, h_matmul, h_add, g_xc, g_rstd, g_xhat, g_xc2, g_rstd2, "
                        "g_xhat2")
    assert lines[1] == "program gpt_block_grad("
    # the forward's first all-reduce (x1 is read by the backward), then the four of the backward
    assert [ln.split(" = ")[0].strip() for ln in lines if " = allreduce(sum, " in ln] == [
        "at", "g_n2", "g_n1", "g_n12", "g_n14"]
    assert ("    return d_x, d_ln1_w, d_ln1_b, d_wq, d_bq, d_wk, d_wv, d_bv, d_wo, d_bo, d_ln2_w, d_ln2_b, "
            "d_w_fc, d_b_fc, d_w_proj, d_b_proj") in lines


def test_heads_that_do_not_split_evenly_raise_naming_the_reshape():
    """4 heads of 2 on 3 ranks: a rank's 2 heads (4 columns) are not its slice of the 8 merged
    columns (3). (With heads of 1 they run, 2, 2 and 0 a rank: tests/test_cpu_backend.py.)"""
    blk = _block()
    x = np.random.default_rng(0).standard_normal((B, S, H))
    p = load_source(_f64()).program("gpt_block")
    line = EXAMPLE.read_text().splitlines().index(
        "    q = transpose(reshape(matmul(n1, reshape(wq, [H, -1])) + reshape(bq, [-1]),") + 1
    with pytest.raises(ValueError, match=rf"line {line}, col 19: reshape of a dim of 8 sliced over 3 ranks into 4 x 2"):
        _run(p, _inputs(blk, x), 3)
