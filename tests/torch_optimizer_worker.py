"""coconetc.torch.DistributedOptimizer on several ranks, run by tests/test_torch_optimizer.py as

    mpiexec -n R python tests/torch_optimizer_worker.py MODE [ARGS]

A small MLP is trained data-parallel: at step t every rank takes its part of one global batch
(drawn from seed t, the same on every rank and in every run) and its loss is its rows' squared
error over the global batch size, so the sum of the ranks' gradients is the global batch's.
The reference is the same model copied, its local gradients summed with mpi4py's Allreduce and
stepped by torch.optim.Adam (or by the LAMB written below), with the same StepLR schedule.
Rank 0 prints "OK <label> <max |difference|>" or "FAIL <label>: <why>" per check.

MODE adam             every schedule of examples/adam.ccn; the state (m, v) against torch's
                      exp_avg/exp_avg_sq; state bytes per rank; two param groups; a closure;
                      shared_memory=True under zero and fused
MODE lamb             every schedule of examples/lamb.ccn against LAMB in PyTorch
MODE save PATH        train under zero, save a checkpoint (ours and the reference's) to PATH,
                      then load it here under every schedule and continue
MODE resume PATH      load PATH under every schedule on this rank count and continue
MODE clip             examples/adamw.ccn, every schedule, three parameter groups (their own lr
                      and weight decay): across_groups=True against clip_grad_norm_ over every
                      parameter + torch.optim.AdamW; across_groups=False against each group
                      clipped by its own norm
MODE clip_file PATH SCHEDULE...  a clipped AdamW of another .ccn file (two groups, across_groups=True)
                      against clip_grad_norm_ + torch.optim.AdamW
MODE scaled           examples/scaled_adam.ccn (f16 parameters and gradients, f32 master weights,
                      dynamic loss scaling), every schedule, two groups with across_groups=True,
                      skipped="bad" and feedback={"scale": "newscale"}: an inf and a NaN in one
                      rank's gradient skip the step of every group and halve the scale, as
                      torch.cuda.amp.GradScaler's logic over torch.optim.Adam does
MODE rank0_only       state_dict() on every rank, then on rank 0 alone: the watchdog must end
                      the job (COCONET_TIMEOUT) instead of letting rank 0 hang"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
from mpi4py import MPI

from coconetc.ir.slices import slice_range
from coconetc.jobs.abort import stop_job_on_failure
from coconetc.torch import DistributedOptimizer

REPO = Path(__file__).resolve().parents[1]
ADAM, LAMB = REPO / "examples" / "adam.ccn", REPO / "examples" / "lamb.ccn"
ADAMW = REPO / "examples" / "adamw.ccn"
ADAM_SCHEDULES = ["default", "rs_c_ag", "zero", "fused"]
LAMB_SCHEDULES = ["default", "rs_c_ag", "zero"]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
B, STEPS = 24, 60
TOL = 1e-6  # max |difference| of any parameter or state element (values are O(0.1..1))

comm = MPI.COMM_WORLD
rank, R = comm.Get_rank(), comm.Get_size()
failures: list[str] = []


def report(label: str, diff: float, tol: float = TOL) -> None:
    if diff <= tol:
        if rank == 0:
            print(f"OK {label} {diff:.3g}", flush=True)
    else:
        failures.append(label)
        if rank == 0:
            print(f"FAIL {label}: max |difference| {diff:.3g} > {tol:.3g}", flush=True)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # 3 layers of uneven sizes: 7*13 + 13 + 13*5 + 5 + 5*2 + 2 = 186
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5),
                               torch.nn.Tanh(), torch.nn.Linear(5, 2))


def local_loss(model: torch.nn.Module, t: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + t)
    x, y = torch.randn(B, 7, generator=gen), torch.randn(B, 2, generator=gen)
    lo, hi = slice_range(B, R, rank)
    return ((model(x[lo:hi]) - y[lo:hi]) ** 2).sum() / B


def allreduced_grads(model: torch.nn.Module, avg: bool = False) -> None:
    """The reference's gradients: each rank's, summed (or averaged) with mpi4py (a frozen
    parameter has none)."""
    for p in model.parameters():
        if p.grad is None:
            continue
        g = p.grad.numpy()
        comm.Allreduce(MPI.IN_PLACE, g, op=MPI.SUM)
        if avg:
            p.grad /= R


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    d = max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))
    return comm.allreduce(d, op=MPI.MAX)


class Pair:
    """Our model and optimizer beside the reference's, stepped together."""

    def __init__(self, schedule: str, model=None, ref=None, source=ADAM, groups=None, shared_memory=False,
                 shared_weights=None, **hyper):
        self.model = model or make_model()
        self.ref = ref or copy.deepcopy(self.model)
        self.source = source
        if source == ADAM:
            self.opt = DistributedOptimizer(groups(self.model) if groups else self.model.parameters(),
                                            str(source), schedule=schedule, shared_memory=shared_memory,
                                            shared_weights=shared_weights, **(hyper or HYPER))
            h = hyper or HYPER
            self.ref_opt = torch.optim.Adam(groups(self.ref) if groups else self.ref.parameters(),
                                            lr=h["lr"], betas=(h["beta1"], h["beta2"]),
                                            eps=h["eps"], foreach=False)
        else:
            self.opt = DistributedOptimizer(self.model.parameters(), str(source), schedule=schedule,
                                            **hyper)
            self.ref_opt = Lamb(self.ref.parameters(), **hyper)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=15, gamma=0.5)
        self.ref_sched = torch.optim.lr_scheduler.StepLR(self.ref_opt, step_size=15, gamma=0.5)
        self.t = 0

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.t += 1
            self.opt.zero_grad()
            local_loss(self.model, self.t).backward()
            self.opt.step()
            self.sched.step()
            self.ref_opt.zero_grad()
            local_loss(self.ref, self.t).backward()
            allreduced_grads(self.ref, avg=self.source == LAMB)
            self.ref_opt.step()
            self.ref_sched.step()


class Lamb(torch.optim.Optimizer):
    """LAMB (per-parameter trust ratio ||w|| / ||r||) in PyTorch, as examples/lamb.ccn states it."""

    def __init__(self, params, lr, beta1, beta2, eps, wd):
        super().__init__(params, dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, wd=wd))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, b1, b2, eps, wd = (group[k] for k in ("lr", "beta1", "beta2", "eps", "wd"))
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                st["t"] += 1
                t, m, v = st["t"], st["m"], st["v"]
                m.mul_(b1).add_((1 - b1) * p.grad)
                v.mul_(b2).add_((1 - b2) * p.grad * p.grad)
                r = (m / (1 - b1 ** t)) / (torch.sqrt(v / (1 - b2 ** t)) + eps) + wd * p
                p.sub_(lr * (p.norm() / r.norm()) * r)


def state_diff(opt: DistributedOptimizer, ref_opt: torch.optim.Optimizer) -> float:
    ours, theirs = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    d = 0.0
    for i, entry in ours.items():
        d = max(d, (entry["m"] - theirs[i]["exp_avg"]).abs().max().item(),
                (entry["v"] - theirs[i]["exp_avg_sq"]).abs().max().item())
    return comm.allreduce(d, op=MPI.MAX)


# --- modes -------------------------------------------------------------------------------------
def mode_adam() -> None:
    n = sum(p.numel() for p in make_model().parameters())
    for schedule in ADAM_SCHEDULES:
        pair = Pair(schedule)
        pair.run(STEPS)
        report(f"adam:{schedule}:R{R}:params", max_diff(pair.model, pair.ref))
        report(f"adam:{schedule}:R{R}:state", state_diff(pair.opt, pair.ref_opt))
        lr_ok = pair.opt.param_groups[0]["lr"] == pair.ref_opt.param_groups[0]["lr"] == 1e-2 * 0.5 ** 4
        report(f"adam:{schedule}:R{R}:lr_scheduled", 0.0 if lr_ok else 1.0)
        held = sum(t.numel() for g in pair.opt.state_tensors for t in g.values())
        everyone = comm.allgather(held)
        want = [2 * (hi - lo) for lo, hi in (slice_range(n, R, r) for r in range(R))] \
            if schedule == "zero" else [2 * n] * R
        if rank == 0:
            print(f"STATE {schedule} R{R} elements per rank {everyone} of {2 * n}", flush=True)
        report(f"adam:{schedule}:R{R}:state_elements", 0.0 if everyone == want else 1.0)
    two_groups()
    with_closure()
    shared_memory()


def shared_memory() -> None:
    """shared_memory=True: the flat weights and gradients in coconetc.empty windows (the fused
    collectives read them in place); the same training as the reference, under zero and fused,
    with one copy of the weights for the node (shared_weights=None: what one rank writes, every
    rank reads) and with each rank's own (shared_weights=False)."""
    from coconetc.runtime import shm
    for schedule in ("zero", "fused"):
        for sw in (None, False):
            pair = Pair(schedule, shared_memory=True, shared_weights=sw)
            g = pair.opt._groups[0]
            spans = [(shm.WINDOWS[k + 1], shm.WINDOWS[k + 2]) for k in range(0, len(shm.WINDOWS), 4)]
            inside = all(any(a <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= a + n
                             for a, n in spans) for t in (g.flat, g.gflat))
            views = all(p.data_ptr() >= g.flat.data_ptr() for p in pair.model.parameters())
            tag = "" if sw is None else "_own_weights"
            report(f"adam:{schedule}:R{R}:shared_memory_buffers{tag}",
                   0.0 if inside and views and pair.opt.shared_weights == (sw is None) else 1.0)
            pair.run(STEPS // 2)
            report(f"adam:{schedule}:R{R}:shared_memory{tag}", max_diff(pair.model, pair.ref))
            report(f"adam:{schedule}:R{R}:one_copy{tag}", 0.0 if one_copy(g.flat) == (sw is None) else 1.0)
    pair = Pair("rs_c_ag", shared_memory=True)  # every rank writes all of w: its own copy
    report(f"adam:rs_c_ag:R{R}:own_weights", 0.0 if not pair.opt.shared_weights and not one_copy(pair.opt._groups[0].flat) else 1.0)


def one_copy(flat: torch.Tensor) -> bool:
    """Whether the ranks' flat weights are one memory: a value the last rank writes, the first
    reads (then put back, the ranks agreeing at each barrier)."""
    old = flat[0].item()
    comm.Barrier()
    if rank == R - 1:
        flat[0] = 1234.5  # (exact in every float type, and no weight of the model)
    comm.Barrier()
    seen = flat[0].item() == 1234.5
    comm.Barrier()
    if rank == R - 1:
        flat[0] = old
    comm.Barrier()
    return comm.bcast(seen, root=0)


def two_groups() -> None:
    def groups(model):
        ps = list(model.parameters())
        return [{"params": ps[:2], "lr": 2e-2}, {"params": ps[2:]}]
    pair = Pair("zero", groups=groups)
    pair.run(STEPS // 2)
    report(f"adam:zero:R{R}:two_groups", max_diff(pair.model, pair.ref))


def with_closure() -> None:
    pair = Pair("rs_c_ag")
    for t in range(1, 11):
        def closure(model=pair.model, t=t):
            pair.opt.zero_grad()
            loss = local_loss(model, t)
            loss.backward()
            return loss
        loss = pair.opt.step(closure)
        pair.ref_opt.zero_grad()
        ref_loss = local_loss(pair.ref, t)
        ref_loss.backward()
        allreduced_grads(pair.ref)
        pair.ref_opt.step()
        if not isinstance(loss, torch.Tensor) or abs(loss.item() - ref_loss.item()) > 1e-5:
            report(f"adam:closure:R{R}:loss", 1.0)
            return
    report(f"adam:closure:R{R}", max_diff(pair.model, pair.ref))


def mode_lamb() -> None:
    hyper = dict(HYPER, wd=0.01)
    for schedule in LAMB_SCHEDULES:
        pair = Pair(schedule, source=LAMB, **hyper)
        pair.run(STEPS)
        report(f"lamb:{schedule}:R{R}:params", max_diff(pair.model, pair.ref))
        ours, theirs = pair.opt.state_dict()["state"], pair.ref_opt.state_dict()["state"]
        d = max(max((ours[i]["m"] - theirs[i]["m"]).abs().max().item(),
                    (ours[i]["v"] - theirs[i]["v"]).abs().max().item()) for i in ours)
        report(f"lamb:{schedule}:R{R}:state", comm.allreduce(d, op=MPI.MAX))


def mode_save(path: str) -> None:
    pair = Pair("zero")
    pair.run(STEPS // 2)
    ckpt = dict(model=pair.model.state_dict(), opt=pair.opt.state_dict(),
                sched=pair.sched.state_dict(), ref=pair.ref.state_dict(),
                ref_opt=pair.ref_opt.state_dict(), ref_sched=pair.ref_sched.state_dict(), t=pair.t)
    same = all(torch.equal(a, b) for a, b in zip(_flat(ckpt["opt"]), _flat(comm.bcast(ckpt["opt"]))))
    report(f"save:zero:R{R}:same_on_every_rank", 0.0 if comm.allreduce(not same) == 0 else 1.0)
    if rank == 0:
        torch.save(ckpt, path)
    comm.Barrier()
    resume(path, f"save:zero:R{R}")


def _flat(sd: dict) -> list[torch.Tensor]:
    return [t for i in sorted(sd["state"]) for _, t in sorted(sd["state"][i].items())]


def resume(path: str, origin: str) -> None:
    """Every schedule: load the checkpoint, check the state round-trips, continue, compare."""
    saved = torch.load(path, weights_only=False)
    for schedule in ADAM_SCHEDULES:
        ckpt = copy.deepcopy(saved)  # torch.optim.Adam.load_state_dict keeps the tensors it is given
        model, ref = make_model(), make_model()
        model.load_state_dict(ckpt["model"])
        ref.load_state_dict(ckpt["ref"])
        pair = Pair(schedule, model=model, ref=ref)
        pair.opt.load_state_dict(ckpt["opt"])
        pair.sched.load_state_dict(ckpt["sched"])
        pair.ref_opt.load_state_dict(ckpt["ref_opt"])
        pair.ref_sched.load_state_dict(ckpt["ref_sched"])
        pair.t = ckpt["t"]
        back = pair.opt.state_dict()
        exact = all(torch.equal(a, b) for a, b in zip(_flat(back), _flat(ckpt["opt"])))
        exact &= back["param_groups"] == ckpt["opt"]["param_groups"]
        label = f"{origin}->{schedule}:R{R}"
        report(f"{label}:state_round_trip", 0.0 if exact else 1.0)
        pair.run(STEPS // 2)
        report(f"{label}:params", max_diff(pair.model, pair.ref))
        report(f"{label}:state", state_diff(pair.opt, pair.ref_opt))


def _three_groups(model: torch.nn.Module) -> list[dict]:
    """Decayed matrices at two learning rates, biases not decayed (as GPT scripts group them)."""
    ps = list(model.parameters())
    return [{"params": [ps[0]], "lr": 2e-2}, {"params": ps[2::2]},
            {"params": ps[1::2], "wd": 0.0}]


def _clipped_pair(sched: str, shared: bool, across: bool, hyper: dict, frozen: int | None = None):
    """Our clipped AdamW (adamw.ccn, three groups) beside PyTorch doing the same
    (clip_grad_norm_ over every parameter, or each group's own, + torch.optim.AdamW), trained
    STEPS // 2 steps; FROZEN: the index of a parameter frozen (requires_grad=False) in both.
    Returns (model, reference, the steps whose gradient was clipped)."""
    model = make_model()
    if frozen is not None:
        list(model.parameters())[frozen].requires_grad_(False)
    ref = copy.deepcopy(model)
    opt = DistributedOptimizer(_three_groups(model), str(ADAMW), schedule=sched, across_groups=across,
                               shared_memory=shared, **hyper)
    ref_groups = _three_groups(ref)
    ref_opt = torch.optim.AdamW([{k: v for k, v in g.items() if k != "wd"} |
                                 {"weight_decay": g.get("wd", 0.1)} for g in ref_groups],
                                lr=hyper["lr"], betas=(hyper["beta1"], hyper["beta2"]),
                                eps=hyper["eps"], foreach=False)
    clipped = 0
    for t in range(1, STEPS // 2 + 1):
        opt.zero_grad()
        local_loss(model, t).backward()
        opt.step()
        ref_opt.zero_grad()
        local_loss(ref, t).backward()
        allreduced_grads(ref)
        parts = [list(ref.parameters())] if across else [g["params"] for g in ref_groups]
        for ps in parts:
            clipped += torch.nn.utils.clip_grad_norm_(ps, hyper["maxnorm"]).item() > hyper["maxnorm"]
        ref_opt.step()
    return model, ref, clipped


def mode_clip() -> None:
    """AdamW with clipping by the global norm: every group's gradient in one norm
    (across_groups=True), or each group's own (False), against PyTorch doing the same; and with
    a frozen matrix, which torch.optim.AdamW leaves as it is and clip_grad_norm_ leaves out."""
    hyper = dict(HYPER, wd=0.1, maxnorm=0.05)
    for schedule in ("default", "rs_c_ag", "sliced", "zero", "zero+shm"):
        sched, shared = schedule.split("+")[0], schedule.endswith("+shm")
        trained = []
        for across in (True, False):
            model, ref, clipped = _clipped_pair(sched, shared, across, hyper)
            label = f"clip:{schedule}:R{R}:{'across_groups' if across else 'per_group'}"
            report(label, max_diff(model, ref))
            report(f"{label}:clipped", 0.0 if clipped >= STEPS // 2 else 1.0)  # the clipping mattered
            trained.append(model)
        # and the two norms train differently (so each check above can tell them apart)
        report(f"clip:{schedule}:R{R}:norms_differ", 0.0 if max_diff(*trained) > 1e-3 else 1.0)
        # a decayed matrix frozen: the step must leave it as it was (not decay it)
        model, ref, _ = _clipped_pair(sched, shared, True, hyper, frozen=2)
        moved = (list(model.parameters())[2] - list(make_model().parameters())[2]).abs().max().item()
        report(f"clip:{schedule}:R{R}:frozen", max(max_diff(model, ref), moved))


def mode_clip_file(path: str, schedules: list[str]) -> None:
    """A clipped AdamW of another file (tests/programs/heldout_clip_adamw.ccn, gradients
    averaged): two groups (decayed and not), across_groups=True, against clip_grad_norm_ over
    every parameter + torch.optim.AdamW."""
    hyper = dict(HYPER, beta2=0.95, wd=0.1, maxnorm=0.05)
    avg = "allreduce(avg" in Path(path).read_text()
    for schedule in schedules:
        model = make_model()
        ref = copy.deepcopy(model)

        def groups(m: torch.nn.Module, key: str) -> list[dict]:
            return [{"params": [p for p in m.parameters() if p.dim() >= 2]},
                    {"params": [p for p in m.parameters() if p.dim() < 2], key: 0.0}]
        opt = DistributedOptimizer(groups(model, "wd"), path, schedule=schedule, across_groups=True, **hyper)
        ref_opt = torch.optim.AdamW(groups(ref, "weight_decay"), lr=hyper["lr"], betas=(hyper["beta1"], hyper["beta2"]),
                                    eps=hyper["eps"], weight_decay=hyper["wd"], foreach=False)
        clipped = 0
        for t in range(1, STEPS // 4 + 1):
            opt.zero_grad()
            (local_loss(model, t) * (R if avg else 1)).backward()
            opt.step()
            ref_opt.zero_grad()
            (local_loss(ref, t) * (R if avg else 1)).backward()
            allreduced_grads(ref, avg=avg)
            clipped += torch.nn.utils.clip_grad_norm_(ref.parameters(), hyper["maxnorm"]).item() > hyper["maxnorm"]
            ref_opt.step()
        report(f"clip_file:{schedule}:R{R}", max_diff(model, ref))
        report(f"clip_file:{schedule}:R{R}:clipped", 0.0 if clipped else 1.0)


def mode_scaled(schedules=("default", "rs_c_ag", "zero"), backend: str | None = None, tag: str = "scaled") -> None:
    """The loss-scaled step against GradScaler's logic written out: the ranks' f16 gradients
    summed in f16 (as the program does), unscaled in f32; any inf/NaN: no optimizer step, the
    scale halved; else torch.optim.Adam on f32 master weights (its step count not advanced by
    a skipped step). Gradients are drawn per rank from seeds (no forward pass in f16). backend=
    and the labels' tag: the CUDA worker's (tests/torch_optimizer_cuda_worker.py)."""
    source = REPO / "examples" / "scaled_adam.ccn"
    shapes = [(7, 5), (11,), (3, 4)]
    steps, bad_steps = 8, {3: ("inf", 0), 5: ("nan", 2)}  # step -> (value, group of the bad element)
    tol = 1e-5 if R <= 2 else 4e-3  # f16 sums of more than two ranks: the algorithm's order
    for schedule in schedules:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s).half()) for s in shapes]
        master = [torch.nn.Parameter(p.detach().float()) for p in params]
        opt = DistributedOptimizer([{"params": params[:2]}, {"params": params[2:]}], str(source), schedule=schedule,
                                   backend=backend, weights="w16", master="w", across_groups=True, skipped="bad",
                                   feedback={"scale": "newscale"}, scale=1024.0, **HYPER)
        ref = torch.optim.Adam(master, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                               eps=HYPER["eps"], foreach=False)
        scale, seen = 1024.0, []
        for t in range(1, steps + 1):
            grads = []
            for r in range(R):
                gen = torch.Generator().manual_seed(100 * t + r)
                grads.append([(torch.randn(p.shape, generator=gen) * scale).half() for p in params])
            if t in bad_steps:
                value, k = bad_steps[t]
                grads[R - 1][k].view(-1)[1] = float(value)
            for p, g in zip(params, grads[rank]):
                p.grad = g.clone()
            opt.step()
            total = [sum(grads[r][k] for r in range(1, R)) + grads[0][k] if R > 1 else grads[0][k]
                     for k in range(len(params))]
            found = any(not torch.isfinite(g.float()).all() for g in total)
            if not found:
                for p, g in zip(master, total):
                    p.grad = g.float() / scale
                ref.step()
            scale = scale * 0.5 if found else scale
            bads = [float(o["bad"]) for o in opt.outputs]
            seen.append((found, all((b > 0) == found for b in bads) and len(bads) == 2,
                         all(g["scale"] == scale for g in opt.param_groups)))
        label = f"{tag}:{schedule}:R{R}"
        sd = opt.state_dict()["state"]
        report(f"{label}:master", comm.allreduce(max((sd[i]["w"] - p.detach()).abs().max().item()
                                                     for i, p in enumerate(master)), op=MPI.MAX), tol)
        report(f"{label}:params", comm.allreduce(max((p.detach().float() - m.detach().half().float()).abs().max().item()
                                                     for p, m in zip(params, master)), op=MPI.MAX), tol)
        report(f"{label}:state", comm.allreduce(max(max((sd[i]["m"] - ref.state[p]["exp_avg"]).abs().max().item(),
                                                        (sd[i]["v"] - ref.state[p]["exp_avg_sq"]).abs().max().item())
                                                    for i, p in enumerate(master)), op=MPI.MAX), tol)
        skipped = [f for f, _, _ in seen]
        report(f"{label}:skipped", 0.0 if skipped == [t in bad_steps for t in range(1, steps + 1)] else 1.0)
        report(f"{label}:bad_and_scale", 0.0 if all(b and s for _, b, s in seen) else 1.0)
        counts = {int(x["step"]) for x in sd.values()}
        report(f"{label}:steps", 0.0 if counts == {steps - len(bad_steps)} == {int(ref.state[master[0]]["step"])} else 1.0)


def run_mode(comm) -> int:
    mode = sys.argv[1]
    if mode == "adam":
        mode_adam()
    elif mode == "lamb":
        mode_lamb()
    elif mode == "clip":
        mode_clip()
    elif mode == "scaled":
        mode_scaled()
    elif mode == "clip_file":
        mode_clip_file(sys.argv[2], sys.argv[3:])
    elif mode == "save":
        mode_save(sys.argv[2])
    elif mode == "rank0_only":
        pair = Pair("zero")
        pair.run(2)
        pair.opt.state_dict()
        print(f"BOTH CALLED {rank}", flush=True)
        if rank == 0:
            pair.opt.state_dict()
            print("RANK 0 WAS NOT STOPPED", flush=True)
    elif mode == "shapes_differ":  # each rank its own parameter size: refused on every rank, before
        p = torch.nn.Parameter(torch.zeros(10 + rank))  # any shared window is made
        try:
            DistributedOptimizer([p], str(ADAM), schedule="zero", **HYPER)
            print(f"ACCEPTED {rank}", flush=True)
        except RuntimeError as err:
            print(f"REFUSED {rank}: {err}", flush=True)
        comm.Barrier()  # (every rank gets here: none is left waiting in an allocation)
        print(f"AFTER {rank}", flush=True)
    elif mode == "resume":
        resume(sys.argv[2], "checkpoint")
    else:
        raise SystemExit(f"unknown mode {mode}")
    return 1 if failures else 0


if __name__ == "__main__":  # a failing rank stops the job
    sys.exit(stop_job_on_failure(run_mode, "torch_optimizer_worker"))
