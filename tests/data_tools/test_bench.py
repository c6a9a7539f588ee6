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
        [sys.executable, "-m", "bert_ds.data_tools", "bench", "--corpus-mb", "2", "--workers", "2", "--vocab-size", "2000",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert [f["name"] for f in report["figures"]] == FIGURES
    assert 1.9e6 <= report["corpus"]["bytes"] <= 2e6
    assert "corpus: 2.0 MB" in proc.stdout
    rows = [line for line in proc.stdout.split("\n") if re.match(r"^[1-4]\. ", line)]
    for i, fig in enumerate(report["figures"], 1):
        row = next(r for r in rows if r.startswith(f"{i}. {fig['name']} "))
        measured = row[len(f"{i}. {fig['name']}"):].split()[0]  # "0.93", "1.62x", "2.048", "10,542", "71"
        assert float(re.sub(r"[^0-9.]", "", measured)) > 0 and fig["value"] > 0, row
        assert fig["goal"] in row and row.rstrip().endswith("yes" if fig["met"] else "NO"), row
        assert fig["how"] and f"{i}. {fig['how']}" in proc.stdout
