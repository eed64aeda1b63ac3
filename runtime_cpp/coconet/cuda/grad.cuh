// coconet CUDA runtime: the tensor operations a derived (vector-Jacobian) program adds, the mirror
// of ../grad.h (the same functions, sizes and meaning; coconetc/autodiff/ops.py has their typing
// rules and NumPy references). Every size is this rank's: the operands are its local parts.
// Included at the end of runtime.cuh.
//
//   matmul_nt, matmul_tn   cuBLAS with a transposed operand (gemm_trans, runtime.cuh)
//   sum_lead, sum_keep     a block a tile of 32 columns, 16 row lanes (sum_mid), 32-bit indices
//                          where they fit
//   mean_last              a block a row
//   layernorm_dx           a block a row (pointwise.h layernorm_dx_of, as layernorm_row_block)
//   layernorm_dgamma       a block a strided set of rows, its per-column partial sums in scratch,
//                          then a thread a column adds the blocks' partials (deterministic)
//   conv2d_dx, conv2d_dw   one thread per result element
//   colsum_rows            a loop's values and their column sums: a block a range of rows, then a
//                          thread a column adds the blocks' partial sums (plan/colsums.py)
//                          (all accumulating in the compute type)
#pragma once

namespace coconet {
namespace cuda {

// C[M, K] = A[M, N] x B[K, N]^T, all dense row-major.
template <class T>
void matmul_nt(const T* A, const T* B, T* C, int64_t M, int64_t N, int64_t K, cudaStream_t s) {
  gemm_trans<T>(false, true, M, K, N, A, N, B, N, C, K, s);
}
// C[M, K] += A[M, N] x B[K, N]^T (a term of an overlap's sum of GEMMs after its first).
template <class T>
void matmul_nt_acc(const T* A, const T* B, T* C, int64_t M, int64_t N, int64_t K, cudaStream_t s) {
  gemm_trans<T>(false, true, M, K, N, A, N, B, N, C, K, s, true);
}

// C[K, N] = A[M, K]^T x B[M, N] (M: the product of the leading dims), all dense row-major.
template <class T>
void matmul_tn(const T* A, const T* B, T* C, int64_t M, int64_t K, int64_t N, cudaStream_t s) {
  gemm_trans<T>(true, false, K, N, M, A, K, B, N, C, N, s);
}
// C[K, N] += A[M, K]^T x B[M, N]: a weight's gradient added into its accumulator in place (an
// accumulating backward: plan/targets.py accumulated_in_place, Library.accumulate).
template <class T>
void matmul_tn_acc(const T* A, const T* B, T* C, int64_t M, int64_t K, int64_t N, cudaStream_t s) {
  gemm_trans<T>(true, false, K, N, M, A, K, B, N, C, N, s, true);
}

// Sums over a middle dim: out[o, j] = sum over m of x[o, m, j] (x: outer x mid x inner). One block
// of kColTile x kRowLanes threads a tile of kColTile adjacent columns of one o: lane (r, t) adds rows
// r, r + kRowLanes, ... of column t (a warp reads kColTile adjacent elements of a row: coalesced),
// then the block adds its kRowLanes partial sums per column in shared memory, in a fixed order
// (deterministic). One thread a column walking every row (before) left a column sum of 4096 rows
// a chain of 4096 dependent loads on few blocks: about a millisecond whatever the width.
constexpr int kColTile = 32, kRowLanes = 16;

template <class T, class I>
__global__ void sum_mid_kernel(const T* x, T* out, I outer, I mid, I inner) {
  using A = compute_t<T>;
  __shared__ A part[kRowLanes][kColTile + 1];
  const int t = threadIdx.x % kColTile, r = threadIdx.x / kColTile;
  const I tiles = (inner + kColTile - 1) / kColTile;
  for (I b = blockIdx.x; b < outer * tiles; b += I(gridDim.x)) {
    const I o = b / tiles, j = (b % tiles) * kColTile + t;
    A acc = 0;
    if (j < inner) {
      const T* col = x + o * mid * inner + j;
      for (I m = r; m < mid; m += kRowLanes) acc += to_compute(col[m * inner]);
    }
    part[r][t] = acc;
    __syncthreads();
    if (r == 0 && j < inner) {
      A s = part[0][t];
      for (int k = 1; k < kRowLanes; ++k) s += part[k][t];
      out[o * inner + j] = from_compute<T>(s);
    }
    __syncthreads();
  }
}

// The sums over the middle dim, indexed in int32_t where every index the kernel forms fits (an
// element; a row lane's step past the last row, kRowLanes rows; a tile past the last, the grid
// and a tile), else int64_t.
template <class T>
void sum_mid(const T* x, T* out, int64_t outer, int64_t mid, int64_t inner, const Ctx& c) {
  const int64_t work = outer * ((inner + kColTile - 1) / kColTile);
  if (work <= 0) {
    COCONET_ACCESS();  // (emulation) no kernel: its declared ranges go with it
    return;
  }
  COCONET_ACCESS(COCONET_R(x, 0, outer * mid * inner), COCONET_W(out, 0, outer * inner));
  const int64_t blocks = std::min<int64_t>(work, 65535);
  const int64_t most = std::max(outer * mid * inner, work * kColTile);
  if (index32(most, (kRowLanes + 1) * inner + (blocks + 1) * kColTile)) {
    COCONET_COUNT_INDEX(32);
    void (*kernel)(const T*, T*, int32_t, int32_t, int32_t) = sum_mid_kernel<T, int32_t>;
    COCONET_LAUNCH(kernel, static_cast<unsigned>(blocks), kColTile * kRowLanes, 0, c.stream, x, out, int32_t(outer),
                   int32_t(mid), int32_t(inner));
  } else {
    COCONET_COUNT_INDEX(64);
    void (*kernel)(const T*, T*, int64_t, int64_t, int64_t) = sum_mid_kernel<T, int64_t>;
    COCONET_LAUNCH(kernel, static_cast<unsigned>(blocks), kColTile * kRowLanes, 0, c.stream, x, out, outer, mid,
                   inner);
  }
  COCONET_CUDA(cudaGetLastError());
}

// out[j] = sum over i of x[i, j] (x: outer x inner).
template <class T>
void sum_lead(const T* x, T* out, int64_t outer, int64_t inner, const Ctx& c) {
  sum_mid(x, out, 1, outer, inner, c);
}

// out[o, j] = sum over m of x[o, m, j] (x: outer x mid x inner; out: outer x 1 x inner).
template <class T>
void sum_keep(const T* x, T* out, int64_t outer, int64_t mid, int64_t inner, const Ctx& c) {
  sum_mid(x, out, outer, mid, inner, c);
}

// out[r] = the mean of x[r, 0:h] (h = 0: NaN, as NumPy's mean of nothing): a block a row
// (launch_rows), its threads striding the row (coalesced), their sums added by block_sum.
template <class T>
void mean_last(const T* x, T* out, int64_t rows, int64_t h, const Ctx& c) {
  using A = compute_t<T>;
  COCONET_ACCESS(COCONET_R(x, 0, rows * h), COCONET_W(out, 0, rows));
  launch_rows<A>(rows, rows * h, c.stream, [=] __device__(auto r, A* part) {
    using I = decltype(r);
    const T* const xr = x + r * I(h);
    A acc = 0;
    for (I j = threadIdx.x; j < I(h); j += I(blockDim.x)) acc += to_compute(xr[j]);
    const A total = block_sum(part, acc);
    if (threadIdx.x == 0) out[r] = from_compute<T>(static_cast<A>(total / static_cast<A>(h)));
  });
}

// layernorm's input gradient of one row of h elements by the calling block (pointwise.h
// layernorm_dx_of, the block's threads striding the row and block_sum adding their parts, as
// layernorm_row_block): x(j) and dy(j) read element j in C, out(j, v) takes its value v; part: the
// block's scratch of launch_rows. The kernel below, and a fused collective's row-wise phase
// (codegen/cuda/fused.py).
template <class C, class X, class G, class D, class Out>
__device__ inline void layernorm_dx_row_block(X x, const G* gamma, D dy, C eps, int64_t h, C* part, Out out) {
  const auto sum = [&](auto f) {
    C s = 0;
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x) s += f(j);
    return block_sum(part, s);
  };
  const auto each = [&](auto f) {
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x) f(j);
  };
  layernorm_dx_of(x, gamma, dy, eps, h, sum, each, out);
}

// dx[r, :] = layernorm's input gradient of row r from x[rows, h], gamma[h] and g[rows, h]: a block a
// row (launch_rows, layernorm_dx_row_block). add (the plan's residual epilogue, plan/epilogue.py):
// dx = add + that gradient, the gradient rounded to T first, as the separate kernel adds it (grad.h).
template <class T>
void layernorm_dx(const T* x, const T* gamma, const T* g, T* dx, double eps, int64_t rows, int64_t h, const Ctx& c,
                  const T* add = nullptr) {
  using C = compute_t<T>;
  COCONET_ACCESS(COCONET_R(x, 0, rows * h), COCONET_R(gamma, 0, h), COCONET_R(g, 0, rows * h),
                 add ? COCONET_R(add, 0, rows * h) : COCONET_R(x, 0, 0), COCONET_W(dx, 0, rows * h));
  launch_rows<C>(rows, rows * h, c.stream, [=] __device__(auto r, C* part) {
    using I = decltype(r);
    const T* const xr = x + r * I(h);
    const T* const gr = g + r * I(h);
    const T* const ar = add ? add + r * I(h) : nullptr;
    T* const dxr = dx + r * I(h);
    layernorm_dx_row_block([&](int64_t j) { return C(to_compute(xr[j])); }, gamma,
                           [&](int64_t j) { return C(to_compute(gr[j])); }, static_cast<C>(eps), h, part,
                           [&](int64_t j, C v) {
                             dxr[j] = ar ? from_compute<T>(to_compute(ar[j]) + to_compute(from_compute<T>(v)))
                                         : from_compute<T>(v);
                           });
  });
}

// layernorm_dgamma's blocks: block b adds g * xhat of rows b, b + kDgammaBlocks, ... into its own
// partial row part[b, 0:h] (each thread its columns), in the compute type.
constexpr int kDgammaBlocks = 128;
constexpr int kDgammaSite = -2;  // the scratch() site of the partials (runtime sites are >= 0)

template <class T>
__global__ void layernorm_dgamma_kernel(const T* x, const T* g, compute_t<T>* part, double eps, int64_t rows,
                                        int64_t h) {
  using C = compute_t<T>;
  __shared__ C red[kRowThreads];
  C* mine = part + blockIdx.x * h;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) mine[j] = C(0);
  const auto sum = [&](auto f) {
    C s = 0;
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x) s += f(j);
    return block_sum(red, s);
  };
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const auto xj = [&](int64_t j) { return C(to_compute(x[r * h + j])); };
    C mean, rstd;
    layernorm_stats(xj, static_cast<C>(eps), h, sum, mean, rstd);
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x) mine[j] += C(to_compute(g[r * h + j])) * ((xj(j) - mean) * rstd);
  }
}

// dgamma[j] = the sum over rows of g[r, j] * xhat[r, j] (the rows' statistics as the forward's):
// kDgammaBlocks blocks' partial sums (layernorm_dgamma_kernel), then a thread a column adds them in
// block order (deterministic, no atomics).
template <class T>
void layernorm_dgamma(const T* x, const T* g, T* dgamma, double eps, int64_t rows, int64_t h, const Ctx& c) {
  using C = compute_t<T>;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(rows, kDgammaBlocks));
  C* part = scratch<C>(kDgammaSite, blocks * h);
  if (h > 0) {
    COCONET_ACCESS(COCONET_R(x, 0, rows * h), COCONET_R(g, 0, rows * h), COCONET_W(part, 0, blocks * h));
    void (*kernel)(const T*, const T*, C*, double, int64_t, int64_t) = layernorm_dgamma_kernel<T>;
    COCONET_LAUNCH(kernel, static_cast<unsigned>(blocks), kRowThreads, 0, c.stream, x, g, part, eps, rows, h);
    COCONET_CUDA(cudaGetLastError());
  }
  COCONET_ACCESS(COCONET_R(part, 0, blocks * h), COCONET_W(dgamma, 0, h));
  launch(h, c.stream, [=] __device__(int64_t j) {
    C s = 0;
    for (int64_t b = 0; b < blocks; ++b) s += part[b * h + j];
    dgamma[j] = from_compute<T>(s);
  });
}

// dx[n, c, y, z] = sum over o, p, q of g[n, o, i, j] w[o, c, p, q] where y = i * stride + p - pad
// and z = j * stride + q - pad: one thread per element of dx.
template <class T>
void conv2d_dx(const T* g, const T* w, T* dx, int64_t N, int64_t C, int64_t H, int64_t W, int64_t O, int64_t KH,
               int64_t KW, int64_t HO, int64_t WO, int64_t stride, int64_t pad, const Ctx& c) {
  COCONET_ACCESS(COCONET_R(g, 0, N * O * HO * WO), COCONET_R(w, 0, O * C * KH * KW), COCONET_W(dx, 0, N * C * H * W));
  launch(N * C * H * W, c.stream, [=] __device__(int64_t e) {
    const int64_t z = e % W, y = (e / W) % H, ch = (e / (W * H)) % C, n = e / (W * H * C);
    compute_t<T> acc = 0;
    for (int64_t p = 0; p < KH; ++p) {
      const int64_t ty = y + pad - p;
      if (ty < 0 || ty % stride != 0 || ty / stride >= HO) continue;
      const int64_t i = ty / stride;
      for (int64_t q = 0; q < KW; ++q) {
        const int64_t tz = z + pad - q;
        if (tz < 0 || tz % stride != 0 || tz / stride >= WO) continue;
        const int64_t j = tz / stride;
        for (int64_t o = 0; o < O; ++o)
          acc += to_compute(g[((n * O + o) * HO + i) * WO + j]) * to_compute(w[((o * C + ch) * KH + p) * KW + q]);
      }
    }
    dx[e] = from_compute<T>(acc);
  });
}

// dw[o, c, p, q] = sum over n, i, j of x[n, c, i * stride + p - pad, j * stride + q - pad] g[n, o, i, j]
// (zero padding): one thread per element of dw.
template <class T>
void conv2d_dw(const T* x, const T* g, T* dw, int64_t N, int64_t C, int64_t H, int64_t W, int64_t O, int64_t KH,
               int64_t KW, int64_t HO, int64_t WO, int64_t stride, int64_t pad, const Ctx& c) {
  COCONET_ACCESS(COCONET_R(x, 0, N * C * H * W), COCONET_R(g, 0, N * O * HO * WO), COCONET_W(dw, 0, O * C * KH * KW));
  launch(O * C * KH * KW, c.stream, [=] __device__(int64_t e) {
    const int64_t q = e % KW, p = (e / KW) % KH, ch = (e / (KW * KH)) % C, o = e / (KW * KH * C);
    compute_t<T> acc = 0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < HO; ++i) {
        const int64_t y = i * stride + p - pad;
        if (y < 0 || y >= H) continue;
        for (int64_t j = 0; j < WO; ++j) {
          const int64_t z = j * stride + q - pad;
          if (z < 0 || z >= W) continue;
          acc += to_compute(x[((n * C + ch) * H + y) * W + z]) * to_compute(g[((n * O + o) * HO + i) * WO + j]);
        }
      }
    dw[e] = from_compute<T>(acc);
  });
}

// C[K, N] = A[M, K]^T x B[M, N] as matmul_tn, and db[N] = the sum of B's M rows as sum_lead, in one
// cublasLtMatmul (plan/epilogue.py: a bgrad epilogue, the bias gradient of a derived program):
// column-major it is C^T (N x K) = B^T (N x M) A (M x K), so cuBLASLt's A is B (op N), its B is A
// (op T), its k is M, and CUBLASLT_EPILOGUE_BGRADA sums its A over k: one value per row of its D,
// N of them, the column sums of the row-major B. Where cuBLASLt has no such GEMM (a status other
// than success: the BGRAD epilogues are not offered for every type and transpose), or a size is 0,
// matmul_tn then sum_lead, the unfused pair. accumulate: C += the product (beta = 1; db written
// whole): a weight's gradient added into its accumulator (Library.accumulate).
template <class T>
void matmul_tn_bgrad(const T* A, const T* B, T* C, int64_t M, int64_t K, int64_t N, T* db, const Ctx& c,
                     bool accumulate = false) {
  static_assert(!std::is_same<T, double>::value, "matmul_tn_bgrad: f32, f16 or bf16 (plan/epilogue.py)");
  cublasStatus_t st = CUBLAS_STATUS_NOT_SUPPORTED;
  if (M > 0 && K > 0 && N > 0) {
    const cudaDataType_t t = BlasType<T>::t;
    cublasLtMatmulDesc_t op;
    COCONET_CUDA(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t tb = CUBLAS_OP_T;
    COCONET_CUDA(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    const cublasLtEpilogue_t e = CUBLASLT_EPILOGUE_BGRADA;
    COCONET_CUDA(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof(e)));
    COCONET_CUDA(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &db, sizeof(db)));
    cublasLtMatrixLayout_t la, lb, ld;  // cuBLASLt's A = B^T (N x M), B = A stored K x M (op T), D = C^T (N x K)
    COCONET_CUDA(cublasLtMatrixLayoutCreate(&la, t, uint64_t(N), uint64_t(M), int64_t(N)));
    COCONET_CUDA(cublasLtMatrixLayoutCreate(&lb, t, uint64_t(K), uint64_t(M), int64_t(K)));
    COCONET_CUDA(cublasLtMatrixLayoutCreate(&ld, t, uint64_t(N), uint64_t(K), int64_t(N)));
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    st = cublasLtMatmul(blas_lt(), op, &alpha, B, la, A, lb, &beta, C, ld, C, ld, nullptr, lt_workspace(), kLtWorkspace,
                        c.stream);
    COCONET_CUDA(cublasLtMatrixLayoutDestroy(ld));
    COCONET_CUDA(cublasLtMatrixLayoutDestroy(lb));
    COCONET_CUDA(cublasLtMatrixLayoutDestroy(la));
    COCONET_CUDA(cublasLtMatmulDescDestroy(op));
  }
  if (st != CUBLAS_STATUS_SUCCESS) {
    sum_lead<T>(B, db, M, N, c);
    if (accumulate)
      matmul_tn_acc<T>(A, B, C, M, K, N, c.stream);
    else
      matmul_tn<T>(A, B, C, M, K, N, c.stream);
  }
}

// A pointwise loop that also adds up the column sums of one of its values (plan/colsums.py,
// Loop.colsums): f(i, col) computes element i = row * cols + col (storing what the loop stores)
// and returns the value whose column sums go to out[cols]. Block b takes the rows [b rb, (b+1) rb),
// its threads striding the columns (a warp: 32 adjacent elements of a row, coalesced), each adding
// its columns' values over the block's rows in the compute type C; part[b, col] (scratch) is
// written once, then a thread a column adds the blocks' parts in block order (deterministic, no
// atomics). The caller has declared the loop's accesses (COCONET_ACCESS): the partial sums are
// added to them.
constexpr int kColSumBlocks = 256;
constexpr int kColSumSite = -3;  // the scratch() site of the partial sums (runtime sites are >= 0)

template <class C, class F>
__global__ void colsum_rows_kernel(int64_t rows, int64_t cols, int64_t rb, C* part, F f) {
  const int64_t r0 = int64_t(blockIdx.x) * rb, r1 = r0 + rb < rows ? r0 + rb : rows;
  for (int64_t col = threadIdx.x; col < cols; col += blockDim.x) {
    C acc = 0;
    for (int64_t row = r0; row < r1; ++row) acc += f(row * cols + col, col);
    part[int64_t(blockIdx.x) * cols + col] = acc;
  }
}

template <class C, class T, class F>
void colsum_rows(int64_t rows, int64_t cols, T* out, cudaStream_t s, F f) {
  if (cols <= 0) {
    COCONET_ACCESS();  // (emulation) no kernel: its declared ranges go with it
    return;
  }
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(rows, kColSumBlocks));
  const int64_t rb = (rows + blocks - 1) / blocks;
  C* part = scratch<C>(kColSumSite, blocks * cols);
  COCONET_ACCESS_ALSO(COCONET_W(part, 0, blocks * cols));
  void (*kernel)(int64_t, int64_t, int64_t, C*, F) = colsum_rows_kernel<C, F>;
  COCONET_LAUNCH(kernel, static_cast<unsigned>(blocks), kRowThreads, 0, s, rows, cols, rb, part, f);
  COCONET_CUDA(cudaGetLastError());
  COCONET_ACCESS(COCONET_R(part, 0, blocks * cols), COCONET_W(out, 0, cols));
  launch(cols, s, [=] __device__(int64_t col) {
    C t = 0;
    for (int64_t b = 0; b < blocks; ++b) t += part[b * cols + col];
    out[col] = from_compute<T>(t);
  });
}

}  // namespace cuda
}  // namespace coconet
