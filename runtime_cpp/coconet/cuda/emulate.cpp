// coconet host emulation: what the emulation's headers leave to one translation unit, the
// functions and variables marked COCONET_EMU (emulate_types.h says why): coconetc's builds
// compile this file once per runtime and options into the emulation library,
// libccnemu-<key>.so, which every emulated module links; the modules include the headers with
// COCONET_EMULATE_LINKS, so that the process holds one emulation however many modules it loads.
#define COCONET_EMULATE_DEFINES
#include "coconet/cuda/runtime.cuh"
