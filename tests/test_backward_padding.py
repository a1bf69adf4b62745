"""A batch's backward padded to ``padded_size(N)`` lookups (kernels/grouping.py ``pad_batch``), so that
batches whose lookup count changes every step replay a few CUDA graphs: the padding's row lies past every
table, sorts last and is never updated, so the padded update equals the unpadded one bit for bit, with the
padding short or long enough to be a hot run, with slots, per-sample weights, the prefetch's sort, one
column group or several. Pooling none (gradient rows per lookup) is not padded. On the GPU, through the
module: tests/test_column_groups_training.py."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import ALL_OPTIMIZERS, STEP, assert_stores_equal, make_batch, poison_empty  # noqa: F401

from tiered_tbe.base.graphs import padded_size, to_device
from tiered_tbe.base.sorting import stable_sort
from tiered_tbe.kernels.backward import backward_update
from tiered_tbe.kernels.linearize import linearize
from tiered_tbe.kernels.rows import Lookups


def _batch(dims, num_lookups, optimizer, weighted, device, batch_size=4, seed=0):
    """``(stores, lookups, slot_of_index)`` of exactly ``num_lookups`` lookups (make_batch's tables and
    slots; bags of random lengths summing to it, one row of table 0 in a third of them)."""
    stores, _, _ = make_batch(dims=dims, num_rows=(9, 1, 30, 4)[: len(dims)], optimizer=optimizer, device=device,
                              num_slots=8)
    generator = torch.Generator().manual_seed(seed)
    num_bags = len(dims) * batch_size
    cuts = torch.sort(torch.randint(0, num_lookups + 1, (num_bags - 1,), generator=generator)).values
    offsets = torch.cat([torch.tensor([0]), cuts, torch.tensor([num_lookups])]).to(device)
    bag_of_index = torch.repeat_interleave(torch.arange(num_bags, device=device), offsets.diff())
    rows = torch.tensor((9, 1, 30, 4)[: len(dims)], device=device)[bag_of_index // batch_size]
    indices = (torch.rand(num_lookups, generator=generator).to(device) * rows).long()
    indices[torch.rand(num_lookups, generator=generator).to(device) < 0.3] = 0
    weights = torch.rand(num_lookups, generator=generator).to(device) + 0.5 if weighted else None
    slot_of_row = torch.full((stores.num_rows,), -1, dtype=torch.int32, device=device)
    slot_of_row[torch.tensor([0, 3, 11], device=device)] = torch.tensor([5, 0, 2], dtype=torch.int32, device=device)
    global_rows = torch.tensor(stores.row_offsets, device=device)[bag_of_index // batch_size] + indices
    return stores, Lookups(indices, offsets, batch_size, weights), slot_of_row[global_rows]


# Padded to 40, 40, 80, 160 lookups: 1 padding lookup (not a hot run), 7, 13, 30. Dims of several column
# groups, or of one (the one-launch row update).
@pytest.mark.parametrize("num_lookups, dims, name, pooling, weighted, cached", [
    (39, (3, 17, 33, 1), "rowwise_adagrad", "sum", True, True),
    (33, (16, 12, 16, 9), "sgd", "sum", False, False),
    (67, (3, 17, 33, 1), "adam", "mean", False, True),
    (67, (16, 12, 16, 9), "rowwise_adagrad", "sum", True, True),
    (130, (3, 17, 33, 1), "sgd", "mean", True, False),
    (130, (16, 12, 16, 9), "adam", "sum", False, True),
])
def test_padded_update_equals_unpadded_bitwise(num_lookups, dims, name, pooling, weighted, cached, device):
    optimizer = ALL_OPTIMIZERS[name]
    stores, lookups, slot_of_index = _batch(dims, num_lookups, optimizer, weighted, device)
    assert padded_size(num_lookups) > num_lookups
    slot_of_index = slot_of_index if cached else None
    grad_output = torch.randn(lookups.batch_size, stores.total_dim, device=device)
    plain, padded = stores.clone(), stores.clone()
    backward_update(grad_output, plain, lookups, slot_of_index, pooling, optimizer, STEP, pad=False)
    backward_update(grad_output, padded, lookups, slot_of_index, pooling, optimizer, STEP, pad=True)
    assert_stores_equal(padded, plain)
    assert not torch.equal(plain.table_weights[0], stores.table_weights[0])  # the update did something


@pytest.mark.parametrize("name", sorted(ALL_OPTIMIZERS))
def test_every_optimizer_padded_equals_unpadded_bitwise(name, device):
    """Every optimizer of the registry, 13 padding lookups (a hot run), slots and weights, mean pooling."""
    optimizer = ALL_OPTIMIZERS[name]
    stores, lookups, slot_of_index = _batch((3, 17, 33, 1), 67, optimizer, True, device, seed=1)
    grad_output = torch.randn(lookups.batch_size, stores.total_dim, device=device)
    plain, padded = stores.clone(), stores.clone()
    backward_update(grad_output, plain, lookups, slot_of_index, "mean", optimizer, STEP, pad=False)
    backward_update(grad_output, padded, lookups, slot_of_index, "mean", optimizer, STEP, pad=True)
    assert_stores_equal(padded, plain)


@pytest.mark.parametrize("dims", [(3, 17, 33, 1), (16, 12, 16, 9)])
def test_padded_update_from_the_prefetchs_sort(dims, device):
    """With the prefetch's stable sort of the rows (every table cached) passed in, padded as the batch."""
    optimizer = ALL_OPTIMIZERS["rowwise_adagrad"]
    stores, lookups, slot_of_index = _batch(dims, 67, optimizer, True, device)
    lookups = linearize(stores, lookups)
    presorted = stable_sort(lookups.global_rows.int(), stores.num_rows)
    grad_output = torch.randn(lookups.batch_size, stores.total_dim, device=device)
    plain, padded = stores.clone(), stores.clone()
    backward_update(grad_output, plain, lookups, slot_of_index, "sum", optimizer, STEP, presorted=presorted,
                    pad=False)
    backward_update(grad_output, padded, lookups, slot_of_index, "sum", optimizer, STEP, presorted=presorted,
                    pad=True)
    assert_stores_equal(padded, plain)


def test_linearize_writes_the_padding_row_past_the_last_bag(device):
    stores, lookups, _ = _batch((3, 17, 33, 1), 33, None, False, device)
    padded = lookups._replace(indices=torch.cat([lookups.indices, lookups.indices.new_zeros(7)]))
    result = linearize(stores, padded, padding_row=stores.num_rows)
    assert result.global_rows[33:].tolist() == [stores.num_rows] * 7 and result.bag_of_index[33:].tolist() == [0] * 7
    assert torch.equal(result.global_rows[:33], linearize(stores, lookups).global_rows)


def test_pooling_none_is_not_padded(device):
    optimizer = ALL_OPTIMIZERS["sgd"]
    stores, lookups, _ = _batch((3, 17, 33, 1), 33, optimizer, False, device)
    grad_output = torch.randn(33, stores.max_dim, device=device)
    with pytest.raises(ValueError, match="pooling none"):
        backward_update(grad_output, stores, lookups, None, "none", optimizer, STEP, pad=True)
    backward_update(grad_output, stores, lookups, None, "none", optimizer, STEP)  # default: not padded


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("given", ["indices", "global rows", "presorted"])
def test_the_backward_hands_its_graph_only_what_it_reads(given, pad, device):
    """The graph's inputs are copied in every step (and padded, for a padded batch): the indices go in only for a
    batch that comes without its global rows, the global rows only where no prefetch's sort stands for them. What
    stays out is never read: the update with it poisoned equals the update with it right, bit for bit."""
    optimizer = ALL_OPTIMIZERS["rowwise_adagrad"]
    stores, lookups, slot_of_index = _batch((3, 17, 33, 1), 67, optimizer, True, device)
    linearized = linearize(stores, lookups)
    presorted = stable_sort(linearized.global_rows.int(), stores.num_rows) if given == "presorted" else None
    if given != "indices":
        lookups = linearized
    grad_output = torch.randn(lookups.batch_size, stores.total_dim, device=device)
    handed = []

    class RunningGraphs:  # runs the launches as an eager run does, from the inputs it was handed (padded there)
        def run(self, key, inputs, enqueue, device, advance=None):
            handed.append(inputs)
            return enqueue(to_device(inputs, device))

    expected, actual = stores.clone(), stores.clone()
    backward_update(grad_output, expected, lookups, slot_of_index, "sum", optimizer, STEP, presorted=presorted,
                    pad=pad)
    poisoned = lookups._replace(indices=torch.full_like(lookups.indices, 10**6))  # no table has such a row
    if given == "presorted":
        poisoned = poisoned._replace(global_rows=torch.full_like(lookups.global_rows, 10**6))
    backward_update(grad_output, actual, poisoned if given != "indices" else lookups, slot_of_index, "sum",
                    optimizer, STEP, presorted=presorted, pad=pad, graphs=RunningGraphs())
    assert_stores_equal(actual, expected)
    indices, _, _, global_rows = handed[0][:4]
    assert (indices is None) == (given != "indices")
    assert (global_rows is None) == (given != "global rows")
