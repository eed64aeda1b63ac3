"""Every page of the docs (the README, docs/*.md and the tutorial, docs/tutorial/*.md; not
docs/results/) runs exactly as written, so it cannot drift from the code.

Each fenced block is run by its info string, in the order of the page, from a temporary
directory outside the checkout, with the `coconetc` of this Python first on PATH:

- ```sh: run by `bash -e` (a failing command fails the block);
- ```python (or ```python NAME, saved as NAME for the blocks after it): written to a file and
  run by this Python (one process: a job of one rank). A fragment that uses names the page leaves to the reader (`g`,
  `model`) runs after the few lines of PRELUDE that make them, in the same file; the block's own
  lines run unchanged. On a page of ONE_PROCESS the unnamed python blocks run one after another
  in one process (torch imported once), each with its own globals;
- ```ccn NAME: a whole .ccn file, written to NAME and checked (`coconetc check NAME`);
- ```text: not run. Every such block is listed in EXEMPT below (by its first line), with why; any
  other is an error. An excerpt of a file is compared with the file (EXCERPTS), a printout with
  the command's output (OUTPUTS).

The pages of docs/ name the checkout's files (`examples/adam.ccn`): they run in a directory
that holds a copy of examples/. Each tutorial page runs in a directory of its own, given the
files it reads from earlier pages (EARLIER: page 4 runs the adam.ccn of page 1), so that the
pages run side by side; a long page runs in parts (PARTS), each in a directory of its own; a
page another test runs block by block (RUN_BY) is not run here.
Builds go to the pytest cache that the other tests share (COCONET_CACHE): page 1 writes
examples/adam.ccn byte for byte, so the modules other tests build from it (CPU, and CUDA under
the host emulation) are reused, and the README's sgd.ccn is the one page 3 writes; the other
pages run the example files themselves, on 2 ranks at most."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
TUTORIAL = sorted((DOCS / "tutorial").glob("[0-9][0-9]_*.md"))
PAGES = [README, *TUTORIAL, *sorted(DOCS.glob("*.md"))]  # every page (docs/results/ holds figures)

FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)


def _name(page: Path) -> str:
    """A page as EXEMPT and the test ids name it: its path under docs/ (README.md at the top)."""
    return page.name if page == README else str(page.relative_to(DOCS))


# The blocks that do not run (fenced ```text), by (page, the block's first line), and why.
RUN_ELSEWHERE = "the same command as a test runs it"
EXEMPT = {
    ("README.md", "make demo    # set-up, then compile examples/adam.ccn and run it and all its schedules on 4 MPI ranks"):
        "make test would run this test again (recursion); both create and install into the checkout's "
        ".venv, which is not the reader's directory. test_readme_make_targets_exist checks the targets.",
    ("README.md", "pip install '.[cpu]'"):
        "an install into this virtualenv; tests/test_install.py installs into a fresh one and runs from elsewhere",
    ("tutorial/01_data_parallel_optimizer.md", "pip install '.[cpu]'"): "the same install as the README's",
    ("architecture.md", "adam.ccn --parse (frontend/parser.py, Lark: grammar/coconet.lark)--> syntax tree, "
                        "a span on every node"): "a diagram of the compiler's stages",
    ("architecture.md", "schedule zero for adam {"): "an excerpt of examples/adam.ccn (EXCERPTS)",
    ("architecture.md", "plan adam [zero]"): "a plan printout (OUTPUT checks it)",
    ("autodiff.md", "coconetc launch -n 2 examples/train_tp.py                         # a model trained with it, "
                    "against one process"):
        "tests/test_torch_function.py::test_training_examples_match_one_process runs both scripts (4 ranks)",
    ("autodiff.md", "schedule overlapped for grad(tp_mlp) {"): "an excerpt of examples/tp_mlp.ccn (EXCERPTS)",
    ("autodiff.md", "# saved by the forward (tp_mlp_fwd returns them): a, h; recomputed by the backward "
                    "(tp_mlp_bwd): h_add"): "program output (`coconetc show --grad`, run above; OUTPUTS)",
    ("autodiff.md", "schedule overlapped for grad(tp_mlp) {          # chunks along S, each packed, a GEMM per "
                    "batch row;"): "an excerpt of examples/tp_mlp.ccn (EXCERPTS)",
    ("autodiff.md", "schedule fused for grad(tp_block) {"): "an excerpt of examples/tp_mlp.ccn (EXCERPTS)",
    ("cluster.md", "srun --mpi=pmix -N 4 --ntasks-per-node 4 python train.py       # 16 ranks, 4 per node"):
        "needs a Slurm cluster",
    ("cluster.md", "cat hosts"): "needs a cluster (four hosts)",
    ("cluster.md", "torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint head:29500 train.py"):
        "needs a cluster of GPU nodes",
    ("cluster.md", "dist.init_process_group(\"nccl\")"): "needs GPUs (NCCL) under torchrun",
    ("cluster.md", "COCONET_SIMULATE_NODES=2 coconetc run examples/adam.ccn --ranks 4 -s all --size N=4099   "
                   "# 2 nodes of 2"):
        "tests/test_nodes.py runs both commands (4 ranks as 2 nodes of 2; 2 as 2 nodes of 1)",
    ("cmake.md", "source .venv/bin/activate            # or: PATH=$PWD/.venv/bin:$PATH, or "
                 "-DPython3_EXECUTABLE=.venv/bin/python"):
        "a build of the checkout; tests/test_cmake.py::test_top_level_build_and_ctest runs these commands",
    ("cmake.md", "cmake_minimum_required(VERSION 3.18)"):
        "a user's CMakeLists.txt; tests/test_cmake.py::test_user_project_with_find_package builds one with "
        "these calls",
    ("cmake.md", "cmake -S . -B build -Dcoconet_DIR=/path/to/coconet/cmake "
                 "-DPython_EXECUTABLE=/path/to/venv/bin/python"):
        "the user's project's build (paths of the reader's); test_user_project_with_find_package runs it",
    ("cmake.md", "import importlib"): "needs the module the user's CMake project builds; cmake/check_module.py "
                                      "does this, run by tests/test_cmake.py",
    ("cuda.md", "pip install -e '.[cuda]'                 # nvidia-nccl-cu13, nvidia-cublas, nvidia-cuda-runtime, "
                "pybind11, cmake, mpi4py"): "needs nvcc and the CUDA wheels (tests/test_cuda_backend.py, slow)",
    ("cuda.md", "import torch, coconetc"): "needs a GPU",
    ("cuda.md", " #  line unit                                            read     written      flops      bound limit"):
        "program output (on a GPU)",
    ("cuda_emulation.md", "coconetc run examples/adam.ccn --backend cuda --emulate --ranks 3 --schedule all"):
        "3 and 4 ranks: tests/test_cuda_emulate.py runs every example (adam.ccn, pipeline.ccn in 2 groups) "
        "under the emulation on 3 and 4 ranks against the interpreter (cuda.md runs adam's on 2)",
    ("cuda_emulation.md", "coconet emulate: race on buffer 'w' (bytes [20, 28) of 40): ncclBroadcast on the comm "
                          "stream"): "program output (an error message)",
    ("cuda_symmetric.md", "# one GPU: the kernel, the window and the device communicator with R = 1 (peer = itself)"):
        "needs GPUs",
    ("gpt_block.md", "n1 = layernorm(x)                    q, k, v = n1 wq + bq, n1 wk, n1 wv + bv    "
                     "(split into heads)"): "the block's maths, not a program (examples/gpt_block.ccn is checked)",
    ("gpt_block.md", "n1s = layernorm(x)        n1 = allgather(n1s)          (x: this rank's rows)"):
        "the block's maths, not a program (examples/gpt_block.ccn is checked)",
    ("language.md", "program NAME(PARAM, ...) { STATEMENTS }"): "a grammar excerpt",
    ("language.md", "q = transpose(reshape(matmul(x, wq), [B, S, 16, -1]), 1, 2)    # [B, 16, S, hd] sliced(1)"):
        "statements, not a file (the layouts they are given)",
    ("language.md", "y = gpt_block_sp(x, ln1_w, ln1_b, wq, bq, wk, wv, bv, wo, bo, ln2_w, ln2_b, w_fc, b_fc, w_proj, "
                    "b_proj,"): "a grammar excerpt (calls; examples/gpt_pipeline.ccn makes one)",
    ("language.md", 'from "gpt_block.ccn" import gpt_block'): "a grammar excerpt (examples/gpt_pipeline.ccn's line)",
    ("pipeline.md", "schedule pp_1f1b for gpt {"): "an excerpt of examples/gpt_pipeline.ccn (EXCERPTS)",
    ("language.md", "y = repeat(f, x, a1, a2, ...)"): "a grammar excerpt",
    ("language.md", "op lerp(a, b, t) = a + t * (b - a)"):
        "an excerpt of tests/programs/custom_ops.ccn (EXCERPTS; tests/test_custom_ops.py runs it)",
    ("language.md", "extern op rmsnorm(x, w, eps) {"): "an excerpt of examples/extern_ops.ccn (EXCERPTS)",
    ("language.md", "function(operands..., T* out, int64_t rows, int64_t cols)"): "a C++ signature's shape",
    ("operations.md", "OpDef("): "a schematic of coconetc/ir/ops.py's entry for sqrt: every field of OpDef",
    ("pytorch.md", "coconetc launch -n 2 examples/train_mlp.py --schedule zero      # python SCRIPT on 2 MPI ranks"):
        "tests/test_torch_optimizer.py::test_train_mlp_example_runs_and_resumes_on_other_ranks runs it",
    ("pytorch.md", 'DistributedOptimizer(params, source, *, program=None, schedule="default", comm=None,'):
        "the constructor's signature, not a call",
    ("pytorch.md", "# torchrun --nproc-per-node 8 train.py"): "needs GPUs (NCCL) under torchrun",
    ("pytorch.md", "model = make_model().cuda().to(torch.bfloat16)"): "needs a GPU",
    ("pytorch.md", "ccn_emu_adam_....adam(schedule='default'): rank 1 failed: ...: ncclAllReduce: unhandled system"):
        "program output (an error message)",
    ("pytorch.md", "....adam(schedule='default'): the NCCL communicator was aborted (rank 1 failed after"):
        "program output (an error message)",
    ("pytorch.md", "....adam(schedule='default'): rank 0 failed: the work of ....adam(schedule='default') (its"):
        "program output (an error message)",
    ("pytorch.md", "coconetc launch -n 2 examples/train_tp.py --schedule overlapped --grad-schedule overlapped"):
        "tests/test_torch_function.py runs train_tp.py and train_pipeline.py, tests/test_train_gpt.py "
        "train_gpt.py's modes",
    ("pytorch.md", "COCONET_CUDA_EMULATE=1 coconetc launch -n 2 train.py     # train.py passing backend=\"cuda\""):
        "train.py is the reader's; tests/test_torch_optimizer_cuda.py runs the optimizer so",
    ("pytorch.md", "coconet::tp_mlp_default_default_cpu_<hash>(Tensor x, Tensor w1, Tensor b1, Tensor w2, Tensor b2) "
                   "-> (Tensor, Tensor, Tensor)"): "program output (the operators' schemas)",
    ("pytorch.md", "model = torch.nn.Sequential(torch.nn.Linear(H, H), ct.Module(\"examples/tp_mlp.ccn\", "
                   "\"tp_mlp\", parameters=w))"):
        "tests/test_torch_compile.py compiles such a model under each backend (inductor's build: ~40 s)",
    ("sharded.md", "program sharded_mlp(x: f32[B, H] sliced(0), w1: f32[H, F] sliced(0), w2: f32[F, H] sliced(0)) {"):
        "an excerpt of examples/sharded_mlp.ccn (EXCERPTS)",
    ("sharded.md", "schedule overlapped for sharded_mlp {"): "an excerpt of examples/sharded_mlp.ccn (EXCERPTS)",
    ("sharded.md", "  L18   overlap w1g = allgather(w1) in 2 chunks along dim 0 (piece i of every rank's slice, "
                   "in place) -> h = matmul(x, w1g) per chunk, as it arrives"): "program output (the plan above; OUTPUTS)",
    ("sharded.md", "sharded_mlp.ccn:18:35: error: overlap on 'w1g': cannot chunk 'w1g' along dim 1 (the dim it "
                   "gathers, other than 0): a gathered right operand is cut along its rows (dim 0), each chunk "
                   "multiplied as it arrives: overlap(w1g, h, chunks=2)"): "program output (an error message)",
    ("sharded.md", "    w2g = allgather(w2)"): "program output (an excerpt of `show --grad` above; OUTPUTS)",
    ("sharded.md", "schedule overlapped for grad(sharded_mlp) {"): "an excerpt of examples/sharded_mlp.ccn (EXCERPTS)",
    ("sharded.md", "program sharded_model(x: f32[B, H] sliced(0), w1: f32[3, H, F] sliced(1), w2: f32[3, F, H] "
                   "sliced(1)) {"): "an excerpt of examples/sharded_mlp.ccn (EXCERPTS)",
    ("sharded.md", "  L40   library y__l0__w1 = index(w1, i=0)"):
        "program output (the plan above; OUTPUTS)",
    ("sharded.md", "program sharded_adamw(x: f32[B, H] sliced(0), w1: f32[H, F] sliced(0), w2: f32[F, H] "
                   "sliced(0),"): "an excerpt of examples/sharded_mlp.ccn (EXCERPTS)",
    ("sharded.md", "  L66   library d_x__g_w2g_part = matmul_tn(d_x__a, d_y)"):
        "program output (the plan above; OUTPUTS)",
    ("sharded.md", "schedule kept for grad(sharded_model) {"): "an excerpt of examples/sharded_mlp.ccn (EXCERPTS)",
    ("train_gpt.md", "python examples/train_gpt.py --mode tp --ranks 2           # tensor parallelism on 2 ranks"):
        "tests/test_train_gpt.py runs each mode (tp, sp on 2 ranks; tp_dp, pp_tp on 4) at tiny sizes",
    ("train_gpt.md", "== sp: gpt_block_sp on 4 ranks, sequence parallel over 4 ranks; schedule overlapped, grad "
                     "schedule default; 9248 of 27968 parameters on each rank"): "program output",
    ("train_gpt.md", "coconetc launch -n 2 python /path/to/coconet/examples/train_sharded.py --save ckpt.pt"):
        "tests/test_train_gpt.py runs each of these commands (and checks that this page shows them)",
    ("train_gpt.md", "== sharded/torch: nanoGPT, torch blocks on 2 ranks, parameters, gradients and AdamW's state "
                     "sharded over 2 ranks (coconetc.torch.shard, min_numel 0); 13984 of 27968 parameters on each "
                     "rank"): "program output",
    ("usage.md", "coconetc explain examples/adam.ccn --ranks 2 --size N=4194304   # bytes moved/sent, passes, launches"):
        "the tuner at this size takes minutes; tests/test_tune.py runs explain, and tune, show -s auto and "
        "run -s auto on adam.ccn at N=1000",
    ("usage.md", "coconetc launch -n 2 examples/train_mlp.py --schedule zero    # python SCRIPT on 2 MPI ranks"):
        "tests/test_torch_optimizer.py::test_train_mlp_example_runs_and_resumes_on_other_ranks runs it",
    ("usage.md", "coconetc launch -n 2 examples/train_tp.py     # Megatron-style MLP blocks, against one process"):
        "tests/test_torch_function.py::test_training_examples_match_one_process runs it",
    ("usage.md", "source .venv/bin/activate        # or -DPython3_EXECUTABLE=.venv/bin/python"):
        "a build of the checkout; tests/test_cmake.py::test_top_level_build_and_ctest runs these commands",
    ("usage.md", "coconet_add_module(my_adam adam.ccn SCHEDULES zero)   # [OUTPUT_DIR dir]; import my_adam"):
        "a CMake line; tests/test_cmake.py::test_user_project_with_find_package builds a project with it",
}

# The ```text blocks that are excerpts of a file a test checks: their lines (comments and blank
# lines aside) are lines of that file, in order (test_excerpts_are_the_files).
EXCERPTS = {
    ("architecture.md", "schedule zero for adam {"): "examples/adam.ccn",
    ("autodiff.md", "schedule overlapped for grad(tp_mlp) {"): "examples/tp_mlp.ccn",
    ("autodiff.md", "schedule overlapped for grad(tp_mlp) {          # chunks along S, each packed, a GEMM per "
                    "batch row;"): "examples/tp_mlp.ccn",
    ("autodiff.md", "schedule fused for grad(tp_block) {"): "examples/tp_mlp.ccn",
    ("language.md", "op lerp(a, b, t) = a + t * (b - a)"): "tests/programs/custom_ops.ccn",
    ("pipeline.md", "schedule pp_1f1b for gpt {"): "examples/gpt_pipeline.ccn",
    ("language.md", "extern op rmsnorm(x, w, eps) {"): "examples/extern_ops.ccn",
    ("sharded.md", "program sharded_mlp(x: f32[B, H] sliced(0), w1: f32[H, F] sliced(0), w2: f32[F, H] sliced(0)) {"):
        "examples/sharded_mlp.ccn",
    ("sharded.md", "schedule overlapped for sharded_mlp {"): "examples/sharded_mlp.ccn",
    ("sharded.md", "schedule overlapped for grad(sharded_mlp) {"): "examples/sharded_mlp.ccn",
    ("sharded.md", "program sharded_model(x: f32[B, H] sliced(0), w1: f32[3, H, F] sliced(1), w2: f32[3, F, H] "
                   "sliced(1)) {"): "examples/sharded_mlp.ccn",
    ("sharded.md", "program sharded_adamw(x: f32[B, H] sliced(0), w1: f32[H, F] sliced(0), w2: f32[F, H] "
                   "sliced(0),"): "examples/sharded_mlp.ccn",
    ("sharded.md", "schedule kept for grad(sharded_model) {"): "examples/sharded_mlp.ccn",
}

# The ```text blocks that are a command's output, or a part of it (test_outputs_are_the_commands).
OUTPUTS = {
    ("architecture.md", "plan adam [zero]"): ["show", "examples/adam.ccn", "-s", "zero", "--format", "plan"],
    ("autodiff.md", "# saved by the forward (tp_mlp_fwd returns them): a, h; recomputed by the backward "
                    "(tp_mlp_bwd): h_add"): ["show", "examples/tp_mlp.ccn", "-p", "tp_mlp", "--grad"],
    ("sharded.md", "  L18   overlap w1g = allgather(w1) in 2 chunks along dim 0 (piece i of every rank's slice, "
                   "in place) -> h = matmul(x, w1g) per chunk, as it arrives"):
        ["show", "examples/sharded_mlp.ccn", "-p", "sharded_mlp", "-s", "overlapped", "--format", "plan"],
    ("sharded.md", "    w2g = allgather(w2)"): ["show", "examples/sharded_mlp.ccn", "-p", "sharded_mlp", "--grad"],
    ("sharded.md", "  L40   library y__l0__w1 = index(w1, i=0)"):
        ["show", "examples/sharded_mlp.ccn", "-p", "sharded_model", "-s", "prefetched", "--format", "plan"],
    ("sharded.md", "  L66   library d_x__g_w2g_part = matmul_tn(d_x__a, d_y)"):
        ["show", "examples/sharded_mlp.ccn", "-p", "sharded_adamw", "-s", "in_backward", "--format", "plan"],
}

# What a ```python fragment uses that its page leaves to the reader, keyed by (page, the block's
# first line): run before the block, in the same file.
ARRAYS = ("import numpy as np\nimport coconetc\n"
          "g, w, m, v = (np.random.default_rng(i).standard_normal(1000).astype(np.float32) for i in range(4))\n")
TORCH = """import torch
from mpi4py import MPI
import coconetc.torch as ct
from coconetc.torch import DistributedOptimizer
torch.manual_seed(0)
rank = MPI.COMM_WORLD.Get_rank()
def make_model():
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
model = make_model()
loss_fn = torch.nn.functional.mse_loss
data = [(torch.randn(3, 4), torch.randn(3, 2)) for _ in range(2)]
"""
TP = """import torch
import torch.nn.functional as F
B, S, H, Fd = 2, 8, 16, 32
x, W1, B1, W2, b2 = (torch.randn(*s) for s in [(B, S, H), (H, Fd), (Fd,), (Fd, H), (H,)])
w1, b1, w2 = (t.clone().requires_grad_() for t in (W1, B1, W2))
b2 = b2.requires_grad_()
target = torch.randn(B, S, H)
def loss(y):
    return y.square().sum()
"""
OPT = TORCH + """opt = DistributedOptimizer(model.parameters(), "examples/adam.ccn",
                           lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
scheduler = torch.optim.lr_scheduler.LinearLR(opt)
for x, y in data:
    opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step(); scheduler.step()
"""
PRELUDE = {
    ("architecture.md", 'mod = coconetc.load("examples/adam.ccn")'): ARRAYS,
    ("usage.md", "import coconetc"): ARRAYS,
    ("usage.md", "from coconetc.torch import DistributedOptimizer"): TORCH,
    ("usage.md", "import coconetc.torch as ct"): TP,
    ("usage.md", "from coconetc.sourcefile import load_file"): (
        "import numpy as np\nrng = np.random.default_rng(0)\ninputs_per_rank = [{n: rng.standard_normal(1000)"
        ".astype(np.float32) for n in ('g', 'w', 'm', 'v')} | {'lr': 1e-3, 'beta1': 0.9, 'beta2': 0.999, "
        "'eps': 1e-8, 'step': 1.0}]\n"),
    ("autodiff.md", "import coconetc.torch as ct"): TP,
    ("operations.md", 'register(OpDef("softplus", "pointwise", (Arg("x"),),'): (
        "import numpy as np\nfrom coconetc.ir.ops import OpDef, Arg, Cpp, Cost, register\n"),
    ("pytorch.md", "# before: dist.all_reduce(p.grad) for every p, then"): TORCH,
    ("pytorch.md", "decay = [p for n, p in model.named_parameters() if p.dim() >= 2]"): TORCH,
    ("pytorch.md", "model = make_model().half()"): TORCH.replace("(torch.randn(3, 4), torch.randn(3, 2))",
                                                                 "(torch.randn(3, 4).half(), torch.randn(3, 2).half())"),
    ("pytorch.md", "state = opt.state_dict()        # on EVERY rank (it gathers the state's slices: a collective)"): OPT,
    ("pytorch.md", 'mod = coconetc.load("examples/adam.ccn")'): "import coconetc\n",
    ("pytorch.md", "import coconetc.torch as ct"): TP,
    ("pytorch.md", "compiled = torch.compile(model, fullgraph=True)"): OPT,
}

# The pages another test runs as written, block by block, on the rank pool (their blocks are still
# checked here: every one run or exempt).
RUN_BY = {"sharded_torch.md": "tests/test_sharded_torch.py::test_the_page_runs_as_written"}

# The pages whose unnamed ```python blocks, independent of each other, run one after another in
# one process (each with its own globals): each would otherwise import torch and MPI again.
ONE_PROCESS = {"pytorch.md", "usage.md", "autodiff.md"}

# The pages run in parts (the index of each part's first block), each part in a directory of its
# own, so that a cold cache's builds for one page are shared by both test workers.
PARTS = {"usage.md": [0, 2], "autodiff.md": [0, 1], "pytorch.md": [0, 6, 17], "sharded.md": [0, 9]}

# The pages whose test builds and runs modules (over ~5 s, the tutorial's too) run in make test
# only; the quick set runs the README's quickstart and the pages that only check and show.
SLOW = {"pytorch.md", "sharded.md", "usage.md", "autodiff.md", "cuda.md", "pipeline.md", "tracing.md"}


def _first(text: str) -> str:
    return text.splitlines()[0] if text else ""


def blocks(page: Path) -> list[tuple[str, str, str]]:
    """(kind, argument, text) of every fenced block of the page, in order."""
    found = []
    for m in FENCE.finditer(page.read_text()):
        info = m.group(1).split()
        found.append((info[0] if info else "", " ".join(info[1:]), m.group(2)))
    return found


@pytest.fixture
def doc_env(request, tmp_path: Path) -> dict[str, str]:
    """The environment a reader has: this virtualenv's `coconetc` first on PATH; builds cached where
    the other tests cache theirs (COCONET_CACHE, also set here for anything they start)."""
    cache = str(request.config.cache.mkdir("coconet-build"))
    os.environ["COCONET_CACHE"] = cache
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, "COCONET_CACHE": cache}


def _script(page: Path, i: int, arg: str, text: str, cwd: Path) -> Path:
    """A ```python block written to its file (```python NAME: NAME), after its PRELUDE."""
    script = cwd / (arg or f"_{page.stem}_block{i}.py")
    script.write_text(PRELUDE.get((_name(page), _first(text)), "") + text)
    return script


def _check_run(what: str, text: str, cmd: list[str], cwd: Path, env: dict[str, str]) -> None:
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, (f"{what} failed with {res.returncode}:\n{text}\n"
                                 f"--- stdout\n{res.stdout[-4000:]}\n--- stderr\n{res.stderr[-4000:]}")


def _run_block(page: Path, i: int, kind: str, arg: str, text: str, cwd: Path, env: dict[str, str]) -> None:
    name = _name(page)
    if kind == "sh":
        cmd = ["bash", "-e", "-c", text]
    elif kind == "python":
        script = _script(page, i, arg, text, cwd)
        cmd = [sys.executable, script.name]
    elif kind == "ccn":
        assert arg, f"{name}, block {i}: a ```ccn block names its file (```ccn sgd.ccn)"
        (cwd / arg).write_text(text)
        cmd = ["coconetc", "check", arg]
    else:
        assert kind == "text" and (name, _first(text)) in EXEMPT, (
            f"{name}, block {i} (```{kind}) is neither run nor listed in EXEMPT:\n{text}")
        return
    _check_run(f"{name}, block {i} (```{kind})", text, cmd, cwd, env)


def _run_in_one_process(page: Path, found: list[tuple[int, str]], cwd: Path, env: dict[str, str]) -> None:
    """Unnamed ```python blocks, each run as its own script (runpy: fresh globals), one after
    another in one process: the imports (torch, MPI) paid once."""
    scripts = [_script(page, i, "", text, cwd).name for i, text in found]
    _check_run(f"{_name(page)}, blocks {[i for i, _ in found]} (```python, in one process)",
               "\n".join(text for _, text in found),
               [sys.executable, "-c", "import runpy, sys\nfor f in sys.argv[1:]: runpy.run_path(f, run_name='__main__')",
                *scripts], cwd, env)


def _run_pages(pages: list[Path], cwd: Path, env: dict[str, str], part: tuple[int, int] = (0, 1 << 30)) -> None:
    """The pages' blocks in order (those of `part`, a range of block indices, alone)."""
    assert cwd.resolve() != REPO and REPO not in cwd.resolve().parents
    for page in pages:
        pending: list[tuple[int, str]] = []  # ONE_PROCESS pages: the python blocks not yet run
        for i, (kind, arg, text) in enumerate(blocks(page)):
            if not part[0] <= i < part[1]:
                continue
            if _name(page) in ONE_PROCESS and kind == "python" and not arg:
                pending.append((i, text))
                continue
            if pending and kind != "text":
                _run_in_one_process(page, pending, cwd, env)
                pending = []
            _run_block(page, i, kind, arg, text, cwd, env)
        if pending:
            _run_in_one_process(page, pending, cwd, env)


# What a page reads that an earlier page wrote, or that its reader brings (the rest of each page is its own): page 4 runs
# page 1's adam.ccn, which is examples/adam.ccn byte for byte (the page's test checks).
EARLIER = {"tutorial/04_gpus_and_clusters.md": {"adam.ccn": REPO / "examples" / "adam.ccn"},
           # nanoGPT's model.py, which the page's reader has: the benchmarks' copy in its shape
           "pipeline.md": {"model.py": REPO / "bench" / "nanogpt.py"}}


def _check_tracing(cwd: Path) -> None:
    """docs/tracing.md: the files it says are there."""
    assert sorted(p.name for p in (cwd / "traces").iterdir()) == ["trace.json", "trace.rank0.json",
                                                                  "trace.rank1.json"]
    assert [p.name for p in (cwd / "traces_block").iterdir()] == ["trace.rank0.json"]


def _check_tutorial_1(cwd: Path) -> None:
    """What page 4 (and the modules other tests build) take as page 1's file."""
    assert (cwd / "adam.ccn").read_bytes() == EARLIER["tutorial/04_gpus_and_clusters.md"]["adam.ccn"].read_bytes()


# What a page's test checks after its blocks ran.
AFTER = {"tracing.md": _check_tracing, "tutorial/01_data_parallel_optimizer.md": _check_tutorial_1}


def _runs(page: Path) -> bool:
    return any(kind in ("sh", "python", "ccn") for kind, _, _ in blocks(page))


def _params() -> list:
    out = []
    for page in PAGES:
        if _runs(page) and _name(page) not in RUN_BY:
            slow = page in TUTORIAL or _name(page) in SLOW
            starts = PARTS.get(_name(page), [0])
            for k, (lo, hi) in enumerate(zip(starts, [*starts[1:], 1 << 30])):
                out.append(pytest.param(page, (lo, hi), id=_name(page) + (f"[{k + 1}]" if len(starts) > 1 else ""),
                                        marks=[pytest.mark.slow] if slow else []))
    return out


@pytest.mark.parametrize("page, part", _params())
def test_page_runs_as_written(page: Path, part: tuple[int, int], tmp_path: Path, doc_env: dict[str, str]) -> None:
    """Each page (or part of a page, PARTS) in a directory of its own, so that the pages run side
    by side on the test workers: a page of docs/ with a copy of examples/, a tutorial page with
    what it reads from earlier pages (EARLIER)."""
    name = _name(page)
    if page.parent == DOCS:
        shutil.copytree(REPO / "examples", tmp_path / "examples")
    for file, src in EARLIER.get(name, {}).items():
        (tmp_path / file).write_bytes(src.read_bytes())
    _run_pages([page], tmp_path, doc_env, part)
    if name in AFTER:
        AFTER[name](tmp_path)


def test_the_tutorial_is_five_pages() -> None:
    assert [p.name for p in TUTORIAL] == ["01_data_parallel_optimizer.md", "02_tensor_parallel_layer.md",
                                          "03_schedules_plan_proofs.md", "04_gpus_and_clusters.md",
                                          "05_your_nanogpt_block.md"]


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_block_is_run_or_listed_exempt(page: Path) -> None:
    """No block is silently skipped: an unknown kind, or a ```text block not in EXEMPT, fails here
    (without running anything)."""
    for i, (kind, _, text) in enumerate(blocks(page)):
        assert kind in ("sh", "python", "ccn", "text"), f"{_name(page)}, block {i}: ```{kind}"
        if kind == "text":
            assert (_name(page), _first(text)) in EXEMPT, f"{_name(page)}, block {i} is not run:\n{text}"


def test_every_exempt_block_is_on_its_page() -> None:
    on_pages = {(_name(page), _first(text)) for page in PAGES for kind, _, text in blocks(page) if kind == "text"}
    assert set(EXEMPT) <= on_pages, set(EXEMPT) - on_pages
    for test in RUN_BY.values():
        file, name = test.split("::")
        assert f"def {name}(" in (REPO / file).read_text(), test
    assert len(_text_blocks(EXCERPTS)) == len(EXCERPTS) and len(_text_blocks(OUTPUTS)) == len(OUTPUTS)
    assert set(PRELUDE) <= {(_name(page), _first(text)) for page in PAGES
                            for kind, _, text in blocks(page) if kind == "python"}


def _code_lines(text: str) -> str:
    return "\n".join(ln.split("#")[0].rstrip() for ln in text.splitlines() if ln.split("#")[0].strip())


def _text_blocks(table: dict) -> list:
    return [pytest.param(page, text, table[(_name(page), _first(text))], id=f"{_name(page)}:{_first(text)[:30]}")
            for page in PAGES for kind, _, text in blocks(page)
            if kind == "text" and (_name(page), _first(text)) in table]


@pytest.mark.parametrize("page, text, source", _text_blocks(EXCERPTS))
def test_excerpts_are_the_files(page: Path, text: str, source: str) -> None:
    assert (_name(page), _first(text)) in EXEMPT
    assert _code_lines(text) in _code_lines((REPO / source).read_text()), f"{_name(page)}: not in {source}:\n{text}"


@pytest.mark.parametrize("page, text, args", _text_blocks(OUTPUTS))
def test_outputs_are_the_commands(page: Path, text: str, args: list[str]) -> None:
    assert (_name(page), _first(text)) in EXEMPT
    exe = Path(sys.executable).parent / "coconetc"
    res = subprocess.run([str(exe), *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert text in res.stdout, f"{_name(page)}: `coconetc {' '.join(args)}` now prints\n{res.stdout}"


def test_readme_make_targets_exist() -> None:
    """The README's two commands name real targets (`make -n` prints their commands, runs none)."""
    res = subprocess.run(["make", "-n", "-C", str(REPO), "demo", "test"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "coconetc run examples/adam.ccn --ranks 4 --schedule all" in res.stdout
    assert "pytest" in res.stdout


def test_readme_is_short() -> None:
    assert len(README.read_text().splitlines()) < 150


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_relative_links_resolve(page: Path) -> None:
    """Every relative link of every page names a file that exists."""
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
        if "://" not in target:
            assert (page.parent / target).exists(), f"{_name(page)}: broken link {target}"


# A repository path in backticks: under a top-level directory, or a top-level file.
NAMED_PATH = re.compile(r"`((?:coconetc|runtime_cpp|tests|examples|bench|docs|grammar|cmake|\.ci)/[\w./-]*"
                        r"|Makefile|pyproject\.toml|README\.md|CMakeLists\.txt)(?::[\w.]+)?[`:\s]")


# What `make bench` writes (git-ignored): named by the pages, there only after a run.
WRITTEN = ("bench/results/",)


def test_named_paths_exist() -> None:
    """Every repository path a page names in backticks (`coconetc/plan/units.py`,
    `runtime_cpp/coconet/trace.h`, `examples/adam.ccn`, ...) exists, so a page cannot go on naming
    a file that is gone. A path with a glob or a placeholder is skipped."""
    missing = []
    for page in PAGES:
        for path in NAMED_PATH.findall(page.read_text()):
            path = path.rstrip(".,;")
            if any(c in path for c in "*{<") or path.startswith(WRITTEN):
                continue
            if not (REPO / path).exists():
                missing.append(f"{_name(page)}: {path}")
    assert not missing, "\n".join(missing)
