"""The epoch order: a keyed bijection of [0, n), the same one position at a time or in a batch."""

import numpy as np
import pytest

from bert_ds.loader.permutation import EpochPermutation


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 1000, 4097])
def test_every_position_reads_a_different_sample(n):
    perm = EpochPermutation(n, seed=3, epoch=1)
    batch = perm.many(np.arange(n))
    assert sorted(batch.tolist()) == list(range(n))
    assert [perm(i) for i in range(n)] == batch.tolist()


def test_order_is_a_pure_function_of_seed_and_epoch_and_looks_shuffled():
    n = 10_000
    order = EpochPermutation(n, 7, 0).many(np.arange(n))
    assert np.array_equal(order, EpochPermutation(n, 7, 0).many(np.arange(n)))
    for other in (EpochPermutation(n, 7, 1), EpochPermutation(n, 8, 0)):
        assert np.mean(other.many(np.arange(n)) == order) < 0.01
    assert np.mean(order == np.arange(n)) < 0.01  # few fixed points
    assert abs(np.corrcoef(order, np.arange(n))[0, 1]) < 0.05
    # neighbouring positions land far apart: the first 100 span the whole epoch
    assert order[:100].min() < n // 10 and order[:100].max() > n - n // 10


def test_positions_outside_the_epoch_are_refused():
    perm = EpochPermutation(10, 0, 0)
    with pytest.raises(IndexError):
        perm(10)
    with pytest.raises(IndexError):
        perm.many(np.array([3, -1]))
