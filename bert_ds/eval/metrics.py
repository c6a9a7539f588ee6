"""GLUE's metrics, from scikit-learn and scipy (nothing fetched at run time), as percentages,
and the average the BERT paper reports.

Each task reports the metric GLUE defines for it, and the paper's one goes into the average:
CoLA Matthews correlation; MRPC and QQP F1 (accuracy beside it); STS-B Spearman (Pearson
beside it); accuracy elsewhere. The average is the paper's Table 1 column: the mean of nine
numbers, MNLI matched and mismatched counted separately (BERT-Base: 79.6). The paper's
figures are on GLUE's test server; these are on the dev sets, which is what papers since
(RoBERTa, MosaicBERT, ModernBERT) compare.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

# The nine columns of the BERT paper's average, in its order.
AVERAGE_OF = ("mnli-m", "mnli-mm", "qqp", "qnli", "sst2", "cola", "stsb", "mrpc", "rte")


def scores(metric: str, predictions: Sequence[float], labels: Sequence[float]) -> dict[str, float]:
    """Every figure of the task's ``metric``, in percent; ``"score"`` is the one the paper reports."""
    from scipy.stats import pearsonr, spearmanr
    from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

    if len(predictions) != len(labels) or not labels:
        raise ValueError(f"{len(predictions)} predictions for {len(labels)} labels")
    if metric == "spearman":
        constant = len(set(predictions)) < 2  # a correlation with a constant is undefined: 0, as GLUE scores it
        pearson = 0.0 if constant else float(pearsonr(predictions, labels)[0])
        spearman = 0.0 if constant else float(spearmanr(predictions, labels)[0])
        return {"score": 100 * spearman, "pearson": 100 * pearson, "spearman": 100 * spearman}
    accuracy = 100 * float(accuracy_score(labels, predictions))
    if metric == "accuracy":
        return {"score": accuracy, "accuracy": accuracy}
    if metric == "f1":
        f1 = 100 * float(f1_score(labels, predictions, zero_division=0.0))
        return {"score": f1, "f1": f1, "accuracy": accuracy}
    if metric == "matthews":
        mcc = 100 * float(matthews_corrcoef(labels, predictions))
        return {"score": mcc, "matthews": mcc, "accuracy": accuracy}
    raise ValueError(f"unknown metric {metric!r}")


def average(medians: dict[str, float]) -> tuple[float, list[str]]:
    """The paper's average over the columns present, and the columns missing from it."""
    present = [medians[name] for name in AVERAGE_OF if name in medians and math.isfinite(medians[name])]
    missing = [name for name in AVERAGE_OF if name not in medians]
    return (statistics.fmean(present) if present else math.nan), missing
