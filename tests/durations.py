"""The test time of each test file (seconds, the sum of its tests' setup, call and teardown),
read from a junit file of a whole run: `python tests/durations.py RUN.xml` rewrites
tests/durations.json. conftest.py runs the files in the order of these times, the longest
first, so that the two workers end together: a long test started last leaves the other
worker idle (a run ended with one worker idle about 250 s when the files ran by name)."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

TABLE = Path(__file__).with_name("durations.json")


def load() -> dict[str, float]:
    return json.loads(TABLE.read_text()) if TABLE.is_file() else {}


def main(junit: str) -> None:
    seconds: Counter[str] = Counter()
    for case in ET.parse(junit).iter("testcase"):
        seconds[case.get("classname", "").rsplit(".", 1)[-1] + ".py"] += float(case.get("time", 0))
    TABLE.write_text(json.dumps({f: round(s, 1) for f, s in sorted(seconds.items())}, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
