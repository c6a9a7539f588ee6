// Device helpers shared by the kernels: dtype conversion, vector access, warp
// reductions, the per-column reduction of fp32 partial sums, the launch helpers of the
// row kernels (one warp per row) and the sum of their warps' column partials per CTA, the
// counter-based random numbers of dropout (Philox), GELU and its derivative (bias + GELU, GeGLU),
// the two tensor-core instructions the attention uses (ldmatrix, mma.sync m16n8k16) and
// its shared-memory access (cp.async, ld_shared/st_shared).
//
// Torch-free on purpose: these files build with nvcc alone (kernels/compile_check.py
// runs on CPU-only CI). The PTX helpers are the only inline assembly; everything
// that touches the hardware's fragment layouts goes through them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <initializer_list>
#include <type_traits>

#include "launchers.h"

namespace bds {

constexpr unsigned kFullMask = 0xffffffffu;

// ----------------------------------------------------------------- dtype conversion

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Whether the kernels for a BdsDtype code are compiled in: all of them, except where the CPU
// emulation builds an edited copy of a kernel (tests/kernels: a planted mistake) that its check
// runs in one dtype, BDS_EMULATE_DTYPE: that copy then compiles a third of the instantiations.
constexpr bool compiled_dtype([[maybe_unused]] int dtype) {
#ifdef BDS_EMULATE_DTYPE
  return dtype == BDS_EMULATE_DTYPE;
#else
  return true;
#endif
}

// Calls f(T{}) with the C++ type for a BdsDtype code; unknown codes (and codes not compiled in)
// are an invalid value.
template <typename F>
inline cudaError_t with_dtype(int dtype, F&& f) {
  switch (dtype) {
    case BDS_FLOAT32:
      if constexpr (compiled_dtype(BDS_FLOAT32)) return f(float{});
      break;
    case BDS_FLOAT16:
      if constexpr (compiled_dtype(BDS_FLOAT16)) return f(__half{});
      break;
    case BDS_BFLOAT16:
      if constexpr (compiled_dtype(BDS_BFLOAT16)) return f(__nv_bfloat16{});
      break;
  }
  return cudaErrorInvalidValue;
}

// ----------------------------------------------------------------- vector access

// N elements read or written as one access (16 bytes at most per instruction;
// a 32-byte Vec<float, 8> becomes two). The pointer must be aligned to
// min(16, sizeof(T) * N) bytes: launchers check before choosing a vector width.
template <typename T, int N>
struct __align__((sizeof(T) * N >= 16) ? 16 : sizeof(T) * N) Vec {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ void load_floats(const T* src, float (&out)[N]) {
  const Vec<T, N> packed = *reinterpret_cast<const Vec<T, N>*>(src);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_float(packed.v[i]);
}

template <typename T, int N>
__device__ __forceinline__ void store_floats(T* dst, const float (&in)[N]) {
  Vec<T, N> packed;
#pragma unroll
  for (int i = 0; i < N; ++i) packed.v[i] = from_float<T>(in[i]);
  *reinterpret_cast<Vec<T, N>*>(dst) = packed;
}

inline bool aligned_to(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

inline bool all_aligned(std::initializer_list<const void*> pointers) {
  for (const void* p : pointers)
    if (!aligned_to(p, 16)) return false;
  return true;
}

// ----------------------------------------------------------------- GELU (bias + GELU, GeGLU)

constexpr float kInvSqrt2 = 0.70710678118654752f;     // 1 / sqrt(2)
constexpr float kInvSqrt2Pi = 0.39894228040143268f;   // 1 / sqrt(2 pi)
constexpr float kSqrt2OverPi = 0.79788456080286536f;  // sqrt(2 / pi)
constexpr float kTanhCubic = 0.044715f;

struct GeluAt {
  float value, grad;  // gelu(h) and gelu'(h)
};

// GELU and its derivative at h in fp32 with the accurate erff/tanhf: the erf form, or the tanh
// approximation with kTanh (torch's approximate="tanh"). Both from one erff/tanhf, for a backward
// that needs both (GeGLU's); a caller of one of them leaves the other to dead-code elimination.
template <bool kTanh>
__device__ __forceinline__ GeluAt gelu_at(float h) {
  if (kTanh) {
    const float th = tanhf(kSqrt2OverPi * (h + kTanhCubic * h * h * h));
    return {0.5f * h * (1.f + th),
            0.5f * (1.f + th) + 0.5f * h * (1.f - th * th) * kSqrt2OverPi * (1.f + 3.f * kTanhCubic * h * h)};
  }
  const float one_plus_erf = 1.f + erff(h * kInvSqrt2);
  return {0.5f * h * one_plus_erf, 0.5f * one_plus_erf + h * kInvSqrt2Pi * expf(-0.5f * h * h)};
}

template <bool kTanh>
__device__ __forceinline__ float gelu(float h) { return gelu_at<kTanh>(h).value; }

template <bool kTanh>
__device__ __forceinline__ float gelu_grad(float h) { return gelu_at<kTanh>(h).grad; }

// Calls f(std::integral_constant<int, kVec>, std::integral_constant<bool, kTanh>): kVec = kWide
// (a 16-byte vector) where `wide`, else 1 (scalar accesses); kTanh from tanh_approx.
template <int kWide, typename F>
cudaError_t with_gelu_shape(bool wide, bool tanh_approx, F&& f) {
  if (wide) {
    return tanh_approx ? f(std::integral_constant<int, kWide>{}, std::true_type{})
                       : f(std::integral_constant<int, kWide>{}, std::false_type{});
  }
  return tanh_approx ? f(std::integral_constant<int, 1>{}, std::true_type{})
                     : f(std::integral_constant<int, 1>{}, std::false_type{});
}

// ----------------------------------------------------------------- reductions

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// out[c] = sum over p of parts[p * cols + c], for the fp32 per-block partial sums
// that the backward kernels leave (LayerNorm dw/db and the dense bias's, bias-GELU dbias): a
// few hundred rows at BERT's shapes (one per CTA of a row kernel's register path, one per
// slab of bias + GELU's). Block (8, 32): x walks 8 adjacent columns (one 32-byte sector of a
// row), y splits the rows 32 ways, each thread summing its rows in order and thread
// y = 0 the 32 partial sums in order (deterministic). The narrow tile gives cols / 8
// blocks (96 at BERT-Base's 768) to keep loads in flight on every SM; a 32-wide tile gave
// 24 blocks on an H100's 132 SMs and took 11 us a call (benchmarks/results/H100-2026-11-24).
// Columns from `split` on go to out_hi[c - split]: one launch for two outputs whose partial
// sums share a workspace row (LayerNorm's [dweight | dbias]).
constexpr int kColumnSumCols = 8;
constexpr int kColumnSumRows = 32;

template <typename OutT>
__global__ void __launch_bounds__(kColumnSumCols * kColumnSumRows)
column_sum_kernel(const float* __restrict__ parts, int num_parts, int cols, int split, OutT* __restrict__ out,
                  OutT* __restrict__ out_hi) {
  // Row stride kColumnSumCols: a warp (4 rows of 8 columns) writes 32 distinct banks.
  __shared__ float partial[kColumnSumRows][kColumnSumCols];
  const int col = blockIdx.x * kColumnSumCols + threadIdx.x;
  float sum = 0.f;
  if (col < cols) {
    for (int p = threadIdx.y; p < num_parts; p += kColumnSumRows) sum += parts[(int64_t)p * cols + col];
  }
  partial[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
#pragma unroll
    for (int r = 1; r < kColumnSumRows; ++r) sum += partial[r][threadIdx.x];
    if (col < split) {
      out[col] = from_float<OutT>(sum);
    } else {
      out_hi[col - split] = from_float<OutT>(sum);
    }
  }
}

// Columns [0, split) into out, [split, cols) into out_hi.
template <typename OutT>
inline cudaError_t column_sum(const float* parts, int num_parts, int cols, int split, OutT* out, OutT* out_hi,
                              cudaStream_t stream) {
  const dim3 grid((cols + kColumnSumCols - 1) / kColumnSumCols), block(kColumnSumCols, kColumnSumRows);
  column_sum_kernel<OutT><<<grid, block, 0, stream>>>(parts, num_parts, cols, split, out, out_hi);
  return cudaGetLastError();
}

template <typename OutT>
inline cudaError_t column_sum(const float* parts, int num_parts, int cols, OutT* out, cudaStream_t stream) {
  return column_sum(parts, num_parts, cols, cols, out, static_cast<OutT*>(nullptr), stream);
}

// Streaming multiprocessors of the current device, to size grid-stride grids.
inline int device_sm_count() {
  int device = 0, count = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || count <= 0) {
    cudaGetLastError();  // do not leave a sticky error for the launch check to find
    return 108;          // an A100's count: a reasonable grid if the query fails
  }
  return count;
}

// Blocks of kKernel (kThreads threads each, no dynamic shared memory) the device holds
// at once: the occupancy API's blocks per SM times the SM count. A grid-stride kernel
// launched with at most this many runs in one wave, with no idle tail. Blocks per SM
// are asked once per kernel: they depend only on its registers and shared memory, fixed
// for the process's architecture (a process driving GPUs of two architectures gets the
// first one's figure for both: a different wave count, the same results).
template <auto kKernel, int kThreads>
inline int resident_blocks() {
  static const int per_sm = [] {
    int blocks = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kKernel, kThreads, 0) != cudaSuccess || blocks < 1) {
      cudaGetLastError();  // as in device_sm_count: no sticky error for the launch check
      blocks = 1;
    }
    return blocks;
  }();
  return per_sm * device_sm_count();
}

// ----------------------------------------------------------------- row kernels (LayerNorm and its fusions)

// One warp per row, 4 rows in flight per block.
constexpr int kRowWarpsPerBlock = 4;
constexpr int kRowThreads = kRowWarpsPerBlock * 32;

// The widths whose rows the LayerNorm kernels hold in registers (BERT-Base and -Large).
inline bool register_row_size(int hidden) { return hidden == 768 || hidden == 1024; }

// The register path reads 16-byte vectors: its size, and every tensor 16-byte aligned.
inline bool register_row_path(int hidden, std::initializer_list<const void*> pointers) {
  if (!register_row_size(hidden)) return false;
  for (const void* p : pointers)
    if (p != nullptr && !aligned_to(p, 16)) return false;
  return true;
}

// One block of kThreads per `per_block` of `items`, but at least one and no more blocks than the
// device holds at once (kKernel's occupancy): the grid-stride kernels then run in one wave, with
// no idle tail.
template <auto kKernel, int kThreads>
int one_wave(int64_t items, int per_block) {
  const int64_t wanted = (items + per_block - 1) / per_block;
  const int64_t resident = resident_blocks<kKernel, kThreads>();
  return (int)(wanted < 1 ? 1 : (wanted < resident ? wanted : resident));
}

// The row kernels' wave: a block per kRowWarpsPerBlock rows.
template <auto kKernel>
int one_wave_of_rows(int64_t rows) {
  return one_wave<kKernel, kRowThreads>(rows, kRowWarpsPerBlock);
}

// Calls f(T{}, RT{}, WT{}) for the (input, residual, weight) dtypes: the residual and the
// weights have the input's dtype or are fp32 (autocast with fp32 parameters gives both).
template <typename F>
cudaError_t with_row_dtypes(int dtype, int residual_dtype, int weight_dtype, F&& f) {
  return with_dtype(dtype, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    auto with_weight = [&](auto rt) -> cudaError_t {
      if (weight_dtype == dtype) return f(t, rt, T{});
      if (weight_dtype == BDS_FLOAT32) return f(t, rt, float{});
      return cudaErrorInvalidValue;
    };
    if (residual_dtype == dtype) return with_weight(T{});
    if (residual_dtype == BDS_FLOAT32) return with_weight(float{});
    return cudaErrorInvalidValue;
  });
}

// ----------------------------------------------------------------- counter-based random numbers

// Philox4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy as 1, 2, 3",
// SC 2011; the round and constants of Random123's philox.h): ten rounds of a bijection of a
// 128-bit counter under a 64-bit key, which the key schedule bumps between rounds. Counter-based:
// any element's random word is computed from (key, counter) alone, with no state, so a backward
// pass regenerates the forward's dropout mask instead of storing it. Host and device code: the
// CPU emulation runs it, and its tests hold it to Random123's known answers.
__host__ __device__ __forceinline__ uint4 philox4x32_10(uint4 counter, uint2 key) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;  // the round's multipliers
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;  // the key's bumps (golden ratio, sqrt(3) - 1)
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      key.x += kW0;
      key.y += kW1;
    }
    const uint64_t p0 = (uint64_t)kM0 * counter.x;  // mul.wide: the high and low words of the product
    const uint64_t p1 = (uint64_t)kM1 * counter.z;
    counter = make_uint4((uint32_t)(p1 >> 32) ^ counter.y ^ key.x, (uint32_t)p1,
                         (uint32_t)(p0 >> 32) ^ counter.w ^ key.y, (uint32_t)p0);
  }
  return counter;
}

// Dropout's keep decisions over a flat tensor, from (seed, offset) and the element index e:
// e takes word e % 4 of Philox4x32-10 with key (seed low, seed high) and counter
// (offset / 4 low, high, e / 4 low, high), and is kept iff the uniform (word >> 8) * 2^-24
// is below 1 - p, i.e. (word >> 8) < ceil((1 - p) * 2^24) (1 - p in fp32). The counter's layout
// is torch's for its own Philox streams (the offset low, the subsequence high): an offset drawn
// from torch's CUDA generator, and advanced by 4, reserves the words this call reads.
// `enabled` false (p = 0): no random numbers at all, every element kept unscaled.
struct Dropout {
  uint2 key;
  uint32_t offset_lo, offset_hi;  // offset / 4
  uint32_t keep_below;            // (word >> 8) < keep_below: kept
  float scale;                    // 1 / (1 - p) for a kept element
  bool enabled;

  // p in [0, 1); offset a multiple of 4 (launchers check both).
  static Dropout make(float p, uint64_t seed, uint64_t offset) {
    Dropout d;
    const float keep_p = 1.f - p;
    d.key = make_uint2((uint32_t)seed, (uint32_t)(seed >> 32));
    d.offset_lo = (uint32_t)(offset / 4);
    d.offset_hi = (uint32_t)((offset / 4) >> 32);
    // keep_p * 2^24 is exact in double; the uniforms below it are the integers below its ceiling
    const double bound = (double)keep_p * 16777216.0;
    const uint32_t whole = (uint32_t)bound;
    d.keep_below = whole + ((double)whole < bound ? 1u : 0u);
    d.scale = 1.f / keep_p;
    d.enabled = p > 0.f;
    return d;
  }

  // Bit t: whether element 4 * group + t is kept.
  __host__ __device__ __forceinline__ uint32_t keep4(uint64_t group) const {
    const uint4 r = philox4x32_10(make_uint4(offset_lo, offset_hi, (uint32_t)group, (uint32_t)(group >> 32)), key);
    return (uint32_t)((r.x >> 8) < keep_below) | (uint32_t)((r.y >> 8) < keep_below) << 1 |
           (uint32_t)((r.z >> 8) < keep_below) << 2 | (uint32_t)((r.w >> 8) < keep_below) << 3;
  }

  // Bit j: whether element e + j is kept, for N elements from e, a multiple of 4 (N a multiple of 4).
  template <int N>
  __host__ __device__ __forceinline__ uint32_t keep_bits(int64_t e) const {
    static_assert(N % 4 == 0 && N <= 32, "whole Philox blocks of 4, at most 32 bits");
    uint32_t bits = 0;
#pragma unroll
    for (int t = 0; t < N / 4; ++t) bits |= keep4((uint64_t)(e / 4) + t) << (4 * t);
    return bits;
  }

  // Whether element e is kept (a whole Philox block for one element: the general paths').
  __host__ __device__ __forceinline__ bool keep(int64_t e) const { return (keep4((uint64_t)e / 4) >> (e % 4)) & 1u; }
};

// ----------------------------------------------------------------- tensor cores

// Two floats as the packed 16-bit pair an mma operand register holds: `lo` is the
// element with the smaller column (or row) index, in the low half.
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&pair);
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 pair = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&pair);
}

#ifndef BDS_EMULATE  // tests/kernels/emu provides these for the CPU emulation of the kernels

// Four 8x8 16-bit matrices from shared memory. Lanes 8i..8i+7 give the addresses of
// the 8 rows (16 bytes each) of matrix i; register i of lane l then holds row l/4,
// columns 2(l%4) and 2(l%4)+1 of matrix i. With `.trans`, matrix i is transposed
// on the way: register i holds rows 2(l%4), 2(l%4)+1 of column l/4.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a * b for a 16x16 (row-major) by 16x8 (column-major) product, fp32 accumulators.
// With g = lane / 4 and t = lane % 4:
//   a[0]: A[g][2t..2t+1]    a[1]: A[g+8][2t..2t+1]   a[2]: A[g][2t+8..]   a[3]: A[g+8][2t+8..]
//   b[0]: B[2t..2t+1][g]    b[1]: B[2t+8..2t+9][g]
//   d[0], d[1]: D[g][2t], D[g][2t+1]                d[2], d[3]: D[g+8][2t], D[g+8][2t+1]
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ----------------------------------------------------------------- shared memory (the attention's)
//
// attention.cu touches shared memory only through ldmatrix and these (and block_column_sum,
// below, through ld_shared and st_shared), so that the CPU
// emulation (tests/kernels/emu) can see every access: it lands a cp.async copy only at
// the wait that covers it and reports reads of bytes still in flight and cross-warp
// accesses with no barrier between.

// 16 bytes global -> shared, asynchronously; both addresses 16-byte aligned. valid ==
// false reads nothing (src-size 0) and zero-fills the 16 shared bytes. The bytes may be
// read only after a cp_async_wait that covers the group they were committed in. .cg:
// cached in L2 only, since a tile is read once per CTA.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(src_bytes)
               : "memory");
}

// Closes this thread's current group of copies.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Returns when at most N of this thread's committed groups are still in flight. The
// memory clobber keeps the compiler from moving shared-memory reads above it.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Declares that the kernel runs with kBytes of dynamic shared memory (`extern __shared__`),
// which its launcher passes and, above 48 KB, opts in to with cudaFuncSetAttribute. ptxas
// reports only static shared memory, so the figure goes into the PTX as a comment,
// `// bds.dynamic_smem <kBytes>`, for kernels/inspect.py's occupancy; it costs no
// instruction. The emulation checks that the launch gave at least this much.
template <int kBytes>
__device__ __forceinline__ void declare_dynamic_smem() {
  asm volatile("// bds.dynamic_smem %0" ::"n"(kBytes));
}

template <typename V>
__device__ __forceinline__ V ld_shared(const V* p) {
  return *p;
}
template <typename V>
__device__ __forceinline__ void st_shared(V* p, const V& v) {
  *p = v;
}

#endif  // BDS_EMULATE

// ----------------------------------------------------------------- the row kernels' column partials

// The end of a register-path backward kernel (LayerNorm's, dropout + LayerNorm's): each lane
// holds, in sums[i][j], its warp's sum over the warp's rows of column (32 i + lane) * kVec + j
// of one per-column gradient (H columns). The CTA adds its warps' sums in warp order (fixed:
// deterministic, no atomics) and writes them to out[0, H), its row of the workspace that
// column_sum reduces: one row per CTA, not per warp, a quarter of the partial sums to write and
// read back. `stage` is the CTA's shared memory, one H-wide fp32 row per warp, reused by each
// gradient in turn; it is reached through st_shared/ld_shared, so the CPU emulation checks the
// barriers around it. Every thread of the CTA must call this, and in the same order.
template <int H, int kPerLane, int kVec>
__device__ __forceinline__ void block_column_sum(float (&stage)[kRowWarpsPerBlock][H],
                                                 const float (&sums)[kPerLane][kVec], float* __restrict__ out) {
  static_assert(kPerLane * 32 * kVec == H, "a warp's lanes hold the H columns");
  static_assert(kVec % 4 == 0 && H % kRowThreads == 0, "16-byte shared stores; whole columns per thread");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i)
#pragma unroll
    for (int j = 0; j < kVec; j += 4)
      st_shared(reinterpret_cast<float4*>(&stage[warp][(i * 32 + lane) * kVec + j]),
                make_float4(sums[i][j], sums[i][j + 1], sums[i][j + 2], sums[i][j + 3]));
  __syncthreads();
#pragma unroll
  for (int k = 0; k < H / kRowThreads; ++k) {
    const int col = k * kRowThreads + threadIdx.x;  // a warp reads and writes 32 adjacent columns
    float total = ld_shared(&stage[0][col]);
#pragma unroll
    for (int w = 1; w < kRowWarpsPerBlock; ++w) total += ld_shared(&stage[w][col]);
    out[col] = total;
  }
  __syncthreads();  // before the next gradient's sums overwrite the stage
}

}  // namespace bds
