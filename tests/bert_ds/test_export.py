"""bert_ds.checkpoint.export: checkpoint folder -> Hugging Face folder that loads and reproduces the model."""

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from bert_ds.checkpoint import store as checkpoint
from bert_ds.model.bert.hf import HF as BERT
from bert_ds.checkpoint import export
from bert_ds.base.errors import ConfigError, UserError
from bert_ds.checkpoint.export import ExportError, export_checkpoint, export_hf, main
from bert_ds.model.bert.model import BertForPreTraining
from bert_ds.model.bert.config import ModelConfig
from bert_ds.base.atomic import file_crc32

pytestmark = pytest.mark.lowest  # all of it also runs under the lowest supported torch (run.sh test-lowest)

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat", "##s", "a", "dog"]


def _config(**overrides) -> ModelConfig:
    values = dict(vocab_size=len(WORDS) + 3,  # padded past the tokenizer, as vocabularies often are
                  hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                  max_position_embeddings=32, kernels="torch")
    return ModelConfig(**{**values, **overrides})


def _write_checkpoint(path, config: ModelConfig, *, with_tied_alias: bool = False) -> BertForPreTraining:
    torch.manual_seed(0)
    model = BertForPreTraining(config)
    path.mkdir(parents=True)
    state = model.state_dict()
    # safetensors refuses shared tensors, so a saver either drops the aliases or stores copies.
    weights = {name: tensor.clone() for name, tensor in state.items()
               if with_tied_alias or name not in BERT.tied_aliases}
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "model_config.json").write_text(json.dumps(config.to_dict()))
    tokenizer = transformers.BertTokenizerFast(vocab={word: i for i, word in enumerate(WORDS)})
    tokenizer.save_pretrained(path / "tokenizer")
    _seal(path)
    return model


def _seal(folder):
    """The completion marker bert_ds.checkpoint.store writes last: size and CRC32 of every file."""
    files = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "crc32": file_crc32(p)}
             for p in sorted(folder.rglob("*")) if p.is_file()}
    (folder / checkpoint.MARKER).write_text(json.dumps({"files": files}))


@pytest.mark.parametrize("with_tied_alias", [False, True])
def test_export_loads_in_transformers_with_same_logits(tmp_path, with_tied_alias):
    ours = _write_checkpoint(tmp_path / "ckpt", _config(), with_tied_alias=with_tied_alias)
    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")

    assert out == tmp_path / "hf"
    hf_config = json.loads((out / "config.json").read_text())
    assert hf_config["architectures"] == ["BertForPreTraining"]
    assert hf_config["hidden_act"] == "gelu" and hf_config["num_hidden_layers"] == 2
    assert "cls.predictions.decoder.weight" not in load_file(out / "model.safetensors")

    theirs = transformers.BertForPreTraining.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    enc = tokenizer(["the cats sat", "a dog sat on the mat"], ["the mat", "a cat"],
                    padding=True, return_tensors="pt")
    assert (enc["input_ids"] != tokenizer.unk_token_id).all()  # the vocabulary came along
    # The tokenizer knows how long an input the model takes: truncation stops at its positions.
    assert tokenizer.model_max_length == 32
    assert len(tokenizer(" ".join(["cat"] * 100), truncation=True)["input_ids"]) == 32
    with torch.no_grad():
        our_out = ours.eval()(enc["input_ids"], enc["token_type_ids"], enc["attention_mask"])
        their_out = theirs(**enc)
    real = enc["attention_mask"].bool()
    torch.testing.assert_close(our_out.mlm_logits, their_out.prediction_logits[real], rtol=0, atol=1e-5)
    torch.testing.assert_close(our_out.nsp_logits, their_out.seq_relationship_logits, rtol=0, atol=1e-5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf"]  # no temporary folders left


@pytest.mark.parametrize("umask,file_mode,dir_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)])
def test_export_follows_the_umask(tmp_path, umask, file_mode, dir_mode):
    """A teammate can read an export exactly as far as the exporter's umask allows."""
    import os

    _write_checkpoint(tmp_path / "ckpt", _config())
    old = os.umask(umask)
    try:
        out = export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == dir_mode
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == {p.name: file_mode for p in out.iterdir()}


def test_export_follows_latest_link_and_replaces_earlier_export(tmp_path):
    _write_checkpoint(tmp_path / "step-1", _config())
    (tmp_path / "latest").symlink_to(tmp_path / "step-1")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_text("stale")
    export_checkpoint(tmp_path / "latest", out)
    assert json.loads((out / "config.json").read_text())["model_type"] == "bert"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "latest", "step-1"]


def test_export_refuses_to_replace_a_folder_that_is_not_an_export(tmp_path):
    _write_checkpoint(tmp_path / "ckpt", _config())
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("precious")
    with pytest.raises(ExportError, match="not an earlier export"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "notes")
    assert (tmp_path / "notes" / "keep.txt").read_text() == "precious"


def test_export_that_does_not_round_trip_is_never_published(tmp_path, monkeypatch):
    """A wrong config.json (LayerNorm eps 1.0 instead of 1e-12) changes the logits: the export must fail."""
    _write_checkpoint(tmp_path / "ckpt", _config())
    wrong = export.to_hf_config(_config(layer_norm_eps=1.0))
    monkeypatch.setattr(export, "to_hf_config", lambda config: wrong)
    with pytest.raises(ExportError, match="does not reproduce"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def _earlier_export_then_main(tmp_path, monkeypatch, name: str, interrupt) -> tuple[int, Path]:
    """An export at hf, a second checkpoint, and the CLI exporting it with ``interrupt``
    patched in for ``NAME`` of the export module (a Ctrl-C there); its exit status and hf."""
    _write_checkpoint(tmp_path / "ckpt", _config())
    export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    _write_checkpoint(tmp_path / "ckpt2", _config(initializer_range=0.5))
    monkeypatch.setattr(f"{export.__name__}.{name}", interrupt)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's, whatever the test runner set
    try:
        return main([str(tmp_path / "ckpt2"), str(tmp_path / "hf")]), tmp_path / "hf"
    except KeyboardInterrupt:  # not the test session's end: a failure of this test
        pytest.fail("a Ctrl-C during the export left main() as a KeyboardInterrupt")
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_during_the_export_is_one_line_and_keeps_the_earlier_export(tmp_path, monkeypatch, capsys):
    def ctrl_c(*args):
        raise KeyboardInterrupt

    status, hf = _earlier_export_then_main(tmp_path, monkeypatch, "_check_round_trip", ctrl_c)
    assert status == 130
    err = capsys.readouterr().err  # the line, and no loading bar of transformers' before it
    assert err.endswith(f"\ninterrupted: {hf} holds no partial export (an earlier one is replaced only by a "
                        "complete one)\n") and "Traceback" not in err and "Loading" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "ckpt2", "hf"]  # no temporary folder left
    assert load_file(str(hf / "model.safetensors"))["bert.pooler.dense.weight"].std() < 0.1  # the first (0.02)


def test_a_ctrl_c_while_an_export_replaces_another_waits_for_the_old_one_to_be_gone(tmp_path, monkeypatch, capsys):
    """The old export is set aside, the new one moved in, the old one deleted: a Ctrl-C there
    comes after the deletion, so no half-deleted folder stays beside the export."""
    rmtree = shutil.rmtree

    def ctrl_c_then_rmtree(path, *args, **kwargs):
        if ".old-" in Path(path).name:
            os.kill(os.getpid(), signal.SIGINT)
        rmtree(path, *args, **kwargs)

    status, hf = _earlier_export_then_main(tmp_path, monkeypatch, "shutil.rmtree", ctrl_c_then_rmtree)
    assert status == 130
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"interrupted: {hf} holds no partial export")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "ckpt2", "hf"]
    assert load_file(str(hf / "model.safetensors"))["bert.pooler.dense.weight"].std() > 0.3  # the new one (0.5)


def test_export_rejects_untied_decoder(tmp_path):
    config = _config()
    state = BertForPreTraining(config).state_dict()
    state = {name: tensor.clone() for name, tensor in state.items()}
    state["cls.predictions.decoder.weight"] += 1.0
    with pytest.raises(ExportError, match="cls.predictions.decoder.weight differs"):
        export_hf(state, config, None, tmp_path / "hf")


def test_export_rejects_state_dict_of_another_shape(tmp_path):
    state = BertForPreTraining(_config(hidden_size=64)).state_dict()
    with pytest.raises(ExportError, match="shape"):
        export_hf(state, _config(), None, tmp_path / "hf")
    state = BertForPreTraining(_config(num_layers=3)).state_dict()
    with pytest.raises(ExportError, match="unexpected.*layer.2"):
        export_hf(state, _config(), None, tmp_path / "hf")


def test_export_refuses_pre_layernorm(tmp_path):
    config = _config(pre_layernorm=True)
    with pytest.raises(ConfigError, match="pre-LN"):
        export_hf(BertForPreTraining(config).state_dict(), config, None, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("missing", ["model.safetensors", "model_config.json", "tokenizer"])
def test_export_names_the_missing_file(tmp_path, missing):
    _write_checkpoint(tmp_path / "ckpt", _config())
    target = tmp_path / "ckpt" / missing
    if target.is_dir():
        for child in target.iterdir():
            child.unlink()
        target.rmdir()
    else:
        target.unlink()
    with pytest.raises(UserError, match=missing):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")


def test_cli_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as caught:
        main(["--help"])
    assert caught.value.code == 0
    assert "CHECKPOINT_DIR" in capsys.readouterr().out


def test_cli_missing_checkpoint_is_a_one_line_error(tmp_path, capsys):
    assert main([str(tmp_path / "nope"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert "nope" in err


def test_cli_exports(tmp_path, capsys):
    _write_checkpoint(tmp_path / "ckpt", _config())
    assert main([str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    out, err = capsys.readouterr()
    assert "exported" in out and err == ""  # nothing of transformers' loading (its bar, its report)


def test_cli_exports_the_newest_checkpoint_of_a_run_folder_and_names_it(tmp_path, capsys):
    run = tmp_path / "run"
    for step in (1, 2):
        _write_checkpoint(run / "checkpoints" / f"step_{step:08d}", _config())
    (run / "checkpoints" / "latest").symlink_to("step_00000002")
    (run / "metrics.jsonl").write_text("")
    for given, shown in ((run, f"exported {run} (step_00000002) to "),
                         (run / "checkpoints" / "latest", f"exported {run / 'checkpoints' / 'latest'} to ")):
        assert main([str(given), str(tmp_path / "hf")]) == 0
        assert capsys.readouterr().out == f"{shown}{tmp_path / 'hf'}\n"
    assert (tmp_path / "hf" / "config.json").is_file()


def test_export_refuses_a_damaged_or_unsealed_checkpoint(tmp_path):
    _write_checkpoint(tmp_path / "ckpt", _config())
    weights = tmp_path / "ckpt" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(UserError, match="model.safetensors: checksum mismatch"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    (tmp_path / "ckpt" / checkpoint.MARKER).unlink()
    with pytest.raises(UserError, match="no complete checkpoint"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
