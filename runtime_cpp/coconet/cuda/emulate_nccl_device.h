// coconet host emulation of the NCCL device API subset symmetric.cuh uses (included at the end of
// emulate.h): symmetric memory, LSA pointers and LSA barriers between the rank processes.
//   - ncclMemAlloc: a POSIX shared-memory segment of this process (shm_open + mmap);
//   - ncclCommWindowRegister (collective): the ranks exchange their segments' names over MPI and
//     map every peer's, so ncclGetLsaPointer(win, offset, peer) is a real address of the peer's
//     memory (peer loads and stores really reach the peer process); each name is unlinked once
//     every rank has mapped it (a buffer is registered once);
//   - ncclDevCommCreate (collective): an array of LSA barrier slots in shared memory, one per
//     (barrier index, rank); ncclLsaBarrierSession::sync is __syncthreads, then thread 0 publishes
//     this block's next epoch in its slot and waits until every peer's slot of that index reaches
//     it (acquire/release atomics, so the window's plain loads and stores are ordered by it), then
//     __syncthreads. The emulation runs a kernel's blocks in order on every rank, so block b's
//     barrier meets the peers' block b; a barrier no peer reaches within 120 s raises;
//   - the LSA team is every rank of the communicator on this node (MPI_COMM_TYPE_SHARED), or,
//     with COCONET_EMULATE_LSA_SIZE=k, teams of k consecutive ranks (to emulate several nodes),
//     or with COCONET_SIMULATE_NODES=K (docs/cluster.md), the K simulated nodes' ranks;
//   - COCONET_EMULATE_NO_DEVICE_API=1: the communicator reports no device API support.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>

#define NCCL_WIN_COLL_SYMMETRIC 0x01
#define NCCL_WIN_REQUIRED_ALIGNMENT 4096

namespace cuda {  // <cuda/atomic>'s memory orders
using memory_order = std::memory_order;
constexpr memory_order memory_order_relaxed = std::memory_order_relaxed;
constexpr memory_order memory_order_acquire = std::memory_order_acquire;
constexpr memory_order memory_order_release = std::memory_order_release;
constexpr memory_order memory_order_acq_rel = std::memory_order_acq_rel;
}  // namespace cuda

struct ncclWindow_vidmem {
  std::vector<char*> peers;  // every rank's registered buffer, mapped here
  std::vector<char*> bases;  // and the ncclMemAlloc segment it lies in
  std::vector<size_t> sizes;
  int lsa_base = 0;          // the communicator rank of LSA peer 0
};
typedef ncclWindow_vidmem* ncclWindow_t;

struct ncclTeam {
  int nRanks, rank, stride;
};
typedef ncclTeam ncclTeam_t;

namespace coconet { namespace cuda { namespace emu { struct LsaBarriers; } } }
struct ncclLsaBarrierHandle {
  coconet::cuda::emu::LsaBarriers* state = nullptr;
  int nBarriers = 0;
};
typedef ncclLsaBarrierHandle ncclLsaBarrierHandle_t;

struct ncclDevComm {
  int rank = 0, nRanks = 1, lsaRank = 0, lsaSize = 1;
  ncclLsaBarrierHandle lsaBarrier;
};
typedef ncclDevComm ncclDevComm_t;

struct ncclDevCommRequirements_t {
  int lsaBarrierCount = 0;
};
// COCONET_EMULATE_NCCL_2_28 (defined at the top of this header by a test): NCCL 2.28's host API,
// which has neither initializer macro nor ncclCommQueryProperties (symmetric.cuh then probes by
// making the device communicator, which fails where the device API is off).
#ifndef COCONET_EMULATE_NCCL_2_28
#define NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER {}
#endif

struct ncclCommProperties_t {
  int rank = 0, nRanks = 1;
  bool deviceApiSupport = false;
  int nLsaTeams = 1;
};
#ifndef COCONET_EMULATE_NCCL_2_28
#define NCCL_COMM_PROPERTIES_INITIALIZER {}
#endif

struct ncclCoopCta {
  int thread_rank() const { return int(threadIdx.x); }
  int size() const { return int(blockDim.x); }
  int num_threads() const { return int(blockDim.x); }
  void sync() { __syncthreads(); }
};

namespace coconet {
namespace cuda {
namespace emu {

// A kernel's declared accesses, extended (symmetric.cuh adds the window's spans to the renderer's).
COCONET_EMU void declare_also(std::vector<Span> spans) {
  State& st = state();
  std::lock_guard<std::recursive_mutex> d(st.det);
  st.pending.insert(st.pending.end(), spans.begin(), spans.end());
  st.pending_set = true;
}

COCONET_EMU std::string shm_name(const char* what) {
  static std::atomic<int> counter{0};
  return "/coconet-" + std::to_string(getpid()) + "-" + what + "-" + std::to_string(counter++);
}
COCONET_EMU char* shm_map(const std::string& name, size_t n, bool create) {
  const int fd = shm_open(name.c_str(), create ? O_CREAT | O_EXCL | O_RDWR : O_RDWR, 0600);
  if (fd < 0) throw std::runtime_error("coconet emulate: shm_open " + name + " failed");
  if (create && ftruncate(fd, off_t(n)) != 0) {
    close(fd);
    shm_unlink(name.c_str());
    throw std::runtime_error("coconet emulate: ftruncate " + name + " failed");
  }
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) throw std::runtime_error("coconet emulate: mmap " + name + " failed");
  return static_cast<char*>(p);
}

// ncclMemAlloc's segments of this process: base -> (name, size, linked).
struct ShmAlloc {
  std::string name;
  size_t size;
  bool linked;
};
COCONET_EMU std::map<uintptr_t, ShmAlloc>& shm_allocs() {
  static auto* m = new std::map<uintptr_t, ShmAlloc>();
  return *m;
}
COCONET_EMU std::mutex& shm_mutex() {
  static std::mutex mu;
  return mu;
}
COCONET_EMU void shm_unlink_all() {  // at exit: names not yet unlinked (never registered)
  std::lock_guard<std::mutex> lock(shm_mutex());
  for (auto& kv : shm_allocs())
    if (kv.second.linked) shm_unlink(kv.second.name.c_str());
}

// The LSA team of a communicator: the ranks of its node, or teams of COCONET_EMULATE_LSA_SIZE.
COCONET_EMU ncclTeam lsa_team(Comm* c) {
  int lsa = c->size;
  const char* sim = std::getenv("COCONET_SIMULATE_NODES");  // as comm.h's node_comm: K nodes
  if (const char* s = std::getenv("COCONET_EMULATE_LSA_SIZE")) {
    lsa = std::max(1, std::min(c->size, std::atoi(s)));
  } else if (sim && *sim) {
    const int k = std::atoi(sim);
    if (k < 1 || c->size % k)
      throw std::runtime_error(std::string("COCONET_SIMULATE_NODES=") + sim + " does not divide the " +
                               std::to_string(c->size) + " ranks of the communicator into equal nodes");
    lsa = c->size / k;
  } else {
    MPI_Comm node;
    mpi_check(MPI_Comm_split_type(c->mpi, MPI_COMM_TYPE_SHARED, c->rank, MPI_INFO_NULL, &node),
              "MPI_Comm_split_type");
    MPI_Comm_size(node, &lsa);
    MPI_Comm_free(&node);
  }
  return ncclTeam{lsa, c->rank % lsa, 1};
}

// LSA barriers of a device communicator: slot[index * lsaSize + rank] (shared) holds the epoch
// that rank's block `index` last reached; epoch[index] is this rank's (its blocks run in turn).
struct LsaBarriers {
  std::atomic<uint64_t>* slots = nullptr;
  size_t bytes = 0;
  int n = 0, size = 1, rank = 0;
  std::vector<uint64_t> epoch;
  void sync(int index) {
    if (index < 0 || index >= n)
      throw std::runtime_error("coconet emulate: LSA barrier " + std::to_string(index) + " of " + std::to_string(n));
    const uint64_t e = ++epoch[size_t(index)];
    std::atomic<uint64_t>* row = slots + size_t(index) * size_t(size);
    row[rank].store(e, std::memory_order_seq_cst);
    const auto start = std::chrono::steady_clock::now();
    for (int p = 0; p < size; ++p)
      for (int spins = 0; row[p].load(std::memory_order_seq_cst) < e; ++spins) {
        if (spins < 64) continue;
        std::this_thread::sleep_for(std::chrono::microseconds(50));
        if (std::chrono::steady_clock::now() - start > std::chrono::seconds(120))
          throw std::runtime_error("coconet emulate: LSA barrier " + std::to_string(index) + " (epoch " +
                                   std::to_string(e) + "): rank " + std::to_string(p) + " did not arrive in 120 s");
      }
  }
};

}  // namespace emu
}  // namespace cuda
}  // namespace coconet

COCONET_EMU ncclTeam_t ncclTeamLsa(ncclComm_t comm) { return coconet::cuda::emu::lsa_team(comm); }
COCONET_EMU const char* ncclGetLastError(ncclComm_t) { return "the emulated communicator has no device API"; }
COCONET_EMU ncclTeam ncclTeamLsa(const ncclDevComm& d) { return ncclTeam{d.lsaSize, d.lsaRank, 1}; }

COCONET_EMU ncclResult_t ncclCommQueryProperties(ncclComm_t comm, ncclCommProperties_t* props) {
  namespace m = coconet::cuda::emu;
  m::sync_all();  // MPI on the communicator's own MPI_Comm: nothing of it may be in flight
  const char* off = std::getenv("COCONET_EMULATE_NO_DEVICE_API");
  props->rank = comm->rank;
  props->nRanks = comm->size;
  props->deviceApiSupport = !(off && *off && std::string(off) != "0");
  const ncclTeam lsa = m::lsa_team(comm);
  props->nLsaTeams = comm->size / lsa.nRanks;
  return ncclSuccess;
}

COCONET_EMU ncclResult_t ncclMemAlloc(void** ptr, size_t size) {
  namespace m = coconet::cuda::emu;
  static const bool at_exit = [] { return std::atexit(m::shm_unlink_all) == 0; }();
  (void)at_exit;
  const std::string name = m::shm_name("mem");
  char* p = m::shm_map(name, size ? size : 1, true);
  std::lock_guard<std::mutex> lock(m::shm_mutex());
  m::shm_allocs()[uintptr_t(p)] = m::ShmAlloc{name, size ? size : 1, true};
  *ptr = p;
  return ncclSuccess;
}
COCONET_EMU ncclResult_t ncclMemFree(void* ptr) {
  namespace m = coconet::cuda::emu;
  m::sync_all();
  m::forget_buffer(ptr);
  std::lock_guard<std::mutex> lock(m::shm_mutex());
  auto it = m::shm_allocs().find(uintptr_t(ptr));
  if (it == m::shm_allocs().end()) return ncclInvalidArgument;
  if (it->second.linked) shm_unlink(it->second.name.c_str());
  munmap(ptr, it->second.size);
  m::shm_allocs().erase(it);
  return ncclSuccess;
}

// Collective: every rank's buffer mapped into every rank (peers[p]).
COCONET_EMU ncclResult_t ncclCommWindowRegister(ncclComm_t comm, void* buff, size_t size, ncclWindow_t* win, int) {
  namespace m = coconet::cuda::emu;
  m::sync_all();
  struct Entry {
    char name[96];
    uint64_t offset, alloc, size;
  } mine{}, *all = nullptr;
  {
    std::lock_guard<std::mutex> lock(m::shm_mutex());
    auto it = m::shm_allocs().upper_bound(uintptr_t(buff));
    if (it == m::shm_allocs().begin()) return ncclInvalidArgument;
    --it;
    if (uintptr_t(buff) + size > it->first + it->second.size || !it->second.linked)
      throw std::runtime_error("coconet emulate: ncclCommWindowRegister: not inside one ncclMemAlloc buffer "
                               "registered for the first time");
    std::snprintf(mine.name, sizeof(mine.name), "%s", it->second.name.c_str());
    mine.offset = uintptr_t(buff) - it->first;
    mine.alloc = it->second.size;
    mine.size = size;
  }
  std::vector<Entry> entries(size_t(comm->size));
  all = entries.data();
  m::mpi_check(MPI_Allgather(&mine, sizeof(Entry), MPI_BYTE, all, sizeof(Entry), MPI_BYTE, comm->mpi),
               "MPI_Allgather");
  auto* w = new ncclWindow_vidmem();
  for (int p = 0; p < comm->size; ++p) {
    if (entries[size_t(p)].size != size)
      throw std::runtime_error("coconet emulate: ncclCommWindowRegister with NCCL_WIN_COLL_SYMMETRIC: ranks "
                               "register different sizes");
    char* base = p == comm->rank ? static_cast<char*>(buff) - mine.offset
                                 : m::shm_map(entries[size_t(p)].name, entries[size_t(p)].alloc, false);
    w->peers.push_back(base + entries[size_t(p)].offset);
    w->bases.push_back(base);
    w->sizes.push_back(entries[size_t(p)].alloc);
  }
  const ncclTeam lsa = m::lsa_team(comm);
  w->lsa_base = comm->rank - lsa.rank;
  m::mpi_check(MPI_Barrier(comm->mpi), "MPI_Barrier");  // every rank has mapped every segment
  {
    std::lock_guard<std::mutex> lock(m::shm_mutex());
    auto it = m::shm_allocs().find(uintptr_t(buff) - mine.offset);
    shm_unlink(it->second.name.c_str());
    it->second.linked = false;
  }
  *win = w;
  return ncclSuccess;
}
COCONET_EMU ncclResult_t ncclCommWindowDeregister(ncclComm_t comm, ncclWindow_t win) {
  namespace m = coconet::cuda::emu;
  m::sync_all();
  m::mpi_check(MPI_Barrier(comm->mpi), "MPI_Barrier");  // no peer reads this window any more
  for (size_t p = 0; p < win->peers.size(); ++p)
    if (int(p) != comm->rank) munmap(win->bases[p], win->sizes[p]);
  delete win;
  return ncclSuccess;
}

// Collective: the LSA barrier slots in shared memory (made by rank 0, mapped by every rank).
COCONET_EMU ncclResult_t ncclDevCommCreate(ncclComm_t comm, const ncclDevCommRequirements_t* reqs, ncclDevComm* dev) {
  namespace m = coconet::cuda::emu;
  m::sync_all();
  const char* off = std::getenv("COCONET_EMULATE_NO_DEVICE_API");
  if (off && *off && std::string(off) != "0") return ncclInvalidArgument;  // as NCCL without it
  const ncclTeam lsa = m::lsa_team(comm);
  auto* b = new m::LsaBarriers();
  b->n = reqs->lsaBarrierCount;
  b->size = lsa.nRanks;
  b->rank = lsa.rank;
  b->epoch.assign(size_t(b->n), 0);
  b->bytes = std::max<size_t>(1, size_t(b->n) * size_t(b->size) * sizeof(std::atomic<uint64_t>));
  MPI_Comm team;  // the ranks of this LSA team
  m::mpi_check(MPI_Comm_split(comm->mpi, comm->rank / lsa.nRanks, lsa.rank, &team), "MPI_Comm_split");
  char name[96] = {0};
  char* slots = nullptr;
  if (lsa.rank == 0) {  // made before its name goes out
    std::snprintf(name, sizeof(name), "%s", m::shm_name("lsa").c_str());
    slots = m::shm_map(name, b->bytes, true);
  }
  m::mpi_check(MPI_Bcast(name, sizeof(name), MPI_CHAR, 0, team), "MPI_Bcast");
  if (lsa.rank != 0) slots = m::shm_map(name, b->bytes, false);
  b->slots = reinterpret_cast<std::atomic<uint64_t>*>(slots);
  m::mpi_check(MPI_Barrier(team), "MPI_Barrier");  // every rank has mapped it
  if (lsa.rank == 0) shm_unlink(name);
  MPI_Comm_free(&team);
  dev->rank = comm->rank;
  dev->nRanks = comm->size;
  dev->lsaRank = lsa.rank;
  dev->lsaSize = lsa.nRanks;
  dev->lsaBarrier = ncclLsaBarrierHandle{b, b->n};
  return ncclSuccess;
}
COCONET_EMU ncclResult_t ncclDevCommDestroy(ncclComm_t, const ncclDevComm* dev) {
  coconet::cuda::emu::sync_all();
  auto* b = dev->lsaBarrier.state;
  if (b) munmap(static_cast<void*>(b->slots), b->bytes);
  delete b;
  return ncclSuccess;
}

// LSA peer `peer`'s buffer (peer: its rank in the LSA team).
COCONET_EMU void* ncclGetLsaPointer(ncclWindow_t w, size_t offset, int peer) {
  return w->peers.at(size_t(w->lsa_base + peer)) + offset;
}

template <class Coop>
struct ncclLsaBarrierSession {
  ncclLsaBarrierHandle handle;
  int index;
  ncclLsaBarrierSession(Coop, const ncclDevComm&, ncclTeam, ncclLsaBarrierHandle h, uint32_t i)
      : handle(h), index(int(i)) {}
  ncclLsaBarrierSession(const ncclLsaBarrierSession&) = delete;
  void sync(Coop coop, cuda::memory_order) {
    coop.sync();
    if (coop.thread_rank() == 0) handle.state->sync(index);
    coop.sync();
  }
};
