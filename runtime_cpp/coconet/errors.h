// coconet runtime: how failures are reported without hanging the other ranks.
//
// Policy (what generated code does):
//   * Argument checks (shapes, dtypes, layouts, segment sizes, group counts) run BEFORE any
//     communication and throw C++ exceptions (std::invalid_argument via require()); pybind11
//     turns them into Python exceptions (ValueError).  Every rank sees the same global shapes,
//     so every rank throws at the same place and nobody waits in a collective.
//   * Collectives in this runtime may also throw std::invalid_argument, but only for conditions
//     that are identical on every rank of the group (sizes that do not fit MPI's int counts, a
//     root outside the group) and only before they communicate.
//   * Once communication has started, a failure on one rank (an MPI error, an exception thrown
//     by a compute callback inside a fused collective, a failed allocation) cannot be reported
//     by an exception: the other ranks would wait forever for messages that never come.  Such
//     failures call abort_all(), which prints "coconet rank R: msg" and calls MPI_Abort, so the
//     whole job stops at once instead of hanging.
//   * All MPI calls of the runtime go through COCONET_MPI(call): the communicators the runtime
//     creates use MPI_ERRORS_RETURN, and a failing call is turned into abort_all() with MPI's
//     own error string.
#pragma once

#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <stdexcept>
#include <string>

#include "require.h"
#include "state.h"

namespace coconet {

// Rank in MPI_COMM_WORLD, or -1 when MPI is not running (before MPI_Init, after MPI_Finalize).
COCONET_LIBRARY int world_rank_or_none() COCONET_LIBRARY_BODY({
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return -1;
  int rank = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
})

// Stops every rank of the job: prints "coconet rank R: msg" to stderr and calls MPI_Abort.
// For failures after communication has started (see the policy above).
[[noreturn]] inline void abort_all(const std::string& msg, int code = 1) {
  int rank = world_rank_or_none();
  std::fprintf(stderr, "coconet rank %d: %s\n", rank, msg.c_str());
  std::fflush(stderr);
  if (rank >= 0) MPI_Abort(MPI_COMM_WORLD, code);
  std::abort();
}

// Turns a failed MPI call into abort_all() with MPI's error string.
COCONET_LIBRARY void check_mpi(int rc, const char* what) COCONET_LIBRARY_BODY({
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  abort_all(std::string(what) + " failed: " + std::string(text, len));
})

#define COCONET_MPI(call) ::coconet::check_mpi((call), #call)

// Runs f(); any exception escaping it aborts the job.  Wraps code that runs while messages are
// in flight (the compute callbacks of fused collectives), where throwing would hang the others.
template <class F>
void abort_on_exception(const char* where, F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    abort_all(std::string(where) + ": " + e.what());
  } catch (...) {
    abort_all(std::string(where) + ": unknown exception");
  }
}

}  // namespace coconet
