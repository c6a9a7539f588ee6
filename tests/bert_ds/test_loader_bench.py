"""``python -m bert_ds.loader.bench`` at a tiny scale: it writes its synthetic dataset, prints every
figure, and its measurements are consistent (the figures themselves are machine-dependent)."""

import json
import re

from tests.conftest import run_cli

FIGURES = [
    "cold open time",
    "cold open peak RSS",
    "two cold opens at once / one",
    "cached open time",
    "RSS after cached open + draws",
    "its private (anonymous) part",
    "loader samples/s per core",
    "sample map bytes per sample",
]


def test_scale_bench_prints_every_figure_and_builds_once_per_cold_start(tmp_path):
    out = tmp_path / "bench.json"
    keep = tmp_path / "data"
    proc = run_cli("bert_ds.loader.bench", "--scale", "200k", "400k", "--keep", str(keep), "--loader-seconds", "0.3",
                   "--draw-seconds", "0.5", "--json", str(out), timeout=300)
    result = json.loads(out.read_text())
    r, larger = result["runs"]
    assert [f["name"] for f in r["figures"]] == FIGURES
    assert 200_000 <= r["totals"]["tokens"] < 200_000 + 60 * 48  # stops at the document that reaches the scale
    assert 400_000 <= larger["totals"]["tokens"] < 400_000 + 60 * 48
    assert (keep / "tokens-200000" / "manifest.json").is_file()  # --keep: the datasets stay for the next run
    g = result["growth"]
    assert (g["from_tokens"], g["to_tokens"]) == (r["totals"]["tokens"], larger["totals"]["tokens"])
    step = (g["to_tokens"] - g["from_tokens"]) / 1e9
    after = [x["cached"]["rss_after_draws"]["VmRSS"] for x in (r, larger)]
    assert abs(g["per_billion"]["VmRSS"] * step - (after[1] - after[0])) < 1
    assert "per further billion tokens: RSS after the cached open and the draws" in proc.stdout
    cold, two, cached = r["cold"], r["two_cold"], r["cached"]
    assert cold["builds"] == 1 and sum(x["builds"] for x in two) == 1 and cached["builds"] == 0
    assert cold["samples"] == cached["samples"] == two[0]["samples"] > 1000
    assert 0 < cold["seconds"] and all(x["seconds"] > 0 for x in two) and cached["seconds"] > 0
    assert cold["peak_rss"] >= cold["rss_before_open"] > 100e6  # torch is imported
    after = cached["rss_after_draws"]
    assert after["VmRSS"] >= after["RssAnon"] > 0 and after["RssFile"] > 0
    assert cached["drawn"] > 0 and cached["samples_per_s"] > 0
    assert r["map_bytes"] == cached["map_header"] + 8 * cached["samples"]  # one uint64 per sample behind the header
    for i, name in enumerate(FIGURES, 1):
        row = next(line for line in proc.stdout.splitlines() if line.startswith(f"{i}. {name} "))
        assert float(re.sub(r"[^0-9.]", "", row[len(f"{i}. {name}"):].split()[0])) > 0, row
    map_row = next(line for line in proc.stdout.splitlines() if line.startswith("8. "))
    assert "8.0" in map_row and map_row.endswith("yes")

    again = run_cli("bert_ds.loader.bench", "--scale", "200k", "--keep", str(keep), "--loader-seconds", "0.1",
                    "--draw-seconds", "0.1", timeout=300)
    assert "reusing the synthetic dataset" in again.stderr


def test_bad_scale_is_one_line():
    proc = run_cli("bert_ds.loader.bench", "--scale", "lots", check=False, timeout=60)
    assert proc.returncode == 2 and "not a token count" in proc.stderr and "Traceback" not in proc.stderr
