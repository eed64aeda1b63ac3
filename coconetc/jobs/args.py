"""The command line every rank program takes (run.py, tune.py): the file, its program, the
schedule labels (repeated), the sizes (N=4096, repeated), repetitions, the inputs' seed, the
extern operations' header and library folders and libraries, and the module's backend (modules.load_for); each program
adds its own."""

from __future__ import annotations

import argparse


def parser(prog: str, reps: int) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("file")
    ap.add_argument("--program", required=True)
    ap.add_argument("--schedule", action="append", default=[])
    ap.add_argument("--size", action="append", default=[])
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--include-dir", action="append", default=[])
    ap.add_argument("--library-dir", action="append", default=[])
    ap.add_argument("--library", action="append", default=[])
    ap.add_argument("--grad-of", action="append", default=[],
                    help="a program whose derived programs (<p>_grad, <p>_fwd, <p>_bwd) the module holds")
    ap.add_argument("--emulate-cuda", action="store_true",
                    help="the CUDA module under the host emulation instead of the CPU module")
    ap.add_argument("--cuda", action="store_true",
                    help="the CUDA module on this node's GPUs (one rank a GPU), torch CUDA tensors")
    return ap
