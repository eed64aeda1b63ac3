// coconet runtime: the argument check both runtimes (CPU and CUDA) throw from, before any
// communication (errors.h says why: pybind11 turns it into a ValueError on every rank alike).
// No MPI here: the CUDA runtime includes it too.
#pragma once

#include <stdexcept>
#include <string>

namespace coconet {

// Argument check before any communication: throws std::invalid_argument(msg) if !ok.
inline void require(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument(msg);
}

}  // namespace coconet
