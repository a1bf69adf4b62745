"""The distinct global rows of a batch, for a lookahead hint: a kernel before the sort, two after it.

A lookahead pipeline tells the cache the rows of every batch entering its window, once per batch, long
before the batch is validated (``TieredEmbeddingBags.rows_for_hint``). Each lookup's global row is its
index clamped into its feature's table plus the table's first global row; lookups past the last bag are
left out. The rows are sorted, and the first of each run of equal rows is moved to the front. With plain
torch that took ~30 kernels over the batch's padded lookups (4M on the mixed-dim shape): the prefetch
stream of the mixed pipeline ran 116 kernels a step against `lfu-admit`'s 50 (H100 trace,
docs/performance.md). Here:

1. ``_hint_keys_kernel``: the global row of each position (a binary search of the feature starts), as
   int32 sort keys when every global row fits, ``none_key`` past the last bag;
2. ``base.sorting.stable_sort`` (CUB where it imports);
3. ``_first_of_runs_kernel``: 1 where a sorted key differs from the one before it and is not ``none_key``;
4. ``torch.cumsum`` of those flags: where each distinct row goes;
5. ``_compact_runs_kernel``: each distinct row to its place as int64, ``INT64_MAX`` after the last.

``hint_rows_reference`` computes the same with plain torch (the ``"torch"`` backend).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tiered_tbe.base.codes import INT32_MAX, INT64_MAX
from tiered_tbe.base.searching import starts_at_or_below
from tiered_tbe.base.sorting import compact, sort_ids, stable_sort

BLOCK = 1024  # positions per program


@triton.jit
def _hint_keys_kernel(
    keys_ptr,  # int32/int64 [N] out: each position's global row, clamped into its table; none_key past the last bag
    indices_ptr,  # int32/int64 [N]: each lookup's row within its feature's table, not validated
    feature_starts_ptr,  # int32/int64 [F + 1]: where each feature's lookups start, then where the last bag ends
    num_rows_ptr,  # int64 [F]: rows of each feature's table (at least 1)
    row_offset_ptr,  # int64 [F]: the global row of row 0 of each feature's table
    num_positions,  # N
    num_features,  # F
    none_key,  # the key of a position past the last bag: the keys' dtype's largest value
    SEARCH_STEPS: tl.constexpr,  # steps of the binary search over the F starts: F.bit_length()
    BLOCK: tl.constexpr,  # positions per program
):
    positions = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = positions < num_positions
    # The last feature whose start is at or before the position, of the F starts (past the end: F - 1);
    # positions before the first start belong to feature 0.
    feature = tl.maximum(starts_at_or_below(feature_starts_ptr, positions, inside, num_features, SEARCH_STEPS) - 1, 0)
    index = tl.load(indices_ptr + positions, mask=inside, other=0).to(tl.int64)
    table_rows = tl.load(num_rows_ptr + feature, mask=inside, other=1)
    row = tl.load(row_offset_ptr + feature, mask=inside, other=0) + tl.minimum(tl.maximum(index, 0), table_rows - 1)
    end = tl.load(feature_starts_ptr + num_features).to(tl.int64)
    key = tl.where(positions < end, row, none_key)
    tl.store(keys_ptr + positions, key.to(keys_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _first_of_runs_kernel(
    first_ptr,  # int32 [N] out: 1 where a key starts a run of equal keys and is not none_key, else 0
    sorted_keys_ptr,  # int32/int64 [N]: ascending
    num_positions,  # N
    none_key,  # the keys of positions past the last bag (they sort last)
    BLOCK: tl.constexpr,  # positions per program
):
    positions = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = positions < num_positions
    key = tl.load(sorted_keys_ptr + positions, mask=inside, other=0)
    before = tl.load(sorted_keys_ptr + positions - 1, mask=inside & (positions > 0), other=0)
    first = ((positions == 0) | (key != before)) & (key != none_key)
    tl.store(first_ptr + positions, first.to(tl.int32), mask=inside)


@triton.jit
def _compact_runs_kernel(
    rows_ptr,  # int64 [N] out: the distinct keys ascending, then INT64_MAX
    sorted_keys_ptr,  # int32/int64 [N]: ascending
    first_ptr,  # int32 [N]: _first_of_runs_kernel's flags
    place_ptr,  # int32 [N]: their inclusive cumsum (a first key's place is its value - 1; the last is the count)
    num_positions,  # N (>= 1)
    padding,  # int64: the row written after the distinct ones (INT64_MAX)
    BLOCK: tl.constexpr,  # positions per program
):
    positions = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = positions < num_positions
    count = tl.load(place_ptr + num_positions - 1).to(tl.int64)
    # Places below the count are written by the first keys only, those at or above it by the padding only.
    tl.store(rows_ptr + positions, tl.zeros([BLOCK], dtype=tl.int64) + padding, mask=inside & (positions >= count))
    first = tl.load(first_ptr + positions, mask=inside, other=0) != 0
    place = tl.load(place_ptr + positions, mask=inside, other=1).to(tl.int64) - 1
    key = tl.load(sorted_keys_ptr + positions, mask=inside, other=0).to(tl.int64)
    tl.store(rows_ptr + place, key, mask=inside & first)


def hint_rows(indices: torch.Tensor, feature_starts: torch.Tensor, num_rows_of_feature: torch.Tensor,
              row_offset: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct global rows of a batch's lookups, ascending, then padding.

    Args:
        indices: int32/int64 [N]: each lookup's row in its feature's table (clamped into it here).
        feature_starts: int32/int64 [F + 1]: the position of each feature's first lookup, then the end of
            the last bag (``offsets[::B]``); positions at or past the end are left out.
        num_rows_of_feature: int64 [F], each >= 1; row_offset: int64 [F]: each feature's table's rows and
            the global row of its row 0.
        num_rows: the global rows of all tables (an exclusive bound of every row).

    Returns:
        ``(rows, count)``: int64 [N], the ``count`` distinct rows ascending then ``INT64_MAX``; ``count``
        an int64 device scalar. No host sync; CUDA-graph capturable.
    """
    n = indices.numel()
    device = indices.device
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=device), torch.zeros((), dtype=torch.int64, device=device)
    num_features = num_rows_of_feature.numel()
    key_dtype, none_key = (torch.int32, INT32_MAX) if num_rows < INT32_MAX else (torch.int64, INT64_MAX)
    grid = (triton.cdiv(n, BLOCK),)
    keys = torch.empty(n, dtype=key_dtype, device=device)
    _hint_keys_kernel[grid](keys, indices, feature_starts, num_rows_of_feature, row_offset, n, num_features,
                            none_key, SEARCH_STEPS=num_features.bit_length(), BLOCK=BLOCK)
    sorted_keys = stable_sort(keys, upper_bound=none_key)[0]
    first = torch.empty(n, dtype=torch.int32, device=device)
    _first_of_runs_kernel[grid](first, sorted_keys, n, none_key, BLOCK=BLOCK)
    place = torch.cumsum(first, 0, dtype=torch.int32)
    rows = torch.empty(n, dtype=torch.int64, device=device)
    _compact_runs_kernel[grid](rows, sorted_keys, first, place, n, INT64_MAX, BLOCK=BLOCK)
    return rows, place[-1].long()


def hint_rows_reference(indices: torch.Tensor, feature_starts: torch.Tensor, num_rows_of_feature: torch.Tensor,
                        row_offset: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`hint_rows` with plain torch ops (the ``"torch"`` backend; the kernels' reference)."""
    indices, feature_starts = indices.long(), feature_starts.long()
    positions = torch.arange(indices.numel(), device=indices.device)
    feature = (torch.searchsorted(feature_starts, positions, right=True) - 1).clamp_(0, num_rows_of_feature.numel() - 1)
    rows = torch.minimum(indices.clamp(min=0), num_rows_of_feature[feature] - 1)
    rows = torch.where(positions < feature_starts[-1], row_offset[feature] + rows, INT64_MAX)
    sorted_rows = sort_ids(rows, num_rows)[0]
    first = torch.ones_like(sorted_rows, dtype=torch.bool)
    first[1:] = sorted_rows[1:] != sorted_rows[:-1]
    first &= sorted_rows != INT64_MAX
    return compact(first, sorted_rows, fill=INT64_MAX)[0], first.sum()
