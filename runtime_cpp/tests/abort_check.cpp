// errors.h: a rank that fails after communication started stops the whole job (no hang).
//   abort_check abort  -> the last rank calls abort_all("boom") while the others wait in a
//                         barrier; the job must end with "coconet rank R: boom" and exit != 0.
//   abort_check fused  -> the last rank's compute callback throws inside a fused collective.
#include <mpi.h>

#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "coconet/fused.h"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  coconet::Comm comm(MPI_COMM_WORLD, 1);
  bool last = comm.rank == comm.size - 1;
  const char* mode = argc > 1 ? argv[1] : "abort";
  if (std::strcmp(mode, "abort") == 0) {
    if (last) coconet::abort_all("boom");
    MPI_Barrier(MPI_COMM_WORLD);
  } else {
    const int64_t n = 1000;
    std::vector<float> g(n, 1.f), w(n, 0.f);
    auto compute = [&](int64_t b, int64_t e, const float* red) {
      if (last) throw std::runtime_error("boom");
      for (int64_t i = b; i < e; ++i) w[size_t(i)] = red[i - b];
    };
    coconet::fused_rs_compute_ag<float>(coconet::Op::sum, g.data(), n, comm, 64, compute,
                                        {coconet::gather_target(w.data(), n)});
  }
  std::printf("not aborted\n");
  MPI_Finalize();
  return 0;
}
