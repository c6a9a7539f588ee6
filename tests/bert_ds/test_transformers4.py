"""Exports read the same by transformers 4 and 5, and ``--init-from`` reads a folder either wrote.

transformers 4.57 (what sentence-transformers, text-embeddings-inference and most deployed code
still load with) reads neither ``layer_types`` nor ``rope_parameters``: without its own keys beside
them it would take a global rotary base of 160,000 whatever the model trained with, and it refuses a
tokenizer folder naming transformers 5's ``TokenizersBackend``. ``./run.sh test`` installs
transformers 4 beside ``.venv`` (``requirements-transformers4.txt``) and names it in
``BERT_DS_TRANSFORMERS4``; each side runs ``transformers4_probe.py`` in its own process, with that
folder first on ``PYTHONPATH`` or not, on the same folder and text.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bert_ds.checkpoint.export import ROUND_TRIP_TOLERANCE, export_hf
from bert_ds.checkpoint.hf_import import match, model_config, open_source, read_state
from bert_ds.model.build import build_model
from bert_ds.model.families import family_of, model_preset
from bert_ds.model.hf import relative_gap
from bert_ds.model.padding import gather_tokens, unpad
from tests.conftest import make_bpe_tokenizer

PROBE = Path(__file__).with_name("transformers4_probe.py")
TEXT = ["the european lobster is a species of clawed lobster from the eastern atlantic ocean"] * 20


@pytest.fixture(scope="module")
def transformers4() -> Path:
    where = os.environ.get("BERT_DS_TRANSFORMERS4")
    if not where:
        pytest.skip("transformers 4 is installed beside .venv by ./run.sh test (BERT_DS_TRANSFORMERS4 names it)")
    assert (Path(where) / "transformers" / "__init__.py").is_file(), f"BERT_DS_TRANSFORMERS4={where} holds no transformers"
    return Path(where)


def _probe(mode: str, folder: Path, out: Path, transformers4: Path | None) -> dict:
    """The probe's figures under transformers 4 (``transformers4``: its folder) or .venv's own 5."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if transformers4 is not None:
        env["PYTHONPATH"] = str(transformers4)
    proc = subprocess.run([sys.executable, str(PROBE), mode, str(folder), str(out)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(out) as npz:
        return {"ids": npz["ids"], "mask": npz["mask"], "logits": npz["logits"], "said": json.loads(str(npz["said"]))}


def _same_reading(folder: Path, tmp_path: Path, transformers4: Path) -> tuple[dict, dict]:
    four = _probe("read", folder, tmp_path / "four.npz", transformers4)
    five = _probe("read", folder, tmp_path / "five.npz", None)
    assert np.array_equal(four["ids"], five["ids"]) and np.array_equal(four["mask"], five["mask"])
    gap = relative_gap(torch.from_numpy(four["logits"]), torch.from_numpy(five["logits"]))
    assert gap <= ROUND_TRIP_TOLERANCE, gap
    return four["said"], five["said"]


def test_a_modernbert_export_reads_the_same_in_transformers_4_and_5(tmp_path, transformers4):
    tokenizer = make_bpe_tokenizer(tmp_path / "tokenizer", TEXT, 300, prefix_space=False)
    # rotary bases neither version defaults to, and a window shorter than the text: a version that
    # read either wrong would give other logits
    config = model_preset("modernbert-tiny", 300, local_attention=8, global_rope_theta=40000.0,
                          local_rope_theta=7000.0, kernels="torch", pad_token_id=3, cls_token_id=1, sep_token_id=2,
                          mask_token_id=4)
    torch.manual_seed(0)
    folder = export_hf(build_model(config).state_dict(), config, tokenizer, tmp_path / "hf")
    four, five = _same_reading(folder, tmp_path, transformers4)
    assert four["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert {k: four[k] for k in ("global_rope_theta", "local_rope_theta", "global_attn_every_n_layers",
                                 "local_attention")} == {"global_rope_theta": 40000.0, "local_rope_theta": 7000.0,
                                                          "global_attn_every_n_layers": 3, "local_attention": 8}
    assert [four[k] for k in ("pad_token_id", "cls_token_id", "sep_token_id")] == [3, 1, 2]


def test_a_bert_export_reads_the_same_in_transformers_4_and_5(tmp_path, transformers4):
    import transformers

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(set(" ".join(TEXT).split()))]
    transformers.BertTokenizerFast(vocab={w: i for i, w in enumerate(words)}).save_pretrained(tmp_path / "tokenizer")
    config = model_preset("tiny", len(words) + 3, max_position_embeddings=64, kernels="torch", pad_token_id=0,
                          cls_token_id=2, sep_token_id=3, mask_token_id=4)
    torch.manual_seed(0)
    folder = export_hf(build_model(config).state_dict(), config, tmp_path / "tokenizer", tmp_path / "hf")
    four, _ = _same_reading(folder, tmp_path, transformers4)
    assert four["pad_token_id"] == 0


def test_init_from_reads_a_folder_transformers_4_wrote(tmp_path, transformers4):
    """transformers 4 writes its own config form (global_rope_theta, global_attn_every_n_layers, no
    layer_types): a run started from it has those settings, and its model gives 4's logits."""
    written = _probe("write", tmp_path / "hf", tmp_path / "four.npz", transformers4)
    assert written["said"]["version"].startswith("4.")
    values = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "layer_types" not in values and values["global_rope_theta"] == 40000.0  # 4's form indeed
    source = open_source(tmp_path / "hf")
    config = model_config(source, None, {"vocab_size": 300, "kernels": "torch"})
    assert (config.global_rope_theta, config.local_rope_theta, config.global_attn_every_n_layers,
            config.local_attention) == (40000.0, 7000.0, 2, 16)
    ours = build_model(config).eval()
    params = [name for name, _ in ours.named_parameters()]
    weights, fresh = match(read_state(source.weights), params, source.weights, family_of(config).hf)
    assert fresh == []
    ours.load_state_dict(weights, strict=False)
    ids, mask = torch.from_numpy(written["ids"]), torch.from_numpy(written["mask"])
    unpadded = unpad(mask)
    with torch.no_grad():
        got = ours(ids, unpadded=unpadded).mlm_logits
    theirs = gather_tokens(torch.from_numpy(written["logits"]), unpadded.token_indices)
    assert relative_gap(got, theirs) <= ROUND_TRIP_TOLERANCE
