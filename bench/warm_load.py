"""A warm start: `import coconetc` and `coconetc.load` of a file built before, in a fresh
process, as a user's script or a rank of an MPI job starts. Beside it, in the same run, what a
fresh `python -c "import numpy"` costs (the floor no load goes under).

Run: python bench/warm_load.py [--reps 7] [--file examples/sgd.ccn] [--target 0.3]
It builds the file once into a temporary build cache, then starts REPS fresh processes for each
row and prints the medians; it exits 1 when the warm load's median is over TARGET seconds, and
names the three slowest imports of one process (python -X importtime) so the cause is on the
screen. Writes bench/results/warm_load.json."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

TIMED = """
import time
t0 = time.perf_counter()
import coconetc
t1 = time.perf_counter()
coconetc.load({file!r}, log=lambda msg: print("BUILT", msg))
t2 = time.perf_counter()
print(t1 - t0, t2 - t1)
"""
NUMPY = "import time; t0 = time.perf_counter(); import numpy; print(time.perf_counter() - t0, 0.0)"


def _run(code: str, env: dict[str, str], *flags: str) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, *flags, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        sys.exit(f"warm_load: a fresh process failed:\n{res.stderr[-3000:]}")
    return res


def _times(code: str, env: dict[str, str], reps: int) -> list[tuple[float, float]]:
    out = []
    for _ in range(reps):
        lines = _run(code, env).stdout.splitlines()
        if any(line.startswith("BUILT") for line in lines):
            sys.exit("warm_load: a timed load built the module: it was not warm")
        a, b = map(float, lines[-1].split())
        out.append((a, b))
    return out


def _slowest_imports(code: str, env: dict[str, str]) -> list[tuple[str, float]]:
    """The three slowest top-level imports of one process, from python -X importtime."""
    rows = []
    for line in _run(code, env, "-X", "importtime").stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            name = parts[2].rstrip()
            if len(name) - len(name.lstrip()) == 1:  # a top-level import (one space of indent)
                rows.append((name.strip(), int(parts[1]) / 1e6))
    return sorted(rows, key=lambda r: -r[1])[:3]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--file", default=str(HERE.parent / "examples" / "sgd.ccn"))
    ap.add_argument("--target", type=float, default=0.3, help="seconds a warm import + load may take (median)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="coconet_warm_") as cache:
        env = {**os.environ, "COCONET_CACHE": cache}
        code = TIMED.format(file=str(Path(args.file).absolute()))
        _run(code, env)  # cold: builds the module and writes the load's record
        warm = _times(code, env, args.reps)
        floor = _times(NUMPY, env, args.reps)
        slowest = _slowest_imports(code, env)
    imp = statistics.median(a for a, _ in warm)
    load = statistics.median(b for _, b in warm)
    total = statistics.median(a + b for a, b in warm)
    numpy_s = statistics.median(a for a, _ in floor)
    print(f"warm start of {args.file}, medians of {args.reps} fresh processes")
    print(f"  import coconetc          {imp * 1e3:8.1f} ms")
    print(f"  coconetc.load (warm)     {load * 1e3:8.1f} ms")
    print(f"  both                     {total * 1e3:8.1f} ms   (target {args.target * 1e3:.0f} ms)")
    print(f"  import numpy alone       {numpy_s * 1e3:8.1f} ms")
    print("  slowest imports of one warm process: " + ", ".join(f"{n} {s * 1e3:.0f} ms" for n, s in slowest))
    out = HERE / "results" / "warm_load.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"file": args.file, "reps": args.reps, "import_s": imp, "load_s": load,
                               "total_s": total, "numpy_import_s": numpy_s, "target_s": args.target,
                               "slowest_imports": slowest}, indent=1))
    if total > args.target:
        print(f"warm_load: {total:.3f} s is over the target of {args.target} s")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
