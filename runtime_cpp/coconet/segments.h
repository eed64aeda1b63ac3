// coconet runtime: scattered tensors (`f32[N] local scattered`).
//
// A scattered tensor is a list of 1-D buffers (segments) treated as one logical 1-D tensor of
// length N = sum of the sizes, without copying them into one buffer.  A contiguous tensor is
// the one-segment case (Segments<T>::one), so code written for Segments serves both.
//
// Logical ranges that cross segment boundaries travel as one MPI message built from an
// MPI_Type_create_hindexed datatype over the absolute addresses of the pieces (buffer
// MPI_BOTTOM); a range inside one segment is sent as a plain (pointer, count).
#pragma once

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "dtypes.h"
#include "errors.h"
#include "pieces.h"
#include "state.h"
#include "slices.h"
#include "trace.h"

namespace coconet {

// Copies the logical range [begin, end) of `src` into contiguous dst[0 .. end-begin).
template <class T>
void copy_out(const Segments<const T>& src, int64_t begin, int64_t end, T* dst) {
  src.for_each(begin, end, [&](const T* p, int64_t ro, int64_t len) {
    std::memcpy(dst + ro, p, static_cast<size_t>(len) * sizeof(T));
  });
}

// Copies contiguous src[0 .. end-begin) into the logical range [begin, end) of `dst`.
template <class T>
void copy_in(const T* src, const Segments<T>& dst, int64_t begin, int64_t end) {
  dst.for_each(begin, end, [&](T* p, int64_t ro, int64_t len) {
    std::memcpy(p, src + ro, static_cast<size_t>(len) * sizeof(T));
  });
}

// ---- type-erased segments and MPI messages over logical ranges ------------------------------

// Segments of any element type (element size + MPI datatype), for code that only moves bytes:
// the gather targets of fused collectives, p2p messages.
struct RawSegments {
  std::vector<char*> ptrs;
  std::vector<int64_t> starts{0};
  size_t elem_size = 1;
  MPI_Datatype type = MPI_BYTE;
  int64_t total() const { return starts.back(); }
};

// The type-erased view of typed segments.
template <class T>
RawSegments raw(const Segments<T>& s) {
  using U = std::remove_const_t<T>;
  RawSegments r;
  for (T* p : s.ptrs) r.ptrs.push_back(reinterpret_cast<char*>(const_cast<U*>(p)));
  r.starts = s.starts;
  r.elem_size = sizeof(U);
  r.type = mpi_type<U>();
  return r;
}

// The type-erased view of a contiguous buffer of n elements.
template <class T>
RawSegments raw(T* p, int64_t n) {
  return raw(Segments<T>::one(p, n));
}

// One MPI message: (buf, count, type).  Owns `type` when it was built for the message; MPI lets
// us free it right after posting the operation.
struct Msg {
  void* buf = nullptr;
  int count = 0;
  MPI_Datatype type = MPI_BYTE;
  bool owned = false;
  Msg() = default;
  Msg(const Msg&) = delete;
  Msg& operator=(const Msg&) = delete;
  ~Msg() {
    if (owned) MPI_Type_free(&type);
  }
};

// Fills `m` with the message for the logical range [begin, end) of `s` (end - begin < 2^31).
COCONET_LIBRARY void range_msg(const RawSegments& s, int64_t begin, int64_t end, Msg& m) COCONET_LIBRARY_BODY({
  std::vector<int> lens;
  std::vector<MPI_Aint> displs;
  char* first = nullptr;
  for_each_piece(s.starts, begin, end, [&](size_t seg, int64_t so, int64_t, int64_t len) {
    char* p = s.ptrs[seg] + so * static_cast<int64_t>(s.elem_size);
    if (!first) first = p;
    MPI_Aint addr;
    MPI_Get_address(p, &addr);
    lens.push_back(static_cast<int>(len));
    displs.push_back(addr);
  });
  if (lens.size() <= 1) {  // empty or inside one segment: plain buffer
    m.buf = first;
    m.count = lens.empty() ? 0 : lens[0];
    m.type = s.type;
    return;
  }
  COCONET_MPI(MPI_Type_create_hindexed(static_cast<int>(lens.size()), lens.data(), displs.data(),
                                       s.type, &m.type));
  COCONET_MPI(MPI_Type_commit(&m.type));
  m.owned = true;
  m.buf = MPI_BOTTOM;
  m.count = 1;
})

// Posts a non-blocking send of the logical range [begin, end) of `s` (nothing if empty).
inline void isend_range(const RawSegments& s, int64_t begin, int64_t end, int dest, int tag,
                        MPI_Comm comm, std::vector<MPI_Request>& reqs) {
  if (begin >= end) return;
  Msg m;
  range_msg(s, begin, end, m);
  reqs.emplace_back();
  COCONET_MPI(MPI_Isend(m.buf, m.count, m.type, dest, tag, comm, &reqs.back()));
}

// Posts a non-blocking receive into the logical range [begin, end) of `s` (nothing if empty).
inline void irecv_range(const RawSegments& s, int64_t begin, int64_t end, int src, int tag,
                        MPI_Comm comm, std::vector<MPI_Request>& reqs) {
  if (begin >= end) return;
  Msg m;
  range_msg(s, begin, end, m);
  reqs.emplace_back();
  COCONET_MPI(MPI_Irecv(m.buf, m.count, m.type, src, tag, comm, &reqs.back()));
}

// ---- request helpers -----------------------------------------------------------------------

// Tests `reqs` (driving MPI's progress engine); clears them and returns true when all are done.
inline bool test_all(std::vector<MPI_Request>& reqs) {
  if (reqs.empty()) return true;
  int done = 0;
  COCONET_MPI(MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done,
                          MPI_STATUSES_IGNORE));
  if (done) reqs.clear();
  return done != 0;
}

// Waits for all of `reqs` and clears them.
inline void wait_all(std::vector<MPI_Request>& reqs) {
  if (reqs.empty()) return;
  trace::Span span("wait");
  COCONET_MPI(MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE));
  reqs.clear();
}

// Checks that an element count fits MPI's int counts (same answer on every rank).
COCONET_LIBRARY int mpi_count(int64_t n, const char* what) COCONET_LIBRARY_BODY({
  require(n >= 0 && n <= INT_MAX, std::string(what) + ": " + std::to_string(n) +
                                      " elements do not fit an MPI count (max 2^31-1)");
  return static_cast<int>(n);
})

}  // namespace coconet
