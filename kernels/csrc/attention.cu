// Bidirectional attention over unpadded variable-length sequences at FlashAttention-2's
// design point, forward and backward, fp16/bf16 on tensor cores (sm_80 instructions:
// mma.sync m16n8k16, ldmatrix, cp.async; the same code runs on A100 and H100).
//
// Layout: q, k, v, out are (total, num_heads, head_dim); sequence b is the token rows
// cu_seqlens[b] .. cu_seqlens[b+1]. A token's head vector is head_dim contiguous
// elements. In out, dout and the fp32 dQ sum the next token's is num_heads * head_dim
// further on; in q, k, v it is qkv_stride further on, and in dq, dk, dv dqkv_stride: the
// model's q, k, v are views of one (total, 3, num_heads, head_dim) projection (stride
// 3 * num_heads * head_dim), read in place, and their gradients are written into one
// tensor laid out alike, which the projection's backward reads as it is.
//
// Shared memory is dynamic (`extern __shared__`, sized at launch from FwdSmem / BwdSmem
// below): above 48 KB a kernel must opt in with cudaFuncSetAttribute, and an A100 gives a
// CTA at most 163 KB (an H100 227 KB). Each kernel declares its bytes
// (declare_dynamic_smem), which kernels/inspect.py reads from the PTX for its occupancy
// figures and the CPU emulation checks against the launch. Shared tiles are row-major,
// padded to head_dim + 8 elements per row so that the eight 16-byte rows an ldmatrix
// reads fall in eight different bank groups. Tiles stream in with cp.async into two
// stages: the copy of tile j + 1 is issued right after the barrier that opens tile j, so
// it lands while tile j is computed. Rows past the sequence end are zero-filled by the
// copy itself: they must be finite, since they meet P = 0 in a product and 0 * NaN is
// NaN. Every shared access goes through ldmatrix, cp_async_16, ld_shared or st_shared
// (common.cuh), which the CPU emulation checks for reads of copies in flight, cross-warp
// races and accesses past the launch's bytes.
//
// Register budget: ptxas may use up to 255 registers per thread, and an SM's 64K hold 8
// warps at that: 2 CTAs of 4 warps (__launch_bounds__(128, 2)) or 1 of 8 (256, 1), on
// A100 and H100 alike. Per thread, a warp's m16 x n8 fp32 accumulator tile costs 4
// registers and a 16 x 16 A operand 4. Occupancy (kernels/inspect.py's calculator, which
// tests/kernels/test_static.py checks): registers decide for the forward and the backward,
// at 8 warps per SM.
//
// Forward (grid: query tiles x sequences x heads; 4 warps). A CTA takes 128 queries, a
// warp 32 of them (two m16 tiles), so each K or V fragment a warp ldmatrix's feeds two
// mma rows: twice the reuse of 16 rows per warp, and every K/V tile is read from L2 once
// per 128 queries. Live state per thread: O is 2 x HD/8 x 4 = HD floats, Q's A operands
// 2 x HD/16 x 4 = HD/2 registers (held for the whole pass), and S (then P, in place) 2 x
// kBlockN/8 x 4 = kBlockN floats. The key tile kBlockN is the largest that fits:
//   hd 64: 64 + 32 + kBlockN; 128 keys would be 224 before indices, softmax state and
//          addresses (spills); 64 keys give 160. kBlockN = 64.
//   hd 32: 32 + 16 + kBlockN; 128 keys give 176. Taken: a key costs half the mma work of
//          hd 64 while the per-tile costs (barrier, row max shuffles, O rescale) do not
//          shrink, so the larger tile halves their share. kBlockN = 128.
// Shared memory: two stages of (K, V), 2 x kBlockN x (HD + 8) elements each: 36,864 B
// (hd 64) / 40,960 B (hd 32) in all, under 48 KB, so 2 CTAs per SM leave room. Q (128 x
// (HD + 8): 18 / 10 KB) is copied into stage 1, which the first prefetch (tile 1)
// overwrites only once every warp holds Q in registers. Per key tile:
//   S = Q K^T (fp32), masked past the sequence end; running row max m and row sum l
//   (online softmax in base 2, scale folded into log2(e) * softmax_scale); O is
//   rescaled by exp2(m_old - m_new) and O += P V, where P's accumulator registers are
//   reused as the A operand without a trip through shared memory. At the end
//   O /= l and lse = ln(sum exp(scale * q.k)) is saved per row for the backward.
// Barriers: one before Q is read (it was copied by all threads), then one per key tile.
//
// Backward (grid: key tiles x sequences x heads). Preprocessing: D = rowsum(dO * O).
// A CTA keeps kBlockN = 128 keys, a warp 16 MT of them (MT m16 tiles): their K and V as A
// operands (2 x MT x HD/16 x 4 registers) and dK, dV accumulators (2 x MT x HD/8 x 4
// floats) stay in registers while the CTA walks the query tiles of kBlockM queries,
// double-buffered (Q, dO with cp.async; lse and D, which are not 16-byte aligned in
// global memory, through registers). Each warp computes, for its keys and the tile's
// queries,
//   P^T = exp(scale K Q^T - lse)          (recomputed from the saved lse)
//   dV += P^T dO,   dP^T = V dO^T,   dS^T = P^T * (dP^T - D),   dK += dS^T Q
// then dS^T goes to shared memory so that the warps can form dQ = dS K over all the
// tile's keys (warp w: query m-tile w % (kBlockM / 16), a slice of the head dims).
// softmax_scale is applied to dK and dQ once, at the end. A warp whose 16 MT keys all lie
// past the sequence end skips the products (P = 0) and dQ's k loop stops before its rows.
// The resident state is 3 x MT x HD / 2 registers (K, V operands + dK, dV) plus P^T and
// dP^T, 2 x MT x kBlockM / 2:
//   hd 64: 8 warps x 16 keys (MT = 1), kBlockM = 64: 96 + 64 = 160 before dQ, indices and
//          addresses; ptxas gives 230 registers, no spills, at __launch_bounds__(256, 1).
//          MT = 2 would hold 192 (K, V + dK, dV) before P^T and dP^T: over budget at any
//          query tile, so each Q or dO fragment a warp loads still feeds 2 mma per warp.
//          The gains are per CTA: the key tile doubles (was 4 warps x 16) and the query
//          tile doubles (was 32), so a barrier pair opens 64 x 128 = 8,192 scores instead
//          of 2,048 (4x fewer barriers per flop), each Q, dO tile comes from L2 once per
//          128 keys instead of 64, and dQ takes S / 128 atomic adds per element instead of
//          S / 64. FlashAttention-2 runs its hd-64 backward with 8 warps too, on 128 x 128
//          tiles where a block may take 144 KB (A100, H100) and on 64 x 128 below
//          (Dao-AILab/flash-attention, csrc/flash_attn/src/flash_bwd_launch_template.h),
//          keeping K, V and dK, dV in shared memory and loading both operands of every
//          product from there; here they live in registers, which leaves room for P^T and
//          dP^T of 64 queries, not 128. Per query tile and warp: 128 mma and 64
//          ldmatrix.x4 for P^T, dV, dP^T, dK, and 32 mma and 24 ldmatrix.x4 for dQ (16
//          queries x 32 head dims over 128 keys): 1.8 mma per ldmatrix, the ratio of the
//          4-warp kernel (80 / 44).
//   hd 32: 4 warps x 32 keys (MT = 2), kBlockM = 32: 96 + 64; 216 registers at
//          __launch_bounds__(128, 2); each B fragment feeds 4 mma.
// Shared memory: K, V (kBlockN x (HD + 8) each), two stages of (Q, dO) (kBlockM x (HD + 8)
// each), dS^T (kBlockN x (kBlockM + 8)) and per stage lse, D (kBlockM floats each):
//   hd 64: 36,864 + 36,864 + 18,432 + 1,024 = 93,184 B, over 48 KB (opted in). With the
//          runtime's 1 KB per CTA, one CTA fits an A100's 164 KB per SM (two would need
//          188,416 B of its 167,936), two an H100's 228 KB; registers allow one of 8 warps
//          on both: 8 warps per SM, as before, but in one CTA, so no other CTA's math
//          hides a CTA's first loads (K, V and query tile 0) as the second 4-warp CTA did.
//   hd 32: 20,480 + 10,240 + 10,240 + 512 = 41,472 B: 2 CTAs per SM on both.
// Barriers: one before K and V are read, then two per query tile: one opens the tile
// (its copies visible; the other stage and dS^T free again), one publishes dS^T to the
// warps that read it for dQ. dS must cross warps, so two is the least.
//
// Two paths, chosen by the launcher from max_seqlen (bds_varlen_attention_bwd_dq_slots):
// - one tile (max_seqlen <= 128: BERT's phase 1): one CTA per (sequence, head) holds all of
//   the sequence's keys, so its dQ rows get their only contribution from it: dQ is scaled,
//   converted and stored by the kernel, with no atomics, no fp32 workspace to zero first
//   and no conversion kernel after (at 16,384 tokens x 12 heads x 64 that workspace is 50
//   MB of fp32 written by the memset, read and written again by every key tile's atomics,
//   and read by the conversion);
// - general (longer sequences): several key tiles add to every dQ row, in fp32 with
//   atomics to the dq_accum workspace, converted to the output dtype at the end. With a
//   window of at most 64 (ModernBERT's local layers, at any length) a dQ row is written by at
//   most two key tiles, consecutive ones, and the rows of tiles t and t + 2 never meet: each
//   tile stores its dQ with plain (8-byte) stores to the fp32 slot of its parity, and one pass
//   (dq_slots_kernel) adds a row's one or two slots, converted. No memset (the pass reads only
//   the slots written, found by the same dq_rows the kernel walks) and no atomics: where the
//   atomics' workspace is written by the memset, read and written by each of two atomic adds
//   and read by the conversion, the slots are written once and read once.
// Both are one kernel template (kOneTile): only dQ's store differs, so both compute the
// same bits (tests/kernels/test_cuda_emulated.py checks it).
//
// Sliding window and rotary embeddings (a ModernBERT-class encoder's local layers, and its Q
// and K in every layer) are template options of both kernels, so that the instances BERT
// runs are compiled as they were:
// - kWindowed: query i sees key j of its sequence only where |i - j| <= window (window >= 0;
//   window tokens on each side). The forward walks only the key tiles that hold a key within
//   the window of one of its queries: from the tile of max(0, m0 - window) to the one of
//   min(len - 1, last query + window). It masks inside a tile only where the tile is not
//   wholly within every query's window (or reaches past the sequence end). A row may see no
//   key of a tile, even none of the first tiles it meets: its running max is then -inf, and
//   the tile's exponentials are taken against 0 instead (FlashAttention's Check_inf), so that
//   no inf - inf gives NaN. The backward walks only the query tiles within the window of its
//   keys. A warp whose keys lie outside the window of every query of a tile skips its
//   products (as a warp past the sequence end does) and dQ's k loop skips those 16-key steps,
//   whose dS^T rows it never reads. At ModernBERT's window of 64 the hd-64 backward's CTA (128
//   keys) meets 4 query tiles of 64, and in the first and the last of them half its warps
//   skip.
// - kRotary: q and k are rotated as their tiles land in shared memory, so that no rotated copy
//   of either is written. The pairs are transformers' (ModernBERT's): head dim d < HD/2 with
//   d + HD/2, turned by the angle pos * theta^(-2d/HD), pos the token's offset in its own
//   sequence (each sequence starts at 0). A thread copies whole pairs of 16-byte chunks of a
//   row (head dims 8c .. 8c + 7 and their partners HD/2 further: copy_qk_tile_async) and, once
//   its cp_async_wait has landed them, rotates those bytes in place (rotate_own_pairs): bytes
//   only its own copies wrote, so the barrier that publishes the tile publishes them rotated,
//   and no barrier is added. The frequencies theta^(-2d/HD) come from the host (computed in
//   double, a __grid_constant__ parameter: the kernels read them from the constant bank at the
//   thread's head dims, where 8 of them held in registers across the forward's key loop made
//   the hd-32 forward spill); the angle pos * frequency is taken in fp32, as transformers' is,
//   reduced to [-pi, pi] (two fma with 2 pi in two parts) and the hardware's sincos there
//   (accurate to ~2^-21; the library's sincosf keeps a path for huge angles that uses local
//   memory). The reference rounds cos and sin to the model's dtype; these do not. The backward computes
//   with the rotated tiles as the forward did: dK and dQ come out with respect to the rotated
//   k and q, and each is turned back by the same angle (the rotation's transpose) before it
//   is stored or added up. For that a thread holds both members of every pair of its dQ
//   columns: a warp's dQ columns are kDqCols / 2 of each half of the head dim (the same sums
//   as before, in another order of the columns over the warps, so the same bits).
//
// Not supported: dropout (the binding refuses dropout_p > 0), causal masks, head dims
// other than 32 and 64.
#include <math.h>

#include <cmath>
#include <type_traits>

#include "common.cuh"

namespace bds {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.69314718055994531f;
constexpr int kDefaultDynamicSmem = 48 * 1024;  // what a launch may ask for without cudaFuncSetAttribute

// The tile sizes the header derives, per head dim.
constexpr int kFwdWarps = 4;
constexpr int kFwdThreads = kFwdWarps * 32;
constexpr int kFwdBlockM = 128;   // queries per forward CTA: 4 warps x 32
constexpr int kFwdWarpTiles = 2;  // m16 tiles per warp in the forward
template <int HD> constexpr int kFwdBlockN = HD == 32 ? 128 : 64;  // keys per forward key tile

template <int HD> struct BwdTiles;
template <> struct BwdTiles<64> {
  static constexpr int kWarps = 8;      // warps per CTA
  static constexpr int kWarpTiles = 1;  // m16 key tiles per warp: 16 keys
  static constexpr int kBlockM = 64;    // queries per query tile
  static constexpr int kMinBlocks = 1;  // __launch_bounds__: up to 255 registers at 256 threads
};
template <> struct BwdTiles<32> {
  static constexpr int kWarps = 4;
  static constexpr int kWarpTiles = 2;  // 32 keys
  static constexpr int kBlockM = 32;
  static constexpr int kMinBlocks = 2;  // 255 registers at 2 x 128 threads
};
template <int HD> constexpr int kBwdThreads = BwdTiles<HD>::kWarps * 32;
template <int HD> constexpr int kBwdBlockN = BwdTiles<HD>::kWarps * 16 * BwdTiles<HD>::kWarpTiles;  // keys per CTA

// Byte offsets of the shared buffers in a kernel's dynamic shared memory; every buffer
// starts 16-byte aligned (cp.async and ldmatrix move 16-byte rows). Tiles are row-major
// with rows of HD + 8 elements (the bank-group padding).
template <typename T, int HD>
struct FwdSmem {
  static constexpr int kTile = kFwdBlockN<HD> * (HD + 8);  // elements of a K or a V tile
  static constexpr int kStage = 2 * kTile;                 // elements of a stage: K, then V
  static constexpr int kBytes = 2 * kStage * (int)sizeof(T);
};

template <typename T, int HD>
struct BwdSmem {
  static constexpr int kBlockM = BwdTiles<HD>::kBlockM, kBlockN = kBwdBlockN<HD>;
  static constexpr int kKVTile = kBlockN * (HD + 8);  // elements of K or V
  static constexpr int kQTile = kBlockM * (HD + 8);   // elements of a Q or a dO tile
  static constexpr int kK = 0;
  static constexpr int kV = kK + kKVTile * (int)sizeof(T);
  static constexpr int kStages = kV + kKVTile * (int)sizeof(T);            // stage s: Q, then dO
  static constexpr int kDS = kStages + 2 * 2 * kQTile * (int)sizeof(T);    // dS^T: (keys, kBlockM + 8)
  static constexpr int kLse = kDS + kBlockN * (kBlockM + 8) * (int)sizeof(T);  // [2][kBlockM] floats
  static constexpr int kDsum = kLse + 2 * kBlockM * (int)sizeof(float);        // [2][kBlockM] floats
  static constexpr int kBytes = kDsum + 2 * kBlockM * (int)sizeof(float);
  static_assert(kV % 16 == 0 && kStages % 16 == 0 && kDS % 16 == 0 && kLse % 16 == 0, "16-byte aligned buffers");
};

// Issues the copies of rows [0, valid) of a (ROWS, HD) slice, `row_stride` elements
// apart, into a padded shared tile; rows from `valid` on are zero-filled. THREADS: the
// CTA's, each issuing the same number of copies.
template <typename T, int HD, int ROWS, int THREADS>
__device__ __forceinline__ void copy_tile_async(T* tile, const T* src, int64_t row_stride, int valid) {
  constexpr int kChunks = HD / 8;  // 16-byte chunks per row
  constexpr int kStride = HD + 8;
  static_assert(ROWS * kChunks % THREADS == 0, "every thread issues the same number of copies");
#pragma unroll
  for (int i = 0; i < ROWS * kChunks / THREADS; ++i) {
    const int c = i * THREADS + threadIdx.x;
    const int r = c / kChunks, chunk = c % kChunks;
    const bool real = r < valid;  // a zero-filled row still names a real address (row 0)
    cp_async_16(tile + r * kStride + chunk * 8, src + (real ? r : 0) * row_stride + chunk * 8, real);
  }
}

// ---------------------------------------------------------------- rotary embeddings (kRotary)

// The chunk pairs of a rotary tile: pair p is row p / kPairs, chunk p % kPairs (head dims
// 8c .. 8c + 7) and its partner chunk HD/2 further. Thread x takes pairs x, x + THREADS, ...:
// its chunk c is x % kPairs, the same in every row, so its frequencies are too.
template <int HD>
constexpr int kRotaryPairs = HD / 16;  // chunk pairs per row

// A q or k tile: with kRotary copied by whole chunk pairs (see above), so that the thread that
// rotates a pair (rotate_own_pairs) is the one whose copies wrote it; else as copy_tile_async.
template <typename T, int HD, int ROWS, int THREADS, bool kRotary>
__device__ __forceinline__ void copy_qk_tile_async(T* tile, const T* src, int64_t row_stride, int valid) {
  if constexpr (!kRotary) {
    copy_tile_async<T, HD, ROWS, THREADS>(tile, src, row_stride, valid);
  } else {
    constexpr int kPairs = kRotaryPairs<HD>, kStride = HD + 8, kTotal = ROWS * kPairs;
    static_assert(THREADS % kPairs == 0, "a thread's chunk pair is the same in every row");
#pragma unroll
    for (int i = 0; i < (kTotal + THREADS - 1) / THREADS; ++i) {
      const int p = i * THREADS + threadIdx.x;
      if (kTotal % THREADS != 0 && p >= kTotal) break;  // the hd-32 backward's query tile: 64 pairs, 128 threads
      const int r = p / kPairs, c = p % kPairs;
      const bool real = r < valid;  // a zero-filled row still names a real address (row 0)
      const T* from = src + (real ? r : 0) * row_stride + c * 8;
      cp_async_16(tile + r * kStride + c * 8, from, real);
      cp_async_16(tile + r * kStride + c * 8 + HD / 2, from + HD / 2, real);
    }
  }
}

// sin and cos of a rotary angle (0 <= angle < 2^24): reduced to [-pi, pi] by two fma with 2 pi
// in two parts, then the hardware's sincos, accurate to ~2^-21 there.
__device__ __forceinline__ void rotary_sincos(float angle, float* s, float* c) {
  const float turns = rintf(angle * 0.159154943091895336f);  // 1 / (2 pi)
  float r = fmaf(-turns, 6.28318548202514648f, angle);       // 2 pi rounded to fp32 ...
  r = fmaf(-turns, -1.74845553146951715e-7f, r);             // ... and what that rounding left off
  __sincosf(r, s, c);
}

// The rotary frequencies theta^(-2d/HD) of head dims d < HD/2 (HD <= 64), computed on the host.
struct RotaryFreqs {
  float inv_freq[32];
};

// The angle of head dim d (< HD/2) at position pos: pos * theta^(-2d/HD).
__device__ __forceinline__ float rotary_angle(int pos, int d, const RotaryFreqs& freqs) {
  return (float)pos * freqs.inv_freq[d];
}

// Rotates, in place, the chunk pairs of rows [0, valid) that this thread's copy_qk_tile_async
// copied, row r being at position pos0 + r of its sequence: x[d] <- x[d] cos - x[d + HD/2] sin,
// x[d + HD/2] <- x[d + HD/2] cos + x[d] sin, in fp32, rounded to T. Call it after the
// cp_async_wait that lands those copies and before the barrier that publishes the tile.
template <typename T, int HD, int ROWS, int THREADS>
__device__ __forceinline__ void rotate_own_pairs(T* tile, int valid, int pos0, const RotaryFreqs& freqs) {
  constexpr int kPairs = kRotaryPairs<HD>, kStride = HD + 8, kTotal = ROWS * kPairs;
  const int c = threadIdx.x % kPairs;  // head dims 8c .. 8c + 7 (and their partners) in every row
#pragma unroll
  for (int i = 0; i < (kTotal + THREADS - 1) / THREADS; ++i) {
    const int p = i * THREADS + threadIdx.x;
    const int r = p / kPairs;
    if ((kTotal % THREADS != 0 && p >= kTotal) || r >= valid) break;  // rows only grow with i
    T* const first = tile + r * kStride + c * 8;
    uint4 lo = ld_shared(reinterpret_cast<const uint4*>(first));
    uint4 hi = ld_shared(reinterpret_cast<const uint4*>(first + HD / 2));
    T* const x1 = reinterpret_cast<T*>(&lo);
    T* const x2 = reinterpret_cast<T*>(&hi);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float s, co;
      rotary_sincos(rotary_angle(pos0 + r, c * 8 + e, freqs), &s, &co);
      const float a = to_float(x1[e]), b = to_float(x2[e]);
      x1[e] = from_float<T>(a * co - b * s);
      x2[e] = from_float<T>(b * co + a * s);
    }
    st_shared(reinterpret_cast<uint4*>(first), lo);
    st_shared(reinterpret_cast<uint4*>(first + HD / 2), hi);
  }
}

// The gradient (g1, g2) of a rotated pair (head dims d and d + HD/2 at position pos), turned
// into the gradient of the pair before the rotation: the rotation's transpose.
__device__ __forceinline__ void unrotate(float& g1, float& g2, int pos, int d, const RotaryFreqs& freqs) {
  float s, c;
  rotary_sincos(rotary_angle(pos, d, freqs), &s, &c);
  const float a = g1, b = g2;
  g1 = a * c + b * s;
  g2 = b * c - a * s;
}

// ---------------------------------------------------------------- sliding window (kWindowed)

// Tokens [lo, hi) of a sequence of len: of the other side (keys of a query tile, queries of a key
// tile), those within `window` of one of the tokens [first, last]; all of them without a window.
struct Span {
  int lo, hi;
};

template <bool kWindowed>
__device__ __forceinline__ Span window_span(int first, int last, int len, int window) {
  if constexpr (kWindowed) {
    const int lo = first - window, hi = last + window + 1;  // window <= len (the kernels clamp it): no overflow
    return {lo > 0 ? lo : 0, hi < len ? hi : len};
  } else {
    return {0, len};
  }
}

// The query rows the backward CTA of the key tile from n0 adds dQ to: the query tiles (kBlockM
// rows, counted from the sequence start) that hold a query seeing one of its keys, cut at the
// sequence end. The kernel walks them; the slots' sum (dq_slots_kernel) finds a row's writers by it.
template <int HD, bool kWindowed>
__device__ __forceinline__ Span dq_rows(int n0, int len, int window) {
  constexpr int kBlockM = BwdTiles<HD>::kBlockM, kBlockN = kBwdBlockN<HD>;
  const int keys_here = len - n0 < kBlockN ? len - n0 : kBlockN;
  const Span queries = window_span<kWindowed>(n0, n0 + keys_here - 1, len, window);
  const int hi = (queries.hi + kBlockM - 1) / kBlockM * kBlockM;
  return {queries.lo / kBlockM * kBlockM, hi < len ? hi : len};
}

// Whether token ranges [a0, a1] and [b0, b1] hold a pair at most `window` apart.
__device__ __forceinline__ bool within_window(int a0, int a1, int b0, int b1, int window) {
  return a1 >= b0 - window && a0 <= b1 + window;
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
// The same B operands stored as rows = k, cols = n (a V tile for P V); ldmatrix .trans. The
// second n8 tile starts `second` columns after the first (dQ's takes the other half of the
// head dim: see attention_bwd_kernel).
template <typename T>
__device__ __forceinline__ const T* b_rows_k(const T* tile, int stride, int n0, int k0, int lane, int second = 8) {
  return tile + (k0 + lane % 8 + ((lane / 8) % 2) * 8) * stride + n0 + (lane / 16) * second;
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

// Warp tile products, the same three shapes in both passes. A warp owns MT strips of 16
// rows; `float acc[MT][NT][4]` is those strips times 8 NT columns in the mma D layout
// (n8 tile nt: rows g, g + 8, columns 2t, 2t + 1). B comes from a shared tile, `stride`
// elements per row; each B fragment loaded feeds all MT strips. The sizes are template
// parameters so that every loop unrolls fully and the fragment arrays stay in registers.

// acc (16 MT x 8 NT) += A B^T over k = 16 KT: a[mt][kk] the A operand of strip mt, k step
// kk; B^T the first 8 NT rows of a tile stored rows = n, cols = k (S = Q K^T, P^T = K Q^T,
// dP^T = V dO^T).
template <typename T, int MT, int NT, int KT>
__device__ __forceinline__ void mma_abt(float (&acc)[MT][NT][4], const uint32_t (&a)[MT][KT][4], const T* tile,
                                        int stride, int lane) {
#pragma unroll
  for (int kk = 0; kk < KT; ++kk) {
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t b[4];
      ldmatrix_x4(b, b_rows_n(tile, stride, np * 16, kk * 16, lane));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_16816<T>(acc[mt][2 * np], a[mt][kk], b[0], b[1]);
        mma_16816<T>(acc[mt][2 * np + 1], a[mt][kk], b[2], b[3]);
      }
    }
  }
}

// acc (16 MT x 8 NT) += A B over one k step: a[mt] a 16 x 16 A operand, B rows k0 .. k0 + 15
// of a tile stored rows = k, cols = n (ldmatrix .trans). One step at a time because the
// callers make A on the fly (accumulators_as_a, or dS read transposed for dQ = dS K).
// kSecond: the columns between n8 tiles 2np and 2np + 1 of acc. 8: the tiles follow each
// other (tile nt at column 8 nt); HD/2: tile 2np at column 8 np and 2np + 1 at 8 np + HD/2,
// each column with its rotary partner (dQ's).
template <typename T, int MT, int NT, int kSecond = 8>
__device__ __forceinline__ void mma_ab_step(float (&acc)[MT][NT][4], const uint32_t (&a)[MT][4], const T* tile,
                                            int stride, int k0, int lane) {
#pragma unroll
  for (int np = 0; np < NT / 2; ++np) {
    uint32_t b[4];
    ldmatrix_x4_trans(b, b_rows_k(tile, stride, kSecond == 8 ? np * 16 : np * 8, k0, lane, kSecond));
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      mma_16816<T>(acc[mt][2 * np], a[mt], b[0], b[1]);
      mma_16816<T>(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
    }
  }
}

// acc (16 MT x 8 NT) += P B over k = 8 PT: P the accumulator of an earlier product, turned
// into A operands in registers (accumulators_as_a), B a tile stored rows = k, cols = n
// (O += P V, dV += P^T dO, dK += dS^T Q).
template <typename T, int MT, int NT, int PT>
__device__ __forceinline__ void mma_pb(float (&acc)[MT][NT][4], const float (&p)[MT][PT][4], const T* tile,
                                       int stride, int lane) {
#pragma unroll
  for (int j = 0; j < PT / 2; ++j) {
    uint32_t pa[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) accumulators_as_a<T>(pa[mt], p[mt][2 * j], p[mt][2 * j + 1]);
    mma_ab_step<T>(acc, pa, tile, stride, j * 16, lane);
  }
}

// The A operands of a warp's MT strips of 16 rows (from row m0 on) over the whole head
// dim, from a tile stored rows = m, cols = head dim.
template <typename T, int MT, int KT>
__device__ __forceinline__ void load_a_strips(uint32_t (&a)[MT][KT][4], const T* tile, int stride, int m0,
                                              int lane) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) ldmatrix_x4(a[mt][kk], a_rows(tile, stride, m0 + mt * 16, kk * 16, lane));
  }
}

// ---------------------------------------------------------------- forward

// Online softmax over one key tile, in place: s holds scale_log2 * q.k on entry (masked
// keys -inf) and P = exp2(s - m_new) on exit; O (acc) and l (row_sum) are rescaled by
// exp2(m_old - m_new). Row r = 2 mt + i of this thread is row g + 8 i of strip mt; its
// columns live in the 4 threads of a quad. kEmptyRows: a row may have no key in the tile,
// nor in the tiles before it (a window): its max is then -inf and its terms are taken
// against 0, which makes them 0 and the correction 0, where -inf - -inf would be NaN.
template <bool kEmptyRows, int MT, int NT, int DT>
__device__ __forceinline__ void online_softmax(float (&s)[MT][NT][4], float (&acc)[MT][DT][4],
                                               float (&row_max)[MT][2], float (&row_sum)[MT][2]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float tile_max = row_max[mt][i];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) tile_max = fmaxf(tile_max, fmaxf(s[mt][nt][2 * i], s[mt][nt][2 * i + 1]));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 2));
      // Without a window every tile holds at least one real key, so tile_max is finite
      // and the correction is 0 on the first tile (exp2(-inf)), never NaN.
      const float base = kEmptyRows && tile_max == -INFINITY ? 0.f : tile_max;
      const float correction = exp2f(row_max[mt][i] - base);
      row_max[mt][i] = tile_max;
      float sum = row_sum[mt][i] * correction;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        s[mt][nt][2 * i] = exp2f(s[mt][nt][2 * i] - base);
        s[mt][nt][2 * i + 1] = exp2f(s[mt][nt][2 * i + 1] - base);
        sum += s[mt][nt][2 * i] + s[mt][nt][2 * i + 1];
      }
      row_sum[mt][i] = sum;  // this thread's columns only; the quad is summed at the end
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        acc[mt][dt][2 * i] *= correction;
        acc[mt][dt][2 * i + 1] *= correction;
      }
    }
  }
}

// The forward's options: a window of `window` tokens on each side (kWindowed), q and k rotated
// as they load (kRotary, with the frequencies of freqs). See the header.
template <typename T, int HD, bool kWindowed, bool kRotary>
__global__ void __launch_bounds__(kFwdThreads, 2)
attention_fwd_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                     const int* __restrict__ cu_seqlens, T* __restrict__ out, float* __restrict__ lse,
                     int num_heads, int64_t total, int64_t qkv_stride, float scale_log2, int window,
                     const __grid_constant__ RotaryFreqs freqs) {
  constexpr int kBlockN = kFwdBlockN<HD>;
  constexpr int MT = kFwdWarpTiles;
  constexpr int kStride = HD + 8;
  using Smem = FwdSmem<T, HD>;
  constexpr int kTile = Smem::kTile;
  static_assert(kFwdBlockM * kStride <= Smem::kStage, "Q must fit in a (K, V) stage");
  declare_dynamic_smem<Smem::kBytes>();
  extern __shared__ __align__(16) unsigned char smem[];
  T* const stages = reinterpret_cast<T*>(smem);  // stage s at s * kStage: K, then V; Q first in stage 1

  const int head = blockIdx.z;
  const int start = cu_seqlens[blockIdx.y];
  const int len = cu_seqlens[blockIdx.y + 1] - start;
  const int m0 = blockIdx.x * kFwdBlockM;  // the tile's first query, counted within the sequence
  if (m0 >= len) return;                   // the whole CTA: grid.x is sized for the longest sequence
  const int w = window < len ? window : len;  // a wider window sees what this one does
  const int last_query = (m0 + kFwdBlockM < len ? m0 + kFwdBlockM : len) - 1;
  // The keys one of the tile's queries sees; the first key tile is the one that holds the first.
  const Span keys = window_span<kWindowed>(m0, last_query, len, w);
  const int first_n0 = keys.lo / kBlockN * kBlockN;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;  // accumulator rows g, g + 8; columns 2t, 2t + 1 of each n8 tile
  const int64_t row_stride = (int64_t)num_heads * HD;  // out's tokens
  const int64_t base = (int64_t)start * row_stride + (int64_t)head * HD;  // element (start, head, 0) of out
  // q, k and v may be views of one packed (total, 3, num_heads, HD) projection: qkv_stride apart
  const int64_t in_base = (int64_t)start * qkv_stride + (int64_t)head * HD;
  auto copy_kv = [&](T* stage, int n0) {
    copy_qk_tile_async<T, HD, kBlockN, kFwdThreads, kRotary>(stage, k + in_base + n0 * qkv_stride, qkv_stride,
                                                             len - n0);
    copy_tile_async<T, HD, kBlockN, kFwdThreads>(stage + kTile, v + in_base + n0 * qkv_stride, qkv_stride,
                                                 len - n0);
    cp_async_commit();
  };

  T* const q_stage = stages + Smem::kStage;
  copy_qk_tile_async<T, HD, kFwdBlockM, kFwdThreads, kRotary>(q_stage, q + in_base + m0 * qkv_stride, qkv_stride,
                                                              len - m0);
  cp_async_commit();
  copy_kv(stages, first_n0);
  cp_async_wait<1>();  // this thread's Q copies have landed (K, V of the first tile may still fly)
  if constexpr (kRotary) rotate_own_pairs<T, HD, kFwdBlockM, kFwdThreads>(q_stage, len - m0, m0, freqs);
  __syncthreads();     // barrier: every thread's Q copies have landed (and are rotated)
  uint32_t qa[MT][HD / 16][4];  // this warp's 32 query rows, the A operands of S = Q K^T
  load_a_strips(qa, q_stage, kStride, warp * 16 * MT, lane);
  const int row0 = m0 + warp * 16 * MT + g;  // this thread's first row; the others are 8 apart

  float acc[MT][HD / 8][4] = {};  // O, unnormalised: n8 tile dt covers head dims 8 dt .. 8 dt + 7
  float row_max[MT][2], row_sum[MT][2];  // rows g, g + 8 of each strip; the max in log2 units
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    row_max[mt][0] = row_max[mt][1] = -INFINITY;
    row_sum[mt][0] = row_sum[mt][1] = 0.f;
  }

  for (int j = 0, n0 = first_n0; n0 < keys.hi; ++j, n0 += kBlockN) {
    T* const sK = stages + (j % 2) * Smem::kStage;
    cp_async_wait<0>();  // this thread's copies of tile j have landed (the only group in flight)
    if constexpr (kRotary) rotate_own_pairs<T, HD, kBlockN, kFwdThreads>(sK, len - n0, n0, freqs);
    // Barrier: every thread's copies of tile j have landed (and K is rotated), and every warp is
    // done with the other stage (tile j - 1, or Q before tile 1), which the prefetch below refills.
    __syncthreads();
    if (n0 + kBlockN < keys.hi) copy_kv(stages + ((j + 1) % 2) * Smem::kStage, n0 + kBlockN);
    const T* sV = sK + kTile;

    float s[MT][kBlockN / 8][4] = {};  // S for 32 queries x kBlockN keys
    mma_abt(s, qa, sK, kStride, lane);
    // Only the last tile has keys past the end; with a window, every tile that is not wholly
    // within every query's window has keys some query does not see.
    const bool partial = n0 + kBlockN > len ||
                         (kWindowed && !(n0 >= last_query - w && n0 + kBlockN - 1 <= m0 + w));
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int nt = 0; nt < kBlockN / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = n0 + nt * 8 + 2 * t + (e & 1);
          const int row = row0 + mt * 16 + 8 * (e / 2);
          const bool unseen = key >= len || (kWindowed && (row - key > w || key - row > w));
          s[mt][nt][e] = partial && unseen ? -INFINITY : s[mt][nt][e] * scale_log2;
        }
      }
    }
    online_softmax<kWindowed>(s, acc, row_max, row_sum);

    // O += P V: k runs over the tile's keys, 16 per mma.
    mma_pb(acc, s, sV, kStride, lane);
  }

#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float sum = row_sum[mt][i];
      sum += __shfl_xor_sync(kFullMask, sum, 1);
      sum += __shfl_xor_sync(kFullMask, sum, 2);
      const int row = row0 + mt * 16 + 8 * i;
      if (row < len) {  // every real query sees at least itself: sum > 0
        const float inv = 1.f / sum;
        T* o = out + base + row * row_stride;
#pragma unroll
        for (int dt = 0; dt < HD / 8; ++dt)
          *reinterpret_cast<uint32_t*>(o + dt * 8 + 2 * t) =
              pack2<T>(acc[mt][dt][2 * i] * inv, acc[mt][dt][2 * i + 1] * inv);
        if (t == 0) lse[(int64_t)head * total + start + row] = (row_max[mt][i] + log2f(sum)) * kLn2;
      }
    }
  }
}

// ---------------------------------------------------------------- backward

// dsum[head][token] = sum over d of dout * out; one warp per (token, head) row.
constexpr int kDsumWarps = 4;

template <typename T, int HD>
__global__ void __launch_bounds__(kDsumWarps * 32)
attention_dsum_kernel(const T* __restrict__ dout, const T* __restrict__ out, float* __restrict__ dsum,
                      int num_heads, int64_t total) {
  const int64_t row = (int64_t)blockIdx.x * kDsumWarps + threadIdx.x / 32;  // token * num_heads + head
  const int lane = threadIdx.x % 32;
  if (row >= total * num_heads) return;
  float sum = 0.f;
#pragma unroll
  for (int d = lane; d < HD; d += 32) sum += to_float(dout[row * HD + d]) * to_float(out[row * HD + d]);
  sum = warp_sum(sum);
  if (lane == 0) dsum[(row % num_heads) * total + row / num_heads] = sum;
}

// A query tile's lse (log2 units) and D, as one thread (threadIdx.x < kBlockM) fetches
// them from global memory into registers and later stores them to shared memory.
struct QueryRowStats {
  float lse_log2, dsum;
};

template <int BM>
__device__ __forceinline__ QueryRowStats fetch_row_stats(const float* lse, const float* dsum, int64_t at0,
                                                         int m0, int len) {
  const int i = threadIdx.x;
  // Past the sequence end: lse = +inf, so that P = 0 for those queries.
  if (i >= BM || m0 + i >= len) return {INFINITY, 0.f};
  return {lse[at0 + m0 + i] * kLog2e, dsum[at0 + m0 + i]};
}

// The backward's options, as the forward's (kWindowed, kRotary); kOneTile: every sequence fits
// one key tile (the launcher's choice, from max_seqlen).
template <typename T, int HD, bool kOneTile, bool kWindowed, bool kRotary>
__global__ void __launch_bounds__(kBwdThreads<HD>, BwdTiles<HD>::kMinBlocks)
attention_bwd_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                     const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ dsum,
                     const int* __restrict__ cu_seqlens, float* __restrict__ dq_accum, T* __restrict__ dq,
                     T* __restrict__ dk, T* __restrict__ dv, int num_heads, int64_t total, int64_t qkv_stride,
                     int64_t dqkv_stride, float scale, float scale_log2, int window, bool dq_in_slots,
                     const __grid_constant__ RotaryFreqs freqs) {
  using Tiles = BwdTiles<HD>;
  using Smem = BwdSmem<T, HD>;
  constexpr int kWarps = Tiles::kWarps, kThreads = kBwdThreads<HD>;
  constexpr int MT = Tiles::kWarpTiles;
  constexpr int kBlockN = kBwdBlockN<HD>;
  constexpr int kBlockM = Tiles::kBlockM;
  constexpr int kStride = HD + 8;          // Q, K, V, dO tiles: (rows, head dim)
  constexpr int kSStride = kBlockM + 8;    // dS^T tile: (keys, queries)
  constexpr int kQTile = Smem::kQTile;
  // dQ = dS K: warp w takes query strip w % kDqStrips and kDqCols of the head dims: kDqCols / 2
  // of each half, from column dq_col0 and dq_col0 + HD/2 on, so that a thread holds both
  // members of every rotary pair (n8 tile 2i of its dQ at column dq_col0 + 8 i, tile 2i + 1
  // at that + HD/2).
  constexpr int kDqStrips = kBlockM / 16;
  constexpr int kDqCols = HD * kDqStrips / kWarps;
  static_assert(kWarps % kDqStrips == 0 && kDqCols % 16 == 0, "dQ work must split evenly over the warps");
  declare_dynamic_smem<Smem::kBytes>();
  extern __shared__ __align__(16) unsigned char smem[];
  T* const sK = reinterpret_cast<T*>(smem + Smem::kK);
  T* const sV = reinterpret_cast<T*>(smem + Smem::kV);
  T* const stages = reinterpret_cast<T*>(smem + Smem::kStages);  // stage s at s * 2 kQTile: Q, then dO
  T* const sdS = reinterpret_cast<T*>(smem + Smem::kDS);
  float* const sLse = reinterpret_cast<float*>(smem + Smem::kLse);    // per stage; log2 units, +inf past the end
  float* const sDsum = reinterpret_cast<float*>(smem + Smem::kDsum);  // per stage

  const int head = blockIdx.z;
  const int start = cu_seqlens[blockIdx.y];
  const int len = cu_seqlens[blockIdx.y + 1] - start;
  const int n0 = blockIdx.x * kBlockN;  // the tile's first key, counted within the sequence
  if (n0 >= len) return;
  const int w = window < len ? window : len;  // a wider window sees what this one does
  const int keys_here = len - n0 < kBlockN ? len - n0 : kBlockN;
  // The query tiles that hold a query seeing one of the tile's keys: the rows this CTA adds dQ to.
  const Span rows = dq_rows<HD, kWindowed>(n0, len, w);
  const int first_m0 = rows.lo;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int64_t row_stride = (int64_t)num_heads * HD;  // dout's and dq_accum's tokens
  const int64_t base = (int64_t)start * row_stride + (int64_t)head * HD;
  // q, k, v (qkv_stride) and dq, dk, dv (dqkv_stride) may be views of packed projections
  const int64_t in_base = (int64_t)start * qkv_stride + (int64_t)head * HD;
  const int64_t grad_base = (int64_t)start * dqkv_stride + (int64_t)head * HD;
  const int64_t stats_at = (int64_t)head * total + start;  // (head, start) in lse and dsum
  // The general path's dQ (not kOneTile): stored to the slot of this key tile's parity where the
  // launcher chose slots (no two key tiles of a parity share a row: bwd_dq_slots), else added to
  // the one fp32 workspace with atomics.
  float* const dq_slot = dq_in_slots ? dq_accum + (int64_t)(blockIdx.x % 2) * total * row_stride : nullptr;
  auto copy_q_do = [&](int stage, int m0) {
    T* const sQ = stages + stage * 2 * kQTile;
    copy_qk_tile_async<T, HD, kBlockM, kThreads, kRotary>(sQ, q + in_base + m0 * qkv_stride, qkv_stride, len - m0);
    copy_tile_async<T, HD, kBlockM, kThreads>(sQ + kQTile, dout + base + m0 * row_stride, row_stride, len - m0);
    cp_async_commit();
  };
  auto store_stats = [&](int stage, QueryRowStats stats) {
    if (threadIdx.x < kBlockM) {
      st_shared(&sLse[stage * kBlockM + threadIdx.x], stats.lse_log2);
      st_shared(&sDsum[stage * kBlockM + threadIdx.x], stats.dsum);
    }
  };

  copy_qk_tile_async<T, HD, kBlockN, kThreads, kRotary>(sK, k + in_base + n0 * qkv_stride, qkv_stride, len - n0);
  copy_tile_async<T, HD, kBlockN, kThreads>(sV, v + in_base + n0 * qkv_stride, qkv_stride, len - n0);
  cp_async_commit();
  copy_q_do(0, first_m0);
  store_stats(0, fetch_row_stats<kBlockM>(lse, dsum, stats_at, first_m0, len));
  cp_async_wait<1>();  // this thread's K, V copies have landed (query tile 0 may still fly)
  if constexpr (kRotary) rotate_own_pairs<T, HD, kBlockN, kThreads>(sK, len - n0, n0, freqs);
  __syncthreads();     // barrier: every thread's K, V copies have landed (and K is rotated)
  // This warp's 16 MT keys as A operands (rows = keys, k = head dim), kept for the whole pass.
  const int key0 = warp * 16 * MT;  // the warp's first key, counted within the tile
  uint32_t ka[MT][HD / 16][4], va[MT][HD / 16][4];
  load_a_strips(ka, sK, kStride, key0, lane);
  load_a_strips(va, sV, kStride, key0, lane);
  // A warp whose keys all lie past the sequence end has P = 0 everywhere: it skips the
  // products and leaves its dS^T rows unwritten, and dQ's k loop stops before them.
  const bool has_keys = key0 < keys_here;
  const int dq_key_steps = (keys_here + 15) / 16;
  // Keys past the sequence end get P = 0. Not needed for the result (their dK, dV are
  // never stored and their zero K rows cancel their dS in dQ), but it keeps P^T honest.
  bool key_real[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    key_real[mt][0] = key0 + mt * 16 + g < keys_here;
    key_real[mt][1] = key0 + mt * 16 + g + 8 < keys_here;
  }
  float dk_acc[MT][HD / 8][4] = {};
  float dv_acc[MT][HD / 8][4] = {};
  const int dq_strip = warp % kDqStrips, dq_col0 = (warp / kDqStrips) * (kDqCols / 2);

  for (int j = 0, m0 = first_m0; m0 < rows.hi; ++j, m0 += kBlockM) {
    const int cur = j % 2, next = 1 - cur;
    T* const sQ = stages + cur * 2 * kQTile;
    cp_async_wait<0>();  // this thread's copies of query tile j have landed
    if constexpr (kRotary) rotate_own_pairs<T, HD, kBlockM, kThreads>(sQ, len - m0, m0, freqs);
    // Barrier: tile j (every thread's copies, Q rotated, and its lse, D) is visible; every warp
    // is done with the other stage (tile j - 1), refilled below, and with dS^T, rewritten below.
    __syncthreads();
    const bool more = m0 + kBlockM < rows.hi;
    QueryRowStats next_stats{};
    if (more) {
      copy_q_do(next, m0 + kBlockM);
      next_stats = fetch_row_stats<kBlockM>(lse, dsum, stats_at, m0 + kBlockM, len);  // lands during the math
    }
    const T* sdO = sQ + kQTile;
    const float* lse_cur = sLse + cur * kBlockM;
    const float* dsum_cur = sDsum + cur * kBlockM;
    // With a window: the tile's last query (its rows past the end have P = 0 by their lse),
    // and whether this warp's keys are within the window of one of the tile's queries.
    const int last_query = (m0 + kBlockM < len ? m0 + kBlockM : len) - 1;
    const bool warp_sees =
        has_keys && (!kWindowed || within_window(n0 + key0, n0 + key0 + 16 * MT - 1, m0, last_query, w));

    if (warp_sees) {
      // P^T = exp2(scale_log2 * K Q^T - lse_log2): 16 MT keys x kBlockM queries.
      float p[MT][kBlockM / 8][4] = {};
      mma_abt(p, ka, sQ, kStride, lane);
#pragma unroll
      for (int nt = 0; nt < kBlockM / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int query = nt * 8 + 2 * t + (e & 1);  // within the tile
          const float lse_q = ld_shared(&lse_cur[query]);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            const int key = n0 + key0 + mt * 16 + g + 8 * (e / 2);
            const int apart = m0 + query - key;
            const bool seen = key_real[mt][e / 2] && (!kWindowed || (apart <= w && apart >= -w));
            p[mt][nt][e] = seen ? exp2f(p[mt][nt][e] * scale_log2 - lse_q) : 0.f;
          }
        }
      }

      // dV += P^T dO: k runs over the tile's queries.
      mma_pb(dv_acc, p, sdO, kStride, lane);

      // dP^T = V dO^T: 16 MT keys x kBlockM queries, k runs over the head dim.
      float dpt[MT][kBlockM / 8][4] = {};
      mma_abt(dpt, va, sdO, kStride, lane);

      // dS^T = P^T * (dP^T - D), in place of P^T (softmax_scale comes at the end).
#pragma unroll
      for (int nt = 0; nt < kBlockM / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float d = ld_shared(&dsum_cur[nt * 8 + 2 * t + (e & 1)]);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) p[mt][nt][e] *= dpt[mt][nt][e] - d;
        }
      }

      // dK += dS^T Q: k runs over the tile's queries.
      mma_pb(dk_acc, p, sQ, kStride, lane);

      // dS^T to shared memory, rows = this warp's keys: dQ needs all the tile's keys of a query.
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < kBlockM / 8; ++nt) {
#pragma unroll
          for (int i = 0; i < 2; ++i)
            st_shared(reinterpret_cast<uint32_t*>(sdS + (key0 + mt * 16 + g + 8 * i) * kSStride + nt * 8 + 2 * t),
                      pack2<T>(p[mt][nt][2 * i], p[mt][nt][2 * i + 1]));
        }
      }
    }
    if (more) store_stats(next, next_stats);
    __syncthreads();  // barrier: every warp's dS^T rows are written

    // dQ = dS K for this warp's 16 queries and kDqCols head dims: A = dS read transposed
    // from dS^T, B = K (rows = keys = k); k runs over the tile's keys that hold a real one
    // and, with a window, lie within the window of one of the tile's queries: the steps
    // whose warp wrote its dS^T rows above.
    float dq_acc[1][kDqCols / 8][4] = {};
    for (int kj = 0; kj < dq_key_steps; ++kj) {
      if (kWindowed && !within_window(n0 + kj * 16, n0 + kj * 16 + 15, m0, last_query, w)) continue;
      uint32_t da[1][4];
      ldmatrix_x4_trans(da[0], a_cols(sdS, kSStride, dq_strip * 16, kj * 16, lane));
      mma_ab_step<T, 1, kDqCols / 8, HD / 2>(dq_acc, da, sK + dq_col0, kStride, kj * 16, lane);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = m0 + dq_strip * 16 + g + 8 * i;
      if (row < len) {
        if constexpr (kRotary) {  // the gradient of the rotated q, turned back: q's
#pragma unroll
          for (int dp = 0; dp < kDqCols / 16; ++dp) {
#pragma unroll
            for (int c = 0; c < 2; ++c)
              unrotate(dq_acc[0][2 * dp][2 * i + c], dq_acc[0][2 * dp + 1][2 * i + c], row,
                       dq_col0 + dp * 8 + 2 * t + c, freqs);
          }
        }
        const int64_t at = base + row * row_stride + dq_col0 + 2 * t;  // in dq_accum
        const int64_t dq_at = grad_base + row * dqkv_stride + dq_col0 + 2 * t;
#pragma unroll
        for (int dt = 0; dt < kDqCols / 8; ++dt) {
          const int col = (dt / 2) * 8 + (dt % 2) * (HD / 2);  // n8 tile dt's, from dq_col0
          if constexpr (kOneTile) {
            // The only key tile of the sequence: this is the whole of dQ, stored once.
            *reinterpret_cast<uint32_t*>(dq + dq_at + col) =
                pack2<T>(dq_acc[0][dt][2 * i] * scale, dq_acc[0][dt][2 * i + 1] * scale);
          } else if (dq_slot != nullptr) {
            // The only key tile of its parity that writes these rows: a plain store.
            const float pair[2] = {dq_acc[0][dt][2 * i] * scale, dq_acc[0][dt][2 * i + 1] * scale};
            store_floats<float, 2>(dq_slot + at + col, pair);
          } else {
            // Every key tile of the sequence adds to these rows.
            atomicAdd(dq_accum + at + col, dq_acc[0][dt][2 * i] * scale);
            atomicAdd(dq_accum + at + col + 1, dq_acc[0][dt][2 * i + 1] * scale);
          }
        }
      }
    }
  }

  if (!has_keys) return;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int key = n0 + key0 + mt * 16 + g + 8 * i;
      if (key < len) {
        if constexpr (kRotary) {  // the gradient of the rotated k, turned back: k's
#pragma unroll
          for (int dt = 0; dt < HD / 16; ++dt) {
#pragma unroll
            for (int c = 0; c < 2; ++c)
              unrotate(dk_acc[mt][dt][2 * i + c], dk_acc[mt][dt + HD / 16][2 * i + c], key, dt * 8 + 2 * t + c,
                       freqs);
          }
        }
        const int64_t at = grad_base + key * dqkv_stride + 2 * t;
#pragma unroll
        for (int dt = 0; dt < HD / 8; ++dt) {
          *reinterpret_cast<uint32_t*>(dk + at + dt * 8) =
              pack2<T>(dk_acc[mt][dt][2 * i] * scale, dk_acc[mt][dt][2 * i + 1] * scale);
          *reinterpret_cast<uint32_t*>(dv + at + dt * 8) =
              pack2<T>(dv_acc[mt][dt][2 * i], dv_acc[mt][dt][2 * i + 1]);
        }
      }
    }
  }
}

// dst row r (dst_stride elements apart) = src row r (cols elements, contiguous), converted.
template <typename T>
__global__ void __launch_bounds__(256) convert_kernel(const float* __restrict__ src, T* __restrict__ dst, int64_t n,
                                                      int64_t cols, int64_t dst_stride) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t row = i / cols;
    dst[row * dst_stride + (i - row * cols)] = from_float<T>(src[i]);
  }
}

// dQ of a windowed backward from its two slots (dq_in_slots): row p of a sequence is the sum of
// slot t % 2 over the key tiles t whose CTA wrote the row (dq_rows), converted; dst rows are
// dst_stride elements apart. A CTA takes kSlotRows rows of one sequence (blockIdx.y), every head.
// With a window of at most kBlockN / 2 (the launcher's condition, bwd_dq_slots) tile t writes no
// row before (t - 1/2) kBlockN nor from (t + 3/2) kBlockN on, so row p's writers are among the
// tiles p / kBlockN - 1 .. p / kBlockN + 1.
constexpr int kSlotRows = 8;  // rows per dq_slots_kernel CTA

template <typename T, int HD>
__global__ void __launch_bounds__(256) dq_slots_kernel(const float* __restrict__ slots, T* __restrict__ dst,
                                                       const int* __restrict__ cu_seqlens, int num_heads,
                                                       int64_t total, int64_t dst_stride, int window) {
  constexpr int kBlockN = kBwdBlockN<HD>;
  const int start = cu_seqlens[blockIdx.y];
  const int len = cu_seqlens[blockIdx.y + 1] - start;
  const int p0 = blockIdx.x * kSlotRows;
  if (p0 >= len) return;
  const int w = window < len ? window : len;  // as the backward clamps it
  const int cols = num_heads * HD, vectors = cols / 4;
  const int64_t slot_size = total * cols;
  const int last_tile = (len - 1) / kBlockN;
  for (int i = threadIdx.x; i < kSlotRows * vectors; i += blockDim.x) {
    const int p = p0 + i / vectors, col = i % vectors * 4;
    if (p >= len) break;  // i grows: every later one is past the end too
    float sum[4] = {0.f, 0.f, 0.f, 0.f};
    const int t_hi = p / kBlockN + 1 < last_tile ? p / kBlockN + 1 : last_tile;
    for (int t = p / kBlockN > 0 ? p / kBlockN - 1 : 0; t <= t_hi; ++t) {
      const Span rows = dq_rows<HD, true>(t * kBlockN, len, w);
      if (p < rows.lo || p >= rows.hi) continue;
      float part[4];
      load_floats<float, 4>(slots + (t % 2) * slot_size + (int64_t)(start + p) * cols + col, part);
#pragma unroll
      for (int e = 0; e < 4; ++e) sum[e] += part[e];
    }
    store_floats<T, 4>(dst + (int64_t)(start + p) * dst_stride + col, sum);
  }
}

// ---------------------------------------------------------------- launch

// Whether the kernels of a head dim and options are compiled in: all of them, except where the
// CPU emulation builds an edited copy of this file (a planted mistake) whose check runs one
// configuration, BDS_EMULATE_HEAD_DIM, BDS_EMULATE_WINDOWED and BDS_EMULATE_ROTARY (0 or 1): that
// copy then compiles its 3 kernels of the 24 per dtype (as BDS_EMULATE_DTYPE does, common.cuh).
constexpr bool compiled_attention([[maybe_unused]] int head_dim, [[maybe_unused]] bool windowed,
                                  [[maybe_unused]] bool rotary) {
#ifdef BDS_EMULATE_HEAD_DIM
  return head_dim == BDS_EMULATE_HEAD_DIM && windowed == (BDS_EMULATE_WINDOWED != 0) &&
         rotary == (BDS_EMULATE_ROTARY != 0);
#else
  return true;
#endif
}

// Calls f(T{}, std::integral_constant<int, HD>{}) for the supported dtypes and head dims.
template <typename F>
cudaError_t with_attention_types(int dtype, int head_dim, F&& f) {
  auto with_hd = [&](auto t) -> cudaError_t {
    if (head_dim == 32) return f(t, std::integral_constant<int, 32>{});
    if (head_dim == 64) return f(t, std::integral_constant<int, 64>{});
    return cudaErrorInvalidValue;
  };
  if constexpr (compiled_dtype(BDS_FLOAT16)) {
    if (dtype == BDS_FLOAT16) return with_hd(__half{});
  }
  if constexpr (compiled_dtype(BDS_BFLOAT16)) {
    if (dtype == BDS_BFLOAT16) return with_hd(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}

// Calls f(std::bool_constant<kWindowed>{}, std::bool_constant<kRotary>{}): a window where
// window >= 0, rotary embeddings where rope_theta > 0 (at head dim HD: compiled_attention).
template <int HD, typename F>
cudaError_t with_attention_options(int window, float rope_theta, F&& f) {
  auto with = [&](auto windowed, auto rotary) -> cudaError_t {
    if constexpr (compiled_attention(HD, decltype(windowed)::value, decltype(rotary)::value)) {
      return f(windowed, rotary);
    } else {
      return cudaErrorInvalidValue;
    }
  };
  auto with_rotary = [&](auto windowed) -> cudaError_t {
    return rope_theta > 0.f ? with(windowed, std::true_type{}) : with(windowed, std::false_type{});
  };
  return window >= 0 ? with_rotary(std::true_type{}) : with_rotary(std::false_type{});
}

// The kernels' rotary frequencies for a base theta: theta^(-2d/head_dim) of d < head_dim/2, in
// double, rounded once to fp32 (zeros without a theta: the kernels then do not read them).
RotaryFreqs rotary_freqs(float rope_theta, int head_dim) {
  RotaryFreqs freqs{};
  for (int d = 0; rope_theta > 0.f && d < head_dim / 2; ++d)
    freqs.inv_freq[d] = (float)std::pow((double)rope_theta, -2.0 * d / head_dim);
  return freqs;
}

bool valid_sizes(int batch, int64_t total, int num_heads, int max_seqlen) {
  return batch >= 0 && batch <= 65535 && total >= 0 && num_heads > 0 && num_heads <= 65535 && max_seqlen >= 0;
}

// A rotary base: none (0) or a finite positive theta.
bool valid_rope_theta(float rope_theta) { return rope_theta == 0.f || (rope_theta > 0.f && std::isfinite(rope_theta)); }

// A token stride of q, k, v or their gradients: at least a token's heads, and a multiple of
// 8 elements, so that every row starts 16-byte aligned for cp.async and the 4-byte stores.
bool valid_stride(int64_t stride, int num_heads, int head_dim) {
  return stride >= (int64_t)num_heads * head_dim && stride % 8 == 0;
}

// Lets `kernel` be launched with `bytes` of dynamic shared memory: above the default 48 KB
// a kernel must opt in (once per device would do; FlashAttention sets it at every launch too,
// which keeps a process that drives several devices right at the cost of a host call).
template <typename Kernel>
cudaError_t allow_dynamic_smem(Kernel* kernel, int bytes) {
  if (bytes <= kDefaultDynamicSmem) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

// The fp32 workspaces, each (total, num_heads, HD), where the backward of sequences up to
// max_seqlen long sums dQ over its key tiles: 0 where every sequence fits one key tile (dQ is
// stored by the kernel); 2 where, with a window, the rows of key tiles t and t + 2 never meet,
// so that each tile stores to the slot of its parity and dq_slots_kernel adds the two; else 1,
// which every key tile adds to with atomics (global attention, wider windows). Tile t's rows
// (dq_rows) lie in [t kBlockN - round_up(window, kBlockM), (t + 1) kBlockN + round_up(window,
// kBlockM)), so those of t and t + 2 never meet where round_up(window, kBlockM) <= kBlockN / 2,
// i.e. window <= kBlockN / 2 = 64 (a multiple of kBlockM): ModernBERT's window, at both head dims.
template <int HD>
int bwd_dq_slots(int max_seqlen, int window) {
  constexpr int kBlockN = kBwdBlockN<HD>;
  static_assert(kBlockN / 2 % BwdTiles<HD>::kBlockM == 0, "the widest window of the slots is whole query tiles");
  if (max_seqlen <= kBlockN) return 0;
  return window >= 0 && window <= kBlockN / 2 ? 2 : 1;
}

template <typename T, int HD, bool kWindowed, bool kRotary>
cudaError_t launch_fwd(const void* q, const void* k, const void* v, const int* cu_seqlens, void* out, float* lse,
                       int batch, int64_t total, int64_t qkv_stride, int num_heads, int max_seqlen, int window,
                       float rope_theta, float softmax_scale, cudaStream_t stream) {
  constexpr int kBytes = FwdSmem<T, HD>::kBytes;
  const cudaError_t err = allow_dynamic_smem(attention_fwd_kernel<T, HD, kWindowed, kRotary>, kBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid((max_seqlen + kFwdBlockM - 1) / kFwdBlockM, batch, num_heads);
  attention_fwd_kernel<T, HD, kWindowed, kRotary><<<grid, kFwdThreads, kBytes, stream>>>(
      static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), cu_seqlens,
      static_cast<T*>(out), lse, num_heads, total, qkv_stride, softmax_scale * kLog2e, window,
      rotary_freqs(rope_theta, HD));
  return cudaGetLastError();
}

template <typename T, int HD, bool kOneTile, bool kWindowed, bool kRotary>
cudaError_t launch_bwd(const void* q, const void* k, const void* v, const void* dout, const float* lse,
                       const float* dsum, const int* cu_seqlens, float* dq_accum, bool dq_in_slots, void* dq,
                       void* dk, void* dv, int batch, int64_t total, int64_t qkv_stride, int64_t dqkv_stride,
                       int num_heads, int max_seqlen, int window, float rope_theta, float softmax_scale,
                       cudaStream_t stream) {
  constexpr int kBytes = BwdSmem<T, HD>::kBytes;
  auto* const kernel = attention_bwd_kernel<T, HD, kOneTile, kWindowed, kRotary>;
  cudaError_t err = allow_dynamic_smem(kernel, kBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid(kOneTile ? 1 : (max_seqlen + kBwdBlockN<HD> - 1) / kBwdBlockN<HD>, batch, num_heads);
  kernel<<<grid, kBwdThreads<HD>, kBytes, stream>>>(
      static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), static_cast<const T*>(dout),
      lse, dsum, cu_seqlens, dq_accum, static_cast<T*>(dq), static_cast<T*>(dk), static_cast<T*>(dv), num_heads,
      total, qkv_stride, dqkv_stride, softmax_scale, softmax_scale * kLog2e, window, dq_in_slots,
      rotary_freqs(rope_theta, HD));
  return cudaGetLastError();
}

}  // namespace
}  // namespace bds

using namespace bds;

extern "C" cudaError_t bds_varlen_attention_fwd(const void* q, const void* k, const void* v, const int* cu_seqlens,
                                                void* out, float* lse, int batch, int64_t total,
                                                int64_t qkv_stride, int num_heads, int head_dim, int max_seqlen,
                                                int window, float rope_theta, float softmax_scale, int dtype,
                                                cudaStream_t stream) {
  if (!valid_sizes(batch, total, num_heads, max_seqlen) || !valid_stride(qkv_stride, num_heads, head_dim) ||
      !valid_rope_theta(rope_theta))
    return cudaErrorInvalidValue;
  return with_attention_types(dtype, head_dim, [&](auto t, auto hd) -> cudaError_t {
    using T = decltype(t);
    constexpr int HD = decltype(hd)::value;
    if (batch == 0 || total == 0 || max_seqlen == 0) return cudaSuccess;
    return with_attention_options<HD>(window, rope_theta, [&](auto windowed, auto rotary) -> cudaError_t {
      return launch_fwd<T, HD, decltype(windowed)::value, decltype(rotary)::value>(
          q, k, v, cu_seqlens, out, lse, batch, total, qkv_stride, num_heads, max_seqlen, window, rope_theta,
          softmax_scale, stream);
    });
  });
}

extern "C" cudaError_t bds_varlen_attention_bwd(const void* dout, const void* q, const void* k, const void* v,
                                                const void* out, const float* lse, const int* cu_seqlens,
                                                void* dq, void* dk, void* dv, float* dq_accum, float* dsum,
                                                int batch, int64_t total, int64_t qkv_stride, int64_t dqkv_stride,
                                                int num_heads, int head_dim, int max_seqlen, int window,
                                                float rope_theta, float softmax_scale, int dtype,
                                                cudaStream_t stream) {
  if (!valid_sizes(batch, total, num_heads, max_seqlen) || !valid_stride(qkv_stride, num_heads, head_dim) ||
      !valid_stride(dqkv_stride, num_heads, head_dim) || !valid_rope_theta(rope_theta))
    return cudaErrorInvalidValue;
  return with_attention_types(dtype, head_dim, [&](auto t, auto hd) -> cudaError_t {
    using T = decltype(t);
    constexpr int HD = decltype(hd)::value;
    if (batch == 0 || total == 0 || max_seqlen == 0) return cudaSuccess;
    const int slots = bwd_dq_slots<HD>(max_seqlen, window);
    if (slots > 0 && dq_accum == nullptr) return cudaErrorInvalidValue;
    const int64_t elements = total * num_heads * HD;
    cudaError_t err;
    if (slots == 1 && (err = cudaMemsetAsync(dq_accum, 0, elements * sizeof(float), stream)) != cudaSuccess)
      return err;

    const int64_t rows = total * num_heads;
    attention_dsum_kernel<T, HD><<<(unsigned)((rows + kDsumWarps - 1) / kDsumWarps), kDsumWarps * 32, 0, stream>>>(
        static_cast<const T*>(dout), static_cast<const T*>(out), dsum, num_heads, total);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;

    err = with_attention_options<HD>(window, rope_theta, [&](auto windowed, auto rotary) -> cudaError_t {
      constexpr bool kWindowed = decltype(windowed)::value, kRotary = decltype(rotary)::value;
      if (slots == 0)  // one key tile per sequence: dQ is written by the kernel, no sum, no conversion
        return launch_bwd<T, HD, true, kWindowed, kRotary>(q, k, v, dout, lse, dsum, cu_seqlens, nullptr, false,
                                                           dq, dk, dv, batch, total, qkv_stride, dqkv_stride,
                                                           num_heads, max_seqlen, window, rope_theta,
                                                           softmax_scale, stream);
      return launch_bwd<T, HD, false, kWindowed, kRotary>(q, k, v, dout, lse, dsum, cu_seqlens, dq_accum,
                                                          slots == 2, dq, dk, dv, batch, total, qkv_stride,
                                                          dqkv_stride, num_heads, max_seqlen, window, rope_theta,
                                                          softmax_scale, stream);
    });
    if (err != cudaSuccess || slots == 0) return err;

    if (slots == 2) {
      const dim3 grid((max_seqlen + kSlotRows - 1) / kSlotRows, batch);
      dq_slots_kernel<T, HD><<<grid, 256, 0, stream>>>(dq_accum, static_cast<T*>(dq), cu_seqlens, num_heads, total,
                                                        dqkv_stride, window);
    } else {
      const int64_t wanted = (elements + 255) / 256, cap = 16LL * device_sm_count();
      convert_kernel<T><<<(unsigned)(wanted < cap ? wanted : cap), 256, 0, stream>>>(
          dq_accum, static_cast<T*>(dq), elements, (int64_t)num_heads * HD, dqkv_stride);
    }
    return cudaGetLastError();
  });
}

extern "C" int bds_varlen_attention_bwd_dq_slots(int head_dim, int max_seqlen, int window) {
  if (head_dim == 32) return bwd_dq_slots<32>(max_seqlen, window);
  if (head_dim == 64) return bwd_dq_slots<64>(max_seqlen, window);
  return 0;
}
