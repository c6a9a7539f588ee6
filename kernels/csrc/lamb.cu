// LAMB's update of a flat fp32 tensor cut into chunks, in two passes around the trust ratio.
//
// The optimizer (bert_ds/optim/lamb.py) steps ZeRO's flat partitions: one fp32 tensor per
// param group holding fragments of many parameters, each parameter needing its own trust
// ratio ||w|| / ||u||, summed over fragments and ranks. The tensor is cut into chunks that
// each lie inside one fragment (or inside padding); the host sums chunk norms into
// parameters, all-reduces them, and hands back one multiplier per chunk.
//
// Design:
// - Memory traffic is the whole cost (a few flops per element), so each pass touches
//   each byte once. `moments` reads g, m, v, w and writes m, v (6 passes over the tensor);
//   `apply` reads m, v, w and writes w (4 passes). The update u is recomputed in `apply`
//   from the same inputs by the same code rather than stored: storing it would cost the
//   same traffic (a write, then a read) plus a tensor the size of the partition.
//   PyTorch's foreach path makes ~31 passes for the same step.
// - One block per chunk (grid-stride over chunks): a chunk's squared norms are a block
//   reduction in a fixed order (warp shuffles, then the warps' sums in order), so the
//   result is deterministic, with no atomics.
// - Chunk offsets are arbitrary (fragments start anywhere), so accesses are scalar and
//   coalesced (a warp reads 128 contiguous bytes); each thread issues its loads for
//   kPerThread elements before using them, to keep several loads in flight.
// - The bias corrections ride on two scalars (step_size = sqrt(1 - b2^t) / (1 - b1^t) and
//   eps_hat = eps sqrt(1 - b2^t)): u = step_size m / (sqrt(v) + eps_hat) + wd w, the same
//   algebra as the foreach path.
// - A step found non-finite is skipped on the device: both passes read a flag (`skip`, one
//   float written by the training step's checks) and return before writing anything but zero
//   squares. The host never reads it: on a GPU that read would wait for the whole step.
#include "common.cuh"

namespace bds {
namespace {

constexpr int kThreads = 256;
constexpr int kPerThread = 4;  // elements per thread per round: 1,024 per block, the optimizer's chunk
constexpr int kWarps = kThreads / 32;

struct LambScalars {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, eps_hat, weight_decay;
};

__device__ __forceinline__ float lamb_direction(float m, float v, float w, const LambScalars& s) {
  return s.step_size * m / (sqrtf(v) + s.eps_hat) + s.weight_decay * w;
}

// x[start + base + j * kThreads + threadIdx.x] for j < kPerThread, 0 past the chunk's end:
// every load issued before any is used.
__device__ __forceinline__ void load_round(const float* __restrict__ x, int64_t start, int64_t base,
                                           int64_t length, float (&out)[kPerThread]) {
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int64_t i = base + j * kThreads + threadIdx.x;
    out[j] = i < length ? x[start + i] : 0.f;
  }
}

// Sum of v over the block, in a fixed order; the result is valid in thread 0.
__device__ __forceinline__ float block_sum(float v, float (&shared)[kWarps]) {
  v = warp_sum(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float total = 0.f;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int i = 0; i < kWarps; ++i) total += shared[i];
  }
  __syncthreads();  // shared[] is reused by the next chunk's sums
  return total;
}

// Whether the step is skipped: a flag the device wrote (null: never).
__device__ __forceinline__ bool skipped(const float* __restrict__ skip) { return skip != nullptr && *skip != 0.f; }

// m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2, in place; squares[2c], squares[2c + 1] =
// sum over chunk c of w^2 and of u^2 (when squares is not null). Skipped: zero squares only.
__global__ void __launch_bounds__(kThreads)
lamb_moments_kernel(const float* __restrict__ g, float* __restrict__ m, float* __restrict__ v,
                    const float* __restrict__ w, const int64_t* __restrict__ offsets,
                    const int64_t* __restrict__ lengths, float* __restrict__ squares,
                    const float* __restrict__ skip, int64_t num_chunks, LambScalars s) {
  __shared__ float sums[2][kWarps];
  if (skipped(skip)) {
    for (int64_t c = blockIdx.x; c < num_chunks && squares != nullptr && threadIdx.x == 0; c += gridDim.x) {
      squares[2 * c] = 0.f;
      squares[2 * c + 1] = 0.f;
    }
    return;  // the whole block: no barrier below is reached by some threads only
  }
  for (int64_t c = blockIdx.x; c < num_chunks; c += gridDim.x) {
    const int64_t start = offsets[c];
    const int64_t length = lengths[c];
    float w_sq = 0.f, u_sq = 0.f;
    for (int64_t base = 0; base < length; base += kThreads * kPerThread) {
      float gi[kPerThread], mi[kPerThread], vi[kPerThread], wi[kPerThread];
      load_round(g, start, base, length, gi);
      load_round(m, start, base, length, mi);
      load_round(v, start, base, length, vi);
      load_round(w, start, base, length, wi);
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        const int64_t i = base + j * kThreads + threadIdx.x;
        if (i >= length) continue;
        mi[j] = s.beta1 * mi[j] + s.one_minus_beta1 * gi[j];
        vi[j] = s.beta2 * vi[j] + s.one_minus_beta2 * gi[j] * gi[j];
        m[start + i] = mi[j];
        v[start + i] = vi[j];
        const float u = lamb_direction(mi[j], vi[j], wi[j], s);
        w_sq += wi[j] * wi[j];
        u_sq += u * u;
      }
    }
    if (squares != nullptr) {
      w_sq = block_sum(w_sq, sums[0]);
      u_sq = block_sum(u_sq, sums[1]);
      if (threadIdx.x == 0) {
        squares[2 * c] = w_sq;
        squares[2 * c + 1] = u_sq;
      }
    }
  }
}

// w -= scale * u, with scale = scales[c] for chunk c, or `uniform` when scales is null; nothing
// when skipped.
__global__ void __launch_bounds__(kThreads)
lamb_apply_kernel(const float* __restrict__ m, const float* __restrict__ v, float* __restrict__ w,
                  const int64_t* __restrict__ offsets, const int64_t* __restrict__ lengths,
                  const float* __restrict__ scales, const float* __restrict__ skip, float uniform,
                  int64_t num_chunks, LambScalars s) {
  if (skipped(skip)) return;
  for (int64_t c = blockIdx.x; c < num_chunks; c += gridDim.x) {
    const int64_t start = offsets[c];
    const int64_t length = lengths[c];
    const float scale = scales != nullptr ? scales[c] : uniform;
    for (int64_t base = 0; base < length; base += kThreads * kPerThread) {
      float mi[kPerThread], vi[kPerThread], wi[kPerThread];
      load_round(m, start, base, length, mi);
      load_round(v, start, base, length, vi);
      load_round(w, start, base, length, wi);
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        const int64_t i = base + j * kThreads + threadIdx.x;
        if (i < length) w[start + i] = wi[j] - scale * lamb_direction(mi[j], vi[j], wi[j], s);
      }
    }
  }
}

template <auto kKernel>
int chunk_blocks(int64_t num_chunks) {
  const int64_t resident = resident_blocks<kKernel, kThreads>();
  return (int)(num_chunks < resident ? num_chunks : resident);
}

LambScalars scalars(float beta1, float beta2, float step_size, float eps_hat, float weight_decay) {
  return {beta1, 1.f - beta1, beta2, 1.f - beta2, step_size, eps_hat, weight_decay};
}

}  // namespace
}  // namespace bds

using namespace bds;

extern "C" cudaError_t bds_lamb_moments(const float* grad, float* exp_avg, float* exp_avg_sq, const float* param,
                                        const int64_t* offsets, const int64_t* lengths, float* squares,
                                        const float* skip, int64_t num_chunks, float beta1, float beta2,
                                        float step_size, float eps_hat, float weight_decay, cudaStream_t stream) {
  if (num_chunks < 0) return cudaErrorInvalidValue;
  if (num_chunks == 0) return cudaSuccess;
  const dim3 grid(chunk_blocks<lamb_moments_kernel>(num_chunks));
  lamb_moments_kernel<<<grid, kThreads, 0, stream>>>(grad, exp_avg, exp_avg_sq, param, offsets, lengths, squares,
                                                     skip, num_chunks, scalars(beta1, beta2, step_size, eps_hat,
                                                                               weight_decay));
  return cudaGetLastError();
}

extern "C" cudaError_t bds_lamb_apply(const float* exp_avg, const float* exp_avg_sq, float* param,
                                      const int64_t* offsets, const int64_t* lengths, const float* scales,
                                      const float* skip, float uniform_scale, int64_t num_chunks, float beta1,
                                      float beta2, float step_size, float eps_hat, float weight_decay,
                                      cudaStream_t stream) {
  if (num_chunks < 0) return cudaErrorInvalidValue;
  if (num_chunks == 0) return cudaSuccess;
  const dim3 grid(chunk_blocks<lamb_apply_kernel>(num_chunks));
  lamb_apply_kernel<<<grid, kThreads, 0, stream>>>(exp_avg, exp_avg_sq, param, offsets, lengths, scales, skip,
                                                   uniform_scale, num_chunks,
                                                   scalars(beta1, beta2, step_size, eps_hat, weight_decay));
  return cudaGetLastError();
}
