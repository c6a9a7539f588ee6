"""What the DeepSpeed engine costs the host per step, apart from the model's compute.

    python benchmarks/engine_overhead.py [--steps 40] [--configs bare,z0,z1,...]

A model with BERT-Base's 206 parameter tensors (12 layers) but hidden size 32, so that its
compute is negligible, trained on the bundled sample's shards (``./run.sh prepare`` makes
them) at micro-batch 8 x 64, one process, fp32 unless a config says bf16: the same step
in a bare loop (``FlatLamb``, no engine) and through ``deepspeed.initialize`` with each
ZeRO setting. Prints the median ms per step after 5 warm-up steps. What the engine adds
over the bare loop is host time: hooks, buckets, bookkeeping. On a GPU the same Python
runs, so the difference is a floor for the engine's host cost there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                   ("MASTER_PORT", "29533")):
    os.environ.setdefault(key, value)

import torch  # noqa: E402

from bert_ds.config import BatchPlan, DataConfig, OptimConfig, resolve_ds_config_path  # noqa: E402
from bert_ds.loader.pretraining import PretrainingLoader, open_pretraining_data  # noqa: E402
from bert_ds.model.build import build_model  # noqa: E402
from bert_ds.model.families import model_preset  # noqa: E402
from bert_ds.model.padding import pretraining_inputs  # noqa: E402
from bert_ds.optim.builders import bind_to_engine, build_optimizer, build_schedule, param_groups  # noqa: E402
from bert_ds.optim.flat import FlatLamb  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "runs" / "sample" / "data" / "train"
# ZeRO-1 as the shipped configs set it (ds_configs/zero1_fp32.json), and with overlap_comm on
ZERO1 = json.loads(resolve_ds_config_path("zero1_fp32.json").read_text())["zero_optimization"]
CONFIGS = {
    "z0": {"zero_optimization": {"stage": 0}},
    "z1": {"zero_optimization": ZERO1},
    "z1-noncontiguous": {"zero_optimization": {**ZERO1, "contiguous_gradients": False}},
    "z1-overlap": {"zero_optimization": {**ZERO1, "overlap_comm": True}},
    "z1-bf16": {"zero_optimization": ZERO1, "bf16": {"enabled": True}, "communication_data_type": "fp32"},
    "z1-bf16-noncontiguous": {"zero_optimization": {**ZERO1, "contiguous_gradients": False},
                              "bf16": {"enabled": True}, "communication_data_type": "fp32"},
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--configs", default="bare," + ",".join(CONFIGS))
    args = p.parse_args()
    if not (DATA / "manifest.json").is_file():
        print(f"error: {DATA}: no shards; ./run.sh prepare makes them", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    train, _ = open_pretraining_data(DataConfig(train=[str(DATA)], max_seq_length=64, num_workers=0), 0)
    cfg = model_preset("base", train.vocab_size, hidden_size=32, intermediate_size=128, num_heads=2,
                       hidden_dropout=0.0, attention_dropout=0.0, kernels="torch")
    loader = PretrainingLoader(train, BatchPlan.resolve(8, 8, 1), 0, num_workers=0)
    batches = [loader.next_step()[0] for _ in range(8)]
    optim = OptimConfig(name="lamb", lr=1e-4)

    def timed(step) -> float:
        times = []
        for i in range(args.steps + 5):
            start = time.perf_counter()
            step(batches[i % len(batches)])
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times[5:])

    for name in args.configs.split(","):
        torch.manual_seed(0)
        model = build_model(cfg)
        if name == "bare":
            opt = FlatLamb(param_groups(model, 0.01), lr=1e-4, kernels="torch")

            def step(batch, model=model, opt=opt):
                model(**pretraining_inputs(batch)).loss.backward()
                opt.step()
                opt.zero_grad()
        else:
            import deepspeed

            opt = build_optimizer(model, optim, kernels="torch")
            ds = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.0,
                  "zero_allow_untested_optimizer": True, "timers": {"throughput": {"enabled": False}},
                  **CONFIGS[name]}
            engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds,
                                                   lr_scheduler=lambda o: build_schedule(o, optim, 1000))
            bind_to_engine(opt, engine)

            def step(batch, engine=engine):
                engine.backward(engine(**pretraining_inputs(batch)).loss)
                engine.step()
        print(f"{name:24s} {timed(step):7.2f} ms/step", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
