// coconet CUDA runtime: NCCL communicators, and the C entry points the Python runtime calls through ctypes (communicator abort, asynchronous errors, the watchdog's events) (runtime.cuh includes every part, in order).
#pragma once

#include "fused.cuh"

namespace coconet {
namespace cuda {

// ---- communicators -----------------------------------------------------------------------------

COCONET_EMU std::string unique_id() {
  ncclUniqueId id;
  COCONET_CUDA(ncclGetUniqueId(&id));
  return std::string(id.internal, sizeof(id.internal));
}

COCONET_EMU uintptr_t comm_init(const std::string& id_bytes, int nranks, int rank) {
  require(id_bytes.size() == sizeof(ncclUniqueId), "an NCCL unique id is 128 bytes");
  ncclUniqueId id;
  std::memcpy(id.internal, id_bytes.data(), sizeof(id.internal));
  ncclComm_t comm;
  COCONET_CUDA(ncclCommInitRank(&comm, nranks, id, rank));
  return reinterpret_cast<uintptr_t>(comm);
}

COCONET_EMU void comm_destroy(uintptr_t comm) { COCONET_CUDA(ncclCommDestroy(reinterpret_cast<ncclComm_t>(comm))); }
}  // namespace cuda
}  // namespace coconet

// ncclCommAbort on a communicator of this module (its NcclComm.handle), callable while a call of
// the module is blocked on it (from another thread, through ctypes: the Python runtime's abort
// path, coconetc/runtime/cuda.py); returns the ncclResult_t.
extern "C" __attribute__((visibility("default"), used)) inline int coconet_nccl_comm_abort(uintptr_t comm) {
  return int(ncclCommAbort(reinterpret_cast<ncclComm_t>(comm)));
}

// The communicator's asynchronous error (ncclCommGetAsyncError), 0 for none, its text in buf: for
// the Python runtime's watchdog, which polls it while the communicator lives (a GPU call returns
// before its collectives run, so their errors surface only here).
extern "C" __attribute__((visibility("default"), used)) inline int coconet_nccl_async_error(uintptr_t comm, char* buf,
                                                                                          int len) {
  ncclResult_t r = ncclSuccess;
  const ncclResult_t q = ncclCommGetAsyncError(reinterpret_cast<ncclComm_t>(comm), &r);
  if (q != ncclSuccess) r = q;
  if (r != ncclSuccess && len > 0) std::snprintf(buf, size_t(len), "%s", ncclGetErrorString(r));
  return int(r);
}

// Events for the same watchdog, which times each call's work on the GPU (a call returns before its
// collectives run, so one whose peers never join would otherwise hang the next synchronization
// untimed): after a call's work is queued, an event of a small pool is recorded on its stream
// (never waited for) and queried until it completes or the call's time is up. Handles are
// cudaEvent_t as integers; 0 from create: none could be made. create writes the device it was
// made on (the caller's current one), which query and destroy make current on the watchdog's
// thread first (once; device -1: never, on the caller's thread), so that that thread does not
// make a context of its own on device 0.
namespace coconet {
namespace cuda {
COCONET_EMU cudaError_t event_thread_device(int device) {
  static thread_local int current = -1;
  if (device < 0 || current == device) return cudaSuccess;
  const cudaError_t r = cudaSetDevice(device);
  if (r == cudaSuccess) current = device;
  return r;
}
}  // namespace cuda
}  // namespace coconet
extern "C" __attribute__((visibility("default"), used)) inline uintptr_t coconet_event_create(int* device) {
  cudaEvent_t e = nullptr;
  if (cudaGetDevice(device) != cudaSuccess) return 0;
  return cudaEventCreateWithFlags(&e, cudaEventDisableTiming) == cudaSuccess ? reinterpret_cast<uintptr_t>(e) : 0;
}
// The cudaError_t of cudaEventRecord(event, stream).
extern "C" __attribute__((visibility("default"), used)) inline int coconet_event_record(uintptr_t event,
                                                                                      uintptr_t stream) {
  return int(cudaEventRecord(reinterpret_cast<cudaEvent_t>(event), reinterpret_cast<cudaStream_t>(stream)));
}
// 0: the work before the event completed; 1: not yet (cudaErrorNotReady); else the cudaError_t of
// cudaEventQuery (a failed kernel: the device's error), its text in buf.
extern "C" __attribute__((visibility("default"), used)) inline int coconet_event_query(uintptr_t event, int device,
                                                                                     char* buf, int len) {
  const cudaError_t set = coconet::cuda::event_thread_device(device);
  if (set != cudaSuccess) {
    if (len > 0) std::snprintf(buf, size_t(len), "cudaSetDevice(%d): %s", device, cudaGetErrorString(set));
    return int(set);
  }
  const cudaError_t r = cudaEventQuery(reinterpret_cast<cudaEvent_t>(event));
  if (r == cudaErrorNotReady) {
    (void)cudaGetLastError();  // not an error: cleared, as PyTorch's CUDAEvent::query does
    return 1;
  }
  if (r != cudaSuccess && len > 0) std::snprintf(buf, size_t(len), "%s", cudaGetErrorString(r));
  return int(r);
}
extern "C" __attribute__((visibility("default"), used)) inline int coconet_event_destroy(uintptr_t event, int device) {
  const cudaError_t set = coconet::cuda::event_thread_device(device);
  return int(set != cudaSuccess ? set : cudaEventDestroy(reinterpret_cast<cudaEvent_t>(event)));
}

// The fused collective as one kernel over symmetric memory (NCCL device API), chosen at run time.
#include "symmetric.cuh"
// The tensor operations a derived (vector-Jacobian) program adds.
#include "grad.cuh"
