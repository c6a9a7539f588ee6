"""The last step of the main job: load the export with transformers and fill masks.

``python -m bert_ds.tools.demo RUN_DIR`` reads ``RUN_DIR/hf`` (the Hugging Face export)
and ``RUN_DIR/train/summary.json``, prints the top predictions for a few masked
sentences, then the run's summary. Everything is loaded through transformers'
own ``from_pretrained``, as a user of the export would.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bert_ds.base.errors import UserError, guarded
from bert_ds.base.interrupts import import_whole
from bert_ds.checkpoint.hf_load import load_quietly

SENTENCES = (
    "The European lobster is a species of [MASK] from the eastern Atlantic Ocean .",
    "The game was released in [MASK] for the PlayStation .",
    "He was born in the city of [MASK] .",
)


def fill_mask(export_dir: Path, sentences: tuple[str, ...] = SENTENCES, top_k: int = 5) -> list[list[str]]:
    """Top-k tokens for the [MASK] of each sentence (written as the tokenizer's mask token), from the
    exported model: BERT's pretraining class or, for another family, its masked-LM class."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(export_dir)
    model = load_quietly(_masked_lm_class(export_dir), export_dir).eval()
    results = []
    with torch.no_grad():
        for text in sentences:
            enc = tokenizer(text.replace("[MASK]", tokenizer.mask_token), return_tensors="pt")
            where = (enc["input_ids"][0] == tokenizer.mask_token_id).nonzero()[0, 0]
            out = model(**enc)
            logits = (out.prediction_logits if hasattr(out, "prediction_logits") else out.logits)[0, where]
            results.append(tokenizer.convert_ids_to_tokens(logits.topk(top_k).indices.tolist()))
    return results


def _masked_lm_class(export_dir: Path):
    """transformers' class of the export (its config.json's architectures), loading its MLM head whole."""
    import transformers

    names = json.loads((export_dir / "config.json").read_text()).get("architectures") or ["BertForPreTraining"]
    return getattr(transformers, names[0])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bert_ds.tools.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="the main job's run folder (holds hf/ and train/)")
    args = p.parse_args(argv)
    return guarded(lambda: _demo(args.run_dir), interrupted="nothing was written")


def _demo(run_dir: Path) -> None:
    export_dir = run_dir / "hf"
    if not (export_dir / "config.json").is_file():
        raise UserError(f"{export_dir}: no Hugging Face export here (run `./run.sh export` first)")
    import_whole("torch", "transformers")
    print(f"== fill-mask with the exported model (transformers.{_masked_lm_class(export_dir).__name__}) ==")
    for text, top in zip(SENTENCES, fill_mask(export_dir)):
        print(f"{text}\n    -> {', '.join(top)}")
    summary_file = run_dir / "train" / "summary.json"
    if summary_file.is_file():
        s = json.loads(summary_file.read_text())
        val = s.get("val") or {}
        print("== summary ==")
        print(f"steps {s['steps']}, real tokens/s {s['tokens_per_s']:,.0f}, "
              f"loss {s['loss_first']:.3f} -> {s['loss_last']:.3f}")
        if val:
            nsp = f" (NSP accuracy {val['nsp_acc']:.3f})" if val["nsp_acc"] == val["nsp_acc"] else ""  # NaN: no pair task
            print(f"held-out masked-LM accuracy {val['mlm_acc']:.3f}{nsp}")
    print(f"export: {export_dir.resolve()}")


if __name__ == "__main__":
    sys.exit(main())
