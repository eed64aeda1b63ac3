#!/usr/bin/env bash
# The GPU run's former name, kept for scripts that start it so: bench/cuda_gpu_run.sh.
exec bash "$(dirname "$0")/cuda_gpu_run.sh" "$@"
