"""Sharded parameters on 2 ranks, memory and speed side by side: a nanoGPT of about 20M
parameters (bench/nanogpt.py: d 512, 6 layers, 8 heads, vocabulary 2048, head tied to the token
embedding; f32), data parallel on random tokens, AdamW (nanoGPT's two groups), in eight ways:

  * coconetc.torch.shard (parameters, gradients and AdamW's state sharded over the ranks, MPI),
    gathered a unit at a time (each block a unit, the rest the root's), prefetch 1, resharded
    after each block's forward (the defaults); the same with prefetch 0
  * the same with reshard_after_forward=False (each block's whole weights kept for its backward)
  * the same as one unit (units=[]: the whole model gathered for the step)
  * the defaults with AdamW inside the backward (adamw_in_backward: each unit's update fused
    into the reduce-scatter of its gradients, no gradient stored); the same with prefetch 0
  * torch FSDP2: fully_shard on each block, then on the model (gloo)
  * DDP (gloo): every rank holds everything

Each variant first trains --check iterations from the same initial weights on the same batches;
its losses must agree with DDP's (relative 1e-4), or the run stops. Speed: --iters iterations of
each, interleaved in one set of ranks (bench/common.py timed_all), the median of the slowest
rank. Memory, for each variant in ranks of its own (so that one variant's peak does not hide
another's): the bytes a rank holds between steps (its parameters, gradients and optimizer state,
counted from the tensors: a DTensor's local part, a storage once), and the growth of the rank's
peak resident memory (ru_maxrss) from before the model is built through --check iterations (the
whole parameters gathered in a step, the activations and communication buffers included;
glibc's mmap threshold pinned so that freed tensors leave the process), and the growth of the
peak within the steps after the first above what the rank holds between them (the peak reset
through /proc/self/clear_refs: the whole parameters gathered, activations, gradients and
buffers of one step; it needs --check 2 or more). A variant that fails
here (FSDP2 on the CPU over gloo depends on the torch version; it runs with torch 2.13) prints its
error in its row instead of figures.

Run: python bench/sharded.py [--small] [--iters 10] [--check 3] [--batch 4] [--seq 64] [--json PATH]
(--small: 4 layers of d 256, 4 heads, about 4M parameters: a run of a few minutes on 2 cores.)
It relaunches itself under mpiexec (once for the speed, once a variant for the memory); prints a
markdown table with ratios against DDP and writes bench/results/sharded.json."""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

CONFIG = dict(block_size=64, vocab_size=2048, n_layer=6, n_head=8, n_embd=512, dropout=0.0, bias=True)
SMALL = dict(n_layer=4, n_head=4, n_embd=256)  # --small: about 4M parameters
HP = dict(lr=6e-4, betas=(0.9, 0.95), eps=1e-8)
WD = 0.1
SHARD = "coconetc.torch.shard, units, prefetch 1 + AdamW(fused)"
SHARD_P0 = "coconetc.torch.shard, units, prefetch 0 + AdamW(fused)"
SHARD_KEPT = "coconetc.torch.shard, units, reshard_after_forward=False + AdamW(fused)"
SHARD_ONE = "coconetc.torch.shard, one unit + AdamW(fused)"
SHARD_IN_BW = "coconetc.torch.shard, units, prefetch 1, AdamW inside the backward (adamw_in_backward)"
SHARD_IN_BW_P0 = "coconetc.torch.shard, units, prefetch 0, AdamW inside the backward (adamw_in_backward)"
FSDP2, DDP = "FSDP2 fully_shard (gloo) + AdamW(fused)", "DDP (gloo) + AdamW(fused)"
VARIANTS = (SHARD, SHARD_P0, SHARD_KEPT, SHARD_ONE, SHARD_IN_BW, SHARD_IN_BW_P0, FSDP2, DDP)
SHARDINGS = {SHARD: {}, SHARD_P0: {"prefetch": 0}, SHARD_KEPT: {"reshard_after_forward": False}, SHARD_ONE: {"units": []},
             SHARD_IN_BW: {}, SHARD_IN_BW_P0: {"prefetch": 0}}
MIB = 1 << 20


def base_model() -> Any:
    import torch
    from nanogpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(**CONFIG))


def adamw(model: Any, in_backward: bool = False) -> Any:
    """nanoGPT's two groups (decay on the 2-D parameters): torch's fused AdamW, or (IN_BACKWARD)
    coconet's inside the backward of the sharded MODEL."""
    import torch
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if in_backward:
        return model._coconet_sharded.adamw_in_backward(groups, **HP)
    return torch.optim.AdamW(groups, fused=True, **HP)


def wrap(name: str, model: Any, comm: Any) -> Any:
    """MODEL made the variant NAME (in place where the variant does so); the module to call."""
    if name in SHARDINGS:
        import coconetc.torch as ct
        ct.shard(model, comm=comm, **SHARDINGS[name])
        return model
    common.gloo(comm)
    if name == DDP:
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (comm.Get_size(),))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class Variant:
    """One model copy made variant NAME, its optimizer and its iteration (batch k the same for
    every variant)."""

    def __init__(self, name: str, comm: Any, batches: Any):
        self.model = base_model()
        self.call = wrap(name, self.model, comm)
        self.opt = adamw(self.model, in_backward=name in (SHARD_IN_BW, SHARD_IN_BW_P0))
        self.batches, self.k = batches, 0

    def __call__(self) -> float:
        x, y = self.batches(self.k)
        self.k += 1
        self.opt.zero_grad(set_to_none=True)
        _, loss = self.call(x, y)
        loss.backward()
        self.opt.step()
        return float(loss.item())

    def held(self) -> int:
        """Bytes of this rank's parameters, gradients and optimizer state (each storage once)."""
        seen: dict[int, int] = {}

        def add(t: Any) -> None:
            t = t.to_local() if hasattr(t, "to_local") else t
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        for p in self.model.parameters():
            add(p)
            if p.grad is not None:
                add(p.grad)
        for st in self.opt.state.values():
            for v in st.values():
                if hasattr(v, "untyped_storage") and v.dim() > 0:
                    add(v)
        return sum(seen.values())


def batches_of(a: argparse.Namespace, rank: int) -> Any:
    import torch

    def batches(k: int) -> tuple[Any, Any]:
        gen = torch.Generator().manual_seed(1000 * k + rank)
        t = torch.randint(CONFIG["vocab_size"], (a.batch, a.seq + 1), generator=gen)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()
    return batches


def rss() -> int:
    """This process's resident memory now, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> bool:
    """This process's peak resident memory (VmHWM) reset to what it holds now (Linux: clear_refs 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def high_water() -> int:
    """This process's peak resident memory (VmHWM) since its last reset, in bytes."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def memory_rank(a: argparse.Namespace, comm: Any) -> dict[str, Any]:
    """In ranks of its own: variant a.memory's held bytes and peak resident growth (each rank's; the
    largest over the ranks), and its losses."""
    from mpi4py import MPI
    comm.Barrier()
    before = rss()
    try:
        v = Variant(a.memory, comm, batches_of(a, comm.Get_rank()))
        losses = [v()]  # (the optimizer's state made)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
        gc.collect()
        reset = reset_peak()
        between = rss()
        losses += [v() for _ in range(a.check - 1)]
    except Exception as err:  # noqa: BLE001 - reported as the variant's row
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
    peak = max(peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before)
    step = high_water() - between if reset and a.check > 1 else None
    return {"held": comm.allreduce(v.held(), op=MPI.MAX), "peak": comm.allreduce(peak, op=MPI.MAX),
            "step": comm.allreduce(step, op=MPI.MAX) if step is not None else None, "losses": losses}


def speed_rank(a: argparse.Namespace, comm: Any) -> dict[str, Any]:
    """Every variant that can run, checked against DDP's losses, then timed interleaved."""
    from mpi4py import MPI
    batches = batches_of(a, comm.Get_rank())
    variants: dict[str, Any] = {}
    errors: dict[str, str] = {}
    losses: dict[str, list[float]] = {}
    for name in VARIANTS:
        try:
            variants[name] = Variant(name, comm, batches)
            losses[name] = [variants[name]() for _ in range(a.check)]
        except Exception as err:  # noqa: BLE001 - reported as the variant's row
            errors[name] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            variants.pop(name, None)
    if DDP not in losses:
        return {"errors": errors}
    want = losses[DDP]
    diff = {k: comm.allreduce(max(abs(x - y) / abs(y) for x, y in zip(ls, want)), op=MPI.MAX)
            for k, ls in losses.items()}
    bad = [k for k, d in diff.items() if not d <= 1e-4]
    if bad:
        return {"errors": errors, "diff": diff, "bad": bad}
    t = common.timed_all(comm, variants, a.iters)
    return {"errors": errors, "diff": diff, "seconds": t}


def in_ranks(a: argparse.Namespace) -> int:
    comm = common.setup_rank()
    out = memory_rank(a, comm) if a.memory else speed_rank(a, comm)
    if comm.Get_rank() == 0:
        Path(a.out).write_text(json.dumps(out))
    return 0


def launch(a: argparse.Namespace, extra: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    from coconetc.launch.mpiexec import run_python
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        rc = run_python(a.ranks, [__file__, *sys.argv[1:], *extra, "--out", str(out)], env=env)
        if rc or not out.exists():
            return {"error": f"the ranks failed (exit code {rc})"}
        return json.loads(out.read_text())


def table(a: argparse.Namespace, speed: dict[str, Any], memory: dict[str, dict[str, Any]]) -> None:
    nparams = sum(p.numel() for p in base_model().parameters())
    print(f"\nnanoGPT {nparams / 1e6:.1f}M parameters ({CONFIG['n_layer']} layers, d {CONFIG['n_embd']}, vocabulary "
          f"{CONFIG['vocab_size']}), f32, {a.ranks} ranks, batch {a.batch} x {a.seq} a rank; median of {a.iters} "
          "iterations, ms of the slowest rank; memory the largest over the ranks\n")
    print("| variant | ms an iteration | speed vs DDP | held between steps (MiB) | vs DDP | peak growth (MiB) | vs DDP "
          "| a step's peak above between steps (MiB) | vs DDP |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    t, ref = speed.get("seconds", {}), memory.get(DDP, {})
    for name in VARIANTS:
        m = memory.get(name, {})
        why = speed.get("errors", {}).get(name) or m.get("error")
        if why:
            print(f"| {name} | cannot run here: {why} | | | | | | | |")
            continue
        speed_cols = (f"{t[name] * 1e3:.0f} | {t[DDP] / t[name]:.2f}" if name in t and DDP in t else "- | -")
        mem_cols = (f"{m['held'] / MIB:.0f} | {m['held'] / ref['held']:.2f} | {m['peak'] / MIB:.0f} | "
                    f"{m['peak'] / ref['peak']:.2f}" if "held" in m and "held" in ref else "- | - | - | -")
        mem_cols += (f" | {m['step'] / MIB:.1f} | {m['step'] / ref['step']:.2f}" if m.get("step") and ref.get("step")
                     else " | - | -")
        print(f"| {name} | {speed_cols} | {mem_cols} |")
    if speed.get("diff"):
        print("\nlosses over the first iterations, largest relative difference from DDP's: "
              + ", ".join(f"{k} {d:.1e}" for k, d in speed["diff"].items()))
    if speed.get("bad"):
        print(f"MISMATCH: losses differ from DDP's: {', '.join(speed['bad'])}: not timed")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=10, help="timed iterations of each variant")
    ap.add_argument("--check", type=int, default=3, help="iterations first trained and compared (and measured)")
    ap.add_argument("--batch", type=int, default=4, help="sequences a rank per iteration")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--small", action="store_true", help="4 layers of d 256 (about 4M parameters)")
    ap.add_argument("--memory", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.small:
        CONFIG.update(SMALL)
    if common.in_mpi_job():
        return in_ranks(a)
    speed = launch(a, [])
    pinned = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}  # freed tensors leave the process
    memory = {name: launch(a, ["--memory", name], pinned) for name in VARIANTS}
    table(a, speed, memory)
    out = Path(a.json) if a.json else common.HERE / "results" / "sharded.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": CONFIG, "ranks": a.ranks, "batch": a.batch, "seq": a.seq, "iters": a.iters,
                               "speed": speed, "memory": memory}, indent=2))
    print(f"\nwrote {out}")
    return 1 if speed.get("bad") or "error" in speed else 0


if __name__ == "__main__":
    sys.exit(main())
