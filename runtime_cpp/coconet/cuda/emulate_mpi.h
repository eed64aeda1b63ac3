// coconet host emulation: streams, events and NCCL communicators over MPI (emulate.h includes every part, in order).
#pragma once

#include "emulate_kernels.h"

namespace coconet {
namespace cuda {
namespace emu {

// ---- MPI -------------------------------------------------------------------------------------------

COCONET_EMU bool mpi_init() {
  int ok = 0;
  MPI_Initialized(&ok);
  if (!ok) {
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
  }
  return true;
}
COCONET_EMU_VAR(const bool mpi_ready, = mpi_init())  // MPI is up when the module loads

COCONET_EMU void mpi_check(int rc, const char* what) {
  if (rc != MPI_SUCCESS) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    throw std::runtime_error(std::string("coconet emulate: ") + what + ": " + std::string(msg, size_t(len)));
  }
}

struct Comm {
  MPI_Comm mpi = MPI_COMM_NULL;
  int size = 1, rank = 0;
  uint64_t issued = 0, done = 0;  // calls run in the order they were issued
  std::atomic<bool> aborted{false};  // ncclCommAbort: its calls in flight stop waiting and fail
  std::atomic<int> async_error{0};  // what ncclCommGetAsyncError reports (injected_async_failure)
};

// The (MPI_COMM_WORLD) rank a fault-injection variable names, -1 for none; and whether it is this one.
COCONET_EMU int injected_rank(const char* env) {
  const char* e = std::getenv(env);
  return e && *e ? std::atoi(e) : -1;
}
COCONET_EMU bool is_this_world_rank(int r) {
  int me = 0;
  if (r >= 0) MPI_Comm_rank(MPI_COMM_WORLD, &me);
  return r >= 0 && me == r;
}

// COCONET_EMULATE_NCCL_FAIL_RANK=r: every NCCL call of (MPI_COMM_WORLD) rank r fails before it
// communicates, as an NCCL error would (the peers then wait for it until the communicator is
// aborted): for testing the abort path (tests/test_torch_optimizer_cuda.py).
COCONET_EMU void injected_failure(const char* call) {
  static const int fail = injected_rank("COCONET_EMULATE_NCCL_FAIL_RANK");
  if (is_this_world_rank(fail))
    throw std::runtime_error(std::string(call) + ": unhandled system error (injected by COCONET_EMULATE_NCCL_FAIL_RANK)");
}

// COCONET_EMULATE_NCCL_ASYNC_FAIL_RANK=r: the NCCL calls of (MPI_COMM_WORLD) rank r complete, but
// leave their communicator with an asynchronous error (ncclCommGetAsyncError: ncclRemoteError),
// as a connection that breaks after a collective went out would on a GPU, where the call has
// long returned: for testing the watchdog that polls for it (coconetc/runtime/cuda.py).
COCONET_EMU void injected_async_failure(Comm* comm) {
  static const int fail = injected_rank("COCONET_EMULATE_NCCL_ASYNC_FAIL_RANK");
  if (is_this_world_rank(fail)) comm->async_error.store(int(ncclRemoteError));
}

// COCONET_EMULATE_NCCL_HANG_RANK=r[:k]: the NCCL calls of (MPI_COMM_WORLD) rank r after its first k
// (default 0) never complete: the call blocks its stream, posting nothing (so the peers' calls wait
// for it too), until the communicator is aborted, as a GPU collective that a peer never joins (a
// rank stuck or gone) would: the work queued behind it never completes, cudaEventQuery reports it
// not ready, and ncclCommAbort ends it. For testing the watchdog that times each call's work with
// a CUDA event (coconetc/runtime/cuda.py).
COCONET_EMU void injected_hang(Comm* comm, const char* call) {
  static const int hang = injected_rank("COCONET_EMULATE_NCCL_HANG_RANK");
  static const long after = [] {
    const char* e = std::getenv("COCONET_EMULATE_NCCL_HANG_RANK");
    const char* colon = e ? std::strchr(e, ':') : nullptr;
    return colon ? std::atol(colon + 1) : 0L;
  }();
  static std::atomic<long> calls{0};
  if (!is_this_world_rank(hang) || calls.fetch_add(1) < after) return;
  while (!comm->aborted.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  throw std::runtime_error(std::string(call) + ": the communicator was aborted (ncclCommAbort) while the call hung "
                           "(injected by COCONET_EMULATE_NCCL_HANG_RANK)");
}

COCONET_EMU size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    default: return 8;
  }
}

template <class T, int OP>
void user_op(void* in, void* inout, int* len, MPI_Datatype*) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    auto x = to_compute(a[i]), y = to_compute(b[i]);
    decltype(x) r = OP == ncclProd ? x * y : OP == ncclMax ? (x < y ? y : x) : OP == ncclMin ? (y < x ? y : x) : x + y;
    b[i] = from_compute<T>(r);
  }
}
template <class T>
MPI_Op make_op(int op) {
  MPI_Op o;
  switch (op) {
    case ncclProd: MPI_Op_create(&user_op<T, ncclProd>, 1, &o); break;
    case ncclMax: MPI_Op_create(&user_op<T, ncclMax>, 1, &o); break;
    case ncclMin: MPI_Op_create(&user_op<T, ncclMin>, 1, &o); break;
    default: MPI_Op_create(&user_op<T, ncclSum>, 1, &o); break;
  }
  return o;
}
COCONET_EMU MPI_Datatype builtin_type(ncclDataType_t t) {
  switch (t) {
    case ncclFloat32: return MPI_FLOAT;
    case ncclFloat64: return MPI_DOUBLE;
    case ncclInt32: return MPI_INT32_T;
    case ncclInt64: return MPI_INT64_T;
    default: return MPI_DATATYPE_NULL;  // f16/bf16: bytes with user operations
  }
}
COCONET_EMU MPI_Datatype mpi_type(ncclDataType_t t) {
  if (builtin_type(t) != MPI_DATATYPE_NULL) return builtin_type(t);
  static std::mutex mu;
  static std::map<size_t, MPI_Datatype> types;
  std::lock_guard<std::mutex> lock(mu);
  auto it = types.find(type_size(t));
  if (it == types.end()) {
    MPI_Datatype d;
    MPI_Type_contiguous(int(type_size(t)), MPI_BYTE, &d);
    MPI_Type_commit(&d);
    it = types.emplace(type_size(t), d).first;
  }
  return it->second;
}
COCONET_EMU MPI_Op mpi_op(ncclDataType_t t, ncclRedOp_t op) {
  if (builtin_type(t) != MPI_DATATYPE_NULL)  // MPI's own reductions (ncclAvg: a sum, divided after)
    return op == ncclProd ? MPI_PROD : op == ncclMax ? MPI_MAX : op == ncclMin ? MPI_MIN : MPI_SUM;
  static std::mutex mu;
  static std::map<std::pair<int, int>, MPI_Op> ops;
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_pair(int(t), int(op));
  auto it = ops.find(key);
  if (it != ops.end()) return it->second;
  MPI_Op o;
  switch (t) {
    case ncclFloat16: o = make_op<half>(op); break;
    case ncclBfloat16: o = make_op<bfloat16>(op); break;
    case ncclFloat32: o = make_op<float>(op); break;
    case ncclFloat64: o = make_op<double>(op); break;
    case ncclInt32: o = make_op<int32_t>(op); break;
    case ncclInt64: o = make_op<int64_t>(op); break;
    default: throw std::runtime_error("coconet emulate: NCCL data type not emulated");
  }
  ops.emplace(key, o);
  return o;
}
template <class T>
void divide(void* p, size_t n, int by) {
  T* x = static_cast<T*>(p);
  for (size_t i = 0; i < n; ++i) x[i] = from_compute<T>(to_compute(x[i]) / static_cast<compute_t<T>>(by));
}
COCONET_EMU void average(ncclDataType_t t, void* p, size_t n, int by) {
  switch (t) {
    case ncclFloat16: divide<half>(p, n, by); break;
    case ncclBfloat16: divide<bfloat16>(p, n, by); break;
    case ncclFloat32: divide<float>(p, n, by); break;
    case ncclFloat64: divide<double>(p, n, by); break;
    case ncclInt32: divide<int32_t>(p, n, by); break;
    case ncclInt64: divide<int64_t>(p, n, by); break;
    default: break;
  }
}

// One NCCL call, run as nonblocking MPI on temporaries (so aliasing buffers are fine).
struct Call {
  enum Kind { AllReduce, Reduce, Broadcast, AllGather, ReduceScatter, Send, Recv } kind;
  const void* send;
  void* recv;
  size_t count;
  ncclDataType_t type;
  ncclRedOp_t op;
  int root;  // root or peer
  Comm* comm;
  std::vector<char> a, b;
};

COCONET_EMU const char* call_name(Call::Kind k) {
  static const char* names[] = {"ncclAllReduce", "ncclReduce", "ncclBroadcast", "ncclAllGather",
                                "ncclReduceScatter", "ncclSend", "ncclRecv"};
  return names[k];
}

COCONET_EMU void spans_of(const Call& c, std::vector<Span>& out) {
  const size_t el = type_size(c.type), n = c.count * el, R = size_t(c.comm->size);
  switch (c.kind) {
    case Call::AllReduce: out.push_back(bytes(c.send, n, false)); out.push_back(bytes(c.recv, n, true)); break;
    case Call::Reduce:
      out.push_back(bytes(c.send, n, false));
      if (c.comm->rank == c.root) out.push_back(bytes(c.recv, n, true));
      break;
    case Call::Broadcast:
      if (c.comm->rank == c.root) out.push_back(bytes(c.send, n, false));
      if (c.comm->rank != c.root || c.send != c.recv) out.push_back(bytes(c.recv, n, true));
      break;
    case Call::AllGather: out.push_back(bytes(c.send, n, false)); out.push_back(bytes(c.recv, n * R, true)); break;
    case Call::ReduceScatter: out.push_back(bytes(c.send, n * R, false)); out.push_back(bytes(c.recv, n, true)); break;
    case Call::Send: out.push_back(bytes(c.send, n, false)); break;
    case Call::Recv: out.push_back(bytes(c.recv, n, true)); break;
  }
}

COCONET_EMU void run_calls(std::vector<Call>& calls) {
  std::vector<MPI_Request> reqs;
  if (!calls.empty()) injected_failure(call_name(calls[0].kind));
  if (!calls.empty()) injected_hang(calls[0].comm, call_name(calls[0].kind));
  for (Call& c : calls) injected_async_failure(c.comm);
  for (Call& c : calls) {
    const size_t el = type_size(c.type), n = c.count * el, R = size_t(c.comm->size);
    const MPI_Datatype dt = mpi_type(c.type);
    const int cnt = int(c.count);
    MPI_Request rq = MPI_REQUEST_NULL;
    MPI_Comm m = c.comm->mpi;
    switch (c.kind) {
      case Call::AllReduce:
      case Call::Reduce:
        c.a.assign(static_cast<const char*>(c.send), static_cast<const char*>(c.send) + n);
        c.b.resize(n);
        if (c.kind == Call::AllReduce)
          mpi_check(MPI_Iallreduce(c.a.data(), c.b.data(), cnt, dt, mpi_op(c.type, c.op), m, &rq), "MPI_Iallreduce");
        else
          mpi_check(MPI_Ireduce(c.a.data(), c.b.data(), cnt, dt, mpi_op(c.type, c.op), c.root, m, &rq), "MPI_Ireduce");
        break;
      case Call::Broadcast:
        c.b.resize(n);
        if (c.comm->rank == c.root) std::memcpy(c.b.data(), c.send, n);
        mpi_check(MPI_Ibcast(c.b.data(), cnt, dt, c.root, m, &rq), "MPI_Ibcast");
        break;
      case Call::AllGather:
        c.a.assign(static_cast<const char*>(c.send), static_cast<const char*>(c.send) + n);
        c.b.resize(n * R);
        mpi_check(MPI_Iallgather(c.a.data(), cnt, dt, c.b.data(), cnt, dt, m, &rq), "MPI_Iallgather");
        break;
      case Call::ReduceScatter:
        c.a.assign(static_cast<const char*>(c.send), static_cast<const char*>(c.send) + n * R);
        c.b.resize(n);
        mpi_check(MPI_Ireduce_scatter_block(c.a.data(), c.b.data(), cnt, dt, mpi_op(c.type, c.op), m, &rq),
                  "MPI_Ireduce_scatter_block");
        break;
      case Call::Send:
        c.a.assign(static_cast<const char*>(c.send), static_cast<const char*>(c.send) + n);
        mpi_check(MPI_Isend(c.a.data(), cnt, dt, c.root, 7, m, &rq), "MPI_Isend");
        break;
      case Call::Recv:
        c.b.resize(n);
        mpi_check(MPI_Irecv(c.b.data(), cnt, dt, c.root, 7, m, &rq), "MPI_Irecv");
        break;
    }
    reqs.push_back(rq);
  }
  // polled, so that ncclCommAbort on another thread ends the wait (the requests are then left
  // behind with the communicator, which is unusable after an abort, as NCCL's)
  for (int flag = 0;;) {
    mpi_check(MPI_Testall(int(reqs.size()), reqs.data(), &flag, MPI_STATUSES_IGNORE), "MPI_Testall");
    if (flag) break;
    if (!calls.empty() && calls[0].comm->aborted.load())
      throw std::runtime_error(std::string(call_name(calls[0].kind)) + ": the communicator was aborted (ncclCommAbort)");
    std::this_thread::yield();
  }
  for (Call& c : calls) {
    const bool out = c.kind == Call::AllReduce || c.kind == Call::AllGather || c.kind == Call::ReduceScatter ||
                     c.kind == Call::Broadcast || c.kind == Call::Recv || (c.kind == Call::Reduce && c.comm->rank == c.root);
    if (!out) continue;
    if (c.op == ncclAvg && c.kind != Call::Broadcast && c.kind != Call::AllGather && c.kind != Call::Recv)
      average(c.type, c.b.data(), c.b.size() / type_size(c.type), c.comm->size);
    std::memcpy(c.recv, c.b.data(), c.b.size());
  }
}

struct GroupState {
  int depth = 0;
  std::vector<Call> calls;
  cudaStream_t stream = nullptr;
};
COCONET_EMU_VAR(thread_local GroupState group, )

COCONET_EMU void submit(std::vector<Call> calls, cudaStream_t cs) {
  if (calls.empty()) return;
  std::vector<Span> spans;
  std::string what;
  for (const Call& c : calls) {
    spans_of(c, spans);
    if (what.find(call_name(c.kind)) == std::string::npos) what += std::string(what.empty() ? "" : "/") + call_name(c.kind);
  }
  Comm* comm = calls[0].comm;
  State& st = state();
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    for (const Call& c : calls)
      if (c.comm != comm) throw std::runtime_error("coconet emulate: one NCCL group on several communicators");
    ticket = comm->issued++;
  }
  op(cs, std::move(spans), what, [calls = std::move(calls), comm, ticket]() mutable {
    State& st = state();
    {
      std::unique_lock<std::mutex> lock(st.mu);
      st.cv.wait(lock, [&] { return comm->done == ticket; });
    }
    try {
      run_calls(calls);
    } catch (...) {
      { std::lock_guard<std::mutex> lock(st.mu); comm->done += 1; }
      st.cv.notify_all();
      throw;
    }
    { std::lock_guard<std::mutex> lock(st.mu); comm->done += 1; }
    st.cv.notify_all();
  });
}

COCONET_EMU ncclResult_t nccl(Call c, cudaStream_t s) {
  if (!c.comm) return ncclInvalidArgument;
  if (group.depth > 0) {
    if (!group.calls.empty() && group.stream != s) throw std::runtime_error("coconet emulate: one NCCL group on several streams");
    group.stream = s;
    group.calls.push_back(std::move(c));
  } else {
    std::vector<Call> one;
    one.push_back(std::move(c));
    submit(std::move(one), s);
  }
  return ncclSuccess;
}

}  // namespace emu
}  // namespace cuda
}  // namespace coconet
