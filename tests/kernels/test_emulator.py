"""The CPU emulator itself (tests/kernels/emu): its shared-memory checks and its fragment layouts.

- Checks: small kernels of our own (emu/smem_checks.cu) run a cp.async double-buffered
  pipeline through the same contract attention.cu uses, in static and in dynamic shared
  memory; the correct pipeline gives the right bytes, and a copy of it missing a wait, or
  either barrier, ends the process with the emulator's one-line report (run in a child
  interpreter, since the emulator aborts).
- Dynamic shared memory: a kernel given more than 48 KB at launch runs once
  ``cudaFuncSetAttribute`` has allowed it, and is reported without; the attribute past an
  A100's 163 KB is refused; an access past the launch's bytes, and a launch short of what a
  kernel declares, are reported.
- Layouts: what each lane's registers hold after the emulator's ``ldmatrix_x4[_trans]`` and
  ``mma_16816`` (through emu/fragment_probe.cu) is compared, entry by entry, with tables
  written here from the PTX ISA's text, independently of the emulator and of the kernels.
  Every element has a distinct value, so a swap or a transposition cannot pass, and each
  comparison is shown to fail when one table entry is deliberately swapped.
"""

import ctypes
import re

import numpy as np
import pytest
import torch

from tests.kernels.emulation import (
    EMU, BuildError, build_library, rewrite_extern_shared, rewrite_launches, run_python, unavailable,
)


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> str:
    if unavailable():
        pytest.skip(unavailable())
    return str(build_library([EMU / "smem_checks.cu", EMU / "fragment_probe.cu"], tmp_path_factory.mktemp("emu")))


def _ptr(a: np.ndarray | torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.data_ptr() if isinstance(a, torch.Tensor) else a.ctypes.data)


# --------------------------------------------------------------------------- cp.async and race checks

THREADS = 64  # smem_checks.cu's block: two warps
FAULTS = {"none": 0, "missing wait": 1, "missing barrier after wait": 2, "missing barrier before refill": 3}


def run_pipeline(library: str, fault: str, tiles: int = 5, n: int = 5 * THREADS - 7,
                 dynamic: bool = False) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Runs smem_checks.cu's pipeline over `tiles` tiles of 16-byte entries, the last `tiles *
    THREADS - n` of them past the end (zero-filled), its buffers in static or (`dynamic`) in
    dynamic shared memory. Returns (status, what every thread read: (tiles, THREADS, 2, 4),
    what landed: (tiles, THREADS, 4)). A faulty pipeline never returns: the emulator aborts
    the process (run it in a child)."""
    lib = ctypes.CDLL(library)
    src = torch.arange(tiles * THREADS * 4, dtype=torch.int32).view(tiles * THREADS, 4) + 1
    out = torch.full((tiles, THREADS, 2, 4), -1, dtype=torch.int32)
    status = lib.emu_pipeline(_ptr(src), n, _ptr(out), tiles, FAULTS[fault], int(dynamic))
    landed = src.clone()
    landed[n:] = 0
    return status, out, landed.view(tiles, THREADS, 4)


def test_a_copy_lands_at_the_wait_not_at_the_issue(library):
    src = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    out = torch.zeros(2, 4, dtype=torch.int32)
    assert ctypes.CDLL(library).emu_landing(_ptr(src), _ptr(out)) == 0
    assert out[0].tolist() == [7, 7, 7, 7] and out[1].tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_double_buffered_pipeline_reads_what_was_copied(library, dynamic):
    """Correct waits and barriers: no report; each thread reads its own entry, zeros past the
    end, and warp 1 reads warp 0's landed copies (lane tid % 32)."""
    status, out, landed = run_pipeline(library, "none", dynamic=dynamic)
    assert status == 0
    assert torch.equal(out[:, :, 0], landed)
    assert torch.equal(out[:, :, 1], landed[:, torch.arange(THREADS) % 32])
    assert (landed[-1, -7:] == 0).all() and (out[:, :, 0] != 0).any()


# Of two conflicting accesses, the later one reports, and the order is the emulator's own
# (cuda_runtime.h, run_block): in block 0 warp 0 runs first up to its first barrier, and the
# warp whose arrival opens a barrier runs first after it. The races below are races in any
# order; the expected wording follows from that order.
ADDRESS = r"shared address 0x[0-9a-f]+"
PIPELINE_ERRORS = {
    "missing wait": rf"emu: read before cp\.async wait in block \(0, 0, 0\): warp [01] lane \d+, {ADDRESS}, "
                    r"reads bytes its own cp\.async has not landed in \(no cp_async_wait covers it\)",
    "missing barrier after wait": rf"emu: race in block \(0, 0, 0\): warp 1 lane \d+, {ADDRESS}, reads bytes "
                                  r"another warp wrote with no __syncthreads between \(warp 0 lane \d+\)",
    "missing barrier before refill": rf"emu: race in block \(0, 0, 0\): warp (?P<a>[01]) lane \d+, {ADDRESS}, "
                                     r"issues a cp\.async to bytes another warp read with no __syncthreads "
                                     r"between \(warp (?!(?P=a))[01]\)",
}


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("fault", list(PIPELINE_ERRORS))
def test_broken_pipeline_aborts_with_one_line(library, fault, dynamic):
    outcome = run_python(f"from tests.kernels.test_emulator import run_pipeline\n"
                         f"run_pipeline({library!r}, {fault!r}, dynamic={dynamic})")
    assert outcome.aborted, (outcome.returncode, outcome.stderr[-2000:])
    assert re.fullmatch(PIPELINE_ERRORS[fault], outcome.emu_error), outcome.stderr[-2000:]


def run_exchange(library: str, barrier: bool) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Every thread st_shared's a word, then ld_shared's its partner's in the other warp.
    Returns (status, the words written, the words read); without the barrier the emulator
    aborts the process instead (run it in a child)."""
    lib = ctypes.CDLL(library)
    words = torch.arange(THREADS, dtype=torch.float32) + 0.5
    out = torch.full((THREADS,), float("nan"))
    status = lib.emu_exchange(_ptr(words), _ptr(out), int(barrier))
    return status, words, out


def test_st_shared_then_ld_shared_across_warps_after_a_barrier(library):
    status, words, out = run_exchange(library, barrier=True)
    assert status == 0
    assert torch.equal(out, words.roll(THREADS // 2))  # thread t read the word of thread t + 32 (mod 64)


def test_st_shared_without_a_barrier_is_a_race(library):
    """After the opening barrier one warp runs ahead: it reads the other warp's words before
    that warp overwrites them, and the overwrite is the race (write after read)."""
    outcome = run_python(f"from tests.kernels.test_emulator import run_exchange\n"
                         f"run_exchange({library!r}, barrier=False)")
    assert outcome.aborted, (outcome.returncode, outcome.stderr[-2000:])
    found = re.fullmatch(rf"emu: race in block \(0, 0, 0\): warp (\d) lane \d+, {ADDRESS}, writes bytes another warp "
                         r"read with no __syncthreads between \(warp (\d)\)", outcome.emu_error)
    assert found and {found.group(1), found.group(2)} == {"0", "1"}, outcome.stderr


# --------------------------------------------------------------------------- dynamic shared memory

ABOVE_48_KB = 30_000  # floats: 120,000 bytes


def run_dynamic(library: str, n: int, allow_bytes: int = 0, past: bool = False) -> tuple[int, torch.Tensor,
                                                                                            torch.Tensor]:
    """smem_checks.cu's dynamic_kernel: n floats of dynamic shared memory in each of two blocks,
    after cudaFuncSetAttribute(allow_bytes) where allow_bytes > 0. Returns (status, the words
    written, what the blocks read: (2, n)); a faulty launch or access aborts the process."""
    lib = ctypes.CDLL(library)
    words = torch.arange(n, dtype=torch.float32) * 0.5 + 1
    out = torch.full((2, n), float("nan"))
    status = lib.emu_dynamic(_ptr(words), _ptr(out), n, allow_bytes, int(past))
    return status, words, out


def test_dynamic_shared_memory_past_48_kb_runs_once_allowed(library):
    status, words, out = run_dynamic(library, ABOVE_48_KB, allow_bytes=4 * ABOVE_48_KB)
    assert status == 0
    assert torch.equal(out, words.roll(-32).expand(2, -1))  # word i + 32 (mod n), in both blocks


def test_dynamic_shared_memory_past_48_kb_without_the_attribute_is_reported(library):
    outcome = run_python(f"from tests.kernels.test_emulator import run_dynamic, ABOVE_48_KB\n"
                         f"run_dynamic({library!r}, ABOVE_48_KB)")
    assert outcome.aborted, (outcome.returncode, outcome.stderr[-2000:])
    assert re.fullmatch(r"emu: launch with 120000 bytes of dynamic shared memory, above the 49152 the kernel allows: "
                        r"past 48 KB it needs cudaFuncSetAttribute\(kernel, "
                        r"cudaFuncAttributeMaxDynamicSharedMemorySize, 120000\) first", outcome.emu_error), \
        outcome.stderr


def test_the_attribute_past_an_a100s_limit_is_refused(library):
    """163 KB (166,912 bytes) per block is an A100's opt-in limit: cudaErrorInvalidValue (1) above it."""
    assert run_dynamic(library, 64, allow_bytes=166_913)[0] == 1
    assert run_dynamic(library, 64, allow_bytes=166_912)[0] == 0


def test_an_access_past_the_launched_bytes_is_reported(library):
    outcome = run_python(f"from tests.kernels.test_emulator import run_dynamic\n"
                         f"run_dynamic({library!r}, 1000, past=True)")
    assert outcome.aborted, (outcome.returncode, outcome.stderr[-2000:])
    assert re.fullmatch(rf"emu: out of bounds in block \(0, 0, 0\): warp 0 lane 0, {ADDRESS}, reads bytes at offset "
                        r"4000 of dynamic shared memory, past the 4000 bytes the launch gave", outcome.emu_error), \
        outcome.stderr


def run_declared(library: str, launch_bytes: int) -> int:
    """smem_checks.cu's declared_kernel (it declares 1,024 bytes) launched with launch_bytes."""
    out = torch.zeros(32)  # held while the kernel writes it: a temporary's memory would be freed first
    return ctypes.CDLL(library).emu_declared(_ptr(out), launch_bytes)


def test_a_launch_short_of_what_the_kernel_declares_is_reported(library):
    assert run_declared(library, 1024) == 0
    outcome = run_python(f"from tests.kernels.test_emulator import run_declared\nrun_declared({library!r}, 512)")
    assert outcome.aborted, (outcome.returncode, outcome.stderr[-2000:])
    assert outcome.emu_error == ("emu: kernel uses 1024 bytes of dynamic shared memory, the launch gave 512, in block "
                                 "(0, 0, 0)"), outcome.stderr


def test_extern_shared_arrays_are_rewritten_and_the_unrewritable_refused():
    comment = "  // `extern __shared__` in a comment stays\n"
    text = "  extern __shared__ __align__(16) unsigned char smem[];" + comment
    rewritten = "  unsigned char* const smem = ::emu::dynamic_shared<unsigned char>();" + comment
    assert rewrite_extern_shared(text, "a.cu") == rewritten
    with pytest.raises(BuildError, match=r"^b\.cu: an extern __shared__ declaration the emulation cannot rewrite$"):
        rewrite_extern_shared("extern __shared__ float sized[64];", "b.cu")


# --------------------------------------------------------------------------- fragment layouts, from the PTX ISA
#
# "Matrix fragments for mma.m16n8k16 with floating point type" (.f16/.bf16 A and B, .f32 C
# and D), with groupID = laneid >> 2 and threadID_in_group = laneid % 4. A register holds
# two 16-bit elements, the lower-numbered one in its low half: a0, a1 in the first
# register, a2, a3 in the second, and so on.
#   A (16 x 16), a0..a7: row = groupID          for ai with i < 2 or 4 <= i < 6, else groupID + 8
#                        col = threadID_in_group * 2 + (i & 1)  for i < 4, that + 8 for i >= 4
#   B (16 x 8), b0..b3:  row = threadID_in_group * 2 + (i & 1)  for i < 2, that + 8 for i >= 2
#                        col = groupID
#   C, D (16 x 8), c0..c3: row = groupID for i < 2, groupID + 8 for i >= 2
#                        col = threadID_in_group * 2 + (i & 1)
# "ldmatrix" .m8n8.x4.b16: lanes 8j .. 8j + 7 give the addresses of rows 0..7 of matrix j,
# whose fragment lands in destination register j. In a fragment, lane l holds the two
# elements of row l >> 2 at columns 2 (l % 4) and 2 (l % 4) + 1; with .trans the matrix is
# read column-major, so those are the elements at rows 2 (l % 4), 2 (l % 4) + 1 of column l >> 2.

Table = dict[tuple[int, int], tuple[int, int]]  # (lane, element index) -> (row, col)


def _mma_a_table() -> Table:
    table = {}
    for lane in range(32):
        group, tid = lane >> 2, lane % 4
        for i in range(8):
            row = group if i < 2 or 4 <= i < 6 else group + 8
            col = tid * 2 + (i & 1) + (8 if i >= 4 else 0)
            table[lane, i] = (row, col)
    return table


def _mma_b_table() -> Table:
    return {(lane, i): ((lane % 4) * 2 + (i & 1) + (8 if i >= 2 else 0), lane >> 2)
            for lane in range(32) for i in range(4)}


def _mma_c_table() -> Table:
    return {(lane, i): ((lane >> 2) + (8 if i >= 2 else 0), (lane % 4) * 2 + (i & 1))
            for lane in range(32) for i in range(4)}


def _ldmatrix_table(trans: bool) -> Table:
    table = {}
    for lane in range(32):
        for i in range(2):
            row, col = lane >> 2, 2 * (lane % 4) + i
            table[lane, i] = (col, row) if trans else (row, col)
    return table


MMA_A, MMA_B, MMA_C = _mma_a_table(), _mma_b_table(), _mma_c_table()


def _swapped(table: Table, first: tuple[int, int], second: tuple[int, int]) -> Table:
    wrong = dict(table)
    wrong[first], wrong[second] = table[second], table[first]
    return wrong


def test_tables_cover_each_matrix_element_once():
    for table, shape in ((MMA_A, (16, 16)), (MMA_B, (16, 8)), (MMA_C, (16, 8)),
                         (_ldmatrix_table(False), (8, 8)), (_ldmatrix_table(True), (8, 8))):
        cells = sorted(table.values())
        assert cells == [(r, c) for r in range(shape[0]) for c in range(shape[1])]


def _bits(values: torch.Tensor) -> np.ndarray:
    """16-bit patterns of a float16/bfloat16 matrix."""
    return values.view(torch.int16).numpy().astype(np.uint16)


def _pack(bits: np.ndarray, table: Table, registers: int) -> np.ndarray:
    """(32, registers) uint32: element i of a lane in half i % 2 of its register i // 2."""
    regs = np.zeros((32, registers), dtype=np.uint32)
    for (lane, i), (row, col) in table.items():
        regs[lane, i // 2] |= np.uint32(bits[row, col]) << np.uint32(16 * (i % 2))
    return regs


def _per_lane(matrix: torch.Tensor, table: Table, count: int) -> np.ndarray:
    out = np.zeros((32, count), dtype=np.float64)
    for (lane, i), (row, col) in table.items():
        out[lane, i] = float(matrix[row, col])
    return out


def _mismatches(got: np.ndarray, expected: np.ndarray, name: str) -> list[str]:
    return [f"lane {lane} {name}{i}: got {got[lane, i]}, expected {expected[lane, i]}"
            for lane, i in zip(*np.nonzero(got != expected))]


def _mma(library: str, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, a_table: Table = MMA_A) -> np.ndarray:
    """D (as c0..c3 per lane) from the emulator's mma_16816, the operands packed by the ISA tables."""
    lib = ctypes.CDLL(library)
    a_regs, b_regs = _pack(_bits(a), a_table, 4), _pack(_bits(b), MMA_B, 2)
    cd = _per_lane(c, MMA_C, 4).astype(np.float32)
    assert lib.emu_mma_probe(_ptr(a_regs), _ptr(b_regs), _ptr(cd), int(a.dtype == torch.bfloat16)) == 0
    return cd.astype(np.float64)


def _distinct(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """rows * cols different integers around 0, exact in fp16 and bf16 (|v| <= 128)."""
    values = torch.randperm(rows * cols, generator=torch.Generator().manual_seed(seed)) - rows * cols // 2
    return values.view(rows, cols).to(dtype)


def _select(rows: int, cols: int, picks: list[int], by_row: bool, dtype: torch.dtype) -> torch.Tensor:
    """A one-hot matrix: row r has its 1 in column picks[r] (by_row), or column c in row picks[c]."""
    m = torch.zeros(rows, cols, dtype=dtype)
    for index, pick in enumerate(picks):
        m[(index, pick) if by_row else (pick, index)] = 1
    return m


def _a_fragment_mismatches(library: str, dtype: torch.dtype, a_table: Table = MMA_A) -> list[str]:
    """D = A B with B picking columns 8h .. 8h + 7 of A: every D entry is one A entry, unmixed."""
    a, found = _distinct(16, 16, dtype, seed=1), []
    for half in range(2):
        b = _select(16, 8, [8 * half + n for n in range(8)], by_row=False, dtype=dtype)
        got = _mma(library, a, b, torch.zeros(16, 8), a_table)
        found += _mismatches(got, _per_lane(a[:, 8 * half:8 * half + 8].double(), MMA_C, 4), f"(cols {8 * half}+) c")
    return found


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mma_a_fragment_matches_the_ptx_table(library, dtype):
    assert _a_fragment_mismatches(library, dtype) == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mma_b_fragment_matches_the_ptx_table(library, dtype):
    """D = I B (the 16 x 16 identity as A): D is B itself, each entry in its c register."""
    b = _distinct(16, 8, dtype, seed=2)
    got = _mma(library, torch.eye(16, dtype=dtype), b, torch.zeros(16, 8))
    assert _mismatches(got, _per_lane(b.double(), MMA_C, 4), "c") == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mma_accumulates_into_c_by_the_ptx_table(library, dtype):
    """D = A B + C with small integers, exact in fp32: C's layout and the product as a whole."""
    generator = torch.Generator().manual_seed(3)
    a = torch.randint(-8, 9, (16, 16), generator=generator).to(dtype)
    b = torch.randint(-8, 9, (16, 8), generator=generator).to(dtype)
    c = torch.arange(128, dtype=torch.float32).view(16, 8) * 1000.0
    expected = _per_lane(a.double() @ b.double() + c.double(), MMA_C, 4)
    assert _mismatches(_mma(library, a, b, c), expected, "c") == []


def test_a_wrong_mma_table_entry_is_caught(library):
    """Two A entries of one lane swapped in the table the operands are packed by."""
    assert _a_fragment_mismatches(library, torch.bfloat16, _swapped(MMA_A, (5, 0), (5, 2))) != []
    assert _a_fragment_mismatches(library, torch.float16, _swapped(MMA_A, (0, 1), (9, 1))) != []


ROW_OF_LANE = np.array([(lane * 37 + 11) % 64 for lane in range(32)], dtype=np.int32)  # scattered, distinct


def _ldmatrix_mismatches(library: str, trans: bool, table: Table) -> list[str]:
    lib = ctypes.CDLL(library)
    elements = np.random.default_rng(4).permutation(64 * 8).astype(np.uint16).reshape(64, 8) + 1  # 64 rows, 16 B
    regs = np.zeros((32, 4), dtype=np.uint32)
    assert lib.emu_ldmatrix_probe(_ptr(elements), _ptr(ROW_OF_LANE), int(trans), _ptr(regs)) == 0
    expected = np.zeros((32, 4), dtype=np.uint32)
    for j in range(4):
        matrix = elements[ROW_OF_LANE[8 * j:8 * j + 8]]  # row r: the row lane 8j + r points at
        for (lane, i), (row, col) in table.items():
            expected[lane, j] |= np.uint32(matrix[row, col]) << np.uint32(16 * i)
    return _mismatches(regs, expected, "r")


@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_x4_matches_the_ptx_table(library, trans):
    assert _ldmatrix_mismatches(library, trans, _ldmatrix_table(trans)) == []


@pytest.mark.parametrize("trans", [False, True])
def test_a_wrong_ldmatrix_table_entry_is_caught(library, trans):
    wrong = _swapped(_ldmatrix_table(trans), (1, 0), (4, 0))
    found = _ldmatrix_mismatches(library, trans, wrong)
    assert {int(line.split()[1]) for line in found} == {1, 4}, found


# --------------------------------------------------------------------------- building edited sources

def test_an_edited_copy_builds_from_text_and_its_fault_is_reported(library, tmp_path):
    """What a kernel test does to show its checks bite: build a copy with one line changed."""
    text = (EMU / "smem_checks.cu").read_text()
    wait = "if (fault != kMissingWait) bds::cp_async_wait<1>();"
    assert wait in text
    edited = build_library({"smem_checks.cu": text.replace(wait, "")}, tmp_path)
    outcome = run_python(f"from tests.kernels.test_emulator import run_pipeline\n"
                         f"run_pipeline({str(edited)!r}, 'none')")
    assert outcome.aborted and re.fullmatch(PIPELINE_ERRORS["missing wait"], outcome.emu_error), outcome.stderr


def test_launches_are_rewritten_and_the_unrewritable_refused():
    text = "kernel<T, 64><<<grid, dim3(128), 0, stream>>>(q, k);"
    assert rewrite_launches(text, "a.cu") == "::emu::launch(kernel<T, 64>, grid, dim3(128), 0, stream, q, k);"
    with pytest.raises(BuildError, match=r"^b\.cu: a kernel launch the emulation cannot rewrite$"):
        rewrite_launches("(*table[i])<<<1, 32, 0, 0>>>(x);", "b.cu")


def test_a_failed_compile_raises_with_the_compiler_output(library, tmp_path):
    with pytest.raises(BuildError, match="no_such_function"):
        build_library({"broken.cu": '#include <cuda_runtime.h>\nint f() { return no_such_function(); }\n'}, tmp_path)


def test_reading_shared_memory_no_thread_of_the_block_wrote_is_an_error(library):
    """Shared arrays keep an earlier block's bytes in the emulation (and whatever is left on
    a GPU): a kernel that reads words it never wrote must not pass on them."""
    outcome = run_python(f"from tests.kernels.test_emulator import run_uninitialised\n"
                         f"run_uninitialised({library!r})")
    assert outcome.aborted, (outcome.returncode, outcome.stderr[-2000:])
    assert re.fullmatch(rf"emu: uninitialised read in block \(1, 0, 0\): warp 0 lane \d+, {ADDRESS}, reads bytes no "
                        r"thread of this block wrote", outcome.emu_error), outcome.stderr


def run_uninitialised(path: str) -> None:
    """Two blocks: the first writes every word, the second reads them without writing."""
    lib = ctypes.CDLL(path)
    out = torch.full((2 * THREADS,), float("nan"))
    lib.emu_uninitialised(_ptr(out))
