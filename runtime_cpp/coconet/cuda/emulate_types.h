// coconet host emulation: the CUDA, NCCL and cuBLAS types and constants (emulate.h includes every part).
#pragma once

#ifndef COCONET_EMULATE
#define COCONET_EMULATE 1
#endif

#include <mpi.h>
#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "../dtypes.h"
#include "../gemm.h"

#define __device__
#define __global__
#define __host__
#define __forceinline__ inline
#define __shared__ static thread_local

// COCONET_EMU, COCONET_EMU_VAR: the functions that are not templates (the emulation's, and the
// CUDA runtime's host functions: core.cuh makes COCONET_EMU plain inline for nvcc) and the
// emulation's variables, built as the CPU runtime's state and helpers are (../state.h):
//   * COCONET_EMULATE_DEFINES (emulate.cpp, which coconetc's builds compile into the emulation
//     library, libccnemu-<key>.so, once per runtime and options): defined, visible to every module;
//   * COCONET_EMULATE_LINKS (an emulated module, its binding, its precompiled header): declared
//     only (gnu_inline: the body is never emitted; noinline: every call goes to the library);
//   * neither: inline, as header-only code.
// So a process holds one emulation (its streams, buffers, happens-before clocks, the fibers'
// thread indices) shared by every emulated module it loads, and a module compiles its own code
// and the templates it instantiates, not the emulation again (about a third of its compile).
#if defined(COCONET_EMULATE_DEFINES)
#define COCONET_EMU inline __attribute__((used, visibility("default")))
#define COCONET_EMU_VAR(decl, init) __attribute__((visibility("default"))) decl init;
#elif defined(COCONET_EMULATE_LINKS)
#define COCONET_EMU inline __attribute__((gnu_inline, noinline))
#define COCONET_EMU_VAR(decl, init) extern decl;
#else
#define COCONET_EMU inline
#define COCONET_EMU_VAR(decl, init) inline decl init;
#endif

// ---- CUDA runtime types --------------------------------------------------------------------------

enum cudaError_t { cudaSuccess = 0, cudaErrorNotReady = 600, cudaErrorUnknown = 999 };
enum cudaMemcpyKind { cudaMemcpyHostToHost = 0, cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2,
                      cudaMemcpyDeviceToDevice = 3, cudaMemcpyDefault = 4 };
enum cudaDataType_t { CUDA_R_16F = 2, CUDA_R_32F = 0, CUDA_R_64F = 1, CUDA_R_16BF = 14 };
#define cudaStreamNonBlocking 0x01
#define cudaEventDisableTiming 0x02

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};

namespace coconet {
namespace cuda {
namespace emu {
struct Stream;
struct Event;
}  // namespace emu
}  // namespace cuda
}  // namespace coconet
typedef coconet::cuda::emu::Stream* cudaStream_t;
typedef coconet::cuda::emu::Event* cudaEvent_t;

COCONET_EMU_VAR(thread_local dim3 threadIdx, )
COCONET_EMU_VAR(thread_local dim3 blockIdx, )
COCONET_EMU_VAR(thread_local dim3 blockDim, )
COCONET_EMU_VAR(thread_local dim3 gridDim, )

// ---- NCCL and cuBLAS types -------------------------------------------------------------------------

enum ncclResult_t { ncclSuccess = 0, ncclInternalError = 3, ncclInvalidArgument = 4, ncclRemoteError = 6 };
enum ncclRedOp_t { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4 };
enum ncclDataType_t { ncclInt8 = 0, ncclUint8 = 1, ncclInt32 = 2, ncclUint32 = 3, ncclInt64 = 4, ncclUint64 = 5,
                      ncclFloat16 = 6, ncclFloat32 = 7, ncclFloat64 = 8, ncclBfloat16 = 9 };
struct ncclUniqueId { char internal[128]; };
namespace coconet { namespace cuda { namespace emu { struct Comm; } } }
typedef coconet::cuda::emu::Comm* ncclComm_t;

enum cublasStatus_t { CUBLAS_STATUS_SUCCESS = 0, CUBLAS_STATUS_NOT_SUPPORTED = 15 };
enum cublasOperation_t { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 };
enum cublasComputeType_t { CUBLAS_COMPUTE_32F = 68, CUBLAS_COMPUTE_64F = 70 };
enum cublasGemmAlgo_t { CUBLAS_GEMM_DEFAULT = -1 };
namespace coconet { namespace cuda { namespace emu { struct Blas { cudaStream_t stream = nullptr; }; } } }
typedef coconet::cuda::emu::Blas* cublasHandle_t;

// cuBLASLt: a matmul descriptor (compute and scale type, epilogue, bias) and matrix layouts.
enum cublasLtEpilogue_t { CUBLASLT_EPILOGUE_DEFAULT = 1, CUBLASLT_EPILOGUE_BIAS = 4, CUBLASLT_EPILOGUE_BGRADA = 256 };
enum cublasLtMatmulDescAttributes_t { CUBLASLT_MATMUL_DESC_TRANSA = 3, CUBLASLT_MATMUL_DESC_TRANSB = 4,
                                      CUBLASLT_MATMUL_DESC_EPILOGUE = 7, CUBLASLT_MATMUL_DESC_BIAS_POINTER = 8 };
namespace coconet {
namespace cuda {
namespace emu {
struct Lt {};
struct LtDesc {
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  cudaDataType_t scale = CUDA_R_32F;
  cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;
};
struct LtLayout {
  cudaDataType_t type = CUDA_R_32F;
  uint64_t rows = 0, cols = 0;
  int64_t ld = 0;
};
struct LtAlgo {};
}  // namespace emu
}  // namespace cuda
}  // namespace coconet
typedef coconet::cuda::emu::Lt* cublasLtHandle_t;
typedef coconet::cuda::emu::LtDesc* cublasLtMatmulDesc_t;
typedef coconet::cuda::emu::LtLayout* cublasLtMatrixLayout_t;
typedef coconet::cuda::emu::LtAlgo cublasLtMatmulAlgo_t;
