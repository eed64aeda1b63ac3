"""The shipping path in Python, one package for every loaded module (CPU, CUDA, the host
emulation). Imports nothing from coconetc.interp or coconetc.tune.

    loader.py    coconetc.load: read the file once, compile (toolchain), import, wrap
    module.py    CompiledModule, ProgramFunction: the module API and a CPU call
    cuda.py      CudaModule, EmulatedModule: a CUDA call's entry and checks
    nccl.py      NCCL communicators (nccl_comm), what every rank of one says (exchange)
    abort_notices.py, watchdog.py  the NCCL abort path: notices, the watchdog, guarded calls
    symmetric_windows.py  window_empty: tensors a symmetric kernel reads in place
    emulation.py the CUDA host emulation's switch (COCONET_CUDA_EMULATE)
    call.py      a call's entry: this rank's checks, its description, the agreement
    agree.py     the exchange across ranks under the watchdog, the 64-byte repeat round
    fastpath.py  the remembered calls and the hot path
    marshal.py   CallArgs: tensors, outputs, sizes, scalars (every backend)
    layout.py    where a parameter lives on a rank (local_shape, local_index, empty, zeros)
    auto.py      schedule="auto", from the tuning records
    tuned.py     the tuning records (the tuner writes them, the runtime reads them)
    shm.py       coconetc.empty: buffers in MPI-3 shared memory
    batch.py     calls run as one step whose reductions span them (across_groups)
    hooks.py     the exception hook that stops an MPI job when one rank fails"""
