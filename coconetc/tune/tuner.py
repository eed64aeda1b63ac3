"""`coconetc tune`: the candidates of a program (space.py), pruned with the cost model
(plan/cost.py), built into one module, timed on R ranks at the real sizes (worker.py), the
winners checked against the interpreter, and the record stored in the tuning cache
(runtime/tuned.py, which the runtime reads for schedule="auto").

Pruning: the file's own schedules and the program itself are always measured; a generated
schedule is measured when its modelled time is at most KEEP times the best modelled time of
any candidate (and at most MAX_GENERATED of them, the best modelled first).

Targets: "cpu" (the CPU module, each fused schedule also measured point to point), "cuda" (the
CUDA module on the node's GPUs, one rank a GPU) and "cuda-emulated" (the CUDA module under the
host emulation: the path, not a GPU's times). On a CUDA target only the schedules the CUDA
backend implements are measured, and the record is stored for that target (runtime/tuned.py),
where the CUDA module's schedule="auto" reads it."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coconetc.plan.label import parse
from coconetc.plan.targets import TARGETS, Target
from coconetc.runtime import tuned
from coconetc.runtime.node_ranks import simulated_nodes
from coconetc.runtime.loader import compile_cpu
from coconetc.sourcefile import SourceFile, load_file
from coconetc.toolchain import Artifact, Options, compile, module_stem
from coconetc.plan.cost import cost
from coconetc.tune.space import DEFAULT, Candidate, algorithm_variants, candidates

KEEP = 2.0
MAX_GENERATED = 12


class TuneError(Exception):
    pass


@dataclass
class Pruned:
    measured: list[Candidate]
    dropped: list[Candidate]
    modelled: dict[str, float]


def prune(cands: list[Candidate], sizes: dict[str, int], ranks: int, keep: float = KEEP) -> Pruned:
    """The candidates worth measuring by the cost model: the ranks on the nodes they run on
    (COCONET_SIMULATE_NODES=K: K simulated nodes, the model's two levels; else one)."""
    nodes = simulated_nodes(ranks) or 1
    modelled = {c.label: cost(c.plan, sizes, ranks, nodes, window=parse(c.label).algorithm != "p2p").seconds()
                for c in cands}
    best = min(modelled.values())
    gen = sorted((c for c in cands if c.generated), key=lambda c: modelled[c.label])
    chosen = [c for c in gen if modelled[c.label] <= keep * best][:MAX_GENERATED]
    measured = [c for c in cands if not c.generated] + chosen
    dropped = [c for c in gen if c not in chosen]
    return Pruned(measured, dropped, modelled)


def augmented_source(mod: SourceFile, generated: list[Candidate]) -> str:
    """The file's text with the generated schedules appended (what the tuning module builds)."""
    blocks = "".join("\n" + c.text for c in generated)
    return mod.source.rstrip("\n") + "\n\n# schedules written by coconetc tune\n" + blocks


def tune(mod: SourceFile, program: str, sizes: dict[str, int], ranks: int, *, reps: int = 5,
         keep: float = KEEP, echo: Callable[[str], None] = print, progress: bool = True,
         timeout: float | None = 600, target: str = "cpu") -> dict[str, Any]:
    """Measures the candidates of PROGRAM on TARGET and stores the record in the tuning cache;
    returns it."""
    assert target in TARGETS, target
    cands = candidates(mod, program)
    pr = prune(cands, sizes, ranks, keep)
    variants = algorithm_variants(pr.measured, ranks) if Target(target).facts.algorithms else []
    echo(f"{program}: {len(cands)} legal schedules ({sum(c.generated for c in cands)} written by the "
         f"tuner); measuring {len(pr.measured)} ({len(pr.dropped)} pruned by the cost model)"
         + (f", {len(variants)} of them also with point-to-point fused collectives (@p2p)" if variants else ""))
    pr.measured += variants
    pr.modelled.update({c.label: pr.modelled[c.schedule] for c in variants})
    work = Path(tempfile.mkdtemp(prefix="coconet-tune-"))
    try:
        res = _measure(mod, program, sizes, ranks, reps, pr, work, echo, progress, timeout, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    record = _record(mod, program, sizes, ranks, reps, pr, res, target)
    tuned.store(tuned.key(mod.source, program, sizes, ranks, target=target), record)
    return record


def _build(src: Path, mod: SourceFile, target: str) -> Artifact:
    """The module the ranks load (cached by the toolchain, so they find it built)."""
    if target == Target.CPU:  # (with the tuned schedules of other programs, as coconetc.load builds)
        return compile_cpu(load_file(src), include_dirs=[str(Path(mod.file).resolve().parent)])
    return compile(load_file(src), target, Options())


def _measure(mod: SourceFile, program: str, sizes: dict[str, int], ranks: int, reps: int,
             pr: Pruned, work: Path, echo: Callable[[str], None], progress: bool,
             timeout: float | None, target: str) -> dict[str, Any]:
    """Builds the file with the generated candidates appended and times them on R ranks."""
    gen = [c for c in pr.measured if c.generated and c.label == c.schedule]  # each text once
    with _beside(mod, augmented_source(mod, gen), work) as src:
        return _run_measured(mod, program, sizes, ranks, reps, pr, work, src, echo, progress, timeout, target)


@contextlib.contextmanager
def _beside(mod: SourceFile, text: str, work: Path) -> Iterator[Path]:
    """The augmented file, written beside the user's file (a hidden name, one per content, so
    that its module is built once for every run that measures the same schedules), so that
    what the file finds beside itself (an extern operation's reference module, its headers) it
    finds there too; in WORK when that directory cannot be written. Two tuners of the same file
    at once share it: each holds a shared lock on its .lock while it runs, the file is written
    whole (a rename) and removed by the last one to finish."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    name = f".{module_stem(mod.file)}.tune_{digest}.ccn"
    try:
        folder = Path(mod.file).resolve().parent
        lock = _shared_lock(folder / f"{name}.lock")
    except OSError:
        folder, lock = work, None
    src = folder / name
    try:
        if not (src.exists() and src.read_text() == text):
            part = folder / f"{name}.{os.getpid()}.part"
            part.write_text(text)
            os.replace(part, src)
        yield src
    finally:
        if lock is not None:
            try:  # the last one out (no other tuner holds the lock) removes the file
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                src.unlink(missing_ok=True)
                Path(lock.name).unlink(missing_ok=True)
            except BlockingIOError:
                pass
            lock.close()


def _shared_lock(path: Path) -> Any:
    """PATH opened and share-locked, the lock taken on the file that is at PATH (one the last
    tuner removed meanwhile is opened again)."""
    while True:
        f = open(path, "a")
        fcntl.flock(f, fcntl.LOCK_SH)
        try:
            if os.fstat(f.fileno()).st_ino == os.stat(path).st_ino:
                return f
        except FileNotFoundError:
            pass
        f.close()


def _run_measured(mod: SourceFile, program: str, sizes: dict[str, int], ranks: int, reps: int,
                  pr: Pruned, work: Path, src: Path, echo: Callable[[str], None], progress: bool,
                  timeout: float | None, target: str) -> dict[str, Any]:
    echo(f"building one module with {len(pr.measured)} schedules"
         + ("" if target == Target.CPU else f" ({target})") + " ...")
    art = _build(src, mod, target)
    if Target(target).facts.schedules_left_out:  # the schedules the CUDA backend does not implement are not in it
        left = [c for c in pr.measured if (program, c.schedule) not in art.sources.functions]
        if left:
            echo("not measured (the CUDA backend does not implement them; `coconetc check --backend cuda` "
                 "says why): " + ", ".join(c.label for c in left))
        pr.measured = [c for c in pr.measured if c not in left]
    out = work / "result.json"
    argv = ["-m", "coconetc.jobs.tune", str(src), "--program", program, f"--reps={reps}",
            f"--out={out}", f"--include-dir={Path(mod.file).resolve().parent}",
            *[f"--size={k}={v}" for k, v in sizes.items()],
            *Target(target).facts.worker_flags,
            *[f"--schedule={c.label}" for c in pr.measured]]
    rc = _run_worker(ranks, argv, len(pr.measured) * (reps + 1), progress, timeout)
    if not out.exists():  # (written, with no choice, when no winner matched the interpreter)
        raise TuneError(f"coconetc tune: the ranks failed (exit code {rc}); see the messages above")
    return json.loads(out.read_text())


def _record(mod: SourceFile, program: str, sizes, ranks: int, reps: int, pr: Pruned,
            res: dict[str, Any], target: str) -> dict[str, Any]:
    if res.get("choice") is None:
        raise TuneError("coconetc tune: no schedule matched the interpreter: "
                        + json.dumps(res.get("problems"))[:2000])
    return {
        "file": mod.file, "program": program, "sizes": dict(sizes), "ranks": ranks, "groups": 1,
        "target": target, "machine": tuned.machine(target), "time": time.time(), "reps": reps,
        "measured": res["measured"], "choice": res["choice"],
        "by_convention": res["by_convention"], "conventions": res["conventions"],
        "problems": {k: v for k, v in res["problems"].items() if v},
        "generated": [c.label for c in pr.measured if c.generated],
        "schedules": {c.label: c.text for c in pr.measured},
        "modelled": {c.label: pr.modelled[c.label] for c in pr.measured},
        "pruned": {c.label: pr.modelled[c.label] for c in pr.dropped},
    }


def _run_worker(ranks: int, argv: list[str], n: int, progress: bool, timeout: float | None) -> int:
    """Runs the worker on R ranks; its PROGRESS lines drive a progress bar on stderr."""
    import click

    from coconetc.launch.mpiexec import command, environment
    # one rank needs no mpiexec (MPI starts as a singleton), as `python train.py` needs none
    one = ranks == 1
    try:
        cmd = [sys.executable, *argv] if one else command(ranks, [sys.executable, *argv])
        env = None if one else environment(ranks)  # (None: this process's environment)
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    except (RuntimeError, OSError) as err:
        raise TuneError(f"coconetc tune: could not start the {ranks} ranks: {err}") from None
    assert proc.stdout is not None
    start = time.monotonic()
    with click.progressbar(length=n, label="timing schedules", file=sys.stderr,
                           show_pos=True, item_show_func=lambda s: s) as bar:
        for line in proc.stdout:
            if line.startswith("PROGRESS "):
                _, _, total, label, secs = line.split()
                bar.length = int(total)  # (the worker's count: a CUDA module warms up longer)
                bar.update(1, f"{label}: {float(secs) * 1e3:.2f} ms" if progress else None)
            else:
                sys.stdout.write(line)
            if timeout is not None and time.monotonic() - start > timeout:
                proc.kill()
                break
    return proc.wait()


def table(record: dict[str, Any]) -> str:
    """The measured schedules, fastest first, with what they are; the modelled time only for a
    record of a target the cost model models (Facts.modelled: the CPU backend's)."""
    meas = record["measured"]
    best = min(meas.values())
    choice = record["choice"]
    modelled = Target(record.get("target", Target.CPU.value)).facts.modelled
    lines = [f"{'schedule':<28} {'measured':>11} {'vs best':>8} " + (f"{'modelled':>11}  " if modelled else "")
             + "notes"]
    for label in sorted(meas, key=meas.__getitem__):
        notes = []
        if label == choice:
            notes.append("CHOICE")
        if label in record["generated"]:
            notes.append("generated")
        conv = record["conventions"].get(label, "")
        if conv:
            notes.append(f"takes {conv}")
        if label in record.get("problems", {}):
            notes.append("MISMATCH")
        model = f"{record['modelled'].get(label, 0.0) * 1e3:>8.3f} ms  " if modelled else ""
        lines.append(f"{label:<28} {meas[label] * 1e3:>8.3f} ms {meas[label] / best:>7.2f}x "
                     f"{model}{', '.join(notes)}")
    for conv, label in record["by_convention"].items():
        who = conv or "the program's own layouts"
        lines.append(f"schedule='auto' with {who}: {label}")
    return "\n".join(lines) + "\n"


def best_handwritten(record: dict[str, Any]) -> str | None:
    hand = {k: v for k, v in record["measured"].items() if k not in record["generated"] and k != DEFAULT}
    return min(hand, key=hand.__getitem__) if hand else None
