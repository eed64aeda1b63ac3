"""Build times of generated modules (CPU backend), each in a fresh process as a user meets them:

  * the compiled runtime (the Python binding; the runtime library: the process's runtime state
    and the collectives' instantiations), once per machine (every module and unit links it);
  * each example built cold (`coconetc compile FILE`: its units not yet in the cache, each
    compiled and linked into a shared object of its own), then again
    warm (everything cached); then `coconetc.load` in fresh processes (the time of the call,
    after `import coconetc`): the first load (the module built, the file parsed, planned and
    generated, its record written) and a warm load (the record read: runtime/warm.py), the
    median of 5 processes, and the median time of `import coconetc`;
  * tp_mlp.ccn after one schedule is changed (chunks=2 -> 3) and after one is added: one unit
    compiles and links, then the table and the module's link;
  * tp_mlp.ccn with its derived programs (as coconetc.torch.function loads it) in f32 and bf16.

Targets (issue 38, this 2-core machine): tp_mlp cold within 15 s, a changed schedule within 8 s,
a warm load within 0.3 s, no module of the examples in any dtype over 60 s cold.

Run: python bench/build_times.py [--examples adam.ccn,tp_mlp.ccn] [--json bench/results/build_times.json]
A fresh cache (a temporary COCONET_CACHE) is used, so nothing built before counts."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
COCONETC = str(Path(sys.executable).parent / "coconetc")
LOAD = """
import sys, time
t = time.perf_counter()
import coconetc
t1 = time.perf_counter()
coconetc.load(sys.argv[1], grad=tuple(sys.argv[2:]), log=lambda m: None)
print(t1 - t, time.perf_counter() - t1)
"""
WARM_LOADS = 5  # fresh processes per warm-load figure (the median)
RUNTIME = "from coconetc.toolchain import runtime; runtime(log=lambda m: None)"


def wall(cmd: list[str], env: dict) -> float:
    t = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    return time.perf_counter() - t


def load_time(path: Path, env: dict, grad: tuple[str, ...] = ()) -> tuple[float, float]:
    """Seconds of `import coconetc` and of coconetc.load(path) after it, in a fresh process."""
    res = subprocess.run([sys.executable, "-c", LOAD, str(path), *grad], env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"load failed: {path}\n{res.stderr[-3000:]}")
    imp, load = res.stdout.split()[-2:]
    return float(imp), float(load)


def warm_loads(path: Path, env: dict) -> tuple[float, float, float]:
    """The first coconetc.load of PATH (its module built already), then the medians of
    WARM_LOADS warm loads and of their `import coconetc`, each in a fresh process."""
    first = load_time(path, env)[1]
    runs = [load_time(path, env) for _ in range(WARM_LOADS)]
    return first, statistics.median(r[1] for r in runs), statistics.median(r[0] for r in runs)


def variant(tmp: Path, name: str, text: str) -> Path:
    path = tmp / name / "tp_mlp.ccn"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", default="", help="comma-separated example files (default: all)")
    ap.add_argument("--json", default="", help="write the figures here as JSON")
    a = ap.parse_args()
    names = a.examples.split(",") if a.examples else sorted(p.name for p in EXAMPLES.glob("*.ccn"))
    tmp = Path(tempfile.mkdtemp(prefix="ccn-build-times-"))
    env = {**os.environ, "COCONET_CACHE": str(tmp / "cache"), "OMP_NUM_THREADS": "1"}
    rows: list[tuple[str, float, float, float, float, float]] = []
    out: dict = {"cpus": os.cpu_count(), "runtime_s": wall([sys.executable, "-c", RUNTIME], env)}
    print(f"the compiled runtime (binding, runtime library), once per machine: {out['runtime_s']:.1f} s", flush=True)
    for name in names:
        path = EXAMPLES / name
        cold = wall([COCONETC, "compile", str(path)], env)
        warm = wall([COCONETC, "compile", str(path)], env)
        rows.append((name, cold, warm, *warm_loads(path, env)))
        print(f"{name}: cold {cold:.1f} s, warm {warm:.2f} s, first load {rows[-1][3]:.3f} s, warm load "
              f"{rows[-1][4]:.3f} s (import coconetc {rows[-1][5]:.3f} s)", flush=True)
    out["examples"] = {n: {"cold_s": c, "warm_s": w, "first_load_s": f, "warm_load_s": ld, "import_s": i}
                       for n, c, w, f, ld, i in rows}
    text = (EXAMPLES / "tp_mlp.ccn").read_text()
    base = variant(tmp, "base", text)
    wall([COCONETC, "compile", str(base)], env)
    changed = variant(tmp, "changed", text.replace("overlap(p, s, chunks=2, dim=1)", "overlap(p, s, chunks=3, dim=1)", 1))
    added = variant(tmp, "added", text + "\nschedule overlapped4 for tp_mlp {\n    overlap(p, s, chunks=4, dim=1)\n}\n")
    out["tp_mlp_changed_schedule_s"] = wall([COCONETC, "compile", str(changed)], env)
    out["tp_mlp_added_schedule_s"] = wall([COCONETC, "compile", str(added)], env)
    grads = ("tp_mlp", "tp_block")
    for dtype in ("f32", "bf16"):
        path = variant(tmp, f"grad_{dtype}", text.replace("f32", dtype))
        t = time.perf_counter()
        load_time(path, env, grads)
        out[f"tp_mlp_with_grads_{dtype}_cold_s"] = time.perf_counter() - t
    print(f"tp_mlp.ccn, one schedule changed: {out['tp_mlp_changed_schedule_s']:.1f} s; one added: "
          f"{out['tp_mlp_added_schedule_s']:.1f} s")
    print(f"tp_mlp.ccn with the derived programs of tp_mlp and tp_block, cold: f32 "
          f"{out['tp_mlp_with_grads_f32_cold_s']:.1f} s, bf16 {out['tp_mlp_with_grads_bf16_cold_s']:.1f} s")
    print("\n| example | cold build | warm build | first coconetc.load | warm coconetc.load | import coconetc |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for n, c, w, f, ld, i in rows:
        print(f"| {n} | {c:.1f} s | {w:.2f} s | {f:.3f} s | {ld:.3f} s | {i:.3f} s |")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
