"""Check a module built by CMake's coconet_add_module against coconetc's reference interpreter.

Run under mpiexec (every rank runs this script):

    mpiexec -n 2 python check_module.py build/sgd_mod.cpython-*.so examples/sgd.ccn --size N=17

The check itself is coconetc's rank program coconetc/jobs/check_module.py (`python -m
coconetc.jobs.check_module` runs it too); this script keeps the path that CMake projects name."""

import sys

from coconetc.jobs.check_module import main

if __name__ == "__main__":
    sys.exit(main())
