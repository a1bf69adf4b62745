"""Numba CUDA kernels of the slot cache. Host code: :mod:`tiered_tbe.cache.slot_cache`.

Every kernel is declared with numba's on-disk cache (``launch.cached_kernel``: a new process
loads what an earlier one compiled) and loops grid-stride over its entries, so one launch shape serves the GPU (many
blocks) and the CUDA simulator (one small block: the simulator starts a Python thread per CUDA
thread). Entries past the end of the real data are marked in the data itself (a row of
``NOT_CACHED``, a flag of 0), so launches are sized from host-known bounds and the GPU path
never waits for the device to learn how many rows a batch had.

No kernel uses atomics: each unique row or slot is handled by one thread. The policy's kernels, which decide what
each unique row of a prefetch gets, are in :mod:`tiered_tbe.cache.policy_kernels`.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from tiered_tbe.base.descriptors import (
    DIM,
    NUM_ROWS,
    ROW_OFFSET,
    STATE_ADDRESS,
    STATE_STRIDE,
    STATE_WIDTH,
    WEIGHTS_ADDRESS,
    WEIGHTS_STRIDE,
)
from tiered_tbe.cache.launch import cached_kernel
from tiered_tbe.cache.policy import EMPTY, NO_SLOT, find_way_device, set_of_row_device

NOT_CACHED = np.iinfo(np.int64).max  # row id standing for "outside every cached table"; sorts last

# ``outcome`` of a unique row of a batch.
OUTCOME_NONE = 0  # padding past the batch's unique rows
OUTCOME_HIT = 1
OUTCOME_FILLED = 2  # missed, copied into a slot
OUTCOME_NO_SLOT = 3  # missed, kept out by the policy's admission or by a batch in flight (bypass_count): slot -1
OUTCOME_SET_FULL = 4  # missed, its set had no unlocked way left for it (locked rows, earlier misses): slot -1
# Both of the last two leave the row in its backing store; ``misses_set_full`` counts only the second, which
# batches in flight raise by locking their rows (what PrefetchPipeline(fit_cache=True) watches).

# Steps of the lookahead window one int64 word of ``window_bits`` holds: bit ``s % WINDOW_BITS``
# of a row's word stands for the batch prefetched at step ``s``.
WINDOW_BITS = 64


# ``wanted`` of copy_rows_kernel that copies every entry whose row lies in the group's tables.
COPY_EVERY_ROW = -1


@cached_kernel
def copy_rows_kernel(
    selected,  # uint8 or int8 [N]: entry e is copied only where selected[e] == wanted (any [N] array when
    #            wanted is COPY_EVERY_ROW)
    wanted,  # int64: the value of `selected` that means "copy", or COPY_EVERY_ROW: every entry is copied
    row_of_entry,  # int32 or int64 [N]: global row of each entry (any value outside the group's tables is skipped)
    slot_of_entry,  # int32 or int64 [N]: its slot
    num_entries,  # int32 or int64 [1]: only entries before num_entries[0] are looked at (a count the device
    #               knows: the batch's unique rows, which fills and write-backs lie among)
    descriptor,  # int64 [G, DESCRIPTOR_COLUMNS]: the group's tables, ascending global rows (base/descriptors.py)
    to_backing,  # bool: True copies slot -> backing store (write-back), False the reverse (fill)
    cache_weights,  # [S, row_words]: slot rows, reinterpreted as integer words
    cache_state,  # fp32 [S, state_width] (or a [1, 1] dummy when no table has state)
    store_weights,  # [W] the group's whole weights buffer, the same integer words
    store_weights_address,  # int64: the byte address of store_weights[0]
    store_state,  # fp32 [V] the group's whole optimizer-state buffer (or a [1] dummy)
    store_state_address,  # int64: the byte address of store_state[0]
    element_shift,  # int64: log2 of a weight's bytes
    word_shift,  # int64: log2 of a word's bytes (a word holds one or more whole elements)
):
    """Copy whole rows (weights and optimizer state) between slots and the backing stores of a
    group of tables that share one buffer: one launch for all of them.

    Launched with 2-D blocks: threadIdx.x walks the columns of a row (coalesced), threadIdx.y
    and the grid walk the entries, one dependent load of ``selected`` each: walking the whole
    padded batch (1.7M entries for ~210K unique rows on Criteo) took ~0.18 ms with nothing to
    copy (H200, results/measurements.jsonl), hence ``num_entries``. Weights travel as integer
    words (up to 8 bytes, several elements each where rows allow): a copy needs no arithmetic,
    and bf16 has no numba type. A binary search over the group's table starts finds an entry's
    table; its descriptor row (the TBE kernels' layout: byte addresses, strides in elements)
    gives the row's place in the group's buffers.
    """
    column_start = cuda.threadIdx.x
    column_stride = cuda.blockDim.x
    entry_stride = cuda.gridDim.x * cuda.blockDim.y
    end = min(num_entries[0], selected.shape[0])
    for entry in range(cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y, end, entry_stride):
        if wanted != COPY_EVERY_ROW and selected[entry] != wanted:
            continue
        _move_row(row_of_entry[entry], slot_of_entry[entry], to_backing, descriptor, cache_weights, cache_state,
                  store_weights, store_weights_address, store_state, store_state_address, element_shift, word_shift,
                  column_start, column_stride)


@cached_kernel
def move_rows_kernel(
    outcome,  # int8 [N]: OUTCOME_* of each unique row of a prefetch (only OUTCOME_FILLED entries move)
    unique_rows,  # int64 [N]: the unique rows, ascending
    slot_of_unique,  # int32 [N]: the slot each was given
    victim_row,  # int64 [N]: the row that slot held, EMPTY if none
    victim_was_dirty,  # uint8 [N]: 1 when that row must be written back first
    num_entries,  # int32 or int64 [1]: only entries before num_entries[0] are looked at (the unique rows)
    descriptor,  # int64 [G, DESCRIPTOR_COLUMNS]: every cached table (one group: one buffer), base/descriptors.py
    cache_weights,  # [S, row_words]: slot rows, reinterpreted as integer words
    cache_state,  # fp32 [S, state_width] (or a [1, 1] dummy)
    store_weights,  # [W]: the tables' weights buffer, the same integer words
    store_weights_address,  # int64: the byte address of store_weights[0]
    store_state,  # fp32 [V]: their optimizer-state buffer (or a [1] dummy)
    store_state_address,  # int64: the byte address of store_state[0]
    element_shift,  # int64: log2 of a weight's bytes
    word_shift,  # int64: log2 of a word's bytes
):
    """A prefetch's moves in one pass, as FBGEMM's insert kernel orders them: the warp of a filled
    slot writes its dirty victim back, then reads the missed row in. SM reads and writes of host
    memory share one limit (two launches take the sum of their times), but interleaved in each warp
    they moved ~55-62 GB/s where two launches moved ~36-45 (H200, docs/performance.md). A victim is
    read before its slot is refilled (one warp, in program order); a row is never both a victim and a
    fill of one prefetch (a victim is cached, a fill is not)."""
    column_start = cuda.threadIdx.x
    column_stride = cuda.blockDim.x
    entry_stride = cuda.gridDim.x * cuda.blockDim.y
    end = min(num_entries[0], outcome.shape[0])
    for entry in range(cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y, end, entry_stride):
        if outcome[entry] != OUTCOME_FILLED:
            continue
        slot = slot_of_unique[entry]
        victim = victim_row[entry]
        if victim != EMPTY and victim_was_dirty[entry] != 0:
            _move_row(victim, slot, True, descriptor, cache_weights, cache_state, store_weights,
                      store_weights_address, store_state, store_state_address, element_shift, word_shift,
                      column_start, column_stride)
        _move_row(unique_rows[entry], slot, False, descriptor, cache_weights, cache_state, store_weights,
                  store_weights_address, store_state, store_state_address, element_shift, word_shift,
                  column_start, column_stride)


@cuda.jit(device=True, inline=True)
def _move_row(row, slot, to_backing, descriptor, cache_weights, cache_state, store_weights, store_weights_address,
              store_state, store_state_address, element_shift, word_shift, column_start, column_stride):
    """Copy one row (weights and optimizer state) between slot ``slot`` and its backing store, by the
    calling warp; nothing when ``row`` lies outside the group's tables. A binary search over the
    group's table starts finds the row's table; its descriptor row (the TBE kernels' layout: byte
    addresses, strides in elements) gives the row's place in the group's buffers."""
    low = table_of_row(row, descriptor[:, ROW_OFFSET])
    first_row = descriptor[low, ROW_OFFSET]
    if row < first_row or row >= first_row + descriptor[low, NUM_ROWS]:
        return  # a row of another group's table
    local_row = row - first_row
    weights_base = (((descriptor[low, WEIGHTS_ADDRESS] - store_weights_address) >> word_shift)
                    + ((local_row * descriptor[low, WEIGHTS_STRIDE]) << element_shift >> word_shift))
    words = descriptor[low, DIM] << element_shift >> word_shift
    state_width = descriptor[low, STATE_WIDTH]
    state_base = 0
    if state_width > 0:
        state_base = ((descriptor[low, STATE_ADDRESS] - store_state_address) >> 2
                      ) + local_row * descriptor[low, STATE_STRIDE]
    state_slot = slot if state_width > 0 else 0  # the [1, 1] dummy when there is no state
    if to_backing:
        _copy_row(store_weights, weights_base, cache_weights[slot], 0, words,
                  store_state, state_base, cache_state[state_slot], 0, state_width, column_start, column_stride)
    else:
        _copy_row(cache_weights[slot], 0, store_weights, weights_base, words,
                  cache_state[state_slot], 0, store_state, state_base, state_width, column_start, column_stride)


@cuda.jit(device=True, inline=True)
def table_of_row(row, table_starts):
    """The last table whose first row is <= ``row`` (table 0 when none is): a binary search over
    ``table_starts`` (int64 [T], ascending)."""
    low, high = 0, table_starts.shape[0]
    while high - low > 1:
        middle = (low + high) // 2
        if table_starts[middle] <= row:
            low = middle
        else:
            high = middle
    return low


@cuda.jit(device=True, inline=True)
def _copy_row(to_words, to_words_base, from_words, from_words_base, words,
              to_state, to_state_base, from_state, from_state_base, state_width, column_start, column_stride):
    """One warp copies a row's words and state values, two words per thread per round.

    Every load of a round is issued before its stores: the compiler cannot reorder a load
    past a store to memory that might alias it, and a load from host memory over PCIe takes
    about a microsecond, so interleaved load-store pairs would wait for each load in turn.
    A 512-byte row of 8-byte words (64 words, a 32-thread warp) is then one round trip.
    """
    state_column = column_start
    for column in range(column_start, words, 2 * column_stride):
        second = column + column_stride
        first_word = from_words[from_words_base + column]
        second_word = from_words[from_words_base + second] if second < words else first_word
        state_value = from_state[from_state_base + state_column] if state_column < state_width else 0.0
        to_words[to_words_base + column] = first_word
        if second < words:
            to_words[to_words_base + second] = second_word
        if state_column < state_width:
            to_state[to_state_base + state_column] = state_value
            state_column += column_stride
    for column in range(state_column, state_width, column_stride):  # state wider than the rounds
        to_state[to_state_base + column] = from_state[from_state_base + column]


@cached_kernel
def lookup_kernel(
    rows,  # int64 [N]: global rows, NOT_CACHED outside every cached table
    num_sets,  # int64
    associativity,  # int64
    tags,  # int64 [S]
    slot_of_index,  # int32 [N] out: slot holding each row, or NO_SLOT
):
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for i in range(start, rows.shape[0], stride):
        row = rows[i]
        slot = NO_SLOT
        if row != NOT_CACHED:
            slot = find_way_device(tags, set_of_row_device(row, num_sets) * associativity, associativity, row)
        slot_of_index[i] = slot


@cached_kernel
def mark_dirty_kernel(
    slot_of_index,  # int32 [N]: slots of a batch's lookups, NO_SLOT for uncached ones
    dirty,  # uint8 [S]
):
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for i in range(start, slot_of_index.shape[0], stride):
        slot = slot_of_index[i]
        if slot != NO_SLOT:
            dirty[slot] = 1  # repeated slots write the same value: no atomics needed


@cached_kernel
def release_kernel(
    locked_slots,  # int32 [N]: the slots a batch's prefetch locked, each once; NO_SLOT padding
    bypassed_rows,  # int64 [N]: the rows it gave no slot, each once; NOT_CACHED padding
    mark_dirty,  # bool: also mark the locked slots dirty (the batch's backward updated them)
    locks,  # int32 [S]
    dirty,  # uint8 [S]
    bypass_count,  # uint8 [R]: per global row (see policy_kernels.find_hits_kernel)
):
    """The batch is done with its rows: one lock less per slot it locked (dirty first, when its
    backward updated them), and later prefetches may cache the rows it read in place. One
    launch for all three: each is a Numba launch of ~60-80 us of host time otherwise."""
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for i in range(start, locked_slots.shape[0], stride):
        slot = locked_slots[i]
        if slot != NO_SLOT:
            if mark_dirty:
                dirty[slot] = 1
            locks[slot] -= 1  # distinct slots: one writer each
        row = bypassed_rows[i]
        if row != NOT_CACHED:
            bypass_count[row] -= 1  # distinct rows: one writer each
