"""Rank programs: what each MPI rank runs when a module is run on ranks and checked against
the interpreter. Started by module path under mpiexec (coconetc/launch), never imported by
the rest of coconetc: the top layer, above the runtime, the oracle and the tuner.

    run.py           `coconetc run` (compiled): every schedule timed, then checked
    tune.py          `coconetc tune`: the candidates timed round-robin, the fastest checked
    check_module.py  the CMake package's check of a module it built (cmake/check_module.py)

and the helpers they share (with the test workers in tests/ and the benchmarks in bench/):

    args.py     the command line every rank program takes
    abort.py    a rank that fails ends the whole job (MPI Abort), so no rank waits for it
    timing.py   interleaved timed calls; the median of repetitions, the slowest rank's
    verify.py   one call on every rank checked against the interpreter on rank 0
    modules.py  the module a rank calls: CPU, CUDA under the host emulation, CUDA on this
                node's GPUs, or an extension built elsewhere (by CMake)"""
