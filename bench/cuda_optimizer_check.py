"""coconetc.torch.DistributedOptimizer on CUDA tensors, checked against torch on one GPU (R = 1),
the way a training script uses it: a small model, its loss's gradients, 20 steps; each check's
largest difference is printed and written to a JSON (bench/cuda_gpu_run.sh runs it).

  adam.ccn, every schedule of the CUDA module, against torch.optim.Adam(fused=True)
  adamw.ccn (default, zero): clip_grad_norm_ + torch.optim.AdamW(fused=True), clipping active;
  and two parameter groups clipped together (across_groups=True) against
  clip_grad_norm_(model.parameters()) + AdamW with the same two groups
  adam zero with the flat gradient in an NCCL window (shared_memory=True: what R > 1 does by
  default; at R = 1 the kernel reads it as any input)
  the communicator from a torch.distributed NCCL group (process_group=, the torchrun path) and
  from MPI (comm=, default)
  a checkpoint: the CUDA optimizer's state_dict (zero) loaded by the CPU backend and back into a
  CUDA one (default): every tensor equal
  mixed precision: bf16 (mixed_adam_bf16.ccn) and f16 (mixed_adam.ccn) parameters and gradients,
  f32 master weights and state (weights="w16", master="w"), against torch.optim.Adam(fused=True)
  on f32 copies of the gradients

Run: python bench/cuda_optimizer_check.py [--json PATH]
Without a GPU: COCONET_CUDA_EMULATE=1 python bench/cuda_optimizer_check.py (CPU tensors stand for
CUDA ones; the NCCL group is a gloo one). Exit code 1 if a check fails."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from coconetc.torch import DistributedOptimizer  # noqa: E402

EX = ROOT / "examples"
HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
STEPS = 20
GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
rows: list[dict] = []


def record(check: str, value: float | bool, tol: float | None = None) -> None:
    ok = bool(value) if isinstance(value, bool) else value <= (tol or 0.0)
    rows.append(dict(check=check, value=value, tolerance=tol, ok=ok))
    print(f"{'ok  ' if ok else 'FAIL'} {check}: {value}" + (f" (tolerance {tol:g})" if tol is not None else ""),
          flush=True)


def trial(name: str, fn) -> None:
    t0 = time.time()
    try:
        fn()
    except Exception:  # noqa: BLE001 - one failing check does not stop the others
        rows.append(dict(check=name, value=traceback.format_exc()[-1500:], tolerance=None, ok=False))
        print(f"FAIL {name}:\n{traceback.format_exc()}", flush=True)
    print(f"-- {name}: {time.time() - t0:.1f} s", flush=True)


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 10)).to(DEV)


def loss(m: torch.nn.Module, t: int) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(t)
    return (m(torch.randn(32, 64, device=DEV, generator=g)) ** 2).mean()


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def against_torch(schedule: str, pg, source: Path = EX / "adam.ccn", wd: float | None = None,
                  maxnorm: float | None = None, **options):
    a, b = model(), model()
    extra = ({} if wd is None else dict(wd=wd, maxnorm=maxnorm)) | options
    opt = DistributedOptimizer(a.parameters(), str(source), schedule=schedule, backend="cuda",
                               **({"process_group": pg} if pg is not None else {}), **HP, **extra)
    betas = (HP["beta1"], HP["beta2"])
    ref = (torch.optim.AdamW(b.parameters(), lr=HP["lr"], betas=betas, eps=HP["eps"], weight_decay=wd, fused=GPU)
           if wd is not None else torch.optim.Adam(b.parameters(), lr=HP["lr"], betas=betas, eps=HP["eps"], fused=GPU))
    clipped = 0
    for t in range(1, STEPS + 1):
        for m, o in ((a, opt), (b, ref)):
            o.zero_grad()
            loss(m, t).backward()
            if o is ref and maxnorm is not None:
                clipped += int(torch.nn.utils.clip_grad_norm_(m.parameters(), maxnorm).item() > maxnorm)
        opt.step()
        ref.step()
    if GPU:
        torch.cuda.synchronize()
    how = ("process_group" if pg is not None else "MPI") + "".join(f", {k}={v}" for k, v in options.items())
    record(f"{source.stem} {schedule} ({how}): max |w - torch's w| after {STEPS} steps", max_diff(a, b), 1e-5)
    if maxnorm is not None:
        record(f"{source.stem} {schedule}: clipping was active (steps clipped: {clipped})", clipped > 0)
    return opt, a


def across_groups(schedule: str, pg) -> None:
    """Two parameter groups (weights decayed, biases not), clipped by the norm of both together
    (across_groups=True), against clip_grad_norm_(model.parameters()) + AdamW with the same groups."""
    a, b = model(), model()

    def groups(m: torch.nn.Module, key: str) -> list[dict]:
        ps = list(m.parameters())
        return [{"params": [p for p in ps if p.dim() > 1], key: 0.1}, {"params": [p for p in ps if p.dim() == 1], key: 0.0}]
    maxnorm = 0.05
    opt = DistributedOptimizer(groups(a, "wd"), str(EX / "adamw.ccn"), schedule=schedule, backend="cuda",
                               across_groups=True, maxnorm=maxnorm, **({"process_group": pg} if pg is not None else {}),
                               **HP)
    ref = torch.optim.AdamW(groups(b, "weight_decay"), lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                            fused=GPU)
    for t in range(1, STEPS + 1):
        for m, o in ((a, opt), (b, ref)):
            o.zero_grad()
            loss(m, t).backward()
            if o is ref:
                torch.nn.utils.clip_grad_norm_(m.parameters(), maxnorm)
        opt.step()
        ref.step()
    if GPU:
        torch.cuda.synchronize()
    record(f"adamw {schedule}, two groups clipped together (across_groups=True): max |w - torch's w|",
           max_diff(a, b), 1e-5)


def checkpoint(pg) -> None:
    opt, a = against_torch("zero", pg)
    path = os.path.join(tempfile.mkdtemp(), "ck.pt")
    torch.save(dict(opt=opt.state_dict(), model=a.state_dict()), path)
    ck = torch.load(path, weights_only=False)

    def same(x: dict, y: dict) -> bool:
        return all(torch.equal(p.cpu(), q.cpu()) for i in x["state"] for p, q in
                   zip(x["state"][i].values(), y["state"][i].values()) if torch.is_tensor(p))
    cpu_model = model().cpu()
    cpu_model.load_state_dict({k: v.cpu() for k, v in ck["model"].items()})
    cpu_opt = DistributedOptimizer(cpu_model.parameters(), str(EX / "adam.ccn"), schedule="zero", backend="cpu", **HP)
    cpu_opt.load_state_dict(ck["opt"])
    back = cpu_opt.state_dict()
    record("checkpoint: CUDA (zero) -> CPU backend (zero), state equal", same(ck["opt"], back))
    m3 = model()
    m3.load_state_dict(a.state_dict())
    o3 = DistributedOptimizer(m3.parameters(), str(EX / "adam.ccn"), schedule="default", backend="cuda",
                              **({"process_group": pg} if pg is not None else {}), **HP)
    o3.load_state_dict(back)
    record("checkpoint: CPU backend -> CUDA (default), state equal", same(back, o3.state_dict()))


def mixed(pg) -> None:
    for source, dt in ((EX / "mixed_adam_bf16.ccn", torch.bfloat16), (EX / "mixed_adam.ccn", torch.float16)):
        for schedule in ("default", "zero"):
            torch.manual_seed(0)
            full = [torch.randn(70, 50, device=DEV), torch.randn(110, device=DEV)]
            params = [torch.nn.Parameter(x.to(dt)) for x in full]
            master = [torch.nn.Parameter(p.detach().float()) for p in params]
            opt = DistributedOptimizer(params, str(source), schedule=schedule, backend="cuda", weights="w16",
                                       master="w", scale=4.0, **({"process_group": pg} if pg is not None else {}), **HP)
            ref = torch.optim.Adam(master, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"], fused=GPU)
            for t in range(1, 11):
                gen = torch.Generator(device=DEV).manual_seed(t)
                grads = [(torch.randn(p.shape, device=DEV, generator=gen) * 4).to(dt) for p in params]
                for p, g in zip(params, grads):
                    p.grad = g.clone()
                for p, g in zip(master, grads):
                    p.grad = g.float() / 4.0
                opt.step()
                ref.step()
            sd = opt.state_dict()["state"]
            d = max((sd[i]["w"].to(DEV) - p.detach()).abs().max().item() for i, p in enumerate(master))
            record(f"{source.stem} {schedule}: max |master w - torch's| after 10 steps", d, 1e-5)
            d = max(((p.detach().float() - m.detach()).abs() / m.detach().abs().clamp_min(1e-6)).max().item()
                    for p, m in zip(params, master))  # one rounding of a master that may differ in its last bits
            ulp = 2.0 ** -7 if dt == torch.bfloat16 else 2.0 ** -10
            record(f"{source.stem} {schedule}: max relative |{str(dt)[6:]} w - torch's master|", d, ulp)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not GPU and os.environ.get("COCONET_CUDA_EMULATE") != "1":
        print("cuda_optimizer_check.py: no CUDA device (set COCONET_CUDA_EMULATE=1 for the host emulation)")
        return 2
    if GPU:
        torch.cuda.set_device(0)
    pg = common.one_rank_group("nccl" if GPU else "gloo")
    from coconetc.torch import _function
    schedules = sorted(_function(EX / "adam.ccn", None, backend="cuda").schedules)
    for s in schedules:
        trial(f"adam {s}", lambda s=s: against_torch(s, pg))
    for s in ("default", "zero"):
        trial(f"adamw {s}", lambda s=s: against_torch(s, pg, EX / "adamw.ccn", wd=0.1, maxnorm=0.05))
    for s in ("default", "zero"):
        trial(f"adamw {s} across groups", lambda s=s: across_groups(s, pg))
    trial("adam zero, comm from MPI", lambda: against_torch("zero", None))
    # the flat gradient in an NCCL window (window_empty: ncclMemAlloc + ncclCommWindowRegister, a
    # torch tensor over it), as every run on more than one rank has it by default
    trial("adam zero, gradient in a window", lambda: against_torch("zero", pg, shared_memory=True))
    trial("checkpoint", lambda: checkpoint(pg))
    trial("mixed precision", lambda: mixed(pg))
    dist.destroy_process_group()
    failed = [r["check"] for r in rows if not r["ok"]]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} checks passed" + (f"; failed: {failed}" if failed else ""))
    if a.json:
        Path(a.json).write_text(json.dumps({"device": torch.cuda.get_device_name() if GPU else "host emulation",
                                            "torch": torch.__version__, "checks": rows}, indent=1, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
