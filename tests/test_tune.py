"""The autotuner: the cost model against hand-computed numbers, the schedules it writes (all
legal, all giving the interpreter's results), the tuning cache, `coconetc explain` and
`show -s auto`, and (slow) a real `coconetc tune` run on 2 ranks whose choice a call with
schedule="auto" then runs."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from coconetc import cli
from coconetc.sourcefile import add_schedules, load_file
from coconetc.oracle.compare import compare
from coconetc.oracle.inputs import adapt_inputs, random_inputs
from coconetc.interp.interpreter import run
from coconetc.ir import printer
from coconetc.launch.mpiexec import run_python
from coconetc.plan.targets import Target
from coconetc.schedule import apply_all
from coconetc.runtime import tuned
from coconetc.plan.cost import Machine, cost
from coconetc.tune.space import candidates, state_params
from coconetc.tune import tuner
from coconetc.tune.tuner import prune

REPO = Path(__file__).resolve().parents[1]
ADAM = REPO / "examples" / "adam.ccn"
SGD = REPO / "examples" / "sgd.ccn"
EXAMPLES = ["adam.ccn", "sgd.ccn", "lamb.ccn", "mlp_out.ccn", "layernorm.ccn", "pipeline.ccn",
            "tp_overlap.ccn", "collectives.ccn", "clipped_sgd.ccn", "mixed_adam.ccn"]


@pytest.fixture(autouse=True)
def tuning_file(tmp_path, monkeypatch):
    """Every test reads and writes its own tuning cache (never the user's)."""
    path = tmp_path / "tuning.json"
    monkeypatch.setenv(tuned.ENV_TUNING, str(path))
    return path


def invoke(*args):
    return CliRunner().invoke(cli.main, [str(a) for a in args])


# --- the cost model ---------------------------------------------------------------------
@pytest.mark.parametrize("R", [1, 2, 3, 4])
def test_cost_of_adam_default_rs_c_ag_and_zero(example, R: int) -> None:
    """f32 Adam at N = 1000 (R = 3 does not divide it); formulas written out independently."""
    mod, N = example("adam.ccn"), 1000
    f = (R - 1) / R
    E = math.ceil(N / R)  # rank 0's slice
    b = 4  # bytes per f32
    # default: allreduce (in, out, received) + one loop reading g1, m, v, w and writing m, v, w
    d = cost(mod.plans[("adam", "default")], {"N": N}, R)
    assert d.sent == pytest.approx(2 * f * b * N)
    assert d.moved == pytest.approx(b * N + b * N + 2 * f * b * N + 4 * b * N + 3 * b * N)
    assert (d.passes, d.launches, d.units) == (3, 2, 2)
    # rs_c_ag: reducescatter, a loop over the slice, three allgathers (m, v, w)
    r = cost(mod.plans[("adam", "rs_c_ag")], {"N": N}, R)
    assert r.sent == pytest.approx(f * b * N + 3 * f * b * N)
    rs = b * N + b * E + f * b * N
    loop = 4 * b * E + 3 * b * E
    ag = b * E + b * N + f * b * N
    assert r.moved == pytest.approx(rs + loop + 3 * ag)
    assert (r.passes, r.launches) == (5, 5)
    # zero: one fused collective; the reduced gradient stays in registers, m and v are slices,
    # w is read at the slice and w1 written into agw (= w) in place; only w is gathered
    z = cost(mod.plans[("adam", "zero")], {"N": N}, R)
    assert z.sent == pytest.approx(f * b * N + f * b * N)
    assert z.moved == pytest.approx(b * N + f * b * N + 3 * b * E + 3 * b * E + f * b * N)
    assert (z.passes, z.launches, z.units) == (1, 1, 1)
    assert z.seconds() < d.seconds() or R == 1


def test_cost_names_the_algorithm_each_collective_runs(example) -> None:
    """The runtime's choice (collectives.h, fused_shm.h): the node's window from 16 KiB on one
    node, MPI below it and under @p2p (window=False), hierarchical over nodes; MPI's
    reduce-scatter counted at its measured rate."""
    mod = example("adam.ccn")
    plan = mod.plans[("adam", "rs_c_ag")]

    def algos(N: int, **kw) -> list[str]:
        return [part.algorithm for _, part in cost(plan, {"N": N}, 2, **kw).parts]

    # rs: a reduce-scatter, then a loop, then three all-gathers
    assert algos(1 << 20) == ["window", "", "window", "window", "window"]
    assert algos(1000) == ["mpi", "", "mpi", "mpi", "mpi"]  # 4000 bytes: under the window's minimum
    assert algos(1 << 20, window=False) == ["mpi", "", "mpi", "mpi", "mpi"]
    assert cost(plan, {"N": 1 << 20}, 4, nodes=2).parts[0][1].algorithm == "hierarchical"
    assert algos(1 << 20, nodes=2) == ["hierarchical", "", "hierarchical", "hierarchical", "hierarchical"]
    on, off = cost(plan, {"N": 1 << 20}, 2), cost(plan, {"N": 1 << 20}, 2, window=False)
    m = Machine()
    rs = 0.5 * 4 * (1 << 20)  # what the reduce-scatter sends: (R-1)/R of the f32 input
    assert (on.slow, off.slow) == (0.0, rs)
    assert off.seconds(m) - on.seconds(m) == pytest.approx(rs / m.mpi_reduce_scatter_bw - rs / m.link_bw)
    zero = cost(mod.plans[("adam", "zero")], {"N": 1 << 20}, 2)
    assert [p.algorithm for _, p in zero.parts] == ["window"]
    assert cost(mod.plans[("adam", "zero")], {"N": 1 << 20}, 2, window=False).parts[0][1].algorithm == "p2p"


def test_cost_counts_a_matmul_and_an_overlap(example) -> None:
    mod = example("mlp_out.ccn")
    sizes = {"B": 2, "S": 8, "K": 16, "H": 32}
    d = cost(mod.plans[("mlp_out", "default")], sizes, 2)
    assert d.flops == 2 * 2 * 8 * 32 * 8  # 2*M*N*K with this rank's K = 16 / 2
    o = cost(mod.plans[("mlp_out", "overlapped")], sizes, 2)
    assert o.flops == d.flops and o.launches > d.launches
    # the same allreduce, overlapped with its matmul in 2 chunks: half the shorter part hidden
    a = cost(mod.plans[("mlp_out", "overlap_ar")], sizes, 2)
    (gemm, comm, k), = a.pipelines
    m = Machine()
    assert k == 2 and a.seconds() == pytest.approx(
        a.moved / m.mem_bw + a.sent / m.link_bw + a.flops / m.flop_rate + a.launches * m.launch_s
        - min(gemm.seconds(), comm.seconds()) / 2)


# --- the schedules the tuner writes -----------------------------------------------------
def test_state_params() -> None:
    assert state_params(load_file(ADAM).programs["adam"]) == ["m", "v"]
    assert state_params(load_file(SGD).programs["sgd"]) == []
    assert state_params(load_file(REPO / "examples" / "lamb.ccn").programs["lamb"]) == ["m", "v"]


def test_adam_candidates_are_legal_and_new(example) -> None:
    mod = example("adam.ccn")
    cands = candidates(mod, "adam")
    labels = [c.label for c in cands]
    assert labels[:4] == ["default", "rs_c_ag", "zero", "fused"]
    generated = [c for c in cands if c.generated]
    assert generated and all(c.label.startswith("auto_") for c in generated)
    # a generated schedule equal to a hand-written one keeps the hand-written label
    assert "auto_fused_slice" not in labels and "auto_rs_c_ag" not in labels
    assert len({printer.program(c.ir) for c in cands}) == len(cands)
    base = mod.programs["adam"]
    for c in generated:
        assert printer.program(apply_all(base, c.directives)) == printer.program(c.ir)
        again = add_schedules(mod, c.text)  # the printed schedule checks back to the same program
        ir = again.schedule("adam", c.label).ir
        assert ir is not None and printer.program(ir) == printer.program(c.ir)
    conv = {c.label: c.convention for c in cands}
    assert conv["zero"] == "m: sliced(0), v: sliced(0)" and conv["default"] == conv["fused"] == ""


def test_overlaps_are_generated_for_a_matmul(example) -> None:
    labels = [c.label for c in candidates(example("mlp_out.ccn"), "mlp_out")]
    assert any("overlap4" in x for x in labels) and any("overlap8" in x for x in labels)


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_candidate_matches_the_interpreter(example, name: str) -> None:
    mod = example(name)
    for prog, base in mod.programs.items():
        sizes = {"N": 7, "B": 2, "S": 3, "K": 4, "H": 5, "M": 3}
        for R in (2, 3):
            inputs = random_inputs(base, R, 1, sizes, seed=R)
            ref = run(base, inputs)
            for c in candidates(mod, prog):
                s_in = adapt_inputs(inputs, base, c.ir)
                problems = compare(ref, run(c.ir, s_in), base, c.ir)
                assert not problems, (name, prog, c.label, R, problems[:3])


def test_prune_keeps_the_files_schedules(example) -> None:
    mod = example("mlp_out.ccn")
    cands = candidates(mod, "mlp_out")
    pr = prune(cands, {"B": 8, "S": 128, "K": 512, "H": 1024}, 2, keep=1.0)
    kept = {c.label for c in pr.measured}
    assert {"default", "overlapped", "rs_c_ag", "overlap_ar"} <= kept
    assert all(pr.modelled[c.label] <= min(pr.modelled.values()) + 1e-12 for c in pr.measured if c.generated)


def test_prune_models_simulated_nodes(example, monkeypatch) -> None:
    """Under COCONET_SIMULATE_NODES=K the pruning models the ranks on K nodes (the cost
    model's two levels): the modelled times are the cost model's over K nodes."""
    mod = example("adam.ccn")
    cands = candidates(mod, "adam")
    sizes = {"N": 1 << 20}
    flat = prune(cands, sizes, 4).modelled
    monkeypatch.setenv("COCONET_SIMULATE_NODES", "2")
    two = prune(cands, sizes, 4).modelled
    for c in cands:
        assert two[c.label] == pytest.approx(cost(c.plan, sizes, 4, 2).seconds())
    assert two["zero"] > flat["zero"]  # the network's bytes cost more


# --- the cache, explain, show -s auto ---------------------------------------------------
def _fake_record(mod, sizes: dict, R: int) -> dict:
    cands = {c.label: c for c in candidates(mod, "adam")}
    gen = "auto_rs_c_ag_slice"
    measured = {"default": 3e-3, "rs_c_ag": 4e-3, "zero": 2e-3, "fused": 3.5e-3, gen: 2.5e-3}
    rec = {"file": str(ADAM), "program": "adam", "sizes": sizes, "ranks": R, "groups": 1,
           "machine": tuned.machine(), "time": 1.0, "measured": measured, "choice": "zero",
           "by_convention": {"": "default", "m: sliced(0), v: sliced(0)": "zero"},
           "conventions": {k: cands[k].convention for k in measured},
           "generated": [gen], "schedules": {k: cands[k].text for k in measured},
           "modelled": {k: 1e-3 for k in measured}}
    tuned.store(tuned.key(mod.source, "adam", sizes, R), rec)
    return rec


def test_cache_key_and_tuned_schedules(example) -> None:
    mod = example("adam.ccn")
    assert tuned.lookup(mod.source, "adam", {"N": 64}, 2) is None
    _fake_record(mod, {"N": 64}, 2)
    assert tuned.lookup(mod.source, "adam", {"N": 64}, 2)["choice"] == "zero"
    assert tuned.lookup(mod.source, "adam", {"N": 64}, 3) is None
    assert tuned.lookup(mod.source + "\n", "adam", {"N": 64}, 2) is None  # the file changed
    assert tuned.tuned_schedules(mod.source) == ""  # the choices are hand-written


def test_the_overall_choice_or_how_to_make_one(example) -> None:
    """runtime/auto.choice, what fn.resolve_schedule("auto") and `coconetc run -s auto` ask
    (DistributedOptimizer allocates the state in the choice's layouts): the record's choice for
    these sizes and ranks, or an error naming the tune command."""
    from coconetc.runtime import auto
    mod = example("adam.ccn")
    with pytest.raises(ValueError, match=r"no choice for N=64 on 2 ranks on this machine; run "
                                         r"`coconetc tune F --program adam --ranks 2 --size N=64` first"):
        auto.choice(mod.source, "F", "adam", {"N": 64}, 2)
    _fake_record(mod, {"N": 64}, 2)
    assert auto.choice(mod.source, "F", "adam", {"N": 64}, 2) == auto.Chosen("zero")
    with pytest.raises(ValueError, match="no choice for N=65 on 2 ranks"):
        auto.choice(mod.source, "F", "adam", {"N": 65}, 2)


@pytest.mark.parametrize("label", ["default", "fused@p2p"])
def test_explain_takes_a_schedule_label(label) -> None:
    """explain -s takes a label as a call does: 'default' (the program) or 'fused@p2p'."""
    res = invoke("explain", SGD, "-s", label, "--size", "N=1024")
    assert res.exit_code == 0, res.output
    assert any(ln.startswith(label + " ") for ln in res.stdout.splitlines()), res.stdout
    bad = invoke("explain", SGD, "-s", "fused@nope", "--size", "N=1024")
    assert bad.exit_code == 1 and "unknown fused-collective algorithm 'nope'" in bad.output


def test_explain_prints_the_cost_model_and_measured_times(example) -> None:
    res = invoke("explain", ADAM, "--size", "N=1000", "--ranks", "3")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0].startswith("adam at N=1000 on 3 ranks")
    zero = next(x for x in lines if x.startswith("zero "))
    assert zero.split()[5:8] == ["1", "1", "1"]  # passes, launches, units
    assert zero.rstrip().endswith("-")  # nothing measured
    _fake_record(example("adam.ccn"), {"N": 1000}, 3)
    res = invoke("explain", ADAM, "--ranks", "3")  # sizes from the tuning record
    assert res.exit_code == 0, res.output
    assert "2.000 ms (tuner's choice)" in res.stdout
    assert "auto_rs_c_ag_slice" in res.stdout and "(generated)" in res.stdout
    one = invoke("explain", ADAM, "--ranks", "3", "-s", "auto")
    assert one.exit_code == 0 and one.stdout.splitlines()[2].startswith("zero ")
    assert one.stdout.splitlines()[3].split()[:3] == ["L23", "fused", "fused0"]  # one row per unit


def test_run_schedule_auto_runs_the_tuners_choice(example, capfd) -> None:
    """`run -s auto` runs the choice recorded for these sizes and ranks (a schedule the tuner
    wrote included) and compares it with the interpreter; with no record it names the command."""
    res = invoke("run", ADAM, "-s", "auto", "--ranks", "2", "--size", "N=65", "--interp")
    assert res.exit_code == 1 and "coconetc tune" in res.stderr and "--size N=65" in res.stderr
    rec = _fake_record(example("adam.ccn"), {"N": 65}, 2)
    res = invoke("run", ADAM, "-s", "auto", "--ranks", "2", "--size", "N=65", "--interp")
    assert res.exit_code == 0, res.output
    assert "the tuner's choice for N=65 on 2 ranks: zero" in res.stdout
    assert "adam [zero]: 2 ranks" in res.stdout and "match" in res.stdout
    rec["choice"] = gen = "auto_rs_c_ag_slice"
    tuned.store(tuned.key(example("adam.ccn").source, "adam", {"N": 65}, 2), rec)
    capfd.readouterr()
    res = invoke("run", ADAM, "-s", "auto", "--ranks", "2", "--size", "N=65")  # compiled, 2 ranks
    ranks_out = capfd.readouterr().out  # the ranks' lines (a subprocess)
    assert res.exit_code == 0, res.output + ranks_out
    assert f"the tuner's choice for N=65 on 2 ranks: {gen}" in res.stdout
    assert f"adam [{gen}]: 2 ranks" in ranks_out and "matches the interpreter on every rank" in ranks_out
    res = invoke("run", ADAM, "-s", "auto", "--ranks", "3", "--size", "N=65", "--interp")
    assert res.exit_code == 1 and "the tuning cache has no choice for N=65 on 3 ranks" in res.stderr


def test_algorithm_choice_in_show_explain_and_run(example) -> None:
    """A choice with a fused-collective algorithm ("zero@p2p") is the schedule zero: show -s
    auto prints zero's block, explain prints a row for each algorithm measured, run -s auto
    --interp runs zero."""
    rec = _fake_record(example("adam.ccn"), {"N": 64}, 2)
    rec["measured"]["zero@p2p"], rec["choice"] = 1.5e-3, "zero@p2p"
    rec["schedules"]["zero@p2p"] = rec["schedules"]["zero"]
    tuned.store(tuned.key(example("adam.ccn").source, "adam", {"N": 64}, 2), rec)
    res = invoke("show", ADAM, "-s", "auto")
    assert res.exit_code == 0, res.output
    assert "zero@p2p" in res.stdout.splitlines()[0] and "schedule zero for adam {" in res.stdout
    res = invoke("explain", ADAM, "--ranks", "2")
    rows = {x.split()[0]: x for x in res.stdout.splitlines()[2:]}
    assert "1.500 ms (tuner's choice)" in rows["zero@p2p"] and "2.000 ms" in rows["zero"]
    assert rows["zero@p2p"].split()[1:7] == rows["zero"].split()[1:7]  # the same plan, the same model
    res = invoke("run", ADAM, "-s", "auto", "--ranks", "2", "--size", "N=64", "--interp")
    assert res.exit_code == 0 and "adam [zero]: 2 ranks" in res.stdout, res.output


def test_tune_needs_every_size() -> None:
    res = invoke("tune", ADAM, "--ranks", "2")
    assert res.exit_code == 1 and "--size N=INT" in res.stderr and "Traceback" not in res.output


def test_show_auto(example) -> None:
    res = invoke("show", ADAM, "-s", "auto")
    assert res.exit_code == 1 and "coconetc tune" in res.stderr and "Traceback" not in res.output
    _fake_record(example("adam.ccn"), {"N": 64}, 2)
    res = invoke("show", ADAM, "-s", "auto")
    assert res.exit_code == 0, res.output
    assert "schedule zero for adam {" in res.stdout and "slice(m, v)" in res.stdout
    plan = invoke("show", ADAM, "-s", "auto", "--format", "plan")
    assert plan.stdout.startswith("plan adam [zero]")


# --- a real tuning run ------------------------------------------------------------------
AUTO_CALL = r"""
import copy
import sys
import numpy as np
import coconetc
from mpi4py import MPI
from coconetc.oracle.compare import compare
from coconetc.oracle.inputs import adapt_inputs, random_inputs
from coconetc.interp.interpreter import Result, run

comm = MPI.COMM_WORLD
rank, R = comm.Get_rank(), comm.Get_size()
backend = sys.argv[3]  # cuda: the CUDA module (under COCONET_CUDA_EMULATE=1, the host emulation)
mod = coconetc.load(sys.argv[1], log=lambda m: None, backend=backend)
fn = mod.adam
base = mod.source_module.programs["adam"]
inputs = random_inputs(base, R, 1, {"N": int(sys.argv[2])}, seed=5)
ref = run(base, inputs)
for want in sys.argv[4:]:
    ir = fn.schedules[want]
    mine = copy.deepcopy(adapt_inputs(inputs, base, ir)[rank])
    fn(schedule="auto", **mine)  # the arrays say which calling convention
    got = comm.allgather(Result({}, {t: np.asarray(mine[t]) for t, _ in ir.updates}, None))
    problems = compare(ref, got, base, ir)
    assert not problems, (want, problems)
print("auto ok", rank, sorted(fn.schedules), flush=True)
"""


@pytest.mark.slow
def test_tune_then_call_with_schedule_auto(tmp_path, tuning_file) -> None:
    out = tmp_path / "tune.json"
    res = invoke("tune", ADAM, "--ranks", "2", "--size", "N=1000", "--reps", "2", "--keep", "100",
                 "--json", out)
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert {"measured", "choice", "generated", "schedules"} <= set(data)
    assert data["choice"] in data["measured"] and data["generated"]
    assert set(data["generated"]) <= set(data["measured"]) <= set(data["schedules"])
    assert "schedule auto_" in "".join(data["schedules"][g] for g in data["generated"])
    best = min(data["measured"].values())
    assert data["measured"][data["choice"]] <= 1.05 * best  # the choice is the fastest verified
    # the fused-collective algorithm is a choice: each fused schedule also measured point-to-point
    assert {"zero@p2p", "fused@p2p"} <= set(data["measured"]) and "default@p2p" not in data["measured"]
    assert data["schedules"]["zero@p2p"] == data["schedules"]["zero"]
    # make the call-time choices schedules the tuner wrote, so that the module must carry them
    store = json.loads(tuning_file.read_text())
    (key, rec), = store.items()
    rec["by_convention"] = {"": "auto_split", "m: sliced(0), v: sliced(0)": "auto_rs_c_ag_slice"}
    tuning_file.write_text(json.dumps({key: rec}))
    script = tmp_path / "auto_call.py"
    script.write_text(AUTO_CALL)
    rc = run_python(2, [str(script), str(ADAM), "1000", "cpu", "auto_split", "auto_rs_c_ag_slice"], timeout=240)
    assert rc == 0


@pytest.mark.slow
def test_tune_one_rank_starts_no_mpiexec(tmp_path, monkeypatch) -> None:
    """At one rank the tuner's worker runs as `python ...` (MPI a singleton), as a one-GPU
    machine whose mpiexec does not start still tunes: here the only mpiexec named does not exist."""
    from coconetc.launch import mpiexec
    monkeypatch.setenv(mpiexec.ENV_MPIEXEC, str(tmp_path / "no-such-mpiexec"))
    mpiexec.mpiexec.cache_clear()
    mpiexec._is_open_mpi.cache_clear()
    try:
        out = tmp_path / "tune.json"
        res = invoke("tune", ADAM, "--ranks", "1", "--size", "N=1000", "--reps", "2", "--json", out)
        assert res.exit_code == 0, res.output
        data = json.loads(out.read_text())
        assert data["ranks"] == 1 and data["choice"] in data["measured"]
        assert {"default", "zero"} <= set(data["measured"])
    finally:
        mpiexec.mpiexec.cache_clear()
        mpiexec._is_open_mpi.cache_clear()
    # R > 1 still goes through that mpiexec, and says it could not start it
    res = invoke("tune", ADAM, "--ranks", "2", "--size", "N=1000", "--reps", "2")
    mpiexec.mpiexec.cache_clear()
    mpiexec._is_open_mpi.cache_clear()
    assert res.exit_code == 1 and "could not start the 2 ranks" in res.output, res.output
    assert "COCONET_MPIEXEC=" in res.output and "is not an executable file" in res.output


AUTO_OPTIMIZER = r"""
import sys
import torch  # (and no mpi4py: the emulated module's own MPI_Init once left MPI unfinalized, a failed rank)
from coconetc.torch import DistributedOptimizer

torch.manual_seed(0)
params = [torch.nn.Parameter(torch.randn(600)), torch.nn.Parameter(torch.randn(400))]  # N = 1000
mine = [torch.nn.Parameter(p.detach().clone()) for p in params]
hyper = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
opt = DistributedOptimizer(mine, sys.argv[1], backend="cuda", schedule="auto", lr=1e-2, beta1=0.9,
                           beta2=0.999, eps=1e-8)
assert opt.schedule == sys.argv[2], (opt.schedule, sys.argv[2])
ref = torch.optim.Adam(params, **hyper)
for it in range(3):
    grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(7 * it + i)) for i, p in enumerate(params)]
    for p, q, g in zip(params, mine, grads):
        p.grad, q.grad = g.clone(), g.clone()  # the same gradient on every rank: the mean is itself
    ref.step()
    opt.step()
for p, q in zip(params, mine):
    torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-5, atol=1e-6)
print("optimizer auto ok", opt.schedule, flush=True)
"""


@pytest.mark.slow
def test_tune_cuda_emulated_then_auto(tmp_path, tuning_file, monkeypatch, capfd) -> None:
    """`coconetc tune --backend cuda --emulate` measures the CUDA module's schedules (no
    point-to-point variants: a CPU choice) and stores the record for the emulated CUDA target
    only; the emulated CUDA module's schedule="auto", and DistributedOptimizer(backend="cuda",
    schedule="auto"), then run its choices, the tuner's own schedules built in."""
    from coconetc.runtime.cuda import EMULATE
    out = tmp_path / "tune.json"
    res = invoke("tune", ADAM, "--backend", "cuda", "--emulate", "--ranks", "2", "--size", "N=1000",
                 "--reps", "1", "--json", out)
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["target"] == Target.EMULATED and data["machine"].endswith("| CUDA host emulation")
    assert not any("@" in label for label in data["measured"])
    assert {"default", "zero", "fused"} <= set(data["measured"]) and data["choice"] in data["measured"]
    mod = load_file(ADAM)
    assert tuned.lookup(mod.source, "adam", {"N": 1000}, 2) is None  # the CPU backend's own records
    assert tuned.lookup(mod.source, "adam", {"N": 1000}, 2, target=Target.EMULATED)["choice"] == data["choice"]
    # the call-time choices made schedules the tuner wrote, which the module must then carry
    store = json.loads(tuning_file.read_text())
    (key, rec), = store.items()
    rec["choice"] = "auto_rs_c_ag_slice"
    rec["by_convention"] = {"": "auto_split", "m: sliced(0), v: sliced(0)": "auto_rs_c_ag_slice"}
    tuning_file.write_text(json.dumps({key: rec}))
    monkeypatch.setenv(EMULATE, "1")
    script = tmp_path / "auto_call.py"
    script.write_text(AUTO_CALL)
    rc = run_python(2, [str(script), str(ADAM), "1000", "cuda", "auto_split", "auto_rs_c_ag_slice"], timeout=240)
    assert rc == 0
    script = tmp_path / "auto_optimizer.py"
    script.write_text(AUTO_OPTIMIZER)
    rc = run_python(2, [str(script), str(ADAM), "auto_rs_c_ag_slice"], timeout=240)
    assert rc == 0
    assert capfd.readouterr().out.count("optimizer auto ok auto_rs_c_ag_slice") == 2


@pytest.mark.slow
def test_tune_cuda_emulated_as_explain_advises_then_show_and_explain(tmp_path, monkeypatch) -> None:
    """With no CUDA-emulated record, `explain -s auto --backend cuda --emulate` names the tune
    command; running it as named makes the record `show -s auto` and `explain` then read for
    that target (and the CPU's stay apart: none)."""
    cuda = ("--backend", "cuda", "--emulate")
    res = invoke("explain", ADAM, "-s", "auto", *cuda, "--ranks", "2", "--size", "N=1000")
    assert res.exit_code == 1, res.output
    advice = re.search(r"`coconetc (tune [^`]*)`", res.stderr)
    assert advice is not None, res.stderr
    res = invoke(*advice.group(1).split(), "--reps", "1")
    assert res.exit_code == 0, res.output
    choice = tuned.lookup(load_file(ADAM).source, "adam", {"N": 1000}, 2, target=Target.EMULATED)["choice"]
    res = invoke("show", ADAM, "-s", "auto", *cuda)
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[0].endswith(f"ms): {choice}"), res.stdout
    res = invoke("explain", ADAM, *cuda, "--ranks", "2")
    assert res.exit_code == 0, res.output
    rows = {x.split()[0]: x for x in res.stdout.splitlines()[2:]}
    assert "(tuner's choice)" in rows[choice] and "modelled" not in res.stdout.splitlines()[1]
    assert invoke("show", ADAM, "-s", "auto").exit_code == 1  # no CPU record


def test_run_auto_on_the_cuda_backend_reads_the_cuda_records(example) -> None:
    """`run -s auto --backend cuda --emulate` takes the choice `tune --backend cuda --emulate`
    recorded, never the CPU backend's: with only a CPU record it names the CUDA tune command
    (it ran the CPU's choice, and a schedule the CPU tuner wrote failed on every rank with
    KeyError: 'auto_rs_c_ag_slice', which the CUDA module does not carry)."""
    rec = _fake_record(example("adam.ccn"), {"N": 65}, 2)
    rec["choice"] = "auto_rs_c_ag_slice"
    tuned.store(tuned.key(example("adam.ccn").source, "adam", {"N": 65}, 2), rec)
    res = invoke("run", ADAM, "-s", "auto", "--backend", "cuda", "--emulate", "--ranks", "2", "--size", "N=65")
    assert res.exit_code == 1, res.output
    assert ("the tuning cache has no choice for N=65 on 2 ranks under the CUDA host emulation on this machine; run `coconetc "
            f"tune {ADAM} --program adam --backend cuda --emulate --ranks 2 --size N=65` first") in res.stderr
    res = invoke("run", ADAM, "-s", "auto", "--ranks", "2", "--size", "N=65", "--interp")  # the CPU's, as before
    assert res.exit_code == 0 and "the tuner's choice for N=65 on 2 ranks: auto_rs_c_ag_slice" in res.stdout


@pytest.mark.slow  # the CPU backend's run of the tuner's choice is quick
def test_run_auto_on_the_cuda_backend_runs_the_cuda_choice(example, tmp_path, monkeypatch, capfd) -> None:
    """With a record for each target, `run -s auto --backend cuda --emulate` runs the CUDA
    record's choice (a schedule its tuner wrote, built into the module before the ranks start)."""
    mod = example("adam.ccn")
    _fake_record(mod, {"N": 65}, 2)  # the CPU's: zero
    rec = _fake_record(mod, {"N": 65}, 2)
    rec["choice"], rec["machine"], rec["target"] = "auto_rs_c_ag_slice", tuned.machine(Target.EMULATED), Target.EMULATED
    tuned.store(tuned.key(mod.source, "adam", {"N": 65}, 2, target=Target.EMULATED), rec)
    capfd.readouterr()
    res = invoke("run", ADAM, "-s", "auto", "--backend", "cuda", "--emulate", "--ranks", "2", "--size", "N=65")
    ranks_out = capfd.readouterr().out
    assert res.exit_code == 0, res.output + ranks_out
    assert "the tuner's choice for N=65 on 2 ranks: auto_rs_c_ag_slice" in res.stdout
    assert "adam [auto_rs_c_ag_slice] (CUDA, host emulation): 2 ranks" in ranks_out
    assert "matches the interpreter on every rank" in ranks_out


def _cuda_record(mod, sizes: dict, R: int) -> dict:
    """A record `tune --backend cuda --emulate` could have written: its own times and choice
    (a schedule its tuner wrote), no point-to-point variants, no 'fused' measured."""
    rec = _fake_record(mod, sizes, R)  # the CPU's: zero at 2.000 ms
    rec["measured"] = {"default": 9e-3, "rs_c_ag": 8e-3, "zero": 7e-3, "auto_rs_c_ag_slice": 6e-3}
    rec["choice"], rec["target"], rec["machine"] = "auto_rs_c_ag_slice", Target.EMULATED, tuned.machine(Target.EMULATED)
    rec["by_convention"] = {"": "default", "m: sliced(0), v: sliced(0)": "auto_rs_c_ag_slice"}
    tuned.store(tuned.key(mod.source, "adam", sizes, R, target=Target.EMULATED), rec)
    return rec


def test_show_and_explain_read_the_records_of_the_backend(example) -> None:
    """`show -s auto` and `explain` with --backend cuda --emulate read the records `tune
    --backend cuda --emulate` wrote, never the CPU's (they read only the CPU's: the CPU's choice
    shown for the CUDA module, and no CUDA record reachable); with none, they name the command
    that makes one; on CUDA explain prints no modelled time (the cost model is the CPU's)."""
    mod = example("adam.ccn")
    _fake_record(mod, {"N": 64}, 2)
    cuda = ("--backend", "cuda", "--emulate")
    res = invoke("show", ADAM, "-s", "auto", *cuda)
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    assert ("no choice for 'adam' in " f"{ADAM} under the CUDA host emulation on this machine; run `coconetc "
            f"tune {ADAM} --program adam --backend cuda --emulate --ranks R --size N=INT` first") in res.stderr
    res = invoke("explain", ADAM, "-s", "auto", *cuda, "--ranks", "2", "--size", "N=64")
    assert res.exit_code == 1, res.output
    assert f"run `coconetc tune {ADAM} --program adam --backend cuda --emulate --ranks 2 --size N=64`" in res.stderr
    res = invoke("explain", ADAM, *cuda, "--ranks", "2")  # no CUDA record to take the sizes from
    assert res.exit_code == 1 and "--backend cuda --emulate --ranks 2 --size N=INT` makes one" in res.stderr
    res = invoke("explain", ADAM, *cuda, "--ranks", "2", "--size", "N=64")  # the counts, no times
    assert res.exit_code == 0, res.output
    assert "modelled" not in res.stdout.splitlines()[1] and "(tuner's choice)" not in res.stdout
    assert "--backend cuda --emulate --ranks 2 --size N=64`" in res.stdout.splitlines()[-1]
    _cuda_record(mod, {"N": 64}, 2)
    res = invoke("show", ADAM, "-s", "auto", *cuda)
    assert res.exit_code == 0, res.output
    head = res.stdout.splitlines()[0]
    assert "under the CUDA host emulation" in head and head.endswith("(6.000 ms): auto_rs_c_ag_slice"), head
    assert "schedule auto_rs_c_ag_slice for adam {" in res.stdout
    plan = invoke("show", ADAM, "-s", "auto", "--format", "plan", *cuda)
    assert plan.stdout.startswith("plan adam [auto_rs_c_ag_slice]"), plan.output
    res = invoke("show", ADAM, "-s", "auto")  # the CPU's, as before
    assert res.exit_code == 0 and "schedule zero for adam {" in res.stdout, res.output
    res = invoke("explain", ADAM, *cuda, "--ranks", "2")  # sizes from the CUDA record
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0].startswith("adam at N=64 on 2 ranks, measured under the CUDA host emulation")
    assert "do not apply to cuda-emulated" in lines[0] and "modelled" not in lines[1]
    rows = {x.split()[0]: x for x in lines[2:]}
    assert rows["auto_rs_c_ag_slice"].endswith("6.000 ms (tuner's choice) (generated)")
    assert rows["zero"].endswith("7.000 ms") and rows["fused"].endswith(" -")
    assert "zero@p2p" not in rows and len(rows["zero"].split()) == 10  # no modelled column
    one = invoke("explain", ADAM, *cuda, "--ranks", "2", "-s", "auto")
    assert one.exit_code == 0 and one.stdout.splitlines()[2].startswith("auto_rs_c_ag_slice "), one.output
    res = invoke("explain", ADAM, "--ranks", "2")  # the CPU's, with the model
    assert "modelled" in res.stdout.splitlines()[1] and "2.000 ms (tuner's choice)" in res.stdout


def test_tune_table_has_no_modelled_time_on_cuda(example) -> None:
    """tune's table: the CPU cost model's time beside a CPU record's measurements only."""
    mod = example("adam.ccn")
    cpu = tuner.table(_fake_record(mod, {"N": 64}, 2)).splitlines()
    gpu = tuner.table(_cuda_record(mod, {"N": 64}, 2)).splitlines()
    assert "modelled" in cpu[0] and "1.000 ms" in cpu[1]
    assert "modelled" not in gpu[0] and gpu[1].split()[:4] == ["auto_rs_c_ag_slice", "6.000", "ms", "1.00x"]
    assert gpu[1].split()[4:] == ["CHOICE,", "generated,", "takes", "m:", "sliced(0),", "v:", "sliced(0)"]


def test_show_and_explain_backend_options(monkeypatch) -> None:
    """--emulate only with --backend cuda; a GPU's records (keyed by its name) need a GPU here."""
    monkeypatch.setattr(cli.options, "gpu_here", lambda: False)
    for cmd in (("show", ADAM, "-s", "auto"), ("explain", ADAM, "--size", "N=64")):
        res = invoke(*cmd, "--emulate")
        assert res.exit_code == 1 and "--emulate goes with --backend cuda" in res.stderr, res.output
        res = invoke(*cmd, "--backend", "cuda")
        assert res.exit_code == 1 and "no CUDA device here" in res.stderr and "add --emulate" in res.stderr


def test_tune_backend_options() -> None:
    res = invoke("tune", ADAM, "--emulate", "--size", "N=64")
    assert res.exit_code == 1 and "--emulate goes with --backend cuda" in res.stderr


def test_the_tuned_copy_sits_beside_the_file(tmp_path) -> None:
    """The file the tuner builds is written beside the user's (what the file finds beside
    itself, an extern operation's reference module, it finds there too), in the work folder
    when that directory is read-only."""
    from coconetc.tune.tuner import _beside
    (tmp_path / "src").mkdir()
    (tmp_path / "work").mkdir()
    f = tmp_path / "src" / "adam.ccn"
    f.write_text(ADAM.read_text())
    mod = load_file(f)
    with _beside(mod, mod.source + "\n# more\n", tmp_path / "work") as got:
        assert got.parent == tmp_path / "src" and got.name.startswith(".adam.tune_") and got.suffix == ".ccn"
        assert got.read_text().endswith("# more\n")
    (tmp_path / "src").chmod(0o500)
    try:
        if not os.access(tmp_path / "src", os.W_OK):  # (root writes anywhere)
            with _beside(mod, mod.source, tmp_path / "work") as other:
                assert other.parent == tmp_path / "work"
    finally:
        (tmp_path / "src").chmod(0o700)


@pytest.mark.slow
def test_tune_a_file_with_extern_operations(tmp_path) -> None:
    """The extern operations' reference module and header are found beside the file (the
    tuner's copy of it was once written elsewhere, where neither was)."""
    out = tmp_path / "tune.json"
    res = invoke("tune", REPO / "examples" / "extern_ops.ccn", "--ranks", "1", "--size", "B=4",
                 "--size", "K=8", "--size", "H=8", "--reps", "1", "--keep", "1", "--json", out)
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["choice"] in data["measured"] and "rows" in data["measured"]
    # the copy is gone (only this file's: a test beside this one may be tuning another example)
    assert not list((REPO / "examples").glob(".extern_ops.tune_*.ccn"))


def test_two_tuners_of_one_file_share_its_augmented_copy(tmp_path) -> None:
    """The augmented file a tuner writes beside the user's (one name per content, so its module
    is built once) is shared by tuners of the same file at once: the first to finish leaves it
    to the other, the last removes it (two `coconetc tune` runs, or two test workers, used to
    delete it under each other's ranks)."""
    f = tmp_path / "m.ccn"
    f.write_text(ADAM.read_text())
    mod = load_file(f)
    with tuner._beside(mod, "first text", tmp_path / "work") as one:
        with tuner._beside(mod, "first text", tmp_path / "work") as two:
            assert one == two and one.parent == tmp_path and one.read_text() == "first text"
        assert one.exists(), "the first to finish removed the file the other still runs"
    assert not one.exists() and not list(tmp_path.glob(".m.tune_*")), "the last one out leaves files"
    with tuner._beside(mod, "another text", tmp_path / "work") as three:
        assert three != one and three.read_text() == "another text"
    assert not three.exists()
