// coconet runtime: the partition rule of the language.
//
// A dim of n elements split over R ranks: c = ceil(n / R), rank i holds [i*c, min((i+1)*c, n)),
// clamped, so trailing ranks may hold nothing (n = 5, R = 4: sizes 2, 2, 1, 0).  The same rule
// chunks a range for pipelining (overlap's chunks, the rounds of fused collectives).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#ifndef COCONET_HD
#ifdef __CUDACC__
#define COCONET_HD __host__ __device__
#else
#define COCONET_HD
#endif
#endif

namespace coconet {

// A half-open range of indices [begin, end).
struct Range {
  int64_t begin = 0;
  int64_t end = 0;
  COCONET_HD int64_t size() const { return end - begin; }
  COCONET_HD bool empty() const { return end <= begin; }
};

// c = ceil(n / R): the size of every non-trailing slice.
COCONET_HD inline int64_t slice_chunk(int64_t n, int64_t R) { return R > 0 ? (n + R - 1) / R : 0; }

// The indices rank i of R holds along a dim of size n.
COCONET_HD inline Range slice_range(int64_t n, int64_t R, int64_t i) {
  int64_t c = slice_chunk(n, R);
  int64_t b = i * c < n ? i * c : n;  // no std::min: also device code
  return Range{b, b + c < n ? b + c : n};
}

// Piece i of k of rank q's slice of a dim of size n, as indices of the whole dim (an overlap
// of an allgather along the dim it gathers: chunk i is piece i of every rank's slice).
COCONET_HD inline Range piece_range(int64_t n, int64_t R, int64_t q, int64_t k, int64_t i) {
  const Range s = slice_range(n, R, q), p = slice_range(s.size(), k, i);
  return Range{s.begin + p.begin, s.begin + p.end};
}

// Slice sizes of all R ranks.
inline std::vector<int64_t> slice_counts(int64_t n, int64_t R) {
  std::vector<int64_t> counts(static_cast<size_t>(R));
  for (int64_t i = 0; i < R; ++i) counts[static_cast<size_t>(i)] = slice_range(n, R, i).size();
  return counts;
}

// Slice starts of all R ranks.
inline std::vector<int64_t> slice_displs(int64_t n, int64_t R) {
  std::vector<int64_t> displs(static_cast<size_t>(R));
  for (int64_t i = 0; i < R; ++i) displs[static_cast<size_t>(i)] = slice_range(n, R, i).begin;
  return displs;
}

// A tensor viewed as [outer, n, inner] around the sliced dim d (size n): outer = product of the
// dims before d, inner = product of the dims after d.
struct Shape3 {
  int64_t outer = 1;
  int64_t n = 0;
  int64_t inner = 1;
  int64_t total() const { return outer * n * inner; }
};

// The [outer, n, inner] view of `dims` around dim d.
inline Shape3 shape3(const std::vector<int64_t>& dims, size_t d) {
  Shape3 s;
  s.n = dims.at(d);
  for (size_t i = 0; i < d; ++i) s.outer *= dims[i];
  for (size_t i = d + 1; i < dims.size(); ++i) s.inner *= dims[i];
  return s;
}

// Why a reshape cannot run ("" when it can), as coconetc/ir/typerules.py's reshape_problem:
// the global element counts differ (n_in != n_out), or, when the reshaped group holds the sliced
// dim (whole > 0), a rank's slice of `whole` is not its slice of `part` times `rest` over a group
// of `ranks` (ceil(whole / R) != ceil(part / R) * rest).  The same on every rank: the generated
// code throws before anything of the call depends on it.
inline std::string reshape_problem(int64_t n_in, int64_t n_out, int64_t whole, int64_t part, int64_t rest,
                                   int64_t ranks, const char* what) {
  if (n_in != n_out)
    return std::string(what) + ": the sizes disagree (" + std::to_string(n_in) + " elements into " +
           std::to_string(n_out) + ")";
  if (whole > 0 && slice_chunk(whole, ranks) != slice_chunk(part, ranks) * rest)
    return std::string(what) + ": a dim of " + std::to_string(whole) + " sliced over " + std::to_string(ranks) +
           " ranks into " + std::to_string(part) + " x " + std::to_string(rest) +
           ": each rank's slice must hold whole groups of " + std::to_string(rest) + " (make " +
           std::to_string(part) + " divisible by " + std::to_string(ranks) + ")";
  return "";
}

}  // namespace coconet
