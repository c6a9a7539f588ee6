"""SQuAD's scores against cases computed by hand from the official scripts' definitions: each
normalisation rule, the token F1 over multisets, the best gold answer, v1.1's and v2.0's
empty-text rules, the HasAns/NoAns split (any gold answer makes a question answerable), and
the no-answer threshold search."""

from __future__ import annotations

import pytest

from bert_ds.eval.squad_metrics import Question, best_threshold, evaluate, exact, f1, normalize_answer


@pytest.mark.parametrize("text, normalised", [
    ("Paris", "paris"),                                  # lower case
    ("Paris!", "paris"), ("U.S.", "us"), ("rock'n'roll", "rocknroll"),  # punctuation removed, not spaced
    ("the Eiffel Tower", "eiffel tower"), ("An apple a day", "apple day"),  # articles, as whole words
    ("theory of an anthem", "theory of anthem"),         # not inside words
    ("  New \t York \n", "new york"),                    # whitespace collapsed
    ("The, the", ""),                                    # nothing left
])
def test_normalisation_rules(text, normalised):
    assert normalize_answer(text) == normalised


def test_exact_and_f1_by_hand():
    assert exact("the Eiffel Tower", "Eiffel tower.") == 1 and exact("Eiffel Tower", "Tower") == 0
    # gold tokens cat sat on mat, predicted cat on mat: P 3/3, R 3/4
    assert f1("the cat sat on the mat", "cat on mat") == pytest.approx(2 * 1 * 0.75 / 1.75)
    # multisets: gold x y y, predicted y y y: 2 shared, P = R = 2/3
    assert f1("x y y", "y y y") == pytest.approx(2 / 3)
    assert f1("Denver Broncos", "Carolina Panthers") == 0.0


def test_the_best_gold_answer_counts():
    q = Question("q", ("Denver Broncos", "the Broncos", "Broncos team"))
    report = evaluate([q], {"q": "Broncos"}, version="1.1")
    assert report == {"exact_match": 100.0, "f1": 100.0}  # exact against "the Broncos"
    # "broncos defense" against "denver broncos" and "broncos team": P = R = 1/2, F1 1/2; against
    # "broncos": P 1/2, R 1, F1 2/3, the best
    report = evaluate([q], {"q": "Broncos defense"}, version="1.1")
    assert report["exact_match"] == 0.0 and report["f1"] == pytest.approx(100 * 2 / 3)


def test_empty_texts_by_version():
    # a gold answer that normalises to nothing: v1.1 finds no shared token (F1 0) but equal texts
    # (exact 1); v2.0 drops such gold answers, leaves "" and scores "" against it as a match
    q = Question("q", ("The",))
    assert evaluate([q], {"q": ""}, version="1.1") == {"exact_match": 100.0, "f1": 0.0}
    assert evaluate([q], {"q": ""}, version="2.0")["f1"] == 100.0
    unanswerable = Question("u", ())
    assert evaluate([unanswerable], {"u": ""}, version="2.0")["exact"] == 100.0
    assert evaluate([unanswerable], {"u": "Denver"}, version="2.0")["f1"] == 0.0


QUESTIONS = [Question("q1", ("Denver Broncos",)), Question("q2", ()), Question("q3", ())]
PREDICTIONS = {"q1": "Denver Broncos", "q2": "Carolina", "q3": ""}
NO_ANSWER = {"q1": 0.1, "q2": 0.5, "q3": 0.9}


def test_v2_splits_the_answerable_from_the_unanswerable():
    report = evaluate(QUESTIONS, PREDICTIONS, version="2.0")
    assert report == {"exact": pytest.approx(200 / 3), "f1": pytest.approx(200 / 3), "total": 3,
                      "HasAns_exact": 100.0, "HasAns_f1": 100.0, "HasAns_total": 1,
                      "NoAns_exact": 50.0, "NoAns_f1": 50.0, "NoAns_total": 2}


def test_the_no_answer_threshold_search_by_hand():
    # every question answered "": 2 of 3 right. Then, by probability: q1 (0.1) answered right
    # (+1 -> 3, the best, threshold 0.1), q2 (0.5) answered "Carolina" where there is no
    # answer (-1), q3 (0.9) answered "" (+0).
    has = {"q1": True, "q2": False, "q3": False}
    scores = {"q1": 1.0, "q2": 0.0, "q3": 1.0}
    assert best_threshold(scores, PREDICTIONS, NO_ANSWER, has) == (100.0, 0.1)
    report = evaluate(QUESTIONS, PREDICTIONS, version="2.0", no_answer_probability=NO_ANSWER)
    assert (report["best_exact"], report["best_exact_thresh"], report["best_f1"]) == (100.0, 0.1, 100.0)
    # the script's --na-prob-thresh (1.0): no probability above it, the raw scores stand
    assert report["exact"] == pytest.approx(200 / 3)
    # at 0.4, q2 and q3 are answered "": both right
    lowered = evaluate(QUESTIONS, PREDICTIONS, version="2.0", no_answer_probability=NO_ANSWER,
                       no_answer_threshold=0.4)
    assert lowered["exact"] == 100.0 and lowered["NoAns_exact"] == 100.0


def test_a_question_whose_answers_all_normalise_to_nothing_is_answerable():
    # The script's bool(qa['answers']): "t" has a gold answer ("The"), so it is answerable, though
    # its raw scores are against "" (it drops the gold answers that normalise to nothing).
    questions = [Question("q1", ("Denver Broncos",)), Question("t", ("The",)), Question("u", ())]
    predictions = {"q1": "Denver Broncos", "t": "", "u": "Carolina"}
    report = evaluate(questions, predictions, version="2.0")
    assert (report["HasAns_total"], report["HasAns_exact"], report["NoAns_total"], report["NoAns_exact"]) == (
        2, 100.0, 1, 0.0)
    # threshold search: 1 right with every question answered "" (u), then q1 (0.1) +1 -> 2, t (0.5),
    # answerable, adds its raw score 1 -> 3, the best, u (0.9) answered "Carolina" -1
    no_answer = {"q1": 0.1, "t": 0.5, "u": 0.9}
    report = evaluate(questions, predictions, version="2.0", no_answer_probability=no_answer)
    assert (report["best_exact"], report["best_exact_thresh"], report["best_f1_thresh"]) == (100.0, 0.5, 0.5)
    # "" answered above 0.4: t, answerable, scores 0 (the script's apply_no_ans_threshold), u 1
    lowered = evaluate(questions, predictions, version="2.0", no_answer_probability=no_answer,
                       no_answer_threshold=0.4)
    assert lowered["exact"] == pytest.approx(200 / 3) and lowered["HasAns_exact"] == 50.0
    assert lowered["NoAns_exact"] == 100.0


def test_a_question_without_a_prediction_or_an_unknown_version_is_refused():
    with pytest.raises(ValueError, match="no prediction for 1 question"):
        evaluate(QUESTIONS, {"q1": "", "q2": ""}, version="2.0")
    with pytest.raises(ValueError, match="1.1 or 2.0"):
        evaluate(QUESTIONS, PREDICTIONS, version="3")
