"""A training iteration of a small GPT (forward, backward, global-norm gradient clipping, AdamW
step) on 2 ranks, data-parallel on random tokens, every variant side by side in one run:

  baselines (the model wrapped in DistributedDataParallel over gloo, which averages the
  gradients during the backward pass; then clip_grad_norm_(model.parameters()) and the step)
  * DDP (gloo) + torch AdamW(fused=True)
  * DDP (gloo) + torch AdamW(foreach=True)
  coconet (the model NOT wrapped: coconetc.torch.DistributedOptimizer over examples/adamw.ccn
  all-reduces the gradients itself, clips and steps; each rank's loss divided by R, as adamw.ccn
  sums the gradients): default, rs_c_ag, sliced, zero (on one node with one copy of the weights
  for the node's ranks), zero with shared_weights=False and zero with shared_memory=False

The model: token and position embeddings, L pre-LN blocks (causal self-attention through
scaled_dot_product_attention, a 4x GELU MLP, residuals), a final LayerNorm and a head tied to
the token embedding (--untied: its own matrix). --size 3M: d 192, 6 layers, 6 heads, vocabulary
2048 (about 3.1M parameters); --size 10M: d 320, 8 layers, 8 heads (about 10.6M). Two parameter
groups as GPT training scripts make them: the linear layers' matrices decayed (weight decay 0.1),
biases, LayerNorms and embeddings not.

The clipping norm: clip_grad_norm_(model.parameters()) takes it over every group together; the
DistributedOptimizer variants pass `across_groups=True` (the program's reductions over all
groups together). Each schedule runs with the optimizer's defaults (the in-place shared windows
on one node; under zero one copy of the weights for the node), and `zero` once more with each
rank's own copy of the weights (shared_weights=False) and with shared_memory=False.

Before timing, every variant trains --check iterations from the same initial weights on the same
batches, and its losses are compared with DDP + fused AdamW's (relative 1e-4); a mismatch stops
the run. Then --iters iterations of each are timed, interleaved (common.timed_all).

Run: python bench/train_step.py [--size 3M|10M] [--untied] [--batch 4] [--seq 64] [--iters 10]
     [--check 4] [--ranks 2] [--json PATH]
It relaunches itself under mpiexec; rank 0 prints a markdown table (median ms an iteration of
the slowest rank, speed-up against DDP + fused AdamW) and writes bench/results/train_step_SIZE.json."""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ADAMW_CCN = common.ROOT / "examples" / "adamw.ccn"
SIZES = {"3M": dict(d=192, layers=6, heads=6, vocab=2048), "10M": dict(d=320, layers=8, heads=8, vocab=2048)}
HP = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, maxnorm=1.0)
WD = 0.1
DDP_FUSED = "DDP (gloo) + AdamW(fused=True)"
DDP_FOREACH = "DDP (gloo) + AdamW(foreach=True)"
SCHEDULES = ("default", "rs_c_ag", "sliced", "zero")
UNSHARED = "zero, shared_memory=False"
OWN_WEIGHTS = "zero, shared_weights=False"


def gpt(d: int, layers: int, heads: int, vocab: int, seq: int, tied: bool):
    import torch
    from torch import nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(B, T, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)
            if tied:
                self.head.weight = self.tok.weight
            for p in self.parameters():
                if p.dim() == 2:
                    nn.init.normal_(p, std=0.02)

        def forward(self, idx):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            for b in self.blocks:
                x = b(x)
            return self.head(self.ln(x))

    return GPT()


def groups(model, decay_key: str) -> list[dict]:
    """Two groups: the linear layers' matrices decayed; biases, LayerNorms, embeddings not (the
    weight decay under DECAY_KEY: "weight_decay" for torch's AdamW, "wd" for adamw.ccn)."""
    from torch import nn
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    params = list(model.parameters())  # tied weights once
    decay = [p for p in params if id(p) in linear and id(p) not in embedded]
    rest = [p for p in params if id(p) not in {id(q) for q in decay}]
    return [{"params": decay, decay_key: WD}, {"params": rest, decay_key: 0.0}]


class Variant:
    """One model copy, its optimizer and its iteration; batch k is the same for every variant."""

    def __init__(self, model, opt, ddp: bool, ranks: int, batches):
        self.model, self.opt, self.ddp, self.ranks, self.batches = model, opt, ddp, ranks, batches
        self.k = 0

    def __call__(self) -> float:
        import torch
        import torch.nn.functional as F
        x, y = self.batches(self.k)
        self.k += 1
        logits = self.model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        if self.ddp:  # DDP averages the gradients in backward
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), HP["maxnorm"])
        else:  # adamw.ccn sums them: each rank's share of the mean; autograd into the flat buffer
            self.opt.zero_grad(set_to_none=False)
            (loss / self.ranks).backward()
        self.opt.step()
        return loss.item()


def make_variants(comm, base, batches) -> dict[str, Variant]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from coconetc.torch import DistributedOptimizer
    common.gloo(comm)
    R = comm.Get_size()
    out = {}
    for label, kw in ((DDP_FUSED, {"fused": True}), (DDP_FOREACH, {"foreach": True})):
        m = copy.deepcopy(base)
        opt = torch.optim.AdamW(groups(m, "weight_decay"), lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]),
                                eps=HP["eps"], **kw)
        out[label] = Variant(DDP(m), opt, True, R, batches)
    for label, sched, kw in [*((s, s, {}) for s in SCHEDULES), (OWN_WEIGHTS, "zero", {"shared_weights": False}),
                             (UNSHARED, "zero", {"shared_memory": False})]:
        m = copy.deepcopy(base)
        opt = DistributedOptimizer(groups(m, "wd"), ADAMW_CCN, schedule=sched, comm=comm,
                                   across_groups=True, wd=WD, **kw, **HP)
        out[label] = Variant(m, opt, False, R, batches)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=sorted(SIZES), default="3M")
    ap.add_argument("--untied", action="store_true", help="the head its own matrix (default: tied)")
    ap.add_argument("--batch", type=int, default=4, help="sequences a rank per iteration")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--iters", type=int, default=10, help="timed iterations of each variant")
    ap.add_argument("--check", type=int, default=4, help="iterations whose losses are compared first")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not common.in_mpi_job():
        return common.relaunch(a.ranks, __file__, ["adamw.ccn"])
    comm = common.setup_rank()
    import torch
    rank, R = comm.Get_rank(), comm.Get_size()
    say = print if rank == 0 else (lambda *x, **k: None)
    cfg = SIZES[a.size]
    torch.manual_seed(0)
    base = gpt(**cfg, seq=a.seq, tied=not a.untied)
    nparams = sum(p.numel() for p in base.parameters())
    say(f"GPT {a.size}: {nparams / 1e6:.2f}M parameters ({cfg}, seq {a.seq}, {'untied' if a.untied else 'tied'} "
        f"head), batch {a.batch} a rank, {R} ranks")

    def batches(k: int):
        gen = torch.Generator().manual_seed(1000 * k + rank)
        t = torch.randint(cfg["vocab"], (a.batch, a.seq + 1), generator=gen)
        return t[:, :-1], t[:, 1:]

    check = make_variants(comm, base, batches)
    losses = {k: [v() for _ in range(a.check)] for k, v in check.items()}
    want = losses[DDP_FUSED]
    worst = {k: max(abs(x - y) / abs(y) for x, y in zip(ls, want)) for k, ls in losses.items()}
    worst = {k: comm.allreduce(w, op=__import__("mpi4py").MPI.MAX) for k, w in worst.items()}
    say(f"losses of rank 0 over {a.check} iterations, DDP + fused AdamW: " + ", ".join(f"{x:.5f}" for x in want))
    say("largest relative difference from them: " + ", ".join(f"{k} {w:.1e}" for k, w in worst.items()))
    ref = [q.detach() for q in check[DDP_FUSED].model.module.parameters()]
    wdiff = {k: comm.allreduce(max(float((q.detach() - r).abs().max())
                                   for q, r in zip((v.model.module if v.ddp else v.model).parameters(), ref)),
                               op=__import__("mpi4py").MPI.MAX) for k, v in check.items()}
    say("largest |difference| of a weight from DDP + fused AdamW's after them: "
        + ", ".join(f"{k} {w:.1e}" for k, w in wdiff.items()))
    with torch.no_grad():  # how far an untrained model's losses are: what the check can tell apart
        import torch.nn.functional as F
        still = [F.cross_entropy(base(x).reshape(-1, cfg["vocab"]), y.reshape(-1)).item()
                 for x, y in map(batches, range(a.check))]
    say("(the untrained model's losses on the same batches differ by up to "
        f"{max(abs(x - y) / abs(y) for x, y in zip(still, want)):.1e})")
    bad = [k for k, w in worst.items() if not w <= 1e-4]
    if bad:
        say(f"train_step: losses differ from DDP + fused AdamW's: {', '.join(bad)}")
        return 1
    t = common.timed_all(comm, dict(check), a.iters)  # the checked variants go on training
    if rank == 0:
        ref = t[DDP_FUSED]
        print(f"\nGPT {a.size} ({nparams / 1e6:.2f}M parameters), {R} ranks, batch {a.batch} x {a.seq} a rank; "
              f"median of {a.iters} iterations, ms of the slowest rank; "
              "two groups, across_groups=True\n")
        print("| variant | ms an iteration | speed-up vs DDP + AdamW(fused=True) |\n| --- | --- | --- |")
        for k, v in t.items():
            print(f"| {k if k in (DDP_FUSED, DDP_FOREACH) else 'coconet ' + k} | {v * 1e3:.1f} | {ref / v:.2f} |")
        import json
        out = Path(a.json) if a.json else common.HERE / "results" / f"train_step_{a.size}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"baselines": {k: t[k] for k in (DDP_FUSED, DDP_FOREACH)},
                                   "coconet": {k: v for k, v in t.items() if k not in (DDP_FUSED, DDP_FOREACH)},
                                   "parameters": nparams, "model": {**cfg, "seq": a.seq, "tied": not a.untied},
                                   "batch": a.batch, "ranks": R, "iters": a.iters, "across_groups": True,
                                   "groups": 2, "check_losses": losses,
                                   "check_max_rel_diff": worst, "check_max_weight_diff": wdiff, "hyperparameters": {**HP, "wd": WD}}, indent=2))
        print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
