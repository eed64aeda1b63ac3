// overlap.h: a matmul producer computed chunk by chunk (rows), each chunk's communication
// started as a task right after it is produced: allreduce, reduce_scatter and allgather along
// the columns, a fused reduce-scatter + compute + all-gather (the Megatron mlp_out pattern) and
// a fused allreduce + compute.  Results must equal the blocking, unchunked collectives.
#include "coconet/collectives.h"
#include "coconet/fused.h"
#include "coconet/gemm.h"
#include "coconet/overlap.h"
#include "test_util.h"

namespace t {
namespace {

struct Problem {
  int64_t M, K, N;
  std::vector<float> x, w, y;  // y = x w, this rank's partial product
};

Problem make_problem(int rank, int64_t M, int64_t K, int64_t N) {
  Problem p{M, K, N, real_data<float>(1, rank, M * K), real_data<float>(2, rank, K * N), {}};
  p.y.resize(size_t(M * N));
  matmul(p.x.data(), p.w.data(), p.y.data(), M, K, N);
  return p;
}

// Rows [r.begin, r.end) of y = x w.
void produce_rows(Problem& p, std::vector<float>& y, Range r) {
  matmul(p.x.data() + r.begin * p.K, p.w.data(), y.data() + r.begin * p.N, r.size(), p.K, p.N);
}

void overlap_collectives(Comm& c, int64_t M, int64_t N, int chunks) {
  Problem p = make_problem(c.rank, M, 5, N);
  Range cols = slice_range(N, c.size, c.rank);
  int64_t sN = cols.size();
  std::vector<float> y(size_t(M * N)), ar(y.size()), rs(size_t(M * sN)), ag(y.size());
  overlap(chunks, [&](int i) { produce_rows(p, y, slice_range(M, chunks, i)); },
          [&](int i, int channel) {
            Range r = slice_range(M, chunks, i);
            return start_allreduce(Op::sum, y.data() + r.begin * N, ar.data() + r.begin * N, r.size() * N, c, channel);
          });
  std::vector<float> want(y.size());
  allreduce(Op::sum, p.y.data(), want.data(), M * N, c);
  std::string what = label("M =", M, "N =", N, "chunks", chunks);
  same(ar, want, 1e-5, "overlap allreduce " + what);
  // reduce-scatter along the columns, then gather the slices back.
  std::vector<float> y2(y.size());
  overlap(chunks, [&](int i) { produce_rows(p, y2, slice_range(M, chunks, i)); },
          [&](int i, int channel) {
            Range r = slice_range(M, chunks, i);
            return start_reduce_scatter(Op::avg, y2.data() + r.begin * N, rs.data() + r.begin * sN, r.size(), N, 1, c, channel);
          });
  std::vector<float> rs_want(rs.size());
  reduce_scatter(Op::avg, p.y.data(), rs_want.data(), M, N, 1, c);
  same(rs, rs_want, 1e-5, "overlap reduce_scatter " + what);
  Overlap ov;
  for (int i = 0; i < chunks; ++i) {
    Range r = slice_range(M, chunks, i);
    ov.add(start_allgather(rs.data() + r.begin * sN, ag.data() + r.begin * N, r.size(), N, 1, c, i + 1));
    ov.progress();
  }
  ov.wait_all();
  std::vector<float> ag_want(ag.size());
  allgather(rs.data(), ag_want.data(), M, N, 1, c);
  same(ag, ag_want, 0.0, "overlap allgather " + what);
}

// mlp_out: y [B, S, H] (here [M, N] rows = B*S... chunked along B), split along S, out =
// reduced + bias gathered everywhere; chunk i of B runs its own fused collective.
void overlap_fused(Comm& c, int64_t B, int64_t S, int64_t H, int chunks, int64_t fchunk) {
  Problem p = make_problem(c.rank, B * S, 3, H);
  std::vector<float> y(p.y.size()), out(y.size(), 0.f), bias = real_data<float>(3, 0, H);
  overlap(chunks, [&](int i) {
            Range b = slice_range(B, chunks, i);
            produce_rows(p, y, Range{b.begin * S, b.end * S});
          },
          [&](int i, int channel) {
            Range b = slice_range(B, chunks, i);
            int64_t base = b.begin * S * H, total = b.size() * S * H;
            auto compute = [&out, &bias, base, H](int64_t lo, int64_t hi, const float* red) {
              for (int64_t j = lo; j < hi; ++j) out[size_t(base + j)] = red[j - lo] + bias[size_t(j % H)];
            };
            return start_fused_rs_compute_ag<float>(Op::sum, Segments<const float>::one(y.data() + base, total),
                                                    Shape3{b.size(), S, H}, c, channel, fchunk, compute,
                                                    {gather_target(out.data() + base, total)});
          });
  std::vector<float> want(y.size());
  allreduce(Op::sum, p.y.data(), want.data(), int64_t(want.size()), c);
  for (size_t j = 0; j < want.size(); ++j) want[j] += bias[j % size_t(H)];
  same(out, want, 1e-5, label("overlap fused mlp_out B S H", B, S, H, "chunks", chunks, "fchunk", fchunk));
  // The same with fused allreduce + compute tasks.
  std::vector<float> out2(y.size(), 0.f);
  overlap(chunks, [&](int i) {
            Range b = slice_range(B, chunks, i);
            produce_rows(p, y, Range{b.begin * S, b.end * S});
          },
          [&](int i, int channel) {
            Range b = slice_range(B, chunks, i);
            int64_t base = b.begin * S * H;
            auto compute = [&out2, &bias, base, H](int64_t lo, int64_t hi, const float* red) {
              for (int64_t j = lo; j < hi; ++j) out2[size_t(base + j)] = red[j - lo] + bias[size_t((base + j) % H)];
            };
            return start_fused_allreduce_compute<float>(Op::sum, Segments<const float>::one(y.data() + base, b.size() * S * H),
                                                        c, channel, fchunk, compute);
          });
  same(out2, want, 1e-5, label("overlap fused allreduce B S H", B, S, H, "chunks", chunks));
}

}  // namespace

void test_overlap() {
  Comm c(MPI_COMM_WORLD, 1);
  for (int chunks : {1, 2, 3, 4, 5}) {
    overlap_collectives(c, 7, 6, chunks);
    overlap_collectives(c, 2, 1, chunks);
    overlap_fused(c, 4, 5, 8, chunks, 7);
    overlap_fused(c, 3, 2, 3, chunks, 1000);
  }
  overlap_collectives(c, 64, 300, 4);
  overlap_fused(c, 8, 33, 64, 4, 256);
}

}  // namespace t
