"""The tuning cache, as the autotuner and `coconetc show/explain` use it: the records store
lives below the runtime (coconetc/runtime/tuned.py), which reads it for schedule="auto"; the
tuner writes through it. Names re-exported here for the tuner's modules."""

from coconetc.plan.label import schedule_name
from coconetc.runtime.tuned import (cached_choice, generated_texts, key, lookup, machine, path, read_all,
                                    records, source_hash, store, tuned_schedules)

__all__ = ["cached_choice", "generated_texts", "key", "lookup", "machine", "path", "read_all", "records",
           "schedule_name", "source_hash", "store", "tuned_schedules"]
