"""A tiny ModernBERT-class model trained through DeepSpeed on the bundled sample (byte-level BPE
shards, whole documents packed to a token budget, 30% masking, no pair task): it learns (the
held-out MLM accuracy three times the unigram baseline, the share of the most frequent token),
and a run killed with SIGKILL resumes from its last checkpoint with the losses of the run that
was never killed, bit for bit (same machine, same world size)."""

from __future__ import annotations

import json
import signal
from collections import Counter
from pathlib import Path

import pytest

from bert_ds.data_tools.manifest import Manifest, open_dataset
from tests.bert_ds.test_reliability import _losses, _start, _wait_for_step
from tests.conftest import SAMPLE, run_cli

pytestmark = pytest.mark.long

STEPS = 120


def _args(data: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return ["bert_ds.train", "--data", str(data["train"]), "--val-data", str(data["heldout"]), "--output", str(out),
            "--preset", "modernbert-tiny", "--seq-len", "128", "--micro-batch-size", "16",
            "--global-batch-size", "16", "--steps", str(STEPS), "--lr", "5e-2", "--warmup-steps", "10",
            "--ds-config", "zero1_fp32.json", "--val-samples", "256", "--no-progress", "--no-tensorboard",
            "--num-workers", "0", *extra]


def _unigram_baseline(folder: Path) -> float:
    """The accuracy of always predicting the held-out set's most frequent non-special token."""
    manifest, readers = open_dataset(folder)
    special = set(manifest.special_tokens.values())
    counts = Counter(token for reader in readers for token in reader.tokens.tolist())
    regular = {token: n for token, n in counts.items() if token not in special}
    return max(regular.values()) / sum(regular.values())


def test_a_tiny_modernbert_learns_and_resumes_exactly_after_a_kill(sample_bpe_data, tmp_path):
    whole = tmp_path / "whole"
    proc = run_cli(*_args(sample_bpe_data, whole))
    assert "modernbert" in json.loads((whole / "train_config.json").read_text())["model"]["arch"]
    assert "nsp_acc=" not in proc.stderr + proc.stdout  # no pair task, no NaN printed for it
    val = json.loads((whole / "summary.json").read_text())["val"]
    baseline = _unigram_baseline(sample_bpe_data["heldout"])
    print(f"\nheld-out MLM accuracy after {STEPS} steps {val['mlm_acc']:.3f}, unigram baseline {baseline:.3f}")
    assert val["mlm_acc"] > 3 * baseline, (val, baseline)
    # The padding row is the tokenizer's [PAD] (3 here), not id 0 ([UNK]), in the run and in its export
    from transformers import AutoTokenizer

    from bert_ds.checkpoint.export import export_checkpoint

    special = Manifest.load(sample_bpe_data["train"]).special_tokens
    names = {"pad_token_id": "pad", "cls_token_id": "cls", "sep_token_id": "sep", "mask_token_id": "mask"}
    model = json.loads((whole / "train_config.json").read_text())["model"]
    assert {name: model[name] for name in names} == {name: special[key] for name, key in names.items()}
    assert special["pad"] == 3
    export = export_checkpoint(whole / "checkpoints", tmp_path / "export")
    written, tokenizer = json.loads((export / "config.json").read_text()), AutoTokenizer.from_pretrained(export)
    for name in ("pad_token_id", "cls_token_id", "sep_token_id"):
        assert written[name] == getattr(tokenizer, name) == model[name], name

    killed = tmp_path / "killed"
    args = _args(sample_bpe_data, killed, "--save-every", "40")
    proc = _start(args, log=tmp_path / "killed.log")
    _wait_for_step(killed, 55, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    run_cli(*args, "--exit-after", "20")  # from the checkpoint of step 40 to step 60
    got, reference = _losses(killed), _losses(whole)
    assert max(got) == 60 and all(got[step] == reference[step] for step in range(1, 61)), (got, reference)


def _modernbert_folder(folder: Path, tokenizer: Path, vocab_size: int):
    """A ModernBertForMaskedLM at random init as transformers saves it, with the shards' tokenizer,
    its embedding rows ``vocab_size`` (as many as the tokenizer's ids, or more, as ModernBERT pads)."""
    import shutil

    import torch
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    torch.manual_seed(0)
    config = ModernBertConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                              num_attention_heads=2, max_position_embeddings=256, local_attention=16,
                              pad_token_id=3, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
    model = ModernBertForMaskedLM(config)
    torch.nn.init.normal_(model.decoder.bias, std=3.0)  # token preferences a fresh model lacks
    model.save_pretrained(folder)
    for file in tokenizer.iterdir():
        shutil.copy(file, folder / file.name)
    return model


def _continue_from_a_folder(data: Path, tokenizer: Path, vocab_size: int, tmp_path: Path):
    """--init-from a ModernBERT folder (no --preset: the shape from its config.json) for two steps:
    the export loads back with no missing or unexpected keys. Returns the run's config, the first
    batch, the first step's loss (before any update) and transformers' on that batch."""
    import torch
    from transformers import AutoModelForMaskedLM

    from bert_ds.checkpoint import hf_import
    from bert_ds.checkpoint.export import export_checkpoint
    from bert_ds.config import BatchPlan
    from bert_ds.loader.pretraining import PretrainingLoader, open_pretraining_data
    from bert_ds.train import cli as train

    hf = tmp_path / "hf"
    source = _modernbert_folder(hf, tokenizer, vocab_size).eval()
    args = ["--data", str(data), "--output", str(tmp_path / "run"), "--init-from", str(hf),
            "--steps", "2", "--seq-len", "64", "--global-batch-size", "8", "--micro-batch-size", "8",
            "--ds-config", "zero0_fp32.json", "--held-out", "0", "--no-progress", "--no-tensorboard",
            "--num-workers", "0"]
    run_cli("bert_ds.train", *args)

    parsed = train.parse_args(args)
    from_data = Manifest.load(data).model_fields()
    cfg = train.config_from_args(parsed, from_data, None, hf_import.open_source(hf))
    assert (cfg.model.arch, cfg.model.vocab_size, cfg.data.layout, cfg.data.mask_rate) == (
        "modernbert", vocab_size, "documents", 0.3)
    assert cfg.model.pad_token_id == from_data["pad_token_id"] == 3  # the tokenizer's
    stream, _ = open_pretraining_data(cfg.data, cfg.seed)
    batch = PretrainingLoader(stream, BatchPlan.resolve(8, 8, 1), rank=0).next_step()[0]
    with torch.no_grad():
        theirs = source(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        labels=batch["labels"]).loss.item()
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    print(f"\nfirst loss {first['loss']!r}, transformers' {theirs!r}: {abs(first['loss'] - theirs):.2e} apart")
    assert first["step"] == 1

    out = export_checkpoint(tmp_path / "run" / "checkpoints", tmp_path / "export")
    loaded, info = AutoModelForMaskedLM.from_pretrained(out, output_loading_info=True)
    assert type(loaded).__name__ == "ModernBertForMaskedLM" and loaded.config.vocab_size == vocab_size
    assert not any(info.values()), info
    return cfg, batch, first["loss"], theirs


@pytest.mark.parametrize("vocab_size", [4096, 4160], ids=["its-tokenizer's-ids", "padded-embedding"])
def test_continued_pretraining_of_a_modernbert_folder_starts_from_its_loss(sample_bpe_data, tmp_path, vocab_size):
    cfg, _, ours, theirs = _continue_from_a_folder(sample_bpe_data["train"], sample_bpe_data["tokenizer"], vocab_size,
                                                   tmp_path)
    assert cfg.model.vocab_size == vocab_size and abs(ours - theirs) <= 1e-5, (ours, theirs)  # fp32 both


MMBERT_VOCAB = 256_000  # mmBERT's Gemma-2 vocabulary: token ids past uint16


def _widened(tokenizer: Path, folder: Path, size: int) -> Path:
    """``tokenizer`` (a byte-level BPE) with ``size`` entries: its special tokens keep their ids, its
    other tokens move to the top of the range (ids past 65,535), and unused entries fill the gap,
    as a large multilingual vocabulary's rare rows do. It tokenizes text as before, into other ids."""
    import shutil

    folder.mkdir()
    for file in tokenizer.iterdir():
        shutil.copy(file, folder / file.name)
    spec = json.loads((tokenizer / "tokenizer.json").read_text())
    special = {t["id"] for t in spec["added_tokens"]}
    vocab = spec["model"]["vocab"]
    regular = sorted((i, token) for token, i in vocab.items() if i not in special)
    top = size - len(regular)
    widened = {token: i for token, i in vocab.items() if i in special}
    widened.update({token: top + n for n, (_, token) in enumerate(regular)})
    widened.update({f"<unused{i}>": i for i in range(max(special) + 1, top)})
    assert sorted(widened.values()) == list(range(size))
    spec["model"]["vocab"] = widened
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


def test_an_mmbert_sized_vocabulary_trains_from_uint32_shards(sample_bpe_data, tmp_path):
    """A 256k-entry BPE (mmBERT's size): its shards hold uint32 ids past 65,535, a ModernBERT folder of
    that vocabulary continues from them with transformers' first loss, and its export loads back."""
    from transformers import AutoTokenizer

    from bert_ds.data_tools.shard_format import ShardReader

    tokenizer = _widened(sample_bpe_data["tokenizer"], tmp_path / "tokenizer", MMBERT_VOCAB)
    assert len(AutoTokenizer.from_pretrained(tokenizer)) == MMBERT_VOCAB
    data = tmp_path / "shards"
    text = tmp_path / "text.txt"  # a fifth of the sample: enough for two steps of 8 x 64 tokens
    lines = (SAMPLE / "valid.txt").read_text(encoding="utf-8").splitlines(keepends=True)
    text.write_text("".join(lines[: len(lines) // 5]), encoding="utf-8")
    run_cli("bert_ds.data_tools", "build", "--input", str(text), "--output", str(data), "--tokenizer",
            str(tokenizer), "--workers", "1")
    manifest = Manifest.load(data)
    assert (manifest.vocab_size, manifest.token_dtype) == (MMBERT_VOCAB, "uint32")
    tokens = ShardReader(data / manifest.shards[0].name).tokens
    assert tokens.dtype.itemsize == 4 and int(tokens.max()) > 65_535
    cfg, batch, ours, theirs = _continue_from_a_folder(data, tokenizer, MMBERT_VOCAB, tmp_path)
    assert abs(ours - theirs) <= 1e-5, (ours, theirs)  # fp32 both
    assert int(batch["input_ids"].max()) > 65_535  # the batch the loss was compared on reaches past uint16


def test_a_bert_run_refuses_a_modernbert_folder_and_a_run_of_one_family_refuses_to_resume_as_the_other(
        sample_bpe_data, tmp_path):
    hf = tmp_path / "hf"
    _modernbert_folder(hf, sample_bpe_data["tokenizer"], 4096)
    common = ["bert_ds.train", "--data", str(sample_bpe_data["train"]), "--steps", "1", "--seq-len", "64",
              "--global-batch-size", "8", "--micro-batch-size", "8", "--ds-config", "zero0_fp32.json",
              "--no-progress", "--no-tensorboard", "--num-workers", "0"]
    proc = run_cli(*common, "--output", str(tmp_path / "a"), "--init-from", str(hf), "--preset", "tiny",
                   "--pair-task", "none", "--layout", "documents", check=False)
    assert proc.returncode == 2 and not (tmp_path / "a").exists()
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --preset tiny is a bert model, but"), proc.stderr

    run_cli(*common, "--output", str(tmp_path / "b"), "--preset", "modernbert-tiny")
    proc = run_cli(*common, "--output", str(tmp_path / "b"), "--steps", "2", "--preset", "tiny", "--pair-task", "none",
                   "--layout", "documents", check=False)
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: cannot resume") and "model.arch: saved modernbert, requested bert" in line, line
