"""coconet layers under torch.compile and torch.export (docs/pytorch.md, "torch.compile and
torch.export"): a call of coconetc.torch.function / Module is a torch.library custom operator
(coconetc/torch/ops.py) with a fake implementation from the program's types and an autograd
formula that runs the derived program (its own operator). One rank, in this process; the
modules are the ones tests/test_torch_function.py and tests/test_torch_optimizer.py build
(tp_mlp.ccn with its derived programs, adam.ccn), in the same pytest cache.

References: the same computation written in plain PyTorch (torch.autograd; torch.optim.Adam),
and the model run eagerly."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

REPO = Path(__file__).resolve().parents[1]
TP_MLP, ADAM = REPO / "examples" / "tp_mlp.ccn", REPO / "examples" / "adam.ccn"
DROPOUT = REPO / "examples" / "residual_dropout.ccn"
TOL = dict(rtol=1e-5, atol=1e-5)
ADAM_HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)


@pytest.fixture(scope="module")
def built(request):
    """tp_mlp (with its derived programs) and adam.ccn, built once in the pytest cache (as the
    other end-to-end tests build them: no module of its own)."""
    from coconetc.runtime.loader import compile_cpu
    from coconetc.sourcefile import load_file, with_grads
    compile_cpu(with_grads(load_file(TP_MLP), ["tp_mlp"]), log=lambda msg: None)
    compile_cpu(load_file(ADAM), log=lambda msg: None)
    yield


def _weights(seed: int, h: int = 4, f: int = 6) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w1": torch.randn(h, f, generator=gen), "b1": torch.randn(f, generator=gen),
            "w2": torch.randn(f, h, generator=gen), "b2": torch.randn(h, generator=gen)}


def _x(seed: int, b: int = 2, s: int = 3, h: int = 4) -> torch.Tensor:
    return torch.randn(b, s, h, generator=torch.Generator().manual_seed(seed))


class Net(torch.nn.Module):
    """A coconet tensor-parallel MLP between two torch layers."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        super().__init__()
        import coconetc.torch as ct
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(4, 4)
        self.mlp = ct.Module(TP_MLP, "tp_mlp", parameters=weights)
        self.out = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.mlp(self.inp(x))))


def _reference(net: Net, x: torch.Tensor) -> torch.Tensor:
    """Net's forward in plain PyTorch, on its own parameters (independent of coconet)."""
    m = net.mlp
    h = net.inp(x)
    y = F.gelu(h @ m.w1 + m.b1) @ m.w2 + m.b2
    return net.out(torch.tanh(y))


def _grads(net: torch.nn.Module, fn, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    net.zero_grad()
    x = x.clone().requires_grad_(True)
    y = fn(x)
    (y.square().sum() + y[..., 0].sum()).backward()
    return y.detach(), [p.grad.clone() for p in net.parameters()] + [x.grad]


# --- the operators ---------------------------------------------------------------------------
def test_operators_are_named_per_call_and_shared(built):
    import coconetc.torch as ct
    f = ct.function(TP_MLP, "tp_mlp")
    fwd, bwd = f.operators()
    name = str(fwd._qualname)
    assert name.startswith("coconet::tp_mlp_default_default_cpu_"), name
    assert str(bwd._qualname) == name + "_backward"
    schema = str(fwd._opoverload._schema)
    assert schema.endswith("(Tensor x, Tensor w1, Tensor b1, Tensor w2, Tensor b2) -> (Tensor, Tensor, Tensor)"), schema
    assert str(bwd._opoverload._schema).endswith(
        "(Tensor x, Tensor w1, Tensor b1, Tensor w2, Tensor b2, Tensor a, Tensor h, Tensor d_y) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)")
    # the same call again shares the operators; another schedule or backend has its own
    assert ct.function(TP_MLP, "tp_mlp").operators() == (fwd, bwd)
    other = ct.function(TP_MLP, "tp_mlp", grad_schedule="overlapped").operators()[0]
    assert str(other._qualname).startswith("coconet::tp_mlp_default_overlapped_cpu_")
    assert str(f.operators("cuda")[0]._qualname).startswith("coconet::tp_mlp_default_default_cuda_")
    assert len({str(o._qualname) for o in (fwd, other, f.operators("cuda")[0])}) == 3
    # the op is reachable as torch.ops.coconet.<name>
    assert getattr(torch.ops.coconet, name.split("::")[1]).default._schema == fwd._opoverload._schema
    # a grad schedule that names forward stages: the whole derived program each step, said once
    block = REPO / "examples" / "gpt_block.ccn"
    with pytest.warns(UserWarning, match=r"grad_schedule 'overlapped' names values gpt_block_sp_bwd does not "
                                         r"have \(the schedules that apply to gpt_block_sp_bwd: 'backward'\)"):
        ct.function(block, "gpt_block_sp", schedule="overlapped", grad_schedule="overlapped")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ct.function(block, "gpt_block_sp", schedule="overlapped", grad_schedule="backward")


def test_scalars_are_typed_arguments():
    """A program's scalars are the operator's int or float arguments, by name (no module is
    built to make the operators)."""
    import coconetc.torch as ct
    f = ct.function(DROPOUT, "f1", backend="cpu")
    fwd, bwd = f.operators()
    assert str(fwd._opoverload._schema).endswith("(Tensor y, Tensor b, Tensor r, int seed) -> Tensor")
    assert str(bwd._opoverload._schema).endswith(
        "(Tensor y, Tensor b, Tensor r, int seed, Tensor d_h) -> (Tensor, Tensor, Tensor)")


def test_opcheck_and_fake_shapes(built):
    """torch.library.opcheck (schema, autograd registration, fake tensors against the real
    kernel, AOT dispatch) on the forward operator; the backward's fake results against its real
    ones under FakeTensorMode."""
    import coconetc.torch as ct
    from torch._subclasses.fake_tensor import FakeTensorMode
    w = _weights(1, f=5)
    f = ct.function(TP_MLP, "tp_mlp")
    fwd, bwd = f.operators()
    args = (_x(2, b=3, s=2), w["w1"], w["b1"], w["w2"], w["b2"])
    result = torch.library.opcheck(fwd, args)
    assert set(result.values()) == {"SUCCESS"}, result
    real = fwd(*args)
    assert [tuple(t.shape) for t in real] == [(3, 2, 4), (3, 2, 5), (3, 2, 5)]  # y, then the saved a, h
    dy = _x(3, b=3, s=2)
    grads = bwd(*args, *real[1:], dy)
    with FakeTensorMode() as mode:
        fake = fwd(*(mode.from_tensor(a) for a in args))
        fake_grads = bwd(*(mode.from_tensor(a) for a in (*args, *real[1:], dy)))
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]
    assert [(t.shape, t.dtype) for t in fake_grads] == [(t.shape, t.dtype) for t in grads]
    assert [t.shape for t in grads] == [a.shape for a in args]
    # and the backward operator's values are torch.autograd's of the same computation
    leaves = [a.clone().requires_grad_(True) for a in args]
    x, w1, b1, w2, b2 = leaves
    torch.autograd.backward(F.gelu(x @ w1 + b1) @ w2 + b2, dy)
    for g, leaf in zip(grads, leaves):
        torch.testing.assert_close(g, leaf.grad, **TOL)


# --- torch.compile ---------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["eager", "aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_model_matches_eager_and_autograd(built, backend):
    """fullgraph=True: the coconet call is in the graph (no break); outputs and gradients (every
    parameter and the input) as eager and as plain PyTorch's; a new batch size recompiles
    (or goes dynamic) through the fake implementation."""
    torch._dynamo.reset()
    net = Net(_weights(5))
    compiled = torch.compile(net, backend=backend, fullgraph=True)
    for x in (_x(6), _x(7, b=5)):
        y_c, g_c = _grads(net, compiled, x)
        y_e, g_e = _grads(net, net, x)
        y_r, g_r = _grads(net, lambda t: _reference(net, t), x)
        torch.testing.assert_close(y_c, y_e, **TOL)
        torch.testing.assert_close(y_c, y_r, **TOL)
        for a, b, c in zip(g_c, g_e, g_r):
            torch.testing.assert_close(a, b, **TOL)
            torch.testing.assert_close(a, c, **TOL)


@pytest.mark.slow  # (in make test-quick: the CPU module compiled, and this module emulated, test_torch_function.py)
def test_cuda_backend_under_the_emulation(built, monkeypatch):
    """backend="cuda" under COCONET_CUDA_EMULATE=1 (the CUDA module on the host, CPU tensors;
    the module tests/test_torch_function.py builds): its own operators ("emu"), compiled with
    fullgraph=True, give the eager values and plain PyTorch's gradients."""
    import coconetc.torch as ct
    from coconetc.runtime.cuda import load_emulated
    monkeypatch.setenv("COCONET_CUDA_EMULATE", "1")
    load_emulated(TP_MLP, log=lambda msg: None, grad=("tp_mlp",))
    torch._dynamo.reset()
    f = ct.function(TP_MLP, "tp_mlp", backend="cuda")
    assert f.operators("cuda")[0]._qualname.startswith("coconet::tp_mlp_default_default_emu_")
    w = _weights(14)
    compiled = torch.compile(lambda x, w1, b1, w2, b2: f(x, w1, b1, w2, b2), backend="aot_eager", fullgraph=True)
    results = []
    for fn in (compiled, f, lambda x, w1, b1, w2, b2: F.gelu(x @ w1 + b1) @ w2 + b2):
        leaves = [t.clone().requires_grad_(True) for t in (_x(15), *w.values())]
        y = fn(*leaves)
        y.square().sum().backward()
        results.append([y.detach()] + [t.grad for t in leaves])
    for got, eager, ref in zip(*results):
        torch.testing.assert_close(got, eager, **TOL)
        torch.testing.assert_close(got, ref, **TOL)


def test_export(built):
    """torch.export.export: the forward graph holds the coconet operator (not its insides), and
    the exported program computes what the model does, on another input too."""
    net = Net(_weights(8))
    x = _x(9)
    ep = torch.export.export(net, (x,))
    fwd_name = net.mlp.fn.operators()[0]._qualname.split("::")[1]
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert f"coconet.{fwd_name}.default" in targets, targets
    with torch.no_grad():
        for t in (x, _x(10)):
            torch.testing.assert_close(ep.module()(t), net(t), **TOL)
            torch.testing.assert_close(ep.module()(t), _reference(net, t), **TOL)


def test_a_copied_model_calls_the_same_operators(built):
    """copy.deepcopy of a model with a coconet layer (an EMA or a frozen copy) works, its
    layer keeps the operators' names, and the copy compiles and computes with its own weights."""
    import copy
    torch._dynamo.reset()
    net = Net(_weights(12))
    twin = copy.deepcopy(net)
    assert twin.mlp.fn.operators() == net.mlp.fn.operators()
    with torch.no_grad():
        twin.mlp.b2.add_(1.0)
    x = _x(13)
    with torch.no_grad():
        got = torch.compile(twin, backend="aot_eager", fullgraph=True)(x)
        torch.testing.assert_close(got, _reference(twin, x), **TOL)
        assert not torch.allclose(got, net(x))


# --- DistributedOptimizer --------------------------------------------------------------------
def _train(net: torch.nn.Module, step_model, opt, steps: int = 3) -> list[float]:
    losses = []
    for k in range(steps):
        opt.zero_grad()
        loss = step_model(_x(20 + k)).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_distributed_optimizer_steps_a_compiled_model(built):
    """The model compiled (fullgraph), the optimizer stepping its parameters outside it: the
    same parameters as the eager model with the same optimizer, and as plain PyTorch with
    torch.optim.Adam (adam.ccn sums the ranks' gradients: one rank here)."""
    from coconetc.torch import DistributedOptimizer
    torch._dynamo.reset()
    w = _weights(11)
    runs = []
    for compile_it in (True, False):
        net = Net(w)
        opt = DistributedOptimizer(net.parameters(), ADAM, **ADAM_HYPER)
        model = torch.compile(net, backend="aot_eager", fullgraph=True) if compile_it else net
        runs.append((_train(net, model, opt), [p.detach().clone() for p in net.parameters()]))
    ref = Net(w)
    adam = torch.optim.Adam(ref.parameters(), lr=ADAM_HYPER["lr"], betas=(0.9, 0.999), eps=1e-8)
    runs.append((_train(ref, lambda t: _reference(ref, t), adam), [p.detach().clone() for p in ref.parameters()]))
    (loss_c, p_c), (loss_e, p_e), (loss_r, p_r) = runs
    assert loss_c[-1] < loss_c[0]
    torch.testing.assert_close(torch.tensor(loss_c), torch.tensor(loss_e), **TOL)
    torch.testing.assert_close(torch.tensor(loss_c), torch.tensor(loss_r), **TOL)
    for a, b, c in zip(p_c, p_e, p_r):
        torch.testing.assert_close(a, b, **TOL)
        torch.testing.assert_close(a, c, **TOL)


def test_step_inside_a_compiled_function(built):
    """step() is not traced (torch.compiler.disable): with fullgraph=True, an error that says
    why and what to do; without it, a graph break there, and the step runs as in eager."""
    from coconetc.torch import DistributedOptimizer
    torch._dynamo.reset()
    p = torch.nn.Parameter(torch.linspace(-1, 1, 10))
    opt = DistributedOptimizer([p], ADAM, **ADAM_HYPER)
    p.grad = torch.linspace(0.5, 2, 10)

    def step():
        opt.step()

    before = p.detach().clone()
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"(?s)DistributedOptimizer.step\(\) runs a compiled "
                       r"coconet program.*call opt.step\(\) outside the compiled function"):
        torch.compile(step, backend="eager", fullgraph=True)()
    torch.testing.assert_close(p.detach(), before)  # nothing stepped
    torch.compile(step, backend="eager")()
    # Adam's first step moves every weight by lr against its gradient's sign
    torch.testing.assert_close(p.detach(), before - ADAM_HYPER["lr"], **TOL)
