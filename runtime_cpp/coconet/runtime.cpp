// coconet runtime: what the headers leave to one translation unit, compiled once per machine:
// the process-wide state and the helpers every unit calls (state.h: defined here, once) and the
// collectives for every dtype (fused_shm.h, COCONET_COLLECTIVES). coconetc's cached
// builds make it a shared library every module and every unit links (state.h says why); a CMake
// build links it into the module beside the binding (bind.cpp). A generated unit includes the
// headers with COCONET_LINKS_RUNTIME defined, so it neither instantiates these again nor holds
// a copy of the state.
#define COCONET_DEFINES_RUNTIME
#include "coconet/module.h"

namespace coconet {

#define COCONET_INSTANTIATE_COLLECTIVES(T) COCONET_COLLECTIVES(T, )
COCONET_EACH_DTYPE(COCONET_INSTANTIATE_COLLECTIVES)
#undef COCONET_INSTANTIATE_COLLECTIVES

}  // namespace coconet
