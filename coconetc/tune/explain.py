"""`coconetc explain`: for each schedule of a program, the cost model's numbers (cost.py) next
to the time the tuning cache measured at the same sizes and ranks, if any. The schedules the
tuner wrote and measured for these sizes are listed too.

A target ("cpu", "cuda", "cuda-emulated") picks the records: those measured there (tuned.py).
The cost model is the CPU backend's, so on a CUDA target its modelled time is left out (the
header says so): its counts (bytes moved and sent, passes, launches, units) are the plan's as
the CPU backend runs it, and the per-unit algorithm, the CPU runtime's, is not shown."""

from __future__ import annotations

from coconetc.plan.label import DEFAULT, parse
from coconetc.sourcefile import SourceFile, add_schedules
from coconetc.oracle.inputs import size_symbols
from coconetc.runtime import tuned as cache
from coconetc.tune.cost import cost


class ExplainError(Exception):
    pass


def symbols(mod: SourceFile, program: str) -> list[str]:
    return size_symbols(mod.programs[program])


def _sizes(mod: SourceFile, program: str, ranks: int, given: dict[str, int],
           target: str) -> dict[str, int]:
    need = symbols(mod, program)
    if all(k in given for k in need):
        return {k: given[k] for k in need}
    recs = [r for r in cache.records(mod.source, program, target) if r.get("ranks") == ranks]
    if recs and not given:
        return dict(recs[-1]["sizes"])
    missing = " ".join(f"--size {k}=INT" for k in need if k not in given)
    sizes = {k: given.get(k, "INT") for k in need}
    raise ExplainError(f"explain {program}: give the sizes ({missing}); the tuning cache has "
                       f"no record of '{program}' on {ranks} ranks{cache.MEASURED_ON[target]} to take "
                       f"them from (`{cache.tune_command(mod.file, program, ranks, sizes, target)}` makes one)")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def explain(mod: SourceFile, program: str, schedule: str | None, ranks: int,
            given: dict[str, int], nodes: int = 1, target: str = "cpu") -> str:
    """The table for one program (all its schedules, or SCHEDULE; 'auto': the tuned choice);
    over NODES nodes, with the bytes per rank that cross the network (docs/cluster.md); the
    measured times those of TARGET's records (on a CUDA target, no modelled time)."""
    if nodes < 1 or ranks % nodes:
        raise ExplainError(f"--nodes {nodes} does not divide the {ranks} ranks into equal nodes")
    sizes = _sizes(mod, program, ranks, given, target)
    rec = cache.lookup(mod.source, program, sizes, ranks, target=target)
    if rec is not None:
        extra = cache.generated_texts(rec)
        mod = add_schedules(mod, extra) if extra else mod
    labels = _labels(mod, program, schedule, rec)
    if schedule == "auto" and rec is None:
        raise ExplainError(f"no tuned choice for '{program}' at these sizes on {ranks} ranks"
                           f"{cache.MEASURED_ON[target]}; run "
                           f"`{cache.tune_command(mod.file, program, ranks, sizes, target)}`")
    modelled = target == "cpu"  # the cost model is the CPU backend's
    measured = rec["measured"] if rec is not None else {}
    head = (f"{'schedule':<26} {'moved':>11} {'sent/rank':>11} " + (f"{'net/rank':>11} " if nodes > 1 else "")
            + f"{'passes':>6} {'launches':>8} {'units':>5} " + (f"{'modelled':>11} " if modelled else "")
            + f"{'measured':>11}")
    lines = [_title(program, sizes, ranks, nodes, target), head]
    for label in labels:
        lab = parse(label)
        c = cost(mod.plans[(program, lab.name)], sizes, ranks, nodes, window=lab.algorithm != "p2p")
        got = f"{measured[label] * 1e3:.3f} ms" if label in measured and nodes == 1 else "-"
        note = " (tuner's choice)" if rec is not None and label == rec["choice"] else ""
        note += " (generated)" if rec is not None and label in rec["generated"] else ""
        net = f"{_human(c.net):>11} " if nodes > 1 else ""
        model = f"{c.seconds() * 1e3:>8.3f} ms " if modelled else ""
        lines.append(f"{label:<26} {_human(c.moved):>11} {_human(c.sent):>11} {net}{c.passes:>6} "
                     f"{c.launches:>8} {c.units:>5} {model}{got:>11}{note}")
        if len(labels) == 1:
            lines += _units(c, algorithms=modelled)
    if rec is None and not modelled:
        lines.append(f"(no record{cache.MEASURED_ON[target]} at these sizes on {ranks} ranks: run "
                     f"`{cache.tune_command(mod.file, program, ranks, sizes, target)}`)")
    return "\n".join(lines) + "\n"


def _labels(mod: SourceFile, program: str, schedule: str | None, rec: dict | None) -> list[str]:
    """The rows: every schedule (each measured with another fused-collective algorithm after
    it), or SCHEDULE ('auto': the record's choice)."""
    labels = ["default", *(s for s, x in mod.schedules.get(program, {}).items() if not x.auto)]
    if rec is not None:
        labels = [x for s in labels for x in [s, *sorted(m for m in rec["measured"]
                                                          if parse(m).name == s and m != s)]]
    if schedule == "auto":
        return [rec["choice"]] if rec is not None else []
    if schedule is None:
        return labels
    try:  # a label: "zero", "zero@p2p", "default"
        name = parse(schedule).name
    except ValueError as err:
        raise ExplainError(str(err)) from None
    if name != DEFAULT and name not in mod.schedules.get(program, {}):
        raise ExplainError(f"no schedule '{name}' for program '{program}' (schedules: "
                           f"{', '.join(labels)})")
    return [schedule]


def _title(program: str, sizes: dict[str, int], ranks: int, nodes: int, target: str) -> str:
    shown = ", ".join(f"{k}={v}" for k, v in sizes.items())
    where = f"{ranks} ranks" + (f" over {nodes} nodes" if nodes > 1 else "")
    if target == "cpu":
        return f"{program} at {shown} on {where} (per rank; cost model: docs/performance.md)"
    return (f"{program} at {shown} on {where}, measured{cache.MEASURED_ON[target]} (per rank; the "
            f"counts are the CPU cost model's, docs/performance.md; its modelled times are the CPU "
            f"backend's and do not apply to {target}, so none is shown)")


def _units(c, algorithms: bool = True) -> list[str]:
    """One row per plan unit (a single schedule explained); ALGORITHMS: each collective's, as
    the CPU runtime chooses it."""
    out = []
    for u, part in c.parts:
        where = f"L{u.line}" if getattr(u, "line", 0) else "-"
        what = type(u).__name__.lower()
        name = getattr(u, "dst", "") or getattr(u, "name", "") or getattr(u, "producer", "")
        label = f"  {where} {what} {name}".rstrip()
        algo = f"  ({part.algorithm})" if part.algorithm and algorithms else ""
        out.append(f"{label:<26} {_human(part.moved):>11} {_human(part.sent):>11} {part.passes:>6} "
                   f"{part.launches:>8}{algo}")
    return out
