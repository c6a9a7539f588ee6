"""Entity scores held to conlleval's figures on cases worked by hand from its chunk rules."""

from __future__ import annotations

import pytest

from bert_ds.eval.ner_metrics import chunks, entity_scores

GOLD = [["B-ORG", "O", "B-PER", "O", "O", "B-LOC", "O"], ["B-PER", "I-PER", "O", "B-LOC"]]
PREDICTED = [["B-ORG", "O", "B-PER", "O", "O", "B-ORG", "O"],  # Baghdad typed ORG
             ["B-PER", "O", "O", "I-LOC"]]  # a person cut short; a stray I-LOC opens a LOC chunk


def test_conllevals_figures_by_hand():
    # gold chunks: ORG 0, PER 2, LOC 5 | PER 0-1, LOC 3; predicted: ORG 0, PER 2, ORG 5 | PER 0, LOC 3.
    # correct: ORG 0, PER 2, LOC 3 of sentence 2: 3 of 5 predicted, 3 of 5 gold
    report = entity_scores(GOLD, PREDICTED)
    assert (report["precision"], report["recall"], report["f1"]) == pytest.approx((60.0, 60.0, 60.0))
    assert report["accuracy"] == pytest.approx(100 * 8 / 11)  # Baghdad, I-PER and I-LOC wrong
    per = report["per_type"]
    assert (per["ORG"]["precision"], per["ORG"]["recall"], per["ORG"]["f1"]) == pytest.approx((50.0, 100.0, 200 / 3))
    assert (per["PER"]["precision"], per["PER"]["recall"]) == pytest.approx((50.0, 50.0))
    assert (per["LOC"]["precision"], per["LOC"]["recall"], per["LOC"]["gold"]) == pytest.approx((100.0, 50.0, 2))


def test_bio_and_iob1_read_alike():
    bio = ["B-PER", "I-PER", "B-PER", "O", "B-LOC", "I-LOC"]
    iob1 = ["I-PER", "I-PER", "B-PER", "O", "I-LOC", "I-LOC"]  # B only between two chunks of one type
    assert chunks(bio) == chunks(iob1) == [("PER", 0, 1), ("PER", 2, 2), ("LOC", 4, 5)]


def test_a_type_change_without_b_opens_a_chunk_and_e_tags_close_one():
    assert chunks(["B-PER", "I-LOC", "I-LOC"]) == [("PER", 0, 0), ("LOC", 1, 2)]
    assert chunks(["B-MISC", "E-MISC", "O", "E-MISC"]) == [("MISC", 0, 1), ("MISC", 3, 3)]
    assert chunks(["O", "O"]) == [] and entity_scores([["O"]], [["O"]])["f1"] == 0.0


def test_mismatched_sentences_are_refused():
    with pytest.raises(ValueError, match="same sentences and lengths"):
        entity_scores(GOLD, [PREDICTED[0]])
