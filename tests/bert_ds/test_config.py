import dataclasses
import json

import pytest

from bert_ds.config import (BatchPlan, DataConfig, OptimConfig, TrainConfig, cpu_runs_bf16, deepspeed_config,
                            engine_json, machine_ds_config, precision_of, runs_bf16_copy, step_owns_gradients)
from bert_ds.base.errors import ConfigError
from bert_ds.model.families import model_preset


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(model=model_preset("tiny", 1000), data=DataConfig(train="x"), **kw)


@pytest.mark.parametrize("gbs,micro,world,accum", [(32, 32, 1, 1), (64, 8, 2, 4), (96, 4, 3, 8)])
def test_batch_plan_holds_the_identity(gbs, micro, world, accum):
    plan = BatchPlan.resolve(gbs, micro, world)
    assert plan.grad_accum == accum
    assert plan.global_batch_size == plan.micro_batch_size * plan.grad_accum * plan.world_size


@pytest.mark.parametrize("gbs, micro, world, hint", [
    (30, 4, 2, "a micro_batch_size that fits: 3 (--micro-batch-size)"),  # 15 per rank
    (16, 32, 1, "a micro_batch_size that fits: 16 (--micro-batch-size)"),
    (30, 4, 4, None),  # no micro-batch fits: the world size does not divide the batch
])
def test_batch_plan_rejects_indivisible_and_names_a_micro_batch_that_fits(gbs, micro, world, hint):
    with pytest.raises(ConfigError, match="not a multiple") as caught:
        BatchPlan.resolve(gbs, micro, world)
    assert (hint in str(caught.value)) if hint else "fits" not in str(caught.value)
    if hint:
        BatchPlan.resolve(gbs, int(hint.split(": ")[1].split()[0]), world)  # the hint holds


def test_deepspeed_config_gets_batch_and_clip_from_train_config():
    cfg = _cfg(global_batch_size=64, micro_batch_size=8, ds_config="zero2_bf16.json")
    ds = deepspeed_config(cfg, BatchPlan.resolve(64, 8, 2))
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (64, 8, 4)
    # ZeRO-2 in bf16: the training step clips (step_owns_gradients), DeepSpeed's threshold is 0
    assert ds["gradient_clipping"] == 0.0 and step_owns_gradients(ds) and cfg.optim.grad_clip == 1.0
    assert ds["zero_optimization"]["stage"] == 2
    assert precision_of(ds) == "bf16"


def test_deepspeed_json_may_not_set_derived_keys(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"train_batch_size": 8, "bf16": {"enabled": True}}))
    with pytest.raises(ConfigError, match="train_batch_size"):
        deepspeed_config(_cfg(ds_config=str(bad)), BatchPlan.resolve(32, 32, 1))


def test_unknown_ds_config_names_the_bundled_ones():
    with pytest.raises(ConfigError, match="zero1_bf16.json"):
        _cfg(ds_config="zero9.json")


@pytest.mark.parametrize("kw,field", [
    ({"max_seq_length": 4}, "max_seq_length"), ({"mask_rate": 0.0}, "mask_rate"),
    ({"pair_task": "xyz"}, "pair_task"), ({"short_seq_prob": 2.0}, "short_seq_prob"),
])
def test_data_config_validation(kw, field):
    with pytest.raises(ConfigError, match=field):
        DataConfig(train="x", **kw)


def test_a_dataset_given_twice_or_as_both_training_and_held_out_data_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"train: ./data/a is given twice"):
        DataConfig(train=["data/a", "data/b", "./data/a"])  # the same folder, however written
    with pytest.raises(ConfigError, match="val: data/b/ is also a training dataset"):
        DataConfig(train=["data/a", "data/b"], val="data/b/")
    assert DataConfig(train=["data/a", "data/b"], val="data/c").val == "data/c"


@pytest.mark.parametrize("kw,field", [({"lr": 0}, "lr"), ({"decay": "cosine"}, "decay"), ({"betas": (0.9, 1.5)}, "betas")])
def test_optim_config_validation(kw, field):
    with pytest.raises(ConfigError, match=field):
        OptimConfig(**kw)


INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("kw,field", [
    ({"lr": INF}, "lr"), ({"lr": 1e300}, "lr"), ({"lr": NAN}, "lr"), ({"weight_decay": INF}, "weight_decay"),
    ({"weight_decay": 2.0}, "weight_decay"), ({"eps": INF}, "eps"), ({"betas": (0.9, NAN)}, "betas"),
    ({"grad_clip": INF}, "grad_clip"), ({"poly_power": INF}, "poly_power"),
])
def test_r16_hyperparameters_must_be_finite_and_in_range(kw, field):
    with pytest.raises(ConfigError, match=f"^{field}: must be"):
        OptimConfig(**kw)


def test_r16_a_non_finite_learning_rate_is_one_line_before_training(sample_data, tmp_path):
    from tests.conftest import run_cli

    proc = run_cli("bert_ds.train", "--data", str(sample_data["train"]), "--output", str(tmp_path / "run"),
                   "--preset", "tiny", "--lr", "inf", check=False, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "error: lr: must be a finite number in (0, 10], got inf"
    assert not (tmp_path / "run").exists()


def test_seq_len_beyond_position_table_is_rejected():
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        TrainConfig(model=model_preset("tiny", 1000), data=DataConfig(train="x", max_seq_length=1024))


def test_train_config_round_trips_through_dict():
    cfg = _cfg(steps=7)
    again = TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    with pytest.raises(ConfigError, match="unknown TrainConfig"):
        TrainConfig.from_dict({**cfg.to_dict(), "stepz": 3})


@pytest.mark.parametrize("ds_config,message", [("zero3_bf16.json", "not 3"), ("zero0_bf16.json", "stage 0 is fp32 only")])
def test_lamb_refuses_engine_layouts_it_cannot_be_exact_under(ds_config, message):
    cfg = _cfg(ds_config=ds_config, optim=OptimConfig(name="lamb"))
    with pytest.raises(ConfigError, match=message):
        deepspeed_config(cfg, BatchPlan.resolve(32, 32, 1))
    cfg.optim = OptimConfig(name="adamw")
    assert deepspeed_config(cfg, BatchPlan.resolve(32, 32, 1))["zero_allow_untested_optimizer"] is True


def test_compiled_layers_refuse_zero3():
    cfg = _cfg(ds_config="zero3_bf16.json", optim=OptimConfig(name="adamw"))
    cfg.model = dataclasses.replace(cfg.model, compile_layers=True)
    with pytest.raises(ConfigError, match="--compile-layers supports ZeRO stages 0-2, not 3"):
        deepspeed_config(cfg, BatchPlan.resolve(32, 32, 1))
    cfg.ds_config = "zero2_bf16.json"
    assert deepspeed_config(cfg, BatchPlan.resolve(32, 32, 1))["zero_optimization"]["stage"] == 2


@pytest.mark.parametrize("name,owned", [("zero1_bf16.json", True), ("zero2_bf16.json", True),
                                        ("zero1_fp32.json", True), ("zero0_fp32.json", True),
                                        ("zero1_fp16.json", False), ("zero3_bf16.json", False)])
def test_deepspeed_config_turns_off_the_per_step_syncs(name, owned):
    ds = deepspeed_config(_cfg(ds_config=name, optim=OptimConfig(name="adamw", grad_clip=0.5)),
                          BatchPlan.resolve(32, 32, 1))
    # DeepSpeed's throughput timer synchronises the device twice a step; bert-ds times itself.
    assert ds["timers"] == {"throughput": {"enabled": False}}
    # ZeRO-0 in fp32, ZeRO-1/2 in bf16 or fp32: the step checks, measures and clips the gradients itself
    assert step_owns_gradients(ds) is owned
    assert ds["gradient_clipping"] == (0.0 if owned else 0.5)
    if ds["zero_optimization"]["stage"] == 0:  # no DeepSpeed wrapper: nothing of its own to turn off
        assert "compute_grad_norm" not in ds["zero_optimization"] and "bf16" not in ds
        return
    assert ds["zero_optimization"].get("compute_grad_norm", True) is not owned
    if precision_of(ds) == "bf16":
        assert ds["bf16"].get("check_grad_overflow", True) is not owned


@pytest.mark.parametrize("name,copy", [("zero1_bf16.json", True), ("zero2_bf16.json", True),
                                       ("zero1_fp32.json", False), ("zero0_bf16.json", False),
                                       ("zero1_fp16.json", False), ("zero3_bf16.json", False)])
def test_bf16_with_fp32_sums_on_zero1_2_runs_a_bf16_copy_on_an_fp32_engine(name, copy):
    ds = deepspeed_config(_cfg(ds_config=name, optim=OptimConfig(name="adamw")), BatchPlan.resolve(32, 32, 1))
    assert runs_bf16_copy(ds) is copy
    engine = engine_json(ds)
    if not copy:
        assert engine is ds  # DeepSpeed runs the config as it is
        return
    # DeepSpeed holds and steps fp32 weights (DeepSpeedZeroOptimizer, its checks off); bert-ds runs bf16
    assert precision_of(ds) == "bf16" and precision_of(engine) == "fp32"
    assert "data_types" not in engine and engine["zero_optimization"]["compute_grad_norm"] is False
    assert step_owns_gradients(engine) and engine["gradient_clipping"] == 0.0


def test_a_bf16_config_that_keeps_deepspeeds_checks_runs_on_deepspeeds_wrapper(tmp_path):
    own = tmp_path / "own.json"
    own.write_text(json.dumps({"zero_optimization": {"stage": 1, "compute_grad_norm": True}, "bf16": {"enabled": True},
                               "data_types": {"grad_accum_dtype": "fp32"}}))
    ds = deepspeed_config(_cfg(ds_config=str(own)), BatchPlan.resolve(32, 32, 1))
    assert not step_owns_gradients(ds) and not runs_bf16_copy(ds) and engine_json(ds) is ds


def test_deepspeed_config_keeps_a_users_own_timers_and_checks(tmp_path):
    own = tmp_path / "own.json"
    own.write_text(json.dumps({"zero_optimization": {"stage": 1}, "bf16": {"enabled": True, "check_grad_overflow": True},
                               "timers": {"throughput": {"enabled": True, "synchronized": False}}}))
    ds = deepspeed_config(_cfg(ds_config=str(own)), BatchPlan.resolve(32, 32, 1))
    assert ds["timers"] == {"throughput": {"enabled": True, "synchronized": False}}
    assert ds["bf16"]["check_grad_overflow"] is True and not step_owns_gradients(ds)
    assert ds["gradient_clipping"] == 1.0 and "compute_grad_norm" not in ds["zero_optimization"]


def test_a_norm_off_with_the_overflow_check_on_is_refused(tmp_path):
    own = tmp_path / "own.json"
    own.write_text(json.dumps({"zero_optimization": {"stage": 1, "compute_grad_norm": False},
                               "bf16": {"enabled": True, "check_grad_overflow": True}}))
    with pytest.raises(ConfigError, match="compute_grad_norm false needs bf16.check_grad_overflow false"):
        deepspeed_config(_cfg(ds_config=str(own)), BatchPlan.resolve(32, 32, 1))


# -- the engine JSON of a run that names none -------------------------------------------------

def _cpuinfo(tmp_path, flags: str):
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nflags\t\t: fpu sse2 avx2 {flags}\n\nprocessor\t: 1\nflags\t\t: fpu {flags}\n")
    return path


@pytest.mark.parametrize("flags,cuda,expected", [
    ("avx512f avx512_bf16", False, "zero1_bf16.json"),
    ("amx_bf16 amx_tile", False, "zero1_bf16.json"),
    ("avx512f avx512_vnni", False, "zero1_fp32.json"),  # no bf16 instructions: emulated bf16 is ~7x slower
    ("", False, "zero1_fp32.json"),
    ("", True, "zero1_bf16.json"),  # a GPU trains in bf16 whatever its host CPU
])
def test_the_machine_default_is_fp32_only_on_a_cpu_without_bf16(tmp_path, flags, cuda, expected):
    assert machine_ds_config(cuda, _cpuinfo(tmp_path, flags)) == expected


def test_unreadable_cpu_flags_keep_the_stated_default(tmp_path):
    assert cpu_runs_bf16(tmp_path / "missing")
    assert machine_ds_config(False, tmp_path / "missing") == TrainConfig.ds_config


def test_a_given_ds_config_wins_then_the_checkpoints_then_the_machines(monkeypatch):
    from bert_ds.train import cli

    monkeypatch.setattr(cli, "machine_ds_config", lambda cuda: "zero1_fp32.json" if not cuda else "zero1_bf16.json")
    given = cli.parse_args(["--data", "d", "--ds-config", "zero2_bf16.json"])
    plain = cli.parse_args(["--data", "d"])
    assert cli.ds_config_from_args(given, "zero1_bf16.json", cuda=False) == ("zero2_bf16.json", "")
    assert cli.ds_config_from_args(plain, "zero1_bf16.json", cuda=False) == ("zero1_bf16.json", "")  # a resume's own
    chosen, note = cli.ds_config_from_args(plain, None, cuda=False)
    assert chosen == "zero1_fp32.json" and "this CPU has no bf16 instructions" in note and "\n" not in note
    assert cli.ds_config_from_args(plain, None, cuda=True) == ("zero1_bf16.json", "")
    # config_from_args puts it into the run's config; without one it is TrainConfig's default
    from_data = {"vocab_size": 1000, "pad_token_id": 0}
    assert cli.config_from_args(plain, from_data, ds_config="zero1_fp32.json").ds_config == "zero1_fp32.json"
    assert cli.config_from_args(plain, from_data).ds_config == TrainConfig.ds_config


def test_a_new_model_pads_with_the_tokenizers_pad_and_a_resumed_one_keeps_its_own():
    from bert_ds.train import cli

    args = cli.parse_args(["--data", "d", "--preset", "tiny"])
    # a tokenizer whose [PAD] is 3, as the manifest says (Manifest.model_fields)
    from_data = {"vocab_size": 1000, "pad_token_id": 3, "cls_token_id": 1, "sep_token_id": 2, "mask_token_id": 4}
    fresh = cli.model_from_args(args, from_data, None)
    assert (fresh.vocab_size, fresh.pad_token_id, fresh.cls_token_id, fresh.sep_token_id, fresh.mask_token_id) == (
        1000, 3, 1, 2, 4)
    # a run saved with another row and no other ids (before the tokenizer's were taken) resumes with them
    saved = {k: v for k, v in fresh.to_dict().items() if k not in ("cls_token_id", "sep_token_id", "mask_token_id")}
    saved["pad_token_id"] = 0
    for resumed in (cli.model_from_args(args, from_data, saved),
                    cli.model_from_args(cli.parse_args(["--data", "d"]), from_data, saved)):
        assert (resumed.pad_token_id, resumed.cls_token_id, resumed.mask_token_id) == (0, None, None)
