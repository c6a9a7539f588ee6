"""``python -m bert_ds.data_tools bench`` on a tiny corpus: it runs, and prints every figure as a
positive number beside its goal (the figures themselves are machine-dependent)."""

import json
import re
import subprocess
import sys

FIGURES = [
    "build / bare tokenizers",
    "build / datasets map+save_to_disk",
    "bytes on disk per token",
    "build worker peak RSS",
]


def test_bench_prints_every_figure_beside_its_goal(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bert_ds.data_tools", "bench", "--corpus-mb", "1", "--workers", "2", "--vocab-size", "2000",
         "--rounds", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert [f["name"] for f in report["figures"]] == FIGURES
    assert 0.9e6 <= report["corpus"]["bytes"] <= 1e6
    assert "corpus: 1.0 MB" in proc.stdout and "2 round(s)" in proc.stdout
    # every pipeline ran once per round; each speed figure is the median of its rounds' ratios
    one = report["layouts"]["one_file"]
    assert [len(one[p]) for p in ("build", "bare_tokenizers", "datasets")] == [2, 2, 2]
    per_round = [b["input_bytes"] / b["seconds"] / (x["input_bytes"] / x["seconds"])
                 for b, x in zip(one["build"], one["bare_tokenizers"])]
    assert abs(report["figures"][0]["value"] - sum(per_round) / 2) < 1e-9  # the median of two is their mean
    assert "median of 2 rounds" in report["figures"][0]["how"] and "main process" in report["figures"][0]["how"]
    rows = [line for line in proc.stdout.split("\n") if re.match(r"^[1-4]\. ", line)]
    for i, fig in enumerate(report["figures"], 1):
        row = next(r for r in rows if r.startswith(f"{i}. {fig['name']} "))
        measured = row[len(f"{i}. {fig['name']}"):].split()[0]  # "0.93", "1.62x", "2.048", "10,542", "71"
        assert float(re.sub(r"[^0-9.]", "", measured)) > 0 and fig["value"] > 0, row
        assert fig["goal"] in row and row.rstrip().endswith("yes" if fig["met"] else "NO"), row
        assert fig["how"] and f"{i}. {fig['how']}" in proc.stdout


def test_split_corpus_keeps_every_byte_in_files_of_varied_size(tmp_path):
    from bert_ds.data_tools.bench import make_corpus, split_corpus

    corpus = tmp_path / "corpus.txt"
    size, _ = make_corpus(corpus, 400_000)
    paths = split_corpus(corpus, tmp_path / "files", 40)
    sizes = [p.stat().st_size for p in paths]
    assert b"".join(p.read_bytes() for p in paths) == corpus.read_bytes()
    assert all(p.read_bytes().endswith(b"\n") for p in paths)  # cut at line ends only
    assert 20 <= len(paths) <= 80 and sum(sizes) == size
    assert max(sizes) > 5 * min(sizes)  # varied, not equal pieces


def test_bench_files_reports_the_many_files_layout(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bert_ds.data_tools", "bench", "--corpus-mb", "1", "--workers", "2", "--vocab-size",
         "2000", "--files", "30", "--rounds", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    files = report["files"]
    assert 15 <= files["count"] <= 60 and 0 < files["min_bytes"] < files["max_bytes"]
    one, many = report["layouts"]["one_file"], report["layouts"]["many_files"]
    # The same text in other files: the same bytes in, the same sentences and tokens out.
    assert many["build"][0]["input_bytes"] == many["bare_tokenizers"][0]["input_bytes"] == \
        many["datasets"][0]["input_bytes"] == report["corpus"]["bytes"]
    assert many["datasets"][0]["rows"] == one["datasets"][0]["rows"]
    for key in ("tokens", "sentences"):
        assert many["build"][0][key] == one["build"][0][key]
    for run in (one["build"][0], one["bare_tokenizers"][0], many["build"][0], many["bare_tokenizers"][0]):
        assert 0 < run["cpu_seconds"] < 2 * 60  # workers' CPU counted, not only the main process's
    assert 0 < one["build"][0]["main_cpu_seconds"] < one["build"][0]["cpu_seconds"]
    assert [f["name"] for f in report["figures"][:4]] == FIGURES
    names = [f"build / bare tokenizers, {files['count']:,} files",
             f"build / datasets map+save_to_disk, {files['count']:,} files"]
    assert [f["name"] for f in report["figures"][4:]] == names
    for i, fig in enumerate(report["figures"][4:], 5):
        row = next(line for line in proc.stdout.split("\n") if line.startswith(f"{i}. {fig['name']} "))
        assert fig["value"] > 0 and fig["shown"] in row and fig["goal"] in row
