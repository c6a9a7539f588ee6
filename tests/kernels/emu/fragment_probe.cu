// Exposes the emulator's ldmatrix_x4[_trans] and mma_16816 to Python one warp-wide call
// at a time, so tests/kernels/test_emulator.py can compare the registers each lane gets
// with the PTX ISA's fragment tables, entry by entry.
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int kRows = 64;  // rows of 8 16-bit elements (16 bytes) the lanes may point ldmatrix at

__global__ void ldmatrix_kernel(const uint4* rows, const int* row_of_lane, int trans, uint32_t* regs) {
  __shared__ __align__(16) uint4 tile[kRows];
  const int lane = threadIdx.x;
  for (int r = lane; r < kRows; r += 32) bds::st_shared(&tile[r], rows[r]);
  __syncthreads();
  uint32_t r[4];
  if (trans) {
    bds::ldmatrix_x4_trans(r, &tile[row_of_lane[lane]]);
  } else {
    bds::ldmatrix_x4(r, &tile[row_of_lane[lane]]);
  }
  for (int i = 0; i < 4; ++i) regs[4 * lane + i] = r[i];
}

template <typename T>
__global__ void mma_kernel(const uint32_t* a, const uint32_t* b, float* cd) {
  const int lane = threadIdx.x;
  const uint32_t fragment_a[4] = {a[4 * lane], a[4 * lane + 1], a[4 * lane + 2], a[4 * lane + 3]};
  float d[4] = {cd[4 * lane], cd[4 * lane + 1], cd[4 * lane + 2], cd[4 * lane + 3]};
  bds::mma_16816<T>(d, fragment_a, b[2 * lane], b[2 * lane + 1]);
  for (int i = 0; i < 4; ++i) cd[4 * lane + i] = d[i];
}

}  // namespace

// rows: kRows x 16 bytes; row_of_lane[32]: the row each lane's address points at;
// regs[32][4]: what each lane receives.
extern "C" int emu_ldmatrix_probe(const uint4* rows, const int* row_of_lane, int trans, uint32_t* regs) {
  ldmatrix_kernel<<<1, 32, 0, 0>>>(rows, row_of_lane, trans, regs);
  return (int)cudaGetLastError();
}

// a[32][4], b[32][2]: each lane's operand registers; cd[32][4]: its C in, D out. bf16 or fp16.
extern "C" int emu_mma_probe(const uint32_t* a, const uint32_t* b, float* cd, int bf16) {
  if (bf16) {
    mma_kernel<__nv_bfloat16><<<1, 32, 0, 0>>>(a, b, cd);
  } else {
    mma_kernel<__half><<<1, 32, 0, 0>>>(a, b, cd);
  }
  return (int)cudaGetLastError();
}
