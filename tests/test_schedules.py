"""Every schedule of every example gives its program's results (interpreter, random inputs) for
R = 1..4, with sizes R does not divide and sizes smaller than R; the schedules' calling
conventions; and proof that the check can fail (deliberately wrong scheduled programs)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from coconetc.sourcefile import load_file, load_source
from coconetc.oracle.compare import compare
from coconetc.oracle.inputs import adapt_inputs, random_inputs
from coconetc.interp.interpreter import run
from coconetc.oracle.interpreted import run_interp
from coconetc.ir.nodes import Op, Ref
from coconetc.schedule.directives import Slice

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
FILES = sorted(EXAMPLES.glob("*.ccn"))
MODULES = {f.name: load_file(f) for f in FILES}


def groups_for(file: str) -> int:
    return 2 if file == "pipeline.ccn" else 1


def sizes(program: str, gs: int, small: bool) -> dict[str, int]:
    """Per program: `small` makes every dim that gets sliced smaller than the group size (when
    the group has more than one rank); otherwise sizes that 2, 3 and 4 do not divide."""
    s = max(1, gs - 1)
    if program in ("sgd", "adam", "adamw", "lamb", "mixed_adam", "mixed_adam_bf16", "clipped_sgd", "scaled_adam",
                   "amax_scale", "adamw_shard", "adamw_whole"):
        return {"N": s if small else 13}
    if program == "mlp_out":  # K sliced (row-parallel), S sliced (split on dim 1)
        return {"B": 2, "S": s, "K": s, "H": 3} if small else {"B": 2, "S": 5, "K": 7, "H": 6}
    if program in ("attn_out", "f1"):  # S sliced
        return {"B": 2, "S": s, "H": 4} if small else {"B": 2, "S": 5, "H": 6}
    if program == "conv_layer":  # the batch N sliced
        return ({"N": s, "C": 2, "H": 3, "W": 4, "O": 2} if small
                else {"N": 5, "C": 3, "H": 5, "W": 4, "O": 3})
    if program == "conv_tp":  # input channels C sliced; the split cuts output channels O
        return ({"N": 1, "C": s, "H": 4, "W": 3, "O": s} if small
                else {"N": 2, "C": 7, "H": 6, "W": 5, "O": 5})
    if program == "collectives":  # N (scatter, sl) and M (reducescatter dim=1) sliced
        return {"N": s, "M": s} if small else {"N": 7, "M": 5}
    if program == "stage":  # B sliced (split on dim 0)
        return {"B": s, "H": 3} if small else {"B": 5, "H": 3}
    if program == "row_parallel":  # K sliced; S and H cut into chunks, H split by rs_seq
        return {"B": 2, "S": s, "K": s, "H": s} if small else {"B": 2, "S": 5, "K": 7, "H": 4}
    if program == "mp_layer":  # K sliced (row-parallel), B split into rows, H cut into chunks
        return {"B": s, "K": s, "H": s} if small else {"B": 5, "K": 7, "H": 4}
    if program == "col_parallel":  # H sliced; M cut into chunks
        return {"M": s, "K": 3, "H": s} if small else {"M": 5, "K": 3, "H": 7}
    if program in ("tp_mlp", "sp_block", "tp_mlp_grad", "tp_block", "tp_block_grad", "gpt_block", "gpt_block_sp",
                   "gpt_block_grad", "gpt_block_sp_grad", "gpt"):  # gpt: gpt_pipeline.ccn's 4 gpt_blocks
        # F sliced (column then row); S split, chunked, sliced; gpt_block: NH heads sliced, of HD = 1
        # (merged with a dim of NH sliced, a rank's heads must be its slice of NH * HD)
        heads = {"NH": s if small else 4, "HD": 1} if program.startswith("gpt") else {}
        return {"B": 2, "S": s, "H": 3, "F": s, **heads} if small else {"B": 2, "S": 5, "H": 4, "F": 7, **heads}
    return _every_dim_sliced(program, s, small)


def _every_dim_sliced(program: str, s: int, small: bool) -> dict[str, int]:
    if program not in EVERY_DIM_SLICED:
        raise KeyError(f"no sizes for program '{program}': add them here")
    return dict.fromkeys(EVERY_DIM_SLICED[program], s) if small else dict(EVERY_DIM_SLICED[program])


EVERY_DIM_SLICED = {  # programs every dim of which gets sliced: their sizes (small: each the group size - 1)
    "sharded_mlp": {"B": 5, "H": 7, "F": 6},  # B (the batch), H (w1's rows), F (w2's rows); chunks of H and F
    "sharded_mlp_grad": {"B": 5, "H": 7, "F": 6},
    "sharded_model": {"B": 5, "H": 7, "F": 6},  # the same, repeated over 3 layers (prefetch)
    "sharded_model_grad": {"B": 5, "H": 7, "F": 6},
    "sgd_step": {"H": 7, "F": 6},  # (sharded_mlp.ccn)
    "sharded_adamw": {"B": 5, "H": 7, "F": 6},  # (sharded_mlp.ccn: AdamW inside the backward)
}


def cases():
    for f, mod in MODULES.items():
        G = groups_for(f)
        for prog, scheds in mod.schedules.items():
            names = [None] + [n for n, s in scheds.items() if not s.auto]
            for sched in names:
                for R in (1, 2, 3, 4):
                    if R % G:
                        continue
                    for small in (False, True):
                        tag = "small" if small else "uneven"
                        yield pytest.param(f, prog, sched, R, G, small,
                                           id=f"{f[:-4]}-{prog}-{sched or 'program'}-R{R}-{tag}")


@pytest.mark.parametrize("file,program,schedule,R,G,small", list(cases()))
def test_schedule_matches_program(file, program, schedule, R, G, small):
    sz = sizes(program, R // G, small)
    rep = run_interp(MODULES[file], program, schedule, R, G, sz, seed=R)
    assert rep.problems == [], "\n".join(rep.problems)
    assert len(rep.results) == R


def test_every_example_is_covered():
    assert {f.name for f in FILES} >= {"adam.ccn", "sgd.ccn", "lamb.ccn", "mlp_out.ccn",
                                       "pipeline.ccn"}
    ids = list(cases())
    for f, mod in MODULES.items():
        for prog, scheds in mod.schedules.items():
            for s in [None, *scheds]:
                if s is not None and scheds[s].auto:
                    continue
                assert any(p.values[:3] == (f, prog, s) for p in ids), (f, prog, s)
    # pipeline runs with 2 groups on 2 and 4 ranks
    assert {p.values[3] for p in ids if p.values[0] == "pipeline.ccn"} == {2, 4}


# --- calling conventions --------------------------------------------------------------------
def schedules():
    for f, mod in MODULES.items():
        for prog, scheds in mod.schedules.items():
            for name, s in scheds.items():
                if not s.auto:
                    yield pytest.param(f, prog, name, id=f"{prog}-{name}")


@pytest.mark.parametrize("file,program,schedule", list(schedules()))
def test_calling_convention(file, program, schedule):
    """Same parameters, in the same order, with the same dtypes and shapes; only the
    parameters a `slice` directive names change layout, to sliced(0); the same outputs and
    updated parameters."""
    mod = MODULES[file]
    base, sched = mod.programs[program], mod.schedule(program, schedule)
    sliced = {p for d in sched.directives if isinstance(d, Slice) for p in d.params}
    ir = sched.ir
    assert [q.name for q in ir.params] == [q.name for q in base.params]
    for a, b in zip(base.params, ir.params):
        assert (b.type.dtype, b.type.shape, b.scalar) == (a.type.dtype, a.type.shape, a.scalar)
        if a.name in sliced:
            assert str(b.type.layout) == "sliced(0)", a.name
            assert not b.scattered, a.name  # a caller passes its slice as one array
        else:
            assert b.type.layout == a.type.layout and b.scattered == a.scattered, a.name
    assert {pub for pub, _ in ir.outputs} == {pub for pub, _ in base.outputs}
    assert {t for t, _ in ir.updates} == {t for t, _ in base.updates}


def test_adam_zero_calling_convention():
    mod = MODULES["adam.ccn"]
    zero = mod.schedule("adam", "zero").ir
    assert str(zero.param("m").type.layout) == "sliced(0)"
    assert str(zero.param("v").type.layout) == "sliced(0)"
    assert str(zero.param("w").type.layout) == "replicated"
    R, N = 3, 13
    inputs = random_inputs(zero, R, sizes={"N": N})
    assert [len(a["m"]) for a in inputs] == [5, 5, 3]
    res = run(zero, inputs)
    assert [r.updates["m"].shape for r in res] == [(5,), (5,), (3,)]
    assert all(r.updates["w"].shape == (N,) for r in res)
    full = random_inputs(mod.programs["adam"], R, sizes={"N": N})
    for a, b in zip(inputs, full):
        a["m"] = b["m"]  # a full-size m where the schedule wants this rank's slice
    with pytest.raises(ValueError, match="'m'"):
        run(zero, inputs)


# --- the check can fail ---------------------------------------------------------------------
def _replace_stage(ir, name, fn):
    stages = tuple(dataclasses.replace(s, expr=fn(s.expr)) if s.name == name else s
                   for s in ir.stages)
    return dataclasses.replace(ir, stages=stages)


def _check(mod, program, bad, R=2, sizes=None, groups=1):
    base = mod.programs[program]
    inputs = random_inputs(base, R, groups, sizes, seed=1)
    ref = run(base, inputs, groups)
    got = run(bad, adapt_inputs(inputs, base, bad, groups), groups)
    return compare(ref, got, base, bad, groups)


def test_good_schedule_passes_the_same_check():
    mod = MODULES["adam.ccn"]
    assert _check(mod, "adam", mod.schedule("adam", "zero").ir, R=3, sizes={"N": 13}) == []


def test_wrong_allgather_input_is_caught():
    """zero schedule of adam, but the all-gather gathers mh instead of the new weights."""
    mod = MODULES["adam.ccn"]
    zero = mod.schedule("adam", "zero").ir
    mh = zero.stage("mh")

    def gather_mh(e):
        assert isinstance(e, Op) and e.op == "allgather" and e.args[0].name == "w1"
        return dataclasses.replace(e, args=(Ref("mh", mh.type),))

    bad = _replace_stage(zero, "agw", gather_mh)
    problems = _check(mod, "adam", bad, R=3, sizes={"N": 13})
    assert problems and all("'w'" in p for p in problems), problems


def test_wrong_reduction_op_is_caught():
    """reducescatter(avg) where the program all-reduces with sum."""
    mod = MODULES["sgd.ccn"]
    fused = mod.schedule("sgd", "fused").ir

    def avg(e):
        assert e.op == "reducescatter" and e.attr("op") == "sum"
        return dataclasses.replace(e, attrs=tuple((k, "avg" if k == "op" else v) for k, v in e.attrs))

    bad = _replace_stage(fused, "rs", avg)
    assert _check(mod, "sgd", bad, R=2, sizes={"N": 7})
    assert _check(mod, "sgd", bad, R=1, sizes={"N": 7}) == []  # one rank: avg == sum


def test_missing_update_is_caught():
    mod = MODULES["adam.ccn"]
    zero = mod.schedule("adam", "zero").ir
    bad = dataclasses.replace(zero, updates=tuple(u for u in zero.updates if u[0] != "m"))
    problems = _check(mod, "adam", bad, R=2, sizes={"N": 5})
    assert any("'m'" in p and "missing" in p for p in problems), problems


def test_wrong_dropout_mask_is_caught():
    """The overlapped mlp_out with the dropout keyed by another site: another mask."""
    mod = MODULES["mlp_out.ccn"]
    ov = mod.schedule("mlp_out", "overlapped").ir

    def resite(e):
        if isinstance(e, Op):
            attrs = tuple((k, v + "x" if k == "site" else v) for k, v in e.attrs)
            return dataclasses.replace(e, attrs=attrs, args=tuple(resite(a) for a in e.args))
        return e

    bad = _replace_stage(ov, "out", resite)
    assert bad != ov
    sizes = {"B": 2, "S": 5, "K": 7, "H": 6}
    assert _check(mod, "mlp_out", bad, R=3, sizes=sizes)
    assert _check(mod, "mlp_out", ov, R=3, sizes=sizes) == []


def test_wrong_op_with_groups_is_caught():
    """The pipeline stage (2 groups) with reducescatter(max) where the program sums."""
    mod = MODULES["pipeline.ccn"]
    ir = mod.schedule("stage", "sliced_p2p").ir
    rs = ir.stage("rs")
    bad = _replace_stage(ir, "rs", lambda e: dataclasses.replace(
        e, attrs=tuple((k, "max" if k == "op" else v) for k, v in e.attrs)))
    assert rs.expr.op == "reducescatter"
    assert _check(mod, "stage", bad, R=4, groups=2, sizes={"B": 5, "H": 3})
    assert _check(mod, "stage", ir, R=4, groups=2, sizes={"B": 5, "H": 3}) == []


def test_wrong_values_fail_compare_beyond_tolerance():
    mod = MODULES["sgd.ccn"]
    base = mod.programs["sgd"]
    inputs = random_inputs(base, 2, sizes={"N": 6})
    ref = run(base, inputs)
    got = run(base, inputs)
    assert compare(ref, got, base, base) == []
    got[1].updates["w"] = got[1].updates["w"] + np.float32(1e-3)
    problems = compare(ref, got, base, base)
    assert len(problems) == 1 and "rank 1" in problems[0] and "'w'" in problems[0]


# --- reorder of a reduction stage (norm of slices + cross-rank sum) --------------------------------------------------------------
def test_reorder_moves_a_norm_stage():
    mod = load_source("""
program p(g: f32[N] local, w: f32[N] replicated) {
    g1 = allreduce(sum, g)
    n = norm(g1)
    w1 = update(w, w - g1 / n)
}
schedule s for p {
    rs, ag = split(g1)
    agw = reorder(ag, n, w1)
}
""")
    for R in (1, 2, 3, 4):
        for N in (7, max(1, R - 1)):
            assert run_interp(mod, "p", "s", R, 1, {"N": N}).problems == []


def test_reorder_retypes_the_stages_left_in_place():
    """A stage that reads a moved value, left in place, reads its allgather afterwards: it is
    replicated again (it was once typed as sliced, so its result came back as a slice)."""
    mod = load_source("""
program p(g: f32[N] local, w: f32[N] replicated, seed: i64) {
    g1 = allreduce(sum, g)
    c = g1 * 2
    w1 = update(w, w - c)
    d = dropout(c, 0.25, seed)
    return d
}
schedule s for p {
    rs, ag = split(g1)
    agc, agw = reorder(ag, c, w1)
}
""")
    ir = mod.schedule("p", "s").ir
    assert str(ir.stage("d").type.layout) == "replicated"
    for R in (1, 2, 3):
        assert run_interp(mod, "p", "s", R, 1, {"N": 11}).problems == []


def test_weak_integer_math_is_float():
    """sigmoid(2 * 2) is a weak f32 (not an integer truncated to 0): the compiled code and the
    interpreter agree on it (tests/test_accepted_runs.py found them apart)."""
    mod = load_source("""
program p(s: f32[N] replicated) {
    out = s * sigmoid(2 * 2) + sqrt(2)
    return out
}
""")
    ir = mod.programs["p"]
    assert ir.stage("out").type.dtype == "f32"
    res = run(ir, [{"s": np.ones(3, np.float32)}], 1)
    want = 1 / (1 + np.exp(-4.0)) + np.sqrt(2.0)
    np.testing.assert_allclose(res[0].outputs["out"], np.full(3, want, np.float32), rtol=1e-6)
