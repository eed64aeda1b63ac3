"""Train a small GPT whose transformer blocks are examples/gpt_block.ccn (forward and derived
backward compiled by coconet) on R MPI ranks, and check it against the same model in one process
of plain PyTorch:

    python examples/train_gpt.py --mode tp --ranks 2           # relaunches itself under mpiexec
    python examples/train_gpt.py --mode tp_dp --ranks 4        # 2 groups of 2: tensor x data parallel
    python examples/train_gpt.py --mode pp_tp --ranks 4 --layers 4   # 2 pipeline stages x tensor parallel 2
    coconetc launch -n 2 examples/train_gpt.py --mode all      # every mode the rank count allows

The model is nanoGPT's (docs/train_gpt.md): token and position embeddings, --layers blocks, a
final layernorm and a head tied to the token embedding. Each block is a
`coconetc.torch.Module` of gpt_block.ccn holding this rank's part of its weights (its heads'
columns of q, k, v, the matching rows of the attention's output projection, its columns of c_fc
and rows of the MLP's c_proj; layernorms and the output biases whole); the embeddings, the final
layernorm and the head are ordinary torch parameters, the same on every rank. Modes:

  tp     tensor parallelism over all R ranks (program gpt_block): every rank sees the whole
         batch; torch.optim.AdamW steps this rank's parameters.
  sp     sequence parallelism (program gpt_block_sp, when gpt_block.ccn has it): each rank's
         blocks see its slice of the sequence; the embeddings' output is cut to this rank's
         slice before the first block and the last block's output gathered after it, with
         Megatron's conjugate functions (coconetc.torch.gpt.scatter_sequence and
         gather_sequence, over mpi4py).
  tp_dp  tensor parallelism inside --dp-groups groups of consecutive ranks (`groups=` of the
         module) and data parallelism across them: each group trains on its rows of the batch,
         and coconetc.torch.DistributedOptimizer over examples/adamw.ccn, on the communicator of
         the ranks that hold the same part in every group, sums the gradients across the groups
         (each group's loss is scaled by its share of the batch, so the sum is the batch's mean).

Every mode checks itself against one process of the same model (plain PyTorch, full weights, the
same initial values, the same batches, torch.optim.AdamW): the first step's gradients (each
rank's part of every parameter against the matching part of the one-process gradient; under
tp_dp the sum across the groups) within --grad-tol relative (the largest element difference
over the largest element), then the losses of every step within --loss-tol relative. Rank 0
prints a table; a mismatch exits non-zero. Dropout is 0 by default: coconet's dropout masks
(counter-based, docs/language.md) are not torch's, so --dropout > 0 trains without the check."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coconetc.pipeline import ORDERS, default_chunks, layer_bounds, make

HERE = Path(__file__).resolve().parent
GPT_BLOCK = HERE / "gpt_block.ccn"
GPT_PIPELINE = HERE / "gpt_pipeline.ccn"  # gpt_block over 4 layers, with a pipeline schedule for each order
ADAMW = HERE / "adamw.ccn"
PROGRAMS = {"tp": "gpt_block", "sp": "gpt_block_sp", "tp_dp": "gpt_block",
            "pp": "gpt_block", "pp_tp": "gpt_block", "pp_tp_dp": "gpt_block"}
SCALARS = ("scale", "pdrop", "seed")
BLOCK_WEIGHTS = ("ln1_w", "ln1_b", "wq", "bq", "wk", "wv", "bv", "wo", "bo",
                 "ln2_w", "ln2_b", "w_fc", "b_fc", "w_proj", "b_proj")


def in_mpi_job() -> bool:
    return "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ


def available_programs() -> set[str]:
    from coconetc.sourcefile import load_file
    return set(load_file(GPT_BLOCK).programs)


def shape_of(mode: str, a: argparse.Namespace, ranks: int) -> tuple[int, int, int]:
    """(data-parallel groups, pipeline stages, tensor-parallel ranks) of MODE on RANKS ranks."""
    dp = a.dp_groups if mode in ("tp_dp", "pp_tp_dp") else 1
    pp = a.stages if mode.startswith("pp") else 1
    return dp, pp, ranks // (dp * pp)


def fits(mode: str, a: argparse.Namespace, ranks: int) -> str | None:
    """Why MODE cannot run on RANKS ranks (None: it can)."""
    dp, pp, tp = shape_of(mode, a, ranks)
    if ranks % (dp * pp):
        return f"{ranks} ranks do not form {dp} data-parallel group(s) x {pp} stage(s) of equal size"
    if mode in ("tp_dp", "pp_tp", "pp_tp_dp") and tp < 2:
        return f"needs tensor-parallel groups of 2 or more ranks ({ranks} ranks = {dp} x {pp} x {tp})"
    if mode == "pp" and tp != 1:
        return f"runs one rank a stage: --ranks {dp * pp} (--stages {pp}), not {ranks}"
    return None


def modes_of(arg: str, ranks: int, a: argparse.Namespace, programs: set[str]) -> tuple[list[str], list[str]]:
    """(the modes to run, notes on the modes left out) for --mode ARG."""
    notes = []
    if arg == "all":
        modes = []
        for m in PROGRAMS:
            why = fits(m, a, ranks)
            if PROGRAMS[m] not in programs:
                notes.append(f"{m}: {GPT_BLOCK.name} has no program {PROGRAMS[m]} (yet): not run")
            elif why:
                notes.append(f"{m}: {why}: not run")
            else:
                modes.append(m)
        return modes, notes
    modes = arg.split(",")
    for m in modes:
        if m not in PROGRAMS:
            raise SystemExit(f"--mode: unknown mode {m!r} ({', '.join(PROGRAMS)}, or all)")
        if PROGRAMS[m] not in programs:
            raise SystemExit(f"--mode {m}: {GPT_BLOCK} has no program {PROGRAMS[m]} (its programs: "
                             f"{', '.join(sorted(programs))})")
        why = fits(m, a, ranks)
        if why:
            raise SystemExit(f"--mode {m}: {why} (--ranks, --stages, --dp-groups)")
    return modes, notes


def orders_of(a: argparse.Namespace) -> list[str]:
    """--order as a list of pipeline orders."""
    got = list(ORDERS) if a.order == "all" else a.order.split(",")
    for o in got:
        if o not in ORDERS:
            raise SystemExit(f"--order: unknown order {o!r} ({', '.join(ORDERS)}, or all)")
    return got


def chunks_of(order: str, a: argparse.Namespace) -> int:
    """Model chunks a rank under ORDER: --chunks under the interleaved order, else the order's own."""
    return a.chunks if order == "interleaved" else default_chunks(order)


def check_sizes(mode: str, a: argparse.Namespace, ranks: int, order: str = "1f1b") -> None:
    """The sizes MODE (and pipeline ORDER) can run with on RANKS ranks (before the ranks start,
    and in each)."""
    groups, stages, gs = shape_of(mode, a, ranks)
    if a.hidden % a.heads:
        raise SystemExit(f"--hidden {a.hidden} is not a multiple of --heads {a.heads}")
    if a.heads % gs and a.hidden // a.heads != 1:
        raise SystemExit(f"--heads {a.heads}: each of the {gs} ranks of a tensor-parallel group must hold "
                         "whole heads (a multiple of the ranks, or heads of 1; docs/gpt_block.md)")
    if a.batch % groups:
        raise SystemExit(f"--batch {a.batch}: not split evenly over {groups} data-parallel groups")
    if a.grad_clip and not mode.startswith("pp"):
        raise SystemExit(f"--grad-clip: the pp modes only (not --mode {mode})")
    if mode.startswith("pp"):
        chunks = chunks_of(order, a)
        if a.layers < stages * chunks:
            raise SystemExit(f"--layers {a.layers}: fewer than the {stages * chunks} virtual stages of "
                             f"{order} ({stages} stages x {chunks} chunks); use --layers {stages * chunks} or more")
        try:
            make(order, stages, a.microbatches, chunks)
        except ValueError as err:
            raise SystemExit(f"--order {order}: {err}") from None
        if a.from_schedule and (a.layers, stages, a.microbatches, chunks) != (4, 2, 4, default_chunks(order)):
            raise SystemExit(f"--from-schedule: {GPT_PIPELINE.name}'s schedules are 4 layers on 2 stages, 4 "
                             "micro-batches (2 chunks a rank, interleaved): use --layers 4 --stages 2 "
                             "--microbatches 4 --chunks 2")
        if (a.batch // groups) % a.microbatches:
            raise SystemExit(f"--batch {a.batch}: {a.batch // groups} rows a data-parallel group do not split "
                             f"into --microbatches {a.microbatches} equal micro-batches")


# --- the model's weights, data and the one-process reference ------------------------------------
def init(a: argparse.Namespace) -> dict[str, Any]:
    """Full initial weights (the same on every rank): nanoGPT's normal(0, 0.02), the residual
    projections' std scaled by 1/sqrt(2 layers); layernorm weights and biases, and the biases,
    drawn near 1 and 0 (not exactly: so that each one's value and gradient matter)."""
    import torch
    g = torch.Generator().manual_seed(a.seed)
    H, NH, F, V, S = a.hidden, a.heads, a.ffn * a.hidden, a.vocab, a.seq
    HD = H // NH

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    proj = 0.02 / math.sqrt(2 * a.layers)
    blocks = []
    for _ in range(a.layers):
        blocks.append({
            "ln1_w": 1 + normal(H, std=0.1), "ln1_b": normal(H, std=0.1),
            "wq": normal(H, NH, HD), "bq": normal(NH, HD), "wk": normal(H, NH, HD),
            "wv": normal(H, NH, HD), "bv": normal(NH, HD),
            "wo": normal(NH, HD, H, std=proj), "bo": normal(H),
            "ln2_w": 1 + normal(H, std=0.1), "ln2_b": normal(H, std=0.1),
            "w_fc": normal(H, F), "b_fc": normal(F), "w_proj": normal(F, H, std=proj), "b_proj": normal(H)})
    return {"wte": normal(V, H), "wpe": normal(S, H), "ln_f_w": 1 + normal(H, std=0.1),
            "ln_f_b": normal(H, std=0.1), "blocks": blocks}


def batches(a: argparse.Namespace) -> list[tuple[Any, Any]]:
    """One batch of (tokens, next tokens) per step, the same on every rank: sequences of a noisy
    affine recurrence t[i+1] = (5 t[i] + 3) mod V (a token replaced by a random one with
    probability 0.1), so the loss falls as the model learns it."""
    import torch
    g = torch.Generator().manual_seed(a.seed + 1)
    out = []
    for _ in range(a.steps):
        t = torch.empty(a.batch, a.seq + 1, dtype=torch.long)
        t[:, 0] = torch.randint(a.vocab, (a.batch,), generator=g)
        for i in range(a.seq):
            nxt = (5 * t[:, i] + 3) % a.vocab
            noise = torch.rand(a.batch, generator=g) < 0.1
            t[:, i + 1] = torch.where(noise, torch.randint(a.vocab, (a.batch,), generator=g), nxt)
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out


def reference_model(full: dict[str, Any], a: argparse.Namespace) -> Any:
    """The model in one process, plain PyTorch (nanoGPT's block in gpt_block.ccn's parameters:
    weights [in, out], heads' columns [NH, HD], no key bias)."""
    import torch
    from torch import nn
    import torch.nn.functional as F

    H, NH = a.hidden, a.heads
    HD = H // NH

    class Block(nn.Module):
        def __init__(self, w: dict[str, torch.Tensor]):
            super().__init__()
            for name in BLOCK_WEIGHTS:
                self.register_parameter(name, nn.Parameter(w[name].clone()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            B, S, _ = x.shape

            def heads(t: torch.Tensor) -> torch.Tensor:
                return t.view(B, S, NH, HD).transpose(1, 2)
            n1 = F.layer_norm(x, (H,), self.ln1_w, self.ln1_b, 1e-5)
            q = heads(n1 @ self.wq.reshape(H, -1) + self.bq.reshape(-1))
            k = heads(n1 @ self.wk.reshape(H, -1))
            v = heads(n1 @ self.wv.reshape(H, -1) + self.bv.reshape(-1))
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(HD))
            mask = torch.ones(S, S, dtype=torch.bool).tril()
            att = torch.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
            o = (att @ v).transpose(1, 2).reshape(B, S, NH * HD)
            x = x + o @ self.wo.reshape(-1, H) + self.bo
            n2 = F.layer_norm(x, (H,), self.ln2_w, self.ln2_b, 1e-5)
            return x + F.gelu(n2 @ self.w_fc + self.b_fc) @ self.w_proj + self.b_proj

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for name in ("wte", "wpe", "ln_f_w", "ln_f_b"):
                self.register_parameter(name, nn.Parameter(full[name].clone()))
            self.blocks = nn.ModuleList(Block(w) for w in full["blocks"])

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.wte[idx] + self.wpe[:idx.shape[1]]
            for b in self.blocks:
                x = b(x)
            x = F.layer_norm(x, (H,), self.ln_f_w, self.ln_f_b, 1e-5)
            return x @ self.wte.T  # the head tied to the token embedding, as nanoGPT's
    return GPT()


def describe(a: argparse.Namespace) -> str:
    """The model's sizes and the training's, in one line."""
    return (f"GPT: {a.layers} blocks of H={a.hidden}, {a.heads} heads, F={a.ffn * a.hidden}; vocabulary {a.vocab}, "
            f"sequence {a.seq}, batch {a.batch}; AdamW lr {a.lr} wd {a.wd}; {a.steps} steps")


def adamw_args(a: argparse.Namespace) -> dict[str, Any]:
    """torch.optim.AdamW's arguments, the same for the model and its one-process reference."""
    return dict(lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=a.wd)


# --- the model with coconet's blocks ------------------------------------------------------------
def coconet_model(full: dict[str, Any], a: argparse.Namespace, program: str, groups: int, tp_comm: Any) -> Any:
    """The model with every block a coconetc.torch.Module of PROGRAM (this rank's parts of its
    weights), on COMM_WORLD in GROUPS groups; the block's input x sliced along the sequence
    when the program says so (sp), with the conjugates over TP_COMM."""
    import torch
    from torch import nn
    import torch.nn.functional as F

    import coconetc.torch as ct
    from coconetc.sourcefile import load_file
    prog = load_file(GPT_BLOCK).program(program)
    params = {q.name: q for q in prog.params}
    x = params.get("x")
    if x is None or x.scalar:
        raise SystemExit(f"{program}: expected a tensor parameter x (the block's input)")
    unknown = [n for n, q in params.items() if n != "x" and n not in BLOCK_WEIGHTS and n not in SCALARS]
    if unknown:
        raise SystemExit(f"{program}: parameter {unknown[0]!r} is not one this script knows "
                         f"(x, {', '.join(BLOCK_WEIGHTS)}, {', '.join(SCALARS)})")
    if x.type.layout.sliced and x.type.layout.dim != 1:
        raise SystemExit(f"{program}: x is {x.type}: only a slice along the sequence (dim 1) is known here")
    seq_sliced = x.type.layout.sliced
    from coconetc.torch.gpt import gather_sequence, scatter_sequence  # Megatron's conjugates at the edges
    weights = [n for n in params if n in BLOCK_WEIGHTS]

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for name in ("wte", "wpe", "ln_f_w", "ln_f_b"):
                self.register_parameter(name, nn.Parameter(full[name].clone()))
            self.blocks = nn.ModuleList(
                ct.Module(GPT_BLOCK, program, parameters={n: w[n] for n in weights}, schedule=a.schedule,
                          grad_schedule=a.grad_schedule, groups=groups)
                for w in full["blocks"])

        def forward(self, idx: torch.Tensor, step: int) -> torch.Tensor:
            x = self.wte[idx] + self.wpe[:idx.shape[1]]
            if seq_sliced:
                x = scatter_sequence(x, comm=tp_comm)
            for i, b in enumerate(self.blocks):
                x = b(x=x.contiguous(), scale=1.0 / math.sqrt(a.hidden // a.heads), pdrop=a.dropout,
                      seed=1000 * step + i)
            if seq_sliced:
                x = gather_sequence(x, idx.shape[1], comm=tp_comm)
            x = F.layer_norm(x, (a.hidden,), self.ln_f_w, self.ln_f_b, 1e-5)
            return x @ self.wte.T
    model = GPT()
    model.layouts = {f"blocks.{i}.{n}": params[n] for i in range(a.layers) for n in weights}
    return model


# --- one mode: train both, compare ----------------------------------------------------------------
def reference_loss(ref: Any, idx: Any, tgt: Any, a: argparse.Namespace) -> Any:
    """The one-process model's mean cross-entropy on the whole batch."""
    import torch.nn.functional as F
    return F.cross_entropy(ref(idx).reshape(-1, a.vocab), tgt.reshape(-1))


def reference_step(ref: Any, ref_opt: Any, idx: Any, tgt: Any, a: argparse.Namespace) -> float:
    """The one-process model's loss and gradients on the whole batch (before its optimizer steps)."""
    ref_opt.zero_grad()
    loss = reference_loss(ref, idx, tgt, a)
    loss.backward()
    return loss.item()


def gradient_errors(mine: dict[str, Any], refs: dict[str, Any], layouts: dict[str, Any], gs: int, r: int,
                    comm: Any, index: Callable[[str], Any] | None = None) -> dict[str, float]:
    """Each parameter's gradient on this rank (MINE: name -> this rank's part, in LAYOUTS' layout
    over a group of GS ranks, this rank R in it; or, with INDEX, the part INDEX(name) of the
    whole tensor) against the one-process model's, as the largest difference over the largest
    element; the worst over the ranks of COMM that hold a part of it (an empty part is none)."""
    from coconetc.runtime import layout
    errs = {}
    for name, g in mine.items():
        want = refs[name].grad.detach()
        if index is not None:
            want = want[index(name)]
        elif name in layouts:
            want = want[layout.local_index(layouts[name], list(want.shape), gs, r)]
        if want.numel():
            errs[name] = float((g - want).abs().max()) / max(float(want.abs().max()), 1e-30)
    worst: dict[str, float] = {}
    for part in comm.allgather(errs):
        for name, e in part.items():
            worst[name] = max(worst.get(name, 0.0), e)
    return worst


def run_mode(mode: str, a: argparse.Namespace, comm: Any) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from mpi4py import MPI

    from coconetc.torch import DistributedOptimizer
    rank, ranks = comm.Get_rank(), comm.Get_size()
    groups = a.dp_groups if mode == "tp_dp" else 1
    gs = ranks // groups
    group, r = rank // gs, rank % gs
    tp_comm = comm.Split(group, r) if groups > 1 else comm
    dp_comm = comm.Split(r, group) if groups > 1 else None
    check_sizes(mode, a, ranks)
    full = init(a)
    data = batches(a)
    ref = reference_model(full, a)
    model = coconet_model(full, a, PROGRAMS[mode], groups, tp_comm)
    hp = adamw_args(a)
    ref_opt = torch.optim.AdamW(ref.parameters(), **hp)
    if dp_comm is not None:
        # adamw.ccn sums the gradients over dp_comm (allreduce(sum, g)); its global-norm
        # clipping would take the norm of this rank's parts only, so it is off (maxnorm huge)
        opt = DistributedOptimizer(model.parameters(), ADAMW, schedule=a.dp_schedule, comm=dp_comm, lr=a.lr,
                                   beta1=0.9, beta2=0.95, eps=1e-8, wd=a.wd, maxnorm=1e30)
    else:
        opt = torch.optim.AdamW(model.parameters(), **hp)
    rows = slice(group * a.batch // groups, (group + 1) * a.batch // groups)
    share = 1.0 / groups  # this group's rows' share of the batch (even split)

    refs = dict(ref.named_parameters())
    mine: dict[str, torch.Tensor] = {}
    grad_err: dict[str, float] = {}
    losses, ref_losses = [], []
    t_coconet = t_ref = 0.0
    for step, (idx, tgt) in enumerate(data):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(model(idx[rows], step).reshape(-1, a.vocab), tgt[rows].reshape(-1)) * share
        loss.backward()
        if step == 0:
            for name, p in model.named_parameters():
                mine[name] = p.grad.detach().clone()
                if dp_comm is not None:  # what the optimizer's all-reduce makes of it: the batch's gradient
                    dp_comm.Allreduce(MPI.IN_PLACE, mine[name].numpy(), op=MPI.SUM)
        opt.step()
        losses.append(loss.item() if dp_comm is None else dp_comm.allreduce(loss.item()))
        t1 = time.perf_counter()
        ref_losses.append(reference_step(ref, ref_opt, idx, tgt, a))
        if step == 0:
            grad_err = gradient_errors(mine, refs, model.layouts, gs, r, comm)
        ref_opt.step()
        t_coconet += t1 - t0
        t_ref += time.perf_counter() - t1
    loss_err = [abs(x - y) / abs(y) for x, y in zip(losses, ref_losses)]
    held = sum(p.numel() for p in model.parameters())
    return {"mode": mode, "groups": groups, "group_size": gs, "grad_err": grad_err, "losses": losses,
            "ref_losses": ref_losses, "loss_err": loss_err, "held": held,
            "total": sum(p.numel() for p in ref.parameters()),
            "seconds": comm.allreduce(t_coconet, op=MPI.MAX), "ref_seconds": t_ref}


def run_pipeline(mode: str, order: str, a: argparse.Namespace, comm: Any) -> dict[str, Any]:
    """MODE (pp, pp_tp, pp_tp_dp) under pipeline ORDER: the model cut into --stages stages
    (--chunks each under the interleaved order), its layers gpt_block.ccn's coconet layers
    (coconetc.torch.pipeline), trained against one process as run_mode does. Rank
    (d * stages + s) * T + t is tensor-parallel rank t of stage s in data-parallel group d."""
    import torch
    import torch.nn.functional as F
    from mpi4py import MPI

    from coconetc.runtime import layout
    from coconetc.sourcefile import load_file
    from coconetc.torch.pipeline import Block, Chunk, Pipeline
    rank, ranks = comm.Get_rank(), comm.Get_size()
    dp, P, T = shape_of(mode, a, ranks)
    check_sizes(mode, a, ranks, order)
    d, s, t = rank // (P * T), rank // T % P, rank % T
    tp_comm = comm.Split(d * P + s, t)
    pp_comm = comm.Split(d * T + t, s)
    dp_comm = comm.Split(s * T + t, d) if dp > 1 else None
    V = chunks_of(order, a)
    cut = make(order, P, a.microbatches, V)  # (its placement: which virtual stages are this rank's)
    bounds = layer_bounds(a.layers, P * V)
    full, data = init(a), batches(a)
    ref = reference_model(full, a)
    program = PROGRAMS[mode]
    prog = load_file(GPT_BLOCK).program(program)
    decl = {q.name: q for q in prog.params}
    params: dict[str, torch.Tensor] = {}  # name as the reference model's -> this rank's part
    layouts: dict[str, Any] = {}

    H = a.hidden
    scale = 1.0 / math.sqrt(H // a.heads)
    held = [cut.stage(s, c) for c in range(V)]  # this rank's virtual stages
    pre = post = None
    if 0 in held:
        for n in ("wte", "wpe"):
            params[n] = full[n].clone().requires_grad_(True)

        def pre(idx: torch.Tensor) -> torch.Tensor:
            return params["wte"][idx] + params["wpe"][:idx.shape[1]]
    if P * V - 1 in held:
        for n in ("wte", "ln_f_w", "ln_f_b"):
            params.setdefault(n, full[n].clone().requires_grad_(True))

        def post(x: torch.Tensor) -> torch.Tensor:
            x = F.layer_norm(x, (H,), params["ln_f_w"], params["ln_f_b"], 1e-5)
            return x @ params["wte"].T
    share = 1.0 / dp

    def loss_fn(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, a.vocab), tgt.reshape(-1)) * share

    layers: list[tuple[int, Any]] = []  # (the seed's offset, the layer)
    if a.from_schedule:
        # the stages of gpt_pipeline.ccn's schedule pp_<order>: each a compiled program of its
        # layers, holding its rows of the stacked weights (this rank's tensor-parallel part)
        from coconetc.torch.pipeline import from_schedule
        stacked = {q.name: q for q in load_file(GPT_PIPELINE).program("gpt").params}
        weights = {}
        for n in BLOCK_WEIGHTS:
            w = torch.stack([full["blocks"][i][n] for i in range(a.layers)])
            weights[n] = w[layout.local_index(stacked[n], list(w.shape), T, t)]
        pipe = from_schedule(GPT_PIPELINE, "gpt", f"pp_{order}", weights=weights, comm=pp_comm, tp_comm=tp_comm,
                             scalars={"scale": scale, "pdrop": a.dropout, "seed": 0}, pre=pre, post=post,
                             loss_fn=loss_fn)
        for (st, n), leaf in pipe.parameters.items():
            params[f"stage{st}.{n}"] = leaf
            first = pipe.rows[(st, n)][0]
            for j in range(leaf.shape[0]):  # its layers, as the reference names them (views)
                layouts[f"blocks.{first + j}.{n}"] = decl[n]
        layers = [(0, c.layers[0]) for c in pipe.chunks]
    else:
        block = Block(GPT_BLOCK, program, comm=tp_comm, schedule=a.schedule, grad_schedule=a.grad_schedule)
        chunks: list[Chunk] = []
        for c in range(V):
            stage = cut.stage(s, c)
            ls = []
            for i in range(bounds[stage], bounds[stage + 1]):
                ws = block.parts({n: full["blocks"][i][n] for n in block.weights})  # this rank's parts
                for n, w in ws.items():
                    params[f"blocks.{i}.{n}"], layouts[f"blocks.{i}.{n}"] = w, decl[n]
                ls.append(block.layer(ws, scale=scale, pdrop=a.dropout, seed=i))
                layers.append((i, ls[-1]))
            chunks.append(Chunk(ls, pre=pre if stage == 0 else None, post=post if stage == P * V - 1 else None))
        pipe = Pipeline(chunks, order, microbatches=a.microbatches, comm=pp_comm, loss_fn=loss_fn, tp_comm=tp_comm)
    # the token embedding is tied to the head: the first and the last stage each hold it, and
    # their gradients are summed between them (Megatron's embedding group)
    ends = {0, cut.place(P * V - 1)[0]}
    tied = pp_comm.Split(0 if s in ends else MPI.UNDEFINED, s) if len(ends) > 1 else None
    hp = adamw_args(a)
    opt = torch.optim.AdamW(params.values(), **hp)
    ref_opt = torch.optim.AdamW(ref.parameters(), **hp)
    refs = dict(ref.named_parameters())
    rows = slice(d * a.batch // dp, (d + 1) * a.batch // dp)
    grad_err: dict[str, float] = {}
    losses, ref_losses = [], []
    norms: list[float] = []  # the gradients' norms before clipping (--grad-clip), coconet's and the one process's
    ref_norms: list[float] = []
    t_coconet = t_ref = 0.0
    holder = s == cut.place(P * V - 1)[0] and t == 0  # a rank of the last stage: it has the loss
    for step, (idx, tgt) in enumerate(data):
        t0 = time.perf_counter()
        opt.zero_grad()
        for i, layer in layers:
            layer.scalars["seed"] = 1000 * step + i
        loss = pipe.step(idx[rows], tgt[rows])
        if tied is not None and tied != MPI.COMM_NULL:
            tied.Allreduce(MPI.IN_PLACE, params["wte"].grad.numpy(), op=MPI.SUM)
        if dp_comm is not None:
            for p in params.values():
                dp_comm.Allreduce(MPI.IN_PLACE, p.grad.numpy(), op=MPI.SUM)
        grads = {n: p.grad.detach().clone() for n, p in params.items() if not n.startswith("stage")} \
            if step == 0 else {}
        if step == 0 and a.from_schedule:  # a stage's stacked leaf: its layers' gradients
            for (st, n), leaf in pipe.parameters.items():
                for j in range(leaf.shape[0]):
                    grads[f"blocks.{pipe.rows[(st, n)][0] + j}.{n}"] = leaf.grad[j].detach().clone()
        if a.grad_clip:  # (the first step's gradients kept) the whole model's norm, each torch part's
            # weight once: the tied wte the first stage's, the last stage's copy scaled alike
            mine = [n for n in ("wte", "wpe", "ln_f_w", "ln_f_b") if n in params]
            norms.append(pipe.clip_grad_norm_(a.grad_clip, [params[n] for n in mine if n != "wte" or 0 in held],
                                              tied=[params["wte"]] if "wte" in mine and 0 not in held else []))
        opt.step()
        losses.append(comm.allreduce(loss if holder else 0.0))  # each group's: its share of the batch's
        t1 = time.perf_counter()
        ref_losses.append(reference_step(ref, ref_opt, idx, tgt, a))
        if step == 0:
            grad_err = gradient_errors(grads, refs, layouts, T, t, comm)
        if a.grad_clip:
            ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), a.grad_clip)))
        ref_opt.step()
        t_coconet += t1 - t0
        t_ref += time.perf_counter() - t1
    loss_err = [abs(x - y) / abs(y) for x, y in zip(losses, ref_losses)]
    # evaluation, as nanoGPT's estimate_loss: the trained model forward only, without dropout,
    # on the first batch (Pipeline.eval; nothing kept for a backward, .grad untouched)
    idx, tgt = data[0]
    val = pipe.eval(idx[rows], tgt[rows], pdrop=0.0)
    val = comm.allreduce(val if holder else 0.0)
    with torch.no_grad():
        ref_val = reference_loss(ref, idx, tgt, a).item()
    held = comm.allreduce(sum(p.numel() for p in params.values()), op=MPI.MAX)
    how = (f"{P} stages x tensor parallel {T}" + (f" x data parallel {dp}" if dp > 1 else "")
           + (f" (stages: {GPT_PIPELINE.name}'s schedule pp_{order})" if a.from_schedule else "")
           + f", order {order}" + (f" ({V} chunks a rank)" if V > 1 else "") + f", {a.microbatches} micro-batches")
    return {"mode": f"{mode}/{order}", "how": how, "program": program, "groups": dp, "group_size": T,
            "grad_err": grad_err, "losses": losses, "ref_losses": ref_losses, "loss_err": loss_err,
            "eval": (val, ref_val, abs(val - ref_val) / abs(ref_val)),
            **({"clip": (a.grad_clip, norms, ref_norms)} if a.grad_clip else {}),
            "held": held, "total": sum(p.numel() for p in ref.parameters()),
            "seconds": comm.allreduce(t_coconet, op=MPI.MAX), "ref_seconds": t_ref}


def report(res: dict[str, Any], a: argparse.Namespace, ranks: int) -> bool:
    """Rank 0's tables for one mode; True when it passes. RES may say, besides the figures, how
    the mode runs ("how"), what the blocks are ("program"), their schedules ("schedules"; "":
    none) and the number of the first step it trained ("first_step", default 0)."""
    mode, gs, groups = res["mode"], res["group_size"], res["groups"]
    how = res.get("how") or {"tp": f"tensor parallel over {gs} ranks", "sp": f"sequence parallel over {gs} ranks",
                             "tp_dp": f"tensor parallel over {gs} ranks x data parallel over {groups} groups "
                                      f"(DistributedOptimizer adamw.ccn, schedule {a.dp_schedule})"}[mode]
    sched = res.get("schedules", f"schedule {a.schedule}, grad schedule {a.grad_schedule}")
    print(f"\n== {mode}: {res.get('program') or PROGRAMS[mode]} on {ranks} ranks, {how}" + (f"; {sched}" if sched else "")
          + f"; {res['held']} of {res['total']} parameters on each rank")
    checked = a.dropout == 0
    worst: dict[str, float] = {}
    for name, err in res["grad_err"].items():  # blocks.<i>.<w>: the worst over the blocks
        key = "blocks.*." + name.split(".", 2)[2] if name.startswith("blocks.") else name
        worst[key] = max(worst.get(key, 0.0), err)
    print(f"first step's gradients, relative (largest difference / largest element), tolerance {a.grad_tol:g}:")
    width = max(len(k) for k in worst)
    for k, e in worst.items():
        print(f"  {k:{width}s}  {e:9.2e}  {'ok' if e <= a.grad_tol else 'MISMATCH' if checked else ''}")
    print(f"{'step':>6s}  {'coconet loss':>13s}  {'one process':>13s}  {'relative':>9s}")
    first = res.get("first_step", 0)
    for i, (x, y, e) in enumerate(zip(res["losses"], res["ref_losses"], res["loss_err"])):
        if i < 3 or i % 5 == 4 or i == len(res["losses"]) - 1:
            print(f"{first + i:6d}  {x:13.7f}  {y:13.7f}  {e:9.2e}")
    g, lo = max(worst.values()), max(res["loss_err"])
    if "clip" in res:  # --grad-clip: the gradients' norms before clipping, each step's
        clip, norms, ref_norms = res["clip"]
        ne = max(abs(x - y) / y for x, y in zip(norms, ref_norms))
        print(f"gradients clipped to norm {clip:g} (Pipeline.clip_grad_norm_): their norm before, steps 0 and "
              f"{len(norms) - 1}: {norms[0]:.5f} and {norms[-1]:.5f} (one process {ref_norms[0]:.5f} and "
              f"{ref_norms[-1]:.5f}), {sum(x > clip for x in ref_norms)} of {len(norms)} steps clipped; largest "
              f"relative difference {ne:.2e}")
        lo = max(lo, ne)
    if "eval" in res:  # a pipeline's forward only (Pipeline.eval) after the steps
        val, ref_val, ev = res["eval"]
        print(f"evaluation after the steps (forward only, no dropout): {val:.7f}, one process {ref_val:.7f}, "
              f"relative {ev:.2e}")
        lo = max(lo, ev)
    ok = g <= a.grad_tol and lo <= a.loss_tol
    print(f"{mode}: {len(res['losses'])} steps in {res['seconds']:.2f} s (one process: {res['ref_seconds']:.2f} s); "
          f"largest gradient difference {g:.2e}, largest loss difference {lo:.2e}: "
          + ("ok" if ok else "MISMATCH" if checked else f"not checked (dropout {a.dropout}: the masks differ)"))
    return ok or not checked


def print_summary(summary: list[tuple[str, float, float, bool]], ranks: int, checked: bool) -> None:
    """Rank 0's last table: a row a mode, (mode, largest gradient difference, largest loss
    difference, passed)."""
    width = max(6, *(len(m) for m, *_ in summary))
    print(f"\n{'mode':{width}s} {'ranks':>5s} {'gradients':>10s} {'losses':>10s}  result")
    for m, g, lo, good in summary:
        print(f"{m:{width}s} {ranks:5d} {g:10.2e} {lo:10.2e}  {('ok' if good else 'MISMATCH') if checked else 'not checked'}")


def model_arguments(ap: argparse.ArgumentParser, steps: int, batch_help: str) -> None:
    """The flags of the model, its training and the check (this script's and train_sharded.py's)."""
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=4, help="the MLP's width in multiples of --hidden")
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4, help=batch_help)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--wd", type=float, default=0.1, help="AdamW's weight decay")
    ap.add_argument("--schedule", default="overlapped", help="the blocks' forward schedule in gpt_block.ccn")
    ap.add_argument("--grad-schedule", default="default", help="the backward's (a `schedule s for grad(...)`)")
    ap.add_argument("--grad-tol", type=float, default=1e-5)
    ap.add_argument("--loss-tol", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="tp", help="tp, sp, tp_dp, a comma-separated list, or all (default tp)")
    ap.add_argument("--ranks", type=int, default=2, help="ranks to start (when not already under mpiexec)")
    ap.add_argument("--dp-groups", type=int, default=2, help="tp_dp, pp_tp_dp: data-parallel groups (default 2)")
    ap.add_argument("--stages", type=int, default=2, help="pp modes: pipeline stages (default 2)")
    ap.add_argument("--order", default="all", help=f"pp modes: {', '.join(ORDERS)}, a comma-separated list, or "
                    "all (the default)")
    ap.add_argument("--microbatches", type=int, default=4, help="pp modes: micro-batches a step (default 4)")
    ap.add_argument("--chunks", type=int, default=2, help="pp modes, the interleaved order: model chunks a "
                    "rank (default 2)")
    ap.add_argument("--from-schedule", action="store_true", help="pp modes: the stages from gpt_pipeline.ccn's "
                    "pipeline schedule pp_<order> (a program of 4 layers) instead of a Block a layer")
    ap.add_argument("--grad-clip", type=float, default=0.0, help="pp modes: clip the gradients' global norm to "
                    "this (Pipeline.clip_grad_norm_; the one process: torch.nn.utils.clip_grad_norm_), as "
                    "nanoGPT's grad_clip; 0: no clipping (the default)")
    model_arguments(ap, steps=20, batch_help="the global batch (split over the groups under tp_dp)")
    ap.add_argument("--dropout", type=float, default=0.0, help="> 0: trained without the comparison")
    ap.add_argument("--dp-schedule", default="zero", help="tp_dp: adamw.ccn's schedule (default, zero, ...)")
    a = ap.parse_args()
    programs = available_programs()
    if not in_mpi_job() and a.ranks > 1:  # build once here, then start the ranks
        modes, _ = modes_of(a.mode, a.ranks, a, programs)
        for m in modes:
            for o in (orders_of(a) if m.startswith("pp") else ["1f1b"]):
                check_sizes(m, a, a.ranks, o)
        import coconetc
        for prog in dict.fromkeys(PROGRAMS[m] + (":x" if m.startswith("pp") else "") for m in modes):
            if not (a.from_schedule and prog.endswith(":x")):
                coconetc.load(GPT_BLOCK, log=lambda msg: None, grad=(prog,))
        if a.from_schedule and any(m.startswith("pp") for m in modes):
            for o in orders_of(a):
                coconetc.load(GPT_PIPELINE, log=lambda msg: None, grad=(f"gpt@pp_{o}:x",))
        if "tp_dp" in modes:
            coconetc.load(ADAMW, log=lambda msg: None)
        from coconetc.launch.mpiexec import run_python
        return run_python(a.ranks, [__file__, *sys.argv[1:]])
    os.environ.setdefault("COCONET_THREADS", "1")
    import torch
    from mpi4py import MPI
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, ranks = comm.Get_rank(), comm.Get_size()
    modes, notes = modes_of(a.mode, ranks, a, programs)
    if rank == 0:
        print(f"{describe(a)}; dropout {a.dropout}")
        for n in notes:
            print(n)
    summary = []
    runs = [(m, o) for m in modes for o in (orders_of(a) if m.startswith("pp") else [None])]
    for m, o in runs:
        res = run_mode(m, a, comm) if o is None else run_pipeline(m, o, a, comm)
        ok = report(res, a, ranks) if rank == 0 else True
        summary.append((res["mode"], max(res["grad_err"].values()), max(res["loss_err"]), ok))
    ok = comm.bcast(all(s[3] for s in summary), root=0)
    if rank == 0:
        print_summary(summary, ranks, a.dropout == 0)
    if not ok:
        if rank == 0:
            print(f"MISMATCH: a gradient part by more than --grad-tol {a.grad_tol:g} or a loss by more than "
                  f"--loss-tol {a.loss_tol:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
