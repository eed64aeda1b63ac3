"""Pipeline orders (coconetc/pipeline/orders.py): every order is complete and deadlock-free, its
simulated bubble and peak activations are the textbook ones, and bad orders and arguments are
refused with messages that name the rank and the way out."""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter
from fractions import Fraction

import pytest

from coconetc.pipeline import ORDERS, Action, Costs, Order, check, default_chunks, make, predicted_bubble, render
from coconetc.pipeline import chart, simulate

UNIT = Costs(forward=1, backward=2, input_grad=1, weight_grad=1, transfer=0)


def grid() -> list[tuple[str, int, int, int]]:
    """(order, P, M, V) for P in 1..4, M in 1..8; interleaved with V=2 where P divides M,
    zero_bubble_v with its V=2."""
    cases = []
    for name in ORDERS:
        for P in range(1, 5):
            for M in range(1, 9):
                if name != "interleaved" or M % P == 0:
                    cases.append((name, P, M, default_chunks(name)))
    return cases


@pytest.mark.parametrize("name,P,M,V", grid())
def test_every_order_is_complete_and_runs(name: str, P: int, M: int, V: int) -> None:
    order = make(name, P, M, V)
    check(order)
    assert (order.ranks, order.microbatches, order.chunks, order.stages) == (P, M, V, P * V)
    assert order.split_backward == (name in ("zero_bubble", "zero_bubble_h2", "zero_bubble_v"))
    kinds = "FBW" if order.split_backward else "FB"
    done = Counter((order.stage(r, a.chunk), a.microbatch, a.kind)
                   for r, acts in enumerate(order.actions) for a in acts)
    assert done == Counter({(s, m, k): 1 for s in range(P * V) for m in range(M) for k in kinds})
    # It runs under any costs, latency included; every action once, each after what it needs.
    t = simulate(order, Costs(forward=1, backward=3, input_grad=2, weight_grad=1, transfer=0.5))
    assert len(t.slots) == len(done)
    assert t.makespan == max(s.end for s in t.slots)


def test_stage_and_place_are_megatrons_mapping() -> None:
    order = make("interleaved", 4, 8, 2)
    assert [order.stage(r, 0) for r in range(4)] == [0, 1, 2, 3]
    assert [order.stage(r, 1) for r in range(4)] == [4, 5, 6, 7]
    assert all(order.place(order.stage(r, c)) == (r, c) for r in range(4) for c in range(2))
    with pytest.raises(ValueError, match="no stage 8: the order has stages 0..7"):
        order.place(8)


def test_orders_as_the_references_write_them() -> None:
    F, B, W = (lambda m, c=0, k=k: Action(k, m, c) for k in "FBW")
    assert make("gpipe", 2, 3).actions[1] == (F(0), F(1), F(2), B(0), B(1), B(2))
    assert make("1f1b", 3, 4).actions == (
        (F(0), F(1), F(2), B(0), F(3), B(1), B(2), B(3)),
        (F(0), F(1), B(0), F(2), B(1), F(3), B(2), B(3)),
        (F(0), B(0), F(1), B(1), F(2), B(2), F(3), B(3)))
    # ZB-H1: rank r holds back the W of its first r steady steps until the end.
    assert make("zero_bubble", 2, 3).actions == (
        (F(0), F(1), B(0), W(0), F(2), B(1), W(1), B(2), W(2)),
        (F(0), B(0), F(1), B(1), W(0), F(2), B(2), W(1), W(2)))
    # ZB-H2, P=2, M=4 (3 micro-batches held at most): rank 0 runs a third forward before its
    # first B; W's run where the rank would wait (W0: the limit stops F3, B1 is not back yet)
    # and at the end.
    assert make("zero_bubble_h2", 2, 4).actions == (
        (F(0), F(1), F(2), B(0), W(0), B(1), F(3), B(2), W(1), W(2), B(3), W(3)),
        (F(0), B(0), F(1), B(1), F(2), B(2), W(0), F(3), B(3), W(1), W(2), W(3)))
    # Megatron's interleaved, P=2, M=4, V=2: rank 1 warms up with (V-1)P = 2 forwards, then
    # 1F1B over microbatch groups of P through chunk 0 then chunk 1 (backward: 1 then 0).
    assert make("interleaved", 2, 4, 2).actions[1] == (
        F(0), F(1), F(0, 1), B(0, 1), F(1, 1), B(1, 1), F(2), B(0), F(3), B(1),
        F(2, 1), B(2, 1), F(3, 1), B(3, 1), B(2), B(3))


def bubble_exactly(name: str, P: int, M: int, V: int = 1) -> Fraction:
    """The simulated bubble under UNIT costs, as a fraction (all times are whole numbers)."""
    t = simulate(make(name, P, M, V), UNIT)
    busy = sum(Fraction(t.busy(r)) for r in range(P))
    assert t.bubble() == pytest.approx(float(1 - busy / (P * Fraction(t.makespan))), abs=1e-12)
    return 1 - busy / (P * Fraction(t.makespan))


@pytest.mark.parametrize("P", range(1, 5))
@pytest.mark.parametrize("M", range(1, 9))
def test_gpipe_and_1f1b_bubble_is_the_textbook_one(P: int, M: int) -> None:
    # Both take (M + P - 1)(F + B): P - 1 idle (F + B) periods per rank against M busy ones.
    expected = Fraction(P - 1, M + P - 1)
    assert bubble_exactly("gpipe", P, M) == expected
    assert bubble_exactly("1f1b", P, M) == expected
    assert predicted_bubble("1f1b", P, M) == pytest.approx(float(expected))


def test_bubbles_worked_by_hand() -> None:
    # P=2, M=4 (F=1, B=2; split B=W=1):
    # 1F1B: makespan (M+P-1)*3 = 15, busy 12 per rank: 1 - 24/30 = 1/5.
    # interleaved V=2: each rank runs 8 F and 8 B of 1 and 2: busy 24; makespan 27 (Megatron's
    #   (P-1)/(VM) bubble per busy time: 24 * 1/8 = 3): 1 - 48/54 = 1/9.
    # ZB-H1: rank 1 runs F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3 from t=1 to 13 with no gap, rank 0
    #   waits once (t=2..3, for B0): makespan 13 = 3M + (P-1), busy 12: 1 - 24/26 = 1/13.
    assert bubble_exactly("1f1b", 2, 4) == Fraction(1, 5)
    assert bubble_exactly("interleaved", 2, 4, 2) == Fraction(1, 9)
    assert bubble_exactly("zero_bubble", 2, 4) == Fraction(1, 13)
    assert simulate(make("zero_bubble", 2, 4), UNIT).makespan == 13
    # P=4, M=8: 1F1B 3/11 (makespan 33, busy 24); interleaved V=2 makespan 48 + 9 = 57, busy
    # 48: 3/19; ZB-H1 makespan 3*8 + 3 = 27, busy 24: 3/27 = 1/9, 11/27 of 1F1B's (the paper's
    # (P-1)(F+B-W) = 3 idle per rank against 1F1B's (P-1)(F+B+W) = 9).
    assert bubble_exactly("1f1b", 4, 8) == Fraction(3, 11)
    assert bubble_exactly("interleaved", 4, 8, 2) == Fraction(3, 19)
    assert bubble_exactly("zero_bubble", 4, 8) == Fraction(1, 9)
    for name, P, M, V in [("interleaved", 2, 4, 2), ("interleaved", 4, 8, 2),
                          ("zero_bubble", 2, 4, 1), ("zero_bubble", 4, 8, 1)]:
        simulated = bubble_exactly(name, P, M, V)
        assert predicted_bubble(name, P, M, V) == pytest.approx(float(simulated))


@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("M", range(2, 9))
def test_interleaved_and_zero_bubble_beat_1f1b(P: int, M: int) -> None:
    one_f_one_b = bubble_exactly("1f1b", P, M)
    if M % P == 0:
        assert bubble_exactly("interleaved", P, M, 2) < one_f_one_b
        assert bubble_exactly("interleaved", P, M, 4) < bubble_exactly("interleaved", P, M, 2)
    zb = bubble_exactly("zero_bubble", P, M)
    assert zb < one_f_one_b
    if M >= 2 * P:
        assert zb <= one_f_one_b / 2
    # ZB-H1's idle time (P-1)(F+B-W) per rank, M >= P.
    if M >= P:
        assert zb == Fraction(P - 1, 3 * M + P - 1)


@pytest.mark.parametrize("P", range(1, 5))
@pytest.mark.parametrize("M", range(1, 9))
def test_zero_bubble_h2_trades_memory_for_the_bubble(P: int, M: int) -> None:
    """ZB-H2 holds up to 2P - 1 micro-batches a rank and idles no longer than ZB-H1: as long
    with F = B = W (both then idle only while the pipeline fills), less where B takes longer
    than W (ZB-H1 idles (P-1)(F+B-W) a rank)."""
    h2, h1 = make("zero_bubble_h2", P, M), make("zero_bubble", P, M)
    unit = simulate(h2, UNIT)
    assert bubble_exactly("zero_bubble_h2", P, M) == bubble_exactly("zero_bubble", P, M)
    assert max(unit.peak_activations(r) for r in range(P)) <= min(2 * P - 1, M)
    longer_b = Costs(forward=2, backward=5, input_grad=3, weight_grad=2)
    assert simulate(h2, longer_b).bubble() <= simulate(h1, longer_b).bubble() + 1e-12
    assert predicted_bubble("zero_bubble_h2", P, M, costs=longer_b) == simulate(h2, longer_b).bubble()


@pytest.mark.parametrize("P", range(1, 5))
@pytest.mark.parametrize("M", range(1, 9))
def test_zero_bubble_v_idles_least_at_1f1bs_memory(P: int, M: int) -> None:
    """ZB-V: rank r runs virtual stages r and 2P - 1 - r (the V), so the first and the last are
    rank 0's; it holds at most 2 min(P, M) chunk activations a rank, each half a stage's, so
    1F1B's peak on 1F1B's rank 0, and idles less than ZB-H2 (which holds up to 2P - 1 whole
    stages'), at most a third of 1F1B's bubble once there are P micro-batches."""
    order = make("zero_bubble_v", P, M)
    assert order.chunks == 2 and order.split_backward
    assert [(order.stage(r, 0), order.stage(r, 1)) for r in range(P)] == [(r, 2 * P - 1 - r) for r in range(P)]
    assert all(order.place(order.stage(r, c)) == (r, c) for r in range(P) for c in range(2))
    assert order.place(0)[0] == order.place(2 * P - 1)[0] == 0
    unit = simulate(order, UNIT)
    assert max(unit.peak_activations(r) for r in range(P)) == 2 * min(P, M)
    assert 2 * simulate(make("1f1b", P, M), UNIT).peak_activations(0) == 2 * min(P, M)
    zbv, one_f_one_b = bubble_exactly("zero_bubble_v", P, M, 2), bubble_exactly("1f1b", P, M)
    assert zbv <= bubble_exactly("zero_bubble_h2", P, M)
    if P > 1 and M >= P:
        assert zbv <= one_f_one_b / 3
    longer_b = Costs(forward=2, backward=5, input_grad=3, weight_grad=2)
    assert predicted_bubble("zero_bubble_v", P, M, 2, costs=longer_b) == simulate(order, longer_b).bubble()
    with pytest.raises(ValueError, match="order 'zero_bubble_v' runs 2 model chunks a rank .* not chunks=1"):
        make("zero_bubble_v", P, M, 1)


@pytest.mark.parametrize("name", ["zero_bubble_h2", "zero_bubble_v"])
def test_list_scheduled_orders_are_built_for_the_times_given(name: str) -> None:
    """make(..., costs=): the lists built for measured times (a B longer than its W, the first
    and last stages slower) end no later under them than those built for F = B = W, and keep
    to the order's memory; for ZB-V at P=2, M=8 (bench/pipeline.py's times) they idle half as
    long. Random times never leave a rank stuck (each order checked)."""
    import random
    rng = random.Random(3)
    for P, M in [(2, 4), (2, 8), (3, 5), (4, 8)]:
        V = default_chunks(name)
        for _ in range(8):
            costs = [Costs(forward=rng.uniform(0.5, 2), input_grad=rng.uniform(0.5, 2.5),
                           weight_grad=rng.uniform(0.3, 1.5)) for _ in range(P * V)]
            timed = make(name, P, M, costs=costs)
            check(timed)
            t = simulate(timed, costs)
            assert t.makespan <= simulate(make(name, P, M), costs).makespan + 1e-9
            assert max(t.peak_activations(r) for r in range(P)) <= (2 * P if V == 2 else 2 * P - 1)
    if name == "zero_bubble_v":
        first_last = Costs(forward=7.5, input_grad=8.7, weight_grad=6.5)
        middle = Costs(forward=6.9, input_grad=7.8, weight_grad=6.5)
        costs = [first_last, middle, middle, first_last]
        unit, timed = simulate(make(name, 2, 8), costs).bubble(), simulate(make(name, 2, 8, costs=costs), costs).bubble()
        assert timed < unit / 2, (timed, unit)
    with pytest.raises(ValueError, match="3 stages' costs for an order of"):
        make(name, 2, 4, costs=[Costs()] * 3)


def test_zero_bubble_h2_worked_by_hand() -> None:
    # P=2, M=4, F=2, B=3, W=2 (1F1B's backward 5): 1F1B takes (M+P-1)(F+B+W) = 35, busy 28 a
    # rank: bubble 1/5. ZB-H1 31: rank 0 waits 3 for B0 (F+B-W), rank 1 waits 2 at the start,
    # 1 at the end: 6/62. ZB-H2 30: rank 0's F2 fills 2 of its wait; rank 1 waits 2 at the
    # start, rank 0 waits 1 for B0 and 1 at the end: 4/60, a third of 1F1B's.
    costs = Costs(forward=2, backward=5, input_grad=3, weight_grad=2)
    one, h1, h2 = (simulate(make(name, 2, 4), costs) for name in ("1f1b", "zero_bubble", "zero_bubble_h2"))
    assert (one.makespan, h1.makespan, h2.makespan) == (35, 31, 30)
    assert (one.bubble(), h1.bubble(), h2.bubble()) == pytest.approx((1 / 5, 6 / 62, 4 / 60))
    assert [h2.peak_activations(r) for r in range(2)] == [3, 3]


@pytest.mark.parametrize("P", range(1, 5))
@pytest.mark.parametrize("M", range(1, 9))
def test_peak_activations(P: int, M: int) -> None:
    gpipe = simulate(make("gpipe", P, M), UNIT)
    ofob = simulate(make("1f1b", P, M), UNIT)
    zb = simulate(make("zero_bubble", P, M), UNIT)
    for r in range(P):
        assert gpipe.peak_activations(r) == M
        assert ofob.peak_activations(r) == min(P - r, M)
        # ZB-H1 keeps 1F1B's peak memory, min(P, M) on 1F1B's rank 0, but on every rank.
        assert zb.peak_activations(r) <= ofob.peak_activations(0)
    assert zb.peak_activations(0) == ofob.peak_activations(0)


def edit(order: Order, rank: int, actions: list[Action]) -> Order:
    lists = list(order.actions)
    lists[rank] = tuple(actions)
    return dataclasses.replace(order, actions=tuple(lists))


def test_check_refuses_a_missing_backward() -> None:
    order = make("1f1b", 2, 2)
    bad = edit(order, 1, [a for a in order.actions[1] if a != Action("B", 1)])
    with pytest.raises(ValueError, match=r"rank 1 never runs B1 \(stage 1\)"):
        check(bad)


def test_check_refuses_a_weight_gradient_before_its_backward() -> None:
    order = make("zero_bubble", 2, 2)
    acts = list(order.actions[0])
    assert acts[:4] == [Action("F", 0), Action("F", 1), Action("B", 0), Action("W", 0)]
    bad = edit(order, 0, [acts[0], acts[1], acts[3], acts[2], *acts[4:]])
    with pytest.raises(ValueError, match=r"rank 0 waits at action 2 \(W0, stage 0\) for B0 \(stage "
                                         r"0, rank 0\), which comes after it on the same rank"):
        check(bad)


def test_check_refuses_ranks_waiting_on_each_other() -> None:
    # Rank 1 runs F1 first: it waits for rank 0's F1, which comes after rank 0's B0, which
    # waits for rank 1's B0.
    order = make("1f1b", 2, 2)
    assert order.actions[0] == (Action("F", 0), Action("F", 1), Action("B", 0), Action("B", 1))
    bad = edit(edit(order, 0, [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)]),
               1, [Action("F", 1), Action("F", 0), Action("B", 0), Action("B", 1)])
    with pytest.raises(ValueError, match="deadlocks") as e:
        check(bad)
    msg = str(e.value)
    assert msg == ("order '1f1b' deadlocks: rank 0 waits at action 1 (B0, stage 0) for B0 "
                   "(stage 1, rank 1); rank 1 waits at action 0 (F1, stage 1) for F1 (stage 0, "
                   "rank 0)")
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(bad)


def test_check_refuses_other_malformed_orders() -> None:
    order = make("1f1b", 2, 2)
    with pytest.raises(ValueError, match=r"rank 1, action 1 \(W0\): a W, but the order does not "
                                         "split the backward"):
        check(edit(order, 1, [Action("F", 0), Action("W", 0), *order.actions[1][1:]]))
    with pytest.raises(ValueError, match=r"rank 0, action 4 \(F1\): runs twice"):
        check(edit(order, 0, [*order.actions[0], Action("F", 1)]))
    with pytest.raises(ValueError, match=r"rank 1, action 0 \(F0.1\): chunk 1 is not on this "
                                         r"rank, which holds chunks 0..0 \(stages 1\)"):
        check(edit(order, 1, [Action("F", 0, 1), *order.actions[1][1:]]))
    with pytest.raises(ValueError, match="micro-batch 2 is not in 0..1"):
        check(edit(order, 1, [Action("F", 2), *order.actions[1][1:]]))
    with pytest.raises(ValueError, match="action lists for 1 ranks, not for its ranks=2"):
        check(dataclasses.replace(order, actions=order.actions[:1]))


@pytest.mark.parametrize("args,message", [
    (("pipedream", 2, 4), "unknown pipeline order 'pipedream'; the orders are gpipe, 1f1b, "
                          "interleaved, zero_bubble, zero_bubble_h2"),
    (("1f1b", 0, 4), "ranks=0: a pipeline needs at least one rank"),
    (("1f1b", 4, 0), r"microbatches=0: .* \(use microbatches=4 or more"),
    (("interleaved", 2, 4, 0), "chunks=0: each rank holds at least one model chunk"),
    (("1f1b", 2, 4, 2), "order '1f1b' runs one model chunk per rank, not chunks=2: use chunks=1, "
                        "or order 'interleaved'"),
    (("interleaved", 2, 4, 1), "order 'interleaved' needs at least 2 model chunks per rank, not "
                               "chunks=1: use chunks=2, or order '1f1b'"),
    (("interleaved", 4, 6, 2), "needs microbatches divisible by ranks .* not microbatches=6 with "
                               "ranks=4: use microbatches=4 or microbatches=8"),
    (("interleaved", 4, 3, 2), "not microbatches=3 with ranks=4: use microbatches=4$"),
])
def test_make_refuses_bad_arguments(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make(*args)
    with pytest.raises(ValueError, match=message):
        predicted_bubble(*args)


def test_render() -> None:
    text = render(simulate(make("1f1b", 4, 8), UNIT), width=66)
    lines = text.splitlines()
    assert lines[0] == "1f1b: 4 ranks, 8 micro-batches; makespan 33"
    assert [line[:8] for line in lines[1:5]] == [f"rank {r} |" for r in range(4)]
    assert all(len(line) == 8 + 66 + 1 for line in lines[1:5])
    # 2 columns per unit of time: rank 3 starts after 3 forwards, then F0 and B0 back to back.
    assert lines[4][8:8 + 12] == "......F0B0  "
    assert lines[5] == ("bubble 0.2727 (27.3%); peak activations: rank 0 4, rank 1 3, rank 2 2, "
                        "rank 3 1")
    # Where labels do not fit, kinds only (lower case for chunk 1), and the width that fits.
    dense = render(simulate(make("interleaved", 8, 16, 2), UNIT)).splitlines()
    assert len(dense) == 1 + 8 + 2
    assert dense[1].startswith("rank 0 |FFFFFFFfffffffFFFFFF......bFb-")
    assert dense[9] == "(kinds only: micro-batches show at width=702)"
    assert dense[10].startswith("bubble 0.1795 (17.9%); peak activations: rank 0 23, ")
    wide = render(simulate(make("interleaved", 8, 16, 2), UNIT), width=702).splitlines()
    assert len(wide) == 1 + 8 + 1 and wide[1].startswith("rank 0 |F0.0  F1.0  F2.0 ")


def test_chart_without_matplotlib_says_how_to_get_it(monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    from coconetc.paths import install_command
    with pytest.raises(RuntimeError) as e:
        chart(simulate(make("1f1b", 2, 2)), str(tmp_path / "t.png"))
    assert str(e.value) == f"chart needs matplotlib: {install_command('bench')}"  # (the bench extra's packages)
    assert "matplotlib" in install_command("bench") and "coconet[" not in str(e.value)


def test_chart_writes_a_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "zb.png"
    chart(simulate(make("zero_bubble", 4, 8)), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_takes_each_stages_costs() -> None:
    """One Costs a virtual stage: the same for every stage is the single Costs' timeline. With
    the last stage twice as slow (the head and the loss: F 2, B 4), 1F1B on 2 ranks and 4
    micro-batches, worked by hand: rank 1 runs F0 at 1-3, then B0 F1 B1 F2 B2 F3 B3 back to back
    (each waiting for nothing of rank 0's) to 25, and rank 0's B3 runs at 25-27."""
    o = make("1f1b", 2, 4)
    c = Costs(1, 2, 1, 1, 0)
    assert simulate(o, [c, c]) == simulate(o, c)
    assert simulate(o, [c, Costs(2, 4, 2, 2, 0)]).makespan == 27
    with pytest.raises(ValueError, match="3 stages' costs for an order of 2 virtual stages"):
        simulate(o, [c, c, c])
    # one action's own time (a measured step replayed): rank 1's B0 takes 6 (2-8), so rank 0's
    # B0 waits for it (8-10) and the rest follow: rank 0's F2 10-11, B1 11-13 (rank 1's B1 ends
    # at 11), F3 13-14, B2 14-16; rank 1's B3 15-17, then rank 0's 17-19
    t = simulate(o, c, times={(1, Action("B", 0)): 6})
    assert t.makespan == 19 and [(x.start, x.end) for x in t.slots if x.rank == 0][2:] == \
        [(8, 10), (10, 11), (11, 13), (13, 14), (14, 16), (17, 19)]
    # a step's warm-up: each rank's first action 0.5 longer (GPipe, 2 ranks, 1 micro-batch: rank
    # 0's F0 0-1.5, rank 1's F0 1.5-3 and B0 3-5, rank 0's B0 5-7; each rank busy 3.5 of 7)
    w = simulate(make("gpipe", 2, 1), Costs(1, 2, 1, 1, 0, first=0.5))
    assert [(x.rank, x.start, x.end) for x in w.slots] == [(0, 0, 1.5), (0, 5, 7), (1, 1.5, 3), (1, 3, 5)]
    assert w.bubble() == 0.5
    # the runtime's time between two actions of a rank: idle, not before a rank's first action
    # (GPipe, 2 ranks, 2 micro-batches, gap 0.5: rank 0's F1 at 1.5-2.5, rank 1's F0 at 1-2)
    g = simulate(make("gpipe", 2, 2), Costs(1, 2, 1, 1, 0, gap=0.5))
    assert [(x.start, x.end) for x in g.slots if x.action.kind == "F"] == [(0, 1), (1.5, 2.5), (1, 2), (2.5, 3.5)]
