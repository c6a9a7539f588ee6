// The MLM loss over the decoder's logits: per row, the cross-entropy lse - x[label], the
// log-sum-exp the backward needs, and whether the row's first maximal logit is its label;
// the backward's (softmax - onehot(label)) * dloss.
//
// Design:
// - Memory-bound, as softmax cross-entropy is wherever the class dimension is large (apex's and
//   Megatron's fused ones are built the same way). The logits are M x V', 4,915 x 30,528 bf16
//   (300 MB) for a BERT-Base micro-batch of 32,768 tokens; per logit the forward does a compare,
//   a subtract, an exp and an add, the backward an exp, a subtract and a multiply: at most 2 FLOPs
//   and half an exp per byte, where an H100 does about 20 fp32 FLOPs and 1.3 exps (MUFU.EX2, 16 per
//   SM per clock) per byte of DRAM bandwidth. So the cost is bytes, and each logit is read once
//   per pass: 2 bytes forward, 4 backward (read, and the gradient written), 6 in all. PyTorch's
//   fp32 path moves at least 36: the fp32 copy (2 read, 4 written), log-softmax (4 and 4), the
//   loss's gradient (4 written), log-softmax's backward (8 read, 4 written) and the cast back
//   (4 and 2); and it holds two fp32 copies of the logits (600 MB at BERT-Base) for the backward.
// - One pass forward: each thread keeps an online softmax state over its columns (the running
//   max m, the sum of exp(x - m), rescaled when m grows; Milakov and Gimelshein, "Online
//   normalizer calculation for softmax", 2018), and the first column holding m. The block
//   merges the states of its threads (warp butterflies, then the 8 warps in order), so a row's
//   result does not depend on timing: deterministic, no atomics.
// - Argmax ties go to the lowest column, as torch.argmax's do: a thread visits its columns in
//   increasing order and keeps the earlier of equal maxima, and a merge keeps the lower column.
//   The count of right predictions then equals (logits.argmax(-1) == labels).sum() (NaN logits
//   aside: torch's argmax picks a NaN, ours skips it; the loss is NaN either way).
// - One block of 256 threads per row, the grid striding over rows in one wave of resident
//   blocks (the occupancy API): a BERT row is 3,816 16-byte vectors, 15 per thread. Both kernels
//   fit 32 registers, so an SM holds 8 blocks (2,048 threads) and keeps that many loads in
//   flight; the forward's threads load two vectors before using either.
// - exp(x - m) is exp2f((x - m) * log2(e)): one MUFU.EX2, where expf adds a range reduction.
// - -inf columns (the decoder's padding to a multiple of 8) add exp(-inf) = 0 to the sum, never
//   win the argmax of a row with a finite logit, and get a gradient of exactly 0.
// - Rows whose label is ignore_index contribute nothing and are not read: loss 0, not counted,
//   lse 0 (unused), and the backward writes their gradient as zeros without reading the row.
// - A label outside [0, cols) other than ignore_index gives a NaN loss and is not counted:
//   torch raises there, a kernel cannot.
// - The rows' losses are summed by the caller (a deterministic torch sum over M floats), and
//   the backward reads dloss from device memory, so no host copy waits for the device.
// - 16-byte vectors when the width and the pointers allow it (every BERT vocabulary padded to
//   a multiple of 8), scalar accesses otherwise (any width).
#include <type_traits>

#include "common.cuh"

namespace bds {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kInFlight = 2;  // vectors a forward thread loads before using them
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kNoColumn = 0x7fffffff;  // a thread with no column: loses every tie

__device__ __forceinline__ float exp_of_difference(float x, float m) { return exp2f((x - m) * kLog2e); }

// Some columns of a row, reduced: their max, the sum of exp(x - max) over them, and the first
// column holding the max.
struct Partial {
  float max;
  float sum;
  int column;
};

// Two disjoint parts of a row as one.
__device__ __forceinline__ Partial merge(const Partial& a, const Partial& b) {
  Partial out;
  out.max = fmaxf(a.max, b.max);
  // Both parts only -inf so far: nothing summed, and -inf - -inf would make the sum NaN.
  out.sum = out.max == -INFINITY
                ? 0.f
                : a.sum * exp_of_difference(a.max, out.max) + b.sum * exp_of_difference(b.max, out.max);
  const bool b_first = b.max > a.max || (b.max == a.max && b.column < a.column);
  out.column = b_first ? b.column : a.column;
  return out;
}

// Adds kVec logits, from `column` on, to p; a thread calls it with increasing columns.
template <int kVec>
__device__ __forceinline__ void add_vector(Partial& p, const float (&x)[kVec], int column) {
  float top = x[0];
  int at = 0;
#pragma unroll
  for (int j = 1; j < kVec; ++j) {
    if (x[j] > top) {  // strict: the first of equal values stays
      top = x[j];
      at = j;
    }
  }
  if (top > p.max) {  // a new running max (rare once a row's large logits are seen): rescale the sum
    p.sum *= exp_of_difference(p.max, top);  // p.max = -inf: the sum is 0 and stays 0
    p.max = top;
    p.column = column + at;
  }
  if (p.max == -INFINITY) return;  // only padding so far: nothing to add, and -inf - -inf is NaN
#pragma unroll
  for (int j = 0; j < kVec; ++j) p.sum += exp_of_difference(x[j], p.max);
}

// The whole block's parts of a row as one, valid in thread 0: butterflies within each warp, then
// thread 0 merges the warps' results in order.
__device__ __forceinline__ Partial block_merge(Partial p, Partial (&shared)[kWarps]) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    Partial other;
    other.max = __shfl_xor_sync(kFullMask, p.max, offset);
    other.sum = __shfl_xor_sync(kFullMask, p.sum, offset);
    other.column = __shfl_xor_sync(kFullMask, p.column, offset);
    p = merge(p, other);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = p;
  __syncthreads();
  if (threadIdx.x == 0) {
    p = shared[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) p = merge(p, shared[w]);
  }
  __syncthreads();  // shared[] is the next row's
  return p;
}

// loss, lse: (rows,) fp32; correct: (rows,) 0 or 1. cols % kVec == 0.
template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads)
cross_entropy_fwd_kernel(const T* __restrict__ logits, const int64_t* __restrict__ labels, float* __restrict__ loss,
                         float* __restrict__ lse, uint8_t* __restrict__ correct, int64_t rows, int cols,
                         int64_t ignore_index) {
  __shared__ Partial warp_parts[kWarps];
  const int vecs = cols / kVec;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t label = labels[row];
    if (label == ignore_index) {  // the same for the whole block: it skips the row together
      if (threadIdx.x == 0) {
        loss[row] = 0.f;
        lse[row] = 0.f;
        correct[row] = 0;
      }
      continue;
    }
    const T* x_row = logits + row * cols;
    Partial p{-INFINITY, 0.f, (int)threadIdx.x < vecs ? (int)threadIdx.x * kVec : kNoColumn};
    for (int v = threadIdx.x; v < vecs; v += kThreads * kInFlight) {
      float x[kInFlight][kVec];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int vu = v + u * kThreads;
        if (vu < vecs) {
          load_floats(x_row + (int64_t)vu * kVec, x[u]);
        } else {
#pragma unroll
          for (int j = 0; j < kVec; ++j) x[u][j] = -INFINITY;  // past the row: adds nothing, never the max
        }
      }
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) add_vector(p, x[u], (v + u * kThreads) * kVec);
    }
    p = block_merge(p, warp_parts);
    if (threadIdx.x == 0) {
      const float row_lse = p.max + logf(p.sum);
      const bool in_range = label >= 0 && label < cols;
      loss[row] = in_range ? row_lse - to_float(x_row[label]) : NAN;
      lse[row] = row_lse;
      correct[row] = in_range && p.column == label;
    }
  }
}

// dlogits = (exp(x - lse) - onehot(label)) * grad_scale[0], zeros in ignored rows. cols % kVec == 0.
template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads)
cross_entropy_bwd_kernel(const float* __restrict__ grad_scale, const T* __restrict__ logits,
                         const int64_t* __restrict__ labels, const float* __restrict__ lse, T* __restrict__ dlogits,
                         int64_t rows, int cols, int64_t ignore_index) {
  const float scale = *grad_scale;
  const int vecs = cols / kVec;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t label = labels[row];
    const int64_t offset = row * cols;
    if (label == ignore_index) {
      const float zeros[kVec] = {};
      for (int v = threadIdx.x; v < vecs; v += kThreads) store_floats(dlogits + offset + (int64_t)v * kVec, zeros);
      continue;
    }
    const float row_lse = lse[row];
#pragma unroll 1  // nvcc's own unrolling takes 48 to 63 registers: fewer threads, no more bytes in flight
    for (int v = threadIdx.x; v < vecs; v += kThreads) {
      float x[kVec];
      load_floats(logits + offset + (int64_t)v * kVec, x);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float target = v * kVec + j == label ? 1.f : 0.f;
        x[j] = (exp_of_difference(x[j], row_lse) - target) * scale;
      }
      store_floats(dlogits + offset + (int64_t)v * kVec, x);
    }
  }
}

// ---------------------------------------------------------------- launch

// One block per row, but no more than the device holds at once: the kernels stride over the
// rows, so more blocks would only add a tail.
template <auto kKernel>
int row_blocks(int64_t rows) {
  const int64_t resident = resident_blocks<kKernel, kThreads>();
  return (int)(rows < resident ? rows : resident);
}

// Calls f(std::integral_constant<int, kVec>) with the 16-byte width of T where `wide`, else 1.
template <typename T, typename F>
cudaError_t with_width(bool wide, F&& f) {
  constexpr int kWide = 16 / sizeof(T);
  return wide ? f(std::integral_constant<int, kWide>{}) : f(std::integral_constant<int, 1>{});
}

}  // namespace
}  // namespace bds

using namespace bds;

extern "C" cudaError_t bds_mlm_cross_entropy_fwd(const void* logits, const int64_t* labels, float* loss, float* lse,
                                                 uint8_t* correct, int64_t rows, int cols, int64_t ignore_index,
                                                 int dtype, cudaStream_t stream) {
  if (cols <= 0 || rows < 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  return with_dtype(dtype, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    const bool wide = cols % (16 / sizeof(T)) == 0 && aligned_to(logits, 16);
    return with_width<T>(wide, [&](auto vec) -> cudaError_t {
      constexpr int kVec = decltype(vec)::value;
      const dim3 grid(row_blocks<cross_entropy_fwd_kernel<T, kVec>>(rows));
      cross_entropy_fwd_kernel<T, kVec><<<grid, kThreads, 0, stream>>>(
          static_cast<const T*>(logits), labels, loss, lse, correct, rows, cols, ignore_index);
      return cudaGetLastError();
    });
  });
}

extern "C" cudaError_t bds_mlm_cross_entropy_bwd(const float* grad_scale, const void* logits, const int64_t* labels,
                                                 const float* lse, void* dlogits, int64_t rows, int cols,
                                                 int64_t ignore_index, int dtype, cudaStream_t stream) {
  if (cols <= 0 || rows < 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  return with_dtype(dtype, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    const bool wide = cols % (16 / sizeof(T)) == 0 && aligned_to(logits, 16) && aligned_to(dlogits, 16);
    return with_width<T>(wide, [&](auto vec) -> cudaError_t {
      constexpr int kVec = decltype(vec)::value;
      const dim3 grid(row_blocks<cross_entropy_bwd_kernel<T, kVec>>(rows));
      cross_entropy_bwd_kernel<T, kVec><<<grid, kThreads, 0, stream>>>(
          grad_scale, static_cast<const T*>(logits), labels, lse, static_cast<T*>(dlogits), rows, cols,
          ignore_index);
      return cudaGetLastError();
    });
  });
}
