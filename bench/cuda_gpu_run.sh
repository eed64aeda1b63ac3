#!/bin/bash
# Every check docs/cuda.md asks of a one-GPU run (R = 1), in one go, the most important first:
#   bash bench/cuda_gpu_run.sh OUTDIR
# Steps (each one's JSON in a temp directory, named after the step):
#   examples        every example, program and schedule against the interpreter (vector path)
#   kernels         every kernel against its bound: the copy bandwidth measured (1 GiB device to
#                   device), then one profiled call of each schedule of bench/cuda_gpu_check.py's
#                   KERNEL_RUNS (adam, adamw, mixed_adam_bf16, lamb, clipped_sgd, tp_mlp,
#                   tp_mlp_grad, attn_out), each unit's kernels matched to `coconetc explain
#                   --backend cuda -s S` and measured / bound printed (docs/cuda.md)
#   optimizer_check coconetc.torch.DistributedOptimizer on a small model against torch: every
#                   schedule, clipping, process_group and MPI, checkpoints to the CPU backend and
#                   back, bf16/f16 with f32 master weights (bench/cuda_optimizer_check.py)
#   optimizer_f32   coconetc.torch.DistributedOptimizer against torch's fused Adam, and against
#                   clip_grad_norm_ + fused AdamW, at 2^20 .. 2^28 (bench/cuda_optimizer.py)
#   optimizer_bf16  the same with bf16 parameters and gradients, f32 master weights and state,
#                   against torch's ways (an f32 master copy; fused Adam on the bf16 parameters)
#   adam_step       the module's Adam step called directly against torch's fused Adam (auto: the
#                   faster fused algorithm, measured), at 2^20, 2^24, 2^26
#   adam_step_pipeline, adam_step_symmetric  the same with the fused algorithm forced
#                   (COCONET_CUDA_FUSED=pipeline, =symmetric: the device-API kernel) at 2^24, 2^26,
#                   2^28: the two side by side for `zero` and `fused` (docs/cuda_symmetric.md, the
#                   kernel's tiles)
#   symmetric       the examples with COCONET_CUDA_FUSED=symmetric (the device-API kernel, peer = itself)
#   tp_mlp_f32, tp_mlp_bf16  the tensor-parallel MLP's forward + backward
#                   (coconetc.torch.function) against the same layer in PyTorch
#   gpt_block_f32, gpt_block_bf16  the GPT-2 block (examples/gpt_block.ccn) forward + backward at
#                   one rank against torch eager with SDPA and with the block's own attention, and
#                   its GEMMs alone (bench/gpt_block_gpu.py)
#   chunks          the examples at size 37 in 5-element chunks (every fused pipeline runs many chunks)
#   misalign        the examples with every tensor one element off (the element path)
#   tune_cuda       `coconetc tune --backend cuda` on adam.ccn at 2^26: the tuner on the GPU (its
#                   table in run.log; the record whole in gpu_run.json)
# then bench/cuda_gpu_report.py merges them. OUTDIR ends up with three files only (the device
# tool brings back at most 8):
#   run.log      every step's output, its exit code and seconds
#   gpu_run.json every step's JSON whole, the steps' exit codes and seconds, matches per way
#   gpu_run.md   one markdown report (printed at the end too)
# A step that fails does not stop the others; each runs under `timeout` (seconds below, times
# COCONET_GPU_TIMEOUT_SCALE, default 1), so a hang costs that step only; the whole run
# keeps within COCONET_GPU_BUDGET seconds (default 450: one device call of at most 8 minutes
# with time to bring the files back; 0: no limit): each step gets at most what is left, and the
# steps that no longer fit are skipped, named. On an H200 (2026-11-28) the steps took about 400 s,
# the kernels step adds about a minute; tune_cuda, the last, gets what is left.
set -u
OUT=${1:-out/gpu}
mkdir -p "$OUT"
cd "$(dirname "$0")/.." || exit 1
export PYTHONUNBUFFERED=1
# one build per module for the whole run: the GPU's architecture only (H100/H200: 90), one cache
export COCONET_CUDA_ARCHS=${COCONET_CUDA_ARCHS:-90} COCONET_CACHE=${COCONET_CACHE:-/tmp/coconet_gpu_cache}
LOG="$OUT/run.log"
: >"$LOG"
tmp=$(mktemp -d)
SCALE=${COCONET_GPU_TIMEOUT_SCALE:-1}
BUDGET=${COCONET_GPU_BUDGET:-450}  # seconds for the whole run (0: no limit): later steps get what is left
step() {
    local name=$1 limit=$(($2 * SCALE))
    shift 2
    local t0=$SECONDS rc
    if [ "$BUDGET" -gt 0 ] && [ "$name" != report ]; then
        local left=$((BUDGET - SECONDS - 20))  # 20 s kept for the report
        if [ $left -lt 30 ]; then
            echo "=== $name: skipped, the run's budget of $BUDGET s is spent" | tee -a "$LOG"
            printf '%s\t%s\t%s\n' "$name" "skipped" 0 >>"$tmp/steps.tsv"
            return
        fi
        [ $left -lt $limit ] && limit=$left
    fi
    echo "=== $name: $*" | tee -a "$LOG"
    timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1
    rc=$?
    [ $rc -eq 124 ] && echo "=== $name: stopped after its limit of $limit s" | tee -a "$LOG"
    echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >>"$tmp/steps.tsv"
}
check() {  # bench/cuda_gpu_check.py --skip-bench ARGS, its JSON as $tmp/NAME.json
    local name=$1 limit=$2
    shift 2
    step "$name" "$limit" "$@" --skip-bench --out "$tmp/$name"
    mv "$tmp/$name/cuda_gpu_check.json" "$tmp/$name.json" 2>/dev/null || echo "no $name.json" | tee -a "$LOG"
}
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'
    python3 -c 'import nvidia.nccl, pathlib; p = pathlib.Path(nvidia.nccl.__path__[0]); print("nccl wheel", p, sorted(x.name for x in (p / "include").glob("nccl*")))'
    nvcc --version | tail -n 2
} >>"$LOG" 2>&1
# the tensor-parallel layer's modules (with their derived backward) build beside the examples
python3 -c 'import sys; sys.path.insert(0, "bench"); import coconetc, tp_mlp
for d in ("f32", "bf16"): coconetc.load(tp_mlp.ccn_file(d), grad="tp_mlp", backend="cuda", log=lambda m: None)
import common
for d in ("f32", "bf16"): coconetc.load(common.example_in_dtype("gpt_block.ccn", d, "f32"), grad="gpt_block", backend="cuda", log=lambda m: None)' \
    >>"$LOG" 2>&1 &
check examples 420 python3 bench/cuda_gpu_check.py --archs "$COCONET_CUDA_ARCHS"
wait
step kernels 120 python3 bench/cuda_gpu_check.py --archs "$COCONET_CUDA_ARCHS" --kernels --out "$tmp/kernels_out"
mv "$tmp/kernels_out/cuda_gpu_check.json" "$tmp/kernels.json" 2>/dev/null || echo "no kernels.json" | tee -a "$LOG"
step optimizer_check 180 python3 bench/cuda_optimizer_check.py --json "$tmp/optimizer_check.json"
step optimizer_f32 300 python3 bench/cuda_optimizer.py --tables adam_f32,adamw_f32 --sizes 20,22,24,26,28 \
    --json "$tmp/optimizer_f32.json"
step optimizer_bf16 240 python3 bench/cuda_optimizer.py --tables mixed_bf16 --sizes 20,22,24,26,28 \
    --json "$tmp/optimizer_bf16.json"
step adam_step 180 python3 bench/adam_step.py --backend cuda --sizes 20,24,26 --json "$tmp/adam_step.json"
step adam_step_pipeline 180 env COCONET_CUDA_FUSED=pipeline \
    python3 bench/adam_step.py --backend cuda --sizes 24,26,28 --json "$tmp/adam_step_pipeline.json"
step adam_step_symmetric 180 env COCONET_CUDA_FUSED=symmetric \
    python3 bench/adam_step.py --backend cuda --sizes 24,26,28 --json "$tmp/adam_step_symmetric.json"
check symmetric 300 env COCONET_CUDA_FUSED=symmetric COCONET_CUDA_FUSED_TRACE=1 python3 bench/cuda_gpu_check.py --archs "$COCONET_CUDA_ARCHS"
step tp_mlp_f32 240 python3 bench/tp_mlp.py --backend cuda --ranks 1 --h 1024,4096 --json "$tmp/tp_mlp_f32.json"
step tp_mlp_bf16 240 python3 bench/tp_mlp.py --backend cuda --ranks 1 --dtype bf16 --h 1024,4096 \
    --json "$tmp/tp_mlp_bf16.json"
step gpt_block_f32 150 python3 bench/gpt_block_gpu.py --dtype f32 --json "$tmp/gpt_block_f32.json"
step gpt_block_bf16 120 python3 bench/gpt_block_gpu.py --dtype bf16 --json "$tmp/gpt_block_bf16.json"
check chunks 300 env COCONET_CUDA_CHUNK=5 python3 bench/cuda_gpu_check.py --archs "$COCONET_CUDA_ARCHS" --odd 37
check misalign 240 python3 bench/cuda_gpu_check.py --archs "$COCONET_CUDA_ARCHS" --misalign
step tune_cuda 240 python3 -c "from coconetc.cli import main; main()" tune examples/adam.ccn --backend cuda --ranks 1 --size N=67108864 --reps 5 \
    --json "$tmp/tune_cuda.json"
step report 60 python3 bench/cuda_gpu_report.py "$tmp" --out "$OUT"
cat "$OUT/gpu_run.md" 2>/dev/null
rm -rf "$tmp"
