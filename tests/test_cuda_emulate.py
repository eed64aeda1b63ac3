"""The CUDA backend run without a GPU, under the host emulation (runtime_cpp/coconet/cuda/emulate.h,
docs/cuda_emulation.md): the same generated module.cu, compiled by g++ with -DCOCONET_EMULATE, streams as
threads, NCCL on MPI, cuBLAS on the CPU GEMM.

- every example and schedule the CUDA backend implements matches the interpreter at R = 1..4
  (size 10: uneven for 3 and 4 ranks; and sizes smaller than R), one mpiexec launch per R;
- dropout masks are bit-identical with the CPU backend;
- race tests: every cudaStreamWaitEvent of the fused pipeline and every stream join of the
  overlap, removed one at a time from the source, makes the emulated run fail naming the buffer
  and both streams (the check is on the happens-before relation, not on timing)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from rank_checks import ranks_run, symmetric_window_bytes

from coconetc import toolchain
from coconetc.toolchain import compiler, probes


REPO = Path(__file__).resolve().parents[1]
EX = REPO / "examples"
WORKER = str(Path(__file__).with_name("cuda_emulate_worker.py"))
FILES = ["adam", "adamw", "amax_scale", "clipped_sgd", "collectives", "conv2d", "lamb", "layernorm", "mixed_adam", "mlp_out", "pipeline",
         "residual_dropout", "scaled_adam", "sgd", "tp_overlap"]

why = probes.emulation_missing()
pytestmark = pytest.mark.skipif(why is not None, reason=why or "")


def _launch(ranks: int, args: list[str], env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return ranks_run(ranks, [WORKER, *args], timeout, env)


@pytest.fixture(scope="module")
def built(request):
    """Every example's emulated module, built once here (the ranks then only import), in the
    session's build cache that tests/test_cpu_backend.py uses too (the dropout test's CPU
    modules are built there already)."""
    from concurrent.futures import ThreadPoolExecutor
    probes.toolchain(), probes.compiler_hash()  # computed once, before the threads
    with ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
        list(pool.map(lambda f: _emulated(EX / f"{f}.ccn"), FILES))
    yield True


def _emulated(path: Path):
    from coconetc.sourcefile import load_file
    return toolchain.compile(load_file(path), "cuda-emulated", toolchain.Options(log=lambda msg: None))


def test_emulation_leaves_out_what_cuda_does_not_do(example):
    from coconetc.codegen.cuda import emulation_problems
    assert not emulation_problems(example("lamb.ccn"))  # scattered parameters, segment_norm
    skip = emulation_problems(example("extern_ops.ccn"))
    assert skip and all("extern" in w for w in skip.values())
    assert not emulation_problems(example("adam.ccn"))


@pytest.mark.slow
@pytest.mark.parametrize("ranks, size, chunk, groups", [(1, 10, None, 0), (3, 10, None, 0), (4, 3, None, 0),
                                                        (3, 10, "2", 0), (4, 10, "3", 2)])
def test_every_example_matches_interpreter(built, ranks, size, chunk, groups):
    """chunk: COCONET_CUDA_CHUNK, so every fused collective runs many chunks through both
    buffers; groups: every program on 2 groups of 2 (ncclCommSplit). Fused units run as the
    chunked pipeline (the symmetric kernel: test_symmetric_kernel_matches_interpreter). Two
    ranks are the groups' communicators of 2; four ranks at N = 10 the grouped case."""
    env = {"COCONET_CUDA_FUSED": "pipeline", **({"COCONET_CUDA_CHUNK": chunk} if chunk else {})}
    res = _launch(ranks, ["match", str(size), str(groups), *[str(EX / f"{f}.ccn") for f in FILES]], env=env)
    log = f"--- stdout\n{res.stdout}\n--- stderr\n{res.stderr[-4000:]}"
    assert res.returncode == 0, log
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(("MATCH", "MISMATCH"))]
    assert lines and all(ln.startswith("MATCH ") for ln in lines), log
    assert len(lines) >= 36, log  # 36 (program, schedule)s of the examples; a lost one shows here


@pytest.mark.slow
def test_dropout_masks_identical_to_cpu_backend(built):
    for file, prog, scheds in [("residual_dropout", "f1", ["default"]),
                               ("mlp_out", "mlp_out", ["default", "rs_c_ag", "fused", "overlap_ar", "overlapped"])]:
        res = _launch(2, ["dropout", str(EX / f"{file}.ccn"), prog, *scheds])
        log = f"--- stdout\n{res.stdout}\n--- stderr\n{res.stderr[-4000:]}"
        assert res.returncode == 0, log
        assert res.stdout.count("masks identical") == 2 * len(scheds), log


VECTOR_OPS = REPO / "tests" / "programs" / "vector_ops.ccn"
VECTOR_BCAST = REPO / "tests" / "programs" / "vector_bcast.ccn"


def _counts(out: str, file: str, program: str, sched: str, off: int) -> dict[str, int]:
    """Rank 0's counts of one call (a COUNTS line of the worker's vector mode)."""
    for ln in out.splitlines():
        w = ln.split()
        if ln.startswith("COUNTS ") and w[1].endswith(file) and w[2:6] == [program, sched, "rank=0", f"shift={off}"]:
            return {k: int(v) for k, v in (x.split("=") for x in w[6:])}
    raise AssertionError(f"no counts for {file} {program} {sched} shift={off}:\n{out}")


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_vector_and_element_paths_match_interpreter(built, ranks):
    """Pointwise kernels on both of their paths against the interpreter, at a size that is no
    multiple of any vector width and large enough that threads take several vectors: every array
    at a 64-byte boundary (the vector path where every operand is aligned, then its tail), and
    every array one element off (the element path: the alignment is checked at run time). The
    emulation counts the kernels launched on each path and the vector accesses made (a
    misaligned one would raise), so the vector path cannot silently be dead code. f32 (adam,
    fused at R = 1 reading its source directly), f16 with f32 (mixed_adam), pieces of scattered
    tensors (lamb), f16 with dropout in the vector lanes (plain and fused), f64, (at size
    12: [12, 12, 12]) dropout with a bias read per lane through its coordinates, and operands read
    through coordinates the lanes step (vector_bcast.ccn at [3, 3, 3] and [5, 5, 5]: a last dim
    shorter than the vector, carries into every dim, a slice's offset)."""
    _emulated(VECTOR_OPS)
    _emulated(VECTOR_BCAST)
    files = [str(EX / "adam.ccn"), str(EX / "mixed_adam.ccn"), str(EX / "lamb.ccn"), str(VECTOR_OPS),
             str(EX / "residual_dropout.ccn") + "@12", str(VECTOR_BCAST) + "@3", str(VECTOR_BCAST) + "@5"]
    size = 40003
    for off in (0, 1):
        # the pipeline's kernels (at R > 1 `auto` would run adam's fused units as the symmetric kernel)
        res = _launch(ranks, ["vector", str(size), str(off), *files], env={"COCONET_CUDA_FUSED": "pipeline"})
        out = res.stdout
        log = f"--- stdout\n{out}\n--- stderr\n{res.stderr[-4000:]}"
        assert res.returncode == 0, log
        lines = [ln for ln in out.splitlines() if ln.startswith(("MATCH", "MISMATCH"))]
        assert len(lines) >= 20 and all(ln.startswith("MATCH ") for ln in lines), log
        for file, prog, sched in [("adam.ccn", "adam", "default"), ("adam.ccn", "adam", "fused"),
                                  ("mixed_adam.ccn", "mixed_adam", "default"), ("lamb.ccn", "lamb", "default"),
                                  ("vector_ops.ccn", "drop16", "default"), ("vector_ops.ccn", "drop16", "fused"),
                                  ("vector_ops.ccn", "axpy64", "default"), ("residual_dropout.ccn", "f1", "default"),
                                  ("vector_bcast.ccn", "bcast16", "default"), ("vector_bcast.ccn", "rows32", "default"),
                                  ("vector_bcast.ccn", "slice32", "default")]:
            c = _counts(out, file, prog, sched, off)  # rank 0: its slices start where the arrays do
            least = {"f1": 12 ** 3 // 4 * 3 // ranks, "bcast16": 3, "rows32": 6, "slice32": 3}.get(prog, size // 8 // ranks)
            if off == 0:
                assert c["vector_kernels"] >= 1 and c["vector_accesses"] >= least, (file, sched, c)
            elif (file, sched) != ("lamb.ccn", "default"):  # lamb's norms are aligned scratch
                assert c["vector_kernels"] == 0 and c["vector_accesses"] == 0 and c["scalar_kernels"] >= 1, \
                    (file, sched, c)


# --- race detection ---------------------------------------------------------------------------------

def _statement_removed(text: str, start: int) -> str:
    """The text with the statement that starts at `start` (up to its ';' at depth 0) replaced by
    `(void)0;` (so an `if (...)` before it keeps a body)."""
    depth, k = 0, start
    while True:
        c = text[k]
        depth += c == "("
        depth -= c == ")"
        if c == ";" and depth == 0:
            break
        k += 1
    return text[:start] + "(void)0;" + text[k + 1:]


def _waits_in(text: str, function: str) -> list[int]:
    """Offsets of the COCONET_CUDA(cudaStreamWaitEvent(...)) statements inside `function`."""
    lo = text.index(function)
    hi = text.index("\n}\n", lo)
    return [lo + m.start() for m in re.finditer(r"COCONET_CUDA\(cudaStreamWaitEvent\(", text[lo:hi])]


def _joins_in(cu: str, fn: str) -> list[int]:
    lo = cu.index(f"void {fn}(")
    hi = cu.index("\n}\n", lo)
    return [lo + m.start() for m in re.finditer(r"coconet::cuda::join\(", cu[lo:hi])]


def _ccn(file: str | Path) -> Path:
    """An example by name, or a .ccn file by path."""
    return file if isinstance(file, Path) else EX / f"{file}.ccn"


def _source(file: str | Path, program: str, sched: str) -> str:
    from coconetc.codegen.cuda import generate
    from coconetc.sourcefile import load_file
    mod = load_file(_ccn(file))
    mod = replace(mod, schedules={p: {s: x for s, x in sc.items() if s == sched} for p, sc in mod.schedules.items()})
    return generate(mod, compiler.PROBE, skip_unsupported=True, emulate=True).cu


def _run_variant(file: str, program: str, sched: str, cu: str, size: int, drop: str = "") -> str:
    # built once into the shared cache (the unedited module serves every dropped wait of a header)
    name, so = compiler.build_emulated(cu, f"race_{file}", log=lambda msg: None)
    env = {"COCONET_CUDA_CHUNK": "2", "COCONET_CUDA_FUSED": "pipeline", **({"COCONET_EMULATE_DROP_WAIT": drop} if drop else {})}
    res = _launch(2, ["race", str(EX / f"{file}.ccn"), program, sched, str(so), name, str(size)], env=env, timeout=300)
    return res.stdout + res.stderr


RACE_CASES = [  # (file, program, schedule, size): a fused and an overlap schedule
    ("sgd", "sgd", "fused", 10),           # 5 elements a rank, 2-element chunks: 3 chunks
    ("mlp_out", "mlp_out", "overlap_ar", 10),
]


@pytest.mark.slow
@pytest.mark.parametrize("file, program, sched, size", RACE_CASES)
def test_race_every_stream_wait_removed_is_reported(file, program, sched, size):
    """Unchanged, the run passes; with any one stream wait of its pipeline removed (a
    cudaStreamWaitEvent of coconet::cuda::pipeline (cuda/fused.cuh) or join (cuda/core.cuh),
    dropped at run time by the emulation's COCONET_EMULATE_DROP_WAIT=HEADER:LINE, or a join call
    of the generated function, edited out of its text), every run fails naming the buffer and
    both streams."""
    from coconetc.codegen.naming import function_name
    from coconetc.paths import runtime_dir
    cu = _source(file, program, sched)
    fn = function_name(program, sched)
    headers = {h: (runtime_dir() / "coconet" / "cuda" / h).read_text() for h in ("fused.cuh", "core.cuh")}
    variants: list[tuple[str, str, str]] = []  # (what, module.cu, the wait dropped: HEADER:LINE)

    def waits(header: str, function: str, label: str) -> None:
        h = headers[header]
        for at in _waits_in(h, function):
            variants.append((label + h[at:h.index(";", at)], cu, f"{header}:{h.count(chr(10), 0, at) + 1}"))
    if "coconet::cuda::pipeline<" in cu:
        waits("fused.cuh", "void pipeline(", "")
    joins = _joins_in(cu, fn)
    if joins:
        waits("core.cuh", "COCONET_EMU void join(", "join(): ")
        for at in joins:
            variants.append((f"{fn}: " + cu[at:cu.index(";", at)], _statement_removed(cu, at), ""))
    assert len(variants) >= 3, variants

    out = _run_variant(file, program, sched, cu, size)
    assert out.count(": ok") == 2 and "race on buffer" not in out, out
    for what, vcu, drop in variants:
        out = _run_variant(file, program, sched, vcu, size, drop)
        assert "coconet emulate: race on buffer '" in out, f"removed {what}: not reported\n{out[-3000:]}"
        line = next(ln for ln in out.splitlines() if "race on buffer" in ln)
        assert re.search(r"stream #\d+", line) and "the call's stream" in line, line
        print(f"removed {what}:\n  {line.strip()}")


# --- the command line -------------------------------------------------------------------------------

def _cli(*args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "coconetc"
    cmd = [str(exe)] if exe.exists() else [shutil.which("coconetc") or "coconetc"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=600)


def test_run_backend_cuda_needs_a_gpu_or_emulate():
    res = _cli("run", str(EX / "sgd.ccn"), "--backend", "cuda")
    assert res.returncode != 0 and "no CUDA device here" in res.stderr and "--emulate" in res.stderr
    res = _cli("run", str(EX / "sgd.ccn"), "--emulate")
    assert res.returncode != 0 and "--backend cuda" in res.stderr


@pytest.mark.slow
def test_run_emulate_command(built, tmp_path):
    """coconetc run --backend cuda --emulate with the CPU run's flags; what the CUDA backend
    does not implement is named and skipped."""
    import numpy as np
    save = tmp_path / "out.npz"
    res = _cli("run", str(EX / "sgd.ccn"), "--backend", "cuda", "--emulate", "--ranks", "3", "-s", "all",
               "--size", "N=7", "--save", str(save))
    assert res.returncode == 0, res.stdout + res.stderr
    for s in ("default", "fused", "rs_c_ag"):
        assert f"sgd [{s}] (CUDA, host emulation): 3 ranks:" in res.stdout, res.stdout
    assert res.stdout.count("matches the interpreter on every rank") == 3, res.stdout
    saved = np.load(tmp_path / "out.fused.npz")
    assert saved["r2.out.w"].shape == (7,)
    # a program the CUDA backend does not implement (an allgather of a sliced scattered tensor)
    # is named and skipped, schedule by schedule
    src = tmp_path / "unsupported.ccn"
    src.write_text("program s(x: f32[N] sliced(0) scattered) {\n    a = allgather(x)\n    return a\n}\n")
    res = _cli("run", str(src), "--backend", "cuda", "--emulate", "--ranks", "2", "-s", "all")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "s [default]: skipped: an allgather of a sliced scattered tensor" in res.stdout, res.stdout


@pytest.mark.slow
def test_row_kernels_wider_than_a_block(built):
    """The layernorm kernel (a block of 256 threads a row) and the derived program's row means
    (mean_last, likewise) over rows of H = 300, so that threads take more than one element of a
    row, against the interpreter: attn_out's schedules (layernorm unit, sliced, fused row phase)
    and its derived program."""
    sizes = ["--size", "B=2", "--size", "S=3", "--size", "H=300"]
    res = _cli("run", str(EX / "layernorm.ccn"), "-p", "attn_out", "-s", "all", "--backend", "cuda", "--emulate",
               "--ranks", "2", *sizes)
    assert res.returncode == 0 and res.stdout.count("matches the interpreter on every rank") == 3, \
        res.stdout + res.stderr
    res = _cli("run", str(EX / "layernorm.ccn"), "-p", "attn_out", "--grad", "--backend", "cuda", "--emulate",
               "--ranks", "2", *sizes)
    assert res.returncode == 0 and "matches the interpreter on every rank" in res.stdout, res.stdout + res.stderr

CALLS = r"""
import sys
import numpy as np
from mpi4py import MPI  # noqa: F401 - MPI up first, as in a user's script
from coconetc.runtime.cuda import load_emulated
mod = load_emulated(sys.argv[1], log=lambda m: None)
g, w = np.full(7, 2.0, np.float32), np.ones(7, np.float32)
for sched in ("default", "fused", "rs_c_ag"):
    w1 = w.copy()
    mod.sgd(schedule=sched, g=g, w=w1, lr=0.25)
    assert np.allclose(w1, 0.5), (sched, w1)
for bad, err in [(dict(g=g.astype(np.float64), w=w.copy()), TypeError), (dict(g=g, w=g), ValueError),
                 (dict(g=g, w=w.copy()[::2]), ValueError)]:
    try:
        mod.sgd(lr=0.1, **bad)
    except err as e:
        print("raised:", e)
    else:
        raise SystemExit(f"no {err.__name__} for {bad}")
print("calls ok")
"""


@pytest.mark.slow
def test_load_emulated_calling_convention(built):
    """NumPy arrays in place of device memory, updated in place; wrong dtypes, aliasing and
    non-contiguous arrays raise before anything runs (one rank, in a fresh process)."""
    res = subprocess.run([sys.executable, "-c", CALLS, str(EX / "sgd.ccn")], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and "calls ok" in res.stdout, res.stdout + res.stderr
    assert res.stdout.count("raised:") == 3, res.stdout


REPEATS = r"""
import sys
import numpy as np
import torch
from mpi4py import MPI  # noqa: F401
from coconetc.runtime.cuda import load_emulated
mod = load_emulated(sys.argv[1], log=lambda m: None)
g, w = np.full(7, 2.0, np.float32), np.ones(7, np.float32)
ref = w.copy()
args = None
for i, lr in enumerate((0.25, 0.5, 0.125, 1.0)):  # the same buffers, new scalars
    mod.sgd(schedule="fused", g=g, w=w, lr=lr)
    ref -= np.float32(lr) * g
    assert np.array_equal(w, ref), (lr, w, ref)
    reps = mod.sgd.recent.values()
    assert len(reps) == 1 and reps[0].args is not None, reps
    assert args is None or reps[0].args is args, "the module's arguments were built again"
    args = reps[0].args
print("repeated ok")
import os
os.environ["COCONET_TIMEOUT"] = "soon"  # read again once it changed (a repeated call reuses what it read)
try:
    mod.sgd(schedule="fused", g=g, w=w, lr=0.5)
except ValueError as e:
    assert "COCONET_TIMEOUT='soon'" in str(e), e
    print("raised:", e)
del os.environ["COCONET_TIMEOUT"]
assert np.array_equal(w, ref), "a refused call changed w"
g.dtype = np.int32  # the same array object, now of another dtype: checked again
try:
    mod.sgd(schedule="fused", g=g, w=w, lr=0.5)
except TypeError as e:
    assert "'g'" in str(e), e
    print("raised:", e)
g.dtype = np.float32
w.shape = (7, 1)  # the same object, another shape
try:
    mod.sgd(schedule="fused", g=g, w=w, lr=0.5)
except ValueError as e:
    assert "'w'" in str(e), e
    print("raised:", e)
w.shape = (7,)
try:
    mod.sgd(schedule="fused", g=g, w=w, lr="0.5")
except TypeError as e:
    assert "'lr'" in str(e), e
    print("raised:", e)
gt, wt = torch.full((7,), 2.0), torch.ones(7)
mod.sgd(schedule="fused", g=gt, w=wt, lr=0.25)
mod.sgd(schedule="fused", g=gt, w=wt, lr=0.25)
old = wt.clone()
kept = wt.detach()  # a view of the first storage, which set_ leaves alone
wt.set_(torch.zeros(7))  # the same tensor object, another storage
mod.sgd(schedule="fused", g=gt, w=wt, lr=0.25)
assert torch.equal(wt, torch.full((7,), -0.5)), wt
assert torch.equal(kept, old), (kept, old)
with torch.no_grad():
    mod.sgd(schedule="fused", g=gt, w=wt, lr=0.25)
assert torch.equal(wt, torch.full((7,), -1.0)), wt
print("storage ok")
import gc, weakref
alive = weakref.ref(gt)
del gt
gc.collect()
assert alive() is None, "a remembered call keeps its tensor alive"
print("memory ok")
"""


@pytest.mark.slow
def test_a_repeated_call_checks_what_changed(built):
    """A call with the same buffers as the last (a training loop's step) reuses the module's
    arguments and checks only its scalars (fastpath.RecentCall), and is still right: new
    scalars each call; a COCONET_TIMEOUT set since is read again (and refused); an array whose
    dtype or shape changed in place, a scalar of the wrong type, raise naming it; a tensor given new storage (set_) is updated there, not in the old;
    and a remembered call does not keep its tensors alive."""
    res = subprocess.run([sys.executable, "-c", REPEATS, str(EX / "sgd.ccn")], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and all(f"{w} ok" in res.stdout for w in ("repeated", "storage", "memory")), \
        res.stdout + res.stderr
    assert res.stdout.count("raised:") == 4, res.stdout


@pytest.mark.slow
def test_wrong_call_on_one_rank_raises_on_every_rank(built):
    """The emulated module's call entry is the CPU loader's agreement: a wrong argument on rank 1
    only, a scalar or a schedule that differs, raise on both ranks before anything runs; calls
    that repeat an agreed one agree by their 64-byte records alone (and a scalar that differs
    there still raises everywhere)."""
    res = _launch(2, ["wrong", str(EX / "sgd.ccn")], timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    for r in (0, 1):
        assert res.stdout.count(f"RANK {r}: raised:") == 4 and f"RANK {r}: ok" in res.stdout, res.stdout
        assert f"RANK {r}: repeats ok" in res.stdout, res.stdout
    assert "rank 1 was given bad arguments" in res.stdout  # what rank 0 hears of rank 1's error


@pytest.mark.slow
def test_nccl_comm_from_torch_process_group(built):
    """nccl_comm(module.ext, process_group=...) under torch.distributed (gloo here, NCCL on
    GPUs): the communicator spans the group, calls agree over it (repeated calls by one
    all_gather of 64-byte records), and sgd runs."""
    pytest.importorskip("torch.distributed")
    res = _launch(2, ["torchpg", str(EX / "sgd.ccn")], timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert all(f"RANK {r}: {w}ok" in res.stdout for r in (0, 1) for w in ("", "repeats ")), res.stdout


def test_a_process_group_wider_than_the_mpi_job_is_refused_with_what_to_run(monkeypatch):
    """Under torchrun each process is an MPI singleton, so the emulated NCCL (on MPI) cannot span
    a 2-rank gloo group: nccl_comm says so and names the launch that works (mpiexec, without
    process_group=), before any NCCL call; emulate.h's own refusal ('an NCCL communicator is
    MPI_COMM_WORLD or one rank') came from inside the module on every rank."""
    pytest.importorskip("torch.distributed")
    import torch.distributed as dist
    from coconetc.runtime import cuda
    monkeypatch.setenv(cuda.EMULATE, "1")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)

    class NoNccl:
        def __getattr__(self, name):
            raise AssertionError(f"the module's {name} was called")

    with pytest.raises(ValueError, match=r"this group has 2 and MPI_COMM_WORLD 1 \(under torchrun each "
                                         r"process is an MPI job of its own\): launch the script under "
                                         r"mpiexec, `COCONET_CUDA_EMULATE=1 coconetc launch -n 2 python SCRIPT`"):
        cuda.nccl_comm(NoNccl(), process_group=object())


def test_the_stream_a_call_runs_on(monkeypatch):
    """stream= as given (a torch.cuda.Stream's cuda_stream, or a raw cudaStream_t int); else
    torch's current stream of the current device, read as a raw handle (a GPU's torch), or
    through torch.cuda.current_stream where torch has no such reader or no device is current."""
    torch = pytest.importorskip("torch")
    from coconetc.runtime import cuda

    class Given:
        cuda_stream = 1234
    assert cuda._stream_handle(Given(), 0) == 1234
    assert cuda._stream_handle(77, 0) == 77
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 500 + device, raising=False)
    assert cuda._stream_handle(None, 3) == 503
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Given())
    assert cuda._stream_handle(None, None) == 1234
    monkeypatch.delattr(torch._C, "_cuda_getCurrentRawStream")
    assert cuda._stream_handle(None, 3) == 1234


def test_load_backend_argument():
    import coconetc
    with pytest.raises(ValueError, match="backend must be 'cpu' or 'cuda'"):
        coconetc.load(EX / "sgd.ccn", backend="tpu")
    with pytest.raises(ValueError, match="archs only with cuda"):
        coconetc.load(EX / "sgd.ccn", archs="90")


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 3])
def test_defined_operations_run_on_the_cuda_backend(ranks):
    """Operations defined in a .ccn file (nested, in a fused reduce-scatter/all-gather) are
    expanded before planning, so the CUDA backend runs them: emulated, against the interpreter."""
    src = REPO / "tests" / "programs" / "custom_ops.ccn"
    _emulated(src)
    res = _launch(ranks, ["match", "11", "0", str(src)])
    log = f"--- stdout\n{res.stdout}\n--- stderr\n{res.stderr[-4000:]}"
    assert res.returncode == 0, log
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(("MATCH", "MISMATCH"))]
    assert len(lines) >= 3 and all(ln.startswith("MATCH ") for ln in lines), log


# --- the fused collective as one kernel over symmetric memory (symmetric.cuh) ----------------------

SYM_FILES = ["adam", "clipped_sgd", "mixed_adam", "sgd"]  # their fused units: reduce-scatters along dim 0
SYM_UNITS = 5  # adam zero, adam fused, clipped_sgd fused, mixed_adam zero, sgd fused
SYMMETRIC = "runs the symmetric kernel"


def _sym_run(ranks: int, size: int, algo: str, groups: int = 0, extra: dict | None = None):
    env = {"COCONET_CUDA_FUSED": algo, "COCONET_CUDA_FUSED_TRACE": "1", **(extra or {})}
    res = _launch(ranks, ["match", str(size), str(groups), *[str(EX / f"{f}.ccn") for f in SYM_FILES]], env=env)
    log = f"--- stdout\n{res.stdout}\n--- stderr\n{res.stderr[-4000:]}"
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(("MATCH", "MISMATCH"))]
    return res, log, lines


@pytest.mark.slow
@pytest.mark.parametrize("ranks, size, groups", [(1, 10, 0), (2, 10, 0), (3, 10, 0), (4, 10, 0), (4, 3, 0),
                                                 (4, 10, 2), (3, 60001, 0)])
def test_symmetric_kernel_matches_interpreter(built, ranks, size, groups):
    """COCONET_CUDA_FUSED=symmetric: every fused unit the symmetric kernel covers runs as that
    kernel (the trace line of every rank and unit says so) and every schedule matches the
    interpreter: uneven slices (3, 4 ranks), empty ones (size 3 on 4 ranks), split communicators
    (2 groups), and 20001 elements a rank (the emulated multiprocessor's 4 blocks of 512 threads,
    each barrier paired across ranks, threads taking several vectors; more blocks:
    test_symmetric_kernel_many_blocks_same_grid_on_every_rank)."""
    res, log, lines = _sym_run(ranks, size, "symmetric", groups)
    assert res.returncode == 0, log
    assert len(lines) == 11 and all(ln.startswith("MATCH ") for ln in lines), log  # 11 schedules
    assert res.stderr.count(SYMMETRIC) == SYM_UNITS * ranks, log
    assert "runs the pipeline" not in res.stderr, log


@pytest.mark.slow
@pytest.mark.parametrize("ranks, who, size", [(2, "all", 10), (2, "all", 20001), (3, "1", 20001), (4, "0,2", 10)])
def test_symmetric_kernel_reads_a_window_in_place(built, ranks, who, size):
    """An input in a window of the communicator (module.empty: window_empty) is read by the peers
    in place, not staged: on the ranks WHO names; the others stage theirs, and each rank finds
    where each peer's input is (its SymInput). Two calls of each (the second rewrites the
    SymInput), f32 and f16 gradients, against the interpreter; window_empty shapes that differ
    by rank raise on every rank."""
    specs = [f"{EX / 'adam.ccn'}:adam:zero:g", f"{EX / 'mixed_adam.ccn'}:mixed_adam:zero:g",
             f"{EX / 'sgd.ccn'}:sgd:fused:g"]
    res = _launch(ranks, ["inplace", str(size), who, *specs],
                  env={"COCONET_CUDA_FUSED": "symmetric", "COCONET_CUDA_FUSED_TRACE": "1"})
    log = f"--- stdout\n{res.stdout}\n--- stderr\n{res.stderr[-4000:]}"
    assert res.returncode == 0, log
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(("MATCH", "MISMATCH"))]
    assert len(lines) == 2 * len(specs) and all(ln.startswith("MATCH ") for ln in lines), log
    inplace = ranks if who == "all" else len(who.split(","))
    assert res.stderr.count("input read in place") == 2 * len(specs) * inplace, log
    assert res.stderr.count("input staged") == 2 * len(specs) * (ranks - inplace), log
    # each spec's kernel window (rank 0's trace, two calls a spec, in order): room to stage its
    # input (size elements of g: f32, f16, f32) only where some rank stages it
    windows = [int(m[1]) for m in re.finditer(r"rank 0 of \d+: symmetric .*, window (\d+) bytes", res.stderr)]
    assert len(windows) == 2 * len(specs), log
    for (spec_in, spec_out), (first, second) in zip([(4, 4), (2, 2), (4, 4)], zip(windows[::2], windows[1::2])):
        staged = size * spec_in if who != "all" else 0
        assert first == second == symmetric_window_bytes(staged, -(-size // ranks), spec_out), (windows, log)


GRID = re.compile(r"rank (\d+) of \d+: symmetric grid (\d+) blocks of \d+ threads, (\w+) path")


def _grids(stderr: str) -> dict[int, list[tuple[int, str]]]:
    """Each rank's symmetric kernel calls in order (COCONET_CUDA_FUSED_TRACE): (grid, path)."""
    out: dict[int, list[tuple[int, str]]] = {}
    for m in GRID.finditer(stderr):
        out.setdefault(int(m[1]), []).append((int(m[2]), m[3]))
    return out


Case = tuple[str | Path, str, str]  # (example name or .ccn path, program, schedule)


@pytest.fixture(scope="session")
def sym_modules():
    """sym_modules(threads, cases) -> {case: (module name, .so)}: the symmetric kernel's schedules
    (default SYM_CASES) built for the emulation (threads: with blocks of that many threads instead
    of 512, the runtime's compile-time switch COCONET_EMULATE_SYM_THREADS), each built once into
    the shared cache, two at a time."""
    from concurrent.futures import ThreadPoolExecutor

    def build(threads: int | None = None, cases: list[Case] | None = None) -> dict[Case, tuple[str, Path]]:
        cases = cases or SYM_CASES
        defines = (f"COCONET_EMULATE_SYM_THREADS={threads}",) if threads else ()
        with ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
            mods = pool.map(lambda c: compiler.build_emulated(_source(*c), f"sym_{c[1]}_{c[2]}", log=lambda msg: None,
                                                              defines=defines), cases)
            return dict(zip(cases, mods))
    return build


SYM_CASES: list[tuple[str | Path, str, str]] = [("adam", "adam", "fused"), ("clipped_sgd", "clipped_sgd", "fused"),
                                                ("mixed_adam", "mixed_adam", "zero"), ("sgd", "sgd", "fused")]
SMS = [3, 1, 2, 5]  # COCONET_EMULATE_SMS of the grid tests: rank r's multiprocessors


def _tile(file: str | Path, prog: str, sched: str, threads: int) -> int:
    """symmetric.cuh's sym_tile(V) for blocks of `threads`: threads x V in whole 16-element units
    (V: the program's generated launch, fused_symmetric<T, G, V>)."""
    from coconetc.codegen.naming import function_name
    cu = _source(file, prog, sched)
    m = re.compile(r"fused_symmetric<[^<>]+, (\d+)>\(").search(cu, cu.index(f"void {function_name(prog, sched)}("))
    assert m, (file, prog, sched)
    return -(-threads * int(m[1]) // 16) * 16


def _slices(n0: int, inner: int, ranks: int) -> list[int]:
    """Each rank's elements of a reduce-scatter of n0 rows of inner (slices.h: ceil(n0 / R) rows
    a rank, the last ones short or empty)."""
    c = -(-n0 // ranks)
    return [max(0, min(c, n0 - r * c)) * inner for r in range(ranks)]


def _grid(slices: list[int], tile: int, threads: int, sm_threads: int) -> int:
    """symmetric_grid: one block per tile of the largest slice, at most the smallest GPU's
    resident blocks (the SMS multiprocessors of sm_threads threads each)."""
    return max(1, min(-(-max(slices) // tile), min(SMS[:len(slices)]) * max(1, sm_threads // threads)))


def _sym_check(ranks: int, mods: dict[Case, tuple[str, Path]], sizes: list[int], extra: dict | None = None
               ) -> dict[Case, dict[int, list[tuple[int, str]]]]:
    """Calls of built symmetric-kernel modules, in one job (COCONET_CUDA_FUSED=symmetric, each
    module in turn, every size symbol at each size in turn) on ranks emulating SMS
    multiprocessors: every call matches the interpreter and every rank launches the same grids.
    Each module's (grid, path) per call, on each rank."""
    specs = ["|".join([str(_ccn(file)), prog, sched, str(so), name]) for (file, prog, sched), (name, so) in mods.items()]
    res = _launch(ranks, ["check", ",".join(map(str, sizes)), *specs],
                  env={"COCONET_CUDA_FUSED": "symmetric", "COCONET_CUDA_FUSED_TRACE": "1",
                       "COCONET_EMULATE_SMS": ",".join(map(str, SMS)), **(extra or {})}, timeout=300)
    log = f"--- stdout\n{res.stdout}\n--- stderr\n{res.stderr[-4000:]}"
    assert res.returncode == 0, log
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(("MATCH", "MISMATCH"))]
    assert len(lines) == len(sizes) * len(mods) and all(ln.startswith("MATCH ") for ln in lines), log
    grids = _grids(res.stderr)
    assert sorted(grids) == list(range(ranks)), log
    assert all(len(grids[r]) == len(sizes) * len(mods) for r in grids), log  # one kernel a call
    assert all([g for g, _ in grids[r]] == [g for g, _ in grids[0]] for r in grids), log
    n = len(sizes)
    return {case: {r: calls[k * n:(k + 1) * n] for r, calls in grids.items()} for k, case in enumerate(mods)}


SIZES_SYM = [10, 100, 1001, 4099, 8209]
# (threads a block: 2 compiled with -DCOCONET_EMULATE_SYM_THREADS=2, None the kernel's own 512;
# sizes; threads a multiprocessor; the rank counts; what the run must show at one size at least)
RUNS_SYM = {"many_blocks": (2, SIZES_SYM, 2048, (1, 3, 4), lambda grid, tiles: grid >= 100 and tiles <= grid),
            "many_tiles": (2, SIZES_SYM, 16, (1, 3, 4), lambda grid, tiles: tiles >= 10 * grid),
            "unedited_kernel": (None, [100003], 2048, (1, 4), lambda grid, tiles: tiles >= 4 * grid)}


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS_SYM)
def test_symmetric_kernel_many_blocks_same_grid_on_every_rank(sym_modules, run):
    """The grid is sized from the device and the same on every rank: one block per tile of the
    largest slice (a tile: the block's threads x V elements, in whole 16-element units), up to the
    smallest GPU's multiprocessors x resident blocks. The ranks emulate different multiprocessor
    counts (COCONET_EMULATE_SMS=3,1,2,5). With blocks of 2 threads (symmetric.cuh
    compiled with COCONET_EMULATE_SYM_THREADS=2; tiles of 16 elements) at sizes 10 .. 8209 on R = 1, 3 and 4 (uneven
    slices; R = 2 adds nothing R = 3 does not: the same smallest GPU, uneven slices too): many blocks (up to 514; a multiprocessor holds 1024 blocks of 2), then, with
    multiprocessors of 16 threads (COCONET_EMULATE_SM_THREADS), grids of 8 blocks (24 at R = 1)
    that take many tiles each (up to 22), the last one partial; with the unedited kernel (blocks
    of 512: 4 a multiprocessor) at 100003 elements the smallest GPU's 4 blocks bound the grid of
    every rank (12 on rank 0 alone, at R = 1; R = 1 and 4), 3 to 7 tiles a block. Every call matches the
    interpreter, every rank launches the grid expected for it, and both the vector and the
    element path run (slices that start off a vector boundary take the element path). One test
    for each of the three runs (RUNS_SYM), so that they run side by side."""
    threads, run_sizes, sm_threads, ranks_list, most = RUNS_SYM[run]
    mods = sym_modules(threads)
    paths, seen = set(), False
    for ranks in ranks_list:
        checked = _sym_check(ranks, mods, run_sizes, {"COCONET_EMULATE_SM_THREADS": str(sm_threads)})
        for case, grids in checked.items():
            tile = _tile(*case, threads or 512)
            for k, n in enumerate(run_sizes):
                sl = _slices(n, 1, ranks)
                want = _grid(sl, tile, threads or 512, sm_threads)
                assert grids[0][k][0] == want, (case, ranks, n, grids[0], want)
                seen |= most(want, -(-max(sl) // tile))
            paths |= {p for r in grids for _, p in grids[r]}
    assert seen, (threads, sm_threads)
    assert paths == {"vector", "element"}, paths


TILES = REPO / "tests" / "programs" / "sym_tiles.ccn"  # 2-d: avg f32, max bf16, min f16


# (threads a block, None: the kernel's own 512; rank counts; sizes N of the [N, N] tensors; threads
# a multiprocessor)
RUNS_TILES = {"blocks_of_2": (2, (2, 3), [7, 41], 2048), "many_tiles_a_block": (2, (2, 3), [7, 41], 16),
              "unedited_kernel": (None, (2, 4), [91], 2048)}


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS_TILES)
def test_symmetric_kernel_tiles_of_uneven_slices(sym_modules, run):
    """Slices that are no whole number of tiles, on ranks with fewer tiles than the grid has
    blocks (blocks with no tile; the grid is one block per tile of the largest slice): fused
    reduce-scatters along dim 0 of [N, N] tensors (slices of whole rows, the last rank's short),
    avg in f32, max in bf16, min in f16. With blocks of 2 threads (tiles of 16 elements) at N = 7
    (21, 21, 7 elements on 3 ranks: 2, 2, 1 tiles) and N = 41 (861, 820 on 2 ranks: 54, 52
    tiles), on multiprocessors of 2048 threads (a block a tile) and of 16 (8 blocks, many tiles
    each); with the unedited kernel (tiles of 2048 f32 or 4096 f16/bf16 elements) at N = 91 (4
    ranks: 2093, 2093, 2093, 2002 elements; 2 ranks: 4186, 4095). Every call matches the
    interpreter, on every rank with the grid expected for it, and in each run every program has a
    call in which some rank's slice is no whole number of tiles and has fewer tiles than the grid.
    One test a run, so that they run side by side."""
    threads, ranks_list, sizes, sm_threads = RUNS_TILES[run]
    cases = [(TILES, prog, "fused") for prog in ("avg2", "max2", "min2")]
    short: set[str] = set()
    mods = sym_modules(threads, cases)
    for ranks in ranks_list:
        checked = _sym_check(ranks, mods, sizes, {"COCONET_EMULATE_SM_THREADS": str(sm_threads)})
        for case, grids in checked.items():
            tile = _tile(*case, threads or 512)
            for k, n in enumerate(sizes):
                sl = _slices(n, n, ranks)
                grid = _grid(sl, tile, threads or 512, sm_threads)
                assert grids[0][k][0] == grid, (case, ranks, n, grids[0], grid)
                if any(m % tile and -(-m // tile) < grid for m in sl):
                    short.add(case[1])
    assert short == {"avg2", "max2", "min2"}, short


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_symmetric_vector_and_element_paths_match_interpreter(built, ranks):
    """The symmetric kernel on both of its paths against the interpreter (the worker's vector
    mode, COCONET_CUDA_FUSED=symmetric): every array at a 64-byte boundary (rank 0's slice, which
    starts there, takes the vector path: its reductions one vector load a peer, its stores and the
    gather's 16 bytes at a time; at R = 3 the other ranks' slices start off a vector boundary and
    take the element path in the same kernel), and every array one element off (the element path;
    at R = 1 no vector access at all)."""
    files = [str(EX / "adam.ccn"), str(EX / "mixed_adam.ccn"), str(EX / "clipped_sgd.ccn")]
    size = 40003
    for off in (0, 1):
        res = _launch(ranks, ["vector", str(size), str(off), *files],
                      env={"COCONET_CUDA_FUSED": "symmetric", "COCONET_CUDA_FUSED_TRACE": "1"})
        out = res.stdout
        log = f"--- stdout\n{out}\n--- stderr\n{res.stderr[-4000:]}"
        assert res.returncode == 0, log
        lines = [ln for ln in out.splitlines() if ln.startswith(("MATCH", "MISMATCH"))]
        assert len(lines) >= 6 and all(ln.startswith("MATCH ") for ln in lines), log
        assert res.stderr.count(SYMMETRIC) == 4 * ranks, log  # adam zero, fused; mixed_adam zero; clipped_sgd fused
        for file, prog, sched in [("adam.ccn", "adam", "fused"), ("adam.ccn", "adam", "zero"),
                                  ("mixed_adam.ccn", "mixed_adam", "zero"), ("clipped_sgd.ccn", "clipped_sgd", "fused")]:
            c = _counts(out, file, prog, sched, off)
            if off == 0:
                assert c["vector_kernels"] >= 1 and c["vector_accesses"] >= size // 8 // ranks, (file, sched, c)
            elif ranks == 1:
                assert c["vector_kernels"] == 0 and c["vector_accesses"] == 0, (file, sched, c)
            elif file != "clipped_sgd.ccn":  # (which reads only the window and aligned scratch: vectors on rank 0)
                # the element path; the gather copies a peer's part 16 bytes at a time where it is aligned
                assert c["vector_kernels"] == 0, (file, sched, c)
        paths = {p for r, calls in _grids(res.stderr).items() for _, p in calls}
        assert "vector" in paths if off == 0 else "element" in paths, (paths, log)
        if ranks > 1:  # rank 1's slice starts off a vector boundary (40003 / R elements, rounded up)
            assert "element" in {p for _, p in _grids(res.stderr)[1]}, log


@pytest.mark.slow
def test_symmetric_kernel_is_chosen_at_run_time(built):
    """auto: where both algorithms can run (the device API, every rank of the group in one LSA
    team; one rank too) a unit's first call runs the symmetric kernel, the first of auto's
    measured trials (test_symmetric_choice_is_measured_and_agreed); the pipeline when the ranks
    are emulated as nodes of one rank each (COCONET_EMULATE_LSA_SIZE=1), or without the device
    API; pipeline forces the pipeline; symmetric where it cannot run raises on every rank."""
    for ranks in (1, 2):
        res, log, lines = _sym_run(ranks, 10, "auto")
        assert res.returncode == 0 and lines and all(ln.startswith("MATCH ") for ln in lines), log
        assert res.stderr.count(SYMMETRIC + " (trial 1 of 8)") == SYM_UNITS * ranks, log
        assert "runs the pipeline" not in res.stderr, log
    for ranks, algo, extra in [(2, "auto", {"COCONET_EMULATE_LSA_SIZE": "1"}),
                               (2, "auto", {"COCONET_EMULATE_NO_DEVICE_API": "1"}), (2, "pipeline", {})]:
        res, log, lines = _sym_run(ranks, 10, algo, extra=extra)
        assert res.returncode == 0 and all(ln.startswith("MATCH ") for ln in lines), log
        assert res.stderr.count("runs the pipeline\n") == SYM_UNITS * ranks and SYMMETRIC not in res.stderr, log
    res, log, _ = _sym_run(2, 10, "symmetric", extra={"COCONET_EMULATE_LSA_SIZE": "1"})
    assert res.returncode != 0, log
    assert "COCONET_CUDA_FUSED=symmetric, but fused fused0 cannot run over symmetric memory: not every rank" in log


CHOICE = re.compile(r"rank (\d+) of \d+: fused0 runs the (symmetric kernel|pipeline) \((trial \d of 8(?:, timed)?|measured: "
                    r"symmetric [\d.]+ ms, pipeline [\d.]+ ms)\)")
SLOWEST = re.compile(r"rank (\d+) of \d+: measured here .*; slowest rank's symmetric ([\d.]+) ms, pipeline ([\d.]+) ms")


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 3])
def test_symmetric_choice_is_measured_and_agreed(sym_modules, ranks):
    """auto where both algorithms can run: a unit's first 8 calls at a size alternate the symmetric
    kernel and the pipeline (all but the first two timed by events, three of each), then every
    later call at that size runs the faster by the slowest rank's medians (an ncclMax over the
    ranks): every rank prints the same agreed times, takes the same decision, the one those times
    give, at each size on its own (10 and 1001 elements, 10 calls each), and every call matches
    the interpreter."""
    mods = sym_modules(None, [("sgd", "sgd", "fused"), ("mixed_adam", "mixed_adam", "zero")])
    sizes = ",".join(["10"] * 10 + ["1001"] * 10)
    for (file, prog, sched), (name, so) in mods.items():
        res = _launch(ranks, ["check", sizes, "|".join([str(_ccn(file)), prog, sched, str(so), name])],
                      env={"COCONET_CUDA_FUSED": "auto", "COCONET_CUDA_FUSED_TRACE": "1"}, timeout=300)
        log = f"--- stdout\n{res.stdout}\n--- stderr\n{res.stderr[-4000:]}"
        assert res.returncode == 0, log
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith(("MATCH", "MISMATCH"))]
        assert len(lines) == 20 and all(ln.startswith("MATCH ") for ln in lines), log
        runs: dict[int, list[tuple[str, str]]] = {}
        for m in CHOICE.finditer(res.stderr):
            runs.setdefault(int(m[1]), []).append((m[2], m[3].split(":")[0].split(" of")[0]))
        slowest: dict[int, list[tuple[str, str]]] = {}
        for m in SLOWEST.finditer(res.stderr):
            slowest.setdefault(int(m[1]), []).append((m[2], m[3]))
        assert sorted(runs) == sorted(slowest) == list(range(ranks)), log
        assert all(runs[r] == runs[0] and slowest[r] == slowest[0] for r in runs), log  # every rank the same
        assert len(slowest[0]) == 2, log  # one decision a size
        trials = [("symmetric kernel" if t % 2 else "pipeline", f"trial {t}") for t in range(1, 9)]
        for k, (sym_ms, pipe_ms) in enumerate(slowest[0]):
            calls = runs[0][10 * k:10 * k + 10]
            want = "symmetric kernel" if float(sym_ms) <= float(pipe_ms) else "pipeline"
            assert calls == trials + [(want, "measured")] * 2, (calls, sym_ms, pipe_ms, log)


@pytest.mark.slow
def test_symmetric_kernel_wrong_reduction_is_found(tmp_path, sym_modules):
    """The comparison can fail: unchanged, sgd fused matches on 2 ranks; with the kernel's
    reduction over peers cut to this rank's own input (an edit of symmetric.cuh, in code only the
    module's kernel runs: the installed runtime's binding serves) it mismatches."""
    from coconetc.paths import runtime_dir
    rt = tmp_path / "runtime"
    shutil.copytree(runtime_dir(), rt)
    sym = rt / "coconet" / "cuda" / "symmetric.cuh"
    text = sym.read_text()
    assert text.count("for (int p = 1; p < R; ++p)") == 2  # SymThread::reduce and vreduce
    sym.write_text(text.replace("for (int p = 1; p < R; ++p)", "for (int p = 1; p < 1; ++p)"))
    case = ("sgd", "sgd", "fused")
    edited = compiler.build_emulated(_source(*case), "sym_sgd", tmp_path / "b", runtime=rt, log=lambda msg: None,
                                     installed_binding=True)
    for (name, so), verdict in [(sym_modules(None, [case])[case], "MATCH "), (edited, "MISMATCH ")]:
        res = _launch(2, ["check", "10", "|".join([str(EX / "sgd.ccn"), "sgd", "fused", str(so), name])],
                      env={"COCONET_CUDA_FUSED": "symmetric"}, timeout=300)
        assert res.returncode == 0 and verdict in res.stdout, res.stdout + res.stderr


@pytest.mark.slow
def test_symmetric_kernel_with_nccl_2_28(tmp_path):
    """NCCL 2.28 (the NCCL torch 2.11 pins) has no ncclCommQueryProperties and no requirements
    initializer: symmetric.cuh then probes by making the device communicator. Emulated with those
    two taken out of the emulation's NCCL: sgd fused runs the symmetric kernel and matches on 2
    ranks; without the device API, auto falls back to the pipeline and still matches."""
    from coconetc.paths import runtime_dir
    rt = tmp_path / "runtime"
    shutil.copytree(runtime_dir(), rt)
    dev = rt / "coconet" / "cuda" / "emulate_nccl_device.h"
    dev.write_text("#define COCONET_EMULATE_NCCL_2_28 1\n" + dev.read_text())
    name, so = compiler.build_emulated(_source("sgd", "sgd", "fused"), "sym_nccl228", tmp_path / "b", runtime=rt,
                                         log=lambda msg: None)
    for extra, want in [({"COCONET_CUDA_FUSED": "symmetric"}, SYMMETRIC),
                        ({"COCONET_CUDA_FUSED": "auto", "COCONET_EMULATE_NO_DEVICE_API": "1"}, "runs the pipeline")]:
        res = _launch(2, ["check", "10", "|".join([str(EX / "sgd.ccn"), "sgd", "fused", str(so), name])],
                      env={"COCONET_CUDA_FUSED_TRACE": "1", **extra}, timeout=300)
        out = res.stdout + res.stderr
        assert res.returncode == 0 and "MATCH " in res.stdout and "MISMATCH" not in res.stdout, out
        assert res.stderr.count(want) == 2, out


@pytest.mark.slow
def test_symmetric_window_is_race_checked(tmp_path):
    """The race detection sees the kernel's reads of the symmetric window: with the copy into the
    window moved to the comm stream (no event orders it before the kernel), both ranks report it."""
    from coconetc.paths import runtime_dir
    rt = tmp_path / "runtime"
    shutil.copytree(runtime_dir(), rt)
    sym = rt / "coconet" / "cuda" / "symmetric.cuh"
    old = "cudaMemcpyAsync(buf + kSymHead, x, in_bytes, cudaMemcpyDeviceToDevice, c.stream)"
    assert old in sym.read_text()
    sym.write_text(sym.read_text().replace(old, old.replace("c.stream", "c.comm_stream")))
    name, so = compiler.build_emulated(_source("sgd", "sgd", "fused"), "sym_race", tmp_path / "b", runtime=rt,
                                         log=lambda msg: None)
    res = _launch(2, ["race", str(EX / "sgd.ccn"), "sgd", "fused", str(so), name, "10"],
                  env={"COCONET_CUDA_FUSED": "symmetric"}, timeout=300)
    out = res.stdout + res.stderr
    assert "race on buffer 'the symmetric window'" in out and "cudaMemcpyAsync on the comm stream" in out, out
