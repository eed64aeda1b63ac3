"""Train nanoGPT (train_gpt.py's model) with its parameters sharded over R MPI ranks by
coconetc.torch.shard (fully sharded data parallelism, as FSDP and ZeRO-3), check it against the
same model in one process, and resume it from a whole-tensor checkpoint:

    python examples/train_sharded.py --ranks 2                  # relaunches itself under mpiexec
    coconetc launch -n 2 python examples/train_sharded.py --save ckpt.pt
    coconetc launch -n 4 python examples/train_sharded.py --load ckpt.pt    # on another rank count
    python examples/train_sharded.py --ranks 2 --blocks torch,coconet

Each rank holds its part of every parameter (coconet's slicing rule along dim 0; below
--min-numel elements a parameter stays whole); a forward gathers the whole parameters, the
backward reduce-scatters their gradients to the parts, and torch.optim.AdamW steps the parts, so
its state is sharded too. Each rank trains on its rows of the batch (`slice_range`: any rank
count), its loss the sum over its rows divided by the batch's tokens, the gradients summed over
the ranks (`shard(..., reduce="sum")`): the batch's mean, however the rows fall.

--blocks torch: the blocks are train_gpt.py's plain torch blocks (the one-process model's code);
coconet: each block a coconetc.torch.Module of examples/gpt_block.ccn's gpt_block (its compiled
forward and derived backward) on a group of one rank, holding whole weights that shard() shards
like every other parameter. A comma-separated list runs each in turn.

The check is train_gpt.py's: every parameter's first-step gradient (this rank's part against
the same part of the one-process gradient) within --grad-tol relative, every step's loss
within --loss-tol; rank 0 prints the tables, a mismatch exits 1.

--save PATH: after the steps, the model and AdamW's state saved as whole tensors
(Sharded.save), loaded on the same ranks into a fresh model (other initial values) and trained
--resume-steps more: the loaded parts and AdamW's state must be the saved ones exactly, and the
gradients and losses those of one process resumed from the same checkpoint. --load PATH: a
checkpoint --save wrote, on any number of ranks with the same sizes and --seed, loaded; its step
count is AdamW's; --resume-steps trained against one process resumed from it."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from train_gpt import (GPT_BLOCK, adamw_args, batches, coconet_model, describe, gradient_errors, in_mpi_job, init,
                       model_arguments, print_summary, reference_model, reference_step, report)

BLOCKS = ("torch", "coconet")


def with_(a: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(a), **changes})


def make(blocks: str, full: dict[str, Any], a: argparse.Namespace, comm: Any) -> tuple[Any, Any, Any]:
    """(the model with FULL's values, sharded over COMM; its Sharded handle; AdamW on its parts)."""
    import torch

    import coconetc.torch as ct
    if blocks == "torch":
        model = reference_model(full, a)
    else:  # every rank a group of its own: whole weights in each block, sharded by shard() below
        model = coconet_model(full, a, "gpt_block", comm.Get_size(), None)
    sharded = ct.shard(model, comm=comm, min_numel=a.min_numel, reduce="sum")
    return model, sharded, torch.optim.AdamW(model.parameters(), **adamw_args(a))


def train(blocks: str, model: Any, sharded: Any, opt: Any, ref: Any, ref_opt: Any, data: list, first: int,
          a: argparse.Namespace, comm: Any) -> dict[str, Any]:
    """DATA's steps (numbered from FIRST) of the sharded model and of the one-process model, side by
    side; the figures report() prints."""
    import torch.nn.functional as F
    from mpi4py import MPI

    from coconetc.ir.slices import slice_range
    rank, ranks = comm.Get_rank(), comm.Get_size()
    refs = dict(ref.named_parameters())
    losses, ref_losses = [], []
    grad_err: dict[str, float] = {}
    t_mine = t_ref = 0.0
    for i, (idx, tgt) in enumerate(data):
        lo, hi = slice_range(idx.shape[0], ranks, rank)  # this rank's rows of the batch
        t0 = time.perf_counter()
        opt.zero_grad()
        out = model(idx[lo:hi]) if blocks == "torch" else model(idx[lo:hi], first + i)
        loss = F.cross_entropy(out.reshape(-1, a.vocab), tgt[lo:hi].reshape(-1), reduction="sum") / tgt.numel()
        loss.backward()  # the parts' gradients: the sum over the ranks (reduce="sum")
        mine = {n: p.grad.detach().clone() for n, p in model.named_parameters()} if i == 0 else {}
        opt.step()
        losses.append(comm.allreduce(loss.item()))
        t1 = time.perf_counter()
        ref_losses.append(reference_step(ref, ref_opt, idx, tgt, a))
        if i == 0:
            grad_err = gradient_errors(mine, refs, {}, ranks, rank, comm, index=sharded.index)
        ref_opt.step()
        t_mine += t1 - t0
        t_ref += time.perf_counter() - t1
    held = comm.allreduce(sum(p.numel() for p in model.parameters()), op=MPI.MAX)
    return {"mode": f"sharded/{blocks}", "first_step": first, "groups": 1, "group_size": ranks,
            "program": "nanoGPT, torch blocks" if blocks == "torch" else f"nanoGPT, blocks {GPT_BLOCK.name}'s gpt_block",
            "schedules": "" if blocks == "torch" else f"schedule {a.schedule}, grad schedule {a.grad_schedule}",
            "how": f"parameters, gradients and AdamW's state sharded over {ranks} ranks (coconetc.torch.shard, "
                   f"min_numel {a.min_numel})",
            "grad_err": grad_err, "losses": losses, "ref_losses": ref_losses,
            "loss_err": [abs(x - y) / abs(y) for x, y in zip(losses, ref_losses)], "held": held,
            "total": sum(p.numel() for p in ref.parameters()), "seconds": comm.allreduce(t_mine, op=MPI.MAX),
            "ref_seconds": t_ref}


def same_state(model: Any, opt: Any, loaded: Any, loaded_opt: Any) -> bool:
    """This rank's parts and AdamW's state in LOADED/LOADED_OPT are MODEL/OPT's, bit for bit."""
    import torch
    if not all(torch.equal(p, q) for p, q in zip(model.parameters(), loaded.parameters())):
        return False
    s, t = opt.state_dict(), loaded_opt.state_dict()
    if s["param_groups"] != t["param_groups"] or s["state"].keys() != t["state"].keys():
        return False
    return all(s["state"][k].keys() == t["state"][k].keys() and
               all(torch.equal(v, t["state"][k][e]) for e, v in s["state"][k].items()) for k in s["state"])


def resume_reference(path: str, ref: Any, ref_opt: Any) -> None:
    """The one-process model and its AdamW set to checkpoint PATH's whole tensors (its names mapped
    to REF's parameter order), so that both sides of a resumed run go on from the same values: a
    reference that never stopped drifts from the saved weights by rounding (AdamW amplifies it in
    small gradients), which is not what a resume is checked for."""
    import torch
    whole = torch.load(path, map_location="cpu", weights_only=True)
    order = {n: i for i, (n, _) in enumerate(ref.named_parameters())}
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(whole["model"][n])
    saved = whole["optimizer"]
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": sorted(order[n] for n in g["params"])}
              for g in saved["param_groups"]]
    ref_opt.load_state_dict({"state": {order[n]: st for n, st in saved["state"].items()}, "param_groups": groups})


def steps_done(opt: Any) -> int:
    """The steps AdamW has taken (its state's step count; 0 before the first)."""
    return next((int(st["step"]) for st in opt.state.values() if "step" in st), 0)


def run(blocks: str, a: argparse.Namespace, comm: Any) -> list[dict[str, Any]]:
    """Train, check, and save and resume (--save) or resume a checkpoint (--load): each part's figures."""
    import torch
    from mpi4py import MPI
    full = init(a)
    ref = reference_model(full, a)
    ref_opt = torch.optim.AdamW(ref.parameters(), **adamw_args(a))
    other = init(with_(a, seed=a.seed + 1))  # a fresh model's initial values, which a load replaces
    if a.load:
        model, sharded, opt = make(blocks, other, a, comm)
        sharded.load(a.load, optimizer=opt)
        done = steps_done(opt)
        data = batches(with_(a, steps=done + a.resume_steps))
        resume_reference(a.load, ref, ref_opt)
        res = train(blocks, model, sharded, opt, ref, ref_opt, data[done:], done, a, comm)
        return [{**res, "mode": f"resumed/{blocks}",
                 "how": f"{res['how']}; {a.load} (AdamW's step {done}) loaded on {comm.Get_size()} ranks into a "
                        "fresh model"}]
    data = batches(with_(a, steps=a.steps + (a.resume_steps if a.save else 0)))
    model, sharded, opt = make(blocks, full, a, comm)
    out = [train(blocks, model, sharded, opt, ref, ref_opt, data[:a.steps], 0, a, comm)]
    if a.save and a.resume_steps:
        sharded.save(a.save, optimizer=opt)  # whole tensors, written by rank 0
        loaded, sharded2, opt2 = make(blocks, other, a, comm)
        sharded2.load(a.save, optimizer=opt2)
        exact = comm.allreduce(same_state(model, opt, loaded, opt2), op=MPI.LAND)
        resume_reference(a.save, ref, ref_opt)
        res = train(blocks, loaded, sharded2, opt2, ref, ref_opt, data[a.steps:], a.steps, a, comm)
        out.append({**res, "mode": f"resumed/{blocks}", "exact": exact,
                    "how": f"{res['how']}; {a.save} saved after step {a.steps - 1} and loaded on the same "
                           f"{comm.Get_size()} ranks into a fresh model"})
    elif a.save:
        sharded.save(a.save, optimizer=opt)
    return out


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2, help="ranks to start (when not already under mpiexec)")
    ap.add_argument("--blocks", default="torch", help=f"{', '.join(BLOCKS)}, or a comma-separated list (default torch)")
    ap.add_argument("--min-numel", type=int, default=0, help="parameters with fewer elements stay whole (default 0)")
    ckpt = ap.add_mutually_exclusive_group()
    ckpt.add_argument("--save", metavar="PATH", help="after the steps, save a checkpoint and resume it on these ranks")
    ckpt.add_argument("--load", metavar="PATH", help="resume the checkpoint --save wrote (on any number of ranks)")
    ap.add_argument("--resume-steps", type=int, default=3, help="steps trained after a load (default 3)")
    model_arguments(ap, steps=10, batch_help="the global batch (each rank trains on its rows)")
    ap.set_defaults(dropout=0.0)
    a = ap.parse_args()
    for k in a.blocks.split(","):
        if k not in BLOCKS:
            raise SystemExit(f"--blocks: unknown blocks {k!r} ({', '.join(BLOCKS)}, or a comma-separated list)")
    if a.load and a.resume_steps < 1:
        raise SystemExit("--load: --resume-steps must be 1 or more (the steps trained after the load)")
    return a


def main() -> int:
    a = arguments()
    kinds = a.blocks.split(",")
    if not in_mpi_job() and a.ranks > 1:  # build once here, then start the ranks
        if "coconet" in kinds:
            import coconetc
            coconetc.load(GPT_BLOCK, log=lambda msg: None, grad=("gpt_block",))
        from coconetc.launch.mpiexec import run_python
        return run_python(a.ranks, [__file__, *sys.argv[1:]])
    os.environ.setdefault("COCONET_THREADS", "1")
    import torch
    from mpi4py import MPI
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, ranks = comm.Get_rank(), comm.Get_size()
    if a.batch < ranks:
        raise SystemExit(f"--batch {a.batch}: fewer rows than the {ranks} ranks (each trains on its rows)")
    if rank == 0:
        print(describe(a) + (f"; checkpoint {a.load} resumed for {a.resume_steps} steps" if a.load else ""))
    summary = []
    for k in kinds:
        for res in run(k, a, comm):
            ok = report(res, a, ranks) if rank == 0 else True
            if rank == 0 and "exact" in res:
                print(f"{res['mode']}: the loaded parts and AdamW's state are the saved ones, bit for bit: "
                      + ("yes" if res["exact"] else "NO (MISMATCH)"))
                ok = ok and res["exact"]
            summary.append((res["mode"], max(res["grad_err"].values()), max(res["loss_err"]), ok))
    ok = comm.bcast(all(s[3] for s in summary), root=0)
    if rank == 0:
        print_summary(summary, ranks, True)
        if not ok:
            print(f"MISMATCH: a gradient part by more than --grad-tol {a.grad_tol:g}, a loss by more than "
                  f"--loss-tol {a.loss_tol:g}, or a checkpoint not loaded as saved", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
