"""The autotuner: a cost model over execution plans (plan/cost.py), the schedules it writes itself
(space.py), measurement under mpiexec (tuner.py; each rank runs coconetc/jobs/tune.py) and
what it explains (explain.py). Its records are written through coconetc/runtime/tuned.py, the
store the runtime reads for schedule="auto"."""
