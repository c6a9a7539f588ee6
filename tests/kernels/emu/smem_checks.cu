// Self-test kernels for the emulator's shared-memory checks (tests/kernels/test_emulator.py):
// a cp.async double-buffered pipeline written through the contract that attention.cu uses
// (and the same pipeline with one step left out), in static or dynamic shared memory, a word
// exchanged between two warps through st_shared/ld_shared, one copy observed before and after
// its wait, and dynamic shared memory sized at launch (past 48 KB, past its end, short of
// what the kernel declares).
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int kThreads = 64;  // two warps: a race needs a second warp

enum Fault : int {
  kNone = 0,
  kMissingWait = 1,               // reads a tile before its cp.async group is waited for
  kMissingBarrierAfterWait = 2,   // warp 1 reads warp 0's landed copy with no __syncthreads (RAW)
  kMissingBarrierBeforeRefill = 3,  // a buffer refilled while the other warp may still read it (WAR)
};

// Tile t is src[t * kThreads .. +kThreads), 16 bytes per thread; entries at or past `n`
// are not read (valid == false: the copy zero-fills). Thread tid copies entry tid of each
// tile; it then reads its own entry and entry tid % 32, which warp 0 copied, so that warp 1
// depends on warp 0's copies. out[2 (t kThreads + tid)] and the next entry get the two.
// `dynamic`: the two buffers are the launch's dynamic shared memory instead of a static array.
__global__ void pipeline_kernel(const uint4* src, int n, uint4* out, int tiles, int fault, int dynamic) {
  __shared__ __align__(16) uint4 static_buffer[2][kThreads];
  extern __shared__ __align__(16) uint4 dynamic_buffer[];
  uint4 (*buffer)[kThreads] = dynamic ? reinterpret_cast<uint4 (*)[kThreads]>(dynamic_buffer) : static_buffer;
  const int tid = threadIdx.x;
  auto fetch = [&](int t) {
    const int i = t * kThreads + tid;
    bds::cp_async_16(&buffer[t % 2][tid], src + (i < n ? i : 0), i < n);
  };
  fetch(0);
  bds::cp_async_commit();
  for (int t = 0; t < tiles; ++t) {
    if (t + 1 < tiles) fetch(t + 1);  // into the buffer tile t - 1 used
    bds::cp_async_commit();
    if (fault != kMissingWait) bds::cp_async_wait<1>();  // tile t has landed, t + 1 may be in flight
    if (fault != kMissingBarrierAfterWait) __syncthreads();  // ... for every thread
    uint4* row = out + 2 * (t * kThreads + tid);
    row[0] = bds::ld_shared(&buffer[t % 2][tid]);
    row[1] = bds::ld_shared(&buffer[t % 2][tid % 32]);
    if (fault != kMissingBarrierBeforeRefill) __syncthreads();  // every read of buffer t % 2 is done
  }
  bds::cp_async_wait<0>();
}

// One word per thread through st_shared/ld_shared: each thread writes its word, then reads
// its partner's in the other warp. `barrier` == 0 leaves the __syncthreads out. The words
// start at 0 (written and published first), so the race is the only fault.
__global__ void exchange_kernel(const float* in, float* out, int barrier) {
  __shared__ __align__(16) float words[kThreads];
  const int tid = threadIdx.x;
  bds::st_shared(&words[tid], 0.f);
  __syncthreads();
  bds::st_shared(&words[tid], in[tid]);
  if (barrier) __syncthreads();
  out[tid] = bds::ld_shared(&words[(tid + 32) % kThreads]);
}

// When a copy lands: out[0] is read straight from the array (past the checks, which would
// refuse it) after the issue, out[1] through ld_shared after the wait.
__global__ void landing_kernel(const uint4* src, uint4* out) {
  __shared__ __align__(16) uint4 slot[1];
  bds::st_shared(&slot[0], make_uint4(7u, 7u, 7u, 7u));
  bds::cp_async_16(&slot[0], src, true);
  bds::cp_async_commit();
  out[0] = slot[0];
  bds::cp_async_wait<0>();
  out[1] = bds::ld_shared(&slot[0]);
}

// n floats of dynamic shared memory (the launch gives n * 4 bytes), in two blocks: each
// thread writes words tid, tid + kThreads, ..., then reads word i + 32 (mod n) for each of
// its i, which another warp wrote. `past`: thread 0 also reads word n, one past the end.
__global__ void dynamic_kernel(const float* in, float* out, int n, int past) {
  extern __shared__ __align__(16) float words[];
  const int tid = threadIdx.x;
  for (int i = tid; i < n; i += kThreads) bds::st_shared(&words[i], in[i]);
  __syncthreads();
  for (int i = tid; i < n; i += kThreads) out[blockIdx.x * n + i] = bds::ld_shared(&words[(i + 32) % n]);
  if (past && tid == 0) out[0] = bds::ld_shared(&words[n]);
}

// Uses 1 KB of dynamic shared memory, by its declaration.
__global__ void declared_kernel(float* out) {
  bds::declare_dynamic_smem<1024>();
  extern __shared__ __align__(16) float words[];
  bds::st_shared(&words[threadIdx.x], 1.f);
  out[threadIdx.x] = bds::ld_shared(&words[threadIdx.x]);
}

// Block 0 writes its words and reads them back; block 1 only reads (it forgot to write).
__global__ void uninitialised_kernel(float* out) {
  __shared__ __align__(16) float words[kThreads];
  const int tid = threadIdx.x;
  if (blockIdx.x == 0) bds::st_shared(&words[tid], (float)tid);
  __syncthreads();
  out[blockIdx.x * kThreads + tid] = bds::ld_shared(&words[tid]);
}

}  // namespace

extern "C" int emu_uninitialised(float* out) {
  uninitialised_kernel<<<2, kThreads, 0, 0>>>(out);
  return (int)cudaGetLastError();
}

extern "C" int emu_landing(const uint4* src, uint4* out) {
  landing_kernel<<<1, 1, 0, 0>>>(src, out);
  return (int)cudaGetLastError();
}

extern "C" int emu_pipeline(const uint4* src, int n, uint4* out, int tiles, int fault, int dynamic) {
  pipeline_kernel<<<1, kThreads, dynamic ? 2 * kThreads * sizeof(uint4) : 0, 0>>>(src, n, out, tiles, fault, dynamic);
  return (int)cudaGetLastError();
}

// allow_bytes > 0: cudaFuncSetAttribute(MaxDynamicSharedMemorySize, allow_bytes) first; its
// error, if any, is returned without launching.
extern "C" int emu_dynamic(const float* in, float* out, int n, int allow_bytes, int past) {
  if (allow_bytes > 0) {
    const cudaError_t err =
        cudaFuncSetAttribute(dynamic_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, allow_bytes);
    if (err != cudaSuccess) return (int)err;
  }
  dynamic_kernel<<<2, kThreads, n * sizeof(float), 0>>>(in, out, n, past);
  return (int)cudaGetLastError();
}

extern "C" int emu_declared(float* out, int bytes) {
  declared_kernel<<<1, 32, bytes, 0>>>(out);
  return (int)cudaGetLastError();
}

extern "C" int emu_exchange(const float* in, float* out, int barrier) {
  exchange_kernel<<<1, kThreads, 0, 0>>>(in, out, barrier);
  return (int)cudaGetLastError();
}
