"""Partitioned datasets: which part a build process makes, and a parent of parts read as one.

A corpus too big for one machine is built in N parts by N runs of the same ``build``
command. Part I of N goes to ``OUTPUT/part-0000I-of-0000N/`` (five digits each), a complete
dataset folder of its own (shards, tokenizer files, ``manifest.json`` written last) whose
manifest records ``build["partition"] = {"index": I, "count": N, "corpus_key": K}``; K is
the same in every part of one build. N = 1 is a plain build into OUTPUT itself.

Which part a process builds (:func:`resolve_part`): ``--part I/N`` if given, else the first
launcher whose variables are set, in this order:

1. torchrun and the deepspeed launcher: ``RANK`` / ``WORLD_SIZE``;
2. Open MPI ``mpirun``: ``OMPI_COMM_WORLD_RANK`` / ``OMPI_COMM_WORLD_SIZE``;
3. MPICH and Intel MPI: ``PMI_RANK`` / ``PMI_SIZE``;
4. ``srun``: ``SLURM_PROCID`` / ``SLURM_STEP_NUM_TASKS``. Only a job step has the latter:
   a plain ``sbatch`` script has ``SLURM_PROCID=0`` and ``SLURM_NTASKS=N`` and must not
   build part 0 of N, so it builds the whole corpus.

A rank without its size (or a size without its rank), values that are not integers or out
of range, and ``--part`` with a count other than a launcher's world size are refused: a
guessed partition would silently drop or double part of the corpus.

:func:`dataset_folders` is how a reader opens either layout: a dataset folder, or a parent
whose N parts are all finished and belong to one build.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from bert_ds.base.errors import ShardError, UserError
from bert_ds.data_tools.manifest import MANIFEST_NAME, Manifest

PART_RE = re.compile(r"^part-(\d{5})-of-(\d{5})$")
MAX_PARTS = 99999  # five digits
# (launcher, rank variable, size variable), in the order they are tried.
LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE"),
    ("mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("MPICH/Intel MPI", "PMI_RANK", "PMI_SIZE"),
    ("srun", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"),
)


def part_name(index: int, count: int) -> str:
    return f"part-{index:05d}-of-{count:05d}"


@dataclass(frozen=True)
class Part:
    """Part ``index`` of ``count`` (0-based); ``origin`` says where that came from."""

    index: int = 0
    count: int = 1
    origin: str = ""  # "--part", "torchrun: RANK/WORLD_SIZE", ...; "" for a plain build

    @property
    def partitioned(self) -> bool:
        return self.count > 1

    @property
    def name(self) -> str:
        return part_name(self.index, self.count)

    @property
    def label(self) -> str:
        return f"part {self.index}/{self.count}"

    def folder(self, output: str | os.PathLike) -> Path:
        """Where this part is built: OUTPUT itself for a plain build."""
        return Path(output) / self.name if self.partitioned else Path(output)


def parse_part(text: str) -> tuple[int, int]:
    """``"I/N"`` -> (I, N); UserError unless 0 <= I < N <= MAX_PARTS."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if m is None:
        raise UserError(f"--part {text}: write I/N, the 0-based part index and the number of parts (e.g. 0/4)")
    index, count = int(m[1]), int(m[2])
    if not 1 <= count <= MAX_PARTS:
        raise UserError(f"--part {text}: the number of parts must be 1 to {MAX_PARTS}")
    if index >= count:
        raise UserError(f"--part {text}: the index must be 0 to {count - 1} (parts are numbered from 0)")
    return index, count


def _env_int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name].strip())
    except ValueError:
        raise UserError(f"{name}={env[name]!r} is not an integer; cannot tell which part to build") from None


def launcher_part(env: Mapping[str, str]) -> Part | None:
    """The part a launcher's variables name, or None when no launcher set them."""
    for launcher, rank_var, size_var in LAUNCHERS:
        has_rank, has_size = rank_var in env, size_var in env
        if launcher == "srun" and not has_size:
            continue  # an sbatch script, not a job step: SLURM_PROCID=0 says nothing of parts
        if not has_rank and not has_size:
            continue
        if has_rank != has_size:
            given, missing = (rank_var, size_var) if has_rank else (size_var, rank_var)
            raise UserError(f"{given} is set but {missing} is not; cannot tell which part to build "
                            "(pass --part I/N)")
        rank, size = _env_int(env, rank_var), _env_int(env, size_var)
        if not (1 <= size <= MAX_PARTS and 0 <= rank < size):
            raise UserError(f"{rank_var}={rank} with {size_var}={size} is no part of a partition "
                            f"(want 0 <= rank < size <= {MAX_PARTS})")
        origin = f"{launcher}: {rank_var}/{size_var}"
        if launcher == "torchrun" and "TORCHELASTIC_RUN_ID" not in env:
            origin = f"launcher: {rank_var}/{size_var}"  # the deepspeed launcher, or another that sets them
        return Part(rank, size, origin)
    return None


# Processes per host, as each launcher says it: a part's default --workers is the host's CPUs shared among them.
LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_STEP_TASKS_PER_NODE")


def processes_per_host(env: Mapping[str, str] | None = None) -> int:
    """How many build processes a launcher started on this host (1 when none says)."""
    env = os.environ if env is None else env
    for name in LOCAL_SIZE_VARS:
        m = re.match(r"\s*(\d+)", env.get(name, ""))  # srun writes e.g. "4(x2),3"
        if m and int(m[1]) > 0:
            return int(m[1])
    return 1


def resolve_part(flag: str | None, env: Mapping[str, str] | None = None) -> Part:
    """The part this process builds: ``--part`` (``flag``) wins, else the launcher's; a plain build else."""
    env = os.environ if env is None else env
    launched = launcher_part(env)
    if flag is None:
        return launched if launched is not None and launched.count > 1 else Part()
    index, count = parse_part(flag)
    if launched is not None and launched.count > 1 and launched.count != count:
        raise UserError(f"--part {flag} names {count} parts, but {launched.origin.split(':')[0]} started "
                        f"{launched.count} processes ({launched.origin.split(': ')[1]}); give --part "
                        f"with {launched.count} parts or drop it")
    return Part(index, count, "--part") if count > 1 else Part()


# -- reading a parent of parts ---------------------------------------------------------------

def part_folders(parent: Path) -> dict[int, list[tuple[int, Path]]]:
    """The part folders in ``parent`` by count: {N: [(index, path), ...] sorted}."""
    found: dict[int, list[tuple[int, Path]]] = {}
    if not parent.is_dir():
        return found
    for p in parent.iterdir():
        m = PART_RE.match(p.name)
        if m and p.is_dir():
            found.setdefault(int(m[2]), []).append((int(m[1]), p))
    return {n: sorted(v) for n, v in found.items()}


def _numbers(indices: list[int]) -> str:
    return f"{'part' if len(indices) == 1 else 'parts'} {', '.join(map(str, indices))}"


def dataset_folders(path: str | os.PathLike) -> list[Path]:
    """The dataset folders ``path`` stands for, in order: itself when it holds a manifest,
    else its N part folders once every one is finished and they belong to one build.
    ShardError naming what is wrong otherwise. Empty parts (no shards) are included."""
    path = Path(path)
    if (path / MANIFEST_NAME).is_file():
        return [path]
    if not path.exists():
        raise ShardError(f"{path}: not found")
    by_count = part_folders(path)
    if not by_count:
        below = sorted(path.glob(f"*/{MANIFEST_NAME}")) if path.is_dir() else []
        hint = f"; dataset folders in it: {', '.join(str(p.parent) for p in below[:4])}" if below else ""
        raise ShardError(f"{path}: not a dataset folder nor a parent of partitions{hint}")
    if len(by_count) > 1:
        raise ShardError(f"{path}: holds parts of {' and of '.join(map(str, sorted(by_count)))} parts "
                         "(two different builds); remove the folders of one")
    (count, found), = by_count.items()
    folders = {i: p for i, p in found if i < count}
    if len(folders) != len(found):
        raise ShardError(f"{path}: part folder names an index past its count: "
                         f"{', '.join(p.name for i, p in found if i >= count)}")
    missing = [i for i in range(count) if i not in folders or not (folders[i] / MANIFEST_NAME).is_file()]
    if missing:
        are, their = ("is", "its build") if len(missing) == 1 else ("are", "their builds")
        raise ShardError(f"{path}: {_numbers(missing)} of {count} {are} missing or unfinished (no "
                         f"{MANIFEST_NAME}); rerun {their}")
    first: dict | None = None
    for i in range(count):
        manifest = Manifest.load(folders[i])
        record = manifest.build.get("partition")
        if not isinstance(record, dict) or record.get("index") != i or record.get("count") != count:
            raise ShardError(f"{folders[i] / MANIFEST_NAME}: records partition {record!r}, not part {i} of "
                             f"{count} as its folder name says")
        mine = {"corpus_key": record.get("corpus_key"), "tokenizer": manifest.tokenizer_fingerprint}
        first = first or mine
        if mine["corpus_key"] != first["corpus_key"]:
            raise ShardError(f"{folders[i]}: built from other inputs or options than part 0 (corpus_key "
                             f"{str(mine['corpus_key'])[:16]} vs {str(first['corpus_key'])[:16]}); rebuild it")
        if mine["tokenizer"] != first["tokenizer"]:
            raise ShardError(f"{folders[i]}: built with another tokenizer than part 0 (fingerprint "
                             f"{mine['tokenizer'][:16]} vs {first['tokenizer'][:16]}); rebuild it")
    return [folders[i] for i in range(count)]
