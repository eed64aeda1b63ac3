// coconet runtime: fused causal attention on the CPU (forward and backward), what the planner
// calls in place of the pieces matmul(q, transpose(k)) * scale, where(causal(s), s, -inf),
// softmax, dropout, matmul(a, v) and their derivatives.
//
// Rows of the scores are whole here, so no online softmax is needed: per matrix and per block of
// kAttentionRows rows, one GEMM gives the block's scores in a per-thread tile (only the columns
// the block's causal mask keeps, unless the caller wants s whole; the saved p's own rows when the
// caller saves p and draws no dropout), the tile is scaled, masked, softmaxed and dropped out in
// place, and one GEMM multiplies it by v.  The backward recomputes (or reads, where it is
// stored) the block's P, forms dS in the tile, and accumulates dk and dv with C += GEMMs.
// The masked columns of a block are not touched by any GEMM: about half of the work of the
// pieces.  Dropout's Philox runs once per kept element per call.  The float softmax's exp is a
// vectorizable polynomial (attention_exp, within 3 ulp of std::exp).
//
// Measured (bench/attention_cpu.py, one thread, batch 64, S = 512, head dim 64, f32, MKL, a
// 2.6 GHz Xeon with AVX-512, one run): forward + backward 120 ms with p saved (125 with p read as
// a backward program reads it), 177 ms with s and a saved (243 ms with dropout 0.1); torch's
// pieces 529 ms, torch SDPA is_causal 203 ms.
//
// Not done: threads.  A call runs in the calling thread, its tile GEMMs in BLAS's thread pool;
// with COCONET_THREADS > 1 those small GEMMs would do better one thread per matrix.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "gemm.h"
#include "pointwise.h"
#include "rng.h"

namespace coconet {

// Where the scores' elements sit in the global tensor, for dropout's counter (the global flat
// index of element (b, i, j) of the [.., M, N] scores): the local batch index b (over the
// leading dims, row-major, this rank's part) is seen as [outer, mid, inner], mid the one leading
// dim that may be sliced across ranks: this rank holds mid_local of its mid_global entries, from
// mid_offset. global batch = (o * mid_global + mid_offset + m) * inner + r  where
// b = (o * mid_local + m) * inner + r;  gidx = (global batch * M + i) * N + j.
// Unsliced: mid_local = mid_global = 1, mid_offset = 0, inner = 1 (gidx = (b * M + i) * N + j).
struct AttentionIndex {
  int64_t mid_local, mid_global, mid_offset, inner;
};

// Rows of the scores per block: the tile [rows, N] stays in L2 (32 x 512 floats: 64 KiB). 32
// measured fastest (bench/attention_cpu.cpp: 16, 48, 64 and 128 were 4 to 15 % slower with
// OpenBLAS; with MKL on a Xeon, 16, 64 and 128 were 1 to 12 % slower, two runs each): the
// smaller the block, the fewer masked columns its GEMMs compute.
constexpr int64_t kAttentionRows = 32;

namespace detail {

// The checks common to both directions; the message names the parameter.
inline void attention_check(const char* fn, int64_t batch, int64_t M, int64_t N, int64_t D, int64_t E,
                            double drop_p, const AttentionIndex& at) {
  const auto bad = [&](const std::string& what) {
    throw std::invalid_argument(std::string(fn) + ": " + what);
  };
  if (batch < 0) bad("batch must be >= 0, got " + std::to_string(batch));
  if (M < 0) bad("M must be >= 0, got " + std::to_string(M));
  if (N < 0) bad("N must be >= 0, got " + std::to_string(N));
  if (D < 0) bad("D must be >= 0, got " + std::to_string(D));
  if (E < 0) bad("E must be >= 0, got " + std::to_string(E));
  if (drop_p != drop_p) bad("drop_p is NaN");
  // mid_local or inner 0: a rank holding none of the sliced dim (more ranks than heads), or an
  // empty leading dim; the batch is then empty
  if (at.mid_local < 0) bad("at.mid_local must be >= 0, got " + std::to_string(at.mid_local));
  if (at.inner < 0) bad("at.inner must be >= 0, got " + std::to_string(at.inner));
  if (at.mid_offset < 0 || at.mid_offset + at.mid_local > at.mid_global)
    bad("at.mid_offset + at.mid_local must lie within at.mid_global (offset " + std::to_string(at.mid_offset) +
        ", local " + std::to_string(at.mid_local) + ", global " + std::to_string(at.mid_global) + ")");
  const int64_t per = at.mid_local * at.inner;
  if (per == 0 ? batch != 0 : batch % per != 0)
    bad("batch (" + std::to_string(batch) + ") is not a multiple of at.mid_local * at.inner (" +
        std::to_string(per) + ")");
}

// The global flat index of element (b, 0, 0) of the scores (see AttentionIndex).
inline uint64_t attention_base(int64_t b, int64_t M, int64_t N, const AttentionIndex& at) {
  const int64_t r = b % at.inner, m = (b / at.inner) % at.mid_local, o = b / (at.inner * at.mid_local);
  const int64_t gb = (o * at.mid_global + at.mid_offset + m) * at.inner + r;
  return static_cast<uint64_t>(gb) * static_cast<uint64_t>(M) * static_cast<uint64_t>(N);
}

// diagonal clamped to [-M, N]: the same kept entries (every row of M rows keeps none at -M,
// all N at N), and i + diagonal + 1 cannot overflow.
inline int64_t attention_diagonal(int64_t diagonal, int64_t M, int64_t N) {
  return std::min<int64_t>(N, std::max<int64_t>(-M, diagonal));
}

// Kept columns of row i: j <= i + diagonal, j < N.
inline int64_t attention_kept(int64_t i, int64_t N, int64_t diagonal) {
  return std::max<int64_t>(0, std::min<int64_t>(N, i + diagonal + 1));
}

// Whether any masked entry of rows [i0, i1) of a [.., N] matrix (x: its row i0) is other than 0
// (-0 is 0; a NaN is not): the bits of every masked entry but the sign ORed together, a loop the
// compiler vectorizes.
template <class T>
bool attention_masked_nonzero(const T* x, int64_t i0, int64_t i1, int64_t N, int64_t diagonal) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "attention_masked_nonzero: a 4- or 8-byte T");
  using U = typename std::conditional<sizeof(T) == 4, uint32_t, uint64_t>::type;
  U any = 0;
  for (int64_t i = i0; i < i1; ++i) {
    const T* row = x + (i - i0) * N;
    for (int64_t j = attention_kept(i, N, diagonal); j < N; ++j) {
      U u;
      std::memcpy(&u, row + j, sizeof u);
      any |= u;
    }
  }
  return (any & ~(U(1) << (8 * sizeof(U) - 1))) != 0;
}

// A per-thread buffer of at least n elements of T, kept across calls (Site: which buffer).
template <class T, int Site>
T* attention_scratch(int64_t n) {
  static thread_local std::vector<T> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(static_cast<size_t>(n));
  return buf.data();
}

// exp(x) for float in a form the compiler vectorizes (no call): Cephes' expf (range reduction
// by ln 2 in two parts, a degree-6 polynomial, the power of two put into the exponent bits),
// within about 1 ulp of std::exp over the softmax's inputs (x <= 0); x below -87.3 gives 0
// (std::exp: a denormal or 0), NaN stays NaN.  Other types: std::exp.
template <class T>
inline T attention_exp(T x) {
  if constexpr (std::is_same<T, float>::value) {
    const float xc = std::min(std::max(x, -87.33654f), 88.0f);
    const float fn = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
    const float r = (xc - fn * 0.693359375f) - fn * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(fn) + 127) << 23;
    float two_n;
    std::memcpy(&two_n, &bits, sizeof two_n);
    const float e = y * two_n;
    return x != x ? x : (x < -87.33654f ? 0.0f : e);
  } else {
    return std::exp(x);
  }
}

// Lanes of the row reductions below: partial maxima and sums the compiler keeps in vector
// registers (the sums' order differs from a left-to-right loop by rounding only).
constexpr int kAttentionLanes = 16;

// The largest of w[0:n), -inf when n = 0.  A NaN may be skipped in the lanes: the softmax's
// row is all NaN either way (the NaN's exp(NaN - max) makes the row's sum NaN).
template <class T>
inline T attention_row_max(const T* w, int64_t n) {
  T lane[kAttentionLanes];
  for (int l = 0; l < kAttentionLanes; ++l) lane[l] = -std::numeric_limits<T>::infinity();
  int64_t j = 0;
  for (; j + kAttentionLanes <= n; j += kAttentionLanes)
    for (int l = 0; l < kAttentionLanes; ++l) lane[l] = w[j + l] > lane[l] ? w[j + l] : lane[l];
  T m = -std::numeric_limits<T>::infinity();
  for (int l = 0; l < kAttentionLanes; ++l) m = max_step(m, lane[l]);
  for (; j < n; ++j) m = max_step(m, w[j]);
  return m;
}

// sum of a[j] * b[j] over [0, n) (b = nullptr: of a[j]).
template <class T>
inline T attention_row_dot(const T* a, const T* b, int64_t n) {
  T lane[kAttentionLanes] = {};
  int64_t j = 0;
  if (b)
    for (; j + kAttentionLanes <= n; j += kAttentionLanes)
      for (int l = 0; l < kAttentionLanes; ++l) lane[l] += a[j + l] * b[j + l];
  else
    for (; j + kAttentionLanes <= n; j += kAttentionLanes)
      for (int l = 0; l < kAttentionLanes; ++l) lane[l] += a[j + l];
  T s = 0;
  for (int l = 0; l < kAttentionLanes; ++l) s += lane[l];
  for (; j < n; ++j) s += b ? a[j] * b[j] : a[j];
  return s;
}

// The softmax of w[0:kc) in place (the row's max subtracted, softmax_shift; kc = 0: nothing),
// a row whose exponentials sum to 0 all zeros (softmax_value).
template <class T>
void attention_softmax(T* w, int64_t kc) {
  const T mx = softmax_shift(attention_row_max(w, kc));
  for (int64_t j = 0; j < kc; ++j) w[j] = attention_exp(w[j] - mx);
  const T sum = attention_row_dot<T>(w, nullptr, kc);
  if (sum == T(0)) {
    for (int64_t j = 0; j < kc; ++j) w[j] = T(0);
    return;
  }
  const T inv = T(1) / sum;
  for (int64_t j = 0; j < kc; ++j) w[j] *= inv;
}

// dropout's keep decisions of kc elements from gidx0 into keep[0:kc) (1 kept, 0 dropped).
inline void attention_keep(uint64_t seed, uint32_t site, uint64_t gidx0, uint32_t threshold, int64_t kc,
                           unsigned char* keep) {
  for (int64_t j = 0; j < kc; ++j)
    keep[j] = dropout_keep(seed, site, gidx0 + static_cast<uint64_t>(j), threshold) ? 1 : 0;
}

// x[0:n) = dropout with attention_keep's decisions: each kept element times scale (1 / (1 - p)),
// each dropped one 0 (the forward's A, dP, and A drawn again in the backward).
template <typename T>
inline void attention_apply_keep(T* x, const unsigned char* keep, int64_t n, T scale) {
  for (int64_t j = 0; j < n; ++j) x[j] = keep[j] ? x[j] * scale : T(0);
}

}  // namespace detail

// C[M, N] += op(A) x op(B) (gemm_trans's operands; C must not overlap A or B): sgemm / dgemm
// with beta = 1 for f32 / f64, a loop in the compute type otherwise.  K = 0 adds nothing.
template <class T>
void gemm_trans_acc(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B,
                    int64_t ldb, T* C, int64_t ldc) {
  if (M <= 0 || N <= 0 || K <= 0) return;
#ifndef COCONET_NO_BLAS
  if constexpr (std::is_same<T, float>::value) {
    require_blas_dims(M, N, K, lda, ldb, ldc);
    COCONET_CBLAS(sgemm)(kRowMajor, ta ? kTrans : kNoTrans, tb ? kTrans : kNoTrans, int(M), int(N), int(K), 1.0f,
                         A, int(lda), B, int(ldb), 1.0f, C, int(ldc));
    return;
  } else if constexpr (std::is_same<T, double>::value) {
    require_blas_dims(M, N, K, lda, ldb, ldc);
    COCONET_CBLAS(dgemm)(kRowMajor, ta ? kTrans : kNoTrans, tb ? kTrans : kNoTrans, int(M), int(N), int(K), 1.0,
                         A, int(lda), B, int(ldb), 1.0, C, int(ldc));
    return;
  }
#endif
  using Acc = compute_t<T>;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      Acc acc = to_compute(C[i * ldc + j]);
      for (int64_t k = 0; k < K; ++k)
        acc += to_compute(ta ? A[k * lda + i] : A[i * lda + k]) * to_compute(tb ? B[j * ldb + k] : B[k * ldb + j]);
      C[i * ldc + j] = from_compute<T>(acc);
    }
}

// Forward. q [batch, M, D], k [batch, N, D], v [batch, N, E] -> o [batch, M, E], all dense
// row-major, T = float or double (computed in T).  Per matrix b and element (i, j):
//   s = scale * sum_d q[i,d] k[j,d]
//   w = (j <= i + diagonal) ? s : -inf                      (torch.tril's keep, `diagonal` any int)
//   p = softmax over j of w's row, the row max subtracted; a row with no kept entry is all zeros
//   a = dropout(p) = coconet::dropout<T>(p, drop_p, seed, site, gidx)   (drop_p <= 0: a = p exactly)
//   o[i, :] = sum_j a[i,j] v[j, :]
// s_out, w_out, p_out, a_out: each may be nullptr; when given, written whole ([batch, M, N], the
// masked elements too: s its real value, w -inf, p 0, a 0).  Only s_out makes the masked part of
// q k^T computed.
template <class T>
void attention_fwd(const T* q, const T* k, const T* v, T* o, T* s_out, T* w_out, T* p_out, T* a_out,
                   int64_t batch, int64_t M, int64_t N, int64_t D, int64_t E, int64_t diagonal, double scale,
                   double drop_p, int64_t seed, uint32_t site, AttentionIndex at) {
  static_assert(std::is_same<T, float>::value || std::is_same<T, double>::value,
                "attention_fwd: T must be float or double");
  detail::attention_check("attention_fwd", batch, M, N, D, E, drop_p, at);
  diagonal = detail::attention_diagonal(diagonal, M, N);
  if (batch == 0 || M == 0) return;
  const T sc = static_cast<T>(scale);
  const T inf = std::numeric_limits<T>::infinity();
  const bool drop = drop_p > 0.0;
  const uint32_t threshold = dropout_threshold(drop_p);
  const T keep_scale = drop_p < 1.0 ? static_cast<T>(1.0 / (1.0 - drop_p)) : T(0);
  const int64_t rows_max = std::min(M, kAttentionRows);
  T* tile = detail::attention_scratch<T, 0>(rows_max * std::max<int64_t>(N, 1));
  unsigned char* keep = detail::attention_scratch<unsigned char, 1>(std::max<int64_t>(N, 1));
  const bool in_p = p_out && !s_out && !drop;
  for (int64_t b = 0; b < batch; ++b) {
    const T* qb = q + b * M * D;
    const T* kb = k + b * N * D;
    const T* vb = v + b * N * E;
    T* ob = o + b * M * E;
    const uint64_t base = drop ? detail::attention_base(b, M, N, at) : 0;
    for (int64_t i0 = 0; i0 < M; i0 += kAttentionRows) {
      const int64_t i1 = std::min(M, i0 + kAttentionRows), rows = i1 - i0;
      const int64_t need = std::max<int64_t>(0, std::min<int64_t>(N, i1 + diagonal));  // columns the block keeps
      const int64_t c = s_out ? N : need;  // columns computed
      // p_out's rows are the tile itself when the GEMM with v reads P (no dropout, s not wanted):
      // no copy of it
      T* tl = in_p ? p_out + (b * M + i0) * N : tile;
      const int64_t ld = in_p ? N : c;  // the tile's leading dim
      if (c > 0) gemm_trans(false, true, rows, c, D, qb + i0 * D, D, kb, D, tl, ld);
      for (int64_t i = i0; i < i1; ++i) {
        T* t = tl + (i - i0) * ld;
        const int64_t kc = detail::attention_kept(i, N, diagonal);
        const int64_t row = (b * M + i) * N;
        for (int64_t j = 0; j < c; ++j) t[j] *= sc;
        if (s_out) std::copy(t, t + N, s_out + row);
        if (w_out) {
          std::copy(t, t + kc, w_out + row);
          std::fill(w_out + row + kc, w_out + row + N, -inf);
        }
        detail::attention_softmax(t, kc);
        std::fill(t + kc, t + (in_p ? N : c), T(0));  // the masked columns the GEMM with v reads (and p_out's)
        if (p_out && !in_p) {
          std::copy(t, t + kc, p_out + row);
          std::fill(p_out + row + kc, p_out + row + N, T(0));
        }
        if (drop) {
          detail::attention_keep(seed, site, base + static_cast<uint64_t>(i) * N, threshold, kc, keep);
          detail::attention_apply_keep(t, keep, kc, keep_scale);
        }
        if (a_out) {
          std::copy(t, t + kc, a_out + row);
          std::fill(a_out + row + kc, a_out + row + N, T(0));
        }
      }
      if (need > 0)
        gemm(rows, E, need, tl, ld, vb, E, ob + i0 * E, E);
      else
        std::fill(ob + i0 * E, ob + i1 * E, T(0));
    }
  }
}

// Backward (what the derived program computes from the pieces). g = dL/do [batch, M, E].
//   P: p as above: p_in when given, else recomputed from s_in (the forward's s, [batch, M, N];
//      required then).  A: a_in when given, else P with the mask (over whole rows where p_whole
//      finds a masked entry of p_in other than 0, as the pieces' dropout(P) has it).  Of s_in, p_in and a_in only
//      the kept entries are read.  The mask is always Philox's (not read from a_in), so a_in
//      that is not the forward's a (a backward program's input) is read as the pieces read it.
//   dA  = g v^T                 [M, N]
//   dP  = dropout(dA) with the forward's mask (same site/seed/gidx; drop_p <= 0: dP = dA)
//   r_i = sum_j dP[i,j] P[i,j]
//   dS  = (j <= i + diagonal) ? P * (dP - r) : 0,   then times scale
//   dq  = dS k   [M, D]     dk = dS^T q   [N, D]     dv = A^T g   [N, E]
// a_whole: dv reads every entry of a_in (a backward program's saved a is an input like any other:
// its masked entries are 0 only when the forward wrote it, and the pieces read them all), its
// GEMM over all N columns; otherwise only the kept entries (a_in computed in the same program).
// p_whole: r reads every entry of p_in's rows, as the pieces' sum_keep(dP * P) does (a backward
// program's saved p, whose masked entries are 0 only when the forward wrote it): a block of rows
// whose masked entries of p_in are all 0 (the forward's) is computed as above, one with any
// other (a NaN included) gets dA over all N columns and r over whole rows.
// dq, dk, dv written whole (dk, dv: rows no kept entry reaches are 0).
template <class T>
void attention_bwd(const T* q, const T* k, const T* v, const T* s_in, const T* p_in, const T* a_in, const T* g,
                   T* dq, T* dk, T* dv, int64_t batch, int64_t M, int64_t N, int64_t D, int64_t E,
                   int64_t diagonal, double scale, double drop_p, int64_t seed, uint32_t site, AttentionIndex at,
                   bool a_whole = false, bool p_whole = false) {
  static_assert(std::is_same<T, float>::value || std::is_same<T, double>::value,
                "attention_bwd: T must be float or double");
  detail::attention_check("attention_bwd", batch, M, N, D, E, drop_p, at);
  diagonal = detail::attention_diagonal(diagonal, M, N);
  if (!s_in && !p_in && batch > 0 && M > 0 && N > 0)
    throw std::invalid_argument("attention_bwd: s_in is required when p_in is nullptr");
  std::fill(dk, dk + batch * N * D, T(0));
  std::fill(dv, dv + batch * N * E, T(0));
  if (batch == 0 || M == 0) return;
  const T sc = static_cast<T>(scale);
  const bool drop = drop_p > 0.0;
  const uint32_t threshold = dropout_threshold(drop_p);
  const T keep_scale = drop_p < 1.0 ? static_cast<T>(1.0 / (1.0 - drop_p)) : T(0);
  const int64_t rows_max = std::min(M, kAttentionRows);
  T* pt = detail::attention_scratch<T, 2>(rows_max * std::max<int64_t>(N, 1));  // P, then A
  T* dt = detail::attention_scratch<T, 3>(rows_max * std::max<int64_t>(N, 1));  // dA, then dS
  unsigned char* keep = detail::attention_scratch<unsigned char, 1>(std::max<int64_t>(N, 1));
  for (int64_t b = 0; b < batch; ++b) {
    const T* qb = q + b * M * D;
    const T* kb = k + b * N * D;
    const T* vb = v + b * N * E;
    const T* gb = g + b * M * E;
    T* dqb = dq + b * M * D;
    T* dkb = dk + b * N * D;
    T* dvb = dv + b * N * E;
    const uint64_t base = drop ? detail::attention_base(b, M, N, at) : 0;
    // p_whole / a_whole ask only for a check: a matrix whose p_in (a_in) holds 0 at every masked
    // entry, as the forward writes it, is read at its kept entries alone (one vectorized pass over
    // its masked entries; dv then over kept columns only).  !a_clean: a_in given, asked whole,
    // and not 0 there
    const bool p_clean = !(p_in && p_whole) || !detail::attention_masked_nonzero(p_in + b * M * N, 0, M, N, diagonal);
    const bool a_clean = !(a_in && a_whole) ||
                         (a_in == p_in ? p_clean : !detail::attention_masked_nonzero(a_in + b * M * N, 0, M, N, diagonal));
    for (int64_t i0 = 0; i0 < M; i0 += kAttentionRows) {
      const int64_t i1 = std::min(M, i0 + kAttentionRows), rows = i1 - i0;
      const int64_t kept = std::max<int64_t>(0, std::min<int64_t>(N, i1 + diagonal));
      const bool whole = !p_clean && detail::attention_masked_nonzero(p_in + (b * M + i0) * N, i0, i1, N, diagonal);
      if (kept == 0 && !whole) {  // no kept entry: dq's rows are 0, nothing reaches dk (nor dv, but from a
        std::fill(dqb + i0 * D, dqb + i1 * D, T(0));  // whole a_in; a whole p_in's rows go the way below:
        if (!a_clean)                                 // dS 0, A = dropout(P) at every entry)
          gemm_trans_acc(true, false, N, E, rows, a_in + (b * M + i0) * N, N, gb + i0 * E, E, dvb, E);
        continue;
      }
      const int64_t c = whole ? N : kept;  // columns of dA computed; the tiles' leading dim
      // A's block, read in place where it is stored when the check above found its masked
      // entries 0 (a_in's, or p_in's when A is P), else made in pt: a_in's kept entries, or
      // from P (only the kept entries of an a_in or p_in not checked are read)
      const bool a_here = a_in && a_whole && a_clean, p_here = !a_in && !drop && p_in && p_whole && p_clean;
      const T* ab = a_here ? a_in + (b * M + i0) * N : p_here ? p_in + (b * M + i0) * N : pt;
      const bool make_a = ab == pt && a_clean;  // (else A is read where it is stored, or dv reads a_in whole)
      gemm_trans(false, true, rows, c, E, gb + i0 * E, E, vb, E, dt, c);  // dA
      for (int64_t i = i0; i < i1; ++i) {
        T* pr = pt + (i - i0) * c;
        T* d = dt + (i - i0) * c;
        const int64_t kc = detail::attention_kept(i, N, diagonal);
        const int64_t kr = whole ? N : kc;  // the entries r reads
        const int64_t row = (b * M + i) * N;
        const T* p = p_in ? p_in + row : pr;
        if (!p_in) {
          std::copy(s_in + row, s_in + row + kc, pr);
          detail::attention_softmax(pr, kc);
        }
        if (drop) {
          detail::attention_keep(seed, site, base + static_cast<uint64_t>(i) * N, threshold, kr, keep);
          detail::attention_apply_keep(d, keep, kr, keep_scale);  // dP
        }
        const T r = detail::attention_row_dot<T>(d, p, kr);
        for (int64_t j = 0; j < kc; ++j) d[j] = p[j] * (d[j] - r) * sc;  // dS
        std::fill(d + kc, d + c, T(0));
        if (make_a && a_in) {
          std::copy(a_in + row, a_in + row + kc, pr);
          std::fill(pr + kc, pr + c, T(0));
        } else if (make_a) {  // A from P over the entries r read (a row of a whole block: every one, as the pieces' A)
          if (p_in) std::copy(p, p + kr, pr);
          if (drop) detail::attention_apply_keep(pr, keep, kr, keep_scale);
          std::fill(pr + kr, pr + c, T(0));
        }
      }
      gemm(rows, D, c, dt, c, kb, D, dqb + i0 * D, D);                            // dq = dS k
      gemm_trans_acc(true, false, c, D, rows, dt, c, qb + i0 * D, D, dkb, D);     // dk += dS^T q
      if (!a_clean)  // dv += a^T g over every column: a_in's masked entries are not all 0
        gemm_trans_acc(true, false, N, E, rows, a_in + (b * M + i0) * N, N, gb + i0 * E, E, dvb, E);
      else
        gemm_trans_acc(true, false, c, E, rows, ab, ab == pt ? c : N, gb + i0 * E, E, dvb, E);  // dv += A^T g
    }
  }
}

}  // namespace coconet
