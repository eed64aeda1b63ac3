"""The fused collective through MPI-3 shared memory (runtime_cpp/coconet/fused_shm.h) against
the point-to-point one, bit for bit, with the input staged or in coconetc.empty's window, on
COMM_WORLD and a sub-communicator (tests/fused_shm_worker.py under mpiexec); and
coconetc.empty itself on one rank."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from coconetc.launch.mpiexec import run_python

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("fused_shm_worker.py")


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 3])
def test_shm_path_matches_p2p(capfd, ranks: int):
    pytest.importorskip("mpi4py")
    import coconetc
    coconetc.load(REPO / "examples" / "adam.ccn", log=lambda msg: None)  # built before the ranks start
    rc = run_python(ranks, [str(WORKER), str(REPO / "examples" / "adam.ccn")], timeout=600)
    out, err = capfd.readouterr()
    assert rc == 0, out + err
    assert "ok" in out.split()
    assert "UCX" not in err


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_empty_is_a_writable_array(framework: str):
    pytest.importorskip("mpi4py")
    if framework == "torch":
        pytest.importorskip("torch")
    import coconetc
    from coconetc.runtime import shm
    before = len(shm.WINDOWS)
    a = coconetc.empty((3, 5), "f32", framework=framework)
    assert tuple(a.shape) == (3, 5)
    a[...] = 2
    assert float(a.sum()) == 30.0
    assert len(shm.WINDOWS) == before + 4
    b = coconetc.empty(0, "bf16")
    assert b.shape == (0,) and b.dtype == np.dtype(shm.STORAGE["bf16"])
    with pytest.raises(ValueError, match="unknown dtype"):
        coconetc.empty(3, "f8")


def test_repeated_call_fast_path_checks_what_changed():
    """A call with the same buffers as the last one skips the per-array checks (the loader's
    fast path) but still takes new scalars and notices an array reshaped in place."""
    pytest.importorskip("mpi4py")
    import coconetc
    fn = coconetc.load(REPO / "examples" / "adam.ccn", log=lambda msg: None).adam
    n = 7
    g = np.linspace(-1, 1, n).astype(np.float32)

    def fresh():
        return {k: np.full(n, 0.5, np.float32) for k in "wmv"}

    a, b = fresh(), fresh()
    for step in (1.0, 2.0, 3.0):  # a: the same buffers every call; b: the checks run each time
        fn(g=g, **a, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, step=step)
        fn(g=g.copy(), **{k: v for k, v in b.items()}, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, step=step)
        b = {k: v.copy() for k, v in b.items()}
    for k in "wmv":
        assert np.array_equal(a[k], b[k]), k
    with pytest.raises(TypeError, match="step"):
        fn(g=g, **a, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, step="x")
    a["w"].shape = (1, n)
    with pytest.raises(ValueError, match="'w'"):
        fn(g=g, **a, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, step=4.0)


def test_repeated_call_hot_path_with_torch_tensors():
    """Repeated calls with the same PyTorch tensors take the hot path: results as with fresh
    NumPy arrays, version counters bumped on every call, and a tensor that requires grad is
    still refused outside torch.no_grad() on a repeat."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("mpi4py")
    import coconetc
    fn = coconetc.load(REPO / "examples" / "adam.ccn", log=lambda msg: None).adam
    n = 7
    g = np.linspace(-1, 1, n).astype(np.float32)
    t = {k: torch.full((n,), 0.5) for k in "wmv"}
    b = {k: np.full(n, 0.5, np.float32) for k in "wmv"}
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
    tg = torch.from_numpy(g.copy())
    for step in (1.0, 2.0, 3.0):
        before = t["w"]._version
        fn(g=tg, **t, **hp, step=step)
        assert t["w"]._version > before
        fn(g=g.copy(), **b, **hp, step=step)
        b = {k: v.copy() for k, v in b.items()}
    assert any(f.hot is not None and f.hot.torch for f in fn.recent.values())
    for k in "wmv":
        assert np.array_equal(t[k].numpy(), b[k]), k
    w = t["w"].requires_grad_()
    with torch.no_grad():
        fn(g=tg, **{**t, "w": w}, **hp, step=4.0)
        fn(g=tg, **{**t, "w": w}, **hp, step=5.0)
    before = w.detach().clone()
    with pytest.raises(RuntimeError, match="'w'.*requires grad"):
        fn(g=tg, **{**t, "w": w}, **hp, step=6.0)
    assert torch.equal(w.detach(), before)


@pytest.mark.slow
def test_intermediate_in_the_shared_window_matches(tmp_path):
    """mlp_out's matmul result y, which the all-reduce (default) and the fused collective (fused)
    read, lives in the group's own shared window (coconet::shared_scratch): the peers read it in
    place. Every schedule matches the interpreter on 3 ranks (uneven slices) at a size where the
    all-reduce goes through the window (2*65*64 f16 elements, over its 16 KiB threshold), and
    again with COCONET_FUSED=p2p (y in ordinary scratch)."""
    import subprocess
    import sys
    exe = Path(sys.executable).parent / "coconetc"
    text = (REPO / "examples" / "mlp_out.ccn").read_text()
    assert "coconet::shared_scratch" not in text
    for env in ({}, {"COCONET_FUSED": "p2p"}):
        res = subprocess.run([str(exe), "run", str(REPO / "examples" / "mlp_out.ccn"), "--ranks", "3",
                              "-s", "all", "--size", "B=2", "--size", "S=65", "--size", "K=7", "--size", "H=64"],
                             capture_output=True, text=True, timeout=900, env={**os.environ, **env})
        assert res.returncode == 0, res.stdout + res.stderr
        assert res.stdout.count("matches the interpreter on every rank") == 5, res.stdout + res.stderr


def test_generated_code_puts_collective_sources_in_the_window():
    """The renderer asks for shared_scratch exactly for scratch buffers a top-level fused
    collective or an all-reduce reads: mlp_out's y in default and fused, not in overlapped (its
    chunks go point to point) or rs_c_ag."""
    from coconetc.codegen.cpu import generate
    from coconetc.sourcefile import load_file
    src = generate(load_file(REPO / "examples" / "mlp_out.ccn"), "m").cpp
    bodies = {name: src.split(f"void mlp_out__{name}(")[1].split("\n}\n")[0]
              for name in ("default", "overlapped", "fused", "rs_c_ag", "overlap_ar")}
    for name, body in bodies.items():
        shared = "coconet::shared_scratch<coconet::half, 1>(comm," in body
        assert shared == (name in ("default", "fused")), (name, body[:400])


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_remembered_calls_keep_no_buffer_alive(framework: str):
    """The loader remembers recent calls' buffers for the fast path (fastpath.RecentCall, Hot) by weak
    references: arrays passed once and dropped are freed (a loop that passes new activations
    each call kept the last 64 calls' alive), and the buffers still remembered still take the
    hot path, exactly, or are checked again where the module's arguments must be laid out anew."""
    pytest.importorskip("mpi4py")
    torch = pytest.importorskip("torch") if framework == "torch" else None
    import gc
    import weakref

    import coconetc
    fn = coconetc.load(REPO / "examples" / "sgd.ccn", log=lambda msg: None).sgd

    def array(v: float):
        a = np.full(9, v, np.float32)
        return torch.from_numpy(a) if torch is not None else a

    dropped = []
    for _ in range(5):
        g, w = array(2.0), array(1.0)
        fn(g=g, w=w, lr=0.5)
        dropped += [weakref.ref(g), weakref.ref(w)]
        del g, w
    gc.collect()
    assert [r for r in dropped if r() is not None] == [], "a remembered call keeps its buffers alive"
    g, w = array(2.0), array(1.0)
    for k in range(3):  # the same buffers: the hot path, its results exact
        fn(g=g, w=w, lr=0.25)
        assert np.array_equal(np.asarray(w), np.full(9, 1.0 - 0.5 * (k + 1), np.float32)), (k, w)
    fast = fn.recent.get(fn.recent.slot(None, dict(g=g, w=w)))
    assert fast.hot is not None
    fast.hot, fast.sizes = None, None  # as if the ranks had bound other sizes: the buffers
    fn(g=g, w=w, lr=0.25)  # are checked again (the remembered call holds none), the result exact
    assert np.array_equal(np.asarray(w), np.full(9, 1.0 - 0.5 * 4, np.float32)), w
