"""The tensors the TBE kernels read rows from and update rows in: one table of row stores.

The kernels know nothing of tiers or caching policy. They receive, per table, the address of
row 0 of its weights and of its optimizer state, wherever those live (HBM, pinned host memory,
managed memory: any memory the GPU addresses), the slot-cache rows, and a slot per lookup
(``slot_of_index``; -1 means "read and update the table's backing store directly"). A new
GPU-addressable tier is therefore only a new way to allocate a table's rows: the kernels, the
references and :class:`RowStores` stay as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from tiered_tbe.base.descriptors import describe_tables

# Weights dtypes the kernels take; the plain-torch references also take float64.
WEIGHTS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_REFERENCE_DTYPES = (*WEIGHTS_DTYPES, torch.float64)

# Features whose tables' dims round up to at most this many columns share one column group: a
# launch of their own would cost more than the few masked columns of a shared tile.
MIN_GROUP_COLUMNS = 8


class ColumnGroup(NamedTuple):
    """Features whose dims round up to one power of two: one launch of the forward-type kernels,
    a column tile of ``block_d`` (a tile of the widest dim would leave a narrow table's rows mostly
    mask, and fit fewer bags in a tile's budget)."""

    block_d: int  # the group's column tile: its widest dim rounded up to a power of two
    features: tuple[int, ...]  # its features, ascending
    # int64 [len(features), DESCRIPTOR_COLUMNS]: their rows of RowStores.descriptor (column FEATURE says whose);
    # the descriptor itself when the group holds every feature.
    descriptor: torch.Tensor


class TableGroups(NamedTuple):
    """The tables grouped by column tile, as the features are in ``column_groups``: the backward
    updates each group's rows with a launch of its own width (``kernels/run_groups.py``)."""

    block_ds: tuple[int, ...]  # each group's column tile, narrowest first
    ends: tuple[int, ...]  # one past each group's last entry of ``tables`` (group g: ends[g-1] .. ends[g])
    tables: torch.Tensor  # int32 [T]: the tables, group by group, ascending within a group
    row_starts: torch.Tensor  # int64 [T + 1]: global row of each table's row 0, then the end of all rows


def by_column_tile(dims: tuple[int, ...]) -> list[tuple[int, list[int]]]:
    """``[(block_d, members)]``: the indices of ``dims`` grouped by column tile (the next power of two of
    their dim, dims up to ``MIN_GROUP_COLUMNS`` together), narrowest first, each group's ``block_d`` its
    widest dim rounded up to a power of two."""
    classes: dict[int, list[int]] = {}
    for i, dim in enumerate(dims):
        classes.setdefault(max(power_of_two_at_least(dim), MIN_GROUP_COLUMNS), []).append(i)
    return [(power_of_two_at_least(max(dims[i] for i in members)), members)
            for _, members in sorted(classes.items())]


def table_groups(dims: tuple[int, ...], row_offsets: tuple[int, ...], num_rows: int,
                 device: torch.device) -> TableGroups | None:
    """The tables of ``dims`` by column tile (``by_column_tile``); None when they all fall in one."""
    groups = by_column_tile(dims)
    if len(groups) == 1:
        return None
    block_ds, ends, order = [], [], []
    for block_d, tables in groups:
        block_ds.append(block_d)
        order += tables
        ends.append(len(order))
    return TableGroups(tuple(block_ds), tuple(ends), torch.tensor(order, dtype=torch.int32, device=device),
                       torch.tensor([*row_offsets, num_rows], dtype=torch.int64, device=device))


def power_of_two_at_least(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(n - 1, 0).bit_length()


def column_groups(dims_of_features: tuple[int, ...], block_d: int, descriptor: torch.Tensor
                  ) -> tuple[ColumnGroup, ...]:
    """The features grouped by column tile (the next power of two of their dim, dims up to
    ``MIN_GROUP_COLUMNS`` together), narrowest first; when they all fall in one: one group of every
    feature, the whole ``descriptor`` and the stores' ``block_d`` (one launch, as of old)."""
    by_tile = by_column_tile(dims_of_features)
    if len(by_tile) == 1:
        return (ColumnGroup(block_d, tuple(range(len(dims_of_features))), descriptor),)
    groups = []
    for group_block_d, features in by_tile:
        rows = torch.tensor(features, dtype=torch.int64, device=descriptor.device)
        groups.append(ColumnGroup(group_block_d, tuple(features), descriptor.index_select(0, rows)))
    return tuple(groups)


@dataclass(frozen=True, eq=False)
class RowStores:
    """Every row of every table of one module, and the optimizer state beside it.

    Row ``r`` of table ``t`` is ``table_weights[t][r]`` (``[num_rows_t, dim_t]``, rows of
    contiguous elements) and its optimizer state ``table_state[t][r]`` (fp32
    ``[num_rows_t, width]``, or ``None`` when the optimizer keeps none). While the row sits in
    slot ``s`` of the cache, its newest copy is ``cache_weights[s, :dim_t]`` and
    ``cache_state[s, :width]``. All weights share one dtype (fp32, fp16 or bf16).

    A batch looks the tables up through ``F`` features (FBGEMM's ``feature_table_map``: feature
    ``f`` looks up table ``feature_table_map[f]``; default: feature ``t`` is table ``t``). Two
    features of one table read and update the same rows: a row has one global row id, whichever
    feature names it. A pooled output row holds the features side by side, in order.

    The kernels read one int64 tensor built here once, on the cache's device: ``descriptor``
    (``[F, DESCRIPTOR_COLUMNS]``, ``base/descriptors.py``), a row per feature: its table's byte
    addresses of row 0 of weights and state, their row strides, dim and global row offset (all
    tables share one global row id space), and the feature's first column in a pooled output row.
    """

    table_weights: tuple[torch.Tensor, ...]
    table_state: tuple[torch.Tensor | None, ...]
    cache_weights: torch.Tensor  # [num_slots, row_width] weights dtype ([0, 1] without a cache)
    cache_state: torch.Tensor  # fp32 [num_slots, state_width] ([0, 1] without state)
    feature_table_map: tuple[int, ...] | None = None  # table of each feature; None: feature t is table t
    descriptor: torch.Tensor = field(init=False)  # int64 [F, DESCRIPTOR_COLUMNS] (base/descriptors.py)
    dims: tuple[int, ...] = field(init=False)  # embedding_dim of each table, on the host
    row_offsets: tuple[int, ...] = field(init=False)  # global row id of row 0 of each table
    features: tuple[int, ...] = field(init=False)  # the table of each feature (feature_table_map resolved)
    output_offsets: tuple[int, ...] = field(init=False)  # first column of each feature in a pooled output row
    shares_tables: bool = field(init=False)  # some table is looked up by two or more features
    num_rows: int = field(init=False)  # global rows of all tables (sorts use int32 keys below 2^31)
    alignment: int = field(init=False)  # elements that every weights row start and dim is a multiple of
    state_alignment: int = field(init=False)  # fp32 values that every state row start is a multiple of
    block_d: int = field(init=False)  # the kernels' column tile: the widest row rounded up to a power of two
    # The features by column tile: the forward launches once per group (one group when every dim rounds alike).
    column_groups: tuple[ColumnGroup, ...] = field(init=False)
    # The tables by column tile: the backward updates each group's rows with a launch of its own (None: one group).
    table_groups: TableGroups | None = field(init=False)

    def __post_init__(self):
        if not self.table_weights or len(self.table_weights) != len(self.table_state):
            raise ValueError("RowStores needs one weights tensor and one state entry (or None) per table")
        dtype = self.table_weights[0].dtype
        if dtype not in _REFERENCE_DTYPES:
            raise TypeError(f"weights must be float32, float16 or bfloat16, got {dtype}")
        device = self.cache_weights.device
        for t, (weights, state) in enumerate(zip(self.table_weights, self.table_state)):
            if weights.dtype != dtype:
                raise TypeError(f"table {t}: all weight stores must share one dtype, got {weights.dtype} and {dtype}")
            if weights.dim() != 2 or weights.shape[0] < 1 or (weights.shape[1] > 1 and weights.stride(1) != 1):
                raise ValueError(f"table {t}: weights must be [num_rows >= 1, dim] with contiguous rows")
            if state is not None and (state.dtype != torch.float32 or state.dim() != 2
                                      or state.shape[0] != weights.shape[0]
                                      or (state.shape[1] > 1 and state.stride(1) != 1)):
                raise ValueError(f"table {t}: state must be fp32 [{weights.shape[0]}, width] with contiguous rows")
        if self.cache_weights.dtype != dtype or self.cache_weights.dim() != 2:
            raise TypeError(f"cache_weights must be 2-D {dtype}, got {self.cache_weights.dtype} "
                            f"{tuple(self.cache_weights.shape)}")
        if self.cache_state.dtype != torch.float32 or self.cache_state.dim() != 2:
            raise TypeError("cache_state must be 2-D fp32")
        for name in ("cache_weights", "cache_state"):
            tensor = getattr(self, name)
            if tensor.numel() > 0 and tensor.shape[1] > 1 and tensor.stride(1) != 1:
                raise ValueError(f"RowStores.{name} must have contiguous rows")

        dims = tuple(int(w.shape[1]) for w in self.table_weights)
        row_offsets, total = [], 0
        for weights in self.table_weights:
            row_offsets.append(total)
            total += int(weights.shape[0])
        element = self.table_weights[0].element_size()

        def stride(tensor):
            return 0 if tensor is None else int(tensor.stride(0))

        # Vector loads need every row start 16-byte aligned: the largest power of two of elements
        # (at most 16 bytes) dividing every address, row stride and dim the kernels use.
        def alignment_of(tensors, cache, element_size):
            present = [t for t in tensors if t is not None]
            if any(t.data_ptr() % element_size for t in present):
                return 1
            quantities = [t.data_ptr() // element_size for t in present] + [stride(t) for t in present]
            if cache.shape[0] > 0:
                quantities += [cache.data_ptr() // element_size, cache.stride(0)]
            return math.gcd(*quantities, 16 // element_size)

        alignment = math.gcd(alignment_of(self.table_weights, self.cache_weights, element), *dims)
        state_alignment = alignment_of(self.table_state, self.cache_state, 4)
        features = tuple(range(len(dims))) if self.feature_table_map is None else tuple(
            int(t) for t in self.feature_table_map)
        if not features or any(not 0 <= t < len(dims) for t in features):
            raise ValueError(f"feature_table_map must name tables 0..{len(dims) - 1}, got {list(features)}")
        output_offsets = tuple(sum(dims[t] for t in features[:f]) for f in range(len(features)))
        descriptor = describe_tables([self.table_weights[t] for t in features], [self.table_state[t] for t in features],
                                     [row_offsets[t] for t in features], output_offsets, device)
        # Computed once: triton.next_power_of_2 took 3.4 us a call on the training path's host.
        block_d = power_of_two_at_least(max(dims, default=1))
        values = {
            "descriptor": descriptor, "block_d": block_d,
            "column_groups": column_groups(tuple(dims[t] for t in features), block_d, descriptor),
            "table_groups": table_groups(dims, tuple(row_offsets), total, device),
            "dims": dims, "row_offsets": tuple(row_offsets), "features": features, "output_offsets": output_offsets,
            "shares_tables": len(set(features)) < len(features), "num_rows": total,
            "alignment": alignment, "state_alignment": state_alignment,
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @property
    def num_tables(self) -> int:
        return len(self.table_weights)

    @property
    def num_features(self) -> int:
        """``F``: the features a batch has bags of (``offsets`` has ``F * B + 1`` entries)."""
        return len(self.features)

    @property
    def max_dim(self) -> int:
        return max(self.dims)

    @property
    def total_dim(self) -> int:
        """Width of a pooled output row: the sum over features of their tables' dims."""
        return sum(self.dims[t] for t in self.features)

    @property
    def weights_dtype(self) -> torch.dtype:
        return self.table_weights[0].dtype

    @property
    def uses_cache(self) -> bool:
        return self.cache_weights.shape[0] > 0

    def replace(self, **changes) -> RowStores:
        """A copy with some of ``table_weights, table_state, cache_weights, cache_state,
        feature_table_map`` replaced."""
        return replace(self, **changes)

    def clone(self) -> RowStores:
        """Deep copy of every row and state value (tests, benchmarks)."""
        return RowStores(tuple(w.clone() for w in self.table_weights),
                         tuple(None if s is None else s.clone() for s in self.table_state),
                         self.cache_weights.clone(), self.cache_state.clone(), self.feature_table_map)


def no_cache(dtype: torch.dtype, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cache_weights, cache_state)`` of a module without a slot cache: empty ``[0, 1]`` tensors."""
    return (torch.empty(0, 1, dtype=dtype, device=device), torch.empty(0, 1, dtype=torch.float32, device=device))


class Lookups(NamedTuple):
    """One batch in FBGEMM's TBE layout.

    ``N`` lookups in ``F`` features of ``B`` bags each (a feature looks up one table:
    ``RowStores.features``); bag ``f * B + b`` is ``indices[offsets[f*B+b] : offsets[f*B+b+1]]``
    (feature-major; with one feature a table, table-major). ``indices`` and ``offsets``
    may be int32 or int64 (the kernels read either). ``global_rows`` (int32 or int64 [N]) and
    ``bag_of_index`` (int32 [N]) may come along when the caller computed them already (the
    cache's prefetch needs them); else the backward computes them (``kernels/linearize.py``).
    """

    # int32 / int64 [N]: row within its feature's table; None only for a batch that comes with its global_rows and
    # bag_of_index (inside the backward, which then never reads them: backward.without_unread_inputs)
    indices: torch.Tensor | None
    offsets: torch.Tensor  # int32 / int64 [F*B+1]: non-decreasing, offsets[0] == 0, offsets[-1] == N
    batch_size: int  # B
    per_sample_weights: torch.Tensor | None = None  # fp32 [N] or None
    global_rows: torch.Tensor | None = None  # int64 [N]: global row of row 0 of the feature's table + indices
    bag_of_index: torch.Tensor | None = None  # int32 [N]: f*B + b of the bag holding each lookup

    @property
    def num_lookups(self) -> int:
        return (self.indices if self.indices is not None else self.bag_of_index).numel()


def check_lookups(stores: RowStores, lookups: Lookups, slot_of_index: torch.Tensor | None) -> None:
    """Shape and dtype checks that need no device synchronization (values are the caller's job)."""
    if stores.weights_dtype not in WEIGHTS_DTYPES:
        raise TypeError(f"the kernels take float32, float16 or bfloat16 weights, got {stores.weights_dtype}")
    num_lookups = lookups.num_lookups
    num_bags = stores.num_features * lookups.batch_size
    if lookups.offsets.numel() != num_bags + 1:
        raise ValueError(f"offsets must have F*B+1 = {num_bags + 1} entries ({stores.num_features} features), got "
                         f"{lookups.offsets.numel()}")
    for name in ("indices", "offsets"):
        tensor = getattr(lookups, name)
        if tensor.dtype not in (torch.int32, torch.int64) or tensor.dim() != 1:
            raise TypeError(f"Lookups.{name} must be a 1-D int32 or int64 tensor, got {tensor.dtype} "
                            f"{tuple(tensor.shape)}")
    if lookups.per_sample_weights is not None and (
        lookups.per_sample_weights.dtype != torch.float32 or lookups.per_sample_weights.shape != (num_lookups,)
    ):
        raise TypeError(f"per_sample_weights must be fp32 [{num_lookups}]")
    if slot_of_index is not None and (slot_of_index.dtype != torch.int32 or slot_of_index.shape != (num_lookups,)):
        raise TypeError(f"slot_of_index must be int32 [{num_lookups}], got {slot_of_index.dtype} "
                        f"{tuple(slot_of_index.shape)}")
