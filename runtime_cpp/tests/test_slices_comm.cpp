// slices.h (the partition rule) and comm.h (groups, peers, the Comm cache).
#include <stdexcept>

#include "coconet/slices.h"
#include "test_util.h"

namespace t {
namespace {

// slice_range covers [0, n) in order, with sizes ceil(n/R) except at the end.
void test_partition() {
  long bad = 0;
  for (int64_t n = 0; n <= 40; ++n) {
    for (int64_t R = 1; R <= 6; ++R) {
      int64_t c = (n + R - 1) / R, at = 0;
      for (int64_t i = 0; i < R; ++i) {
        Range r = slice_range(n, R, i);
        bad += r.begin != std::min(i * c, n) || r.end != std::min((i + 1) * c, n);
        bad += r.begin != at || r.size() < 0;
        bad += slice_counts(n, R)[size_t(i)] != r.size() || slice_displs(n, R)[size_t(i)] != r.begin;
        at = r.end;
      }
      bad += at != n;
    }
  }
  check(bad == 0, label("partition rule violations:", bad));
  check(slice_counts(5, 4) == std::vector<int64_t>({2, 2, 1, 0}), "n=5 R=4 sizes 2 2 1 0");
  check(slice_counts(2, 4) == std::vector<int64_t>({1, 1, 0, 0}), "n=2 R=4 sizes 1 1 0 0");
  Shape3 s = shape3({2, 3, 5, 7}, 2);
  check(s.outer == 6 && s.n == 5 && s.inner == 7, "shape3 around dim 2");
}

// Every G that divides W: consecutive groups, in-group ranks, next/prev peers.
void test_groups() {
  int W, me;
  MPI_Comm_size(MPI_COMM_WORLD, &W);
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  for (int G = 1; G <= W; ++G) {
    if (W % G) continue;
    Comm c(MPI_COMM_WORLD, G);
    int S = W / G;
    bool ok = c.size == S && c.groups == G && c.group_index == me / S && c.rank == me % S;
    ok = ok && c.next_peer == (me / S + 1 < G ? me + S : MPI_PROC_NULL);
    ok = ok && c.prev_peer == (me / S > 0 ? me - S : MPI_PROC_NULL);
    int gs = 0, gr = 0;
    MPI_Comm_size(c.group, &gs);
    MPI_Comm_rank(c.group, &gr);
    check(ok && gs == S && gr == me % S, label("groups G =", G));
    int sum = 0, one = me;  // the group holds consecutive world ranks
    MPI_Allreduce(&one, &sum, 1, MPI_INT, MPI_SUM, c.group);
    int first = (me / S) * S;
    check(sum == S * first + S * (S - 1) / 2, label("group members G =", G));
  }
}

// Groups that do not divide W, or G < 1, are argument errors (thrown before communicating).
void test_bad_groups() {
  int W;
  MPI_Comm_size(MPI_COMM_WORLD, &W);
  for (int G : {0, -1, W + 1, W == 4 ? 3 : W == 3 ? 2 : W + 2}) {
    bool threw = false;
    try {
      Comm c(MPI_COMM_WORLD, G);
    } catch (const std::invalid_argument& e) {
      threw = std::string(e.what()).find("groups") != std::string::npos;
    }
    check(threw, label("groups", G, "rejected with W =", W));
  }
}

// cached_comm returns one Comm per (communicator, G); channels are distinct communicators.
void test_cache_and_channels() {
  Comm& a = cached_comm(MPI_COMM_WORLD, 1);
  Comm& b = cached_comm(MPI_COMM_WORLD, 1);
  check(&a == &b, "cached_comm returns the same Comm");
  MPI_Comm user;
  MPI_Comm_dup(MPI_COMM_WORLD, &user);
  Comm& c = cached_comm(user, 1);
  check(&c != &a, "another communicator gets another Comm");
  int cmp = 0;
  MPI_Comm_compare(c.channel(1), c.channel(2), &cmp);
  check(cmp == MPI_CONGRUENT && c.channel(0) == c.group, "channels are private dups");
  MPI_Comm_free(&user);  // the attribute's delete callback frees the cached Comm
}

}  // namespace

void test_slices_and_comm() {
  test_partition();
  test_groups();
  test_bad_groups();
  test_cache_and_channels();
}

}  // namespace t
