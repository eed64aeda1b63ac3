// coconet CUDA runtime: what the generated CUDA code (coconetc/codegen/cuda) calls around its
// kernels, one header a job (as the CPU runtime's), included in order:
//
//   core.cuh           includes (or the host emulation), errors, CallArgs and Ctx, streams, scratch, launch
//   trace.cuh          the trace's marks on the GPU: units and pieces timed by CUDA events (../trace.h)
//   batch.cuh          a batch's calls combining their reductions
//   pointwise.cuh      pointwise kernels (vector accesses where aligned)
//   reductions.cuh     max/min, sums and norms, row reductions
//   blas.cuh           cuBLAS GEMMs
//   collectives.cuh    NCCL collectives, contiguous and scattered
//   fused.cuh          fused collectives
//   communicators.cuh  NCCL communicators and the C entry points of the Python runtime
//
// Collectives are stock NCCL on the call's stream, matmul is cuBLAS (cublasGemmEx), layernorm and
// conv2d are direct kernels, sum/norm are block reductions accumulated in double. Element math
// comes from ../pointwise.h, the same text the CPU loops use.
#pragma once

#include "core.cuh"
#include "trace.cuh"
#include "batch.cuh"
#include "pointwise.cuh"
#include "reductions.cuh"
#include "blas.cuh"
#include "collectives.cuh"
#include "fused.cuh"
#include "communicators.cuh"
