"""The shipping path in Python, one package for every loaded module (CPU, CUDA, the host
emulation). Imports nothing from coconetc.interp or coconetc.tune.

    loader.py    coconetc.load: read the file once, compile (toolchain), import, wrap
    warm.py      what a load made of a file, remembered: a warm load reads it and imports none
                 of the front half, the planner or the code generators
    module.py    CompiledModule, ProgramFunction: the module API and a CPU call
    cuda.py      CudaModule, EmulatedModule: the CUDA modules
    backends.py  the backend objects (cpu, cuda, cuda-emulated): what differs between them
                 (tensor checks, addresses, outputs, transports, devices), asked by the
                 entry, coconetc.torch and the CLI instead of branching on a name
    programs.py  what both modules do with their programs: a function per program (bind),
                 a schedule label resolved (resolve, program_of), a call's arguments laid
                 out and run (run)
    entry.py     a call's one entry: checked, agreed, remembered; returns a Call
    checks.py    the one argument checker (names, scalars, each buffer, overlaps)
    call.py      a call's description and the checks that every rank's agrees
    agree.py     the exchange across ranks, the 64-byte repeat round
    fastpath.py  the record of recent calls (RecentCall) and the CPU hot path
    timeout.py   COCONET_TIMEOUT
    watchdog.py  the watchdog (one class, Watchdog): a call on a communicator, watched where it
                 waits (an MPI request; an NCCL communicator's thread), the abort path
    nccl.py      NCCL communicators (nccl_comm), what every rank of one says (exchange)
    abort_notices.py, events.py  the abort path's notices, a CUDA call's work timed on the GPU
    symmetric_windows.py  window_empty: tensors a symmetric kernel reads in place
    emulation.py the CUDA host emulation's switch (COCONET_CUDA_EMULATE)
    marshal.py   CallArgs: tensors, outputs, sizes, scalars (every backend)
    layout.py    where a parameter lives on a rank (local_shape, local_index, empty, zeros)
    auto.py      schedule="auto", from the tuning records (choice: the one home of a size set's)
    tuned.py     the tuning records (the tuner writes them, the runtime reads them)
    shm.py       coconetc.empty: buffers in MPI-3 shared memory
    node_ranks.py  which ranks share a node (and COCONET_SIMULATE_NODES)
    batch.py     calls run as one step whose reductions span them (across_groups)
    hooks.py     the exception hook that stops an MPI job when one rank fails"""
