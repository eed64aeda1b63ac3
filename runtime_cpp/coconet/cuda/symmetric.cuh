// coconet CUDA runtime: a fused reduce-scatter + compute + all-gather as ONE kernel over NCCL
// symmetric memory (NCCL's device API), the second algorithm of a `Fused` unit next to the chunked
// host-API pipeline (runtime.cuh: pipeline). Used where every rank of the group is in one LSA team
// (load/store access: one node, NVLink or PCIe P2P) and NCCL's device API is available; chosen at
// run time (use_symmetric), forced with COCONET_CUDA_FUSED=pipeline|symmetric|auto (the same on
// every rank). Under the host emulation (g++ -DCOCONET_EMULATE) the device API comes from
// emulate_nccl_device.h: windows in POSIX shared memory, LSA barriers across the rank processes.
//
// Covered (the renderer emits this path only for them): a reduce-scatter along dim 0 of a
// contiguous (not scattered) tensor, pointwise phases only, not inside an overlap.
//
// One call: the input is staged into this rank's window (one copy); then the kernel, whose block b
// of every rank pairs with block b of every peer at each LSA barrier:
//   1. barrier (acquire): every rank's input is staged
//   2. each thread takes elements l of this rank's slice (grid-stride: block b takes the same
//      elements on every call), loads element l of the slice from every peer's window (peer loads),
//      reduces them (sum, avg, max, min; in the compute type, as the plan says), runs the fused
//      element function (the same element math as the pipeline's chunk kernel, rendered from the
//      same body), and stores the gathered value in this rank's window
//   3. barrier (acq_rel): every rank's computed slice is in its window
//   4. block b reads the elements block b of each peer wrote in step 2 from that peer's window
//      (peer loads) straight into the caller's gathered tensor.
// Pull, not push, for the gather: the peers' values land in the caller's tensor without a copy
// out of the window afterwards (one pass over N fewer) and without a third barrier: a rank writes
// its window again only after the next call's first barrier, which a peer reaches only when its
// previous kernel, and with it its reads of that window, is over (stream order).
#pragma once

#ifndef COCONET_EMULATE
#include <nccl_device.h>
#define COCONET_ACCESS_ALSO(...)
#else
#define COCONET_ACCESS_ALSO(...) ::coconet::cuda::emu::declare_also({__VA_ARGS__})
#endif

#include <cstdio>

namespace coconet {
namespace cuda {

// The kernel's grid is at most this many blocks (one LSA barrier each), of kSymThreads threads.
constexpr int kSymBlocks = 32;
constexpr int kSymThreads = 512;

enum class FusedAlgo { automatic, pipeline, symmetric };

// COCONET_CUDA_FUSED: auto (default), pipeline or symmetric.
inline FusedAlgo fused_algo() {
  static const FusedAlgo a = [] {
    const char* s = std::getenv("COCONET_CUDA_FUSED");
    const std::string v = s ? s : "";
    if (v.empty() || v == "auto") return FusedAlgo::automatic;
    if (v == "pipeline") return FusedAlgo::pipeline;
    if (v == "symmetric") return FusedAlgo::symmetric;
    throw std::invalid_argument("COCONET_CUDA_FUSED='" + v + "': expected auto, pipeline or symmetric");
  }();
  return a;
}

// A communicator's device-API state, made on first use and kept: whether the symmetric kernel can
// run on it (and why not), its device communicator (LSA barriers) and its window.
struct Symmetric {
  bool ok = false;
  std::string why;
  bool dev_made = false;
  ncclDevComm dev{};
  void* buf = nullptr;
  size_t bytes = 0;
  ncclWindow_t win = nullptr;
};

// NCCL 2.29 added ncclCommQueryProperties and the requirements' initializer; 2.28 (the NCCL that
// torch 2.11 pins) has the device API without them: its requirements are zero-initialized, and
// whether a communicator supports the device API shows only when its device communicator is made.
#if defined(NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER)
#define COCONET_DEV_COMM_REQUIREMENTS NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER
#else
#define COCONET_DEV_COMM_REQUIREMENTS {}
#endif

// Make the device communicator of `comm` into `s` (collective over the communicator).
inline ncclResult_t make_dev_comm(ncclComm_t comm, Symmetric& s) {
  ncclDevCommRequirements_t reqs = COCONET_DEV_COMM_REQUIREMENTS;
  reqs.lsaBarrierCount = kSymBlocks;
  const ncclResult_t r = ncclDevCommCreate(comm, &reqs, &s.dev);
  s.dev_made = r == ncclSuccess;
  return r;
}

inline Symmetric probe_symmetric(ncclComm_t comm, const Group& g) {
  Symmetric s;
#if defined(NCCL_COMM_PROPERTIES_INITIALIZER)
  ncclCommProperties_t props = NCCL_COMM_PROPERTIES_INITIALIZER;
  if (ncclCommQueryProperties(comm, &props) != ncclSuccess) {
    s.why = "ncclCommQueryProperties failed";
    return s;
  }
  if (!props.deviceApiSupport) {
    s.why = "this communicator has no NCCL device API support";
    return s;
  }
#endif
  const ncclTeam_t lsa = ncclTeamLsa(comm);
  if (lsa.nRanks != g.size || lsa.rank != g.rank) {
    s.why = "not every rank of the group is in this rank's LSA team (lsaSize " + std::to_string(lsa.nRanks) +
            ", " + std::to_string(g.size) + " ranks)";
    return s;
  }
#if !defined(NCCL_COMM_PROPERTIES_INITIALIZER)
  // No query before NCCL 2.29: making the device communicator is the test. Every rank probes at
  // the same call (the first fused unit of the call), so the collective creation lines up.
  if (make_dev_comm(comm, s) != ncclSuccess) {
    s.why = std::string("ncclDevCommCreate failed (no NCCL device API here?): ") + ncclGetLastError(comm);
    return s;
  }
#endif
  s.ok = true;
  return s;
}

inline std::mutex& symmetric_mutex() {
  static std::mutex mu;
  return mu;
}
// The state of communicator `comm` (the caller holds symmetric_mutex()).
inline Symmetric& symmetric_state(ncclComm_t comm, const Group& g) {
  static std::map<ncclComm_t, Symmetric> states;
  auto it = states.find(comm);
  if (it == states.end()) it = states.emplace(comm, probe_symmetric(comm, g)).first;
  return it->second;
}

// Does fused unit `unit` run as the symmetric kernel here? auto: where the device API is
// available, every rank of the group is in the LSA team and the group has more than one rank;
// symmetric: wherever it can run (one rank included), an error elsewhere; pipeline: never.
// COCONET_CUDA_FUSED_TRACE=1 prints the choice (rank, unit, algorithm) on stderr.
inline bool use_symmetric(const Ctx& c, const char* unit) {
  const FusedAlgo a = fused_algo();
  bool sym = false;
  if (a != FusedAlgo::pipeline) {
    std::lock_guard<std::mutex> lock(symmetric_mutex());
    const Symmetric& s = symmetric_state(c.comm, c.group);
    if (a == FusedAlgo::symmetric && !s.ok)
      throw std::runtime_error(std::string("coconet (cuda): COCONET_CUDA_FUSED=symmetric, but fused ") + unit +
                               " cannot run over symmetric memory: " + s.why);
    sym = s.ok && (a == FusedAlgo::symmetric || c.group.size > 1);
  }
  static const bool trace = [] {
    const char* t = std::getenv("COCONET_CUDA_FUSED_TRACE");
    return t && *t && std::string(t) != "0";
  }();
  if (trace)
    std::fprintf(stderr, "coconet fused: rank %d of %d: %s runs the %s\n", c.group.rank, c.group.size, unit,
                 sym ? "symmetric kernel" : "pipeline");
  return sym;
}

// This communicator's window of at least `bytes` (collective: every rank asks for the same size
// in the same order, as every rank runs the same calls) and its device communicator, made once
// (the window grown when a call needs more). The caller holds symmetric_mutex().
inline Symmetric& symmetric_window(const Ctx& c, size_t bytes) {
  Symmetric& s = symmetric_state(c.comm, c.group);
  if (!s.dev_made) COCONET_CUDA(make_dev_comm(c.comm, s));
  if (s.bytes < bytes) {
    if (s.win) {
      COCONET_CUDA(cudaDeviceSynchronize());  // the old window may still be read by a queued kernel
      COCONET_CUDA(ncclCommWindowDeregister(c.comm, s.win));
      COCONET_CUDA(ncclMemFree(s.buf));
    }
    bytes = (bytes + NCCL_WIN_REQUIRED_ALIGNMENT - 1) / NCCL_WIN_REQUIRED_ALIGNMENT * NCCL_WIN_REQUIRED_ALIGNMENT;
    COCONET_CUDA(ncclMemAlloc(&s.buf, bytes));
    COCONET_CUDA(ncclCommWindowRegister(c.comm, s.buf, bytes, &s.win, NCCL_WIN_COLL_SYMMETRIC));
    s.bytes = bytes;
    COCONET_BUFFER(s.buf, bytes, "the symmetric window");
  }
  return s;
}

template <class C>
COCONET_HD inline C combine(int op, C a, C b) {
  switch (op) {
    case ncclMax: return a > b ? a : b;
    case ncclMin: return a < b ? a : b;
    default: return a + b;  // sum, avg
  }
}

// The kernel (see the top of this file). The window holds the staged input [0, n0*inner) of type T
// and, from out_off, this rank's gathered slice (type G) at slice-local indices. f(l, red): the
// fused element function at local element l of this rank's slice, given the reduced value red;
// it stores the gathered value at gathered[begin + l] itself (computed in place, as the pipeline).
template <class T, class G, class F>
__global__ void fused_symmetric_kernel(ncclDevComm dev, ncclWindow_t win, size_t out_off, int op, int64_t n0,
                                       int64_t inner, G* gathered, T* keep, F f) {
  using C = compute_t<T>;
  ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), dev, ncclTeamLsa(dev), dev.lsaBarrier, blockIdx.x};
  const int R = dev.lsaSize, me = dev.lsaRank;
  const int64_t step = int64_t(gridDim.x) * blockDim.x, first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const Range mine = slice_range(n0, R, me);
  const int64_t m = mine.size() * inner, base = mine.begin * inner;
  bar.sync(ncclCoopCta(), ::cuda::memory_order_acquire);  // every rank's input is staged
  G* const out_me = static_cast<G*>(ncclGetLsaPointer(win, out_off, me));
  for (int64_t l = first; l < m; l += step) {
    C acc = to_compute(static_cast<const T*>(ncclGetLsaPointer(win, 0, 0))[base + l]);
    for (int p = 1; p < R; ++p)
      acc = combine<C>(op, acc, to_compute(static_cast<const T*>(ncclGetLsaPointer(win, 0, p))[base + l]));
    if (op == ncclAvg) acc = acc / static_cast<C>(R);
    const T red = from_compute<T>(acc);
    if (keep) keep[l] = red;
    f(l, red);
    if (gathered) out_me[l] = gathered[base + l];
  }
  bar.sync(ncclCoopCta(), ::cuda::memory_order_acq_rel);  // every rank's computed slice is in its window
  if (!gathered) return;
  for (int p = 0; p < R; ++p) {
    if (p == me) continue;
    const Range sl = slice_range(n0, R, p);
    const int64_t pm = sl.size() * inner, pb = sl.begin * inner;
    const G* const src = static_cast<const G*>(ncclGetLsaPointer(win, out_off, p));
    for (int64_t l = first; l < pm; l += step) gathered[pb + l] = src[l];
  }
}

// A fused reduce-scatter (op) of x [n0, inner] along dim 0, f on this rank's slice, and, when
// gathered is not null, the all-gather of the value f stores into gathered (same shape) — as one
// kernel over symmetric memory. keep (or null): this rank's slice of the reduced value, kept.
// The caller declares f's own reads and writes (COCONET_ACCESS) before the call.
template <class T, class G, class F>
void fused_symmetric(ncclRedOp_t op, const T* x, int64_t n0, int64_t inner, G* gathered, T* keep, const Ctx& c,
                     F f) {
  const int R = c.group.size;
  const int64_t n = n0 * inner, most = slice_chunk(n0, R) * inner;
  const size_t in_bytes = size_t(n) * sizeof(T);
  const size_t out_off = (in_bytes + 255) / 256 * 256;
  ncclDevComm dev;
  ncclWindow_t win;
  char* buf;
  {
    std::lock_guard<std::mutex> lock(symmetric_mutex());
    Symmetric& s = symmetric_window(c, out_off + size_t(most > 0 ? most : 1) * sizeof(G));
    dev = s.dev, win = s.win, buf = static_cast<char*>(s.buf);
  }
  if (n > 0) COCONET_CUDA(cudaMemcpyAsync(buf, x, in_bytes, cudaMemcpyDeviceToDevice, c.stream));
  // the same grid on every rank (block b pairs with the peers' block b at each barrier)
  int64_t blocks = (most + kSymThreads - 1) / kSymThreads;
  blocks = std::max<int64_t>(1, std::min<int64_t>(blocks, kSymBlocks));
  const Range mine = slice_range(n0, R, c.group.rank);
  COCONET_ACCESS_ALSO(COCONET_R(buf, 0, int64_t(in_bytes)), COCONET_W(buf + out_off, 0, mine.size() * inner * int64_t(sizeof(G))),
                      gathered ? COCONET_W(gathered, 0, n) : COCONET_R(buf, 0, 0),
                      keep ? COCONET_W(keep, 0, mine.size() * inner) : COCONET_R(buf, 0, 0));
  void (*kernel)(ncclDevComm, ncclWindow_t, size_t, int, int64_t, int64_t, G*, T*, F) = fused_symmetric_kernel<T, G, F>;
  COCONET_LAUNCH(kernel, static_cast<unsigned>(blocks), kSymThreads, 0, c.stream, dev, win, out_off, int(op), n0, inner,
                 gathered, keep, f);
  COCONET_CUDA(cudaGetLastError());
}

}  // namespace cuda
}  // namespace coconet
