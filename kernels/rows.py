"""The tensors the TBE kernels read rows from and update rows in.

The kernels know nothing of caching policy: they receive the backing stores of every tier,
the slot-cache rows, and a slot per lookup (``slot_of_index``; -1 means "read and update the
backing store directly"). Without a cache every slot is -1.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# Codes of ``RowStores.table_tier``.
TIER_DEVICE = 0
TIER_HOST = 1
TIER_MANAGED = 2


class RowStores(NamedTuple):
    """Every row of every table of one module, and the optimizer state beside it.

    Row ``r`` of table ``t`` is, in its backing store,
    ``weights[tier][table_weight_offset[t] + r * table_dim[t] + c]`` for column ``c``; its
    optimizer state (``state_width`` fp32 values, see ``state_width_of``) is
    ``state[tier][table_state_offset[t] + r * state_width + j]``. While the row sits in slot
    ``s`` of the cache, the newest copy is ``cache_weights[s, c]`` and ``cache_state[s, j]``.
    All offsets are element offsets (int64: addresses of large tables pass 2^31).
    """

    device_weights: torch.Tensor  # flat, weights dtype: rows of DEVICE tables (numel 0 if none)
    host_weights: torch.Tensor  # flat, weights dtype: pinned host rows (HOST, HOST_CACHED)
    managed_weights: torch.Tensor  # flat, weights dtype: managed rows (MANAGED, MANAGED_CACHED)
    device_state: torch.Tensor  # flat fp32 optimizer state of DEVICE tables
    host_state: torch.Tensor  # flat fp32 optimizer state of host tables
    managed_state: torch.Tensor  # flat fp32 optimizer state of managed tables
    table_tier: torch.Tensor  # int32 [T]: TIER_DEVICE, TIER_HOST or TIER_MANAGED
    table_weight_offset: torch.Tensor  # int64 [T]: element offset of row 0 in its tier's weights
    table_state_offset: torch.Tensor  # int64 [T]: element offset of row 0 in its tier's state
    table_dim: torch.Tensor  # int32 [T]: embedding_dim
    table_output_offset: torch.Tensor  # int32 [T]: first column of table t in a pooled output row
    cache_weights: torch.Tensor  # [num_slots, cache_row_width] weights dtype ([0, 1] without cache)
    cache_state: torch.Tensor  # [num_slots, cache_state_width] fp32 ([0, 1] without state)
    max_dim: int  # largest embedding_dim
    total_dim: int  # sum of embedding_dim: width of a pooled output row
    num_rows: int | None = None  # global rows of all tables (lets sorts use int32 keys); None: unknown

    @property
    def num_tables(self) -> int:
        return self.table_dim.numel()


class Lookups(NamedTuple):
    """One batch in FBGEMM's TBE layout, with the per-lookup facts the kernels need.

    ``N`` lookups into ``T`` tables of ``B`` bags each; bag ``t * B + b`` is
    ``indices[offsets[t*B+b] : offsets[t*B+b+1]]`` (table-major).
    """

    indices: torch.Tensor  # int64 [N]: row within its table
    offsets: torch.Tensor  # int64 [T*B+1]: non-decreasing, offsets[0] == 0, offsets[-1] == N
    bag_of_index: torch.Tensor  # int64 [N]: t*B + b of the bag holding each lookup
    global_rows: torch.Tensor  # int64 [N]: row_offset[t] + indices, one id space for all tables
    per_sample_weights: torch.Tensor | None  # fp32 [N] or None
    batch_size: int  # B

    @property
    def num_lookups(self) -> int:
        return self.indices.numel()


def state_width_of(optimizer_kind: int, dim: int) -> int:
    """fp32 optimizer-state values per row: SGD 0, row-wise Adagrad 1, Adam 2 * dim (m, v)."""
    return (0, 0, 1, 2 * dim)[int(optimizer_kind)]
