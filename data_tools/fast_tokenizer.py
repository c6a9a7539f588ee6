"""Any Hugging Face fast tokenizer (``build --tokenizer PATH``), kept as it is.

:mod:`bert_ds.data_tools.tokenizer` makes BERT's WordPiece tokenizer from a vocabulary
(``--train-vocab``, ``--vocab``). This module takes a whole ``tokenizer.json`` instead, of any
model (BPE, Unigram, WordLevel, WordPiece): ModernBERT's byte-level BPE (50,368 ids), mmBERT's
(~256k ids, stored as uint32), or any other.

Design choices:

* Kept as it is: ``tokenizer.json`` is copied byte for byte into the dataset folder and is what
  encodes the shards (its truncation and padding settings, which act on whole inputs, are
  switched off while encoding). ``tokenizer_config.json`` and ``special_tokens_map.json`` are
  copied byte for byte where they name every special token and the tokenizer's class; where they
  do not, the tokens the flags named (and ``PreTrainedTokenizerFast`` as the class) are added, so
  that ``AutoTokenizer.from_pretrained(DIR)`` gives the shards' ids and knows the mask token. The
  install loads the folder with ``AutoTokenizer`` and checks both before a shard is written.
* Special tokens: the five a sample needs (cls, sep, pad, mask, unk) are named by the
  tokenizer's config (``cls_token``, ..., in ``tokenizer_config.json``, else in
  ``special_tokens_map.json``); ``--special-token KIND=TOKEN`` names those the config does not,
  and one that disagrees with the config is refused (it would give an id another meaning than
  the model it belongs to gives it). Each must be in the vocabulary, and cls, sep, pad and mask
  must differ. A tokenizer without a mask token is refused: no masked-language-model sample can
  be made with it.
* The fingerprint (the manifest's ``tokenizer_fingerprint``, what training matches folders and
  held-out sets by) is the SHA-256 of the vocabulary, every id's token with the added tokens,
  and the five special ids, as canonical JSON (:func:`vocabulary_fingerprint`), not of
  ``tokenizer.json``'s bytes. What a model's embedding rows mean is the id-to-token map and
  which ids are special: two copies of one tokenizer saved by different transformers versions
  (another key order or indentation, other flags on an added token) match, while another
  vocabulary, or the same one with another mask id, does not. Merges and the normalizer are not
  in it, as the WordPiece fingerprint (``vocab.txt``) leaves the normalizer out: they change
  how text is cut, not what an id means. The exact file is still held to: the manifest records
  the SHA-256 of ``tokenizer.json`` (``build.tokenizer_sha256``), which opening a dataset checks
  against the folder's file, and a rerun's plan key (:meth:`FastTokenizer.key`) covers it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from bert_ds.base.atomic import write_synced
from bert_ds.base.errors import UserError
from bert_ds.data_tools.shard_format import MAX_VOCAB_SIZE
from bert_ds.data_tools.tokenizer import SPECIAL_TOKENS, TokenizerSpec, replace_files

KINDS = tuple(SPECIAL_TOKENS)  # pad, unk, cls, sep, mask: what a sample needs
DISTINCT = ("cls", "sep", "pad", "mask")  # must be four different ids
CONFIG_NAME, MAP_NAME = "tokenizer_config.json", "special_tokens_map.json"
FILES = ("tokenizer.json", CONFIG_NAME, MAP_NAME)
DEFAULT_CLASS = "PreTrainedTokenizerFast"  # what transformers 4 and 5 load a bare tokenizer.json as
# What the install encodes with both libraries: accents, CJK, an emoji, a newline and indentation
_PROBE = "Pre-training data, 2026: Äpfel, straße, 東京, 🙂.\n  An indented line, 3.14 [x]"


def vocabulary_fingerprint(vocab: dict[str, int], special_ids: dict[str, int]) -> str:
    """SHA-256 hex of the id-to-token map (``vocab``: token -> id, added tokens included) and
    the special ids, as canonical JSON: the identity of a ``--tokenizer`` dataset's tokenizer."""
    doc = {"vocabulary": sorted([i, t] for t, i in vocab.items()),
           "special_tokens": {k: special_ids[k] for k in KINDS}}
    return hashlib.sha256(json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()).hexdigest()


def file_fingerprint(tokenizer_json: str, special_ids: dict[str, int]) -> tuple[str, int]:
    """(:func:`vocabulary_fingerprint`, vocabulary size) of a tokenizer.json's text."""
    tok = _parse(tokenizer_json, "tokenizer.json")
    vocab = tok.get_vocab(with_added_tokens=True)
    return vocabulary_fingerprint(vocab, special_ids), max(vocab.values(), default=-1) + 1


def _parse(text: str, where: object):
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_str(text)
    except Exception as e:  # the Rust side raises plain Exception for any parse error
        raise UserError(f"{where}: not a tokenizers tokenizer.json: {str(e).splitlines()[0]}") from None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"{path}: unreadable ({e})") from None
    if not isinstance(found, dict):
        raise UserError(f"{path}: not a JSON object")
    return found


def _token_name(value: object) -> str | None:
    """A special token as a config names it: a string, or an AddedToken's {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


@dataclass(frozen=True)
class FastTokenizer:
    """A tokenizer given with ``--tokenizer``: its files and what the build needs of them."""

    path: str  # as given
    tokenizer_json: bytes  # the file, byte for byte
    special: dict[str, str]  # kind -> token
    special_ids: dict[str, int]  # kind -> id
    vocab_size: int  # the largest id + 1
    fingerprint: str  # vocabulary_fingerprint
    lowercase: bool  # its normalizer lowercases
    normalizer: dict | None  # tokenizer.json's normalizer entry
    configs: dict[str, bytes | None] = field(default_factory=dict)  # CONFIG_NAME, MAP_NAME as given (None: absent)

    @property
    def sha256(self) -> str:
        """SHA-256 hex of tokenizer.json's bytes: the manifest's ``build.tokenizer_sha256``."""
        return hashlib.sha256(self.tokenizer_json).hexdigest()

    def key(self) -> dict:
        """What a build's plan key takes of this tokenizer: everything that shapes the shards."""
        return {"tokenizer": self.fingerprint, "tokenizer_sha256": self.sha256, "special_tokens": self.special_ids}

    def install(self, directory: str | os.PathLike) -> TokenizerSpec:
        """Write the tokenizer files into DIR, each atomically, after checking that transformers
        loads them as the shards will be encoded."""
        directory = Path(directory)
        replace_files(directory, self._write, FILES)
        # A WordPiece vocabulary left by another build (--overwrite) is not this tokenizer's.
        (directory / "vocab.txt").unlink(missing_ok=True)
        return TokenizerSpec(tokenizer_json=self.tokenizer_json.decode("utf-8"), vocab_size=self.vocab_size,
                             special_tokens=dict(self.special_ids), fingerprint=self.fingerprint,
                             lowercase=self.lowercase, normalizer=self.normalizer, text=True)

    def _write(self, tmp: Path) -> None:
        tmp.mkdir(parents=True)
        write_synced(tmp / "tokenizer.json", self.tokenizer_json)
        names = {f"{k}_token": v for k, v in self.special.items()}
        for name, extra in ((CONFIG_NAME, {"tokenizer_class": DEFAULT_CLASS, **names}), (MAP_NAME, names)):
            given = self.configs.get(name)
            settings = json.loads(given) if given is not None else {}
            missing = {k: v for k, v in extra.items() if _token_name(settings.get(k)) is None}
            data = given if given is not None and not missing else \
                (json.dumps({**settings, **missing}, indent=2, ensure_ascii=False, sort_keys=True) + "\n").encode()
            write_synced(tmp / name, data)
        self._check_transformers(tmp)

    def _check_transformers(self, folder: Path) -> None:
        """AutoTokenizer loads ``folder`` with these special ids and encodes as tokenizers does."""
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(str(folder))
        except Exception as e:  # transformers raises many kinds for files it cannot use
            raise UserError(f"{self.path}: transformers' AutoTokenizer cannot load this tokenizer's files "
                            f"({' '.join(str(e).split())[:200]})") from None
        ids = {k: getattr(hf, f"{k}_token_id", None) for k in KINDS}
        if ids != self.special_ids:
            raise UserError(f"{self.path}: AutoTokenizer reads the special ids {ids}, tokenizer.json has "
                            f"{self.special_ids}: the dataset folder would not reproduce them")
        theirs = hf(_PROBE, add_special_tokens=False)["input_ids"]
        ours = _parse(self.tokenizer_json.decode("utf-8"), self.path).encode(_PROBE, add_special_tokens=False).ids
        if theirs != ours:
            raise UserError(f"{self.path}: AutoTokenizer encodes differently from tokenizer.json ({theirs[:8]} "
                            f"against {ours[:8]}): the dataset folder would not reproduce the shards' ids")


def load_fast_tokenizer(path: str, flags: dict[str, str] | None = None) -> FastTokenizer:
    """The tokenizer of a folder holding ``tokenizer.json`` (a Hugging Face tokenizer or model
    folder, or a dataset folder built with ``--tokenizer``), or of a ``tokenizer.json``; ``flags``:
    the special tokens ``--special-token`` names (kind -> token). UserError on anything unusable."""
    source = Path(path)
    file = source / "tokenizer.json" if source.is_dir() else source
    if not file.is_file():
        hint = ("; a WordPiece vocab.txt is given with --vocab" if (source / "vocab.txt").is_file()
                else "")
        raise UserError(f"{path}: no tokenizer.json (a Hugging Face fast tokenizer){hint}")
    try:
        data = file.read_bytes()
        text = data.decode("utf-8")
    except OSError as e:
        raise UserError(f"{file}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    tok = _parse(text, file)
    # The configs that go with it: beside a tokenizer.json of that name (a folder's)
    folder = file.parent if file.name == "tokenizer.json" else None
    configs = {name: (folder / name).read_bytes() if folder and (folder / name).is_file() else None
               for name in (CONFIG_NAME, MAP_NAME)}
    settings = [(_read_json(folder / name) if folder else {}, name) for name in (CONFIG_NAME, MAP_NAME)]
    special = _special_tokens(path, settings, dict(flags or {}))
    ids = {k: tok.token_to_id(t) for k, t in special.items()}
    for kind, i in ids.items():
        if i is None:
            raise UserError(f"{path}: the {kind} token {special[kind]!r} is not in the tokenizer's vocabulary")
    same = [k for k in DISTINCT if [ids[j] for j in DISTINCT].count(ids[k]) > 1]
    if same:
        raise UserError(f"{path}: the {', '.join(same)} tokens share an id; a sample needs four different ones")
    vocab = tok.get_vocab(with_added_tokens=True)
    size = max(vocab.values()) + 1
    if size > MAX_VOCAB_SIZE:
        raise UserError(f"{path}: {size} ids do not fit the shards' uint32 tokens")
    lowercase = tok.normalizer is not None and tok.normalizer.normalize_str("A") == "a"
    return FastTokenizer(path=path, tokenizer_json=data, special=special, special_ids=ids, vocab_size=size,
                         fingerprint=vocabulary_fingerprint(vocab, ids), lowercase=lowercase,
                         normalizer=json.loads(text).get("normalizer"), configs=configs)


def _special_tokens(path: str, settings: list[tuple[dict, str]], flags: dict[str, str]) -> dict[str, str]:
    """kind -> token: from the configs where they name it, else from the flags."""
    unknown = sorted(set(flags) - set(KINDS))
    if unknown:
        raise UserError(f"--special-token {unknown[0]}=...: the kinds are {', '.join(KINDS)}")
    special, missing = {}, []
    for kind in KINDS:
        named = next(((_token_name(s.get(f"{kind}_token")), name) for s, name in settings
                      if _token_name(s.get(f"{kind}_token")) is not None), (None, None))
        flag = flags.get(kind)
        if named[0] is not None and flag is not None and flag != named[0]:
            raise UserError(f"{path}: its {named[1]} names {kind}_token {named[0]!r}; --special-token "
                            f"{kind}={flag} would give the id another meaning: drop the flag")
        if named[0] is None and flag is None:
            missing.append(kind)
        special[kind] = named[0] if named[0] is not None else flag
    if missing:
        what = " and ".join(f"no {k} token" for k in missing)
        why = " (masked-language-model samples need one)" if "mask" in missing else ""
        flags_hint = " ".join(f"--special-token {k}=TOKEN" for k in missing)
        raise UserError(f"{path}: the tokenizer has {what}{why}: its config names none; name a token of its "
                        f"vocabulary with {flags_hint}")
    return special
