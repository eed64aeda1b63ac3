"""The tuning records: one JSON file, `tuning.json` under the build cache (COCONET_CACHE, default
~/.cache/coconet; COCONET_TUNING names another file), mapping a key to the tuner's record. The key is the file's
content hash, the program, the size symbols, the ranks, the groups and the machine (host name,
CPU model, core count; for the CUDA backend the GPU's name too, or the host emulation), so a
record never outlives what it measured and a backend reads only its own records: a module
built for a target ("cpu", "cuda", "cuda-emulated", as the toolchain names them) reads the
records measured on that target.

A record holds what `coconetc tune --json` writes (measured, choice, generated, schedules) and
`by_convention`: for each calling convention among the measured schedules ('' for the
program's own parameter layouts, else e.g. 'm: sliced(0), v: sliced(0)'), the fastest
verified schedule that takes it. A call with schedule="auto" runs the choice whose
convention matches the arrays it was given (docs/performance.md).

The store sits in the runtime, below the autotuner: a call with schedule="auto" reads it, the
tuner (coconetc/tune/tuner.py) writes it through `store`. Nothing here imports the tuner or
the interpreter."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coconetc.errors import CompileError
from coconetc.plan.label import schedule_name
from coconetc.plan.targets import Target
from coconetc.toolchain.probes import cache_dir, cpu_info

if TYPE_CHECKING:  # (the front half: imported by with_tuned, on a load's cold path only)
    from coconetc.sourcefile import SourceFile

FILE = "tuning.json"
ENV_TUNING = "COCONET_TUNING"  # the tuning cache file (default: COCONET_CACHE/tuning.json)


def tune_command(file: str, program: str, ranks: int | str, sizes: dict[str, Any], target: str = "cpu") -> str:
    """The `coconetc tune` command that makes the record of PROGRAM at these SIZES on RANKS on
    TARGET (what a reader of the records names when it finds none; "R", "INT": for the user to fill)."""
    shown = " ".join(f"--size {k}={v}" for k, v in sizes.items())
    return f"coconetc tune {file} --program {program}{Target(target).facts.tune_flags} --ranks {ranks} {shown}".rstrip()


def path() -> Path:
    return Path(os.environ.get(ENV_TUNING) or cache_dir() / FILE)


@cache
def machine(target: str = "cpu") -> str:
    """host name, CPU model and core count (and, for a CUDA target, the GPU's name or the host
    emulation): what a timing on TARGET depends on beyond the program."""
    device = _DEVICE.get(target)
    if device is not None:
        return machine() + " | " + device()
    import socket  # (here, not with the module: a load asks only when the file has tuning records)
    model = cpu_info("model name") or platform.processor() or platform.machine()
    return f"{socket.gethostname()} | {model} | {os.cpu_count()} cores"


def _gpu_name() -> str:
    import torch
    return torch.cuda.get_device_name()


_DEVICE: dict[str, Any] = {Target.EMULATED: lambda: "CUDA host emulation", Target.CUDA: _gpu_name}  # a CUDA target's device


def source_hash(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def key(source: str, program: str, sizes: dict[str, int], ranks: int, groups: int = 1,
        target: str = "cpu") -> str:
    shown = ",".join(f"{k}={sizes[k]}" for k in sorted(sizes))
    return f"{source_hash(source)} {program} [{shown}] R={ranks} G={groups} @ {machine(target)}"


def read_all() -> dict[str, Any]:
    try:
        data = json.loads(path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def store(k: str, record: dict[str, Any]) -> None:
    """Adds or replaces one record (written to a temporary file, then renamed)."""
    data = read_all()
    data[k] = record
    p = path()
    p.parent.mkdir(parents=True, exist_ok=True)
    import tempfile  # (here: only the tuner writes)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".tuning.")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, p)


def lookup(source: str, program: str, sizes: dict[str, int], ranks: int, groups: int = 1,
           target: str = "cpu"):
    return read_all().get(key(source, program, sizes, ranks, groups, target))


def records(source: str, program: str | None = None, target: str = "cpu") -> list[dict[str, Any]]:
    """Every record of this file (and program) measured on this machine's TARGET, the newest last."""
    head = source_hash(source) + " "
    found = [r for k, r in read_all().items()
             if k.startswith(head) and k.endswith("@ " + machine(target))
             and (program is None or r.get("program") == program)]
    return sorted(found, key=lambda r: r.get("time", 0))


def tuned_schedules(source: str, target: str = "cpu") -> str:
    """The .ccn text of every generated schedule a record of this file on TARGET chose (the
    loader adds them to the module, so that schedule="auto" can run them)."""
    texts: dict[tuple[str, str], str] = {}
    for r in records(source, target=target):
        chosen = {r.get("choice"), *r.get("by_convention", {}).values()}
        for label in sorted(x for x in chosen if x):  # the same text (and module) on every rank
            if label in r.get("generated", []):  # "auto_x@p2p": the schedule auto_x, once
                texts[(r["program"], schedule_name(label))] = r["schedules"][label]
    return "".join(texts[k] for k in sorted(texts))


def generated_texts(record: dict[str, Any]) -> str:
    """The .ccn text of every schedule the tuner wrote and measured for this record, each
    schedule once (a label with a fused-collective algorithm, "auto_x@p2p", is auto_x)."""
    texts = {schedule_name(g): record["schedules"][g] for g in record.get("generated", [])
             if g in record.get("schedules", {})}
    return "".join(texts[k] for k in sorted(texts))


def with_tuned(mod: SourceFile, target: str = "cpu") -> SourceFile:
    """The file with the schedules the autotuner wrote and chose for it on TARGET, so that
    schedule="auto" can run them (what coconetc.load compiles); a stale record that no longer
    checks is left out."""
    text = tuned_schedules(mod.source, target)
    if not text:
        return mod
    from coconetc.sourcefile import add_schedules
    try:
        return add_schedules(mod, text)
    except CompileError:
        return mod
