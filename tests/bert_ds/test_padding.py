"""The unpadded layout: bert_ds.model.padding.unpad, and the fields the loader's collate delivers."""

import pytest
import torch

from bert_ds.config import BatchPlan, DataConfig
from bert_ds.loader.pretraining import PretrainingDataset, PretrainingLoader, to_device, validation_batches
from bert_ds.model.padding import IGNORE_INDEX, Unpadded, positions, unpad

pytestmark = pytest.mark.lowest  # all of it also runs under the lowest supported torch (run.sh test-lowest)

PADDED_FIELDS = {"input_ids", "token_type_ids", "attention_mask", "labels", "next_sentence_label"}
LAYOUT_FIELDS = {"token_indices", "cu_seqlens", "max_seqlen", "masked_positions", "masked_labels"}


def test_unpad_layout():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    labels = torch.tensor([[-100, 7, -100, -100], [5, -100, -100, -100], [-100, -100, 9, 3]])
    packed = unpad(mask, labels)
    assert packed.token_indices.tolist() == [0, 1, 2, 4, 8, 9, 10, 11]
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.cu_seqlens.tolist() == [0, 3, 4, 8]
    assert packed.max_seqlen == 4 and type(packed.max_seqlen) is int
    assert packed.masked_positions.tolist() == [1, 3, 6, 7]
    assert packed.masked_labels.tolist() == [7, 5, 9, 3]
    assert unpad(mask).masked_positions is None
    # every sequence's positions start at 0 (the models' position ids, BERT's table rows, ModernBERT's rotations)
    assert positions(packed.token_indices, 4).tolist() == [0, 1, 2, 0, 0, 1, 2, 3]


def test_unpad_ignores_labels_on_padding():
    """A label under padding is no target: the masked rows index real tokens only."""
    packed = unpad(torch.tensor([[1, 1, 0]]), torch.tensor([[-100, 4, 6]]))
    assert packed.masked_positions.tolist() == [1] and packed.masked_labels.tolist() == [4]


@pytest.mark.parametrize("mask, message", [
    ([[1, 1], [0, 0]], "without any real token"),
    ([[1, 0, 1]], "padding on the right"),
])
def test_unpad_rejects_bad_masks(mask, message):
    with pytest.raises(ValueError, match=message):
        unpad(torch.tensor(mask))


def test_layout_round_trips_through_a_batch():
    packed = unpad(torch.tensor([[1, 1, 0], [1, 1, 1]]), torch.tensor([[4, -100, -100], [-100, -100, 2]]))
    batch = to_device({"input_ids": torch.zeros(2, 3, dtype=torch.long), **packed.batch_fields()}, torch.device("cpu"))
    again = Unpadded.from_batch(batch)
    assert again.max_seqlen == 3 and type(again.max_seqlen) is int  # moving a batch leaves host ints alone
    for name in LAYOUT_FIELDS - {"max_seqlen"}:
        assert torch.equal(getattr(again, name), getattr(packed, name)), name


def _reference_layout(batch) -> dict:
    """The layout by a walk over every position of the padded batch, row by row."""
    mask, labels = batch["attention_mask"].tolist(), batch["labels"].tolist()
    width = len(mask[0])
    token_indices, cu_seqlens, masked_positions, masked_labels = [], [0], [], []
    for row, (row_mask, row_labels) in enumerate(zip(mask, labels)):
        for col, (real, label) in enumerate(zip(row_mask, row_labels)):
            if not real:
                continue
            if label != IGNORE_INDEX:
                masked_positions.append(len(token_indices))
                masked_labels.append(label)
            token_indices.append(row * width + col)
        cu_seqlens.append(len(token_indices))
    seqlens = [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])]
    return {"token_indices": token_indices, "cu_seqlens": cu_seqlens, "max_seqlen": max(seqlens),
            "masked_positions": masked_positions, "masked_labels": masked_labels}


def _check_layout(batch) -> None:
    assert set(batch) == PADDED_FIELDS | LAYOUT_FIELDS
    want = _reference_layout(batch)
    assert type(batch["max_seqlen"]) is int and batch["max_seqlen"] == want["max_seqlen"]
    for name, dtype in (("token_indices", torch.int64), ("cu_seqlens", torch.int32),
                        ("masked_positions", torch.int64), ("masked_labels", torch.int64)):
        assert batch[name].dtype == dtype, name
        assert batch[name].tolist() == want[name], name
    assert want["masked_labels"]  # the batch had targets, so the comparison covered them


@pytest.fixture(scope="module")
def dataset(sample_data):
    return PretrainingDataset(sample_data["train"], DataConfig(train=str(sample_data["train"])), seed=11)


def test_loader_batches_carry_the_reference_layout(dataset):
    """Batches from the loader's worker processes, whose samples vary in length."""
    loader = PretrainingLoader(dataset, BatchPlan.resolve(8, 4, 1), rank=0, num_workers=2)
    batches = [batch for _ in range(3) for batch in loader.next_step()]
    assert any((b["attention_mask"] == 0).any() for b in batches)  # some rows are padded
    for batch in batches:
        _check_layout(batch)


def test_validation_batches_carry_the_reference_layout(dataset):
    for batch in validation_batches(dataset, samples=8, micro_batch=4, rank=0, world_size=1):
        _check_layout(batch)
