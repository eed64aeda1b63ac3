"""layernorm's backward as two derived-program operations (coconetc/autodiff/ops.py):
layernorm_dx and layernorm_dgamma's NumPy references against torch.autograd of
torch.nn.functional.layer_norm (f64), and what the derivation emits for each kind of eps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from coconetc.autodiff import ops as gradops
from coconetc.autodiff import vjp
from coconetc.ir import printer
from coconetc.sourcefile import load_source


def _torch_grads(x: np.ndarray, gamma: np.ndarray, g: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    xt = torch.tensor(x, requires_grad=True)
    gt = torch.tensor(gamma, requires_grad=True)
    y = torch.nn.functional.layer_norm(xt, (x.shape[-1],), gt, torch.zeros_like(gt), eps)
    y.backward(torch.tensor(g))
    assert xt.grad is not None and gt.grad is not None
    return xt.grad.numpy(), gt.grad.numpy()


@pytest.mark.parametrize("shape", [(2, 3, 5), (7, 16), (4,), (3, 0, 6)])
@pytest.mark.parametrize("eps", [1e-5, 0.5])
def test_references_match_torch(shape: tuple[int, ...], eps: float) -> None:
    rng = np.random.default_rng(sum(shape))
    x = rng.normal(1.0, 2.0, size=shape)
    gamma = rng.normal(size=shape[-1:])
    g = rng.normal(size=shape)
    dx, dgamma = _torch_grads(x, gamma, g, eps)
    np.testing.assert_allclose(gradops._np_ln_dx(x, gamma, g, np.float64(eps)), dx, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(gradops._np_ln_dgamma(x, g, np.float64(eps)), dgamma, rtol=1e-10, atol=1e-12)


def test_references_of_sliced_rows_add_up() -> None:
    """Rows sliced over ranks: dx row by row is each slice's, dgamma the sum of the slices' partial sums."""
    rng = np.random.default_rng(3)
    x, g, gamma = rng.normal(size=(5, 3, 8)), rng.normal(size=(5, 3, 8)), rng.normal(size=8)
    dx, dgamma = _torch_grads(x, gamma, g, 1e-5)
    parts = [(x[:3], g[:3]), (x[3:], g[3:])]
    got_dx = np.concatenate([gradops._np_ln_dx(a, gamma, b, 1e-5) for a, b in parts])
    got_dgamma = sum(gradops._np_ln_dgamma(a, b, 1e-5) for a, b in parts)
    np.testing.assert_allclose(got_dx, dx, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got_dgamma, dgamma, rtol=1e-10, atol=1e-12)


SRC = """program p(x: f32[B, H] {layout}, gamma: f32[H] replicated, beta: f32[H] replicated, e: f32) {{
    y = layernorm(x, gamma, beta, {eps})
    return y
}}"""


@pytest.mark.parametrize("eps, wrt, fused", [("1e-05", ["x", "gamma", "beta"], True),
                                             ("e", ["x", "gamma", "beta"], True),
                                             ("e", ["x", "gamma", "beta", "e"], False),
                                             ("e * 2.0", ["x", "gamma", "beta"], False)])
def test_derivation_uses_the_operations(eps: str, wrt: list[str], fused: bool) -> None:
    """A literal or scalar-parameter eps not differentiated: layernorm_dx, layernorm_dgamma and
    sum_lead(g); a differentiated or computed eps: the pieces (mean_last ...)."""
    mod = load_source(SRC.format(layout="sliced(0)", eps=eps), "t.ccn")
    text = printer.program(vjp(mod.programs["p"], wrt))
    assert ("layernorm_dx(x, gamma, d_y" in text) is fused
    assert ("layernorm_dgamma(x, d_y" in text) is fused
    assert ("mean_last" in text) is not fused


def test_dgamma_of_sliced_rows_is_all_reduced() -> None:
    mod = load_source(SRC.format(layout="sliced(0)", eps="1e-05"), "t.ccn")
    text = printer.program(vjp(mod.programs["p"], ["gamma"]))
    assert "g_gamma_part = layernorm_dgamma(x, d_y, 1e-05)" in text
    assert "d_gamma = allreduce(sum, g_gamma_part)" in text
