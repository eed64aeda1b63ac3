"""Programs the CUDA backend used to refuse (issue 9), run as a held-out program would be:
`coconetc run FILE -p PROGRAM --backend cuda --emulate --ranks 2 --schedule all --size N=23`,
and all of them in one MPI job on each of 1 to 4 ranks (23 elements: uneven slices and three
uneven segments; 3 elements on 4 ranks: a rank with nothing; 2-element chunks: many chunks of a
fused collective, crossing segments), every schedule matching the interpreter; `coconetc check --backend cuda` accepting each file;
and each file's CUDA module compiled and linked by nvcc (skipped, with the reason, without nvcc)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from coconetc import toolchain
from coconetc.sourcefile import load_file
from coconetc.toolchain import probes
import rank_pool

PROGRAMS = Path(__file__).resolve().parent / "programs"
COCONETC = str(Path(sys.executable).parent / "coconetc")
CASES = {  # file: {program: its schedules, default included}
    "cuda_fused_scattered.ccn": {"sgdsc": 3, "mom": 2, "mix": 2, "half": 2},
    "cuda_scattered_collectives.ccn": {"clipw": 3, "sums": 1, "bc": 1, "red": 1, "sc": 1, "snd": 1},
    "cuda_fused_kept.ccn": {"keepout": 3, "keepupd": 2, "lneps": 1, "lnf": 2},
    "cuda_overlap_fused.ccn": {"ovar": 3, "ovln": 2},
}
GROUPED = {"snd"}  # send between groups: one group a rank (2 groups on 4 ranks)
RUNS = [(1, 23, None), (2, 23, None), (3, 23, None), (4, 23, None), (4, 3, None), (3, 23, "2")]
RUN_JOBS = Path(__file__).with_name("run_jobs_worker.py")


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ, **(env or {}))
    return subprocess.run([COCONETC, *args], capture_output=True, text=True, timeout=900, env=e)


@pytest.mark.parametrize("file", sorted(CASES))
def test_check_backend_cuda_accepts(file):
    res = _cli("check", "--backend", "cuda", str(PROGRAMS / file))
    assert res.returncode == 0 and "not in the CUDA backend" not in res.stderr, res.stderr


@pytest.mark.slow
@pytest.mark.parametrize("file, program", [(f, next(iter(ps))) for f, ps in CASES.items()])
def test_emulated_run_matches_interpreter(file, program):
    """As a user runs it: `coconetc run --backend cuda --emulate` on 2 ranks, every schedule (a
    program of each file; every program runs in test_every_program_on_every_rank_count)."""
    why = probes.emulation_missing()
    if why:
        pytest.skip(why)
    groups = 2 if program in GROUPED else 1
    res = _cli("run", str(PROGRAMS / file), "-p", program, "--backend", "cuda", "--emulate", "--ranks", "2",
               "--groups", str(groups), "--schedule", "all", "--size", "N=23")
    log = f"--- stdout\n{res.stdout}\n--- stderr\n{res.stderr[-4000:]}"
    assert res.returncode == 0, log
    matched = [ln for ln in res.stdout.splitlines() if "(CUDA, host emulation)" in ln]
    assert len(matched) == CASES[file][program], log
    assert all("matches the interpreter on every rank" in ln for ln in matched), log
    assert "skipped" not in res.stdout, log


@pytest.fixture(scope="module")
def emulated(request):
    """Every file's emulated module built once here (the ranks only import it), in the session's
    build cache."""
    from coconetc.runtime.cuda import load_emulated
    why = probes.emulation_missing()
    if why:
        pytest.skip(why)
    for file in CASES:
        load_emulated(PROGRAMS / file, log=lambda msg: None)
    yield


@pytest.mark.slow
@pytest.mark.parametrize("ranks, size, chunk", RUNS, ids=[f"R{r}-N{n}" + (f"-ch{c}" if c else "") for r, n, c in RUNS])
def test_every_program_on_every_rank_count(emulated, monkeypatch, ranks, size, chunk):
    """Every program and schedule of the files on 1 to 4 ranks (uneven slices and segments, a
    rank with nothing at N = 3 on 4 ranks, many 2-element chunks), in one MPI job a rank count
    (tests/run_jobs_worker.py, coconetc.jobs.run's jobs in turn), against the interpreter."""
    if chunk:
        monkeypatch.setenv("COCONET_CUDA_CHUNK", chunk)
    argv, want = [str(RUN_JOBS)], []
    for file, programs in CASES.items():
        mod = load_file(PROGRAMS / file)
        for program in programs:
            scheds = ["default", *(s for s, x in mod.schedules.get(program, {}).items() if not x.auto)]
            assert len(scheds) == programs[program], (file, program, scheds)
            groups = (ranks if ranks < 4 else 2) if program in GROUPED else 1
            argv += [str(PROGRAMS / file), "--program", program, "--emulate-cuda", "--reps", "1", "--groups",
                     str(groups), *(f"--schedule={s}" for s in scheds), f"--size=N={size}", "--"]
            want += [f"{program} [{s}] (CUDA, host emulation): {ranks} ranks:" for s in scheds]
    rc, out, err = rank_pool.run(ranks, argv, timeout=900)
    log = f"--- stdout\n{out[-4000:]}\n--- stderr\n{err[-4000:]}"
    assert rc == 0, log
    lines = [ln for ln in out.splitlines() if "(CUDA, host emulation): " in ln]
    assert len(lines) == len(want), log
    for line, head in zip(lines, want):
        assert line.startswith(head) and line.endswith("matches the interpreter on every rank"), f"{line}\n{log}"


@pytest.mark.slow
@pytest.mark.parametrize("file", sorted(CASES))
def test_compiles_and_links_with_nvcc(file):
    why = probes.cuda_missing()
    if why:
        print(f"skipped: {why}")
        pytest.skip(why)
    so = toolchain.compile(load_file(PROGRAMS / file), "cuda", toolchain.Options(archs="90", log=lambda m: None)).path
    assert so is not None and so.exists()
