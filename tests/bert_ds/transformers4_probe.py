"""Run by tests/bert_ds/test_transformers4.py under whichever transformers PYTHONPATH gives it (4 or 5):
what that version reads of a model folder. Standard library, torch, numpy and transformers only.

    python transformers4_probe.py read FOLDER OUT.npz    the folder's tokenizer and model as transformers
                                                         loads them: ids, mask, logits, what its config says
    python transformers4_probe.py write FOLDER OUT.npz   a ModernBertForMaskedLM of this version's config
                                                         form saved to FOLDER, and its logits on fixed ids
"""

import json
import sys

import numpy as np
import torch
import transformers

TEXTS = ["the european lobster is a species", "clawed lobster from the eastern atlantic ocean the european lobster"]
READ_BACK = ("global_rope_theta", "local_rope_theta", "global_attn_every_n_layers", "local_attention", "pad_token_id",
             "cls_token_id", "sep_token_id")


def logits(model, input_ids, attention_mask):
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask)
    return (out.logits if hasattr(out, "logits") else out.prediction_logits).numpy()


def read(folder: str, out: str) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    config = json.loads(open(f"{folder}/config.json").read())
    model = getattr(transformers, config["architectures"][0]).from_pretrained(folder, attn_implementation="eager")
    enc = tokenizer(TEXTS, padding=True, return_tensors="pt")
    said = {name: getattr(model.config, name) for name in READ_BACK if hasattr(model.config, name)}
    said["tokenizer_class"] = type(tokenizer).__name__
    np.savez(out, ids=enc["input_ids"].numpy(), mask=enc["attention_mask"].numpy(),
             logits=logits(model.eval(), enc["input_ids"], enc["attention_mask"]), said=json.dumps(said))


def write(folder: str, out: str) -> None:
    config = transformers.ModernBertConfig(
        vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=2,
        max_position_embeddings=256, local_attention=16, global_attn_every_n_layers=2, global_rope_theta=40000.0,
        local_rope_theta=7000.0, pad_token_id=3, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
    torch.manual_seed(0)
    model = transformers.ModernBertForMaskedLM(config).eval()
    model.save_pretrained(folder)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, 300, (2, 40), generator=generator)
    mask = torch.ones_like(input_ids)
    mask[1, 25:] = 0
    np.savez(out, ids=input_ids.numpy(), mask=mask.numpy(), logits=logits(model, input_ids, mask),
             said=json.dumps({"version": transformers.__version__}))


if __name__ == "__main__":
    {"read": read, "write": write}[sys.argv[1]](sys.argv[2], sys.argv[3])
