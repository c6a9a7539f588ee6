"""The datasheet peaks behind every MFU figure, by the device names CUDA reports."""

import pytest

from bert_ds.model.flops import datasheet_peak_tflops


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989.0),  # SXM5, as the lent H100 reports itself
    ("NVIDIA H100 PCIe", 756.0),
    ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0),
    ("NVIDIA H200 NVL", 835.0),
    ("NVIDIA GH200 480GB", 989.0),
    ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100 80GB PCIe", 312.0),
    ("NVIDIA L40S", 362.0),
    ("NVIDIA L4", 121.0),
    ("NVIDIA L40", None),  # no bf16 figure kept for it: no datasheet MFU rather than a wrong one
    ("NVIDIA GeForce RTX 4090", None),
])
def test_each_device_gets_its_own_datasheet_peak(name, peak):
    assert datasheet_peak_tflops(name) == peak


def test_a_local_layer_counts_the_pairs_within_its_window():
    """Against a count of the pairs, pair by pair: sequences shorter than, as long as and longer
    than the window."""
    import torch

    from bert_ds.kernels.local_attention import local_pairs

    window = 3
    for n in (1, 3, 4, 5, 7, 40):
        brute = sum(1 for i in range(n) for j in range(n) if abs(i - j) <= window)
        assert int(local_pairs(torch.tensor([n]), window)) == brute, n


def test_the_matmul_flops_are_the_models_linear_layers():
    """2 FLOPs per weight per token through each Linear of a layer, from the modules themselves:
    BERT's four projections and its FFN, ModernBERT's Wqkv, Wo and GeGLU (whose Wi makes 2F)."""
    import torch

    from bert_ds.model.families import model_preset
    from bert_ds.model.build import meta_model
    from bert_ds.model.flops import training_flops

    for preset in ("mini", "modernbert-base"):
        config = model_preset(preset, 1000, kernels="torch")
        model = meta_model(config)
        layers = model.bert.encoder.layer if preset == "mini" else model.model.layers
        linear = sum(m.weight.numel() for layer in layers for m in layer.modules() if isinstance(m, torch.nn.Linear))
        # one token, no attention pairs, nothing masked: the encoder's matmuls alone, 3 x forward
        assert training_flops(config, 1, 0, 0) == 3.0 * 2 * linear, preset
