// A CPU stand-in for the CUDA runtime, so that kernels/csrc/*.cu can be compiled as C++
// (with -DBDS_EMULATE and this directory first on the include path) and their logic
// tested on a machine without a GPU: tests/kernels/test_cuda_emulated.py.
//
// Model: one block at a time, its threads as cooperative fibers (ucontext) on one OS
// thread. __syncthreads and the warp-synchronous operations are barriers among the
// fibers; shuffles, ldmatrix and mma.sync exchange values through per-warp slots, and
// ldmatrix/mma reproduce the fragment layouts of the PTX ISA ("Matrix fragments for
// mma.m16n8k16", "ldmatrix"). __shared__ variables become function statics, shared by
// the block's fibers. Kernel launches are rewritten to emu::launch by the test before
// compiling (`k<<<grid, block, smem, stream>>>(args)` -> `::emu::launch(k, grid, ...)`),
// and `extern __shared__ T name[]` to a pointer to the first `smem` bytes of one static
// buffer (dynamic_shared), the launch's dynamic shared memory.
//
// Dynamic shared memory follows an A100's rules, the stricter of the two targets, so that
// a kernel the emulation accepts fits an H100 too: a launch may ask for 48 KB, or up to
// 163 KB (166,912 bytes) once cudaFuncSetAttribute(kernel,
// cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) has allowed it; a larger setting is
// cudaErrorInvalidValue and a launch past its allowance an `emu:` report. Accesses through
// the contract past the launch's bytes are reported (shared_memory.h), and a kernel that
// declares more than it was given (declare_dynamic_smem) too. Static and dynamic shared
// memory are not summed against the limit (the static arrays live apart): kernels/inspect.py
// checks the sum with the compiler's figures.
//
// What it checks: indexing, tiling, masking, fragment bookkeeping and the arithmetic;
// barriers that can never open (a deadlock report); and, for shared memory reached through
// the kernels' contract (cp_async_16/commit/wait, ld_shared/st_shared, ldmatrix: see
// shared_memory.h), every read of bytes whose cp.async the issuing thread has not waited
// for, and every write-then-read, write-then-write or read-then-write of the same bytes by
// two different warps with no __syncthreads between. Those are found from the accesses
// themselves, whatever order the fibers run in, and end the process with one line
// `emu: ...` naming the block, warp, lane and shared address.
// What it cannot: timing; races on shared memory a kernel touches directly (plain loads
// and stores of a __shared__ array: only wrong values can show those), on global memory,
// or between lanes of one warp; the real hardware's accumulation order inside an mma; and
// device-only failure modes.
#pragma once

#define __shared__ static  // before host_defines.h, which leaves a defined __shared__ alone
#define __launch_bounds__(...)
#define __grid_constant__  // a kernel parameter read in place on a GPU; here one like any other

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <driver_types.h>
#include <stdint.h>
#include <ucontext.h>
#include <vector_functions.h>
#include <vector_types.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <vector>

// ----------------------------------------------------------------- runtime API subset

// cudaError_t, cudaStream_t, cudaDeviceAttr: the real (host-compatible) declarations.
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline cudaError_t cudaGetDevice(int* device) { *device = 0; return cudaSuccess; }
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr, int) { *value = 2; return cudaSuccess; }
inline cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t) {
  std::memset(p, value, bytes);
  return cudaSuccess;
}

// Kernel attributes: only the dynamic shared memory allowance is kept (emu::launch checks it).
namespace emu {
constexpr size_t kDefaultDynamicSmem = 48 * 1024;  // what any launch may ask for
constexpr size_t kMaxDynamicSmem = 166912;         // an A100's opt-in limit per block (163 KB)
inline std::unordered_map<const void*, size_t>& dynamic_smem_allowed() {
  static std::unordered_map<const void*, size_t> allowed;
  return allowed;
}
}  // namespace emu

template <typename... P>
inline cudaError_t cudaFuncSetAttribute(void (*kernel)(P...), cudaFuncAttribute attribute, int value) {
  if (attribute != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaSuccess;  // recorded nowhere: no effect here
  if (value < 0 || (size_t)value > emu::kMaxDynamicSmem) return cudaErrorInvalidValue;
  emu::dynamic_smem_allowed()[reinterpret_cast<const void*>(kernel)] = (size_t)value;
  return cudaSuccess;
}

// Grids sized from the occupancy API see a small, fixed device: 2 SMs (above), 2 blocks each.
template <typename F>
inline cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, F, int, size_t) {
  *blocks = 2;
  return cudaSuccess;
}

inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
// The hardware's fast sine and cosine (the kernels call it on [-pi, pi], where it is accurate to
// ~2^-21): the library's, which is closer.
inline void __sincosf(float x, float* s, float* c) {
  *s = std::sin(x);
  *c = std::cos(x);
}

// ----------------------------------------------------------------- fibers and barriers

namespace emu {

struct Barrier {
  int alive = 0, arrived = 0;
  unsigned generation = 0;
};

// What the lanes of a warp exchange in one warp-wide operation: each writes its entry,
// all meet at the warp barrier, each reads what it needs.
struct Slots {
  uint64_t value[32];          // shuffles
  const void* address[32];     // ldmatrix row addresses
  uint32_t regs[32][6];        // mma operands
  float product[16][8];        // mma: A B, computed once by the first lane that needs it
  bool product_ready;
};

// Two sets of slots, for alternate operations: a lane can start the operation after next
// (which reuses a set) only once every lane has arrived at the next one, so by then every
// lane has read this operation's set, and one barrier per operation suffices.
struct Warp {
  Barrier barrier;
  Slots slots[2];
};

// A cp.async in flight: its bytes, snapshotted at issue, land at the wait covering `group`.
struct AsyncCopy {
  unsigned char* dst;
  unsigned char bytes[16];
  unsigned group;  // the thread's committed-group count when it was issued
};

struct Fiber {
  ucontext_t context;
  std::vector<char> stack;
  dim3 thread_idx;
  int linear = 0;
  bool done = false;
  bool at_block_barrier = false;  // waiting in __syncthreads for `block_generation` to pass
  unsigned block_generation = 0;
  std::vector<AsyncCopy> copies;  // issued, not landed; oldest first
  unsigned committed_groups = 0;
  unsigned warp_ops = 0;  // warp-wide operations so far: picks the Slots set (every lane calls the same sequence)
};

struct State {
  std::vector<Fiber> fibers;
  ucontext_t scheduler;
  int current = -1;
  dim3 block_idx, block_dim, grid_dim;
  Barrier block;
  std::vector<Warp> warps;
  std::function<void()> body;
  long idle_yields = 0;  // yields since a barrier last opened or a fiber finished
  uint32_t epoch = 0;    // advances at every block start and __syncthreads: shared_memory.h's race clock
  uint32_t block_epoch = 0;  // the epoch this block started in: older writes are another block's bytes
  size_t dynamic_smem = 0;   // bytes of dynamic shared memory the running launch gave
  long long atomic_adds = 0;  // atomicAdd calls so far (bds_emu_atomic_adds)
};

inline State& state() {
  static State s;
  return s;
}
inline Fiber& me() { return state().fibers[state().current]; }
inline int lane_id() { return me().linear % 32; }
inline Warp& my_warp() { return state().warps[me().linear / 32]; }

inline void yield() {
  State& s = state();
  if (++s.idle_yields > 4L * (long)s.fibers.size() + 64) {
    std::fprintf(stderr, "emu: deadlock in block (%u, %u, %u): every live thread waits at a barrier that cannot open\n",
                 s.block_idx.x, s.block_idx.y, s.block_idx.z);
    std::abort();
  }
  swapcontext(&s.fibers[s.current].context, &s.scheduler);
}

inline void open(Barrier& b) {
  b.arrived = 0;
  ++b.generation;
  state().idle_yields = 0;
  if (&b == &state().block) ++state().epoch;
}

inline void arrive_and_wait(Barrier& b) {
  const unsigned generation = b.generation;
  if (++b.arrived == b.alive) {
    open(b);
    return;
  }
  while (b.generation == generation) yield();
}

inline void leave(Barrier& b) {
  --b.alive;
  if (b.arrived > 0 && b.arrived == b.alive) open(b);
}

inline void block_sync() {
  State& s = state();
  Fiber& f = me();
  f.at_block_barrier = true;
  f.block_generation = s.block.generation;
  arrive_and_wait(s.block);
  f.at_block_barrier = false;
}

inline bool blocked(const Fiber& f) {
  return f.done || (f.at_block_barrier && f.block_generation == state().block.generation);
}

// Warp-synchronous operations require the whole warp (they are all .sync.aligned or
// full-mask here); a partial warp is a kernel bug.
inline Warp& full_warp(const char* what) {
  Warp& w = my_warp();
  if (w.barrier.alive != 32) {
    std::fprintf(stderr, "emu: %s with %d live lanes in the warp (needs 32)\n", what, w.barrier.alive);
    std::abort();
  }
  return w;
}
inline void warp_sync() { arrive_and_wait(my_warp().barrier); }
inline Slots& next_slots(Warp& w) { return w.slots[me().warp_ops++ % 2]; }

inline void land_copies(int pending);  // shared_memory.h: lands a thread's cp.async copies

inline void fiber_entry() {
  State& s = state();
  s.body();
  land_copies(-1);
  Fiber& f = me();
  f.done = true;
  leave(s.block);
  leave(s.warps[f.linear / 32].barrier);
  s.idle_yields = 0;
  swapcontext(&f.context, &s.scheduler);
}

inline void run_block(dim3 block_idx) {
  State& s = state();
  s.block_idx = block_idx;
  const int n = (int)(s.block_dim.x * s.block_dim.y * s.block_dim.z);
  if (n < 1 || n > 1024) {  // CUDA's limit, which the shared-memory shadow relies on (a warp mask in 32 bits)
    std::fprintf(stderr, "emu: a block of %d threads (CUDA allows 1 to 1024)\n", n);
    std::abort();
  }
  s.fibers.resize(n);
  s.warps.assign((n + 31) / 32, Warp{});
  s.block = Barrier{};
  s.block.alive = n;
  s.block_epoch = ++s.epoch;
  for (int i = 0; i < n; ++i) s.warps[i / 32].barrier.alive++;
  for (int i = 0; i < n; ++i) {
    Fiber& f = s.fibers[i];
    f.stack.resize(1 << 18);
    f.linear = i;
    f.done = false;
    f.copies.clear();
    f.committed_groups = 0;
    f.warp_ops = 0;
    f.thread_idx = dim3(i % s.block_dim.x, (i / s.block_dim.x) % s.block_dim.y, i / (s.block_dim.x * s.block_dim.y));
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack.data();
    f.context.uc_stack.ss_size = f.stack.size();
    f.context.uc_link = nullptr;
    makecontext(&f.context, fiber_entry, 0);
  }
  // Each warp runs as far as it can (to the next __syncthreads or its end) before the
  // next warp starts, in forward order on even blocks and backward on odd ones: warps
  // drift apart as much as the barriers allow, so a missing __syncthreads shows up as
  // a read of shared memory another warp has not written yet (or has overwritten).
  s.idle_yields = 0;
  const int warps = (n + 31) / 32;
  const bool backward = (block_idx.x + block_idx.y + block_idx.z) % 2 == 1;
  for (bool live = true; live;) {
    live = false;
    for (int wi = 0; wi < warps; ++wi) {
      const int w = backward ? warps - 1 - wi : wi;
      for (bool ran = true; ran;) {
        ran = false;
        for (int i = 32 * w; i < n && i < 32 * (w + 1); ++i) {
          if (blocked(s.fibers[i])) continue;
          s.current = i;
          swapcontext(&s.scheduler, &s.fibers[i].context);
          ran = true;
        }
      }
    }
    for (int i = 0; i < n; ++i) live = live || !s.fibers[i].done;
  }
  s.current = -1;
}

// The dynamic shared memory of every launch: one buffer, so that its shadow words persist
// (shared_memory.h). Larger than any launch may ask for, so that an access past the launch's
// bytes still falls inside it and is reported rather than touching other memory.
constexpr size_t kDynamicSmemBuffer = 256 * 1024;
inline unsigned char* dynamic_smem_base() {
  alignas(128) static unsigned char buffer[kDynamicSmemBuffer];
  return buffer;
}

// What `extern __shared__ T name[]` becomes: the start of the launch's dynamic shared memory.
template <typename T>
inline T* dynamic_shared() {
  return reinterpret_cast<T*>(dynamic_smem_base());
}

template <typename... P, typename... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t, A&&... args) {
  State& s = state();
  if (smem > kDefaultDynamicSmem) {
    const auto found = dynamic_smem_allowed().find(reinterpret_cast<const void*>(kernel));
    const size_t allowed = found == dynamic_smem_allowed().end() ? kDefaultDynamicSmem : found->second;
    if (smem > allowed) {
      std::fprintf(stderr, "emu: launch with %zu bytes of dynamic shared memory, above the %zu the kernel allows: "
                   "past 48 KB it needs cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, "
                   "%zu) first\n", smem, allowed, smem);
      std::abort();
    }
  }
  s.dynamic_smem = smem;
  std::tuple<std::decay_t<P>...> params(static_cast<std::decay_t<P>>(args)...);
  s.body = [&] { std::apply(kernel, params); };
  s.grid_dim = grid;
  s.block_dim = block;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) run_block(dim3(x, y, z));
}

template <typename T>
float decode(uint16_t bits) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const uint32_t wide = (uint32_t)bits << 16;
    float f;
    std::memcpy(&f, &wide, 4);
    return f;
  } else {
    __half h;
    std::memcpy(&h, &bits, 2);
    return __half2float(h);
  }
}

}  // namespace emu

#define threadIdx (::emu::me().thread_idx)
#define blockIdx (::emu::state().block_idx)
#define blockDim (::emu::state().block_dim)
#define gridDim (::emu::state().grid_dim)

inline void __syncthreads() { emu::block_sync(); }

template <typename T>
T __shfl_xor_sync(unsigned, T v, int lane_mask) {
  static_assert(sizeof(T) <= 8, "shuffle of a value wider than 8 bytes");
  emu::Warp& w = emu::full_warp("__shfl_xor_sync");
  const int lane = emu::lane_id();
  emu::Slots& slots = emu::next_slots(w);
  std::memcpy(&slots.value[lane], &v, sizeof(T));
  emu::warp_sync();
  T out;
  std::memcpy(&out, &slots.value[lane ^ lane_mask], sizeof(T));
  return out;
}

// Fibers switch only at barriers, so a plain add is atomic here.
inline float atomicAdd(float* address, float value) {
  ++emu::state().atomic_adds;
  const float old = *address;
  *address = old + value;
  return old;
}

// The atomicAdd calls the library's kernels have made so far: a test of a path that must make none
// reads it before and after (exported from every library built on the emulator).
extern "C" __attribute__((used)) inline long long bds_emu_atomic_adds() { return emu::state().atomic_adds; }

#include "shared_memory.h"

// ----------------------------------------------------------------- tensor-core operations

namespace bds {

inline void emu_ldmatrix(uint32_t (&r)[4], const void* row_address, bool trans) {
  emu::Warp& w = emu::full_warp("ldmatrix");
  const int lane = emu::lane_id();
  emu::require_aligned("ldmatrix row", row_address, 16);
  emu::track_read(row_address, 16, "ldmatrix reads");
  emu::Slots& slots = emu::next_slots(w);
  slots.address[lane] = row_address;
  emu::warp_sync();
  for (int i = 0; i < 4; ++i) {
    auto row = [&](int r8) { return static_cast<const uint16_t*>(slots.address[8 * i + r8]); };
    uint16_t lo, hi;
    if (!trans) {  // row lane/4, columns 2(lane%4), 2(lane%4)+1
      lo = row(lane / 4)[2 * (lane % 4)];
      hi = row(lane / 4)[2 * (lane % 4) + 1];
    } else {  // of the transpose: rows 2(lane%4), 2(lane%4)+1 of column lane/4
      lo = row(2 * (lane % 4))[lane / 4];
      hi = row(2 * (lane % 4) + 1)[lane / 4];
    }
    r[i] = (uint32_t)lo | ((uint32_t)hi << 16);
  }
}

inline void ldmatrix_x4(uint32_t (&r)[4], const void* row_address) { emu_ldmatrix(r, row_address, false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row_address) { emu_ldmatrix(r, row_address, true); }

// The warp's A (16 x 16) and B (16 x 8) from the lanes' operand registers, and their product.
template <typename T>
void mma_product(emu::Slots& slots) {
  float A[16][16], B[16][8];
  auto lo = [](uint32_t r) { return emu::decode<T>((uint16_t)(r & 0xffffu)); };
  auto hi = [](uint32_t r) { return emu::decode<T>((uint16_t)(r >> 16)); };
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, t = l % 4;
    const uint32_t* r = slots.regs[l];
    A[g][2 * t] = lo(r[0]);         A[g][2 * t + 1] = hi(r[0]);
    A[g + 8][2 * t] = lo(r[1]);     A[g + 8][2 * t + 1] = hi(r[1]);
    A[g][2 * t + 8] = lo(r[2]);     A[g][2 * t + 9] = hi(r[2]);
    A[g + 8][2 * t + 8] = lo(r[3]); A[g + 8][2 * t + 9] = hi(r[3]);
    B[2 * t][g] = lo(r[4]);         B[2 * t + 1][g] = hi(r[4]);
    B[2 * t + 8][g] = lo(r[5]);     B[2 * t + 9][g] = hi(r[5]);
  }
  for (int row = 0; row < 16; ++row) {
    for (int col = 0; col < 8; ++col) {
      float sum = 0.f;
      for (int k = 0; k < 16; ++k) sum += A[row][k] * B[k][col];
      slots.product[row][col] = sum;
    }
  }
  slots.product_ready = true;
}

template <typename T>
void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  emu::Warp& w = emu::full_warp("mma.sync");
  const int lane = emu::lane_id();
  emu::Slots& slots = emu::next_slots(w);
  const uint32_t mine[6] = {a[0], a[1], a[2], a[3], b0, b1};
  std::memcpy(slots.regs[lane], mine, sizeof(mine));
  slots.product_ready = false;  // no lane reads this set's product again: see Warp
  emu::warp_sync();
  if (!slots.product_ready) mma_product<T>(slots);
  const int g = lane / 4, t = lane % 4;
  for (int e = 0; e < 4; ++e) d[e] += slots.product[g + 8 * (e / 2)][2 * t + (e & 1)];
}

}  // namespace bds
