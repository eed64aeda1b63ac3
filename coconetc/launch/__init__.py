"""Starting ranks: the mpiexec that comes with the installed MPI (mpiexec.py), and what each
rank of `coconetc run` runs (worker.py)."""
