// coconet host emulation: byte ranges, buffers and the happens-before relation of queued work (the race detection) (emulate.h includes every part, in order).
#pragma once

#include "emulate_types.h"

namespace coconet {
namespace cuda {
namespace emu {

// ---- byte ranges, buffers and the happens-before relation --------------------------------------

struct Span {
  uintptr_t lo = 0, hi = 0;
  bool write = false;
  bool whole = false;  // the whole buffer that contains lo
};
template <class T> Span R(const T* p, int64_t lo, int64_t hi) {
  return Span{uintptr_t(p + lo), uintptr_t(p + (hi > lo ? hi : lo)), false, false};
}
template <class T> Span W(const T* p, int64_t lo, int64_t hi) {
  return Span{uintptr_t(p + lo), uintptr_t(p + (hi > lo ? hi : lo)), true, false};
}
template <class T> Span RA(const T* p) { return Span{uintptr_t(p), uintptr_t(p) + 1, false, true}; }
COCONET_EMU Span bytes(const void* p, size_t n, bool write) {
  return Span{uintptr_t(p), uintptr_t(p) + n, write, false};
}
// rows x cols elements of `el` bytes, `ld` elements apart
COCONET_EMU void strided(std::vector<Span>& out, const void* p, int64_t rows, int64_t cols, int64_t ld, size_t el,
                    bool write) {
  if (rows <= 0 || cols <= 0) return;
  if (ld == cols || rows == 1) {
    out.push_back(bytes(p, size_t(rows * cols) * el, write));
    return;
  }
  for (int64_t r = 0; r < rows; ++r) out.push_back(bytes(static_cast<const char*>(p) + size_t(r * ld) * el, size_t(cols) * el, write));
}

using Clock = std::vector<uint64_t>;
COCONET_EMU uint64_t at(const Clock& c, int s) { return size_t(s) < c.size() ? c[size_t(s)] : 0; }
COCONET_EMU void merge(Clock& a, const Clock& b) {
  if (a.size() < b.size()) a.resize(b.size(), 0);
  for (size_t k = 0; k < b.size(); ++k) a[k] = std::max(a[k], b[k]);
}

struct Record {
  uintptr_t lo, hi;
  int stream;
  uint64_t seq;
  bool write;
  std::string what;
};
struct Region {
  uintptr_t end;
  std::string name;
  std::vector<Record> records;
};

class RaceError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Task {
  std::function<void()> fn;
};

struct Stream {
  int id = 0;
  std::string name;
  // execution
  std::deque<Task> queue;
  uint64_t enqueued = 0, completed = 0;
  std::thread worker;
  bool stop = false;
  std::string error;
  // detection
  Clock clock;
};

struct Event {
  Stream* stream = nullptr;
  uint64_t position = 0;  // done when stream->completed >= position
  Clock clock;
  bool recorded = false;
  std::atomic<double> at{0};  // when its stream reached it (seconds; cudaEventElapsedTime)
};

struct State {
  std::mutex mu;  // execution: queues and counters
  std::condition_variable cv;
  std::vector<Stream*> streams;
  std::recursive_mutex det;  // detection: clocks and buffers (host threads only)
  Clock host;
  std::map<uintptr_t, Region> regions;
  std::vector<Span> pending;  // COCONET_ACCESS before the next kernel launch
  bool pending_set = false;
  int allocs = 0;
};
COCONET_EMU State& state() {
  static State* s = new State();  // never destroyed: worker threads may outlive static teardown
  return *s;
}

COCONET_EMU void worker_loop(Stream* s) {
  State& st = state();
  for (;;) {
    Task t;
    {
      std::unique_lock<std::mutex> lock(st.mu);
      st.cv.wait(lock, [&] { return s->stop || !s->queue.empty(); });
      if (s->queue.empty()) return;
      t = std::move(s->queue.front());
      s->queue.pop_front();
    }
    try {
      t.fn();
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(st.mu);
      if (s->error.empty()) s->error = e.what();
    }
    {
      std::lock_guard<std::mutex> lock(st.mu);
      s->completed += 1;
    }
    st.cv.notify_all();
  }
}

COCONET_EMU Stream* make_stream(const std::string& name) {
  State& st = state();
  Stream* s = new Stream();
  {
    std::lock_guard<std::recursive_mutex> d(st.det);
    std::lock_guard<std::mutex> lock(st.mu);
    s->id = int(st.streams.size());
    s->name = name.empty() ? "stream #" + std::to_string(s->id) : name;
    st.streams.push_back(s);
    s->clock = st.host;
  }
  s->worker = std::thread(worker_loop, s);
  s->worker.detach();
  return s;
}
COCONET_EMU Stream* get(cudaStream_t s) {
  static Stream* legacy = make_stream("the call's stream (default stream)");
  return s ? s : legacy;
}

COCONET_EMU void name_stream(cudaStream_t s, const std::string& name) {
  State& st = state();
  Stream* x = get(s);
  std::lock_guard<std::mutex> lock(st.mu);
  x->name = name + " (stream #" + std::to_string(x->id) + ")";
}

COCONET_EMU std::string describe_stream(int id) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  return size_t(id) < st.streams.size() ? st.streams[size_t(id)]->name : "stream #" + std::to_string(id);
}

// A buffer the generated code knows by name (parameters, outputs, scratch): accesses inside it
// are checked. Registering a range drops what was registered over it before.
COCONET_EMU void name_buffer(const void* p, size_t n, const std::string& name) {
  State& st = state();
  std::lock_guard<std::recursive_mutex> d(st.det);
  uintptr_t lo = uintptr_t(p), hi = lo + (n ? n : 1);
  auto it = st.regions.find(lo);
  if (it != st.regions.end() && it->second.end == hi) {
    it->second.name = name;
    return;
  }
  for (auto r = st.regions.begin(); r != st.regions.end();) {
    if (r->first < hi && lo < r->second.end) r = st.regions.erase(r);
    else ++r;
  }
  st.regions[lo] = Region{hi, name, {}};
}
COCONET_EMU void access(Stream* s, std::vector<Span> spans, const std::string& what);
// A parameter or output of the call: named, and written on the call's stream before the call
// (what the caller queued there produced it), so the call's other streams must wait for it.
COCONET_EMU void caller_buffer(const void* p, size_t n, const std::string& name, cudaStream_t s) {
  name_buffer(p, n, name);
  access(get(s), {bytes(p, n ? n : 1, true)}, "the caller's work before the call");
}
COCONET_EMU void forget_buffer(const void* p) {
  State& st = state();
  std::lock_guard<std::recursive_mutex> d(st.det);
  st.regions.erase(uintptr_t(p));
}
COCONET_EMU Region* region_of(uintptr_t a) {
  State& st = state();
  auto it = st.regions.upper_bound(a);
  if (it == st.regions.begin()) return nullptr;
  --it;
  return a < it->second.end ? &it->second : nullptr;
}

// One operation queued on s: advance s's clock and check its accesses against every unordered
// access of another stream; throws RaceError naming the buffer and both streams.
COCONET_EMU void access(Stream* s, std::vector<Span> spans, const std::string& what) {
  State& st = state();
  std::lock_guard<std::recursive_mutex> d(st.det);
  merge(s->clock, st.host);
  if (s->clock.size() <= size_t(s->id)) s->clock.resize(size_t(s->id) + 1, 0);
  const uint64_t seq = ++s->clock[size_t(s->id)];
  for (Span sp : spans) {
    if (sp.hi <= sp.lo && !sp.whole) continue;
    Region* reg = region_of(sp.lo);
    if (!reg) continue;  // not a buffer of the call (untracked)
    uintptr_t base = 0;
    for (auto& kv : st.regions)
      if (&kv.second == reg) base = kv.first;
    if (sp.whole) sp.lo = base, sp.hi = reg->end;
    sp.hi = std::min(sp.hi, reg->end);
    for (const Record& r : reg->records) {
      if (r.hi <= sp.lo || sp.hi <= r.lo) continue;
      if (r.stream == s->id || at(s->clock, r.stream) >= r.seq) continue;
      if (!r.write && !sp.write) continue;
      std::ostringstream m;
      m << "coconet emulate: race on buffer '" << reg->name << "' (bytes [" << std::max(r.lo, sp.lo) - base << ", "
        << std::min(r.hi, sp.hi) - base << ") of " << reg->end - base << "): " << what << " on "
        << s->name << " " << (sp.write ? "writes" : "reads") << " it, but " << r.what << " on "
        << describe_stream(r.stream) << " " << (r.write ? "writes" : "reads")
        << " it and no event orders the two (a cudaStreamWaitEvent is missing)";
      throw RaceError(m.str());
    }
    if (sp.write) {
      auto& rs = reg->records;
      rs.erase(std::remove_if(rs.begin(), rs.end(), [&](const Record& r) { return sp.lo <= r.lo && r.hi <= sp.hi; }),
               rs.end());
    }
    reg->records.push_back(Record{sp.lo, sp.hi, s->id, seq, sp.write, what});
  }
}

// The end of a call on stream s: everything the call did on other streams must be ordered
// before it (the caller may use every buffer on s right after).
COCONET_EMU void call_end(cudaStream_t cs) {
  State& st = state();
  Stream* s = get(cs);
  std::lock_guard<std::recursive_mutex> d(st.det);
  merge(s->clock, st.host);
  for (auto& kv : st.regions)
    for (const Record& r : kv.second.records)
      if (r.stream != s->id && at(s->clock, r.stream) < r.seq) {
        std::ostringstream m;
        m << "coconet emulate: race on buffer '" << kv.second.name << "': " << r.what << " on "
          << describe_stream(r.stream) << " " << (r.write ? "writes" : "reads") << " it, but the end of the call on "
          << s->name << " is not ordered after it (a cudaStreamWaitEvent is missing)";
        throw RaceError(m.str());
      }
}

COCONET_EMU void enqueue(Stream* s, std::function<void()> fn) {
  State& st = state();
  {
    std::lock_guard<std::mutex> lock(st.mu);
    s->queue.push_back(Task{std::move(fn)});
    s->enqueued += 1;
  }
  st.cv.notify_all();
}

COCONET_EMU void op(cudaStream_t cs, std::vector<Span> spans, const std::string& what, std::function<void()> fn) {
  Stream* s = get(cs);
  access(s, std::move(spans), what);
  enqueue(s, std::move(fn));
}

COCONET_EMU void sync_stream(Stream* s) {
  State& st = state();
  std::string err;
  {
    std::unique_lock<std::mutex> lock(st.mu);
    const uint64_t want = s->enqueued;
    st.cv.wait(lock, [&] { return s->completed >= want; });
    err.swap(s->error);
  }
  {
    std::lock_guard<std::recursive_mutex> d(st.det);
    merge(st.host, s->clock);
  }
  if (!err.empty()) throw std::runtime_error("coconet emulate: " + s->name + ": " + err);
}

COCONET_EMU void sync_all() {
  State& st = state();
  get(nullptr);
  std::vector<Stream*> all;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    all = st.streams;
  }
  for (Stream* s : all) sync_stream(s);
  std::lock_guard<std::recursive_mutex> d(st.det);
  for (auto& kv : st.regions) kv.second.records.clear();  // everything is ordered before the host now
}

}  // namespace emu
}  // namespace cuda
}  // namespace coconet
