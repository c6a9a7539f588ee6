"""SQuAD's contexts cut into windows the model reads, and its span scores back into answers.

**Windows**, as Hugging Face's ``run_qa.py`` makes them: the question and the context as the
tokenizer pairs them (BERT's and ModernBERT's ``[CLS] question [SEP] context [SEP]``; its own
special tokens, however many, for another) in at most ``max_seq_length`` tokens (384), the
context cut by the fast tokenizer into windows that overlap by ``doc_stride`` tokens (128), each
token with its character offsets in the context. A question longer than ``max_query_length``
tokens (64) keeps its first 64, as BERT's ``run_squad.py`` does; one that still leaves no room
for the special tokens and ``doc_stride`` context tokens is refused. A training window's labels
are the answer's first and last token where the whole answer lies inside the window, else the
first token (``[CLS]``, position 0), as for an unanswerable question. Only the first answer of
a training question is a label (the training sets hold one).

**Answers**: for each question, over all its windows, the ``n_best`` highest start and end
scores are paired (the end not before the start, at most ``max_answer_length`` tokens, both
inside the context) and the best pair's text is cut from the context by the offsets. Where no
such pair is among a window's top scores (an untrained head may rank only the question's tokens
high), every pair of its context tokens is searched, so every question has a best span and a
finite no-answer score. The null answer (the first token) scores ``start[0] + end[0]``, its
lowest over the windows. For SQuAD v2.0 the question is answered "" where the null score exceeds
the best span's by more than the threshold (0 by default, BERT's), and the difference is the
question's no-answer score, the ``na_prob`` the official script searches its best threshold over
(:mod:`bert_ds.eval.squad_metrics`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bert_ds.base.errors import UserError
from bert_ds.eval.squad_data import SquadExample


@dataclass(frozen=True)
class Windows:
    """The model's inputs for a list of questions, one row per window."""

    features: list[dict[str, Any]]  # input_ids, token_type_ids, attention_mask (and labels for training);
    # a model whose forward takes no token_type_ids is given the others (finetune.model_inputs)
    example_of: list[int]  # the question each window belongs to
    offsets: list[list[tuple[int, int] | None]]  # per window and token: its characters in the context, or None
    questions_cut: int = 0  # questions longer than max_query_length tokens, cut to it


def make_windows(tokenizer, examples: Sequence[SquadExample], max_seq_length: int = 384, doc_stride: int = 128,
                 *, labels: bool, max_query_length: int = 64, source: object = "SQuAD") -> Windows:
    """``examples`` cut into windows; ``labels``: with each window's answer positions (training);
    ``source``: the file the examples came from, for an error."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("SQuAD's windows need a fast tokenizer (its character offsets); this model folder has a "
                         f"{type(tokenizer).__name__}")
    questions, cut = _questions(tokenizer, examples, max_query_length, max_seq_length, doc_stride, source)
    encoded = tokenizer(questions, [e.context for e in examples],
                        truncation="only_second", max_length=max_seq_length, stride=doc_stride,
                        return_overflowing_tokens=True, return_offsets_mapping=True, return_token_type_ids=True,
                        padding=False)
    example_of = list(encoded["overflow_to_sample_mapping"])
    features, offsets = [], []
    for w, example in enumerate(example_of):
        sequence_ids = encoded.sequence_ids(w)
        window_offsets = [tuple(o) if s == 1 else None for o, s in zip(encoded["offset_mapping"][w], sequence_ids)]
        feature = {key: encoded[key][w] for key in ("input_ids", "token_type_ids", "attention_mask")}
        if labels:
            feature["start_positions"], feature["end_positions"] = _answer_tokens(examples[example], window_offsets)
        features.append(feature)
        offsets.append(window_offsets)
    return Windows(features, example_of, offsets, cut)


def _questions(tokenizer, examples: Sequence[SquadExample], max_query_length: int, max_seq_length: int,
               doc_stride: int, source: object) -> tuple[list[str], int]:
    """Each question as the windows hold it: at most ``max_query_length`` tokens, cut after its
    last whole token; and how many were cut. A question that fills the window less the pair's
    special tokens and the stride would leave no context to move on by: refused."""
    specials = tokenizer.num_special_tokens_to_add(pair=True)
    room = max_seq_length - specials - doc_stride
    texts = [e.question.lstrip() for e in examples]
    encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    out, cut = [], 0
    for example, text, offsets in zip(examples, texts, encoded["offset_mapping"]):
        if len(offsets) > max_query_length:
            text, offsets, cut = text[:offsets[max_query_length - 1][1]], offsets[:max_query_length], cut + 1
        if len(offsets) >= room:
            raise UserError(f"{source}: question {example.id!r}: its {len(offsets)} tokens, the {specials} special "
                            f"tokens of a question and context pair and the {doc_stride} tokens of --doc-stride fill "
                            f"the window of {max_seq_length}; lower --max-query-length or --doc-stride, or raise "
                            "--max-seq-length")
        out.append(text)
    return out, cut


def _answer_tokens(example: SquadExample, offsets: list[tuple[int, int] | None]) -> tuple[int, int]:
    """The first answer's first and last token in this window; (0, 0) where it is not wholly in it."""
    if not example.answers:
        return 0, 0
    first, last = example.answers[0].start, example.answers[0].start + len(example.answers[0].text)
    inside = [i for i, o in enumerate(offsets) if o is not None]
    if offsets[inside[0]][0] > first or offsets[inside[-1]][1] < last:
        return 0, 0
    start = next(i for i in inside if offsets[i][1] > first)  # the token holding the first character
    end = next(i for i in reversed(inside) if offsets[i][0] < last)  # the token holding the last one
    return start, end


@dataclass(frozen=True)
class Predictions:
    answers: dict[str, str]  # question id -> answer text ("" for no answer)
    no_answer_score: dict[str, float]  # question id -> null score minus the best span's


def predict_answers(examples: Sequence[SquadExample], windows: Windows, start_logits: np.ndarray,
                    end_logits: np.ndarray, *, version: str, n_best: int = 20, max_answer_length: int = 30,
                    null_threshold: float = 0.0) -> Predictions:
    """The answer of every question from its windows' scores (rows of ``*_logits``, padded)."""
    best: dict[int, tuple[float, str]] = {}
    null: dict[int, float] = {}
    for w, example in enumerate(windows.example_of):
        starts, ends, offsets = start_logits[w], end_logits[w], windows.offsets[w]
        null[example] = min(null.get(example, np.inf), float(starts[0] + ends[0]))
        span = _best_span(starts[:len(offsets)], ends[:len(offsets)], offsets, n_best, max_answer_length)
        if span is not None and (example not in best or span[0] > best[example][0]):
            s, e = span[1:]
            best[example] = (span[0], examples[example].context[offsets[s][0]:offsets[e][1]])
    answers, no_answer = {}, {}
    for i, example in enumerate(examples):
        span_score, text = best.get(i, (-np.inf, ""))
        difference = null.get(i, np.inf) - span_score
        answers[example.id] = "" if version == "2.0" and difference > null_threshold else text
        no_answer[example.id] = difference
    return Predictions(answers, no_answer)


def _best_span(starts: np.ndarray, ends: np.ndarray, offsets: list[tuple[int, int] | None], n_best: int,
               max_answer_length: int) -> tuple[float, int, int] | None:
    """(score, first token, last token) of a window's best answer: among its ``n_best`` top start
    and end scores, else among all its context tokens; None where it holds no context token."""
    top_starts, top_ends = np.argsort(starts)[::-1][:n_best], np.argsort(ends)[::-1][:n_best]
    found = None
    for s in top_starts:
        for e in top_ends:
            if offsets[s] is None or offsets[e] is None or e < s or e - s + 1 > max_answer_length:
                continue
            score = float(starts[s] + ends[e])
            if found is None or score > found[0]:
                found = (score, int(s), int(e))
    context = np.flatnonzero([o is not None for o in offsets])
    if found is not None or not len(context):
        return found
    first, last = np.meshgrid(context, context, indexing="ij")
    valid = (last >= first) & (last - first < max_answer_length)  # a one-token answer always is
    scores = np.where(valid, starts[first] + ends[last], -np.inf)
    at = np.unravel_index(np.argmax(scores), scores.shape)
    return float(scores[at]), int(first[at]), int(last[at])


__all__ = ["Predictions", "Windows", "make_windows", "predict_answers"]
