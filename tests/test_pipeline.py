"""coconetc.torch.pipeline's bad input and faults, on 2 ranks (its orders: test_pipeline_orders.py;
training in every order against one process: test_train_gpt.py; the docs' script: test_docs.py):
each refusal on every rank before any message between the stages, naming the value, and the
pipeline usable after it; a rank that fails mid-step ends the job, named, instead of leaving
the other waiting for its gradient."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from coconetc.toolchain import probes
import rank_checks

pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(probes.missing_cpu_extra(), reason="needs the 'cpu' extra")

WORKER = Path(__file__).with_name("pipeline_worker.py")


# make test only, as the pipeline's other compiled runs: each stage is a layer of gpt_block.ccn, whose
# forward and derived backward no quick test builds (the orders, plans and refusals of schedules are quick)
@pytest.mark.slow
def test_bad_input_is_refused_on_every_rank(capfd) -> None:
    rc, lines, log = rank_checks.launch(capfd, WORKER, 2, "refusals", timeout=300)
    assert rc == 0, log
    said: dict[str, list[str]] = {}
    for ln in lines:
        name, _, msg = ln.partition(" ")
        said.setdefault(name, []).append(msg)
    assert all(len(said[c]) == 2 and all(m.startswith("ok: ") for m in said[c])
               for c in ("batch", "empty", "loss", "chunks", "target", "losses", "scale", "nograd", "clip", "schedule",
                         "parts", "dims")), log
    assert all("scale_grads differs across the ranks (rank 0: True, rank 1: False)" in m for m in said["scale"]), log
    assert "losses must be a list (each micro-batch's loss is appended to it) or None, got tuple" in said["losses"][0], log
    assert "rank 0 refused: TypeError: Pipeline.step: losses must be a list" in said["losses"][1], log
    assert all("max_norm must be a number above 0, got 0.0" in m for m in said["clip"]), log
    assert "does not divide into microbatches=4" in said["batch"][0] and "6 rows" in said["batch"][0], log
    assert "rank 0 refused" in said["batch"][1] and "6 rows" in said["batch"][1], log  # the last stage: told
    assert any("virtual stage 1 (rank 1, chunk 0) has no layers" in m for m in said["empty"]), log
    assert all("needs loss_fn=" in m for m in said["loss"]), log
    assert all("interleaved" in m for m in said["chunks"]), log
    assert any("needs target=" in m for m in said["target"]), log
    assert "rank 1 runs it with autograd off" in said["nograd"][0] and "use Pipeline.eval" in said["nograd"][0], log
    assert "rank 1 runs it with autograd off" in said["nograd"][1], log
    assert all("grad_schedule='overlaped': gpt_block_grad has no such schedule (its schedules: 'overlapped'" in m
               for m in said["schedule"]), log
    assert all("has no weight 'w_qkv' (its weights: ln1_w" in m for m in said["parts"]), log
    assert all("weights['wq'] has 2 dims; gpt_block declares wq: f32[H, NH, HD]" in m for m in said["dims"]), log
    assert len(said["step"]) == 2 and float(said["step"][0 if "sent" in said["step"][1] else 1][4:]) > 0, log
    # a batch's shape seen before: each rank's 2 boundaries (an activation, a gradient) known, the
    # receives posted ahead without headers; the same losses and gradients as the headers' step
    assert sorted(said["steps"]) == ["0 0 2 0 2 same", "1 0 2 0 2 same"], log
    # forward only: the step's loss (and its outputs' loss) on the last stage, None on the first,
    # each micro-batch's loss (losses=) the step's, in order,
    # a dropout rate given for the call used, .grad untouched; a scalar no layer has: refused
    assert sorted(m.split(":")[0] for m in said["eval"]) == ["0 ok", "1 ok"], log
    assert len(said["pre"]) == 2, log  # a pre whose output needs no gradient: no backward through it
    assert sorted(said["clipnorm"]) == ["0 ok", "1 ok"], log  # torch's norms (1, 2, inf) over both stages
    assert sorted(said["summed"]) == ["0 ok", "1 ok"], log  # scale_grads=False: the micro-batches' sum
    # under torch.profiler: each action a PP:<stage><kind><m> range, each compiled call one inside it
    assert sorted(m.split(":")[0] for m in said["profiled"]) == ["0 ok", "1 ok"], log
    # under coconetc.trace: each action a range holding its layers' calls, each receive a wait; the
    # merged files' bubble, as coconetc trace-merge prints it
    assert sorted(m.split(":")[0] for m in said["traced"]) == ["0 ok", "1 ok"], log
    assert len(said["merged"]) == 1 and re.match(r"ok: pipeline \d+: 1 runs \(its steps and evaluations\), bubble", said["merged"][0]), log
    # Block.whole(Block.parts(w)) == w on a stage of 2 tensor-parallel ranks; a name it lacks refused on both
    assert sorted(said["whole"]) == ["0 ok: 9 sliced", "1 ok: 9 sliced"], log
    assert len(said["wholename"]) == 2 and all(m.startswith("ok: Block.whole: gpt_block has no weight 'w_qkv'")
                                                for m in said["wholename"]), log
    assert sum("(rank 1 of comm passed it)" in m for m in said["wholename"]) == 1, log
    assert sorted(said["bf16"]) == ["0 ok", "1 ok"], log  # a bfloat16 boundary: one process's gradients
    assert sorted(said["masks"]) == ["0 ok", "1 ok"], log  # dropout: each micro-batch its own masks
    # coconetc.torch.gpt.GPTPipeline: nanoGPT's GPT in 2 stages against one process, then refused inputs
    assert sorted(m.split(":")[0] for m in said["gptpipe"]) == [
        "0 1f1b ok", "0 1f1b/sp2 ok", "0 gpipe/tp2 ok", "0 zero_bubble_v ok", "1 1f1b ok", "1 1f1b/sp2 ok",
        "1 gpipe/tp2 ok", "1 zero_bubble_v ok"], log
    # (the weight matrices and embeddings decayed: 2 blocks' 6 a rank, wte and wpe on rank 0, the tied head on 1;
    # one stage over both ranks: 4 blocks' parts and both embeddings)
    assert sorted(m.split(", ")[-1] for m in said["gptpipe"]) == ["12 decayed", "13 decayed", "14 decayed",
                                                                  "14 decayed"] + ["26 decayed"] * 4, log
    assert all("GPTPipeline: 2 stages for the model's 1 blocks; each stage needs at least one (at most 1 ranks in comm)"
               in m for m in said["gptstages"]) and len(said["gptstages"]) == 2, log
    assert all("model must be nanoGPT's GPT" in m and "Linear lacks transformer.wte" in m
               for m in said["gptmodel"]) and len(said["gptmodel"]) == 2, log
    assert len(said["evalscalar"]) == 2 and all(
        "no layer of the pipeline has a scalar 'pdropp' (their scalars: pdrop, scale, seed)" in m
        for m in said["evalscalar"]), log


@pytest.mark.slow
def test_a_rank_that_fails_mid_step_ends_the_job(capfd) -> None:
    rc, _, log = rank_checks.launch(capfd, WORKER, 2, "dies", timeout=120)
    assert rc not in (0, 124), log  # ended, and not by the timeout
    assert "ZeroDivisionError" in log and "rank 1" in log, log


# --- the pipeline(...) directive of a model program's schedule -------------------------------------
MODEL = """program blk(x: f64[B, H] replicated, w1: f64[H, F] sliced(1), w2: f64[F, H] sliced(0)) {
    h = gelu(matmul(x, w1))
    s = allreduce(sum, matmul(h, w2))
    y = x + s
    return y
}

program model(x: f64[B, H] replicated, w1: f64[4, H, F] sliced(2), w2: f64[4, F, H] sliced(1)) {
    y = repeat(blk, x, w1, w2)
    return y
}
"""


def _schedule(line: str) -> str:
    return MODEL + f"\nschedule pp for model {{\n    {line}\n}}\n"


def test_a_pipeline_schedule_is_checked_and_shows_its_timeline(tmp_path) -> None:
    """A legal pipeline directive changes nothing the program computes; the plan shows each
    virtual stage's layers (3 + 1 as written), each rank's actions and the timeline."""
    from click.testing import CliRunner

    from coconetc.cli import main
    from coconetc.schedule.pipeline import Pipeline, cut
    from coconetc.sourcefile import load_source
    src = _schedule('pipeline(stages=2, microbatches=4, order="zero_bubble", layers=[3, 1])')
    mod = load_source(src)
    sched = mod.schedule("model", "pp")
    assert sched.ir == mod.programs["model"]
    d = sched.directives[0]
    assert isinstance(d, Pipeline)
    c = cut(mod.programs["model"], d)
    assert (c.repeat, c.layers, c.order.name, c.order.split_backward) == ("y", ((0, 3), (3, 4)), "zero_bubble", True)
    f = tmp_path / "model.ccn"
    f.write_text(src)
    out = CliRunner().invoke(main, ["show", str(f), "-s", "pp", "--format", "plan"]).output
    assert "#   virtual stage 0 (rank 0, chunk 0): layers 0..2" in out, out
    assert "#   rank 1: F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3" in out, out
    assert "# bubble 0.0769 (7.7%); peak activations: rank 0 2, rank 1 2" in out, out


@pytest.mark.parametrize("line, at, says", [
    ("pipeline(stages=8, microbatches=4)", "8,", "8 stages need 8 layers; y has 4 (use stages=4 or fewer)"),
    ('pipeline(stages=2, microbatches=4, order="interleaved", chunks=4)', "2,",
     "2 stages x 4 chunks a rank need 8 layers; y has 4 (use stages=1 or fewer)"),
    ('pipeline(stages=2, microbatches=4, layers=[4, 0])', "layers=", "virtual stage 1 has no layers"),
    ('pipeline(stages=2, microbatches=4, layers=[-1, 5])', "layers=", "virtual stage 0 has -1 layers"),
    ('pipeline(stages=2, microbatches=4, layers=[2, 1])', "layers=", "adds up to 3; y has 4"),
    ('pipeline(stages=1, microbatches=4, order="interleaved", chunks=3)', "3)", "does not divide y's 4 layers"),
    # not "use stages=1", which a chunk count of 3 would refuse again
    ('pipeline(stages=2, microbatches=4, order="interleaved", chunks=3)', "3)", "does not divide y's 4 layers"),
    ('pipeline(stages=2, microbatches=3, order="interleaved")', "3,", "microbatches=3"),
    ('pipeline(stages=2, microbatches=4, order="zero_bubble_v", chunks=3)', "3)",
     "order 'zero_bubble_v' runs 2 model chunks a rank (placed in a V), not chunks=3: use chunks=2"),
    ('pipeline(stages=2, microbatches=4, order="pipedream")', '"pipedream"', "unknown"),
    ('pipeline(stages=2, microbatches=8, order="gpipe", max_activations=4)', "4)",
     "holds 8 micro-batches' activations at once on rank 0"),
    ('pipeline(stages=2, microbatches=4, order="zero_bubble_h2", max_activations=2)', "2)",
     "holds 3 micro-batches' activations at once on rank 0, over max_activations=2 (within it: order \"1f1b\", "
     "order \"zero_bubble\" or microbatches=2)"),
    ("pipeline(stages=2)", "pipeline", "needs microbatches="),
    ("pipeline(stages=2, microbatches=4, order=gpipe)", "gpipe", "order is a string"),
    ("pipeline(w1, stages=2, microbatches=4)", "w1", "'w1' is not a repeat of model (its repeats: y)"),
])
def test_an_illegal_pipeline_schedule_is_refused_at_its_place(line: str, at: str, says: str) -> None:
    """Each at the argument that is wrong (line and column), saying what to write instead."""
    from coconetc.errors import CompileError
    from coconetc.sourcefile import load_source
    src = _schedule(line)
    with pytest.raises(CompileError) as err:
        load_source(src)
    d = err.value.diagnostics[0]
    assert says in d.message, d.message
    assert (d.span.line, d.span.col) == (src.count("\n", 0, src.index(line)) + 1, 5 + line.index(at)), d


@pytest.mark.parametrize("lines, at, says", [
    (["pipeline(stages=2, stages=4, microbatches=4)"], (0, "stages=4"), "pipeline() got 'stages' twice"),
    (["pipeline(stages=2, microbatches=4)", "pipeline(stages=4, microbatches=4)"], (1, "pipeline"),
     "pipeline(): one a schedule (the first is at line"),
    (["pipeline(stages=2, microbatches=4)", "slice(x)"], (1, "slice"),
     "slice(): beside pipeline(...) a schedule holds directives of stages"),
])
def test_a_pipeline_stands_alone_in_its_schedule(lines: list[str], at: tuple[int, str], says: str) -> None:
    """A keyword given twice, a second pipeline(), or a directive beside it that no stage's
    program would take (a slice) is refused at its place."""
    from coconetc.errors import CompileError
    from coconetc.sourcefile import load_source
    src = _schedule("\n    ".join(lines))
    with pytest.raises(CompileError) as err:
        load_source(src)
    d = err.value.diagnostics[0]
    assert says in d.message, d.message
    row, word = at
    assert (d.span.line, d.span.col) == (src.count("\n", 0, src.index(lines[0])) + 1 + row,
                                         5 + lines[row].index(word)), d


BLOCK_SCHEDULE = """
schedule sliced for blk {
    rs, ag = split(s)
    ag_y = reorder(ag, y)
}
"""


def test_each_layer_writes_the_blocks_schedule_out_and_each_stage_takes_its_layers() -> None:
    """each_layer(block_schedule="sliced") is the block's schedule written out once per layer
    (its names the layer's; the last layer's result `y`): the same scheduled program as the
    directives written by hand. Beside a pipeline each virtual stage's program takes its layers'
    directives as its schedule of the same name, which its training cut's forward keeps."""
    from coconetc.sourcefile import load_source, with_grads
    by_hand = "\n    ".join(f"y__l{k}__rs, y__l{k}__ag = split(y__l{k}__s)\n    "
                             f"y__l{k}__ag_y = reorder(y__l{k}__ag, {'y' if k == 3 else f'y__l{k}__y'})"
                             for k in range(4))
    cut = "pipeline(stages=2, microbatches=4, layers=[3, 1])"
    src = (_schedule(f'each_layer(block_schedule="sliced")\n    {cut}') + BLOCK_SCHEDULE
           + f"schedule hand for model {{\n    {by_hand}\n    {cut}\n}}\n")
    mod = load_source(src)
    ours, hand = mod.schedule("model", "pp"), mod.schedule("model", "hand")
    assert ours.directives == hand.directives and ours.ir == hand.ir
    assert any(s.name == "y__l3__ag_y" for s in ours.ir.stages)
    full = with_grads(mod, ["model@pp:x"])
    for k, layers in ((0, (0, 1, 2)), (1, (3,))):
        stage = full.schedule(f"model_pp_stage{k}", "pp")
        assert [d.stage for d in stage.directives if hasattr(d, "rs")] == [f"y__l{n}__s" for n in layers]
        assert "pp" in full.schedules[f"model_pp_stage{k}_fwd"]


def test_a_pipelines_stages_backward_takes_its_layers_directives_of_the_grad_schedule() -> None:
    """grad(model)'s schedule of a pipeline schedule's name schedules each stage's backward:
    each of its directives goes to the stage whose derived program holds its values, which
    keeps it, as do its training cut's backward and the zero-bubble order's input-gradient
    program; one that no stage holds (a fusion across the cut) is refused at its line, and
    accepted with the cut moved as the error says."""
    from coconetc.errors import CompileError
    from coconetc.sourcefile import load_source, with_grads
    grad = "schedule splitx for grad(blk) {\n    rs, ag = split(g_x)\n}\n"
    each = "schedule pp for grad(model) {\n    each_layer(block_schedule=\"splitx\")\n}\n"
    cut = 'pipeline(stages=2, microbatches=4, order="zero_bubble", layers=[3, 1])'
    full = with_grads(load_source(_schedule(cut) + grad + each), ["model@pp:x+acc"])
    for k, split in ((0, ["g_x", "g_y__l0__y", "g_y__l1__y"]), (1, ["g_y__l2__y"])):
        for prog in ("grad", "bwd", "bwd_input", "bwd_acc"):
            assert [d.stage for d in full.schedule(f"model_pp_stage{k}_{prog}", "pp").directives] == split
    across = "schedule pp for grad(model) {\n    f = fuse(g_y__l1__y, g_y__l1__y2)\n}\n"
    src = _schedule(cut.replace("[3, 1]", "[2, 2]")) + across
    with pytest.raises(CompileError) as err:
        load_source(src)
    d = err.value.diagnostics[0]
    assert "no stage's derived program holds all of g_y__l1__y, g_y__l1__y2: cut the layers" in d.message, d
    assert d.span.line == src.count("\n", 0, src.index("f = fuse")) + 1
    load_source(_schedule(cut) + across)


def test_each_layer_of_a_derived_program_renames_cotangents_as_the_derivation_names_them() -> None:
    """In a schedule of grad(model), each_layer writes out the block's derived program's
    schedule: a cotangent `g_<value>...` of the block becomes `g_<the layer's value>...`, the
    carried input's that of the layer before's result (layer 0's: the model's input), as the
    model's derivation names them; a value the derivation numbers (`g_allgather2`, numbered
    otherwise in each layer) is refused at the argument."""
    from coconetc.errors import CompileError
    from coconetc.sourcefile import load_source
    grad = "schedule splitx for grad(blk) {\n    rs, ag = split(g_x)\n}\n"
    each = "schedule each for grad(model) {\n    each_layer(block_schedule=\"splitx\")\n}\n"
    mod = load_source(MODEL + grad + each)
    got = [(d.stage, d.rs) for d in mod.schedule("model_grad", "each").directives]
    assert got == [("g_x", "y__l0__rs"), ("g_y__l0__y", "y__l1__rs"), ("g_y__l1__y", "y__l2__rs"),
                   ("g_y__l2__y", "y__l3__rs")]
    with pytest.raises(CompileError) as err:
        load_source(MODEL + grad.replace("g_x", "g_allgather2") + each)
    said = [d.message for d in err.value.diagnostics]
    assert any("grad(blk)'s schedule 'splitx' names g_allgather2, a value the derivation numbers" in m
               for m in said), said


@pytest.mark.parametrize("lines, at, says", [
    (['each_layer(block_schedule="fused")'], '"fused"',
     "blk (the block y repeats) has no schedule 'fused' (its schedules: sliced)"),
    (["y__l1__rs, y__l1__ag = split(y__l1__s)", 'each_layer(block_schedule="sliced")'], "each_layer",
     "each_layer(): the block's schedule 'sliced', written out for each layer, is refused: split on "
     "'y__l1__s'"),
    (['each_layer(block_schedule="sliced")'] * 2, "each_layer", "split on 'y__l0__s'"),
])
def test_each_layer_is_refused_at_its_place(lines: list[str], at: str, says: str) -> None:
    """A block schedule the block lacks is refused at the argument, naming those it has; one of
    its directives that the model refuses (a layer split by hand already; the schedule twice),
    at the each_layer(...), saying it is that."""
    from coconetc.errors import CompileError
    from coconetc.sourcefile import load_source
    src = _schedule("\n    ".join(lines)) + BLOCK_SCHEDULE
    with pytest.raises(CompileError) as err:
        load_source(src)
    d = err.value.diagnostics[0]
    assert says in d.message, d.message
    row = max(i for i, ln in enumerate(lines) if at in ln)
    assert (d.span.line, d.span.col) == (src.count("\n", 0, src.index(lines[0])) + 1 + row,
                                         5 + lines[row].index(at)), d


def test_a_directive_beside_a_pipeline_stays_within_one_stage() -> None:
    """A legal fusion of the last stage of layer 2 and the first of layer 3 is refused where
    the cut falls between them, saying how to keep both in one stage, and accepted with that cut."""
    from coconetc.errors import CompileError
    from coconetc.sourcefile import load_source
    src = """program blk(x: f64[B, H] replicated, w: f64[H, H] replicated) {
    a = relu(x)
    s = matmul(a, w)
    y = x + s
    return y
}

program model(x: f64[B, H] replicated, w: f64[4, H, H] replicated) {
    y = repeat(blk, x, w)
    return y
}

schedule cross for model {
    f = fuse(y__l2__y, y__l3__a)
    pipeline(stages=2, microbatches=4, layers=[3, 1])
}
"""
    with pytest.raises(CompileError) as err:
        load_source(src)
    d = err.value.diagnostics[0]
    assert "names y__l2__y (virtual stage 0) and y__l3__a (virtual stage 1)" in d.message, d.message
    assert "with layers=[...]" in d.message and (d.span.line, d.span.col) == (14, 9), d
    load_source(src.replace("layers=[3, 1]", "layers=[2, 2]"))


@pytest.mark.parametrize("line", ['pipeline(stages=2, microbatches=8, order="gpipe", max_activations=4)',
                                  'pipeline(stages=4, microbatches=8, order="1f1b", max_activations=2)',
                                  'pipeline(stages=2, microbatches=4, order="interleaved", max_activations=2)'])
def test_what_max_activations_advises_keeps_to_it(line: str) -> None:
    """Each order and micro-batch count the refusal names, written in its place, is accepted."""
    import re

    from coconetc.errors import CompileError
    from coconetc.sourcefile import load_source
    with pytest.raises(CompileError) as err:
        load_source(_schedule(line))
    advice = err.value.diagnostics[0].message.split("(within it: ")[1].rstrip(")")
    choices = re.findall(r'order "(\w+)"|microbatches=(\d+)', advice)
    assert choices
    for order, m in choices:
        fixed = re.sub(r'order="\w+"', f'order="{order}"', line) if order else re.sub(r"microbatches=\d+", f"microbatches={m}", line)
        load_source(_schedule(fixed))


@pytest.mark.parametrize("stage", ["y__l3__twice", "y__l9__twice", "y__l3__y"])
def test_a_users_stage_named_as_a_layers_is_refused_at_its_line(stage: str) -> None:
    """A stage the program writes itself in the form repeat() gives its layers' stages
    (`y__l<k>__<stage>`) would be taken for one of layer k's: refused where it is written (a
    name the other layers lack, a layer past the last, or the last layer's result, which
    repeat() names `y`)."""
    from coconetc.errors import CompileError
    from coconetc.sourcefile import load_source
    body = f"    y = repeat(blk, x, w1, w2)\n    {stage} = y + y\n    return {stage}\n"
    src = _schedule("pipeline(stages=2, microbatches=4)").replace("    y = repeat(blk, x, w1, w2)\n    return y\n", body)
    with pytest.raises(CompileError) as err:
        load_source(src)
    d = err.value.diagnostics[0]
    assert f"stage '{stage}' is named as repeat() names a stage of layer" in d.message and "rename it" in d.message
    assert (d.span.line, d.span.col) == (src.count("\n", 0, src.index(f"    {stage} =")) + 1, 5), d


def test_a_stage_named_as_a_layers_of_no_repeat_is_no_repeat() -> None:
    """`foo__l0__bar` where the program has no stage foo (a repeat's result) is not a repeat: the
    directive still finds the program's only one."""
    from coconetc.schedule.pipeline import cut
    from coconetc.sourcefile import load_source
    body = "    y = repeat(blk, x, w1, w2)\n    foo__l0__bar = y + y\n    return foo__l0__bar\n"
    src = _schedule("pipeline(stages=2, microbatches=4)").replace("    y = repeat(blk, x, w1, w2)\n    return y\n", body)
    mod = load_source(src)
    c = cut(mod.programs["model"], mod.schedule("model", "pp").directives[0])
    assert (c.repeat, c.layers) == ("y", ((0, 2), (2, 4)))


def test_the_accumulating_backwards_add_the_weights_gradients_into_their_accumulators() -> None:
    """`blk:x+acc` (what a pipeline Block builds): `blk_bwd_acc` and `blk_bwd_weight_acc` take
    an accumulator per weight and add the weight's gradient into it in place, returning the
    rest as `blk_bwd` and `blk_bwd_weight` do; under the interpreter on 2 ranks (w1, w2 sliced)
    each accumulator ends as its start plus the gradient the plain backward returns, and the
    weight gradients' GEMMs are one GEMM with beta = 1 into the accumulator on the CPU."""
    import numpy as np

    from coconetc.autodiff.saved import acc_name, accumulator, bwd_name, input_name, weight_name
    from coconetc.interp.interpreter import run
    from coconetc.ir.slices import take_slice
    from coconetc.plan.epilogue import accumulates, fused_loop
    from coconetc.plan.units import Library
    from coconetc.sourcefile import load_source, with_grads
    mod = with_grads(load_source(MODEL), ["blk:x+acc"])
    rng = np.random.default_rng(1)
    x, dy = rng.standard_normal((6, 4)), rng.standard_normal((6, 4))
    w1, w2 = rng.standard_normal((4, 4)), rng.standard_normal((4, 4))
    ranks = [{"x": x, "w1": np.ascontiguousarray(take_slice(w1, 1, 2, 2, r)),
              "w2": np.ascontiguousarray(take_slice(w2, 0, 2, 2, r))} for r in range(2)]
    fwd = run(mod.programs["blk_fwd"], ranks)
    saved = [{k[len("saved_"):]: v for k, v in f.outputs.items() if k.startswith("saved_")} for f in fwd]
    args = [{**a, **sv, "d_y": dy} for a, sv in zip(ranks, saved)]
    start = [{accumulator(w): rng.standard_normal(a[w].shape) for w in ("w1", "w2")} for a in ranks]
    plain = run(mod.programs[bwd_name("blk")], args)
    acc = run(mod.programs[acc_name(bwd_name("blk"))], [{**a, **st} for a, st in zip(args, start)])
    b = run(mod.programs[input_name("blk")], args)
    kept = [{k[len("kept_"):]: v for k, v in r.outputs.items() if k.startswith("kept_")} for r in b]
    wplain = run(mod.programs[weight_name("blk")], [{**a, **k} for a, k in zip(args, kept)])
    wacc = run(mod.programs[acc_name(weight_name("blk"))], [{**a, **k, **st} for a, k, st in zip(args, kept, start)])
    for r in range(2):
        assert sorted(acc[r].outputs) == ["d_x"] and sorted(wacc[r].outputs) == []
        np.testing.assert_allclose(acc[r].outputs["d_x"], plain[r].outputs["d_x"], rtol=1e-12)
        for w in ("w1", "w2"):
            for got, want in ((acc, plain), (wacc, wplain)):
                np.testing.assert_allclose(got[r].updates[accumulator(w)], start[r][accumulator(w)]
                                           + want[r].outputs[f"d_{w}"], rtol=1e-12, atol=1e-12)
    plan = mod.plans[(acc_name(bwd_name("blk")), "default")]
    buffers = {u.name: u for u in plan.buffers}
    gemms = [u for u in plan.units if isinstance(u, Library) and u.op == "matmul_tn"]
    assert len(gemms) == 2
    for u in gemms:
        loop = fused_loop(plan.units, u)
        assert loop is not None and accumulates(u, loop, buffers) and u.fused == ("cpu",), u
    # a misspelt suffix, or one with no input to cut at, is refused (not a plain backward)
    for entry, says in (("blk:x+acx", "only 'acc'"), ("blk+acc", r"'blk:x\+acc'"), ("blk:+acc", r"'blk:x\+acc'")):
        with pytest.raises(ValueError, match=says):
            with_grads(load_source(MODEL), [entry])


# --- proven equal: every order's gradients against the unpipelined derived program's --------------
DEEP = MODEL.replace("4, H, F", "8, H, F").replace("4, F, H", "8, F, H")


@pytest.mark.parametrize("order", ["gpipe", "1f1b", "interleaved", "zero_bubble", "zero_bubble_h2", "zero_bubble_v"])
@pytest.mark.parametrize("stages, ranks, microbatches, layers", [
    (1, 1, 1, None), (2, 1, 4, "[5, 3]"), (2, 2, 8, None), (3, 2, 3, "[1, 4, 3]"), (4, 1, 8, None),
    (4, 2, 4, "[1, 2, 3, 2]")])
def test_every_pipeline_order_computes_the_programs_gradients(order: str, stages: int, ranks: int,
                                                              microbatches: int, layers: str | None) -> None:
    """coconetc/oracle/pipeline.py runs the stages' derived programs (the zero-bubble order's B
    and W cut) over the micro-batches in the order's actions under the interpreter; the
    gradients, added over the micro-batches, equal the whole batch's derived program's: 1 to 4
    stages, tensor parallel 1 and 2, 1 to 8 micro-batches, uneven splits of 8 layers."""
    import numpy as np

    from coconetc.autodiff.vjp import vjp
    from coconetc.interp.interpreter import run
    from coconetc.ir.slices import take_slice
    from coconetc.oracle.pipeline import interpret
    from coconetc.sourcefile import load_source
    if order == "interleaved" and (microbatches % stages or layers):
        pytest.skip("interleaved: micro-batches a multiple of the stages, layers split evenly over 2 chunks")
    if order == "zero_bubble_v" and layers:  # (2 chunks a rank: 2P virtual stages' layers)
        layers = {2: "[3, 2, 2, 1]", 3: "[1, 2, 1, 1, 2, 1]", 4: "[1, 1, 1, 1, 1, 1, 1, 1]"}[stages]
    chunks = ", chunks=2" if order == "interleaved" else ""
    split = f", layers={layers}" if layers else ""
    mod = load_source(DEEP + f'\nschedule pp for model {{\n    pipeline(stages={stages}, microbatches={microbatches}, '
                             f'order="{order}"{chunks}{split})\n}}\n')
    p = mod.programs["model"]
    rng = np.random.default_rng(0)
    sizes = {"B": 2 * microbatches, "H": 4, "F": 4}
    whole = {"x": rng.standard_normal((sizes["B"], 4)), "w1": rng.standard_normal((8, 4, 4)) * 0.5,
             "w2": rng.standard_normal((8, 4, 4)) * 0.5}
    cot = rng.standard_normal((sizes["B"], 4))
    mine = [{"x": whole["x"], "w1": np.ascontiguousarray(take_slice(whole["w1"], 2, 4, ranks, r)),
             "w2": np.ascontiguousarray(take_slice(whole["w2"], 1, 4, ranks, r))} for r in range(ranks)]
    got = interpret(p, mod.schedule("model", "pp").directives[0], mine, [{"d_y": cot}] * ranks, batch=["x"])
    g = vjp(p)
    want = run(g, [{**a, "d_y": cot} for a in mine])
    for r in range(ranks):
        assert sorted(got[r]) == sorted(want[r].outputs)
        for k, v in want[r].outputs.items():
            np.testing.assert_allclose(got[r][k], v, rtol=1e-12, atol=1e-12, err_msg=f"{k} on rank {r}")


@pytest.mark.slow  # the pipeline's schedules run under the interpreter in the quick set
@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_a_pipeline_schedule_runs_compiled(capfd, backend: str) -> None:
    """coconetc.torch.pipeline.from_schedule: tests/programs/pipeline_model.ccn's zero-bubble
    schedule, its stage programs compiled (each its layers' rows of the stacked weights, its
    backward cut into B and W), on 2 ranks, on the CPU backend and under the CUDA emulation:
    every stage's weight gradients equal the interpreter's derived program's for the whole
    batch (the rows of that stage's layers)."""
    env = {"COCONET_CUDA_EMULATE": "1"} if backend == "cuda" else None
    rc, lines, log = rank_checks.launch(capfd, WORKER, 2, "schedule", backend, timeout=600, env=env)
    assert rc == 0, log
    got = [ln.split() for ln in lines if ln.startswith("stage ")]
    assert sorted((ln[1], ln[2]) for ln in got) == [("0:", "g"), ("0:", "w1"), ("0:", "w2"),
                                                      ("1:", "g"), ("1:", "w1"), ("1:", "w2")], log
    assert all(float(ln[-1]) < 1e-10 for ln in got), log
    # Pipeline.eval: the last stage's outputs are the interpreter's forward of the whole batch
    evals = sorted(ln for ln in lines if ln.startswith("eval: "))
    assert len(evals) == 2 and evals[1] == "eval: none, grads kept" and evals[0].endswith("grads kept"), log
    assert float(evals[0].split()[3].rstrip(",")) < 1e-10, log


def test_explain_models_a_pipeline_schedule(tmp_path) -> None:
    """`coconetc explain -s PIPELINE`: each virtual stage's modelled forward and backward on one
    micro-batch (the zero-bubble order's backward as its input- and weight-gradient programs,
    which add up to it: no stage computed twice), and the bubble those costs give."""
    from click.testing import CliRunner

    from coconetc.cli import main
    from coconetc.pipeline import orders
    f = tmp_path / "model.ccn"
    f.write_text(_schedule('pipeline(stages=2, microbatches=4, order="zero_bubble", layers=[3, 1])'))
    res = CliRunner().invoke(main, ["explain", str(f), "-s", "pp", "-n", "2", "--size", "B=16", "--size", "H=64",
                                    "--size", "F=256"])
    assert res.exit_code == 0, res.output
    assert "pipeline pp: 2 virtual stages, 4 micro-batches of B=4, order zero_bubble; 2 rank(s) a stage" in res.output
    costs = []
    for s, layers in ((0, "0..2"), (1, "3..3")):
        line = next(ln for ln in res.output.splitlines() if ln.startswith(f"  stage {s} (layers {layers})"))
        f_ms, b_ms, bi, w = (float(x) for x in re.findall(r"([0-9.]+) ms", line))
        assert abs(bi + w - b_ms) <= 0.002 + 0.02 * b_ms, line
        costs.append(orders.Costs(forward=f_ms, backward=b_ms, input_grad=bi, weight_grad=w))
    assert costs[0].forward > 2 * costs[1].forward  # 3 layers against 1
    bubble = orders.simulate(orders.make("zero_bubble", 2, 4), costs).bubble()
    said = float(re.search(r"^bubble ([0-9.]+) ", res.output, re.M).group(1))  # type: ignore[union-attr]
    assert abs(said - bubble) <= 0.003, (bubble, res.output)  # (the costs above are the printed, rounded ones)


def _explain_chart(tmp_path):
    from click.testing import CliRunner

    from coconetc.cli import main
    f, png = tmp_path / "model.ccn", tmp_path / "timeline.png"
    f.write_text(_schedule('pipeline(stages=2, microbatches=4, order="zero_bubble", layers=[3, 1])'))
    res = CliRunner().invoke(main, ["explain", str(f), "-s", "pp", "-n", "2", "--size", "B=16", "--size", "H=64",
                                    "--size", "F=256", "--chart", str(png)])
    return res, png


def test_explain_draws_a_pipeline_chart(tmp_path) -> None:
    """`explain -s PIPELINE --chart PNG`: a row per rank (2 ranks: 0.5 x 2 + 1.2 inches at 120
    dpi; 6 inches wide, the least), each kind's bars in its colour (F, B and zero bubble's W) on
    both ranks' rows."""
    pytest.importorskip("matplotlib")
    import matplotlib.image
    import numpy as np

    from coconetc.pipeline.orders import COLORS
    res, png = _explain_chart(tmp_path)
    assert res.exit_code == 0, res.output
    assert f"chart: {png}" in res.output, res.output
    img = matplotlib.image.imread(str(png))
    assert img.shape[:2] == (264, 720), img.shape
    for kind in "FBW":
        rgb = np.array([int(COLORS[kind][i:i + 2], 16) / 255 for i in (1, 3, 5)])
        rows = np.nonzero((np.abs(img[:, :, :3] - rgb).max(axis=2) < 0.01).sum(axis=1) > 5)[0]
        assert len(rows) > 20 and rows.max() - rows.min() > 60, (kind, rows)  # bars on the rows of both ranks


def test_explain_without_matplotlib_says_what_to_install(tmp_path, monkeypatch) -> None:
    """With no matplotlib, --chart is refused with what to install, and no file is written."""
    import sys
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    res, png = _explain_chart(tmp_path)
    from coconetc.paths import install_command
    assert res.exit_code != 0 and f"chart needs matplotlib: {install_command('bench')}" in res.output, res.output
    assert not png.exists()
