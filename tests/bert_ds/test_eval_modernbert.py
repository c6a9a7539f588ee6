"""The evaluation commands on a ModernBERT-class Hugging Face folder: a tiny ``ModernBertForMaskedLM``
at random init with a byte-level BPE tokenizer of its own (no ``##`` pieces, a leading ``Ġ`` for
a word after a space, no ``token_type_ids``), fine-tuned by ``glue``, ``squad`` and ``ner``
through transformers' ModernBERT heads; and the parts that used to assume BERT's tokenizer: the
words of a sentence as the model read them, the special tokens a pair has, the padding side, the
inputs a model's ``forward`` takes, the model's positions."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bert_ds.eval.ner_data import NerSplit
from tests.bert_ds.test_glue import WORDS, learnable_sst2
from tests.bert_ds.test_ner import ENTITIES, learnable_conll
from tests.bert_ds.test_squad import COLORS, learnable_squad, official_scores
from tests.conftest import BPE_SPECIALS, REPO, run_cli
from tests.conftest import bpe_tokenizer as trained_bpe

SPECIALS = list(BPE_SPECIALS.values())


def bpe_tokenizer(**settings):
    """A byte-level BPE as ModernBERT's is (OLMo's kind: no prefix space, ``[CLS] A [SEP] B [SEP]``),
    trained on the tests' words."""
    words = [*WORDS, "good", "bad", *COLORS, *(w for names in ENTITIES.values() for n in names for w in n),
             "what", "color", "?"]
    return trained_bpe([" ".join(words[i:] + words[:i]) for i in range(len(words))], 400, prefix_space=False,
                       **settings)


@pytest.fixture(scope="module")
def modernbert(tmp_path_factory):
    """A ModernBERT masked-LM export at random init (3 layers, a local window of 8 tokens), saved
    with its tokenizer as transformers saves them."""
    import torch
    import transformers

    folder = tmp_path_factory.mktemp("modernbert") / "model"
    tokenizer = bpe_tokenizer()
    tokenizer.save_pretrained(folder)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in
           (("pad", "[PAD]"), ("cls", "[CLS]"), ("sep", "[SEP]"))}
    config = transformers.ModernBertConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
        local_attention=8, max_position_embeddings=128, pad_token_id=ids["pad"], bos_token_id=ids["cls"],
        eos_token_id=ids["sep"], cls_token_id=ids["cls"], sep_token_id=ids["sep"])
    torch.manual_seed(0)
    transformers.ModernBertForMaskedLM(config).save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "modernbert"
    return folder


def _eval(command, model, data, out, *extra, check=True):
    return run_cli("bert_ds.eval", command, "--model", str(model), "--data", str(data), "--output", str(out),
                   "--no-progress", "--seeds", "1", *extra, check=check)


@pytest.mark.lowest
def test_glue_fine_tunes_a_modernbert_folder(modernbert, tmp_path):
    learnable_sst2(tmp_path / "glue")
    _eval("glue", modernbert, tmp_path / "glue", tmp_path / "out", "--tasks", "sst2", "--epochs", "1",
          "--batch-size", "64")
    run = json.loads((tmp_path / "out" / "sst2" / "seed1.json").read_text())
    assert run["steps"] == 8 and math.isfinite(run["mean_train_loss"])  # 480 examples, batch 64
    assert run["eval_examples"] == {"sst2": 160} and 0.0 <= run["scores"]["sst2"]["score"] <= 100.0
    assert "| sst2 | accuracy |" in (tmp_path / "out" / "results.md").read_text()


def test_squad_v2_fine_tunes_a_modernbert_folder_and_writes_the_official_inputs(modernbert, tmp_path):
    data, out = tmp_path / "squad", tmp_path / "out"
    learnable_squad(data, version="2.0", sizes=(48, 24))
    _eval("squad", modernbert, data, out, "--epochs", "1", "--batch-size", "16", "--max-seq-length", "48",
          "--doc-stride", "8", "--max-query-length", "24")
    run = json.loads((out / "squad_v2" / "seed1.json").read_text())
    assert run["task"] == "squad_v2" and run["steps"] >= 3 and {"HasAns_f1", "NoAns_f1", "best_f1"} <= set(run["scores"])
    # the official v2.0 script on predictions.json with null_odds.json as --na-prob-file: the run's scores
    assert official_scores(data, out / "squad_v2" / "seed1") == run["scores"]


def test_ner_fine_tunes_a_modernbert_folder(modernbert, tmp_path):
    learnable_conll(tmp_path / "conll", sizes=(48, 16, 16))
    _eval("ner", modernbert, tmp_path / "conll", tmp_path / "out", "--epochs", "1", "--batch-size", "16",
          "--max-seq-length", "32")
    run = json.loads((tmp_path / "out" / "ner" / "seed1.json").read_text())
    assert run["steps"] == 3 and set(run["scores"]) == {"dev", "test"} and run["words_cut_off"] == {"dev": 0, "test": 0}
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(report["columns"]) == {"dev", "test"} and report["labels"][0] == "O"


@pytest.mark.lowest
def test_retrieval_fine_tunes_a_modernbert_folder_at_its_context(modernbert, tmp_path):
    """The bi-encoder of a ModernBERT folder: sentence-transformers' ModernBertModel with mean pooling,
    fine-tuned, and its saved folder a ModernBERT one; --max-seq-length up to the model's positions."""
    task = REPO / "tests" / "assets" / "retrieval" / "tiny-beir"
    _eval("retrieval", modernbert, task, tmp_path / "out", "--epochs", "1", "--batch-size", "32",
          "--max-seq-length", "128")
    run = json.loads((tmp_path / "out" / "retrieval" / "seed1.json").read_text())
    assert run["steps"] == 5 and set(run["scores"]) == {"dev", "test"}
    saved = json.loads((Path(run["model_folder"]) / "config.json").read_text())
    assert saved["model_type"] == "modernbert"
    from sentence_transformers import SentenceTransformer

    assert SentenceTransformer(run["model_folder"], device="cpu").max_seq_length == 128


def test_a_length_beyond_the_models_positions_is_one_line_and_trains_nothing(modernbert, tmp_path):
    learnable_conll(tmp_path / "conll", sizes=(8, 8, 0))
    proc = _eval("ner", modernbert, tmp_path / "conll", tmp_path / "out", "--max-seq-length", "256", check=False)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr
    assert err[0] == (f"error: max_seq_length 256 (--max-seq-length or the recipe's): the model has 128 positions "
                      f"(max_position_embeddings in {modernbert / 'config.json'}); give a length up to it")
    assert not (tmp_path / "out").exists()


SENTENCES = [["john", "lives", "in", "new", "york", "."], ["king", "john", "saw", "the", "river"],
             ["red", "U.S.", "don't", "café"]]


def _split(sentences=SENTENCES):
    return NerSplit([list(s) for s in sentences], [["O"] * len(s) for s in sentences], source=None)


def test_ner_reads_a_sentence_as_its_text_under_a_byte_level_bpe():
    """Each word after a space keeps its ``Ġ`` (handed over one by one, ``york`` would be read
    as it opens a text), and its label is on its first token, the one holding its first character
    (a token's offsets take in the space before it; a lone ``Ġ`` is no word's)."""
    from bert_ds.eval.ner import encode

    tokenizer = bpe_tokenizer()
    features, firsts = encode(tokenizer, _split(), ("O",), 64)
    for words, feature, first in zip(SENTENCES, features, firsts):
        text = " ".join(words)
        assert feature["input_ids"] == tokenizer(text)["input_ids"]
        offsets = tokenizer(text, return_offsets_mapping=True)["offset_mapping"]
        starts = [len(" ".join(words[:i])) + (i > 0) for i in range(len(words))]
        assert all(offsets[p][0] <= start < offsets[p][1] for p, start in zip(first, starts)), (words, first)
        assert [i for i, label in enumerate(feature["labels"]) if label != -100] == first
    tokens = tokenizer.convert_ids_to_tokens(features[0]["input_ids"])
    assert tokens[firsts[0][4]] == "Ġyork"
    assert "Ġyork" not in tokenizer.convert_ids_to_tokens(tokenizer(SENTENCES[0], is_split_into_words=True)["input_ids"])


def test_ner_reads_a_sentence_as_before_under_wordpiece():
    """BERT's tokenizer: the same tokens and first sub-tokens as the words handed over one by one."""
    import transformers

    from bert_ds.eval.ner import encode

    pieces = sorted({p for s in SENTENCES for w in s for p in (w.lower(), w[:2].lower(), "##" + w[2:].lower())} |
                    {"u", ".", "s", "don", "'", "t", "##s", "##n", "caf", "##e", "##é"})
    tokenizer = transformers.BertTokenizerFast(vocab={w: i for i, w in enumerate([*SPECIALS, *pieces])})
    features, firsts = encode(tokenizer, _split(), ("O",), 64)
    for words, feature, first in zip(SENTENCES, features, firsts):
        before = tokenizer(words, is_split_into_words=True)
        assert feature["input_ids"] == before["input_ids"]
        word_ids = before.word_ids()
        assert first == [word_ids.index(w) for w in range(len(words))]


def test_a_cut_sentence_leaves_its_last_words_without_a_token():
    from bert_ds.eval.ner import encode

    features, firsts = encode(bpe_tokenizer(), _split([["john"] * 30]), ("O",), 12)
    assert len(features[0]["input_ids"]) == 12 and firsts[0][:10] == list(range(1, 11)) and firsts[0][10:] == [None] * 20


def test_the_tokenizer_pads_on_the_right_whatever_its_folder_says(tmp_path):
    """The scores are read by position from the left: a folder saved with left padding (as
    decoder tokenizers often are) must not shift them."""
    import transformers

    from bert_ds.eval.finetune import load_tokenizer

    bpe_tokenizer(padding_side="left", truncation_side="left").save_pretrained(tmp_path)
    assert transformers.AutoTokenizer.from_pretrained(tmp_path).padding_side == "left"  # the folder's setting
    tokenizer = load_tokenizer(tmp_path)
    batch = transformers.DataCollatorWithPadding(tokenizer)([tokenizer("red"), tokenizer("john lives in new york")])
    assert batch["input_ids"][0, 0].item() == tokenizer.cls_token_id and batch["attention_mask"][0, -1].item() == 0
    assert tokenizer("john " * 20, truncation=True, max_length=5)["input_ids"][0] == tokenizer.cls_token_id


def test_a_model_gets_the_inputs_its_forward_takes(modernbert):
    """ModernBERT's forward takes no token_type_ids, BERT's does: the rule the Trainer applies."""
    import torch
    import transformers

    from bert_ds.eval.finetune import model_inputs

    batch = {"input_ids": torch.ones(1, 4, dtype=torch.long), "token_type_ids": torch.zeros(1, 4, dtype=torch.long),
             "attention_mask": torch.ones(1, 4, dtype=torch.long)}
    modern = transformers.AutoModelForQuestionAnswering.from_config(transformers.AutoConfig.from_pretrained(modernbert))
    bert = transformers.BertForQuestionAnswering(transformers.BertConfig(
        vocab_size=8, hidden_size=8, num_hidden_layers=1, num_attention_heads=1, intermediate_size=8))
    assert type(modern).__name__ == "ModernBertForQuestionAnswering"
    assert set(model_inputs(modern, batch)) == {"input_ids", "attention_mask"}
    assert set(model_inputs(bert, batch)) == set(batch)


def test_a_tokenizer_without_a_padding_token_is_refused_in_one_line(tmp_path):
    from bert_ds.base.errors import UserError
    from bert_ds.eval import runs

    bpe_tokenizer(pad_token=None).save_pretrained(tmp_path)
    with pytest.raises(UserError, match=rf"--model {tmp_path}: its tokenizer has no padding token, which batches of "
                                        r"examples of several lengths need; name one \(pad_token\)"):
        runs.check_tokenizer(tmp_path)
