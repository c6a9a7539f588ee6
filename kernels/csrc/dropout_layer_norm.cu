// LayerNorm(dropout(x + bias) + residual) * weight + ln_bias, forward and backward: the end
// of every post-LN BERT sublayer, LayerNorm(dropout(dense(h) + bias) + h_in), with the GEMM
// run without its bias.
//
// Design:
// - The layout of layer_norm.cu: one warp per row, fp32 two-pass statistics, a register path
//   for hidden 768 and 1024 with 16-byte-aligned tensors (a lane holds its 24 or 32 values,
//   read with 16-byte loads) and a scalar, lane-strided general path for any other size; the
//   kernels stride over rows in one wave of resident blocks (common.cuh: one_wave_of_rows).
// - The forward is one kernel: bias add, dropout, residual add, statistics, normalise, affine.
//   It saves mean and rstd (fp32, per row) and nothing else: the backward recomputes
//   h = dropout(x + bias) + residual from x, bias and residual, as layer_norm.cu recomputes
//   x + residual (the same traffic as saving h, and no extra activation kept alive).
// - The dropout mask is never stored. Element e of the (rows, hidden) tensor is kept by word
//   e % 4 of Philox4x32-10(seed; offset / 4, e / 4) (common.cuh: Dropout), so the backward
//   regenerates it from (seed, offset). The register path draws one Philox block per 4 elements
//   of its vectors and keeps the row's decisions in one 32-bit mask; the general path draws a
//   block per element visited (three times in the forward, twice in the backward): it is the
//   path of sizes BERT does not use.
// - p = 0 (evaluation, or dropout off) takes a branch without Philox or scaling:
//   exactly LayerNorm(x + bias + residual), summed in that order.
// - The backward is one kernel and one column sum, apex's fast_layer_norm backward in shape.
//   Per row it gives dh = d(h) (the gradient of the residual), dx = dh * keep / (1 - p), and
//   accumulates per column dweight = sum dy * xhat, dln_bias = sum dy and dbias = sum dx (fp32,
//   the unrounded dx): the bias gradient comes out of the same pass, with no separate reduction
//   over dx. A lane keeps its columns' three sums in registers over every row its warp visits
//   (a CTA of the one-wave grid visits rows / grid of them: about 40 at BERT-Base's 16,384 rows
//   on an H100), and at the end the CTA adds its 4 warps' sums in shared memory, in warp order
//   (common.cuh: block_column_sum), into its one row of an fp32 workspace
//   [dweight | dln_bias | dbias] (3 * hidden wide). A second kernel (column_sum) adds the rows
//   into the (3, hidden) output. No atomics: deterministic. The workspace has a row per CTA, not
//   per warp: at BERT-Base in bf16 on an H100, 396 rows (3.6 MB written and read back) where it
//   had 1,584 (14.6 MB each way, beside the 126 MB of dy, x, residual, dx and dresidual the pass
//   must move), and the column sum adds 12 or 13 rows per thread instead of 50. The general path
//   keeps a workspace row per warp: it accumulates in that row in global memory as it goes.
// - dtypes as layer_norm.cu: x (and y, dx) fp32, fp16 or bf16; the residual (and dresidual) x's
//   dtype or fp32; weight, ln_bias and bias one dtype, x's or fp32 (autocast over fp32
//   parameters gives a bf16 GEMM output with fp32 biases and weights).
#include "common.cuh"

namespace bds {
namespace {

constexpr int kWarpsPerBlock = kRowWarpsPerBlock;
constexpr int kThreads = kRowThreads;

// ---------------------------------------------------------------- forward

// The minimum CTAs per SM set the register budget: 5 (96 registers) for 16-bit rows, 4 (128) for
// fp32 rows, which hold twice the values. ln_fwd_registers fits 16-bit rows in 80 (6 CTAs); the
// bias vector and a Philox block in flight spilled 4-16 bytes there with hidden 1024 and fp32
// weights (sm_80 and sm_90, nvcc 13.0).
template <typename T, typename RT, typename WT, int H>
__global__ void __launch_bounds__(kThreads, sizeof(T) == 2 ? 5 : 4)
dln_fwd_registers(const T* __restrict__ x, const WT* __restrict__ bias, const RT* __restrict__ residual,
                  const WT* __restrict__ weight, const WT* __restrict__ ln_bias, T* __restrict__ y,
                  float* __restrict__ mean_out, float* __restrict__ rstd_out, uint8_t* __restrict__ keep_out,
                  int64_t rows, float eps, Dropout dropout) {
  constexpr int kVec = 16 / sizeof(T);         // elements per 16-byte access
  constexpr int kPerLane = H / (32 * kVec);    // accesses per lane
  static_assert(H % (32 * kVec) == 0, "the register path needs hidden % (32 * vector width) == 0");
  static_assert(kPerLane * kVec <= 32, "a lane's keep decisions fit one 32-bit mask");
  const int lane = threadIdx.x % 32;
  for (int64_t row = (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / 32; row < rows;
       row += (int64_t)gridDim.x * kWarpsPerBlock) {
    const int64_t offset = row * H;

    // Access i of lane l covers columns (32 i + l) * kVec ..: 512 contiguous bytes per warp access.
    float v[kPerLane][kVec];
    uint32_t kept = dropout.enabled ? 0u : ~0u;  // bit i * kVec + j: element j of access i survives dropout
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int col = (i * 32 + lane) * kVec;
      load_floats(x + offset + col, v[i]);
      if (bias != nullptr) {
        float b[kVec];
        load_floats(bias + col, b);
#pragma unroll
        for (int j = 0; j < kVec; ++j) v[i][j] += b[j];
      }
      if (dropout.enabled) {
        const uint32_t bits = dropout.keep_bits<kVec>(offset + col);
        kept |= bits << (i * kVec);
#pragma unroll
        for (int j = 0; j < kVec; ++j) v[i][j] = (bits >> j) & 1u ? v[i][j] * dropout.scale : 0.f;
      }
      float r[kVec];
      load_floats(residual + offset + col, r);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        v[i][j] += r[j];
        sum += v[i][j];
      }
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
      float w[kVec], b[kVec], out[kVec];
      load_floats(weight + col, w);
      load_floats(ln_bias + col, b);
#pragma unroll
      for (int j = 0; j < kVec; ++j) out[j] = (v[i][j] - mean) * rstd * w[j] + b[j];
      store_floats(y + offset + col, out);
      if (keep_out != nullptr) {  // tests' view of the mask: one byte per element
#pragma unroll
        for (int j = 0; j < kVec; ++j) keep_out[offset + col + j] = (kept >> (i * kVec + j)) & 1u;
      }
    }
    if (lane == 0) {
      mean_out[row] = mean;
      rstd_out[row] = rstd;
    }
  }
}

template <typename T, typename RT, typename WT>
__global__ void __launch_bounds__(kThreads)
dln_fwd_general(const T* __restrict__ x, const WT* __restrict__ bias, const RT* __restrict__ residual,
                const WT* __restrict__ weight, const WT* __restrict__ ln_bias, T* __restrict__ y,
                float* __restrict__ mean_out, float* __restrict__ rstd_out, uint8_t* __restrict__ keep_out,
                int64_t rows, int hidden, float eps, Dropout dropout) {
  const int lane = threadIdx.x % 32;
  for (int64_t row = (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / 32; row < rows;
       row += (int64_t)gridDim.x * kWarpsPerBlock) {
    const int64_t offset = row * hidden;
    // h at column j: the row is read again (from L1/L2) in each of the three passes
    auto value = [&](int j) {
      float v = to_float(x[offset + j]);
      if (bias != nullptr) v += to_float(bias[j]);
      if (dropout.enabled) v = dropout.keep(offset + j) ? v * dropout.scale : 0.f;
      return v + to_float(residual[offset + j]);
    };

    float sum = 0.f;
    for (int j = lane; j < hidden; j += 32) sum += value(j);
    const float mean = warp_sum(sum) / hidden;
    float squares = 0.f;
    for (int j = lane; j < hidden; j += 32) {
      const float d = value(j) - mean;
      squares += d * d;
    }
    const float rstd = rsqrtf(warp_sum(squares) / hidden + eps);
    T* yr = y + offset;
    for (int j = lane; j < hidden; j += 32) {
      yr[j] = from_float<T>((value(j) - mean) * rstd * to_float(weight[j]) + to_float(ln_bias[j]));
      if (keep_out != nullptr) keep_out[offset + j] = dropout.enabled ? dropout.keep(offset + j) : 1;
    }
    if (lane == 0) {
      mean_out[row] = mean;
      rstd_out[row] = rstd;
    }
  }
}

// ---------------------------------------------------------------- backward
//
// With h = dropout(x + bias) + residual, xhat = (h - mean) * rstd, g = weight * dy and means over
// the row: dh = rstd * (g - mean(g) - xhat * mean(g * xhat)) is the gradient of the residual;
// dx = dh * keep / (1 - p); dweight = sum_rows dy * xhat, dln_bias = sum_rows dy, dbias = sum_rows dx.

template <typename T, typename RT, typename WT, int H>
__global__ void __launch_bounds__(kThreads)
dln_bwd_registers(const T* __restrict__ dy, const T* __restrict__ x, const WT* __restrict__ bias,
                  const RT* __restrict__ residual, const WT* __restrict__ weight, const float* __restrict__ mean,
                  const float* __restrict__ rstd, T* __restrict__ dx, RT* __restrict__ dresidual,
                  float* __restrict__ parts, int64_t rows, Dropout dropout) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kPerLane = H / (32 * kVec);
  static_assert(H % (32 * kVec) == 0, "the register path needs hidden % (32 * vector width) == 0");
  const int lane = threadIdx.x % 32;
  const int warp = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  const int num_warps = gridDim.x * kWarpsPerBlock;

  // This lane's columns of dweight, dln_bias and dbias, summed over the warp's rows (grid-stride).
  float dw[kPerLane][kVec] = {};
  float dlb[kPerLane][kVec] = {};
  float db[kPerLane][kVec] = {};
  for (int64_t row = warp; row < rows; row += num_warps) {
    const int64_t offset = row * H;
    const float mu = mean[row], rs = rstd[row];
    float xhat[kPerLane][kVec], g[kPerLane][kVec];
    uint32_t kept = dropout.enabled ? 0u : ~0u;  // the forward's decisions, regenerated: bit i * kVec + j
    float sum_g = 0.f, sum_g_xhat = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int col = (i * 32 + lane) * kVec;
      float d[kVec], w[kVec], r[kVec];
      load_floats(x + offset + col, xhat[i]);
      if (bias != nullptr) {
        float b[kVec];
        load_floats(bias + col, b);
#pragma unroll
        for (int j = 0; j < kVec; ++j) xhat[i][j] += b[j];
      }
      if (dropout.enabled) {
        const uint32_t bits = dropout.keep_bits<kVec>(offset + col);
        kept |= bits << (i * kVec);
#pragma unroll
        for (int j = 0; j < kVec; ++j) xhat[i][j] = (bits >> j) & 1u ? xhat[i][j] * dropout.scale : 0.f;
      }
      load_floats(residual + offset + col, r);
      load_floats(dy + offset + col, d);
      load_floats(weight + col, w);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        xhat[i][j] = (xhat[i][j] + r[j] - mu) * rs;
        dw[i][j] += d[j] * xhat[i][j];
        dlb[i][j] += d[j];
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
      store_floats(dresidual + offset + col, out);
      if (dropout.enabled) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) out[j] = (kept >> (i * kVec + j)) & 1u ? out[j] * dropout.scale : 0.f;
      }
#pragma unroll
      for (int j = 0; j < kVec; ++j) db[i][j] += out[j];
      store_floats(dx + offset + col, out);
    }
  }
  // The CTA's row of the workspace, zeros included (a CTA with no rows), so the column sum needs
  // no memset.
  __shared__ __align__(16) float stage[kWarpsPerBlock][H];
  float* own = parts + (int64_t)blockIdx.x * 3 * H;
  block_column_sum(stage, dw, own);
  block_column_sum(stage, dlb, own + H);
  block_column_sum(stage, db, own + 2 * H);
}

template <typename T, typename RT, typename WT>
__global__ void __launch_bounds__(kThreads)
dln_bwd_general(const T* __restrict__ dy, const T* __restrict__ x, const WT* __restrict__ bias,
                const RT* __restrict__ residual, const WT* __restrict__ weight, const float* __restrict__ mean,
                const float* __restrict__ rstd, T* __restrict__ dx, RT* __restrict__ dresidual,
                float* __restrict__ parts, int64_t rows, int hidden, Dropout dropout) {
  const int lane = threadIdx.x % 32;
  const int warp = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  const int num_warps = gridDim.x * kWarpsPerBlock;
  // The warp's own workspace row; lane l only ever touches columns l, l + 32, ... of each third.
  float* dwp = parts + (int64_t)warp * 3 * hidden;
  float* dlbp = dwp + hidden;
  float* dbp = dwp + 2 * hidden;
  for (int j = lane; j < hidden; j += 32) {
    dwp[j] = 0.f;
    dlbp[j] = 0.f;
    dbp[j] = 0.f;
  }
  for (int64_t row = warp; row < rows; row += num_warps) {
    const int64_t offset = row * hidden;
    const float mu = mean[row], rs = rstd[row];
    auto xhat_at = [&](int j, bool kept) {
      float h = to_float(x[offset + j]);
      if (bias != nullptr) h += to_float(bias[j]);
      if (dropout.enabled) h = kept ? h * dropout.scale : 0.f;
      return (h + to_float(residual[offset + j]) - mu) * rs;
    };
    float sum_g = 0.f, sum_g_xhat = 0.f;
    for (int j = lane; j < hidden; j += 32) {
      const bool kept = !dropout.enabled || dropout.keep(offset + j);
      const float g = to_float(weight[j]) * to_float(dy[offset + j]);
      sum_g += g;
      sum_g_xhat += g * xhat_at(j, kept);
    }
    const float mean_g = warp_sum(sum_g) / hidden;
    const float mean_g_xhat = warp_sum(sum_g_xhat) / hidden;
    for (int j = lane; j < hidden; j += 32) {
      const bool kept = !dropout.enabled || dropout.keep(offset + j);
      const float d = to_float(dy[offset + j]);
      const float xhat = xhat_at(j, kept);
      const float dh = rs * (to_float(weight[j]) * d - mean_g - xhat * mean_g_xhat);
      const float dxv = !dropout.enabled ? dh : kept ? dh * dropout.scale : 0.f;
      dresidual[offset + j] = from_float<RT>(dh);
      dx[offset + j] = from_float<T>(dxv);
      dwp[j] += d * xhat;
      dlbp[j] += d;
      dbp[j] += dxv;
    }
  }
}

// ---------------------------------------------------------------- launch

template <typename T, typename RT, typename WT>
int fwd_blocks(int64_t rows, int hidden, bool fast) {
  if (fast && hidden == 768) return one_wave_of_rows<dln_fwd_registers<T, RT, WT, 768>>(rows);
  if (fast && hidden == 1024) return one_wave_of_rows<dln_fwd_registers<T, RT, WT, 1024>>(rows);
  return one_wave_of_rows<dln_fwd_general<T, RT, WT>>(rows);
}

// The backward's CTAs sum the rows they visit into their workspace rows, so one wave also
// keeps the workspace and its column sum as small as a full device allows.
template <typename T, typename RT, typename WT>
int bwd_blocks(int64_t rows, int hidden, bool fast) {
  if (fast && hidden == 768) return one_wave_of_rows<dln_bwd_registers<T, RT, WT, 768>>(rows);
  if (fast && hidden == 1024) return one_wave_of_rows<dln_bwd_registers<T, RT, WT, 1024>>(rows);
  return one_wave_of_rows<dln_bwd_general<T, RT, WT>>(rows);
}

// Workspace rows a backward block writes: one per CTA on the register path, one per warp on the
// general path.
int bwd_rows_per_block(int hidden, bool fast) { return fast && register_row_size(hidden) ? 1 : kWarpsPerBlock; }

bool valid_dropout(float p, uint64_t offset) { return p >= 0.f && p < 1.f && offset % 4 == 0; }

}  // namespace
}  // namespace bds

using namespace bds;

extern "C" cudaError_t bds_dropout_layer_norm_fwd(const void* x, const void* bias, const void* residual,
                                                  const void* weight, const void* ln_bias, void* y, float* mean,
                                                  float* rstd, uint8_t* keep_out, int64_t rows, int hidden,
                                                  float eps, float dropout_p, uint64_t seed, uint64_t offset,
                                                  int dtype, int residual_dtype, int weight_dtype,
                                                  cudaStream_t stream) {
  if (hidden <= 0 || rows < 0 || residual == nullptr || !valid_dropout(dropout_p, offset))
    return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const bool fast = register_row_path(hidden, {x, bias, residual, weight, ln_bias, y, keep_out});
  const Dropout dropout = Dropout::make(dropout_p, seed, offset);
  return with_row_dtypes(dtype, residual_dtype, weight_dtype, [&](auto t, auto rt, auto wt) -> cudaError_t {
    using T = decltype(t);
    using RT = decltype(rt);
    using WT = decltype(wt);
    const auto* xs = static_cast<const T*>(x);
    const auto* bs = static_cast<const WT*>(bias);
    const auto* rs = static_cast<const RT*>(residual);
    const auto* ws = static_cast<const WT*>(weight);
    const auto* lbs = static_cast<const WT*>(ln_bias);
    auto* ys = static_cast<T*>(y);
    const dim3 grid(fwd_blocks<T, RT, WT>(rows, hidden, fast));
    if (fast && hidden == 768) {
      dln_fwd_registers<T, RT, WT, 768><<<grid, kThreads, 0, stream>>>(xs, bs, rs, ws, lbs, ys, mean, rstd, keep_out,
                                                                       rows, eps, dropout);
    } else if (fast && hidden == 1024) {
      dln_fwd_registers<T, RT, WT, 1024><<<grid, kThreads, 0, stream>>>(xs, bs, rs, ws, lbs, ys, mean, rstd,
                                                                        keep_out, rows, eps, dropout);
    } else {
      dln_fwd_general<T, RT, WT><<<grid, kThreads, 0, stream>>>(xs, bs, rs, ws, lbs, ys, mean, rstd, keep_out, rows,
                                                                hidden, eps, dropout);
    }
    return cudaGetLastError();
  });
}

extern "C" int bds_dropout_layer_norm_bwd_parts(int64_t rows, int hidden) {
  // As bds_layer_norm_bwd_parts: the most workspace rows any dtype combination writes at this
  // size with aligned tensors (at least a block's warps); a misaligned call's general kernel is
  // capped at `parts`.
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

extern "C" cudaError_t bds_dropout_layer_norm_bwd(const void* dy, const void* x, const void* bias,
                                                  const void* residual, const void* weight, const float* mean,
                                                  const float* rstd, void* dx, void* dresidual, void* dparams,
                                                  float* workspace, int parts, int64_t rows, int hidden,
                                                  float dropout_p, uint64_t seed, uint64_t offset, int dtype,
                                                  int residual_dtype, int weight_dtype, cudaStream_t stream) {
  if (hidden <= 0 || rows < 0 || parts < kWarpsPerBlock || residual == nullptr || !valid_dropout(dropout_p, offset))
    return cudaErrorInvalidValue;
  const bool fast = register_row_path(hidden, {dy, x, bias, residual, weight, dx, dresidual, workspace});
  const Dropout dropout = Dropout::make(dropout_p, seed, offset);
  return with_row_dtypes(dtype, residual_dtype, weight_dtype, [&](auto t, auto rt, auto wt) -> cudaError_t {
    using T = decltype(t);
    using RT = decltype(rt);
    using WT = decltype(wt);
    const auto* dys = static_cast<const T*>(dy);
    const auto* xs = static_cast<const T*>(x);
    const auto* bs = static_cast<const WT*>(bias);
    const auto* rs = static_cast<const RT*>(residual);
    const auto* ws = static_cast<const WT*>(weight);
    auto* dxs = static_cast<T*>(dx);
    auto* drs = static_cast<RT*>(dresidual);
    const int blocks = bwd_blocks<T, RT, WT>(rows, hidden, fast);
    const int rows_per_block = bwd_rows_per_block(hidden, fast);
    const dim3 grid(blocks < parts / rows_per_block ? blocks : parts / rows_per_block);
    if (fast && hidden == 768) {
      dln_bwd_registers<T, RT, WT, 768><<<grid, kThreads, 0, stream>>>(dys, xs, bs, rs, ws, mean, rstd, dxs, drs,
                                                                       workspace, rows, dropout);
    } else if (fast && hidden == 1024) {
      dln_bwd_registers<T, RT, WT, 1024><<<grid, kThreads, 0, stream>>>(dys, xs, bs, rs, ws, mean, rstd, dxs, drs,
                                                                        workspace, rows, dropout);
    } else {
      dln_bwd_general<T, RT, WT><<<grid, kThreads, 0, stream>>>(dys, xs, bs, rs, ws, mean, rstd, dxs, drs,
                                                                workspace, rows, hidden, dropout);
    }
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    // Only the launched blocks' rows hold partial sums; [dweight | dln_bias | dbias] in one pass.
    return column_sum(workspace, (int)grid.x * rows_per_block, 3 * hidden, static_cast<WT*>(dparams), stream);
  });
}
