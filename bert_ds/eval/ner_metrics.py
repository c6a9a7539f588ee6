"""Entity-level precision, recall and F1 with the semantics of CoNLL's ``conlleval`` script.

A sentence's tags (``B-PER``, ``I-PER``, ``O``, ...) are read into chunks, each a type and a
token span, by conlleval's two rules: where a chunk starts (a ``B``; an ``I`` after ``O`` or
after a chunk of another type; any tag whose type differs from the previous tag's) and where
the previous one ends (before a ``B`` or ``O``; where the type changes). So BIO and IOB1
(``I`` opens a chunk, ``B`` only between two chunks of one type) are read alike, and a stray
``I-LOC`` after ``O`` opens a chunk rather than being dropped. A predicted chunk is correct
where a gold chunk has the same type, start and end; precision is correct over predicted,
recall correct over gold, over all sentences at once (micro), and per type.

The maintained libraries users reach for here (``seqeval``, Hugging Face's ``evaluate``) wrap
these same two rules; seqeval has had no release since 2020 and ships no wheel, so the rules
are written out here, rule for rule (``E-`` tags included, as conlleval reads them), and held
to conlleval's output on hand-made cases in the tests.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

Chunk = tuple[str, int, int]  # (type, first token, last token)


def _split(tag: str) -> tuple[str, str]:
    """``B-PER`` -> (``B``, ``PER``); ``O`` -> (``O``, ``""``)."""
    if tag == "O" or "-" not in tag:
        return tag, ""
    prefix, kind = tag.split("-", 1)
    return prefix, kind


# conlleval's endOfChunk and startOfChunk, rule for rule: (previous tag, tag) pairs, then the type rule.
_END_PAIRS = {("B", "B"), ("B", "O"), ("I", "B"), ("I", "O"), ("E", "E"), ("E", "I"), ("E", "O")}
_START_PAIRS = {("B", "B"), ("I", "B"), ("O", "B"), ("O", "I"), ("E", "E"), ("E", "I"), ("O", "E")}


def _ends(previous: str, previous_kind: str, tag: str, kind: str) -> bool:
    """The previous token closed a chunk before this one."""
    return (previous, tag) in _END_PAIRS or (previous not in ("O", ".") and previous_kind != kind)


def _starts(previous: str, previous_kind: str, tag: str, kind: str) -> bool:
    """This token opens a chunk."""
    return (previous, tag) in _START_PAIRS or (tag not in ("O", ".") and previous_kind != kind)


def chunks(tags: Sequence[str]) -> list[Chunk]:
    """The chunks of one sentence's tags, in order."""
    found: list[Chunk] = []
    previous, previous_kind, start = "O", "", None
    for i, tag in enumerate([*tags, "O"]):  # a final O closes the last chunk
        prefix, kind = _split(tag)
        if start is not None and _ends(previous, previous_kind, prefix, kind):
            found.append((previous_kind, start, i - 1))
            start = None
        if _starts(previous, previous_kind, prefix, kind):
            start = i
        previous, previous_kind = prefix, kind
    return found


def entity_scores(gold: Sequence[Sequence[str]], predicted: Sequence[Sequence[str]]) -> dict:
    """Micro precision, recall and F1 (percent) over all sentences, the per-type figures, and
    the token accuracy conlleval prints beside them."""
    if len(gold) != len(predicted) or any(len(g) != len(p) for g, p in zip(gold, predicted)):
        raise ValueError("gold and predicted tags must have the same sentences and lengths")
    counts = {"gold": Counter(), "predicted": Counter(), "correct": Counter()}
    for g, p in zip(gold, predicted):
        gold_chunks, predicted_chunks = set(chunks(g)), set(chunks(p))
        counts["gold"].update(c[0] for c in gold_chunks)
        counts["predicted"].update(c[0] for c in predicted_chunks)
        counts["correct"].update(c[0] for c in gold_chunks & predicted_chunks)
    tokens = sum(len(g) for g in gold)
    right = sum(a == b for g, p in zip(gold, predicted) for a, b in zip(g, p))
    report = _prf(sum(counts["correct"].values()), sum(counts["predicted"].values()), sum(counts["gold"].values()))
    report["accuracy"] = 100.0 * right / tokens if tokens else 0.0
    report["per_type"] = {kind: {**_prf(counts["correct"][kind], counts["predicted"][kind], counts["gold"][kind]),
                                 "gold": counts["gold"][kind], "predicted": counts["predicted"][kind]}
                          for kind in sorted(set(counts["gold"]) | set(counts["predicted"]))}
    return report


def _prf(correct: int, predicted: int, gold: int) -> dict[str, float]:
    precision = 100.0 * correct / predicted if predicted else 0.0
    recall = 100.0 * correct / gold if gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1}


__all__ = ["chunks", "entity_scores"]
