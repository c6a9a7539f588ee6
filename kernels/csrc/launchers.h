// The C interface of the fused kernels: plain pointers, sizes and a stream.
//
// Torch-free, so that the .cu files compile with nvcc alone (CI checks that on a CPU
// machine) and so that anything able to call C can drive them. bindings.cpp is the
// torch side: it validates tensors, allocates outputs and workspaces, and calls these.
//
// Conventions for every launcher:
//   - tensors are contiguous and row-major; `rows` is the product of the leading dims;
//   - `dtype` / `weight_dtype` / `bias_dtype` are BdsDtype codes;
//   - nothing is synchronised: work is queued on `stream` and the launch status is
//     returned (cudaGetLastError after the last launch);
//   - zero rows is valid and still writes the (zero) parameter gradients.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum BdsDtype { BDS_FLOAT32 = 0, BDS_FLOAT16 = 1, BDS_BFLOAT16 = 2 };

// ---------------------------------------------------------------- LayerNorm(x + residual)
// x, y: (rows, hidden) of `dtype`; residual (may be NULL): (rows, hidden) of `residual_dtype`;
// weight, bias (may be NULL: no bias): (hidden,) of `weight_dtype`; the residual and weight dtypes
// equal `dtype` or are fp32. mean, rstd: (rows,) fp32, saved for the backward.
cudaError_t bds_layer_norm_fwd(const void* x, const void* residual, const void* weight, const void* bias,
                               void* y, float* mean, float* rstd, int64_t rows, int hidden, float eps,
                               int dtype, int residual_dtype, int weight_dtype, cudaStream_t stream);

// Rows of fp32 partial sums the backward may use (an upper bound: its grid is one wave of
// the device, from the occupancy API; a row per CTA, or per warp off the register path): pass a
// workspace of 2 * parts * hidden floats (parts * hidden suffice without a bias gradient). Its
// contents are ignored and overwritten.
int bds_layer_norm_bwd_parts(int64_t rows, int hidden);

// dx: (rows, hidden) of `dtype`, the gradient of both x and residual; dresidual (may be NULL):
// the same values in `residual_dtype` (pass it when that differs from `dtype`); dweight, dbias:
// (hidden,) of `weight_dtype`, reduced in fp32 (per-CTA partials, then a column sum); dbias NULL
// for a LayerNorm without a bias (no bias gradient is computed).
cudaError_t bds_layer_norm_bwd(const void* dy, const void* x, const void* residual, const void* weight,
                               const float* mean, const float* rstd, void* dx, void* dresidual, void* dweight,
                               void* dbias, float* workspace, int parts, int64_t rows, int hidden,
                               int dtype, int residual_dtype, int weight_dtype, cudaStream_t stream);

// ---------------------------------------------------------------- LayerNorm(dropout(x + bias) + residual)
// x, y: (rows, hidden) of `dtype`; residual: (rows, hidden) of `residual_dtype` (`dtype` or fp32);
// bias (may be NULL), weight, ln_bias: (hidden,) of `weight_dtype` (`dtype` or fp32). Dropout keeps
// element e (of the flat rows x hidden tensor) iff word e % 4 of Philox4x32-10 with key `seed` and
// counter (offset / 4, e / 4) is below (1 - dropout_p) * 2^32 in its top 24 bits, and scales it by
// 1 / (1 - dropout_p); dropout_p in [0, 1) (0: no dropout, no random numbers), offset a multiple
// of 4. mean, rstd: (rows,) fp32, saved for the backward. keep_out (may be NULL): (rows, hidden)
// bytes, 1 where the element was kept (for tests; costs a write per element).
cudaError_t bds_dropout_layer_norm_fwd(const void* x, const void* bias, const void* residual, const void* weight,
                                       const void* ln_bias, void* y, float* mean, float* rstd, uint8_t* keep_out,
                                       int64_t rows, int hidden, float eps, float dropout_p, uint64_t seed,
                                       uint64_t offset, int dtype, int residual_dtype, int weight_dtype,
                                       cudaStream_t stream);

// Rows of fp32 partial sums the backward may use (an upper bound, as bds_layer_norm_bwd_parts):
// pass a workspace of 3 * parts * hidden floats. Its contents are ignored and overwritten.
int bds_dropout_layer_norm_bwd_parts(int64_t rows, int hidden);

// With the forward's inputs and (dropout_p, seed, offset), which regenerate its mask: dx (rows, hidden)
// of `dtype`; dresidual (rows, hidden) of `residual_dtype`; dparams (3, hidden) of `weight_dtype`:
// dweight, dln_bias and dbias (the column sums of dx; zeros without a bias), reduced in fp32.
cudaError_t bds_dropout_layer_norm_bwd(const void* dy, const void* x, const void* bias, const void* residual,
                                       const void* weight, const float* mean, const float* rstd, void* dx,
                                       void* dresidual, void* dparams, float* workspace, int parts, int64_t rows,
                                       int hidden, float dropout_p, uint64_t seed, uint64_t offset, int dtype,
                                       int residual_dtype, int weight_dtype, cudaStream_t stream);

// ---------------------------------------------------------------- gelu(x + bias)
// x, y: (rows, cols) of `dtype`; bias: (cols,) of `bias_dtype` (equal to `dtype`, or fp32).
// tanh_approx: 0 = exact erf form, 1 = tanh approximation.
cudaError_t bds_bias_gelu_fwd(const void* x, const void* bias, void* y, int64_t rows, int cols, int tanh_approx,
                              int dtype, int bias_dtype, cudaStream_t stream);

// Rows of fp32 partial sums the backward may use (an upper bound, as above): pass a
// workspace of parts * cols floats.
int bds_bias_gelu_bwd_parts(int64_t rows, int cols);

// dx = dy * gelu'(x + bias); dbias = sum over rows of dx, accumulated in fp32.
cudaError_t bds_bias_gelu_bwd(const void* dy, const void* x, const void* bias, void* dx, void* dbias,
                              float* workspace, int parts, int64_t rows, int cols, int tanh_approx,
                              int dtype, int bias_dtype, cudaStream_t stream);

// ---------------------------------------------------------------- gelu(input) * gate (GeGLU)
// x: (rows, 2 * cols) of `dtype`, each row its input half then its gate half (ModernBERT's Wi
// projection, as `chunk(2, dim=-1)` splits it); y: (rows, cols) = gelu(input) * gate.
// tanh_approx: 0 = exact erf form, 1 = tanh approximation.
cudaError_t bds_geglu_fwd(const void* x, void* y, int64_t rows, int cols, int tanh_approx, int dtype,
                          cudaStream_t stream);

// dx: (rows, 2 * cols), laid out as x: d_input = dy * gate * gelu'(input), d_gate = dy * gelu(input).
cudaError_t bds_geglu_bwd(const void* dy, const void* x, void* dx, int64_t rows, int cols, int tanh_approx,
                          int dtype, cudaStream_t stream);

// ---------------------------------------------------------------- varlen attention
// q, k, v: (total, num_heads, head_dim) of `dtype` (fp16 or bf16), head_dim 32 or 64, each
// token qkv_stride elements after the one before (num_heads * head_dim when contiguous;
// 3 * num_heads * head_dim for views of one (total, 3, num_heads, head_dim) projection; a
// multiple of 8, 16-byte aligned rows); out: (total, num_heads, head_dim) contiguous.
// cu_seqlens: (batch + 1,) int32 on the device, sequence b = rows cu_seqlens[b]:cu_seqlens[b+1];
// every sequence is at most max_seqlen long. lse: (num_heads, total) fp32, the natural-log
// sum of exp(scale * q.k) of each query row over the keys it sees, saved for the backward.
// window: query i sees key j of its sequence only where |i - j| <= window; < 0: every key.
// rope_theta: > 0: q and k are rotated as they are read (rotary embeddings of base rope_theta,
// head dim d < head_dim/2 paired with d + head_dim/2, each token at its offset in its own
// sequence), nothing rotated is written; 0: q and k as they are.
cudaError_t bds_varlen_attention_fwd(const void* q, const void* k, const void* v, const int* cu_seqlens,
                                     void* out, float* lse, int batch, int64_t total, int64_t qkv_stride,
                                     int num_heads, int head_dim, int max_seqlen, int window, float rope_theta,
                                     float softmax_scale, int dtype, cudaStream_t stream);

// dout: like out (contiguous); dq, dk, dv: like q, each token dqkv_stride elements apart (views
// of one packed gradient, or contiguous). Workspaces (contents ignored, overwritten): dq_accum
// (slots, total, num_heads, head_dim) fp32, where the key tiles sum their dq contributions, slots
// as bds_varlen_attention_bwd_dq_slots says (may be NULL where it says 0); dsum (num_heads,
// total) fp32, rowsum(dout * out). window and rope_theta: the forward's; with a rope_theta, dq and
// dk are the gradients of q and k as given (before their rotation).
cudaError_t bds_varlen_attention_bwd(const void* dout, const void* q, const void* k, const void* v,
                                     const void* out, const float* lse, const int* cu_seqlens,
                                     void* dq, void* dk, void* dv, float* dq_accum, float* dsum,
                                     int batch, int64_t total, int64_t qkv_stride, int64_t dqkv_stride,
                                     int num_heads, int head_dim, int max_seqlen, int window, float rope_theta,
                                     float softmax_scale, int dtype, cudaStream_t stream);

// The slots of dq_accum the backward at this head dim, max_seqlen and window needs: 0 when every
// sequence fits one key tile (max_seqlen up to 128) and dq is written directly; 2 when, with a
// window of at most 64, each key tile stores to the slot of its parity (no atomics); 1 when the
// key tiles add dq up in one slot with fp32 atomics (global attention, wider windows).
int bds_varlen_attention_bwd_dq_slots(int head_dim, int max_seqlen, int window);

// ---------------------------------------------------------------- MLM cross-entropy
// logits: (rows, cols) of `dtype`; labels: (rows,) int64, `ignore_index` where a row has no loss.
// Forward, per row: loss = logsumexp(x) - x[label] in fp32 (0 where ignored, NaN for a label
// outside [0, cols)); lse = logsumexp(x) (0 where ignored); correct = 1 where the first column of
// the row's maximum is the label, else 0. -inf logits (padding columns) are allowed.
cudaError_t bds_mlm_cross_entropy_fwd(const void* logits, const int64_t* labels, float* loss, float* lse,
                                      uint8_t* correct, int64_t rows, int cols, int64_t ignore_index, int dtype,
                                      cudaStream_t stream);

// dlogits (rows, cols) of `dtype` = (exp(x - lse) - onehot(label)) * grad_scale[0], with the forward's
// lse; zeros in ignored rows. grad_scale: one fp32 on the device (the gradient of the summed loss).
cudaError_t bds_mlm_cross_entropy_bwd(const float* grad_scale, const void* logits, const int64_t* labels,
                                      const float* lse, void* dlogits, int64_t rows, int cols, int64_t ignore_index,
                                      int dtype, cudaStream_t stream);

// ---------------------------------------------------------------- LAMB over a chunked flat tensor
// grad, exp_avg, exp_avg_sq, param: one flat fp32 tensor each (the same numel); chunk c is
// elements [offsets[c], offsets[c] + lengths[c]) (int64 arrays on the device, num_chunks each,
// chunks disjoint). With u = step_size * m / (sqrt(v) + eps_hat) + weight_decay * w:
// moments: m = beta1 m + (1 - beta1) g, v = beta2 v + (1 - beta2) g^2 in place, and, when
// squares (2 * num_chunks floats) is not NULL, squares[2c] = sum of w^2 and squares[2c + 1] =
// sum of u^2 over chunk c (fp32, in a fixed order). skip: NULL, or one float on the device; where
// it is non-zero both passes leave m, v and param as they are (and squares are zeros): the step's
// skip of a non-finite step, decided on the device without a read.
cudaError_t bds_lamb_moments(const float* grad, float* exp_avg, float* exp_avg_sq, const float* param,
                             const int64_t* offsets, const int64_t* lengths, float* squares, const float* skip,
                             int64_t num_chunks, float beta1, float beta2, float step_size, float eps_hat,
                             float weight_decay, cudaStream_t stream);

// apply (after moments, with the same scalars): param -= scale * u, scale = scales[c] over chunk c
// (num_chunks floats on the device), or uniform_scale everywhere when scales is NULL.
cudaError_t bds_lamb_apply(const float* exp_avg, const float* exp_avg_sq, float* param, const int64_t* offsets,
                           const int64_t* lengths, const float* scales, const float* skip, float uniform_scale,
                           int64_t num_chunks, float beta1, float beta2, float step_size, float eps_hat,
                           float weight_decay, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
