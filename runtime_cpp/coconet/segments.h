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
#include "slices.h"

namespace coconet {

// Prefix sums of segment sizes: starts[i] = first logical index of segment i; back() = total.
inline std::vector<int64_t> segment_starts(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> starts(sizes.size() + 1, 0);
  for (size_t i = 0; i < sizes.size(); ++i) starts[i + 1] = starts[i] + sizes[i];
  return starts;
}

// Calls f(segment, offset in segment, offset in range, length) for each non-empty piece of the
// logical range [begin, end), in order.
template <class F>
void for_each_piece(const std::vector<int64_t>& starts, int64_t begin, int64_t end, F&& f) {
  if (begin >= end) return;
  auto it = std::upper_bound(starts.begin(), starts.end(), begin);
  size_t seg = static_cast<size_t>(it - starts.begin()) - 1;
  for (int64_t pos = begin; pos < end; ++seg) {
    int64_t len = std::min(end, starts[seg + 1]) - pos;
    if (len > 0) f(seg, pos - starts[seg], pos - begin, len);
    pos += std::max<int64_t>(len, 0);
  }
}

// A logical 1-D tensor stored as segments ptrs[i][0 .. sizes[i]).
template <class T>
struct Segments {
  std::vector<T*> ptrs;
  std::vector<int64_t> sizes;
  std::vector<int64_t> starts{0};

  Segments() = default;
  Segments(std::vector<T*> p, std::vector<int64_t> s)
      : ptrs(std::move(p)), sizes(std::move(s)), starts(segment_starts(sizes)) {
    require(ptrs.size() == sizes.size(), "Segments: pointer and size lists differ in length");
  }
  // A contiguous buffer as one segment.
  static Segments one(T* p, int64_t n) { return Segments({p}, {n}); }

  int64_t total() const { return starts.back(); }
  size_t count() const { return ptrs.size(); }

  // Calls f(T* ptr, offset in range, length) for the pieces of [begin, end).
  template <class F>
  void for_each(int64_t begin, int64_t end, F&& f) const {
    for_each_piece(starts, begin, end, [&](size_t s, int64_t so, int64_t ro, int64_t len) {
      f(ptrs[s] + so, ro, len);
    });
  }

  // The same segments, read-only.
  operator Segments<const T>() const {
    return Segments<const T>(std::vector<const T*>(ptrs.begin(), ptrs.end()), sizes);
  }

  // True when the segments have the same sizes as `o` (scattered arguments of one call must).
  template <class U>
  bool same_sizes(const Segments<U>& o) const {
    return sizes == o.sizes;
  }
};

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
inline void range_msg(const RawSegments& s, int64_t begin, int64_t end, Msg& m) {
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
}

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
  COCONET_MPI(MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE));
  reqs.clear();
}

// Checks that an element count fits MPI's int counts (same answer on every rank).
inline int mpi_count(int64_t n, const char* what) {
  require(n >= 0 && n <= INT_MAX, std::string(what) + ": " + std::to_string(n) +
                                      " elements do not fit an MPI count (max 2^31-1)");
  return static_cast<int>(n);
}

}  // namespace coconet
