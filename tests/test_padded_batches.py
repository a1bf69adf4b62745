"""Batches whose size changes every step are padded to a few sizes (base/graphs.padded_size), so that
CUDA graphs of their shapes are replayed rather than captured anew; the padding changes no result."""

import pytest
import torch

from tiered_tbe.base.graphs import SIZES_PER_DOUBLING, padded_size
from tiered_tbe.cache import CachedTable, SlotCache


def test_padded_size_bounds_and_buckets():
    sizes = [padded_size(n) for n in range(0, 1 << 16)]
    for n, size in enumerate(sizes):
        assert n <= size <= n + n // SIZES_PER_DOUBLING + 1, (n, size)
        assert padded_size(size) == size  # a bucket pads to itself
    assert sizes == sorted(sizes)
    for octave in range(5, 16):
        # at most SIZES_PER_DOUBLING + 1 shapes for every size in [2^k, 2^(k+1))
        assert len(set(sizes[1 << octave: 2 << octave])) <= SIZES_PER_DOUBLING + 1


@pytest.mark.parametrize("num_lookups", [33, 101, 1001])
def test_prefetch_of_unpadded_size_returns_the_batch_only(num_lookups):
    torch.manual_seed(num_lookups)
    tables = [CachedTable(0, 40, 4, torch.randn(40, 4)), CachedTable(40, 30, 4, torch.randn(30, 4))]
    cache = SlotCache(tables, num_slots=16, associativity=4)
    assert padded_size(num_lookups) != num_lookups
    cache.unlock(cache.prefetch(torch.arange(3)))  # a batch of another size first: this one is padded
    before = cache.stats()
    rows = torch.randint(0, 75, (num_lookups,))  # 70..74: outside every table
    batch = cache.prefetch(rows)
    assert batch.locked_slots.numel() == padded_size(num_lookups)
    cache.wait_filled(batch)
    assert batch.slot_of_index.shape == (num_lookups,)
    expected_keys = torch.where(rows < 70, rows, torch.iinfo(batch.sorted_rows.dtype).max).to(batch.sorted_rows.dtype)
    expected_sorted, expected_order = torch.sort(expected_keys, stable=True)
    assert torch.equal(batch.sorted_rows, expected_sorted)
    assert torch.equal(batch.order.long(), expected_order)
    held = batch.slot_of_index >= 0
    assert torch.equal(cache.tags[batch.slot_of_index[held].long()], rows[held])
    assert (batch.slot_of_index[rows >= 70] == -1).all()
    stats = cache.stats()
    assert stats.lookups - before.lookups == int((rows < 70).sum())
    assert stats.unique_rows - before.unique_rows == len(set(rows[rows < 70].tolist()))
    cache.unlock(batch)
    assert cache.num_locked() == 0


def test_a_prefetch_pads_only_a_batch_whose_size_differs_from_the_one_before_it():
    """The prefetch lays a batch out at its padded size (a few graph shapes for batches whose size changes
    every step) only when its size differs from the batch before it; the first batch and a batch the size of
    the one before it keep their own size (no padding to sort, rank and copy). The results are the same."""
    torch.manual_seed(5)
    tables = [CachedTable(0, 40, 4, torch.randn(40, 4)), CachedTable(40, 30, 4, torch.randn(30, 4))]
    sizes = [33, 33, 101, 101, 101, 33]
    batches = [torch.randint(0, 75, (n,)) for n in sizes]
    cache = SlotCache(tables, num_slots=16, associativity=4)
    laid_out = []
    for rows in batches:
        batch = cache.prefetch(rows)
        cache.wait_filled(batch)
        laid_out.append(batch.locked_slots.numel())
        assert batch.slot_of_index.shape == rows.shape
        held = batch.slot_of_index >= 0
        assert torch.equal(cache.tags[batch.slot_of_index[held].long()], rows[held])
        cache.unlock(batch)
    assert laid_out == [33, 33, padded_size(101), 101, 101, padded_size(33)]
    assert cache.num_locked() == 0
