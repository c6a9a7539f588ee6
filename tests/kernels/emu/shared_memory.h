// Shared memory as a kernel reaches it through the contract between kernels/csrc and this
// emulator (the GPU definitions sit in kernels/csrc/common.cuh, outside BDS_EMULATE):
// cp_async_16 / cp_async_commit / cp_async_wait<N> (cp.async.cg 16 bytes, commit_group,
// wait_group N), ld_shared / st_shared for every other access, and the reads of ldmatrix.
// Included by cuda_runtime.h after the fibers, before ldmatrix.
//
// cp.async: a copy is snapshotted at issue and lands (its 16 bytes written) only when
// the issuing thread's cp_async_wait covers its group, or when that thread exits (the
// hardware completes copies a thread never waits for). Until then shared memory keeps
// its old bytes, so a kernel that reads early reads stale data even if no check fired.
//
// Checks, always on. Every access through the contract is at least 4 bytes and
// naturally aligned (ld_shared/st_shared check it; ldmatrix rows and cp.async are 16
// aligned bytes), so one shadow Word per aligned 4-byte word sees every conflict a
// per-byte shadow would. A Word keeps the last writer and the block-barrier epoch of the
// write, the warps that read it in the current epoch, and the thread whose cp.async to it
// is in flight. Epochs are numbered across blocks, so nothing needs clearing between
// blocks. Errors end the process with one line `emu: ...`:
// - reading bytes with a copy in flight (the issuer's own: read before cp.async wait;
//   another thread's: a race), writing them, or issuing a second copy to them;
// - RAW / WAW: bytes written by warp A (st_shared, or a copy at landing) then read or
//   written by warp B != A in the same epoch (no __syncthreads between);
// - WAR: bytes read by warp B then written by warp A != B in the same epoch (a cp.async
//   counts as a write at issue here, so refilling a buffer too early is caught at once);
// - reading bytes no thread of this block wrote: shared arrays are statics here, so they
//   would hold an earlier block's (finite, plausible) values, and on a GPU whatever is
//   left there; a kernel that forgets to zero-fill the rows past a sequence's end must
//   not pass because of them;
// - any access (read, write, cp.async) to dynamic shared memory past the bytes the launch
//   gave (`out of bounds`): on a GPU it would land in another CTA's shared memory or fault.
// Dynamic shared memory is one static buffer (cuda_runtime.h), so these checks apply to it
// as they do to the static arrays.
// Shared memory touched directly (plain loads and stores of a __shared__ array) is not
// seen: only kernels that use the contract throughout are checked.
#pragma once

#include <cstdarg>
#include <memory>
#include <unordered_map>

namespace emu {

struct Word {
  uint32_t write_epoch = 0;  // 0: never written through the contract
  uint32_t read_epoch = 0;
  uint32_t readers = 0;     // bit w: warp w read it in read_epoch (a block has at most 32 warps)
  int16_t writer = -1;      // linear thread index of the last write
  int16_t in_flight = -1;   // linear thread index of the cp.async not landed yet, -1: none
};

// Shadow Words by address, in 4 KiB pages created on first touch. Shared arrays are
// function statics here, so their addresses are fixed for the life of the library.
class Shadow {
 public:
  Word& at(uintptr_t address) {
    const uintptr_t page = address >> kPageBits;
    if (page != last_page_) {
      std::unique_ptr<Word[]>& words = pages_[page];
      if (!words) words.reset(new Word[kWordsPerPage]);
      last_page_ = page;
      last_ = words.get();
    }
    return last_[(address & ((uintptr_t(1) << kPageBits) - 1)) >> 2];
  }

 private:
  static constexpr int kPageBits = 12;
  static constexpr int kWordsPerPage = (1 << kPageBits) / 4;
  std::unordered_map<uintptr_t, std::unique_ptr<Word[]>> pages_;
  uintptr_t last_page_ = ~uintptr_t(0);
  Word* last_ = nullptr;
};

inline Shadow& shadow() {
  static Shadow s;
  return s;
}

// One line, `emu: <what> in block (x, y, z): warp W lane L, shared address A, <detail>`,
// then abort: the process ends at the first error, like the deadlock report.
[[noreturn]] __attribute__((format(printf, 3, 4))) inline void report(const char* what, uintptr_t address,
                                                                      const char* detail, ...) {
  const State& s = state();
  const int self = me().linear;
  std::fprintf(stderr, "emu: %s in block (%u, %u, %u): warp %d lane %d, shared address %#lx, ", what, s.block_idx.x,
               s.block_idx.y, s.block_idx.z, self / 32, self % 32, (unsigned long)address);
  va_list args;
  va_start(args, detail);
  std::vfprintf(stderr, detail, args);
  va_end(args);
  std::fputc('\n', stderr);
  std::abort();
}

inline void check_read_not_in_flight(const Word& w, uintptr_t address, const char* access) {
  if (w.in_flight < 0) return;
  if (w.in_flight == me().linear)
    report("read before cp.async wait", address, "%s bytes its own cp.async has not landed in (no cp_async_wait "
           "covers it)", access);
  report("race", address, "%s bytes while a cp.async to them is in flight (issued by warp %d lane %d)", access,
         w.in_flight / 32, w.in_flight % 32);
}

inline void check_not_written_by_another_warp(const Word& w, uintptr_t address, const char* access) {
  if (w.write_epoch == state().epoch && w.writer / 32 != me().linear / 32)
    report("race", address, "%s bytes another warp wrote with no __syncthreads between (warp %d lane %d)", access,
           w.writer / 32, w.writer % 32);
}

// A write (st_shared, a copy's issue or landing) must follow every other warp's access
// to the word in this epoch by a __syncthreads.
inline void check_write(const Word& w, uintptr_t address, const char* access) {
  check_not_written_by_another_warp(w, address, access);
  const uint32_t others = w.read_epoch == state().epoch ? w.readers & ~(1u << (me().linear / 32)) : 0u;
  if (others != 0)  // readers are kept per warp: the reader's lane is not known
    report("race", address, "%s bytes another warp read with no __syncthreads between (warp %d)", access,
           __builtin_ctz(others));
}

inline void record_write(Word& w) {
  w.writer = (int16_t)me().linear;
  w.write_epoch = state().epoch;
}

// Accesses to the dynamic shared memory buffer must stay within the launch's bytes.
inline void check_dynamic_bounds(const void* p, size_t bytes, const char* access) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p), base = reinterpret_cast<uintptr_t>(dynamic_smem_base());
  if (a + bytes <= base || a >= base + kDynamicSmemBuffer) return;  // not dynamic shared memory
  const size_t given = state().dynamic_smem;
  if (a >= base && a + bytes <= base + given) return;
  report("out of bounds", a, "%s bytes at offset %ld of dynamic shared memory, past the %zu bytes the launch gave",
         access, (long)(a - base), given);
}

inline void track_read(const void* p, size_t bytes, const char* access) {
  check_dynamic_bounds(p, bytes, access);
  const uint32_t now = state().epoch;
  const int warp = me().linear / 32;
  for (uintptr_t a = reinterpret_cast<uintptr_t>(p), end = a + bytes; a < end; a += 4) {
    Word& w = shadow().at(a);
    check_read_not_in_flight(w, a, access);
    if (w.write_epoch < state().block_epoch)
      report("uninitialised read", a, "%s bytes no thread of this block wrote", access);
    check_not_written_by_another_warp(w, a, access);
    if (w.read_epoch != now) {
      w.read_epoch = now;
      w.readers = 0;
    }
    w.readers |= 1u << warp;
  }
}

inline void track_write(const void* p, size_t bytes) {
  check_dynamic_bounds(p, bytes, "writes");
  for (uintptr_t a = reinterpret_cast<uintptr_t>(p), end = a + bytes; a < end; a += 4) {
    Word& w = shadow().at(a);
    if (w.in_flight >= 0)
      report("race", a, "writes bytes a cp.async is still in flight to (issued by warp %d lane %d)", w.in_flight / 32,
             w.in_flight % 32);
    check_write(w, a, "writes");
    record_write(w);
  }
}

[[noreturn]] inline void misaligned(const char* what, const void* p, size_t alignment) {
  const State& s = state();
  const int self = me().linear;
  std::fprintf(stderr, "emu: %s in block (%u, %u, %u): warp %d lane %d, address %p is not %zu-byte aligned\n", what,
               s.block_idx.x, s.block_idx.y, s.block_idx.z, self / 32, self % 32, p, alignment);
  std::abort();
}

inline void require_aligned(const char* what, const void* p, size_t alignment) {
  if (reinterpret_cast<uintptr_t>(p) % alignment != 0) misaligned(what, p, alignment);
}

// ----------------------------------------------------------------- cp.async

inline void issue_copy(void* dst, const void* src, bool valid) {
  check_dynamic_bounds(dst, 16, "issues a cp.async to");
  Fiber& f = me();
  AsyncCopy copy{static_cast<unsigned char*>(dst), {}, f.committed_groups};
  if (valid) std::memcpy(copy.bytes, src, 16);
  for (uintptr_t a = reinterpret_cast<uintptr_t>(dst), end = a + 16; a < end; a += 4) {
    Word& w = shadow().at(a);
    if (w.in_flight >= 0)
      report("race", a, "issues a cp.async to bytes that already have one in flight (issued by warp %d lane %d)",
             w.in_flight / 32, w.in_flight % 32);
    check_write(w, a, "issues a cp.async to");
    w.in_flight = (int16_t)f.linear;
  }
  f.copies.push_back(copy);
}

inline void land(const AsyncCopy& copy) {
  std::memcpy(copy.dst, copy.bytes, 16);
  for (uintptr_t a = reinterpret_cast<uintptr_t>(copy.dst), end = a + 16; a < end; a += 4) {
    Word& w = shadow().at(a);
    w.in_flight = -1;
    record_write(w);
  }
}

// Lands this thread's copies of the groups committed before the newest `pending`
// (every copy, committed or not, with pending < 0: the thread is exiting).
inline void land_copies(int pending) {
  Fiber& f = me();
  size_t n = 0;
  for (; n < f.copies.size(); ++n) {
    if (pending >= 0 && f.copies[n].group + (unsigned)pending >= f.committed_groups) break;
    land(f.copies[n]);
  }
  f.copies.erase(f.copies.begin(), f.copies.begin() + n);
}

}  // namespace emu

namespace bds {

inline void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
  emu::require_aligned("cp.async destination", smem_dst, 16);
  if (valid) emu::require_aligned("cp.async source", gmem_src, 16);
  emu::issue_copy(smem_dst, gmem_src, valid);
}

inline void cp_async_commit() { ++emu::me().committed_groups; }

template <int N>
inline void cp_async_wait() {
  static_assert(N >= 0, "cp.async.wait_group takes a non-negative count");
  emu::land_copies(N);
}

// kernels/csrc/common.cuh's declaration of the dynamic shared memory a kernel uses: the
// launch must have given at least that much.
template <int kBytes>
inline void declare_dynamic_smem() {
  const emu::State& s = emu::state();
  if (s.dynamic_smem < (size_t)kBytes) {
    std::fprintf(stderr, "emu: kernel uses %d bytes of dynamic shared memory, the launch gave %zu, in block "
                 "(%u, %u, %u)\n", kBytes, s.dynamic_smem, s.block_idx.x, s.block_idx.y, s.block_idx.z);
    std::abort();
  }
}

template <typename V>
inline V ld_shared(const V* p) {
  static_assert(std::is_trivially_copyable_v<V> && (sizeof(V) == 4 || sizeof(V) == 8 || sizeof(V) == 16),
                "ld_shared moves 4, 8 or 16 bytes");
  emu::require_aligned("ld_shared", p, sizeof(V));
  emu::track_read(p, sizeof(V), "reads");
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

template <typename V>
inline void st_shared(V* p, const V& v) {
  static_assert(std::is_trivially_copyable_v<V> && (sizeof(V) == 4 || sizeof(V) == 8 || sizeof(V) == 16),
                "st_shared moves 4, 8 or 16 bytes");
  emu::require_aligned("st_shared", p, sizeof(V));
  emu::track_write(p, sizeof(V));
  std::memcpy(p, &v, sizeof(V));
}

}  // namespace bds
