"""SQuAD's scores, as the official evaluation scripts define them (v1.1 and v2.0).

Both scripts compare a predicted answer text with each gold answer text after the same
normalisation: lower case, punctuation removed (Python's ``string.punctuation``), the
articles "a", "an" and "the" removed as whole words, whitespace collapsed to single spaces.
Then, per question, the best over the gold answers of:

- **exact match**: the normalised texts are equal (1 or 0);
- **F1**: over the normalised texts' whitespace tokens, counted as multisets: precision is the
  shared tokens over the predicted ones, recall over the gold ones.

The two scripts differ in what has no tokens after normalisation. v1.1 has no unanswerable
questions, and an F1 without shared tokens is 0. v2.0 gives unanswerable questions the gold
answer "" and scores an empty prediction against an empty gold answer as a match (1), against
anything else as 0. It also drops gold answers that normalise to nothing (a question left with
none is scored against "" alone), and reports the scores of the answerable (``HasAns``) and
unanswerable (``NoAns``) questions apart. A question is answerable where it has any gold answer,
the script's ``bool(qa['answers'])``, even one whose answers all normalise to nothing ("the"):
such a question counts as answerable in the split, in the threshold search and when "" is
answered above the threshold (it then scores 0, as the script scores it). Given
each question's no-answer probability (the model's null score against its best span), it
reports the threshold that scores best (``best_exact``, ``best_f1`` and their thresholds),
walking the questions in order of that probability as the script does.

Scores are percentages, as the scripts print them.
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces: the scripts' ``normalize_answer``."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact(gold: str, prediction: str) -> int:
    return int(normalize_answer(gold) == normalize_answer(prediction))


def f1(gold: str, prediction: str, *, version: str = "2.0") -> float:
    """Token F1 of one prediction against one gold answer (``version``: whose empty-text rule)."""
    gold_tokens, predicted = normalize_answer(gold).split(), normalize_answer(prediction).split()
    if version == "2.0" and (not gold_tokens or not predicted):
        return float(gold_tokens == predicted)  # no answer against no answer
    shared = sum((collections.Counter(gold_tokens) & collections.Counter(predicted)).values())
    if shared == 0:
        return 0.0
    precision, recall = shared / len(predicted), shared / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


@dataclass(frozen=True)
class Question:
    """What the scores need of one question: its id and gold answer texts (none: unanswerable)."""

    id: str
    answers: tuple[str, ...]


def question_scores(question: Question, prediction: str, version: str) -> tuple[float, float]:
    """(exact, F1) of ``prediction``, each the best over the gold answers (the script's
    ``get_raw_scores``: under v2.0 against "" where none is left once normalised)."""
    golds = list(question.answers)
    if version == "2.0":
        golds = [a for a in golds if normalize_answer(a)] or [""]
    return (max(exact(g, prediction) for g in golds), max(f1(g, prediction, version=version) for g in golds))


def evaluate(questions: Sequence[Question], predictions: Mapping[str, str], *, version: str,
             no_answer_probability: Mapping[str, float] | None = None,
             no_answer_threshold: float = 1.0) -> dict[str, float]:
    """The script's report over ``questions`` (every one needs a prediction; "" is "no answer").

    v1.1: ``exact_match`` and ``f1``. v2.0: ``exact``, ``f1``, ``total``, the ``HasAns_``
    and ``NoAns_`` splits where there are such questions, and, given each question's
    ``no_answer_probability`` (the script's ``--na-prob-file``), the scores with "" answered
    above ``no_answer_threshold`` (its ``--na-prob-thresh``, 1.0 by default), and
    ``best_exact``, ``best_f1`` and their thresholds."""
    if version not in ("1.1", "2.0"):
        raise ValueError(f"SQuAD version must be 1.1 or 2.0, got {version!r}")
    missing = [q.id for q in questions if q.id not in predictions]
    if missing:
        raise ValueError(f"no prediction for {len(missing)} question(s), e.g. {missing[0]!r}")
    raw = {q.id: question_scores(q, predictions[q.id], version) for q in questions}
    if version == "1.1":
        return {"exact_match": _percent(s[0] for s in raw.values()), "f1": _percent(s[1] for s in raw.values())}
    has_answer = {q.id: bool(q.answers) for q in questions}  # the script's make_qid_to_has_ans
    scores = raw
    if no_answer_probability is not None:  # the script's --na-prob-thresh: "" above it
        scores = {q: (float(not has_answer[q]),) * 2 if no_answer_probability[q] > no_answer_threshold else s
                  for q, s in raw.items()}
    report = _split_report(questions, scores, "")
    for name, has in (("HasAns", True), ("NoAns", False)):
        part = [q for q in questions if has_answer[q.id] is has]
        if part:
            report.update(_split_report(part, scores, name + "_"))
    if no_answer_probability is not None:
        for i, metric in enumerate(("exact", "f1")):
            best, threshold = best_threshold({q: s[i] for q, s in raw.items()}, predictions,
                                             no_answer_probability, has_answer)
            report[f"best_{metric}"], report[f"best_{metric}_thresh"] = best, threshold
    return report


def best_threshold(scores: Mapping[str, float], predictions: Mapping[str, str],
                   no_answer_probability: Mapping[str, float], has_answer: Mapping[str, bool]) -> tuple[float, float]:
    """The script's ``find_best_thresh``: the no-answer threshold that scores best over all
    questions, and that score (a percentage). Above the threshold a question is answered with
    "" (right for the unanswerable ones); at or below it, with its prediction."""
    score = best = sum(not has for has in has_answer.values())  # every question answered ""
    threshold = 0.0
    # the script's order: by probability, ties in the order the probabilities were given
    for qid in sorted(no_answer_probability, key=lambda q: no_answer_probability[q]):
        if qid not in scores:
            continue
        if has_answer[qid]:
            score += scores[qid]
        elif predictions[qid]:
            score -= 1
        if score > best:
            best, threshold = score, no_answer_probability[qid]
    return 100.0 * best / len(scores), threshold


def _split_report(questions: Sequence[Question], scores: Mapping[str, tuple[float, float]],
                  prefix: str) -> dict[str, float]:
    part = [scores[q.id] for q in questions]
    return {f"{prefix}exact": _percent(s[0] for s in part), f"{prefix}f1": _percent(s[1] for s in part),
            f"{prefix}total": len(part)}


def _percent(values) -> float:
    values = list(values)
    return 100.0 * sum(values) / len(values) if values else 0.0


__all__ = ["Question", "best_threshold", "evaluate", "exact", "f1", "normalize_answer", "question_scores"]
