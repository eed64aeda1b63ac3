"""coconetc.torch.function / Module on several ranks, run by tests/test_torch_function.py as

    mpiexec -n R python tests/torch_function_worker.py MODE

Every check compares with the same computation written for ONE process in plain PyTorch (full
weights, torch.autograd): the gradient of every input in its layout (replicated: the whole
gradient on every rank; sliced: this rank's slice), then the weights after SGD steps.
Rank 0 prints "OK <label> <max relative difference>" or "FAIL <label>: <why>" per check.

MODE tp     examples/tp_mlp.ccn's tp_mlp under every forward x backward schedule of the file;
            the saved-values cut against the recomputing derived program; 5 SGD steps of a
            coconetc.torch.Module against the one-process layer
MODE tp_cuda  tp_mlp with backend="cuda" (run with COCONET_CUDA_EMULATE=1: the CUDA module
            under the host emulation, CPU tensors standing for CUDA tensors)
MODE block  tp_mlp.ccn's tp_block (the residual MLP) under its schedules, the backward fused
            with its epilogue and overlapped
MODE sp     tp_mlp.ccn's sp_block (sequence-parallel: layernorm on this rank's rows, allgather,
            column- and row-parallel matmuls, reducescatter, dropout, residual)
MODE pipe   examples/pipeline.ccn's stage on 4 ranks as 2 groups: group 0's stage trained with
            the loss computed on group 1 (send(next) forward, send(prev) backward)"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

import coconetc.torch as ct
from coconetc.ir.slices import slice_range
from coconetc.jobs.abort import stop_job_on_failure

REPO = Path(__file__).resolve().parents[1]
TP_MLP, PIPELINE = REPO / "examples" / "tp_mlp.ccn", REPO / "examples" / "pipeline.ccn"
TOL = 2e-5  # f32, relative to the largest element of the reference
FAILED: list[str] = []


def report(comm, label: str, pairs: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
    """Compare (name, got, want) on every rank; rank 0 prints the worst over the ranks."""
    worst, why = 0.0, ""
    for name, got, want in pairs:
        if tuple(got.shape) != tuple(want.shape):
            worst, why = float("inf"), f"{name}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
            break
        scale = float(want.abs().max()) or 1.0
        err = float((got.double() - want.double()).abs().max()) / scale
        if err > worst:
            worst, why = err, f"{name} differs by {err:.2e} (relative)"
    everyone = comm.allgather((worst, why))
    worst, why = max(everyone, key=lambda t: t[0])
    if comm.Get_rank() == 0:
        if worst <= TOL:
            print(f"OK {label} {worst:.2e}", flush=True)
        else:
            print(f"FAIL {label}: {why}", flush=True)
    if worst > TOL:
        FAILED.append(label)


def tp_full(gen: torch.Generator, b: int, s: int, h: int, f: int) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(b, s, h, generator=gen), "w1": torch.randn(h, f, generator=gen) / h ** 0.5,
            "b1": torch.randn(f, generator=gen), "w2": torch.randn(f, h, generator=gen) / f ** 0.5,
            "b2": torch.randn(h, generator=gen)}


def tp_reference(t: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.gelu(t["x"] @ t["w1"] + t["b1"]) @ t["w2"] + t["b2"]


def tp_parts(t: dict[str, torch.Tensor], lo: int, hi: int) -> dict[str, torch.Tensor]:
    """This rank's arguments: w1's columns, b1's and w2's rows lo:hi; x and b2 whole."""
    return {"x": t["x"], "w1": t["w1"][:, lo:hi], "b1": t["b1"][lo:hi], "w2": t["w2"][lo:hi], "b2": t["b2"]}


def mode_tp(comm, backend: str | None = None) -> None:
    R, rank = comm.Get_size(), comm.Get_rank()
    B, S, H, F = 2, 6, 8, 12
    lo, hi = slice_range(F, R, rank)
    gen = torch.Generator().manual_seed(0)
    full = tp_full(gen, B, S, H, F)
    dy = torch.randn(B, S, H, generator=gen)
    ref = {k: v.clone().requires_grad_(True) for k, v in full.items()}
    tp_reference(ref).backward(dy)
    want = tp_parts({k: v.grad for k, v in ref.items()}, lo, hi)
    from coconetc.sourcefile import load_file, with_grads
    mod = with_grads(load_file(TP_MLP), ["tp_mlp"])
    fwd = ["default", *[s for s, v in mod.schedules["tp_mlp"].items() if not v.auto]]
    bwd = ["default", *[s for s, v in mod.schedules["tp_mlp_grad"].items() if not v.auto]]
    y_want = tp_reference(full)
    if backend == "cuda":  # the CUDA module under the host emulation: a few pairs
        fwd, bwd = fwd[:2], bwd[:2]
    for s in fwd:
        for g in bwd:
            fn = ct.function(TP_MLP, "tp_mlp", schedule=s, grad_schedule=g, comm=comm, backend=backend)
            args = {k: v.clone().contiguous().requires_grad_(True) for k, v in tp_parts(full, lo, hi).items()}
            y = fn(**args)
            y.backward(dy)
            label = f"tp{'_cuda' if backend else ''}:{s}:{g}:R{R}" + (":saved" if fn.saved else ":recomputed")
            report(comm, label, [("y", y.detach(), y_want)] +
                   [(f"d_{k}", args[k].grad, want[k]) for k in args])
    if backend == "cuda":
        return
    # the saved-values cut must keep a and h and recompute only the bias add inside gelu
    fn = ct.function(TP_MLP, "tp_mlp", comm=comm)
    if rank == 0:
        print(f"{'OK' if set(fn.saved) == {'a', 'h'} else 'FAIL'} tp:saved_values {fn.saved} {fn.recomputed}",
              flush=True)
    # training: 5 SGD steps of the layer as a Module against the one-process layer
    layer = ct.Module(TP_MLP, "tp_mlp", parameters={k: full[k] for k in ("w1", "b1", "w2", "b2")}, comm=comm)
    refw = {k: full[k].clone().requires_grad_(True) for k in ("w1", "b1", "w2", "b2")}
    opts = [torch.optim.SGD(layer.parameters(), lr=0.05), torch.optim.SGD(refw.values(), lr=0.05)]
    target = torch.randn(B, S, H, generator=gen)
    for _ in range(5):
        for o in opts:
            o.zero_grad()
        torch.nn.functional.mse_loss(layer(x=full["x"]), target).backward()
        torch.nn.functional.mse_loss(tp_reference({"x": full["x"], **refw}), target).backward()
        for o in opts:
            o.step()
    report(comm, f"tp:module_sgd:R{R}", [(k, layer.full(k), refw[k].detach()) for k in refw] +
           [(f"{k}_part", getattr(layer, k).detach(), tp_parts({"x": full["x"], **refw}, lo, hi)[k].detach())
            for k in refw])


def mode_block(comm) -> None:
    """tp_block (y = x + mlp(x)) under every forward x backward schedule: the backward
    all-reduce split, fused with the residual's epilogue and overlapped with the matmul_nt."""
    R, rank = comm.Get_size(), comm.Get_rank()
    B, S, H, F = 2, 6, 8, 12
    lo, hi = slice_range(F, R, rank)
    gen = torch.Generator().manual_seed(4)
    full = tp_full(gen, B, S, H, F)
    dy = torch.randn(B, S, H, generator=gen)
    ref = {k: v.clone().requires_grad_(True) for k, v in full.items()}
    y_want = ref["x"] + tp_reference(ref)
    y_want.backward(dy)
    want = tp_parts({k: v.grad for k, v in ref.items()}, lo, hi)
    for s in ("default", "overlapped"):
        for g in ("default", "fused"):
            fn = ct.function(TP_MLP, "tp_block", schedule=s, grad_schedule=g, comm=comm)
            args = {k: v.clone().contiguous().requires_grad_(True) for k, v in tp_parts(full, lo, hi).items()}
            y = fn(**args)
            y.backward(dy)
            report(comm, f"block:{s}:{g}:R{R}" + (":saved" if fn.saved else ":recomputed"),
                   [("y", y.detach(), y_want.detach())] + [(f"d_{k}", args[k].grad, want[k]) for k in args])


def mode_sp(comm) -> None:
    from coconetc.interp.rng import dropout_keep, site_key
    R, rank = comm.Get_size(), comm.Get_rank()
    B, S, H, F, P, SEED = 2, 6, 8, 12, 0.1, 7
    s_lo, s_hi = slice_range(S, R, rank)
    lo, hi = slice_range(F, R, rank)
    gen = torch.Generator().manual_seed(1)
    full = tp_full(gen, B, S, H, F)
    full["gamma"], full["beta"] = 1 + 0.1 * torch.randn(H, generator=gen), 0.1 * torch.randn(H, generator=gen)
    dy = torch.randn(B, S, H, generator=gen)
    # dropout's mask: the language's counter-based RNG at the stage's site (docs/language.md, "Operations")
    keep = dropout_keep(SEED, site_key("y#0"), np.arange(B * S * H, dtype=np.uint64), P)
    mask = torch.from_numpy(np.asarray(keep).reshape(B, S, H)).to(torch.float32)

    def reference(t):
        n = torch.nn.functional.layer_norm(t["x"], (H,), t["gamma"], t["beta"], eps=1e-5)
        p = torch.nn.functional.gelu(n @ t["w1"] + t["b1"]) @ t["w2"]
        return mask * (p + t["b2"]) / (1 - P) + t["x"]

    ref = {k: v.clone().requires_grad_(True) for k, v in full.items()}
    y_want = reference(ref)
    y_want.backward(dy)
    g = {k: v.grad for k, v in ref.items()}
    want = {"x": g["x"][:, s_lo:s_hi], "gamma": g["gamma"], "beta": g["beta"], "w1": g["w1"][:, lo:hi],
            "b1": g["b1"][lo:hi], "w2": g["w2"][lo:hi], "b2": g["b2"]}
    fn = ct.function(TP_MLP, "sp_block", comm=comm)
    args = {k: v.contiguous().clone().requires_grad_(True) for k, v in
            {"x": full["x"][:, s_lo:s_hi], "gamma": full["gamma"], "beta": full["beta"],
             "w1": full["w1"][:, lo:hi], "b1": full["b1"][lo:hi], "w2": full["w2"][lo:hi],
             "b2": full["b2"]}.items()}
    y = fn(**args, seed=SEED)
    y.backward(dy[:, s_lo:s_hi].contiguous())
    report(comm, f"sp:default:R{R}", [("y", y.detach(), y_want.detach()[:, s_lo:s_hi])] +
           [(f"d_{k}", args[k].grad, want[k]) for k in args])


def mode_pipe(comm) -> None:
    """stage(y local, b replicated, r replicated) on 2 groups: group 0 computes
    h = relu(allreduce(sum, y) + b) + r and sends it to group 1, whose loss trains group 0."""
    R, rank = comm.Get_size(), comm.Get_rank()
    G = 2
    gs = R // G
    group, member = rank // gs, rank % gs
    Bt, H = 4, 6
    gen = torch.Generator().manual_seed(2)
    ys = [torch.randn(Bt, H, generator=gen) for _ in range(gs)]  # group 0's local inputs, per member
    b, r = torch.randn(H, generator=gen), torch.randn(Bt, H, generator=gen)
    target = torch.randn(Bt, H, generator=gen)
    fn = ct.function(PIPELINE, "stage", comm=comm, groups=G)
    # every group holds parameters; only group 0's reach a loss (group 1's h goes nowhere)
    mine = {"y": ys[member].clone(), "b": b.clone(), "r": r.clone()}
    params = {k: v.requires_grad_(True) for k, v in mine.items()}
    opt = torch.optim.SGD(params.values(), lr=0.1)
    ref = {"y": [t.clone().requires_grad_(True) for t in ys], "b": b.clone().requires_grad_(True),
           "r": r.clone().requires_grad_(True)}
    ref_opt = torch.optim.SGD([*ref["y"], ref["b"], ref["r"]], lr=0.1)
    for step in range(4):
        opt.zero_grad()
        ref_opt.zero_grad()
        nxt = fn(**params)
        # group 1 receives group 0's h; group 0 receives nothing (zeros): the same loss everywhere
        loss = ((nxt - target) ** 2).sum() if group == 1 else (nxt * 0).sum()
        loss.backward()
        h = torch.relu(sum(ref["y"]) + ref["b"]) + ref["r"]
        ((h - target) ** 2).sum().backward()
        if step == 0:
            if group == 0:
                pairs = [("d_y", params["y"].grad, ref["y"][member].grad), ("d_b", params["b"].grad, ref["b"].grad),
                         ("d_r", params["r"].grad, ref["r"].grad)]
            else:  # nothing group 1 holds reaches its loss
                pairs = [(f"d_{k}", params[k].grad, torch.zeros_like(params[k])) for k in params]
            pairs.append(("nxt", nxt.detach(), h.detach() if group == 1 else torch.zeros_like(h)))
            report(comm, f"pipe:gradients:R{R}", pairs)
        opt.step()
        ref_opt.step()
    if group == 0:
        pairs = [("y", params["y"].detach(), ref["y"][member].detach()), ("b", params["b"].detach(), ref["b"].detach()),
                 ("r", params["r"].detach(), ref["r"].detach())]
    else:
        pairs = [("b", params["b"].detach(), b)]
    report(comm, f"pipe:sgd:R{R}", pairs)


def main(comm) -> int:
    torch.set_num_threads(1)
    {"tp": mode_tp, "tp_cuda": lambda c: mode_tp(c, "cuda"), "sp": mode_sp, "block": mode_block, "pipe": mode_pipe}[sys.argv[1]](comm)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(stop_job_on_failure(main, "torch_function_worker"))
