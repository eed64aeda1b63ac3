"""coconetc.torch.shard (docs/sharded_torch.md): a model's parameters kept sharded between steps
in coconet's slicing convention, gathered for the forward, gradients reduce-scattered; whole
tensors on demand; whole-tensor checkpoints saved on R ranks and loaded on R'; bad input refused on
every rank before anything changes.

The checks on ranks are tests/sharded_worker.py's modes, several to a job on the rank pool
(tests/rank_checks.py), on 2 and 3 ranks, and on one rank in this process."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from rank_checks import check, launch, ranks_run

torch = pytest.importorskip("torch")
ct = pytest.importorskip("coconetc.torch")

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("sharded_worker.py")
TP_MLP = REPO / "examples" / "tp_mlp.ccn"
PAGE = REPO / "docs" / "sharded_torch.md"
LAUNCH = re.compile(r"coconetc launch -n (\d+) python (\S+)((?: \S+)*)")
ERRORS_EVERY_R = ["missing", "extra", "shape", "dtype", "not_a_dict", "optim_shape", "optim_params",
                  "optim_not_in_file", "optim_unchanged"]
ERRORS_SEVERAL_R = ["one_rank_missing", "wrong_part:forward", "wrong_part:full", "wrong_part:state_dict",
                    "wrong_part:save", "fault_inside_gathered", "file_missing_on_one_rank", "save_fails_on_rank_0",
                    "models_differ", "unknown_name"]


@pytest.fixture(scope="module")
def built():
    """examples/tp_mlp.ccn's tp_mlp with its derived program, built once into the session's
    cache (the same module tests/test_torch_function.py builds), so that the ranks only import it."""
    from coconetc.runtime.loader import compile_cpu
    from coconetc.sourcefile import load_file, with_grads
    compile_cpu(with_grads(load_file(TP_MLP), ["tp_mlp"]), log=lambda msg: None)


@pytest.fixture(scope="module")
def in_backward_built():
    """examples/adamw_sharded.ccn's module (adamw_in_backward's), built once before the ranks
    load it (the same module tests/test_cpu_backend.py builds)."""
    import coconetc
    coconetc.load(REPO / "examples" / "adamw_sharded.ccn", log=lambda msg: None)


# each mode's OK lines (after "MODE:R{R}:"), where it prints more than its own name
CHECKS = {
    "roundtrip": ["parts", "full", "gathered", "gathered_modifier_rank", "state_dict"],
    "train": ["sum", "avg"],
    "program": ["tp_mlp"],
    "units": [f"reshard={r}:prefetch={p}" for r in (True, False) for p in (0, 1, 2)] + ["named", "two_forwards",
                                                                                        "not_reaching", "traced"],
    "unit_memory": [f"prefetch={p}" for p in (0, 1, 2)] + ["kept"],
    "in_backward": ["default", "named_tied", "two_forwards", "not_reaching", "checkpoint"],
}


def labels(R: int, modes: list[str]) -> list[str]:
    """The OK lines the worker's MODES print on R ranks."""
    out = []
    for mode in modes:
        name, _, rest = mode.partition(":")
        if name in CHECKS:
            out += [f"{name}:R{R}:{c}" for c in CHECKS[name]]
        elif name in ("save", "opt_save", "partial"):
            out.append(f"{name}:R{R}")
        elif name in ("load", "opt_load"):
            out.append(f"{name}:R{rest.rpartition(':')[2]}->R{R}")
        else:
            out += [f"errors:R{R}:{e}" for e in ERRORS_EVERY_R + (ERRORS_SEVERAL_R if R > 1 else [])]
    return out


def _job(capfd, R: int, *modes: str) -> None:
    """The worker's MODES on R ranks: on the rank pool, or (R = 1) in this process."""
    if R > 1:
        rc, lines, log = launch(capfd, WORKER, R, *modes)
    else:
        from mpi4py import MPI

        import sharded_worker
        capfd.readouterr()
        rc = sharded_worker.run(list(modes), MPI.COMM_WORLD)
        log = capfd.readouterr().out
        lines = log.splitlines()
    check(lines, log, labels(R, list(modes)))
    assert rc == 0, log


@pytest.mark.parametrize("R", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
def test_sharded_parameters_on_R_ranks(built, capfd, tmp_path, R):
    """Parts, gathers and state dicts of uneven shapes, dims and dtypes; 3 AdamW steps against one
    process; gradients of layers used on some ranks or none; shards passed to a compiled program;
    every bad input (after a save, which the errors load)."""
    _job(capfd, R, "roundtrip", "train", "partial", "program", f"save:{tmp_path / 'ckpt.pt'}", "errors")


@pytest.mark.parametrize("R", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_units_gather_one_at_a_time_and_train_like_one_process(capfd, in_backward_built, R):
    """Units (the default split, named nested ones, a weight tied across units, a branch that
    reaches the loss on one rank only), both reshard settings and prefetch 0 to 2: gradients and
    5 AdamW steps against one process; with reshard_after_forward=True the whole weights alive at
    any layer's forward or backward are at most the largest prefetch+1 units'. AdamW inside the
    backward (adamw_in_backward: examples/adamw_sharded.ccn's fused reduce-scatter) on the same
    kinds of units against torch.optim.AdamW in one process, no gradient kept, and its
    checkpoint resumed by a torch AdamW."""
    _job(capfd, R, "units", "unit_memory", "in_backward")


def test_checkpoints_across_rank_counts(capfd, tmp_path):
    """Checkpoints of the parameters (c) and of the parameters with AdamW's state after 2 steps
    (o), continued for a third step: saved on 2 ranks, loaded on 3 and 1; saved on 3, loaded on 2
    and 1."""
    c = {R: tmp_path / f"r{R}" / "ckpt.pt" for R in (2, 3)}
    o = {R: tmp_path / f"r{R}" / "with_optimizer.pt" for R in (2, 3)}
    for p in c.values():
        p.parent.mkdir()
    _job(capfd, 2, f"save:{c[2]}", f"opt_save:{o[2]}")
    _job(capfd, 3, f"load:{c[2]}:2", f"opt_load:{o[2]}:2", f"save:{c[3]}", f"opt_save:{o[3]}")
    _job(capfd, 2, f"load:{c[3]}:3", f"opt_load:{o[3]}:3")
    _job(capfd, 1, f"load:{c[2]}:2", f"load:{c[3]}:3", f"opt_load:{o[2]}:2", f"opt_load:{o[3]}:3")


def test_the_page_runs_as_written(capfd, tmp_path):
    """docs/sharded_torch.md: its scripts (```python NAME blocks) written to a directory, and each
    line of its ```sh blocks, `coconetc launch -n R python SCRIPT ARGS`, run on the rank pool of R
    ranks (`python SCRIPT ARGS`, the arguments taken in that directory); the scripts check
    themselves (against one process, the checkpoint against its file). Any other block fails here."""
    from test_docs import blocks
    runs = 0
    for i, (kind, arg, text) in enumerate(blocks(PAGE)):
        if kind == "python" and arg:
            (tmp_path / arg).write_text(text)
            continue
        assert kind == "sh", f"block {i} (```{kind} {arg}) is not run by this test"
        for line in text.strip().splitlines():
            m = LAUNCH.fullmatch(line.strip())
            assert m, f"block {i}: {line!r} is not `coconetc launch -n R python SCRIPT ARGS`"
            args = [str(tmp_path / a) for a in [m.group(2), *m.group(3).split()]]
            res = ranks_run(int(m.group(1)), args, timeout=300)
            assert res.returncode == 0, f"{line}\n--- stdout\n{res.stdout[-3000:]}\n--- stderr\n{res.stderr[-3000:]}"
            runs += 1
    assert runs == 3


# --- on one rank, in this process ----------------------------------------------------------------
def test_parts_are_what_a_programs_sliced_parameters_take():
    """part_index is the runtime's local_index of a program's sliced(d) parameter (tp_mlp.ccn's
    w1 sliced(1), b1 and w2 sliced(0), b2 replicated), at sizes 1 to 4 ranks do not divide."""
    from coconetc.runtime import layout
    from coconetc.sourcefile import load_file
    from coconetc.torch.parts import part_index
    p = load_file(TP_MLP).program("tp_mlp")
    sizes = {"B": 2, "S": 3, "H": 5, "F": 7}
    for name in ("w1", "b1", "w2", "b2"):
        q = layout.param(p, name, "test")
        shape = tuple(layout.bind(p, q, sizes, "test"))
        dim = q.type.layout.dim if q.type.layout.sliced else None
        for R in (1, 2, 3, 4):
            for r in range(R):
                assert part_index(shape, dim, R, r) == layout.local_index(q, list(shape), R, r), (name, R, r)


def test_tied_parameters_are_one_part_and_both_names_in_checkpoints():
    """A weight shared by two layers (tied embeddings) is one sharded parameter seen by both in
    the forward, and under both names in the whole state dict."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False))
    m[1].weight = m[0].weight
    ref = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False))
    ref[0].weight.data.copy_(m[0].weight.data)
    ref[1].weight = ref[0].weight
    sh = ct.shard(m)
    assert sh.sharded == ["0.weight"] and m[1].weight is m[0].weight
    x = torch.randn(3, 4)
    m(x).sum().backward()
    ref(x).sum().backward()
    assert torch.allclose(m(x), ref(x)) and torch.allclose(m[0].weight.grad, ref[0].weight.grad)
    sd = sh.state_dict()
    assert list(sd) == ["0.weight", "1.weight"] and torch.equal(sd["1.weight"], ref[1].weight)


def test_frozen_and_unused_parameters_get_no_gradient_as_in_one_process():
    """A frozen parameter (requires_grad=False) and one the forward does not use get None, as in
    one process, so AdamW leaves them alone (no weight decay); the others step as in one process."""
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.unused = (torch.nn.Linear(4, 4) for _ in range(3))
            self.a.weight.requires_grad_(False)

        def forward(self, x):
            return self.b(self.a(x))
    torch.manual_seed(0)
    m = Model()
    ref = Model()
    ref.load_state_dict(m.state_dict())
    sh = ct.shard(m)
    opts = [torch.optim.AdamW(x.parameters(), lr=0.1, weight_decay=0.5) for x in (m, ref)]
    x = torch.randn(3, 4)
    for model, opt in zip((m, ref), opts):
        model(x).square().sum().backward()
        opt.step()
    assert m.a.weight.grad is None and m.unused.weight.grad is None and m.unused.bias.grad is None
    got = sh.state_dict()
    assert all(torch.allclose(got[k], v, atol=1e-6) for k, v in ref.state_dict().items())


@pytest.mark.parametrize("kwargs,error,needle", [
    (dict(comm=object()), TypeError, "mpi4py intra-communicator"),
    (dict(reduce="mean"), ValueError, "'avg' (as DDP and FSDP) or 'sum'"),
    (dict(dims={"0.weight": 2}), ValueError, "'0.weight' is shaped (3, 2): it has no dim 2"),
    (dict(params=["1.weight"]), ValueError, "no parameter '1.weight'"),
    (dict(units=["1"]), ValueError, "units: the module has no submodule '1'"),
    (dict(units="0"), TypeError, "units must be a list of submodule names"),
    (dict(prefetch=-1), ValueError, "prefetch must be an int >= 0"),
])
def test_shard_argument_errors(kwargs, error, needle):
    with pytest.raises(error) as err:
        ct.shard(torch.nn.Sequential(torch.nn.Linear(2, 3)), **kwargs)
    assert needle in str(err.value)


def test_handle_errors(in_backward_built):
    m = torch.nn.Sequential(torch.nn.Linear(2, 3))
    steps = torch.arange(4)
    m.register_parameter("steps", torch.nn.Parameter(steps.clone(), requires_grad=False))  # no gradient: sharded too
    sh = ct.shard(m, params=["0.weight", "steps"])
    assert sh.dim("0.bias") is None and sh.dim("steps") == 0 and torch.equal(sh.full("steps"), steps)
    m(torch.randn(2, 2)).sum().backward()
    assert m.steps.grad is None and m[0].weight.grad.shape == (3, 2)
    with pytest.raises(ValueError, match="sharded already"):
        ct.shard(m)
    with pytest.raises(KeyError, match="no parameter 'w'"):
        sh.local("w")
    with pytest.raises(ValueError, match="modifier_rank 1 is not a rank"):
        with sh.gathered(modifier_rank=1):
            pass
    with sh.gathered():
        with pytest.raises(RuntimeError, match="already inside gathered"):
            with sh.gathered():
                pass
        with pytest.raises(RuntimeError, match="not inside gathered"):
            sh.state_dict()
    # the update inside the backward: a trainable parameter of another dtype is refused, naming
    # it, as is a shared_memory that is not a bool; a second call is refused, saying what to
    # change instead
    wide = ct.shard(torch.nn.Sequential(torch.nn.Linear(2, 3).double()))
    with pytest.raises(ValueError, match="parameter '0.weight' is torch.float64"):
        wide.adamw_in_backward()
    with pytest.raises(TypeError, match="shared_memory must be True or False, got 'yes'"):
        sh.adamw_in_backward(shared_memory="yes")
    assert wide.units.in_backward is None and sh.units.in_backward is None
    opt = sh.adamw_in_backward(lr=0.5)
    assert opt.param_groups[0]["lr"] == 0.5 and len(opt.param_groups[0]["params"]) == 2  # (not the frozen steps)
    with pytest.raises(ValueError, match="called already: change the returned optimizer's param_groups"):
        sh.adamw_in_backward()


# --- last: it ends the job of its ranks (their pool starts again for the next test) ---------------
@pytest.mark.slow
def test_a_rank_that_never_arrives_ends_the_job(capfd):
    """Rank 0 gathers a parameter alone: the watchdog ends the job after COCONET_TIMEOUT (3 s,
    set by the worker) instead of a hang, naming the call and the rank that did not arrive."""
    rc, lines, log = launch(capfd, WORKER, 2, "absent")
    assert "SHARDED 0" in lines and "SHARDED 1" in lines, log
    assert rc != 0 and "RANK 0 WAS NOT STOPPED" not in lines, log
    assert "coconetc.torch.Sharded.gather of '0.weight'" in log or "coconetc.torch.Sharded.full('0.weight')" in log, log
    assert "rank 1 did not arrive" in log, log
