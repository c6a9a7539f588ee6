import json, statistics, sys
from pathlib import Path
run = Path(sys.argv[1])
try:
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
except OSError as e:
    print("  no metrics:", e); sys.exit()
train = [r for r in recs if "step_time_s" in r][10:]
if not train:
    print("  no train records", recs[:2]); sys.exit()
med = lambda k: statistics.median(r[k] for r in train if r.get(k) is not None)
print(f"  {run.name}: steps {len(train)}, step {1e3*med('step_time_s'):.1f} ms, data wait {1e3*med('data_wait_s'):.2f} ms, tokens/s {med('tokens_per_s'):,.0f}")
s = run / "summary.json"
if s.exists():
    j = json.loads(s.read_text()); print(f"  summary tokens/s {j['tokens_per_s']:,.0f} mfu {100*j['mfu']:.1f}%")
