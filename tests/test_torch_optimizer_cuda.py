"""coconetc.torch.DistributedOptimizer on the CUDA backend (issue 19), tested without a GPU:
with COCONET_CUDA_EMULATE=1, backend="cuda" builds the CUDA module for the host emulation and
takes CPU tensors in place of CUDA tensors. On 2 ranks (3 slow-marked): every schedule of
examples/adam.ccn the CUDA module has, against torch.optim.Adam and against the CPU backend
(also on 1 and 4 ranks, slow);
AdamW; a checkpoint of the emulated CUDA optimizer loaded by the CPU one and back;
process_group= with a gloo group; mixed precision (f16 and bf16 parameters, f32 master weights
and state); across_groups=True (clipping by the norm of every group, the loss-scaled step's
inf/NaN test over every group); the abort path: an NCCL error on one rank, an asynchronous one
after a step, and a collective that never completes (timed by the watchdog's event on 2 ranks, 3
slow-marked). In this process: without the switch, CPU tensors given to the CUDA backend are an
error naming the tensor (nothing built); parameters given as torch optimizers take them
(named_parameters(), torch's TypeError for anything else); a state dict that does not fit
(shapes, a later group's steps, a scalar that is not a number, torch.optim.AdamW's own) refused
with nothing changed, on both backends.

The ranks run tests/torch_optimizer_cuda_worker.py; the modules are built once into the pytest
cache (shared with the other end-to-end tests)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from rank_checks import check, launch, symmetric_window_bytes

from coconetc.launch.mpiexec import run_python

torch = pytest.importorskip("torch")

# make test only: the five optimizers' emulated CUDA modules take most of a minute to build, and
# the quick set checks DistributedOptimizer on the CPU backend (tests/test_torch_optimizer.py)
# and the emulated CUDA backend through tests/test_cuda_emulate.py's quick cases
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
EX = REPO / "examples"
WORKER = Path(__file__).with_name("torch_optimizer_cuda_worker.py")
FILES = ("adam", "adamw", "mixed_adam", "mixed_adam_bf16", "scaled_adam")
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)


@pytest.fixture(scope="module")
def built(request):
    """COCONET_CUDA_EMULATE=1 (for this process and the ranks it starts); every file's emulated CUDA module and CPU module built once here."""
    import coconetc
    from coconetc.runtime.cuda import EMULATE
    saved = os.environ.get(EMULATE)
    os.environ[EMULATE] = "1"
    for f in FILES:
        coconetc.load(EX / f"{f}.ccn", log=lambda msg: None, backend="cuda")
        coconetc.load(EX / f"{f}.ccn", log=lambda msg: None)
    yield True
    if saved is None:
        os.environ.pop(EMULATE, None)
    else:
        os.environ[EMULATE] = saved


def _run(capfd, ranks: int, *args: str) -> tuple[int, list[str], str]:
    return launch(capfd, WORKER, ranks, *args)


def _check(lines: list[str], log: str, labels: list[str]) -> None:
    check(lines, log, labels)


RANKS = [2, pytest.param(3, marks=pytest.mark.slow)]
# Cases whose CPU twin in tests/test_torch_optimizer.py runs in the quick set: `make test` only,
# and on 2 ranks: uneven slices of CUDA tensors on 3 ranks are every_cuda_schedule_of_adam's [3].
SLOW_TWO = [pytest.param(2, marks=pytest.mark.slow)]


@pytest.mark.parametrize("ranks", [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(3, marks=pytest.mark.slow),
                                   pytest.param(4, marks=pytest.mark.slow)])
def test_every_cuda_schedule_of_adam_against_torch_and_the_cpu_backend(built, capfd, ranks):
    rc, lines, log = _run(capfd, ranks, "adam")
    scheds = next(ln for ln in lines if ln.startswith("SCHEDULES ")).split()[1:]
    assert scheds == ["default", "fused", "rs_c_ag", "zero"], log
    _check(lines, log, [f"cuda:{s}:R{ranks}:{w}" for s in scheds
                        for w in ("backend", "params_vs_torch", "state_vs_torch", "params_vs_cpu", "state_elements")]
           + [f"cuda:adamw{t}:R{ranks}:{w}" for t in ("", ":zero") for w in ("params_vs_torch", "params_vs_cpu")])
    assert rc == 0, log


@pytest.mark.parametrize("ranks", RANKS)
def test_the_peers_read_the_gradient_in_place(built, capfd, monkeypatch, ranks):
    """At R > 1 the optimizer's flat gradient is in a window of the NCCL communicator
    (shared_memory's default on the CUDA backend): the symmetric kernel (forced) reads it on the
    peers in place, staging nothing, and zero and fused still match torch.optim.Adam and the
    CPU backend; with shared_memory=False every call stages it, as before."""
    monkeypatch.setenv("COCONET_CUDA_FUSED", "symmetric")
    monkeypatch.setenv("COCONET_CUDA_FUSED_TRACE", "1")
    rc = run_python(ranks, [str(WORKER), "inplace"], timeout=500)
    out, err = capfd.readouterr()
    log = f"--- stdout\n{out}\n--- stderr\n{err[-4000:]}"
    _check(out.splitlines(), log, [f"cuda:{s}:R{ranks}:{sh}:{w}" for sh in ("None", "False")
                                   for s in ("zero", "fused") for w in ("shared", "params_vs_torch", "params_vs_cpu")])
    assert rc == 0, log
    calls = ranks * 2 * 10  # each rank's call of each schedule at each of the 10 steps, in each phase
    assert err.count("input read in place") == calls and err.count("input staged") == calls, log
    # the kernel's window (20002 f32 parameters): this rank's slice of the gathered weights, and
    # room to stage the gradient only where it is staged (its size in the emulated NCCL's 4096-byte units)
    n, most = 20002, -(-20002 // ranks)
    sizes = {(how, int(size)) for how, size in re.findall(r"input (staged|read in place), window (\d+) bytes", err)}
    assert sizes == {("read in place", symmetric_window_bytes(0, most, 4)),
                     ("staged", symmetric_window_bytes(4 * n, most, 4))}, (sizes, log)


@pytest.mark.parametrize("ranks", RANKS)
def test_checkpoints_across_backends(built, capfd, ranks):
    rc, lines, log = _run(capfd, ranks, "checkpoint")
    _check(lines, log, [f"ckpt:{a}:zero->{b}:{s}:R{ranks}:{w}" for a, b in (("cuda", "cpu"), ("cpu", "cuda"))
                        for s in ("default", "zero") for w in ("state_round_trip", "params", "state")])
    assert rc == 0, log


def test_process_group_gloo(built, capfd):
    rc, lines, log = _run(capfd, 2, "pg")
    _check(lines, log, [f"pg:{s}:R2:{w}" for s in ("default", "zero") for w in ("nccl_from_group", "params", "state")]
           + [f"pg:device_group:R2:{w}" for w in ("host_group", "exchanged_over_host_group", "params")])
    assert rc == 0, log


@pytest.mark.parametrize("ranks", [2])  # on 3 ranks: every_cuda_schedule_of_adam's [3]
def test_mixed_precision_f16_and_bf16(built, capfd, monkeypatch, ranks):
    """The fused unit runs the symmetric kernel on every step (forced): the CUDA-vs-CPU comparison
    holds the f16/bf16 gradient sum to 1e-6, and the kernel reduces it in the compute type as the
    CPU backend does, while the pipeline's NCCL sum rounds in the tensor's type (at R >= 3 the
    roundings differ), so auto, whose measured trials alternate the two, would mix them."""
    monkeypatch.setenv("COCONET_CUDA_FUSED", "symmetric")
    rc, lines, log = _run(capfd, ranks, "mixed")
    _check(lines, log, [f"mixed:{f}:{b}:{s}:R{ranks}:{w}" for f in ("mixed_adam", "mixed_adam_bf16")
                        for b, s in (("cuda", "default"), ("cuda", "zero"), ("cpu", "zero"))
                        for w in ("master", "params", "state", "f32_state")]
           + [f"mixed:{f}:zero:R{ranks}:cuda_vs_cpu" for f in ("mixed_adam", "mixed_adam_bf16")])
    assert rc == 0, log


@pytest.mark.parametrize("ranks", SLOW_TWO)
def test_clipping_by_the_norm_of_every_group(built, capfd, ranks):
    """adamw.ccn with two parameter groups (their own lr and weight decay), every schedule of the
    CUDA module: across_groups=True clips by the norm of both (clip_grad_norm_(model.parameters()))
    as the CPU backend does, False by each group's own; every step clips, and the two differ."""
    rc, lines, log = _run(capfd, ranks, "across")
    scheds = next(ln for ln in lines if ln.startswith("SCHEDULES ")).split()[1:]
    assert scheds == ["default", "rs_c_ag", "sliced", "zero"], log
    _check(lines, log, [f"across:{s}:R{ranks}:{a}:{w}" for s in scheds for a in ("across_groups", "per_group")
                        for w in ("backend", "params_vs_torch", "params_vs_cpu", "clipped")]
           + [f"across:{s}:R{ranks}:norms_differ" for s in scheds])
    assert rc == 0, log


@pytest.mark.parametrize("ranks", SLOW_TWO)
def test_loss_scaled_step_across_groups(built, capfd, ranks):
    """scaled_adam.ccn (f16 parameters, f32 master weights, dynamic loss scale), two groups,
    across_groups=True on the CUDA backend, every schedule: an inf and a NaN in one group's
    gradient skip every group's step and halve the scale (test_torch_optimizer.py's check)."""
    rc, lines, log = _run(capfd, ranks, "scaled")
    scheds = next(ln for ln in lines if ln.startswith("SCHEDULES ")).split()[1:]
    assert scheds == ["default", "rs_c_ag", "zero"], log
    _check(lines, log, [f"scaled_cuda:{s}:R{ranks}:{what}" for s in scheds
                        for what in ("master", "params", "state", "skipped", "bad_and_scale", "steps")])
    assert rc == 0, log


def test_the_watchdogs_events_are_recycled_and_time_only_unfinished_work(built):
    """runtime/events.py on the emulated module: an event recorded after work that completed
    goes back to the pool (five calls, one event made) and is never late, even past its
    deadline; close() destroys them all."""
    import time

    import coconetc
    from coconetc.runtime.events import Events
    fn = coconetc.load(EX / "adam.ccn", log=lambda msg: None, backend="cuda").adam
    events = Events(fn.ext)
    for k in range(5):
        events.record(0, f"call {k}", time.monotonic() - 1.0, 3.0)  # already past its deadline
        fn.ext.synchronize()
    assert events.made == 1 and len(events.outstanding) == 1, (events.made, events.outstanding)
    assert events.late(time.monotonic()) is None
    assert events.made == 1 and events.free and not events.outstanding
    events.close()
    assert not events.free and not events.outstanding


def test_a_batch_runs_on_one_stream(built):
    """The calls of one batch must share a stream (they run on it in turn): two streams raise."""
    import coconetc
    from coconetc.runtime import batch
    fn = coconetc.load(EX / "adamw.ccn", log=lambda msg: None, backend="cuda").adamw
    ext = fn.ext
    calls = [ext.CallArgs(), ext.CallArgs()]
    calls[1].stream = 1
    with pytest.raises(ValueError, match="every call must be given the same stream"):
        batch.run_all([(ext, ext.adamw__default, a, None) for a in calls])


@pytest.mark.parametrize("made_from", ["mpi", pytest.param("pg", marks=pytest.mark.slow),
                                       pytest.param("window", marks=pytest.mark.slow)])
def test_an_nccl_error_on_one_rank_aborts_the_communicator_on_every_rank(built, capfd, monkeypatch, made_from):
    """Rank 1's NCCL calls fail (COCONET_EMULATE_NCCL_FAIL_RANK, the emulation's injection) while
    rank 0 waits in the all-reduce for it: rank 1 notifies rank 0 and aborts its communicator,
    rank 0's watchdog aborts its own (ncclCommAbort), and step() raises on both, naming rank 1
    and the call, well within COCONET_TIMEOUT; the aborted communicator refuses later calls.
    pg: the communicator made from a gloo process group, the notice in the group's store.
    window: the first NCCL call is the one that makes the optimizer's gradient window
    (window_empty, collective), so the construction raises so on every rank, and again."""
    monkeypatch.setenv("COCONET_EMULATE_NCCL_FAIL_RANK", "1")
    monkeypatch.setenv("COCONET_TIMEOUT", "60")
    rc, lines, log = _run(capfd, 2, "abort", *(["default", made_from] if made_from != "mpi" else []))
    assert not [ln for ln in lines if "NOT RAISED" in ln or "NOT FROM THE GROUP" in ln], log
    for r in (0, 1):
        raised = next((ln for ln in lines if ln.startswith(f"RAISED {r} ")), None)
        assert raised is not None, log
        assert float(raised.split()[2].rstrip("s")) < 30, raised
        call = r"window_empty\(\(\d+,\), 'f32'\)" if made_from == "window" else r"\.adam\(schedule='default'\)"
        assert re.search(call + ": rank 1 failed: ", raised), raised
        for needle in ("ncclAllReduce: unhandled system error",
                       "the NCCL communicator was aborted (ncclCommAbort) on every rank", f"(this is rank {r})"):
            assert needle in raised, raised
        again = next(ln for ln in lines if ln.startswith(f"AGAIN {r} "))
        assert "the NCCL communicator was aborted (rank 1 failed in " in again, again
    assert rc == 0, log


def test_an_asynchronous_nccl_error_after_a_step_ends_the_job_on_every_rank(built, capfd, monkeypatch):
    """Rank 1's NCCL calls complete but leave an asynchronous error on its communicator
    (COCONET_EMULATE_NCCL_ASYNC_FAIL_RANK, ncclCommGetAsyncError), as on a GPU, where step()
    returns before its collectives run: the communicator's watchdog finds it (between calls, or
    in the next one), tells rank 0 and aborts; every rank's next step raises, naming rank 1 and
    the asynchronous error, and the communicator refuses later calls."""
    monkeypatch.setenv("COCONET_EMULATE_NCCL_ASYNC_FAIL_RANK", "1")
    monkeypatch.setenv("COCONET_TIMEOUT", "60")
    rc, lines, log = _run(capfd, 2, "async")
    assert not [ln for ln in lines if "NOT RAISED" in ln], log
    for r in (0, 1):
        raised = next((ln for ln in lines if ln.startswith(f"RAISED {r} ")), None)
        assert raised is not None, log
        assert int(raised.split()[2]) <= 3, raised  # found within a step or two, not at the end
        assert "rank 1 failed" in raised and "an asynchronous NCCL error" in raised, raised
        assert "ncclCommGetAsyncError: 6" in raised or "ncclCommGetAsyncError" in raised, raised
        again = next(ln for ln in lines if ln.startswith(f"AGAIN {r} "))
        assert "the NCCL communicator was aborted (rank 1 failed" in again, again
    assert rc == 0, log


@pytest.mark.parametrize("ranks", [2])
def test_a_collective_that_never_completes_ends_the_job_on_every_rank_after_the_timeout(built, capfd, monkeypatch,
                                                                                          ranks):
    """Rank 1's NCCL calls after its first two never complete (COCONET_EMULATE_NCCL_HANG_RANK=1:2:
    its emulated stream blocks in the all-reduce, posting nothing, so the peers' all-reduce waits
    too), as a GPU collective that a stuck or dead peer never joins, after step() has returned.
    The event the watchdog recorded after the step's work stays not ready (cudaEventQuery);
    COCONET_TIMEOUT (3 s) after the call the watchdog aborts the communicator, which ends the
    blocked work, and the step raises on every rank, naming the rank, the call whose work did
    not complete and the timeout, within a bounded time; the communicator refuses the next
    step. The healthy steps before it reused one event (the pool)."""
    monkeypatch.setenv("COCONET_EMULATE_NCCL_HANG_RANK", "1:2")
    monkeypatch.setenv("COCONET_TIMEOUT", "3")
    rc, lines, log = _run(capfd, ranks, "hang")
    assert not [ln for ln in lines if "NOT RAISED" in ln], log
    for r in range(ranks):
        raised = next((ln for ln in lines if ln.startswith(f"RAISED {r} ")), None)
        assert raised is not None, log
        step, seconds = int(raised.split()[2]), float(raised.split()[3].rstrip("s"))
        assert step == 3, raised  # steps 1 and 2 ran; the third's collective never completed
        assert 2.5 <= seconds < 15, raised  # the timeout, not sooner, and not much later
        for needle in (".adam(schedule='default'): rank ", " failed: the work of ccn_emu_adam_",
                       ".adam(schedule='default') (its kernels and NCCL collectives, queued on the call's stream) "
                       "did not complete within 3 s of the call (COCONET_TIMEOUT)",
                       "the NCCL communicator was aborted (ncclCommAbort) on every rank", f"(this is rank {r})"):
            assert needle in raised, raised
        assert next(ln for ln in lines if ln.startswith(f"EVENTS {r} ")).split()[2:] == ["1", "0"], log
        again = next(ln for ln in lines if ln.startswith(f"AGAIN {r} "))
        assert "the NCCL communicator was aborted (rank " in again, again
    assert rc == 0, log


# --- in this process ------------------------------------------------------------------------------
def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def test_cpu_tensors_to_the_cuda_backend_without_the_switch_name_the_tensor(built, monkeypatch):
    """No silent fallback: without COCONET_CUDA_EMULATE=1, backend="cuda" with CPU parameters
    is an error naming the parameter, raised before anything is built."""
    from coconetc.runtime.cuda import EMULATE
    from coconetc.torch import DistributedOptimizer
    monkeypatch.delenv(EMULATE)
    with pytest.raises(ValueError, match=r"'params\[0\] \(shape \(4, 3\)\)' is on cpu; the CUDA backend takes "
                                         r"CUDA tensors \(or set COCONET_CUDA_EMULATE=1"):
        DistributedOptimizer(_model().parameters(), str(EX / "adam.ccn"), backend="cuda", **HYPER)
    groups = [{"params": list(_model().parameters())[2:]}]
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] \(shape \(2, 4\)\)' is on cpu"):
        DistributedOptimizer(groups, str(EX / "adam.ccn"), backend="cuda", **HYPER)


def test_backend_follows_the_parameters_and_is_checked(built):
    from coconetc.torch import DistributedOptimizer
    opt = DistributedOptimizer(_model().parameters(), str(EX / "adam.ccn"), **HYPER)
    assert opt.backend == "cpu"  # CPU tensors: the CPU backend, even under the emulation switch
    opt = DistributedOptimizer(_model().parameters(), str(EX / "adam.ccn"), backend="cuda", **HYPER)
    assert opt.backend == "cuda" and opt._groups[0].flat.device.type == "cpu"
    assert type(opt._fn).__name__ == "EmulatedProgram"
    with pytest.raises(ValueError, match="backend must be 'cpu', 'cuda' or None"):
        DistributedOptimizer(_model().parameters(), str(EX / "adam.ccn"), backend="gpu", **HYPER)
    with pytest.raises(ValueError, match="process_group= and NCCL are for backend='cuda'"):
        DistributedOptimizer(_model().parameters(), str(EX / "adam.ccn"), process_group=object(), **HYPER)
    opt = DistributedOptimizer(_model().parameters(), str(EX / "adam.ccn"), backend="cuda", shared_memory=True,
                               **HYPER)  # the gradient in an NCCL window (one rank: plain memory), not the weights
    assert opt.shared_memory and not opt.shared_weights
    opt = DistributedOptimizer(_model().parameters(), str(EX / "adam.ccn"), backend="cuda", **HYPER)
    assert not opt.shared_memory  # one rank: nothing for a peer to read in place
    with pytest.raises(ValueError, match="unknown schedule 'nope' .*the CUDA module leaves out"):
        DistributedOptimizer(_model().parameters(), str(EX / "adam.ccn"), backend="cuda", schedule="nope",
                             **HYPER)
    with pytest.raises(ValueError, match="master='m16' must name a floating-point tensor parameter"):
        DistributedOptimizer(_model().parameters(), str(EX / "adam.ccn"), master="m16", **HYPER)


def _two_group_adamw(backend: str):
    from coconetc.torch import DistributedOptimizer
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = DistributedOptimizer([{"params": decay}, {"params": other, "wd": 0.0}], str(EX / "adamw.ccn"),
                               schedule="zero", backend=backend, across_groups=True, wd=0.1, maxnorm=1.0, **HYPER)
    return model, opt


def _train(model, opt, steps: int) -> None:
    for t in range(steps):
        opt.zero_grad()
        x = torch.randn(5, 3, generator=torch.Generator().manual_seed(t))
        model(x).square().sum().backward()
        opt.step()


@pytest.mark.parametrize("backend", ["cuda", "cpu"])
def test_parameters_are_taken_as_torch_optimizers_take_them(built, backend):
    """model.named_parameters() (as torch.optim takes it since 2.6: the names in the group's
    "param_names", in state_dict() too), and torch's TypeError for what is not a parameter, not an
    AttributeError from inside; comm= must be an mpi4py communicator."""
    from coconetc.torch import DistributedOptimizer
    src = str(EX / "adam.ccn")
    named, plain = _model(), _model()
    opt = DistributedOptimizer(named.named_parameters(), src, backend=backend, **HYPER)
    ref = DistributedOptimizer(plain.parameters(), src, backend=backend, **HYPER)
    assert opt.param_groups[0]["param_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    for m, o in ((named, opt), (plain, ref)):
        o.zero_grad()
        m(torch.ones(2, 3)).sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(named.parameters(), plain.parameters()))
    assert opt.state_dict()["param_groups"][0]["param_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    groups = [{"params": [(n, p) for n, p in _model().named_parameters() if p.dim() == 2]}]
    assert DistributedOptimizer(groups, src, backend=backend, **HYPER).param_groups[0]["param_names"] == \
        ["0.weight", "2.weight"]
    for bad, match in (([1, 2], "optimizer can only optimize Tensors, but one of the params is int"),
                       ([_model().parameters()], "one of the params is Module.parameters"),
                       (dict(_model().named_parameters()), "params must be a tensor or an ordered collection of tensors"),
                       ([{"params": {torch.zeros(2)}}], "must be a tensor or an ordered collection")):
        with pytest.raises(TypeError, match=match):
            DistributedOptimizer(bad, src, backend=backend, **HYPER)
    with pytest.raises(TypeError, match="comm must be an mpi4py intra-communicator"):
        DistributedOptimizer(_model().parameters(), src, backend=backend, comm=42, **HYPER)


@pytest.mark.parametrize("backend", ["cuda", "cpu"])
def test_a_state_dict_that_does_not_fit_is_refused_and_changes_nothing(built, backend):
    """load_state_dict checks everything before it copies anything: a state tensor shaped
    otherwise than its parameter (even with as many elements), a later group's mismatch, a
    scalar that is not a number, torch.optim.AdamW's own state dict: a ValueError naming what,
    the optimizer's state, step counts and scalars as they were, and it still trains."""
    import copy
    model, opt = _two_group_adamw(backend)
    _train(model, opt, 2)
    good = opt.state_dict()
    _train(model, opt, 1)  # the optimizer now differs from `good`
    opt.param_groups[1]["lr"] = 1e-4

    def snapshot():
        return ([{k: v.clone() for k, v in g.items()} for g in opt.state_tensors],
                [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
                [g.steps for g in opt._groups])

    def refused(mutate, match):
        sd = copy.deepcopy(good)
        mutate(sd)
        before = snapshot()
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(sd)
        after = snapshot()
        assert after[1:] == before[1:]
        assert all(torch.equal(x[k], y[k]) for x, y in zip(after[0], before[0]) for k in x)

    first, later = good["param_groups"][0]["params"][0], good["param_groups"][1]["params"][0]

    def transposed(sd):
        sd["state"][first]["m"] = sd["state"][first]["m"].t().contiguous()
    refused(transposed, r"'m' of parameter 0 \(param group 0\) is shaped \(3, 4\); the parameter is \(4, 3\)")

    def steps_differ(sd):  # group 0 would load fine; group 1 does not
        sd["state"][later]["step"] = torch.tensor(7.0)
    refused(steps_differ, r"different steps \[2.0, 7.0\]")

    def short_v(sd):
        sd["state"][later]["v"] = sd["state"][later]["v"][:-1]
    refused(short_v, r"'v' of parameter 2 \(param group 1\) is shaped \(3,\); the parameter is \(4,\)")

    def lr_text(sd):
        sd["param_groups"][1]["lr"] = "fast"
    refused(lr_text, "param group 1: scalar 'lr' is 'fast'; it must be a number")
    ref_model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    ref = torch.optim.AdamW([{"params": [p for p in ref_model.parameters() if p.dim() >= 2]},
                             {"params": [p for p in ref_model.parameters() if p.dim() < 2]}])
    _train(ref_model, ref, 1)
    torch_sd = ref.state_dict()
    refused(lambda sd: sd.update(torch_sd), r"'m' of parameter 0 \(param group 0\) is missing \(its state has "
                                            r"'step', 'exp_avg', 'exp_avg_sq'\)")
    opt.load_state_dict(good)
    assert all(torch.equal(a, b) for a, b in zip(opt.state_dict()["state"][later].values(),
                                                 good["state"][later].values()))
    _train(model, opt, 1)
