"""Rank worker for tests/test_pipeline.py: coconetc.torch.pipeline's refusals and a rank that
fails mid-step, on 2 ranks (one layer of examples/gpt_block.ccn a stage).

    refusals  each bad input raises on every rank, before any message between the stages, and
              the pipeline still runs a good step after them: prints `CASE ok: MESSAGE` a case;
              then steps with batches of 8, 8, 4 and 8 rows: the boundaries' shapes known at each
              step's start (none the first time a batch's shape is seen: headers go; then the
              receives are posted ahead), and whether the repeated batches' losses and gradients
              equal the first's bit for bit (`steps RANK KNOWN... same|DIFFER`; the last two
              steps' waits sleep between polls, as where ranks outnumber cores)
    dies      rank 1's loss raises in the middle of a step (rank 0 waits for its gradient)
    schedule [BACKEND]  tests/programs/pipeline_model.ccn's pipeline schedule through from_schedule
              (on the CPU backend, or "cuda": run under COCONET_CUDA_EMULATE=1, the emulation): each
              stage's gradients against the interpreter's of the whole batch (prints
              `stage S: largest difference E`), and Pipeline.eval's outputs against the
              interpreter's forward (`eval: largest difference E, grads kept`, the last stage)"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from mpi4py import MPI

from coconetc.torch.pipeline import Block, Chunk, Pipeline, microbatch_seed

GPT_BLOCK = Path(__file__).resolve().parents[1] / "examples" / "gpt_block.ccn"
B, S, H, NH, F = 8, 4, 8, 2, 16


SHAPES = {"ln1_w": [H], "ln1_b": [H], "wq": [H, NH, H // NH], "bq": [NH, H // NH], "wk": [H, NH, H // NH],
          "wv": [H, NH, H // NH], "bv": [NH, H // NH], "wo": [NH, H // NH, H], "bo": [H], "ln2_w": [H],
          "ln2_b": [H], "w_fc": [H, F], "b_fc": [F], "w_proj": [F, H], "b_proj": [H]}


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(*s, generator=g) * 0.1).requires_grad_(True) for n, s in SHAPES.items()}


def layer(block: Block, seed: int):
    return block.layer(weights(seed), scale=1 / math.sqrt(H // NH), pdrop=0.0, seed=seed)


def wholes(comm, rank: int) -> None:
    """Block.whole, parts' inverse, on a block whose tensor-parallel group is both ranks: every
    weight of a layer split into this rank's parts and gathered back equals the layer's whole
    weight bit for bit (the sliced ones are halves here); a name the block lacks refused on
    every rank."""
    tp = Block(GPT_BLOCK, "gpt_block", comm=comm)
    ws = weights(7)
    parts = tp.parts(ws)
    back = tp.whole(parts)
    halves = sum(parts[n].shape != ws[n].shape for n in ws)
    same = sorted(back) == sorted(ws) and all(torch.equal(back[n], ws[n].detach()) and not back[n].requires_grad
                                              for n in ws)
    print(f"whole {rank} {'ok' if same and halves == 9 else 'WRONG'}: {halves} sliced", flush=True)
    try:
        tp.whole({"w_qkv": parts["wq"]} if rank == 1 else {"wq": parts["wq"]})
    except TypeError as err:
        print(f"wholename ok: {err}", flush=True)
    else:
        print("wholename NOT REFUSED", flush=True)


def gpt_pipelined(comm, rank: int) -> None:
    """coconetc.torch.gpt.GPTPipeline: nanoGPT's GPT (bench/nanogpt.py, model.py's shape) of 4
    blocks cut into 2 stages, each order below trained 2 SGD steps beside the same model in one
    process: every step's loss and gradients' norm (clipped to 0.05, below it), then
    (update_model) every parameter of the model, then eval's loss, against the one process's
    (1f1b with biases and the head tied across the ranks; zero_bubble_v without biases, both
    ends on rank 0; one stage holding the embeddings, every block and the head over both ranks:
    gpipe tensor parallel, 1f1b sequence parallel, each rank's blocks on its slice of 7 tokens). A model of 1 block for 2 stages, and a model without nanoGPT's parts, refused on
    every rank."""
    import copy
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import nanogpt

    from coconetc.torch.gpt import GPTPipeline
    for order, bias, pp, program in (("1f1b", True, comm, "gpt_block"), ("zero_bubble_v", False, comm, "gpt_block"),
                                     ("gpipe", True, MPI.COMM_SELF, "gpt_block"),
                                     ("1f1b", True, MPI.COMM_SELF, "gpt_block_sp")):
        tp = None if pp is comm else comm  # (one stage: both ranks its tensor- or sequence-parallel group)
        torch.manual_seed(0)
        model = nanogpt.GPT(nanogpt.GPTConfig(block_size=8, vocab_size=16, n_layer=4, n_head=2, n_embd=8, bias=bias))
        ref = copy.deepcopy(model)
        pipe = GPTPipeline(model, order, microbatches=4, comm=pp, tp_comm=tp, program=program)
        opt, ref_opt = torch.optim.SGD(pipe.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
        g = torch.Generator().manual_seed(1)
        worst = 0.0
        for _ in range(2):
            # (7 tokens: a sequence-parallel pair of slices of 4 and 3)
            idx, tgt = torch.randint(0, 16, (8, 7), generator=g), torch.randint(0, 16, (8, 7), generator=g)
            loss = pipe.step(idx, tgt)
            ref_loss = ref(idx, tgt)[1]
            ref_loss.backward()
            if loss is not None:
                worst = max(worst, abs(loss - ref_loss.item()) / ref_loss.item())
            norm, ref_norm = pipe.clip_grad_norm_(0.05), float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05))
            worst = max(worst, abs(norm - ref_norm) / ref_norm) if ref_norm > 0.05 else 1.0  # (it clips)
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        pipe.update_model()
        moved = max(float((a.detach() - b.detach()).abs().max()) for a, b in zip(model.parameters(), ref.parameters()))
        val = pipe.eval(idx, tgt)
        with torch.no_grad():
            ref_val = ref(idx, tgt)[1].item()
        if val is not None:
            worst = max(worst, abs(val - ref_val) / ref_val)
        decayed = len(pipe.param_groups(0.1)[0]["params"])
        ok = worst < 1e-6 and moved < 1e-6
        print(f"gptpipe {rank} {order}{'' if tp is None else '/tp2' if program == 'gpt_block' else '/sp2'} {'ok' if ok else 'WRONG'}: loss {worst:.1e}, weights {moved:.1e}, "
              f"{decayed} decayed", flush=True)
    refused({"gptstages": lambda: GPTPipeline(nanogpt.GPT(nanogpt.GPTConfig(
                 block_size=8, vocab_size=16, n_layer=1, n_head=2, n_embd=8)), microbatches=4, comm=comm),
             "gptmodel": lambda: GPTPipeline(torch.nn.Linear(2, 2), microbatches=4, comm=comm)})


def refused(cases: dict) -> None:
    """Each case called: `NAME ok: MESSAGE` where it raises a ValueError or TypeError, else
    `NAME NOT REFUSED`."""
    for name, case in cases.items():
        try:
            case()
        except (ValueError, TypeError) as err:
            print(f"{name} ok: {err}", flush=True)
        else:
            print(f"{name} NOT REFUSED", flush=True)


def mse(y, t):
    return ((y - t) ** 2).mean()


def scheduled(comm, backend: str) -> None:
    import numpy as np

    from coconetc.autodiff.vjp import vjp
    from coconetc.interp.interpreter import run
    from coconetc.sourcefile import load_file
    from coconetc.torch.pipeline import from_schedule
    model = Path(__file__).with_name("programs") / "pipeline_model.ccn"
    rng = np.random.default_rng(0)
    B, H, F = 8, 4, 6
    whole = {"w1": rng.standard_normal((4, H, F)) * 0.5, "w2": rng.standard_normal((4, F, H)) * 0.5,
             "g": 1 + 0.1 * rng.standard_normal((4, H))}
    x, cot = rng.standard_normal((B, H)), rng.standard_normal((B, H))
    pipe = from_schedule(model, "model", "zb", weights={k: torch.from_numpy(v) for k, v in whole.items()},
                         comm=comm, loss_fn=lambda y, c: (y * c).sum(), backend=backend)
    pipe.step(torch.from_numpy(x), torch.from_numpy(cot))
    p = load_file(model).program("model")
    want = run(vjp(p), [{**whole, "x": x, "d_y": cot}])[0].outputs
    # forward only (Pipeline.eval): the last stage's outputs, the micro-batches' joined, against
    # the interpreter's forward of the whole batch; nothing added to .grad
    grads = [t.grad.clone() for t in pipe.parameters.values()]
    y = pipe.eval(torch.from_numpy(x))
    same = all(torch.equal(t.grad, g) for t, g in zip(pipe.parameters.values(), grads))
    if y is None:
        print(f"eval: none, grads {'kept' if same else 'CHANGED'}", flush=True)
    else:
        err = float(np.abs(y.numpy() - run(p, [{**whole, "x": x}])[0].outputs["y"]).max())
        print(f"eval: largest difference {err:.1e}, grads {'kept' if same else 'CHANGED'}", flush=True)
    rows = {0: (0, 3), 1: (3, 4)}
    for (s, n), t in pipe.parameters.items():
        a, b = rows[s]
        err = float(np.abs(t.grad.numpy() * 4 - want[f"d_{n}"][a:b]).max())  # the loss of each micro-batch / M
        print(f"stage {s}: {n} largest difference {err:.1e}", flush=True)


def nograd(pipe: Pipeline, x, t, rank: int) -> None:
    """A step with autograd off on rank 1 only (its backward could not run there)."""
    if rank == 1:
        with torch.no_grad():
            pipe.step(x, t)
    else:
        pipe.step(x, t)


def profiled(pipe: Pipeline, x, t, rank: int) -> None:
    """A step under torch.profiler: each action a range named as torch's pipelining schedules
    name theirs (PP:<stage><kind><micro-batch>; zero bubble: F, I, W), each layer's compiled
    call a `coconet <program>[<schedule>]` range inside its action's."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pipe.step(x, t)
    evs = [e for e in prof.events() if e.name.startswith(("PP:", "coconet "))]
    names = sorted(e.name for e in evs if e.name.startswith("PP:"))
    want = sorted(f"PP:{rank}{k}{m}" for k in "FIW" for m in range(4))
    calls = {k: sum(e.name.startswith(f"coconet gpt_block_{k}") for e in evs) for k in ("fwd", "bwd_input", "bwd_weight")}
    inside = all(any(a.name.startswith("PP:") and a.time_range.start <= c.time_range.start
                     and c.time_range.end <= a.time_range.end for a in evs)
                 for c in evs if c.name.startswith("coconet "))
    ok = names == want and calls == {"fwd": 4, "bwd_input": 4, "bwd_weight": 4} and inside
    print(f"profiled {rank} {'ok' if ok else 'WRONG'}: {names} {calls} {inside}", flush=True)


def bf16_boundary(comm, rank: int) -> None:
    """Two stages of torch parts alone whose boundary is bfloat16 (the activation, and its
    gradient back): each stage's weight's gradient and each micro-batch's loss those of one
    process computing every micro-batch alike (its loss / 4), bit for bit."""
    g = torch.Generator().manual_seed(5)  # (the same batch and weights on both ranks)
    x, t, w0, w1 = (torch.randn(*s, generator=g) for s in ((B, S, H), (B, S, H), (H, H), (H, H)))

    def f0(v, w):
        return torch.tanh(v @ w).to(torch.bfloat16)

    def f1(h, w):
        return h.float() @ w
    mine = (w0 if rank == 0 else w1).clone().requires_grad_(True)
    chunk = Chunk([], pre=(lambda v: f0(v, mine)) if rank == 0 else None,
                  post=(lambda h: f1(h, mine)) if rank == 1 else None)
    losses: list = []
    Pipeline([chunk], "1f1b", microbatches=4, comm=comm, loss_fn=mse).step(x, t, losses=losses)
    a, b = w0.clone().requires_grad_(True), w1.clone().requires_grad_(True)
    want = []
    for m in range(4):
        rows = slice(m * 2, m * 2 + 2)
        loss = mse(f1(f0(x[rows], a), b), t[rows])
        (loss / 4).backward()
        want.append(loss.detach())
    ok = torch.equal(mine.grad, a.grad if rank == 0 else b.grad) and (
        losses == [] if rank == 0 else all(torch.equal(u, v) for u, v in zip(losses, want, strict=True)))
    print(f"bf16 {rank} {'ok' if ok else 'WRONG'}", flush=True)


def dropout_masks(block: Block, comm, rank: int) -> None:
    """With dropout, each micro-batch draws masks of its own: four micro-batches of the same rows
    give four losses, micro-batch m's that of a one-micro-batch step on its rows whose layers'
    seeds are microbatch_seed(seed, m), and the step's gradients those steps' mean (the backward
    redrew each micro-batch's masks)."""
    g = torch.Generator().manual_seed(9)  # (the same batch on both ranks)
    x0, t0 = torch.randn(2, S, H, generator=g), torch.randn(2, S, H, generator=g)
    x, t = x0.repeat(4, 1, 1), t0.repeat(4, 1, 1)
    ws = weights(3 + rank)

    def step(M: int, seed: int, rows: torch.Tensor, tgt: torch.Tensor) -> tuple[list, list]:
        mine = {n: w.detach().clone().requires_grad_(True) for n, w in ws.items()}
        ly = block.layer(mine, scale=1 / math.sqrt(H // NH), pdrop=0.3, seed=seed)
        losses: list = []
        Pipeline([Chunk([ly])], "1f1b", microbatches=M, comm=comm, loss_fn=mse).step(rows, tgt, losses=losses)
        return losses, [w.grad for w in mine.values()]
    losses, grads = step(4, 11 + rank, x, t)
    each = [step(1, microbatch_seed(11 + rank, m), x0, t0) for m in range(4)]
    mean = [sum(e[1][i] for e in each) / 4 for i in range(len(grads))]
    ok = all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(grads, mean))
    if rank == 1:
        vals = [float(v) for v in losses]
        ok = ok and len(set(vals)) == 4 and vals == [float(e[0][0]) for e in each]
    print(f"masks {rank} {'ok' if ok else 'WRONG'}", flush=True)


def traced(pipe: Pipeline, x, t, comm, rank: int) -> None:
    """A step under coconetc.trace: each action a range (PP:<stage><kind><m>, its work that of
    Pipeline.events) holding its layers' compiled calls, each receive a wait; merged, the
    ranks' files give the step's bubble (coconetc trace-merge prints it)."""
    import json
    import shutil
    import tempfile

    from click.testing import CliRunner

    import coconetc
    from coconetc.cli.trace import trace_merge
    from coconetc.runtime.trace import pipeline_bubbles
    folder = comm.bcast(tempfile.mkdtemp(prefix="ccn_pipe_trace") if rank == 0 else None)
    with coconetc.trace(folder) as tr:
        pipe.step(x, t)
    acts = [e for e in tr.events if e["cat"] == "action"]
    calls = [e for e in tr.events if e["cat"] == "call"]
    waits = [e for e in tr.events if e["cat"] == "wait" and e["name"].startswith("wait: receive")]
    names = sorted(e["name"] for e in acts)
    inside = all(any(a["ts"] <= c["ts"] and c["ts"] + c["dur"] <= a["ts"] + a["dur"] for a in acts) for c in calls)
    works = sorted(e["args"]["work_us"] for e in acts) == sorted(ev.work * 1e6 for ev in pipe.events)
    ok = names == sorted(f"PP:{rank}{k}{m}" for k in "FIW" for m in range(4)) and len(calls) == 12 and inside \
        and works and len(waits) == 4 and len({(e["args"]["pipeline"], e["args"]["run"]) for e in acts}) == 1
    print(f"traced {rank} {'ok' if ok else 'WRONG'}: {len(acts)} actions, {len(calls)} calls, {len(waits)} waits",
          flush=True)
    comm.Barrier()  # (both ranks' files written)
    if rank == 0:
        got = CliRunner().invoke(trace_merge, [folder])
        bubbles = pipeline_bubbles(json.loads((Path(folder) / "trace.json").read_text())["traceEvents"])
        said = got.output.strip().splitlines()[-1]
        print(f"merged {'ok' if got.exit_code == 0 and len(bubbles) == 1 and 0 < list(bubbles.values())[0] < 1 and said.startswith(f'pipeline {pipe._id}: 1 runs') else 'WRONG'}: {said}",
              flush=True)
        shutil.rmtree(folder, ignore_errors=True)
    comm.Barrier()


def clipped(pipe: Pipeline, chunk: Chunk, rank: int) -> None:
    """clip_grad_norm_ against torch's norm of norms over both stages' weights (gathered), norm
    types 1, 2 and inf, the weights passed as params too (each counted once): the norm, and each
    gradient scaled by max_norm / (norm + 1e-6)."""
    ws = list(chunk.layers[0].params.values())
    ok = True
    for p in (1.0, 2.0, math.inf):
        grads = [w.grad.clone() for w in ws]
        every = [torch.from_numpy(a) for part in pipe.comm.allgather([g.numpy() for g in grads]) for a in part]
        want = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, p) for g in every]), p))
        got = pipe.clip_grad_norm_(1e-3, ws, norm_type=p)
        coef = 1e-3 / (want + 1e-6)
        ok = ok and abs(got - want) <= 1e-6 * want and all(
            torch.allclose(w.grad, g * coef, rtol=1e-5, atol=0) for w, g in zip(ws, grads))
        for w, g in zip(ws, grads):
            w.grad = g
    print(f"clipnorm {rank} {'ok' if ok else 'WRONG'}", flush=True)


def evaluated(pipe: Pipeline, chunk: Chunk, x, t, step_loss, step_losses: list, rank: int) -> None:
    """Forward only (Pipeline.eval) over the batch of the first step: its loss (no dropout) that
    step's, and each micro-batch's (losses=) too, the step's per micro-batch (their mean its
    loss); its outputs' loss the same, a dropout given for the call another, a post's tuple
    joined element by element, nothing added to .grad; a scalar no layer has refused on every
    rank."""
    grads = [w.grad.clone() for w in chunk.layers[0].params.values()]
    each: list = []
    loss, out = pipe.eval(x, t, losses=each), pipe.eval(x)
    dropped = pipe.eval(x, pdrop=0.5)  # the outputs: a loss against a random target barely moves
    kept = all(torch.equal(w.grad, g) for w, g in zip(chunk.layers[0].params.values(), grads))
    # a post returning a tuple: each of its elements joined over the micro-batches
    pair = Pipeline([Chunk(chunk.layers, post=(lambda v: (v, v.sum(-1))) if rank == 1 else None)], "1f1b",
                    microbatches=4, comm=pipe.comm, loss_fn=mse).eval(x)
    if rank == 1:
        mine = float(mse(out, t))
        ok = abs(loss - step_loss) <= 1e-6 * abs(step_loss) and abs(mine - step_loss) <= 1e-6 * abs(step_loss) \
            and not torch.allclose(dropped, out, rtol=1e-3, atol=1e-3) \
            and isinstance(pair, tuple) and torch.equal(pair[0], out) and torch.equal(pair[1], out.sum(-1))
        # each micro-batch's loss: the step's (a 0-d tensor each, in order) are the eval's and its outputs'
        rows = x.shape[0] // 4
        ok = ok and len(step_losses) == len(each) == 4 and all(v.dim() == 0 and not v.requires_grad for v in step_losses) \
            and abs(float(sum(step_losses)) / 4 - step_loss) <= 1e-6 * abs(step_loss) and all(
                abs(float(a) - float(b)) <= 1e-6 * abs(float(a)) and abs(float(a) - float(mse(out[m * rows:(m + 1) * rows],
                                                                                     t[m * rows:(m + 1) * rows])))
                <= 1e-6 * abs(float(a)) for m, (a, b) in enumerate(zip(step_losses, each)))
        print(f"eval {rank} {'ok' if ok and kept else 'WRONG'}: {loss} {mine} {step_loss} {float(mse(dropped, t))}, dropout moved an output by {float((dropped - out).abs().max()):.2g}", flush=True)
    else:
        print(f"eval {rank} {'ok' if loss is None and out is None and dropped is None and pair is None and kept and not each and not step_losses else 'WRONG'}",
              flush=True)
    try:
        pipe.eval(x, t, pdropp=0.0)
    except ValueError as err:
        print(f"evalscalar ok: {err}", flush=True)
    else:
        print("evalscalar NOT REFUSED", flush=True)


def main() -> None:
    mode = sys.argv[1]
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if mode == "schedule":
        scheduled(comm, sys.argv[2] if len(sys.argv) > 2 else "cpu")
        return
    block = Block(GPT_BLOCK, "gpt_block", comm=MPI.COMM_SELF)
    chunk = Chunk([layer(block, rank)])
    g = torch.Generator().manual_seed(3)  # (the same batch on both ranks, the same every run)
    x, t = torch.randn(B, S, H, generator=g), torch.randn(B, S, H, generator=g)
    if mode == "dies":
        def loss(y, tt):
            raise ZeroDivisionError("the loss failed on purpose")
        Pipeline([chunk], "1f1b", microbatches=4, comm=comm, loss_fn=loss).step(x, t)
        return
    cases = {
        "batch": lambda: Pipeline([chunk], "1f1b", microbatches=4, comm=comm, loss_fn=mse).step(x[:6], t),
        "empty": lambda: Pipeline([chunk if rank == 0 else Chunk([])], "1f1b", microbatches=4, comm=comm,
                                  loss_fn=mse),
        "loss": lambda: Pipeline([chunk], "gpipe", microbatches=4, comm=comm),
        "chunks": lambda: Pipeline([chunk], "interleaved", microbatches=4, comm=comm, loss_fn=mse),
        "target": lambda: Pipeline([chunk], "1f1b", microbatches=4, comm=comm, loss_fn=mse).step(x, None),
        "losses": lambda: Pipeline([chunk], "1f1b", microbatches=4, comm=comm, loss_fn=mse).step(
            x, t, losses=() if rank == 0 else []),
        "scale": lambda: Pipeline([chunk], "1f1b", microbatches=4, comm=comm, loss_fn=mse, scale_grads=rank == 0),
        "nograd": lambda: nograd(Pipeline([chunk], "1f1b", microbatches=4, comm=comm, loss_fn=mse), x, t, rank),
        "clip": lambda: Pipeline([chunk], "1f1b", microbatches=4, comm=comm, loss_fn=mse).clip_grad_norm_(0.0),
        "schedule": lambda: Block(GPT_BLOCK, "gpt_block", comm=MPI.COMM_SELF, grad_schedule="overlaped"),
        "parts": lambda: block.parts({"w_qkv": torch.zeros(H, 3 * H)}),
        "dims": lambda: block.parts({"wq": torch.zeros(H, H)}),
    }
    refused(cases)
    pipe = Pipeline([chunk], "zero_bubble", microbatches=4, comm=comm, loss_fn=mse)
    runs, known = [], []
    for i, rows in enumerate((8, 8, 4, 8)):
        # the last two steps wait as on a machine with more ranks than cores (sleeping between
        # polls; the third step's headers too): the fourth must still equal the first
        pipe._nap = 5e-5 if i >= 2 else 0.0
        for w in chunk.layers[0].params.values():
            w.grad = None
        losses: list = []
        loss = pipe.step(x[:rows], t[:rows], losses=losses)
        known.append(len(pipe._known))
        runs.append((rows, loss, [w.grad.clone() for w in chunk.layers[0].params.values()], losses))
        if len(runs) == 1:
            print(f"step ok: {loss if rank == 1 else 'sent'}", flush=True)
    same = all(a[1] == b[1] and all(torch.equal(g, h) for g, h in zip(a[2], b[2]))
               for a, b in ((runs[0], runs[1]), (runs[0], runs[3])))
    print(f"steps {rank} {' '.join(map(str, known))} {'same' if same else 'DIFFER'}", flush=True)
    evaluated(pipe, chunk, x, t, runs[0][1], runs[0][3], rank)
    # scale_grads=False: each micro-batch's loss not divided by 4, so 4 times the first step's
    # gradients (the same order's first step: the same sums, each term times 4)
    for w in chunk.layers[0].params.values():
        w.grad = None
    summed = Pipeline([chunk], "zero_bubble", microbatches=4, comm=comm, loss_fn=mse, scale_grads=False)
    again = summed.step(x, t)
    four = all(torch.equal(w.grad, g * 4) for w, g in zip(chunk.layers[0].params.values(), runs[0][2]))
    print(f"summed {rank} {'ok' if four and again == runs[0][1] else 'WRONG'}", flush=True)
    profiled(pipe, x, t, rank)
    traced(pipe, x, t, comm, rank)
    wholes(comm, rank)
    bf16_boundary(comm, rank)
    dropout_masks(block, comm, rank)
    clipped(pipe, chunk, rank)
    gpt_pipelined(comm, rank)
    # a pre with no parameters on a batch that needs no gradient: the step runs (no backward through it)
    plain = Pipeline([Chunk(chunk.layers, pre=(lambda v: v * 2) if rank == 0 else None)], "1f1b", microbatches=4,
                     comm=comm, loss_fn=mse)
    print(f"pre ok: {plain.step(x, t)}", flush=True)


if __name__ == "__main__":
    main()
