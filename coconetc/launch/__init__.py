"""Starting ranks: the mpiexec that comes with the installed MPI (mpiexec.py). A leaf: it
imports nothing from coconetc, so the tuner, the CLI, the tests and the benchmarks all start
ranks with it. What the ranks run (the rank programs) is in coconetc/jobs."""
