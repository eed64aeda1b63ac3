"""A nanoGPT block as coconet's GPT block (examples/gpt_block.ccn): its weights in the program's
layouts, and the edges of the sequence-parallel region.

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

# The block's parameters in examples/gpt_block.ccn's order, and where nanoGPT keeps each.
NAMES = ("ln1_w", "ln1_b", "wq", "bq", "wk", "wv", "bv", "wo", "bo", "ln2_w", "ln2_b", "w_fc", "b_fc",
         "w_proj", "b_proj")


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

    def ln(m: Any, part: str) -> torch.Tensor:
        t = getattr(m, part, None)
        return (t if t is not None else torch.zeros(H, dtype=w.dtype, device=w.device)).detach()

    out = {
        "ln1_w": ln(block.ln_1, "weight"), "ln1_b": ln(block.ln_1, "bias"),
        "wq": heads(w[:H].T), "bq": heads(b[:H]), "wk": heads(w[H:2 * H].T),
        "wv": heads(w[2 * H:].T), "bv": heads(b[2 * H:]),
        "wo": attn.c_proj.weight.detach().T.reshape(n_head, hd, H), "bo": _bias(attn.c_proj, H, w).detach(),
        "ln2_w": ln(block.ln_2, "weight"), "ln2_b": ln(block.ln_2, "bias"),
        "w_fc": mlp.c_fc.weight.detach().T, "b_fc": _bias(mlp.c_fc, mlp.c_fc.weight.shape[0], w).detach(),
        "w_proj": mlp.c_proj.weight.detach().T, "b_proj": _bias(mlp.c_proj, H, w).detach(),
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
            parts = self.comm.allgather(t.cpu().numpy())
            return torch.cat([torch.from_numpy(p) for p in parts], dim=1).to(t.device)
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
