"""Forward + backward of a GPT-2 block (examples/gpt_block.ccn: nanoGPT's Block, Megatron's tensor
parallelism over heads and MLP columns; gpt_block_sp: with Megatron's sequence parallelism) on R
ranks, f32, side by side in one run:

  tensor parallelism (x and y whole on every rank)
  * Megatron TP, torch + gloo      PyTorch autograd with Megatron's conjugate functions written
  * Megatron TP, torch + mpi4py    as autograd functions: f (identity forward, all-reduce
                                   backward) before the column-parallel q/k/v and c_fc, g
                                   (all-reduce forward, identity backward) after each
                                   row-parallel c_proj; over torch.distributed gloo or mpi4py
  * PyTorch TP (parallelize_module)  torch.distributed.tensor.parallel: ColwiseParallel q/k/v and
                                   c_fc, RowwiseParallel c_projs, on a CPU gloo DeviceMesh
  * coconet gpt_block <schedule>   coconetc.torch.function: the compiled forward under each
                                   schedule of the file, the compiled derived backward; and
    <schedule>, grad <g>           each `schedule g for grad(gpt_block)` of the file, with the
                                   forward schedule of its name (else with each one timed)
  sequence parallelism (x and y sliced along the sequence)
  * Megatron SP, torch + gloo / mpi4py  layernorm, dropout and residual on this rank's rows;
                                   all-gather forward / reduce-scatter backward before the
                                   column-parallel matmuls, reduce-scatter forward / all-gather
                                   backward after the row-parallel ones, in Megatron's [S, B, H]
                                   layout (the gathers along the leading dim, no copies); the
                                   replicated parameters' gradients (layernorms, c_proj biases)
                                   all-reduced after the backward, in one flat buffer, as
                                   Megatron does
  * PyTorch TP+SP (parallelize_module)  the same plan with SequenceParallel layernorms and
                                   Shard(1) activations; the layernorms' Partial gradients
                                   redistributed to Replicate after the backward
  * coconet gpt_block_sp <schedule> (when examples/gpt_block.ccn has it)
  the bound
  * GEMMs alone                    every matmul of this rank's forward and backward (each
                                   forward C = A B, then dA = dC B^T and dB = A^T dC), nothing
                                   else: no layernorm, softmax, GELU, copy or communication

The attention core of every PyTorch variant is the block's own arithmetic (scores of the whole
S x S, the causal mask, softmax, probabilities times v: nanoGPT's explicit path and Megatron's
non-flash one); --sdpa adds each Megatron variant over gloo once more with
F.scaled_dot_product_attention(is_causal=True) (PyTorch's fused CPU attention, which skips the
masked blocks). Dropout is 0 (the block's dropouts are identities at p = 0 in every variant).

One step: the layer's forward on x (requiring its gradient: a layer inside a model) and every
weight, then backward(dy). Before timing, every variant's y and dx are checked against the
first TP variant's (this rank's rows under SP; relative 1e-3). Times are medians over --reps
repetitions of the slowest rank (common.timed_all: every variant once per round, interleaved).

Run: python bench/gpt_block.py [--b 8] [--s 512] [--h 1024] [--heads 16] [--ffn 4] [--ranks 2]
     [--reps 5] [--schedules all|default,fused,...] [--sdpa] [--no-grad-schedules] [--json PATH]
It relaunches itself under mpiexec; rank 0 prints the table and writes
bench/results/gpt_block_f32.json."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

GPT_BLOCK = common.ROOT / "examples" / "gpt_block.ccn"
TP, SP = "gpt_block", "gpt_block_sp"
REPLICATED = ("ln1_w", "ln1_b", "bo", "ln2_w", "ln2_b", "b_proj")


def programs() -> dict[str, list[str]]:
    """The file's block programs and their schedules (default first)."""
    from coconetc.sourcefile import load_file
    mod = load_file(GPT_BLOCK)
    return {p: ["default", *[s for s, v in mod.schedules.get(p, {}).items() if not v.auto]]
            for p in (TP, SP) if p in mod.programs}


def grad_schedules() -> dict[str, list[str]]:
    """Each block program's `schedule s for grad(p)`s in the file (none: the derived program's
    default only)."""
    from coconetc.sourcefile import load_file
    mod = load_file(GPT_BLOCK)
    return {p: [s for s, v in mod.schedules.get(f"{p}_grad", {}).items() if not v.auto] for p in (TP, SP)}


def weights(a: argparse.Namespace) -> dict[str, Any]:
    """Full weights in gpt_block.ccn's parameters (the same on every rank)."""
    import torch
    g = torch.Generator().manual_seed(0)
    H, NH, F = a.h, a.heads, a.ffn * a.h
    HD = H // NH

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std
    return {"ln1_w": 1 + normal(H, std=0.1), "ln1_b": normal(H, std=0.1), "wq": normal(H, NH, HD),
            "bq": normal(NH, HD), "wk": normal(H, NH, HD), "wv": normal(H, NH, HD), "bv": normal(NH, HD),
            "wo": normal(NH, HD, H), "bo": normal(H), "ln2_w": 1 + normal(H, std=0.1),
            "ln2_b": normal(H, std=0.1), "w_fc": normal(H, F), "b_fc": normal(F), "w_proj": normal(F, H),
            "b_proj": normal(H)}


def mine(full: dict[str, Any], comm) -> dict[str, Any]:
    """This rank's part of every weight, in gpt_block's layouts."""
    from coconetc.runtime import layout
    from coconetc.sourcefile import load_file
    p = load_file(GPT_BLOCK).program(TP)
    R, r = comm.Get_size(), comm.Get_rank()
    return {k: v[layout.local_index(layout.param(p, k, "bench"), list(v.shape), R, r)].contiguous()
            for k, v in full.items()}


# --- collectives: gloo or mpi4py ---------------------------------------------------------------
class Collectives:
    """all_reduce(t) in place; all_gather(t) and reduce_scatter(t) along dim 0 (Megatron's
    [S, B, H] layout: the ranks' blocks are contiguous)."""

    def __init__(self, comm, how: str):
        import torch
        self.torch, self.comm, self.how, self.R = torch, comm, how, comm.Get_size()
        self.dist = common.gloo(comm) if how == "gloo" else None

    def all_reduce(self, t):
        if self.dist is not None:
            self.dist.all_reduce(t)
        else:
            from mpi4py import MPI
            self.comm.Allreduce(MPI.IN_PLACE, t.numpy(), op=MPI.SUM)
        return t

    def all_gather(self, t):
        out = self.torch.empty((self.R * t.shape[0], *t.shape[1:]), dtype=t.dtype)
        if self.dist is not None:
            self.dist.all_gather_into_tensor(out, t)
        else:
            self.comm.Allgather(t.numpy(), out.numpy())
        return out

    def reduce_scatter(self, t):
        out = self.torch.empty((t.shape[0] // self.R, *t.shape[1:]), dtype=t.dtype)
        if self.dist is not None:
            self.dist.reduce_scatter_tensor(out, t)
        else:
            from mpi4py import MPI
            self.comm.Reduce_scatter_block(t.numpy(), out.numpy(), op=MPI.SUM)
        return out


def conjugates(c: Collectives) -> dict[str, Any]:
    """Megatron's four autograd functions: f, g (tensor parallelism), and the sequence-parallel
    all-gather / reduce-scatter pair."""
    import torch

    class F(torch.autograd.Function):  # identity forward, all-reduce backward
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return c.all_reduce(g.contiguous())

    class G(torch.autograd.Function):  # all-reduce forward, identity backward
        @staticmethod
        def forward(ctx, p):
            return c.all_reduce(p.contiguous())

        @staticmethod
        def backward(ctx, g):
            return g

    class AG(torch.autograd.Function):  # all-gather forward, reduce-scatter backward
        @staticmethod
        def forward(ctx, x):
            return c.all_gather(x.contiguous())

        @staticmethod
        def backward(ctx, g):
            return c.reduce_scatter(g.contiguous())

    class RS(torch.autograd.Function):  # reduce-scatter forward, all-gather backward
        @staticmethod
        def forward(ctx, p):
            return c.reduce_scatter(p.contiguous())

        @staticmethod
        def backward(ctx, g):
            return c.all_gather(g.contiguous())
    return {"f": F.apply, "g": G.apply, "ag": AG.apply, "rs": RS.apply}


def attention(q, k, v, scale: float, sdpa: bool):
    """[B, nh, S, hd] each: the causal attention core."""
    import torch
    if sdpa:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    causal = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool).tril()
    return torch.matmul(torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1), v)


def all_reduce_grads(c: Collectives, params) -> None:
    """The gradients of PARAMS summed over the ranks in one flat buffer, as Megatron all-reduces
    the sequence-parallel parameters' gradients after the backward."""
    import torch
    flat = torch.cat([w.grad.reshape(-1) for w in params])
    c.all_reduce(flat)
    off = 0
    for w in params:
        w.grad.copy_(flat[off:off + w.numel()].view_as(w))
        off += w.numel()


def schedule_pairs(a: argparse.Namespace, prog: str, scheds: list[str], grads: dict[str, list[str]]) -> list[tuple[str, str]]:
    """The (forward, grad) schedules to time of PROG: each chosen forward schedule with the
    derived program's default; and each `grad(p)` schedule with the forward schedule of its
    name, else with each chosen forward schedule."""
    chosen = scheds if a.schedules == "all" else [s for s in a.schedules.split(",") if s in scheds]
    pairs = [(s, "default") for s in chosen]
    for g in grads.get(prog, []) if a.grad_schedules else []:
        pairs += [(g, g)] if g in scheds else [(s, g) for s in chosen]
    return pairs


def megatron_block(c: Collectives, sequence: bool, hd: int, sdpa: bool):
    """block(x, **w): this rank's part of the block in PyTorch. Tensor parallel: x [B, S, H]
    whole; sequence parallel: x [S/R, B, H], this rank's rows in Megatron's layout."""
    import torch.nn.functional as F
    fns = conjugates(c)
    scale = 1.0 / math.sqrt(hd)

    def block(x, ln1_w, ln1_b, wq, bq, wk, wv, bv, wo, bo, ln2_w, ln2_b, w_fc, b_fc, w_proj, b_proj):
        H = x.shape[-1]
        enter, leave = (fns["ag"], fns["rs"]) if sequence else (fns["f"], fns["g"])
        n1 = enter(F.layer_norm(x, (H,), ln1_w, ln1_b, 1e-5))
        lead = n1.shape[:2]  # (S, B) under SP, (B, S) under TP

        def heads(t):  # -> [B, nh, S, hd]
            t = t.view(*lead, -1, hd)
            return t.permute(1, 2, 0, 3) if sequence else t.transpose(1, 2)
        q = heads(n1 @ wq.reshape(H, -1) + bq.reshape(-1))
        k = heads(n1 @ wk.reshape(H, -1))
        v = heads(n1 @ wv.reshape(H, -1) + bv.reshape(-1))
        o = attention(q, k, v, scale, sdpa)
        o = (o.permute(2, 0, 1, 3) if sequence else o.transpose(1, 2)).reshape(*lead, -1)
        x1 = x + leave(o @ wo.reshape(-1, H)) + bo
        n2 = enter(F.layer_norm(x1, (H,), ln2_w, ln2_b, 1e-5))
        return x1 + leave(F.gelu(n2 @ w_fc + b_fc) @ w_proj) + b_proj
    return block


def pytorch_tp(full: dict[str, Any], a: argparse.Namespace, sequence: bool, sdpa: bool):
    """The block as a torch module parallelized by torch.distributed.tensor.parallel over a CPU
    gloo mesh of every rank: (module, ranks). Raises what PyTorch raises where it cannot."""
    import torch
    from torch import nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    H, NH = a.h, a.heads
    HD = H // NH

    def linear(w, b):  # nn.Linear holding w [in, ...] transposed
        w = w.reshape(w.shape[0], -1) if w.shape[0] == H else w.reshape(-1, H)
        lin = nn.Linear(w.shape[0], w.shape[1], bias=b is not None)
        with torch.no_grad():
            lin.weight.copy_(w.T)
            if b is not None:
                lin.bias.copy_(b.reshape(-1))
        return lin

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k = linear(full["wq"], full["bq"]), linear(full["wk"], None)
            self.v, self.o = linear(full["wv"], full["bv"]), linear(full["wo"], full["bo"])

        def forward(self, x):
            b, s, _ = x.shape

            def heads(t):  # this rank's heads: its columns of q, k, v
                return t.view(b, s, -1, HD).transpose(1, 2)
            o = attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), 1.0 / math.sqrt(HD), sdpa)
            return self.o(o.transpose(1, 2).reshape(b, s, -1))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(H), nn.LayerNorm(H)
            with torch.no_grad():
                for ln, w, b in ((self.ln_1, "ln1_w", "ln1_b"), (self.ln_2, "ln2_w", "ln2_b")):
                    ln.weight.copy_(full[w])
                    ln.bias.copy_(full[b])
            self.attn = Attention()
            self.fc, self.proj = linear(full["w_fc"], full["b_fc"]), linear(full["w_proj"], full["b_proj"])

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.proj(F.gelu(self.fc(self.ln_2(x))))

    mesh = init_device_mesh("cpu", (a.ranks_now,))
    blk = Block()
    if sequence:
        plan = {"ln_1": SequenceParallel(), "ln_2": SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                "attn.o": RowwiseParallel(output_layouts=Shard(1)),
                "fc": ColwiseParallel(input_layouts=Shard(1)), "proj": RowwiseParallel(output_layouts=Shard(1))}
    else:
        plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                "attn.o": RowwiseParallel(), "fc": ColwiseParallel(), "proj": RowwiseParallel()}
    return parallelize_module(blk, mesh, plan)


def gemms_alone(full_local: dict[str, Any], a: argparse.Namespace, R: int):
    """Every GEMM of this rank's forward and backward, alone (the bound)."""
    import torch
    B, S, H, NH = a.b, a.s, a.h, a.heads
    HD, nh = H // NH, NH // R
    g = torch.Generator().manual_seed(1)
    like = full_local["w_fc"]  # (the weights' device and dtype: bench/gpt_block_gpu.py's too)

    def randn(*shape: int):
        return torch.randn(*shape, generator=g).to(like)
    n = randn(B * S, H)
    D = nh * HD
    qkv = [full_local[k].reshape(H, -1) for k in ("wq", "wk", "wv")]
    wo, w_fc, w_proj = full_local["wo"].reshape(D, H), full_local["w_fc"], full_local["w_proj"]
    q = randn(B * nh, S, HD)
    a_ = randn(B * nh, S, S)
    o = randn(B * S, D)
    h = randn(B * S, w_fc.shape[1])
    pairs = [(n, w) for w in qkv] + [(q, q.transpose(1, 2)), (a_, q), (o, wo), (n, w_fc), (h, w_proj)]

    def run():
        for x, w in pairs:
            c = torch.matmul(x, w)          # forward
            torch.matmul(c, w.transpose(-2, -1))  # d of the left operand
            torch.matmul(x.transpose(-2, -1), c)  # d of the right operand
    return run


class Variants:
    """Every variant's step (forward + backward) and check (its y and dx as [B, rows, H]), by
    (parallelism, label), on this rank's inputs: x and dy whole (TP), this rank's rows of the
    sequence (SP), and the same rows in Megatron's [S/R, B, H] layout."""

    def __init__(self, comm, a: argparse.Namespace):
        import torch
        from coconetc.ir.slices import slice_range
        self.comm, self.a, self.R = comm, a, comm.Get_size()
        self.full = weights(a)
        self.local = mine(self.full, comm)
        gen = torch.Generator().manual_seed(2)
        x, dy = torch.randn(a.b, a.s, a.h, generator=gen), torch.randn(a.b, a.s, a.h, generator=gen)
        self.lo, self.hi = slice_range(a.s, self.R, comm.Get_rank())
        self.tp = x, dy
        self.sp = x[:, self.lo:self.hi].contiguous(), dy[:, self.lo:self.hi].contiguous()
        self.sbh = (x.transpose(0, 1)[self.lo:self.hi].contiguous(), dy.transpose(0, 1)[self.lo:self.hi].contiguous())
        self.hd = a.h // a.heads
        self.steps: dict[tuple[str, str], Any] = {}
        self.checks: dict[tuple[str, str], Any] = {}
        self.notes: list[str] = []

    def leaves(self, x):
        return x.clone().requires_grad_(True), {k: v.clone().requires_grad_(True) for k, v in self.local.items()}

    def add(self, par: str, label: str, forward, x, dy, ws: dict | None, after=None, sbh: bool = False) -> None:
        """A variant: FORWARD() -> y, then y.backward(dy) and AFTER() (x's and WS's gradients
        cleared first)."""
        def step():
            x.grad = None
            for w in (ws or {}).values():
                w.grad = None
            y = forward()
            y.backward(dy)
            if after is not None:
                after()
            return y

        def check():
            y = step().detach()
            return (y.transpose(0, 1), x.grad.transpose(0, 1)) if sbh else (y, x.grad)
        self.steps[par, label] = step
        self.checks[par, label] = check

    def megatron(self, sdpa: bool) -> None:
        for how in ("gloo", "mpi4py"):
            if sdpa and how != "gloo":
                continue
            suffix = ", SDPA attention" if sdpa else ""
            col = Collectives(self.comm, how)
            x, ws = self.leaves(self.tp[0])
            blk = megatron_block(col, False, self.hd, sdpa)
            self.add("tp", f"Megatron TP, torch + {how}{suffix}", lambda blk=blk, x=x, ws=ws: blk(x, **ws), x,
                     self.tp[1], ws)
            x, ws = self.leaves(self.sbh[0])
            blk = megatron_block(col, True, self.hd, sdpa)

            def reduce_replicated(ws=ws, col=col):  # Megatron: the sequence-parallel params' grads
                all_reduce_grads(col, [ws[k] for k in REPLICATED])
            self.add("sp", f"Megatron SP, torch + {how}{suffix}", lambda blk=blk, x=x, ws=ws: blk(x, **ws), x,
                     self.sbh[1], ws, after=reduce_replicated, sbh=True)

    def pytorch(self) -> None:
        for sequence in (False, True):
            par = "sp" if sequence else "tp"
            label = f"PyTorch TP{'+SP' if sequence else ''} (parallelize_module), gloo"
            try:
                common.gloo(self.comm)
                mod = pytorch_tp(self.full, self.a, sequence, False)
            except Exception as err:  # noqa: BLE001 - said under the table, not fatal
                self.notes.append(f"{label}: does not run here: {type(err).__name__}: "
                                  f"{str(err).splitlines()[0][:200]}")
                continue
            x0, dy = self.sp if sequence else self.tp
            x = x0.clone().requires_grad_(True)

            def finish(mod=mod):  # the Partial gradients (SP layernorms) made whole, as a step needs them
                from torch.distributed.tensor import DTensor, Replicate
                for p in mod.parameters():
                    g = p.grad
                    if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
                        p.grad = g.redistribute(placements=[Replicate()])

            def forward(mod=mod, x=x):
                for p in mod.parameters():
                    p.grad = None
                return mod(x)
            self.add(par, label, forward, x, dy, None, after=finish)

    def coconet(self, progs: dict[str, list[str]], grads: dict[str, list[str]]) -> None:
        """Each forward schedule with the derived program's default; and each `grad(p)` schedule
        with the forward schedule of its name, else with each forward schedule timed."""
        import coconetc.torch as ct
        scalars = {"scale": 1.0 / math.sqrt(self.hd), "pdrop": 0.0, "seed": 1}
        for prog, scheds in progs.items():
            par = "sp" if prog == SP else "tp"
            x0, dy = self.sp if prog == SP else self.tp
            for s, g in schedule_pairs(self.a, prog, scheds, grads):
                fn = ct.function(GPT_BLOCK, prog, schedule=s, grad_schedule=g, comm=self.comm)
                x, ws = self.leaves(x0)
                label = f"coconet {prog} {s}" + (f", grad {g}" if g != "default" else "")
                self.add(par, label, lambda fn=fn, x=x, ws=ws: fn(x=x, **ws, **scalars), x, dy, ws)
        if SP not in progs:
            self.notes.append(f"coconet {SP}: {GPT_BLOCK.name} has no such program (yet)")

    def check(self) -> None:
        """Every variant's y and dx against the first TP variant's (this rank's rows under SP)."""
        ref = None
        for (par, label), check in self.checks.items():
            y, dx = check()
            if ref is None:
                ref = y, dx
            want = ref if par == "tp" else (ref[0][:, self.lo:self.hi], ref[1][:, self.lo:self.hi])
            for what, got, exp in (("y", y, want[0]), ("dx", dx, want[1])):
                err = float((got - exp).abs().max() / exp.abs().max())
                if err > 1e-3:
                    raise SystemExit(f"{label}: {what} differs from the first variant's by {err:.2e} (relative)")


def run(comm, a: argparse.Namespace) -> dict[str, Any]:
    import warnings
    from mpi4py import MPI

    from coconetc.jobs.timing import slowest_medians, timed_rounds
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*is deprecated.*")
    R = comm.Get_size()
    a.ranks_now = R
    if a.heads % R or a.s % R:
        raise SystemExit(f"--heads {a.heads} and --s {a.s} must be multiples of the {R} ranks")
    v = Variants(comm, a)
    v.megatron(False)
    if a.sdpa:
        v.megatron(True)
    v.pytorch()
    v.coconet(programs(), grad_schedules())
    v.check()
    fns = {**v.steps, ("bound", "GEMMs alone"): gemms_alone(v.local, a, R)}
    times = timed_rounds(comm, {k: (lambda fn=fn: fn) for k, fn in fns.items()}, a.reps, 1, barrier_after=True)
    med = slowest_medians(comm, times)
    best = {k: comm.allreduce(min(t), op=MPI.MAX) for k, t in times.items()}
    return {"times": {f"{par}|{label}": t for (par, label), t in med.items()},
            "best": {f"{par}|{label}": t for (par, label), t in best.items()}, "notes": v.notes,
            "shape": {"B": a.b, "S": a.s, "H": a.h, "NH": a.heads, "HD": v.hd, "F": a.ffn * a.h}}


class ModelVariants:
    """--model: nanoGPT's GPT (bench/nanogpt.py, one seeded model, the same on every rank) with
    every Block replaced from outside, as a user of an unmodified model.py does: by a
    coconetc.torch.Module of gpt_block (or gpt_block_sp, with coconetc.torch.gpt's
    scatter_sequence in the first block and gather_sequence in the last), or by Megatron's
    tensor- (sequence-) parallel block over gloo, with and without SDPA attention. Each variant
    a model of its own with nanoGPT's AdamW; a step is forward, loss, backward, the optimizer's
    step and zero_grad."""

    def __init__(self, comm, a: argparse.Namespace):
        import torch
        import nanogpt
        self.comm, self.a, self.R = comm, a, comm.Get_size()
        self.cfg = nanogpt.GPTConfig(block_size=a.s, vocab_size=a.vocab, n_layer=a.layers, n_head=a.heads,
                                     n_embd=a.h)
        torch.manual_seed(0)
        self.base = nanogpt.GPT(self.cfg)
        with torch.no_grad():  # layernorms and biases away from 1 and 0, so each one's gradient matters
            for p in self.base.parameters():
                if p.dim() == 1:
                    p.add_(torch.randn(p.shape) * 0.1)
        g = torch.Generator().manual_seed(2)
        self.idx = torch.randint(a.vocab, (a.b, a.s), generator=g)
        self.targets = torch.randint(a.vocab, (a.b, a.s), generator=g)
        self.hd = a.h // a.heads
        self.steps: dict[tuple[str, str], Any] = {}
        self.models: dict[tuple[str, str], Any] = {}
        self.afters: dict[tuple[str, str], Any] = {}
        self.notes: list[str] = []

    def add(self, par: str, label: str, blocks, after=None) -> None:
        """A variant: a copy of the model with block i replaced by BLOCKS(i, nanoGPT's block i)."""
        import copy
        m = copy.deepcopy(self.base)
        for i, blk in enumerate(m.transformer.h):
            m.transformer.h[i] = blocks(i, blk)
        opt = m.configure_optimizers(0.1, 6e-4, (0.9, 0.95))

        def step(m=m, opt=opt, after=after):
            _, loss = m(self.idx, self.targets)
            loss.backward()
            if after is not None:
                after()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
        self.steps[par, label] = step
        self.models[par, label] = m
        self.afters[par, label] = after

    def coconet(self, progs: dict[str, list[str]], grads: dict[str, list[str]]) -> None:
        import torch
        import coconetc.torch as ct
        from coconetc.torch.gpt import block_parameters, gather_sequence, scatter_sequence
        a, comm, L = self.a, self.comm, self.a.layers
        scale = 1.0 / math.sqrt(self.hd)

        class Layer(torch.nn.Module):
            def __init__(self, i, blk, prog, s, g):
                super().__init__()
                self.sp, self.first, self.last = prog == SP, i == 0, i == L - 1
                self.layer = ct.Module(GPT_BLOCK, prog, parameters=block_parameters(blk, a.heads), schedule=s,
                                       grad_schedule=g, comm=comm)

            def forward(self, x):
                if self.sp and self.first:
                    x = scatter_sequence(x, comm=comm)
                y = self.layer(x=x.contiguous(), scale=scale, pdrop=0.0, seed=1)
                return gather_sequence(y, a.s, comm=comm) if self.sp and self.last else y
        for prog, scheds in progs.items():
            for s, g in schedule_pairs(a, prog, scheds, grads):
                label = f"coconet {prog} {s}" + (f", grad {g}" if g != "default" else "")
                self.add("sp" if prog == SP else "tp", label,
                         lambda i, blk, prog=prog, s=s, g=g: Layer(i, blk, prog, s, g))

    def megatron(self) -> None:
        import torch
        from coconetc.ir.slices import slice_range
        from coconetc.torch.gpt import block_parameters
        comm, a, L = self.comm, self.a, self.a.layers
        col = Collectives(comm, "gloo")
        lo, hi = slice_range(a.s, self.R, comm.Get_rank())

        class Scatter(torch.autograd.Function):  # [B, S, H] -> this rank's rows as [S/R, B, H]
            @staticmethod
            def forward(ctx, x):
                return x.transpose(0, 1)[lo:hi].contiguous()

            @staticmethod
            def backward(ctx, g):
                return col.all_gather(g.contiguous()).transpose(0, 1)

        class Gather(torch.autograd.Function):  # [S/R, B, H] -> [B, S, H] whole on every rank
            @staticmethod
            def forward(ctx, x):
                return col.all_gather(x.contiguous()).transpose(0, 1)

            @staticmethod
            def backward(ctx, g):
                return g.transpose(0, 1)[lo:hi].contiguous()

        class Layer(torch.nn.Module):
            def __init__(self, i, blk, sequence, sdpa):
                super().__init__()
                self.sequence, self.first, self.last = sequence, i == 0, i == L - 1
                self.w = torch.nn.ParameterDict(
                    {k: torch.nn.Parameter(v) for k, v in mine(block_parameters(blk, a.heads), comm).items()})
                self.fn = megatron_block(col, sequence, a.h // a.heads, sdpa)

            def forward(self, x):
                if self.sequence and self.first:
                    x = Scatter.apply(x)
                y = self.fn(x, **self.w)
                return Gather.apply(y) if self.sequence and self.last else y
        for sdpa in (False, True):
            suffix = ", SDPA attention" if sdpa else ""
            self.add("tp", f"Megatron TP, torch + gloo{suffix}", lambda i, blk, sdpa=sdpa: Layer(i, blk, False, sdpa))
            key = ("sp", f"Megatron SP, torch + gloo{suffix}")

            def reduce_replicated(key=key):  # Megatron: the sequence-parallel params' grads
                all_reduce_grads(col, [b.w[k] for b in self.models[key].transformer.h for k in REPLICATED])
            self.add(*key, lambda i, blk, sdpa=sdpa: Layer(i, blk, True, sdpa), after=reduce_replicated)

    def check(self) -> None:
        """Every variant's loss and the tied embedding's gradient (replicated in every variant) after
        one forward and backward against the unmodified model's in this process (relative 1e-4 and
        1e-3); then the gradients cleared."""
        _, loss = self.base(self.idx, self.targets)
        loss.backward()
        want, gwant = float(loss.detach()), self.base.lm_head.weight.grad.clone()
        self.base.zero_grad(set_to_none=True)
        for key, m in self.models.items():
            _, loss = m(self.idx, self.targets)
            loss.backward()
            if self.afters[key] is not None:
                self.afters[key]()
            got, grad = float(loss.detach()), m.lm_head.weight.grad
            err = float((grad - gwant).abs().max() / gwant.abs().max())
            m.zero_grad(set_to_none=True)
            if abs(got - want) > 1e-4 * abs(want) or err > 1e-3:
                raise SystemExit(f"{key[1]}: loss {got:.6f} against the unmodified model's {want:.6f}, the "
                                 f"embedding's gradient {err:.1e} relative")


def run_model(comm, a: argparse.Namespace) -> dict[str, Any]:
    """--model: one training step of each ModelVariants variant, timed side by side."""
    import warnings

    from coconetc.jobs.timing import slowest_medians, timed_rounds
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*is deprecated.*")
    if a.heads % comm.Get_size() or a.s % comm.Get_size():
        raise SystemExit(f"--heads {a.heads} and --s {a.s} must be multiples of the {comm.Get_size()} ranks")
    v = ModelVariants(comm, a)
    v.megatron()
    v.coconet(programs(), grad_schedules())
    v.check()
    times = timed_rounds(comm, {k: (lambda fn=fn: fn) for k, fn in v.steps.items()}, a.reps, 1, barrier_after=True)
    med = slowest_medians(comm, times)
    from mpi4py import MPI
    best = {k: comm.allreduce(min(t), op=MPI.MAX) for k, t in times.items()}
    return {"times": {f"{par}|{label}": t for (par, label), t in med.items()},
            "best": {f"{par}|{label}": t for (par, label), t in best.items()}, "notes": v.notes,
            "shape": {"B": a.b, "S": a.s, "H": a.h, "NH": a.heads, "HD": v.hd, "F": 4 * a.h,
                      "layers": a.layers, "vocab": a.vocab}}


def report(res: dict[str, Any], a: argparse.Namespace, R: int) -> None:
    times = res["times"]
    bound = times.get("bound|GEMMs alone")  # (none under --model)
    sh = res["shape"]
    what = (f"nanoGPT, {sh['layers']} layers, vocabulary {sh['vocab']}: a training step (forward, loss, backward, AdamW)"
            if a.model else "gpt_block forward + backward")
    print(f"\n{what}, f32, {R} ranks, B={sh['B']} S={sh['S']} H={sh['H']} "
          f"NH={sh['NH']} (HD={sh['HD']}) F={sh['F']}; median of {a.reps} (slowest rank)")
    width = max(len(k.split("|")[1]) for k in times) + 2
    print(f"{'variant':{width}s} {'ms':>9s} {'min ms':>9s} {'best PyTorch / this':>20s}"
          + (f" {'GEMMs alone / this':>19s}" if bound else ""))
    ratios: dict[str, dict[str, float]] = {}
    summary = {}
    for par, title in (("tp", "tensor parallel"), ("sp", "sequence parallel")):
        rows = {k.split("|")[1]: v for k, v in times.items() if k.startswith(par + "|")}
        if not rows:
            continue
        torch_rows = {k: v for k, v in rows.items() if not k.startswith("coconet")}
        best = min(torch_rows.values()) if torch_rows else float("nan")
        print(f"-- {title}")
        for k, v in rows.items():
            ratios[k] = {"vs_best_pytorch": best / v, **({"gemm_fraction": bound / v} if bound else {})}
            print(f"{'  ' + k:{width}s} {v * 1e3:9.1f} {res['best'][par + '|' + k] * 1e3:9.1f} {best / v:20.2f}"
                  + (f" {bound / v:19.2f}" if bound else ""))
        cc = {k: v for k, v in rows.items() if k.startswith("coconet")}
        if cc and torch_rows:
            kbest = min(cc, key=cc.get)
            summary[par] = {"best_coconet": kbest, "best_pytorch": min(torch_rows, key=torch_rows.get),
                            "speedup": best / cc[kbest], **({"of_gemm_bound": cc[kbest] / bound} if bound else {})}
            print(f"  best coconet ({kbest}): {best / cc[kbest]:.2f}x the speed of the best PyTorch variant "
                  f"({summary[par]['best_pytorch']})" + (f"; its time {cc[kbest] / bound:.2f}x the GEMMs' alone"
                                                          if bound else ""))
    if bound:
        print(f"-- bound\n{'  GEMMs alone':{width}s} {bound * 1e3:9.1f} {res['best']['bound|GEMMs alone'] * 1e3:9.1f}")
    for n in res["notes"]:
        print(f"note: {n}")
    out = Path(a.json) if a.json else common.HERE / "results" / ("gpt_model_f32.json" if a.model else "gpt_block_f32.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"ranks": R, "dtype": "f32", "reps": a.reps, "model": a.model, **res, "ratios": ratios,
                               "summary": summary}, indent=2))
    print(f"\nwrote {out}")


def shape_arguments(ap: argparse.ArgumentParser) -> None:
    """The block's shape options (the issue's B=8, S=512, H=1024, 16 heads, F=4H by default),
    here and in bench/gpt_block_gpu.py."""
    ap.add_argument("--b", type=int, default=8)
    ap.add_argument("--s", type=int, default=512)
    ap.add_argument("--h", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--ffn", type=int, default=4, help="F = ffn x h")


def checked_shape(a: argparse.Namespace) -> None:
    if a.h % a.heads:
        raise SystemExit(f"--h {a.h} is not a multiple of --heads {a.heads}")


SWEEP_H = (256, 512, 1024)
SWEEP_S = (128, 256, 512)


def sweep(a: argparse.Namespace, rest: list[str]) -> int:
    """--sweep: the block at H in SWEEP_H x S in SWEEP_S (B = --b, heads of 64, F = --ffn x H),
    each size a run of this script of its own (its table printed as it goes, its JSON in
    bench/results/gpt_block_sweep/), then one table of the best coconet against the best
    PyTorch variant at each size, tensor and sequence parallel (bench/results/gpt_block_sweep.json)."""
    name = "gpt_model_sweep" if a.model else "gpt_block_sweep"
    folder = common.HERE / "results" / name
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for h in SWEEP_H:
        for s in SWEEP_S:
            out = folder / f"h{h}_s{s}.json"
            cmd = [sys.executable, __file__, *rest, "--h", str(h), "--s", str(s), "--heads", str(h // 64),
                   "--json", str(out)]
            print(f"== H={h} S={s}: {' '.join(cmd[1:])}", flush=True)
            code = subprocess.run(cmd).returncode
            if code != 0:
                print(f"H={h} S={s}: failed with exit code {code}", flush=True)
                rows.append({"h": h, "s": s, "failed": code})
                continue
            doc = json.loads(out.read_text())
            rows.append({"h": h, "s": s, **{par: doc["summary"].get(par) for par in ("tp", "sp")}})
    what = f"nanoGPT ({a.layers} layers) training step" if a.model else "gpt_block forward + backward"
    print(f"\n{what}, f32, {a.ranks} ranks, B={a.b}, heads of 64, F={a.ffn}H: the best coconet "
          "against the best PyTorch variant (speed-up = its time / coconet's)")
    print(f"{'H':>6s} {'S':>6s} {'tensor parallel':>16s} {'sequence parallel':>18s}")
    for r in rows:
        cells = [f"{r[par]['speedup']:.2f}x" if r.get(par) else "-" for par in ("tp", "sp")]
        print(f"{r['h']:6d} {r['s']:6d} {cells[0]:>16s} {cells[1]:>18s}")
    out = Path(a.json) if a.json else common.HERE / "results" / f"{name}.json"
    out.write_text(json.dumps({"ranks": a.ranks, "b": a.b, "ffn": a.ffn, "reps": a.reps, "model": a.model,
                               **({"layers": a.layers, "vocab": a.vocab} if a.model else {}), "sizes": rows},
                              indent=2))
    print(f"\nwrote {out}")
    return 1 if any("failed" in r for r in rows) else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shape_arguments(ap)
    ap.add_argument("--sweep", action="store_true",
                    help="every H in 256, 512, 1024 and S in 128, 256, 512 (heads of 64), each a run of its own, "
                         "then one table (bench/results/gpt_block_sweep.json)")
    ap.add_argument("--schedules", default="all", help="coconet schedules to time (comma-separated), or all")
    ap.add_argument("--sdpa", action="store_true", help="also the Megatron variants over gloo with torch's SDPA")
    ap.add_argument("--no-grad-schedules", dest="grad_schedules", action="store_false",
                    help="leave out the file's `schedule s for grad(p)`s (each timed with the forward schedule of its name, "
                         "else with each forward schedule timed)")
    ap.add_argument("--model", action="store_true",
                    help="the block inside nanoGPT's GPT (bench/nanogpt.py): a training step of the model with every "
                         "Block replaced, against the model with Megatron's blocks (bench/results/gpt_model_f32.json)")
    ap.add_argument("--layers", type=int, default=2, help="--model: the model's blocks")
    ap.add_argument("--vocab", type=int, default=65, help="--model: the vocabulary (nanoGPT's shakespeare_char: 65)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    checked_shape(a)
    if a.model and a.ffn != 4:
        raise SystemExit("--model: nanoGPT's MLP is 4 x H wide; leave out --ffn")
    if a.sweep:
        rest = [x for x in sys.argv[1:] if x != "--sweep"]
        for opt in ("--h", "--s", "--heads", "--json"):  # each size's own
            while opt in rest:
                i = rest.index(opt)
                del rest[i:i + 2]
        return sweep(a, rest)
    if not common.in_mpi_job() and a.ranks > 1:  # built once here, before the ranks start
        import coconetc
        for prog in programs():
            coconetc.load(GPT_BLOCK, log=lambda msg: None, grad=prog)
        from coconetc.launch.mpiexec import run_python
        return run_python(a.ranks, [__file__, *sys.argv[1:]])
    comm = common.setup_rank()
    res = run_model(comm, a) if a.model else run(comm, a)
    if comm.Get_rank() == 0:
        report(res, a, comm.Get_size())
    return 0


if __name__ == "__main__":
    sys.exit(main())
