"""coconetc.torch.shard on R ranks, run by tests/test_sharded_torch.py as

    python tests/sharded_worker.py MODE...        (on the rank pool, or in the test's process at R = 1)

Every value checked is computed here independently of coconetc.torch.sharded: a rank's part is
`slice_range(n, R, rank)` of the sharded dim (coconetc.ir.slices, the language's rule), whole
tensors are the unsharded module's, training is compared with one process running the same model
unsharded. Rank 0 prints "OK <label>" or "FAIL <label>: <why>" per check (every rank's reason).

MODE roundtrip        parameters of uneven shapes, dims and dtypes (an empty part at R = 3, a 0-d
                      one, bf16, f64, one under min_numel): each rank's part, full(), gathered(),
                      gathered(modifier_rank=...), state_dict() on rank 0 only and on every rank
MODE train            two Linear layers and a LayerNorm, sharded (one along dim 1), 3 AdamW steps
                      with reduce="sum" and "avg" against one process: losses, gradients of the
                      parts, whole parameters (1e-5); the optimizer's state shaped like the parts
MODE save:PATH        the checkpoint model sharded here, saved to PATH: the file holds the unsharded
                      model's state dict exactly, and no temporary file is left
MODE load:PATH:R      PATH (saved on R ranks) loaded into another model sharded here: its whole
                      tensors are the file's and the unsharded model's, each part is its slice
MODE partial          a layer only rank 0's forward uses, one no rank uses: gradients as one process
                      summing every rank's loss (zero from the ranks that did not use it; None)
MODE opt_save:PATH    2 AdamW steps of the training model, saved with its optimizer: the file's
                      whole parameters and AdamW state are one process's (1e-5), keyed by name
MODE opt_load:PATH:R  PATH (saved on R ranks) loaded with a fresh AdamW (another lr) here, one more
                      step: the parameters of one process's 3 steps, step count 3, the saved lr
MODE program         a model holding examples/tp_mlp.ccn's weights sharded as the program slices
                      them (w1 along dim 1, b1 and w2 along dim 0, b2 whole): the parts passed as
                      they are to the compiled tp_mlp give the unsharded model's output, and its
                      gradients of the parts
MODE units           Stack (a root Linear on each side of a ModuleList of blocks of uneven widths):
                      gathered a unit at a time (the default units; reshard_after_forward True and
                      False; prefetch 0, 1, 2), and by named units (nested ones, a tied weight), 5
                      AdamW steps against one process: losses, gradients of the parts each step,
                      whole parameters after (1e-5); two forwards before one backward
MODE unit_memory     Chain (a ModuleList of Linear blocks only) with reshard_after_forward=True,
                      prefetch 0, 1, 2: at every layer's forward and backward, the bytes of whole
                      weights alive (tensors found by the garbage collector holding a sharded
                      weight's whole values, and the byte buffers the all-gathers fill) are at most
                      the largest prefetch+1 units' (their alignment padding allowed)
MODE absent          (alone in its job) rank 0 gathers a parameter the other ranks never gather:
                      the watchdog (COCONET_TIMEOUT=3) must end the job, naming the call and rank 1
MODE errors           (after a save) bad checkpoints (missing, extra, wrong shape, wrong dtype, on
                      one rank only; an optimizer state of the wrong shape or parameters, none saved),
                      a part of the wrong shape on one rank, a rank failing inside gathered(), a
                      file missing on one rank, a failed save, models that differ: raised on every
                      rank, naming the parameter (and the rank), nothing changed"""

from __future__ import annotations

import copy
import gc
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from mpi4py import MPI

import coconetc.torch as ct
from coconetc.ir.slices import slice_range

TOL = 1e-5
B = 7  # rows of each step's batch: uneven parts on 2 and 3 ranks
TP_MLP = Path(__file__).resolve().parents[1] / "examples" / "tp_mlp.ccn"


def part(whole: torch.Tensor, dim: int | None, R: int, rank: int) -> torch.Tensor:
    if dim is None:
        return whole
    lo, hi = slice_range(whole.shape[dim], R, rank)
    return whole.narrow(dim, lo, hi - lo)


class Params(torch.nn.Module):
    """Parameters of every kind the sharding meets: name -> (shape, dtype, dim asked)."""
    KINDS = {"a": ((5, 7), torch.float32, 0), "b": ((5, 7), torch.float32, 1), "c": ((2, 3), torch.float32, 0),
             "d": ((13,), torch.bfloat16, 0), "e": ((4, 6, 3), torch.float64, 2), "s": ((), torch.float32, 0),
             "small": ((3,), torch.float32, 0)}

    def __init__(self, seed: int):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        for name, (shape, dtype, _) in self.KINDS.items():
            self.register_parameter(name, torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype)))


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.LayerNorm(13), torch.nn.Tanh(), torch.nn.Linear(13, 5))
    with torch.no_grad():  # (LayerNorm starts at ones and zeros: made to differ between seeds)
        m[1].weight.add_(torch.randn(13) * 0.1)
        m[1].bias.add_(torch.randn(13) * 0.1)
    m.register_buffer("scale", torch.arange(3.0) + seed)
    return m


class Branches(torch.nn.Module):
    """A layer `c` used when asked; a layer `idle` never used."""

    def __init__(self):
        super().__init__()
        self.a, self.c, self.idle = torch.nn.Linear(7, 6), torch.nn.Linear(6, 6), torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, use_c: bool) -> torch.Tensor:
        h = self.a(x)
        return self.c(h) if use_c else h


class Stack(torch.nn.Module):
    """inp and out (the root unit's), a ModuleList of blocks of uneven widths (a unit each),
    out's weight sharded along dim 1, a small bias kept whole (min_numel)."""
    WIDTHS = (12, 20, 12, 20)

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        w = self.WIDTHS
        self.inp = torch.nn.Linear(7, w[0])
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.LayerNorm(b), torch.nn.Tanh()) for a, b in zip(w, w[1:]))
        self.out = torch.nn.Linear(w[-1], 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


class Branched(Stack):
    """Stack with blocks.0 and blocks.1 as a branch beside the input of blocks.2: the branch's
    output added where USE (its forward runs either way)."""

    def forward(self, x: torch.Tensor, use: bool = True) -> torch.Tensor:  # type: ignore[override]
        h = self.inp(x)
        b = self.blocks[1](self.blocks[0](h))
        return self.out(self.blocks[2](h + b if use else h))


STACK_SHARDING = dict(min_numel=6, dims={"out.weight": 1})  # out.bias (5 elements) stays whole
NAMED_UNITS = ["blocks.0", "blocks.1", "blocks.1.0"]  # nested units; blocks.2 in the root's


class _Probe(torch.autograd.Function):
    """The identity; its backward calls PROBE (after the backward of the layer it feeds)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, probe: Callable[[], None]) -> torch.Tensor:  # type: ignore[override]
        ctx.probe = probe
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        ctx.probe()
        return g, None


class Chain(torch.nn.Module):
    """A ModuleList of Linear layers only (no root parameters): each layer a unit. PROBE is
    called inside every layer's forward (its forward pre-hook, added after shard()'s) and in the
    backward after each layer's backward (its input's gradient computed, its weights' used)."""
    WIDTHS = (7, 30, 11, 24, 13, 17, 5)

    def __init__(self, probe: Callable[[], None]):
        super().__init__()
        torch.manual_seed(0)
        w = self.WIDTHS
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(w, w[1:]))
        self.probe = probe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(_Probe.apply(x, self.probe)))
        return x


def differences(sh, ref: torch.nn.Module) -> list[float]:
    """The largest |difference| of each tensor of the sharded model's whole state dict (every
    rank) from REF's."""
    whole = sh.state_dict(rank0_only=False)
    return [(whole[k] - v).abs().max().item() for k, v in ref.state_dict().items()]


def two_groups(m: torch.nn.Module) -> list[dict]:
    """nanoGPT's param groups: weight decay on the matrices only."""
    ps = list(m.parameters())
    return [{"params": [p for p in ps if p.dim() >= 2]}, {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]


def adamw(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)


MODEL_SHARDING = dict(min_numel=10, dims={"3.weight": 1})  # 3.bias (5 elements) stays whole


class Roundtrip:
    """Params(1) sharded on R ranks beside an unsharded copy: each check returns why it failed."""

    def __init__(self, R: int, rank: int):
        self.R, self.rank = R, rank
        self.m, self.whole = Params(1), Params(1)
        self.sh = ct.shard(self.m, min_numel=4, dims={n: d for n, (_, _, d) in Params.KINDS.items()})
        self.wants = {n: dict(self.whole.named_parameters())[n].detach() for n in Params.KINDS}
        self.dims = {n: None if n in ("s", "small") else d for n, (_, _, d) in Params.KINDS.items()}

    def part(self, n: str, whole: torch.Tensor) -> torch.Tensor:
        return part(whole, self.dims[n], self.R, self.rank)

    def parts(self) -> str | None:
        sh = self.sh
        for n, w in self.wants.items():
            got = dict(self.m.named_parameters())[n]
            if sh.dim(n) != self.dims[n] or not torch.equal(got, self.part(n, w)):
                return f"{n}: part {tuple(got.shape)} dim {sh.dim(n)}, want {tuple(self.part(n, w).shape)}"
            if sh.local(n) is not got or not torch.equal(got, w[sh.index(n)]):
                return f"{n}: local()/index() are not this rank's part"
        return f"sharded {sh.sharded}" if sorted(sh.sharded) != ["a", "b", "c", "d", "e"] else None

    def full(self) -> str | None:
        return next((n for n, w in self.wants.items() if not torch.equal(self.sh.full(n), w)), None)

    def gathered(self) -> str | None:
        before = {n: p.detach().clone() for n, p in self.m.named_parameters()}
        with self.sh.gathered():
            bad = [n for n, p in self.m.named_parameters() if not torch.equal(p, self.wants[n])]
            for p in self.m.parameters():
                p.data.fill_(7)  # dropped on exit (no modifier_rank)
        bad += [n for n, p in self.m.named_parameters() if not torch.equal(p, before[n])]
        return f"not whole, or changed after: {bad}" if bad else None

    def gathered_modifier_rank(self) -> str | None:
        last = self.R - 1
        with self.sh.gathered(modifier_rank=last):  # the other ranks' writes are dropped
            for n, p in self.m.named_parameters():
                p.data.copy_(self.wants[n] * 2 + 1 if self.rank == last else torch.full_like(p, 9))
        bad = [n for n, p in self.m.named_parameters() if not torch.equal(p, self.part(n, self.wants[n] * 2 + 1))]
        with self.sh.gathered(modifier_rank=0):  # back to the start
            for n, p in self.m.named_parameters():
                p.data.copy_(self.wants[n])
        return f"not rank {last}'s values: {bad}" if bad else None

    def state_dict(self) -> str | None:
        on0, everywhere = self.sh.state_dict(), self.sh.state_dict(rank0_only=False)
        want = self.whole.state_dict()
        if self.rank != 0 and on0 != {}:
            return f"rank0_only: rank {self.rank} got {list(on0)}"
        for got in ([on0] if self.rank == 0 else []) + [everywhere]:
            if list(got) != list(want) or any(not torch.equal(got[k], want[k]) for k in want):
                return f"state dict {[(k, tuple(v.shape)) for k, v in got.items()]} is not the whole one"
        return None


class Worker:
    def __init__(self, comm):
        self.comm, self.rank, self.R = comm, comm.Get_rank(), comm.Get_size()
        self.failed = 0

    def check(self, label: str, fn: Callable[[], str | None]) -> None:
        """FN() returns why it failed (or raises); every rank's reason is printed by rank 0."""
        try:
            why = fn() or ""
        except Exception as err:  # noqa: BLE001 - a failed check is reported, the others still run
            why = f"{type(err).__name__}: {err}"
        whys = self.comm.allgather(why)
        bad = [f"rank {r}: {w}" for r, w in enumerate(whys) if w]
        self.failed += bool(bad)
        if self.rank == 0:
            print(f"FAIL {label}: {' | '.join(bad)}" if bad else f"OK {label}", flush=True)

    # --- roundtrip -----------------------------------------------------------------------------
    def roundtrip(self) -> None:
        t = Roundtrip(self.R, self.rank)
        for label in ("parts", "full", "gathered", "gathered_modifier_rank", "state_dict"):
            self.check(f"roundtrip:R{self.R}:{label}", getattr(t, label))

    # --- training against one process ----------------------------------------------------------
    def train(self) -> None:
        for reduce in ("sum", "avg"):
            self.check(f"train:R{self.R}:{reduce}", lambda reduce=reduce: self._train(reduce))

    def _batch(self, t: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """Step t's batch (the same on every rank and in one process) and this rank's rows."""
        gen = torch.Generator().manual_seed(100 + t)
        lo, hi = slice_range(B, self.R, self.rank)
        return torch.randn(B, 7, generator=gen), torch.randn(B, 5, generator=gen), lo, hi

    def _step(self, m: torch.nn.Module, opt: torch.optim.Optimizer, t: int, scale: int = 1) -> torch.Tensor:
        """One step of the sharded model on this rank's rows: its loss (the ranks' add up to the
        batch's), backward scaled by SCALE (R under reduce="avg": the average is then the sum)."""
        x, y, lo, hi = self._batch(t)
        opt.zero_grad()
        mine = ((m(x[lo:hi]) - y[lo:hi]) ** 2).sum() / B
        (mine * scale).backward()
        return mine

    def _ref_step(self, ref: torch.nn.Module, ropt: torch.optim.Optimizer, t: int, step: bool = True) -> torch.Tensor:
        x, y, _, _ = self._batch(t)
        ropt.zero_grad()
        loss = ((ref(x) - y) ** 2).sum() / B
        loss.backward()
        if step:
            ropt.step()
        return loss

    def _steps_against(self, m, opt, ref, ropt, sh, steps: int, *scale: int) -> list[float]:
        """STEPS training steps of the sharded M and of REF in one process: each step's loss
        difference and every part's gradient difference (the optimizers step after)."""
        errs = []
        for t in range(steps):
            mine = self._step(m, opt, t, *scale)
            loss = self._ref_step(ref, ropt, t, step=False)
            errs.append(abs(self.comm.allreduce(mine.item()) - loss.item()))
            rp = dict(ref.named_parameters())
            errs += [(p.grad - part(rp[n].grad, sh.dim(n), self.R, self.rank)).abs().max().item()
                     for n, p in m.named_parameters() if p.numel()]
            opt.step()
            ropt.step()
        return errs

    def _train(self, reduce: str) -> str | None:
        R = self.R
        m, ref = make_model(0), make_model(0)
        sh = ct.shard(m, reduce=reduce, **MODEL_SHARDING)  # type: ignore[arg-type]
        opt, ropt = adamw(m), adamw(ref)
        errs = self._steps_against(m, opt, ref, ropt, sh, 3, R if reduce == "avg" else 1)
        shapes = [tuple(opt.state[p]["exp_avg"].shape) == tuple(p.shape) for p in m.parameters()]
        errs += differences(sh, ref)
        with torch.no_grad():
            x = torch.randn(4, 7, generator=torch.Generator().manual_seed(9))
            errs.append((m(x) - ref(x)).abs().max().item())  # a forward without gradients
        if not all(shapes):
            return "the optimizer's state is not shaped like the parts"
        return f"max |difference| {max(errs):.3g} > {TOL}" if max(errs) > TOL else None

    def partial(self) -> None:
        """A layer only rank 0's forward uses: its gradient is rank 0's (zero from the others),
        one no rank uses has none; as one process summing every rank's loss."""
        def run() -> str | None:
            torch.manual_seed(3)
            m = Branches()
            ref = copy.deepcopy(m)
            sh = ct.shard(m, reduce="sum")

            def loss(model: torch.nn.Module, r: int) -> torch.Tensor:
                x, y, _, _ = self._batch(r)
                lo, hi = slice_range(B, self.R, r)
                return model(x[lo:hi], r == 0).square().sum()
            loss(m, self.rank).backward()
            sum(loss(ref, r) for r in range(self.R)).backward()
            rp = dict(ref.named_parameters())
            if any(p.grad is not None for p in m.idle.parameters()):
                return "the unused layer got a gradient"
            errs = [(p.grad - part(rp[n].grad, sh.dim(n), self.R, self.rank)).abs().max().item()
                    for n, p in m.named_parameters() if not n.startswith("idle") and p.numel()]
            return f"max |difference| {max(errs):.3g} > {TOL}" if max(errs) > TOL else None
        self.check(f"partial:R{self.R}", run)

    # --- units, resharding, prefetching -------------------------------------------------------
    def units(self) -> None:
        for reshard in (True, False):
            for prefetch in (0, 1, 2):
                self.check(f"units:R{self.R}:reshard={reshard}:prefetch={prefetch}",
                           lambda r=reshard, p=prefetch: self._units(dict(reshard_after_forward=r, prefetch=p)))
        self.check(f"units:R{self.R}:named", lambda: self._units(dict(units=NAMED_UNITS, prefetch=1), tied=True))
        self.check(f"units:R{self.R}:two_forwards", self._two_forwards)
        self.check(f"units:R{self.R}:not_reaching", self._not_reaching)
        self.check(f"units:R{self.R}:traced", self._traced)

    def _traced(self) -> str | None:
        """A forward and backward under torch.profiler and coconetc.trace at once: each unit's
        all-gather (its start, the wait for it, the copy out of its whole tensors) and each
        non-root unit's gradients' reduce-scatter (its start, the wait) a range of both traces."""
        import shutil
        import tempfile

        import coconetc
        m = Stack(0)
        ct.shard(m, reduce="sum", prefetch=1, **STACK_SHARDING)  # type: ignore[arg-type]
        x, y, lo, hi = self._batch(0)
        folder = tempfile.mkdtemp(prefix="ccn_shard_trace")
        try:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, \
                    coconetc.trace(folder) as tr:
                (((m(x[lo:hi]) - y[lo:hi]) ** 2).sum() / B).backward()
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        want = set()
        for u in ("the root unit", *(f"unit 'blocks.{i}'" for i in range(3))):
            want |= {f"coconet shard: start the all-gather of {u}", f"coconet shard: wait for the all-gather of {u}",
                     f"coconet shard: copy out the all-gather of {u}"}
        for u in (f"unit 'blocks.{i}'" for i in range(3)):
            want |= {f"coconet shard: start the gradients' reduce-scatter of {u}",
                     f"coconet shard: wait for the reduce-scatter of the gradients of {u}"}
        profiled = {e.name for e in prof.events() if e.name.startswith("coconet shard:")}
        traced = {e["name"] for e in tr.events if e["cat"] in ("shard", "wait")}
        missing = sorted((want - profiled) | (want - traced))
        # AdamW inside the backward: each unit's update a compiled call's range
        m2 = Stack(0)
        sh2 = ct.shard(m2, reduce="sum", **STACK_SHARDING)  # type: ignore[arg-type]
        sh2.adamw_in_backward(two_groups(m2), lr=1e-2)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof2:
            (((m2(x[lo:hi]) - y[lo:hi]) ** 2).sum() / B).backward()
        updates = sum(e.name.startswith("coconet adamw_shard[") for e in prof2.events())
        if updates < 3:
            missing.append(f"{updates} coconet adamw_shard ranges (a unit's each)")
        return f"not in the traces: {missing}" if missing else None

    def _not_reaching(self) -> str | None:
        """A branch of two units whose output reaches the loss on rank 0 only (gathered again in
        rank 0's backward, caught up at the end of the others', in the same order), prefetch 0:
        3 AdamW steps against one process."""
        m, ref = Branched(0), Branched(0)
        sh = ct.shard(m, reduce="sum", prefetch=0, **STACK_SHARDING)  # type: ignore[arg-type]
        opt, ropt = adamw(m), adamw(ref)
        for t in range(3):
            x, y, lo, hi = self._batch(t)
            opt.zero_grad()
            (((m(x[lo:hi], self.rank == 0) - y[lo:hi]) ** 2).sum() / B).backward()
            opt.step()
            self._branched_ref_step(ref, ropt, t)
        err = max(differences(sh, ref))
        return f"max |difference| {err:.3g} > {TOL}" if err > TOL else None

    def _branched_ref_step(self, ref: Branched, ropt: torch.optim.Optimizer, t: int) -> None:
        """_ref_step for Branched: each rank's rows, the branch used for rank 0's only."""
        x, y, _, _ = self._batch(t)
        parts = [slice_range(B, self.R, r) for r in range(self.R)]
        ropt.zero_grad()
        (sum(((ref(x[a:b], r == 0) - y[a:b]) ** 2).sum() for r, (a, b) in enumerate(parts)) / B).backward()
        ropt.step()

    def _two_forwards(self) -> str | None:
        """Two forwards (this rank's rows in two halves), then one backward of their sum."""
        m, ref = Stack(0), Stack(0)
        sh = ct.shard(m, reduce="sum", **STACK_SHARDING)  # type: ignore[arg-type]
        x, y, lo, hi = self._batch(0)
        mid = (lo + hi) // 2
        (sum(((m(x[a:b]) - y[a:b]) ** 2).sum() for a, b in ((lo, mid), (mid, hi))) / B).backward()
        (((ref(x) - y) ** 2).sum() / B).backward()
        rp = dict(ref.named_parameters())
        errs = [(p.grad - part(rp[n].grad, sh.dim(n), self.R, self.rank)).abs().max().item()
                for n, p in m.named_parameters() if p.numel()]
        return f"max |difference| {max(errs):.3g} > {TOL}" if max(errs) > TOL else None

    def _units(self, how: dict, tied: bool = False) -> str | None:
        m, ref = Stack(0), Stack(0)
        if tied:  # blocks.0's first weight is blocks.2's too: a parameter of two units goes to the root's unit
            for model in (m, ref):
                model.blocks[2][0].weight = model.blocks[0][0].weight
        sh = ct.shard(m, reduce="sum", **STACK_SHARDING, **how)  # type: ignore[arg-type]
        want = {"": ["inp.weight", "inp.bias", "out.weight", "out.bias"]} if not tied else None
        got = {u.name: u.names for u in sh.units.units}
        if want is not None and (got[""] != want[""] or list(got)[1:] != [f"blocks.{i}" for i in range(3)]):
            return f"units {got}"
        if tied and (got["blocks.1.0"] != ["blocks.1.0.weight", "blocks.1.0.bias"] or "blocks.0.0.weight" not in got[""]
                     or "blocks.2.0.bias" not in got[""] or got["blocks.1"] != ["blocks.1.1.weight", "blocks.1.1.bias"]):
            return f"named units {got}"
        opt, ropt = adamw(m), adamw(ref)
        errs = self._steps_against(m, opt, ref, ropt, sh, 5)
        errs += differences(sh, ref)
        with torch.no_grad():
            x = torch.randn(4, 7, generator=torch.Generator().manual_seed(9))
            errs.append((m(x) - ref(x)).abs().max().item())
        return f"max |difference| {max(errs):.3g} > {TOL}" if max(errs) > TOL else None

    def in_backward(self) -> None:
        """adamw_in_backward: 4 steps against torch.optim.AdamW in one process, nanoGPT's two param
        groups (weight decay on the matrices only; each unit updated
        inside its backward, no .grad kept), with units of every kind (the default split,
        nested named ones with a weight tied across units, through the shared-memory window,
        whole tensors kept to the backward with two forwards before it, a unit whose output
        reaches the loss on rank 0 only; the fused collectives point to point but where asked); a
        checkpoint of its state resumed by a torch AdamW on a model sharded anew."""
        for label, how in (("default", dict(reduce="avg")), ("named_tied", dict(units=NAMED_UNITS, prefetch=2)),
                           ("two_forwards", dict(reshard_after_forward=False)), ("not_reaching", dict(prefetch=0))):
            self.check(f"in_backward:R{self.R}:{label}", lambda how=how, label=label: self._in_backward(label, how))
        self.check(f"in_backward:R{self.R}:checkpoint", self._in_backward_checkpoint)

    def _in_backward_run(self, how: dict, steps: int, tied: bool = False, two: bool = False,
                         branch: bool = False) -> tuple:
        m, ref = (Branched(0), Branched(0)) if branch else (Stack(0), Stack(0))
        if tied:
            for model in (m, ref):
                model.blocks[2][0].weight = model.blocks[0][0].weight
        how = {"reduce": "sum", **how}
        sh = ct.shard(m, **STACK_SHARDING, **how)  # type: ignore[arg-type]
        shm = tied  # (the fused collectives through the shared-memory window: the named units' case)
        opt = sh.adamw_in_backward(two_groups(m), lr=1e-2, weight_decay=0.1, shared_memory=shm)
        ropt = torch.optim.AdamW(two_groups(ref), lr=1e-2, weight_decay=0.1)
        windowed = opt._mod.adamw_shard.ext._shm_runs()  # type: ignore[attr-defined]
        scale = self.R if how["reduce"] == "avg" else 1
        errs: list[float] = []
        for t in range(steps):
            x, y, lo, hi = self._batch(t)
            if two:
                mid = (lo + hi) // 2
                (sum(((m(x[a:b]) - y[a:b]) ** 2).sum() for a, b in ((lo, mid), (mid, hi))) / B * scale).backward()
            elif branch:  # blocks.1's output feeds the loss on rank 0 only (its backward ends last elsewhere)
                (((m(x[lo:hi], self.rank == 0) - y[lo:hi]) ** 2).sum() / B * scale).backward()
            else:
                self._step(m, opt, t, scale)
            opt.step()
            errs += [1.0 for p in m.parameters() if p.grad is not None]  # (no gradient is kept)
            if branch:
                self._branched_ref_step(ref, ropt, t)
            else:
                self._ref_step(ref, ropt, t)
        errs += differences(sh, ref)
        windowed = opt._mod.adamw_shard.ext._shm_runs() - windowed  # type: ignore[attr-defined]
        if (windowed > 0) != (shm and self.R > 1):
            errs.append(float("inf"))  # (the window used where it was not asked for, or not where it was)
        return errs, sh, opt, ref, ropt

    def _in_backward(self, label: str, how: dict) -> str | None:
        errs = self._in_backward_run(how, 4, tied=label == "named_tied", two=label == "two_forwards",
                                     branch=label == "not_reaching")[0]
        return f"max |difference| {max(errs):.3g} > {TOL}" if max(errs) > TOL else None

    def _in_backward_checkpoint(self) -> str | None:
        """Saved after 3 steps in the backward, loaded into a torch AdamW stepping a model sharded
        anew (the same state format), and back into the optimizer that saved it (its state's
        tensors replaced: the next update copies them into new slices): a fourth step as one
        process takes it, in both."""
        errs, sh, opt, ref, ropt = self._in_backward_run({}, 3)
        path = Path(self.comm.bcast(tempfile.mkdtemp() if self.rank == 0 else None)) / "in_backward.pt"
        sh.save(path, optimizer=opt)
        m2 = Stack(5)
        sh2 = ct.shard(m2, reduce="sum", **STACK_SHARDING)  # type: ignore[arg-type]
        opt2 = torch.optim.AdamW(two_groups(m2), lr=1.0)  # (lr and weight decay: the checkpoint's)
        sh2.load(path, optimizer=opt2)
        self._step(m2, opt2, 3)
        opt2.step()
        sh.load(path, optimizer=opt)
        self._step(sh.module, opt, 3)
        self._ref_step(ref, ropt, 3)
        errs += differences(sh2, ref) + differences(sh, ref)
        self.comm.barrier()
        if self.rank == 0:
            shutil.rmtree(path.parent)
        return f"max |difference| {max(errs):.3g} > {TOL}" if max(errs) > TOL else None

    def unit_memory(self) -> None:
        for prefetch in (0, 1, 2):
            self.check(f"unit_memory:R{self.R}:prefetch={prefetch}", lambda p=prefetch: self._unit_memory(p))
        self.check(f"unit_memory:R{self.R}:kept", lambda: self._unit_memory(0, reshard=False))

    def _unit_memory(self, prefetch: int, reshard: bool = True) -> str | None:
        """The peak of whole weights' bytes within the largest prefetch+1 units' (RESHARD false:
        above the largest unit's, the forward's weights kept for the backward: the probe sees them)."""
        wholes = {n: p.detach().clone() for n, p in Chain(lambda: None).named_parameters()}
        gc.collect()
        warnings.simplefilter("ignore", FutureWarning)  # (isinstance on a deprecated torch alias warns)
        old = [t for t in gc.get_objects() if isinstance(t, torch.Tensor)]  # (held: their ids stay theirs)
        mine = {id(t) for t in old} | {id(w) for w in wholes.values()}
        peak = [0]

        def probe() -> None:  # the bytes of whole weights alive now, each storage once
            alive: dict[int, int] = {}
            for t in gc.get_objects():
                if not isinstance(t, torch.Tensor) or isinstance(t, torch.nn.Parameter) or id(t) in mine:
                    continue
                st = t.untyped_storage()
                if st.nbytes() == 0:
                    continue
                if t.dtype == torch.uint8 or any(t.shape == w.shape and torch.equal(t, w) for w in wholes.values()):
                    alive[st.data_ptr()] = st.nbytes()
            peak[0] = max(peak[0], sum(alive.values()))
        m = Chain(probe)
        sh = ct.shard(m, prefetch=prefetch, reshard_after_forward=reshard)
        for layer in m.layers:
            layer.register_forward_pre_hook(lambda mod, args: probe())
        x, y, lo, hi = self._batch(0)
        ((m(x[lo:hi]) - y[lo:hi]) ** 2).sum().backward()
        sizes = sorted((sum(_whole_bytes(sh, n) for n in u.names) for u in sh.units.units), reverse=True)
        bound = sum(sizes[:prefetch + 1])
        if self.rank == 0 and os.environ.get("SHARDED_SHOW_PEAK"):
            print(f"peak {peak[0]} bound {bound} reshard={reshard} prefetch={prefetch}", flush=True)
        if not reshard:
            return None if peak[0] > bound else f"kept: peak {peak[0]} bytes, not above the largest unit's {bound}"
        if not 0 < peak[0] <= bound:
            return f"peak {peak[0]} bytes of whole weights, the largest {prefetch + 1} units' {bound}"
        return None

    # --- the optimizer's state in checkpoints --------------------------------------------------
    def opt_save(self, path: str) -> None:
        def run() -> str | None:
            m, ref = make_model(0), make_model(0)
            sh = ct.shard(m, reduce="sum", **MODEL_SHARDING)  # type: ignore[arg-type]
            opt, ropt = adamw(m), adamw(ref)
            for t in range(2):
                self._step(m, opt, t)
                opt.step()
                self._ref_step(ref, ropt, t)
            sh.save(path, optimizer=opt)
            every = sh.optim_state_dict(opt, rank0_only=False)  # the same, on every rank
            errs = [(every["state"][n][k] - ropt.state[p][k]).abs().max().item()
                    for n, p in ref.named_parameters() for k in ("exp_avg", "exp_avg_sq", "step")]
            if self.rank != 0:
                return f"max |difference| {max(errs):.3g} > {TOL}" if max(errs) > TOL else None
            file = torch.load(path, weights_only=True)
            got, names = file["optimizer"], [n for n, _ in ref.named_parameters()]
            if got["param_groups"][0]["params"] != names or got["param_groups"][0]["lr"] != 1e-2:
                return f"param groups {got['param_groups']}"
            errs += [(file["model"][k] - v).abs().max().item() for k, v in ref.state_dict().items()]
            for n, p in ref.named_parameters():
                want = ropt.state[p]
                errs += [(got["state"][n][k] - want[k]).abs().max().item() for k in ("exp_avg", "exp_avg_sq", "step")]
            return f"max |difference| {max(errs):.3g} > {TOL}" if max(errs) > TOL else None
        self.check(f"opt_save:R{self.R}", run)

    def opt_load(self, path: str, saved_on: str) -> None:
        def run() -> str | None:
            m, ref = make_model(5), make_model(0)
            sh = ct.shard(m, reduce="sum", **MODEL_SHARDING)  # type: ignore[arg-type]
            opt, ropt = torch.optim.AdamW(m.parameters(), lr=0.5), adamw(ref)
            sh.load(path, optimizer=opt)  # the parameters, their AdamW state and the hyperparameters
            self._step(m, opt, 2)
            opt.step()
            for t in range(3):
                self._ref_step(ref, ropt, t)
            errs = differences(sh, ref)
            steps = {float(opt.state[p]["step"]) for p in m.parameters()}
            if steps != {3.0} or opt.param_groups[0]["weight_decay"] != 0.1:
                return f"steps {steps}, group {opt.param_groups[0]}"
            return f"max |difference| {max(errs):.3g} > {TOL}" if max(errs) > TOL else None
        self.check(f"opt_load:R{saved_on}->R{self.R}", run)

    # --- checkpoints ---------------------------------------------------------------------------
    def save(self, path: str) -> None:
        def saved() -> str | None:
            m = make_model(1)
            want = copy.deepcopy(m).state_dict()
            sh = ct.shard(m, **MODEL_SHARDING)  # type: ignore[arg-type]
            sh.save(path)
            if self.rank != 0:
                return None
            got = torch.load(path, weights_only=True)
            left = [p.name for p in Path(path).parent.iterdir() if p.name.endswith(".tmp")]
            if list(got) != list(want) or any(not torch.equal(got[k], want[k]) for k in want) or left:
                return f"the file is not the unsharded model's state dict ({list(got)}), or left {left}"
            return None
        self.check(f"save:R{self.R}", saved)

    def load(self, path: str, saved_on: str) -> None:
        def loaded() -> str | None:
            m = make_model(5)
            sh = ct.shard(m, **MODEL_SHARDING)  # type: ignore[arg-type]
            sh.load(path)
            file, want = torch.load(path, weights_only=True), make_model(1).state_dict()
            got = sh.state_dict(rank0_only=False)
            bad = [k for k in want if not torch.equal(got[k], want[k]) or not torch.equal(file[k], want[k])]
            bad += [n for n, p in m.named_parameters() if not torch.equal(p, part(want[n], sh.dim(n), self.R, self.rank))]
            plain = make_model(7)
            plain.load_state_dict(file)  # an unsharded model loads the same file
            bad += [k for k, v in plain.state_dict().items() if not torch.equal(v, want[k])]
            return f"not the saved values: {bad}" if bad else None
        self.check(f"load:R{saved_on}->R{self.R}", loaded)

    # --- a compiled program's sliced parameters -------------------------------------------------
    def program(self) -> None:
        def run() -> str | None:
            gen = torch.Generator().manual_seed(4)
            B, S, H, F = 2, 3, 5, 7
            m = torch.nn.ParameterDict({"w1": torch.randn(H, F, generator=gen), "b1": torch.randn(F, generator=gen),
                                        "w2": torch.randn(F, H, generator=gen), "b2": torch.randn(H, generator=gen)})
            ref = {k: v.detach().clone().requires_grad_(True) for k, v in m.items()}
            sh = ct.shard(m, dims={"w1": 1}, params=["w1", "b1", "w2"])
            x, dy = torch.randn(B, S, H, generator=gen), torch.randn(B, S, H, generator=gen)
            y = ct.function(TP_MLP, "tp_mlp", comm=self.comm)(x=x, **{k: sh.local(k) for k in ref})
            y.backward(dy)
            want = torch.nn.functional.gelu(x @ ref["w1"] + ref["b1"]) @ ref["w2"] + ref["b2"]
            want.backward(dy)
            errs = [(y - want).abs().max().item()]
            errs += [(sh.local(k).grad - part(v.grad, sh.dim(k), self.R, self.rank)).abs().max().item()
                     for k, v in ref.items() if sh.local(k).numel()]
            return f"max |difference| {max(errs):.3g} > {TOL}" if max(errs) > TOL else None
        self.check(f"program:R{self.R}:tp_mlp", run)

    # --- bad input -----------------------------------------------------------------------------
    def errors(self) -> None:
        e = Errors(self)
        e.every_rank_count()
        if self.R > 1:
            e.one_rank()


class Errors:
    """make_model(2) sharded; each bad call must raise ERROR on every rank, its message holding
    every needle, and leave the module's state as it was."""

    def __init__(self, w: Worker):
        self.w, self.R, self.rank, self.bad = w, w.R, w.rank, w.R - 1
        self.m = make_model(2)
        self.sh = ct.shard(self.m, **MODEL_SHARDING)  # type: ignore[arg-type]
        self.good = make_model(3).state_dict()

    def refused(self, label: str, call: Callable[[], object], error: type, needles: list[str]) -> None:
        def run() -> str | None:
            before = {k: v.clone() for k, v in self.m.state_dict().items()}
            try:
                call()
            except error as err:
                text = str(err)
                missing = [n for n in needles if n not in text]
                changed = [k for k, v in self.m.state_dict().items() if not torch.equal(v, before[k])]
                return f"{text!r} lacks {missing}, or changed {changed}" if missing or changed else None
            return f"no {error.__name__}"
        self.w.check(f"errors:R{self.R}:{label}", run)

    def without(self, key: str) -> dict:
        return {k: v for k, v in self.good.items() if k != key}

    def every_rank_count(self) -> None:
        sh, good = self.sh, self.good
        self.refused("missing", lambda: sh.load_state_dict(self.without("0.bias")), ValueError, ["missing '0.bias'"])
        self.refused("extra", lambda: sh.load_state_dict({**good, "2.weight": torch.zeros(1)}), ValueError,
                     ["unexpected '2.weight'"])
        self.refused("shape", lambda: sh.load_state_dict({**good, "3.weight": torch.zeros(5, 12)}), ValueError,
                     ["'3.weight'", "(5, 12)", "(5, 13)"])
        self.refused("dtype", lambda: sh.load_state_dict({**good, "1.weight": good["1.weight"].double()}),
                     ValueError, ["'1.weight'", "torch.float64", "torch.float32"])
        self.refused("not_a_dict", lambda: sh.load_state_dict([1, 2]), TypeError, ["list"])  # type: ignore[arg-type]
        opt = adamw(self.m)
        names = [n for n, _ in self.m.named_parameters()]
        state = {"state": {"0.weight": {"step": torch.tensor(1.0), "exp_avg": torch.zeros(13, 6),
                                        "exp_avg_sq": torch.zeros(13, 7)}},
                 "param_groups": [{**{k: v for k, v in opt.param_groups[0].items() if k != "params"}, "params": names}]}
        self.refused("optim_shape", lambda: sh.load_optim_state_dict(opt, state), ValueError,
                     ["'exp_avg' of '0.weight'", "(13, 6)", "(13, 7)"])
        wrong = {**state, "param_groups": [{**state["param_groups"][0], "params": names[::-1]}]}
        self.refused("optim_params", lambda: sh.load_optim_state_dict(opt, wrong), ValueError,
                     ["param group 0", "'3.bias'"])
        self.refused("optim_not_in_file", lambda: sh.load(SELF, optimizer=opt), ValueError,
                     ["holds no optimizer state"])
        self.w.check(f"errors:R{self.R}:optim_unchanged", lambda: f"state {list(opt.state)}" if opt.state else None)

    def wrong_part(self, call: Callable[[], object]) -> Callable[[], object]:
        """CALL with the last rank's part of 0.weight one row too long."""
        def run() -> object:
            p = self.m[0].weight
            keep = p.data
            if self.rank == self.bad:
                p.data = torch.zeros(keep.shape[0] + 1, 7)
            try:
                return call()
            finally:
                p.data = keep
        return run

    def fails_inside(self) -> None:
        with self.sh.gathered(modifier_rank=0):
            for p in self.m.parameters():
                p.data.fill_(3)
            if self.rank == self.bad:
                raise RuntimeError("a fault inside gathered()")

    def one_rank(self) -> None:
        sh, rank, bad, R = self.sh, self.rank, self.bad, self.R
        self.refused("one_rank_missing", lambda: sh.load_state_dict(self.without("3.bias") if rank == bad else self.good),
                     ValueError, [f"rank {bad} failed", "missing '3.bias'"])
        x = torch.randn(2, 7)
        for what, call in (("forward", lambda: self.m(x)), ("full", lambda: sh.full("3.weight")),
                           ("state_dict", sh.state_dict), ("save", lambda: sh.save("/nonexistent/x.pt"))):
            self.refused(f"wrong_part:{what}", self.wrong_part(call), ValueError,
                         [f"rank {bad} failed", "'0.weight'", f"on {R} ranks"])
        self.refused("fault_inside_gathered", self.fails_inside, RuntimeError,  # (the failing rank: its own exception)
                     ["a fault inside"] + ([f"rank {bad} failed"] if rank != bad else []))
        self.refused("file_missing_on_one_rank", lambda: sh.load(f"/nonexistent/{rank}.pt" if rank == bad else SELF),
                     FileNotFoundError, [f"rank {bad} failed", f"/nonexistent/{bad}.pt"])
        self.refused("save_fails_on_rank_0", lambda: sh.save(Path(SELF).parent), IsADirectoryError,
                     ["rank 0 failed", "save("])
        other = torch.nn.Linear(7 + (rank == bad), 3)
        self.refused("models_differ", lambda: ct.shard(other), RuntimeError,
                     [f"rank {bad} holds other parameters", "'weight'"])
        self.refused("unknown_name", lambda: ct.shard(torch.nn.Linear(3, 3), dims={"wieght": 1}), ValueError,
                     ["no parameter 'wieght'"])


def _whole_bytes(sh, name: str) -> int:
    """Parameter NAME's whole bytes as the gathers hold them: each rank's part padded to 16."""
    s = sh.specs[name]
    if s.dim is None:
        return 0
    return sum(-(-s.nbytes(sh.ranks, r) // 16) * 16 for r in range(sh.ranks))


def absent(comm) -> None:
    os.environ["COCONET_TIMEOUT"] = "3"  # (the rank pool restores the environment after the job)
    sh = ct.shard(make_model(2), **MODEL_SHARDING)  # type: ignore[arg-type]
    print(f"SHARDED {comm.Get_rank()}", flush=True)
    if comm.Get_rank() == 0:
        sh.full("0.weight")
        print("RANK 0 WAS NOT STOPPED", flush=True)


SELF = ""  # a checkpoint this job saved (errors: loaded by every rank but one)


def run(argv: list[str], comm) -> int:
    global SELF
    w = Worker(comm)
    plain: dict[str, Callable[[], None]] = {
        "roundtrip": w.roundtrip, "train": w.train, "program": w.program, "partial": w.partial,
        "units": w.units, "in_backward": w.in_backward, "unit_memory": w.unit_memory, "absent": lambda: absent(comm), "errors": w.errors}
    for mode in argv:
        name, _, rest = mode.partition(":")
        if name in plain:
            plain[name]()
        elif name == "save":
            SELF = rest
            w.save(rest)
        elif name == "opt_save":
            w.opt_save(rest)
        elif name in ("load", "opt_load"):
            path, _, saved_on = rest.rpartition(":")
            (w.load if name == "load" else w.opt_load)(path, saved_on)
        else:
            raise SystemExit(f"unknown mode {mode}")
    return 1 if w.failed else 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:], MPI.COMM_WORLD))
