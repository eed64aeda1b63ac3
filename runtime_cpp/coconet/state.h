// coconet runtime: where the process-wide state lives (one instance per process).
//
// The runtime's state is the functions marked COCONET_STATE: each holds a static (or a
// thread-local) that every piece of code of the process must share: the threads per rank and
// their hook (comm.h), the key of the Comm cache (so every module and unit finds the same
// communicators and shared windows), the counters the Python side reads (fused_shm.h), the
// batch a thread runs in and its place there (turns.h: the binding sets them, the unit's code
// reads them). Three ways to build them:
//
//   * COCONET_DEFINES_RUNTIME (runtime.cpp): defined here, not inline, with default visibility:
//     the one definition of the process. coconetc's cached CPU builds compile runtime.cpp into
//     a shared library once per machine (libccnrt-<key>.so in the objects cache); every module
//     and every unit's shared object links it (DT_NEEDED, rpath), so the dynamic loader maps it
//     once and every one of them reaches the same state, however many units are loaded, and
//     whether dlopen'd (RTLD_LOCAL) or not (coconetc/toolchain/commands.py). A CMake build links
//     runtime.cpp into the one module .so.
//   * COCONET_LINKS_RUNTIME (a generated unit, bind.cpp): declared only, with default
//     visibility, so that a unit compiled with -fvisibility=hidden refers to the runtime's copy
//     instead of making one of its own.
//   * neither (code that uses the headers alone: runtime_cpp/tests, the CUDA backends): inline
//     definitions, as ordinary header-only code.
//
// Everything else in the headers is either per call or may be per shared object without harm:
// per-thread scratch memory (one per allocation site anyway), values read from the environment
// (the same in every copy), the MPI_Ops of 16-bit floats (one per copy, created once each), the
// batch's worker threads (Workers, turns.h: only the binding runs batches, one pool per module
// as before). The BLAS thread pool is the shared library's own (one per process: OpenBLAS's,
// or MKL's OpenMP threads); the loops' is the state's (loop_pool.h). A unit is never unmapped,
// so the state's callbacks (the BLAS hook, the Comm cache's delete callback) stay valid for the
// process's life.
#pragma once

// COCONET_SHARED: what the compiled runtime defines for every shared object of the process (the
// state, the collectives' instantiations of fused_shm.h): visible across shared objects.
#if defined(COCONET_DEFINES_RUNTIME) || defined(COCONET_LINKS_RUNTIME)
#define COCONET_SHARED __attribute__((visibility("default")))
#else
#define COCONET_SHARED
#endif
#if defined(COCONET_DEFINES_RUNTIME)
#define COCONET_STATE COCONET_SHARED
#define COCONET_STATE_BODY(...) __VA_ARGS__
#elif defined(COCONET_LINKS_RUNTIME)
#define COCONET_STATE COCONET_SHARED
#define COCONET_STATE_BODY(...) ;
#else
#define COCONET_STATE inline
#define COCONET_STATE_BODY(...) __VA_ARGS__
#endif

// COCONET_LIBRARY, COCONET_LIBRARY_BODY: the runtime's larger functions that every unit calls
// (the Comm cache, checking an MPI call, the trace's record, a GEMM's dimension check, ...),
// built as the state is: compiled once into the runtime library and only declared in a unit.
// Inline, every unit compiled them again with the standard library's code they instantiate;
// none is on a hot path (each runs once per call, per message or per GEMM), so a call into the
// library costs nothing measurable at -O3 either.
#define COCONET_LIBRARY COCONET_STATE
#define COCONET_LIBRARY_BODY COCONET_STATE_BODY
