// coconet CUDA runtime: the trace's marks on the GPU (runtime.cuh includes every part, in order).
//
// The trace's switch, its buffer of events and its limit are ../trace.h's, as for a CPU module
// (here, as every state of a CUDA module, one copy per module: state.h). A mark here times work
// queued on a stream: two CUDA events recorded on that stream around the work (cudaEventRecord),
// kept pending until the Python side takes the call's events (take: it waits for each pending
// end event, reads cudaEventElapsedTime and adds the event to ../trace.h's buffer). Times are
// placed on the host's steady clock from a reference event recorded on the stream of the first
// mark after the last take: the host time at which that event was queued, plus the GPU's time
// since it. Under the host emulation (emulate_cuda_api.h) the same code runs on the emulation's
// events, which hold the host's steady clock at the moment the stream's thread reaches them.
//
//   Unit:  a plan unit on the call's stream (the generated code marks each unit: its index in the
//          plan, then end()); every unit's work on other streams is joined back to that stream
//          before the unit ends, so the two events bracket all of it;
//   Piece: a piece of the current unit on one stream (an NCCL call, an overlap's chunk, a fused
//          collective's chunk), recorded when it goes out of scope.
//
// While tracing is off a mark costs one relaxed atomic load and records no event (so it adds no
// synchronization). The event of stream k (in the order this module's trace met them) has the
// track kStreamTrack + k (Event::thread; coconetc/runtime/trace.py names the tracks).
#pragma once

#include "core.cuh"
#include "../trace.h"

namespace coconet {
namespace cuda {
namespace trace {

using ::coconet::trace::current_unit;

constexpr int32_t kStreamTrack = 1000;  // Event::thread of the k-th stream: kStreamTrack + k

struct Pending {
  int32_t unit, chunk;
  const char* what;  // nullptr: the unit itself
  cudaEvent_t a, b;
  cudaStream_t stream;
};

struct Marks {
  std::mutex mu;
  std::vector<Pending> pending;
  std::vector<cudaEvent_t> spare;     // events of earlier calls, recorded again
  std::vector<cudaStream_t> streams;  // the tracks' streams, in the order met
  cudaEvent_t ref = nullptr;          // the reference of the pending marks (nullptr: none yet)
  int64_t ref_ns = 0;                 // the host time it was queued
};

COCONET_STATE Marks& marks() COCONET_STATE_BODY({
  static Marks m;
  return m;
})

// An event (the caller holds marks().mu).
COCONET_EMU cudaEvent_t spare_event(Marks& m) {
  if (!m.spare.empty()) {
    cudaEvent_t e = m.spare.back();
    m.spare.pop_back();
    return e;
  }
  cudaEvent_t e;
  COCONET_CUDA(cudaEventCreate(&e));  // with timing (the runtime's own events have none)
  return e;
}

// An event recorded on s now (the call's reference first, if none yet).
COCONET_EMU cudaEvent_t start(cudaStream_t s) {
  Marks& m = marks();
  std::lock_guard<std::mutex> lock(m.mu);
  if (!m.ref) {
    m.ref = spare_event(m);
    m.ref_ns = ::coconet::trace::now_ns();
    COCONET_CUDA(cudaEventRecord(m.ref, s));
  }
  cudaEvent_t e = spare_event(m);
  COCONET_CUDA(cudaEventRecord(e, s));
  return e;
}

// The mark begun with event a ends now on s: pending until take, or dropped past the trace's limit.
// Never throws (a Piece ends in its destructor): a failed record drops the mark.
COCONET_EMU void finish(int32_t unit, int32_t chunk, const char* what, cudaEvent_t a, cudaStream_t s) noexcept {
  Marks& m = marks();
  std::lock_guard<std::mutex> lock(m.mu);
  ::coconet::trace::Buffer& buf = ::coconet::trace::buffer();
  bool room;
  {
    std::lock_guard<std::mutex> block(buf.mu);
    room = static_cast<int64_t>(buf.events.size() + m.pending.size()) < buf.max_events;
    if (!room) ++buf.dropped;
  }
  cudaEvent_t b = nullptr;
  if (room) {
    try {
      b = spare_event(m);
    } catch (...) {
      b = nullptr;
    }
  }
  if (b && cudaEventRecord(b, s) == cudaSuccess) {
    m.pending.push_back(Pending{unit, chunk, what, a, b, s});
    return;
  }
  if (b) m.spare.push_back(b);
  m.spare.push_back(a);
}

// The pending marks, each waited for and added to ../trace.h's buffer (the Python side calls this
// after a traced call, before trace::take). Never throws: a mark whose events cannot be read (a
// call that failed on the GPU) is left out, so that the call's own error is the one raised.
COCONET_EMU void resolve() noexcept {
  Marks& m = marks();
  std::lock_guard<std::mutex> lock(m.mu);
  for (const Pending& p : m.pending) {
    float ta = 0, tb = 0;
    if (cudaEventSynchronize(p.b) != cudaSuccess || cudaEventElapsedTime(&ta, m.ref, p.a) != cudaSuccess ||
        cudaEventElapsedTime(&tb, m.ref, p.b) != cudaSuccess)
      continue;  // (its events are not used again)
    auto it = std::find(m.streams.begin(), m.streams.end(), p.stream);
    if (it == m.streams.end()) it = m.streams.insert(m.streams.end(), p.stream);
    const int32_t track = kStreamTrack + static_cast<int32_t>(it - m.streams.begin());
    ::coconet::trace::record(::coconet::trace::Event{p.unit, p.chunk, p.what, m.ref_ns + int64_t(double(ta) * 1e6),
                                                     m.ref_ns + int64_t(double(tb) * 1e6), track});
    m.spare.push_back(p.a);
    m.spare.push_back(p.b);
  }
  m.pending.clear();
  if (m.ref) m.spare.push_back(m.ref);
  m.ref = nullptr;
}

// A plan unit on the call's stream, from its mark to end() (a unit that throws records nothing).
class Unit {
 public:
  Unit(int32_t k, cudaStream_t s) : k_(k), s_(s), on_(::coconet::trace::on()) {
    if (on_) {
      a_ = start(s);
      prev_ = current_unit();
      current_unit() = k;
    }
  }
  void end() {
    if (!on_) return;
    finish(k_, -1, nullptr, a_, s_);
    current_unit() = prev_;
    on_ = false;
  }

 private:
  int32_t k_, prev_ = -1;
  cudaStream_t s_;
  bool on_;
  cudaEvent_t a_ = nullptr;
};

// A piece of the current unit: the work queued on stream s while it is in scope.
class Piece {
 public:
  Piece(const char* what, int64_t chunk, cudaStream_t s)
      : what_(what), chunk_(static_cast<int32_t>(chunk)), s_(s), on_(::coconet::trace::on()) {
    if (on_) a_ = start(s);
  }
  ~Piece() {
    if (on_) finish(current_unit(), chunk_, what_, a_, s_);
  }
  Piece(const Piece&) = delete;
  Piece& operator=(const Piece&) = delete;

 private:
  const char* what_;
  int32_t chunk_;
  cudaStream_t s_;
  bool on_;
  cudaEvent_t a_ = nullptr;
};

}  // namespace trace
}  // namespace cuda
}  // namespace coconet
