"""Static evidence about the compiled kernels, on CPU: no spills, attention on tensor cores
with ``cp.async``, attention's shared memory and CTAs per SM on A100 and H100 as its design
says (attention.cu's header), no global atomics in the one-tile backward, the LayerNorm
backwards' CTAs per SM and shared memory as their design says (layer_norm.cu's and
dropout_layer_norm.cu's headers), and the MLM cross-entropy's kernels holding an SM's every
thread (cross_entropy.cu's header).

The figures come from bert_ds.kernels.inspect (ptxas -v, the PTX and, where nvdisasm is
installed, the SASS), compiled once per source and architecture for the whole session.
The occupancy calculator is checked against hand-computed cases first, since every
CTA figure rests on it.
"""

import fcntl
import hashlib
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bert_ds.kernels import inspect as kinspect
from bert_ds.kernels.compile_check import find_nvcc
from tests.kernels.emulation import cache_dir

A100, H100 = kinspect.DEVICES["80"], kinspect.DEVICES["90"]
REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- the calculator

@pytest.mark.parametrize("device, registers, smem, threads, ctas, limiter", [
    # 163 regs -> 5216 per warp, 5376 allocated; 16384 per sub-partition hold 3 warps: 12 warps, 3 CTAs of 4
    (A100, 163, 27648, 128, 3, "registers"),
    # 226 -> 7424 per warp: 2 per sub-partition, 8 warps, 2 CTAs
    (A100, 226, 46592, 128, 2, "registers"),
    # 170 -> 5440, allocated 5632 (the 256-register unit): 2 per sub-partition, not 3
    (H100, 170, 0, 128, 2, "registers"),
    # 200 -> 6400 per warp: 2 per sub-partition (8 warps), though 10 would fit the whole file
    (A100, 200, 0, 32, 8, "registers"),
    # 32 warps x 72 regs = 73728 > 65536: one CTA does not fit
    (H100, 72, 0, 1024, 0, "registers"),
    # 48 KiB + the 1 KiB reserve = 50176 B: 3 on 164 KiB, 4 on 228 KiB
    (A100, 32, 48 * 1024, 128, 3, "shared memory"),
    (H100, 32, 48 * 1024, 128, 4, "shared memory"),
    # 45666 + 1024 = 46690, rounded to 46720 (128 B unit): 4 on 228 KiB, where 46690 would give 5
    (H100, 16, 45666, 64, 4, "shared memory"),
    # 32 warps per CTA: 64 warps per SM allow 2
    (A100, 32, 0, 1024, 2, "warps"),
    # tiny CTAs stop at the 32-CTA limit
    (H100, 16, 0, 32, 32, "CTAs"),
    # attention's backward at head dim 64: 230 regs -> 7424 per warp, 2 warps per sub-partition: one CTA of 8
    (A100, 230, 93184, 256, 1, "registers"),
    (H100, 230, 93184, 256, 1, "registers"),
    # its 93,184 B of shared memory + 1 KiB = 94,208 B: one CTA on 164 KiB, two on 228 KiB
    (A100, 128, 93184, 256, 1, "shared memory"),
    (H100, 128, 93184, 256, 2, "registers"),
])
def test_occupancy_calculator_matches_hand_computed_cases(device, registers, smem, threads, ctas, limiter):
    assert kinspect.ctas_per_sm(device, registers, smem, threads) == (ctas, limiter)


# --------------------------------------------------------------------------- the parsers

PTXAS = """\
ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_80'
ptxas info    : Function properties for _Z3fooPf
    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 2048 bytes smem, 360 bytes cmem[0]
ptxas info    : Compiling entry function '_Z3barv' for 'sm_80'
ptxas info    : Function properties for _Z3barv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 12 registers, used 0 barriers, 356 bytes cmem[0]
"""

PTX = """\
.visible .entry _Z3fooPf(
.maxntid 64, 2, 1
.minnctapersm 2
{
 mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1}, {%r1}, {%r2}, {%f1};
 cp.async.cg.shared.global [%r3], [%rd1], 16;
 cp.async.commit_group;
 cp.async.wait_group 0;
 ld.local.u32 %r4, [%rd2];
 atom.global.add.f32 %f2, [%rd3], %f1;
 red.shared.add.u32 [%r6], 1;
 // bds.dynamic_smem 93184
}
.entry _Z3barv(
{
 ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r1, %r2, %r3, %r4}, [%r5];
}
"""

SASS = """\
.text._Z3fooPf:
        /*0000*/                   IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ;
        /*0010*/              @!P0 LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64] ;
        /*0020*/                   HMMA.16816.F32.BF16 R8, R12, R16, R8 ;
        /*0030*/               @P1 STL [R1], R3 ;
        /*0040*/                   REDG.E.ADD.F32.FTZ.RN.STRONG.GPU desc[UR4][R2.64], R5 ;
        /*0050*/                   ATOMS.ADD RZ, [R6], R7 ;
.text._Z3barv:
        /*0000*/                   LDSM.16.M88.4 R4, [R2] ;
        /*0010*/                   EXIT ;
"""


def test_ptxas_report_gives_registers_spills_and_shared_memory_per_entry():
    stats = kinspect.parse_ptxas(PTXAS)
    assert stats["_Z3fooPf"] == {"registers": 40, "stack": 16, "spill_stores": 8, "spill_loads": 4, "smem": 2048}
    assert stats["_Z3barv"] == {"registers": 12, "stack": 0, "spill_stores": 0, "spill_loads": 0, "smem": 0}


def test_ptx_entries_give_block_size_and_instruction_counts():
    entries = kinspect.ptx_entries(PTX)
    assert set(entries) == {"_Z3fooPf", "_Z3barv"}
    assert kinspect.ptx_threads(entries["_Z3fooPf"]) == 128 and kinspect.ptx_threads(entries["_Z3barv"]) is None
    counts = {col: len(re.findall(rx, entries["_Z3fooPf"])) for col, rx in kinspect.PTX_COUNTS.items()}
    # commit/wait are not copies, a shared-memory atomic is not a global one, "shared.global" is no "red."
    assert counts == {"mma.sync": 1, "ldmatrix": 0, "cp.async": 1, "ld/st.local": 1, "atom/red": 1}
    assert len(re.findall(kinspect.PTX_COUNTS["ldmatrix"], entries["_Z3barv"])) == 1


def test_ptx_gives_the_dynamic_shared_memory_a_kernel_declares():
    entries = kinspect.ptx_entries(PTX)
    assert kinspect.ptx_dynamic_smem(entries["_Z3fooPf"]) == 93184
    assert kinspect.ptx_dynamic_smem(entries["_Z3barv"]) == 0


def test_sass_opcodes_are_counted_per_function_predicated_or_not():
    ops = kinspect.sass_opcodes(SASS)
    assert ops["_Z3fooPf"] == {"IMAD": 1, "LDGSTS": 1, "HMMA": 1, "STL": 1, "REDG": 1, "ATOMS": 1}
    assert ops["_Z3barv"] == {"LDSM": 1, "EXIT": 1}


def _kernel(name, arch, registers, ctas, mma=0):
    return kinspect.Kernel(source="a.cu", arch=arch, name=name, mangled=name, registers=registers, stack=0,
                           spill_stores=0, spill_loads=0, smem=0, threads=128,
                           ptx={"mma.sync": mma, "ldmatrix": 0, "cp.async": 0, "ld/st.local": 0, "atom/red": 0},
                           sass=None,
                           ctas_per_sm=ctas, limiter="registers")


def test_summary_folds_dtype_instantiations_and_gives_ranges_per_arch():
    kernels = [_kernel("k<bf16, 64>", "80", 160, 3, mma=8), _kernel("k<fp16, 64>", "80", 170, 2, mma=8),
               _kernel("k<bf16, 64>", "90", 150, 3, mma=8), _kernel("k<fp16, 64>", "90", 150, 3, mma=8),
               _kernel("k<bf16, 32>", "80", 100, 4), _kernel("k<bf16, 32>", "90", 100, 4)]
    rows = [line for line in kinspect.summary(kernels).splitlines() if line.startswith("| a.cu")]
    assert rows == ["| a.cu | k<T, 64> | 160-170 / 150 | 0 | 0 | 0 | 128 | 2-3 / 3 | 8 | 0 | 0 | 0 | 0 |",
                    "| a.cu | k<T, 32> | 100 / 100 | 0 | 0 | 0 | 128 | 4 / 4 | 0 | 0 | 0 | 0 | 0 |"]


def test_without_nvcc_inspect_says_so_and_succeeds():
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    env["PATH"] = str(Path(sys.executable).parent)  # python, but no nvcc
    proc = subprocess.run([sys.executable, "-m", "bert_ds.kernels.inspect"], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=120)
    assert proc.returncode == 0 and "nvcc not found" in proc.stdout


# --------------------------------------------------------------------------- the kernels

needs_nvcc = pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found")


@pytest.fixture(scope="session")
def compiled():
    """(every kernel for sm_80 and sm_90, whether SASS counts are there): one compile per source
    and arch, shared by the suite's workers (one compiles, the others wait and read its result:
    a compile of every source is minutes of CPU) and kept by content for the next run."""
    nvcc = find_nvcc()
    digest = hashlib.sha256(subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.encode())
    for path in (*sorted(kinspect.CSRC.iterdir()), Path(kinspect.__file__)):
        digest.update(f"\0{path.name}\0".encode() + path.read_bytes())
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    result = folder / f"inspect-{digest.hexdigest()[:32]}.pickle"
    with open(result.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.is_file():
            kernels, nvdisasm = kinspect.inspect_all()
            partial = result.with_name(f"{result.name}.{os.getpid()}.partial")
            partial.write_bytes(pickle.dumps((kernels, nvdisasm is not None)))
            os.replace(partial, result)  # whole or absent
        return pickle.loads(result.read_bytes())


def _attention_math(kernels):
    """The attention kernels that do the matmuls: attention.cu's kernels named fwd or bwd."""
    return [k for k in kernels if k.source == "attention.cu" and re.search(r"fwd|bwd", k.name.split("<")[0])]


def _attention_kind(kernel) -> tuple[str, int, str, tuple[bool, bool]]:
    """(kernel name, head dim, "one tile" / "general" / "", (windowed, rotary)) of an attention
    matmul kernel: attention_fwd_kernel<T, HD, kWindowed, kRotary>,
    attention_bwd_kernel<T, HD, kOneTile, kWindowed, kRotary>."""
    found = re.fullmatch(r"(attention_\w+_kernel)<\w+, (\d+)((?:, (?:true|false))+)>", kernel.name)
    assert found, kernel.name
    flags = [flag == "true" for flag in found.group(3).split(", ")[1:]]
    path = {True: "one tile", False: "general"}[flags.pop(0)] if found.group(1) == "attention_bwd_kernel" else ""
    assert len(flags) == 2, kernel.name
    return found.group(1), int(found.group(2)), path, (flags[0], flags[1])


# What attention.cu's header designs, per (kernel, head dim): warps per CTA, CTAs per SM on
# A100 and H100 (both: registers decide), and bytes of dynamic shared memory (all of it).
ATTENTION_DESIGN = {
    ("attention_fwd_kernel", 64): (4, 2, 36864),   # 2 stages x (K, V) of 64 keys
    ("attention_fwd_kernel", 32): (4, 2, 40960),   # 2 stages x (K, V) of 128 keys
    ("attention_bwd_kernel", 64): (8, 1, 93184),   # K, V of 128 keys, 2 stages x (Q, dO) of 64, dS^T, lse, D
    ("attention_bwd_kernel", 32): (4, 2, 41472),   # K, V of 128 keys, 2 stages x (Q, dO) of 32, dS^T, lse, D
}


@pytest.mark.long
@needs_nvcc
def test_every_source_compiles_for_both_archs(compiled):
    """Every kernels/csrc/*.cu, for sm_80 and sm_90, with compile_check's flags (every warning an
    error): the compile these figures come from fails the fixture otherwise; each gives kernels."""
    kernels, _ = compiled
    sources = sorted(p.name for p in kinspect.CSRC.glob("*.cu"))
    found = {(k.source, k.arch) for k in kernels}
    assert sources and {(s, a) for s in sources for a in kinspect.DEVICES} <= found, sorted(found)


@needs_nvcc
def test_no_kernel_spills(compiled):
    kernels, _ = compiled
    spilling = [f"{k.source} {k.name} sm_{k.arch}: {k.spill_stores} B spill stores, {k.spill_loads} B spill loads, "
                f"{k.ptx['ld/st.local']} ld/st.local" + (f", {k.sass['LDL/STL']} LDL/STL" if k.sass else "")
                for k in kernels if k.spills]
    assert kernels and not spilling, "\n".join(spilling)


@needs_nvcc
def test_every_kernel_declares_its_block_size(compiled):
    # The CTA figures need it; every launcher launches with exactly the bound.
    kernels, _ = compiled
    unbounded = sorted({f"{k.source} {k.name}" for k in kernels if k.threads is None})
    assert not unbounded, f"no __launch_bounds__: {unbounded}"


@needs_nvcc
def test_attention_has_forward_and_backward_kernels_for_both_archs(compiled):
    kernels, _ = compiled
    for arch in kinspect.DEVICES:
        names = {k.name.split("<")[0] for k in _attention_math(kernels) if k.arch == arch}
        assert any("fwd" in n for n in names) and any("bwd" in n for n in names), (arch, names)


@needs_nvcc
def test_attention_uses_tensor_cores_and_cp_async(compiled):
    kernels, with_sass = compiled
    missing = []
    for k in _attention_math(kernels):
        wanted = {"mma.sync": k.ptx["mma.sync"], "cp.async": k.ptx["cp.async"]}
        if with_sass:
            wanted.update(HMMA=k.sass["HMMA"], LDGSTS=k.sass["LDGSTS"])
        missing += [f"{k.name} sm_{k.arch}: 0 {what}" for what, count in wanted.items() if count == 0]
    assert not missing, "\n".join(missing)


@needs_nvcc
@pytest.mark.parametrize("arch", sorted(kinspect.DEVICES))
def test_attention_occupancy_is_as_designed(compiled, arch):
    """Every attention kernel keeps at least 8 warps per SM; the matmul kernels have the warps,
    CTAs per SM and dynamic shared memory attention.cu's header derives (and no static shared
    memory), both paths of the backward alike, within an A100's 163 KB per block."""
    kernels, _ = compiled
    device = kinspect.DEVICES[arch]

    def figures(k):
        return (f"{k.name} sm_{arch}: {k.threads} threads, {k.ctas_per_sm} CTAs per SM on {device.name} ({k.limiter}: "
                f"{k.registers} registers, {k.smem} + {k.dynamic_smem} B smem)")
    attention = [k for k in kernels if k.source == "attention.cu" and k.arch == arch]
    short = [figures(k) for k in attention if (k.ctas_per_sm or 0) * (k.threads or 0) < 8 * 32]
    assert attention and not short, "\n".join(short)
    math = _attention_math(attention)
    assert {_attention_kind(k)[:2] for k in math} == set(ATTENTION_DESIGN)
    off = [figures(k) for k in math
           if (k.threads // 32, k.ctas_per_sm, k.dynamic_smem, k.smem) != (*ATTENTION_DESIGN[_attention_kind(k)[:2]], 0)
           or k.dynamic_smem > 166912]
    assert not off, "\n".join(off)


@needs_nvcc
def test_attention_has_every_option_for_both_archs(compiled):
    """Each head dim's forward and both backward paths with and without a window and rotary
    embeddings (attention.cu's header): the design and atomics tests above and below see every one."""
    kernels, _ = compiled
    options = {(False, False), (True, False), (False, True), (True, True)}
    for arch in kinspect.DEVICES:
        kinds = {_attention_kind(k) for k in _attention_math(kernels) if k.arch == arch}
        wanted = {(name, hd, path, option) for name, hd in ATTENTION_DESIGN
                  for path in (("one tile", "general") if name == "attention_bwd_kernel" else ("",))
                  for option in options}
        assert kinds == wanted, (arch, sorted(wanted - kinds), sorted(kinds - wanted))


@needs_nvcc
def test_one_tile_backward_has_no_global_atomics(compiled):
    """Where every sequence fits one key tile, the backward stores dQ itself: no atom/red in its
    PTX (nor ATOM/RED in its SASS). The general path adds dQ up with them: the count can see them."""
    kernels, with_sass = compiled
    backward = [k for k in _attention_math(kernels) if _attention_kind(k)[0] == "attention_bwd_kernel"]
    paths = {path: [k for k in backward if _attention_kind(k)[2] == path] for path in ("one tile", "general")}
    assert paths["one tile"] and paths["general"], [k.name for k in backward]
    with_atomics = [f"{k.name} sm_{k.arch}: {k.ptx['atom/red']} atom/red" + (f", {k.sass['ATOM/RED']} ATOM/RED"
                                                                           if with_sass else "")
                    for k in paths["one tile"] if k.ptx["atom/red"] or (with_sass and k.sass["ATOM/RED"])]
    assert not with_atomics, "\n".join(with_atomics)
    assert all(k.ptx["atom/red"] > 0 and (not with_sass or k.sass["ATOM/RED"] > 0) for k in paths["general"])


@needs_nvcc
@pytest.mark.parametrize("arch", sorted(kinspect.DEVICES))
def test_lamb_kernels_keep_half_the_sm_busy(compiled, arch):
    """LAMB's two passes are memory-bound: they need many loads in flight, so at least 1,024
    threads (half an SM's 2,048) resident per SM, i.e. 4 CTAs of 256."""
    kernels, _ = compiled
    lamb = [k for k in kernels if k.source == "lamb.cu" and k.arch == arch]
    assert {k.name.split("(")[0].split("<")[0].split("::")[-1] for k in lamb} >= {"lamb_moments_kernel",
                                                                                   "lamb_apply_kernel"}, lamb
    short = [f"{k.name}: {k.ctas_per_sm} CTAs of {k.threads} ({k.limiter}: {k.registers} registers)"
             for k in lamb if (k.ctas_per_sm or 0) * (k.threads or 0) < 1024]
    assert not short, "\n".join(short)


# What the LayerNorm backwards' register path is designed for (layer_norm.cu's and
# dropout_layer_norm.cu's headers), per (kernel, hidden): CTAs of 128 threads per SM on A100 and
# H100 alike (registers decide: a lane holds its row and three, or two, per-column sums), for
# 16-bit and for fp32 input. Its static shared memory is the CTA's sum of its warps' column sums:
# one fp32 row of `hidden` per warp.
ROW_BACKWARD_DESIGN = {
    ("ln_bwd_registers", 768): (3, 3), ("ln_bwd_registers", 1024): (2, 2),
    ("dln_bwd_registers", 768): (3, 2), ("dln_bwd_registers", 1024): (2, 2),
}


@needs_nvcc
@pytest.mark.parametrize("arch", sorted(kinspect.DEVICES))
def test_layer_norm_backwards_are_as_designed(compiled, arch):
    """Every instantiation of the register-path backwards has the CTAs per SM of the design and
    4 x hidden x 4 bytes of shared memory; no kernel of the two sources has a global atomic (the
    parameter gradients are summed per CTA, then by column_sum, in a fixed order)."""
    kernels, with_sass = compiled
    rows = [k for k in kernels if k.source in ("layer_norm.cu", "dropout_layer_norm.cu") and k.arch == arch]
    backward = {}
    for k in rows:
        if found := re.fullmatch(r"(d?ln_bwd_registers)<(\w+), \w+, \w+, (\d+)>", k.name):
            backward[k.name, k.source] = (k, found.group(1), found.group(2), int(found.group(3)))
    assert {(name, hidden) for _, name, _, hidden in backward.values()} == set(ROW_BACKWARD_DESIGN), sorted(backward)
    off = [f"{k.source} {k.name} sm_{arch}: {k.ctas_per_sm} CTAs of {k.threads} ({k.limiter}: {k.registers} "
           f"registers), {k.smem} B shared memory"
           for k, name, dtype, hidden in backward.values()
           if (k.threads, k.ctas_per_sm, k.smem)
           != (128, ROW_BACKWARD_DESIGN[name, hidden][dtype == "fp32"], 4 * hidden * 4)]
    assert not off, "\n".join(off)
    atomics = [f"{k.source} {k.name} sm_{arch}" for k in rows
               if k.ptx["atom/red"] or (with_sass and k.sass["ATOM/RED"])]
    assert not atomics, "\n".join(atomics)


# What cross_entropy.cu's header designs, per kernel (every dtype and vector width): threads per CTA
# and CTAs per SM, A100 and H100 alike: 8 CTAs of 256, all 2,048 thread slots of an SM, which allows
# at most 32 registers a thread.
CROSS_ENTROPY_DESIGN = {"cross_entropy_fwd_kernel": (256, 8), "cross_entropy_bwd_kernel": (256, 8)}


@needs_nvcc
@pytest.mark.parametrize("arch", sorted(kinspect.DEVICES))
def test_cross_entropy_kernels_hold_every_thread_of_an_sm(compiled, arch):
    """The MLM loss streams its logits once a pass, so it wants the most loads in flight: every
    instantiation at 32 registers or fewer, 8 CTAs of 256 per SM, no spills, and no global atomics
    (a row's sums merge in a fixed order)."""
    kernels, _ = compiled
    ce = [k for k in kernels if k.source == "cross_entropy.cu" and k.arch == arch]

    def base(k):
        return k.name.split("(")[0].split("<")[0].split("::")[-1]
    assert {base(k) for k in ce} == set(CROSS_ENTROPY_DESIGN), [k.name for k in ce]
    off = [f"{k.name} sm_{arch}: {k.registers} registers, {k.ctas_per_sm} CTAs of {k.threads} ({k.limiter}), "
           f"{k.ptx['atom/red']} atom/red" for k in ce
           if (k.threads, k.ctas_per_sm) != CROSS_ENTROPY_DESIGN[base(k)] or k.registers > 32 or k.spills
           or k.ptx["atom/red"]]
    assert not off, "\n".join(off)


@needs_nvcc
@pytest.mark.parametrize("arch", sorted(kinspect.DEVICES))
def test_geglu_kernels_keep_loads_in_flight(compiled, arch):
    """GeGLU is elementwise and memory-bound (geglu.cu's header): every instantiation, forward and
    backward, 16-byte vectors or scalar, keeps at least 1,024 threads resident per SM (4 CTAs of
    256) to keep loads in flight, with no shared memory and no global atomics (no reduction)."""
    kernels, with_sass = compiled
    geglu = [k for k in kernels if k.source == "geglu.cu" and k.arch == arch]
    assert {k.name.split("<")[0] for k in geglu} == {"geglu_fwd_kernel", "geglu_bwd_kernel"}, [k.name for k in geglu]
    off = [f"{k.name} sm_{arch}: {k.ctas_per_sm} CTAs of {k.threads} ({k.limiter}: {k.registers} registers), "
           f"{k.smem} B shared memory, {k.ptx['atom/red']} atom/red" for k in geglu
           if (k.ctas_per_sm or 0) * (k.threads or 0) < 1024 or k.smem or k.ptx["atom/red"]
           or (with_sass and k.sass["ATOM/RED"])]
    assert not off, "\n".join(off)
