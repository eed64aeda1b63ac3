// coconet runtime: `overlap(producer, consumer, chunks=k)` in a schedule.
//
// The producer (e.g. a matmul) is computed chunk by chunk (chunk i of k along some dim, split
// with the language's partition rule: slices.h slice_range); right after chunk i is produced, the
// consumer's communication for that chunk starts as a non-blocking Task (MPI_Iallreduce,
// MPI_Ireduce_scatter, MPI_Iallgatherv, or a fused collective of fused.h), and every
// outstanding task is tested (MPI_Testall, which drives MPI's progress engine) before the next
// chunk is produced, so chunk i's communication runs while chunk i+1 is computed.  At the end
// the tasks are waited for in the order they were started.
//
// Each chunk's task gets its own channel (a private communicator of the group, Comm::channel),
// because a fused task posts messages while being tested, in an order that depends on timing;
// on separate communicators nothing can cross-match.  Waiting in start order cannot deadlock:
// a rank blocks only on its earliest unfinished task, and every rank that has moved past a
// task has posted all of that task's messages.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "collectives.h"
#include "comm.h"
#include "dtypes.h"
#include "errors.h"
#include "fused.h"
#include "reduce_ops.h"
#include "segments.h"
#include "slices.h"
#include "trace.h"

namespace coconet {

// Communication in flight: test() progresses it without blocking (true when done), wait()
// finishes it.
struct Task {
  virtual ~Task() = default;
  virtual bool test() = 0;
  virtual void wait() = 0;
};

// A Task made of MPI requests, the buffers and count arrays they use, and a finishing step
// (unpacking, avg's division) run once when the requests complete.
class RequestTask : public Task {
 public:
  std::vector<MPI_Request> reqs;
  std::vector<std::vector<char>> buffers;
  std::vector<std::vector<int>> arrays;
  std::function<void()> on_done;

  bool test() override { return test_all(reqs) && finish(); }
  void wait() override {
    wait_all(reqs);
    finish();
  }

  // A buffer of n elements of T owned by the task.
  template <class T>
  T* buffer(int64_t n) {
    buffers.emplace_back(static_cast<size_t>(n) * sizeof(T));
    return reinterpret_cast<T*>(buffers.back().data());
  }

  // An int array owned by the task (counts and displacements must outlive the operation).
  int* array(std::vector<int> v) {
    arrays.push_back(std::move(v));
    return arrays.back().data();
  }

 private:
  bool done_ = false;
  bool finish() {
    if (!done_ && on_done) on_done();
    done_ = true;
    return true;
  }
};

// Wraps a fused operation (anything with test() and wait()) as a Task.
template <class F>
struct OpTask : Task {
  F op;
  template <class... A>
  explicit OpTask(A&&... a) : op(std::forward<A>(a)...) {}
  bool test() override { return op.test(); }
  void wait() override { op.wait(); }
};

// ---- non-blocking collectives as tasks ---------------------------------------------------------

// Non-blocking allreduce (out = in reduced; in == out allowed) on a channel.
template <class T>
std::unique_ptr<Task> start_allreduce(Op op, const T* in, T* out, int64_t count, Comm& comm,
                                      int channel) {
  auto t = std::make_unique<RequestTask>();
  t->reqs.emplace_back();
  COCONET_MPI(MPI_Iallreduce(send_or_in_place(in, out), out, mpi_count(count, "allreduce"),
                             mpi_type<T>(), mpi_op<T>(op), comm.channel(channel),
                             &t->reqs.back()));
  int size = comm.size;
  t->on_done = [=] { finish_avg(op, out, count, size); };
  return t;
}

// Non-blocking reduce_scatter of [outer, n, inner] (outer > 1 packs rank-major first).
template <class T>
std::unique_ptr<Task> start_reduce_scatter(Op op, const T* in, T* out_slice, int64_t outer,
                                           int64_t n, int64_t inner, Comm& comm, int channel) {
  auto t = std::make_unique<RequestTask>();
  Shape3 s{outer, n, inner};
  std::vector<int64_t> c64 = slice_elems(s, comm.size, outer);
  int* counts = t->array(int_counts(c64, "reduce_scatter"));
  const T* src = in;
  if (outer > 1) {
    T* packed = t->buffer<T>(s.total());
    pack_by_rank(in, packed, s, comm.size, 0, outer);
    src = packed;
  }
  t->reqs.emplace_back();
  COCONET_MPI(MPI_Ireduce_scatter(src, out_slice, counts, mpi_type<T>(), mpi_op<T>(op),
                                  comm.channel(channel), &t->reqs.back()));
  int64_t mine = c64[static_cast<size_t>(comm.rank)];
  int size = comm.size;
  t->on_done = [=] { finish_avg(op, out_slice, mine, size); };
  return t;
}

// Non-blocking allgather of [outer, n, inner] slices (outer > 1 unpacks when done).
template <class T>
std::unique_ptr<Task> start_allgather(const T* in_slice, T* out, int64_t outer, int64_t n,
                                      int64_t inner, Comm& comm, int channel) {
  auto t = std::make_unique<RequestTask>();
  Shape3 s{outer, n, inner};
  std::vector<int64_t> c64 = slice_elems(s, comm.size, outer);
  int* counts = t->array(int_counts(c64, "allgather"));
  int* displs = t->array(int_counts(prefix(c64), "allgather"));
  T* dst = outer > 1 ? t->buffer<T>(s.total()) : out;
  t->reqs.emplace_back();
  COCONET_MPI(MPI_Iallgatherv(in_slice, counts[comm.rank], mpi_type<T>(), dst, counts, displs,
                              mpi_type<T>(), comm.channel(channel), &t->reqs.back()));
  int size = comm.size;
  if (outer > 1) t->on_done = [=] { unpack_by_rank(dst, out, s, size, 0, outer); };
  return t;
}

// Non-blocking broadcast: out on every rank = root's in (count elements; in == out allowed).
template <class T>
std::unique_ptr<Task> start_broadcast(const T* in, T* out, int64_t count, int root, Comm& comm,
                                      int channel) {
  if (comm.rank == root && in != out)
    std::memcpy(out, in, static_cast<size_t>(count) * sizeof(T));
  auto t = std::make_unique<RequestTask>();
  t->reqs.emplace_back();
  COCONET_MPI(MPI_Ibcast(out, mpi_count(count, "broadcast"), mpi_type<T>(), root,
                         comm.channel(channel), &t->reqs.back()));
  return t;
}

// Non-blocking allgather of piece i of k of every rank's slice of dim 0 of [n, inner] (rows of
// this rank's slice in_slice) straight into their places in out (slices.h piece_range).
template <class T>
std::unique_ptr<Task> start_allgather_pieces(const T* in_slice, T* out, int64_t n, int64_t inner,
                                             int k, int i, Comm& comm, int channel) {
  auto t = std::make_unique<RequestTask>();
  std::vector<int64_t> c64(static_cast<size_t>(comm.size)), d64(c64.size());
  for (int q = 0; q < comm.size; ++q) {
    const Range p = piece_range(n, comm.size, q, k, i);
    c64[static_cast<size_t>(q)] = p.size() * inner;
    d64[static_cast<size_t>(q)] = p.begin * inner;
  }
  int* counts = t->array(int_counts(c64, "allgather"));
  int* displs = t->array(int_counts(d64, "allgather"));
  const Range mine = slice_range(slice_range(n, comm.size, comm.rank).size(), k, i);
  t->reqs.emplace_back();
  COCONET_MPI(MPI_Iallgatherv(in_slice + mine.begin * inner, counts[comm.rank], mpi_type<T>(), out,
                              counts, displs, mpi_type<T>(), comm.channel(channel),
                              &t->reqs.back()));
  return t;
}

// A fused reduce-scatter + compute + all-gather (fused.h) as a task; compute runs in pieces of
// progress_elems (whole rows where the computation has a row-wise phase: the plan's
// Chunking.progress_rows, as for the blocking call).
template <class T, class Compute>
std::unique_ptr<Task> start_fused_rs_compute_ag(Op op, const Segments<const T>& in, Shape3 shape,
                                                Comm& comm, int channel, int64_t chunk_elems,
                                                Compute compute,
                                                std::vector<GatherTarget> gathers,
                                                int64_t progress_elems = kProgressElems) {
  return std::make_unique<OpTask<FusedRsComputeAg<T, Compute>>>(
      op, in, shape, comm, channel, chunk_elems, std::move(compute), std::move(gathers),
      progress_elems);
}

// A fused allreduce + compute (fused.h) as a task (progress_elems: as above).
template <class T, class Compute>
std::unique_ptr<Task> start_fused_allreduce_compute(Op op, const Segments<const T>& in,
                                                    Comm& comm, int channel,
                                                    int64_t chunk_elems, Compute compute,
                                                    int64_t progress_elems = kProgressElems) {
  return std::make_unique<OpTask<FusedAllreduceCompute<T, Compute>>>(op, in, comm, channel,
                                                                     chunk_elems,
                                                                     std::move(compute),
                                                                     progress_elems);
}

// ---- chunks along any dim: packed for their collective, unpacked into place ------------------

// Block r of dim n of a tensor viewed as [outer, n, inner] <-> a dense [outer, |r|, inner].
template <class T>
void pack_block(const T* src, T* dst, int64_t outer, int64_t n, int64_t inner, Range r) {
  const int64_t run = r.size() * inner;
  for (int64_t o = 0; o < outer; ++o)
    std::memcpy(dst + o * run, src + (o * n + r.begin) * inner, static_cast<size_t>(run) * sizeof(T));
}

template <class T>
void unpack_block(const T* src, T* dst, int64_t outer, int64_t n, int64_t inner, Range r) {
  const int64_t run = r.size() * inner;
  for (int64_t o = 0; o < outer; ++o)
    std::memcpy(dst + (o * n + r.begin) * inner, src + o * run, static_cast<size_t>(run) * sizeof(T));
}

// The packed input and output buffers of every chunk of an overlap along a dim other than 0.
template <class T>
class PackedChunks {
 public:
  PackedChunks(int chunks, int64_t outer, int64_t n, int64_t inner)
      : chunks_(chunks), outer_(outer), n_(n), inner_(inner), in_(chunks), out_(chunks) {}
  T* in(int i) {
    auto& b = in_[static_cast<size_t>(i)];
    b.resize(static_cast<size_t>(outer_ * slice_range(n_, chunks_, i).size() * inner_));
    return b.data();
  }
  T* out(int i, int64_t count) {
    auto& b = out_[static_cast<size_t>(i)];
    b.resize(static_cast<size_t>(count));
    return b.data();
  }

 private:
  int chunks_;
  int64_t outer_, n_, inner_;
  std::vector<std::vector<T>> in_, out_;
};

// A task whose packed result is unpacked into block r of dst ([outer, n, inner]) when done.
template <class T>
struct UnpackTask : Task {
  std::unique_ptr<Task> inner_task;
  const T* packed;
  T* dst;
  int64_t outer, n, inner;
  Range r;
  bool done = false;
  void finish() {
    if (!done) unpack_block(packed, dst, outer, n, inner, r);
    done = true;
  }
  bool test() override {
    if (!done && inner_task->test()) finish();
    return done;
  }
  void wait() override {
    inner_task->wait();
    finish();
  }
};

template <class T>
std::unique_ptr<Task> then_unpack(std::unique_ptr<Task> t, const T* packed, T* dst, int64_t outer,
                                  int64_t n, int64_t inner, Range r) {
  auto u = std::make_unique<UnpackTask<T>>();
  u->inner_task = std::move(t);
  u->packed = packed;
  u->dst = dst;
  u->outer = outer;
  u->n = n;
  u->inner = inner;
  u->r = r;
  return u;
}

// ---- the overlap driver ----------------------------------------------------------------------

// Row blocks (GEMM calls) per chunk of an overlapped matmul, with the tasks in flight tested
// between them (gemm.h gemm_steps).
constexpr int kOverlapSteps = 4;

// Tasks in flight, tested in start order and waited for in start order.
class Overlap {
 public:
  void add(std::unique_ptr<Task> t) { tasks_.push_back(std::move(t)); }

  // One non-blocking pass over the unfinished tasks.
  void progress() {
    for (size_t i = first_; i < tasks_.size(); ++i) {
      bool done = tasks_[i]->test();
      if (done && i == first_) ++first_;
    }
  }

  // Finishes the tasks up to and including task i, oldest first.
  void wait_through(size_t i) {
    for (; first_ <= i && first_ < tasks_.size(); ++first_) wait(first_);
  }

  // Finishes every task, oldest first.
  void wait_all() {
    for (; first_ < tasks_.size(); ++first_) wait(first_);
  }

 private:
  void wait(size_t i) {
    trace::Span span("overlap: wait for the chunk's communication", static_cast<int64_t>(i));
    tasks_[i]->wait();
  }

  std::vector<std::unique_ptr<Task>> tasks_;
  size_t first_ = 0;  // tasks before this are done
};

// Chunk i's communication, started (traced as the chunk's start).
template <class Start>
std::unique_ptr<Task> started(Start& start, int i) {
  trace::Span span("overlap: start the chunk's communication", i);
  return start(i, i + 1);
}

// Chunk i consumed (its GEMM), an error in it ending the job.
template <class Consume>
void consumed(Consume& consume, int i, Overlap& ov) {
  abort_on_exception("overlap consumer", [&] {
    trace::Span span("overlap: consume the chunk", i);
    consume(i, ov);
  });
}

// overlap(producer, consumer, chunks=k): for i in 0..k-1, produce(i) (compute chunk i), then
// start(i, channel) returns chunk i's communication as a Task (channel: pass it to the
// start_* function); outstanding tasks are tested between chunks and waited for at the end.
//
// A producer that takes (int i, Overlap& ov) may call ov.progress() while it computes (the
// generated matmul does, between row blocks: gemm.h gemm_steps), so the communication of
// earlier chunks advances during a chunk's GEMM from this same thread (no progress thread
// competing with the GEMM for a core).
template <class Produce, class Start>
void overlap(int chunks, Produce produce, Start start) {
  Overlap ov;
  for (int i = 0; i < chunks; ++i) {
    abort_on_exception("overlap producer", [&] {
      trace::Span span("overlap: produce the chunk", i);
      if constexpr (std::is_invocable_v<Produce&, int, Overlap&>)
        produce(i, ov);
      else
        produce(i);
    });
    ov.add(started(start, i));
    ov.progress();
  }
  ov.wait_all();
}

// overlap(y, f) and overlap(g, z) with g gathered by the fused collective f (a matmul, its fused
// reduce-scatter + compute + all-gather, and the matmul that reads the gathered value, all in the
// same blocks of rows): produce(i) and start(i, channel) as overlap() does; chunk i-1's task is
// waited for after chunk i's is started, and consume(i - 1, ov) multiplies its rows while chunk
// i's task is in flight (tested between its row blocks), so each block's GEMM, communication
// and consuming GEMM run in a pipeline.
template <class Produce, class Start, class Consume>
void overlap_through(int chunks, Produce produce, Start start, Consume consume) {
  Overlap ov;
  for (int i = 0; i < chunks; ++i) {
    abort_on_exception("overlap producer", [&] {
      trace::Span span("overlap: produce the chunk", i);
      produce(i, ov);
    });
    ov.add(started(start, i));
    ov.progress();
    if (i > 0) {
      ov.wait_through(static_cast<size_t>(i - 1));
      consumed(consume, i - 1, ov);
    }
  }
  if (chunks > 0) {
    ov.wait_through(static_cast<size_t>(chunks - 1));
    consumed(consume, chunks - 1, ov);
  }
  ov.wait_all();
}

// overlap(g, y) the other way (a collective's result consumed chunk by chunk: all-gather-matmul):
// start(i, channel) returns chunk i's communication as a Task; chunk i+1's is started before
// chunk i is waited for, and consume(i, ov) (chunk i's GEMM) runs as soon as chunk i has
// arrived, testing the next chunk's task between its row blocks (ov.progress()), so chunk i+1
// arrives while chunk i is multiplied.
template <class Start, class Consume>
void overlap_into(int chunks, Start start, Consume consume) {
  Overlap ov;
  if (chunks > 0) ov.add(started(start, 0));
  for (int i = 0; i < chunks; ++i) {
    if (i + 1 < chunks) ov.add(started(start, i + 1));
    ov.wait_through(static_cast<size_t>(i));
    consumed(consume, i, ov);
  }
  ov.wait_all();
}

}  // namespace coconet
