// gelu(x + bias), erf or tanh form, forward and backward.
//
// Design:
// - Elementwise and memory-bound, so the only goal is to touch each byte once with
//   wide accesses: 16-byte vectors when the row width and every pointer allow it,
//   scalar accesses otherwise (odd widths such as 1031 still work).
// - Arithmetic in fp32 with the accurate erff/tanhf, whatever the storage dtype.
// - Backward: dx = dy * gelu'(x + bias) and dbias = sum over rows of dx (fp32, the
//   unrounded dx). A block owns 32 column vectors and a slab of rows; its 8 row
//   groups meet in shared memory and the block writes one fp32 partial row; a column
//   sum over the partial rows gives dbias. Deterministic, no atomics.
// - Grids are one wave of resident blocks (the occupancy API): the kernels stride over
//   the rows, so more blocks would only add a tail, and fewer backward row slabs keep
//   the partial sums small.
#include "common.cuh"

namespace bds {
namespace {

constexpr int kFwdThreads = 256;
constexpr int kBwdRowGroups = 8;  // threadIdx.y of the backward: rows handled side by side

// Grid-stride over kVec-element vectors of the flattened (rows, cols) tensor; cols % kVec == 0.
template <typename T, typename BT, int kVec, bool kTanh>
__global__ void __launch_bounds__(kFwdThreads)
bias_gelu_fwd_kernel(const T* __restrict__ x, const BT* __restrict__ bias, T* __restrict__ y,
                     int64_t num_vecs, int vecs_per_row) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < num_vecs; i += stride) {
    const int col = (int)(i % vecs_per_row) * kVec;
    float v[kVec], b[kVec];
    load_floats(x + i * kVec, v);
    load_floats(bias + col, b);
#pragma unroll
    for (int j = 0; j < kVec; ++j) v[j] = gelu<kTanh>(v[j] + b[j]);
    store_floats(y + i * kVec, v);
  }
}

// Block (32, kBwdRowGroups): x picks a column vector, y a row group. grid.x covers the
// columns, grid.y the row slabs; blockIdx.y is the block's row of `parts`.
template <typename T, typename BT, int kVec, bool kTanh>
__global__ void __launch_bounds__(32 * kBwdRowGroups)
bias_gelu_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x, const BT* __restrict__ bias,
                     T* __restrict__ dx, float* __restrict__ parts, int64_t rows, int cols) {
  // partial[r][j * 32 + lane]: element j of lane's vector, as summed by row group r;
  // lane-minor so that both the writes and the final reads are conflict-free.
  __shared__ float partial[kBwdRowGroups][32 * kVec];
  const int col = (blockIdx.x * 32 + threadIdx.x) * kVec;
  float acc[kVec] = {};
  if (col < cols) {
    float b[kVec];
    load_floats(bias + col, b);
    const int64_t row_stride = (int64_t)gridDim.y * kBwdRowGroups;
    for (int64_t row = (int64_t)blockIdx.y * kBwdRowGroups + threadIdx.y; row < rows; row += row_stride) {
      const int64_t offset = row * cols + col;
      float v[kVec], d[kVec];
      load_floats(x + offset, v);
      load_floats(dy + offset, d);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        d[j] *= gelu_grad<kTanh>(v[j] + b[j]);
        acc[j] += d[j];
      }
      store_floats(dx + offset, d);
    }
  }
#pragma unroll
  for (int j = 0; j < kVec; ++j) partial[threadIdx.y][j * 32 + threadIdx.x] = acc[j];
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      float sum = 0.f;
#pragma unroll
      for (int r = 0; r < kBwdRowGroups; ++r) sum += partial[r][j * 32 + threadIdx.x];
      parts[(int64_t)blockIdx.y * cols + col + j] = sum;
    }
  }
}

// ---------------------------------------------------------------- launch

template <typename T, typename BT, int kVec, bool kTanh>
int fwd_blocks(int64_t num_vecs) {
  return one_wave<bias_gelu_fwd_kernel<T, BT, kVec, kTanh>, kFwdThreads>(num_vecs, kFwdThreads);
}

// Row slabs (grid.y) of at least 64 rows (8 per thread), and with the column tiles
// (grid.x) no more blocks than the device holds at once.
template <typename T, typename BT, int kVec, bool kTanh>
int bwd_slabs(int64_t rows, int cols) {
  const int64_t wanted = (rows + 63) / 64;
  const int64_t tiles = (cols + 32 * kVec - 1) / (32 * kVec);
  const int64_t fit = resident_blocks<bias_gelu_bwd_kernel<T, BT, kVec, kTanh>, 32 * kBwdRowGroups>() / tiles;
  const int64_t slabs = wanted < fit ? wanted : fit;
  return (int)(slabs < 1 ? 1 : slabs);
}

template <typename F>
cudaError_t with_dtypes(int dtype, int bias_dtype, F&& f) {
  return with_dtype(dtype, [&](auto t) -> cudaError_t {
    using T = decltype(t);
    if (bias_dtype == dtype) return f(t, T{});
    if (bias_dtype == BDS_FLOAT32) return f(t, float{});
    return cudaErrorInvalidValue;
  });
}

}  // namespace
}  // namespace bds

using namespace bds;

extern "C" cudaError_t bds_bias_gelu_fwd(const void* x, const void* bias, void* y, int64_t rows, int cols,
                                         int tanh_approx, int dtype, int bias_dtype, cudaStream_t stream) {
  if (cols <= 0 || rows < 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  return with_dtypes(dtype, bias_dtype, [&](auto t, auto bt) -> cudaError_t {
    using T = decltype(t);
    using BT = decltype(bt);
    constexpr int kWide = 16 / sizeof(T);
    const bool wide = cols % kWide == 0 && all_aligned({x, bias, y});
    return with_gelu_shape<kWide>(wide, tanh_approx != 0, [&](auto vec, auto tanh_form) -> cudaError_t {
      constexpr int kVec = decltype(vec)::value;
      const int64_t num_vecs = rows * cols / kVec;
      const dim3 grid(fwd_blocks<T, BT, kVec, decltype(tanh_form)::value>(num_vecs));
      bias_gelu_fwd_kernel<T, BT, kVec, decltype(tanh_form)::value><<<grid, kFwdThreads, 0, stream>>>(
          static_cast<const T*>(x), static_cast<const BT*>(bias), static_cast<T*>(y), num_vecs, cols / kVec);
      return cudaGetLastError();
    });
  });
}

extern "C" int bds_bias_gelu_bwd_parts(int64_t rows, int cols) {
  // Asked before the dtypes and pointers are known: the most row slabs any dtype pair and
  // GELU form takes at this size with aligned tensors. A misaligned call's scalar kernel
  // runs within the same workspace (the launcher caps its slabs at `parts`).
  int slabs = 1;
  for (const int dtype : {BDS_FLOAT32, BDS_FLOAT16, BDS_BFLOAT16}) {
    for (const int bias_dtype : {dtype, (int)BDS_FLOAT32}) {
      for (const bool tanh_approx : {false, true}) {
        with_dtypes(dtype, bias_dtype, [&](auto t, auto bt) -> cudaError_t {
          using T = decltype(t);
          using BT = decltype(bt);
          constexpr int kWide = 16 / sizeof(T);
          return with_gelu_shape<kWide>(cols % kWide == 0, tanh_approx, [&](auto vec, auto tanh_form) -> cudaError_t {
            const int s = bwd_slabs<T, BT, decltype(vec)::value, decltype(tanh_form)::value>(rows, cols);
            slabs = s > slabs ? s : slabs;
            return cudaSuccess;
          });
        });
      }
    }
  }
  return slabs;
}

extern "C" cudaError_t bds_bias_gelu_bwd(const void* dy, const void* x, const void* bias, void* dx, void* dbias,
                                         float* workspace, int parts, int64_t rows, int cols, int tanh_approx,
                                         int dtype, int bias_dtype, cudaStream_t stream) {
  if (cols <= 0 || rows < 0 || parts < 1) return cudaErrorInvalidValue;
  return with_dtypes(dtype, bias_dtype, [&](auto t, auto bt) -> cudaError_t {
    using T = decltype(t);
    using BT = decltype(bt);
    constexpr int kWide = 16 / sizeof(T);
    const bool wide = cols % kWide == 0 && all_aligned({dy, x, bias, dx});
    return with_gelu_shape<kWide>(wide, tanh_approx != 0, [&](auto vec, auto tanh_form) -> cudaError_t {
      constexpr int kVec = decltype(vec)::value;
      constexpr bool kTanh = decltype(tanh_form)::value;
      const int cols_per_block = 32 * kVec;
      const int slabs = bwd_slabs<T, BT, kVec, kTanh>(rows, cols);
      const dim3 grid((cols + cols_per_block - 1) / cols_per_block, slabs < parts ? slabs : parts);
      const dim3 block(32, kBwdRowGroups);
      bias_gelu_bwd_kernel<T, BT, kVec, kTanh><<<grid, block, 0, stream>>>(
          static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const BT*>(bias),
          static_cast<T*>(dx), workspace, rows, cols);
      const cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) return err;
      return column_sum(workspace, (int)grid.y, cols, static_cast<BT*>(dbias), stream);  // the slabs written
    });
  });
}
