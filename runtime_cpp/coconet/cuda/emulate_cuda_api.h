// coconet host emulation: the CUDA runtime API (emulate.h includes every part, in order).
#pragma once

#include "emulate_mpi.h"

// ---- the CUDA runtime API ----------------------------------------------------------------------------

COCONET_EMU const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaSuccess ? "no error" : e == cudaErrorNotReady ? "device not ready" : "emulation error";
}
COCONET_EMU cudaError_t cudaGetLastError() { return cudaSuccess; }
COCONET_EMU cudaError_t cudaGetDevice(int* d) { *d = 0; return cudaSuccess; }
COCONET_EMU cudaError_t cudaSetDevice(int) { return cudaSuccess; }
COCONET_EMU cudaError_t cudaMalloc(void** p, size_t n) {
  namespace e = coconet::cuda::emu;
  *p = std::calloc(n ? n : 1, 1);
  if (!*p) return cudaErrorUnknown;
  e::name_buffer(*p, n, "device allocation #" + std::to_string(++e::state().allocs));
  return cudaSuccess;
}
template <class T> cudaError_t cudaMalloc(T** p, size_t n) { return cudaMalloc(reinterpret_cast<void**>(p), n); }
COCONET_EMU cudaError_t cudaFree(void* p) {
  coconet::cuda::emu::sync_all();
  coconet::cuda::emu::forget_buffer(p);
  std::free(p);
  return cudaSuccess;
}
COCONET_EMU cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  *s = coconet::cuda::emu::make_stream("");
  return cudaSuccess;
}
COCONET_EMU cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, 0); }
COCONET_EMU cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  coconet::cuda::emu::sync_stream(coconet::cuda::emu::get(s));
  return cudaSuccess;
}
COCONET_EMU cudaError_t cudaDeviceSynchronize() {
  coconet::cuda::emu::sync_all();
  return cudaSuccess;
}
COCONET_EMU cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) {
  *e = new coconet::cuda::emu::Event();
  return cudaSuccess;
}
COCONET_EMU cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, 0); }
COCONET_EMU cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t cs = nullptr) {
  namespace m = coconet::cuda::emu;
  m::State& st = m::state();
  m::Stream* s = m::get(cs);
  m::enqueue(s, [e] {  // the time the stream reaches the event, for cudaEventElapsedTime
    e->at = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  });
  std::lock_guard<std::recursive_mutex> d(st.det);
  std::lock_guard<std::mutex> lock(st.mu);
  e->stream = s;
  e->position = s->enqueued;
  m::merge(s->clock, st.host);
  e->clock = s->clock;
  e->recorded = true;
  return cudaSuccess;
}
COCONET_EMU cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  namespace m = coconet::cuda::emu;
  if (!e->recorded) return cudaSuccess;
  m::State& st = m::state();
  std::unique_lock<std::mutex> lock(st.mu);
  st.cv.wait(lock, [&] { return e->stream->completed >= e->position; });
  return cudaSuccess;
}
// Whether the event's stream has reached it (never waits): cudaErrorNotReady while the work queued
// before it runs, or is blocked (an NCCL call whose peers never join).
COCONET_EMU cudaError_t cudaEventQuery(cudaEvent_t e) {
  namespace m = coconet::cuda::emu;
  if (!e->recorded) return cudaSuccess;
  m::State& st = m::state();
  std::lock_guard<std::mutex> lock(st.mu);
  return e->stream->completed >= e->position ? cudaSuccess : cudaErrorNotReady;
}
// As CUDA's: an event its stream has not reached yet is released once it is (the release queued
// behind it; a stream blocked for ever keeps it).
COCONET_EMU cudaError_t cudaEventDestroy(cudaEvent_t e) {
  namespace m = coconet::cuda::emu;
  if (!e) return cudaSuccess;
  if (!e->recorded || cudaEventQuery(e) == cudaSuccess) {
    delete e;
    return cudaSuccess;
  }
  m::enqueue(e->stream, [e] { delete e; });
  return cudaSuccess;
}
// Milliseconds between two events their streams have reached (the host's wall clock there).
COCONET_EMU cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  cudaEventSynchronize(start);
  cudaEventSynchronize(end);
  *ms = float((end->at.load() - start->at.load()) * 1e3);
  return cudaSuccess;
}
// The race tests' switch: COCONET_EMULATE_DROP_WAIT=FILE:LINE (a header's name and a line of
// it) makes the cudaStreamWaitEvent written there do nothing, as if the line were removed, so
// that one build shows what each missing wait does (the race detector must name the buffer).
COCONET_EMU bool coconet_emulate_dropped_wait(const char* file, int line) {
  static const std::string drop = [] {
    const char* e = std::getenv("COCONET_EMULATE_DROP_WAIT");
    return std::string(e ? e : "");
  }();
  if (drop.empty()) return false;
  const char* base = std::strrchr(file, '/');
  return drop == std::string(base ? base + 1 : file) + ":" + std::to_string(line);
}
COCONET_EMU cudaError_t coconet_emulate_wait_event(const char* file, int line, cudaStream_t cs, cudaEvent_t e,
                                              unsigned = 0) {
  namespace m = coconet::cuda::emu;
  m::State& st = m::state();
  m::Stream* s = m::get(cs);
  if (!e->recorded || coconet_emulate_dropped_wait(file, line)) return cudaSuccess;
  m::Stream* on = e->stream;
  const uint64_t pos = e->position;
  {
    std::lock_guard<std::recursive_mutex> d(st.det);
    m::merge(s->clock, e->clock);
  }
  m::enqueue(s, [on, pos] {
    m::State& st2 = m::state();
    std::unique_lock<std::mutex> lock(st2.mu);
    st2.cv.wait(lock, [&] { return on->completed >= pos; });
  });
  return cudaSuccess;
}
#define cudaStreamWaitEvent(...) coconet_emulate_wait_event(__FILE__, __LINE__, __VA_ARGS__)
COCONET_EMU cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind, cudaStream_t s = nullptr) {
  namespace m = coconet::cuda::emu;
  if (n == 0) return cudaSuccess;
  m::op(s, {m::bytes(src, n, false), m::bytes(dst, n, true)}, "cudaMemcpyAsync",
        [dst, src, n] { std::memmove(dst, src, n); });
  return cudaSuccess;
}
COCONET_EMU cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind k) {
  cudaMemcpyAsync(dst, src, n, k, nullptr);
  return cudaStreamSynchronize(nullptr);
}
COCONET_EMU cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                                     size_t height, cudaMemcpyKind, cudaStream_t s = nullptr) {
  namespace m = coconet::cuda::emu;
  if (width == 0 || height == 0) return cudaSuccess;
  std::vector<m::Span> spans;
  m::strided(spans, src, int64_t(height), int64_t(width), int64_t(spitch), 1, false);
  m::strided(spans, dst, int64_t(height), int64_t(width), int64_t(dpitch), 1, true);
  m::op(s, std::move(spans), "cudaMemcpy2DAsync", [=] {
    for (size_t r = 0; r < height; ++r)
      std::memmove(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch, width);
  });
  return cudaSuccess;
}
COCONET_EMU cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t s = nullptr) {
  namespace m = coconet::cuda::emu;
  if (n == 0) return cudaSuccess;
  m::op(s, {m::bytes(p, n, true)}, "cudaMemsetAsync", [=] { std::memset(p, v, n); });
  return cudaSuccess;
}
COCONET_EMU cudaError_t cudaMemset2DAsync(void* p, size_t pitch, int v, size_t width, size_t height, cudaStream_t s = nullptr) {
  namespace m = coconet::cuda::emu;
  if (width == 0 || height == 0) return cudaSuccess;
  std::vector<m::Span> spans;
  m::strided(spans, p, int64_t(height), int64_t(width), int64_t(pitch), 1, true);
  m::op(s, std::move(spans), "cudaMemset2DAsync", [=] {
    for (size_t r = 0; r < height; ++r) std::memset(static_cast<char*>(p) + r * pitch, v, width);
  });
  return cudaSuccess;
}

COCONET_EMU void __syncthreads() {
  namespace m = coconet::cuda::emu;
  m::BlockRun* b = m::block_run;
  if (!b || b->direct || !b->cur)
    throw std::runtime_error("coconet emulate: __syncthreads not reached by every thread of a block");
  m::yield_fiber(b, b->cur);
}

template <class T> inline T atomicAdd(T* p, T v) {  // a block's threads and a stream's blocks run in turn
  T old = *p;
  *p = old + v;
  return old;
}
