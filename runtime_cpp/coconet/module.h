// coconet runtime: what a generated CPU module includes.  CallArgs carries one call's
// arguments from the Python side (coconetc/runtime/loader.py), which has already checked every
// dtype, shape, layout size and segment list on every rank before anything here runs.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <memory>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "batch.h"
#include "call_args.h"
#include "collectives.h"
#include "comm.h"
#include "dtypes.h"
#include "errors.h"
#include "attention.h"
#include "fused.h"
#include "gemm.h"
#include "grad.h"
#include "overlap.h"
#include "kernels.h"
#include "loop_pool.h"
#include "rng.h"
#include "segments.h"
#include "slices.h"
#include "state.h"
#include "trace.h"

#ifdef _OPENMP
#include <omp.h>
#endif

// With COCONET_VECTOR_MATH (coconetc's own builds where glibc's vector math library, libmvec, is
// linked: toolchain/probes.py vector_math), the float exp, log and tanh that generated loops call
// have glibc's vector versions, so such a loop vectorizes (GCC calls _ZGV*_expf on 8 or 16
// elements) instead of calling the library once an element: a GELU backward loop of 262k
// elements took 983 us scalar, 162 us so (docs/cpu_backend.md).
#if defined(COCONET_VECTOR_MATH) && defined(__GNUC__) && !defined(__clang__)
#include <cmath>
extern "C" {
float expf(float) noexcept __attribute__((__simd__("notinbranch")));
float logf(float) noexcept __attribute__((__simd__("notinbranch")));
#if defined(__GLIBC_PREREQ)
#if __GLIBC_PREREQ(2, 35)
float tanhf(float) noexcept __attribute__((__simd__("notinbranch")));
#endif
#endif
}
#endif

// Before a generated pointwise loop: iterations are independent. Every loop reads a buffer it
// also writes (an in-place update) only at the element it writes, so there is no loop-carried
// dependence, and the compiler may vectorize without runtime alias checks.
#if defined(__clang__)
#define COCONET_IVDEP _Pragma("clang loop vectorize(assume_safety)")
#elif defined(__GNUC__)
#define COCONET_IVDEP _Pragma("GCC ivdep")
#else
#define COCONET_IVDEP
#endif

namespace coconet {

// Threads per rank: COCONET_THREADS, else the cores divided among the ranks of the caller's
// communicator on this node (counted by the first Comm, comm.h; 1 until then).
inline int omp_threads() { return std::max(1, process_threads().load(std::memory_order_relaxed)); }

// A generated loop's blocks fn(b), b in [0, nb), on omp_threads() threads (loop_pool.h).
template <class F>
inline void parallel_blocks(int64_t nb, F&& fn) {
  loop_pool().run(nb, omp_threads(), std::function<void(int64_t)>(std::ref(fn)));
}

// Elements per chunk of a fused collective: COCONET_CHUNK, else 2^16.
inline int64_t fused_chunk_elems() {
  static int64_t n = [] {
    const char* env = std::getenv("COCONET_CHUNK");
    return env ? std::max<int64_t>(1, std::atoll(env)) : int64_t(1) << 16;
  }();
  return n;
}

// Elements per chunk of a fused collective that runs as an overlap task over `count` elements
// of a group of R ranks: COCONET_CHUNK when set, else large enough that the task takes two
// rounds (each round's messages are posted as soon as the previous one is consumed, so few
// large rounds let the transfers advance between the GEMM steps that test them), and at least
// fused_chunk_elems().
inline int64_t overlap_task_chunk_elems(int64_t count, int R) {
  static const bool set = std::getenv("COCONET_CHUNK") != nullptr;
  if (set) return fused_chunk_elems();
  const int64_t per_rank = (count + R - 1) / std::max(R, 1);
  return std::max(fused_chunk_elems(), (per_rank + 1) / 2);
}

// At the start of every generated function, before its Comm: COCONET_THREADS if set; and BLAS
// gets as many threads as the loops (the cores left per rank), so ranks sharing a node do
// not oversubscribe it with spinning BLAS threads.
COCONET_LIBRARY void init_threads() COCONET_LIBRARY_BODY({
  static bool done = [] {
    on_threads_set() = [](int n) { set_blas_threads(n); };
    if (const char* env = std::getenv("COCONET_THREADS")) {
      process_threads() = std::max(1, std::atoi(env));
      set_blas_threads(process_threads().load());
    }
    return true;
  }();
  (void)done;
})

// A temporary of n elements for allocation site Site of a generated function, kept per thread
// across calls (grown when needed), so repeated calls neither allocate nor page-fault.  A
// module function may run in several threads at once; one thread never reenters it.
template <class T, int Site>
T* scratch(int64_t n) {
  static thread_local std::vector<T> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(static_cast<size_t>(n));
  return buf.data();
}

// Scratch memory for n elements of T that a fused collective or an all-reduce of this call
// reads (the generated code's intermediate `y` of `s = allreduce(sum, y)`, a fused
// reduce-scatter's source): in the group's own shared window `Site` when the collectives go
// through the window, so the peers read it in place and nothing is staged; else the thread's
// scratch (scratch<T, Site> above). Collective over the group (every rank declares the same
// buffers in the same order).
constexpr int kBatchSites = 1 << 16;  // shared_scratch sites of one call of a batch
template <class T, int Site>
T* shared_scratch(Comm& comm, int64_t n) {
  if (!shm_chosen(comm)) return scratch<T, Site>(n);
  // each call of a batch (batch.h) its own, as its scratch is its thread's
  const int site = Site + kBatchSites * batch_slot();
  return reinterpret_cast<T*>(comm.shm.own(site, static_cast<size_t>(std::max<int64_t>(n, 0)) * sizeof(T)));
}

// n rounded up to a multiple of m (m > 0): chunks that hold whole rows.
inline int64_t round_up(int64_t n, int64_t m) { return m > 0 ? (n + m - 1) / m * m : n; }

// What Python passes (call_args.h), with the MPI communicator and the fused collectives' algorithm.
struct CallArgs : CallArgsBase {
  uintptr_t comm = 0;  // MPI_Comm handle (mpi4py's _handleof)
  // The fused collectives' algorithm for this call (a schedule label "S@p2p" / "S@shm", the
  // autotuner's choice): 0 as COCONET_FUSED says, 1 point-to-point, 2 the shared window when
  // every rank of the group is on this node.
  int fused = 0;
  std::vector<uint64_t> windows;  // coconetc.empty's shared windows: (id, address, bytes, MPI_Win) each

  MPI_Comm mpi_comm() const {
    MPI_Comm c;
    static_assert(sizeof(MPI_Comm) <= sizeof(uintptr_t), "MPI_Comm handle does not fit");
    if (sizeof(MPI_Comm) == sizeof(uintptr_t)) {
      std::memcpy(&c, &comm, sizeof(MPI_Comm));
    } else {
      int h = static_cast<int>(comm);
      std::memcpy(&c, &h, sizeof(MPI_Comm));
    }
    return c;
  }
};

}  // namespace coconet
