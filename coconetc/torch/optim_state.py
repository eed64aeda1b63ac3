"""Whole-tensor checkpoints of a torch optimizer that steps sharded parameters
(coconetc.torch.shard): its state gathered into whole tensors keyed by parameter name, and such a
state loaded on any number of ranks, each keeping its part (as FSDP's full optimizer state dict).

A state tensor of a sharded parameter shaped like the rank's part (AdamW's exp_avg and
exp_avg_sq, SGD's momentum_buffer) is gathered along the parameter's dim; every other entry
(a 0-d `step`, the state of a parameter kept whole) is the same on every rank and kept as it is.
The format is torch's with names for indices:

    {"state": {name: {"step": tensor, "exp_avg": whole tensor, ...}},
     "param_groups": [{"lr": ..., ..., "params": [names]}]}"""

from __future__ import annotations

from typing import Any

import torch

from coconetc.torch.parts import Parts


def _names(parts: Parts, opt: torch.optim.Optimizer) -> list[list[str]]:
    """The names of each param group's parameters; one the handle does not hold is a ValueError."""
    by_id = {id(p): n for n, p in parts._params.items()}
    out = []
    for g, group in enumerate(opt.param_groups):
        names = [by_id.get(id(p)) for p in group["params"]]
        if None in names:
            raise ValueError(f"param group {g} of the optimizer holds a parameter that is not one of the "
                             f"sharded module's (its {names.index(None)}th)")
        out.append([n for n in names if n is not None])
    return out


def _sharded_entry(parts: Parts, name: str, v: Any) -> bool:
    """Whether state value V of parameter NAME is one value per element of the rank's part."""
    s = parts.specs[name]
    return (isinstance(v, torch.Tensor) and s.dim is not None and v.dim() == len(s.shape)
            and tuple(v.shape) == s.part(parts.ranks, parts.rank))


def _describe(parts: Parts, opt: torch.optim.Optimizer, names: list[list[str]]) -> list[tuple]:
    """What every rank's optimizer must agree on before its state is gathered."""
    out: list[tuple] = []
    for group, gnames in zip(opt.param_groups, names):
        for n, p in zip(gnames, group["params"]):
            st = opt.state.get(p, {})
            out.append((n, tuple(sorted((k, _sharded_entry(parts, n, v), str(getattr(v, "dtype", type(v))))
                                        for k, v in st.items()))))
    return out


def optim_state_dict(parts: Parts, opt: torch.optim.Optimizer, rank0_only: bool = True) -> dict[str, Any]:
    """OPT's state with whole tensors (the module's doc), on rank 0 only ({} elsewhere) or on
    every rank. Collective."""
    names: list[list[str]] = []

    def local() -> list[tuple]:
        names.extend(_names(parts, opt))
        return _describe(parts, opt, names)
    parts._agree("optim_state_dict()", local, describe=lambda d: d, words="optimizer states")
    root = 0 if rank0_only else None
    state: dict[str, dict[str, Any]] = {}
    for group, gnames in zip(opt.param_groups, names):
        for n, p in zip(gnames, group["params"]):
            entry = {}
            for k, v in opt.state.get(p, {}).items():
                if _sharded_entry(parts, n, v):
                    entry[k] = parts._gathered_one(parts.specs[n], v, root)
                else:
                    entry[k] = v.clone() if isinstance(v, torch.Tensor) else v
            if entry:
                state[n] = entry
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": gn}
              for g, gn in zip(opt.param_groups, names)]
    return {"state": state, "param_groups": groups} if root in (None, parts.rank) else {}


def local_state(parts: Parts, opt: torch.optim.Optimizer, state_dict: Any) -> dict[str, Any]:
    """A whole optimizer state dict as torch's own for this rank (its part of each sharded entry),
    checked first: the groups and their parameters' names in order, each whole entry's shape."""
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("param_groups"), list) \
            or not isinstance(state_dict.get("state"), dict):
        raise TypeError("expected a dict with 'state' and 'param_groups', as optim_state_dict() returns")
    names = _names(parts, opt)
    saved = state_dict["param_groups"]
    if len(saved) != len(names):
        raise ValueError(f"the optimizer state has {len(saved)} param groups, the optimizer {len(names)}")
    index = {n: i for i, n in enumerate(n for gn in names for n in gn)}
    for g, (sg, gn) in enumerate(zip(saved, names)):
        if not isinstance(sg, dict) or list(sg.get("params", ())) != gn:
            got = sg.get("params") if isinstance(sg, dict) else sg
            raise ValueError(f"param group {g} of the optimizer state holds {got!r}; the optimizer's holds {gn!r}")
    state = {}
    for n, entry in state_dict["state"].items():
        if n not in index:
            raise ValueError(f"the optimizer state has state for {n!r}, which the optimizer does not step")
        s = parts.specs[n]
        out = {}
        for k, v in entry.items():
            sharded = isinstance(v, torch.Tensor) and s.dim is not None and v.dim() == len(s.shape)
            if sharded and tuple(v.shape) != s.shape:
                raise ValueError(f"the optimizer state's {k!r} of {n!r} is shaped {tuple(v.shape)}; "
                                 f"the parameter is {s.shape}")
            out[k] = v[parts.index(n)].clone() if sharded else v
        state[index[n]] = out
    groups = [{**{k: v for k, v in sg.items() if k != "params"}, "params": [index[n] for n in gn]}
              for sg, gn in zip(saved, names)]
    return {"state": state, "param_groups": groups}


def load_optim_state_dict(parts: Parts, opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """Loads a whole optimizer state (optim_state_dict() on any number of ranks), given on every
    rank, into OPT: each rank keeps its part. Checked on every rank first, and agreed: one that
    does not fit raises on every rank, naming the parameter (and the rank), and nothing changes."""
    opt.load_state_dict(parts._agree("load_optim_state_dict()", lambda: local_state(parts, opt, state_dict)))
