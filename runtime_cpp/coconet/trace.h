// coconet runtime: the trace of a call (coconetc/runtime/trace.py turns it into a
// Chrome-trace/Perfetto file per rank).
//
// Switched on by the Python side for the calls it traces (set_on); while it is off, a mark costs
// one relaxed atomic load. While it is on, every plan unit of a generated function records its
// start and end (Unit: the generated code marks each unit with its index in the plan), and the
// runtime records the pieces inside a unit (Span): each chunk of an overlap (its producer, the
// start of its communication, its consumer) or of a fused collective (its computation), and
// each wait for communication. Events go to one buffer per process, under a mutex, up to a
// limit (set_on's max_events: events past it are counted, not kept); the Python side takes them
// after each call (take). A CUDA module has the same state and buffer (one copy per module,
// state.h); its marks time the work queued on the GPU with CUDA events (cuda/trace.cuh) and are
// added here when the Python side takes the call's events.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <vector>

#include "state.h"

namespace coconet {
namespace trace {

struct Event {
  int32_t unit;      // the plan unit's index in its function (-1: outside any unit)
  int32_t chunk;     // the chunk of an overlap or a fused collective (-1: none)
  const char* what;  // nullptr: the unit itself; else the piece (a string literal)
  int64_t t0, t1;    // steady clock, nanoseconds
  int32_t thread;    // a small number per thread of the process
};

struct Buffer {
  std::mutex mu;
  std::vector<Event> events;
  int64_t max_events = 0;
  int64_t dropped = 0;
};

COCONET_STATE std::atomic<bool>& on_flag() COCONET_STATE_BODY({
  static std::atomic<bool> on{false};
  return on;
})
COCONET_STATE Buffer& buffer() COCONET_STATE_BODY({
  static Buffer b;
  return b;
})
COCONET_STATE int32_t& current_unit() COCONET_STATE_BODY({
  static thread_local int32_t u = -1;
  return u;
})
COCONET_STATE int32_t thread_number() COCONET_STATE_BODY({
  static std::atomic<int32_t> next{0};
  static thread_local int32_t mine = next.fetch_add(1);
  return mine;
})

inline bool on() { return on_flag().load(std::memory_order_relaxed); }

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

COCONET_LIBRARY void record(const Event& e) COCONET_LIBRARY_BODY({
  Buffer& b = buffer();
  std::lock_guard<std::mutex> lock(b.mu);
  if (static_cast<int64_t>(b.events.size()) < b.max_events)
    b.events.push_back(e);
  else
    ++b.dropped;
})

// Tracing on (keeping at most max_events until the next take) or off.
inline void set_on(bool on, int64_t max_events) {
  {
    std::lock_guard<std::mutex> lock(buffer().mu);
    buffer().max_events = max_events;
  }
  on_flag().store(on, std::memory_order_relaxed);
}

// The events recorded since the last take, and how many were dropped past the limit.
inline std::vector<Event> take(int64_t* dropped) {
  Buffer& b = buffer();
  std::lock_guard<std::mutex> lock(b.mu);
  std::vector<Event> out;
  out.swap(b.events);
  *dropped = b.dropped;
  b.dropped = 0;
  return out;
}

// A plan unit, from its mark to end() (the generated code calls end() after the unit's code;
// a unit that throws records nothing).
class Unit {
 public:
  explicit Unit(int32_t k) : k_(k), on_(on()) {
    if (on_) {
      prev_ = current_unit();
      current_unit() = k;
      t0_ = now_ns();
    }
  }
  void end() {
    if (!on_) return;
    record(Event{k_, -1, nullptr, t0_, now_ns(), thread_number()});
    current_unit() = prev_;
    on_ = false;
  }

 private:
  int32_t k_, prev_ = -1;
  bool on_;
  int64_t t0_ = 0;
};

// A piece of the current unit (a chunk's work, a wait), recorded when it goes out of scope.
class Span {
 public:
  explicit Span(const char* what, int64_t chunk = -1)
      : what_(what), chunk_(static_cast<int32_t>(chunk)), on_(on()) {
    if (on_) t0_ = now_ns();
  }
  ~Span() {
    if (on_) record(Event{current_unit(), chunk_, what_, t0_, now_ns(), thread_number()});
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  const char* what_;
  int32_t chunk_;
  bool on_;
  int64_t t0_ = 0;
};

}  // namespace trace
}  // namespace coconet
