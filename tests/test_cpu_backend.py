"""The CPU backend end to end: every example's programs and schedules, compiled to C++, built
with CMake and run under mpiexec on 1-4 ranks, against the reference interpreter; the calling
convention of a loaded module (argument checks, in-place updates, no copies, PyTorch tensors);
cross-rank argument errors; the build cache.

Building every example takes a few minutes the first time (about 20 s a file on 2 cores); the
modules are cached under the pytest cache (.pytest_cache/d/coconet-build), so later runs only
import them (unless the compiler or the runtime headers changed, which changes the cache key)."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from coconetc.toolchain import probes
from coconetc.launch.mpiexec import run_python
from coconetc.sourcefile import load_file
from coconetc.interp.values import TOLERANCE
import rank_pool

REPO = Path(__file__).resolve().parents[1]
# Files whose compiled runs are tested elsewhere, not in this file's matrix: gpt_pipeline.ccn is
# gpt_block.ccn's block repeated over 4 layers (a build of 4 blocks, 5 times: one per schedule,
# which differ only in their pipeline directive); test_train_gpt.py trains it compiled, through
# its pipeline schedule, against one process, and test_program_calls.py runs repeats compiled.
# sharded_mlp.ccn's overlaps (a gathered weight as a matmul's right operand, a weight gradient's
# matmul_tn with its reduce-scatter) are those of tests/programs/gather_matmul.ccn's fsdp and
# fsdp_cols, which test_gather_matmul.py runs compiled (CPU and CUDA emulation) on 2 and 3 ranks.
ELSEWHERE = {"gpt_pipeline.ccn", "sharded_mlp.ccn"}
EXAMPLES = sorted(p for p in (REPO / "examples").glob("*.ccn") if p.name not in ELSEWHERE)
_loaded = cache(load_file)  # each example parsed and planned once for the matrices below (collection)
CALLS_WORKER = Path(__file__).with_name("cpu_calls_worker.py")
RUN_JOBS = Path(__file__).with_name("run_jobs_worker.py")
LAUNCH_TIMEOUT = 240  # s; generous: a rank rebuilds if the compiler changed since the fixture ran

# --- sizes -------------------------------------------------------------------------------------
# Per program: sizes that 2, 3 and 4 do not divide (with R = 4 several of them leave the last
# rank a short or an empty slice), and the symbols that end up sliced across the ranks of a
# group (by a layout or by a split). For the second launch those become `group size - 1`: one
# rank of each group holds an empty slice.
SIZES: dict[str, tuple[dict[str, int], tuple[str, ...]]] = {
    "adam": ({"N": 13}, ("N",)),
    "mixed_adam": ({"N": 13}, ("N",)),
    "mixed_adam_bf16": ({"N": 13}, ("N",)),
    "sgd": ({"N": 17}, ("N",)),
    "lamb": ({"N": 17}, ("N",)),
    "conv_layer": ({"N": 7, "C": 2, "H": 5, "W": 4, "O": 3}, ("N",)),
    "conv_tp": ({"N": 2, "C": 5, "H": 5, "W": 4, "O": 7}, ("C", "O")),
    "attn_out": ({"B": 2, "S": 5, "H": 6}, ("S",)),
    "mlp_out": ({"B": 2, "S": 5, "K": 7, "H": 6}, ("S", "K")),
    "stage": ({"B": 5, "H": 6}, ("B",)),
    "f1": ({"B": 2, "S": 5, "H": 6}, ("S",)),
    "collectives": ({"N": 7, "M": 5}, ("N", "M")),
    "clipped_sgd": ({"N": 17}, ("N",)),
    "adamw": ({"N": 17}, ("N",)),
    "adamw_shard": ({"N": 17}, ("N",)),
    "adamw_whole": ({"N": 17}, ("N",)),
    "scaled_adam": ({"N": 17}, ("N",)),
    "amax_scale": ({"N": 17}, ("N",)),
    "row_parallel": ({"B": 2, "S": 5, "K": 7, "H": 4}, ("K", "H")),
    "col_parallel": ({"M": 5, "K": 3, "H": 7}, ("H",)),
    "mp_layer": ({"B": 5, "K": 7, "H": 4}, ("B", "K")),
    "tp_mlp": ({"B": 2, "S": 5, "H": 4, "F": 7}, ("F", "S")),
    "sp_block": ({"B": 2, "S": 5, "H": 4, "F": 7}, ("F", "S")),
    "tp_mlp_grad": ({"B": 2, "S": 5, "H": 4, "F": 7}, ("F", "S")),  # the derived program's schedules
    "tp_block": ({"B": 2, "S": 5, "H": 4, "F": 7}, ("F", "S")),
    "tp_block_grad": ({"B": 2, "S": 5, "H": 4, "F": 7}, ("F", "S")),
    "gpt_block": ({"B": 2, "S": 5, "H": 6, "NH": 4, "HD": 1, "F": 7}, ("NH", "F", "S")),  # HD = 1: any heads on any ranks
    "gpt_block_sp": ({"B": 2, "S": 5, "H": 6, "NH": 4, "HD": 1, "F": 7}, ("NH", "F", "S")),  # S: x and y sliced
    "gpt_block_grad": ({"B": 2, "S": 5, "H": 6, "NH": 4, "HD": 1, "F": 7}, ("NH", "F", "S")),
    "gpt_block_sp_grad": ({"B": 2, "S": 5, "H": 6, "NH": 4, "HD": 1, "F": 7}, ("NH", "F", "S")),
}
GROUPS = {"pipeline.ccn": 2}  # files whose programs run in groups
# Files whose compiled programs run in `make test` only: gpt_block.ccn's 12 functions are a third
# of the examples' build; the quick set compiles the block's operations in tests/test_block_ops.py.
SLOW_FILES = {"gpt_block.ccn"}
RANKS = {"pipeline.ccn": (2, 4)}  # default: 1, 2, 3, 4


def _size_label(sizes: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in sizes.items())


def _matrix():
    """(file, program, schedules, ranks, groups, sizes) for every launch, with readable ids."""
    for f in EXAMPLES:
        mod = _loaded(f)
        groups = GROUPS.get(f.name, 1)
        for prog in mod.programs:
            scheds = ["default", *(s for s, x in mod.schedules.get(prog, {}).items() if not x.auto)]
            big, sliced = SIZES.get(prog, ({}, ()))
            for ranks in RANKS.get(f.name, (1, 2, 3, 4)):
                gs = ranks // groups
                configs = [big]
                if gs >= 2:
                    configs.append({**big, **{s: gs - 1 for s in sliced}})
                for sizes in configs:
                    yield pytest.param(f, prog, scheds, ranks, groups, sizes,
                                       id=f"{f.name}-{prog}-R{ranks}-{_size_label(sizes)}")


MATRIX = list(_matrix())


def _chunked_matrix():
    """The fused-collective and overlap schedules on 3 ranks with 2-element chunks
    (COCONET_CHUNK), so that they run through many chunks, not the one the sizes above give."""
    for f in EXAMPLES:
        mod = _loaded(f)
        groups = GROUPS.get(f.name, 1)
        ranks = 3 * groups
        for prog, scheds in mod.schedules.items():
            names = [s for s, x in scheds.items() if not x.auto and any(
                type(d).__name__ in ("Fuse", "OverlapD") for d in x.directives)]
            if names:
                sizes = SIZES.get(prog, ({}, ()))[0]
                yield pytest.param(f, prog, names, ranks, groups, sizes,
                                   id=f"{f.name}-{prog}-R{ranks}-{_size_label(sizes)}-chunk2")


CHUNKED = list(_chunked_matrix())


# --- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def modules(request):
    """Every example the session's tests of this file run built once and imported
    here, so that the ranks only import (any other on first use). The map holds each file's
    loaded module or the exception building or importing it raised (reported by the tests that
    use that file)."""
    import coconetc
    from coconetc.runtime.loader import compile_cpu
    probes.toolchain(), probes.compiler_hash()  # computed once, before the threads

    def build(f: Path):  # one compiler process per core: the files build side by side
        try:
            return compile_cpu(load_file(f), log=lambda msg: None)
        except Exception as err:  # noqa: BLE001 - each test reports its own file's failure
            return err

    def load(f: Path, built):
        try:
            if isinstance(built, Exception):
                raise built
            return coconetc.load(f, log=lambda msg: None)  # cached: imports only
        except Exception as err:  # noqa: BLE001
            return err

    class Modules(dict):
        def __missing__(self, name: str):
            f = next(f for f in EXAMPLES if f.name == name)
            self[name] = load(f, build(f))
            return self[name]

    wanted = _files_run(request.session.items) | {"adam.ccn", "sgd.ccn", "lamb.ccn", "layernorm.ccn"}
    todo = [f for f in EXAMPLES if f.name in wanted]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        builds = list(pool.map(build, todo))
    yield Modules({f.name: load(f, b) for f, b in zip(todo, builds)})


def _files_run(items) -> set[str]:
    """The examples the selected tests of this file call (their `jobs` or `file` parameter)."""
    out = set()
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.module.__name__ == __name__:
            out |= {job[0].name for job in params.get("jobs", ())}
            out |= {params["file"].name} if "file" in params else set()
    return out


def _module(modules, name: str):
    got = modules[name]
    if isinstance(got, Exception):
        pytest.fail(f"building or importing {name} failed: {type(got).__name__}: {got}")
    return got


@pytest.fixture(scope="session")
def adam_mod(modules):
    return _module(modules, "adam.ccn")


# --- every program and schedule under mpiexec ----------------------------------------------------
def test_matrix_covers_every_program():
    """A program added to an example without sizes here would run with the default size only."""
    programs = {p for f in EXAMPLES for p in _loaded(f).programs}
    assert programs <= set(SIZES), f"add sizes for {sorted(programs - set(SIZES))}"


def _launches(params, per: int = 12) -> list:
    """The jobs of PARAMS grouped into launches of at most PER jobs on the same number of ranks
    (one mpiexec start, import and load for many programs), with readable ids."""
    by_ranks: dict[tuple[bool, int], list] = {}
    for p in params:
        by_ranks.setdefault((p.values[0].name in SLOW_FILES, p.values[3]), []).append(p.values)
    out = []
    for (slow, ranks), jobs in sorted(by_ranks.items()):
        for k in range(0, len(jobs), per):
            part = jobs[k:k + per]
            out.append(pytest.param(ranks, part, id=f"R{ranks}-{part[0][1]}..{part[-1][1]}",
                                    marks=[pytest.mark.slow] if slow else []))
    return out


@pytest.mark.parametrize("ranks, jobs", _launches(MATRIX))
def test_schedules_match_interpreter(modules, ranks, jobs):
    _check_jobs(modules, ranks, jobs)


@pytest.mark.parametrize("ranks, jobs", _launches(CHUNKED))
def test_fused_schedules_in_small_chunks(modules, monkeypatch, ranks, jobs):
    monkeypatch.setenv("COCONET_CHUNK", "2")
    _check_jobs(modules, ranks, jobs)


def test_chunked_matrix_is_not_empty():
    assert {p.values[1] for p in CHUNKED} >= {"adam", "sgd", "lamb", "mlp_out"}


def _check_jobs(modules, ranks, jobs):
    """One mpiexec launch for JOBS ((file, program, schedules, ranks, groups, sizes) each, in
    turn: tests/run_jobs_worker.py); every schedule of every job must match the interpreter."""
    argv: list[str] = [str(RUN_JOBS)]
    for file, program, schedules, _, groups, sizes in jobs:
        _module(modules, file.name)
        argv += [str(file), "--program", program, "--reps", "1", "--groups", str(groups)]
        for s in schedules:
            argv += ["--schedule", s]
        for k, v in sizes.items():
            argv += ["--size", f"{k}={v}"]
        argv.append("--")
    rc, out, err = rank_pool.run(ranks, argv, timeout=LAUNCH_TIMEOUT + 10 * len(jobs))
    log = f"--- stdout\n{out}\n--- stderr\n{err[-4000:]}"
    assert rc == 0, f"worker exited with {rc}\n{log}"
    results = [ln for ln in out.splitlines() if re.match(r"\S+ \[[^\]]+\]: \d+ ranks:", ln)]
    want = [f"{program} [{s}]: {ranks} ranks:" for _, program, schedules, *_ in jobs for s in schedules]
    assert len(results) == len(want), f"{len(results)} result lines for {len(want)} schedules\n{log}"
    for line, head in zip(results, want):  # in the order the jobs ran
        assert line.startswith(head), f"{head} expected, got {line}\n{log}"
        assert line.endswith("matches the interpreter on every rank"), f"{line}\n{log}"


# --- the calling convention, in this process (one rank) ------------------------------------------
N = 13


def _adam_args(seed: int = 0, n: int = N) -> dict:
    rng = np.random.default_rng(seed)
    arrays = {k: rng.uniform(0.5, 1.5, n).astype(np.float32) for k in ("g", "w", "m", "v")}
    return dict(**arrays, lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, step=3.0)


def _snapshot(args: dict) -> dict:
    return {k: copy.deepcopy(v) for k, v in args.items()}


def _assert_unchanged(before: dict, after: dict) -> None:
    for k, v in before.items():
        if isinstance(v, list):
            assert all(np.array_equal(a, b) for a, b in zip(v, after[k])), f"'{k}' was modified"
        elif isinstance(v, np.ndarray):
            assert np.array_equal(v, after[k]), f"'{k}' was modified by a call that failed"
        elif type(v).__module__.startswith("torch"):
            assert np.array_equal(v.numpy(), after[k].numpy()), f"'{k}' was modified"


def test_signature_shows_sliced_state(adam_mod):
    sig = adam_mod.adam.signature("zero")
    assert sig["m"] == "f32[N] sliced(0)" and sig["v"] == "f32[N] sliced(0)"
    assert sig["g"] == "f32[N] local" and sig["w"] == "f32[N] replicated"
    assert sig["lr"] == "f32"
    assert adam_mod.adam.signature()["m"] == "f32[N] replicated"
    assert set(adam_mod.programs) == {"adam"}
    assert {"default", "rs_c_ag", "zero", "fused"} <= set(adam_mod.adam.schedules)


def _torch_strided():
    torch = pytest.importorskip("torch")
    return torch.from_numpy(np.ones(2 * N, np.float32))[::2]


BAD_CALLS = {
    # id: (changes to the arguments, schedule, expected exception, words its message must hold)
    "dtype": (lambda a: a.update(g=a["g"].astype(np.float64)), "zero", TypeError, ["'g'", "f32"]),
    "scalar-type": (lambda a: a.update(lr="0.1"), "zero", TypeError, ["'lr'"]),
    "ndim": (lambda a: a.update(w=a["w"].reshape(1, N)), "zero", ValueError, ["'w'"]),
    "size-symbol": (lambda a: a.update(v=np.ones(N + 1, np.float32)), "default", ValueError,
                    ["'v'", "N"]),
    "size-symbol-sliced": (lambda a: a.update(m=np.ones(N - 1, np.float32)), "zero", ValueError,
                           ["'m'"]),
    "non-contiguous-numpy": (lambda a: a.update(m=np.ones(2 * N, np.float32)[::2]), "zero",
                             ValueError, ["'m'", "contiguous"]),
    "non-contiguous-torch": (lambda a: a.update(m=_torch_strided()), "zero", ValueError,
                             ["'m'", "contiguous"]),
    "missing": (lambda a: a.pop("v"), "zero", TypeError, ["'v'"]),
    "unknown-keyword": (lambda a: a.update(momentum=0.9), "zero", TypeError, ["momentum"]),
    "unknown-schedule": (lambda a: None, "zero_plus", ValueError, ["zero_plus", "zero"]),
    "read-only-update": (lambda a: a["w"].setflags(write=False), "zero", ValueError, ["'w'"]),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_arguments_raise_and_touch_nothing(adam_mod, case):
    change, schedule, exc, words = BAD_CALLS[case]
    args = _adam_args()
    change(args)
    before = _snapshot(args)
    with pytest.raises(exc) as info:
        adam_mod.adam(schedule=schedule, **args)
    for w in words:
        assert w in str(info.value), f"{info.value!s} does not mention {w}"
    _assert_unchanged(before, args)


def test_groups_that_do_not_divide_the_ranks(adam_mod):
    args = _adam_args()
    before = _snapshot(args)
    with pytest.raises(ValueError, match="groups"):
        adam_mod.adam(schedule="zero", groups=2, **args)
    _assert_unchanged(before, args)


def _reference(adam_mod, args: dict) -> dict:
    from coconetc.interp.interpreter import run
    plain = {k: (v.numpy().copy() if hasattr(v, "numpy") else copy.deepcopy(v))
             for k, v in args.items()}
    return run(adam_mod.source_module.programs["adam"], [plain])[0].updates


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("schedule", ["default", "rs_c_ag", "zero", "fused"])
def test_updates_in_place_without_copies(adam_mod, kind, schedule):
    """On one rank a sliced parameter's slice is the whole tensor, so every schedule takes the
    same arguments. The updated parameters are written into the caller's buffers."""
    args = _adam_args(seed=7)
    if kind == "torch":
        torch = pytest.importorskip("torch")
        args.update({k: torch.from_numpy(args[k].copy()) for k in ("g", "w", "m", "v")})
        ptr = {k: args[k].data_ptr() for k in ("g", "w", "m", "v")}
        view = {k: args[k].numpy() for k in ("g", "w", "m", "v")}
    else:
        ptr = {k: args[k].ctypes.data for k in ("g", "w", "m", "v")}
        view = {k: args[k] for k in ("g", "w", "m", "v")}
    before = {k: view[k].copy() for k in view}
    want = _reference(adam_mod, args)
    out = adam_mod.adam(schedule=schedule, **args)
    assert out is None  # adam has no `return`: its results are the in-place updates
    now = {k: (args[k].data_ptr() if kind == "torch" else args[k].ctypes.data) for k in ptr}
    assert now == ptr, "a parameter was replaced instead of updated in place"
    assert np.array_equal(view["g"], before["g"]), "g is not updated and must not change"
    rtol, atol = TOLERANCE["f32"]
    for k in ("w", "m", "v"):
        assert not np.array_equal(view[k], before[k]), f"{k} was not updated"
        np.testing.assert_allclose(view[k], want[k], rtol=rtol, atol=atol, err_msg=k)


def _segments(rng, sizes):
    return [rng.uniform(0.5, 1.5, n).astype(np.float32) for n in sizes]


def _lamb_convention(arrays: dict, schedule: str) -> dict:
    """zero slices m and v (one rank: its slice is everything): plain arrays, not segments."""
    if schedule != "zero":
        return dict(arrays)
    return {**arrays, **{k: np.concatenate(arrays[k]) if isinstance(arrays[k], list) else arrays[k]
                         for k in ("m", "v")}}


LAMB_SCALARS = dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.01, step=2.0)
SCATTERED_CASES = {
    # id: segment sizes of (g, w, m, v) (None: one plain array), words the ValueError must hold
    "w-cut-differently": (([5, 12], [6, 11], [5, 12], [5, 12]), ["'w'", "'g'"]),
    "list-against-array": (([5, 12], None, None, None), ["'w'"]),
}


@pytest.mark.parametrize("schedule", ["default", "rs_c_ag", "zero"])
@pytest.mark.parametrize("case", list(SCATTERED_CASES))
def test_scattered_segments_must_agree(modules, case, schedule):
    """lamb's scattered parameters: every one of a call must have the same segment sizes."""
    fn = _module(modules, "lamb.ccn").lamb
    rng = np.random.default_rng(0)
    cuts, words = SCATTERED_CASES[case]
    arrays = {k: _segments(rng, c) if c is not None else _segments(rng, [17])[0]
              for k, c in zip("gwmv", cuts)}
    args = {**_lamb_convention(arrays, schedule), **LAMB_SCALARS}
    before = _snapshot(args)
    with pytest.raises(ValueError) as info:
        fn(schedule=schedule, **args)
    for w in words:
        assert w in str(info.value), f"{info.value!s} does not mention {w}"
    _assert_unchanged(before, args)


def test_scattered_segment_must_be_1d(modules):
    fn = _module(modules, "lamb.ccn").lamb
    rng = np.random.default_rng(0)
    arrays = {k: _segments(rng, [5, 12]) for k in "gwmv"}
    arrays["g"] = [x.reshape(1, -1) for x in arrays["g"]]
    args = {**arrays, **LAMB_SCALARS}
    before = _snapshot(args)
    with pytest.raises(ValueError, match="'g'"):
        fn(**args)
    _assert_unchanged(before, args)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("schedule", ["default", "rs_c_ag", "zero"])
def test_scattered_updates_in_place(modules, schedule, kind):
    """A list of per-layer buffers is updated in place, segment by segment, as the interpreter
    computes it (one rank)."""
    from coconetc.interp.interpreter import run
    mod = _module(modules, "lamb.ccn")
    rng = np.random.default_rng(3)
    arrays = _lamb_convention({k: _segments(rng, [3, 1, 9, 4]) for k in "gwmv"}, schedule)
    want = run(mod.lamb.schedules[schedule], [{**copy.deepcopy(arrays), **LAMB_SCALARS}])[0].updates
    if kind == "torch":
        torch = pytest.importorskip("torch")
        arrays = {k: [torch.from_numpy(x) for x in v] if isinstance(v, list) else torch.from_numpy(v)
                  for k, v in arrays.items()}
    ptrs = {k: [x.ctypes.data for x in v] if kind == "numpy" else [x.data_ptr() for x in v]
            for k, v in arrays.items() if isinstance(v, list)}
    mod.lamb(schedule=schedule, **arrays, **LAMB_SCALARS)
    rtol, atol = TOLERANCE["f32"]
    for k in ("w", "m", "v"):
        v = arrays[k]
        got = np.concatenate([np.asarray(x) for x in v]) if isinstance(v, list) else np.asarray(v)
        np.testing.assert_allclose(got, want[k], rtol=rtol, atol=atol, err_msg=k)
        if isinstance(v, list):
            now = [x.ctypes.data for x in v] if kind == "numpy" else [x.data_ptr() for x in v]
            assert now == ptrs[k], f"{k}'s segments were replaced"


def test_torch_in_torch_out(modules):
    """Returned outputs come back as tensors when the inputs were tensors."""
    torch = pytest.importorskip("torch")
    from coconetc.oracle.inputs import random_inputs
    from coconetc.interp.interpreter import run
    fn = _module(modules, "layernorm.ccn").attn_out
    inputs = random_inputs(fn.schedules["default"], 1, 1, {"B": 2, "S": 5, "H": 6}, seed=4)[0]
    want = run(fn.schedules["default"], [copy.deepcopy(inputs)])[0].outputs
    rtol, atol = TOLERANCE["f32"]
    for schedule in fn.schedules:
        out, h = fn(schedule=schedule, **{k: torch.from_numpy(v.copy()) for k, v in inputs.items()})
        assert isinstance(out, torch.Tensor) and isinstance(h, torch.Tensor), schedule
        np.testing.assert_allclose(out.numpy(), want["out"], rtol=rtol, atol=atol, err_msg=schedule)
        np.testing.assert_allclose(h.numpy(), want["h"], rtol=rtol, atol=atol, err_msg=schedule)
        out_np, h_np = fn(schedule=schedule, **copy.deepcopy(inputs))
        assert isinstance(out_np, np.ndarray) and isinstance(h_np, np.ndarray), schedule


def test_large_outputs_reuse_memory_only_once_given_back(modules, monkeypatch):
    """Outputs of 1 MiB or more come from memory an earlier output gave back (host_blocks):
    a second call's outputs land where the first call's were once those are gone, never while
    a view of them (a torch tensor included) lives, and each call's values are its own."""
    torch = pytest.importorskip("torch")
    from coconetc.oracle.inputs import random_inputs
    from coconetc.interp.interpreter import run
    from coconetc.runtime import host_blocks
    monkeypatch.setitem(host_blocks._state, "limit", 1 << 30)
    fn = _module(modules, "layernorm.ccn").attn_out
    ir = fn.schedules["default"]
    sizes = {"B": 4, "S": 256, "H": 256}  # each output 1 MiB of f32
    calls = [random_inputs(ir, 1, 1, sizes, seed=s)[0] for s in (7, 8, 9)]
    wants = [run(ir, [copy.deepcopy(x)])[0].outputs for x in calls]
    rtol, atol = TOLERANCE["f32"]

    def check(outs, want, what):
        for got, name in zip(outs, ("out", "h")):
            np.testing.assert_allclose(np.asarray(got), want[name], rtol=rtol, atol=atol, err_msg=f"{what}: {name}")
    first = fn(**copy.deepcopy(calls[0]))
    check(first, wants[0], "first call")
    where = {a.ctypes.data for a in first}
    held = torch.from_numpy(first[1][1:])  # a view of h: h's memory is not given back
    del first
    second = fn(**copy.deepcopy(calls[1]))
    check(second, wants[1], "second call")
    np.testing.assert_allclose(held.numpy(), wants[0]["h"][1:], rtol=rtol, atol=atol, err_msg="the held view of h")
    now = {a.ctypes.data for a in second}
    assert len(now & where) == 1, "out's memory, given back, was not reused (or h's, still held, was)"
    kept = host_blocks.kept_bytes()
    del second, held
    assert host_blocks.kept_bytes() - kept >= 3 << 20, "the three outputs' memory was not kept"
    third = fn(**copy.deepcopy(calls[2]))
    check(third, wants[2], "third call")
    assert {a.ctypes.data for a in third} <= where | now
    import coconetc
    kept = host_blocks.kept_bytes()
    assert coconetc.empty_cache() == kept >= 1 << 20 and host_blocks.kept_bytes() == 0  # third's are alive
    del third
    assert host_blocks.kept_bytes() >= 2 << 20  # and given back when they die
    monkeypatch.setitem(host_blocks._state, "limit", 0)  # COCONET_HOST_CACHE_MB=0: NumPy's own arrays
    assert all(a.base is None for a in fn(**copy.deepcopy(calls[0])))


@pytest.mark.parametrize("text", ["lots", "-1"])
def test_host_cache_limit_must_be_a_size(monkeypatch, text):
    from coconetc.runtime import host_blocks
    monkeypatch.setenv("COCONET_HOST_CACHE_MB", text)
    monkeypatch.setitem(host_blocks._state, "limit", -1)
    with pytest.raises(ValueError, match="COCONET_HOST_CACHE_MB"):
        host_blocks.empty((1 << 20,), np.float32)


def _repeat_sizes(big: dict[str, int]) -> list[dict[str, int]]:
    return [big, {k: max(1, v // 3) for k, v in big.items()}, {k: v + 3 for k, v in big.items()}]


REPEATS = [pytest.param(f, prog, id=f"{f.name}-{prog}", marks=[pytest.mark.slow] if f.name in SLOW_FILES else [])
           for f in EXAMPLES for prog in _loaded(f).programs]


@pytest.mark.parametrize("file, program", REPEATS)
def test_repeated_calls_with_changing_sizes(modules, file, program):
    """Every schedule called again and again in one process (one rank), the sizes shrinking
    and growing between calls, each call against the interpreter: buffers the module keeps
    between calls must not leak one call's values or sizes into the next."""
    from coconetc.oracle.compare import compare
    from coconetc.oracle.inputs import adapt_inputs, joined, random_inputs
    from coconetc.interp.interpreter import Result, run
    if program not in SIZES:
        pytest.fail(f"no sizes for {program} in SIZES")
    fn = _module(modules, file.name).programs[program]
    base = fn.schedules["default"]
    problems = []
    for k, sizes in enumerate(_repeat_sizes(SIZES[program][0])):
        for schedule, ir in fn.schedules.items():
            inputs = adapt_inputs(random_inputs(base, 1, 1, sizes, seed=50 + k), base, ir)
            mine = copy.deepcopy(inputs[0])
            out = fn(schedule=schedule, **mine)
            outs = out if isinstance(out, tuple) else (out,) if out is not None else ()
            got = Result({pub: np.asarray(v) for (pub, _), v in zip(ir.outputs, outs)},
                         {t: np.asarray(joined(mine[t])) for t, _ in ir.updates}, None)
            ref = run(ir, copy.deepcopy(inputs))
            problems += [f"{schedule} {sizes}: {p}" for p in compare(ref, [got], ir, ir)]
    assert not problems, "\n".join(problems[:10])


def test_every_example_imports_into_one_process(modules):
    """Several generated modules live side by side in one process (each binds its own
    CallArgs), and calls to one do not disturb the other."""
    bad = {k: f"{type(v).__name__}: {v}" for k, v in modules.items() if isinstance(v, Exception)}
    assert not bad, bad
    adam, sgd = modules["adam.ccn"], modules["sgd.ccn"]
    assert adam.ext.CallArgs is not sgd.ext.CallArgs
    for _ in range(2):
        args = _adam_args()
        adam.adam(schedule="zero", **args)
        w = np.ones(N, np.float32)
        sgd.sgd(g=np.ones(N, np.float32), w=w, lr=0.5)
        np.testing.assert_allclose(w, 0.5)


# --- errors across ranks -------------------------------------------------------------------------
def test_cross_rank_argument_errors(modules, capfd):
    _module(modules, "adam.ccn")
    rc = run_python(2, [str(CALLS_WORKER), str(REPO / "examples" / "adam.ccn")], timeout=120)
    out, err = capfd.readouterr()
    log = f"--- stdout\n{out}\n--- stderr\n{err[-4000:]}"
    assert rc == 0, f"exit code {rc}\n{log}"
    for check in ("full_m_everywhere", "wrong_slice_on_rank0", "dtype_on_rank1", "missing_on_rank0",
                  "replicated_size_differs", "bad_groups", "still_in_step"):
        assert f"OK {check}" in out.splitlines(), f"{check}\n{log}"


# --- the build cache and the generated code ------------------------------------------------------
LOAD_TIMED = textwrap.dedent("""
    import json, sys, time
    import coconetc
    said = []
    t0 = time.perf_counter()
    mod = coconetc.load(sys.argv[1], log=said.append)
    dt = time.perf_counter() - t0
    print("TIMED " + json.dumps(dict(seconds=dt, log=said, programs=list(mod.programs))))
""")


def test_cached_load_is_fast(modules):
    """A fresh process loads an already built file from the cache: no CMake, well under 1 s
    (best of three processes, so that one slow start on a busy machine does not count)."""
    from coconetc.runtime.loader import compile_cpu
    _module(modules, "adam.ccn")
    # built for the compiler as it is now: the cache key hashes the compiler's own sources,
    # which may have been edited since the session started
    probes.compiler_hash.cache_clear()
    compile_cpu(load_file(REPO / "examples" / "adam.ccn"), log=lambda msg: None)
    times = []
    for _ in range(3):
        res = subprocess.run([sys.executable, "-c", LOAD_TIMED, str(REPO / "examples" / "adam.ccn")],
                             capture_output=True, text=True, timeout=120, cwd=REPO)
        assert res.returncode == 0, res.stderr[-3000:]
        got = json.loads(next(ln for ln in res.stdout.splitlines()
                              if ln.startswith("TIMED "))[len("TIMED "):])
        assert got["log"] == [], f"the cached module was rebuilt: {got['log']}"
        assert got["programs"] == ["adam"]
        times.append(got["seconds"])
        if got["seconds"] < 1.0:
            break
    assert min(times) < 1.0, f"cached coconetc.load took {times} s"


def _function_body(cpp: str, name: str) -> str:
    m = re.search(rf"^void {name}\(const coconet::CallArgs& a\) \{{\n(.*?)^\}}$", cpp, re.M | re.S)
    assert m, f"no function {name} in the generated source"
    return m.group(1)


_ALLOCATION = re.compile(r"std::vector<[^;]*?>\s+(\w+)\(|coconet::scratch<[^;]*?>\(|new\s+\w+\s*\[")


def _call_argument(text: str, start: int) -> str:
    """The text inside the parenthesis (or bracket) that opens at text[start - 1]."""
    depth, i = 1, start
    while depth:
        depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(text[i], 0)
        i += 1
    return text[start:i - 1]


def _allocation_sizes(body: str) -> list[str]:
    """The element count of every buffer a generated function allocates (std::vector,
    coconet::scratch or new[]), unwrapped from static_cast<size_t>(...) and factors of 1."""
    sizes = []
    for m in _ALLOCATION.finditer(body):
        size = re.sub(r"\s+", "", _call_argument(body, m.end()))
        size = re.sub(r"^static_cast<size_t>\((.*)\)$", r"\1", size)
        size = re.sub(r"\*int64_t\(1\)|int64_t\(1\)\*", "", size)
        while size.startswith("(") and len(_call_argument(size, 1)) == len(size) - 2:
            size = size[1:-1]
        sizes.append(size)
    return sizes


def test_zero_schedule_allocates_no_full_size_buffer(adam_mod):
    """ZeRO: the reduced gradient exists only as this rank's slice (inside the fused
    collective); adam__zero allocates nothing of N (S_N) elements. adam__default does (g1),
    which shows that the check sees such a buffer."""
    on_disk = (Path(adam_mod.ext.__file__).parent.parent / "module.cpp").read_text()
    assert on_disk == adam_mod.sources.cpp
    zero = _allocation_sizes(_function_body(adam_mod.sources.cpp, "adam__zero"))
    assert "S_N" not in zero, zero
    default = _allocation_sizes(_function_body(adam_mod.sources.cpp, "adam__default"))
    assert "S_N" in default, default


# --- an operation registered at run time -------------------------------------------------------
REGISTERED_OP = textwrap.dedent("""
    import sys
    import numpy as np
    from mpi4py import MPI
    sys.path.insert(0, sys.argv[1])
    from test_registry import SOFTPLUS  # softplus exists in this process only
    from coconetc.runtime.loader import load
    from coconetc.ir import ops
    ops.register(SOFTPLUS)
    r, ranks = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    mod = load(sys.argv[2], log=lambda msg: None)
    rng = np.random.default_rng(1)
    gs = [rng.standard_normal(11).astype(np.float32) for _ in range(ranks)]
    b = rng.standard_normal(11).astype(np.float32)
    want = 2 * np.log1p(np.exp(np.sum(gs, axis=0, dtype=np.float64) + b))
    for schedule in ("default", "moved"):
        np.testing.assert_allclose(mod.sp(g=gs[r], b=b, schedule=schedule), want, rtol=1e-5)
        print(f"OK rank {r} {schedule}", flush=True)
""")


def test_pointwise_op_registered_at_run_time_compiles_and_runs(modules, tmp_path, capfd):
    """softplus, registered in the process only (tests/test_registry.py), goes through the CPU
    backend too: the shared emitter renders it from its registry entry, and on 2 ranks both the
    program and its reordered schedule give NumPy's values."""
    from test_registry import SOFTPLUS, SOURCE

    from coconetc.runtime.loader import compile_cpu
    from coconetc.ir import ops
    path = tmp_path / "sp.ccn"
    path.write_text(SOURCE)
    with ops.registered(SOFTPLUS):
        src = compile_cpu(load_file(path), log=lambda msg: None).sources  # built here; the ranks import it
    assert "std::log1p(std::exp(" in src.cpp
    rc = run_python(2, ["-c", REGISTERED_OP, str(Path(__file__).parent), str(path)],
                    timeout=LAUNCH_TIMEOUT)
    out, err = capfd.readouterr()
    assert rc == 0, f"exit code {rc}\n{out}\n{err[-3000:]}"
    assert sorted(ln for ln in out.splitlines() if ln.startswith("OK")) == [
        "OK rank 0 default", "OK rank 0 moved", "OK rank 1 default", "OK rank 1 moved"]
