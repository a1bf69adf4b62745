"""Inputs of the TBE kernels' tests (tests/test_forward.py, test_backward.py, test_grouping.py,
test_update_rows.py): random tables and batches, and how the tests compare row stores.

Every check draws fresh random inputs: several tables with different dims (1, 3, 17, 33), tables
of one row, empty bags, rows repeated in a bag and across bags, per-sample weights, rows in a
small slot cache beside rows read from backing stores. Outputs the kernels allocate start as
NaN (``poison_empty``, an autouse fixture of every module importing it), so an element no
program writes shows up. In CPU simulation the Triton interpreter runs everything: sizes stay small.
"""

from __future__ import annotations

import math

import pytest
import torch

from tiered_tbe.kernels import backward as backward_module
from tiered_tbe.kernels import forward as forward_module
from tiered_tbe.kernels.optimizers import LAMB, OPTIMIZERS, SGD, Adagrad, Adam, PartialRowwiseAdam, RowwiseAdagrad
from tiered_tbe.kernels.rows import Lookups, RowStores, no_cache

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# One unit in the last place at 1.0 of each weights dtype: the tolerance of a row rounded once.
ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
UNPOISONED_EMPTY = torch.empty  # for buffers the test itself must leave untouched
# Every registered optimizer with hyper-parameters that make each term matter.
ALL_OPTIMIZERS = {
    "sgd": SGD(lr=0.05),
    "rowwise_adagrad": RowwiseAdagrad(lr=0.05, eps=1e-3),
    "adagrad": Adagrad(lr=0.05, eps=1e-3),
    "adam": Adam(lr=0.05, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.01),
    "partial_rowwise_adam": PartialRowwiseAdam(lr=0.05, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.01),
    "lamb": LAMB(lr=0.05, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.01),
}
assert set(ALL_OPTIMIZERS) == set(OPTIMIZERS), "a registered optimizer has no kernel test"
STEP = 3


@pytest.fixture(autouse=True)
def poison_empty(monkeypatch):
    """Make the kernels' ``torch.empty`` outputs NaN, so elements no program writes are caught."""
    original = torch.empty

    def empty_filled_with_nan(*args, **kwargs):
        tensor = original(*args, **kwargs)
        if tensor.is_floating_point():
            tensor.fill_(math.nan)
        return tensor

    monkeypatch.setattr(forward_module.torch, "empty", empty_filled_with_nan)
    assert backward_module.torch.empty is empty_filled_with_nan


def make_stores(dims, num_rows, dtype, optimizer, num_slots, device) -> RowStores:
    """Random rows (and positive optimizer state) for tables of ``dims`` x ``num_rows``.

    The tables live in one flat buffer each for weights and state, as the module lays them
    out, so the kernels' per-table addresses point into shared allocations."""
    weights_flat = torch.randn(sum(r * d for r, d in zip(num_rows, dims)), device=device).to(dtype)
    widths = [optimizer.state_width(d) if optimizer is not None else 0 for d in dims]
    # Adagrad sums and second moments must be >= 0; first moments may be anything, positive is fine.
    state_flat = torch.rand(sum(r * w for r, w in zip(num_rows, widths)), device=device) * 0.1
    weights, states, w_at, s_at = [], [], 0, 0
    for rows, dim, width in zip(num_rows, dims, widths):
        weights.append(weights_flat[w_at : w_at + rows * dim].view(rows, dim))
        states.append(state_flat[s_at : s_at + rows * width].view(rows, width) if width else None)
        w_at, s_at = w_at + rows * dim, s_at + rows * width
    cache_width = max(1, max(widths))
    cache_weights = torch.randn(num_slots, max(dims), device=device).to(dtype)
    cache_state = torch.rand(num_slots, cache_width, device=device) * 0.1
    return RowStores(tuple(weights), tuple(states), cache_weights, cache_state)


def make_batch(dims=(3, 17, 33, 1), num_rows=(7, 1, 40, 5), batch_size=5, max_bag=6, dtype=torch.float32,
               optimizer=None, weighted=False, num_slots=8, index_dtype=torch.int64, device="cpu",
               feature_table_map=None):
    """``(stores, lookups, slot_of_index)``: a random batch over random tables.

    Every fourth bag is empty; half the lookups hit one of a table's first three rows, so rows
    repeat within bags and across bags (and across features, when several look up one table:
    ``feature_table_map``). Up to ``num_slots`` of the rows used sit in the slot cache, where
    their (newer) copy differs from the backing store's.
    """
    stores = make_stores(dims, num_rows, dtype, optimizer, num_slots, device)
    if feature_table_map is not None:
        stores = stores.replace(feature_table_map=tuple(feature_table_map))
    num_features = stores.num_features
    lengths = torch.randint(0, max_bag + 1, (num_features * batch_size,), device=device)
    lengths[::4] = 0
    offsets = torch.zeros(num_features * batch_size + 1, dtype=torch.int64, device=device)
    offsets[1:] = torch.cumsum(lengths, 0)
    bag_of_index = torch.repeat_interleave(torch.arange(num_features * batch_size, device=device), lengths)
    num_lookups = bag_of_index.numel()
    table_of_index = torch.tensor(stores.features, device=device)[bag_of_index // batch_size]
    rows_of_table = torch.tensor(num_rows, device=device)[table_of_index]
    uniform = (torch.rand(num_lookups, device=device) * rows_of_table).long()
    hot = (torch.rand(num_lookups, device=device) * rows_of_table.clamp(max=3)).long()
    indices = torch.where(torch.rand(num_lookups, device=device) < 0.5, hot, uniform)
    global_rows = torch.tensor(stores.row_offsets, device=device)[table_of_index] + indices
    per_sample_weights = torch.rand(num_lookups, device=device) + 0.5 if weighted else None
    lookups = Lookups(indices.to(index_dtype), offsets.to(index_dtype), batch_size, per_sample_weights)

    used_rows = torch.unique(global_rows)
    cached_rows = used_rows[torch.randperm(used_rows.numel(), device=device)[: min(num_slots, used_rows.numel() // 2)]]
    slot_of_row = torch.full((sum(num_rows),), -1, dtype=torch.int32, device=device)
    slot_of_row[cached_rows] = torch.randperm(num_slots, device=device)[: cached_rows.numel()].int()
    slot_of_index = slot_of_row[global_rows]
    return stores, lookups, slot_of_index


def assert_stores_close(actual: RowStores, expected: RowStores, dtype: torch.dtype) -> None:
    """Every weight (rounded once in ``dtype``) and state value of the two stores agree."""
    rtol = 2 * ULP[dtype] if dtype != torch.float32 else 1e-5
    pairs = [(f"table {t} weights", a, e) for t, (a, e) in enumerate(zip(actual.table_weights, expected.table_weights))]
    pairs.append(("cache_weights", actual.cache_weights, expected.cache_weights))
    for name, a, e in pairs:
        torch.testing.assert_close(a.float().cpu(), e.float().cpu(), rtol=rtol, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
    states = [(f"table {t} state", a, e) for t, (a, e) in enumerate(zip(actual.table_state, expected.table_state))
              if a is not None]
    for name, a, e in states + [("cache_state", actual.cache_state, expected.cache_state)]:
        torch.testing.assert_close(a.cpu(), e.cpu(), rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def assert_stores_equal(actual: RowStores, expected: RowStores) -> None:
    """Every weight and state value of the two stores, and of their slots, equal bit for bit."""
    for name in ("table_weights", "table_state"):
        for t, (a, e) in enumerate(zip(getattr(actual, name), getattr(expected, name))):
            assert (a is None and e is None) or torch.equal(a, e), f"{name} of table {t}"
    assert torch.equal(actual.cache_weights, expected.cache_weights)
    assert torch.equal(actual.cache_state, expected.cache_state)


def one_table_stores(weights: torch.Tensor) -> RowStores:
    """RowStores of one table (SGD: no state, no cache) whose rows are ``weights`` [rows, dim]."""
    return RowStores((weights,), (None,), *no_cache(weights.dtype, weights.device))


CHUNK = 8  # the hot-row tests' window (a power of two)


def segments_batch(lengths, dim, device, optimizer):
    """One table with a row per entry of ``lengths``, looked up that many times each (lookups
    shuffled, in bags of up to 3), some rows cached."""
    num_rows = len(lengths)
    stores = make_stores([dim], [num_rows], torch.float32, optimizer, 4, device)
    indices = torch.repeat_interleave(torch.arange(num_rows, device=device), torch.tensor(lengths, device=device))
    indices = indices[torch.randperm(indices.numel(), device=device)]
    bag_lengths = torch.randint(0, 4, (indices.numel(),), device=device)
    bag_lengths = bag_lengths[: int(torch.searchsorted(bag_lengths.cumsum(0), indices.numel())) + 1]
    bag_lengths[-1] = indices.numel() - bag_lengths[:-1].sum()
    offsets = torch.zeros(bag_lengths.numel() + 1, dtype=torch.int64, device=device)
    offsets[1:] = bag_lengths.cumsum(0)
    slot_of_row = torch.full((num_rows,), -1, dtype=torch.int32, device=device)
    slot_of_row[torch.randperm(num_rows, device=device)[:3]] = torch.arange(3, dtype=torch.int32, device=device)
    return stores, Lookups(indices, offsets, bag_lengths.numel()), slot_of_row[indices]


def zipf_batch(num_rows, dim, batch_size, bag_size, device, dtype=torch.float32, optimizer=None):
    """One table, fixed-size bags, rows drawn from a Zipf(1.05)-like law: hot rows with
    thousands of lookups (many windows) beside rows seen once."""
    stores = make_stores([dim], [num_rows], dtype, optimizer, 0, device)
    stores = stores.replace(**dict(zip(("cache_weights", "cache_state"), no_cache(dtype, device))))
    num_lookups = batch_size * bag_size
    ranks = torch.arange(1, num_rows + 1, device=device, dtype=torch.float64)
    cdf = torch.cumsum(ranks**-1.05, 0)
    indices = torch.searchsorted(cdf / cdf[-1], torch.rand(num_lookups, device=device, dtype=torch.float64))
    indices = torch.randperm(num_rows, device=device)[indices.clamp(max=num_rows - 1)]
    offsets = torch.arange(0, num_lookups + 1, bag_size, device=device)
    return stores, Lookups(indices, offsets, batch_size)
