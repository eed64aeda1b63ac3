"""A pipeline stage of 4 GPT-2 blocks in one process, one thread: the stage as one compiled
program (examples/gpt_pipeline.ccn's `gpt`, a `repeat` of gpt_block.ccn's `gpt_block` over
stacked weights, cut by a `pipeline(stages=1, ...)` schedule: coconetc.torch.pipeline.from_schedule,
one call a micro-batch for the 4 layers) against the same 4 blocks as 4 layers of their own
(coconetc.torch.pipeline.Block, one call a layer: what bench/pipeline.py and GPTPipeline run),
and against nanoGPT's 4 `Block`s in torch eager (autograd, scaled_dot_product_attention), the
same weights, at B=--batch, S=128, H=256, 4 heads, f32.

A step is what a pipeline stage runs for --microbatches micro-batches: every forward, then every
backward, the weights' gradients added up over the micro-batches (coconet: each layer's
accumulating backward from the second micro-batch on); with the backward whole ("B+W") and, for
coconet, split into its input- and weight-gradient programs ("B, W", as the zero-bubble orders
run it). The three sides' gradients are checked against each other first. Medians of --reps
steps after two warm-up steps, the sides interleaved.

Run: python bench/stage_program.py [--batch 2] [--microbatches 4] [--reps 15] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("COCONET_THREADS", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
H, NH, S, LAYERS = 256, 4, 128, 4
ONE_STAGE = '\nschedule one_stage for gpt {\n    pipeline(stages=1, microbatches=1, order="1f1b")\n}\n'


class Stage:
    """The three sides of one stage: nanoGPT's blocks (REFS), the same weights as 4 coconet
    layers (BLOCKS) and as one stage program (STAGE), and each step's micro-batches."""

    def __init__(self, batch: int, microbatches: int):
        import coconetc  # noqa: F401  (before MPI starts)
        import torch
        torch.set_num_threads(1)
        from mpi4py import MPI

        import nanogpt
        from coconetc.paths import source_path
        from coconetc.torch.gpt import block_parameters
        from coconetc.torch.pipeline import Block, from_schedule
        torch.manual_seed(0)
        cfg = nanogpt.GPTConfig(block_size=S, vocab_size=512, n_layer=LAYERS, n_head=NH, n_embd=H, dropout=0.0)
        self.refs = [nanogpt.Block(cfg) for _ in range(LAYERS)]
        per = [block_parameters(r, NH) for r in self.refs]
        self.names = list(per[0])
        scalars = {"scale": 1 / math.sqrt(H // NH), "pdrop": 0.0, "seed": 0}
        block = Block(source_path("gpt_block.ccn"), "gpt_block", comm=MPI.COMM_SELF)
        self.blocks = [block.layer({k: v.clone().contiguous().requires_grad_(True) for k, v in p.items()}, **scalars)
                       for p in per]
        self._folder = tempfile.TemporaryDirectory(prefix="ccn_stage_")  # (removed at exit)
        folder = Path(self._folder.name)
        (folder / "gpt_block.ccn").write_text(source_path("gpt_block.ccn").read_text())
        (folder / "gpt_pipeline.ccn").write_text(source_path("gpt_pipeline.ccn").read_text() + ONE_STAGE)
        stacked = {k: torch.stack([p[k] for p in per]).contiguous() for k in self.names}
        pipe = from_schedule(folder / "gpt_pipeline.ccn", "gpt", "one_stage", weights=stacked, comm=MPI.COMM_SELF,
                             loss_fn=lambda y, t: (y * t).sum(), scalars=scalars)
        self.stage = pipe.chunks[0].layers[0]
        g = torch.Generator().manual_seed(1)
        self.xs = [torch.randn(batch, S, H, generator=g) for _ in range(microbatches)]
        self.dys = [torch.randn(batch, S, H, generator=g) for _ in range(microbatches)]

    def clear(self) -> None:
        for p in [*(w for lay in self.blocks for w in lay.params.values()), *self.stage.params.values(),
                  *(w for r in self.refs for w in r.parameters())]:
            p.grad = None

    def per_block(self, split: bool) -> None:
        for m, x in enumerate(self.xs):
            for lay in self.blocks:
                x = lay.forward(m, x)
        for m, dy in enumerate(self.dys):
            for lay in reversed(self.blocks):
                dy = lay.backward(m, dy, split)
        for m in range(len(self.xs)) if split else ():
            for lay in reversed(self.blocks):
                lay.weight(m)

    def one_program(self, split: bool) -> None:
        for m, x in enumerate(self.xs):
            self.stage.forward(m, x)
        for m, dy in enumerate(self.dys):
            self.stage.backward(m, dy, split)
        for m in range(len(self.xs)) if split else ():
            self.stage.weight(m)

    def torch_eager(self, split: bool) -> None:
        outs = []
        for x in self.xs:
            for r in self.refs:
                x = r(x)
            outs.append(x)
        for y, dy in zip(outs, self.dys):
            y.backward(dy)

    def worst_difference(self) -> float:
        """The largest relative difference of the coconet sides' accumulated gradients from torch's."""
        import torch
        grads = {}
        for name, fn in (("blocks", self.per_block), ("program", self.one_program), ("torch", self.torch_eager)):
            self.clear()
            fn(False)
            ref_grads = [block_parameters_grads(r) for r in self.refs] if name == "torch" else []
            grads[name] = {k: (torch.stack([lay.params[k].grad for lay in self.blocks]) if name == "blocks" else
                               self.stage.params[k].grad if name == "program" else
                               torch.stack([g[k] for g in ref_grads])) for k in self.names}
        return max(float((grads[s][k] - grads["torch"][k]).abs().max() / grads["torch"][k].abs().max().clamp_min(1e-30))
                   for s in ("blocks", "program") for k in self.names)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    st = Stage(a.batch, a.microbatches)
    worst = st.worst_difference()
    if not worst < 1e-4:
        raise SystemExit(f"the gradients differ from torch's by {worst:.3g} (relative)")
    cases = [("one program", st.one_program, False), ("one program", st.one_program, True),
             ("4 blocks", st.per_block, False), ("4 blocks", st.per_block, True), ("torch eager", st.torch_eager, False)]
    times: dict[tuple[str, bool], list[float]] = {(n, s): [] for n, _, s in cases}
    for rep in range(a.reps + 2):  # (two warm-up rounds; the sides interleaved)
        for name, fn, split in cases:
            st.clear()
            t0 = time.perf_counter()
            fn(split)
            if rep >= 2:
                times[(name, split)].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"\nA pipeline stage of {LAYERS} GPT-2 blocks, {a.microbatches} micro-batches of B={a.batch}, S={S}, "
          f"H={H}, {NH} heads, f32, one thread: medians of {a.reps} steps (ms); the gradients checked against "
          f"torch's (largest relative difference {worst:.1e})\n")
    print("| stage | backward | step ms | torch eager / it |")
    print("| --- | --- | ---: | ---: |")
    for name, _, split in cases:
        print(f"| {name} | {'B, W' if split else 'B+W'} | {med[(name, split)]:.1f} | "
              f"{med[('torch eager', False)] / med[(name, split)]:.2f} |")
    if a.json:
        import torch
        Path(a.json).write_text(json.dumps({
            "batch": a.batch, "microbatches": a.microbatches, "reps": a.reps, "layers": LAYERS,
            "max_relative_difference": worst, "torch": torch.__version__,
            "ms": {f"{n}|{'split' if s else 'whole'}": v for (n, s), v in med.items()},
            "s_all": {f"{n}|{'split' if s else 'whole'}": v for (n, s), v in times.items()}}, indent=1))
    return 0


def block_parameters_grads(ref) -> dict:
    """nanoGPT Block REF's gradients laid out as block_parameters lays out its weights (the map
    is linear: transposes, splits by heads), by parameter name."""
    import copy

    from coconetc.torch.gpt import block_parameters
    shadow = copy.deepcopy(ref)
    for (_, p), (_, q) in zip(shadow.named_parameters(), ref.named_parameters()):
        p.data = q.grad.detach().clone()
    return block_parameters(shadow, NH)


if __name__ == "__main__":
    sys.exit(main())
