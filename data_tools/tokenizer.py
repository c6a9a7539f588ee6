"""The WordPiece tokenizer of a dataset: train or load a vocabulary, write the HF files.

A dataset folder holds its tokenizer in Hugging Face form, made by
``transformers.BertTokenizerFast`` from the vocabulary and ``save_pretrained``:
``vocab.txt``, ``tokenizer.json``, ``tokenizer_config.json`` and
``special_tokens_map.json`` (transformers 5 writes neither vocab.txt nor the special
tokens map, so we write both). The build encodes with exactly that
``tokenizer.json``, so ``BertTokenizerFast.from_pretrained(DIR)`` reproduces the
shards' ids. A tokenizer given whole with ``--tokenizer`` (a BPE, any ``tokenizer.json``) is
:mod:`bert_ds.data_tools.fast_tokenizer`'s; both give the build a :class:`TokenizerSpec`.

Design choices:

* The fingerprint of a tokenizer is the sha256 of its ``vocab.txt`` bytes. A vocabulary
  given with ``--vocab vocab.txt`` is copied byte for byte (only CRLF line ends and a
  missing final newline are normalized), so a held-out set built with the training
  set's vocab.txt carries the same fingerprint.
* Training is deterministic. The tokenizers WordPiece trainer breaks ties between
  equally frequent pairs by token id, and it numbers the ``##x`` continuation tokens
  in hash-map order, which changes from process to process, so two runs give
  different vocabularies. We count the alphabet ourselves (normalized characters, the
  ``limit_alphabet`` most frequent, ties by code point) and pass the ``##x`` tokens in
  code-point order as trainer special tokens after the five real ones: every initial
  id is then fixed, and so is every merge. ids: [PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3
  [MASK]=4, then ``##x``, then the single characters, then merges.
* The alphabet takes at most a quarter of the requested size (each character costs two
  entries, ``x`` and ``##x``), capped at 1000 as in BERT.
* A tokenizer given with ``--vocab`` is kept as given: its vocabulary, and its
  normalizer (case, accents, Chinese-character handling) exactly, read from its
  ``tokenizer.json`` or, beside a ``vocab.txt``, from its ``tokenizer_config.json``
  (:func:`load_vocabulary`). Adapting a cased model must never quietly lowercase. Only a
  bare ``vocab.txt`` says nothing of case: it is cased exactly when it holds cased
  tokens (an uncased vocabulary has none), unless ``--[no-]lowercase`` says otherwise.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from bert_ds.base.atomic import fsync_path, write_synced
from bert_ds.base.errors import UserError

SPECIAL_TOKENS = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}
HF_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
LIMIT_ALPHABET = 1000
MIN_FREQUENCY = 2
MIN_VOCAB_SIZE = 64
_TMP_DIR = ".tokenizer.tmp"


@dataclass(frozen=True)
class Normalization:
    """BERT's normalizer (tokenizers' BertNormalizer): what a dataset's text goes through."""

    lowercase: bool
    strip_accents: bool | None = None  # None: strip exactly when lowercasing (BERT's rule)
    handle_chinese_chars: bool = True  # a space around every CJK ideograph
    clean_text: bool = True  # control characters removed, whitespace made spaces

    def to_json(self) -> dict:
        """tokenizer.json's ``normalizer`` entry for these settings."""
        return {"type": "BertNormalizer", "clean_text": self.clean_text,
                "handle_chinese_chars": self.handle_chinese_chars, "strip_accents": self.strip_accents,
                "lowercase": self.lowercase}

    @classmethod
    def from_json(cls, entry: object, where: str) -> Normalization:
        if not isinstance(entry, dict) or entry.get("type") != "BertNormalizer":
            kind = entry.get("type") if isinstance(entry, dict) else entry
            raise UserError(f"{where}: its normalizer is {kind!r}; a BERT tokenizer has a BertNormalizer")
        return cls(lowercase=bool(entry.get("lowercase", True)), strip_accents=entry.get("strip_accents"),
                   handle_chinese_chars=bool(entry.get("handle_chinese_chars", True)),
                   clean_text=bool(entry.get("clean_text", True)))


@dataclass(frozen=True)
class TokenizerSpec:
    """What the build needs to know of the tokenizer installed in a dataset folder."""

    tokenizer_json: str  # the folder's tokenizer.json text: what encodes the shards
    vocab_size: int  # ids are 0 .. vocab_size - 1 (WordPiece: the vocab.txt entries)
    special_tokens: dict[str, int]  # {"pad": 0, ...}
    fingerprint: str  # WordPiece: sha256 hex of vocab.txt; --tokenizer: :func:`vocabulary_fingerprint`
    lowercase: bool  # the normalizer lowercases
    normalizer: dict | None  # tokenizer.json's normalizer entry
    text: bool = False  # --tokenizer: lines are encoded as text, whitespace kept (build.py's _Tokenize)


def vocab_entries(vocab: bytes) -> list[str]:
    """Tokens of a vocab.txt by id (line number), as WordPiece reads the file."""
    text = vocab.decode("utf-8")
    lines = text.split("\n") if text else []
    if text.endswith("\n"):
        lines.pop()
    return [line.rstrip("\r") for line in lines]


def load_vocabulary(path: str) -> tuple[bytes, Normalization | None]:
    """(vocab.txt bytes, the normalizer) of a Hugging Face tokenizer folder, a WordPiece
    ``tokenizer.json`` or a ``vocab.txt``; the normalizer is None only for a bare vocab.txt
    (no ``tokenizer_config.json`` beside it)."""
    source = Path(path)
    if source.is_dir():
        for name in ("tokenizer.json", "vocab.txt"):
            if (source / name).is_file():
                return load_vocabulary(str(source / name))
        raise UserError(f"{path}: a tokenizer folder holds tokenizer.json or vocab.txt; this one holds neither")
    vocab = read_vocab(path)
    if path.endswith(".json"):
        entry = json.loads(Path(path).read_text(encoding="utf-8")).get("normalizer")
        return vocab, Normalization.from_json(entry, path)
    config = source.with_name("tokenizer_config.json")
    if not config.is_file():
        return vocab, None
    try:
        settings = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"{config}: unreadable ({e})") from None
    lowercase = bool(settings.get("do_lower_case", True))
    return vocab, Normalization(lowercase=lowercase, strip_accents=settings.get("strip_accents"),
                                handle_chinese_chars=bool(settings.get("tokenize_chinese_chars", True)))


def holds_cased_tokens(vocab: bytes) -> bool:
    """Whether a vocabulary has tokens with upper-case letters (besides the special ones):
    an uncased vocabulary has none, and lowercasing would make them unreachable."""
    special = set(SPECIAL_TOKENS.values())
    return any(t not in special and t != t.lower() for t in vocab_entries(vocab))


def read_vocab(path: str) -> bytes:
    """vocab.txt content from a vocab.txt, or built from a WordPiece tokenizer.json
    (the vocabulary only: :func:`load_vocabulary` also reads the normalizer)."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise UserError(f"vocabulary not found: {path}") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read: {e.strerror}") from None
    if path.endswith(".json"):
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # the Rust side raises plain Exception for any parse error
            raise UserError(f"{path}: not a tokenizers tokenizer.json: {str(e).splitlines()[0]}") from None
        if type(tok.model).__name__ != "WordPiece":
            raise UserError(f"{path}: model is {type(tok.model).__name__}, BERT needs WordPiece")
        vocab = tok.get_vocab(with_added_tokens=False)
        by_id = sorted(vocab, key=vocab.__getitem__)
        if [vocab[t] for t in by_id] != list(range(len(by_id))):
            raise UserError(f"{path}: vocabulary ids are not 0 .. {len(by_id) - 1} without gaps")
        data = ("\n".join(by_id) + "\n").encode("utf-8")
    try:
        entries = vocab_entries(data)
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    seen: dict[str, int] = {}
    for i, token in enumerate(entries):
        if not token.strip():
            raise UserError(f"{path}: entry {i} (line {i + 1}) is empty")
        if token in seen:
            raise UserError(f"{path}: {token!r} appears twice (lines {seen[token] + 1} and {i + 1})")
        seen[token] = i
    missing = [t for t in SPECIAL_TOKENS.values() if t not in seen]
    if missing:
        raise UserError(f"{path}: the vocabulary lacks the special token(s) {', '.join(missing)}")
    # One token per line, LF ends: transformers reads a CRLF file with "\r" in every
    # token. A file already in this form is kept byte for byte (same fingerprint).
    return ("\n".join(entries) + "\n").encode("utf-8")


def _alphabet(lines: Iterable[str], lowercase: bool, limit: int) -> list[str]:
    """The ``limit`` most frequent normalized characters, in code-point order."""
    from tokenizers.normalizers import BertNormalizer

    raw: Counter[str] = Counter()
    for line in lines:
        raw.update(line)
    norm = BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lowercase)
    counts: Counter[str] = Counter()
    for ch, n in raw.items():
        # Normalizing a character alone misses context rules (a final sigma lowercases
        # to ς only after a letter), so normalize it after a letter too.
        for out in set(norm.normalize_str(ch)) | set(norm.normalize_str("a" + ch)[1:]):
            if not out.isspace():
                counts[out] += n
    top = sorted(counts, key=lambda c: (-counts[c], c))[:limit]
    return sorted(top)


def train_vocab(lines: Callable[[], Iterable[str]], size: int, lowercase: bool) -> bytes:
    """Train a WordPiece vocabulary of at most ``size`` entries; vocab.txt bytes.

    ``lines`` returns a fresh iterator over the training text each call (two passes).
    """
    from tokenizers.implementations import BertWordPieceTokenizer

    if size < MIN_VOCAB_SIZE:
        raise UserError(f"--train-vocab {size} is too small (at least {MIN_VOCAB_SIZE})")
    alphabet = _alphabet(lines(), lowercase, min(LIMIT_ALPHABET, (size - len(SPECIAL_TOKENS)) // 4))
    if not alphabet:
        raise UserError("cannot train a vocabulary: the inputs hold no text")
    tok = BertWordPieceTokenizer(clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lowercase)
    tok.train_from_iterator(
        lines(),
        vocab_size=size,
        min_frequency=MIN_FREQUENCY,
        limit_alphabet=len(alphabet),
        initial_alphabet=alphabet,
        special_tokens=list(SPECIAL_TOKENS.values()) + ["##" + c for c in alphabet],
        show_progress=False,
        wordpieces_prefix="##",
    )
    vocab = tok.get_vocab()
    by_id = sorted(vocab, key=vocab.__getitem__)
    return ("\n".join(by_id) + "\n").encode("utf-8")


def vocab_fingerprint(vocab: bytes) -> str:
    """The identity of a vocabulary: what shards and models are matched by."""
    return hashlib.sha256(vocab).hexdigest()


def install_tokenizer(directory: str | os.PathLike, vocab: bytes, normalization: Normalization) -> TokenizerSpec:
    """Write the HF tokenizer files for ``vocab`` into DIR, each atomically."""
    from tokenizers import Tokenizer

    directory = Path(directory)
    replace_files(directory, lambda tmp: _write_hf_files(tmp, vocab, normalization), HF_FILES)
    tokenizer_json = (directory / "tokenizer.json").read_text(encoding="utf-8")
    tok = Tokenizer.from_str(tokenizer_json)
    special = {k: tok.token_to_id(v) for k, v in SPECIAL_TOKENS.items()}
    return TokenizerSpec(
        tokenizer_json=tokenizer_json,
        vocab_size=len(vocab_entries(vocab)),
        special_tokens=special,
        fingerprint=vocab_fingerprint(vocab),
        lowercase=normalization.lowercase,
        normalizer=normalization.to_json(),
    )


def replace_files(directory: Path, write: Callable[[Path], None], names: Iterable[str]) -> None:
    """The files ``names`` that ``write`` makes in a new temporary folder, moved into DIR one by
    one, each synced and renamed: a final name only ever holds a whole file."""
    tmp = directory / _TMP_DIR
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
        for name in names:
            fsync_path(tmp / name)
            os.replace(tmp / name, directory / name)
        fsync_path(directory)
    finally:  # a failed write (disk full) leaves no temporary folder; final names are whole files
        shutil.rmtree(tmp, ignore_errors=True)


def _write_hf_files(tmp: Path, vocab: bytes, normalization: Normalization) -> None:
    """The HF tokenizer files for ``vocab`` in a new folder ``tmp``."""
    from transformers import BertTokenizerFast

    tmp.mkdir(parents=True)
    write_synced(tmp / "vocab.txt", vocab)
    # from_pretrained on a folder holding only vocab.txt builds the fast tokenizer the
    # same way in transformers 4 and 5 (5 ignores a vocab_file= constructor argument).
    hf = BertTokenizerFast.from_pretrained(str(tmp), do_lower_case=normalization.lowercase,
                                           strip_accents=normalization.strip_accents,
                                           tokenize_chinese_chars=normalization.handle_chinese_chars)
    expected = {t: i for i, t in enumerate(vocab_entries(vocab))}
    if hf.get_vocab() != expected:
        raise RuntimeError(f"transformers built a tokenizer of {len(hf.get_vocab())} entries from a "
                           f"vocab.txt of {len(expected)}: the HF files would not match the shards")
    hf.save_pretrained(str(tmp))
    # The normalizer exactly as given (transformers' constructor has no clean_text switch).
    tokenizer_json = json.loads((tmp / "tokenizer.json").read_text(encoding="utf-8"))
    if tokenizer_json.get("normalizer") != normalization.to_json():
        tokenizer_json["normalizer"] = normalization.to_json()
        write_synced(tmp / "tokenizer.json", json.dumps(tokenizer_json, ensure_ascii=False, indent=2).encode())
    # Older transformers rewrite vocab.txt from their dict; keep the exact input bytes.
    write_synced(tmp / "vocab.txt", vocab)
    if not (tmp / "special_tokens_map.json").exists():
        smap = {f"{k}_token": v for k, v in sorted(SPECIAL_TOKENS.items())}
        write_synced(tmp / "special_tokens_map.json", (json.dumps(smap, indent=2, sort_keys=True) + "\n").encode())


def load_tokenizer(directory: str | os.PathLike):
    """The dataset's fast tokenizer (``tokenizers.Tokenizer``) from DIR/tokenizer.json."""
    from tokenizers import Tokenizer

    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"{path}: missing (the dataset's tokenizer)")
    return Tokenizer.from_file(str(path))


def write_tokenizer_folder(folder: str | os.PathLike, vocab: bytes, normalization: Normalization) -> None:
    """The HF tokenizer files for ``vocab`` in a new folder (made here, synced; the caller renames it)."""
    folder = Path(folder)
    _write_hf_files(folder, vocab, normalization)
    for name in HF_FILES:
        fsync_path(folder / name)
