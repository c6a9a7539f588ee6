// LayerNorm(x + residual) * weight + bias, forward and backward; the bias may be absent (ModernBERT's
// LayerNorms have none).
//
// Design:
// - One warp per row. Statistics are fp32 and two-pass (mean, then the mean of squared
//   deviations), which is exact enough at eps = 1e-12 where E[x^2] - mean^2 is not.
// - Fast path for hidden 768 and 1024 (BERT-Base/Large) with 16-byte-aligned tensors:
//   each lane holds its 24 or 32 values in registers, read with 16-byte loads, so
//   the row is read once. Any other size (or alignment) takes the general path: scalar,
//   strided by lane, re-reading the row from L1/L2 between passes.
// - The forward saves mean and rstd (fp32, per row); the backward recomputes
//   xhat = (x + residual - mean) * rstd from the inputs rather than saving the sum,
//   which costs the same traffic and keeps no extra activation alive.
// - dweight/dbias are summed in fp32 in two stages, as apex's fast_layer_norm does: on the
//   register path a lane keeps its columns' sums in registers over every row its warp visits
//   (grid-stride), and the CTA adds its warps' sums in shared memory, in warp order, into its one
//   row [dweight | dbias] of a workspace (common.cuh: block_column_sum); on the general path
//   every warp accumulates its rows into a workspace row of its own. Then one column_sum reduces
//   the workspace into both outputs. No atomics, so the result is deterministic. A row per CTA
//   rather than per warp is a quarter of the partial sums to write and read back (at BERT-Base on
//   an H100: 396 rows, 2.4 MB each way, where there were 1,584, 9.7 MB, beside the 101 MB of dy,
//   x, residual and dx the pass must move).
// - Without a bias (a null bias pointer forward, a null dbias backward) nothing reads a bias, and
//   the workspace rows are [dweight] alone: no bias gradient is written, nor summed by column_sum.
//   The register path still adds up its lanes' dbias (a register add per element beside the row's
//   loads) rather than take a second instantiation of the kernel.
// - Grids are one wave: every kernel strides over the rows, and the launchers launch as
//   many blocks as the device holds at once (the occupancy API), never more. A fixed
//   multiple of the SM count left a tail: 4 blocks per SM where 2-3 fit.
// - The residual and the weights may be fp32 with fp16/bf16 input (autocast over fp32
//   parameters feeds the first layer an fp32 residual). The gradient is written in the
//   input's dtype, and also in the residual's when a dresidual buffer is passed, so an
//   fp32 residual keeps an fp32 gradient as it would in the reference.
#include "common.cuh"

namespace bds {
namespace {

constexpr int kWarpsPerBlock = kRowWarpsPerBlock;  // one row per warp, 4 rows in flight per block
constexpr int kThreads = kRowThreads;

// ---------------------------------------------------------------- forward

// The minimum CTAs per SM set the register budget ptxas works to: 6 (80 registers) for
// 16-bit rows, 4 (128) for fp32 rows, which hold twice the values; both hold the row
// without spilling. Left to itself ptxas kept bf16 hidden 1024 in 64 registers with a
// spill on sm_90 once the kernel strides over rows. Each warp has its whole row of loads
// in flight, so 16-28 warps per SM still cover the memory latency.
template <typename T, typename RT, typename WT, int H>
__global__ void __launch_bounds__(kThreads, sizeof(T) == 2 ? 6 : 4)
ln_fwd_registers(const T* __restrict__ x, const RT* __restrict__ residual, const WT* __restrict__ weight,
                 const WT* __restrict__ bias, T* __restrict__ y, float* __restrict__ mean_out,
                 float* __restrict__ rstd_out, int64_t rows, float eps) {
  constexpr int kVec = 16 / sizeof(T);         // elements per 16-byte access
  constexpr int kPerLane = H / (32 * kVec);    // accesses per lane
  static_assert(H % (32 * kVec) == 0, "the register path needs hidden % (32 * vector width) == 0");
  const int lane = threadIdx.x % 32;
  // Grid-stride over rows: the launcher sizes the grid to one wave of resident blocks.
  // (The stride is re-read from gridDim rather than held: one register less.)
  for (int64_t row = (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / 32; row < rows;
       row += (int64_t)gridDim.x * kWarpsPerBlock) {
    const int64_t offset = row * H;

    // Access i of lane l covers columns (32 i + l) * kVec ..: the warp reads 512
    // contiguous bytes per access.
    float v[kPerLane][kVec];
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int col = (i * 32 + lane) * kVec;
      load_floats(x + offset + col, v[i]);
      if (residual != nullptr) {
        float r[kVec];
        load_floats(residual + offset + col, r);
#pragma unroll
        for (int j = 0; j < kVec; ++j) v[i][j] += r[j];
      }
#pragma unroll
      for (int j = 0; j < kVec; ++j) sum += v[i][j];
    }
    const float mean = warp_sum(sum) * (1.f / H);
    float squares = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
#pragma unroll
      for (int j = 0; j < kVec; ++j) squares += (v[i][j] - mean) * (v[i][j] - mean);
    const float rstd = rsqrtf(warp_sum(squares) * (1.f / H) + eps);

#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int col = (i * 32 + lane) * kVec;
      float w[kVec], b[kVec] = {}, out[kVec];
      load_floats(weight + col, w);
      if (bias != nullptr) load_floats(bias + col, b);
#pragma unroll
      for (int j = 0; j < kVec; ++j) out[j] = (v[i][j] - mean) * rstd * w[j] + b[j];
      store_floats(y + offset + col, out);
    }
    if (lane == 0) {
      mean_out[row] = mean;
      rstd_out[row] = rstd;
    }
  }
}

template <typename T, typename RT, typename WT>
__global__ void __launch_bounds__(kThreads)
ln_fwd_general(const T* __restrict__ x, const RT* __restrict__ residual, const WT* __restrict__ weight,
               const WT* __restrict__ bias, T* __restrict__ y, float* __restrict__ mean_out,
               float* __restrict__ rstd_out, int64_t rows, int hidden, float eps) {
  const int lane = threadIdx.x % 32;
  // Grid-stride over rows: the launcher sizes the grid to one wave of resident blocks.
  // (The stride is re-read from gridDim rather than held: one register less.)
  for (int64_t row = (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / 32; row < rows;
       row += (int64_t)gridDim.x * kWarpsPerBlock) {
    const T* xr = x + row * hidden;
    const RT* rr = residual == nullptr ? nullptr : residual + row * hidden;
    auto value = [&](int j) { return rr == nullptr ? to_float(xr[j]) : to_float(xr[j]) + to_float(rr[j]); };

    float sum = 0.f;
    for (int j = lane; j < hidden; j += 32) sum += value(j);
    const float mean = warp_sum(sum) / hidden;
    float squares = 0.f;
    for (int j = lane; j < hidden; j += 32) {
      const float d = value(j) - mean;
      squares += d * d;
    }
    const float rstd = rsqrtf(warp_sum(squares) / hidden + eps);
    T* yr = y + row * hidden;
    for (int j = lane; j < hidden; j += 32) {
      const float b = bias == nullptr ? 0.f : to_float(bias[j]);
      yr[j] = from_float<T>((value(j) - mean) * rstd * to_float(weight[j]) + b);
    }
    if (lane == 0) {
      mean_out[row] = mean;
      rstd_out[row] = rstd;
    }
  }
}

// ---------------------------------------------------------------- backward
//
// With xhat = (h - mean) * rstd, g = weight * dy and means over the row:
//   dh = rstd * (g - mean(g) - xhat * mean(g * xhat)),   dweight = sum_rows dy * xhat,
//   dbias = sum_rows dy.   dh is the gradient of both x and residual. with_bias false: no dbias
//   in the workspace (its rows are [dweight] alone).

template <typename T, typename RT, typename WT, int H>
__global__ void __launch_bounds__(kThreads)
ln_bwd_registers(const T* __restrict__ dy, const T* __restrict__ x, const RT* __restrict__ residual,
                 const WT* __restrict__ weight, const float* __restrict__ mean, const float* __restrict__ rstd,
                 T* __restrict__ dx, RT* __restrict__ dresidual, float* __restrict__ parts, int64_t rows,
                 bool with_bias) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kPerLane = H / (32 * kVec);
  static_assert(H % (32 * kVec) == 0, "the register path needs hidden % (32 * vector width) == 0");
  const int lane = threadIdx.x % 32;
  const int warp = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  const int num_warps = gridDim.x * kWarpsPerBlock;

  // This lane's columns of dweight and dbias, summed over the warp's rows (grid-stride).
  float dw[kPerLane][kVec] = {};
  float db[kPerLane][kVec] = {};
  for (int64_t row = warp; row < rows; row += num_warps) {
    const int64_t offset = row * H;
    const float mu = mean[row], rs = rstd[row];
    float xhat[kPerLane][kVec], g[kPerLane][kVec];
    float sum_g = 0.f, sum_g_xhat = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int col = (i * 32 + lane) * kVec;
      float d[kVec], w[kVec];
      load_floats(x + offset + col, xhat[i]);
      if (residual != nullptr) {
        float r[kVec];
        load_floats(residual + offset + col, r);
#pragma unroll
        for (int j = 0; j < kVec; ++j) xhat[i][j] += r[j];
      }
      load_floats(dy + offset + col, d);
      load_floats(weight + col, w);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        xhat[i][j] = (xhat[i][j] - mu) * rs;
        dw[i][j] += d[j] * xhat[i][j];
        db[i][j] += d[j];
        g[i][j] = w[j] * d[j];
        sum_g += g[i][j];
        sum_g_xhat += g[i][j] * xhat[i][j];
      }
    }
    const float mean_g = warp_sum(sum_g) * (1.f / H);
    const float mean_g_xhat = warp_sum(sum_g_xhat) * (1.f / H);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int col = (i * 32 + lane) * kVec;
      float out[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) out[j] = rs * (g[i][j] - mean_g - xhat[i][j] * mean_g_xhat);
      store_floats(dx + offset + col, out);
      if (dresidual != nullptr) store_floats(dresidual + offset + col, out);
    }
  }
  // The CTA's row of the workspace, zeros included (a CTA with no rows), so the column sum needs
  // no memset.
  __shared__ __align__(16) float stage[kWarpsPerBlock][H];
  float* own = parts + (int64_t)blockIdx.x * (with_bias ? 2 : 1) * H;
  block_column_sum(stage, dw, own);
  if (with_bias) block_column_sum(stage, db, own + H);  // with_bias is the whole grid's: no divergent barrier
}

template <typename T, typename RT, typename WT>
__global__ void __launch_bounds__(kThreads)
ln_bwd_general(const T* __restrict__ dy, const T* __restrict__ x, const RT* __restrict__ residual,
               const WT* __restrict__ weight, const float* __restrict__ mean, const float* __restrict__ rstd,
               T* __restrict__ dx, RT* __restrict__ dresidual, float* __restrict__ parts, int64_t rows,
               int hidden, bool with_bias) {
  const int lane = threadIdx.x % 32;
  const int warp = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  const int num_warps = gridDim.x * kWarpsPerBlock;
  // The warp's own workspace row [dweight | dbias] ([dweight] without a bias); lane l only ever
  // touches columns l, l + 32, ...
  const int grads = with_bias ? 2 : 1;
  float* dwp = parts + (int64_t)(grads * warp) * hidden;
  float* dbp = parts + (int64_t)(grads * warp + 1) * hidden;  // (as dwp + hidden, ptxas spilled 4-8 bytes)
  for (int j = lane; j < hidden; j += 32) {
    dwp[j] = 0.f;
    if (with_bias) dbp[j] = 0.f;
  }
  for (int64_t row = warp; row < rows; row += num_warps) {
    const int64_t offset = row * hidden;
    const float mu = mean[row], rs = rstd[row];
    auto xhat_at = [&](int j) {
      const float h = residual == nullptr ? to_float(x[offset + j])
                                          : to_float(x[offset + j]) + to_float(residual[offset + j]);
      return (h - mu) * rs;
    };
    float sum_g = 0.f, sum_g_xhat = 0.f;
    for (int j = lane; j < hidden; j += 32) {
      const float g = to_float(weight[j]) * to_float(dy[offset + j]);
      sum_g += g;
      sum_g_xhat += g * xhat_at(j);
    }
    const float mean_g = warp_sum(sum_g) / hidden;
    const float mean_g_xhat = warp_sum(sum_g_xhat) / hidden;
    for (int j = lane; j < hidden; j += 32) {
      const float d = to_float(dy[offset + j]);
      const float xhat = xhat_at(j);
      const float dh = rs * (to_float(weight[j]) * d - mean_g - xhat * mean_g_xhat);
      dx[offset + j] = from_float<T>(dh);
      if (dresidual != nullptr) dresidual[offset + j] = from_float<RT>(dh);
      dwp[j] += d * xhat;
      if (with_bias) dbp[j] += d;
    }
  }
}

// ---------------------------------------------------------------- launch

template <typename T, typename RT, typename WT>
int fwd_blocks(int64_t rows, int hidden, bool fast) {
  if (fast && hidden == 768) return one_wave_of_rows<ln_fwd_registers<T, RT, WT, 768>>(rows);
  if (fast && hidden == 1024) return one_wave_of_rows<ln_fwd_registers<T, RT, WT, 1024>>(rows);
  return one_wave_of_rows<ln_fwd_general<T, RT, WT>>(rows);
}

// The backward's CTAs sum the rows they visit into their workspace rows, so one wave
// also keeps the workspace and its column sum as small as a full device allows.
template <typename T, typename RT, typename WT>
int bwd_blocks(int64_t rows, int hidden, bool fast) {
  if (fast && hidden == 768) return one_wave_of_rows<ln_bwd_registers<T, RT, WT, 768>>(rows);
  if (fast && hidden == 1024) return one_wave_of_rows<ln_bwd_registers<T, RT, WT, 1024>>(rows);
  return one_wave_of_rows<ln_bwd_general<T, RT, WT>>(rows);
}

// Workspace rows a backward block writes: one per CTA on the register path, one per warp on the
// general path.
int bwd_rows_per_block(int hidden, bool fast) { return fast && register_row_size(hidden) ? 1 : kWarpsPerBlock; }

}  // namespace
}  // namespace bds

using namespace bds;

extern "C" cudaError_t bds_layer_norm_fwd(const void* x, const void* residual, const void* weight, const void* bias,
                                          void* y, float* mean, float* rstd, int64_t rows, int hidden, float eps,
                                          int dtype, int residual_dtype, int weight_dtype, cudaStream_t stream) {
  if (hidden <= 0 || rows < 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const bool fast = register_row_path(hidden, {x, residual, weight, bias, y});
  if (residual == nullptr) residual_dtype = dtype;  // no residual: no extra instantiation
  return with_row_dtypes(dtype, residual_dtype, weight_dtype, [&](auto t, auto rt, auto wt) -> cudaError_t {
    using T = decltype(t);
    using RT = decltype(rt);
    using WT = decltype(wt);
    const auto* xs = static_cast<const T*>(x);
    const auto* rs = static_cast<const RT*>(residual);
    const auto* ws = static_cast<const WT*>(weight);
    const auto* bs = static_cast<const WT*>(bias);
    auto* ys = static_cast<T*>(y);
    const dim3 grid(fwd_blocks<T, RT, WT>(rows, hidden, fast));
    if (fast && hidden == 768) {
      ln_fwd_registers<T, RT, WT, 768><<<grid, kThreads, 0, stream>>>(xs, rs, ws, bs, ys, mean, rstd, rows, eps);
    } else if (fast && hidden == 1024) {
      ln_fwd_registers<T, RT, WT, 1024><<<grid, kThreads, 0, stream>>>(xs, rs, ws, bs, ys, mean, rstd, rows, eps);
    } else {
      ln_fwd_general<T, RT, WT><<<grid, kThreads, 0, stream>>>(xs, rs, ws, bs, ys, mean, rstd, rows, hidden, eps);
    }
    return cudaGetLastError();
  });
}

extern "C" int bds_layer_norm_bwd_parts(int64_t rows, int hidden) {
  // Asked before the dtypes and pointers are known: the most workspace rows any dtype
  // combination writes at this size with aligned tensors (at least a block's warps). A
  // misaligned call's general kernel runs within the same workspace (the launcher caps its grid
  // at `parts`).
  const bool fast = register_row_size(hidden);
  int blocks = 1;
  for (const int dtype : {BDS_FLOAT32, BDS_FLOAT16, BDS_BFLOAT16}) {
    for (const int residual_dtype : {dtype, (int)BDS_FLOAT32}) {
      for (const int weight_dtype : {dtype, (int)BDS_FLOAT32}) {
        with_row_dtypes(dtype, residual_dtype, weight_dtype, [&](auto t, auto rt, auto wt) -> cudaError_t {
          const int b = bwd_blocks<decltype(t), decltype(rt), decltype(wt)>(rows, hidden, fast);
          blocks = b > blocks ? b : blocks;
          return cudaSuccess;
        });
      }
    }
  }
  const int parts = blocks * bwd_rows_per_block(hidden, fast);
  return parts > kWarpsPerBlock ? parts : kWarpsPerBlock;
}

extern "C" cudaError_t bds_layer_norm_bwd(const void* dy, const void* x, const void* residual, const void* weight,
                                          const float* mean, const float* rstd, void* dx, void* dresidual,
                                          void* dweight, void* dbias, float* workspace, int parts, int64_t rows,
                                          int hidden,
                                          int dtype, int residual_dtype, int weight_dtype, cudaStream_t stream) {
  if (hidden <= 0 || rows < 0 || parts < kWarpsPerBlock) return cudaErrorInvalidValue;
  const bool fast = register_row_path(hidden, {dy, x, residual, weight, dx, dresidual, workspace});
  const bool with_bias = dbias != nullptr;
  if (residual == nullptr) residual_dtype = dtype;
  return with_row_dtypes(dtype, residual_dtype, weight_dtype, [&](auto t, auto rt, auto wt) -> cudaError_t {
    using T = decltype(t);
    using RT = decltype(rt);
    using WT = decltype(wt);
    const auto* dys = static_cast<const T*>(dy);
    const auto* xs = static_cast<const T*>(x);
    const auto* rs = static_cast<const RT*>(residual);
    const auto* ws = static_cast<const WT*>(weight);
    auto* dxs = static_cast<T*>(dx);
    auto* drs = static_cast<RT*>(dresidual);
    const int blocks = bwd_blocks<T, RT, WT>(rows, hidden, fast);
    const int rows_per_block = bwd_rows_per_block(hidden, fast);
    const dim3 grid(blocks < parts / rows_per_block ? blocks : parts / rows_per_block);
    if (fast && hidden == 768) {
      ln_bwd_registers<T, RT, WT, 768><<<grid, kThreads, 0, stream>>>(dys, xs, rs, ws, mean, rstd, dxs, drs,
                                                                  workspace, rows, with_bias);
    } else if (fast && hidden == 1024) {
      ln_bwd_registers<T, RT, WT, 1024><<<grid, kThreads, 0, stream>>>(dys, xs, rs, ws, mean, rstd, dxs, drs,
                                                                   workspace, rows, with_bias);
    } else {
      ln_bwd_general<T, RT, WT><<<grid, kThreads, 0, stream>>>(dys, xs, rs, ws, mean, rstd, dxs, drs, workspace,
                                                           rows, hidden, with_bias);
    }
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    // Only the launched blocks' rows hold partial sums; [dweight | dbias] in one pass.
    const int written = (int)grid.x * rows_per_block;
    if (!with_bias) return column_sum(workspace, written, hidden, static_cast<WT*>(dweight), stream);
    return column_sum(workspace, written, 2 * hidden, hidden, static_cast<WT*>(dweight), static_cast<WT*>(dbias),
                      stream);
  });
}
