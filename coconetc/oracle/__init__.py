"""The oracle's side of every check, apart from the interpreter itself (coconetc/interp) and
from the shipping path (coconetc/runtime): inputs.py (random inputs in a schedule's calling
convention), interpreted.py (an interpreted run of a schedule checked against its program:
`coconetc run --interp`), compare.py (two runs compared within each dtype's tolerance; a
compiled run against the interpreter), npz.py (a run's inputs and results saved). The rank
programs that check compiled modules on MPI ranks are in coconetc/jobs."""
