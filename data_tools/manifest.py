"""``manifest.json``: what a dataset folder holds, written last by the build.

A dataset folder is complete exactly when ``manifest.json`` exists: the build writes
it after every shard is in place (tmp + fsync + ``os.replace``), so a crashed build
leaves no manifest and is never read as a dataset.

Keys (``format_version`` 1)::

    format_version         1
    created_by             "bert-ds X.Y.Z"
    vocab_size             ids are 0 .. vocab_size - 1
    token_dtype            "uint16" | "uint32"
    lowercase              the tokenizer lowercases (and strips accents)
    special_tokens         {"pad": id, "unk": id, "cls": id, "sep": id, "mask": id}
    tokenizer_fingerprint  sha256 hex of the folder's vocab.txt bytes; of a --tokenizer build
                           (build.vocab {"tokenizer": PATH}), of its vocabulary and special ids
                           (fast_tokenizer.vocabulary_fingerprint), build.tokenizer_sha256 then
                           being the sha256 of its tokenizer.json
    shards                 [ShardInfo as a dict, ...] in order
    totals                 {"docs": n, "sentences": n, "tokens": n}
    sources                [{"path": as given, "bytes": n, "sha256": hex}, ...]
    build                  the options that shaped the output (never --workers)
    stats                  input and filtering counts (documents in/written/skipped ...)

No timestamps or timings: the same inputs and options give a byte-identical manifest.

:func:`open_dataset` is the one way the training side opens a dataset: it checks the
manifest, the tokenizer fingerprint, and every shard header against its manifest
entry, and that no token id can reach past the vocabulary (R5), before any token is
read.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field, fields
from importlib import metadata
from pathlib import Path

import numpy as np

from bert_ds.base.atomic import atomic_write
from bert_ds.base.errors import ShardError, UserError
from bert_ds.data_tools.shard_format import ShardInfo, ShardReader, token_dtype

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
VOCAB_NAME = "vocab.txt"
SPECIAL_KEYS = ("pad", "unk", "cls", "sep", "mask")
_SHARD_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")  # a plain file name: no folders, no ..


def created_by() -> str:
    try:
        return f"bert-ds {metadata.version('bert-ds')}"
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "bert-ds (not installed)"


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def tokenizer_fingerprint(vocab_path: str | os.PathLike) -> str:
    """sha256 hex of the vocab.txt bytes; ShardError naming the file if unreadable."""
    try:
        return file_sha256(vocab_path)
    except FileNotFoundError:
        raise ShardError(f"{vocab_path}: missing (the dataset's tokenizer vocabulary)") from None
    except OSError as e:
        raise ShardError(f"{vocab_path}: cannot read: {e.strerror}") from None


@dataclass
class Manifest:
    vocab_size: int
    token_dtype: str
    lowercase: bool
    special_tokens: dict[str, int]
    tokenizer_fingerprint: str
    shards: list[ShardInfo]
    totals: dict[str, int]
    sources: list[dict] = field(default_factory=list)
    build: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    format_version: int = MANIFEST_VERSION
    created_by: str = field(default_factory=created_by)

    def model_fields(self) -> dict[str, int]:
        """What the data decides of a model trained on it: its vocabulary's size and its special
        tokens' ids, the tokenizer's own (the padding token's row is the embedding row that gets no
        gradient), named as a model config names them."""
        special = self.special_tokens
        return {"vocab_size": self.vocab_size, "pad_token_id": special["pad"], "cls_token_id": special["cls"],
                "sep_token_id": special["sep"], "mask_token_id": special["mask"]}

    def to_dict(self) -> dict:
        return {
            "format_version": self.format_version,
            "created_by": self.created_by,
            "vocab_size": self.vocab_size,
            "token_dtype": self.token_dtype,
            "lowercase": self.lowercase,
            "special_tokens": dict(self.special_tokens),
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
            "shards": [s.to_dict() for s in self.shards],
            "totals": dict(self.totals),
            "sources": list(self.sources),
            "build": dict(self.build),
            "stats": dict(self.stats),
        }

    def save(self, directory: str | os.PathLike) -> Path:
        """Write DIR/manifest.json atomically (tmp, fsync, os.replace, fsync DIR)."""
        text = json.dumps(self.to_dict(), indent=1) + "\n"
        return atomic_write(Path(directory) / MANIFEST_NAME, text)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> Manifest:
        """Read and check DIR/manifest.json; ShardError naming the file on any problem."""
        path = Path(directory) / MANIFEST_NAME
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ShardError(f"{path}: missing (not a bert-ds dataset, or its build did not finish)") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ShardError(f"{path}: unreadable: {e}") from None
        return cls.from_dict(raw, path)

    @classmethod
    def from_dict(cls, raw: object, path: str | os.PathLike = MANIFEST_NAME) -> Manifest:
        def bad(what: str) -> ShardError:
            return ShardError(f"{path}: {what}")

        if not isinstance(raw, dict):
            raise bad("not a JSON object")
        if raw.get("format_version") != MANIFEST_VERSION:
            raise bad(f"unsupported format_version {raw.get('format_version')!r} (this bert-ds reads {MANIFEST_VERSION})")
        types = {
            "created_by": str, "vocab_size": int, "token_dtype": str, "lowercase": bool,
            "special_tokens": dict, "tokenizer_fingerprint": str, "shards": list,
            "totals": dict, "sources": list, "build": dict, "stats": dict,
        }
        for key, typ in types.items():
            if key not in raw:
                raise bad(f"missing key {key!r}")
            if not isinstance(raw[key], typ) or (typ is int and isinstance(raw[key], bool)):
                raise bad(f"{key!r} should be {typ.__name__}, got {type(raw[key]).__name__}")
        vocab_size = raw["vocab_size"]
        try:
            expected_dtype = token_dtype(vocab_size).name
        except ShardError as e:
            raise bad(str(e)) from None
        if raw["token_dtype"] != expected_dtype:
            raise bad(f"token_dtype {raw['token_dtype']!r} does not match vocab_size {vocab_size} ({expected_dtype})")
        special = raw["special_tokens"]
        for key in SPECIAL_KEYS:
            sid = special.get(key)
            if not isinstance(sid, int) or not 0 <= sid < vocab_size:
                raise bad(f"special token {key!r} id {sid!r} is not in [0, {vocab_size})")
        shards = []
        names = [f.name for f in fields(ShardInfo)]
        for i, entry in enumerate(raw["shards"]):
            if not isinstance(entry, dict) or set(entry) != set(names):
                raise bad(f"shards[{i}] should have exactly the keys {names}")
            if not isinstance(entry["name"], str) or not _SHARD_NAME.match(entry["name"]):
                raise bad(f"shards[{i}] has an invalid name {entry['name']!r}")
            for n in names[1:]:
                if not isinstance(entry[n], int) or isinstance(entry[n], bool) or entry[n] < 0:
                    raise bad(f"shards[{i}].{n} should be a non-negative integer")
            shards.append(ShardInfo(**entry))
        for i, src in enumerate(raw["sources"]):
            if not isinstance(src, dict) or not {"path", "bytes", "sha256"} <= set(src):
                raise bad(f"sources[{i}] should be an object with path, bytes and sha256")
        totals = raw["totals"]
        for key, attr in (("docs", "num_docs"), ("sentences", "num_sentences"), ("tokens", "num_tokens")):
            want = sum(getattr(s, attr) for s in shards)
            if totals.get(key) != want:
                raise bad(f"totals.{key} = {totals.get(key)!r}, but the shards add up to {want}")
        return cls(
            vocab_size=vocab_size, token_dtype=raw["token_dtype"], lowercase=raw["lowercase"],
            special_tokens={k: special[k] for k in SPECIAL_KEYS},
            tokenizer_fingerprint=raw["tokenizer_fingerprint"], shards=shards, totals=dict(totals),
            sources=raw["sources"], build=raw["build"], stats=raw["stats"],
            format_version=raw["format_version"], created_by=raw["created_by"],
        )


def given_tokenizer(manifest: Manifest) -> bool:
    """Whether the dataset was built with ``--tokenizer`` (any fast tokenizer), not a WordPiece vocabulary."""
    vocab = manifest.build.get("vocab")
    return isinstance(vocab, dict) and "tokenizer" in vocab


def check_tokenizer(directory: str | os.PathLike, manifest: Manifest, full: bool = False) -> list[str]:
    """Problems with DIR/vocab.txt against the manifest (fingerprint, size); of a ``--tokenizer``
    build, with DIR/tokenizer.json (its sha256; with ``full``, its fingerprint and size too)."""
    if given_tokenizer(manifest):
        return _check_tokenizer_json(Path(directory) / "tokenizer.json", manifest, full)
    vocab = Path(directory) / VOCAB_NAME
    try:
        data = vocab.read_bytes()
    except FileNotFoundError:
        return [f"{vocab}: missing (the dataset's tokenizer vocabulary)"]
    except OSError as e:
        return [f"{vocab}: cannot read: {e.strerror}"]
    actual = hashlib.sha256(data).hexdigest()
    if actual != manifest.tokenizer_fingerprint:
        return [
            f"{vocab}: tokenizer fingerprint {actual[:16]} does not match the manifest's "
            f"{manifest.tokenizer_fingerprint[:16]}: the shards were built with another vocabulary"
        ]
    lines = data.count(b"\n") + (0 if data.endswith(b"\n") or not data else 1)  # as WordPiece reads it
    if lines != manifest.vocab_size:
        return [f"{vocab}: {lines} entries, but the manifest says vocab_size={manifest.vocab_size}"]
    return []


def _check_tokenizer_json(path: Path, manifest: Manifest, full: bool) -> list[str]:
    from bert_ds.data_tools.fast_tokenizer import file_fingerprint

    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [f"{path}: missing (the dataset's tokenizer)"]
    except OSError as e:
        return [f"{path}: cannot read: {e.strerror}"]
    actual, recorded = hashlib.sha256(data).hexdigest(), str(manifest.build.get("tokenizer_sha256"))
    if actual != recorded:
        return [f"{path}: sha256 {actual[:16]} does not match the manifest's tokenizer_sha256 {recorded[:16]}: "
                "the shards were built with another tokenizer"]
    if not full:
        return []
    try:
        fingerprint, size = file_fingerprint(data.decode("utf-8"), manifest.special_tokens)
    except (UserError, UnicodeDecodeError) as e:
        return [f"{path}: {e}"]
    if fingerprint != manifest.tokenizer_fingerprint:
        return [f"{path}: tokenizer fingerprint {fingerprint[:16]} does not match the manifest's "
                f"{manifest.tokenizer_fingerprint[:16]}"]
    if size != manifest.vocab_size:
        return [f"{path}: {size} ids, but the manifest says vocab_size={manifest.vocab_size}"]
    return []


def check_shard(reader: ShardReader, info: ShardInfo, manifest: Manifest) -> list[str]:
    """Problems of an opened shard against its manifest entry and the vocabulary."""
    problems = []
    actual = reader.info()
    for f in fields(ShardInfo):
        want, got = getattr(info, f.name), getattr(actual, f.name)
        if want != got:
            problems.append(f"{reader.idx_path}: header {f.name}={got}, manifest says {want}")
    if reader.dtype != np.dtype(manifest.token_dtype):
        problems.append(f"{reader.idx_path}: token dtype {reader.dtype.name}, manifest says {manifest.token_dtype}")
    for name, max_id in ((reader.idx_path, reader.max_token_id), (f"manifest entry {info.name}", info.max_token_id)):
        if max_id >= manifest.vocab_size:
            problems.append(
                f"{name}: max token id {max_id} >= vocab size {manifest.vocab_size}: "
                "built with a larger vocabulary than this dataset's tokenizer"
            )
    return problems


def open_dataset(directory: str | os.PathLike, *, verify: bool = False) -> tuple[Manifest, list[ShardReader]]:
    """Open every shard of a dataset folder after checking it against its manifest.

    Raises ShardError listing every problem found (each names its file). With
    ``verify=True`` also reads every ``.bin`` fully (checksums, max ids). Each shard's index is
    checked a block at a time and not kept (:class:`ShardReader`): the readers returned hold
    headers and memory maps, nothing per sentence, whatever the corpus size.
    """
    directory = Path(directory)
    manifest = Manifest.load(directory)
    problems = check_tokenizer(directory, manifest, full=verify)
    readers: list[ShardReader] = []
    for info in manifest.shards:
        try:
            reader = ShardReader(directory / info.name)
        except ShardError as e:
            problems.append(str(e))
            continue
        readers.append(reader)
        found = check_shard(reader, info, manifest)
        if not found and verify:
            try:
                reader.verify()
            except ShardError as e:
                found.append(str(e))
        problems += found
    if problems:
        for r in readers:
            r.close()
        raise ShardError("; ".join(problems))
    return manifest, readers
