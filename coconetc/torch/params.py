"""What the PyTorch fronts share: the compiled module of a .ccn file (loaded once per file,
backend and derived programs), the arguments of a call bound to the program's parameters and
checked to be on the backend's device, and torch's `params` (tensors, (name, tensor) pairs,
param-group dicts) as DistributedOptimizer takes them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from coconetc.ir import dtypes


_LOADED: dict[tuple, Any] = {}


def _shipped() -> list[str]:
    from coconetc.paths import examples_dir
    return sorted(p.name for p in examples_dir().glob("*.ccn"))


def load(source: str | Path, grad: tuple[str, ...] = (), what: str = "DistributedOptimizer",
         backend: str = "cpu") -> Any:
    """coconetc.load, once per file and version of it, backend and derived programs (`grad`)
    in this process."""
    from coconetc.paths import source_path
    path = source_path(source).resolve()  # a bare name may be a shipped example's ("adamw.ccn")
    if not path.exists():
        raise FileNotFoundError(f"{what}: no such .ccn file: {source} (nor an example of that name "
                                f"shipped with coconet: {', '.join(_shipped())})")
    from coconetc.runtime.backends import backend_for
    from coconetc.paths import imported_files
    stamps = tuple(f.stat().st_mtime if f.is_file() else 0.0 for f in imported_files(path, path.read_text()))
    key = (str(path), path.stat().st_mtime, stamps, grad, backend_for(backend).name)
    if key not in _LOADED:
        import coconetc
        _LOADED[key] = coconetc.load(path, log=lambda msg: None, grad=grad, backend=backend)
    return _LOADED[key]


def _ordered(ps: Any, where: str) -> list:
    """ps (a tensor, or an ordered collection) as a list; a dict, a string or a set (whose
    order changes between runs) is a TypeError."""
    if isinstance(ps, torch.Tensor):
        return [ps]
    if isinstance(ps, (dict, str, set)) or not hasattr(ps, "__iter__"):
        raise TypeError(f"DistributedOptimizer: {where} must be a tensor or an ordered collection of tensors, "
                        f"of (name, tensor) pairs or of param-group dicts (as torch optimizers take), "
                        f"got {torch.typename(ps)}")
    return list(ps)


def _named(ps: Any, where: str) -> tuple[list, list[str] | None]:
    """The tensors of ps (tensors or (name, tensor) pairs) and their names (None: unnamed);
    anything else is torch's TypeError."""
    tensors, names = [], []
    for x in _ordered(ps, where):
        if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str):
            names.append(x[0])
            x = x[1]
        if not isinstance(x, torch.Tensor):
            raise TypeError("DistributedOptimizer: optimizer can only optimize Tensors, but one of the params "
                            f"is {torch.typename(x)}")
        tensors.append(x)
    if names and len(names) != len(tensors):
        raise ValueError("DistributedOptimizer: all optimizer params should be with/without names. "
                         "Some param names are missing")
    return tensors, names or None


def param_groups(params: Any) -> list:
    """`params` as torch optimizers take it (a tensor, an iterable of tensors, of (name, tensor)
    pairs as `model.named_parameters()` gives, or of param-group dicts) as a list of tensors or
    of group dicts whose "params" is a list of tensors; named parameters become tensors with
    the group's "param_names" beside them, as torch.optim does. Anything else is torch's
    TypeError, raised before anything is built or communicated."""
    params = _ordered(params, "params")
    if params and not all(isinstance(x, dict) for x in params):
        if any(isinstance(x, dict) for x in params):
            raise TypeError("DistributedOptimizer: params mixes param-group dicts with tensors")
        tensors, names = _named(params, "params")
        return tensors if names is None else [{"params": tensors, "param_names": names}]
    out = []
    for g, x in enumerate(params):
        if "params" not in x:
            raise TypeError(f"DistributedOptimizer: param group {g} has no 'params'")
        tensors, names = _named(x["params"], f"param group {g}'s 'params'")
        out.append(dict(x, params=tensors) if names is None else dict(x, params=tensors, param_names=names))
    return out


def all_tensors(params: list) -> list:
    """The parameter tensors of `params` (tensors, or param-group dicts)."""
    out = []
    for x in params:
        ps = x["params"] if isinstance(x, dict) else [x]
        out.extend([ps] if isinstance(ps, torch.Tensor) else list(ps))
    return out


def numel(params: list) -> int:
    """Elements of all parameters (of every group)."""
    return sum(p.numel() for p in all_tensors(params))


def param_names(params: list) -> dict[str, torch.Tensor]:
    """The parameters by the names an error gives them: params[i], or param_groups[g]['params'][i]."""
    out: dict[str, torch.Tensor] = {}
    for g, x in enumerate(params):
        if isinstance(x, dict):
            ps = x["params"]
            names = x.get("param_names") or [None] * len(ps)
            for i, (p, name) in enumerate(zip(ps, names)):
                called = f" {name!r}" if name is not None else ""
                out[f"param_groups[{g}]['params'][{i}]{called} (shape {tuple(p.shape)})"] = p
        else:
            out[f"params[{g}] (shape {tuple(x.shape)})"] = x
    return out


def bind(what: str, names: list[str], args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Positional arguments bound to `names` in order (the program's parameters, as a Python
    function's), then the keywords; too many, or one given both ways, is a TypeError."""
    if len(args) > len(names):
        raise TypeError(f"{what}: takes {len(names)} argument{'s' if len(names) != 1 else ''} "
                        f"({', '.join(names)}), got {len(args)} positional")
    bound = dict(zip(names, args))
    both = sorted(set(bound) & set(kwargs))
    if both:
        raise TypeError(f"{what}: got multiple values for argument {both[0]!r}")
    return {**bound, **kwargs}


FLOATS = dtypes.FLOATS


def check_devices(what: str, backend: str, tensors: dict[str, torch.Tensor]) -> None:
    """Every tensor on the backend's device, before anything is built or communicated:
    CUDA tensors for "cuda" (CPU tensors under COCONET_CUDA_EMULATE=1), CPU tensors for "cpu"."""
    from coconetc.runtime.backends import backend_for
    b = backend_for(backend)
    for n, t in tensors.items():
        if t.device.type != b.device:
            raise ValueError(b.device_error(what, n, t.device))
