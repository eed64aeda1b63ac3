// coconet runtime: pieces of scattered tensors, the same for the CPU and the CUDA runtime.
//
// A scattered tensor (`f32[N] local scattered`) is a list of 1-D buffers (segments) taken as one
// logical 1-D tensor of length N = the sum of their sizes; a logical range [begin, end) falls
// into pieces, one per segment it touches. Host code only (the CUDA runtime walks the pieces on
// the host and issues a kernel, copy or NCCL call per piece), and no MPI: the MPI messages over
// logical ranges are segments.h's.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "require.h"
#include "state.h"

namespace coconet {

// Prefix sums of segment sizes: starts[i] = first logical index of segment i; back() = total.
COCONET_LIBRARY std::vector<int64_t> segment_starts(const std::vector<int64_t>& sizes) COCONET_LIBRARY_BODY({
  std::vector<int64_t> starts(sizes.size() + 1, 0);
  for (size_t i = 0; i < sizes.size(); ++i) starts[i + 1] = starts[i] + sizes[i];
  return starts;
})

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

// One piece of a logical range [begin, end) inside one segment: segment index, offset inside
// the segment, offset inside the range, length.  A list, so loops over it need no lambda.
struct Piece {
  size_t segment;
  int64_t at, offset, size;
};
inline std::vector<Piece> pieces(const std::vector<int64_t>& starts, int64_t begin, int64_t end) {
  std::vector<Piece> out;
  for_each_piece(starts, begin, end, [&](size_t s, int64_t a, int64_t b, int64_t len) {
    out.push_back(Piece{s, a, b, len});
  });
  return out;
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
  // Where a piece (of pieces(starts, ...)) begins.
  T* at(const Piece& pc) const { return ptrs[pc.segment] + pc.at; }

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

}  // namespace coconet
