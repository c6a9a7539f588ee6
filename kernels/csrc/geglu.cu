// GeGLU, gelu(input) * gate (erf or tanh form), forward and backward: ModernBERT's MLP activation.
//
// Design:
// - x is the MLP's Wi projection, (rows, 2 * cols): row r's input is x[r, :cols] and its gate
//   x[r, cols:], as transformers' `Wi(x).chunk(2, dim=-1)` splits it. The kernels read both
//   halves in place (the model copies neither), and the backward writes d_input and d_gate into
//   one (rows, 2 * cols) gradient laid out as x, which Wi's GEMM backward reads whole (no cat).
// - Elementwise and memory-bound: each byte is touched once, with 16-byte vectors when cols and
//   every pointer allow it (cols a multiple of the vector width puts both halves of every row on
//   a vector boundary), scalar accesses otherwise (odd widths such as 1031 still work).
// - Arithmetic in fp32 with the accurate erff/tanhf (common.cuh's GELU, which bias + GELU shares),
//   one rounding to the storage dtype per output. The backward takes gelu(input) and gelu'(input)
//   from one erff/tanhf.
// - No reduction (there is no bias): no workspace, no atomics, one kernel each way.
// - Grids are one wave of resident blocks (the occupancy API) striding over the vectors. A
//   thread's vectors lie a fixed number of rows and columns apart, so it steps its (row, column)
//   by that stride instead of dividing a 64-bit index by the row width per vector.
#include "common.cuh"

namespace bds {
namespace {

constexpr int kThreads = 256;

// The vectors i, i + stride, i + 2 stride, ... of a (rows, cols) tensor read kVec elements at a
// time, i = this thread's index in the grid, as (row, first column) pairs.
struct VectorWalk {
  int64_t row;
  int col;
  int64_t row_step;  // whole rows in the grid's stride
  int col_step;      // and the columns beyond them
  int cols;

  template <int kVec>
  __device__ static VectorWalk start(int cols) {
    const int64_t vecs_per_row = cols / kVec;
    const int64_t first = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    return {first / vecs_per_row, (int)(first % vecs_per_row) * kVec, stride / vecs_per_row,
            (int)(stride % vecs_per_row) * kVec, cols};
  }

  __device__ void next() {
    row += row_step;
    col += col_step;  // both below cols: one wrap at most
    if (col >= cols) {
      col -= cols;
      ++row;
    }
  }
};

// y[r, c] = gelu(x[r, c]) * x[r, cols + c]; cols % kVec == 0.
template <typename T, int kVec, bool kTanh>
__global__ void __launch_bounds__(kThreads)
geglu_fwd_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int cols) {
  for (VectorWalk at = VectorWalk::start<kVec>(cols); at.row < rows; at.next()) {
    const T* input = x + at.row * 2 * cols + at.col;  // the gate is cols further on
    float a[kVec], g[kVec];
    load_floats(input, a);
    load_floats(input + cols, g);
#pragma unroll
    for (int j = 0; j < kVec; ++j) a[j] = gelu<kTanh>(a[j]) * g[j];
    store_floats(y + at.row * cols + at.col, a);
  }
}

// dx[r, c] = dy[r, c] * gate * gelu'(input), dx[r, cols + c] = dy[r, c] * gelu(input).
template <typename T, int kVec, bool kTanh>
__global__ void __launch_bounds__(kThreads)
geglu_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ dx, int64_t rows, int cols) {
  for (VectorWalk at = VectorWalk::start<kVec>(cols); at.row < rows; at.next()) {
    const int64_t input = at.row * 2 * cols + at.col;
    float a[kVec], g[kVec], d[kVec];
    load_floats(x + input, a);
    load_floats(x + input + cols, g);
    load_floats(dy + at.row * cols + at.col, d);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const GeluAt h = gelu_at<kTanh>(a[j]);
      a[j] = d[j] * g[j] * h.grad;  // d_input
      g[j] = d[j] * h.value;        // d_gate
    }
    store_floats(dx + input, a);
    store_floats(dx + input + cols, g);
  }
}

// ---------------------------------------------------------------- launch

// Runs launch(T{}, vec, tanh_form) for the dtype code, with 16-byte vectors where cols and every
// pointer allow them.
template <typename F>
cudaError_t with_geglu_shape(int dtype, int cols, bool tanh_approx, std::initializer_list<const void*> pointers,
                             F&& launch) {
  return with_dtype(dtype, [&](auto t) -> cudaError_t {
    constexpr int kWide = 16 / sizeof(decltype(t));
    const bool wide = cols % kWide == 0 && all_aligned(pointers);
    return with_gelu_shape<kWide>(wide, tanh_approx, [&](auto vec, auto tanh_form) -> cudaError_t {
      return launch(t, vec, tanh_form);
    });
  });
}

}  // namespace
}  // namespace bds

using namespace bds;

extern "C" cudaError_t bds_geglu_fwd(const void* x, void* y, int64_t rows, int cols, int tanh_approx, int dtype,
                                     cudaStream_t stream) {
  if (cols <= 0 || rows < 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  return with_geglu_shape(dtype, cols, tanh_approx != 0, {x, y}, [&](auto t, auto vec, auto tanh_form) {
    using T = decltype(t);
    constexpr int kVec = decltype(vec)::value;
    constexpr auto kernel = geglu_fwd_kernel<T, kVec, decltype(tanh_form)::value>;
    const int blocks = one_wave<kernel, kThreads>(rows * cols / kVec, kThreads);
    kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const T*>(x), static_cast<T*>(y), rows, cols);
    return cudaGetLastError();
  });
}

extern "C" cudaError_t bds_geglu_bwd(const void* dy, const void* x, void* dx, int64_t rows, int cols, int tanh_approx,
                                     int dtype, cudaStream_t stream) {
  if (cols <= 0 || rows < 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  return with_geglu_shape(dtype, cols, tanh_approx != 0, {dy, x, dx}, [&](auto t, auto vec, auto tanh_form) {
    using T = decltype(t);
    constexpr int kVec = decltype(vec)::value;
    constexpr auto kernel = geglu_bwd_kernel<T, kVec, decltype(tanh_form)::value>;
    const int blocks = one_wave<kernel, kThreads>(rows * cols / kVec, kThreads);
    kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<T*>(dx),
                                            rows, cols);
    return cudaGetLastError();
  });
}
