"""The autotuner: a cost model over execution plans (cost.py), the schedules it writes itself
(space.py), measurement under mpiexec (tuner.py, worker.py) and the tuning cache (cache.py)."""

from coconetc.tune.cache import cached_choice

__all__ = ["cached_choice"]
