"""Rankings as TREC run files, scored with trec_eval's measures through ``pytrec_eval`` (its C code).

- A run file is TREC's: ``qid Q0 docid rank score tag`` per line, each query's documents in
  the order trec_eval reads them: by score, highest first, a tie broken by document id, the
  larger first (trec_eval sorts a run that way itself, whatever ranks the file states).
- The measures, each a mean over the queries the qrels grade: nDCG@10 (``ndcg_cut_10``, BEIR's
  headline), Recall@100 (``recall_100``) and MRR@10: trec_eval's ``recip_rank`` of the run cut
  to each query's first 10 documents (trec_eval's own ``recip_rank`` has no cutoff).
- A query the qrels grade that the run does not rank scores 0 in every measure, as
  ``trec_eval -c`` counts it, not left out of the mean.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from bert_ds.base.atomic import atomic_write
from bert_ds.base.errors import ConfigError

Run = Mapping[str, Mapping[str, float]]  # query id -> document id -> score
Qrels = Mapping[str, Mapping[str, int]]  # query id -> document id -> grade
MEASURES = ("ndcg@10", "recall@100", "mrr@10")


def ranked(scores: Mapping[str, float]) -> list[tuple[str, float]]:
    """A query's documents in trec_eval's order: by score, highest first; a tie by id, the larger first."""
    return sorted(scores.items(), key=lambda item: (item[1], item[0]), reverse=True)


def write_run(path: Path, run: Run, tag: str) -> None:
    """``run`` as a TREC run file (atomically: a reader never sees half of one)."""
    lines = [f"{qid} Q0 {doc} {rank} {score:.6f} {tag}\n"
             for qid in sorted(run) for rank, (doc, score) in enumerate(ranked(run[qid]), 1)]
    atomic_write(path, "".join(lines))


def read_run(path: Path) -> dict[str, dict[str, float]]:
    """A TREC run file's scores (its ranks are trec_eval's to recompute from them)."""
    run: dict[str, dict[str, float]] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 6:
            raise ConfigError(f"{path}:{number}: a run line is qid Q0 docid rank score tag, got {len(parts)} fields")
        try:
            run.setdefault(parts[0], {})[parts[2]] = float(parts[4])
        except ValueError:
            raise ConfigError(f"{path}:{number}: score {parts[4]!r} is not a number") from None
    return run


def score(qrels: Qrels, run: Run) -> dict[str, float]:
    """nDCG@10, Recall@100 and MRR@10 of ``run``, each the mean over the queries ``qrels`` grades."""
    import pytrec_eval

    graded = {qid: dict(docs) for qid, docs in qrels.items()}
    scored = {qid: {doc: float(s) for doc, s in run.get(qid, {}).items()} for qid in graded}
    full = pytrec_eval.RelevanceEvaluator(graded, {"ndcg_cut.10", "recall.100"}).evaluate(scored)
    top10 = {qid: dict(ranked(docs)[:10]) for qid, docs in scored.items()}
    reciprocal = pytrec_eval.RelevanceEvaluator(graded, {"recip_rank"}).evaluate(top10)
    per_query = {qid: {"ndcg@10": full.get(qid, {}).get("ndcg_cut_10", 0.0),
                       "recall@100": full.get(qid, {}).get("recall_100", 0.0),
                       "mrr@10": reciprocal.get(qid, {}).get("recip_rank", 0.0)} for qid in graded}
    return {measure: sum(q[measure] for q in per_query.values()) / len(per_query) for measure in MEASURES}
