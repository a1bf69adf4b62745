"""Numba CUDA kernels of a prefetch's bookkeeping: deduplicating the batch, the remap, the counters.

The policy's kernels (:mod:`tiered_tbe.cache.policy_kernels`) decide what happens to each unique
row of a batch. Around them a prefetch of ``N``
lookups must find the unique rows (grouped by set) and, afterwards, turn the decisions into
each lookup's slot, the rows left in the backing store, the write-back list and the counters.
Done with torch ops that took ~45 launches over the ``N`` lookups (~0.56 ms of a 2.34 ms
cached Criteo step on the H200, results/measurements.jsonl, 2026-12-01); here each
pass over the batch is one kernel::

    sort_keys_kernel         rows -> sort keys (rows outside every cached table -> the "none" key)
    stable_sort              keys ascending, and their order (the backward's too: kernels/grouping.py)
    run_heads_kernel         1 at the first sorted position of each cached row, else 0
    torch.cumsum             the unique number (1-based) of every sorted position
    unique_rows_kernel       the unique rows (ascending, then NOT_CACHED padding), their sets,
                             and the policy kernel's outputs initialised
    stable_sort              the unique rows grouped by set
    run_heads_kernel, torch.cumsum, set_starts_kernel
                             the first position of each set the batch touches, in order
    the policy's kernels     hits, victims, fills (``policy_kernels.py``)
    torch.cumsum             the rank of each row given no slot among them
    batch_outcomes_kernel    each lookup's slot, the rows given no slot (and each such lookup's
                             rank), the dirty victims' write-back keys, and each thread's counts

Everything stays on the device, sized by ``N`` (padding marks what is not a row), so a prefetch
never waits for the GPU and replays as one CUDA graph. No atomics: every output entry has one
writer, and each thread writes its counts to its own row of ``partial_counters``, summed by
torch afterwards. Host functions: :func:`unique_rows_of_batch` (before the policy
kernel) and :func:`outcomes_of_batch` (after it); their plain-torch reference is
``reference_bookkeeping`` in ``tests/test_cache_bookkeeping.py``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from numba import cuda

from tiered_tbe.base.codes import INT32_MAX, INT64_MAX
from tiered_tbe.base.sorting import stable_sort
from tiered_tbe.cache._kernels import (
    NOT_CACHED,
    OUTCOME_FILLED,
    OUTCOME_HIT,
    OUTCOME_NO_SLOT,
    OUTCOME_NONE,
    OUTCOME_SET_FULL,
    table_of_row,
)
from tiered_tbe.cache.launch import cached_kernel
from tiered_tbe.cache.policy import EMPTY, NO_SLOT, set_of_row_device

# The device counters a prefetch adds to, in this order (the CacheStats fields but ``batches``).
COUNTER_NAMES = ("lookups", "lookup_hits", "unique_rows", "unique_hits", "unique_misses", "misses_no_slot",
                 "misses_set_full", "evictions", "write_backs", "bytes_in", "bytes_out")
(_LOOKUPS, _LOOKUP_HITS, _UNIQUE_ROWS, _UNIQUE_HITS, _UNIQUE_MISSES, _MISSES_NO_SLOT, _MISSES_SET_FULL, _EVICTIONS,
 _WRITE_BACKS, _BYTES_IN, _BYTES_OUT) = range(len(COUNTER_NAMES))
NUM_COUNTERS = len(COUNTER_NAMES)
# Most blocks of batch_outcomes_kernel: each of its threads writes a row of partial_counters, so
# the grid is capped (512 x 256 threads: 10 MB of partial counts, summed in a few microseconds).
REDUCE_BLOCKS = 512


@cached_kernel
def sort_keys_kernel(
    rows,  # int32 or int64 [N]: global row of each lookup
    table_starts,  # int64 [T]: first global row of each cached table, ascending
    table_ends,  # int64 [T]: one past the last global row of each
    none_key,  # int64: the key of a row outside every cached table (the largest value of keys' dtype)
    keys,  # int32 or int64 [N] out: the row (it fits the dtype), or none_key
):
    """The keys the batch is sorted by: its rows, with those outside the cached tables sorted last."""
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for i in range(start, rows.shape[0], stride):
        row = rows[i]
        table = table_of_row(row, table_starts)
        inside = row >= table_starts[table] and row < table_ends[table]
        keys[i] = row if inside else none_key


@cached_kernel
def run_heads_kernel(
    sorted_keys,  # int32 or int64 [N]: the sort keys, ascending
    none_key,  # int64: the key of no row (sorts last)
    is_head,  # int32 [N] out: 1 where a cached row's run of equal keys starts, else 0
):
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for i in range(start, sorted_keys.shape[0], stride):
        key = sorted_keys[i]
        is_head[i] = 1 if key != none_key and (i == 0 or sorted_keys[i - 1] != key) else 0


@cached_kernel
def unique_rows_kernel(
    sorted_keys,  # int32 or int64 [N]: the sort keys, ascending
    unique_number,  # int32 [N]: inclusive prefix sum of run_heads_kernel's is_head
    none_key,  # int64: the key of no row
    num_sets,  # int64
    unique_rows,  # int64 [N] out: the unique rows, ascending, then NOT_CACHED
    set_of_unique,  # int32 [N] out: set of each unique row; num_sets for padding (sorts last)
    slot_of_unique,  # int32 [N] out: NO_SLOT (the policy kernels' input state)
    outcome,  # int8 [N] out: OUTCOME_NONE
    victim_row,  # int64 [N] out: EMPTY
    victim_was_dirty,  # uint8 [N] out: 0
):
    """Thread ``i`` writes position ``i`` of every padded output, and the unique row whose run
    starts at sorted position ``i`` (its unique number is never above ``i + 1``; padding
    starts at the batch's count of unique rows, past every unique row's index: one writer each)."""
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    n = sorted_keys.shape[0]
    num_unique = unique_number[n - 1]
    for i in range(start, n, stride):
        slot_of_unique[i] = NO_SLOT
        outcome[i] = OUTCOME_NONE
        victim_row[i] = EMPTY
        victim_was_dirty[i] = 0
        if i >= num_unique:
            unique_rows[i] = NOT_CACHED
            set_of_unique[i] = num_sets
        key = sorted_keys[i]
        if key != none_key and (i == 0 or sorted_keys[i - 1] != key):
            row = np.int64(key)
            u = unique_number[i] - 1
            unique_rows[u] = row
            set_of_unique[u] = set_of_row_device(row, num_sets)


@cached_kernel
def set_starts_kernel(
    is_set_head,  # int32 [N]: 1 at the first sorted position of each set the batch touches, else 0
    set_number,  # int32 [N]: inclusive prefix sum of is_set_head
    set_start,  # int32 [N] out: the first position of each touched set, in order, then N
):
    """Thread ``i`` writes the start of the set whose first position is ``i`` (at its set number,
    never above ``i``), and ``N`` at ``i`` when ``i`` is past the batch's count of sets: one writer each."""
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    n = is_set_head.shape[0]
    num_sets_touched = set_number[n - 1]
    for i in range(start, n, stride):
        if i >= num_sets_touched:
            set_start[i] = n
        if is_set_head[i] != 0:
            set_start[set_number[i] - 1] = i


@cached_kernel
def batch_outcomes_kernel(
    sorted_keys,  # int32 or int64 [N]: the sort keys, ascending
    order,  # int32 [N]: the lookup at each sorted position
    unique_number,  # int32 [N]: 1-based unique number of each sorted position (see unique_rows_kernel)
    none_key,  # int64: the key of no row
    unique_rows,  # int64 [N]: the unique rows, then NOT_CACHED
    slot_of_unique,  # int32 [N]: the policy's slot of each unique row (NO_SLOT: none)
    outcome,  # int8 [N]: its OUTCOME_* of each
    victim_row,  # int64 [N]: the row a fill evicted, EMPTY if none
    victim_was_dirty,  # uint8 [N]: 1 when that row must be written back
    table_starts,  # int64 [T]: first global row of each cached table, ascending
    table_row_bytes,  # int64 [T]: bytes of a row of each, weights and optimizer state
    no_slot_count,  # int32 [N]: inclusive prefix sum over the unique rows given no slot (OUTCOME_NO_SLOT, _SET_FULL)
    slot_of_index,  # int32 [N] out: the slot of every lookup's row, NO_SLOT when none
    in_place_rank,  # int32 [N] out: for a lookup whose row got no slot, that row's rank among the batch's
    #                 rows given none (0-based, ascending rows); NO_SLOT for every other lookup
    bypassed_rows,  # int64 [N] out: the unique rows given no slot, NOT_CACHED elsewhere
    write_back_keys,  # dtype of sorted_keys [N] out: the dirty victims' rows, none_key elsewhere
    partial_counters,  # int64 [gridDim.x * blockDim.x, NUM_COUNTERS] out: each thread's sums of COUNTER_NAMES
):
    """Thread ``i`` handles sorted position ``i`` as a lookup (its slot goes to the lookup
    ``order[i]``) and as a unique row's position, and writes its counts to its own row of
    ``partial_counters`` (summed by torch). Not a shared-memory reduction per block: its
    barrier cost the CUDA simulator ~15 ms a launch, and the rows of a capped grid are a few MB."""
    counts = cuda.local.array(NUM_COUNTERS, np.int64)
    for c in range(NUM_COUNTERS):
        counts[c] = 0
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    num_unique = unique_number[sorted_keys.shape[0] - 1]
    for i in range(start, sorted_keys.shape[0], stride):
        slot = NO_SLOT
        rank = NO_SLOT
        if sorted_keys[i] != none_key:
            u = unique_number[i] - 1
            slot = slot_of_unique[u]
            counts[_LOOKUPS] += 1
            if outcome[u] == OUTCOME_HIT:
                counts[_LOOKUP_HITS] += 1
            elif outcome[u] == OUTCOME_NO_SLOT or outcome[u] == OUTCOME_SET_FULL:
                rank = no_slot_count[u] - 1
        slot_of_index[order[i]] = slot
        in_place_rank[order[i]] = rank

        bypassed = NOT_CACHED
        write_back_key = none_key
        if i < num_unique:  # past it, padding: nothing to read
            row = unique_rows[i]
            result = outcome[i]
            counts[_UNIQUE_ROWS] += 1
            if result == OUTCOME_HIT:
                counts[_UNIQUE_HITS] += 1
            else:
                counts[_UNIQUE_MISSES] += 1
            if result == OUTCOME_NO_SLOT or result == OUTCOME_SET_FULL:
                counts[_MISSES_NO_SLOT] += 1
                bypassed = row
            if result == OUTCOME_SET_FULL:
                counts[_MISSES_SET_FULL] += 1
            if result == OUTCOME_FILLED:
                counts[_BYTES_IN] += table_row_bytes[table_of_row(row, table_starts)]
                victim = victim_row[i]
                if victim != EMPTY:
                    counts[_EVICTIONS] += 1
                    if victim_was_dirty[i] != 0:
                        counts[_WRITE_BACKS] += 1
                        counts[_BYTES_OUT] += table_row_bytes[table_of_row(victim, table_starts)]
                        write_back_key = victim
        bypassed_rows[i] = bypassed
        write_back_keys[i] = write_back_key

    for c in range(NUM_COUNTERS):
        partial_counters[start, c] = counts[c]


# ------------------------------------------------------------------------------------ host functions


class UniqueRows(NamedTuple):
    """A batch of ``N`` lookups deduplicated (device tensors [N], padded past its unique rows),
    and the policy kernels' outputs, initialised (``policy_kernels.py`` fills them in)."""

    sorted_keys: torch.Tensor  # int32 when the rows fit, else int64: the sort keys, ascending
    order: torch.Tensor  # int32: the lookup at each sorted position
    unique_number: torch.Tensor  # int32: the 1-based unique number of each sorted position
    none_key: int  # the key of no row: the largest value of sorted_keys' dtype
    unique_rows: torch.Tensor  # int64: the unique rows, ascending, then NOT_CACHED
    set_of_unique: torch.Tensor  # int32: the set of each, num_sets for padding
    slot_of_unique: torch.Tensor  # int32 NO_SLOT: slot of each unique row
    outcome: torch.Tensor  # int8 OUTCOME_NONE: OUTCOME_* of each
    victim_row: torch.Tensor  # int64 EMPTY: the row its fill evicted
    victim_was_dirty: torch.Tensor  # uint8 0: 1 when that row must be written back


def sort_keys_dtype(rows_end: int) -> tuple[torch.dtype, int]:
    """``(dtype, none_key)`` of a batch's sort keys when the cached tables' rows end at ``rows_end``:
    int32 when they fit (half the bytes to sort), the key of no row the dtype's largest value."""
    return (torch.int32, INT32_MAX) if rows_end <= INT32_MAX else (torch.int64, INT64_MAX)


def unique_rows_of_batch(launcher, rows: torch.Tensor, table_starts: torch.Tensor, table_ends: torch.Tensor,
                         rows_end: int, num_sets: int) -> UniqueRows:
    """Deduplicate ``rows`` (int32 or int64 [N], N >= 1; rows outside the cached tables, given by
    ``table_starts`` / ``table_ends`` int64 [T] ascending, are dropped); ``rows_end`` bounds the
    rows of those tables (int32 keys below INT32_MAX). ``launcher``: a ``KernelLauncher``."""
    n = rows.numel()
    on = dict(device=rows.device)
    key_dtype, none_key = sort_keys_dtype(rows_end)
    keys = torch.empty(n, dtype=key_dtype, **on)
    launcher.launch(sort_keys_kernel, n, rows, table_starts, table_ends, none_key, keys)
    # Stable: equal keys keep the lookups' order, so the backward can take this sort as its own.
    sorted_keys, order = stable_sort(keys, none_key)
    is_head = torch.empty(n, dtype=torch.int32, **on)
    launcher.launch(run_heads_kernel, n, sorted_keys, none_key, is_head)
    unique_number = torch.cumsum(is_head, 0, dtype=torch.int32)
    unique = UniqueRows(sorted_keys, order, unique_number, none_key, torch.empty(n, dtype=torch.int64, **on),
                        torch.empty(n, dtype=torch.int32, **on), torch.empty(n, dtype=torch.int32, **on),
                        torch.empty(n, dtype=torch.int8, **on), torch.empty(n, dtype=torch.int64, **on),
                        torch.empty(n, dtype=torch.uint8, **on))
    launcher.launch(unique_rows_kernel, n, sorted_keys, unique_number, none_key, num_sets, *unique[4:])
    return unique


def set_starts_of_batch(launcher, set_of_position: torch.Tensor, num_sets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(set_start, set_number)``, int32 [N] each: the first position of each set in ``set_of_position``
    (int32 [N], ascending; ``num_sets`` for padding, sorted last), in order, then N; and the 1-based
    number of each position's set among the touched ones (the padding's: the count of touched sets)."""
    n = set_of_position.numel()
    is_set_head = torch.empty(n, dtype=torch.int32, device=set_of_position.device)
    launcher.launch(run_heads_kernel, n, set_of_position, num_sets, is_set_head)
    set_number = torch.cumsum(is_set_head, 0, dtype=torch.int32)
    set_start = torch.empty(n, dtype=torch.int32, device=set_of_position.device)
    launcher.launch(set_starts_kernel, n, is_set_head, set_number, set_start)
    return set_start, set_number


def outcomes_of_batch(launcher, unique: UniqueRows, table_starts: torch.Tensor, table_row_bytes: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """After the policy kernel filled ``unique``'s outputs: ``(slot_of_index int32 [N],
    in_place_rank int32 [N], bypassed_rows int64 [N], write_back_keys [N] (sorted_keys' dtype), counters
    int64 [NUM_COUNTERS])`` (see batch_outcomes_kernel); ``table_row_bytes`` int64 [T]."""
    n = unique.sorted_keys.numel()
    on = dict(device=unique.sorted_keys.device)
    # The padding's outcome is OUTCOME_NONE: only the unique rows given no slot are counted.
    no_slot = (unique.outcome == OUTCOME_NO_SLOT) | (unique.outcome == OUTCOME_SET_FULL)
    no_slot_count = torch.cumsum(no_slot, 0, dtype=torch.int32)
    slot_of_index = torch.empty(n, dtype=torch.int32, **on)
    in_place_rank = torch.empty(n, dtype=torch.int32, **on)
    bypassed_rows = torch.empty(n, dtype=torch.int64, **on)
    write_back_keys = torch.empty(n, dtype=unique.sorted_keys.dtype, **on)
    blocks, threads = launcher.shape_of(n, REDUCE_BLOCKS)
    partial_counters = torch.empty(blocks * threads, NUM_COUNTERS, dtype=torch.int64, **on)
    launcher.launch_configured(batch_outcomes_kernel, blocks, threads, *unique[:4], unique.unique_rows,
                               unique.slot_of_unique, unique.outcome, unique.victim_row, unique.victim_was_dirty,
                               table_starts, table_row_bytes, no_slot_count, slot_of_index, in_place_rank,
                               bypassed_rows, write_back_keys, partial_counters)
    return slot_of_index, in_place_rank, bypassed_rows, write_back_keys, partial_counters.sum(0)
