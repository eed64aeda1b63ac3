"""Differentiable programs in PyTorch (issue 18): coconetc.torch.function and Module, the
compiled forward and its compiled derived backward, against the same computation written for
one process in plain PyTorch (torch.autograd), on 2 and 3 ranks and in groups; and the argument
errors in this process.

Multi-rank checks run tests/torch_function_worker.py under mpiexec (coconetc/launch); the
modules are built once into the pytest cache (shared with the other end-to-end tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
from rank_checks import check, launch

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
TP_MLP, PIPELINE = REPO / "examples" / "tp_mlp.ccn", REPO / "examples" / "pipeline.ccn"
WORKER = Path(__file__).with_name("torch_function_worker.py")


@pytest.fixture(scope="module")
def built(request):
    """The modules (with their derived programs) built once here, in the pytest cache, so that
    the ranks only import them."""
    from coconetc.runtime.loader import compile_cpu
    from coconetc.sourcefile import load_file, with_grads
    for f, progs in ((TP_MLP, ["tp_mlp"]), (TP_MLP, ["sp_block"]), (TP_MLP, ["tp_block"]), (PIPELINE, ["stage"])):
        compile_cpu(with_grads(load_file(f), progs), log=lambda msg: None)
    yield


def _launch(capfd, ranks: int, *args: str) -> tuple[int, list[str], str]:
    return launch(capfd, WORKER, ranks, *args)


def _check(lines: list[str], log: str, prefixes: list[str]) -> None:
    check(lines, log, prefixes, prefix=True)


@pytest.mark.parametrize("ranks", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_tp_mlp_every_schedule_against_autograd(built, capfd, ranks):
    rc, lines, log = _launch(capfd, ranks, "tp")
    _check(lines, log, [f"tp:default:default:R{ranks}:saved", f"tp:overlapped:default:R{ranks}",
                        f"tp:module_sgd:R{ranks}", "tp:saved_values"])
    assert rc == 0, log


@pytest.mark.slow  # its CPU twin, test_tp_mlp_every_schedule_against_autograd, is quick
def test_tp_mlp_on_the_cuda_backend_under_the_emulation(built, capfd, monkeypatch):
    """backend="cuda" with COCONET_CUDA_EMULATE=1: the generated CUDA forward and backward
    (cuBLAS, NCCL and the kernels under the host emulation) take CPU tensors for CUDA ones."""
    from coconetc.runtime.cuda import load_emulated
    monkeypatch.setenv("COCONET_CUDA_EMULATE", "1")
    load_emulated(TP_MLP, log=lambda msg: None, grad=("tp_mlp",))  # built here, once
    rc, lines, log = _launch(capfd, 2, "tp_cuda")
    _check(lines, log, ["tp_cuda:default:default:R2:saved", "tp_cuda:overlapped:default:R2"])
    assert rc == 0, log


def test_cuda_backend_without_the_switch_names_the_cpu_tensor(built, monkeypatch):
    import coconetc.torch as ct
    monkeypatch.delenv("COCONET_CUDA_EMULATE", raising=False)
    f = ct.function(TP_MLP, "tp_mlp", backend="cuda")
    x = torch.zeros(1, 2, 4)
    with pytest.raises(ValueError, match="'x' is on cpu; the CUDA backend takes CUDA tensors .*COCONET_CUDA_EMULATE=1"):
        f(x=x, w1=torch.zeros(4, 6), b1=torch.zeros(6), w2=torch.zeros(6, 4), b2=torch.zeros(4))


def test_residual_block_fused_backward_against_autograd(built, capfd):
    rc, lines, log = _launch(capfd, 2, "block")
    _check(lines, log, [f"block:{s}:{g}:R2" for s in ("default", "overlapped") for g in ("default", "fused")])
    assert rc == 0, log


def test_sequence_parallel_block_against_autograd(built, capfd):
    rc, lines, log = _launch(capfd, 2, "sp")
    _check(lines, log, ["sp:default:R2"])
    assert rc == 0, log


@pytest.mark.slow
def test_pipeline_stage_trained_across_two_groups(built, capfd):
    rc, lines, log = _launch(capfd, 4, "pipe")
    _check(lines, log, ["pipe:gradients:R4", "pipe:sgd:R4"])
    assert rc == 0, log


# --- in this process (one rank) ----------------------------------------------------------------
def test_argument_errors_name_the_parameter(built):
    import coconetc.torch as ct
    f = ct.function(TP_MLP, "tp_mlp")
    x = torch.zeros(1, 2, 4)
    w1, b1, w2, b2 = torch.zeros(4, 6), torch.zeros(6), torch.zeros(6, 4), torch.zeros(4)
    with pytest.raises(TypeError, match="missing argument 'b2'"):
        f(x=x, w1=w1, b1=b1, w2=w2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'w3'"):
        f(x=x, w1=w1, b1=b1, w2=w2, b2=b2, w3=b2)
    with pytest.raises(TypeError, match="'w2' must be a torch tensor"):
        f(x=x, w1=w1, b1=b1, w2=w2.numpy(), b2=b2)
    with pytest.raises(Exception, match="b1"):  # the runtime's check, before any buffer changes
        f(x=x, w1=w1, b1=torch.zeros(5), w2=w2, b2=b2)
    with pytest.raises(ValueError, match="say which with program="):
        ct.function(TP_MLP)
    with pytest.raises(KeyError, match="no schedule 'nope'"):
        ct.function(TP_MLP, "tp_mlp", schedule="nope")


def test_one_rank_gradients_match_autograd(built):
    import coconetc.torch as ct
    gen = torch.Generator().manual_seed(3)
    t = {"x": torch.randn(2, 3, 4, generator=gen), "w1": torch.randn(4, 6, generator=gen),
         "b1": torch.randn(6, generator=gen), "w2": torch.randn(6, 4, generator=gen), "b2": torch.randn(4, generator=gen)}
    a = {k: v.clone().requires_grad_(True) for k, v in t.items()}
    b = {k: v.clone().requires_grad_(True) for k, v in t.items()}
    dy = torch.randn(2, 3, 4, generator=gen)
    # under torch.profiler: the compiled forward and backward each a `coconet <program>[<schedule>]` range
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ct.function(TP_MLP, "tp_mlp")(**a).backward(dy)
    assert sorted(e.name for e in prof.events() if e.name.startswith("coconet ")) == [
        "coconet tp_mlp_bwd[default]", "coconet tp_mlp_fwd[default]"]
    (torch.nn.functional.gelu(b["x"] @ b["w1"] + b["b1"]) @ b["w2"] + b["b2"]).backward(dy)
    for k in t:
        torch.testing.assert_close(a[k].grad, b[k].grad, rtol=1e-5, atol=1e-5)


def test_positional_arguments_bind_in_the_programs_order(built):
    """As a PyTorch user calls a layer: `layer(x)` for a Module whose only other input is x, and
    f(x, w1, ...) for a function, bound in the program's parameter order (a Module's: the
    parameters it does not hold). They raised 'Differentiable.__call__() takes 1 positional
    argument but 6 were given' / 'Module.forward() takes 1 positional argument ...'."""
    import coconetc.torch as ct
    gen = torch.Generator().manual_seed(4)
    t = {"x": torch.randn(2, 3, 4, generator=gen), "w1": torch.randn(4, 6, generator=gen),
         "b1": torch.randn(6, generator=gen), "w2": torch.randn(6, 4, generator=gen), "b2": torch.randn(4, generator=gen)}
    f = ct.function(TP_MLP, "tp_mlp")
    torch.testing.assert_close(f(*t.values()), f(**t))
    torch.testing.assert_close(f(t["x"], t["w1"], b1=t["b1"], w2=t["w2"], b2=t["b2"]), f(**t))
    layer = ct.Module(TP_MLP, "tp_mlp", parameters={k: v for k, v in t.items() if k != "x"})
    torch.testing.assert_close(layer(t["x"]), f(**t))
    with pytest.raises(TypeError, match=r"tp_mlp\(\): takes 5 arguments \(x, w1, b1, w2, b2\), got 6 positional"):
        f(*t.values(), t["x"])
    with pytest.raises(TypeError, match=r"tp_mlp\(\): got multiple values for argument 'x'"):
        f(t["x"], x=t["x"], w1=t["w1"], b1=t["b1"], w2=t["w2"], b2=t["b2"])
    with pytest.raises(TypeError, match=r"tp_mlp: takes 1 argument \(x\), got 2 positional"):
        layer(t["x"], t["w1"])


@pytest.mark.slow
@pytest.mark.parametrize("script, ranks, args", [
    ("train_tp.py", 2, ["--steps", "12", "--schedule", "overlapped"]),
    ("train_pipeline.py", 4, ["--steps", "6"]),
])
def test_training_examples_match_one_process(built, script, ranks, args):
    """The examples train and check themselves against the same model in one process (they
    exit non-zero when the loss curves part)."""
    import subprocess
    import sys
    exe = Path(sys.executable).parent / "coconetc"
    res = subprocess.run([str(exe), "launch", "-n", str(ranks), str(REPO / "examples" / script), *args],
                         capture_output=True, text=True, timeout=500)
    assert res.returncode == 0, res.stdout + res.stderr
    diff = [ln for ln in res.stdout.splitlines() if ln.startswith("largest relative loss difference")]
    assert diff and float(diff[0].split()[4].rstrip(";")) < 1e-4, res.stdout
    rows = [ln.split() for ln in res.stdout.splitlines()]
    losses = [float(r[1]) for r in rows if len(r) == 3 and r[0].isdigit()]  # step, ours, one process
    assert losses[-1] < losses[0], res.stdout  # it learns
