"""Plain-torch references of the Triton kernels, for tests: slow, short, computed in float64.

Each function takes the same arguments as its kernel (``kernels/forward.py``,
``kernels/backward.py``) and computes the same thing feature by feature (the output) and table
by table (the update: the lookups of all features of a table summed per row) with gathers and
``index_add_``: no tiles, no sorting, no fused loops. Rows come from ``cache_weights[slot]``
when a lookup's slot is ``>= 0``, else from the table's backing rows, as in ``kernels/rows.py``;
the optimizers' math is each optimizer's ``reference_update`` (``kernels/optimizers/``).
"""

from __future__ import annotations

import torch

from .in_place_copies import InPlaceCopies
from .optimizers import FusedOptimizer
from .rows import Lookups, RowStores


def _bags_of_lookups(lookups: Lookups) -> torch.Tensor:
    """int64 [N]: the bag ``f*B + b`` of each lookup."""
    positions = torch.arange(lookups.num_lookups, device=lookups.indices.device)
    return torch.searchsorted(lookups.offsets.long(), positions, right=True) - 1


def _tables_of_lookups(stores: RowStores, lookups: Lookups) -> torch.Tensor:
    """int64 [N]: the table each lookup reads (its feature's)."""
    features = _bags_of_lookups(lookups) // max(lookups.batch_size, 1)
    return torch.tensor(stores.features, device=features.device)[features]


def _slots(slot_of_index: torch.Tensor | None, lookups: Lookups) -> torch.Tensor:
    if slot_of_index is None:
        return torch.full((lookups.num_lookups,), -1, dtype=torch.int64, device=lookups.indices.device)
    return slot_of_index.long()


def reference_rows(
    stores: RowStores, lookups: Lookups, slot_of_index: torch.Tensor | None, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """``dtype`` [N, max_dim]: the newest copy of each lookup's row (no per-sample weight), zero-padded."""
    device = lookups.indices.device
    rows = torch.zeros(lookups.num_lookups, stores.max_dim, dtype=dtype, device=device)
    tables = _tables_of_lookups(stores, lookups)
    slots = _slots(slot_of_index, lookups)
    for table, weights in enumerate(stores.table_weights):
        ids = torch.nonzero(tables == table).flatten()
        if ids.numel() == 0:
            continue
        dim = weights.shape[1]
        table_rows = weights[lookups.indices[ids].long().to(weights.device)].to(device=device, dtype=dtype)
        cached = slots[ids] >= 0
        if bool(cached.any()):
            table_rows[cached] = stores.cache_weights[slots[ids][cached], :dim].to(dtype)
        rows[ids, :dim] = table_rows
    return rows


def _copy_ranks(copies: InPlaceCopies | None, slots: torch.Tensor) -> torch.Tensor:
    """int64 [N]: the copy row of each lookup (``kernels/in_place_copies.py``), -1 for none."""
    if copies is None:
        return torch.full_like(slots, -1)
    ranks = copies.rank.long()
    return torch.where((slots < 0) & (ranks >= 0) & (ranks < copies.rows.shape[0]), ranks, -1)


def reference_forward(
    stores: RowStores,
    lookups: Lookups,
    slot_of_index: torch.Tensor | None,
    pooling: str,
    dtype: torch.dtype = torch.float64,
    copies: InPlaceCopies | None = None,
) -> torch.Tensor:
    """What ``pooled_forward`` computes, in ``dtype``: ``[B, total_dim]`` (sum, mean) or ``[N, max_dim]``;
    and, with ``copies``, the copy row of each lookup read in place (its row, as stored)."""
    if copies is not None and lookups.num_lookups:
        ranks = _copy_ranks(copies, _slots(slot_of_index, lookups))
        tables = _tables_of_lookups(stores, lookups)
        for table, weights in enumerate(stores.table_weights):
            ids = torch.nonzero((tables == table) & (ranks >= 0)).flatten()
            if ids.numel():  # (only a cached table's rows have ranks: no wider than a copy row)
                copies.rows[ranks[ids], :weights.shape[1]] = weights[
                    lookups.indices[ids].long().to(weights.device)].to(copies.rows.device)
    rows = reference_rows(stores, lookups, slot_of_index, dtype)
    if lookups.per_sample_weights is not None:
        rows = rows * lookups.per_sample_weights.to(dtype)[:, None]
    if pooling == "none":
        return rows
    if pooling not in ("sum", "mean"):
        raise ValueError(f"unknown pooling {pooling!r}")
    batch_size = lookups.batch_size
    output = torch.zeros(batch_size, stores.total_dim, dtype=dtype, device=rows.device)
    bags = _bags_of_lookups(lookups)
    features, samples = bags // max(batch_size, 1), bags % max(batch_size, 1)
    offsets = lookups.offsets.long()
    for feature, (table, column) in enumerate(zip(stores.features, stores.output_offsets)):
        dim = stores.dims[table]
        in_feature = features == feature
        pooled = torch.zeros(batch_size, dim, dtype=dtype, device=rows.device)
        pooled.index_add_(0, samples[in_feature], rows[in_feature, :dim])
        if pooling == "mean":
            bounds = offsets[feature * batch_size : (feature + 1) * batch_size + 1]
            pooled = pooled / (bounds[1:] - bounds[:-1]).clamp(min=1).to(dtype)[:, None]
        output[:, column : column + dim] = pooled
    return output


def reference_lookup_gradients(
    grad_output: torch.Tensor, stores: RowStores, lookups: Lookups, pooling: str, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """``dtype`` [N, max_dim]: d loss / d row for each lookup (zero-padded past its table's dim).

    The gradient of the output row of its bag (table columns), times its per-sample weight, divided
    by the bag length for mean pooling; for pooling none, row ``i`` of ``grad_output``.
    """
    device = grad_output.device
    gradients = torch.zeros(lookups.num_lookups, stores.max_dim, dtype=dtype, device=device)
    bags = _bags_of_lookups(lookups)
    features, samples = bags // max(lookups.batch_size, 1), bags % max(lookups.batch_size, 1)
    for feature, (table, column) in enumerate(zip(stores.features, stores.output_offsets)):
        dim = stores.dims[table]
        ids = torch.nonzero(features == feature).flatten()
        if pooling == "none":
            gradients[ids, :dim] = grad_output[ids, :dim].to(dtype)
        else:
            gradients[ids, :dim] = grad_output[samples[ids], column : column + dim].to(dtype)
    if lookups.per_sample_weights is not None:
        gradients *= lookups.per_sample_weights.to(dtype)[:, None]
    if pooling == "mean":
        offsets = lookups.offsets.long()
        gradients /= (offsets[1:] - offsets[:-1])[bags].to(dtype)[:, None]
    return gradients


def reference_per_sample_weights_grad(
    grad_output: torch.Tensor, stores: RowStores, lookups: Lookups, slot_of_index: torch.Tensor | None, pooling: str
) -> torch.Tensor:
    """float64 [N]: d loss / d per_sample_weights[i] = dot(gradient of lookup i's output, row i) (/ len for mean)."""
    unweighted = lookups._replace(per_sample_weights=None)
    gradients = reference_lookup_gradients(grad_output, stores, unweighted, pooling)
    rows = reference_rows(stores, lookups, slot_of_index)
    return (gradients * rows).sum(dim=1)


def reference_backward_update(
    grad_output: torch.Tensor,
    stores: RowStores,
    lookups: Lookups,
    slot_of_index: torch.Tensor | None,
    pooling: str,
    optimizer: FusedOptimizer,
    step: int = 1,
    copies: InPlaceCopies | None = None,
) -> None:
    """What ``backward_update`` does, in float64, rounding the new rows to the stores' dtype (nearest);
    a row with a copy row (``copies``) is read from it.

    Sums the gradient of every lookup of a row (``reference_lookup_gradients``), then applies the
    optimizer's ``reference_update`` once per row, in its slot or its backing store, and in the
    optimizer state beside it.
    """
    if lookups.num_lookups == 0:
        return
    device = lookups.indices.device
    gradients = reference_lookup_gradients(grad_output, stores, lookups, pooling)
    tables = _tables_of_lookups(stores, lookups)  # the lookups of every feature of a table update it together
    slots = _slots(slot_of_index, lookups)
    ranks = _copy_ranks(copies, slots)
    for table, weights_store in enumerate(stores.table_weights):
        ids = torch.nonzero(tables == table).flatten()
        if ids.numel() == 0:
            continue
        dim = weights_store.shape[1]
        unique_rows, row_of_lookup = torch.unique(lookups.indices[ids].long(), return_inverse=True)
        grad = torch.zeros(unique_rows.numel(), dim, dtype=torch.float64, device=device)
        grad.index_add_(0, row_of_lookup, gradients[ids, :dim])
        # One lookup of each row gives its slot (all lookups of a row agree).
        first = torch.full_like(unique_rows, ids.numel()).scatter_reduce_(
            0, row_of_lookup, torch.arange(ids.numel(), device=device), reduce="amin")
        row_slots = slots[ids][first]
        cached = row_slots >= 0
        store_rows = unique_rows.to(weights_store.device)
        weights = weights_store[store_rows].to(device=device, dtype=torch.float64)
        if bool(cached.any()):
            weights[cached] = stores.cache_weights[row_slots[cached], :dim].to(torch.float64)
        row_ranks = ranks[ids][first]
        copied = row_ranks >= 0
        if bool(copied.any()):
            weights[copied] = copies.rows[row_ranks[copied], :dim].to(device=device, dtype=torch.float64)
        state_store = stores.table_state[table]
        state = None
        if state_store is not None:
            width = state_store.shape[1]
            state = state_store[store_rows].to(device=device, dtype=torch.float64)
            if bool(cached.any()):
                state[cached] = stores.cache_state[row_slots[cached], :width].to(torch.float64)

        weights, state = optimizer.reference_update(weights, grad, state, step)

        backing = ~cached
        weights_store[store_rows[backing.to(weights_store.device)]] = weights[backing].to(
            weights_store.device, weights_store.dtype)
        if state is not None:
            state_store[store_rows[backing.to(state_store.device)]] = state[backing].to(state_store.device,
                                                                                           torch.float32)
        if bool(cached.any()):
            stores.cache_weights[row_slots[cached], :dim] = weights[cached].to(stores.cache_weights.dtype)
            if state is not None:
                stores.cache_state[row_slots[cached], : state.shape[1]] = state[cached].float()
