"""A nanoGPT block as coconet's GPT block (examples/gpt_block.ccn): its weights in the program's
layouts and back, the edges of the sequence-parallel region, and nanoGPT's whole GPT cut into
pipeline stages of such blocks (GPTPipeline).

    params = coconetc.torch.gpt.block_parameters(block, n_head)   # nn.Linear's [out, in] -> [in, out], heads cut
    layer = coconetc.torch.Module("gpt_block.ccn", "gpt_block", parameters=params, comm=comm)
    x = layer(x=x, scale=1 / math.sqrt(head_dim), pdrop=0.0, seed=step)

Under sequence parallelism (program gpt_block_sp) each rank's blocks see its slice of the
sequence: `scatter_sequence` before the first block, `gather_sequence` after the last. They are
Megatron's conjugate functions (each one's backward is the other's forward), over an mpi4py
communicator (`comm=`, default COMM_WORLD) or a torch.distributed process group
(`process_group=`), on CPU or CUDA tensors. A rank's slice is the language's: ceil(S / R) rows
a rank, the last ranks' shorter or empty (docs/language.md)."""

from __future__ import annotations

from typing import Any

import torch

from coconetc.ir.slices import slice_range
from coconetc.torch.parts import joined

# The block's parameters in examples/gpt_block.ccn's order, and where nanoGPT keeps each.
NAMES = ("ln1_w", "ln1_b", "wq", "bq", "wk", "wv", "bv", "wo", "bo", "ln2_w", "ln2_b", "w_fc", "b_fc",
         "w_proj", "b_proj")


# The block's parameters that are one of nanoGPT's tensors as it is: the Linear or LayerNorm that
# holds it and which of its tensors (module path, attribute). Where nanoGPT lacks it (its
# biases under bias=False) the block's is zeros, and stays zero (GPTPipeline leaves it out of
# what the optimizer steps).
_HELD = {"ln1_w": ("ln_1", "weight"), "ln1_b": ("ln_1", "bias"), "bo": ("attn.c_proj", "bias"),
         "ln2_w": ("ln_2", "weight"), "ln2_b": ("ln_2", "bias"), "b_fc": ("mlp.c_fc", "bias"),
         "b_proj": ("mlp.c_proj", "bias")}


def _holder(block: Any, path: str) -> Any:
    for part in path.split("."):
        block = getattr(block, part)
    return block


def _held(block: Any, name: str) -> torch.Tensor | None:
    """nanoGPT's tensor of the block's parameter NAME (of _HELD), None where it has none."""
    path, attr = _HELD[name]
    return getattr(_holder(block, path), attr, None)


def _bias(linear: Any, n: int, like: torch.Tensor) -> torch.Tensor:
    """A Linear's bias, or zeros where it has none (nanoGPT's bias=False)."""
    b = getattr(linear, "bias", None)
    return b if b is not None else torch.zeros(n, dtype=like.dtype, device=like.device)


def block_parameters(block: Any, n_head: int) -> dict[str, torch.Tensor]:
    """The whole parameters of examples/gpt_block.ccn's programs (gpt_block, gpt_block_sp) from
    a nanoGPT `Block` (ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj), as copies:
    nn.Linear's [out, in] weights transposed to [in, out]; c_attn split into q, k and v, each
    cut by heads ([H, NH, HD], its bias [NH, HD]); attention's c_proj as [NH, HD, H]. The key's
    bias is left out: it adds the same to every score of a row, which the softmax cancels.
    A block with bias=False gets zero biases (the same arithmetic). Pass them as `parameters=`
    of coconetc.torch.Module, which keeps this rank's part of each."""
    attn, mlp = block.attn, block.mlp
    w = attn.c_attn.weight.detach()
    H = w.shape[1]
    if w.shape[0] != 3 * H or H % n_head:
        raise ValueError(f"block_parameters: c_attn is {tuple(w.shape)}: expected [3 * H, H] with H = {H} "
                         f"a multiple of n_head = {n_head}")
    hd = H // n_head
    b = _bias(attn.c_attn, 3 * H, w).detach()

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(*t.shape[:-1], n_head, hd)

    def held(n: str) -> torch.Tensor:  # nanoGPT's tensor as it is, or zeros of its module's width
        t = _held(block, n)
        if t is None:
            m = _holder(block, _HELD[n][0])
            width = m.weight.shape[0] if getattr(m, "weight", None) is not None else H
            t = torch.zeros(width, dtype=w.dtype, device=w.device)
        return t.detach()

    out = {
        "wq": heads(w[:H].T), "bq": heads(b[:H]), "wk": heads(w[H:2 * H].T),
        "wv": heads(w[2 * H:].T), "bv": heads(b[2 * H:]),
        "wo": attn.c_proj.weight.detach().T.reshape(n_head, hd, H),
        "w_fc": mlp.c_fc.weight.detach().T, "w_proj": mlp.c_proj.weight.detach().T,
        **{n: held(n) for n in _HELD},
    }
    return {k: out[k].clone().contiguous() for k in NAMES}


class _Group:
    """The ranks a sequence is cut over: an mpi4py communicator or a torch process group."""

    def __init__(self, comm: Any, process_group: Any):
        if comm is not None and process_group is not None:
            raise ValueError("give comm= (mpi4py) or process_group= (torch.distributed), not both")
        if process_group is None:
            if comm is None:
                from mpi4py import MPI
                comm = MPI.COMM_WORLD
            self.comm, self.pg = comm, None
            self.size, self.rank = comm.Get_size(), comm.Get_rank()
        else:
            import torch.distributed as dist
            self.comm, self.pg = None, process_group
            self.size, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)

    def mine(self, t: torch.Tensor) -> torch.Tensor:
        lo, hi = slice_range(t.shape[1], self.size, self.rank)
        return t[:, lo:hi].contiguous()

    def gathered(self, t: torch.Tensor, whole: int) -> torch.Tensor:
        """The ranks' slices of dim 1 joined (WHOLE rows in all)."""
        t = t.detach().contiguous()
        if self.pg is None:
            return joined(self.comm, [t], [1])[0]
        import torch.distributed as dist
        most = -(-whole // self.size)  # every rank's slice padded to the first's rows
        pad = torch.zeros(t.shape[0], most, *t.shape[2:], dtype=t.dtype, device=t.device)
        pad[:, :t.shape[1]] = t
        parts = [torch.empty_like(pad) for _ in range(self.size)]
        dist.all_gather(parts, pad, group=self.pg)
        rows = [slice_range(whole, self.size, r) for r in range(self.size)]
        return torch.cat([p[:, :hi - lo] for p, (lo, hi) in zip(parts, rows)], dim=1)


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: _Group) -> torch.Tensor:
        ctx.group, ctx.whole = group, x.shape[1]
        return group.mine(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return ctx.group.gathered(g, ctx.whole), None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: _Group, whole: int) -> torch.Tensor:
        ctx.group = group
        return group.gathered(x, whole)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return ctx.group.mine(g), None, None


def scatter_sequence(x: torch.Tensor, *, comm: Any = None, process_group: Any = None) -> torch.Tensor:
    """This rank's slice of X [B, S, ...] along the sequence (dim 1), entering the
    sequence-parallel region; its backward all-gathers the slices' gradients."""
    return _Scatter.apply(x, _Group(comm, process_group))


def gather_sequence(x: torch.Tensor, seq_len: int, *, comm: Any = None, process_group: Any = None) -> torch.Tensor:
    """The ranks' slices X of a [B, SEQ_LEN, ...] tensor joined along dim 1, leaving the
    sequence-parallel region (every rank gets the whole); its backward keeps this rank's slice
    of the gradient (every rank computes the same loss from the joined tensor)."""
    return _Gather.apply(x, _Group(comm, process_group), seq_len)


# the block's weight matrices: decayed by nanoGPT's configure_optimizers (its 2-D parameters)
DECAYED = ("wq", "wk", "wv", "wo", "w_fc", "w_proj")


def absent_parameters(block: Any) -> set[str]:
    """The names of block_parameters(BLOCK) that nanoGPT's BLOCK does not have (its biases and
    layernorm biases under bias=False): zeros there."""
    qv = {"bq", "bv"} if getattr(block.attn.c_attn, "bias", None) is None else set()
    return qv | {n for n in _HELD if _held(block, n) is None}


def load_block_parameters(block: Any, params: dict[str, torch.Tensor]) -> None:
    """block_parameters' inverse: PARAMS (the whole parameters of gpt_block.ccn's programs, as
    block_parameters names them) written into nanoGPT's BLOCK in place, in its layouts ([in,
    out] transposed back to nn.Linear's [out, in], q, k and v joined into c_attn). The key's bias,
    which the program leaves out, is left as it is; a parameter the block lacks (bias=False) is
    not written. A name block_parameters does not make, or one missing, a KeyError."""
    missing = [n for n in NAMES if n not in params]
    extra = sorted(set(params) - set(NAMES))
    if missing or extra:
        raise KeyError(f"load_block_parameters: {'missing ' + repr(missing[0]) if missing else 'no parameter ' + repr(extra[0])}"
                       f" (gpt_block.ccn's are {', '.join(NAMES)})")
    attn, mlp = block.attn, block.mlp
    H = attn.c_attn.weight.shape[1]

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.detach().reshape(*t.shape[:-2], H)

    with torch.no_grad():
        w = attn.c_attn.weight
        w[:H].copy_(flat(params["wq"]).T)
        w[H:2 * H].copy_(flat(params["wk"]).T)
        w[2 * H:].copy_(flat(params["wv"]).T)
        attn.c_proj.weight.copy_(params["wo"].detach().reshape(H, H).T)
        mlp.c_fc.weight.copy_(params["w_fc"].detach().T)
        mlp.c_proj.weight.copy_(params["w_proj"].detach().T)
        if attn.c_attn.bias is not None:
            attn.c_attn.bias[:H].copy_(params["bq"].detach().reshape(H))
            attn.c_attn.bias[2 * H:].copy_(params["bv"].detach().reshape(H))
        for n in _HELD:
            t = _held(block, n)
            if t is not None:
                t.copy_(params[n].detach())


class GPTPipeline:
    """nanoGPT's `GPT` (its model.py as it is) cut into pipeline stages whose blocks are
    coconet's: the ranks of COMM (mpi4py) are the stages, in rank order, running ORDER (a name
    of coconetc.pipeline.ORDERS) over MICROBATCHES micro-batches; CHUNKS: the model chunks a
    rank holds (the order's own where None: 2 for interleaved and zero_bubble_v).
    `orders.layer_bounds` gives each virtual stage its blocks of `model.transformer.h`; each
    block is a layer of the shipped gpt_block.ccn's PROGRAM (`coconetc.torch.pipeline.Block`,
    under SCHEDULE and GRAD_SCHEDULE), holding this rank's part of the block's weights
    (block_parameters: copies, taken when the pipeline is made) on its stage's group TP_COMM
    (None: one rank a stage): tensor parallel (gpt_block), or sequence parallel (gpt_block_sp:
    the embeddings' output cut to this rank's slice of the sequence, the last block's joined
    before ln_f, as examples/train_gpt.py --mode sp does). The first stage runs the model's
    own `wte`, `wpe` and `drop` before its layers, the last its `ln_f` and `lm_head` after them
    and nanoGPT's loss (cross-entropy, ignore_index=-1); each micro-batch's loss is divided by
    M, so a step's gradients are those of the mean of the micro-batches' losses (the batch's
    mean loss when no target is -1). The token embedding tied to the head (nanoGPT's
    `wte.weight is lm_head.weight`) is held by the first and the last stage; `step` sums its
    two gradients between them (Megatron's embedding group). The blocks' dropout rate is
    `model.config.dropout`, their masks drawn from SEED, new each step.

        pipe = GPTPipeline(model, "1f1b", microbatches=4, comm=MPI.COMM_WORLD)
        opt = torch.optim.AdamW(pipe.param_groups(weight_decay=0.1), lr=6e-4)
        loss = pipe.step(idx, targets)        # the batch's loss on the last stage, else None
        pipe.clip_grad_norm_(1.0)             # nanoGPT's grad_clip, over the whole model
        opt.step(); opt.zero_grad()
        pipe.update_model()                   # the trained weights back into model, every rank

    Every rank of COMM passes the same model configuration and arguments; a model without
    nanoGPT's parts, or more virtual stages than blocks, a TypeError or ValueError on every
    rank before any message."""

    def __init__(self, model: Any, order: str = "1f1b", *, microbatches: int, comm: Any, tp_comm: Any = None,
                 chunks: int | None = None, program: str = "gpt_block", schedule: str = "default",
                 grad_schedule: str = "default", seed: int = 0, backend: str = "cpu"):
        import math

        from mpi4py import MPI

        from coconetc.pipeline import orders
        from coconetc.torch.pipeline import Block, Chunk, Pipeline
        tr = getattr(model, "transformer", None)
        missing = [n for n in ("wte", "wpe", "drop", "h", "ln_f") if tr is None or not hasattr(tr, n)]
        if missing or not hasattr(model, "lm_head") or not hasattr(model, "config"):
            raise TypeError(f"GPTPipeline: model must be nanoGPT's GPT (config, transformer.wte, wpe, drop, h, ln_f "
                            f"and lm_head); {type(model).__name__} lacks "
                            f"{'transformer.' + missing[0] if missing else 'lm_head or config'}")
        if program not in ("gpt_block", "gpt_block_sp"):
            raise ValueError(f"GPTPipeline: program must be 'gpt_block' (tensor parallel) or 'gpt_block_sp' "
                             f"(sequence parallel), got {program!r}")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"GPTPipeline: seed must be an int, got {type(seed).__name__}")
        self.model, self.comm = model, comm
        self.seed = seed
        tr = model.transformer
        cfg, L = model.config, len(tr.h)
        P, rank = comm.Get_size(), comm.Get_rank()
        placed = orders.make(order, P, microbatches, chunks)  # ValueError for a bad order, M or V (every rank)
        V = placed.chunks
        if P * V > L:
            many = f"{P} stages" if V == 1 else f"{P} stages x {V} chunks a rank = {P * V} virtual stages"
            fewer = f"at most {L} ranks in comm" if V == 1 else (
                (f"at most {L // V} ranks in comm, or " if L >= V else "")
                + f"an order of one chunk a rank, such as '1f1b', on at most {L} ranks")
            raise ValueError(f"GPTPipeline: {many} for the model's {L} blocks; each stage needs at least one "
                             f"({fewer})")
        bounds = orders.layer_bounds(L, P * V)
        self.block = Block("gpt_block.ccn", program, comm=tp_comm if tp_comm is not None else MPI.COMM_SELF,
                           schedule=schedule, grad_schedule=grad_schedule, backend=backend)
        # sequence parallel: each rank's blocks see its slice of the sequence, cut after the
        # embeddings and joined before ln_f (Megatron's conjugates)
        self._sp = tp_comm if not self.block.replicated and tp_comm is not None and tp_comm.Get_size() > 1 else None
        self._seq = 0  # the step's sequence length (the join's)
        scale = 1.0 / math.sqrt(cfg.n_embd // cfg.n_head)
        self.layers: dict[int, Any] = {}  # block index -> its layer (this rank's)
        self._absent: dict[int, set[str]] = {}
        head_stage = P * V - 1
        self.first, self.last = placed.place(0)[0], placed.place(head_stage)[0]
        chunk_list = []
        for c in range(V):
            stage = placed.stage(rank, c)
            layers = []
            for i in range(bounds[stage], bounds[stage + 1]):
                parts = self.block.parts(block_parameters(tr.h[i], cfg.n_head))
                self._absent[i] = absent_parameters(tr.h[i])
                self.layers[i] = self.block.layer(parts, scale=scale, pdrop=float(cfg.dropout), seed=seed)
                layers.append(self.layers[i])
            chunk_list.append(Chunk(layers, pre=self._pre if stage == 0 else None,
                                    post=self._post if stage == head_stage else None))
        self.pipe = Pipeline(chunk_list, order, microbatches=microbatches, comm=comm, loss_fn=self._loss,
                             tp_comm=tp_comm)
        self._steps = 0
        # the head tied to the token embedding on two ranks: their gradients summed between them
        tied = model.lm_head.weight is tr.wte.weight and self.first != self.last
        holds = rank in (self.first, self.last)
        self._tied = comm.Split(0 if holds else MPI.UNDEFINED, rank) if tied else None
        if self._tied == MPI.COMM_NULL:
            self._tied = None
        # the model's own torch parameters this rank computes with
        own: list[Any] = []
        if rank == self.first:
            own += [tr.wte, tr.wpe]
        if rank == self.last:
            own += [tr.ln_f, model.lm_head]
        ids = {id(p) for m in own for p in m.parameters()}
        self._torch = [(n, p) for n, p in model.named_parameters() if id(p) in ids]

    # the torch parts, as nanoGPT's GPT.forward computes them
    def _pre(self, idx: torch.Tensor) -> torch.Tensor:
        tr = self.model.transformer
        t = idx.shape[1]
        if t > self.model.config.block_size:
            raise ValueError(f"GPTPipeline: a sequence of {t} tokens; the model's block_size is "
                             f"{self.model.config.block_size}")
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = tr.drop(tr.wte(idx) + tr.wpe(pos))
        return x if self._sp is None else scatter_sequence(x, comm=self._sp)

    def _post(self, x: torch.Tensor) -> torch.Tensor:
        if self._sp is not None:
            x = gather_sequence(x, self._seq, comm=self._sp)
        return self.model.lm_head(self.model.transformer.ln_f(x))

    @staticmethod
    def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """What this rank trains, by name: each of its blocks' parts as
        `transformer.h.<i>.<name>` (gpt_block.ccn's names: wq, w_fc, ...; those the model lacks,
        under bias=False, left out), then the model's own parameters its stages compute with
        (`transformer.wte.weight` and `wpe` on the first stage, `ln_f` and the head on the last;
        the tied head once, as `transformer.wte.weight`)."""
        out = [(f"transformer.h.{i}.{n}", p) for i, ly in sorted(self.layers.items())
               for n, p in ly.params.items() if n not in self._absent[i]]
        return out + list(self._torch)

    def parameters(self) -> list[torch.Tensor]:
        return [p for _, p in self.named_parameters()]

    def param_groups(self, weight_decay: float) -> list[dict[str, Any]]:
        """nanoGPT's configure_optimizers' two groups over this rank's parameters: WEIGHT_DECAY
        on the weight matrices and the embeddings (the model's 2-D parameters), none on the
        biases and layernorms; for torch.optim.AdamW."""
        named = self.named_parameters()
        decayed = [p for n, p in named if (n.rsplit(".", 1)[-1] in DECAYED if n.startswith("transformer.h.")
                                           else p.dim() >= 2)]
        ids = {id(p) for p in decayed}
        return [{"params": decayed, "weight_decay": weight_decay},
                {"params": [p for _, p in named if id(p) not in ids], "weight_decay": 0.0}]

    def step(self, idx: torch.Tensor, targets: torch.Tensor, *, losses: list | None = None) -> float | None:
        """One step over the batch (IDX, TARGETS: [B, T] token ids, on every rank; each rank
        uses what its stages need): every parameter's gradient of the batch's loss added to its
        `.grad` (the tied embedding's summed between the first and the last stage); returns the
        loss on the last stage's ranks, None elsewhere. LOSSES: as Pipeline.step's."""
        for i, layer in self.layers.items():
            layer.scalars["seed"] = self.seed + self._steps * len(self.model.transformer.h) + i
        self._seq = idx.shape[1]
        loss = self.pipe.step(idx, targets, losses=losses)
        self._steps += 1
        for i, layer in self.layers.items():
            for n in self._absent[i]:  # (zeros the model lacks: no gradient, as in the model; none clipped)
                layer.params[n].grad = None
        if self._tied is not None:
            from mpi4py import MPI
            g = self.model.transformer.wte.weight.grad
            host = g.detach().cpu()  # (on the CPU, g's own memory)
            self._tied.Allreduce(MPI.IN_PLACE, host.numpy(), op=MPI.SUM)
            if g.device.type != "cpu":
                g.copy_(host)
        return loss

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """torch.nn.utils.clip_grad_norm_ over the whole model, as nanoGPT's grad_clip: the norm of
        every gradient of the model (each parameter once: the tied embedding as the first stage's)
        and every gradient scaled by max_norm / (norm + 1e-6) where that is below 1
        (Pipeline.clip_grad_norm_); the norm, the same on every rank. After step (and after
        summing data-parallel groups' gradients), before the optimizer's step, on every rank."""
        wte = self.model.transformer.wte.weight
        tied = [wte] if self._tied is not None and self.comm.Get_rank() == self.last else []
        return self.pipe.clip_grad_norm_(max_norm, [p for _, p in self._torch if not any(p is t for t in tied)],
                                         norm_type, tied=tied)

    def eval(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        """The batch forward only, without dropout, as nanoGPT's estimate_loss runs the model
        under model.eval(): with TARGETS the batch's loss on the last stage's ranks, without
        them the logits; None elsewhere (Pipeline.eval)."""
        self._seq = idx.shape[1]
        drop = self.model.transformer.drop
        was = drop.training
        drop.eval()
        try:
            return self.pipe.eval(idx, targets, pdrop=0.0)
        finally:
            drop.train(was)

    def update_model(self) -> None:
        """The trained weights written back into `model` on every rank of COMM and TP_COMM
        (collective over both): each block's whole weights gathered over its stage's
        tensor-parallel group (Block.whole) and sent to every stage, the embeddings from the
        first stage's ranks, ln_f and the head from the last's; then `model` computes as the
        pipeline does, in one process (to save it with torch.save, sample from it, or check it
        against one process)."""
        mine = {i: self.block.whole(ly.params) for i, ly in self.layers.items()}
        every: dict[int, dict[str, torch.Tensor]] = {}
        for got in self.comm.allgather(mine):
            every.update(got)
        tr = self.model.transformer
        for i, whole in every.items():
            load_block_parameters(tr.h[i], whole)
        sent: set[int] = set()  # (the head tied to wte: sent once, as the first stage's)
        for owner, mods in ((self.first, (tr.wte, tr.wpe)), (self.last, (tr.ln_f, self.model.lm_head))):
            for p in (p for m in mods for p in m.parameters() if id(p) not in sent):
                sent.add(id(p))
                got = self.comm.bcast(p.detach().cpu() if self.comm.Get_rank() == owner else None, root=owner)
                with torch.no_grad():
                    p.copy_(got)
