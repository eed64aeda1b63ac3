"""What `coconetc check` accepts, the CPU backend runs and matches: random programs with random
schedules (a seeded generator of optimizer steps and tensor-parallel layers), kept when `check`
accepts them, are
compiled into one module and run on 2 and 3 MPI ranks under every schedule against the
interpreter (coconetc run). A program that checks but fails to build, crashes or differs is a
bug of the planner or the backend, never an acceptable outcome."""

from __future__ import annotations

import functools
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from coconetc.sourcefile import load_source
from coconetc.errors import CompileError
import rank_pool

pytestmark = pytest.mark.slow  # one module of 14 programs, then a launch on 2 and one on 3 ranks

COUNT = 14  # programs, each with its schedules
SIZES = ["--size=N=11", "--size=B=2", "--size=S=5", "--size=K=7", "--size=H=4"]
UNARY = ["sqrt(abs({}))", "relu({})", "tanh({})", "-{}", "abs({})", "sigmoid({})", "gelu({})"]
BINARY = ["{} + {}", "{} - {}", "{} * {}", "min({}, {})", "max({}, {})", "{} / (abs({}) + 1)"]


def _pointwise(rng: random.Random, names: list[str], depth: int = 0) -> str:
    if depth > 2 or rng.random() < 0.3:
        return rng.choice(names + ["lr", "0.5", "2"])
    if rng.random() < 0.35:
        return rng.choice(UNARY).format(_pointwise(rng, names, depth + 1))
    a, b = _pointwise(rng, names, depth + 1), _pointwise(rng, names, depth + 1)
    return f"({rng.choice(BINARY).format(a, b)})"


def _optimizer(rng: random.Random, i: int) -> str:
    """Data parallel: a reduced gradient, pointwise state updates, sometimes a norm; schedules
    split + reorder, slice of the state, fuse (with or without what needs every chunk)."""
    op = rng.choice(["sum", "avg", "max"])
    lines = [f"    g1 = allreduce({op}, g)"]
    names, stages = ["g1", "w", "m"], []
    gathered = {"g1"}  # the stages that read the all-reduced gradient (what a reorder may move)

    def reads(text: str, stage: str) -> str:
        if gathered & set(re.findall(r"\b\w+\b", text)):
            gathered.add(stage)
        return text
    for k in range(rng.randint(1, 3)):
        lines.append(f"    c{k} = {reads(_pointwise(rng, names), f'c{k}')}")
        names.append(f"c{k}")
        stages.append(f"c{k}")
    scale = f" / (norm({rng.choice(names)}) + 1)" if rng.random() < 0.4 else ""
    lines.append(f"    m1 = update(m, {reads('0.5 * m + ' + rng.choice(names), 'm1')})")
    lines.append(f"    w1 = update(w, {reads(f'w - lr * {rng.choice(names[:1] + stages)}{scale} + 0.1 * m1', 'w1')})")
    if rng.random() < 0.3:
        lines.append(f"    d = dropout({reads(rng.choice(['g1', 'w1'] + stages), 'd')}, 0.25, seed)\n    return d")
        stages.append("d")
    stages += ["m1", "w1"]
    prog = (f"program q{i}(g: f32[N] local, w: f32[N] replicated, m: f32[N] replicated, lr: f32, "
            f"seed: i64) {{\n" + "\n".join(lines) + "\n}\n")
    # a reorder moves only stages that consume the all-gathered value (check refuses the others)
    moved = [s for s in stages if s in gathered and (s != "d" or rng.random() < 0.5)] or stages
    outs = ", ".join(f"a{k}" for k in range(len(moved)))
    base = f"    rs, ag = split(g1)\n    {outs} = reorder(ag, {', '.join(moved)})\n"
    scheds = [f"schedule rcag for q{i} {{\n{base}}}\n"]
    gathers = [f"a{k}" for k, s in enumerate(moved) if s == "w1"]
    fused = ", ".join(["rs", *moved[:rng.randint(1, len(moved))], *gathers])
    scheds.append(f"schedule fz for q{i} {{\n{base}    fuse({fused})\n}}\n")
    if rng.random() < 0.5:
        scheds.append(f"schedule sl for q{i} {{\n{base}    slice(m)\n    fuse({fused})\n}}\n")
    return prog + "".join(scheds)


def _layer(rng: random.Random, i: int) -> str:
    """Model parallel: a row-parallel matmul, its all-reduce, pointwise work with a bias;
    schedules overlap (any dim), split along a dim, fuse, overlap into the fusion."""
    out = _pointwise(rng, ["s", "b"]).replace("s", "s")
    prog = (f"program q{i}(x: f32[B, S, K] sliced(2), w: f32[K, H] sliced(0), b: f32[H] replicated) {{\n"
            f"    y = matmul(x, w)\n    s = allreduce(sum, y)\n    out = {out} + s\n    return out\n}}\n")
    d = rng.choice([0, 1, 2])
    c = rng.choice([1, 2, 3])
    sd = rng.choice([1, 2])
    scheds = [f"schedule ov for q{i} {{\n    overlap(y, s, chunks={c}, dim={d})\n}}\n",
              f"schedule fz for q{i} {{\n    rs, ag = split(s, dim={sd})\n    ago = reorder(ag, out)\n"
              f"    f = fuse(rs, out, ago)\n    overlap(y, f, chunks={c})\n}}\n",
              f"schedule rsov for q{i} {{\n    rs, ag = split(s, dim={sd})\n    ago = reorder(ag, out)\n"
              f"    overlap(y, rs, chunks={c}, dim={3 - sd if sd == 1 else rng.choice([0, 1])})\n}}\n"]
    return prog + "".join(scheds)


@functools.cache
def _generated(count: int) -> list[str]:
    """Programs with schedules from a seeded generator, kept when `check` accepts them whole
    (a rejected schedule must be a located error: that is the other accepted outcome)."""
    rng, out = random.Random(7), []
    while len(out) < count:
        i = len(out)
        src = (_optimizer if i % 2 == 0 else _layer)(rng, i)
        try:
            load_source(src, "g.ccn")
        except CompileError as err:
            assert all(d.span.line >= 1 for d in err.diagnostics)
            continue
        out.append(src)
    return out


@pytest.fixture(scope="module")
def accepted_file(tmp_path_factory) -> tuple[Path, list[str]]:
    progs = _generated(COUNT)
    text, names = progs, [f"q{i}" for i in range(len(progs))]
    path = tmp_path_factory.mktemp("accepted") / "accepted.ccn"
    path.write_text("\n".join(text))
    return path, names


def _coconetc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from coconetc.cli import main; main()", *args],
                          capture_output=True, text=True, timeout=900)


def test_accepted_programs_build(accepted_file) -> None:
    path, _ = accepted_file
    res = _coconetc("check", str(path))
    assert res.returncode == 0, res.stderr
    res = _coconetc("compile", str(path), "-o", str(path.parent / "out"))
    assert res.returncode == 0, f"{path.read_text()}\n{res.stderr[-4000:]}"


@pytest.mark.parametrize("ranks", [2, 3])
def test_accepted_programs_run_and_match(accepted_file, ranks: int) -> None:
    """Every program under every schedule (what `coconetc run -s all` does one program at a
    time), all in one MPI job (tests/run_jobs_worker.py), against the interpreter."""
    import coconetc
    path, names = accepted_file
    schedules = coconetc.load(path, log=lambda msg: None).source_module.schedules  # built once; the ranks import it
    argv, want = [str(RUN_JOBS)], []
    for name in names:
        scheds = ["default", *(s for s, x in schedules.get(name, {}).items() if not x.auto)]
        argv += [str(path), "--program", name, "--reps", "1", *(f"--schedule={s}" for s in scheds),
                 *(s for s in SIZES if f"{s.split('=')[1]}" in _symbols(path, name)), "--"]
        want += [f"{name} [{s}]: {ranks} ranks:" for s in scheds]
    rc, out, err = rank_pool.run(ranks, argv, timeout=900)
    log = f"{path.read_text()}\n--- stdout\n{out[-4000:]}\n--- stderr\n{err[-4000:]}"
    assert rc == 0, log
    lines = [ln for ln in out.splitlines() if re.match(r"\S+ \[[^\]]+\]: \d+ ranks:", ln)]
    assert len(lines) == len(want), log
    for line, head in zip(lines, want):
        assert line.startswith(head) and line.endswith("matches the interpreter on every rank"), f"{line}\n{log}"


RUN_JOBS = Path(__file__).with_name("run_jobs_worker.py")
CASES = Path(__file__).with_name("programs") / "plan_cases.ccn"
CASE_SIZES = {"ln": "B=2 S=5 K=6 H=4", "arf": "N=13", "lam": "N=13", "d2": "B=3 H=5"}


@pytest.mark.parametrize("name", sorted(CASE_SIZES))
def test_plan_cases_run_and_match(name: str) -> None:
    sizes = [f"--size={s}" for s in CASE_SIZES[name].split()]
    for ranks, chunk in ((2, None), (3, "2")):
        env = {**os.environ, **({"COCONET_CHUNK": chunk} if chunk else {})}
        res = subprocess.run([sys.executable, "-c", "from coconetc.cli import main; main()", "run", str(CASES),
                              "-p", name, "-s", "all", "--ranks", str(ranks), *sizes],
                             capture_output=True, text=True, timeout=900, env=env)
        assert res.returncode == 0, f"{name} on {ranks} ranks:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
        assert "MISMATCH" not in res.stdout and res.stdout.count("matches the interpreter") >= 2


def _symbols(path: Path, name: str) -> set[str]:
    m = re.search(rf"^program {name}\((.*?)\)\s*\{{", path.read_text(), re.M | re.S)
    assert m
    return set(re.findall(r"\b([A-Z])\b", m.group(1)))


def test_generator_covers_the_schedules() -> None:
    """The generated file holds fusions with work after the chunks, overlaps along every dim,
    and slices: the cases the plan had to learn."""
    text = "\n".join(_generated(COUNT))
    assert "norm(" in text and "slice(m)" in text
    assert all(f"dim={d})" in text for d in (0, 1, 2))
