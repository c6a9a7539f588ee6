"""What every CUDA kernel costs the hardware, read from the compiler: registers, spills,
shared memory and the CTAs per SM they allow on an A100 (sm_80) and an H100 (sm_90),
with the instruction counts that say whether a kernel uses tensor cores and ``cp.async``.

    python -m bert_ds.kernels.inspect [--sources attention.cu,layer_norm.cu] [--summary] [--json FILE]

Design choices, and why:

- **One compile per source and architecture**, with compile_check's flags (the defines
  torch's extension builder adds, ``-O3``, ``-Xptxas -v``) and ``-cubin -keep``: ptxas's
  report, the PTX and the cubin all come from the same nvcc run, so the figures describe
  the code a user's build produces and a test session pays for each compile once.
- **Per template instantiation**: every kernel ptxas compiles is a row, because the
  dtype and head-dim instantiations differ in registers and so in occupancy.
- **Threads per block from ``__launch_bounds__``** (``.maxntid`` in the PTX): every
  launcher launches its kernels with exactly their bound, so the occupancy is known
  without running anything. A kernel without one has no CTA figure.
- **CTAs per SM by the CUDA occupancy calculator's rules** (:func:`ctas_per_sm`):
  registers are allocated per warp in units of 256 and split over the SM's four
  sub-partitions; shared memory in units of 128 bytes plus the 1 KiB the runtime
  reserves per CTA; at most 64 warps and 32 CTAs per SM.
- **Dynamic shared memory from the PTX**: ptxas reports only static shared memory, so a
  kernel with ``extern __shared__`` memory states what its launcher gives it with
  ``declare_dynamic_smem<bytes>()`` (``kernels/csrc/common.cuh``), which leaves the comment
  ``// bds.dynamic_smem <bytes>`` in its PTX; the CTA figures count static plus dynamic.
- **Instruction counts from the PTX** (``mma.sync``, ``ldmatrix``, ``cp.async`` copies,
  ``ld.local``/``st.local``, ``atom``/``red`` outside shared memory) always, and **from
  the SASS** (``HMMA``, ``LDSM``, ``LDGSTS``, ``LDL``/``STL``, ``ATOM``/``RED``) where
  ``nvdisasm`` is found: the toolkit's, one on PATH,
  or the ``nvidia-cuda-nvdisasm`` wheel (the ``test`` extra installs it on Linux).
  Without it the SASS columns read "-" and everything else still works. Counts are
  static (instructions in the code, after unrolling), not executed instructions.

Exit status 0 when every source compiles (or when nvcc is not found: it says so and
skips, as compile_check does); 1 when one fails.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from bert_ds.base.errors import UserError
from bert_ds.kernels.compile_check import CSRC, TARGETS, find_nvcc, nvcc_flags, source_paths


# --------------------------------------------------------------------------- occupancy

@dataclass(frozen=True)
class Device:
    """The per-SM limits the occupancy calculator uses (CUDA C Programming Guide, compute capabilities)."""

    name: str
    smem_per_sm: int  # bytes a CTA may be given, at the largest carveout
    regs_per_sm: int = 65536
    regs_per_cta: int = 65536
    max_threads_per_sm: int = 2048
    max_ctas_per_sm: int = 32
    reg_unit: int = 256  # registers are allocated per warp in these units
    sub_partitions: int = 4  # the register file is split among 4 schedulers
    smem_unit: int = 128
    smem_reserved_per_cta: int = 1024  # the runtime's own per-CTA shared memory (sm_80 and later)
    warp_size: int = 32


DEVICES = {"80": Device("A100", smem_per_sm=164 * 1024), "90": Device("H100", smem_per_sm=228 * 1024)}


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def ctas_per_sm(device: Device, registers: int, smem: int, threads: int) -> tuple[int, str]:
    """CTAs of a kernel resident on one SM, and what limits them ("warps", "registers",
    "shared memory" or "CTAs"); 0 when one CTA does not fit at all."""
    warps = -(-threads // device.warp_size)
    limits = {"CTAs": device.max_ctas_per_sm,
              "warps": device.max_threads_per_sm // device.warp_size // warps}
    regs_per_warp = _round_up(registers * device.warp_size, device.reg_unit)
    if regs_per_warp:
        # A CTA's warps must fit the per-CTA limit as if spread over every sub-partition
        # (the hardware's check), and each sub-partition holds whole warps.
        fits = regs_per_warp * _round_up(warps, device.sub_partitions) <= device.regs_per_cta
        warps_per_partition = device.regs_per_sm // device.sub_partitions // regs_per_warp
        limits["registers"] = warps_per_partition * device.sub_partitions // warps if fits else 0
    smem_per_cta = _round_up(smem + device.smem_reserved_per_cta, device.smem_unit)
    limits["shared memory"] = device.smem_per_sm // smem_per_cta
    limiter = min(limits, key=lambda k: limits[k])
    return limits[limiter], limiter


# --------------------------------------------------------------------------- one kernel

PTX_COUNTS = {  # column -> what counts in the PTX
    "mma.sync": r"\bmma\.sync\b",
    "ldmatrix": r"\bldmatrix\b",
    "cp.async": r"\bcp\.async\.c[ag]\b",  # the copies, not their commit/wait
    "ld/st.local": r"\b(?:ld|st)\.local\b",
    "atom/red": r"\b(?:atom|red)\.(?!(?:\w+\.)*shared\b)",  # global (or generic) atomics, not shared-memory ones
}
SASS_COUNTS = {"HMMA": ("HMMA",), "LDSM": ("LDSM",), "LDGSTS": ("LDGSTS",), "LDL/STL": ("LDL", "STL"),
               "ATOM/RED": ("ATOM", "ATOMG", "RED", "REDG")}  # ATOMS (shared memory) left out
_DYNAMIC_SMEM = re.compile(r"//\s*bds\.dynamic_smem\s+(\d+)")


@dataclass
class Kernel:
    source: str
    arch: str
    name: str  # demangled, without namespaces and parameters
    mangled: str
    registers: int
    stack: int  # bytes of stack frame
    spill_stores: int
    spill_loads: int
    smem: int  # static shared memory, bytes
    threads: int | None  # from __launch_bounds__
    ptx: dict[str, int]
    sass: dict[str, int] | None  # None without a disassembler
    ctas_per_sm: int | None = None
    limiter: str = ""
    dynamic_smem: int = 0  # bytes, as the kernel declares them in its PTX (declare_dynamic_smem)

    @property
    def device(self) -> Device:
        return DEVICES[self.arch]

    @property
    def spills(self) -> bool:
        return bool(self.spill_stores or self.spill_loads or self.ptx["ld/st.local"]
                    or (self.sass is not None and self.sass["LDL/STL"]))


# --------------------------------------------------------------------------- parsing

_ENTRY = re.compile(r"Compiling entry function '(\w+)' for 'sm_(\d+)'")
_PROPERTIES = re.compile(r"Function properties for (\w+)\s+(\d+) bytes stack frame, (\d+) bytes spill stores, "
                         r"(\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(.*)")


def parse_ptxas(output: str) -> dict[str, dict[str, int]]:
    """``-Xptxas -v`` output -> {mangled entry: registers, stack, spill_stores, spill_loads, smem}."""
    stats: dict[str, dict[str, int]] = {}
    current = None
    for match in re.finditer(f"{_ENTRY.pattern}|{_PROPERTIES.pattern}|{_USED.pattern}", output):
        entry, _, props, stack, stores, loads, registers, rest = match.groups()
        if entry:
            current = stats.setdefault(entry, {"stack": 0, "spill_stores": 0, "spill_loads": 0, "smem": 0})
        elif props and props in stats:
            stats[props].update(stack=int(stack), spill_stores=int(stores), spill_loads=int(loads))
        elif registers and current is not None:
            smem = re.search(r"(\d+) bytes smem", rest)
            current.update(registers=int(registers), smem=int(smem.group(1)) if smem else 0)
    return stats


def ptx_entries(ptx: str) -> dict[str, str]:
    """PTX -> {mangled entry: its text (directives and body)}."""
    linkage = r"^\s*(?:\.visible\s+|\.weak\s+)?"
    starts = [(m.start(), m.group(1)) for m in re.finditer(linkage + r"\.entry\s+(\w+)", ptx, re.M)]
    ends = [m.start() for m in re.finditer(linkage + r"\.(?:entry|func)\s", ptx, re.M)]
    bodies = {}
    for start, name in starts:
        end = next((e for e in ends if e > start), len(ptx))
        bodies[name] = ptx[start:end]
    return bodies


def ptx_threads(entry_ptx: str) -> int | None:
    """Threads per block that ``__launch_bounds__`` declared (``.maxntid x, y, z``)."""
    match = re.search(r"\.maxntid\s+(\d+)(?:,\s*(\d+))?(?:,\s*(\d+))?", entry_ptx)
    if not match:
        return None
    x, y, z = (int(v) if v else 1 for v in match.groups())
    return x * y * z


def ptx_dynamic_smem(entry_ptx: str) -> int:
    """Bytes of dynamic shared memory a kernel declares (``// bds.dynamic_smem N``), 0 if none."""
    return max((int(n) for n in _DYNAMIC_SMEM.findall(entry_ptx)), default=0)


def sass_opcodes(disassembly: str) -> dict[str, dict[str, int]]:
    """``nvdisasm`` output -> {mangled function: {opcode (before its first '.'): count}}."""
    functions: dict[str, dict[str, int]] = {}
    current: dict[str, int] | None = None
    for line in disassembly.splitlines():
        label = re.match(r"^\.text\.(\w+):", line)
        if label:
            current = functions.setdefault(label.group(1), {})
            continue
        instruction = re.match(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_]*)", line)
        if instruction and current is not None:
            opcode = instruction.group(1)
            current[opcode] = current.get(opcode, 0) + 1
    return functions


_SHORT_TYPES = {"__nv_bfloat16": "bf16", "__half": "fp16", "float": "fp32"}


def short_names(mangled: list[str]) -> dict[str, str]:
    """Mangled -> ``kernel<args>`` (c++filt, namespaces and parameters dropped); mangled without c++filt."""
    demangler = shutil.which("c++filt")
    if demangler is None or not mangled:
        return {m: m for m in mangled}
    lines = subprocess.run([demangler], input="\n".join(mangled), capture_output=True, text=True).stdout.splitlines()
    names = {}
    for m, full in zip(mangled, lines):
        head = re.sub(r"^void ", "", full.replace("(anonymous namespace)::", "")).split("(")[0]
        head = re.sub(r"^[\w:]*::", "", head)  # the namespaces before the name
        names[m] = re.sub(r"\b(" + "|".join(_SHORT_TYPES) + r")\b", lambda t: _SHORT_TYPES[t.group(1)], head)
    return names


# --------------------------------------------------------------------------- compiling

def find_nvdisasm(nvcc: str | None = None) -> str | None:
    """nvdisasm beside nvcc, on PATH, or from the nvidia-cuda-nvdisasm wheel; None if nowhere."""
    candidates = [Path(nvcc).resolve().parent / "nvdisasm"] if nvcc else []
    on_path = shutil.which("nvdisasm")
    candidates += [Path(on_path)] if on_path else []
    try:
        import nvidia  # the namespace package NVIDIA's CUDA wheels install into
        candidates += [p for root in nvidia.__path__ for p in sorted(Path(root).glob("cu*/bin/nvdisasm"))]
    except ImportError:
        pass
    return next((str(c) for c in candidates if c.is_file()), None)


class CompileError(RuntimeError):
    pass


def inspect_source(nvcc: str, source: Path, arch: str, std: str, nvdisasm: str | None) -> list[Kernel]:
    """Every kernel of one source compiled for one architecture."""
    with tempfile.TemporaryDirectory(prefix="bds-inspect-") as tmp:
        cubin = Path(tmp) / f"{source.stem}.cubin"
        proc = subprocess.run([nvcc, *nvcc_flags(arch, std), "-cubin", "-keep", "-keep-dir", tmp,
                               str(source), "-o", str(cubin)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise CompileError(f"{source.name} sm_{arch}: nvcc failed:\n{(proc.stdout + proc.stderr).strip()}")
        stats = parse_ptxas(proc.stdout + proc.stderr)
        entries = ptx_entries((Path(tmp) / f"{source.stem}.ptx").read_text())
        sass = None
        if nvdisasm is not None:
            dis = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True)
            if dis.returncode != 0:
                raise CompileError(f"{source.name} sm_{arch}: nvdisasm failed: {dis.stderr.strip()}")
            sass = sass_opcodes(dis.stdout)
    names = short_names(sorted(stats))
    kernels = []
    for mangled in sorted(stats, key=lambda m: names[m]):
        s, body = stats[mangled], entries.get(mangled, "")
        kernel = Kernel(
            source=source.name, arch=arch, name=names[mangled], mangled=mangled, registers=s["registers"],
            stack=s["stack"], spill_stores=s["spill_stores"], spill_loads=s["spill_loads"], smem=s["smem"],
            threads=ptx_threads(body), dynamic_smem=ptx_dynamic_smem(body),
            ptx={col: len(re.findall(rx, body)) for col, rx in PTX_COUNTS.items()},
            sass=None if sass is None else {col: sum(sass.get(mangled, {}).get(op, 0) for op in ops)
                                            for col, ops in SASS_COUNTS.items()})
        if kernel.threads is not None:
            kernel.ctas_per_sm, kernel.limiter = ctas_per_sm(kernel.device, kernel.registers,
                                                             kernel.smem + kernel.dynamic_smem, kernel.threads)
        kernels.append(kernel)
    return kernels


def inspect_all(sources: list[Path] | None = None) -> tuple[list[Kernel], str | None]:
    """Every kernel of ``sources`` (default: every ``csrc/*.cu``) for sm_80 and sm_90, and
    the nvdisasm used (None: no SASS counts). Raises CompileError; needs nvcc."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise CompileError("nvcc not found (PATH, CUDA_HOME, CUDA_PATH)")
    nvdisasm = find_nvdisasm(nvcc)
    jobs = [(source, arch, std) for source in sources or sorted(CSRC.glob("*.cu")) for arch, std in TARGETS]
    # nvcc runs are independent and single-threaded: one per core (a 2-core CI machine halves the wait)
    with ThreadPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1)) as pool:
        results = list(pool.map(lambda job: inspect_source(nvcc, job[0], job[1], job[2], nvdisasm), jobs))
    return [kernel for result in results for kernel in result], nvdisasm


# --------------------------------------------------------------------------- report

def table(kernels: list[Kernel], arch: str) -> str:
    """One architecture's kernels as a markdown table."""
    d = DEVICES[arch]
    with_sass = any(k.sass is not None for k in kernels)
    header = ["source", "kernel", "regs", "stack/spill st/ld B", "smem B", "dyn smem B", "threads",
              f"CTAs/SM on {d.name}",
              "warps/SM", *PTX_COUNTS, *(SASS_COUNTS if with_sass else ())]
    lines = [f"sm_{arch} on {d.name} ({d.regs_per_sm} registers, {d.smem_per_sm // 1024} KiB shared memory, "
             f"{d.max_threads_per_sm} threads, {d.max_ctas_per_sm} CTAs per SM)", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * 2 + "---:|" * (len(header) - 2)]
    for k in (k for k in kernels if k.arch == arch):
        ctas = "-" if k.ctas_per_sm is None else f"{k.ctas_per_sm} ({k.limiter})"
        warps = "-" if k.ctas_per_sm is None else str(k.ctas_per_sm * -(-k.threads // 32))
        cells = [k.source, k.name, str(k.registers), f"{k.stack}/{k.spill_stores}/{k.spill_loads}", str(k.smem),
                 str(k.dynamic_smem), str(k.threads or "-"), ctas, warps, *(str(k.ptx[c]) for c in PTX_COUNTS),
                 *((str(k.sass[c]) if k.sass else "-" for c in SASS_COUNTS) if with_sass else ())]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def family(kernel: Kernel) -> str:
    """The kernel with its dtype arguments folded (``ln_bwd_registers<T, T, T, 1024>``): the
    instantiations that differ only in dtypes, which the summary puts on one row."""
    return re.sub(r"\b(?:" + "|".join(_SHORT_TYPES.values()) + r")\b", "T", kernel.name)


def _span(values: list[int]) -> str:
    return str(min(values)) if min(values) == max(values) else f"{min(values)}-{max(values)}"


def summary(kernels: list[Kernel]) -> str:
    """One row per kernel family and both architectures side by side: ranges over the dtypes."""
    archs = [arch for arch, _ in TARGETS]
    names = " / ".join(f"{DEVICES[a].name}" for a in archs)
    with_sass = all(k.sass is not None for k in kernels)
    header = ["source", "kernel (T: each dtype)", f"regs sm_{' / sm_'.join(archs)}", "spill B (st+ld)", "smem B",
              "dyn smem B", "threads", f"CTAs/SM {names}", *PTX_COUNTS, *(SASS_COUNTS if with_sass else ())]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 2 + "---:|" * (len(header) - 2)]
    groups: dict[tuple[str, str], list[Kernel]] = {}
    for k in kernels:
        groups.setdefault((k.source, family(k)), []).append(k)
    for (source, name), group in groups.items():
        by_arch = {a: [k for k in group if k.arch == a] for a in archs}
        ctas = [_span([k.ctas_per_sm for k in by_arch[a]]) if all(k.ctas_per_sm is not None for k in by_arch[a])
                else "-" for a in archs]
        cells = [source, name, " / ".join(_span([k.registers for k in by_arch[a]]) for a in archs),
                 _span([k.spill_stores + k.spill_loads for k in group]), _span([k.smem for k in group]),
                 _span([k.dynamic_smem for k in group]), _span([k.threads or 0 for k in group]), " / ".join(ctas),
                 *(_span([k.ptx[c] for k in group]) for c in PTX_COUNTS),
                 *(_span([k.sass[c] for k in group]) for c in (SASS_COUNTS if with_sass else ()))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(kernels: list[Kernel], nvdisasm: str | None, compact: bool = False) -> str:
    sass = f"SASS counts from {nvdisasm}" if nvdisasm else \
        "no SASS counts: nvdisasm not found (pip install nvidia-cuda-nvdisasm, or the toolkit's)"
    parts = [f"bert_ds.kernels.inspect: {len(kernels)} kernels; {sass}"]
    parts += [summary(kernels)] if compact else [table(kernels, arch) for arch, _ in TARGETS]
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bert_ds.kernels.inspect", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sources", default=None, help="comma-separated .cu files of kernels/csrc (default: all)")
    parser.add_argument("--json", type=Path, default=None, help="also write every kernel's figures to this file")
    parser.add_argument("--summary", action="store_true",
                        help="one row per kernel and both architectures, dtype instantiations folded")
    args = parser.parse_args(argv)
    try:
        sources = [s for s in source_paths(args.sources) if s.suffix == ".cu"]
    except UserError as error:
        parser.error(str(error))
    if not sources:
        parser.error("--sources names no .cu file")
    if find_nvcc() is None:
        print("bert_ds.kernels.inspect: nvcc not found (PATH, CUDA_HOME, CUDA_PATH); nothing to inspect")
        return 0
    try:
        kernels, nvdisasm = inspect_all(sources)
    except CompileError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(report(kernels, nvdisasm, compact=args.summary))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(k) for k in kernels], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
