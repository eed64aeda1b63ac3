// coconet host emulation: NCCL's host API (emulate.h includes every part, in order).
#pragma once

#include "emulate_cuda_api.h"

// ---- NCCL ------------------------------------------------------------------------------------------

COCONET_EMU const char* ncclGetErrorString(ncclResult_t r) {
  if (r == ncclRemoteError) return "remote process exited or there was a network error";  // NCCL's words
  return r == ncclSuccess ? "no error" : "emulation error";
}
COCONET_EMU ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* r) {
  *r = ncclResult_t(comm->async_error.load());
  return ncclSuccess;
}
COCONET_EMU ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  std::memset(id->internal, 0, sizeof(id->internal));
  std::strcpy(id->internal, "coconet host emulation");
  return ncclSuccess;
}
COCONET_EMU ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId, int rank) {
  namespace m = coconet::cuda::emu;
  int provided = 0, wsize = 1;
  MPI_Query_thread(&provided);
  if (provided != MPI_THREAD_MULTIPLE)
    throw std::runtime_error("coconet emulate: MPI must be initialized with MPI_THREAD_MULTIPLE");
  MPI_Comm_size(MPI_COMM_WORLD, &wsize);
  auto* c = new m::Comm();
  if (nranks == 1) {
    m::mpi_check(MPI_Comm_dup(MPI_COMM_SELF, &c->mpi), "MPI_Comm_dup");
  } else if (nranks == wsize) {
    m::mpi_check(MPI_Comm_split(MPI_COMM_WORLD, 0, rank, &c->mpi), "MPI_Comm_split");
  } else {
    delete c;
    throw std::runtime_error("coconet emulate: an NCCL communicator is MPI_COMM_WORLD or one rank");
  }
  MPI_Comm_size(c->mpi, &c->size);
  MPI_Comm_rank(c->mpi, &c->rank);
  *comm = c;
  return ncclSuccess;
}
COCONET_EMU ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* out, void*) {
  namespace m = coconet::cuda::emu;
  coconet::cuda::emu::sync_all();
  auto* c = new m::Comm();
  m::mpi_check(MPI_Comm_split(comm->mpi, color, key, &c->mpi), "MPI_Comm_split");
  MPI_Comm_size(c->mpi, &c->size);
  MPI_Comm_rank(c->mpi, &c->rank);
  *out = c;
  return ncclSuccess;
}
COCONET_EMU ncclResult_t ncclCommAbort(ncclComm_t comm) {  // no wait for the calls in flight: they fail
  if (comm) comm->aborted.store(true);
  return ncclSuccess;
}
COCONET_EMU ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  coconet::cuda::emu::sync_all();
  MPI_Comm_free(&comm->mpi);
  delete comm;
  return ncclSuccess;
}
COCONET_EMU ncclResult_t ncclCommCount(ncclComm_t c, int* n) { *n = c->size; return ncclSuccess; }
COCONET_EMU ncclResult_t ncclCommUserRank(ncclComm_t c, int* r) { *r = c->rank; return ncclSuccess; }
COCONET_EMU ncclResult_t ncclGroupStart() {
  coconet::cuda::emu::group.depth += 1;
  return ncclSuccess;
}
COCONET_EMU ncclResult_t ncclGroupEnd() {
  namespace m = coconet::cuda::emu;
  if (--m::group.depth == 0) {
    std::vector<m::Call> calls;
    calls.swap(m::group.calls);
    m::submit(std::move(calls), m::group.stream);
  }
  return ncclSuccess;
}
COCONET_EMU ncclResult_t ncclAllReduce(const void* s, void* r, size_t n, ncclDataType_t t, ncclRedOp_t op, ncclComm_t c,
                                  cudaStream_t st) {
  return coconet::cuda::emu::nccl({coconet::cuda::emu::Call::AllReduce, s, r, n, t, op, 0, c, {}, {}}, st);
}
COCONET_EMU ncclResult_t ncclReduce(const void* s, void* r, size_t n, ncclDataType_t t, ncclRedOp_t op, int root,
                               ncclComm_t c, cudaStream_t st) {
  return coconet::cuda::emu::nccl({coconet::cuda::emu::Call::Reduce, s, r, n, t, op, root, c, {}, {}}, st);
}
COCONET_EMU ncclResult_t ncclBroadcast(const void* s, void* r, size_t n, ncclDataType_t t, int root, ncclComm_t c,
                                  cudaStream_t st) {
  return coconet::cuda::emu::nccl({coconet::cuda::emu::Call::Broadcast, s, r, n, t, ncclSum, root, c, {}, {}}, st);
}
COCONET_EMU ncclResult_t ncclAllGather(const void* s, void* r, size_t n, ncclDataType_t t, ncclComm_t c, cudaStream_t st) {
  return coconet::cuda::emu::nccl({coconet::cuda::emu::Call::AllGather, s, r, n, t, ncclSum, 0, c, {}, {}}, st);
}
COCONET_EMU ncclResult_t ncclReduceScatter(const void* s, void* r, size_t n, ncclDataType_t t, ncclRedOp_t op,
                                      ncclComm_t c, cudaStream_t st) {
  return coconet::cuda::emu::nccl({coconet::cuda::emu::Call::ReduceScatter, s, r, n, t, op, 0, c, {}, {}}, st);
}
COCONET_EMU ncclResult_t ncclSend(const void* s, size_t n, ncclDataType_t t, int peer, ncclComm_t c, cudaStream_t st) {
  return coconet::cuda::emu::nccl({coconet::cuda::emu::Call::Send, s, nullptr, n, t, ncclSum, peer, c, {}, {}}, st);
}
COCONET_EMU ncclResult_t ncclRecv(void* r, size_t n, ncclDataType_t t, int peer, ncclComm_t c, cudaStream_t st) {
  return coconet::cuda::emu::nccl({coconet::cuda::emu::Call::Recv, nullptr, r, n, t, ncclSum, peer, c, {}, {}}, st);
}
