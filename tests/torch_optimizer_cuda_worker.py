"""coconetc.torch.DistributedOptimizer on the CUDA backend under the host emulation
(COCONET_CUDA_EMULATE=1: the CUDA module built for the CPU, CPU tensors standing for CUDA
tensors, the emulated NCCL on MPI), run by tests/test_torch_optimizer_cuda.py as

    COCONET_CUDA_EMULATE=1 mpiexec -n R python tests/torch_optimizer_cuda_worker.py MODE [ARGS]

The training is tests/torch_optimizer_worker.py's (a small MLP, data-parallel, each rank's loss
its rows' over the global batch); rank 0 prints "OK <label> <max |difference|>" or "FAIL ...".

MODE adam          every schedule of examples/adam.ccn the CUDA module has, backend="cuda",
                   against torch.optim.Adam and against the CPU backend stepped beside it;
                   examples/adamw.ccn (default, zero) against torch.nn.utils.clip_grad_norm_ + torch.optim.AdamW
MODE inplace       zero and fused with the gradient in an NCCL window (read in place by the peers'
                   symmetric kernel) and, shared_memory=False, staged: against torch.optim.Adam
                   (a model of 20002 parameters)
MODE checkpoint    a checkpoint of the emulated CUDA optimizer (zero) loaded by the CPU one
                   (every schedule) and one of the CPU optimizer loaded by the CUDA one, each
                   continued against torch.optim.Adam continued from its own checkpoint
MODE pg            process_group= a gloo group made inside the mpiexec job (no comm=)
MODE mixed         mixed precision: f16 (mixed_adam.ccn) and bf16 (mixed_adam_bf16.ccn)
                   parameters and gradients, f32 master weights and state, on both backends,
                   against torch.optim.Adam on f32 copies
MODE across        examples/adamw.ccn, every schedule the CUDA module has, two parameter groups
                   (matrices decayed, biases not) with across_groups=True, backend="cuda": against
                   clip_grad_norm_(model.parameters()) + torch.optim.AdamW with the same groups and
                   against the CPU backend with across_groups=True; across_groups=False against
                   each group clipped by its own norm, and the two train differently
MODE scaled        examples/scaled_adam.ccn, two groups, across_groups=True on the CUDA backend
                   (every schedule its CUDA module has): tests/torch_optimizer_worker.py's
                   mode_scaled (an inf and a NaN in one group skip every group's step)
MODE async         COCONET_EMULATE_NCCL_ASYNC_FAIL_RANK=1: an asynchronous NCCL error on rank 1 after
                   its step returned; a later step raises on every rank (the watchdog)
MODE hang          COCONET_EMULATE_NCCL_HANG_RANK=1:K: rank 1's NCCL calls after its first K never
                   complete (its stream blocks, the peers' collectives wait for it): every rank's
                   step raises after COCONET_TIMEOUT (the watchdog's event on the call's stream)
MODE abort [SCHED [pg|window]]  COCONET_EMULATE_NCCL_FAIL_RANK=1 (set by the test): rank 1's NCCL calls fail
                   (pg: the communicator made from a gloo process group, no MPI; window: the
                   gradient's window, made when the optimizer is, fails first);
                   step() must raise on every rank, naming rank 1 and the call, the NCCL
                   communicator aborted on each (prints "RAISED <rank> <message>")"""

from __future__ import annotations

import copy
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch_optimizer_worker as W  # noqa: E402  (the CPU worker's model, data and checks)

from coconetc.jobs.abort import stop_job_on_failure  # noqa: E402
from coconetc.runtime.cuda import emulating  # noqa: E402
from coconetc.torch import DistributedOptimizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
EX = REPO / "examples"
ADAM, ADAMW = EX / "adam.ccn", EX / "adamw.ccn"
HYPER, STEPS = W.HYPER, 30
comm, rank, R = W.comm, W.rank, W.R
report = W.report


class Trio:
    """The CUDA-backend optimizer, the CPU-backend one and torch's, on three copies of one model."""

    def __init__(self, schedule: str, source: Path = ADAM, models=None, cuda_options=None, **hyper):
        hyper = hyper or dict(HYPER)
        self.models = models or [W.make_model() for _ in range(3)]
        cuda, cpu, ref = self.models
        self.cuda = DistributedOptimizer(cuda.parameters(), str(source), schedule=schedule, backend="cuda",
                                         **(cuda_options or {}), **hyper)
        self.cpu = DistributedOptimizer(cpu.parameters(), str(source), schedule=schedule, **hyper)
        betas = (hyper["beta1"], hyper["beta2"])
        self.maxnorm = hyper.get("maxnorm")  # adamw.ccn clips by the global norm first
        if "wd" in hyper:
            self.ref = torch.optim.AdamW(ref.parameters(), lr=hyper["lr"], betas=betas, eps=hyper["eps"],
                                         weight_decay=hyper["wd"], foreach=False)
        else:
            self.ref = torch.optim.Adam(ref.parameters(), lr=hyper["lr"], betas=betas, eps=hyper["eps"],
                                        foreach=False)
        self.t = 0

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.t += 1
            for model, opt in zip(self.models, (self.cuda, self.cpu, self.ref)):
                opt.zero_grad()
                W.local_loss(model, self.t).backward()
                if opt is self.ref:
                    W.allreduced_grads(model)
                    if self.maxnorm is not None:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), self.maxnorm)
                opt.step()


def mode_adam() -> None:
    assert emulating()
    from coconetc.torch.roles import function_of
    schedules = sorted(function_of(ADAM, None, backend="cuda").schedules)
    if rank == 0:
        print(f"SCHEDULES {' '.join(schedules)}", flush=True)
    n = sum(p.numel() for p in W.make_model().parameters())
    for schedule in schedules:
        trio = Trio(schedule)
        report(f"cuda:{schedule}:R{R}:backend", 0.0 if trio.cuda.backend == "cuda" else 1.0)
        trio.run(STEPS)
        cuda, cpu, ref = trio.models
        report(f"cuda:{schedule}:R{R}:params_vs_torch", W.max_diff(cuda, ref))
        report(f"cuda:{schedule}:R{R}:state_vs_torch", W.state_diff(trio.cuda, trio.ref))
        report(f"cuda:{schedule}:R{R}:params_vs_cpu", W.max_diff(cuda, cpu))
        held = sum(t.numel() for g in trio.cuda.state_tensors for t in g.values())
        want = 2 * (W.slice_range(n, R, rank)[1] - W.slice_range(n, R, rank)[0]) if schedule == "zero" else 2 * n
        report(f"cuda:{schedule}:R{R}:state_elements", 0.0 if comm.allreduce(held != want) == 0 else 1.0)
    for schedule in ("default", "zero"):  # clip_grad_norm_ + AdamW; zero: the norm inside the fused collective
        trio = Trio(schedule, ADAMW, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.1, maxnorm=0.5)
        trio.run(STEPS)
        tag = "" if schedule == "default" else f":{schedule}"
        report(f"cuda:adamw{tag}:R{R}:params_vs_torch", W.max_diff(trio.models[0], trio.models[2]))
        report(f"cuda:adamw{tag}:R{R}:params_vs_cpu", W.max_diff(trio.models[0], trio.models[1]))


def mode_inplace() -> None:
    """COCONET_CUDA_FUSED=symmetric and COCONET_CUDA_FUSED_TRACE=1 (set by the test): zero and
    fused with the flat gradient in a window of the NCCL communicator (shared_memory's default
    at R > 1), which the peers read in place, then with shared_memory=False (staged), each
    against torch.optim.Adam and the CPU backend."""
    def wide() -> torch.nn.Module:  # 20002 parameters: the window's staging room shows (its 4096-byte units)
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(7, 2000), torch.nn.Tanh(), torch.nn.Linear(2000, 2))
    for shared in (None, False):
        for schedule in ("zero", "fused"):
            trio = Trio(schedule, models=[wide() for _ in range(3)], cuda_options={"shared_memory": shared})
            report(f"cuda:{schedule}:R{R}:{shared}:shared", 0.0 if trio.cuda.shared_memory == (shared is None) else 1.0)
            trio.run(10)
            cuda, cpu, ref = trio.models
            # the ranks' gradients summed vs torch's one backward over the whole batch: f32 rounding
            # of 2000-term sums, which Adam's m / sqrt(v) scales up where a gradient is near zero
            report(f"cuda:{schedule}:R{R}:{shared}:params_vs_torch", W.max_diff(cuda, ref), 1e-5)
            report(f"cuda:{schedule}:R{R}:{shared}:params_vs_cpu", W.max_diff(cuda, cpu))


def _two_groups(model: torch.nn.Module) -> list[dict]:
    """Matrices decayed at their own learning rate, biases not decayed (as GPT scripts group them)."""
    ps = list(model.parameters())
    return [{"params": ps[0::2], "lr": 2e-2}, {"params": ps[1::2], "wd": 0.0}]


def mode_across() -> None:
    """AdamW clipped by the norm of every group's gradient (across_groups=True) on the CUDA
    backend, against PyTorch and the CPU backend doing the same; per group (False) against each
    group's own norm. maxnorm is small enough that every step clips."""
    from coconetc.torch.roles import function_of
    schedules = sorted(function_of(ADAMW, None, backend="cuda").schedules)
    if rank == 0:
        print(f"SCHEDULES {' '.join(schedules)}", flush=True)
    hyper = dict(HYPER, wd=0.1, maxnorm=0.05)
    betas = (hyper["beta1"], hyper["beta2"])
    for schedule in schedules:
        trained = []
        for across in (True, False):
            cuda, cpu, ref = (W.make_model() for _ in range(3))
            opts = [DistributedOptimizer(_two_groups(m), str(ADAMW), schedule=schedule, backend=backend,
                                         across_groups=across, **hyper)
                    for m, backend in ((cuda, "cuda"), (cpu, "cpu"))]
            ref_groups = _two_groups(ref)
            ref_opt = torch.optim.AdamW([{k: v for k, v in g.items() if k != "wd"} |
                                         {"weight_decay": g.get("wd", hyper["wd"])} for g in ref_groups],
                                        lr=hyper["lr"], betas=betas, eps=hyper["eps"], foreach=False)
            clipped = 0
            for t in range(1, STEPS // 2 + 1):
                for m, o in ((cuda, opts[0]), (cpu, opts[1]), (ref, ref_opt)):
                    o.zero_grad()
                    W.local_loss(m, t).backward()
                    if o is not ref_opt:
                        o.step()
                W.allreduced_grads(ref)
                parts = [list(ref.parameters())] if across else [g["params"] for g in ref_groups]
                for ps in parts:
                    clipped += torch.nn.utils.clip_grad_norm_(ps, hyper["maxnorm"]).item() > hyper["maxnorm"]
                ref_opt.step()
            label = f"across:{schedule}:R{R}:{'across_groups' if across else 'per_group'}"
            report(f"{label}:backend", 0.0 if opts[0].backend == "cuda" else 1.0)
            report(f"{label}:params_vs_torch", W.max_diff(cuda, ref))
            report(f"{label}:params_vs_cpu", W.max_diff(cuda, cpu))
            report(f"{label}:clipped", 0.0 if clipped >= STEPS // 2 else 1.0)  # the clipping mattered
            trained.append(cuda)
        # the global norm and the groups' own train differently (each check above tells them apart)
        report(f"across:{schedule}:R{R}:norms_differ", 0.0 if W.max_diff(*trained) > 1e-3 else 1.0)


def mode_scaled() -> None:
    from coconetc.torch.roles import function_of
    schedules = sorted(function_of(EX / "scaled_adam.ccn", None, backend="cuda").schedules)
    if rank == 0:
        print(f"SCHEDULES {' '.join(schedules)}", flush=True)
    W.mode_scaled(schedules, backend="cuda", tag="scaled_cuda")


def mode_checkpoint() -> None:
    """CUDA (emulated) -> CPU and CPU -> CUDA, through torch.save/torch.load."""
    path = comm.bcast(tempfile.mkdtemp(prefix="coconet_ckpt_") if rank == 0 else None)
    for src, dst_backend in (("cuda", "cpu"), ("cpu", "cuda")):
        model, ref = W.make_model(), W.make_model()
        opt = DistributedOptimizer(model.parameters(), str(ADAM), schedule="zero", backend=src, **HYPER)
        ref_opt = train_against_adam(model, opt, ref, STEPS // 2)
        sd = opt.state_dict()
        f = os.path.join(path, f"{src}.pt")
        if rank == 0:
            torch.save(dict(model=model.state_dict(), opt=sd, ref=ref.state_dict(), ref_opt=ref_opt.state_dict()), f)
        comm.Barrier()
        saved = torch.load(f, weights_only=False)
        for schedule in ("default", "zero"):
            ck = copy.deepcopy(saved)
            m2, r2 = W.make_model(), W.make_model()
            m2.load_state_dict(ck["model"])
            r2.load_state_dict(ck["ref"])
            o2 = DistributedOptimizer(m2.parameters(), str(ADAM), schedule=schedule, backend=dst_backend, **HYPER)
            o2.load_state_dict(ck["opt"])
            ro2 = torch.optim.Adam(r2.parameters(), lr=HYPER["lr"], foreach=False)
            ro2.load_state_dict(ck["ref_opt"])
            back = o2.state_dict()
            exact = all(torch.equal(a, b) for a, b in zip(W._flat(back), W._flat(ck["opt"])))
            exact &= back["param_groups"] == ck["opt"]["param_groups"]
            label = f"ckpt:{src}:zero->{dst_backend}:{schedule}:R{R}"
            report(f"{label}:state_round_trip", 0.0 if exact else 1.0)
            train(m2, o2, r2, ro2, range(STEPS // 2 + 1, STEPS + 1))
            report(f"{label}:params", W.max_diff(m2, r2))
            report(f"{label}:state", W.state_diff(o2, ro2))
    comm.Barrier()
    if rank == 0:
        for name in os.listdir(path):
            os.unlink(os.path.join(path, name))
        os.rmdir(path)


def gloo() -> object:
    """A gloo process group over the job's ranks (a TCP store on a port rank 0 found free), as
    bench/common.py makes one."""
    import torch.distributed as dist
    name = None
    if rank == 0:  # (a TCP store on a free port: a file store stays in /tmp unless the group is destroyed)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            name = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    name = comm.bcast(name, root=0)
    dist.init_process_group("gloo", init_method=name, rank=rank, world_size=R)
    return dist.group.WORLD


def train_against_adam(model, opt, ref, steps: int = STEPS):
    """STEPS steps of MODEL with OPT and of REF with torch.optim.Adam on the all-reduced
    gradients (the same losses); returns torch's optimizer."""
    ref_opt = torch.optim.Adam(ref.parameters(), lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                               eps=HYPER["eps"], foreach=False)
    train(model, opt, ref, ref_opt, range(1, steps + 1))
    return ref_opt


def train(model, opt, ref, ref_opt, steps: range) -> None:
    """Steps STEPS (their numbers pick the losses) of MODEL with OPT and of REF with REF_OPT,
    which is given the gradients all-reduced."""
    for t in steps:
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            W.local_loss(m, t).backward()
            if o is ref_opt:
                W.allreduced_grads(m)
            o.step()


def mode_pg() -> None:
    group = gloo()
    for schedule in ("default", "zero"):
        model, ref = W.make_model(), W.make_model()
        opt = DistributedOptimizer(model.parameters(), str(ADAM), schedule=schedule, backend="cuda",
                                   process_group=group, **HYPER)
        ok = opt._comm.group is group and opt._comm.mpi is None
        report(f"pg:{schedule}:R{R}:nccl_from_group", 0.0 if ok else 1.0)
        ref_opt = train_against_adam(model, opt, ref)
        report(f"pg:{schedule}:R{R}:params", W.max_diff(model, ref))
        report(f"pg:{schedule}:R{R}:state", W.state_diff(opt, ref_opt))  # gathered over gloo
    device_group()


def device_group() -> None:
    """A group whose object collectives run on the device (an NCCL group under torchrun; a new
    gloo group said to be one here): the calls agree over a gloo group of its ranks made once
    (runtime/nccl.py, _host_group), never over the group itself, which would synchronize the
    host with the GPU on every step; every step's record round goes over it too, and repeated
    steps need no full exchange (all_gather_object); the steps are still torch's."""
    import torch.distributed as dist

    import coconetc.runtime.nccl as rc
    group = dist.new_group(list(range(R)), backend="gloo")  # (the optimizers above made their NCCL
    # communicator from WORLD: one per module and group)
    real_device, real_gather, real_all_gather = rc._object_device, dist.all_gather_object, dist.all_gather
    used: list = []  # (kind, group) of each collective of a call's agreement
    rc._object_device = lambda pg: "cuda" if pg is group else real_device(pg)

    def gather(out, obj, group=None):
        used.append(("full", group))
        return real_gather(out, obj, group=group)

    def records(out, t, group=None, **kw):
        used.append(("records", group))
        return real_all_gather(out, t, group=group, **kw)
    try:
        model, ref = W.make_model(), W.make_model()
        opt = DistributedOptimizer(model.parameters(), str(ADAM), schedule="default", backend="cuda",
                                   process_group=group, **HYPER)
        host = opt._comm.host_group
        report(f"pg:device_group:R{R}:host_group",
               0.0 if host is not group and dist.get_backend(host) == "gloo"
               and dist.get_process_group_ranks(host) == dist.get_process_group_ranks(group) else 1.0)
        dist.all_gather_object, dist.all_gather = gather, records
        train_against_adam(model, opt, ref)
        dist.all_gather_object, dist.all_gather = real_gather, real_all_gather
        kinds = [k for k, _ in used]
        report(f"pg:device_group:R{R}:exchanged_over_host_group",
               0.0 if kinds.count("records") >= STEPS and kinds.count("full") < STEPS
               and all(g is host for _, g in used) else 1.0)
        report(f"pg:device_group:R{R}:params", W.max_diff(model, ref))
    finally:
        rc._object_device, dist.all_gather_object, dist.all_gather = real_device, real_gather, real_all_gather


def mode_mixed() -> None:
    """Low-precision parameters (the model's copy) and gradients, f32 master weights `w` and
    state: the optimizer is given weights="w16", master="w"; gradients are set directly (each
    rank's own, drawn from a seed), the reference sums them in low precision as the program does
    and steps torch.optim.Adam on an f32 copy. On 2 ranks the low-precision sum is one rounding
    whatever the order, so the reference is exact; on more, the reduce-scatter's order is the
    algorithm's, so the reference is held to the low precision and the two backends (the same
    algorithm) to each other exactly."""
    for source, dt in ((EX / "mixed_adam.ccn", torch.float16), (EX / "mixed_adam_bf16.ccn", torch.bfloat16)):
        torch.manual_seed(0)
        full = [torch.randn(7, 5), torch.randn(11)]
        ulp = 1e-5 if R <= 2 else (4e-3 if dt == torch.float16 else 3e-2)
        masters: dict[str, list] = {}
        for backend, schedule in (("cuda", "default"), ("cuda", "zero"), ("cpu", "zero")):
            params = [torch.nn.Parameter(x.to(dt)) for x in full]
            master = [torch.nn.Parameter(p.detach().float()) for p in params]
            opt = DistributedOptimizer(params, str(source), schedule=schedule, backend=backend, weights="w16",
                                       master="w", scale=4.0, **HYPER)
            ref = torch.optim.Adam(master, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                                   eps=HYPER["eps"], foreach=False)
            for t in range(1, STEPS + 1):
                grads = []
                for r in range(R):
                    gen = torch.Generator().manual_seed(100 * t + r)
                    grads.append([(torch.randn(p.shape, generator=gen) * 4).to(dt) for p in params])
                for p, g in zip(params, grads[rank]):
                    p.grad = g.clone()
                for k, p in enumerate(master):
                    total = grads[0][k]
                    for r in range(1, R):
                        total = total + grads[r][k]  # summed in the low precision, as the program
                    p.grad = total.float() / 4.0
                opt.step()
                ref.step()
            sd = opt.state_dict()["state"]
            d_master = max((sd[i]["w"] - p.detach()).abs().max().item() for i, p in enumerate(master))
            d_model = max((p.detach().float() - m.detach().to(dt).float()).abs().max().item()
                          for p, m in zip(params, master))
            d_state = max(max((sd[i]["m"] - ref.state[p]["exp_avg"]).abs().max().item(),
                              (sd[i]["v"] - ref.state[p]["exp_avg_sq"]).abs().max().item())
                          for i, p in enumerate(master))
            label = f"mixed:{source.stem}:{backend}:{schedule}:R{R}"
            report(f"{label}:master", comm.allreduce(d_master, op=MPI.MAX), ulp)
            report(f"{label}:params", comm.allreduce(d_model, op=MPI.MAX), ulp)
            report(f"{label}:state", comm.allreduce(d_state, op=MPI.MAX), ulp)
            masters[f"{backend}:{schedule}"] = [sd[i]["w"] for i in sorted(sd)] + [p.detach().float() for p in params]
            dtypes = {t.dtype for g in opt.state_tensors for t in g.values()}
            report(f"{label}:f32_state", 0.0 if dtypes == {torch.float32} and params[0].dtype == dt else 1.0)
        d = max((a - b).abs().max().item() for a, b in zip(masters["cuda:zero"], masters["cpu:zero"]))
        report(f"mixed:{source.stem}:zero:R{R}:cuda_vs_cpu", comm.allreduce(d, op=MPI.MAX), 1e-6)


def mode_abort() -> None:
    model = W.make_model()
    schedule = sys.argv[2] if len(sys.argv) > 2 else "default"
    how = sys.argv[3] if len(sys.argv) > 3 else ""
    pg = {"process_group": gloo()} if how == "pg" else {}
    if how == "window":  # the gradient's window (collective) is the first NCCL call: the construction fails
        for tag in ("RAISED", "AGAIN"):
            try:
                DistributedOptimizer(model.parameters(), str(ADAM), schedule=schedule, backend="cuda", **HYPER)
                print(f"NOT RAISED {rank}", flush=True)
            except RuntimeError as err:
                print(f"{tag} {rank} 0.0s {err}".replace("\n", " "), flush=True)
        comm.Barrier()
        return
    # (shared_memory=False: the step's NCCL calls are the first to fail, not the gradient window's allocation)
    opt = DistributedOptimizer(model.parameters(), str(ADAM), schedule=schedule, backend="cuda", shared_memory=False,
                               **HYPER, **pg)
    if pg and opt._comm.mpi is not None:
        print("NOT FROM THE GROUP", flush=True)
    W.local_loss(model, 1).backward()
    start = time.monotonic()
    try:
        opt.step()
        print(f"NOT RAISED {rank}", flush=True)
    except RuntimeError as err:
        print(f"RAISED {rank} {time.monotonic() - start:.1f}s {err}".replace("\n", " "), flush=True)
    try:
        opt.step()
        print(f"AGAIN NOT RAISED {rank}", flush=True)
    except RuntimeError as err:
        print(f"AGAIN {rank} {err}".replace("\n", " "), flush=True)
    comm.Barrier()  # MPI_COMM_WORLD is untouched by the abort


def _refused_again(opt) -> None:
    """The step after an abort: the communicator refuses it ("AGAIN <rank> <message>")."""
    try:
        opt.step()
        print(f"AGAIN NOT RAISED {rank}", flush=True)
    except RuntimeError as err:
        print(f"AGAIN {rank} {err}".replace("\n", " "), flush=True)
    comm.Barrier()


def mode_async() -> None:
    """COCONET_EMULATE_NCCL_ASYNC_FAIL_RANK=1 (set by the test): rank 1's NCCL calls complete but
    leave an asynchronous error on its communicator, as on a GPU after step() has returned. Steps
    go on (a pause between them, as a training loop's forward and backward); within a few steps
    every rank's step raises, naming rank 1 and the asynchronous error (prints "RAISED <rank>
    <step> <message>"), and the communicator refuses the next one ("AGAIN <rank> <message>")."""
    model = W.make_model()
    # (shared_memory=False: no gradient window, whose making is NCCL calls of its own, so the step's
    # calls are the ones the injection counts)
    opt = DistributedOptimizer(model.parameters(), str(ADAM), schedule="default", backend="cuda", shared_memory=False,
                               **HYPER)
    for t in range(1, 6):
        opt.zero_grad()
        W.local_loss(model, t).backward()
        try:
            opt.step()
        except RuntimeError as err:
            print(f"RAISED {rank} {t} {err}".replace("\n", " "), flush=True)
            break
        time.sleep(1.0)  # the notice reaches every watchdog before the next step
    else:
        print(f"NOT RAISED {rank}", flush=True)
    _refused_again(opt)


def mode_hang() -> None:
    """COCONET_EMULATE_NCCL_HANG_RANK=1:K and a short COCONET_TIMEOUT (set by the test): steps
    run until rank 1's NCCL calls stop completing; that step's work never completes on any rank
    (rank 1's stream is blocked, the others' all-reduce waits for it), its event stays not
    ready, and the watchdog aborts the communicator after COCONET_TIMEOUT: the step raises on
    every rank ("RAISED <rank> <step> <seconds>s <message>"), and the communicator refuses the
    next one ("AGAIN <rank> <message>"). "EVENTS <rank> <made>": the events the watchdog made
    (recycled: one per call outstanding at once, not one per call)."""
    from coconetc.runtime.watchdog import WATCHDOGS
    model = W.make_model()
    # (shared_memory=False: no gradient window, whose making is NCCL calls of its own, so the step's
    # calls are the ones the injection counts)
    opt = DistributedOptimizer(model.parameters(), str(ADAM), schedule="default", backend="cuda", shared_memory=False,
                               **HYPER)
    for t in range(1, 11):
        opt.zero_grad()
        W.local_loss(model, t).backward()
        start = time.monotonic()
        try:
            opt.step()
        except RuntimeError as err:
            print(f"RAISED {rank} {t} {time.monotonic() - start:.1f}s {err}".replace("\n", " "), flush=True)
            break
    else:
        print(f"NOT RAISED {rank}", flush=True)
    dog = WATCHDOGS[id(opt._comm)]
    dog.thread.join(10.0)  # it ends after the abort, destroying its events
    print(f"EVENTS {rank} {dog.events.made} {len(dog.events.free) + len(dog.events.outstanding)}", flush=True)
    _refused_again(opt)


def run_mode(comm) -> int:
    mode = sys.argv[1]
    {"adam": mode_adam, "checkpoint": mode_checkpoint, "pg": mode_pg, "mixed": mode_mixed,
     "abort": mode_abort, "async": mode_async, "hang": mode_hang, "across": mode_across, "scaled": mode_scaled,
     "inplace": mode_inplace}[mode]()
    return 1 if W.failures else 0


if __name__ == "__main__":  # a failing rank stops the job
    sys.exit(stop_job_on_failure(run_mode, "torch_optimizer_cuda_worker"))
