#!/bin/bash
# Every check docs/cuda.md asks of a one-GPU session (R = 1), in one go, each step's output kept:
#   bash bench/cuda_gpu_session.sh OUTDIR
# writes OUTDIR/session.log (every step's output, its exit code and seconds) and the steps' JSON:
#   examples.json   every example, program and schedule against the interpreter (vector path)
#   misalign.json   the same with every tensor one element off (the element path)
#   symmetric.json  the same with COCONET_CUDA_FUSED=symmetric (the device-API kernel, peer = itself)
#   chunks.json     the same at size 37 in 5-element chunks (every fused pipeline runs many chunks)
#   adam_step_cuda.json, adam_step_cuda_symmetric.json  the Adam step against torch's fused Adam
#   tp_mlp_cuda_f32.json, tp_mlp_cuda_bf16.json  the tensor-parallel MLP's forward + backward
#                   (coconetc.torch.function) against the same layer in PyTorch
# A step that fails does not stop the others.
set -u
OUT=${1:-out/gpu}
mkdir -p "$OUT"
cd "$(dirname "$0")/.." || exit 1
export PYTHONUNBUFFERED=1
LOG="$OUT/session.log"
: >"$LOG"
step() {
    local name=$1
    shift
    local t0=$SECONDS
    echo "=== $name: $*" | tee -a "$LOG"
    "$@" >>"$LOG" 2>&1
    echo "=== $name: exit $? after $((SECONDS - t0)) s" | tee -a "$LOG"
}
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'
    python3 -c 'import nvidia.nccl, pathlib; p = pathlib.Path(nvidia.nccl.__path__[0]); print("nccl wheel", p, sorted(x.name for x in (p / "include").glob("nccl*")))'
    nvcc --version | tail -n 2
} >>"$LOG" 2>&1
tmp=$(mktemp -d)
step examples python3 bench/cuda_gpu_check.py --skip-bench --out "$tmp/examples"
step misalign python3 bench/cuda_gpu_check.py --skip-bench --misalign --out "$tmp/misalign"
step symmetric env COCONET_CUDA_FUSED=symmetric COCONET_CUDA_FUSED_TRACE=1 \
    python3 bench/cuda_gpu_check.py --skip-bench --out "$tmp/symmetric"
step chunks env COCONET_CUDA_CHUNK=5 python3 bench/cuda_gpu_check.py --skip-bench --odd 37 --out "$tmp/chunks"
step adam python3 bench/adam_step.py --backend cuda --sizes 20,24,26 --json "$OUT/adam_step_cuda.json"
step adam_symmetric env COCONET_CUDA_FUSED=symmetric \
    python3 bench/adam_step.py --backend cuda --sizes 26 --json "$OUT/adam_step_cuda_symmetric.json"
step tp_mlp python3 bench/tp_mlp.py --backend cuda --ranks 1 --h 1024,4096 --json "$OUT/tp_mlp_cuda_f32.json"
step tp_mlp_bf16 python3 bench/tp_mlp.py --backend cuda --ranks 1 --dtype bf16 --h 1024,4096 \
    --json "$OUT/tp_mlp_cuda_bf16.json"
for s in examples misalign symmetric chunks; do
    cp "$tmp/$s/cuda_gpu_check.json" "$OUT/$s.json" 2>/dev/null || echo "no $s.json" | tee -a "$LOG"
done
