// Torch bindings of the fused kernels: the extension module `bert_ds_kernels`.
//
// Each function is one forward or backward pass; the autograd Functions that pair
// them live in kernels/<op>.py. Every function here
//   - checks that tensors are CUDA tensors on one device, with supported dtypes and
//     consistent shapes (TORCH_CHECK: a RuntimeError, ValueError for a bad value);
//   - takes strided inputs and makes them contiguous explicitly (a no-op when they
//     already are; otherwise one copy), so callers may pass views. The attention also
//     copies a contiguous input whose data is not 16-byte aligned (a view at an odd
//     offset), because its kernels read 16-byte vectors. q, k and v laid out alike with a
//     token stride of their own (views of one packed (tokens, 3, heads, head_dim)
//     projection) are read in place: the kernels take that stride;
//   - queues the launchers on the current stream of the inputs' device, with the GIL
//     released, and raises a RuntimeError naming the CUDA error if a launch fails.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
// ATen and the Python binding alone: <torch/extension.h> adds the whole C++ frontend
// (torch/all.h: nn, optim, data), which nothing here uses and which took a third of the
// file's compile (69 -> 44 s on a 2-core CPU)
#include <ATen/ATen.h>
#include <torch/python.h>

#include <cmath>
#include <limits>
#include <vector>

#include "launchers.h"

#ifndef BDS_SOURCE_HASH
#define BDS_SOURCE_HASH unknown
#endif
#define BDS_STRINGIFY_(x) #x
#define BDS_STRINGIFY(x) BDS_STRINGIFY_(x)

namespace {

int dtype_code(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return BDS_FLOAT32;
    case at::kHalf: return BDS_FLOAT16;
    case at::kBFloat16: return BDS_BFLOAT16;
    default: TORCH_CHECK(false, "unsupported dtype ", type, " (float32, float16 or bfloat16)");
  }
  return -1;
}

void check_cuda(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got one on ", t.device());
  TORCH_CHECK(t.device() == device, name, " is on ", t.device(), " but the other inputs are on ", device);
}

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, " failed: ", cudaGetErrorString(err), " (", static_cast<int>(err), ")");
}

at::Tensor aligned_contiguous(const at::Tensor& t) {
  at::Tensor out = t.contiguous();
  if (reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 != 0) out = out.clone();
  return out;
}

int checked_int(int64_t value, const char* what) {
  TORCH_CHECK(value <= std::numeric_limits<int>::max(), what, " (", value, ") does not fit in 32 bits");
  return static_cast<int>(value);
}

// ---------------------------------------------------------------- LayerNorm(x + residual)

void check_layer_norm_params(const at::Tensor& x, const at::Tensor& weight, const char* weight_name) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "x must have a non-empty last dimension, got shape ", x.sizes());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), weight_name, " must have shape (",
              x.size(-1), ",), got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat, weight_name,
              " must have x's dtype (", x.scalar_type(), ") or float32, got ", weight.scalar_type());
}

// The residual may be fp32 under fp16/bf16 x: autocast over fp32 parameters produces that.
void check_residual(const at::Tensor& residual, const at::Tensor& x) {
  check_cuda(residual, "residual", x.device());
  TORCH_CHECK(residual.sizes() == x.sizes(), "residual must have x's shape ", x.sizes(), ", got ", residual.sizes());
  TORCH_CHECK(residual.scalar_type() == x.scalar_type() || residual.scalar_type() == at::kFloat,
              "residual must have x's dtype (", x.scalar_type(), ") or float32, got ", residual.scalar_type());
}

int residual_code(const at::Tensor& residual, const at::Tensor& x) {
  return dtype_code(residual.defined() ? residual.scalar_type() : x.scalar_type());
}

// A row-normalising forward's shape and outputs: y like x, each row's mean and rstd in fp32.
struct RowNormOutputs {
  int hidden;
  int64_t rows;
  at::Tensor y, mean, rstd;
};

RowNormOutputs row_norm_outputs(const at::Tensor& x) {
  const int hidden = checked_int(x.size(-1), "hidden size");
  const int64_t rows = x.numel() / hidden;
  const auto stats = x.options().dtype(at::kFloat);
  return {hidden, rows, at::empty_like(x), at::empty({rows}, stats), at::empty({rows}, stats)};
}

// bias may be None: a LayerNorm without one (ModernBERT's).
std::vector<at::Tensor> layer_norm_fwd(const at::Tensor& x_in, const at::Tensor& weight_in,
                                       const c10::optional<at::Tensor>& bias_in,
                                       const c10::optional<at::Tensor>& residual_in, double eps) {
  const at::Device device = x_in.device();
  check_cuda(x_in, "x", device);
  check_cuda(weight_in, "weight", device);
  if (bias_in) check_cuda(*bias_in, "bias", device);
  check_layer_norm_params(x_in, weight_in, "weight");
  if (bias_in)
    TORCH_CHECK(bias_in->sizes() == weight_in.sizes() && bias_in->scalar_type() == weight_in.scalar_type(),
                "bias must match weight in shape and dtype");
  if (residual_in) check_residual(*residual_in, x_in);
  const c10::cuda::CUDAGuard guard(device);
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  const at::Tensor bias = bias_in ? bias_in->contiguous() : at::Tensor();
  const at::Tensor residual = residual_in ? residual_in->contiguous() : at::Tensor();
  auto [hidden, rows, y, mean, rstd] = row_norm_outputs(x);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaError_t err;
  {
    pybind11::gil_scoped_release no_gil;
    err = bds_layer_norm_fwd(x.data_ptr(), residual.defined() ? residual.data_ptr() : nullptr, weight.data_ptr(),
                             bias.defined() ? bias.data_ptr() : nullptr, y.data_ptr(), mean.data_ptr<float>(),
                             rstd.data_ptr<float>(), rows, hidden, static_cast<float>(eps),
                             dtype_code(x.scalar_type()), residual_code(residual, x),
                             dtype_code(weight.scalar_type()), stream);
  }
  check_launch(err, "layer_norm forward");
  return {y, mean, rstd};
}

// Returns (dx, dweight, dbias, dresidual): dresidual is dx itself when the residual has x's
// dtype, the same values in fp32 for an fp32 residual, undefined (None) without a residual; dbias
// is undefined (None) where with_bias is false (a LayerNorm without a bias: none is computed).
std::vector<at::Tensor> layer_norm_bwd(const at::Tensor& dy_in, const at::Tensor& x_in,
                                       const c10::optional<at::Tensor>& residual_in, const at::Tensor& weight_in,
                                       const at::Tensor& mean, const at::Tensor& rstd, bool with_bias) {
  const at::Device device = x_in.device();
  check_cuda(dy_in, "dy", device);
  check_cuda(x_in, "x", device);
  check_cuda(weight_in, "weight", device);
  check_cuda(mean, "mean", device);
  check_cuda(rstd, "rstd", device);
  check_layer_norm_params(x_in, weight_in, "weight");
  TORCH_CHECK(dy_in.sizes() == x_in.sizes() && dy_in.scalar_type() == x_in.scalar_type(),
              "dy must match x in shape and dtype");
  const int hidden = checked_int(x_in.size(-1), "hidden size");
  const int64_t rows = x_in.numel() / hidden;
  TORCH_CHECK(mean.scalar_type() == at::kFloat && rstd.scalar_type() == at::kFloat && mean.numel() == rows &&
                  rstd.numel() == rows,
              "mean and rstd must be float32 with one value per row (the forward's outputs)");
  if (residual_in) check_residual(*residual_in, x_in);
  const c10::cuda::CUDAGuard guard(device);
  const at::Tensor dy = dy_in.contiguous(), x = x_in.contiguous(), weight = weight_in.contiguous();
  const at::Tensor residual = residual_in ? residual_in->contiguous() : at::Tensor();
  const at::Tensor mean_c = mean.contiguous(), rstd_c = rstd.contiguous();
  const int parts = bds_layer_norm_bwd_parts(rows, hidden);
  const int64_t grads = with_bias ? 2 : 1;  // workspace rows of [dweight | dbias], or of [dweight]
  at::Tensor workspace = at::empty({grads * parts * hidden}, x.options().dtype(at::kFloat));
  at::Tensor dx = at::empty_like(x);
  const bool separate_dresidual = residual.defined() && residual.scalar_type() != x.scalar_type();
  at::Tensor dresidual = separate_dresidual ? at::empty_like(residual) : at::Tensor();
  at::Tensor dweight = at::empty_like(weight), dbias = with_bias ? at::empty_like(weight) : at::Tensor();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaError_t err;
  {
    pybind11::gil_scoped_release no_gil;
    err = bds_layer_norm_bwd(dy.data_ptr(), x.data_ptr(), residual.defined() ? residual.data_ptr() : nullptr,
                             weight.data_ptr(), mean_c.data_ptr<float>(), rstd_c.data_ptr<float>(), dx.data_ptr(),
                             separate_dresidual ? dresidual.data_ptr() : nullptr, dweight.data_ptr(),
                             with_bias ? dbias.data_ptr() : nullptr, workspace.data_ptr<float>(), parts, rows, hidden,
                             dtype_code(x.scalar_type()), residual_code(residual, x),
                             dtype_code(weight.scalar_type()), stream);
  }
  check_launch(err, "layer_norm backward");
  if (residual.defined() && !separate_dresidual) dresidual = dx;
  return {dx, dweight, dbias, dresidual};
}

// ---------------------------------------------------------------- LayerNorm(dropout(x + bias) + residual)

// The forward's and backward's common checks: x, residual (x's dtype or fp32, x's shape), weight
// (x's dtype or fp32) and bias (may be undefined), which must match weight in shape and dtype.
void check_dropout_layer_norm(const at::Tensor& x, const c10::optional<at::Tensor>& bias, const at::Tensor& residual,
                              const at::Tensor& weight, double dropout_p, uint64_t offset) {
  const at::Device device = x.device();
  check_cuda(x, "x", device);
  if (bias) check_cuda(*bias, "bias", device);
  check_residual(residual, x);
  check_cuda(weight, "weight", device);
  check_layer_norm_params(x, weight, "weight");
  if (bias)
    TORCH_CHECK(bias->sizes() == weight.sizes() && bias->scalar_type() == weight.scalar_type(),
                "bias must match weight in shape and dtype, got ", bias->scalar_type(), " of shape ", bias->sizes());
  TORCH_CHECK_VALUE(dropout_p >= 0.0 && dropout_p < 1.0, "dropout_p must be in [0, 1), got ", dropout_p);
  TORCH_CHECK_VALUE(offset % 4 == 0, "the Philox offset must be a multiple of 4, got ", offset);
}

// Returns (y, mean, rstd). keep_out (bool, x's shape, contiguous): where given, the kernel writes
// its dropout mask there (true: kept), for tests.
std::vector<at::Tensor> dropout_layer_norm_fwd(const at::Tensor& x_in, const c10::optional<at::Tensor>& bias_in,
                                               const at::Tensor& residual_in, const at::Tensor& weight_in,
                                               const at::Tensor& ln_bias_in, double eps, double dropout_p,
                                               uint64_t seed, uint64_t offset,
                                               const c10::optional<at::Tensor>& keep_out) {
  check_dropout_layer_norm(x_in, bias_in, residual_in, weight_in, dropout_p, offset);
  const at::Device device = x_in.device();
  check_cuda(ln_bias_in, "ln_bias", device);
  TORCH_CHECK(ln_bias_in.sizes() == weight_in.sizes() && ln_bias_in.scalar_type() == weight_in.scalar_type(),
              "ln_bias must match weight in shape and dtype");
  if (keep_out) {
    check_cuda(*keep_out, "keep_out", device);
    TORCH_CHECK(keep_out->scalar_type() == at::kBool && keep_out->sizes() == x_in.sizes() &&
                    keep_out->is_contiguous(),
                "keep_out must be a contiguous bool tensor of x's shape ", x_in.sizes(), ", got ",
                keep_out->scalar_type(), " of shape ", keep_out->sizes());
  }
  const c10::cuda::CUDAGuard guard(device);
  const at::Tensor x = x_in.contiguous(), residual = residual_in.contiguous(), weight = weight_in.contiguous();
  const at::Tensor ln_bias = ln_bias_in.contiguous();
  const at::Tensor bias = bias_in ? bias_in->contiguous() : at::Tensor();
  auto [hidden, rows, y, mean, rstd] = row_norm_outputs(x);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaError_t err;
  {
    pybind11::gil_scoped_release no_gil;
    err = bds_dropout_layer_norm_fwd(
        x.data_ptr(), bias.defined() ? bias.data_ptr() : nullptr, residual.data_ptr(), weight.data_ptr(),
        ln_bias.data_ptr(), y.data_ptr(), mean.data_ptr<float>(), rstd.data_ptr<float>(),
        keep_out ? static_cast<uint8_t*>(keep_out->data_ptr()) : nullptr, rows, hidden, static_cast<float>(eps),
        static_cast<float>(dropout_p), seed, offset, dtype_code(x.scalar_type()), dtype_code(residual.scalar_type()),
        dtype_code(weight.scalar_type()), stream);
  }
  check_launch(err, "dropout_layer_norm forward");
  return {y, mean, rstd};
}

// Returns (dx, dbias, dresidual, dweight, dln_bias); dbias is undefined (None) without a bias.
// (dropout_p, seed, offset) must be the forward's: they regenerate its mask.
std::vector<at::Tensor> dropout_layer_norm_bwd(const at::Tensor& dy_in, const at::Tensor& x_in,
                                               const c10::optional<at::Tensor>& bias_in,
                                               const at::Tensor& residual_in, const at::Tensor& weight_in,
                                               const at::Tensor& mean, const at::Tensor& rstd, double dropout_p,
                                               uint64_t seed, uint64_t offset) {
  check_dropout_layer_norm(x_in, bias_in, residual_in, weight_in, dropout_p, offset);
  const at::Device device = x_in.device();
  check_cuda(dy_in, "dy", device);
  check_cuda(mean, "mean", device);
  check_cuda(rstd, "rstd", device);
  TORCH_CHECK(dy_in.sizes() == x_in.sizes() && dy_in.scalar_type() == x_in.scalar_type(),
              "dy must match x in shape and dtype");
  const int hidden = checked_int(x_in.size(-1), "hidden size");
  const int64_t rows = x_in.numel() / hidden;
  TORCH_CHECK(mean.scalar_type() == at::kFloat && rstd.scalar_type() == at::kFloat && mean.numel() == rows &&
                  rstd.numel() == rows,
              "mean and rstd must be float32 with one value per row (the forward's outputs)");
  const c10::cuda::CUDAGuard guard(device);
  const at::Tensor dy = dy_in.contiguous(), x = x_in.contiguous(), residual = residual_in.contiguous();
  const at::Tensor weight = weight_in.contiguous(), mean_c = mean.contiguous(), rstd_c = rstd.contiguous();
  const at::Tensor bias = bias_in ? bias_in->contiguous() : at::Tensor();
  const int parts = bds_dropout_layer_norm_bwd_parts(rows, hidden);
  at::Tensor workspace = at::empty({3 * (int64_t)parts * hidden}, x.options().dtype(at::kFloat));
  at::Tensor dx = at::empty_like(x), dresidual = at::empty_like(residual);
  at::Tensor dparams = at::empty({3, hidden}, weight.options());  // dweight, dln_bias, dbias
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaError_t err;
  {
    pybind11::gil_scoped_release no_gil;
    err = bds_dropout_layer_norm_bwd(dy.data_ptr(), x.data_ptr(), bias.defined() ? bias.data_ptr() : nullptr,
                                     residual.data_ptr(), weight.data_ptr(), mean_c.data_ptr<float>(),
                                     rstd_c.data_ptr<float>(), dx.data_ptr(), dresidual.data_ptr(),
                                     dparams.data_ptr(), workspace.data_ptr<float>(), parts, rows, hidden,
                                     static_cast<float>(dropout_p), seed, offset, dtype_code(x.scalar_type()),
                                     dtype_code(residual.scalar_type()), dtype_code(weight.scalar_type()), stream);
  }
  check_launch(err, "dropout_layer_norm backward");
  return {dx, bias.defined() ? dparams[2] : at::Tensor(), dresidual, dparams[0], dparams[1]};
}

// ---------------------------------------------------------------- gelu(x + bias)

void check_bias_gelu(const at::Tensor& x, const at::Tensor& bias) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "x must have a non-empty last dimension, got shape ", x.sizes());
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) == x.size(-1), "bias must have shape (", x.size(-1), ",), got ",
              bias.sizes());
  TORCH_CHECK(bias.scalar_type() == x.scalar_type() || bias.scalar_type() == at::kFloat,
              "bias must have x's dtype (", x.scalar_type(), ") or float32, got ", bias.scalar_type());
}

at::Tensor bias_gelu_fwd(const at::Tensor& x_in, const at::Tensor& bias_in, bool tanh_approx) {
  const at::Device device = x_in.device();
  check_cuda(x_in, "x", device);
  check_cuda(bias_in, "bias", device);
  check_bias_gelu(x_in, bias_in);
  const c10::cuda::CUDAGuard guard(device);
  const at::Tensor x = x_in.contiguous(), bias = bias_in.contiguous();
  const int cols = checked_int(x.size(-1), "width");
  at::Tensor y = at::empty_like(x);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaError_t err;
  {
    pybind11::gil_scoped_release no_gil;
    err = bds_bias_gelu_fwd(x.data_ptr(), bias.data_ptr(), y.data_ptr(), x.numel() / cols, cols, tanh_approx,
                            dtype_code(x.scalar_type()), dtype_code(bias.scalar_type()), stream);
  }
  check_launch(err, "bias_gelu forward");
  return y;
}

// Returns (dx, dbias).
std::vector<at::Tensor> bias_gelu_bwd(const at::Tensor& dy_in, const at::Tensor& x_in, const at::Tensor& bias_in,
                                      bool tanh_approx) {
  const at::Device device = x_in.device();
  check_cuda(dy_in, "dy", device);
  check_cuda(x_in, "x", device);
  check_cuda(bias_in, "bias", device);
  check_bias_gelu(x_in, bias_in);
  TORCH_CHECK(dy_in.sizes() == x_in.sizes() && dy_in.scalar_type() == x_in.scalar_type(),
              "dy must match x in shape and dtype");
  const c10::cuda::CUDAGuard guard(device);
  const at::Tensor dy = dy_in.contiguous(), x = x_in.contiguous(), bias = bias_in.contiguous();
  const int cols = checked_int(x.size(-1), "width");
  const int64_t rows = x.numel() / cols;
  const int parts = bds_bias_gelu_bwd_parts(rows, cols);
  at::Tensor workspace = at::empty({(int64_t)parts * cols}, x.options().dtype(at::kFloat));
  at::Tensor dx = at::empty_like(x), dbias = at::empty_like(bias);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaError_t err;
  {
    pybind11::gil_scoped_release no_gil;
    err = bds_bias_gelu_bwd(dy.data_ptr(), x.data_ptr(), bias.data_ptr(), dx.data_ptr(), dbias.data_ptr(),
                            workspace.data_ptr<float>(), parts, rows, cols, tanh_approx, dtype_code(x.scalar_type()),
                            dtype_code(bias.scalar_type()), stream);
  }
  check_launch(err, "bias_gelu backward");
  return {dx, dbias};
}

// ---------------------------------------------------------------- gelu(input) * gate (GeGLU)

// x (..., 2 * cols): each row's input half, then its gate half. Returns cols.
int geglu_width(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0 && x.size(-1) % 2 == 0,
              "x must end in an input half and a gate half (an even, non-empty last dimension), got shape ",
              x.sizes());
  return checked_int(x.size(-1) / 2, "GeGLU width");
}

// Returns y (..., cols).
at::Tensor geglu_fwd(const at::Tensor& x_in, bool tanh_approx) {
  check_cuda(x_in, "x", x_in.device());
  const int cols = geglu_width(x_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = cols;
  at::Tensor y = at::empty(shape, x.options());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaError_t err;
  {
    pybind11::gil_scoped_release no_gil;
    err = bds_geglu_fwd(x.data_ptr(), y.data_ptr(), y.numel() / cols, cols, tanh_approx,
                        dtype_code(x.scalar_type()), stream);
  }
  check_launch(err, "geglu forward");
  return y;
}

// Returns dx, laid out as x (contiguous): the input half's gradient, then the gate half's.
at::Tensor geglu_bwd(const at::Tensor& dy_in, const at::Tensor& x_in, bool tanh_approx) {
  const at::Device device = x_in.device();
  check_cuda(dy_in, "dy", device);
  check_cuda(x_in, "x", device);
  const int cols = geglu_width(x_in);
  TORCH_CHECK(dy_in.scalar_type() == x_in.scalar_type() && dy_in.dim() == x_in.dim() && dy_in.size(-1) == cols &&
                  dy_in.sizes().slice(0, dy_in.dim() - 1) == x_in.sizes().slice(0, x_in.dim() - 1),
              "dy must have x's dtype and shape with its last dimension halved, got ", dy_in.scalar_type(),
              " of shape ", dy_in.sizes(), " for x of shape ", x_in.sizes());
  const c10::cuda::CUDAGuard guard(device);
  const at::Tensor dy = dy_in.contiguous(), x = x_in.contiguous();
  at::Tensor dx = at::empty_like(x);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaError_t err;
  {
    pybind11::gil_scoped_release no_gil;
    err = bds_geglu_bwd(dy.data_ptr(), x.data_ptr(), dx.data_ptr(), dy.numel() / cols, cols, tanh_approx,
                        dtype_code(x.scalar_type()), stream);
  }
  check_launch(err, "geglu backward");
  return dx;
}

// ---------------------------------------------------------------- varlen attention

void check_attention_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cu_seqlens, int64_t max_seqlen) {
  const at::Device device = q.device();
  check_cuda(q, "q", device);
  check_cuda(k, "k", device);
  check_cuda(v, "v", device);
  check_cuda(cu_seqlens, "cu_seqlens", device);
  TORCH_CHECK(q.dim() == 3, "q must be (total_tokens, num_heads, head_dim), got shape ", q.sizes());
  TORCH_CHECK(k.sizes() == q.sizes() && v.sizes() == q.sizes(), "q, k and v must have one shape, got ", q.sizes(),
              ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
              "the fused attention takes float16 or bfloat16, got ", q.scalar_type());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "q, k and v must have one dtype");
  TORCH_CHECK(q.size(2) == 32 || q.size(2) == 64, "the fused attention takes head_dim 32 or 64, got ", q.size(2));
  TORCH_CHECK(q.size(1) >= 1 && q.size(1) <= 65535, "num_heads must be in [1, 65535], got ", q.size(1));
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 1 && cu_seqlens.numel() - 1 <= 65535 &&
                  cu_seqlens.scalar_type() == at::kInt,
              "cu_seqlens must be a 1-D int32 tensor of batch + 1 <= 65536 offsets, got ", cu_seqlens.scalar_type(),
              " of shape ", cu_seqlens.sizes());
  TORCH_CHECK(max_seqlen >= 0 && max_seqlen <= std::numeric_limits<int>::max(), "max_seqlen must be >= 0, got ",
              max_seqlen);
  TORCH_CHECK(q.size(0) <= std::numeric_limits<int>::max(), "more than 2^31 tokens");
}

// q, k and v as the kernels read them: as they are where they are views of one packed
// projection, or any tensors laid out alike (heads contiguous, every token `stride` elements
// after the one before: a multiple of 8, rows 16-byte aligned); otherwise contiguous copies.
struct AttentionInputs {
  at::Tensor q, k, v;
  int64_t stride;
};

AttentionInputs attention_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t heads = q.size(1), head_dim = q.size(2), stride = q.stride(0);
  auto readable = [&](const at::Tensor& t) {
    return t.stride(2) == 1 && t.stride(1) == head_dim && t.stride(0) == stride &&
           reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  };
  if (stride >= heads * head_dim && stride % 8 == 0 && readable(q) && readable(k) && readable(v))
    return {q, k, v, stride};
  return {aligned_contiguous(q), aligned_contiguous(k), aligned_contiguous(v), heads * head_dim};
}

// Which keys a query sees and how q, k are rotated, as the launchers take them: window < 0
// (every key) or the tokens on each side (a window wider than any sequence sees what one of
// INT_MAX does); rope_theta 0 (no rotation) or a finite positive rotary base.
struct AttentionOptions {
  int window;
  float rope_theta;
};

AttentionOptions attention_options(int64_t window, double rope_theta) {
  TORCH_CHECK_VALUE(rope_theta == 0.0 || (std::isfinite(rope_theta) && rope_theta > 0.0 &&
                                          rope_theta <= std::numeric_limits<float>::max()),
                    "rope_theta must be 0 (no rotary embeddings) or a finite positive base, got ", rope_theta);
  const int64_t widest = std::numeric_limits<int>::max();
  return {window < 0 ? -1 : (int)(window < widest ? window : widest), static_cast<float>(rope_theta)};
}

// Returns (out, lse); out is contiguous, lse is (num_heads, total) float32.
std::vector<at::Tensor> varlen_attention_fwd(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                             const at::Tensor& cu_seqlens_in, int64_t max_seqlen, double dropout_p,
                                             double softmax_scale, int64_t window, double rope_theta) {
  TORCH_CHECK_VALUE(dropout_p == 0.0, "the fused varlen_attention has no dropout (dropout_p=", dropout_p,
                    "): set attention_dropout to 0, or run kernels=torch");
  check_attention_inputs(q_in, k_in, v_in, cu_seqlens_in, max_seqlen);
  TORCH_CHECK_VALUE(std::isfinite(softmax_scale), "softmax_scale must be finite, got ", softmax_scale);
  const AttentionOptions options = attention_options(window, rope_theta);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const AttentionInputs in = attention_inputs(q_in, k_in, v_in);
  const at::Tensor cu_seqlens = cu_seqlens_in.contiguous();
  const int64_t total = in.q.size(0), heads = in.q.size(1), head_dim = in.q.size(2);
  at::Tensor out = at::empty({total, heads, head_dim}, in.q.options());
  at::Tensor lse = at::empty({heads, total}, in.q.options().dtype(at::kFloat));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaError_t err;
  {
    pybind11::gil_scoped_release no_gil;
    err = bds_varlen_attention_fwd(in.q.data_ptr(), in.k.data_ptr(), in.v.data_ptr(), cu_seqlens.data_ptr<int>(),
                                   out.data_ptr(), lse.data_ptr<float>(), (int)(cu_seqlens.numel() - 1), total,
                                   in.stride, (int)heads, (int)head_dim, (int)max_seqlen, options.window,
                                   options.rope_theta, static_cast<float>(softmax_scale),
                                   dtype_code(in.q.scalar_type()), stream);
  }
  check_launch(err, "varlen_attention forward");
  return {out, lse};
}

// The backward into dq, dk, dv (views laid out like q, every token dqkv_stride elements apart).
void attention_bwd_into(const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
                        const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& lse_in,
                        const at::Tensor& cu_seqlens_in, int64_t max_seqlen, double softmax_scale,
                        int64_t window, double rope_theta, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                        int64_t dqkv_stride) {
  check_attention_inputs(q_in, k_in, v_in, cu_seqlens_in, max_seqlen);
  const AttentionOptions options = attention_options(window, rope_theta);
  const at::Device device = q_in.device();
  check_cuda(dout_in, "dout", device);
  check_cuda(out_in, "out", device);
  check_cuda(lse_in, "lse", device);
  TORCH_CHECK(dout_in.sizes() == q_in.sizes() && out_in.sizes() == q_in.sizes() &&
                  dout_in.scalar_type() == q_in.scalar_type() && out_in.scalar_type() == q_in.scalar_type(),
              "dout and out must match q in shape and dtype");
  TORCH_CHECK(lse_in.scalar_type() == at::kFloat && lse_in.dim() == 2 && lse_in.size(0) == q_in.size(1) &&
                  lse_in.size(1) == q_in.size(0),
              "lse must be float32 of shape (num_heads, total) (the forward's output), got ", lse_in.sizes());
  const c10::cuda::CUDAGuard guard(device);
  const AttentionInputs in = attention_inputs(q_in, k_in, v_in);
  const at::Tensor dout = aligned_contiguous(dout_in), out = aligned_contiguous(out_in);
  const at::Tensor lse = lse_in.contiguous(), cu_seqlens = cu_seqlens_in.contiguous();
  const int64_t total = in.q.size(0), heads = in.q.size(1), head_dim = in.q.size(2);
  // Only where a sequence may span several key tiles, which then sum their dq in fp32.
  const int slots = bds_varlen_attention_bwd_dq_slots((int)head_dim, (int)max_seqlen, options.window);
  const at::Tensor dq_accum =
      slots > 0 ? at::empty({slots, total, heads, head_dim}, in.q.options().dtype(at::kFloat)) : at::Tensor();
  float* const dq_accum_ptr = slots > 0 ? dq_accum.data_ptr<float>() : nullptr;
  at::Tensor dsum = at::empty({heads, total}, in.q.options().dtype(at::kFloat));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaError_t err;
  {
    pybind11::gil_scoped_release no_gil;
    err = bds_varlen_attention_bwd(dout.data_ptr(), in.q.data_ptr(), in.k.data_ptr(), in.v.data_ptr(),
                                   out.data_ptr(), lse.data_ptr<float>(), cu_seqlens.data_ptr<int>(), dq.data_ptr(),
                                   dk.data_ptr(), dv.data_ptr(), dq_accum_ptr, dsum.data_ptr<float>(),
                                   (int)(cu_seqlens.numel() - 1), total, in.stride, dqkv_stride, (int)heads,
                                   (int)head_dim, (int)max_seqlen, options.window, options.rope_theta,
                                   static_cast<float>(softmax_scale), dtype_code(in.q.scalar_type()), stream);
  }
  check_launch(err, "varlen_attention backward");
}

// Returns (dq, dk, dv), each contiguous.
std::vector<at::Tensor> varlen_attention_bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                             const at::Tensor& cu_seqlens, int64_t max_seqlen,
                                             double softmax_scale, int64_t window, double rope_theta) {
  TORCH_CHECK(q.dim() == 3, "q must be (total_tokens, num_heads, head_dim), got shape ", q.sizes());
  const auto options = q.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor dq = at::empty(q.sizes(), options), dk = at::empty(q.sizes(), options), dv = at::empty(q.sizes(), options);
  attention_bwd_into(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, softmax_scale, window, rope_theta, dq, dk, dv,
                     q.size(1) * q.size(2));
  return {dq, dk, dv};
}

// qkv: (total, 3, num_heads, head_dim), the packed projection the forward read q, k and v from
// (qkv[:, 0], [:, 1], [:, 2]). Returns dqkv, laid out alike: the backward writes dq, dk and dv
// into it, so the projection's backward reads one gradient, with no copy or sum.
at::Tensor varlen_attention_bwd_packed(const at::Tensor& dout, const at::Tensor& qkv, const at::Tensor& out,
                                       const at::Tensor& lse, const at::Tensor& cu_seqlens, int64_t max_seqlen,
                                       double softmax_scale, int64_t window, double rope_theta) {
  TORCH_CHECK(qkv.dim() == 4 && qkv.size(1) == 3,
              "qkv must be (total_tokens, 3, num_heads, head_dim), got shape ", qkv.sizes());
  at::Tensor dqkv = at::empty(qkv.sizes(), qkv.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor dq = dqkv.select(1, 0), dk = dqkv.select(1, 1), dv = dqkv.select(1, 2);
  attention_bwd_into(dout, qkv.select(1, 0), qkv.select(1, 1), qkv.select(1, 2), out, lse, cu_seqlens, max_seqlen,
                     softmax_scale, window, rope_theta, dq, dk, dv, dqkv.stride(0));
  return dqkv;
}

// ---------------------------------------------------------------- MLM cross-entropy

// logits (rows, cols) of a kernel dtype, labels (rows,) int64, on one device.
void check_cross_entropy(const at::Tensor& logits, const at::Tensor& labels) {
  const at::Device device = logits.device();
  check_cuda(logits, "logits", device);
  check_cuda(labels, "labels", device);
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logits must be (rows, vocab) with vocab > 0, got shape ",
              logits.sizes());
  TORCH_CHECK(labels.scalar_type() == at::kLong && labels.dim() == 1 && labels.size(0) == logits.size(0),
              "labels must be int64 of shape (", logits.size(0), ",), got ", labels.scalar_type(), " of shape ",
              labels.sizes());
}

// Returns (loss, lse, correct), one entry per row: the fp32 loss (0 where the label is
// ignore_index), the fp32 log-sum-exp the backward reads, and whether the argmax is the label (bool).
std::vector<at::Tensor> mlm_cross_entropy_fwd(const at::Tensor& logits_in, const at::Tensor& labels_in,
                                              int64_t ignore_index) {
  check_cross_entropy(logits_in, labels_in);
  const c10::cuda::CUDAGuard guard(logits_in.device());
  const at::Tensor logits = logits_in.contiguous(), labels = labels_in.contiguous();
  const int64_t rows = logits.size(0);
  const int cols = checked_int(logits.size(1), "vocab size");
  const auto per_row = logits.options().dtype(at::kFloat);
  at::Tensor loss = at::empty({rows}, per_row), lse = at::empty({rows}, per_row);
  at::Tensor correct = at::empty({rows}, logits.options().dtype(at::kBool));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaError_t err;
  {
    pybind11::gil_scoped_release no_gil;
    err = bds_mlm_cross_entropy_fwd(logits.data_ptr(), labels.data_ptr<int64_t>(), loss.data_ptr<float>(),
                                    lse.data_ptr<float>(), reinterpret_cast<uint8_t*>(correct.data_ptr<bool>()), rows,
                                    cols, ignore_index, dtype_code(logits.scalar_type()), stream);
  }
  check_launch(err, "mlm_cross_entropy forward");
  return {loss, lse, correct};
}

// dloss: the gradient of the summed loss (one fp32 value, read by the kernel on the device).
// Returns dlogits, contiguous, of the logits' dtype.
at::Tensor mlm_cross_entropy_bwd(const at::Tensor& dloss, const at::Tensor& logits_in, const at::Tensor& labels_in,
                                 const at::Tensor& lse_in, int64_t ignore_index) {
  check_cross_entropy(logits_in, labels_in);
  check_cuda(dloss, "dloss", logits_in.device());
  check_cuda(lse_in, "lse", logits_in.device());
  TORCH_CHECK(dloss.numel() == 1, "dloss must hold one value (the summed loss's gradient), got shape ", dloss.sizes());
  TORCH_CHECK(lse_in.scalar_type() == at::kFloat && lse_in.dim() == 1 && lse_in.size(0) == logits_in.size(0),
              "lse must be float32 of shape (rows,) (the forward's output), got ", lse_in.scalar_type(), " of shape ",
              lse_in.sizes());
  const c10::cuda::CUDAGuard guard(logits_in.device());
  const at::Tensor logits = logits_in.contiguous(), labels = labels_in.contiguous(), lse = lse_in.contiguous();
  const at::Tensor scale = dloss.to(at::kFloat).contiguous();
  const int64_t rows = logits.size(0);
  const int cols = checked_int(logits.size(1), "vocab size");
  at::Tensor dlogits = at::empty_like(logits);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaError_t err;
  {
    pybind11::gil_scoped_release no_gil;
    err = bds_mlm_cross_entropy_bwd(scale.data_ptr<float>(), logits.data_ptr(), labels.data_ptr<int64_t>(),
                                    lse.data_ptr<float>(), dlogits.data_ptr(), rows, cols, ignore_index,
                                    dtype_code(logits.scalar_type()), stream);
  }
  check_launch(err, "mlm_cross_entropy backward");
  return dlogits;
}

// ---------------------------------------------------------------- LAMB over a chunked flat tensor

struct LambFlat {
  at::Tensor offsets, lengths;
  int64_t num_chunks;
};

// The checks both passes share: fp32 1-D contiguous state of one numel on one device, and a
// chunk table of int64 offsets and lengths on it.
LambFlat check_lamb(const std::vector<const at::Tensor*>& state, const at::Tensor& offsets,
                    const at::Tensor& lengths) {
  const at::Device device = state[0]->device();
  const char* names[] = {"param", "exp_avg", "exp_avg_sq", "grad"};
  for (size_t i = 0; i < state.size(); ++i) {
    const at::Tensor& t = *state[i];
    check_cuda(t, names[i], device);
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 1 && t.is_contiguous(), names[i],
                " must be a contiguous 1-D float32 tensor, got ", t.scalar_type(), " of shape ", t.sizes());
    TORCH_CHECK(t.numel() == state[0]->numel(), names[i], " has ", t.numel(), " elements, param ",
                state[0]->numel());
  }
  check_cuda(offsets, "offsets", device);
  check_cuda(lengths, "lengths", device);
  TORCH_CHECK(offsets.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong && offsets.dim() == 1 &&
                  lengths.sizes() == offsets.sizes(),
              "offsets and lengths must be int64 vectors of one length, got ", offsets.sizes(), " and ",
              lengths.sizes());
  // The chunks' bounds are the caller's contract (checked when the table is built); reading
  // them back here would be a host sync per step.
  return {offsets.contiguous(), lengths.contiguous(), offsets.numel()};
}

// The skip flag: none, or one float32 on the state's device (read by the kernels, never here).
at::Tensor check_skip(const c10::optional<at::Tensor>& skip, const at::Device device) {
  if (!skip) return at::Tensor();
  check_cuda(*skip, "skip", device);
  TORCH_CHECK(skip->scalar_type() == at::kFloat && skip->numel() == 1, "skip must be one float32 value, got ",
              skip->scalar_type(), " of ", skip->numel());
  return skip->contiguous();
}

at::Tensor lamb_moments(const at::Tensor& grad, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                        const at::Tensor& param, const at::Tensor& offsets, const at::Tensor& lengths,
                        double beta1, double beta2, double step_size, double eps_hat, double weight_decay,
                        bool norms, const c10::optional<at::Tensor>& skip_in) {
  const LambFlat flat = check_lamb({&param, &exp_avg, &exp_avg_sq, &grad}, offsets, lengths);
  const at::Tensor skip = check_skip(skip_in, param.device());
  const c10::cuda::CUDAGuard guard(param.device());
  at::Tensor squares = at::empty({norms ? flat.num_chunks : 0, 2}, param.options());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaError_t err;
  {
    pybind11::gil_scoped_release no_gil;
    err = bds_lamb_moments(grad.data_ptr<float>(), exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(),
                           param.data_ptr<float>(), flat.offsets.data_ptr<int64_t>(),
                           flat.lengths.data_ptr<int64_t>(), norms ? squares.data_ptr<float>() : nullptr,
                           skip.defined() ? skip.data_ptr<float>() : nullptr, flat.num_chunks, (float)beta1, (float)beta2, (float)step_size, (float)eps_hat,
                           (float)weight_decay, stream);
  }
  check_launch(err, "lamb moments");
  return squares;
}

void lamb_apply(const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                const at::Tensor& offsets, const at::Tensor& lengths, const c10::optional<at::Tensor>& scales_in,
                double uniform_scale, double beta1, double beta2, double step_size, double eps_hat,
                double weight_decay, const c10::optional<at::Tensor>& skip_in) {
  const LambFlat flat = check_lamb({&param, &exp_avg, &exp_avg_sq}, offsets, lengths);
  const at::Tensor skip = check_skip(skip_in, param.device());
  at::Tensor scales;
  if (scales_in) {
    check_cuda(*scales_in, "scales", param.device());
    TORCH_CHECK(scales_in->scalar_type() == at::kFloat && scales_in->numel() == flat.num_chunks,
                "scales must be float32 with one value per chunk (", flat.num_chunks, "), got ",
                scales_in->scalar_type(), " of ", scales_in->numel());
    scales = scales_in->contiguous();
  }
  const c10::cuda::CUDAGuard guard(param.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaError_t err;
  {
    pybind11::gil_scoped_release no_gil;
    err = bds_lamb_apply(exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(), param.data_ptr<float>(),
                         flat.offsets.data_ptr<int64_t>(), flat.lengths.data_ptr<int64_t>(),
                         scales.defined() ? scales.data_ptr<float>() : nullptr,
                         skip.defined() ? skip.data_ptr<float>() : nullptr, (float)uniform_scale,
                         flat.num_chunks, (float)beta1, (float)beta2, (float)step_size, (float)eps_hat,
                         (float)weight_decay, stream);
  }
  check_launch(err, "lamb apply");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "bert-ds fused CUDA kernels: LayerNorm(x + residual), LayerNorm(dropout(x + bias) + residual), "
            "gelu(x + bias), gelu(input) * gate, varlen attention, MLM cross-entropy, LAMB";
  m.attr("source_hash") = BDS_STRINGIFY(BDS_SOURCE_HASH);
  m.def("layer_norm_fwd", &layer_norm_fwd, "LayerNorm(x + residual) forward -> (y, mean, rstd)", py::arg("x"),
        py::arg("weight"), py::arg("bias"), py::arg("residual"), py::arg("eps"));
  m.def("layer_norm_bwd", &layer_norm_bwd, "LayerNorm(x + residual) backward -> (dx, dweight, dbias, dresidual)",
        py::arg("dy"), py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("mean"), py::arg("rstd"),
        py::arg("with_bias") = true);
  m.def("dropout_layer_norm_fwd", &dropout_layer_norm_fwd,
        "LayerNorm(dropout(x + bias) + residual) forward -> (y, mean, rstd)", py::arg("x"), py::arg("bias"),
        py::arg("residual"), py::arg("weight"), py::arg("ln_bias"), py::arg("eps"), py::arg("dropout_p"),
        py::arg("seed"), py::arg("offset"), py::arg("keep_out"));
  m.def("dropout_layer_norm_bwd", &dropout_layer_norm_bwd,
        "LayerNorm(dropout(x + bias) + residual) backward -> (dx, dbias, dresidual, dweight, dln_bias)",
        py::arg("dy"), py::arg("x"), py::arg("bias"), py::arg("residual"), py::arg("weight"), py::arg("mean"),
        py::arg("rstd"), py::arg("dropout_p"), py::arg("seed"), py::arg("offset"));
  m.def("bias_gelu_fwd", &bias_gelu_fwd, "gelu(x + bias) forward", py::arg("x"), py::arg("bias"),
        py::arg("tanh_approx"));
  m.def("bias_gelu_bwd", &bias_gelu_bwd, "gelu(x + bias) backward -> (dx, dbias)", py::arg("dy"), py::arg("x"),
        py::arg("bias"), py::arg("tanh_approx"));
  m.def("geglu_fwd", &geglu_fwd, "gelu(input) * gate forward, x = [input | gate]", py::arg("x"),
        py::arg("tanh_approx"));
  m.def("geglu_bwd", &geglu_bwd, "gelu(input) * gate backward -> dx = [dinput | dgate]", py::arg("dy"),
        py::arg("x"), py::arg("tanh_approx"));
  // window: < 0 every key, else the tokens seen on each side; rope_theta: 0, or the rotary base of q and k
  m.def("varlen_attention_fwd", &varlen_attention_fwd, "varlen attention forward -> (out, lse)", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("cu_seqlens"), py::arg("max_seqlen"), py::arg("dropout_p"),
        py::arg("softmax_scale"), py::arg("window") = -1, py::arg("rope_theta") = 0.0);
  m.def("varlen_attention_bwd", &varlen_attention_bwd, "varlen attention backward -> (dq, dk, dv)",
        py::arg("dout"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"),
        py::arg("cu_seqlens"), py::arg("max_seqlen"), py::arg("softmax_scale"), py::arg("window") = -1,
        py::arg("rope_theta") = 0.0);
  m.def("varlen_attention_bwd_packed", &varlen_attention_bwd_packed,
        "varlen attention backward of a packed (total, 3, heads, head_dim) qkv -> dqkv, laid out alike",
        py::arg("dout"), py::arg("qkv"), py::arg("out"), py::arg("lse"), py::arg("cu_seqlens"),
        py::arg("max_seqlen"), py::arg("softmax_scale"), py::arg("window") = -1, py::arg("rope_theta") = 0.0);
  m.def("mlm_cross_entropy_fwd", &mlm_cross_entropy_fwd,
        "MLM cross-entropy forward -> per row (loss, lse, correct)", py::arg("logits"), py::arg("labels"),
        py::arg("ignore_index"));
  m.def("mlm_cross_entropy_bwd", &mlm_cross_entropy_bwd, "MLM cross-entropy backward -> dlogits", py::arg("dloss"),
        py::arg("logits"), py::arg("labels"), py::arg("lse"), py::arg("ignore_index"));
  m.def("lamb_moments", &lamb_moments, "LAMB moments in place -> (chunks, 2) squared norms of w and u",
        py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("param"), py::arg("offsets"),
        py::arg("lengths"), py::arg("beta1"), py::arg("beta2"), py::arg("step_size"), py::arg("eps_hat"),
        py::arg("weight_decay"), py::arg("norms"), py::arg("skip") = py::none());
  m.def("lamb_apply", &lamb_apply, "LAMB update in place: param -= scale * u", py::arg("param"),
        py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("offsets"), py::arg("lengths"), py::arg("scales"),
        py::arg("uniform_scale"), py::arg("beta1"), py::arg("beta2"), py::arg("step_size"), py::arg("eps_hat"),
        py::arg("weight_decay"), py::arg("skip") = py::none());
}
