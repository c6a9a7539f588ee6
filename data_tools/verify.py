"""Check a dataset folder completely (``verify``) and describe it (``inspect``).

``verify`` reports every problem it finds, one line each, naming the file: the
manifest, the tokenizer fingerprint, each shard's header against its manifest entry,
and each shard's full contents (checksums, max token id < vocab size). ``inspect``
opens the dataset the way training does (:func:`bert_ds.data_tools.manifest.open_dataset`) and
summarizes it, optionally decoding the first documents. Both take a parent of parts too
(:func:`bert_ds.data_tools.partition.dataset_folders`): ``verify`` checks that every part is there
and finished, then verifies each; ``inspect`` prints the totals and one line per part.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TextIO

import numpy as np

from bert_ds.base.errors import ShardError
from bert_ds.data_tools.manifest import Manifest, check_shard, check_tokenizer, given_tokenizer, open_dataset
from bert_ds.data_tools.partition import dataset_folders, part_folders
from bert_ds.data_tools.shard_format import ShardReader
from bert_ds.data_tools.sources import input_kind
from bert_ds.data_tools.tokenizer import load_tokenizer


def verify_dataset(directory: str | os.PathLike) -> tuple[list[str], Manifest | None]:
    """Every problem found in DIR (empty when sound), and the manifest if it loaded."""
    directory = Path(directory)
    try:
        manifest = Manifest.load(directory)
    except ShardError as e:
        return [str(e)], None
    problems = check_tokenizer(directory, manifest, full=True)
    for info in manifest.shards:
        try:
            with ShardReader(directory / info.name) as reader:
                found = check_shard(reader, info, manifest)
                if not found:
                    reader.verify()
                problems += found
        except ShardError as e:
            problems.append(str(e))
    return problems, manifest


def verify_parts(path: str | os.PathLike) -> tuple[list[str], list[Manifest]]:
    """:func:`verify_dataset` of a dataset folder, or of every part of a parent (after checking
    they are all there, finished and of one build): the problems, and the manifests."""
    if not part_folders(Path(path)):  # a dataset folder, or no dataset at all: its own first problem
        problems, manifest = verify_dataset(path)
        return problems, [manifest] if manifest is not None else []
    try:
        folders = dataset_folders(path)
    except ShardError as e:
        return [str(e)], []
    problems, manifests = [], []
    for folder in folders:
        found, manifest = verify_dataset(folder)
        problems += found
        if manifest is not None:
            manifests.append(manifest)
    return problems, manifests


def _percentiles(values: np.ndarray, qs=(50, 90, 99)) -> str:
    if values.size == 0:
        return "n/a"
    p = np.percentile(values, qs)
    parts = [f"p{q} {v:.0f}" for q, v in zip(qs, p, strict=True)]
    return ", ".join(parts + [f"max {int(values.max())}", f"mean {values.mean():.1f}"])




def short_documents_warning(tokens_per_doc: float, seq_len: int, build: dict, sources: list[dict]) -> str:
    hint = ""
    # --join-wrapped-lines and --documents shape plain text only: a record or a row is a document already
    plain = any(input_kind(str(s.get("path", ""))) == "text" for s in sources)
    if plain and (build.get("documents", "blank") == "blank" or not build.get("join_wrapped")):
        hint = (" If the text is hard-wrapped or holds one document per file, rebuild with --join-wrapped-lines "
                "and/or --documents file.")
    return (f"warning: documents average {tokens_per_doc:.0f} tokens, fewer than a sequence of {seq_len}: "
            f"samples never cross a document, so most will be short.{hint}")


def _decode(directory: Path, readers: list[ShardReader], decode: int, p, whole: bool = False) -> None:
    """The first ``decode`` documents, a sentence a line; ``whole`` (a --tokenizer's, whose
    tokens hold the text's whitespace): each document decoded at once."""
    tok = load_tokenizer(directory)
    shown = 0
    for r in readers:
        for d in range(r.num_docs):
            if shown == decode:
                return
            sents = r.document(d)
            p(f"\n--- document {shown} ({r.prefix.name} #{d}: {len(sents)} sentences, "
              f"{sum(len(s) for s in sents)} tokens)")
            if whole:
                p(tok.decode(np.concatenate(sents).tolist(), skip_special_tokens=False).rstrip("\n"))
            else:
                for s in sents:
                    p(tok.decode(s.tolist(), skip_special_tokens=False))
            shown += 1


def inspect_documents(directory: Path, decode: int, out: TextIO) -> None:
    """Print the first ``decode`` documents of a dataset folder as text."""
    manifest, readers = open_dataset(directory)
    try:
        _decode(directory, readers, decode, lambda line: print(line, file=out), given_tokenizer(manifest))
    finally:
        for r in readers:
            r.close()


def inspect_dataset(directory: str | os.PathLike, decode: int = 0, out: TextIO | None = None,
                    seq_len: int = 128) -> None:
    """Print the dataset summary; with ``decode`` > 0 also its first documents as text.

    Warns (on stderr) when documents average fewer tokens than ``seq_len``: BERT's samples
    never cross a document, so such a dataset trains mostly on short samples.
    """
    out = out or sys.stdout

    def p(line: str) -> None:
        print(line, file=out)

    directory = Path(directory)
    manifest, readers = open_dataset(directory)
    try:
        m = manifest
        tokens = m.totals["tokens"]
        bin_bytes = sum(s.bin_bytes for s in m.shards)
        idx_bytes = sum(s.idx_bytes for s in m.shards)
        lengths = np.concatenate([r.sentence_lengths for r in readers]) if readers else np.zeros(0)
        per_doc = np.concatenate([np.diff(r.doc_bounds) for r in readers]) if readers else np.zeros(0)
        st = m.stats
        p(f"dataset:     {directory} (manifest v{m.format_version}, {m.created_by})")
        p(f"shards:      {len(m.shards)}" + (f" ({m.shards[0].name} .. {m.shards[-1].name})" if m.shards else ""))
        p(f"documents:   {m.totals['docs']:,}   sentences: {m.totals['sentences']:,}   tokens: {tokens:,}")
        p(f"vocab:       {m.vocab_size:,} ({m.token_dtype}), {'lowercase' if m.lowercase else 'cased'}, "
          f"tokenizer sha256 {m.tokenizer_fingerprint[:16]}")
        p("special:     " + " ".join(f"{k}={v}" for k, v in m.special_tokens.items()))
        p(f"disk:        {bin_bytes + idx_bytes:,} bytes = {(bin_bytes + idx_bytes) / max(tokens, 1):.3f} bytes/token "
          f"(.bin {bin_bytes / max(tokens, 1):.3f}, .idx {idx_bytes / max(tokens, 1):.3f})")
        p(f"sentence length (tokens): {_percentiles(lengths)}")
        p(f"sentences per document:   {_percentiles(per_doc)}")
        if st:
            skipped = st.get("documents_skipped", {})
            p(f"input:       {st.get('documents_in', '?'):,} documents in, {st.get('documents_written', '?'):,} written, "
              f"skipped {skipped}; invalid UTF-8 {st.get('invalid_utf8_replaced')}, NUL {st.get('nul_bytes_removed')}, "
              f"CRLF {st.get('crlf_lines')}, long lines cut {st.get('long_lines_cut')}")
        for s in m.sources:
            p(f"source:      {s.get('path')} ({s.get('bytes', 0):,} bytes, sha256 {str(s.get('sha256'))[:16]})")
        p("build:       " + ", ".join(f"{k}={v}" for k, v in m.build.items() if not k.endswith("_re")))
        if m.totals["docs"] and tokens / m.totals["docs"] < seq_len:
            print(short_documents_warning(tokens / m.totals["docs"], seq_len, m.build, m.sources), file=sys.stderr)
        if decode > 0:
            _decode(directory, readers, decode, p, given_tokenizer(m))
    finally:
        for r in readers:
            r.close()


def inspect_parts(parent: str | os.PathLike, folders: list[Path], decode: int = 0, out: TextIO | None = None,
                  seq_len: int = 128) -> None:
    """Print the totals over the parts of a parent, then one line per part; with ``decode`` > 0
    the first documents, from the first parts on."""
    out = out or sys.stdout
    manifests = [Manifest.load(f) for f in folders]
    m0 = manifests[0]
    docs = sum(m.totals["docs"] for m in manifests)
    tokens = sum(m.totals["tokens"] for m in manifests)
    print(f"dataset:     {parent}: {len(folders)} parts (corpus_key {m0.build['partition']['corpus_key'][:16]})",
          file=out)
    print(f"shards:      {sum(len(m.shards) for m in manifests)}", file=out)
    print(f"documents:   {docs:,}   sentences: {sum(m.totals['sentences'] for m in manifests):,}   "
          f"tokens: {tokens:,}", file=out)
    print(f"vocab:       {m0.vocab_size:,} ({m0.token_dtype}), {'lowercase' if m0.lowercase else 'cased'}, "
          f"tokenizer sha256 {m0.tokenizer_fingerprint[:16]}", file=out)
    for folder, m in zip(folders, manifests, strict=True):
        print(f"part {m.build['partition']['index']}: {folder.name}: {len(m.shards)} shards, "
              f"{m.totals['docs']:,} documents, {m.totals['tokens']:,} tokens, {len(m.sources)} source(s)", file=out)
    if docs and tokens / docs < seq_len:
        print(short_documents_warning(tokens / docs, seq_len, m0.build, m0.sources), file=sys.stderr)
    left = decode
    for folder, m in zip(folders, manifests, strict=True):
        if left <= 0:
            break
        if m.totals["docs"]:
            print(f"\n=== {folder.name}", file=out)
            inspect_documents(folder, min(left, m.totals["docs"]), out)
            left -= m.totals["docs"]
