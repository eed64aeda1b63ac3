"""Reliability of compiled modules at call time (issue 8): wrong calls raise on every rank and
touch nothing (ranks that disagree, aliased buffers, PyTorch autograd rules), sub-communicators
work, a failing or missing rank ends the job instead of hanging it, the interpreter stays out
of the shipping path, and a missing `cpu` extra says what to install.

Multi-rank checks run tests/cpu_reliability_worker.py under mpiexec (coconetc/launch); the
modules are built once into the pytest cache (shared with tests/test_cpu_backend.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from coconetc.toolchain import probes
from coconetc.launch.mpiexec import run_python

REPO = Path(__file__).resolve().parents[1]
ADAM = REPO / "examples" / "adam.ccn"
WORKER = Path(__file__).with_name("cpu_reliability_worker.py")
COMM_FILES = [REPO / "examples" / f for f in ("adam.ccn", "lamb.ccn", "mlp_out.ccn", "pipeline.ccn")]
N = 13


@pytest.fixture(scope="module")
def built(request):
    """The files the workers use built once here (in the session's build cache, conftest.py),
    so that the ranks only import them."""
    from coconetc.runtime.loader import compile_cpu
    from coconetc.sourcefile import load_file
    for f in COMM_FILES:
        compile_cpu(load_file(f), log=lambda msg: None)
    import coconetc
    yield coconetc.load(ADAM, log=lambda msg: None)


def _launch(capfd, ranks: int, mode: str, files, timeout: float, env: dict | None = None):
    old = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        t0 = time.monotonic()
        rc = run_python(ranks, [str(WORKER), mode, *map(str, files)], timeout=timeout)
        took = time.monotonic() - t0
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out, err = capfd.readouterr()
    return rc, took, out, err, f"--- stdout\n{out}\n--- stderr\n{err[-4000:]}"


# --- on two and three ranks --------------------------------------------------------------------
CALL_CHECKS = ["scalar_differs", "scalar_differs_in_last_bit", "schedule_differs", "groups_differ",
               "same_buffer_twice", "view_of_another", "alias_on_rank1_only", "torch_views_alias",
               "leaf_requires_grad", "no_grad_updates_and_bumps_version", "still_in_step",
               "repeated_call_scalar_differs", "warm_call_alias_on_rank1_only"]


def test_wrong_calls_raise_on_every_rank(built, capfd):
    rc, _, out, _, log = _launch(capfd, 2, "calls", [ADAM], timeout=180)
    for check in CALL_CHECKS:
        assert f"OK {check}" in out.splitlines(), f"{check}\n{log}"
    assert rc == 0, log


def test_sub_communicators_split_and_dup(built, capfd):
    """Every schedule of these files on ranks {0, 1} of a split (rank 2 alone in the other
    part) and on a duplicate of COMM_WORLD (3 ranks), against the interpreter."""
    rc, _, out, _, log = _launch(capfd, 3, "comm", COMM_FILES, timeout=400)
    ok = [ln for ln in out.splitlines() if ln.startswith("OK comm ")]
    assert not [ln for ln in out.splitlines() if ln.startswith("FAIL")], log
    for sched in ("default", "rs_c_ag", "zero", "fused"):
        assert f"OK comm adam.ccn:adam[{sched}]:split:2" in ok, log
        assert f"OK comm adam.ccn:adam[{sched}]:dup:3" in ok, log
    assert any(ln.startswith("OK comm pipeline.ccn:") and ":split:2" in ln for ln in ok), log
    assert any(ln.startswith("OK comm mlp_out.ccn:") and "[overlapped]" in ln for ln in ok), log
    assert rc == 0, log


@pytest.mark.parametrize("mode", ["crash", "crash_torch"])
def test_uncaught_exception_on_one_rank_ends_the_job(built, capfd, mode):
    """Rank 1 raises while rank 0 waits at the next call's entry (watchdog far away): the
    hook installed by `import coconetc` aborts the job at once, its traceback printed. crash_torch:
    after torch.distributed.init_process_group, whose exception hook collects the traceback in
    memory and prints it after the hook it wraps returns (which aborts): the traceback must
    still reach stderr, not end the job without a word."""
    if mode == "crash_torch":
        pytest.importorskip("torch")
    rc, took, out, err, log = _launch(capfd, 2, mode, [ADAM], timeout=120,
                                      env={"COCONET_TIMEOUT": "300"})
    assert "FIRST CALL DONE 0" in out and "FIRST CALL DONE 1" in out, log
    assert rc != 0, log
    assert "KeyError: 'deliberate failure on rank 1'" in err, log
    assert "uncaught KeyError on rank 1: aborting the MPI job" in err, log
    assert "RANK 0 WAS NOT STOPPED" not in out, log
    assert took < 60, f"the job took {took:.0f} s to end\n{log}"


def test_rank_that_never_arrives_trips_the_watchdog(built, capfd):
    rc, took, out, err, log = _launch(capfd, 2, "stall", [ADAM], timeout=120,
                                      env={"COCONET_TIMEOUT": "3"})
    assert "FIRST CALL DONE 1" in out, log
    assert rc != 0, log
    assert "coconet watchdog" in err and "adam(schedule='zero')" in err, log
    assert "rank 1 did not arrive" in err and "call #2" in err and "COCONET_TIMEOUT" in err, log
    assert "RANK 0 WAS NOT STOPPED" not in out, log
    assert took < 60, f"the job took {took:.0f} s to end\n{log}"


# --- on one rank, in this process ----------------------------------------------------------------
def _args(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    arrays = {k: rng.uniform(0.5, 1.5, N).astype(np.float32) for k in ("g", "w", "m", "v")}
    return dict(**arrays, lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, step=3.0)


def _numpy(v):
    return v.detach().numpy().copy() if hasattr(v, "detach") else np.array(v, copy=True)


def _torch():
    return pytest.importorskip("torch")


ALIASES = {
    # id: (change to the arguments, the two parameters the error must name)
    "same-array": (lambda a: a.update(v=a["m"]), ("'m'", "'v'")),
    "numpy-view": (lambda a: a.update(v=a["w"][:]), ("'w'", "'v'")),
    "overlapping-views": (lambda a: a.update(**dict(zip("mv", _overlap(np.ones(2 * N, np.float32))))),
                          ("'m'", "'v'")),
    "read-only-inputs-too": (lambda a: a.update(g=a["w"]), ("'g'", "'w'")),
    "torch-same-storage": (lambda a: a.update(**dict(zip("gm", _overlap(_torch().ones(2 * N))))),
                           ("'g'", "'m'")),
}


def _overlap(buf):
    return buf[:N], buf[N // 2:N // 2 + N]


@pytest.mark.parametrize("case", list(ALIASES))
def test_aliased_parameters_raise(built, case):
    change, names = ALIASES[case]
    args = _args()
    change(args)
    before = {k: _numpy(v) for k, v in args.items() if not isinstance(v, float)}
    with pytest.raises(ValueError, match="overlap in memory") as info:
        built.adam(schedule="default", **args)
    for n in names:
        assert n in str(info.value), str(info.value)
    for k, v in before.items():
        np.testing.assert_array_equal(_numpy(args[k]), v, err_msg=k)


def test_disjoint_views_of_one_buffer_are_fine(built):
    buf = np.random.default_rng(0).uniform(0.5, 1.5, 4 * N).astype(np.float32)
    args = {**_args(), **{k: buf[i * N:(i + 1) * N] for i, k in enumerate("gwmv")}}
    before = buf.copy()
    built.adam(schedule="default", **args)
    assert np.array_equal(buf[:N], before[:N]) and not np.array_equal(buf[N:], before[N:])


def test_update_of_a_leaf_that_requires_grad_raises(built):
    torch = _torch()
    args = _args()
    w = torch.from_numpy(args["w"]).requires_grad_()
    before = args["w"].copy()
    with pytest.raises(RuntimeError, match="'w': a leaf Variable that requires grad is being "
                                           "used in an in-place operation"):
        built.adam(**{**args, "w": w})
    np.testing.assert_array_equal(w.detach().numpy(), before)
    # what PyTorch itself says for the same thing
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
        w.add_(1)


def test_update_of_a_non_leaf_that_requires_grad_raises(built):
    torch = _torch()
    args = _args()
    w = torch.from_numpy(args["w"]).requires_grad_() * 1.0
    with pytest.raises(RuntimeError, match="'w': a tensor that requires grad"):
        built.adam(**{**args, "w": w})


def test_inputs_that_require_grad_are_only_read(built):
    """g is read, not updated: requiring grad is fine, and its version stays."""
    torch = _torch()
    args = _args()
    g = torch.from_numpy(args["g"]).requires_grad_()
    version = g._version
    built.adam(**{**args, "g": g})
    assert g._version == version


def test_no_grad_updates_and_bumps_versions(built):
    torch = _torch()
    from coconetc.interp.interpreter import run
    args = _args(seed=3)
    want = run(built.adam.schedules["default"], [{k: _numpy(v) if not isinstance(v, float) else v
                                                  for k, v in args.items()}])[0].updates
    w = torch.from_numpy(args["w"]).requires_grad_()
    m, v = torch.from_numpy(args["m"]), torch.from_numpy(args["v"])
    versions = [t._version for t in (w, m, v)]
    saved = (w * 2).sum()  # autograd saved nothing of w, but w * w would: see below
    sq = (w * w).sum()
    with torch.no_grad():
        built.adam(**{**args, "w": w, "m": m, "v": v})
    assert [t._version for t in (w, m, v)] == [x + 1 for x in versions]
    np.testing.assert_allclose(w.detach().numpy(), want["w"], rtol=2e-4, atol=1e-5)
    np.testing.assert_allclose(m.numpy(), want["m"], rtol=2e-4, atol=1e-5)
    saved.backward()  # did not save w: fine
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        sq.backward()  # saved w, which changed since: autograd must notice


def test_comm_self_works(built):
    from mpi4py import MPI
    from coconetc.interp.interpreter import run
    args = _args(seed=4)
    want = run(built.adam.schedules["zero"], [{k: (v.copy() if hasattr(v, "copy") else v)
                                               for k, v in args.items()}])[0].updates
    built.adam(schedule="zero", comm=MPI.COMM_SELF.Dup(), **args)
    np.testing.assert_allclose(args["w"], want["w"], rtol=2e-4, atol=1e-5)


def test_comm_must_be_an_intracommunicator(built):
    with pytest.raises(TypeError, match="intra-communicator"):
        built.adam(comm="world", **_args())


@pytest.mark.parametrize("value", ["ten", "-1"])
def test_bad_timeout_setting_raises(built, monkeypatch, value):
    monkeypatch.setenv("COCONET_TIMEOUT", value)
    args = _args()
    before = args["w"].copy()
    with pytest.raises(ValueError, match="COCONET_TIMEOUT"):
        built.adam(**args)
    np.testing.assert_array_equal(args["w"], before)


def test_watchdog_message_names_ranks():
    from coconetc.runtime.watchdog import watchdog_message
    msg = watchdog_message(0, 4, 7, "m.adam(schedule='zero')", 10.0,
                           {0: (7, "m.adam(schedule='zero')"), 2: (7, "m.adam(schedule='zero')"),
                            3: (6, "m.adam(schedule='zero')")})
    assert "ranks 1 did not arrive" not in msg
    assert "rank 1 did not arrive" in msg and "rank 3 is in call #6" in msg
    assert "ranks 0, 2 did" in msg and "call #7" in msg and "10 s" in msg
    # every rank answered, from different calls (a step on one rank, a checkpoint on the other):
    # the message said 'no rank did not arrive; ... (rank 1 did)'
    msg = watchdog_message(1, 2, 4, "DistributedOptimizer.state_dict() (adam, schedule 'zero')", 10.0,
                           {0: (4, "m.adam(schedule='zero')"),
                            1: (4, "DistributedOptimizer.state_dict() (adam, schedule 'zero')")})
    assert "did not arrive" not in msg, msg
    assert ("every rank is in a call of this communicator, but not all in this one; rank 0 is in call #4 "
            "(m.adam(schedule='zero')) (rank 1 in this one). Aborting the job.") in msg, msg


# --- the shipping path imports no interpreter ------------------------------------------------------
NO_INTERP = textwrap.dedent("""
    import sys
    import numpy as np
    from coconetc.runtime.loader import load
    mod = load(sys.argv[1], log=lambda msg: None)
    a = {k: np.ones(5, np.float32) for k in "gwmv"}
    mod.adam(schedule="zero", **a, lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, step=1.0)
    assert a["w"][0] != 1.0
    print("INTERP MODULES", sorted(m for m in sys.modules if m.startswith("coconetc.interp")))
    print("HARNESS MODULES", sorted(m for m in sys.modules if m.startswith("coconetc.oracle")))
    print("TUNER MODULES", sorted(m for m in sys.modules if m.startswith("coconetc.tune")))
""")


def test_loading_and_calling_imports_no_interpreter(built):
    res = subprocess.run([sys.executable, "-c", NO_INTERP, str(ADAM)], capture_output=True,
                         text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "INTERP MODULES []" in res.stdout, res.stdout
    assert "HARNESS MODULES []" in res.stdout, res.stdout
    assert "TUNER MODULES []" in res.stdout, res.stdout  # tuned choices come from runtime/tuned.py


def test_a_call_parses_its_label_once(built, monkeypatch):
    """The label ("zero@p2p": the schedule zero, point-to-point collectives) is parsed once
    per call (plan/label.py), and not at all on the hot path of a repeated call."""
    from coconetc.runtime import entry
    seen: list = []
    real = entry.parse
    monkeypatch.setattr(entry, "parse", lambda label: seen.append(label) or real(label))
    a = {k: np.ones(5, np.float32) for k in "gwmv"}
    scalars = dict(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, step=1.0)
    built.adam(schedule="zero@p2p", **a, **scalars)
    assert seen == ["zero@p2p"]
    built.adam(schedule="zero@p2p", **a, **scalars)
    assert seen == ["zero@p2p"]  # the hot path: the same buffers as an agreed call
    with pytest.raises(ValueError, match="unknown fused-collective algorithm 'nope'"):
        built.adam(schedule="zero@nope", **a, **scalars)


def test_new_buffers_like_an_agreed_calls_take_the_warm_path(built, monkeypatch):
    """A call with new buffers of an agreed call's kinds, shapes and dtypes (a layer called with
    each step's activations) skips the full checks (fastpath.warm_check) and computes what the
    interpreter does, also after calls of another kind (tensors, then arrays again); buffers
    that overlap, a read-only array it would update, a tensor that requires grad updated with
    grad on or another shape are not taken: the full path raises as always, touching nothing,
    or runs."""
    torch = _torch()
    from coconetc.interp.interpreter import run
    from coconetc.runtime import module
    entered: list = []
    real = module.enter
    monkeypatch.setattr(module, "enter", lambda *a, **k: entered.append(1) or real(*a, **k))
    def want(a: dict) -> dict:
        return run(built.adam.schedules["zero"], [{k: _numpy(v) if not isinstance(v, float) else v
                                                   for k, v in a.items()}])[0].updates
    built.adam(schedule="zero", **_args(seed=10))
    for seed, kind in ((11, np.asarray), (12, torch.from_numpy)):
        a = {k: kind(v) if not isinstance(v, float) else v for k, v in _args(seed=seed).items()}
        expect, entered[:] = want(a), []
        built.adam(schedule="zero", **a)
        if kind is np.asarray:  # (torch tensors: a call with other kinds than the one remembered)
            assert entered == [], "new arrays of the same shapes took the full path"
        for k in "wmv":
            np.testing.assert_allclose(_numpy(a[k]), expect[k], rtol=2e-4, atol=1e-5, err_msg=k)
    entered[:] = []
    built.adam(schedule="zero", **{**_args(seed=13), **{k: torch.from_numpy(v) for k, v in _args(13).items()
                                                        if not isinstance(v, float)}})
    assert entered == [], "new tensors like the last call's took the full path"
    a = _args(seed=17)  # arrays again, after tensors: the warm path remembers both kinds
    expect, entered[:] = want(a), []
    built.adam(schedule="zero", **a)
    assert entered == [], "new arrays like an earlier call's took the full path after a call with tensors"
    np.testing.assert_allclose(a["w"], expect["w"], rtol=2e-4, atol=1e-5)

    def refused(change, err, match, kind=np.asarray, grad=False):
        """CHANGE made to arguments of KIND right after a good call with arguments like them (so
        the warm path is tried: under no_grad, with w requiring grad, when GRAD)."""
        good = {k: kind(v) if not isinstance(v, float) else v for k, v in _args(seed=16).items()}
        with torch.no_grad():
            if grad:
                good["w"].requires_grad_()
            built.adam(schedule="zero", **good)
        a = {k: kind(v) if not isinstance(v, float) else v for k, v in _args(seed=14).items()}
        change(a)
        before = {k: _numpy(v) for k, v in a.items() if not isinstance(v, float)}
        entered[:] = []
        with pytest.raises(err, match=match):
            built.adam(schedule="zero", **a)
        assert entered == [1]  # the full path, which says why
        for k, v in before.items():
            np.testing.assert_array_equal(_numpy(a[k]), v, err_msg=k)
    buf = np.ones(2 * N, np.float32)
    refused(lambda a: a.update(m=buf[:N], v=buf[N - 1:2 * N - 1]), ValueError, "'m' and 'v' overlap")
    tbuf = torch.ones(2 * N)
    refused(lambda a: a.update(m=tbuf[:N], v=tbuf[N - 1:2 * N - 1]), ValueError, "'m' and 'v' overlap",
            kind=torch.from_numpy)
    refused(lambda a: a["w"].setflags(write=False), ValueError, "'w' is updated in place but is read-only")
    refused(lambda a: a["w"].requires_grad_(), RuntimeError, "'w': a leaf Variable that requires grad",
            kind=torch.from_numpy, grad=True)
    a = _args(seed=15)
    a.update({k: np.ascontiguousarray(np.resize(a[k], N + 2)) for k in "gwmv"})
    expect, entered[:] = want(a), []
    built.adam(schedule="zero", **a)
    assert entered == [1]
    np.testing.assert_allclose(a["w"], expect["w"], rtol=2e-4, atol=1e-5)


# --- the exception hook, installed by `import coconetc` in MPI jobs only ----------------------------
HOOK = "import sys, coconetc; print(getattr(sys.excepthook, 'coconet_abort', False), 'mpi4py' in sys.modules)"


@pytest.mark.parametrize("env, want", [({}, "False False"), ({"OMPI_COMM_WORLD_SIZE": "1"}, "False False"),
                                       ({"OMPI_COMM_WORLD_SIZE": "2"}, "True False"),
                                       ({"PMI_SIZE": "4"}, "True False")])
def test_exception_hook_only_in_mpi_jobs(env, want):
    clean = {k: v for k, v in os.environ.items() if k not in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
                                                              "PMIX_SIZE", "MV2_COMM_WORLD_SIZE")}
    res = subprocess.run([sys.executable, "-c", HOOK], capture_output=True, text=True, timeout=60,
                         env={**clean, **env})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == want


# --- without the cpu extra ------------------------------------------------------------------------
def test_missing_cpu_extra_says_what_to_install(monkeypatch, tmp_path):
    import coconetc
    from coconetc.cli import main
    monkeypatch.setattr(probes, "missing_cpu_extra", lambda: ("pybind11",))
    from coconetc.paths import install_command
    want = install_command("cpu")  # each package of the extra, by name: no registry has a 'coconet'
    assert want.startswith("pip install ") and "'mpi4py>=4'" in want and "coconet" not in want
    with pytest.raises(probes.BuildError, match=re.escape(want)) as info:
        coconetc.load(ADAM)
    assert "pybind11" in str(info.value)
    from click.testing import CliRunner
    res = CliRunner().invoke(main, ["compile", str(ADAM), "-o", str(tmp_path)])
    assert res.exit_code == 1 and want in res.output
    assert "Traceback" not in res.output
