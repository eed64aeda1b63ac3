"""Is `zero_bubble` (ZB-H1) the best order at 1F1B's memory? Every order of 2 pipeline ranks and M
micro-batches (each rank's F, B and W in micro-batch order, a B after its F, a W after its B, at
most 2 micro-batches held a rank from an F's start to its W's end: 1F1B's peak) simulated with
coconetc.pipeline.orders.simulate under the costs a `bench/pipeline.py --json` run measured (each
rank's mean F, B and W, its costs_per_rank_s; the transfer latency, the step's first action's
extra time and the gap between actions), against `zero_bubble`'s own order: the idle fraction of
each over 1F1B's.

Run: python bench/zb_h1_search.py RUN.json [RUN.json ...] [--microbatches 4]
(M = 4 is 89 orders a rank, 7,921 pairs; M = 8 is too many to try them all.)"""

from __future__ import annotations

import argparse
import json
from typing import Any

from coconetc.pipeline import orders as o


def rank_orders(M: int, limit: int) -> list[tuple[o.Action, ...]]:
    """Every list of one rank's actions that keeps the rules above."""
    out: list[tuple[o.Action, ...]] = []

    def walk(nf: int, nb: int, nw: int, acc: list[o.Action]) -> None:
        if nw == M:
            out.append(tuple(acc))
            return
        if nf < M and nf - nw < limit:
            walk(nf + 1, nb, nw, [*acc, o.Action("F", nf)])
        if nb < nf:
            walk(nf, nb + 1, nw, [*acc, o.Action("B", nb)])
        if nw < nb:
            walk(nf, nb, nw + 1, [*acc, o.Action("W", nw)])
    walk(0, 0, 0, [])
    return out


def costs_of(case: dict[str, Any]) -> list[o.Costs]:
    """Each rank's (stage's) Costs as bench/pipeline.py measured them for CASE."""
    per: dict[int, dict[str, float]] = {}
    for rank, _chunk, kind, seconds in case["costs_per_rank_s"]:
        per.setdefault(rank, {})[kind] = seconds
    return [o.Costs(forward=c["F"], input_grad=c["B"], weight_grad=c["W"], backward=c["B"] + c["W"],
                    transfer=case["transfer_latency_s"], first=case["first_action_extra_s"], gap=case["action_gap_s"])
            for _, c in sorted(per.items())]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="bench/pipeline.py --json files")
    ap.add_argument("--microbatches", type=int, default=4)
    a = ap.parse_args()
    M = a.microbatches
    lists = rank_orders(M, 2)
    print(f"2 ranks, M = {M}: {len(lists)} orders a rank; idle time over 1F1B's (the same costs)")
    print(f"{'run':<48} {'1F1B':>7} {'zero_bubble':>12} {'best order':>11} {'measured':>9}")
    for path in a.runs:
        with open(path) as f:
            results = json.load(f)["results"]
        case = next((c for c in results if c["P"] == 2 and c["M"] == M and c["order"] == "zero_bubble"), None)
        if case is None:
            print(f"{path:<48} (no zero_bubble case at P = 2, M = {M})")
            continue
        costs = costs_of(case)
        one = o.simulate(o.make("1f1b", 2, M), costs).bubble()
        ours = o.simulate(o.make("zero_bubble", 2, M), costs)
        best = ours
        for first in lists:
            for last in lists:
                try:
                    t = o.simulate(o.Order("zero_bubble", 2, M, 1, True, (first, last), False), costs)
                except ValueError:  # an order that deadlocks
                    continue
                if t.makespan < best.makespan:
                    best = t
        measured = next((c["bubble_measured"] for c in results if c["P"] == 2 and c["M"] == M and c["order"] == "1f1b"),
                        None)
        ratio = f"{case['bubble_measured'] / measured:.3f}" if measured else "-"
        print(f"{path[-48:]:<48} {one:>7.3f} {ours.bubble() / one:>12.3f} {best.bubble() / one:>11.3f} {ratio:>9}")


if __name__ == "__main__":
    main()
