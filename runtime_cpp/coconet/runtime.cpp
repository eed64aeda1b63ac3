// coconet runtime: what the headers leave to one translation unit, compiled once per machine and
// linked into every CPU module beside its binding (bind.cpp): the collectives through the
// shared-memory window for every dtype (fused_shm.h, COCONET_SHM_COLLECTIVES). A generated unit
// includes the headers with COCONET_LINKS_RUNTIME defined, so it does not instantiate them again.
#include "coconet/module.h"

namespace coconet {

#define COCONET_INSTANTIATE_SHM_COLLECTIVES(T) COCONET_SHM_COLLECTIVES(T, )
COCONET_EACH_DTYPE(COCONET_INSTANTIATE_SHM_COLLECTIVES)
#undef COCONET_INSTANTIATE_SHM_COLLECTIVES

}  // namespace coconet
