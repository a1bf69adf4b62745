"""Plain-torch references of the Triton kernels, for tests: slow, short, computed in float64.

Each function takes the same arguments as its kernel (``kernels/forward.py``, ``kernels/backward.py``)
and computes the same thing table by table with gathers and ``index_add_``: no tiles, no sorting,
no fused loops. Rows come from ``cache_weights[slot]`` when ``slot_of_index >= 0``, else from the
table's backing store, exactly as in ``kernels/rows.py``.
"""

from __future__ import annotations

import torch

from .rows import TIER_DEVICE, TIER_HOST, TIER_MANAGED, Lookups, RowStores

_OPTIMIZER_SGD, _OPTIMIZER_ROWWISE_ADAGRAD, _OPTIMIZER_ADAM = 1, 2, 3  # tiered_tbe.optimizers.OptimizerKind


def _store_of_tier(stores: RowStores, tier: int, kind: str) -> torch.Tensor:
    """The flat backing store (``kind`` "weights" or "state") of a tier code."""
    prefix = {TIER_DEVICE: "device", TIER_HOST: "host", TIER_MANAGED: "managed"}[tier]
    return getattr(stores, f"{prefix}_{kind}")


def _state_width(optimizer_kind: int, dim: int) -> int:
    return (0, 0, 1, 2 * dim)[int(optimizer_kind)]


def _table_facts(stores: RowStores, table: int) -> tuple[int, int, int, int, int]:
    """``(tier, dim, weight_offset, state_offset, output_offset)`` of one table, as Python ints."""
    return (int(stores.table_tier[table]), int(stores.table_dim[table]), int(stores.table_weight_offset[table]),
            int(stores.table_state_offset[table]), int(stores.table_output_offset[table]))


def _row_elements(offset: int, rows: torch.Tensor, width: int) -> torch.Tensor:
    """int64 [len(rows), width]: flat element index of each column of each row of a table."""
    return offset + rows[:, None] * width + torch.arange(width, device=rows.device)


def _lookup_tables(stores: RowStores, lookups: Lookups) -> torch.Tensor:
    """int64 [N]: table of each lookup."""
    return lookups.bag_of_index // lookups.batch_size


def _bag_lengths(lookups: Lookups) -> torch.Tensor:
    """int64 [N]: length of the bag holding each lookup."""
    return (lookups.offsets[1:] - lookups.offsets[:-1])[lookups.bag_of_index]


def reference_rows(
    stores: RowStores, lookups: Lookups, slot_of_index: torch.Tensor, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """``dtype`` [N, max_dim]: the newest copy of each lookup's row (no per-sample weight), zero-padded."""
    device = lookups.indices.device
    rows = torch.zeros(lookups.num_lookups, stores.max_dim, dtype=dtype, device=device)
    tables = _lookup_tables(stores, lookups)
    for table in range(stores.num_tables):
        tier, dim, weight_offset, _, _ = _table_facts(stores, table)
        lookup_ids = torch.nonzero(tables == table).flatten()
        if lookup_ids.numel() == 0:
            continue
        store = _store_of_tier(stores, tier, "weights")
        elements = _row_elements(weight_offset, lookups.indices[lookup_ids], dim)
        table_rows = store[elements.to(store.device)].to(device=device, dtype=dtype)
        slots = slot_of_index[lookup_ids].long()
        cached = slots >= 0
        if bool(cached.any()):
            table_rows[cached] = stores.cache_weights[slots[cached], :dim].to(dtype)
        rows[lookup_ids, :dim] = table_rows
    return rows


def reference_forward(
    stores: RowStores,
    lookups: Lookups,
    slot_of_index: torch.Tensor,
    pooling: str,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """What ``pooled_forward`` computes, in ``dtype``: ``[B, total_dim]`` (sum, mean) or ``[N, max_dim]``."""
    rows = reference_rows(stores, lookups, slot_of_index, dtype)
    if lookups.per_sample_weights is not None:
        rows = rows * lookups.per_sample_weights.to(dtype)[:, None]
    if pooling == "none":
        return rows
    if pooling not in ("sum", "mean"):
        raise ValueError(f"unknown pooling {pooling!r}")
    batch_size = lookups.batch_size
    output = torch.zeros(batch_size, stores.total_dim, dtype=dtype, device=rows.device)
    tables = _lookup_tables(stores, lookups)
    samples = lookups.bag_of_index % batch_size
    for table in range(stores.num_tables):
        _, dim, _, _, output_offset = _table_facts(stores, table)
        in_table = tables == table
        pooled = torch.zeros(batch_size, dim, dtype=dtype, device=rows.device)
        pooled.index_add_(0, samples[in_table], rows[in_table, :dim])
        if pooling == "mean":
            lengths = lookups.offsets[table * batch_size + 1 : (table + 1) * batch_size + 1] - lookups.offsets[
                table * batch_size : (table + 1) * batch_size
            ]
            pooled = pooled / lengths.clamp(min=1).to(dtype)[:, None]
        output[:, output_offset : output_offset + dim] = pooled
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
    tables = _lookup_tables(stores, lookups)
    for table in range(stores.num_tables):
        _, dim, _, _, output_offset = _table_facts(stores, table)
        lookup_ids = torch.nonzero(tables == table).flatten()
        if pooling == "none":
            gradients[lookup_ids, :dim] = grad_output[lookup_ids, :dim].to(dtype)
        else:
            samples = lookups.bag_of_index[lookup_ids] % lookups.batch_size
            gradients[lookup_ids, :dim] = grad_output[samples, output_offset : output_offset + dim].to(dtype)
    if lookups.per_sample_weights is not None:
        gradients *= lookups.per_sample_weights.to(dtype)[:, None]
    if pooling == "mean":
        gradients /= _bag_lengths(lookups).to(dtype)[:, None]
    return gradients


def reference_per_sample_weights_grad(
    grad_output: torch.Tensor, stores: RowStores, lookups: Lookups, slot_of_index: torch.Tensor, pooling: str
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
    slot_of_index: torch.Tensor,
    pooling: str,
    optimizer_kind: int,
    lr: float,
    eps: float = 1e-8,
    beta1: float = 0.9,
    beta2: float = 0.999,
    weight_decay: float = 0.0,
    step: int = 1,
) -> None:
    """What ``backward_update`` does, in float64, rounding the new rows to the stores' dtype (nearest).

    Sums the gradient of every lookup of a row (``reference_lookup_gradients``), then applies the
    optimizer of ``tiered_tbe/optimizers.py`` once per row, in its slot or its backing store, and
    in the optimizer state beside it.
    """
    if int(optimizer_kind) == 0 or lookups.num_lookups == 0:
        return
    device = lookups.indices.device
    gradients = reference_lookup_gradients(grad_output, stores, lookups, pooling)
    unique_rows, row_of_lookup = torch.unique(lookups.global_rows, return_inverse=True)
    summed = torch.zeros(unique_rows.numel(), stores.max_dim, dtype=torch.float64, device=device)
    summed.index_add_(0, row_of_lookup, gradients)
    # One lookup of each unique row gives its table, row within the table and slot (all lookups agree).
    positions = torch.arange(lookups.num_lookups, device=device)
    first_lookup = torch.full_like(unique_rows, lookups.num_lookups).scatter_reduce_(
        0, row_of_lookup, positions, reduce="amin")
    row_tables = _lookup_tables(stores, lookups)[first_lookup]
    for table in range(stores.num_tables):
        tier, dim, weight_offset, state_offset, _ = _table_facts(stores, table)
        ids = torch.nonzero(row_tables == table).flatten()
        if ids.numel() == 0:
            continue
        grad = summed[ids, :dim]
        table_rows = lookups.indices[first_lookup[ids]]
        slots = slot_of_index[first_lookup[ids]].long()
        cached = slots >= 0
        weight_store = _store_of_tier(stores, tier, "weights")
        weight_elements = _row_elements(weight_offset, table_rows, dim)
        weights = weight_store[weight_elements.to(weight_store.device)].to(device=device, dtype=torch.float64)
        if bool(cached.any()):
            weights[cached] = stores.cache_weights[slots[cached], :dim].to(torch.float64)

        state_width = _state_width(optimizer_kind, dim)
        if state_width:
            state_store = _store_of_tier(stores, tier, "state")
            state_elements = _row_elements(state_offset, table_rows, state_width)
            state = state_store[state_elements.to(state_store.device)].to(device=device, dtype=torch.float64)
            if bool(cached.any()):
                state[cached] = stores.cache_state[slots[cached], :state_width].to(torch.float64)

        if optimizer_kind == _OPTIMIZER_SGD:
            weights = weights - lr * grad
        elif optimizer_kind == _OPTIMIZER_ROWWISE_ADAGRAD:
            state = state + (grad * grad).mean(dim=1, keepdim=True)
            weights = weights - lr * grad / (state.sqrt() + eps)
        elif optimizer_kind == _OPTIMIZER_ADAM:
            m = beta1 * state[:, :dim] + (1 - beta1) * grad
            v = beta2 * state[:, dim:] + (1 - beta2) * grad * grad
            m_hat = m / (1 - beta1**step)
            v_hat = v / (1 - beta2**step)
            weights = weights - lr * (m_hat / (v_hat.sqrt() + eps) + weight_decay * weights)
            state = torch.cat([m, v], dim=1)
        else:
            raise ValueError(f"unknown optimizer kind {optimizer_kind}")

        backing = ~cached
        weight_store[weight_elements[backing].to(weight_store.device)] = weights[backing].to(
            weight_store.device, weight_store.dtype)
        if state_width:
            state_store[state_elements[backing].to(state_store.device)] = state[backing].to(
                state_store.device, torch.float32)
        if bool(cached.any()):
            stores.cache_weights[slots[cached], :dim] = weights[cached].to(stores.cache_weights.dtype)
            if state_width:
                stores.cache_state[slots[cached], :state_width] = state[cached].float()
