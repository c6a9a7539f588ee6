"""Writes tests/assets/retrieval/tiny-beir, the made-up BEIR-format task the retrieval tests and
the docs test use: 120 documents about invented places, each with two invented rare words; a
query names a document's kind and one of them. Train: the first 80 documents by both words;
dev: the other 40 by the first word; test: those 40 by the second. Rerun it to remake the files
(the same files: the generator is seeded)."""

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent / "tiny-beir"
SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "zi", "pe", "su", "do", "fa", "gu", "hi", "jo", "be"]
KINDS = ["river", "mountain", "city", "island", "forest", "lake"]


def main() -> None:
    rng = random.Random(7)
    used: set[str] = set()

    def unique(syllables: int) -> str:
        while True:
            word = "".join(rng.choice(SYLLABLES) for _ in range(syllables))
            if word not in used:
                used.add(word)
                return word

    places = [unique(2) for _ in range(8)]
    docs = [dict(name=unique(3), kind=rng.choice(KINDS), place=rng.choice(places), thing=unique(3), other=unique(3))
            for _ in range(120)]
    (OUT / "qrels").mkdir(parents=True, exist_ok=True)
    with open(OUT / "corpus.jsonl", "w") as f:
        for i, d in enumerate(docs):
            text = f"{d['name']} is a {d['kind']} in {d['place']} . it is known for its {d['thing']} and its {d['other']} ."
            f.write(json.dumps({"_id": f"d{i}", "title": d["name"], "text": text}) + "\n")
    queries, qrels = {}, {"train": [], "dev": [], "test": []}
    for i, d in enumerate(docs):
        queries[f"q{i}"] = f"which {d['kind']} is known for its {d['thing']} ?"
        queries[f"r{i}"] = f"where is the {d['kind']} with the {d['other']} ?"
        (qrels["train"] if i < 80 else qrels["dev"]).append((f"q{i}", f"d{i}"))
        (qrels["train"] if i < 80 else qrels["test"]).append((f"r{i}", f"d{i}"))
    with open(OUT / "queries.jsonl", "w") as f:
        for qid, text in queries.items():
            f.write(json.dumps({"_id": qid, "text": text}) + "\n")
    for split, rows in qrels.items():
        with open(OUT / "qrels" / f"{split}.tsv", "w") as f:
            f.write("query-id\tcorpus-id\tscore\n" + "".join(f"{q}\t{d}\t1\n" for q, d in rows))


if __name__ == "__main__":
    main()
