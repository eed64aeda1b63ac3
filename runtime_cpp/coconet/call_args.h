// coconet runtime: the call's arguments as Python passes them, the part the CPU and the CUDA
// runtime share (module.h's CallArgs adds the MPI communicator and the fused collectives'
// algorithm, cuda/runtime.cuh's the stream and the NCCL communicator). No MPI here.
#pragma once

#include <cstdint>
#include <vector>

#include "pieces.h"

namespace coconet {

struct CallArgsBase {
  std::vector<uintptr_t> tensors;                // data pointers, one per tensor parameter
  std::vector<std::vector<uintptr_t>> seg_ptrs;  // per tensor parameter: its segments (scattered)
  std::vector<int64_t> seg_sizes;                // segment sizes (all scattered params share them)
  std::vector<uintptr_t> outputs;                // data pointers of the output arrays
  std::vector<int64_t> sizes;                    // size symbols, sorted by name
  std::vector<double> scalars;                   // scalar parameters (float ones)
  std::vector<int64_t> iscalars;                 // scalar parameters (integer ones)
  int groups = 1;

  template <class T> T* tensor(size_t k) const { return reinterpret_cast<T*>(tensors.at(k)); }
  template <class T> T* output(size_t k) const { return reinterpret_cast<T*>(outputs.at(k)); }
  template <class T> Segments<T> segments(size_t k) const {
    std::vector<T*> ptrs;
    for (uintptr_t p : seg_ptrs.at(k)) ptrs.push_back(reinterpret_cast<T*>(p));
    return Segments<T>(ptrs, seg_sizes);
  }
};

}  // namespace coconet
