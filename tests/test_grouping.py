"""The backward's grouping of a batch by global row (kernels/linearize.py, kernels/grouping.py)
against plain torch. Inputs: tests/kernel_inputs.py."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import (  # noqa: F401  (poison_empty: an autouse fixture, active where imported)
    make_batch,
    poison_empty,
    segments_batch,
)

from tiered_tbe.kernels.backward import sort_lookups
from tiered_tbe.kernels.linearize import linearize, linearize_tile


@pytest.mark.parametrize("feature_table_map", [None, (2, 0, 1, 2, 3, 0, 2)], ids=["a_feature_a_table", "shared"])
@pytest.mark.parametrize("tile", [(2, 2), (128, 1), (16, 8), (4, 32)])
def test_linearize_every_tile_matches_torch(tile, feature_table_map, device):
    """Each lookup's global row (its feature's table's) and bag, for the tiles linearize_tile picks
    (one lane a bag up to a warp a bag), over bags of 0 to 70 lookups (several steps of 32 lanes)
    and int32 indices."""
    stores, lookups, _ = make_batch(batch_size=9, max_bag=70, index_dtype=torch.int32, device=device,
                                    feature_table_map=feature_table_map)
    lengths = lookups.offsets[1:] - lookups.offsets[:-1]
    bags = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths.long())
    table_of_feature = torch.tensor(stores.features, device=device)
    expected_rows = (torch.tensor(stores.row_offsets, device=device)[table_of_feature[bags // lookups.batch_size]]
                     + lookups.indices.long())
    for key_dtype in (torch.int32, torch.int64):
        result = linearize(stores, lookups, key_dtype=key_dtype, tile=tile)
        assert result.global_rows.dtype == key_dtype and result.bag_of_index.dtype == torch.int32
        assert torch.equal(result.global_rows.long(), expected_rows)
        assert torch.equal(result.bag_of_index.long(), bags)


def test_linearize_tile_follows_the_mean_bag_length():
    assert linearize_tile(65536 * 26, 65536 * 26) == (128, 1)  # Criteo: one lookup a bag
    assert linearize_tile(65536 * 32, 65536) == (4, 32)  # bags of 32: a warp a bag
    assert linearize_tile(65536 * 300, 65536) == (4, 32)  # longer bags loop over 32 lanes
    assert linearize_tile(10, 4) == (64, 2)
    assert linearize_tile(0, 0) == (128, 1)


def test_sort_lookups_from_a_sort_made_already(device):
    """Given the stable sort of the batch's rows (the cache's prefetch makes one), the grouping is
    the one it makes itself; a sort of another size is refused."""
    stores, lookups, _ = make_batch(batch_size=7, max_bag=9, device=device)
    lookups = linearize(stores, lookups, key_dtype=torch.int32)
    own = sort_lookups(stores, lookups)
    sorted_rows, order = torch.sort(lookups.global_rows, stable=True)
    given = sort_lookups(stores, lookups, (sorted_rows, order.to(torch.int32)))
    for name, expected, got in zip(own._fields, own, given):
        assert torch.equal(expected, got), name
    with pytest.raises(ValueError, match="presorted needs"):
        sort_lookups(stores, lookups, (own.sorted_rows[1:], own.order[1:]))


def test_sort_lookups_carrying_the_bags_groups_as_with_positions(device):
    """need_order=False (the sort carries each lookup's bag, no gather) groups the lookups as the
    sort by position does, in every field but the positions it does not make."""
    stores, lookups, _ = make_batch(batch_size=9, max_bag=12, device=device)
    lookups = linearize(stores, lookups, key_dtype=torch.int32)
    with_order = sort_lookups(stores, lookups)
    without = sort_lookups(stores, lookups, need_order=False)
    assert without.order is None
    for name, expected, got in zip(with_order._fields, with_order, without):
        if name != "order":
            assert torch.equal(expected, got), name


def test_sort_lookups_matches_torch(device):
    """Sorted rows, bags by sorted position, run counts and run ends (N past the last run: the
    kernels read those as empty runs) against plain torch, with memory just freed full of garbage
    so that an entry the kernels forget to write shows."""
    lengths = [1, 5, 2, 40, 1, 1, 3, 17]
    stores, lookups, _ = segments_batch(lengths, 4, device, None)
    num_lookups = lookups.num_lookups
    for _ in range(3):  # garbage where the caching allocator will hand out the next int32 buffers
        torch.full((4 * num_lookups + 8,), -7, dtype=torch.int32, device=device)
    sorted_lookups = sort_lookups(stores, lookups)
    rows = lookups.indices.long()  # one table: global row = row
    expected_rows, expected_order = torch.sort(rows, stable=True)
    assert torch.equal(sorted_lookups.sorted_rows.long(), expected_rows)
    assert sorted_lookups.order.dtype == torch.int32
    assert torch.equal(sorted_lookups.order.long(), expected_order)
    bag_of_index = torch.repeat_interleave(torch.arange(lookups.batch_size, device=device),
                                           lookups.offsets.diff())
    assert torch.equal(sorted_lookups.sorted_bags.long(), bag_of_index[expected_order])
    _, counts = torch.unique_consecutive(expected_rows, return_counts=True)
    assert int(sorted_lookups.num_runs) == counts.numel()
    starts = torch.ones(num_lookups, dtype=torch.long, device=device)
    starts[1:] = (expected_rows[1:] != expected_rows[:-1]).long()
    assert torch.equal(sorted_lookups.run_count.long(), starts.cumsum(0))
    expected_end = torch.full((num_lookups,), num_lookups, dtype=torch.long, device=device)
    expected_end[: counts.numel()] = counts.cumsum(0)
    assert torch.equal(sorted_lookups.run_end.long(), expected_end)
