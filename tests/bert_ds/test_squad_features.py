"""SQuAD's windows and answers: a long context cut into overlapping windows whose labels point
at the answer's characters exactly where the answer is inside, and span scores turned back
into the answer's text, the null answer winning under v2.0 only where it scores higher."""

from __future__ import annotations

import re

import numpy as np
import pytest

from bert_ds.eval.squad_data import Answer, SquadExample
from bert_ds.eval.squad_features import make_windows, predict_answers

FILLER = "the river runs past old mills and quiet farms near the town ."
CONTEXT = " ".join([FILLER] * 6 + ["Denver Broncos won Super Bowl 50 in Santa Clara ."] + [FILLER] * 6)
QUESTION = "who won super bowl 50 ?"


@pytest.fixture(scope="module")
def tokenizer():
    import transformers

    words = sorted(set(re.findall(r"\w+|[^\w\s]", (CONTEXT + " " + QUESTION).lower())))
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    return transformers.BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)})


def _example(answerable: bool = True) -> SquadExample:
    text = "Denver Broncos"
    return SquadExample("q", QUESTION, CONTEXT, (Answer(text, CONTEXT.index(text)),) if answerable else ())


def test_windows_overlap_and_label_the_answer_where_it_lies_whole(tokenizer):
    example = _example()
    windows = make_windows(tokenizer, [example], max_seq_length=40, doc_stride=10, labels=True)
    assert len(windows.features) > 3 and set(windows.example_of) == {0}
    labelled = 0
    for feature, offsets in zip(windows.features, windows.offsets):
        ids = feature["input_ids"]
        assert len(ids) <= 40 and ids[0] == tokenizer.cls_token_id
        start, end = feature["start_positions"], feature["end_positions"]
        context_tokens = [o for o in offsets if o is not None]
        whole = context_tokens[0][0] <= example.answers[0].start and \
            context_tokens[-1][1] >= example.answers[0].start + len(example.answers[0].text)
        if whole:
            labelled += 1
            assert CONTEXT[offsets[start][0]:offsets[end][1]] == "Denver Broncos"
        else:
            assert (start, end) == (0, 0)
    assert labelled >= 1
    # consecutive windows share doc_stride context tokens
    first, second = ([o for o in offsets if o is not None] for offsets in windows.offsets[:2])
    assert first[-10:] == second[:10]


def test_an_unanswerable_question_points_every_window_at_cls(tokenizer):
    windows = make_windows(tokenizer, [_example(answerable=False)], max_seq_length=40, doc_stride=10, labels=True)
    assert {(f["start_positions"], f["end_positions"]) for f in windows.features} == {(0, 0)}


def _scores(windows, span_score: float, null_score: float):
    """Logits that give the answer's tokens ``span_score`` (start + end) in the window that
    holds it, and [CLS] ``null_score`` in every window."""
    width = max(len(f["input_ids"]) for f in windows.features)
    starts, ends = np.full((len(windows.features), width), -10.0), np.full((len(windows.features), width), -10.0)
    starts[:, 0] = ends[:, 0] = null_score / 2
    for w, offsets in enumerate(windows.offsets):
        for i, o in enumerate(offsets):
            if o is not None and CONTEXT[o[0]:o[1]].lower() == "denver":
                starts[w, i] = span_score / 2
            if o is not None and CONTEXT[o[0]:o[1]].lower() == "broncos":
                ends[w, i] = span_score / 2
    return starts, ends


def test_the_best_span_across_windows_is_the_answer(tokenizer):
    example = _example()
    windows = make_windows(tokenizer, [example], max_seq_length=40, doc_stride=10, labels=False)
    starts, ends = _scores(windows, span_score=8.0, null_score=2.0)
    got = predict_answers([example], windows, starts, ends, version="1.1")
    assert got.answers == {"q": "Denver Broncos"} and got.no_answer_score["q"] == pytest.approx(2.0 - 8.0)
    # a longest answer of one token cannot reach "Denver Broncos" (two)
    short = predict_answers([example], windows, starts, ends, version="1.1", max_answer_length=1)
    assert short.answers["q"] != "Denver Broncos"


def test_the_null_answer_wins_under_v2_only_above_the_threshold(tokenizer):
    example = _example()
    windows = make_windows(tokenizer, [example], max_seq_length=40, doc_stride=10, labels=False)
    starts, ends = _scores(windows, span_score=3.0, null_score=6.0)
    assert predict_answers([example], windows, starts, ends, version="2.0").answers == {"q": ""}
    assert predict_answers([example], windows, starts, ends, version="1.1").answers == {"q": "Denver Broncos"}
    kept = predict_answers([example], windows, starts, ends, version="2.0", null_threshold=5.0)
    assert kept.answers == {"q": "Denver Broncos"} and kept.no_answer_score["q"] == pytest.approx(3.0)


def test_a_tokenizer_without_offsets_is_refused():
    class PythonTokenizer:  # a slow (pure Python) tokenizer: no character offsets
        is_fast = False

    with pytest.raises(ValueError, match="need a fast tokenizer.*PythonTokenizer"):
        make_windows(PythonTokenizer(), [_example()], labels=False)


def test_a_long_question_keeps_its_first_tokens_and_one_that_fills_the_window_is_refused(tokenizer):
    from bert_ds.base.errors import UserError

    long = SquadExample("long", " ".join(["who won super bowl 50 ?"] * 4), CONTEXT, ())  # 24 tokens
    windows = make_windows(tokenizer, [long], max_seq_length=40, doc_stride=10, labels=False, max_query_length=6)
    assert windows.questions_cut == 1
    first_sep = windows.features[0]["input_ids"].index(tokenizer.sep_token_id)
    assert windows.features[0]["input_ids"][1:first_sep] == tokenizer(QUESTION, add_special_tokens=False).input_ids
    assert make_windows(tokenizer, [_example()], 40, 10, labels=False).questions_cut == 0
    with pytest.raises(UserError, match=r"dev.json: question 'long': its 24 tokens, the 3 special tokens of a "
                                        r"question and context pair and the 10 tokens of --doc-stride fill the "
                                        r"window of 36"):
        make_windows(tokenizer, [long], max_seq_length=36, doc_stride=10, labels=False, source="dev.json")


def test_the_room_for_the_question_counts_the_tokenizers_own_special_tokens(tokenizer):
    """A pair template with four special tokens (RoBERTa's ``<s> A </s></s> B </s>``): a question
    that fits beside three but not four is refused in one line, not left to the tokenizer."""
    import copy

    from tokenizers import processors

    from bert_ds.base.errors import UserError

    four = copy.deepcopy(tokenizer)
    cls, sep = four.cls_token_id, four.sep_token_id
    four.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] [SEP] $B [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    long = SquadExample("long", " ".join(["who won super bowl 50 ?"] * 4), CONTEXT, ())  # 24 tokens
    assert len(make_windows(tokenizer, [long], max_seq_length=38, doc_stride=10, labels=False).features) > 1
    with pytest.raises(UserError, match=r"question 'long': its 24 tokens, the 4 special tokens of a question and "
                                        r"context pair and the 10 tokens of --doc-stride fill the window of 38"):
        make_windows(four, [long], max_seq_length=38, doc_stride=10, labels=False)
    windows = make_windows(four, [long], max_seq_length=39, doc_stride=10, labels=False)
    assert all(len(f["input_ids"]) <= 39 for f in windows.features) and len(windows.features) > 1


def test_a_window_whose_top_scores_pair_no_span_is_searched_whole(tokenizer):
    """An untrained head that scores the question's tokens highest still answers from the
    context, with a finite no-answer score (the v2.0 threshold search needs one)."""
    example = _example()
    windows = make_windows(tokenizer, [example], max_seq_length=40, doc_stride=10, labels=False)
    starts, ends = _scores(windows, span_score=4.0, null_score=0.0)
    for w, offsets in enumerate(windows.offsets):
        question = [i for i, o in enumerate(offsets) if o is None][1:-1]  # between [CLS] and the last [SEP]
        starts[w, question] = ends[w, question] = 50.0
    got = predict_answers([example], windows, starts, ends, version="2.0", n_best=3)
    assert got.answers == {"q": "Denver Broncos"} and got.no_answer_score["q"] == pytest.approx(-4.0)
