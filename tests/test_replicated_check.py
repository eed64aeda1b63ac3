"""COCONET_CHECK_REPLICATED=1, the opt-in check that a `replicated` tensor argument holds the
same value on every rank of a group (coconetc/runtime/call.py: description, _replicated_differ):
a call where rank 1 passes a different `w` raises on every rank, naming 'w' and rank 1, before
any buffer changes, on the CPU module (adam.ccn) and on the CUDA module under the host
emulation (sgd.ccn); without the variable that call runs (the check costs a read of every
replicated tensor, so it is off by default). Multi-rank checks run
tests/replicated_check_worker.py under mpiexec, about 2 s a launch once the modules are built."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from coconetc.launch import mpiexec
from coconetc.plan.targets import Target
from coconetc.runtime import call
from coconetc.toolchain import probes

REPO = Path(__file__).resolve().parents[1]
WORKER = str(Path(__file__).with_name("replicated_check_worker.py"))
FILES = {"cpu": REPO / "examples" / "adam.ccn", "cuda": REPO / "examples" / "sgd.ccn"}


@pytest.fixture(scope="module")
def built(request):
    """The two modules built once into the pytest cache (shared with the other launch tests),
    so that the ranks only import them."""
    from coconetc import toolchain
    from coconetc.runtime.loader import compile_cpu
    from coconetc.sourcefile import load_file
    compile_cpu(load_file(FILES["cpu"]), log=lambda msg: None)
    if probes.emulation_missing() is None:
        toolchain.compile(load_file(FILES["cuda"]), Target.EMULATED, toolchain.Options(log=lambda msg: None))
    yield True


def _launch(mode: str, backend: str, check: str | None) -> subprocess.CompletedProcess:
    if backend == "cuda" and probes.emulation_missing():
        pytest.skip(probes.emulation_missing() or "")
    env = mpiexec.environment(2)
    env.pop(call.ENV_CHECK_REPLICATED, None)
    if check is not None:
        env[call.ENV_CHECK_REPLICATED] = check
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = mpiexec.command(2, [sys.executable, WORKER, mode, backend, str(FILES[backend])])
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)


def _passed(res: subprocess.CompletedProcess, checks: list[str]) -> None:
    log = res.stdout + res.stderr[-4000:]
    assert res.returncode == 0, log
    for r in (0, 1):
        for c in checks:
            assert f"RANK {r}: {c} ok" in res.stdout, log
        assert f"RANK {r}: done" in res.stdout, log


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_a_replicated_value_that_differs_raises_on_every_rank(built, backend):
    """Rank 1's `w` one bit off (in a fresh buffer, then in the buffers of calls that agreed):
    both ranks raise naming 'w' and rank 1, nothing changes; groups=2 and equal values run."""
    res = _launch("on", backend, "1")
    _passed(res, ["differs", "repeated", "groups", "same"])
    assert res.stdout.count("rank 1's value differs from rank 0's") == 4, res.stdout


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_without_the_check_the_wrong_call_runs(built, backend):
    """Off by default (and with =0): the same wrong call runs, silently; that is the gap the
    debug mode is for."""
    _passed(_launch("off", backend, None), ["ran"])
    _passed(_launch("off", backend, "0"), ["ran"])


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_the_check_on_some_ranks_only_raises_on_every_rank(built, backend):
    """A rank without the check cannot give digests: every call raises on every rank, saying
    where the variable is off (the worker sets it on rank 0 only)."""
    _passed(_launch("mixed", backend, None), ["mixed"])


# --- one process ------------------------------------------------------------------------------
@pytest.fixture
def setting(monkeypatch):
    """Sets COCONET_CHECK_REPLICATED for check_replicated(), which reads it once per process."""
    def put(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(call.ENV_CHECK_REPLICATED, raising=False)
        else:
            monkeypatch.setenv(call.ENV_CHECK_REPLICATED, value)
        call.check_replicated.cache_clear()
    yield put
    call.check_replicated.cache_clear()


@pytest.mark.parametrize("value, on", [(None, False), ("", False), ("0", False), ("off", False),
                                       ("1", True), ("true", True), (" ON ", True)])
def test_the_setting(setting, value, on):
    setting(value)
    assert call.check_replicated() is on


def test_a_bad_setting_says_what_it_takes(setting):
    setting("maybe")
    with pytest.raises(ValueError, match="COCONET_CHECK_REPLICATED='maybe': expected 1"):
        call.check_replicated()


def test_the_description_is_unchanged_with_the_check_off(setting, example):
    """Off: the record every call exchanges is what it was (no digests, nothing read); on: a
    digest per replicated tensor (adam: w, m, v; not the local g)."""
    p = example("adam.ccn").variants()[("adam", "default")]
    values = dict(g=np.ones(3, np.float32), w=np.ones(3, np.float32), m=np.zeros(3, np.float32),
                  v=np.zeros(3, np.float32), lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, step=1.0)
    setting(None)
    assert len(call.description(("head",), p, values, {})) == 3
    setting("1")
    desc = call.description(("head",), p, values, {})
    assert [name for name, _ in desc[3]] == ["w", "m", "v"]


def test_the_digest_is_of_the_bits():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert call.value_digest(a) == call.value_digest(a.copy())
    assert call.value_digest(a) == call.value_digest([a[0].copy(), a[1].copy()])  # segments in order
    b = a.copy()
    b[1, 2] = np.nextafter(b[1, 2], np.float32(10))
    assert call.value_digest(b) != call.value_digest(a)
    assert call.value_digest(np.zeros(2, np.float32)) != call.value_digest(np.array([0.0, -0.0], np.float32))


def test_the_digest_of_a_tensor_is_that_of_its_array():
    """The CUDA module's path (copied to the host) on a CPU tensor: the same bytes, bf16 too."""
    torch = pytest.importorskip("torch")
    a = np.arange(6, dtype=np.float32)
    assert call.value_digest(torch.from_numpy(a.copy())) == call.value_digest(a)
    t = torch.arange(4, dtype=torch.bfloat16)
    assert call.value_digest(t) == call.value_digest(t.view(torch.int16).numpy())


def _descs(digests: list[bytes | None]) -> list[tuple]:
    return [(("head",), (), {}) + (() if d is None else ((("w", d),),)) for d in digests]


@pytest.mark.parametrize("digests, groups, needle", [
    ([b"a", b"b"], 1, "rank 1's value differs from rank 0's"),
    ([b"b", b"a", b"a"], 1, "rank 0's value differs from rank 1's"),  # the odd one is named
    ([b"a", b"b", b"c", b"b"], 1, "the values of ranks 0, 2 differ from rank 1's"),
    ([b"a", b"a", b"b", b"c"], 2, "rank 3's value differs from rank 2's"),  # within its group
    ([b"a", None], 1, "is on (1) on rank 0 but off on rank 1"),
])
def test_which_ranks_differ(digests, groups, needle):
    with pytest.raises(ValueError, match="adam\\(\\): ") as err:
        call._replicated_differ(_descs(digests), SimpleNamespace(name="adam"), groups)
    assert needle in str(err.value)


def test_groups_may_differ_from_each_other():
    call._replicated_differ(_descs([b"a", b"a", b"b", b"b"]), SimpleNamespace(name="adam"), 2)
