"""The lookahead window's bits: set or clear one step's bit in the per-row words of a batch's rows.

``cache/hints.py`` keeps, per row of the cached tables, an int64 word whose bit ``s % WINDOW_BITS`` is set
while the recorded batch of step ``s`` names the row. One Triton kernel sets a recorded batch's bit and
clears it when the step leaves the window, skipping the rows outside the cached tables itself (a binary
search of the table starts). Four torch ops and a masked copy of the rows did it before: a lookahead
pipeline's hints are padded to the batch's padded lookups (~4M on the mixed-dim benchmark, about half of
them padding), every padded row was masked, gathered and scattered to one spare word, and a masked copy
was kept (32 MB a batch, 1 GiB over a window of 32). On an H100 the kernel made the ragged lookahead
pipeline's step 0.72 of what it was, the mixed one's 0.93 (docs/performance.md). A Triton launch costs
the host tens of microseconds; a Numba launch outside a graph ~0.3 ms (docs/PITFALLS.md), which is why
this cache kernel is not a Numba one. ``update_window_bits_reference`` is the same update in plain torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tiered_tbe.base.searching import starts_at_or_below
from tiered_tbe.cache._kernels import WINDOW_BITS
from tiered_tbe.cache.tables import in_cached_tables

BLOCK = 1024  # rows per program of _update_window_bits_kernel


@triton.jit(do_not_specialize=["num_rows", "bit"])  # one compile per SET_BIT, whatever the batch and its step
def _update_window_bits_kernel(
    words_ptr,  # int64 [R] in/out: window_bits, one word per global row of the cached tables' id space
    rows_ptr,  # int64 [M]: a recorded batch's global rows (repeats, padding and rows of no cached table allowed)
    table_starts_ptr,  # int64 [T]: the first global row of each cached table, ascending
    table_ends_ptr,  # int64 [T]: one past the last global row of each cached table
    num_rows,  # M
    num_tables,  # T (>= 1)
    bit,  # the step's bit, 0 .. WINDOW_BITS - 1 (step % WINDOW_BITS)
    SET_BIT: tl.constexpr,  # True: set the bit in each row's word; False: clear it
    SEARCH_STEPS: tl.constexpr,  # steps of the binary search over the T starts: T.bit_length()
    BLOCK: tl.constexpr,  # rows per program
):
    positions = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = positions < num_rows
    row = tl.load(rows_ptr + positions, mask=inside, other=-1)
    # The cached table of each row: the last table start at or below it (-1: below the first).
    table = starts_at_or_below(table_starts_ptr, row, inside, num_tables, SEARCH_STEPS) - 1
    end = tl.load(table_ends_ptr + tl.maximum(table, 0), mask=inside, other=0)
    cached = inside & (table >= 0) & (row < end)
    # Rows of no cached table (padding among them) neither load nor store. A row named twice is read and
    # written twice with the same word: every write of an index carries the same value.
    word = tl.load(words_ptr + row, mask=cached, other=0)
    step_bit = tl.full([BLOCK], 1, dtype=tl.int64) << bit  # bit 63 is the sign bit of an int64
    word = (word | step_bit) if SET_BIT else (word & ~step_bit)
    tl.store(words_ptr + row, word, mask=cached)


def update_window_bits(words: torch.Tensor, rows: torch.Tensor, table_starts: torch.Tensor,
                       table_ends: torch.Tensor, step: int, set_bit: bool) -> None:
    """Set (or clear) bit ``step % WINDOW_BITS`` of ``words[r]`` for each row ``r`` of ``rows`` in a
    cached table (``table_starts[t] <= r < table_ends[t]``); other rows are skipped. One launch, no sync.

    Args:
        words: int64 [R], updated in place; rows: int64 [M]; table_starts, table_ends: int64 [T], ascending."""
    if rows.numel() == 0 or table_starts.numel() == 0:
        return
    num_tables = table_starts.numel()
    _update_window_bits_kernel[(triton.cdiv(rows.numel(), BLOCK),)](
        words, rows, table_starts, table_ends, rows.numel(), num_tables, step % WINDOW_BITS, SET_BIT=set_bit,
        SEARCH_STEPS=num_tables.bit_length(), BLOCK=BLOCK)


def update_window_bits_reference(words: torch.Tensor, rows: torch.Tensor, table_starts: torch.Tensor,
                                 table_ends: torch.Tensor, step: int, set_bit: bool) -> None:
    """:func:`update_window_bits` in plain torch (the kernel's reference)."""
    if rows.numel() == 0 or table_starts.numel() == 0:
        return
    index = rows[in_cached_tables(rows, table_starts, table_ends)]
    bit = step % WINDOW_BITS
    step_bit = 1 << bit if bit < WINDOW_BITS - 1 else -(1 << bit)  # as an int64: bit 63 is the sign
    selected = words[index]
    words[index] = (selected | step_bit) if set_bit else (selected & ~step_bit)
