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
