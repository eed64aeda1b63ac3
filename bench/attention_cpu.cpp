// The fused attention of runtime_cpp/coconet/attention.h timed alone (bench/attention_cpu.py builds
// and runs it): forward + backward at batch B, M = N = S, D = E = 64, f32, one thread, median of
// 5 after one warm-up.  Arguments: drop_p, mode (0: the forward writes p and the backward reads
// it; 1: s instead, so q k^T is computed whole and the backward recomputes p; 2: p and a; 3: s and a, as gpt_block's
// generated code; 4: p, the backward reading it as a backward program's input does, every entry of
// it and A = p, as a GPT block's backward program does), S, B.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#include "coconet/attention.h"
using namespace coconet;
using clk = std::chrono::steady_clock;
static double ms(clk::time_point a, clk::time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); }
int main(int argc, char** argv) {
  set_blas_threads(1);
  const int64_t S = argc > 3 ? std::atoll(argv[3]) : 512, B = argc > 4 ? std::atoll(argv[4]) : 64;
  const int64_t M = S, N = S, D = 64, E = 64;
  const double drop = argc > 1 ? std::atof(argv[1]) : 0.0;
  const int mode = argc > 2 ? std::atoi(argv[2]) : 0;
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> q(B * M * D), k(B * N * D), v(B * N * E), g(B * M * E), o(B * M * E), dq(q.size()), dk(k.size()), dv(v.size());
  std::vector<float> sp(B * M * N), a(mode == 2 || mode == 3 ? B * M * N : 0);
  const bool program = mode == 4;  // the saved p read whole, and as A
  float* ap = program ? sp.data() : a.empty() ? nullptr : a.data();
  const bool with_s = mode == 1 || mode == 3;
  for (auto* x : {&q, &k, &v, &g}) for (auto& e : *x) e = u(rng);
  const AttentionIndex at{1, 1, 0, 1};
  const double scale = 0.125;
  std::vector<double> tf, tb, tt;
  for (int rep = 0; rep < 6; ++rep) {
    auto t0 = clk::now();
    attention_fwd<float>(q.data(), k.data(), v.data(), o.data(), with_s ? sp.data() : nullptr, nullptr, with_s ? nullptr : sp.data(),
                         program ? nullptr : ap,
                         B, M, N, D, E, 0, scale, drop, 7, 99, at);
    auto t1 = clk::now();
    attention_bwd<float>(q.data(), k.data(), v.data(), with_s ? sp.data() : nullptr, with_s ? nullptr : sp.data(), ap, g.data(),
                         dq.data(), dk.data(), dv.data(), B, M, N, D, E, 0, scale, drop, 7, 99, at, program, program);
    auto t2 = clk::now();
    if (rep == 0) continue;  // warm-up
    tf.push_back(ms(t0, t1)); tb.push_back(ms(t1, t2)); tt.push_back(ms(t0, t2));
  }
  auto med = [](std::vector<double> x) { std::sort(x.begin(), x.end()); return x[x.size() / 2]; };
  std::printf("drop %.2f saved %s: fwd %.1f ms  bwd %.1f ms  total %.1f ms (median of 5)\n", drop, mode == 1 ? "s" : mode == 2 ? "p,a" : mode == 3 ? "s,a" : mode == 4 ? "p (read whole)" : "p", med(tf), med(tb), med(tt));
}
