"""The two-phase recipe (bert_ds.train.phases): plan validation in-process, and one real run
whose second phase is killed and resumed."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from bert_ds.checkpoint import store as checkpoint
from bert_ds.config import TrainConfig
from bert_ds.base.errors import ConfigError
from bert_ds.train.phases import PhasePlan
from tests.conftest import REPO, cli_env, run_cli, spawn

RECIPES = REPO / "bert_ds" / "recipes"


def _tiny_plan(data: dict[str, Path], output: Path) -> dict:
    plan = json.loads((RECIPES / "tiny_two_phase.json").read_text())
    plan["output"] = str(output)
    plan["base"]["data"]["train"] = [str(data["train"])]
    return plan


@pytest.mark.parametrize("recipe", sorted(p.name for p in RECIPES.glob("*.json")))
def test_bundled_recipes_validate(recipe):
    plan = PhasePlan.load(RECIPES / recipe)
    configs = plan.train_configs({"vocab_size": 30522, "pad_token_id": 5})
    assert [c.steps for c in configs] == [p.steps for p in plan.phases]
    assert all((c.model.vocab_size, c.model.pad_token_id) == (30522, 5) for c in configs)  # the data's
    assert all(isinstance(c, TrainConfig) for c in configs)
    seq = [c.data.max_seq_length for c in configs]
    print(f"phases: {recipe}: {len(configs)} phases, sequence lengths {seq}")
    assert seq == sorted(seq)  # short sequences first, as in BERT's recipe


def test_phase_overrides_merge_into_the_base():
    plan = PhasePlan.load(RECIPES / "bert_base_two_phase.json")
    one, two = plan.train_configs({"vocab_size": 30522, "pad_token_id": 0})
    assert (one.optim.lr, two.optim.lr) == (6e-3, 4e-3)
    assert one.optim.decay == two.optim.decay == "poly"  # from the base, kept by both
    assert one.data.train == two.data.train and two.data.max_seq_length == 512
    assert Path(two.output) == Path(plan.output) / "phase2"


def test_each_phase_builds_its_model_at_its_own_sequence_length(monkeypatch):
    # kernels=auto races at the shapes the model is built with: phase 2's at seq 512, not phase 1's.
    from bert_ds.train import loop

    class Built(Exception):
        pass

    seq_lens = []

    def model(config, train_seq_len=None):
        seq_lens.append(train_seq_len)
        raise Built
    monkeypatch.setattr(loop, "build_model", model)
    for cfg in PhasePlan.load(RECIPES / "bert_base_two_phase.json").train_configs({"vocab_size": 30522, "pad_token_id": 0}):
        with pytest.raises(Built):
            loop._build_engine(cfg, {}, torch.device("cpu"))
    assert seq_lens == [128, 512]


@pytest.mark.parametrize("edit,message", [
    (lambda d: d.update(phasez=[]), "unknown key"),
    (lambda d: d["phases"][1].update(stepz=3), "phase 'phase2': unknown TrainConfig field"),
    (lambda d: d["phases"][1]["optim"].update(lrr=1.0), "phase 'phase2': unknown OptimConfig field"),
    (lambda d: d["phases"][0].update(model={"hidden_size": 128}), "may change only"),
    (lambda d: d["phases"][0].update(output="x"), "set by the phase plan"),
    (lambda d: d["phases"][1].update(name="phase1"), "unique"),
    (lambda d: d["phases"][0].update(steps=0), "positive integer"),
    (lambda d: d["phases"][1]["data"].update(max_seq_length=4), "max_seq_length"),
    (lambda d: d.update(phases=[]), "non-empty"),
])
def test_bad_plans_are_config_errors(edit, message):
    d = json.loads((RECIPES / "tiny_two_phase.json").read_text())
    edit(d)
    with pytest.raises(ConfigError, match=message):
        PhasePlan.from_dict(d).train_configs({"vocab_size": 2048, "pad_token_id": 0})


@pytest.mark.parametrize("recipe", sorted(p.name for p in RECIPES.glob("*.json")))
def test_a_bundled_recipe_without_its_data_names_the_command_that_makes_it(recipe, tmp_path):
    """On a fresh clone (the datasets not built yet) --check says how to make them, in one line."""
    plan = PhasePlan.load(RECIPES / recipe)
    assert plan.prepare and all("data_tools build" in c or c == "./run.sh prepare" for c in plan.prepare)
    proc = subprocess.run([sys.executable, "-m", "bert_ds.train.phases", "--config", str(RECIPES / recipe), "--check"],
                          capture_output=True, text=True, cwd=tmp_path, env=cli_env(), timeout=120)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr
    assert err[0].endswith(f"; this plan's data is made by: {' && '.join(plan.prepare)}")


def test_the_tiny_recipe_checks_once_run_sh_prepare_made_its_data(sample_data, tmp_path):
    (tmp_path / "runs" / "sample").mkdir(parents=True)
    (tmp_path / "runs" / "sample" / "data").symlink_to(sample_data["train"].parent)
    proc = subprocess.run([sys.executable, "-m", "bert_ds.train.phases", "--config", str(RECIPES / "tiny_two_phase.json"),
                           "--check"], capture_output=True, text=True, cwd=tmp_path, env=cli_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "phase1: 6 steps, seq 64" in proc.stdout


def test_check_prints_the_plan_and_a_typo_is_one_line(sample_data, tmp_path):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    plan = _tiny_plan(sample_data, tmp_path / "run")
    good.write_text(json.dumps(plan))
    proc = run_cli("bert_ds.train.phases", "--config", str(good), "--check")
    assert "phase1: 6 steps, seq 64" in proc.stdout and "phase2: 6 steps, seq 128" in proc.stdout
    plan["phases"][1]["warmup"] = 3
    bad.write_text(json.dumps(plan))
    proc = run_cli("bert_ds.train.phases", "--config", str(bad), "--check", check=False)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and "phase 'phase2'" in err[0] and "warmup" in err[0], proc.stderr


def _records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    lines = []
    for line in path.read_text().splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:  # being written
            pass
    return [r for r in lines if "split" not in r]


def test_two_phases_run_and_a_crash_in_phase_two_resumes_phase_two(sample_data, tmp_path):
    root = tmp_path / "run"
    config = tmp_path / "plan.json"
    config.write_text(json.dumps(_tiny_plan(sample_data, root)))
    p1, p2 = root / "phase1", root / "phase2"
    cmd = [sys.executable, "-m", "bert_ds.train.phases", "--config", str(config)]
    with open(tmp_path / "first.log", "w") as log:
        proc = spawn(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        deadline = time.monotonic() + 180
        while not (_records(p2) and _records(p2)[-1]["step"] >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-3000:]
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    first = (tmp_path / "first.log").read_text()
    before = _records(p2)
    phase1_lines = len(_records(p1))

    second = run_cli("bert_ds.train.phases", "--config", str(config))
    phase1_final = checkpoint.step_dir_name(6)
    assert f"phase1: finished ({p1 / 'checkpoints' / phase1_final}" in second.stderr  # not rerun
    assert len(_records(p1)) == phase1_lines == 6
    assert f"initialized weights from {p1 / 'checkpoints' / phase1_final / 'model.safetensors'}" in first
    assert f"resuming from {p2 / 'checkpoints'}" in second.stderr

    after = _records(p2)[len(before):]
    redone = {r["step"]: r["loss"] for r in after}
    overlap = [r for r in before if r["step"] in redone]
    lr1, lr2 = [r["lr"] for r in _records(p1)], [r["lr"] for r in _records(p2)]
    with safe_open(str(p2 / "checkpoints" / "step_00000002" / checkpoint.OPTIMIZER), framework="pt") as f:
        steps_at_2 = json.loads(f.metadata()["bert_ds"])["scalars"][0]["step"]["value"]
    print(f"phases: phase 1 (seq 64, 6 steps) then phase 2 (seq 128) from its final weights, fresh optimizer "
          f"(LAMB step count {steps_at_2} at phase-2 step 2) and re-warm-up (lr {lr1[-1]:.4g} -> {lr2[0]:.4g} -> "
          f"{max(lr2):.4g}); SIGKILL in phase 2 at step {before[-1]['step']}: rerun skipped phase 1 and resumed "
          f"phase 2 at step {after[0]['step']}; {sum(redone[r['step']] == r['loss'] for r in overlap)}/{len(overlap)} "
          f"redone steps identical")
    assert [r["step"] for r in _records(p2)[len(before):]][-1] == 6 and overlap
    assert all(redone[r["step"]] == r["loss"] for r in overlap)
    assert steps_at_2 == 2
    assert lr2[0] == pytest.approx(1e-2 / 4) and max(lr2) == pytest.approx(1e-2)  # warm-up again, 4 steps
    for phase, seq in ((p1, 64), (p2, 128)):  # each phase's folder: what its own model's kernels ran
        kernels = json.loads((phase / "kernels.json").read_text())
        assert (kernels["backend"], kernels["seq"]) == ("torch", seq)


def test_a_plan_ending_with_glue_squad_and_ner_exports_and_fine_tunes_after_its_last_phase(sample_data, tmp_path):
    """phase 1 -> phase 2 -> GLUE, SQuAD and NER is one command with one results folder; the
    stage's data is checked before the first phase, and a rerun keeps what is done."""
    from tests.bert_ds.test_glue import learnable_sst2
    from tests.bert_ds.test_ner import learnable_conll
    from tests.bert_ds.test_squad import learnable_squad

    learnable_sst2(tmp_path / "glue")
    learnable_squad(tmp_path / "squad", version="2.0", sizes=(64, 32))  # a quarter of them unanswerable
    learnable_conll(tmp_path / "conll", sizes=(64, 16, 0))  # no test split: it is optional
    root, config = tmp_path / "run", tmp_path / "plan.json"
    plan = _tiny_plan(sample_data, root)
    plan["evaluate"] = {"glue": {"data": str(tmp_path / "glue"), "tasks": ["rte"], "seeds": 1},
                        "squad": {"data": str(tmp_path / "squad"), "version": "1.1"}}
    config.write_text(json.dumps(plan))
    proc = run_cli("bert_ds.train.phases", "--config", str(config), check=False)
    assert proc.returncode == 2 and "no folder for rte" in proc.stderr and not root.exists()  # before phase 1
    plan["evaluate"]["glue"].update(tasks=["sst2"], lr=1e-3, epochs=1)
    config.write_text(json.dumps(plan))
    proc = run_cli("bert_ds.train.phases", "--config", str(config), check=False)
    assert proc.returncode == 2 and "no SQuAD data" in proc.stderr and not root.exists()  # v1.1 asked, v2.0 there

    plan["evaluate"]["squad"] = {"data": str(tmp_path / "squad"), "seeds": 1, "epochs": 1, "max_seq_length": 48,
                                 "doc_stride": 8}
    config.write_text(json.dumps(plan))
    proc = run_cli("bert_ds.train.phases", "--config", str(config), check=False)
    assert proc.returncode == 2 and "--max-query-length 64" in proc.stderr and not root.exists()  # 64 + 3 + 8 > 48
    plan["evaluate"]["squad"]["max_query_length"] = 24
    plan["evaluate"]["ner"] = {"data": str(tmp_path / "conll"), "seeds": 1, "epochs": 1, "max_seq_length": 32}
    plan["evaluate"]["retrieval"] = {"data": str(REPO / "tests" / "assets" / "retrieval" / "tiny-beir"), "seeds": 1,
                                     "max_seq_length": 32}
    config.write_text(json.dumps(plan))
    checked = run_cli("bert_ds.train.phases", "--config", str(config), "--check").stdout
    assert "then glue: sst2, seeds [1], recipe bert_paper" in checked and "then squad: v2.0, seeds [1]" in checked
    assert "then ner" in checked and "then retrieval: dev, test, seeds [1], recipe single_vector" in checked
    run_cli("bert_ds.train.phases", "--config", str(config))
    assert (root / "hf" / "config.json").is_file()
    report = json.loads((root / "glue" / "results.json").read_text())
    assert report["model"] == str((root / "hf").resolve()) and report["columns"]["sst2"]["seeds"] == 1
    squad = json.loads((root / "squad" / "results.json").read_text())
    assert squad["model"] == str((root / "hf").resolve()) and squad["version"] == "2.0"
    assert {"exact", "f1", "HasAns_exact", "NoAns_exact", "best_f1", "best_f1_thresh"} <= set(squad["figures"])
    ner = json.loads((root / "ner" / "results.json").read_text())
    assert ner["model"] == str((root / "hf").resolve()) and set(ner["columns"]) == {"dev"}
    retrieval = json.loads((root / "retrieval" / "results.json").read_text())
    assert retrieval["model"] == str((root / "hf").resolve()) and set(retrieval["columns"]) == {"dev", "test"}
    again = run_cli("bert_ds.train.phases", "--config", str(config))
    assert again.stdout.count("kept from an earlier run") == 4 and "finished" in again.stderr


@pytest.mark.parametrize("evaluate,message", [
    ({"glue": {"tasks": ["sst2"]}}, 'evaluate.glue must be an object with "data"'),
    ({"squad": {}}, 'evaluate.squad must be an object with "data"'),
    ({"mlm": {"data": "x"}}, '"evaluate" must be an object whose keys are of glue, squad, ner'),
    ({"ner": {"data": "x", "tasks": ["a"]}}, "evaluate.ner: unknown key(s) tasks"),
    ({"squad": {"data": "x", "version": "3"}}, 'evaluate.squad.version must be "1.1" or "2.0"'),
    ({"glue": {"data": "x", "seedz": 3}}, "evaluate.glue: unknown key(s) seedz"),
    ({"glue": {"data": "x", "seeds": "3"}}, "evaluate.glue.seeds must be an integer, got '3'"),
])
def test_a_bad_evaluate_stage_is_a_config_error(evaluate, message):
    d = json.loads((RECIPES / "tiny_two_phase.json").read_text())
    d["evaluate"] = evaluate
    with pytest.raises(ConfigError, match=re.escape(message)):
        PhasePlan.from_dict(d).evaluations()
