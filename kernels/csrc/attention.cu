// Bidirectional attention over unpadded variable-length sequences (FlashAttention-2
// style), forward and backward, fp16/bf16 on tensor cores.
//
// Layout: q, k, v, out are (total, num_heads, head_dim); sequence b is the token rows
// cu_seqlens[b] .. cu_seqlens[b+1]. A token's head vector is head_dim contiguous
// elements, the next token's is num_heads * head_dim further on.
//
// Tiling (both passes): a CTA of 4 warps takes one (sequence, head) and one tile of
// 64 rows; each warp owns 16 of those rows, the M of one mma.sync.m16n8k16. The other
// operand streams through shared memory 64 rows at a time. Shared tiles are padded
// to head_dim + 8 elements per row so that the eight 16-byte rows an ldmatrix reads
// fall in eight different bank groups.
//
// Forward (grid: query tiles x sequences x heads). Per key tile:
//   S = Q K^T (fp32), masked past the sequence end; running row max m and row sum l
//   (online softmax in base 2, scale folded into log2(e) * softmax_scale); O is
//   rescaled by exp2(m_old - m_new) and O += P V, where P's accumulator registers are
//   reused as the A operand without a trip through shared memory. At the end
//   O /= l and lse = ln(sum exp(scale * q.k)) is saved per row for the backward.
//
// Backward (grid: key tiles x sequences x heads). Preprocessing: D = rowsum(dO * O).
// The CTA keeps its 64 keys (K, V) and accumulates dK, dV in registers while it walks
// the query tiles; each warp computes, for its 16 keys,
//   P^T = exp(scale K Q^T - lse)          (recomputed from the saved lse)
//   dV += P^T dO,   dP^T = V dO^T,   dS^T = P^T * (dP^T - D),   dK += dS^T Q
// then dS^T goes to shared memory so that each warp can form dQ = dS K for 16 queries
// over all 64 keys, added in fp32 with atomics to a dq accumulator (several key tiles
// contribute to every query row) and converted to the output dtype at the end.
// softmax_scale is applied to dK and dQ once, at the end.
//
// Not supported: dropout (the binding refuses dropout_p > 0), causal masks, head dims
// other than 32 and 64.
#include <math.h>

#include <type_traits>

#include "common.cuh"

namespace bds {
namespace {

constexpr int kBlockM = 64;  // query rows per tile: 4 warps x 16
constexpr int kBlockN = 64;  // key rows per tile
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.69314718055994531f;

// Copies rows [0, valid) of a (ROWS, HD) slice, `row_stride` elements apart, into a
// padded shared tile and zero-fills the rest: rows past the sequence end must hold
// finite values, since they meet P = 0 in a product and 0 * NaN is NaN.
template <typename T, int HD, int ROWS>
__device__ __forceinline__ void load_tile(T* tile, const T* src, int64_t row_stride, int valid) {
  constexpr int kChunks = HD / 8;  // 16-byte chunks per row
  constexpr int kStride = HD + 8;
  for (int c = threadIdx.x; c < ROWS * kChunks; c += kThreads) {
    const int r = c / kChunks, chunk = c % kChunks;
    uint4 value = make_uint4(0u, 0u, 0u, 0u);
    if (r < valid) value = *reinterpret_cast<const uint4*>(src + r * row_stride + chunk * 8);
    *reinterpret_cast<uint4*>(tile + r * kStride + chunk * 8) = value;
  }
}

// Where lane points ldmatrix_x4 (see common.cuh) to fetch mma operands from a
// row-major shared tile with `stride` elements per row:
//
// A operand (16 x 16) stored as rows = m, cols = k; plain ldmatrix gives a[0..3].
template <typename T>
__device__ __forceinline__ const T* a_rows(const T* tile, int stride, int m0, int k0, int lane) {
  return tile + (m0 + lane % 16) * stride + k0 + (lane / 16) * 8;
}
// A operand stored transposed (rows = k, cols = m); ldmatrix .trans gives a[0..3].
template <typename T>
__device__ __forceinline__ const T* a_cols(const T* tile, int stride, int m0, int k0, int lane) {
  return tile + (k0 + lane % 8 + (lane / 16) * 8) * stride + m0 + ((lane / 8) % 2) * 8;
}
// B operands of two adjacent n8 tiles (16 k x 16 n) stored as rows = n, cols = k (a K
// tile for Q K^T); plain ldmatrix gives b0, b1 of tile n0 in r[0], r[1] and of n0 + 8
// in r[2], r[3].
template <typename T>
__device__ __forceinline__ const T* b_rows_n(const T* tile, int stride, int n0, int k0, int lane) {
  return tile + (n0 + lane % 8 + (lane / 16) * 8) * stride + k0 + ((lane / 8) % 2) * 8;
}
// The same B operands stored as rows = k, cols = n (a V tile for P V); ldmatrix .trans.
template <typename T>
__device__ __forceinline__ const T* b_rows_k(const T* tile, int stride, int n0, int k0, int lane) {
  return tile + (k0 + lane % 8 + ((lane / 8) % 2) * 8) * stride + n0 + (lane / 16) * 8;
}

// The accumulators of n8 tiles 2j and 2j+1 (16 rows x 16 columns, fp32) as the A operand
// of the next mma, whose k runs over those 16 columns: the register layouts coincide.
template <typename T>
__device__ __forceinline__ void accumulators_as_a(uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
  a[0] = pack2<T>(lo[0], lo[1]);
  a[1] = pack2<T>(lo[2], lo[3]);
  a[2] = pack2<T>(hi[0], hi[1]);
  a[3] = pack2<T>(hi[2], hi[3]);
}

// Warp tile products, the same three shapes in both passes. A warp owns a strip of 16
// rows; `float acc[NT][4]` is that strip times 8 NT columns in the mma D layout (n8 tile
// nt: rows g, g + 8, columns 2t, 2t + 1). B comes from a shared tile, `stride` elements
// per row. The sizes are template parameters so that every loop unrolls fully and the
// fragment arrays stay in registers.

// acc (16 x 8 NT) += A B^T over k = 16 KT: a[kk] the A operand of k step kk, B^T the first
// 8 NT rows of a tile stored rows = n, cols = k (S = Q K^T, P^T = K Q^T, dP^T = V dO^T).
template <typename T, int NT, int KT>
__device__ __forceinline__ void mma_abt(float (&acc)[NT][4], const uint32_t (&a)[KT][4], const T* tile, int stride,
                                        int lane) {
#pragma unroll
  for (int kk = 0; kk < KT; ++kk) {
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t b[4];
      ldmatrix_x4(b, b_rows_n(tile, stride, np * 16, kk * 16, lane));
      mma_16816<T>(acc[2 * np], a[kk], b[0], b[1]);
      mma_16816<T>(acc[2 * np + 1], a[kk], b[2], b[3]);
    }
  }
}

// acc (16 x 8 NT) += A B over one k step: `a` a 16 x 16 A operand, B rows k0 .. k0 + 15
// of a tile stored rows = k, cols = n (ldmatrix .trans). One step at a time because the
// callers make A on the fly (accumulators_as_a, or dS read transposed for dQ = dS K).
template <typename T, int NT>
__device__ __forceinline__ void mma_ab_step(float (&acc)[NT][4], const uint32_t (&a)[4], const T* tile, int stride,
                                            int k0, int lane) {
#pragma unroll
  for (int np = 0; np < NT / 2; ++np) {
    uint32_t b[4];
    ldmatrix_x4_trans(b, b_rows_k(tile, stride, np * 16, k0, lane));
    mma_16816<T>(acc[2 * np], a, b[0], b[1]);
    mma_16816<T>(acc[2 * np + 1], a, b[2], b[3]);
  }
}

// acc (16 x 8 NT) += P B over k = 8 PT: P the accumulator of an earlier product, turned
// into A operands in registers (accumulators_as_a), B a tile stored rows = k, cols = n
// (O += P V, dV += P^T dO, dK += dS^T Q).
template <typename T, int NT, int PT>
__device__ __forceinline__ void mma_pb(float (&acc)[NT][4], const float (&p)[PT][4], const T* tile, int stride,
                                       int lane) {
#pragma unroll
  for (int j = 0; j < PT / 2; ++j) {
    uint32_t pa[4];
    accumulators_as_a<T>(pa, p[2 * j], p[2 * j + 1]);
    mma_ab_step<T>(acc, pa, tile, stride, j * 16, lane);
  }
}

// ---------------------------------------------------------------- forward

// (kThreads, 2): without a minimum-blocks hint ptxas 13 caps the sm_90 build at 128
// registers and spills; 2 blocks per SM lets it use what it needs (163).
template <typename T, int HD>
__global__ void __launch_bounds__(kThreads, 2)
attention_fwd_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                     const int* __restrict__ cu_seqlens, T* __restrict__ out, float* __restrict__ lse,
                     int num_heads, int64_t total, float scale_log2) {
  constexpr int kStride = HD + 8;
  __shared__ __align__(16) T sQ[kBlockM * kStride];
  __shared__ __align__(16) T sK[kBlockN * kStride];
  __shared__ __align__(16) T sV[kBlockN * kStride];

  const int head = blockIdx.z;
  const int start = cu_seqlens[blockIdx.y];
  const int len = cu_seqlens[blockIdx.y + 1] - start;
  const int m0 = blockIdx.x * kBlockM;  // the tile's first query, counted within the sequence
  if (m0 >= len) return;                // the whole CTA: grid.x is sized for the longest sequence

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;  // accumulator rows g, g + 8; columns 2t, 2t + 1 of each n8 tile
  const int64_t row_stride = (int64_t)num_heads * HD;
  const int64_t base = (int64_t)start * row_stride + (int64_t)head * HD;  // element (start, head, 0)

  load_tile<T, HD, kBlockM>(sQ, q + base + m0 * row_stride, row_stride, len - m0);
  __syncthreads();
  uint32_t qa[HD / 16][4];  // this warp's 16 query rows, the A operand of S = Q K^T
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) ldmatrix_x4(qa[kk], a_rows(sQ, kStride, warp * 16, kk * 16, lane));

  float acc[HD / 8][4] = {};  // O, unnormalised: n8 tile dt covers head dims 8 dt .. 8 dt + 7
  float row_max[2] = {-INFINITY, -INFINITY};  // rows g, g + 8, in log2 units
  float row_sum[2] = {0.f, 0.f};  // this thread's columns only; the quad is summed at the end

  for (int n0 = 0; n0 < len; n0 += kBlockN) {
    __syncthreads();  // every warp is done with the previous K, V tiles
    load_tile<T, HD, kBlockN>(sK, k + base + n0 * row_stride, row_stride, len - n0);
    load_tile<T, HD, kBlockN>(sV, v + base + n0 * row_stride, row_stride, len - n0);
    __syncthreads();

    float s[kBlockN / 8][4] = {};  // S for 16 queries x 64 keys
    mma_abt(s, qa, sK, kStride, lane);

    // Online softmax. Every tile holds at least one real key (n0 < len), so the new
    // max is finite and exp2(old - new) is 0 on the first tile, never NaN.
    float tile_max[2] = {row_max[0], row_max[1]};
#pragma unroll
    for (int nt = 0; nt < kBlockN / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = n0 + nt * 8 + 2 * t + (e & 1);
        s[nt][e] = key < len ? s[nt][e] * scale_log2 : -INFINITY;
        tile_max[e / 2] = fmaxf(tile_max[e / 2], s[nt][e]);
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {  // a row's 64 columns live in the 4 threads of a quad
      tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(kFullMask, tile_max[i], 1));
      tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(kFullMask, tile_max[i], 2));
      const float correction = exp2f(row_max[i] - tile_max[i]);
      row_max[i] = tile_max[i];
      row_sum[i] *= correction;
#pragma unroll
      for (int dt = 0; dt < HD / 8; ++dt) {
        acc[dt][2 * i] *= correction;
        acc[dt][2 * i + 1] *= correction;
      }
    }
#pragma unroll
    for (int nt = 0; nt < kBlockN / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[nt][e] = exp2f(s[nt][e] - row_max[e / 2]);
        row_sum[e / 2] += s[nt][e];
      }
    }

    // O += P V: k runs over the tile's 64 keys, 16 per mma.
    mma_pb(acc, s, sV, kStride, lane);
  }

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    row_sum[i] += __shfl_xor_sync(kFullMask, row_sum[i], 1);
    row_sum[i] += __shfl_xor_sync(kFullMask, row_sum[i], 2);
    const int row = m0 + warp * 16 + g + 8 * i;
    if (row < len) {
      const float inv = 1.f / row_sum[i];
      T* o = out + base + row * row_stride;
#pragma unroll
      for (int dt = 0; dt < HD / 8; ++dt)
        *reinterpret_cast<uint32_t*>(o + dt * 8 + 2 * t) = pack2<T>(acc[dt][2 * i] * inv, acc[dt][2 * i + 1] * inv);
      if (t == 0) lse[(int64_t)head * total + start + row] = (row_max[i] + log2f(row_sum[i])) * kLn2;
    }
  }
}

// ---------------------------------------------------------------- backward

// dsum[head][token] = sum over d of dout * out; one warp per (token, head) row.
template <typename T, int HD>
__global__ void __launch_bounds__(kThreads)
attention_dsum_kernel(const T* __restrict__ dout, const T* __restrict__ out, float* __restrict__ dsum,
                      int num_heads, int64_t total) {
  const int64_t row = (int64_t)blockIdx.x * kWarps + threadIdx.x / 32;  // token * num_heads + head
  const int lane = threadIdx.x % 32;
  if (row >= total * num_heads) return;
  float sum = 0.f;
#pragma unroll
  for (int d = lane; d < HD; d += 32) sum += to_float(dout[row * HD + d]) * to_float(out[row * HD + d]);
  sum = warp_sum(sum);
  if (lane == 0) dsum[(row % num_heads) * total + row / num_heads] = sum;
}

template <typename T, int HD>
__global__ void __launch_bounds__(kThreads)
attention_bwd_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                     const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ dsum,
                     const int* __restrict__ cu_seqlens, float* __restrict__ dq_accum, T* __restrict__ dk,
                     T* __restrict__ dv, int num_heads, int64_t total, float scale, float scale_log2) {
  constexpr int kStride = HD + 8;        // Q, K, V, dO tiles: (rows, head dim)
  constexpr int kSStride = kBlockM + 8;  // dS^T tile: (keys, queries)
  __shared__ __align__(16) T sK[kBlockN * kStride];
  __shared__ __align__(16) T sV[kBlockN * kStride];
  __shared__ __align__(16) T sQ[kBlockM * kStride];
  __shared__ __align__(16) T sdO[kBlockM * kStride];
  __shared__ __align__(16) T sdS[kBlockN * kSStride];
  __shared__ float sLse[kBlockM];   // log2 units; +inf past the sequence end, so that P = 0 there
  __shared__ float sDsum[kBlockM];

  const int head = blockIdx.z;
  const int start = cu_seqlens[blockIdx.y];
  const int len = cu_seqlens[blockIdx.y + 1] - start;
  const int n0 = blockIdx.x * kBlockN;  // the tile's first key, counted within the sequence
  if (n0 >= len) return;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int64_t row_stride = (int64_t)num_heads * HD;
  const int64_t base = (int64_t)start * row_stride + (int64_t)head * HD;

  load_tile<T, HD, kBlockN>(sK, k + base + n0 * row_stride, row_stride, len - n0);
  load_tile<T, HD, kBlockN>(sV, v + base + n0 * row_stride, row_stride, len - n0);
  __syncthreads();
  // This warp's 16 keys as A operands (rows = keys, k = head dim), kept for the whole pass.
  uint32_t ka[HD / 16][4], va[HD / 16][4];
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    ldmatrix_x4(ka[kk], a_rows(sK, kStride, warp * 16, kk * 16, lane));
    ldmatrix_x4(va[kk], a_rows(sV, kStride, warp * 16, kk * 16, lane));
  }
  // Keys past the sequence end get P = 0. Not needed for the result (their dK, dV are
  // never stored and their zero K rows cancel their dS in dQ), but it keeps P^T honest.
  const bool key_real[2] = {n0 + warp * 16 + g < len, n0 + warp * 16 + g + 8 < len};
  float dk_acc[HD / 8][4] = {};
  float dv_acc[HD / 8][4] = {};

  for (int m0 = 0; m0 < len; m0 += kBlockM) {
    __syncthreads();  // every warp is done with the previous query tile and its dS^T
    load_tile<T, HD, kBlockM>(sQ, q + base + m0 * row_stride, row_stride, len - m0);
    load_tile<T, HD, kBlockM>(sdO, dout + base + m0 * row_stride, row_stride, len - m0);
    for (int i = threadIdx.x; i < kBlockM; i += kThreads) {
      const bool real = m0 + i < len;
      const int64_t at = (int64_t)head * total + start + m0 + i;
      sLse[i] = real ? lse[at] * kLog2e : INFINITY;
      sDsum[i] = real ? dsum[at] : 0.f;
    }
    __syncthreads();

    // P^T = exp2(scale_log2 * K Q^T - lse_log2): 16 keys x 64 queries.
    float p[kBlockM / 8][4] = {};
    mma_abt(p, ka, sQ, kStride, lane);
#pragma unroll
    for (int nt = 0; nt < kBlockM / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int query = nt * 8 + 2 * t + (e & 1);
        p[nt][e] = key_real[e / 2] ? exp2f(p[nt][e] * scale_log2 - sLse[query]) : 0.f;
      }
    }

    // dV += P^T dO: k runs over the 64 queries.
    mma_pb(dv_acc, p, sdO, kStride, lane);

    // dP^T = V dO^T: 16 keys x 64 queries, k runs over the head dim.
    float dpt[kBlockM / 8][4] = {};
    mma_abt(dpt, va, sdO, kStride, lane);

    // dS^T = P^T * (dP^T - D), in place of P^T (softmax_scale comes at the end).
#pragma unroll
    for (int nt = 0; nt < kBlockM / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) p[nt][e] *= dpt[nt][e] - sDsum[nt * 8 + 2 * t + (e & 1)];
    }

    // dK += dS^T Q: k runs over the 64 queries.
    mma_pb(dk_acc, p, sQ, kStride, lane);

    // dS^T to shared memory, rows = this warp's keys: dQ needs all 64 keys of a query.
#pragma unroll
    for (int nt = 0; nt < kBlockM / 8; ++nt) {
#pragma unroll
      for (int i = 0; i < 2; ++i)
        *reinterpret_cast<uint32_t*>(sdS + (warp * 16 + g + 8 * i) * kSStride + nt * 8 + 2 * t) =
            pack2<T>(p[nt][2 * i], p[nt][2 * i + 1]);
    }
    __syncthreads();

    // dQ = dS K for this warp's 16 queries: A = dS read transposed from dS^T, B = K
    // (rows = keys = k); k runs over the tile's 64 keys.
    float dq[HD / 8][4] = {};
#pragma unroll
    for (int j = 0; j < kBlockN / 16; ++j) {
      uint32_t da[4];
      ldmatrix_x4_trans(da, a_cols(sdS, kSStride, warp * 16, j * 16, lane));
      mma_ab_step(dq, da, sK, kStride, j * 16, lane);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = m0 + warp * 16 + g + 8 * i;
      if (row < len) {
        float* dst = dq_accum + base + row * row_stride + 2 * t;
#pragma unroll
        for (int dt = 0; dt < HD / 8; ++dt) {
          atomicAdd(dst + dt * 8, dq[dt][2 * i] * scale);
          atomicAdd(dst + dt * 8 + 1, dq[dt][2 * i + 1] * scale);
        }
      }
    }
  }

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int key = n0 + warp * 16 + g + 8 * i;
    if (key < len) {
      const int64_t at = base + key * row_stride + 2 * t;
#pragma unroll
      for (int dt = 0; dt < HD / 8; ++dt) {
        *reinterpret_cast<uint32_t*>(dk + at + dt * 8) =
            pack2<T>(dk_acc[dt][2 * i] * scale, dk_acc[dt][2 * i + 1] * scale);
        *reinterpret_cast<uint32_t*>(dv + at + dt * 8) = pack2<T>(dv_acc[dt][2 * i], dv_acc[dt][2 * i + 1]);
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(256) convert_kernel(const float* __restrict__ src, T* __restrict__ dst, int64_t n) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) dst[i] = from_float<T>(src[i]);
}

// ---------------------------------------------------------------- launch

// Calls f(T{}, std::integral_constant<int, HD>{}) for the supported dtypes and head dims.
template <typename F>
cudaError_t with_attention_types(int dtype, int head_dim, F&& f) {
  auto with_hd = [&](auto t) -> cudaError_t {
    if (head_dim == 32) return f(t, std::integral_constant<int, 32>{});
    if (head_dim == 64) return f(t, std::integral_constant<int, 64>{});
    return cudaErrorInvalidValue;
  };
  if (dtype == BDS_FLOAT16) return with_hd(__half{});
  if (dtype == BDS_BFLOAT16) return with_hd(__nv_bfloat16{});
  return cudaErrorInvalidValue;
}

bool valid_sizes(int batch, int64_t total, int num_heads, int max_seqlen) {
  return batch >= 0 && batch <= 65535 && total >= 0 && num_heads > 0 && num_heads <= 65535 && max_seqlen >= 0;
}

}  // namespace
}  // namespace bds

using namespace bds;

extern "C" cudaError_t bds_varlen_attention_fwd(const void* q, const void* k, const void* v, const int* cu_seqlens,
                                                void* out, float* lse, int batch, int64_t total, int num_heads,
                                                int head_dim, int max_seqlen, float softmax_scale, int dtype,
                                                cudaStream_t stream) {
  if (!valid_sizes(batch, total, num_heads, max_seqlen)) return cudaErrorInvalidValue;
  return with_attention_types(dtype, head_dim, [&](auto t, auto hd) -> cudaError_t {
    using T = decltype(t);
    constexpr int HD = decltype(hd)::value;
    if (batch == 0 || total == 0 || max_seqlen == 0) return cudaSuccess;
    const dim3 grid((max_seqlen + kBlockM - 1) / kBlockM, batch, num_heads);
    attention_fwd_kernel<T, HD><<<grid, kThreads, 0, stream>>>(
        static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), cu_seqlens,
        static_cast<T*>(out), lse, num_heads, total, softmax_scale * kLog2e);
    return cudaGetLastError();
  });
}

extern "C" cudaError_t bds_varlen_attention_bwd(const void* dout, const void* q, const void* k, const void* v,
                                                const void* out, const float* lse, const int* cu_seqlens,
                                                void* dq, void* dk, void* dv, float* dq_accum, float* dsum,
                                                int batch, int64_t total, int num_heads, int head_dim,
                                                int max_seqlen, float softmax_scale, int dtype,
                                                cudaStream_t stream) {
  if (!valid_sizes(batch, total, num_heads, max_seqlen)) return cudaErrorInvalidValue;
  return with_attention_types(dtype, head_dim, [&](auto t, auto hd) -> cudaError_t {
    using T = decltype(t);
    constexpr int HD = decltype(hd)::value;
    if (batch == 0 || total == 0 || max_seqlen == 0) return cudaSuccess;
    const int64_t elements = total * num_heads * HD;
    cudaError_t err = cudaMemsetAsync(dq_accum, 0, elements * sizeof(float), stream);
    if (err != cudaSuccess) return err;

    const int64_t rows = total * num_heads;
    attention_dsum_kernel<T, HD><<<(unsigned)((rows + kWarps - 1) / kWarps), kThreads, 0, stream>>>(
        static_cast<const T*>(dout), static_cast<const T*>(out), dsum, num_heads, total);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;

    const dim3 grid((max_seqlen + kBlockN - 1) / kBlockN, batch, num_heads);
    attention_bwd_kernel<T, HD><<<grid, kThreads, 0, stream>>>(
        static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
        static_cast<const T*>(dout), lse, dsum, cu_seqlens, dq_accum, static_cast<T*>(dk),
        static_cast<T*>(dv), num_heads, total, softmax_scale, softmax_scale * kLog2e);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;

    const int64_t wanted = (elements + 255) / 256, cap = 16LL * device_sm_count();
    convert_kernel<T><<<(unsigned)(wanted < cap ? wanted : cap), 256, 0, stream>>>(dq_accum, static_cast<T*>(dq),
                                                                                   elements);
    return cudaGetLastError();
  });
}
