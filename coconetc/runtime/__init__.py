"""The shipping path in Python: loading a compiled module and calling it (loader.py), the
cross-rank agreement and watchdog at each call's entry (agree.py), and the exception hook that
stops an MPI job when one rank fails (hooks.py). Imports nothing from coconetc.interp."""
