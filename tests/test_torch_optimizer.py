"""PyTorch integration (issue 12): coconetc.torch.DistributedOptimizer against torch.optim.Adam
and a PyTorch LAMB on 2 and 3 MPI ranks, with a StepLR scheduler, under every schedule;
checkpoints saved under `zero` on 2 ranks and loaded under every schedule on 2 and 3 ranks;
the state held per rank; and the layout helpers of compiled functions (in this process).

Multi-rank checks run tests/torch_optimizer_worker.py under mpiexec (coconetc/launch); the
modules are built once into the pytest cache (shared with the other end-to-end tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from rank_checks import check, launch

from coconetc.ir.slices import slice_range

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
ADAM, LAMB = REPO / "examples" / "adam.ccn", REPO / "examples" / "lamb.ccn"
SCALED = REPO / "examples" / "scaled_adam.ccn"
ADAMW = REPO / "examples" / "adamw.ccn"
WORKER = Path(__file__).with_name("torch_optimizer_worker.py")
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)


@pytest.fixture(scope="module")
def built(request):
    """adam.ccn, lamb.ccn, adamw.ccn and scaled_adam.ccn built once here (in the session's build
    cache, conftest.py), so that the ranks only import them."""
    from coconetc.runtime.loader import compile_cpu
    from coconetc.sourcefile import load_file
    for f in (ADAM, LAMB, ADAMW, SCALED):
        compile_cpu(load_file(f), log=lambda msg: None)
    import coconetc
    yield coconetc.load(ADAM, log=lambda msg: None)


def _launch(capfd, ranks: int, *args: str) -> tuple[int, list[str], str]:
    return launch(capfd, WORKER, ranks, *args)


def _check(lines: list[str], log: str, labels: list[str]) -> None:
    check(lines, log, labels)


# --- on two and three ranks --------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 3])
def test_adam_matches_torch_adam_every_schedule(built, capfd, ranks):
    rc, lines, log = _launch(capfd, ranks, "adam")
    labels = [f"adam:{s}:R{ranks}:{what}" for s in ("default", "rs_c_ag", "zero", "fused")
              for what in ("params", "state", "lr_scheduled", "state_elements")]
    _check(lines, log, labels + [f"adam:zero:R{ranks}:two_groups", f"adam:closure:R{ranks}"]
           + [f"adam:{s}:R{ranks}:{what}{t}" for s in ("zero", "fused")
              for what in ("shared_memory", "shared_memory_buffers", "one_copy") for t in ("", "_own_weights")]
           + [f"adam:rs_c_ag:R{ranks}:own_weights"])
    # memory per rank under zero: this rank's slice of m and v, 1/R of the state
    n = 186
    line = next(ln for ln in lines if ln.startswith(f"STATE zero R{ranks} "))
    held = [int(x) for x in line.split("[")[1].split("]")[0].split(",")]
    assert held == [2 * (hi - lo) for lo, hi in (slice_range(n, ranks, r) for r in range(ranks))]
    assert sum(held) == 2 * n and max(held) <= 2 * -(-n // ranks), line
    assert rc == 0, log


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 3])
def test_lamb_matches_pytorch_lamb_every_schedule(built, capfd, ranks):
    rc, lines, log = _launch(capfd, ranks, "lamb")
    _check(lines, log, [f"lamb:{s}:R{ranks}:{what}" for s in ("default", "rs_c_ag", "zero")
                        for what in ("params", "state")])
    assert rc == 0, log


@pytest.mark.parametrize("ranks", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_clipping_by_the_norm_of_every_group(built, capfd, ranks):
    """adamw.ccn with three parameter groups, every schedule: across_groups=True clips by the
    norm of all of them (clip_grad_norm_(model.parameters())), False by each group's own; and
    with a frozen matrix (requires_grad=False), which the step leaves as it is, as torch does."""
    rc, lines, log = _launch(capfd, ranks, "clip")
    _check(lines, log, [f"clip:{s}:R{ranks}:{what}" for s in ("default", "rs_c_ag", "sliced", "zero", "zero+shm")
                        for what in ("across_groups", "across_groups:clipped", "per_group",
                                     "per_group:clipped", "norms_differ", "frozen")])
    assert rc == 0, log


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 3])
def test_a_users_clipped_adamw_matches_torch(built, capfd, ranks):
    """tests/programs/heldout_clip_adamw.ccn (averaged gradients, the norm and the decay as
    stages of their own, a zero schedule listing its fusion out of order) under each schedule,
    two groups clipped together, against clip_grad_norm_ + torch.optim.AdamW."""
    from coconetc.runtime.loader import compile_cpu
    from coconetc.sourcefile import load_file
    path = REPO / "tests" / "programs" / "heldout_clip_adamw.ccn"
    compile_cpu(load_file(path), log=lambda msg: None)
    scheds = ("default", "rs_c_ag", "zero")
    rc, lines, log = _launch(capfd, ranks, "clip_file", str(path), *scheds)
    _check(lines, log, [f"clip_file:{s}:R{ranks}{what}" for s in scheds for what in ("", ":clipped")])
    assert rc == 0, log


@pytest.mark.parametrize("ranks", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_loss_scaled_step_skips_like_grad_scaler(built, capfd, ranks):
    """scaled_adam.ccn (f16 parameters, f32 master weights, dynamic loss scale) with two groups,
    across_groups=True, skipped="bad", feedback={"scale": "newscale"}, every schedule: an inf
    and a NaN in one rank's gradient skip every group's step (the step count too) and halve the
    scale, against GradScaler's logic over torch.optim.Adam."""
    rc, lines, log = _launch(capfd, ranks, "scaled")
    _check(lines, log, [f"scaled:{s}:R{ranks}:{what}" for s in ("default", "rs_c_ag", "zero")
                        for what in ("master", "params", "state", "skipped", "bad_and_scale", "steps")])
    assert rc == 0, log


def test_scaled_output_errors(built):
    """skipped= naming a tensor output, feedback= naming an unknown output."""
    from coconetc.torch import DistributedOptimizer
    params = [torch.nn.Parameter(torch.zeros(4).half())]
    kw = dict(weights="w16", master="w", lr=1.0, beta1=0.9, beta2=0.9, eps=1e-8, scale=1.0)
    with pytest.raises(ValueError, match="skipped='nope' must name a 0-d output of the program \\(its outputs: newscale, bad\\)"):
        DistributedOptimizer(params, str(SCALED), skipped="nope", **kw)
    with pytest.raises(ValueError, match=r"feedback\['scale'\]='bad2' must name a 0-d output"):
        DistributedOptimizer(params, str(SCALED), feedback={"scale": "bad2"}, **kw)


def test_shared_memory_by_default_where_safe(built):
    """shared_memory=None: flat weights on one node go into shared windows (the in-place fused
    path); False keeps ordinary tensors; scattered weights (lamb.ccn) stay the model's own."""
    from coconetc.runtime import shm
    from coconetc.torch import DistributedOptimizer

    def in_window(t):
        spans = [(shm.WINDOWS[k + 1], shm.WINDOWS[k + 2]) for k in range(0, len(shm.WINDOWS), 4)]
        return any(a <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= a + n for a, n in spans)
    opt = DistributedOptimizer(_model().parameters(), str(ADAM), schedule="zero", **HYPER)
    assert in_window(opt._groups[0].flat) and in_window(opt._groups[0].gflat) and opt.shared_memory
    opt = DistributedOptimizer(_model().parameters(), str(ADAM), schedule="zero", shared_memory=False, **HYPER)
    assert not in_window(opt._groups[0].flat) and not in_window(opt._groups[0].gflat) and not opt.shared_memory
    opt = DistributedOptimizer(_model().parameters(), str(LAMB), **HYPER, wd=0.01)
    assert opt._groups[0].flat is None and not in_window(opt._groups[0].gflat)
    with pytest.raises(TypeError, match="shared_memory must be None, True or False"):
        DistributedOptimizer(_model().parameters(), str(ADAM), shared_memory="yes", **HYPER)


def test_one_copy_of_the_weights_where_each_rank_writes_its_own_part(built):
    """shared_weights=None: one copy of the weights for the node's ranks where the schedule
    has each rank write only its own part of them (zero, fused: the all-gather into them then
    copies nothing; on 2 and 3 ranks in the worker's shared_memory checks); not where every
    rank writes all of them (default, rs_c_ag), nor without shared memory. True where it cannot
    be says why, and leaving it out is accepted."""
    from coconetc.torch import DistributedOptimizer
    for schedule, want in (("zero", True), ("fused", True), ("default", False), ("rs_c_ag", False)):
        opt = DistributedOptimizer(_model().parameters(), str(ADAM), schedule=schedule, **HYPER)
        assert opt.shared_weights is want, schedule
    assert not DistributedOptimizer(_model().parameters(), str(ADAM), schedule="zero", shared_weights=False,
                                    **HYPER).shared_weights
    assert not DistributedOptimizer(_model().parameters(), str(ADAM), schedule="zero", shared_memory=False,
                                    **HYPER).shared_weights
    assert DistributedOptimizer(_model().parameters(), str(ADAM), schedule="zero", shared_weights=True,
                                **HYPER).shared_weights
    with pytest.raises(ValueError, match="shared_weights=True: schedule 'default' does not write each rank's "
                                         "part of 'w' alone.*leave shared_weights out"):
        DistributedOptimizer(_model().parameters(), str(ADAM), schedule="default", shared_weights=True, **HYPER)
    with pytest.raises(ValueError, match="shared_weights=True: the weights are not in shared memory"):
        DistributedOptimizer(_model().parameters(), str(ADAM), schedule="zero", shared_memory=False,
                             shared_weights=True, **HYPER)
    with pytest.raises(TypeError, match="shared_weights must be None, True or False"):
        DistributedOptimizer(_model().parameters(), str(ADAM), shared_weights=1, **HYPER)
    assert not DistributedOptimizer(_model().parameters(), str(LAMB), **HYPER, wd=0.01).shared_weights


@pytest.mark.slow
def test_parameter_sizes_that_differ_by_rank_are_refused_on_every_rank(built, capfd):
    """Sizes that differ by rank are refused on every rank before the node's shared windows
    are made (an allocation sized by one rank's parameters would fail on another, or wait
    for ever), and every rank goes on."""
    rc, lines, log = _launch(capfd, 2, "shapes_differ")
    assert rc == 0, log
    refused = [ln for ln in lines if ln.startswith("REFUSED")]
    assert len(refused) == 2 and all("with the same parameter shapes" in ln for ln in refused), log
    assert sorted(ln for ln in lines if ln.startswith("AFTER")) == ["AFTER 0", "AFTER 1"], log


def test_own_part_only_reads_the_plan() -> None:
    """plan.own_part_only: which schedules of the examples have each rank write only its own
    part of the weights (through a fused collective's all-gather into them, in place)."""
    from coconetc.sourcefile import load_file
    found = set()
    for f in sorted((REPO / "examples").glob("*.ccn")):
        mod = load_file(f)
        for (_, sched), plan in mod.plans.items():
            found |= {(f.stem, sched, q) for q in plan.params if plan.own_part_only(q)}
    assert found == {("adam", "zero", "w"), ("adam", "fused", "w"), ("adamw", "zero", "w"),
                     ("amax_scale", "zero", "w"), ("clipped_sgd", "fused", "w"), ("mixed_adam", "zero", "w16"),
                     ("mixed_adam_bf16", "zero", "w16"), ("scaled_adam", "zero", "w16"), ("sgd", "fused", "w")}


def test_batch_of_calls_runs_each_once_and_refuses_two_functions(built):
    """coconetc.runtime.batch on one rank: a batch of one function's calls gives each call's
    result; calls of two functions in one batch are refused before any runs."""
    from coconetc.runtime import batch
    n = 10
    args = {k: np.full(n, v, np.float32) for k, v in (("g", 0.5), ("w", 1.0), ("m", 0.0), ("v", 0.0))}
    other = {k: a.copy() for k, a in args.items()}
    with batch.together():
        built.adam(**args, **HYPER, step=1)
        built.adam(**other, **HYPER, step=1)
        assert args["w"][0] == 1.0  # not run yet
    ref = {k: np.full(n, v, np.float32) for k, v in (("g", 0.5), ("w", 1.0), ("m", 0.0), ("v", 0.0))}
    built.adam(**ref, **HYPER, step=1)
    assert np.array_equal(args["w"], ref["w"]) and np.array_equal(other["w"], ref["w"])
    with pytest.raises(ValueError, match="one function of one module"):
        with batch.together():
            built.adam(**args, **HYPER, step=1)
            built.adam(**other, **HYPER, step=1, schedule="zero")
    with pytest.raises(RuntimeError, match="do not nest"):
        with batch.together(), batch.together():
            pass


@pytest.mark.slow
def test_checkpoint_from_zero_on_2_ranks_to_every_schedule_on_2_and_3(built, capfd, tmp_path):
    path = str(tmp_path / "ckpt.pt")
    rc, lines, log = _launch(capfd, 2, "save", path)
    scheds = ("default", "rs_c_ag", "zero", "fused")
    _check(lines, log, ["save:zero:R2:same_on_every_rank"] +
           [f"save:zero:R2->{s}:R2:{w}" for s in scheds for w in ("state_round_trip", "params", "state")])
    assert rc == 0, log
    rc, lines, log = _launch(capfd, 3, "resume", path)
    _check(lines, log, [f"checkpoint->{s}:R3:{w}" for s in scheds
                        for w in ("state_round_trip", "params", "state")])
    assert rc == 0, log


@pytest.mark.slow
def test_state_dict_on_one_rank_only_ends_the_job(built, capfd):
    """Gathering the state is collective: rank 0 calling state_dict() alone is stopped by the
    watchdog, which names the call and the missing rank."""
    old = os.environ.get("COCONET_TIMEOUT")
    os.environ["COCONET_TIMEOUT"] = "5"
    try:
        rc, lines, log = _launch(capfd, 2, "rank0_only")
    finally:
        if old is None:
            os.environ.pop("COCONET_TIMEOUT")
        else:
            os.environ["COCONET_TIMEOUT"] = old
    assert "BOTH CALLED 0" in lines and "BOTH CALLED 1" in lines, log
    assert rc != 0 and "RANK 0 WAS NOT STOPPED" not in lines, log
    assert "DistributedOptimizer.state_dict() (adam, schedule 'zero')" in log, log
    assert "rank 1 did not arrive" in log, log


# --- on one rank, in this process ----------------------------------------------------------------
def test_layout_helpers(built):
    fn = built.adam
    for ranks in (1, 2, 3, 4):
        for r in range(ranks):
            lo, hi = slice_range(10, ranks, r)
            assert fn.local_shape("m", schedule="zero", rank=r, ranks=ranks, N=10) == (hi - lo,)
            assert fn.local_index("m", schedule="zero", rank=r, ranks=ranks, N=10) == (slice(lo, hi),)
            assert fn.local_shape("m", rank=r, ranks=ranks, N=10) == (10,)
            assert fn.local_shape("w", schedule="zero", rank=r, ranks=ranks, N=10) == (10,)
    assert fn.local_shape("m", schedule="zero", N=1000) == (1000,)  # COMM_WORLD: one rank here
    assert fn.local_shape("lr", N=5) == ()
    a = fn.zeros("v", schedule="zero", rank=1, ranks=3, N=7)
    assert isinstance(a, np.ndarray) and a.dtype == np.float32 and a.shape == (3,) and not a.any()
    t = fn.zeros("v", schedule="zero", rank=2, ranks=3, N=7, framework="torch")
    assert t.dtype == torch.float32 and t.shape == (1,) and not t.any()
    assert fn.empty("w", N=3, framework="torch").shape == (3,)
    assert fn.empty("g", N=4).shape == (4,)


@pytest.mark.parametrize("kwargs, error, needle", [
    (dict(name="m"), TypeError, "the size N of 'm' is needed"),
    (dict(name="m", N=3, M=2), TypeError, "'M' is not a size of adam"),
    (dict(name="m", N=-1), ValueError, "size N must be a non-negative integer"),
    (dict(name="q", N=3), ValueError, "adam has no parameter 'q'"),
    (dict(name="m", N=3, schedule="nope"), ValueError, "unknown schedule 'nope'"),
    (dict(name="m", N=3, rank=3, ranks=3), ValueError, "rank 3 is not one of 3 ranks"),
    (dict(name="m", N=3, rank=0, ranks=3, groups=2), ValueError, "3 ranks do not form 2 equal groups"),
])
def test_layout_helper_errors(built, kwargs, error, needle):
    with pytest.raises(error, match=needle):
        built.adam.local_shape(**kwargs)


def test_zeros_framework_error(built):
    with pytest.raises(ValueError, match="framework must be one of 'numpy', 'torch', got 'jax'"):
        built.adam.zeros("m", N=3, framework="jax")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def test_parameters_view_one_flat_buffer_and_versions_bump(built):
    from coconetc.torch import DistributedOptimizer
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = DistributedOptimizer(model.parameters(), str(ADAM), schedule="zero", **HYPER)
    flat = opt._groups[0].flat
    ptr, off = flat.data_ptr(), 0
    for p, b in zip(model.parameters(), before):
        assert p.data_ptr() == ptr + 4 * off and torch.equal(p.detach(), b)
        off += p.numel()
    assert off == flat.numel() == 26
    model(torch.ones(5, 3)).sum().backward()
    versions = [p._version for p in model.parameters()]
    opt.step()
    assert [p._version for p in model.parameters()] == [v + 1 for v in versions]
    assert all(p.grad.data_ptr() == v.data_ptr() for p, v in zip(model.parameters(), opt._groups[0].gviews))
    assert opt.state_tensors[0]["m"].shape == (26,)  # one rank: the whole state


def test_state_dict_format_follows_torch(built):
    from coconetc.torch import DistributedOptimizer
    model = _model()
    opt = DistributedOptimizer(model.parameters(), str(ADAM), **HYPER)
    assert opt.state_dict() == {"state": {}, "param_groups": [dict(HYPER, params=[0, 1, 2, 3])]}
    for _ in range(3):
        opt.zero_grad()
        model(torch.ones(5, 3)).sum().backward()
        opt.step()
    sd = opt.state_dict()
    assert sorted(sd["state"]) == [0, 1, 2, 3]
    for i, p in enumerate(model.parameters()):
        assert sd["state"][i]["step"].item() == 3.0
        assert sd["state"][i]["m"].shape == p.shape == sd["state"][i]["v"].shape


@pytest.mark.parametrize("kwargs, error, needle", [
    (dict(lr=1e-2, beta1=0.9, beta2=0.999), TypeError, "no value for the scalar 'eps'"),
    (dict(HYPER, wd=0.1), TypeError, "unexpected keyword argument 'wd'"),
    (dict(HYPER, weights="x"), ValueError, "weights='x' must name a tensor parameter"),
    (dict(HYPER, step="w"), ValueError, "step='w' must name a scalar parameter"),
    (dict(HYPER, schedule="nope"), ValueError, "unknown schedule 'nope'"),
    (dict(HYPER, program="sgd"), ValueError, "no program 'sgd'"),
    (dict(HYPER, across_groups=1), TypeError, "across_groups must be True or False"),
    (dict(HYPER, skipped="bad"), ValueError, r"skipped='bad' must name a 0-d output of the program \(its outputs: none\)"),
    (dict(HYPER, feedback=[("scale", "x")]), TypeError, "feedback must be a dict {scalar: output}, got list"),
    (dict(HYPER, feedback={"scale": "x"}), ValueError, r"feedback=\{'scale': ...\} must name a scalar of the program \(its scalars: lr, beta1"),
])
def test_constructor_errors(built, kwargs, error, needle):
    from coconetc.torch import DistributedOptimizer
    with pytest.raises(error, match=needle):
        DistributedOptimizer(_model().parameters(), str(ADAM), **kwargs)


@pytest.mark.parametrize("schedule", ["default", "fused"])
def test_a_program_without_a_step_count(built, schedule):
    """examples/sgd.ccn has no scalar `step` (SGD needs no count): the default step="step"
    names none, and the optimizer steps as torch.optim.SGD (one rank: the sum is the gradient)."""
    from coconetc.torch import DistributedOptimizer
    model = _model()
    ref = _model()
    opt = DistributedOptimizer(model.parameters(), str(REPO / "examples" / "sgd.ccn"), schedule=schedule, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for t in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(torch.full((5, 3), float(t + 1))).pow(2).sum().backward()
            o.step()
    assert max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters())) < 1e-6
    with pytest.raises(ValueError, match="step='t' must name a scalar parameter"):
        DistributedOptimizer(model.parameters(), str(REPO / "examples" / "sgd.ccn"), step="t", lr=0.1)


def test_wrong_parameter_dtype(built):
    from coconetc.torch import DistributedOptimizer
    with pytest.raises(ValueError, match="a parameter is torch.float64 .* 'w' is f32"):
        DistributedOptimizer(_model().double().parameters(), str(ADAM), **HYPER)


def test_auto_without_a_tuning_cache_entry_says_so(built):
    with pytest.raises(ValueError, match="the tuning cache has no choice for N=10 on 1 ranks"):
        built.adam.resolve_schedule("auto", N=10)
    assert built.adam.resolve_schedule("zero", N=10) == "zero"
    assert built.adam.resolve_schedule(None) == "default"


def test_import_coconetc_does_not_import_torch():
    code = "import sys, coconetc; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow
def test_train_mlp_example_runs_and_resumes_on_other_ranks(built, tmp_path):
    exe = Path(sys.executable).parent / "coconetc"
    ckpt = tmp_path / "mlp.pt"
    first = subprocess.run([str(exe), "launch", "-n", "2", str(REPO / "examples" / "train_mlp.py"),
                            "--epochs", "5", "--checkpoint", str(ckpt)],
                           capture_output=True, text=True, timeout=500)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "2 ranks, schedule zero: 5378 parameters, optimizer state on rank 0: 5378 of 10756" in first.stdout
    assert "max weight difference between ranks: 0.0" in first.stdout and ckpt.exists()
    mse = [float(ln.split()[-1]) for ln in first.stdout.splitlines() if "test mse" in ln]
    assert mse and mse[-1] < 0.02, first.stdout  # it learns (the targets' variance is about 0.4)
    again = subprocess.run([str(exe), "launch", "-n", "3", str(REPO / "examples" / "train_mlp.py"),
                            "--epochs", "1", "--schedule", "default", "--checkpoint", str(ckpt),
                            "--resume"], capture_output=True, text=True, timeout=500)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "3 ranks, schedule default" in again.stdout
    assert "max weight difference between ranks: 0.0" in again.stdout
