"""The switch of the CUDA host emulation (COCONET_CUDA_EMULATE): the CUDA backend's module built
for the host and CPU tensors in place of CUDA tensors (runtime/cuda.py: load_emulated)."""

from __future__ import annotations

import os

EMULATE = "COCONET_CUDA_EMULATE"


def emulating() -> bool:
    """COCONET_CUDA_EMULATE=1 in the environment: the CUDA backend (coconetc.load(backend=
    "cuda"), DistributedOptimizer, coconetc.torch.function) builds its module for the host
    emulation and takes CPU tensors in place of CUDA tensors. An explicit switch: without it,
    a CPU tensor given to the CUDA backend is an error naming it."""
    return os.environ.get(EMULATE, "").strip() not in ("", "0")
