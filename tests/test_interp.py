"""The reference interpreter against formulas written here, independently of it (NumPy in
float64, or PyTorch): optimizers, tensor-parallel matmul/conv, dropout, layernorm, every
collective and reduction op, groups, f16/bf16, uneven and empty slices, and the errors a bad
call must raise."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from coconetc.sourcefile import load_source
from coconetc.interp import rng as crng
from coconetc.interp.interpreter import run
from coconetc.ir.nodes import walk

F16, F32, F64, BF16 = np.float16, np.float32, np.float64, ml_dtypes.bfloat16
TOL = {F16: (2e-2, 2e-2), BF16: (6e-2, 6e-2), F32: (1e-5, 1e-6)}


# --- helpers (deliberately not the interpreter's own) --------------------------------------
def part(n: int, parts: int, i: int) -> tuple[int, int]:
    """docs/language.md, "Parameters": c = ceil(n / R); rank i holds [i*c, min((i+1)*c, n))."""
    c = -(-n // parts)
    return min(i * c, n), min((i + 1) * c, n)


def cut(a: np.ndarray, axis: int, parts: int, i: int) -> np.ndarray:
    lo, hi = part(a.shape[axis], parts, i)
    idx = [slice(None)] * a.ndim
    idx[axis] = slice(lo, hi)
    return np.ascontiguousarray(a[tuple(idx)])


def f32(x: float) -> float:
    """A scalar as an f32 parameter holds it."""
    return float(np.float32(x))


def d64(a) -> np.ndarray:
    return np.asarray(a).astype(F64)


def close(got: np.ndarray, want: np.ndarray, dtype=F32, what: str = "") -> None:
    assert got.dtype == np.dtype(dtype), f"{what}: dtype {got.dtype}, want {np.dtype(dtype)}"
    assert got.shape == np.shape(want), f"{what}: shape {got.shape}, want {np.shape(want)}"
    rtol, atol = TOL[dtype]
    np.testing.assert_allclose(d64(got), d64(want), rtol=rtol, atol=atol, err_msg=what)


def call(prog, ranks: int, shared: dict, per_rank: dict | None = None, groups: int = 1):
    """Run `prog`: `shared` values go to every rank, `per_rank[name][r]` to rank r; a parameter
    that `prog` declares sliced is cut here from the global value, for the rank's group."""
    gs = ranks // groups
    inputs = []
    for r in range(ranks):
        args = {}
        for q in prog.params:
            v = per_rank[q.name][r] if per_rank and q.name in per_rank else shared[q.name]
            if not q.scalar and q.type.layout.sliced:
                full = np.concatenate(v) if isinstance(v, list) else v
                v = cut(full, q.type.layout.dim, gs, r % gs)
            elif isinstance(v, np.ndarray):
                v = v.copy()
            elif isinstance(v, list):
                v = [x.copy() for x in v]
            args[q.name] = v
        inputs.append(args)
    return run(prog, inputs, groups)


def want_update(prog, name: str, full: np.ndarray, ranks: int, r: int) -> np.ndarray:
    """The expected update of parameter `name` on rank r in prog's calling convention."""
    lay = prog.param(name).type.layout
    return cut(full, lay.dim, ranks, r) if lay.sliced else full


def prog_or_sched(mod, program: str, schedule: str | None):
    return mod.programs[program] if schedule is None else mod.schedule(program, schedule).ir


# --- SGD ------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", [None, "fused", "rs_c_ag"])
@pytest.mark.parametrize("R,N", [(1, 7), (2, 7), (3, 11), (4, 2)])
def test_sgd(example, schedule, R, N):
    prog = prog_or_sched(example("sgd.ccn"), "sgd", schedule)
    gen = np.random.default_rng(N * 10 + R)
    g = gen.standard_normal((R, N)).astype(F32)
    w = gen.standard_normal(N).astype(F32)
    res = call(prog, R, {"w": w, "lr": 0.05}, {"g": list(g)})
    want = d64(w) - f32(0.05) * d64(g).sum(0)
    for r in range(R):
        assert set(res[r].updates) == {"w"} and res[r].outputs == {}
        close(res[r].updates["w"], want, F32, f"rank {r} w")


# --- Adam -----------------------------------------------------------------------------------
def adam_reference(w, m, v, g, lr, b1, b2, eps, step):
    """Adam's math in float64, written out."""
    m1 = b1 * m + (1 - b1) * g
    v1 = b2 * v + (1 - b2) * g * g
    mh, vh = m1 / (1 - b1**step), v1 / (1 - b2**step)
    return w - lr * mh / (np.sqrt(vh) + eps), m1, v1


def torch_adam(w, m, v, g, lr, b1, b2, eps, step):
    """torch.optim.Adam with the gradient set by hand and the state of step - 1 loaded."""
    p = torch.nn.Parameter(torch.tensor(w, dtype=torch.float64))
    opt = torch.optim.Adam([p], lr=lr, betas=(b1, b2), eps=eps, foreach=False)
    opt.state[p] = {"step": torch.tensor(float(step - 1)),
                    "exp_avg": torch.tensor(m, dtype=torch.float64),
                    "exp_avg_sq": torch.tensor(v, dtype=torch.float64)}
    p.grad = torch.tensor(g, dtype=torch.float64)
    opt.step()
    st = opt.state[p]
    return p.detach().numpy(), st["exp_avg"].numpy(), st["exp_avg_sq"].numpy()


@pytest.mark.parametrize("schedule", [None, "rs_c_ag", "zero", "fused"])
@pytest.mark.parametrize("R,N", [(1, 9), (2, 9), (3, 13), (4, 2)])
def test_adam(example, schedule, R, N):
    prog = prog_or_sched(example("adam.ccn"), "adam", schedule)
    gen = np.random.default_rng(R * 100 + N)
    g = gen.standard_normal((R, N)).astype(F32)
    w = gen.standard_normal(N).astype(F32)
    m = (0.1 * gen.standard_normal(N)).astype(F32)
    v = gen.uniform(0.01, 0.2, N).astype(F32)
    sc = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "step": 3.0}
    res = call(prog, R, {"w": w, "m": m, "v": v, **sc}, {"g": list(g)})
    args = [f32(sc[k]) for k in ("lr", "beta1", "beta2", "eps", "step")]
    gsum = d64(g).sum(0)
    ref = adam_reference(d64(w), d64(m), d64(v), gsum, *args)
    tw, tm, tv = torch_adam(d64(w), d64(m), d64(v), gsum, *args)
    np.testing.assert_allclose(ref[0], tw, rtol=1e-12, atol=1e-12)  # the two references agree
    for r in range(R):
        for name, want in zip("wmv", (tw, tm, tv)):
            close(res[r].updates[name], want_update(prog, name, want, R, r), F32, f"rank {r} {name}")


# --- LAMB -----------------------------------------------------------------------------------
def lamb_reference(g_ranks, w, m, v, segs, lr, b1, b2, eps, wd, step):
    """LAMB with one trust ratio per segment ('layer'), by hand, one segment at a time."""
    g1 = np.mean(g_ranks, axis=0)
    w1, m1, v1 = np.empty_like(w), np.empty_like(w), np.empty_like(w)
    lo = 0
    for n in segs:
        s = slice(lo, lo + n)
        m1[s] = b1 * m[s] + (1 - b1) * g1[s]
        v1[s] = b2 * v[s] + (1 - b2) * g1[s] ** 2
        upd = (m1[s] / (1 - b1**step)) / (np.sqrt(v1[s] / (1 - b2**step)) + eps) + wd * w[s]
        trust = np.sqrt(np.sum(w[s] ** 2)) / np.sqrt(np.sum(upd**2))
        w1[s] = w[s] - lr * trust * upd
        lo += n
    return w1, m1, v1


@pytest.mark.parametrize("schedule", [None, "rs_c_ag", "zero"])
@pytest.mark.parametrize("R,segs", [(1, (4, 1, 6)), (2, (5, 1, 7, 3)), (3, (5, 1, 7, 3)),
                                    (4, (1, 2)), (3, (9,))])
def test_lamb_scattered(example, schedule, R, segs):
    """g, w, m, v arrive as lists of per-layer arrays of different sizes; the slices of the
    zero schedule cut across the layers' boundaries."""
    prog = prog_or_sched(example("lamb.ccn"), "lamb", schedule)
    N = sum(segs)
    gen = np.random.default_rng(R + N)

    def split(a):
        return [a[lo:lo + n].copy() for lo, n in zip(np.cumsum((0,) + segs[:-1]), segs)]

    g = gen.standard_normal((R, N)).astype(F32)
    w = gen.standard_normal(N).astype(F32)
    m = (0.1 * gen.standard_normal(N)).astype(F32)
    v = gen.uniform(0.01, 0.2, N).astype(F32)
    sc = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-6, "wd": 0.01, "step": 2.0}
    res = call(prog, R, {"w": split(w), "m": split(m), "v": split(v), **sc},
               {"g": [split(x) for x in g]})
    want = lamb_reference(d64(g), d64(w), d64(m), d64(v), segs,
                          *[f32(sc[k]) for k in ("lr", "beta1", "beta2", "eps", "wd", "step")])
    for r in range(R):
        assert res[r].segments == segs
        for name, full in zip("wmv", want):
            close(res[r].updates[name], want_update(prog, name, full, R, r), F32, f"rank {r} {name}")


# --- mixed-precision Adam -------------------------------------------------------------------
@pytest.mark.parametrize("schedule", [None, "zero"])
@pytest.mark.parametrize("R,N", [(1, 6), (2, 13), (3, 13), (4, 3)])
def test_mixed_adam(example, schedule, R, N):
    prog = prog_or_sched(example("mixed_adam.ccn"), "mixed_adam", schedule)
    gen = np.random.default_rng(7 * R + N)
    g = gen.uniform(-4, 4, (R, N)).astype(F16)  # f16 gradients (scaled by `scale`)
    w = gen.standard_normal(N).astype(F32)
    m = (0.1 * gen.standard_normal(N)).astype(F32)
    v = gen.uniform(0.01, 0.2, N).astype(F32)
    sc = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "step": 5.0, "scale": 4.0}
    res = call(prog, R, {"w": w, "w16": w.astype(F16), "m": m, "v": v, **sc}, {"g": list(g)})
    g1 = d64(d64(g).sum(0).astype(F16))  # the all-reduced gradient is an f16 value
    gf = g1 / sc["scale"]
    tw, tm, tv = torch_adam(d64(w), d64(m), d64(v), gf,
                            *[f32(sc[k]) for k in ("lr", "beta1", "beta2", "eps", "step")])
    for r in range(R):
        up = res[r].updates
        for name, want in zip("wmv", (tw, tm, tv)):
            close(up[name], want_update(prog, name, want, R, r), F32, f"rank {r} {name}")
        close(up["w16"], tw, F16, f"rank {r} w16")
        # the f16 copy is exactly the rounding of the f32 master weights
        if not prog.param("w").type.layout.sliced:
            np.testing.assert_array_equal(up["w16"], up["w"].astype(F16))


# --- Megatron row-parallel linear + dropout -------------------------------------------------
def mlp_inputs(B, S, K, H, seed, gen_seed=0):
    gen = np.random.default_rng(gen_seed)
    return {"x": gen.uniform(0.5, 1.5, (B, S, K)).astype(F16),
            "w": gen.uniform(0.5, 1.5, (K, H)).astype(F16),
            "b": gen.uniform(0.5, 1.5, H).astype(F16),
            "r": gen.uniform(-1, 1, (B, S, H)).astype(F16), "seed": seed}


def mlp_run(prog, R, args):
    res = call(prog, R, args)
    outs = [x.outputs["out"] for x in res]
    for r, o in enumerate(outs):
        assert o.dtype == F16 and o.shape == args["r"].shape, f"rank {r}"
    return outs


def dropout_site(prog) -> str:
    return next(n.attr("site") for s in prog.stages for n in walk(s.expr)
                if getattr(n, "op", None) == "dropout")


def test_row_parallel_matmul_partial_products():
    """matmul(sliced(last), sliced(0)) gives local partial sums that add up to the full
    product; matmul(replicated, sliced(1)) gives the column slice."""
    mod = load_source("""
program rowp(x: f32[B, S, K] sliced(2), w: f32[K, H] sliced(0)) {
    y = matmul(x, w)
    s = allreduce(sum, y)
    return y, s
}
program colp(x: f32[B, S, K] replicated, w: f32[K, H] sliced(1)) {
    y = matmul(x, w)
    return y
}
""")
    gen = np.random.default_rng(3)
    x, w = gen.standard_normal((2, 5, 7)).astype(F32), gen.standard_normal((7, 6)).astype(F32)
    full = np.einsum("bsk,kh->bsh", d64(x), d64(w))
    for R in (2, 3, 4):
        res = call(mod.programs["rowp"], R, {"x": x, "w": w})
        total = np.zeros_like(full)
        for r in range(R):
            lo, hi = part(7, R, r)
            close(res[r].outputs["y"], d64(x[..., lo:hi]) @ d64(w[lo:hi]), F32, f"R={R} y{r}")
            total += res[r].outputs["y"]
            close(res[r].outputs["s"], full, F32, f"R={R} s{r}")
        close(total.astype(F32), full, F32)
        res = call(mod.programs["colp"], R, {"x": x, "w": w})
        for r in range(R):
            close(res[r].outputs["y"], cut(full, 2, R, r), F32, f"R={R} col{r}")


@pytest.mark.parametrize("R", [2, 3])
def test_mlp_out(example, R):
    mod = example("mlp_out.ccn")
    prog = mod.programs["mlp_out"]
    args = mlp_inputs(2, 5, 7, 6, seed=1234, gen_seed=R)
    outs = mlp_run(prog, R, args)
    x, w, b, r = (d64(args[k]) for k in "xwbr")
    s = np.einsum("bsk,kh->bsh", x, w)  # the full product: what the partial sums must add to
    kept_value = (s + b) / 0.9 + r
    mask = outs[0] != args["r"]  # out - r == 0 exactly where the element was dropped
    for k, o in enumerate(outs):
        np.testing.assert_array_equal(o != args["r"], mask, err_msg=f"mask of rank {k}")
        np.testing.assert_array_equal(o[~mask], args["r"][~mask])
        close(o[mask], kept_value[mask], F16, f"rank {k} kept values")
    assert 0 < mask.sum() < mask.size
    # the mask is the contract's generator at the elements' global indices
    keep = crng.dropout_keep(1234, crng.site_key(dropout_site(prog)),
                             np.arange(mask.size).reshape(mask.shape), 0.1)
    np.testing.assert_array_equal(mask, keep)
    # ... so it is the same under a schedule (the dropout runs on sequence slices there)
    for sched in ("overlapped", "rs_c_ag", "overlap_ar"):
        sprog = mod.schedule("mlp_out", sched).ir
        assert [(q.name, q.type) for q in sprog.params] == [(q.name, q.type) for q in prog.params]
        for k, o in enumerate(mlp_run(sprog, R, args)):
            np.testing.assert_array_equal(o != args["r"], mask, err_msg=f"{sched} rank {k}")
            close(o, outs[0], F16, f"{sched} rank {k}")
    # and it changes with the seed
    other = mlp_run(prog, R, {**args, "seed": 1235})[0] != args["r"]
    assert not np.array_equal(other, mask)


def test_dropout_rate_and_partition_independence(example):
    mod = example("mlp_out.ccn")
    args = mlp_inputs(4, 64, 2, 64, seed=-77)  # a negative seed wraps (i64 -> u64)
    masks = {}
    for R, sched in ((2, None), (3, None), (3, "overlapped"), (4, "overlapped")):
        out = mlp_run(prog_or_sched(mod, "mlp_out", sched), R, args)[R - 1]
        masks[R, sched] = out != args["r"]
    first = masks[2, None]
    assert 0.88 < first.mean() < 0.92, first.mean()
    for key, m in masks.items():
        np.testing.assert_array_equal(m, first, err_msg=str(key))


# --- layernorm ------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", [None, "seq_sliced", "fused"])
@pytest.mark.parametrize("R,S", [(1, 4), (2, 5), (3, 5), (3, 2)])
def test_layernorm(example, schedule, R, S):
    prog = prog_or_sched(example("layernorm.ccn"), "attn_out", schedule)
    B, H = 2, 6
    gen = np.random.default_rng(R * 10 + S)
    y = gen.standard_normal((R, B, S, H)).astype(F32)
    sh = {"b": gen.standard_normal(H), "r": gen.standard_normal((B, S, H)),
          "gamma": gen.uniform(0.5, 1.5, H), "beta": gen.standard_normal(H)}
    sh = {k: v.astype(F32) for k, v in sh.items()}
    res = call(prog, R, sh, {"y": list(y)})
    h = d64(y).sum(0) + d64(sh["b"]) + d64(sh["r"])
    want = F.layer_norm(torch.tensor(h), (H,), torch.tensor(d64(sh["gamma"])),
                        torch.tensor(d64(sh["beta"])), eps=1e-5).numpy()
    for r in range(R):
        close(res[r].outputs["h"], h, F32, f"rank {r} h")
        np.testing.assert_allclose(res[r].outputs["out"], want, rtol=1e-4, atol=1e-5)


# --- conv2d ---------------------------------------------------------------------------------
@pytest.mark.parametrize("R,N", [(1, 2), (2, 3), (3, 5), (3, 2), (4, 2)])
def test_conv_layer(example, R, N):
    """Data parallel over the batch: gelu(conv2d(x, k, padding=1) + bias), gathered; the
    bias steps with the averaged gradient."""
    prog = example("conv2d.ccn").programs["conv_layer"]
    C, H, W, Oc = 3, 5, 4, 4
    gen = np.random.default_rng(R + N)
    x = gen.standard_normal((N, C, H, W)).astype(F32)
    k = gen.standard_normal((Oc, C, 3, 3)).astype(F32)
    bias = gen.standard_normal((Oc, 1, 1)).astype(F32)
    gb = gen.standard_normal((R, Oc, 1, 1)).astype(F32)
    res = call(prog, R, {"x": x, "k": k, "bias": bias, "lr": 0.1}, {"gb": list(gb)})
    y = F.conv2d(torch.tensor(d64(x)), torch.tensor(d64(k)), stride=1, padding=1)
    want = F.gelu(y + torch.tensor(d64(bias)), approximate="none").numpy()
    for r in range(R):
        np.testing.assert_allclose(res[r].outputs["full"], want, rtol=1e-4, atol=1e-5)
        assert res[r].outputs["full"].dtype == F32
        close(res[r].updates["bias"], d64(bias) - f32(0.1) * d64(gb).mean(0), F32)


@pytest.mark.parametrize("schedule", [None, "rs_c_ag"])
@pytest.mark.parametrize("R,C,Oc", [(1, 3, 2), (2, 5, 3), (3, 5, 4), (4, 3, 2)])
def test_conv_tp(example, schedule, R, C, Oc):
    """Channel-parallel convolution: each rank convolves its input channels with its slice of
    the kernel; the partial sums add up to the full convolution."""
    prog = prog_or_sched(example("conv2d.ccn"), "conv_tp", schedule)
    gen = np.random.default_rng(R * C)
    x = gen.standard_normal((2, C, 6, 5)).astype(F32)
    k = gen.standard_normal((Oc, C, 3, 3)).astype(F32)
    want = F.relu(F.conv2d(torch.tensor(d64(x)), torch.tensor(d64(k)), stride=2, padding=1)).numpy()
    res = call(prog, R, {"x": x, "k": k})
    for r in range(R):
        np.testing.assert_allclose(res[r].outputs["out"], want, rtol=1e-4, atol=1e-5)


def test_conv_partial_sums():
    mod = load_source("""
program part(x: f32[N, C, H, W] sliced(1), k: f32[O, C, 3, 3] sliced(1)) {
    p = conv2d(x, k, stride=2, padding=1)
    return p
}
""")
    gen = np.random.default_rng(5)
    x, k = gen.standard_normal((2, 5, 7, 6)).astype(F32), gen.standard_normal((3, 5, 3, 3)).astype(F32)
    full = F.conv2d(torch.tensor(d64(x)), torch.tensor(d64(k)), stride=2, padding=1).numpy()
    for R in (2, 3, 4, 6):  # C = 5: R = 6 leaves a rank with no channel
        res = call(mod.programs["part"], R, {"x": x, "k": k})
        parts = [res[r].outputs["p"] for r in range(R)]
        for r, p in enumerate(parts):
            lo, hi = part(5, R, r)
            want = F.conv2d(torch.tensor(d64(x[:, lo:hi])), torch.tensor(d64(k[:, lo:hi])),
                            stride=2, padding=1).numpy() if hi > lo else np.zeros(full.shape)
            np.testing.assert_allclose(p, want, rtol=1e-4, atol=1e-5, err_msg=f"R={R} rank {r}")
        np.testing.assert_allclose(sum(d64(p) for p in parts), full, rtol=1e-4, atol=1e-5)


# --- pointwise math against PyTorch ---------------------------------------------------------
def test_pointwise_against_torch():
    mod = load_source("""
program pw(x: f32[N] replicated, y: f32[N] replicated) {
    a = gelu(x)
    b = tanh(x)
    c = sigmoid(x)
    d = relu(x)
    e = exp(x)
    f = log(abs(x) + 1)
    g = rsqrt(y)
    h = where(x < y, x, y)
    i = min(x, y) + max(x, y) * 2
    j = y ** 1.5
    k = -x / y
    return a, b, c, d, e, f, g, h, i, j, k
}
""")
    gen = np.random.default_rng(9)
    x = np.concatenate([np.linspace(-6, 6, 41), gen.standard_normal(20)]).astype(F32)
    y = gen.uniform(0.1, 3, x.size).astype(F32)
    out = call(mod.programs["pw"], 1, {"x": x, "y": y})[0].outputs
    tx, ty = torch.tensor(d64(x)), torch.tensor(d64(y))
    want = {"a": F.gelu(tx), "b": torch.tanh(tx), "c": torch.sigmoid(tx), "d": torch.relu(tx),
            "e": torch.exp(tx), "f": torch.log(tx.abs() + 1), "g": torch.rsqrt(ty),
            "h": torch.where(tx < ty, tx, ty), "i": torch.minimum(tx, ty) + 2 * torch.maximum(tx, ty),
            "j": ty**1.5, "k": -tx / ty}
    for name, w in want.items():
        close(out[name], w.numpy(), F32, name)


# --- collectives and reduction ops ----------------------------------------------------------
REDUCE = {"sum": lambda a: a.sum(0), "avg": lambda a: a.mean(0), "prod": lambda a: a.prod(0),
          "max": lambda a: a.max(0), "min": lambda a: a.min(0)}


@pytest.mark.parametrize("op", list(REDUCE))
@pytest.mark.parametrize("R,N", [(1, 5), (2, 5), (3, 7), (4, 9), (3, 2), (4, 1)])
def test_reduction_ops(op, R, N):
    mod = load_source(f"""
program p(x: f32[N] local) {{
    a = allreduce({op}, x)
    s = reducescatter({op}, x)
    return a, s
}}
program q(x: f32[M, N] local) {{
    s = reducescatter({op}, x, dim=1)
    return s
}}
""")
    gen = np.random.default_rng(R * N)
    x = gen.uniform(0.5, 1.5, (R, N)).astype(F32)
    x[:, 0] = -x[:, 0]  # max and min must not be fooled by signs
    want = REDUCE[op](d64(x))
    res = call(mod.programs["p"], R, {}, {"x": list(x)})
    for r in range(R):
        close(res[r].outputs["a"], want, F32, f"rank {r} allreduce")
        close(res[r].outputs["s"], cut(want, 0, R, r), F32, f"rank {r} reducescatter")
    x2 = gen.uniform(0.5, 1.5, (R, 3, N)).astype(F32)
    want2 = REDUCE[op](d64(x2))
    res = call(mod.programs["q"], R, {}, {"x": list(x2)})
    for r in range(R):
        close(res[r].outputs["s"], cut(want2, 1, R, r), F32, f"rank {r} reducescatter dim=1")


@pytest.mark.parametrize("op", ["sum", "prod", "max", "min"])
def test_integer_reductions_exact(op):
    mod = load_source(f"program p(x: i32[N] local) {{\n a = allreduce({op}, x)\n return a\n}}")
    x = np.random.default_rng(1).integers(-9, 9, (3, 8)).astype(np.int32)
    res = call(mod.programs["p"], 3, {}, {"x": list(x)})
    for r in range(3):
        assert res[r].outputs["a"].dtype == np.int32
        np.testing.assert_array_equal(res[r].outputs["a"], REDUCE[op](x.astype(np.int64)))


GROUPED = """
program coll(x: f32[N] local) {
    a = broadcast(x, 1)
    b = reduce(sum, x, 1)
    c = send(x, next)
    d = send(x, prev)
    e = allreduce(max, x)
    return a, b, c, d, e
}
program p2p(y: f32[N] local) {
    rs = reducescatter(sum, y)
    n = send(rs, next)
    return n
}
program sc(x: f32[M, N] replicated) {
    a = scatter(x, dim=1)
    b = allgather(a)
    return a, b
}
program rootless(x: f32[N] local) {
    c = send(x, next)
    d = send(x, prev)
    return c, d
}
"""


@pytest.mark.parametrize("R,G", [(2, 1), (4, 2), (6, 3), (6, 2)])
def test_broadcast_reduce_send_with_groups(R, G):
    prog = load_source(GROUPED).programs["coll"]
    gs, N = R // G, 5
    x = np.random.default_rng(R).standard_normal((R, N)).astype(F32)
    res = call(prog, R, {}, {"x": list(x)}, groups=G)
    zero = np.zeros(N)
    for r in range(R):
        g, j = divmod(r, gs)
        mine = d64(x[g * gs:(g + 1) * gs])
        out = res[r].outputs
        close(out["a"], mine[1], F32, f"rank {r} broadcast")
        close(out["b"], mine.sum(0) if j == 1 else x[r], F32, f"rank {r} reduce")
        close(out["c"], x[r - gs] if g > 0 else zero, F32, f"rank {r} send next")
        close(out["d"], x[r + gs] if g < G - 1 else zero, F32, f"rank {r} send prev")
        close(out["e"], mine.max(0), F32, f"rank {r} allreduce in group")


def test_send_one_rank_groups_and_bad_root():
    mod = load_source(GROUPED)
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(F32)
    res = call(mod.programs["rootless"], 3, {}, {"x": list(x)}, groups=3)
    for r in range(3):
        close(res[r].outputs["c"], x[r - 1] if r else np.zeros(4), F32)
        close(res[r].outputs["d"], x[r + 1] if r < 2 else np.zeros(4), F32)
    with pytest.raises(ValueError, match="root"):  # root 1 in groups of one rank
        call(mod.programs["coll"], 2, {}, {"x": list(x[:2])}, groups=2)


@pytest.mark.parametrize("R,G,N", [(4, 2, 5), (6, 2, 7), (6, 3, 1), (4, 2, 1)])
def test_send_sliced_and_scatter_with_groups(R, G, N):
    mod = load_source(GROUPED)
    gs = R // G
    gen = np.random.default_rng(N)
    y = gen.standard_normal((R, N)).astype(F32)
    res = call(mod.programs["p2p"], R, {}, {"y": list(y)}, groups=G)
    for r in range(R):
        g, j = divmod(r, gs)
        want = cut(d64(y[(g - 1) * gs:g * gs]).sum(0), 0, gs, j) if g else np.zeros(len(range(*part(N, gs, j))))
        close(res[r].outputs["n"], want, F32, f"rank {r}")
    # replicated within a group, different between groups
    xs = [gen.standard_normal((3, N)).astype(F32) for _ in range(G)]
    res = call(mod.programs["sc"], R, {}, {"x": [xs[r // gs] for r in range(R)]}, groups=G)
    for r in range(R):
        close(res[r].outputs["a"], cut(xs[r // gs], 1, gs, r % gs), F32, f"rank {r} scatter")
        close(res[r].outputs["b"], xs[r // gs], F32, f"rank {r} allgather")


@pytest.mark.parametrize("schedule", [None, "sliced_p2p"])
@pytest.mark.parametrize("R", [2, 4, 6])
def test_pipeline_stage(example, schedule, R):
    prog = prog_or_sched(example("pipeline.ccn"), "stage", schedule)
    G, B, H = 2, 5, 3
    gs = R // G
    gen = np.random.default_rng(R)
    y = gen.standard_normal((R, B, H)).astype(F32)
    b = [gen.standard_normal(H).astype(F32) for _ in range(G)]
    rr = [gen.standard_normal((B, H)).astype(F32) for _ in range(G)]
    res = call(prog, R, {}, {"y": list(y), "b": [b[r // gs] for r in range(R)],
                             "r": [rr[r // gs] for r in range(R)]}, groups=G)
    h0 = np.maximum(d64(y[:gs]).sum(0) + d64(b[0]), 0) + d64(rr[0])
    for r in range(R):
        close(res[r].outputs["nxt"], h0 if r >= gs else np.zeros((B, H)), F32, f"rank {r}")


# --- bf16 / f16 -----------------------------------------------------------------------------
def test_bf16():
    mod = load_source("""
program bf(x: bf16[N] local, b: bf16[N] replicated, s: f32, x32: f32[N] replicated) {
    t = allreduce(sum, x)
    y = t * b + s
    c = cast(x32, bf16)
    return y, c
}
""")
    gen = np.random.default_rng(2)
    x = gen.uniform(-2, 2, (3, 10)).astype(BF16)
    b = gen.uniform(0.5, 1.5, 10).astype(BF16)
    x32 = gen.standard_normal(10).astype(F32)
    res = call(mod.programs["bf"], 3, {"b": b, "s": 0.25, "x32": x32}, {"x": list(x)})
    t = d64(x).sum(0).astype(BF16)  # the all-reduce result is stored in bf16
    for r in range(3):
        out = res[r].outputs
        close(out["y"], d64(t) * d64(b) + 0.25, BF16, "y")
        assert out["c"].dtype == BF16
        np.testing.assert_array_equal(out["c"], x32.astype(BF16))  # round to nearest even
    with pytest.raises(TypeError, match="'x'"):
        call(mod.programs["bf"], 3, {"b": b, "s": 0.25, "x32": x32}, {"x": [a.astype(F16) for a in x]})


# --- uneven and empty slices ----------------------------------------------------------------
def test_empty_slices_adam_zero(example):
    """N = 2 on 4 ranks: ranks 2 and 3 hold empty slices of m and v and still take part."""
    prog = example("adam.ccn").schedule("adam", "zero").ir
    R, N = 4, 2
    g = np.arange(R * N, dtype=F32).reshape(R, N) / 10
    w, m, v = np.ones(N, F32), np.zeros(N, F32), np.full(N, 0.1, F32)
    sc = {"lr": 0.1, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "step": 1.0}
    res = call(prog, R, {"w": w, "m": m, "v": v, **sc}, {"g": list(g)})
    want = adam_reference(d64(w), d64(m), d64(v), d64(g).sum(0),
                          *[f32(sc[k]) for k in ("lr", "beta1", "beta2", "eps", "step")])
    assert [res[r].updates["m"].shape for r in range(R)] == [(1,), (1,), (0,), (0,)]
    for r in range(R):
        close(res[r].updates["w"], want[0], F32)
        close(res[r].updates["m"], cut(want[1], 0, R, r), F32)


# --- bad calls ------------------------------------------------------------------------------
def adam_args(prog, R, N, **override):
    gen = np.random.default_rng(0)
    sh = {"w": np.ones(N, F32), "m": np.zeros(N, F32), "v": np.ones(N, F32), "lr": 0.1,
          "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "step": 1.0}
    out = []
    for r in range(R):
        a = {q.name: (cut(sh[q.name], 0, R, r) if q.type.layout.sliced else sh[q.name])
             for q in prog.params if q.name != "g"}
        a["g"] = gen.standard_normal(N).astype(F32)
        out.append(a)
    for r, changes in override.items():
        out[int(r[1:])].update(changes)
    return out


def test_bad_calls_adam(example):
    mod = example("adam.ccn")
    prog, zero = mod.programs["adam"], mod.schedule("adam", "zero").ir
    run(prog, adam_args(prog, 2, 5))  # the good call
    run(zero, adam_args(zero, 3, 7))
    cases = [
        (prog, {"r1": {"g": np.ones(5, F64)}}, TypeError, "'g'.*dtype"),
        (prog, {"r0": {"w": np.ones(5, F16)}}, TypeError, "'w'"),
        (prog, {"r0": {"w": np.ones((5, 1), F32)}}, ValueError, "'w'"),
        (prog, {"r0": {"v": np.ones(6, F32)}}, ValueError, "'v'.*N"),  # N = 6 here, 5 from g
        (prog, {"r1": {"g": np.ones(4, F32)}}, ValueError, "'g'"),  # rank 1 disagrees on N
        (prog, {"r0": {"lr": np.ones(1, F32)}}, TypeError, "'lr'"),
        (prog, {"r0": {"g": [1.0] * 5}}, TypeError, "'g'"),
    ]
    for p, ov, exc, pat in cases:
        with pytest.raises(exc, match=pat):
            run(p, adam_args(p, 2, 5, **ov))
    args = adam_args(prog, 2, 5)
    del args[1]["eps"]
    with pytest.raises(TypeError, match="'eps'"):
        run(prog, args)
    # zero: m is sliced; N = 7 on 3 ranks means slices of 3, 3, 1
    with pytest.raises(ValueError, match="'m'"):  # a full-size m
        run(zero, adam_args(zero, 3, 7, r0={"m": np.zeros(7, F32)}, r1={"m": np.zeros(7, F32)},
                            r2={"m": np.zeros(7, F32)}))
    with pytest.raises(ValueError, match="'m'"):  # slices of 2, 3, 2: right total, wrong parts
        run(zero, adam_args(zero, 3, 7, r0={"m": np.zeros(2, F32)}, r2={"m": np.zeros(2, F32)}))
    with pytest.raises(ValueError, match="'v'"):  # rank 2's slice too long
        run(zero, adam_args(zero, 3, 7, r2={"v": np.zeros(3, F32)}))


def test_bad_calls_scattered_and_seed(example):
    lamb = example("lamb.ccn").programs["lamb"]
    segs_a, segs_b = (3, 4), (4, 3)

    def lists(segs):
        return [np.ones(n, F32) for n in segs]

    sc = {"lr": 0.1, "beta1": 0.9, "beta2": 0.99, "eps": 1e-6, "wd": 0.0, "step": 1.0}
    good = {"g": lists(segs_a), "w": lists(segs_a), "m": lists(segs_a), "v": lists(segs_a), **sc}
    run(lamb, [good, good])
    with pytest.raises(ValueError, match="'w'.*segment"):
        run(lamb, [{**good, "w": lists(segs_b)}] * 2)
    with pytest.raises(ValueError, match="'g'.*segment"):  # rank 1 cuts g differently
        run(lamb, [good, {**good, "g": lists(segs_b)}])
    with pytest.raises(TypeError, match="'v'"):
        run(lamb, [{**good, "v": [np.ones(3, F32), np.ones(4, F16)]}] * 2)
    with pytest.raises(ValueError, match="'m'"):
        run(lamb, [{**good, "m": [np.ones(3, F32), np.ones((2, 2), F32)]}] * 2)

    mlp = example("mlp_out.ccn").programs["mlp_out"]
    args = mlp_inputs(2, 3, 4, 5, seed=1)
    with pytest.raises(TypeError, match="'seed'"):
        call(mlp, 2, {**args, "seed": 1.5})
    good = [{"x": cut(args["x"], 2, 2, i), "w": cut(args["w"], 0, 2, i), "b": args["b"],
             "r": args["r"], "seed": 1} for i in range(2)]
    run(mlp, good)
    with pytest.raises(ValueError, match="'w'"):  # w cut along the wrong dim
        run(mlp, [{**a, "w": cut(args["w"], 1, 2, i)} for i, a in enumerate(good)])
    with pytest.raises(ValueError, match="'x'"):  # x not cut at all
        run(mlp, [{**a, "x": args["x"]} for a in good])
