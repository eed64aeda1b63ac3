"""Re-draws the PNG plot of a benchmark's JSON (as written by --json): speed-up against size.

Run: python bench/plot.py RESULT.json [OUT.png] [--title TITLE]"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("out", nargs="?")
    ap.add_argument("--title", default=None)
    a = ap.parse_args()
    doc = json.loads(Path(a.json).read_text())
    results = {int(n): r for n, r in doc["sizes"].items()}
    best = list(results[min(results)]["baselines"])
    best = [b for b in best if b not in ("bare matmul",)]
    out = Path(a.out) if a.out else Path(a.json).with_suffix(".png")
    common.plot(a.title or Path(a.json).stem, results, best, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
