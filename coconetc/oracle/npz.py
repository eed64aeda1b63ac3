"""Every rank's inputs and results of one run in one .npz file (`coconetc run --save`, the
interpreted and the compiled run alike)."""

from __future__ import annotations

import numpy as np

from coconetc.interp.interpreter import Result
from coconetc.oracle.inputs import joined


def save_results(path: str, inputs: list, results: list[Result]) -> None:
    """Every rank's inputs and results: r{rank}.in.{param}, r{rank}.out.{name} (returned stages
    by public name, updated parameters by parameter name), r{rank}.seg.{param} for scattered.
    The interpreted and the compiled `coconetc run --save` both write this."""
    arrays: dict[str, np.ndarray] = {}
    for r, (args, res) in enumerate(zip(inputs, results)):
        for name, v in args.items():
            arrays[f"r{r}.in.{name}"] = np.asarray(joined(v))
            if isinstance(v, (list, tuple)):
                arrays[f"r{r}.seg.{name}"] = np.array([len(x) for x in v], dtype=np.int64)
        for name, v in {**res.outputs, **res.updates}.items():
            arrays[f"r{r}.out.{name}"] = v
    np.savez(path, **arrays)  # type: ignore[arg-type]  # numpy's stub: a key could be allow_pickle
