// coconet CUDA runtime: a fused reduce-scatter + compute + all-gather as ONE kernel over NCCL
// symmetric memory (NCCL's device API), the second algorithm of a `Fused` unit next to the chunked
// host-API pipeline (runtime.cuh: pipeline). Used where every rank of the group is in one LSA team
// (load/store access: one node, NVLink or PCIe P2P) and NCCL's device API is available; chosen at
// run time (choose_fused: in auto mode the faster of the two, measured on a unit's first calls at a
// size and agreed by every rank), forced with COCONET_CUDA_FUSED=pipeline|symmetric (the same on
// every rank). Under the host emulation (g++ -DCOCONET_EMULATE) the device API comes from
// emulate_nccl_device.h: windows in POSIX shared memory, LSA barriers across the rank processes.
//
// Covered (the renderer emits this path only for them): a reduce-scatter along dim 0 of a
// contiguous (not scattered) tensor, pointwise phases only, not inside an overlap.
//
// One call: at R > 1 the input is staged into this rank's window (one copy), unless it lies in a
// window of the communicator's the caller allocated (window_empty: the optimizer's flat gradient),
// which the peers then read in place; at R = 1 the kernel reads the caller's input itself. The
// window holds room to stage the input only where some rank's call stages it (c.in_place: the
// call's exchange agrees whether every rank's input is in a caller window). Then
// the kernel, whose block b of every rank pairs with block b
// of every peer at each LSA barrier. The grid is the same on every rank (symmetric_grid: the least
// over the ranks of multiprocessors x resident blocks per multiprocessor, at most one block per
// tile of the largest slice). Each slice is cut into tiles of sym_tile(V) elements (kSymThreads x
// V: one whole vector a thread) and block b of a grid of G takes tiles b, b + G, b + 2G, ... of
// each slice (Tiled: a function of the slice's size and the grid only), its threads striding
// within a tile, so that the blocks walk the arrays together in one window of about G tiles, as
// the pipeline's grid-stride kernels do:
//   1. each block writes where this rank's input is (SymInput: staged, or window k at offset o)
//      into the head of this rank's window; barrier (acq_rel): every rank's input is staged and
//      its SymInput written; the block reads every rank's SymInput once (into shared memory)
//   2. the generated per-thread function (the pipeline chunk kernel's, rendered by the same
//      code: its Lets once per thread, then the thread's whole vectors of V elements in its
//      block's tiles where every operand is aligned, then the rest one element at a time) reads
//      each element's value reduced over every peer's window (SymThread::reduce / vreduce: peer
//      loads, reduced in the compute type as the plan says: sum, avg, max, min), runs the fused
//      element math, and stores the gathered value in the caller's tensor and in this rank's
//      window (th.out)
//   3. barrier (acq_rel): every rank's computed slice is in its window
//   4. block b reads the tiles block b of each peer wrote in step 2 from that peer's window
//      (peer loads, 16 bytes at a time where the caller's tensor is aligned) straight into the
//      caller's gathered tensor.
// Pull, not push, for the gather: the peers' values land in the caller's tensor without a copy
// out of the window afterwards (one pass over N fewer) and without a third barrier: a rank writes
// its window again only after the next call's first barrier, which a peer reaches only when its
// previous kernel, and with it its reads of that window, is over (stream order). At R = 1 there
// is no barrier (nothing to order) and nothing staged or gathered.
#pragma once

#ifndef COCONET_EMULATE
#include <nccl_device.h>
#define COCONET_ACCESS_ALSO(...)
#else
#define COCONET_ACCESS_ALSO(...) ::coconet::cuda::emu::declare_also({__VA_ARGS__})
#endif

#include <algorithm>
#include <cstdio>
#include <tuple>

namespace coconet {
namespace cuda {

// The kernel's blocks have kSymThreads threads; the grid is sized from the device (symmetric_grid).
// The host emulation's tests compile blocks of a few threads (-DCOCONET_EMULATE_SYM_THREADS=2:
// many blocks, many tiles a block, at sizes an emulated run can afford).
#if defined(COCONET_EMULATE) && defined(COCONET_EMULATE_SYM_THREADS)
constexpr int kSymThreads = COCONET_EMULATE_SYM_THREADS;
#else
constexpr int kSymThreads = 512;
#endif
// A tile is a whole number of these elements (a multiple of every vector width: 16 bytes of a
// 1-byte type), so that each tile starts on a whole 16-byte vector of any operand's type.
constexpr int64_t kSymUnit = 16;
// The elements of a tile of a kernel of V elements a vector: one vector a thread of a block
// (kSymThreads x V, as a block of the pipeline's kernels steps), in whole kSymUnits (which
// kSymThreads x V is unless a block has fewer than 16 threads).
COCONET_HD constexpr int64_t sym_tile(int V) { return (int64_t(kSymThreads) * V + kSymUnit - 1) / kSymUnit * kSymUnit; }

// The head of a rank's window: where its input is this call (SymInput), written by its kernel.
constexpr size_t kSymHead = 256;
// The caller's windows (window_empty) a kernel can read in place: the first this many made on a
// communicator (an input in a later one is staged). The optimizer makes one a param group, and
// layer-wise learning rates make a group or two a layer; each is 8 bytes of the kernel's
// parameters (SymWindows), 512 in all.
constexpr int kSymUserWindows = 64;
// The most ranks a group may have for the symmetric kernel (the kernel keeps a pointer per rank in
// shared memory).
constexpr int kSymMaxRanks = 128;

// Where a rank's input is in a call: win < 0, staged in its window at kSymHead; else in the
// caller's window `win` (the communicator's win-th window_empty, the same on every rank: they
// are made collectively, in order) at byte offset off.
struct SymInput {
  int64_t win = -1;
  int64_t off = 0;
};

// The communicator's first kSymUserWindows caller windows, a kernel parameter of its own, read
// only at constant indices (at(k)): a parameter indexed at run time, or one inside the SymThread
// the kernel modifies, is copied into every thread's local memory (a 632-byte stack frame when it
// was SymThread::user, written by each of the 135 168 threads of a call on an H100 before any work).
struct SymWindows {
  ncclWindow_t user[kSymUserWindows]{};
  __device__ ncclWindow_t at(int64_t k) const {
    ncclWindow_t w{};
    COCONET_UNROLL
    for (int j = 0; j < kSymUserWindows; ++j)
      if (j == k) w = user[j];
    return w;
  }
};

enum class FusedAlgo { automatic, pipeline, symmetric };

// COCONET_CUDA_FUSED: auto (default), pipeline or symmetric.
COCONET_EMU FusedAlgo fused_algo() {
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

// auto's measurement of one fused unit at one size on one communicator (choose_fused): its first
// kTrialCalls calls alternate the algorithms (symmetric first), the first two untimed (they make
// the window, the device communicator, the chunk buffers), the other kTimedEach of each timed by
// events on the call's stream; the next call takes, on every rank, the faster by the slowest
// rank's medians. (One timed call of each decided by a single sample: on an H100 one algorithm's
// step varied by up to 15% from run to run, as much as the two differ at 2^26 elements.)
constexpr int kTimedEach = 3;
constexpr int kTrialCalls = 2 + 2 * kTimedEach;
struct Trial {
  int calls = 0;
  cudaEvent_t start[2][kTimedEach]{}, end[2][kTimedEach]{};  // [0]: the symmetric kernel, [1]: the pipeline
  cudaEvent_t comm_done = nullptr;   // the comm stream's work joined before the end is recorded
  float ms[2]{};                     // the slowest rank's medians (after the decision)
  int decided = -1;                  // 1: the symmetric kernel, 0: the pipeline
};

// A window the caller allocated on a communicator (window_empty).
struct UserWindow {
  char* buf = nullptr;
  size_t bytes = 0;
  ncclWindow_t win = nullptr;
};

// A communicator's device-API state, made on first use and kept: whether the symmetric kernel can
// run on it (and why not), its device communicator (LSA barriers), its window and the windows the
// caller allocated on it (window_empty: kept until the process ends).
struct Symmetric {
  bool ok = false;
  std::string why;
  bool dev_made = false;
  ncclDevComm dev{};
  int barriers = 0;  // the device communicator's LSA barriers: the most blocks a grid may have
  std::map<const void*, int> grids;  // per kernel: the grid every rank agreed on (symmetric_grid)
  std::map<std::tuple<std::string, std::string, int64_t>, Trial> trials;  // auto: per (function, unit, elements)
  void* buf = nullptr;
  size_t bytes = 0;
  ncclWindow_t win = nullptr;
  std::vector<UserWindow> user;
};

// v[0..count) combined over every rank by op (collective over the communicator, blocking: on first
// use only, or once per measured unit and size).
template <class T>
void agree(T* v, int count, ncclDataType_t type, ncclRedOp_t op, const Ctx& c) {
  T* d = nullptr;
  COCONET_CUDA(cudaMalloc(reinterpret_cast<void**>(&d), sizeof(T) * size_t(count)));
  COCONET_CUDA(cudaMemcpyAsync(d, v, sizeof(T) * size_t(count), cudaMemcpyHostToDevice, c.stream));
  COCONET_CUDA(ncclAllReduce(d, d, size_t(count), type, op, c.comm, c.stream));
  COCONET_CUDA(cudaMemcpyAsync(v, d, sizeof(T) * size_t(count), cudaMemcpyDeviceToHost, c.stream));
  COCONET_CUDA(cudaStreamSynchronize(c.stream));
  COCONET_CUDA(cudaFree(d));
}
// The least of every rank's v.
COCONET_EMU int agree_min(int v, const Ctx& c) {
  agree(&v, 1, ncclInt32, ncclMin, c);
  return v;
}

// NCCL 2.29 added ncclCommQueryProperties and the requirements' initializer; 2.28 (the NCCL that
// torch 2.11 pins) has the device API without them: its requirements are zero-initialized, and
// whether a communicator supports the device API shows only when its device communicator is made.
#if defined(NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER)
#define COCONET_DEV_COMM_REQUIREMENTS NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER
#else
#define COCONET_DEV_COMM_REQUIREMENTS {}
#endif

// Make the device communicator of c.comm into `s` (collective over the communicator), with an LSA
// barrier for every block that can be resident at once on the smallest GPU of the group
// (multiprocessors x the threads a multiprocessor holds / kSymThreads), agreed by every rank.
COCONET_EMU ncclResult_t make_dev_comm(const Ctx& c, Symmetric& s) {
  int dev = 0, threads = 0;
  COCONET_CUDA(cudaGetDevice(&dev));
  COCONET_CUDA(cudaDeviceGetAttribute(&threads, cudaDevAttrMaxThreadsPerMultiProcessor, dev));
  s.barriers = agree_min(sm_count() * std::max(1, threads / kSymThreads), c);
  ncclDevCommRequirements_t reqs = COCONET_DEV_COMM_REQUIREMENTS;
  reqs.lsaBarrierCount = s.barriers;
  const ncclResult_t r = ncclDevCommCreate(c.comm, &reqs, &s.dev);
  s.dev_made = r == ncclSuccess;
  return r;
}

COCONET_EMU Symmetric probe_symmetric(const Ctx& c) {
  const ncclComm_t comm = c.comm;
  const Group& g = c.group;
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
  if (g.size > kSymMaxRanks) {
    s.why = std::to_string(g.size) + " ranks: the symmetric kernel takes at most " + std::to_string(kSymMaxRanks);
    return s;
  }
  const ncclTeam_t lsa = ncclTeamLsa(comm);
  if (lsa.nRanks != g.size || lsa.rank != g.rank) {
    s.why = "not every rank of the group is in this rank's LSA team (lsaSize " + std::to_string(lsa.nRanks) +
            ", " + std::to_string(g.size) + " ranks)";
    return s;
  }
#if !defined(NCCL_COMM_PROPERTIES_INITIALIZER)
  // No query before NCCL 2.29: making the device communicator is the test. Every rank probes at
  // the same call (the first fused unit of the call), so the collective creation lines up.
  if (make_dev_comm(c, s) != ncclSuccess) {
    s.why = std::string("ncclDevCommCreate failed (no NCCL device API here?): ") + ncclGetLastError(comm);
    return s;
  }
#endif
  s.ok = true;
  return s;
}

COCONET_EMU std::mutex& symmetric_mutex() {
  static std::mutex mu;
  return mu;
}
// Every communicator's state made so far (the caller holds symmetric_mutex()).
COCONET_EMU std::map<ncclComm_t, Symmetric>& symmetric_states() {
  static std::map<ncclComm_t, Symmetric> states;
  return states;
}
// The state of communicator c.comm, made (collectively) on first use (the caller holds
// symmetric_mutex()).
COCONET_EMU Symmetric& symmetric_state(const Ctx& c) {
  auto& states = symmetric_states();
  auto it = states.find(c.comm);
  if (it == states.end()) it = states.emplace(c.comm, probe_symmetric(c)).first;
  return it->second;
}

// Which of s's caller windows (window_empty's: the first kSymUserWindows) holds [at, at + bytes):
// its index, or -1.
COCONET_EMU int user_window(const Symmetric& s, const void* at, size_t bytes) {
  const char* p = static_cast<const char*>(at);
  for (int k = 0; k < kSymUserWindows && k < int(s.user.size()); ++k) {
    const UserWindow& u = s.user[size_t(k)];
    if (p >= u.buf && p + bytes <= u.buf + u.bytes) return k;
  }
  return -1;
}

// user_window on communicator comm (a world communicator: groups = 1), or -1 where comm has no
// state yet; makes nothing (no collective): a call's exchange asks it of each tensor argument.
COCONET_EMU int window_index(uintptr_t comm, uintptr_t at, size_t bytes) {
  std::lock_guard<std::mutex> lock(symmetric_mutex());
  const auto& states = symmetric_states();
  const auto it = states.find(reinterpret_cast<ncclComm_t>(comm));
  return it == states.end() ? -1 : user_window(it->second, reinterpret_cast<const void*>(at), bytes);
}

// COCONET_CUDA_FUSED_TRACE=1: print each fused unit's algorithm and the symmetric kernel's grid.
COCONET_EMU bool fused_trace() {
  static const bool trace = [] {
    const char* t = std::getenv("COCONET_CUDA_FUSED_TRACE");
    return t && *t && std::string(t) != "0";
  }();
  return trace;
}

// What a fused unit runs in this call (choose_fused), and, in a timed trial call, the event
// fused_done records at its end.
struct FusedChoice {
  bool symmetric = false;
  Trial* timed = nullptr;
  int which = 0;  // the algorithm timed ([0]: the symmetric kernel) and which of its timed calls
  int sample = 0;
};

// auto's decision for trial t (collective: every rank decides at the same call): each
// algorithm's median time here, the slowest rank's (ncclMax), the faster kept.
COCONET_EMU void decide(Trial& t, const Ctx& c) {
  float ms[2];
  for (int i = 0; i < 2; ++i) {
    float each[kTimedEach];
    for (int j = 0; j < kTimedEach; ++j) {
      COCONET_CUDA(cudaEventSynchronize(t.end[i][j]));  // (elapsed time is an error before both are reached)
      COCONET_CUDA(cudaEventElapsedTime(&each[j], t.start[i][j], t.end[i][j]));
    }
    std::sort(each, each + kTimedEach);
    ms[i] = each[kTimedEach / 2];
  }
  const float here[2] = {ms[0], ms[1]};
  agree(ms, 2, ncclFloat32, ncclMax, c);
  t.ms[0] = ms[0], t.ms[1] = ms[1];
  t.decided = ms[0] <= ms[1] ? 1 : 0;
  if (fused_trace())
    std::fprintf(stderr, "coconet fused: rank %d of %d: measured here symmetric %.6f ms, pipeline %.6f ms; "
                 "slowest rank's symmetric %.6f ms, pipeline %.6f ms\n", c.group.rank, c.group.size, double(here[0]),
                 double(here[1]), double(ms[0]), double(ms[1]));
}

// Does fused unit `unit` of generated function `fn` (n elements) run as the symmetric kernel in this call? Where it cannot
// run (no device API, not every rank in the LSA team): the pipeline. Where both can run: auto
// measures both (Trial) and keeps the faster per (fn, unit, n) on this communicator, the same on every
// rank; symmetric forces the kernel (an error where it cannot run); pipeline forces the pipeline.
// COCONET_CUDA_FUSED_TRACE=1 prints the choice (rank, unit, algorithm, why) on stderr.
COCONET_EMU FusedChoice choose_fused(const Ctx& c, const char* fn, const char* unit, int64_t n) {
  const FusedAlgo a = fused_algo();
  FusedChoice ch;
  char how[96] = "";
  if (a != FusedAlgo::pipeline) {
    std::lock_guard<std::mutex> lock(symmetric_mutex());
    Symmetric& s = symmetric_state(c);
    if (a == FusedAlgo::symmetric && !s.ok)
      throw std::runtime_error(std::string("coconet (cuda): COCONET_CUDA_FUSED=symmetric, but fused ") + unit +
                               " cannot run over symmetric memory: " + s.why);
    if (a == FusedAlgo::symmetric) {
      ch.symmetric = true;
    } else if (s.ok) {
      Trial& t = s.trials[std::make_tuple(std::string(fn), std::string(unit), n)];
      if (t.decided < 0 && t.calls == kTrialCalls) decide(t, c);
      if (t.decided >= 0) {
        ch.symmetric = t.decided == 1;
        std::snprintf(how, sizeof how, " (measured: symmetric %.6f ms, pipeline %.6f ms)", double(t.ms[0]),
                      double(t.ms[1]));
      } else {
        const int k = t.calls++;
        ch.symmetric = k % 2 == 0;
        if (k >= 2) {  // timed
          const int i = ch.symmetric ? 0 : 1, j = (k - 2) / 2;
          COCONET_CUDA(cudaEventCreate(&t.start[i][j]));
          COCONET_CUDA(cudaEventCreate(&t.end[i][j]));
          if (!t.comm_done) COCONET_CUDA(cudaEventCreateWithFlags(&t.comm_done, cudaEventDisableTiming));
          COCONET_CUDA(cudaEventRecord(t.start[i][j], c.stream));
          ch.timed = &t, ch.which = i, ch.sample = j;
        }
        std::snprintf(how, sizeof how, " (trial %d of %d%s)", k + 1, kTrialCalls, ch.timed ? ", timed" : "");
      }
    }
  }
  if (fused_trace())
    std::fprintf(stderr, "coconet fused: rank %d of %d: %s runs the %s%s\n", c.group.rank, c.group.size, unit,
                 ch.symmetric ? "symmetric kernel" : "pipeline", how);
  return ch;
}

// After the unit (either algorithm): in a timed trial call, the comm stream's work joined into the
// call's stream and the end recorded there.
COCONET_EMU void fused_done(const FusedChoice& ch, const Ctx& c) {
  if (!ch.timed) return;
  COCONET_CUDA(cudaEventRecord(ch.timed->comm_done, c.comm_stream));
  COCONET_CUDA(cudaStreamWaitEvent(c.stream, ch.timed->comm_done, 0));
  COCONET_CUDA(cudaEventRecord(ch.timed->end[ch.which][ch.sample], c.stream));
}

// `bytes` rounded up to a whole number of NCCL_WIN_REQUIRED_ALIGNMENT (a window's size).
COCONET_EMU size_t window_bytes(size_t bytes) {
  return (bytes + NCCL_WIN_REQUIRED_ALIGNMENT - 1) / NCCL_WIN_REQUIRED_ALIGNMENT * NCCL_WIN_REQUIRED_ALIGNMENT;
}

// This communicator's window of at least `bytes` (collective: every rank asks for the same size
// in the same order, as every rank runs the same calls) and its device communicator, made once
// (the window grown when a call needs more). The caller holds symmetric_mutex().
COCONET_EMU Symmetric& symmetric_window(const Ctx& c, size_t bytes) {
  Symmetric& s = symmetric_state(c);
  if (!s.dev_made) COCONET_CUDA(make_dev_comm(c, s));
  if (s.bytes < bytes) {
    if (s.win) {
      COCONET_CUDA(cudaDeviceSynchronize());  // the old window may still be read by a queued kernel
      COCONET_CUDA(ncclCommWindowDeregister(c.comm, s.win));
      COCONET_CUDA(ncclMemFree(s.buf));
    }
    bytes = window_bytes(bytes);
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

// The elements a thread takes of [lo, hi) cut into tiles of `tile` elements (tile k: [k * tile,
// (k + 1) * tile) clipped to [lo, hi)): in tiles k, k + every, k + 2 * every, ... (its block's),
// the elements first, first + step, ... from the start of each, for a range-for in device code.
// Which tiles a block takes is a function of the tiling and the grid only, so that a rank knows
// which of a peer's elements the peer's block b computed: the only ones LSA barrier b orders
// before this rank's block b.
struct Tiled {
  int64_t lo, hi, tile, k, every, first, step;
  struct It {
    int64_t i, end, next, hop, first, step, tile, hi;  // end: the current tile's; next: the block's next tile
    COCONET_HD void settle() {  // past the current tile: on to the block's next tile, or done (i = hi)
      while (i >= end) {
        if (next >= hi) {
          i = hi;
          return;
        }
        i = next + first;
        end = next + tile < hi ? next + tile : hi;
        next += hop;
      }
    }
    COCONET_HD int64_t operator*() const { return i; }
    COCONET_HD It& operator++() {
      i += step;
      settle();
      return *this;
    }
    COCONET_HD bool operator!=(const It& e) const { return i < e.i; }
  };
  COCONET_HD It begin() const {
    const int64_t kl = lo / tile;  // the tile lo is in, and the block's first tile from there
    const int64_t k0 = k >= kl ? k : k + (kl - k + every - 1) / every * every, at = k0 * tile;
    It it{(at > lo ? at : lo) + first, at + tile < hi ? at + tile : hi, at + every * tile, every * tile, first, step,
          tile, hi};
    it.settle();
    return it;
  }
  COCONET_HD It end() const { return It{hi, hi, hi, 0, 0, 0, tile, hi}; }
};

// What the generated per-thread function of the symmetric kernel sees: its elements of this rank's
// slice [0, m) as a pipeline kernel's Thread<V> offers them (vectors(), elements()), but in its
// block's tiles (Tiled), plus an element's value reduced over the ranks (reduce, vreduce: V of
// them) and where the gathered value goes besides the caller's tensor (out: this rank's window;
// slice-local indices throughout).
template <class T, class G, int V>
struct SymThread {
  using C = compute_t<T>;
  int64_t m = 0;  // this rank's slice
  int64_t block = 0, blocks = 1, thread = 0, threads = 1;  // the thread's block of the grid, its place in the block
  bool vec = false;  // every operand is aligned for V (the vector path)
  const T* direct = nullptr;  // one rank: the caller's input at this rank's slice (nothing staged)
  ncclWindow_t win{};
  SymInput mine;                        // where this rank's input is (R > 1)
  const void* const* in = nullptr;      // every rank's whole input (R > 1; the kernel's shared memory)
  int64_t base = 0;  // this rank's slice in the input
  int R = 1, op = 0;
  T* keep = nullptr;  // this rank's slice of the reduced value, kept (or null)
  G* out = nullptr;

  // the thread's elements first, first + step, ... of each of its block's tiles, in [lo, hi)
  COCONET_HD Tiled tiles(int64_t lo, int64_t hi, int64_t first, int64_t step) const {
    return Tiled{lo, hi, sym_tile(V), block, blocks, first, step};
  }
  // the first element of each whole group of V elements this thread takes (none unless vec): its
  // block's tiles, tiles(0, m / V * V, thread * V, threads * V); where a tile is one vector a
  // thread of the launch's kSymThreads (the usual case) the same elements as a plain grid
  // stride, with the state of a pipeline kernel's loop (3 values, not Tiled's 8: fewer registers)
  COCONET_HD auto vectors() const {
    const int64_t hi = vec ? m / V * V : 0;
    if constexpr (sym_tile(V) == int64_t(kSymThreads) * V) {
      return Strided{block * sym_tile(V) + thread * V, hi, blocks * sym_tile(V)};
    } else {
      return tiles(0, hi, thread * V, threads * V);
    }
  }
  // the elements it takes one at a time: those past the last whole group, or all of them
  COCONET_HD Tiled elements() const { return tiles(vec ? m / V * V : 0, m, thread, threads); }
  // rank p's input at this rank's slice
  __device__ const T* input(int p) const { return direct ? direct : static_cast<const T*>(in[p]) + base; }
  // where rank p's input starts (its SymInput, read from the head of its window)
  __device__ const void* find_input(int p, const SymWindows& users) const {
    const SymInput h = *static_cast<const SymInput*>(ncclGetLsaPointer(win, 0, p));
    return h.win < 0 ? ncclGetLsaPointer(win, kSymHead, p) : ncclGetLsaPointer(users.at(h.win), size_t(h.off), p);
  }
  // element l of this rank's slice reduced over the ranks (stored in keep too, when kept)
  __device__ T reduce(int64_t l) const {
    C acc = to_compute(input(0)[l]);
    for (int p = 1; p < R; ++p) acc = combine<C>(op, acc, to_compute(input(p)[l]));
    if (op == ncclAvg) acc = acc / static_cast<C>(R);
    const T red = from_compute<T>(acc);
    if (keep) keep[l] = red;
    return red;
  }
  // elements l0 .. l0 + V - 1 reduced (one aligned vector load per rank, one store to keep)
  __device__ Vec<T, V> vreduce(int64_t l0) const {
    const Vec<T, V> x0 = load<V>(input(0) + l0);
    C acc[V];
    COCONET_UNROLL
    for (int u = 0; u < V; ++u) acc[u] = to_compute(x0[u]);
    for (int p = 1; p < R; ++p) {
      const Vec<T, V> xp = load<V>(input(p) + l0);
      COCONET_UNROLL
      for (int u = 0; u < V; ++u) acc[u] = combine<C>(op, acc[u], to_compute(xp[u]));
    }
    Vec<T, V> red;
    COCONET_UNROLL
    for (int u = 0; u < V; ++u) red[u] = from_compute<T>(op == ncclAvg ? acc[u] / static_cast<C>(R) : acc[u]);
    if (keep) store<V>(keep + l0, red);
    return red;
  }
};

// The kernel (see the top of this file). th: every thread's SymThread but for its place in the grid,
// its slice and the ranks' inputs; f(th): the generated per-thread function. The window holds this
// rank's SymInput at 0, the staged input [0, n0*inner) of type T from kSymHead (where it is staged)
// and, from out_off, this rank's gathered slice (type G) at slice-local indices.
template <class T, class G, int V, class F>
__global__ void fused_symmetric_kernel(ncclDevComm dev, SymThread<T, G, V> th, const SymWindows users,
                                       size_t out_off, int64_t n0, int64_t inner, G* gathered, F f) {
  ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), dev, ncclTeamLsa(dev), dev.lsaBarrier, blockIdx.x};
  const int R = dev.lsaSize, me = dev.lsaRank;
  th.m = slice_range(n0, R, me).size() * inner;
  th.block = blockIdx.x, th.blocks = gridDim.x, th.thread = threadIdx.x, th.threads = blockDim.x;
  __shared__ const void* ins[kSymMaxRanks];
  if (R > 1) {
    if (threadIdx.x == 0) *static_cast<SymInput*>(ncclGetLsaPointer(th.win, 0, me)) = th.mine;  // every block: the same
    bar.sync(ncclCoopCta(), ::cuda::memory_order_acq_rel);  // every rank's input is staged, its SymInput written
    for (int p = threadIdx.x; p < R; p += blockDim.x) ins[p] = th.find_input(p, users);
    __syncthreads();
    th.in = ins;
    for (int p = 0; p < R && th.vec; ++p) th.vec = aligned<V>(static_cast<const T*>(ins[p]) + th.base);
  }
  f(static_cast<const SymThread<T, G, V>&>(th));
  if (R == 1) return;  // nothing staged, nothing to gather
  bar.sync(ncclCoopCta(), ::cuda::memory_order_acq_rel);  // every rank's computed slice is in its window
  if (!gathered) return;
  constexpr int VG = sizeof(G) < 16 ? int(16 / sizeof(G)) : 1;  // 16 bytes of G
  for (int p = 0; p < R; ++p) {
    if (p == me) continue;
    const Range sl = slice_range(n0, R, p);
    const int64_t mp = sl.size() * inner;  // p's slice, of which p's block b wrote its tiles
    const G* const src = static_cast<const G*>(ncclGetLsaPointer(th.win, out_off, p));
    G* const dst = gathered + sl.begin * inner;
    int64_t rest = 0;
    if (VG > 1 && reinterpret_cast<uintptr_t>(dst) % (sizeof(G) * VG) == 0) {  // the window is aligned
      rest = mp / VG * VG;  // (a tile is whole VG-vectors: some threads idle in a tile where VG > V)
      for (const int64_t l : th.tiles(0, rest, th.thread * VG, th.threads * VG)) store<VG>(dst + l, load<VG>(src + l));
    }
    for (const int64_t l : th.tiles(rest, mp, th.thread, th.threads)) dst[l] = src[l];
  }
}

// This kernel's grid on communicator c (the caller holds symmetric_mutex()): the same on every
// rank (block b pairs with the peers' block b at each barrier). Made once per kernel: the least
// over the ranks of multiprocessors x this kernel's resident blocks per multiprocessor
// (cudaOccupancyMaxActiveBlocksPerMultiprocessor), at most the device communicator's barriers; a
// call takes no more blocks than the largest slice has tiles (the same on every rank too; a
// smaller slice may have fewer, and blocks with none).
template <class K>
int symmetric_grid(const Ctx& c, Symmetric& s, K kernel, int64_t most, int V) {
  auto it = s.grids.find(reinterpret_cast<const void*>(kernel));
  if (it == s.grids.end()) {
    int occ = 0;
    COCONET_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, kSymThreads, 0));
    const int mine = std::max(1, std::min(s.barriers, sm_count() * std::max(1, occ)));
    it = s.grids.emplace(reinterpret_cast<const void*>(kernel), agree_min(mine, c)).first;
  }
  const int64_t per = sym_tile(V), work = (most + per - 1) / per;
  return int(std::max<int64_t>(1, std::min<int64_t>(work, it->second)));
}

// A fused reduce-scatter (op) of x [n0, inner] along dim 0, f on this rank's slice, and, when
// gathered is not null, the all-gather of the value f stores into gathered (same shape) — as one
// kernel over symmetric memory. keep (or null): this rank's slice of the reduced value, kept.
// vec: every operand of f's vector path is aligned for V (the caller's check; the window's, the
// input's and keep's are checked here). The caller declares f's own reads and writes
// (COCONET_ACCESS) before the call.
template <class T, class G, int V, class F>
void fused_symmetric(ncclRedOp_t op, const T* x, int64_t n0, int64_t inner, G* gathered, T* keep, const Ctx& c,
                     bool vec, F f) {
  const int R = c.group.size;
  const int64_t n = n0 * inner, most = slice_chunk(n0, R) * inner;
  const Range mine = slice_range(n0, R, c.group.rank);
  const int64_t m = mine.size() * inner, base = mine.begin * inner;
  // The window's size is the same on every rank (it is made collectively): room to stage the
  // input, unless every rank's is in a caller window (c.in_place, agreed by the call's exchange),
  // whether or not this one stages.
  const size_t in_bytes = size_t(n) * sizeof(T);
  const bool everywhere =
      R > 1 && std::find(c.in_place.begin(), c.in_place.end(), reinterpret_cast<uintptr_t>(x)) != c.in_place.end();
  const size_t out_off = (kSymHead + (R > 1 && !everywhere ? in_bytes : 0) + 255) / 256 * 256;
  void (*kernel)(ncclDevComm, SymThread<T, G, V>, const SymWindows, size_t, int64_t, int64_t, G*, F) =
      fused_symmetric_kernel<T, G, V, F>;
  SymThread<T, G, V> th;
  SymWindows users;
  ncclDevComm dev;
  char* buf;
  int blocks;
  size_t window;
  {
    std::lock_guard<std::mutex> lock(symmetric_mutex());
    Symmetric& s = symmetric_window(c, R > 1 ? out_off + size_t(most > 0 ? most : 1) * sizeof(G) : 1);
    dev = s.dev, th.win = s.win, buf = static_cast<char*>(s.buf);
    blocks = symmetric_grid(c, s, kernel, most, V);
    window = s.bytes;
    for (int k = 0; k < kSymUserWindows && k < int(s.user.size()); ++k) users.user[k] = s.user[size_t(k)].win;
    const int k = R > 1 ? user_window(s, x, in_bytes) : -1;
    if (k >= 0)  // the peers read it in place
      th.mine = SymInput{k, int64_t(reinterpret_cast<const char*>(x) - s.user[size_t(k)].buf)};
  }
  const bool staged = R > 1 && th.mine.win < 0;
  require(!(everywhere && staged), "coconet (cuda): the fused collective's input was agreed to be in a window of "
                                   "the communicator on every rank, but is not in one on this rank");
  const trace::Piece tp("fused collective: the symmetric kernel", -1, c.stream);  // its staging and its kernel
  if (staged && n > 0) COCONET_CUDA(cudaMemcpyAsync(buf + kSymHead, x, in_bytes, cudaMemcpyDeviceToDevice, c.stream));
  th.direct = R > 1 ? nullptr : x + base;
  th.base = base, th.R = R, th.op = int(op), th.keep = keep;
  th.out = R > 1 ? reinterpret_cast<G*>(buf + out_off) : gathered ? gathered + base : nullptr;
  // (the kernel checks every rank's input too)
  th.vec = vec && V > 1 && aligned<V>(staged ? reinterpret_cast<const T*>(buf + kSymHead) + base : x + base) &&
           (!keep || aligned<V>(keep)) && (!th.out || aligned<V>(th.out));
  if (R > 1)  // the peers read x in place during this kernel where it is not staged
    COCONET_ACCESS_ALSO(COCONET_W(buf, 0, int64_t(sizeof(SymInput))),
                        staged ? COCONET_R(buf + kSymHead, 0, int64_t(in_bytes)) : COCONET_R(x, 0, n),
                        COCONET_W(buf + out_off, 0, m * int64_t(sizeof(G))),
                        gathered ? COCONET_W(gathered, 0, n) : COCONET_R(buf, 0, 0),
                        keep ? COCONET_W(keep, 0, m) : COCONET_R(buf, 0, 0));
  else
    COCONET_ACCESS_ALSO(COCONET_R(x, base, base + m), gathered ? COCONET_W(gathered, base, base + m) : COCONET_R(x, 0, 0),
                        keep ? COCONET_W(keep, 0, m) : COCONET_R(x, 0, 0));
  if (fused_trace()) {
    char where[96] = "";
    if (R > 1)
      std::snprintf(where, sizeof where, ", input %s, window %zu bytes", staged ? "staged" : "read in place", window);
    std::fprintf(stderr, "coconet fused: rank %d of %d: symmetric grid %d blocks of %d threads, %s path%s\n",
                 c.group.rank, R, blocks, kSymThreads, th.vec ? "vector" : "element", where);
  }
  COCONET_COUNT_KERNEL(th.vec);
  COCONET_LAUNCH(kernel, static_cast<unsigned>(blocks), kSymThreads, 0, c.stream, dev, th, users, out_off, n0,
                 inner, gathered, f);
  COCONET_CUDA(cudaGetLastError());
}

// A buffer of `bytes` (the most any rank asks for) that the symmetric kernel reads in place, on
// communicator comm (collective: every rank calls it together, in the same order): NCCL memory
// registered as a window of comm (ncclMemAlloc, ncclCommWindowRegister) where comm can run the
// symmetric kernel, else plain device memory. Kept until the process ends (deregistering is
// collective too).
COCONET_EMU uintptr_t window_empty(uintptr_t comm, uintptr_t stream, size_t bytes) {
  CallArgs a;
  a.comm = comm, a.stream = stream;
  const Ctx c = context(a);
  std::lock_guard<std::mutex> lock(symmetric_mutex());
  Symmetric& s = symmetric_state(c);
  int64_t most = int64_t(bytes);
  agree(&most, 1, ncclInt64, ncclMax, c);
  const size_t size = window_bytes(size_t(std::max<int64_t>(most, 1)));
  void* p = nullptr;
  if (!s.ok) {
    COCONET_CUDA(cudaMalloc(&p, size));
    return reinterpret_cast<uintptr_t>(p);
  }
  COCONET_CUDA(ncclMemAlloc(&p, size));
  UserWindow u{static_cast<char*>(p), size, nullptr};
  COCONET_CUDA(ncclCommWindowRegister(c.comm, p, size, &u.win, NCCL_WIN_COLL_SYMMETRIC));
  s.user.push_back(u);
  COCONET_BUFFER(p, size, "window_empty #" + std::to_string(s.user.size()));
  return reinterpret_cast<uintptr_t>(p);
}

}  // namespace cuda
}  // namespace coconet
