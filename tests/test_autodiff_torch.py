"""Derived (vector-Jacobian) programs against torch.autograd of the same computation written
independently, for one process, in plain PyTorch (f64).

Each program is derived with coconetc.autodiff.vjp and run under the interpreter on 1, 2 and 4
simulated ranks (and in groups); the reference is the whole computation on full tensors (the
full weight matrices; the ranks' partial sums become the one sum they stand for), differentiated
by torch.autograd.grad(outputs, inputs, grad_outputs=the cotangents). The loss convention is
docs/autodiff.md's: a replicated or sliced output counts once a group (the same cotangent in
every group), a local one once a rank. So torch's gradient of a replicated input is compared with
every rank's (summed over the groups, which share the input), a sliced input's is cut into the
ranks' slices, a local input's is per rank.

A dropout's mask is coconet's (the counter-based generator keyed by the stage, docs/language.md,
"Operations"): the reference computes it with coconetc.interp.rng at the same site and uses it as a
constant. A float literal of the program is rounded to f32 by the front end (a weak f32, see
docs/autodiff.md), so the reference uses the rounded value (f32c)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from coconetc.autodiff import vjp
from coconetc.autodiff.vjp import recomputed
from coconetc.autodiff.text import check_text, unfaithful_sites
from coconetc.interp.interpreter import run
from coconetc.interp.rng import dropout_keep, site_key
from coconetc.ir import ops, printer
from coconetc.ir.nodes import Program
from coconetc.ir.slices import take_slice
from coconetc.sourcefile import load_source
from test_autodiff import _inputs, _logical, _random, _shape

torch = pytest.importorskip("torch")
F = torch.nn.functional

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RTOL = 1e-9


def f32c(v: float) -> float:
    """A float literal as the interpreter uses it (rounded to f32)."""
    return float(np.float32(v))


def f64(src: str) -> str:
    return src.replace("bf16", "f64").replace("f16", "f64").replace("f32", "f64")


def example(file: str) -> str:
    return f64((EXAMPLES / file).read_text())


def keep_mask(site: str, shape: tuple[int, ...], p: float, seed: int) -> torch.Tensor:
    """coconet's dropout mask at `site` for a value of global shape `shape`, scaled: the
    constant the reference multiplies by."""
    keep = dropout_keep(seed, site_key(site), np.arange(int(np.prod(shape))).reshape(shape), p)
    return torch.tensor(np.where(keep, 1.0 / (1.0 - p), 0.0), dtype=torch.float64)


# --- the programs and their references --------------------------------------------------------
# A reference: ref(v, R, G) with v the parameters (a replicated or sliced one: one full leaf
# tensor; a local one: a list of R leaves, rank by rank; a scalar: a 0-d tensor or an int)
# returns {output: value}; a replicated or sliced output's value is one full tensor (the same in
# every group) or a list of G (one a group); a local output's is a list of R (rank by rank).
# Integer outputs are left out (they have no gradient).
Ref = Callable[[dict, int, int], dict]


@dataclass
class Case:
    src: str
    sizes: dict[str, int]
    ref: Ref
    name: str | None = None
    configs: tuple[tuple[int, int], ...] = ((1, 1), (2, 1), (4, 1), (4, 2))  # (ranks, groups)
    wrt: list[str] | None = None
    positive: bool = False
    prepare: Callable[[dict], None] | None = None  # sets chosen values (zeros, ties) in the drawn ones


def _groups(vals: list, R: int, G: int) -> list[list]:
    gs = R // G
    return [vals[k * gs:(k + 1) * gs] for k in range(G)]


def ref_tp_mlp(v: dict, R: int, G: int) -> dict:
    return {"y": F.gelu(v["x"] @ v["w1"] + v["b1"]) @ v["w2"] + v["b2"]}


def ref_sp_block(v: dict, R: int, G: int) -> dict:
    x = v["x"]
    n = F.layer_norm(x, (x.shape[-1],), v["gamma"], v["beta"], eps=f32c(1e-5))
    p = F.gelu(n @ v["w1"] + v["b1"]) @ v["w2"]
    return {"y": (p + v["b2"]) * keep_mask("y#0", tuple(x.shape), 0.1, v["seed"]) + x}


def ref_sp_block_no_dropout(v: dict, R: int, G: int) -> dict:
    x = v["x"]
    n = F.layer_norm(x, (x.shape[-1],), v["gamma"], v["beta"], eps=f32c(1e-5))
    return {"y": F.gelu(n @ v["w1"] + v["b1"]) @ v["w2"] + v["b2"] + x}


def _sp_no_dropout() -> str:
    """sp_block without its dropout: its derived text can be printed (a dropout's cannot yet,
    docs/autodiff.md), so the text read back is compared too."""
    src = _tp_mlp_src()
    assert "dropout(rs + b2, 0.1, seed)" in src
    return src.replace("dropout(rs + b2, 0.1, seed)", "(rs + b2)")


def ref_row_parallel(v: dict, R: int, G: int) -> dict:
    return {"s": v["x"] @ v["w"]}


def ref_attn_out(v: dict, R: int, G: int) -> dict:
    h = [sum(ys) + v["b"] + v["r"] for ys in _groups(v["y"], R, G)]
    H = v["b"].shape[0]
    return {"out": [F.layer_norm(hk, (H,), v["gamma"], v["beta"], eps=f32c(1e-5)) for hk in h], "h": h}


def ref_stage(v: dict, R: int, G: int) -> dict:
    h = [F.relu(sum(ys) + v["b"]) + v["r"] for ys in _groups(v["y"], R, G)]
    return {"nxt": [torch.zeros_like(h[0])] + h[:-1]}


def ref_collectives(v: dict, R: int, G: int) -> dict:
    gs = R // G
    xs, ys = _groups(v["x"], R, G), _groups(v["y"], R, G)
    out: dict = {"a": [torch.stack(x).amax(0) for x in xs],
                 "b": [torch.stack(x).mean(0) for x in xs]}
    out["c"] = out["b"]
    out["d"] = [x[0] for x in xs]
    out["e"] = [sum(y) if i == 0 else y[i] for y in ys for i in range(gs)]
    out["g"] = v["z"] * 2 + v["sl"]
    out["p"] = [torch.zeros_like(v["y"][r]) if r < gs else v["y"][r - gs] for r in range(R)]
    out["q"] = [torch.stack([yi / 2 for yi in y]).prod(0) for y in ys]
    out["n"] = torch.linalg.vector_norm(v["sl"]) + v["sl"].sum()
    return out


def ref_mlp_out(v: dict, R: int, G: int) -> dict:
    s = v["x"] @ v["w"] + v["b"]
    return {"out": s * keep_mask("out#0", tuple(s.shape), 0.1, v["seed"]) + v["r"]}


def ref_conv_tp(v: dict, R: int, G: int) -> dict:
    return {"out": F.relu(F.conv2d(v["x"], v["k"], stride=2, padding=1))}


def ref_conv_layer(v: dict, R: int, G: int) -> dict:
    return {"full": F.gelu(F.conv2d(v["x"], v["k"], stride=1, padding=1) + v["bias"])}


# a data-parallel loss: every rank's own batch, averaged over the group
DP_AVG = """program dp(x: f64[B, H] local, t: f64[B, C] local, w: f64[H, C] replicated, b: f64[C] replicated) {
    y = tanh(matmul(x, w) + b)
    e = y - t
    l = allreduce(avg, sum(e * e) * 0.5)
    return l
}"""


def ref_dp(v: dict, R: int, G: int) -> dict:
    losses = [0.5 * ((torch.tanh(x @ v["w"] + v["b"]) - t) ** 2).sum() for x, t in zip(v["x"], v["t"])]
    return {"l": [sum(ls) / len(ls) for ls in _groups(losses, R, G)]}


# a column-parallel linear layer whose output is gathered (and also returned sliced)
COL_GATHER = """program col_gather(x: f64[B, S, H] replicated, w: f64[H, F] sliced(1), b: f64[F] sliced(0),
                   r: f64[B, S, F] replicated) {
    y = matmul(x, w) + b
    z = allgather(relu(y))
    out = sigmoid(z) * r
    return out, y
}"""


def ref_col_gather(v: dict, R: int, G: int) -> dict:
    y = v["x"] @ v["w"] + v["b"]
    return {"out": torch.sigmoid(F.relu(y)) * v["r"], "y": y}


# attention without the softmax: a (learned) mixing of the sequence applied to column-parallel
# values, gated by column-parallel queries, then a row-parallel output projection
ATTN = """program attn(x: f64[S, H] replicated, mix: f64[S, S] replicated, wq: f64[H, D] sliced(1),
             wv: f64[H, D] sliced(1), wo: f64[D, H] sliced(0), bo: f64[H] replicated) {
    q = matmul(x, wq)
    v = matmul(x, wv)
    ctx = matmul(mix, v)
    a = ctx * tanh(q)
    o = matmul(a, wo)
    s = allreduce(sum, o)
    y = s + bo
    z = matmul(y, wq)
    return y, z
}"""


def ref_attn(v: dict, R: int, G: int) -> dict:
    x = v["x"]
    a = (v["mix"] @ (x @ v["wv"])) * torch.tanh(x @ v["wq"])
    y = a @ v["wo"] + v["bo"]
    return {"y": y, "z": y @ v["wq"]}


# norm-based losses: of a sliced error, of sliced weights, and of each rank's own values summed
NORMS = """program norms(x: f64[B, H] replicated, w: f64[H, F] sliced(1), t: f64[B, F] sliced(1),
              u: f64[N] local, c: f64[N] replicated) {
    e = matmul(x, w) - t
    l = norm(e) + sum(e * e) * 0.5 + norm(w) * 0.25
    m = allreduce(sum, norm(u * c) + sum(u) * 0.5)
    return l, m
}"""


def ref_norms(v: dict, R: int, G: int) -> dict:
    e = v["x"] @ v["w"] - v["t"]
    nrm = torch.linalg.vector_norm
    loss = nrm(e) + (e * e).sum() * 0.5 + nrm(v["w"]) * 0.25
    per_rank = [nrm(u * v["c"]) + u.sum() * 0.5 for u in v["u"]]
    return {"l": loss, "m": [sum(ms) for ms in _groups(per_rank, R, G)]}


# data parallelism by slicing the batch: replicated weights read by sliced rows
ROWS = """program rows(x: f64[B, H] sliced(0), w: f64[H, F] replicated, b: f64[F] replicated) {
    y = gelu(matmul(x, w) + b)
    l = sum(y * y)
    return y, l
}"""


def ref_rows(v: dict, R: int, G: int) -> dict:
    y = F.gelu(v["x"] @ v["w"] + v["b"])
    return {"y": y, "l": (y * y).sum()}


# ties of allreduce(max/min): a replicated operand is the same on every rank (the result is the
# operand itself: its gradient is g, not R g), and every rank's max(u - 10, c) is c
TIES = """program ties(x: f64[N, H] replicated, u: f64[N, H] local, c: f64[N, H] replicated) {
    a = allreduce(max, tanh(x))
    b = reducescatter(min, x * 2.0, dim=1)
    m = allreduce(max, max(u - 10.0, c))
    return a, b, m
}"""


def ref_ties(v: dict, R: int, G: int) -> dict:
    per_rank = [torch.maximum(u - 10.0, v["c"]) for u in v["u"]]
    return {"a": torch.tanh(v["x"]), "b": v["x"] * 2.0, "m": [torch.stack(m).amax(0) for m in _groups(per_rank, R, G)]}


# zero norms: PyTorch's subgradient there is 0 (x / norm(x) would be 0 / 0)
ZERO_NORMS = """program zero_norms(x: f64[N, H] sliced(0), w: f64[N, H] replicated, u: f64[N, H] local) {
    n = norm(x * 0.0) + norm(w * x) + norm(w - w)
    k = allreduce(sum, norm(u * 0.0) * 3.0 + norm(u))
    return n, k
}"""


def ref_zero_norms(v: dict, R: int, G: int) -> dict:
    nrm = torch.linalg.vector_norm
    per_rank = [nrm(u * 0.0) * 3.0 + nrm(u) for u in v["u"]]
    return {"n": nrm(v["x"] * 0.0) + nrm(v["w"] * v["x"]) + nrm(v["w"] - v["w"]),
            "k": [sum(ks) for ks in _groups(per_rank, R, G)]}


# LAMB's trust ratio on layers passed as one buffer a layer; one layer's weights are zeros (a
# bias initialized to 0): its norm is 0
SEGMENTS = (2, 3, 1, 4)  # how test_autodiff passes a scattered value
LAMB_TRUST = """program trust(w: f64[N] replicated scattered, r: f64[N] replicated scattered, lr: f64) {
    t = w - lr * (segment_norm(w) / segment_norm(r)) * r
    return t
}"""


def ref_trust(v: dict, R: int, G: int) -> dict:
    nrm = torch.linalg.vector_norm
    ws, rs = torch.split(v["w"], SEGMENTS), torch.split(v["r"], SEGMENTS)
    return {"t": v["w"] - v["lr"] * torch.cat([nrm(w) / nrm(r) * r for w, r in zip(ws, rs)])}


def _zero_segment(vals: dict) -> None:
    vals["w"][2:5] = 0.0


# broadcasting onto sliced values: replicated operands of every shape read at the slice, a scalar
BROADCASTS = """program bcast(x: f64[B, S, H] sliced(DIM), c: f64[S, H] replicated, k: f64[B, 1, H] replicated,
              m: f64[S, 1] replicated, h: f64[H] replicated, a: f64) {
    y = x * c + k * a
    z = tanh(y) * m + h
    return z
}"""


def ref_bcast(v: dict, R: int, G: int) -> dict:
    return {"z": torch.tanh(v["x"] * v["c"] + v["k"] * v["a"]) * v["m"] + v["h"]}


# one replicated value read by a sliced, a local and a replicated computation, and gathered
MIXED_READS = """program mixed(x: f64[B, H] replicated, w: f64[H, F] sliced(1), u: f64[B, H] local,
              s: f64[B, H] sliced(0)) {
    a = matmul(x, w)
    b = x * u
    c = x * s
    d = exp(x * 0.5)
    e0 = allreduce(sum, b)
    e = e0 + d
    f0 = allgather(c)
    f = f0 + e
    g = allgather(a)
    return f, g, b
}"""


def ref_mixed(v: dict, R: int, G: int) -> dict:
    b = [v["x"] * u for u in v["u"]]
    f = [v["x"] * v["s"] + sum(bs) + torch.exp(v["x"] * 0.5) for bs in _groups(b, R, G)]
    return {"f": f, "g": v["x"] @ v["w"], "b": b}


# the pointwise rules with sliced, replicated and local operands and a scalar exponent
POINTWISE = """program pointwise(x: f64[N, H] sliced(1), y: f64[N, H] replicated, u: f64[N, H] local, k: f64) {
    a = x ** 3 + y ** k + max(x, y * 2.0)
    b = where(u < y, u * y, y / u) + min(u, y) + abs(u - 1.5) * 0.5
    c = sqrt(y) * rsqrt(x) + log(y) * sigmoid(x)
    return a, b, c
}"""


def ref_pointwise(v: dict, R: int, G: int) -> dict:
    x, y = v["x"], v["y"]
    return {"a": x ** 3 + y ** v["k"] + torch.maximum(x, y * 2.0),
            "b": [torch.where(u < y, u * y, y / u) + torch.minimum(u, y) + torch.abs(u - 1.5) * 0.5 for u in v["u"]],
            "c": torch.sqrt(y) * torch.rsqrt(x) + torch.log(y) * torch.sigmoid(x)}


# layernorm of batch slices with its eps differentiated, a matmul chain sharing one weight
LN_CHAIN = """program ln_chain(x: f64[B, S, H] sliced(0), g: f64[H] replicated, b: f64[H] replicated,
                w: f64[H, H] replicated, e: f64) {
    n = layernorm(x, g, b, e)
    y = matmul(matmul(n, w), w)
    l = sum(y * y) + norm(n)
    return y, l
}"""


def ref_ln_chain(v: dict, R: int, G: int) -> dict:
    x = v["x"]
    xc = x - x.mean(-1, keepdim=True)
    n = xc / torch.sqrt((xc * xc).mean(-1, keepdim=True) + v["e"]) * v["g"] + v["b"]  # eps is a leaf
    y = (n @ v["w"]) @ v["w"]
    return {"y": y, "l": (y * y).sum() + torch.linalg.vector_norm(n)}


# pipeline stages (groups) whose layer is tensor-parallel: send forward and backward
PIPE_TP = """program pipe_tp(x: f64[B, H] replicated, w1: f64[H, F] sliced(1), w2: f64[F, H] sliced(0)) {
    h = relu(matmul(x, w1))
    p = matmul(h, w2)
    s = allreduce(sum, p)
    n = send(s + x, next)
    m = send(h, prev)
    return n, m
}"""


def ref_pipe_tp(v: dict, R: int, G: int) -> dict:
    h = F.relu(v["x"] @ v["w1"])
    s = h @ v["w2"] + v["x"]
    return {"n": [torch.zeros_like(s)] + [s] * (G - 1), "m": [h] * (G - 1) + [torch.zeros_like(h)]}


# reducescatter along the first and the last dim (avg, sum), gathered back
RS_DIMS = """program rs_dims(u: f64[N, M, K] local, w: f64[N, M, K] replicated) {
    a = reducescatter(avg, u * w, dim=2)
    b = reducescatter(sum, exp(u), dim=0)
    c = allgather(a * 2.0)
    return a, b, c
}"""


def ref_rs_dims(v: dict, R: int, G: int) -> dict:
    us = _groups(v["u"], R, G)
    a = [sum(u * v["w"] for u in g) / len(g) for g in us]
    return {"a": a, "b": [sum(torch.exp(u) for u in g) for g in us], "c": [ak * 2.0 for ak in a]}


# broadcast and reduce with roots other than 0, scatter of their result
ROOTS = """program roots(u: f64[N, H] local, w: f64[N, H] replicated) {
    a = broadcast(u * w, 1)
    b = reduce(sum, tanh(u) + w, 0)
    c = reduce(avg, u, 1)
    d = scatter(a * w, dim=1)
    return a, b, c, d
}"""


def ref_roots(v: dict, R: int, G: int) -> dict:
    us, w = _groups(v["u"], R, G), v["w"]
    return {"a": [g[1] * w for g in us],
            "b": [sum(torch.tanh(x) + w for x in g) if i == 0 else torch.tanh(g[i]) + w for g in us for i in range(len(g))],
            "c": [sum(g) / len(g) if i == 1 else g[i] for g in us for i in range(len(g))],
            "d": [g[1] * w * w for g in us]}


# conv2d channel-parallel (row), output-channel-parallel (column) and a replicated 1x1 conv
CONVS = """program convs(x: f64[N, C, 5, 4] sliced(1), w: f64[O, C, 3, 2] sliced(1), v: f64[O, O, 1, 1] replicated,
             w0: f64[O, C, 3, 2] sliced(0), xr: f64[N, C, 5, 4] replicated) {
    part = conv2d(x, w, stride=2, padding=1)
    y = allreduce(sum, part)
    z = conv2d(relu(y), v)
    q0 = conv2d(xr, w0, stride=1, padding=0)
    q = allgather(tanh(q0))
    return z, q
}"""


def ref_convs(v: dict, R: int, G: int) -> dict:
    return {"z": F.conv2d(F.relu(F.conv2d(v["x"], v["w"], stride=2, padding=1)), v["v"]),
            "q": torch.tanh(F.conv2d(v["xr"], v["w0"]))}


# local 0-d outputs (each rank's own loss) next to their all-reduced product
LOCAL_SCALARS = """program local_scalars(x: f64[B, H] local, w: f64[H] replicated) {
    l = sum(tanh(x * w))
    n = norm(x)
    y = allreduce(sum, l * n)
    return l, y
}"""


def ref_local_scalars(v: dict, R: int, G: int) -> dict:
    ls = [torch.tanh(x * v["w"]).sum() for x in v["x"]]
    ns = [torch.linalg.vector_norm(x) for x in v["x"]]
    return {"l": ls, "y": [sum(a * b for a, b in zip(lg, ng)) for lg, ng in zip(_groups(ls, R, G), _groups(ns, R, G))]}


# an output that later stages read, returned sliced and gathered
REUSED = """program reused(x: f64[B, H] sliced(1), w: f64[H] replicated) {
    y = x * w
    z = allgather(y)
    q = sum(z * z)
    return y, z, q
}"""


def ref_reused(v: dict, R: int, G: int) -> dict:
    y = v["x"] * v["w"]
    return {"y": y, "z": y, "q": (y * y).sum()}


# a defined operation (a whole tensor-parallel FFN) and two dropouts in one stage (sites y#0, y#1)
DEFINED = """op ffn(x, w1, w2) = matmul(gelu(matmul(x, w1)), w2)
program defined(x: f64[B, S, H] replicated, w1: f64[H, F] sliced(1), w2: f64[F, H] sliced(0), seed: i64) {
    p = ffn(x, w1, w2)
    s = allreduce(sum, p)
    y = dropout(s, 0.25, seed) + dropout(x, 0.5, seed)
    return y
}"""


def ref_defined(v: dict, R: int, G: int) -> dict:
    shape = tuple(v["x"].shape)
    return {"y": (F.gelu(v["x"] @ v["w1"]) @ v["w2"]) * keep_mask("y#0", shape, 0.25, v["seed"])
            + v["x"] * keep_mask("y#1", shape, 0.5, v["seed"])}


def _conv_literal(src: str) -> str:
    """conv2d.ccn with literal spatial sizes (then the output's are literals too and the
    derived text parses) and conv_layer without its update (a program with an update has no
    derivative)."""
    src = src.replace("H, W]", "6, 5]")
    return "\n".join(line for line in src.splitlines() if "gsum" not in line and "nb = update" not in line)


def _tp_mlp_src() -> str:
    return example("tp_mlp.ccn")


SOME = ((1, 1), (2, 1), (3, 1), (4, 2))
UNEVEN = ((3, 1), (4, 1), (6, 1), (6, 2))  # slices of unequal sizes, some empty

CASES: dict[str, Case] = {
    "tp_mlp": Case(_tp_mlp_src(), {"B": 2, "S": 4, "H": 4, "F": 8}, ref_tp_mlp, "tp_mlp"),
    "sp_block": Case(_tp_mlp_src(), {"B": 2, "S": 4, "H": 4, "F": 8}, ref_sp_block, "sp_block"),
    "sp_block_no_dropout": Case(_sp_no_dropout(), {"B": 2, "S": 4, "H": 4, "F": 8}, ref_sp_block_no_dropout, "sp_block"),
    "tp_overlap.row_parallel": Case(example("tp_overlap.ccn"), {"B": 2, "S": 2, "K": 4, "H": 3}, ref_row_parallel,
                                    "row_parallel"),
    "tp_overlap.col_parallel": Case(example("tp_overlap.ccn"), {"M": 2, "K": 4, "H": 4}, ref_row_parallel,
                                    "col_parallel"),
    "layernorm.attn_out": Case(example("layernorm.ccn"), {"B": 2, "S": 2, "H": 3}, ref_attn_out, "attn_out"),
    "pipeline.stage": Case(example("pipeline.ccn"), {"B": 2, "H": 3}, ref_stage, "stage",
                           configs=((1, 1), (2, 2), (4, 2), (4, 4))),
    "collectives": Case(example("collectives.ccn"), {"N": 4, "M": 4}, ref_collectives, "collectives",
                        configs=((1, 1), (2, 1), (4, 1), (4, 2), (2, 2))),
    "mlp_out": Case(example("mlp_out.ccn"), {"B": 2, "S": 4, "K": 4, "H": 3}, ref_mlp_out, "mlp_out"),
    "conv2d.conv_tp": Case(_conv_literal(example("conv2d.ccn")), {"N": 2, "C": 4, "O": 3}, ref_conv_tp, "conv_tp"),
    "conv2d.conv_layer": Case(_conv_literal(example("conv2d.ccn")), {"N": 4, "C": 2, "O": 3}, ref_conv_layer,
                              "conv_layer"),
    "dp_avg": Case(DP_AVG, {"B": 3, "H": 4, "C": 2}, ref_dp),
    "col_gather": Case(COL_GATHER, {"B": 2, "S": 3, "H": 4, "F": 8}, ref_col_gather),
    "attn": Case(ATTN, {"S": 3, "H": 4, "D": 8}, ref_attn),
    "norms": Case(NORMS, {"B": 3, "H": 4, "F": 8, "N": 5}, ref_norms),
    "rows": Case(ROWS, {"B": 4, "H": 3, "F": 5}, ref_rows),
    "ties": Case(TIES, {"N": 2, "H": 4}, ref_ties),
    "zero_norms": Case(ZERO_NORMS, {"N": 4, "H": 3}, ref_zero_norms),
    "bcast_seq": Case(BROADCASTS.replace("DIM", "1"), {"B": 2, "S": 5, "H": 3}, ref_bcast, wrt=["x", "c", "k", "m", "h", "a"],
                      configs=UNEVEN),
    "bcast_features": Case(BROADCASTS.replace("DIM", "2"), {"B": 2, "S": 3, "H": 5}, ref_bcast,
                           wrt=["x", "c", "k", "m", "h", "a"], configs=UNEVEN),
    "tp_mlp_uneven": Case(_tp_mlp_src(), {"B": 2, "S": 3, "H": 4, "F": 5}, ref_tp_mlp, "tp_mlp", configs=UNEVEN),
    "sp_block_uneven": Case(_tp_mlp_src(), {"B": 2, "S": 6, "H": 4, "F": 5}, ref_sp_block, "sp_block",
                            configs=((3, 1), (6, 1), (6, 3))),
    "mixed_reads": Case(MIXED_READS, {"B": 3, "H": 4, "F": 5}, ref_mixed, configs=SOME),
    "pointwise": Case(POINTWISE, {"N": 3, "H": 5}, ref_pointwise, wrt=["x", "y", "u", "k"], positive=True, configs=SOME),
    "ln_chain": Case(LN_CHAIN, {"B": 3, "S": 2, "H": 4}, ref_ln_chain, wrt=["x", "g", "b", "w", "e"], configs=SOME),
    "pipe_tp": Case(PIPE_TP, {"B": 2, "H": 3, "F": 4}, ref_pipe_tp, configs=((2, 2), (4, 2), (6, 3), (3, 3))),
    "rs_dims": Case(RS_DIMS, {"N": 5, "M": 2, "K": 3}, ref_rs_dims, configs=SOME + ((6, 2),)),
    "roots": Case(ROOTS, {"N": 2, "H": 3}, ref_roots, configs=((2, 1), (3, 1), (4, 1), (4, 2))),
    "convs": Case(CONVS, {"N": 2, "C": 4, "O": 3}, ref_convs, configs=SOME),
    "local_scalars": Case(LOCAL_SCALARS, {"B": 2, "H": 3}, ref_local_scalars, configs=SOME),
    "reused": Case(REUSED, {"B": 2, "H": 5}, ref_reused, configs=SOME),
    "defined": Case(DEFINED, {"B": 2, "S": 3, "H": 4, "F": 6}, ref_defined, configs=SOME),
    "lamb_trust": Case(LAMB_TRUST, {"N": sum(SEGMENTS)}, ref_trust, wrt=["w", "r", "lr"], prepare=_zero_segment),
}


# --- the comparison -----------------------------------------------------------------------------
def _draw(p: Program, sizes: dict, ranks: int, rng: np.random.Generator, positive: bool) -> dict:
    """A logical value a parameter: an int or a float (scalars), a full array (replicated,
    sliced), a list of R arrays (local)."""
    vals: dict = {}
    for q in p.params:
        if q.scalar:
            vals[q.name] = int(rng.integers(0, 1000)) if q.type.dtype.startswith("i") else float(rng.uniform(0.5, 2.0))
        else:
            vals[q.name] = _random(q.type, sizes, ranks, rng, positive)
    return vals


def _leaves(p: Program, vals: dict) -> tuple[dict, list]:
    """The reference's parameters as torch tensors; the floating ones are leaves with grads."""
    tv: dict = {}
    leaves: list = []

    def leaf(a) -> torch.Tensor:
        t = torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=True)
        leaves.append(t)
        return t
    for q in p.params:
        a = vals[q.name]
        if q.type.dtype.startswith("i"):
            tv[q.name] = a if q.scalar else ([torch.tensor(x) for x in a] if isinstance(a, list) else torch.tensor(a))
        else:
            tv[q.name] = [leaf(x) for x in a] if isinstance(a, list) else leaf(a)
    return tv, leaves


def _as_groups(value, G: int) -> list:
    return value if isinstance(value, list) else [value] * G


def _close(got, want, what: str, rtol: float = RTOL) -> None:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, torch {want.shape}"
    scale = max(1.0, float(np.abs(want).max())) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale, err_msg=what)


def _compare_grads(p: Program, g: Program, res: list, vals: dict, tgrad: dict, R: int, G: int, rtol: float,
                   tag: str) -> None:
    gs = R // G
    for pub, s in g.outputs:
        x = pub[2:]
        q = p.param(x)
        per_rank = [np.asarray(r.outputs[pub], dtype=np.float64) for r in res]
        want = tgrad[x]
        what = f"{tag}: {pub}"
        if q.type.layout.kind == "local" and not q.scalar:
            for r in range(R):
                _close(per_rank[r], want[r], f"{what} on rank {r}", rtol)
        elif q.type.layout.sliced:  # rank i of every group holds slice i; the groups share x
            d, n = q.type.layout.dim, want.shape[q.type.layout.dim]
            for i in range(gs):
                got = sum(per_rank[k * gs + i] for k in range(G))
                _close(got, take_slice(want, d, n, gs, i), f"{what}, slice {i}", rtol)
        else:  # replicated (scalars too): the same on every rank of a group, summed over groups
            got = sum(_logical(g.stage_named(s).type, per_rank, pub, G))
            _close(got, want, what, rtol)


def _torch_grads(p: Program, case: Case, vals: dict, cot: dict, ranks: int, groups: int) -> tuple[dict, dict]:
    """The reference's outputs, and torch's gradient of every floating parameter:
    torch.autograd.grad with the cotangents as grad_outputs, each logical output once (a
    replicated or sliced one once a group, a local one once a rank)."""
    tv, leaves = _leaves(p, vals)
    touts = case.ref(tv, ranks, groups)
    outs, grads_out = [], []
    for pub, s in p.outputs:
        t = p.stage_named(s).type
        if t.dtype.startswith("i"):
            continue
        if t.layout.kind == "local":
            pairs = list(zip(touts[pub], cot[pub]))
        else:
            pairs = [(o, cot[pub]) for o in _as_groups(touts[pub], groups)]
        for o, c in pairs:
            if o.requires_grad:
                outs.append(o)
                grads_out.append(torch.tensor(np.asarray(c, dtype=np.float64)).reshape(o.shape))
    tg = torch.autograd.grad(outputs=outs, inputs=leaves, grad_outputs=grads_out, allow_unused=True)
    grad_of = {id(lf): (np.zeros(tuple(lf.shape)) if gr is None else gr.detach().numpy()) for lf, gr in zip(leaves, tg)}
    tgrad = {}
    for k, v in tv.items():
        if isinstance(v, list) and v and id(v[0]) in grad_of:
            tgrad[k] = [grad_of[id(t)] for t in v]
        elif id(v) in grad_of:
            tgrad[k] = grad_of[id(v)]
    return touts, tgrad


def _check_forward(p: Program, vals: dict, touts: dict, ranks: int, groups: int) -> None:
    """The program's outputs under the interpreter are the reference's (checks the reference)."""
    fres = run(p, _inputs(p, vals, ranks, groups), groups)
    for pub, s in p.outputs:
        t = p.stage_named(s).type
        if t.dtype.startswith("i"):
            continue
        per_rank = [np.asarray(r.outputs[pub], dtype=np.float64) for r in fres]
        if t.layout.kind == "local":
            for r in range(ranks):
                _close(per_rank[r], touts[pub][r].detach().numpy(), f"forward {pub} on rank {r}")
        else:
            for k, (got, want) in enumerate(zip(_logical(t, per_rank, pub, groups), _as_groups(touts[pub], groups))):
                _close(got, want.detach().numpy(), f"forward {pub} in group {k}")


def compare(case: Case, ranks: int, groups: int, seed: int = 0) -> Program:
    """Derive, run under the interpreter on `ranks` ranks in `groups` groups, and compare every
    input's gradient with torch.autograd of the reference; the forward outputs too. When the
    derived program's text says what it does, its text read back is run and compared as well."""
    p = load_source(case.src).program(case.name)
    rng = np.random.default_rng(seed)
    vals = _draw(p, case.sizes, ranks, rng, case.positive)
    if case.prepare:
        case.prepare(vals)
    cot = {pub: _random(p.stage_named(s).type, case.sizes, ranks, rng, False) for pub, s in p.outputs}
    touts, tgrad = _torch_grads(p, case, vals, cot, ranks, groups)
    _check_forward(p, vals, touts, ranks, groups)

    # the derived program under the interpreter
    g = vjp(p, case.wrt)
    dnames = {pub: q.name for (pub, _), q in zip(p.outputs, g.params[len(p.params):])}
    allv = {**vals, **{dnames[k]: v for k, v in cot.items()}}
    res = run(g, _inputs(g, allv, ranks, groups), groups)
    _compare_grads(p, g, res, vals, tgrad, ranks, groups, RTOL, "derived IR")
    if not unfaithful_sites(g):
        text = printer.program(g)
        again = check_text(text)[g.name]
        res2 = run(again, _inputs(again, allv, ranks, groups), groups)
        # 1e-7: the text's float constants (gelu's 1/sqrt(2 pi)) are read back as weak f32
        _compare_grads(p, again, res2, vals, tgrad, ranks, groups, 1e-7, "derived text")
    return g


@pytest.mark.parametrize("case, ranks, groups", [(c, r, gr) for c, case in CASES.items() for r, gr in case.configs])
def test_against_torch(case: str, ranks: int, groups: int) -> None:
    compare(CASES[case], ranks, groups)


def test_every_input_is_compared() -> None:
    """Every floating tensor parameter of every case has a gradient compared (the default wrt)."""
    for key, case in CASES.items():
        p = load_source(case.src).program(case.name)
        g = vjp(p, case.wrt)
        assert [pub for pub, _ in g.outputs] == [f"d_{x}" for x in case.wrt or
                                                 [q.name for q in p.params if not q.scalar and q.type.dtype.startswith("f")]], key


def test_tp_mlp_derived_text_is_megatrons() -> None:
    """f's backward is the all-reduce of x's gradient; g's backward passes d_y through: the only
    collective of the backward is d_x's."""
    text = printer.program(vjp(load_source(_tp_mlp_src()).program("tp_mlp")))
    # the forward's own all-reduce is not in the derived program (no cotangent reads s)
    assert text.count("allreduce") == 1 and "d_x = allreduce(sum, g_x_part)" in text
    assert "g_x_part = matmul_nt(" in text
    assert "allgather" not in text and "reducescatter" not in text


def test_sp_block_backward_conjugates() -> None:
    """The sequence-parallel block's backward (Megatron's): reducescatter's is an allgather, and
    allgather's is a reducescatter of the partial input gradients of the column-parallel matmul
    that reads the gathered value (not an allreduce of them and this rank's part: half the
    traffic)."""
    p = load_source(_tp_mlp_src()).program("sp_block")
    g = vjp(p)
    forward = set(recomputed(g, p))
    back = [s for s in g.stages if s.name not in forward]
    colls = [e.op for s in back for e in [s.expr] if hasattr(e, "op") and ops.get(e.op).kind == "collective"]
    assert "allgather" in colls and "reducescatter" in colls and "scatter" not in colls, colls
    assert colls.count("allreduce") == 3, colls  # the replicated parameters' gradients (gamma, beta, b2)


# --- training: SGD steps under the interpreter, against the same steps in PyTorch ---------------
TRAIN = {  # program: (the weights trained, sizes, the reference forward on full tensors)
    "tp_mlp": (["w1", "b1", "w2", "b2"], {"B": 2, "S": 4, "H": 4, "F": 8},
               lambda v: F.gelu(v["x"] @ v["w1"] + v["b1"]) @ v["w2"] + v["b2"]),
    "sp_block": (["gamma", "beta", "w1", "b1", "w2", "b2"], {"B": 2, "S": 4, "H": 4, "F": 8},
                 lambda v: ref_sp_block(v, 0, 1)["y"]),
}


@pytest.mark.parametrize("ranks", [2])
@pytest.mark.parametrize("name", list(TRAIN))
def test_sgd_steps_match_torch(name: str, ranks: int) -> None:
    """Five SGD steps on 2 simulated ranks: each rank updates its own slices of the sliced
    weights (and the replicated ones) with the derived gradients; a NumPy loss
    0.5 * mean((y - t)^2) of the whole y gives d_y. The same steps in one process with
    torch.optim.SGD on the full tensors end with the same weights (tp_mlp: Megatron's MLP;
    sp_block: the sequence-parallel block, its dropout mask the same at every step)."""
    trained, sizes, forward = TRAIN[name]
    steps, lr, seed = 5, 0.5, 7
    p = load_source(_tp_mlp_src()).program(name)
    g = vjp(p, trained)
    rng = np.random.default_rng(3)
    full = {q.name: rng.standard_normal(_shape(q.type, sizes)) * 0.5 for q in p.params if not q.scalar}
    t_out = p.stage_named(dict(p.outputs)["y"]).type
    target = rng.standard_normal(_shape(t_out, sizes))
    layouts = {q.name: q.type.layout for q in p.params} | {"d_y": t_out.layout}

    def cut(name: str, a: np.ndarray, r: int) -> np.ndarray:
        lay = layouts[name]
        return np.ascontiguousarray(take_slice(a, lay.dim, a.shape[lay.dim], ranks, r)) if lay.sliced else a.copy()
    mine = [{k: cut(k, a, r) for k, a in full.items()} | ({"seed": seed} if p.param("seed") else {})
            for r in range(ranks)]  # each rank's arguments
    losses = []
    for _ in range(steps):
        y = _logical(t_out, [np.asarray(r.outputs["y"]) for r in run(p, mine)], "y")[0]
        losses.append(0.5 * float(np.mean((y - target) ** 2)))
        d_y = (y - target) / y.size
        res = run(g, [{**m, "d_y": cut("d_y", d_y, r)} for r, m in enumerate(mine)])
        for r in range(ranks):
            for k in trained:
                mine[r][k] = mine[r][k] - lr * np.asarray(res[r].outputs[f"d_{k}"])

    tw: dict = {k: torch.tensor(a, requires_grad=k in trained) for k, a in full.items()} | {"seed": seed}
    opt = torch.optim.SGD([tw[k] for k in trained], lr=lr)
    tlosses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = 0.5 * ((forward(tw) - torch.tensor(target)) ** 2).mean()
        tlosses.append(float(loss.detach()))
        loss.backward()
        opt.step()
    np.testing.assert_allclose(losses, tlosses, rtol=RTOL)
    assert tlosses[-1] < tlosses[0]
    for k in trained:
        want = tw[k].detach().numpy()
        for r in range(ranks):
            _close(mine[r][k], cut(k, want, r), f"{k} on rank {r} after {steps} steps")
