// coconet runtime: ranks and groups (docs/language.md, "Groups").
//
// A call runs on W processes forming G consecutive groups of W/G ranks; layouts and collectives
// refer to the caller's group, and send(x, next|prev) talks to the same in-group rank of the
// next/previous group.  Comm owns private communicators (a dup of the caller's communicator and
// the group split), so the runtime's messages never match the user's own MPI traffic.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "errors.h"
#include "state.h"

namespace coconet {

// Threads per rank, process-wide: 0 until set, by COCONET_THREADS (module.h) or else by the
// first Comm made, as the cores divided among the ranks of its communicator on this node.
// Counting those ranks is a collective over the caller's communicator, never MPI_COMM_WORLD: a
// call on a sub-communicator must not wait for ranks outside it.
COCONET_STATE std::atomic<int>& process_threads() COCONET_STATE_BODY({
  static std::atomic<int> n{0};
  return n;
})
// Called once when process_threads() is first set (module.h: sizes the BLAS thread pool).
COCONET_STATE void (*&on_threads_set())(int) COCONET_STATE_BODY({
  static void (*f)(int) = nullptr;
  return f;
})

// ---- nodes ---------------------------------------------------------------------------------
//
// A node is a set of ranks that share memory (MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)).  For
// tests on one machine, COCONET_SIMULATE_NODES=K splits the ranks of the caller's communicator
// into K simulated nodes of consecutive ranks (rank / (size / K)) that never share memory, so
// the paths for groups that span several nodes run on one machine.  Every place that asks
// "which ranks are on my node" goes through node_comm() (Python: coconetc/runtime/node_ranks.py).

constexpr const char* kEnvSimulateNodes = "COCONET_SIMULATE_NODES";

// K of COCONET_SIMULATE_NODES for a communicator of `size` ranks (0 when unset or empty).
// Throws std::invalid_argument (the same on every rank) unless K is an integer >= 1 dividing
// the size.
COCONET_LIBRARY int simulated_nodes(int size) COCONET_LIBRARY_BODY({
  const char* env = std::getenv(kEnvSimulateNodes);
  if (!env || !*env) return 0;
  char* end = nullptr;
  const long k = std::strtol(env, &end, 10);
  require(*end == '\0' && k >= 1,
          std::string(kEnvSimulateNodes) + "=" + env + ": the number of simulated nodes must be an integer >= 1");
  require(size % k == 0, std::string(kEnvSimulateNodes) + "=" + env + " does not divide the " +
                             std::to_string(size) + " ranks of the communicator into equal nodes");
  return static_cast<int>(k);
})

// The simulated node of rank `rank` of a communicator of `size` ranks (0 without simulation).
COCONET_LIBRARY int simulated_node(int rank, int size) COCONET_LIBRARY_BODY({
  const int k = simulated_nodes(size);
  return k ? rank / (size / k) : 0;
})

// The ranks of `comm` on this rank's node, in comm's order (collective over comm; the caller
// frees it): those sharing memory with it and, under COCONET_SIMULATE_NODES, in the same
// simulated node `sim_node` (simulated_node of this rank in the caller's communicator, which
// may be larger than comm: a group's ranks keep the nodes of the communicator it was split
// from).
inline MPI_Comm node_comm(MPI_Comm comm, int sim_node) {
  MPI_Comm shared, node;
  COCONET_MPI(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &shared));
  if (!std::getenv(kEnvSimulateNodes) || !*std::getenv(kEnvSimulateNodes)) return shared;
  int r = 0;
  MPI_Comm_rank(shared, &r);
  COCONET_MPI(MPI_Comm_split(shared, sim_node, r, &node));
  MPI_Comm_free(&shared);
  return node;
}

// The cores of this node divided among the ranks of `comm` on it (collective over comm).
COCONET_LIBRARY int node_share(MPI_Comm comm, int sim_node) COCONET_LIBRARY_BODY({
  MPI_Comm node = node_comm(comm, sim_node);
  int local = 1;
  MPI_Comm_size(node, &local);
  MPI_Comm_free(&node);
  int cores = static_cast<int>(std::thread::hardware_concurrency());
  return std::max(1, cores / std::max(1, local));
})

// How a group lies on nodes (ShmWindow::available): M nodes of L ranks each when every node
// holds the same number of the group's ranks (L = 0 otherwise).
struct NodeLayout {
  int nodes = 1;       // M
  int per_node = 0;    // L (0: the nodes hold different numbers of ranks)
  int node = 0;        // this rank's node, 0 .. M-1 (the nodes ordered by their first rank)
  int local = 0;       // this rank's place on its node, 0 .. L-1 (group order)
  std::vector<int> rank_of;  // [node * L + local]: the group rank
  MPI_Comm across = MPI_COMM_NULL;  // the ranks of the same `local` on every node, by node
  // The group rank at (node k, local l).
  int at(int k, int l) const { return rank_of[static_cast<size_t>(k * per_node + l)]; }
  // True for a group over several nodes of L ranks each.
  bool hierarchical() const { return nodes > 1 && per_node > 0; }
};

// ---- an MPI-3 shared-memory window over a group on one node --------------------------------
//
// The fused collectives' fast path on one machine (fused.h, FusedShm): every rank of the group
// gets a segment of one MPI_Win_allocate_shared window and can read every peer's segment with
// plain loads.  Created on first use (collective over the group), kept across calls and grown
// when a call needs more (every rank of the group computes the same size from the call's
// shapes, so the collective regrowth is reached by all of them).
class ShmWindow {
 public:
  ShmWindow() = default;
  ShmWindow(const ShmWindow&) = delete;
  ShmWindow& operator=(const ShmWindow&) = delete;
  ~ShmWindow() { release(); }

  // True when every rank of `group` shares this node (collective on the first call, which also
  // finds how the group lies on nodes: layout()).  `sim_node`: this rank's simulated node
  // (node_comm).  Otherwise the window spans the ranks of this node only (the hierarchical
  // fused collectives' intra-node steps, fused_shm.h).
  bool available(MPI_Comm group, int size, int sim_node) {
    if (checked_) return whole_;
    checked_ = true;
    node_ = node_comm(group, sim_node);  // same rank order as the group
    int n = 0, me = 0;
    MPI_Comm_size(node_, &n);
    MPI_Comm_rank(node_, &node_rank_);
    MPI_Comm_rank(group, &me);
    bases_.assign(static_cast<size_t>(n), nullptr);
    whole_ = n == size;
    layout_.local = node_rank_;
    if (whole_) return true;
    // the nodes, numbered in the order of their first ranks (the leaders, local rank 0)
    MPI_Comm leaders;
    COCONET_MPI(MPI_Comm_split(group, node_rank_ == 0 ? 0 : MPI_UNDEFINED, me, &leaders));
    int k = 0;
    if (leaders != MPI_COMM_NULL) {
      MPI_Comm_rank(leaders, &k);
      MPI_Comm_size(leaders, &layout_.nodes);
      MPI_Comm_free(&leaders);
    }
    int km[2] = {k, layout_.nodes};
    COCONET_MPI(MPI_Bcast(km, 2, MPI_INT, 0, node_));
    layout_.node = km[0];
    layout_.nodes = km[1];
    std::vector<int> all(static_cast<size_t>(3 * size));
    int mine[3] = {layout_.node, node_rank_, n};
    COCONET_MPI(MPI_Allgather(mine, 3, MPI_INT, all.data(), 3, MPI_INT, group));
    bool even = true;
    for (int r = 0; r < size; ++r) even &= all[static_cast<size_t>(3 * r + 2)] == n;
    if (!even) return false;  // nodes of different sizes: the fused collectives go point to point
    layout_.per_node = n;
    layout_.rank_of.assign(static_cast<size_t>(size), 0);
    for (int r = 0; r < size; ++r)
      layout_.rank_of[static_cast<size_t>(all[static_cast<size_t>(3 * r)] * n + all[static_cast<size_t>(3 * r + 1)])] = r;
    COCONET_MPI(MPI_Comm_split(group, node_rank_, layout_.node, &layout_.across));
    COCONET_MPI(MPI_Comm_set_errhandler(layout_.across, MPI_ERRORS_RETURN));
    return false;
  }

  // How the group lies on nodes (after available()).
  const NodeLayout& layout() const { return layout_; }

  // This rank's place in the window (its node's ranks, in group order).
  int node_rank() const { return node_rank_; }

  // Makes every rank's segment at least `bytes` long (collective when it grows).
  void reserve(size_t bytes) {
    if (bytes <= bytes_ && win_ != MPI_WIN_NULL) return;
    if (win_ != MPI_WIN_NULL) COCONET_MPI(MPI_Barrier(node_));  // peers done reading it
    release_window();
    bytes = std::max<size_t>(bytes, 64);
    win_ = allocate(bytes, bases_);
    COCONET_MPI(MPI_Win_lock_all(MPI_MODE_NOCHECK, win_));
    bytes_ = bytes;
  }

  // Bytes of every rank's segment.
  size_t bytes() const { return bytes_; }

  // Where this call's region of `region` bytes starts in every segment; collective (every rank
  // of the group makes the same calls).  While two regions fit in kDouble bytes, calls
  // alternate between the two halves of the segment, so a rank may fill call k+1's region
  // while a peer still reads call k's: nothing else is needed between calls.  Above that, the
  // region starts at 0 and the call is fenced by a barrier before (`fenced`: and one after).
  size_t region_for(size_t region, bool& fenced, size_t kDouble) {
    fenced = 2 * region > kDouble;
    reserve(fenced ? region : 2 * region);
    const size_t at = fenced ? 0 : static_cast<size_t>(calls % 2) * (bytes_ / 2);
    ++calls;
    if (fenced) sync();  // nobody still reads a region of an earlier call
    return at;
  }

  // Rank r's segment (readable by every rank of the group).
  char* base(int r) const { return static_cast<char*>(bases_[static_cast<size_t>(r)]); }

  // This rank's part of the runtime's own shared window `site`, at least `bytes` long: scratch
  // memory for an intermediate a fused collective (or an all-reduce) reads, so that the peers
  // read it in place and nothing is staged (as for coconetc.empty). Collective when it grows
  // (every rank of the group asks for the same sizes in the same order); kept across calls.
  // Only after available() said yes.
  char* own(int site, size_t bytes) {
    Own& o = own_[site];
    if (bytes > o.bytes || o.win == MPI_WIN_NULL) {
      if (o.win != MPI_WIN_NULL) {
        COCONET_MPI(MPI_Barrier(node_));  // no peer reads the old one any more
        MPI_Win_free(&o.win);
      }
      o.bytes = std::max<size_t>(bytes, 64);
      o.win = allocate(o.bytes, o.bases);
    }
    return o.at(rank_of_node());
  }

  // Everything written to the window before it, by any rank, is visible to all after it.
  void sync() {
    COCONET_MPI(MPI_Win_sync(win_));
    COCONET_MPI(MPI_Barrier(node_));
    COCONET_MPI(MPI_Win_sync(win_));
  }

  // Frees the window and its communicator (idempotent; nothing once MPI is finalized).
  void release() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    release_window();
    for (auto& [site, o] : own_)
      if (o.win != MPI_WIN_NULL) MPI_Win_free(&o.win);
    own_.clear();
    if (node_ != MPI_COMM_NULL) MPI_Comm_free(&node_);
    if (layout_.across != MPI_COMM_NULL) MPI_Comm_free(&layout_.across);
  }

  int64_t calls = 0;  // fused calls run on the window (their parity picks a region)

  // The user's shared windows known to the running call (coconetc.empty, set by the generated
  // function from CallArgs::windows): (id, address, bytes, MPI_Win handle) each. An id with
  // kNodeShared set is a window whose memory is one for the whole node (runtime/shm.py:
  // empty_node, every rank mapping the same bytes): every rank's memory at an offset there is
  // this rank's own mapping of it, so a gather into it finds every part already in place.
  const std::vector<uint64_t>* user = nullptr;
  static constexpr uint64_t kNodeShared = uint64_t(1) << 41;

  // The running call's fused-collective algorithm (CallArgs::fused): 0 as COCONET_FUSED says,
  // 1 point-to-point, 2 this window when every rank is on this node (across nodes of L ranks
  // each: the hierarchical path, fused_shm.h).
  int algo = 0;

  // The id of the user window holding [p, p + bytes) of this rank, its offset there, when every
  // rank of the group can read it (the window's group holds them all); id -1 otherwise.
  std::pair<int64_t, int64_t> user_window_of(const void* p, size_t bytes) const {
    if (node_ == MPI_COMM_NULL || !whole_) return {-1, 0};
    const uint64_t a = reinterpret_cast<uintptr_t>(p);
    for (const auto& [site, o] : own_) {  // the runtime's own (shared_scratch): the group's node
      const uint64_t at = reinterpret_cast<uintptr_t>(o.at(rank_of_node()));
      if (a >= at && a + bytes <= at + o.bytes) return {kOwnIds + site, static_cast<int64_t>(a - at)};
    }
    if (!user) return {-1, 0};
    for (size_t k = 0; k + 3 < user->size(); k += 4) {
      const uint64_t at = (*user)[k + 1], n = (*user)[k + 2];
      if (a < at || a + bytes > at + n) continue;
      std::vector<int> ranks = window_ranks(handle(k));
      bool all = std::find(ranks.begin(), ranks.end(), MPI_UNDEFINED) == ranks.end();
      return all ? std::make_pair(static_cast<int64_t>((*user)[k]), static_cast<int64_t>(a - at))
                 : std::make_pair(int64_t(-1), int64_t(0));
    }
    return {-1, 0};
  }

  // Rank r's memory at `offset` in the user window `id` (as every rank registered it).
  const char* user_memory(int64_t id, int r, int64_t offset) const {
    if (id >= kOwnIds && (static_cast<uint64_t>(id) & kNodeShared) == 0) {
      auto it = own_.find(static_cast<int>(id - kOwnIds));
      if (it != own_.end()) return it->second.at(r) + offset;
    }
    for (size_t k = 0; user && k + 3 < user->size(); k += 4) {
      if (static_cast<int64_t>((*user)[k]) != id) continue;
      if ((*user)[k] & kNodeShared) return reinterpret_cast<const char*>((*user)[k + 1]) + offset;
      MPI_Win w = handle(k);
      int wr = window_ranks(w)[static_cast<size_t>(r)];
      MPI_Aint size = 0;
      int disp = 1;
      void* base = nullptr;
      COCONET_MPI(MPI_Win_shared_query(w, wr, &size, &disp, &base));
      return static_cast<const char*>(base) + offset;
    }
    abort_all("fused collective: a peer's buffer is in a shared window this rank does not know");
    return nullptr;
  }

 private:
  MPI_Win handle(size_t k) const {
    MPI_Win w;
    uint64_t h = (*user)[k + 3];
    if (sizeof(MPI_Win) == sizeof(uint64_t)) {
      std::memcpy(&w, &h, sizeof(MPI_Win));
    } else {
      int i = static_cast<int>(h);
      std::memcpy(&w, &i, sizeof(MPI_Win));
    }
    return w;
  }

  // The ranks of this window's group (the node's ranks, in group order) in window w.
  std::vector<int> window_ranks(MPI_Win w) const {
    MPI_Group wg, ng;
    COCONET_MPI(MPI_Win_get_group(w, &wg));
    COCONET_MPI(MPI_Comm_group(node_, &ng));
    std::vector<int> mine(bases_.size()), theirs(bases_.size());
    for (size_t i = 0; i < mine.size(); ++i) mine[i] = static_cast<int>(i);
    COCONET_MPI(MPI_Group_translate_ranks(ng, static_cast<int>(mine.size()), mine.data(), wg,
                                          theirs.data()));
    MPI_Group_free(&wg);
    MPI_Group_free(&ng);
    return theirs;
  }

  void release_window() {
    if (win_ == MPI_WIN_NULL) return;
    MPI_Win_unlock_all(win_);
    MPI_Win_free(&win_);
    bytes_ = 0;
  }

  // The ids of the runtime's own windows (user windows' ids count up from 0).
  static constexpr int64_t kOwnIds = int64_t(1) << 40;
  struct Own {
    MPI_Win win = MPI_WIN_NULL;
    size_t bytes = 0;
    std::vector<void*> bases;  // every rank's part (node ranks: the group's order)
    char* at(int r) const { return static_cast<char*>(bases[static_cast<size_t>(r)]); }
  };

  // A new window of `bytes` per rank over the node's ranks, every rank's part into `bases`
  // (collective).
  MPI_Win allocate(size_t bytes, std::vector<void*>& bases) const {
    MPI_Info info;
    MPI_Info_create(&info);
    MPI_Info_set(info, "alloc_shared_noncontig", "true");
    char* mine = nullptr;
    MPI_Win win = MPI_WIN_NULL;
    COCONET_MPI(MPI_Win_allocate_shared(static_cast<MPI_Aint>(bytes), 1, info, node_, &mine, &win));
    MPI_Info_free(&info);
    bases.assign(bases_.size(), nullptr);
    for (size_t r = 0; r < bases.size(); ++r) {
      MPI_Aint size = 0;
      int disp = 1;
      COCONET_MPI(MPI_Win_shared_query(win, static_cast<int>(r), &size, &disp, &bases[r]));
    }
    return win;
  }
  std::map<int, Own> own_;
  int rank_of_node() const { return node_rank_; }
  int node_rank_ = 0;

  bool checked_ = false;
  bool whole_ = false;  // the group is on this node
  NodeLayout layout_;
  MPI_Comm node_ = MPI_COMM_NULL;
  MPI_Win win_ = MPI_WIN_NULL;
  size_t bytes_ = 0;
  std::vector<void*> bases_;
};

// Direction of send(x, next|prev).
enum class Direction { next, prev };

struct Comm {
  MPI_Comm world = MPI_COMM_NULL;  // private dup of the caller's communicator (all W ranks)
  MPI_Comm group = MPI_COMM_NULL;  // this rank's group (W/G ranks)
  int world_rank = 0, world_size = 1;
  int groups = 1, group_index = 0;  // G and this rank's group
  int rank = 0, size = 1;           // rank and size in the group
  int sim_node = 0;                 // this rank's simulated node (COCONET_SIMULATE_NODES; node_comm)
  int next_peer = MPI_PROC_NULL;    // world rank of the same in-group rank in the next group
  int prev_peer = MPI_PROC_NULL;    // ... in the previous group
  ShmWindow shm;                    // the group's shared-memory window (fused.h), on first use

  // Splits `base` into `groups` consecutive groups.  Collective over `base`; throws
  // std::invalid_argument (before communicating) unless groups divides the size of `base`.
  Comm(MPI_Comm base, int groups_ = 1) {
    MPI_Comm_size(base, &world_size);
    MPI_Comm_rank(base, &world_rank);
    require(groups_ >= 1, "groups must be >= 1, got " + std::to_string(groups_));
    require(world_size % groups_ == 0,
            "groups=" + std::to_string(groups_) + " does not divide the number of processes (" +
                std::to_string(world_size) + ")");
    sim_node = simulated_node(world_rank, world_size);  // (throws, before communicating, if bad)
    groups = groups_;
    size = world_size / groups;
    group_index = world_rank / size;
    rank = world_rank % size;
    next_peer = group_index + 1 < groups ? world_rank + size : MPI_PROC_NULL;
    prev_peer = group_index > 0 ? world_rank - size : MPI_PROC_NULL;
    COCONET_MPI(MPI_Comm_dup(base, &world));
    COCONET_MPI(MPI_Comm_set_errhandler(world, MPI_ERRORS_RETURN));
    int share = node_share(world, sim_node);  // on every rank of `base` alike, whatever was set before
    if (process_threads() == 0) {
      process_threads() = share;
      if (on_threads_set()) on_threads_set()(share);
    }
    COCONET_MPI(MPI_Comm_split(world, group_index, rank, &group));
    COCONET_MPI(MPI_Comm_set_errhandler(group, MPI_ERRORS_RETURN));
  }

  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  ~Comm() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;  // MPI already tore everything down
    shm.release();  // before the communicators it was made from
    for (MPI_Comm& c : channels_) MPI_Comm_free(&c);
    if (group != MPI_COMM_NULL) MPI_Comm_free(&group);
    if (world != MPI_COMM_NULL) MPI_Comm_free(&world);
  }

  // A reusable scratch buffer of at least `bytes` bytes for (channel, index), kept (and grown)
  // for the Comm's life, so operations called every training step do not pay for fresh pages
  // each time.  Operations that can be in flight together use different keys; the contents are
  // undefined on return.
  void* scratch(int channel, int index, size_t bytes) {
    Scratch& s = scratch_[{channel, index}];
    if (s.size < bytes) {
      s.data.reset(new char[bytes]);
      s.size = bytes;
    }
    return s.data.get();
  }

  // World rank of send's peer: where data goes for `next`, where it comes from for `prev`.
  int peer(Direction d) const { return d == Direction::next ? next_peer : prev_peer; }

  // A communicator over the same group for traffic that must not interleave with other
  // in-flight operations: channel 0 is `group`; channel i >= 1 is a private dup, created
  // (collectively, on first use) and cached.  overlap() gives each in-flight chunk its own
  // channel, so operations posted in data-dependent order never cross-match.
  MPI_Comm channel(int i) {
    if (i <= 0) return group;
    while (static_cast<int>(channels_.size()) < i) {
      MPI_Comm c;
      COCONET_MPI(MPI_Comm_dup(group, &c));
      COCONET_MPI(MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN));
      channels_.push_back(c);
    }
    return channels_[static_cast<size_t>(i - 1)];
  }

 private:
  struct Scratch {
    std::unique_ptr<char[]> data;
    size_t size = 0;
  };
  std::vector<MPI_Comm> channels_;
  std::map<std::pair<int, int>, Scratch> scratch_;
};

// Scratch memory for n elements of T (see Comm::scratch).
template <class T>
T* scratch_as(Comm& comm, int channel, int index, int64_t n) {
  return static_cast<T*>(comm.scratch(channel, index, static_cast<size_t>(n) * sizeof(T)));
}

// Scratch keys of the runtime: channel 0 serves blocking operations (the fused collectives use
// indexes 0..4, the staged collectives kScratchStage); overlap tasks use their own channel.
constexpr int kScratchStage = 8;

// ---- a cache of Comms per (caller communicator, groups) ------------------------------------
//
// Creating a Comm costs two collective calls, so generated modules look it up here.  The cache
// hangs off the caller's communicator as an MPI attribute: when the user frees that
// communicator, MPI calls the delete callback and the cached Comms go with it.

using CommCache = std::map<int, std::unique_ptr<Comm>>;

// MPI attribute delete callback: frees the cached Comms of a communicator being freed.
inline int comm_cache_delete(MPI_Comm, int, void* value, void*) {
  delete static_cast<CommCache*>(value);
  return MPI_SUCCESS;
}

// The process-wide attribute key of the cache.
COCONET_STATE int comm_cache_keyval() COCONET_STATE_BODY({
  static int keyval = [] {
    int k = MPI_KEYVAL_INVALID;
    COCONET_MPI(MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, comm_cache_delete, &k, nullptr));
    return k;
  }();
  return keyval;
})

// The Comm for `base` split into `groups` groups, created on first use (collective then).
COCONET_LIBRARY Comm& cached_comm(MPI_Comm base, int groups = 1) COCONET_LIBRARY_BODY({
  int key = comm_cache_keyval();
  void* value = nullptr;
  int found = 0;
  COCONET_MPI(MPI_Comm_get_attr(base, key, &value, &found));
  if (!found) {
    value = new CommCache();
    COCONET_MPI(MPI_Comm_set_attr(base, key, value));
  }
  auto& cache = *static_cast<CommCache*>(value);
  auto it = cache.find(groups);
  if (it != cache.end()) return *it->second;
  auto comm = std::make_unique<Comm>(base, groups);
  Comm& ref = *comm;
  cache.emplace(groups, std::move(comm));
  return ref;
})

}  // namespace coconet
