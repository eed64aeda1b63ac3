// Runs every suite of the runtime's C++ tests on all ranks and prints "N passed, M failed"
// (summed over ranks) on rank 0.  Exit code 0 only if nothing failed on any rank.
#include <mpi.h>

#include <cstdio>
#include <exception>

#include "test_util.h"

namespace {

// Runs one suite; an exception is a failure of this rank, not a crash.
void run(const char* name, void (*suite)()) {
  t::counters().where = name;
  double t0 = MPI_Wtime();
  try {
    suite();
  } catch (const std::exception& e) {
    t::check(false, std::string("exception: ") + e.what());
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (t::world_rank() == 0) std::printf("  %-12s %.2fs\n", name, MPI_Wtime() - t0);
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  double t0 = MPI_Wtime();
  run("dtypes", t::test_dtypes);
  run("slices+comm", t::test_slices_and_comm);
  run("collectives", t::test_collectives);
  run("scattered", t::test_scattered);
  run("fused", t::test_fused);
  run("overlap", t::test_overlap);
  run("gemm", t::test_gemm);
  run("attention", t::test_attention);
  long mine[2] = {t::counters().passed, t::counters().failed}, all[2] = {0, 0};
  MPI_Reduce(mine, all, 2, MPI_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
  int rank, size;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  long failed_anywhere = 0;
  MPI_Allreduce(&mine[1], &failed_anywhere, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) {
    std::printf("ranks=%d time=%.2fs\n%ld passed, %ld failed\n", size, MPI_Wtime() - t0, all[0],
                all[1]);
    std::fflush(stdout);
  }
  MPI_Finalize();
  return failed_anywhere ? 1 : 0;
}
