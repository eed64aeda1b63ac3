"""The oracle's side of every check: random inputs in a schedule's calling convention,
interpreted runs (session.py) and the comparison of a run (interpreted or compiled) with the
interpreter (core.py). Apart from the interpreter itself (coconetc/interp) and from the
shipping path (coconetc/runtime)."""
