"""The run harness: random inputs in a schedule's calling convention, interpreted runs
(session.py) and the comparison of a run (interpreted or compiled) with the oracle. Apart
from the oracle itself (coconetc/interp) and from the shipping path (coconetc/runtime)."""
