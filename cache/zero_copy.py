"""The zero-copy row mover: copy kernels read and write the backing stores in place, on the prefetch's stream.

Everything happens on the current stream, in order: a prefetch's dirty victims are written
back (ascending rows: the GPU writes host memory at ~52 GB/s in row order, ~21 GB/s in random
order on the H200 machine), then the missed rows are copied in. So a batch's fills are ready
when its prefetch's stream reaches them, and nothing else needs waiting for.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from tiered_tbe.base.descriptors import describe_tables
from tiered_tbe.base.mode import SIMULATION
from tiered_tbe.base.sorting import stable_sort
from tiered_tbe.cache import _kernels
from tiered_tbe.cache._kernels import OUTCOME_FILLED
from tiered_tbe.cache.launch import KernelLauncher, flat_view
from tiered_tbe.cache.mover import Moves, RowMover
from tiered_tbe.cache.tables import BITS_OF_SIZE, CachedTable
from tiered_tbe.cache.tiers import is_pinned_host_memory

# Most thread blocks a copy launch (fill, write-back, flush) uses; each block moves 8 rows at a
# time. On the H200 fewer blocks (1056, 264, 132) copied 10-20% more slowly and did not speed a
# pipeline up (results/measurements.jsonl); other platforms can try `bench_cache.py --copy-blocks`.
# Env TIERED_TBE_COPY_BLOCKS overrides it.
DEFAULT_COPY_BLOCKS = int(os.environ.get("TIERED_TBE_COPY_BLOCKS", "16384"))
# Rows a copy block moves at a time (a warp each): 32 x this many threads per block.
DEFAULT_COPY_ROWS_PER_BLOCK = int(os.environ.get("TIERED_TBE_COPY_ROWS_PER_BLOCK", "8"))
# A prefetch's moves in one launch (move_rows_kernel: each warp writes its slot's dirty victim back, then
# reads the missed row in) rather than two (write-backs in row order, then fills). On the H200, 12 mixed-dim
# tables in managed memory, 2.35M rows in and out a batch: prefetch 41.7 ms against 49.2; 214K rows: 8.3 against
# 10.1 (docs/performance.md). SM reads and writes of host memory share one ~52 GB/s limit (they do not overlap
# as copy-engine DMAs do), but interleaved in one warp they reach ~55-62. Managed memory only (see __init__).
# Env TIERED_TBE_FUSED_MOVES=0: two launches everywhere; =all: one launch into pinned memory too (to measure it).
FUSED_MOVES_SETTING = os.environ.get("TIERED_TBE_FUSED_MOVES", "1")
DEFAULT_FUSED_MOVES = FUSED_MOVES_SETTING in ("1", "all")


class ZeroCopyMover(RowMover):
    """Moves rows with ``copy_rows_kernel`` (``cache/_kernels.py``): one launch per group of
    tables that share a backing buffer, weights and state together.

    ``copy_blocks`` and ``copy_rows_per_block`` set the launch shape on the GPU.
    """

    name = "zero_copy"

    def __init__(self, weights: torch.Tensor, state: torch.Tensor, tables: list[CachedTable],
                 device: torch.device, launcher: KernelLauncher, rows_end: int):
        self.device = device
        self.launcher = launcher
        self.rows_end = rows_end
        self.copy_blocks = DEFAULT_COPY_BLOCKS  # most thread blocks per copy launch (GPU only)
        self.copy_rows_per_block = DEFAULT_COPY_ROWS_PER_BLOCK  # warps per copy block (GPU only)
        # One launch for a prefetch's moves: one buffer group only, and not into pinned memory, where writes in
        # random order (a victim's) ran at ~12 GB/s against ~52 in row order (managed memory: ~45; the H200,
        # docs/performance.md): there the two launches keep the write-backs sorted by row. Measured end to end
        # on pinned tables: 12 mixed-dim tables 11.9 ms a prefetch with two launches, 21.0 with one; the Criteo
        # tables 2.73 and 2.55 (bench fbgemm, records of f4e466c and 875449f).
        self.fused_moves = DEFAULT_FUSED_MOVES and (
            FUSED_MOVES_SETTING == "all" or not any(is_pinned_host_memory(t.weights) for t in tables))
        self._copy_groups = self._make_copy_groups(weights, state, tables)

    def enqueue(self, moves: Moves) -> tuple[torch.Tensor, ...]:
        if self.fused_moves and len(self._copy_groups) == 1:
            # Write-backs and fills side by side. Not with several groups: a victim of one group may be
            # replaced by a row of another, and one launch per group would not keep its read before its refill.
            group = self._copy_groups[0]
            self.launcher.launch_configured(
                _kernels.move_rows_kernel, *self._copy_shape(moves.outcome.numel(), moves.num_unique), moves.outcome,
                moves.unique_rows, moves.slot_of_unique, moves.victim_row, moves.victim_was_dirty, moves.num_unique,
                group.descriptor, group.cache_weights, group.cache_state, group.store_weights,
                group.store_weights_address, group.store_state, group.store_state_address, group.element_shift,
                group.word_shift)
            return ()
        # A slot's old row leaves before its new row arrives: write-backs first, then fills. The
        # dirty victims are distinct rows, written in ascending order (the GPU writes host memory
        # ~2.5x faster in row order); the padding keys sort last and lie outside every table.
        # Both lie among the batch's unique rows, a count the device knows (moves.num_unique).
        sorted_rows, order = stable_sort(moves.write_back_keys)
        self.copy_rows(sorted_rows, _kernels.COPY_EVERY_ROW, sorted_rows, moves.slot_of_unique[order],
                       to_backing=True, num_entries=moves.num_unique)
        self.copy_rows(moves.outcome, OUTCOME_FILLED, moves.unique_rows, moves.slot_of_unique, to_backing=False,
                       num_entries=moves.num_unique)
        return ()  # nothing to hand off: the fills are done when the prefetch's stream gets here

    def wait_filled(self, ticket) -> None:
        pass  # the fills ran on the prefetch's stream, which the caller already waits for

    def write_back(self, sorted_rows, sorted_slots, selected) -> None:
        self.copy_rows(selected, 1, sorted_rows, sorted_slots, to_backing=True)

    def drain(self) -> None:
        pass

    def copy_rows(self, selected, wanted, row_of_entry, slot_of_entry, to_backing, num_entries=None) -> None:
        """Copy the rows of the entries where ``selected == wanted`` (every entry with ``wanted ==
        COPY_EVERY_ROW``; all tables, one launch per buffer group; see ``copy_rows_kernel``):
        slot -> backing store if ``to_backing``, else backing store -> slot. ``num_entries``: an
        int32/int64 [1] device tensor, the entries to look at (default all)."""
        if num_entries is None:
            num_entries = torch.full((1,), selected.numel(), dtype=torch.int64, device=selected.device)
        grid, block = self._copy_shape(selected.numel(), num_entries)
        for group in self._copy_groups:
            self.launcher.launch_configured(
                _kernels.copy_rows_kernel, grid, block, selected, wanted, row_of_entry, slot_of_entry, num_entries,
                group.descriptor, to_backing, group.cache_weights, group.cache_state, group.store_weights,
                group.store_weights_address, group.store_state, group.store_state_address, group.element_shift,
                group.word_shift)

    def _copy_shape(self, num_entries: int, entries_to_look_at: torch.Tensor) -> tuple[int, tuple[int, int]]:
        """``(grid, block)`` of a copy launch over ``num_entries`` entries, of which the first
        ``entries_to_look_at[0]`` (a device count) hold rows."""
        if SIMULATION:
            # Few simulator threads (each is a Python thread); each walks many entries, all columns.
            # No more threads than entries to look at: a thread past the last has nothing to do,
            # and each costs the simulator ~1 ms a launch (most launches look at a few entries).
            from tiered_tbe.cache import launch

            entries = min(num_entries, int(entries_to_look_at[0]))
            return 1, (1, max(1, min(entries, launch.SIMULATED_THREADS)))
        rows_per_block = self.copy_rows_per_block
        return max(1, min(-(-num_entries // rows_per_block), self.copy_blocks)), (32, rows_per_block)

    def _make_copy_groups(self, weights, state, tables) -> list[_CopyGroup]:
        """Kernel arguments of ``copy_rows_kernel`` for each group of tables whose weights (and
        state) share one buffer, as a module's tables of one tier do: one launch copies rows of
        every table of a group, converted for the kernels once.

        Rows travel as the widest integer words (up to 8 bytes) that divide every row, row
        stride and row offset involved: a warp then moves up to 256 bytes per instruction.
        """
        element = weights.element_size()
        array = self.launcher.array
        if weights.stride(1) != 1:
            raise ValueError("the cache's slot rows must be contiguous (weights.stride(1) == 1)")
        groups: dict[tuple, list[CachedTable]] = {}
        for t in tables:
            state_key = None if t.state is None else t.state.untyped_storage().data_ptr()
            groups.setdefault((t.weights.untyped_storage().data_ptr(), state_key), []).append(t)

        byte_quantities = [weights.data_ptr(), weights.stride(0) * element, weights.shape[1] * element]
        for t in tables:
            byte_quantities += [t.weights.data_ptr(), t.weights.stride(0) * element, t.dim * element]
        word = next(size for size in (8, 4, 2, 1) if all(q % size == 0 for q in byte_quantities))
        word_dtype = BITS_OF_SIZE[word]
        dummy_state = torch.zeros(1, 1, dtype=torch.float32, device=self.device)
        k_cache_weights = array(weights.view(word_dtype))
        k_cache_state = array(state if state.shape[1] else dummy_state)

        result = []
        for group in groups.values():  # tables ascend by global row (see check_tables)
            store_weights = flat_view(group[0].weights, word_dtype)
            store_state = flat_view(group[0].state, torch.float32) if group[0].state is not None else dummy_state[0]
            descriptor = describe_tables([t.weights for t in group], [t.state for t in group],
                                         [t.global_row_start for t in group], device=self.device)
            result.append(_CopyGroup(
                (descriptor, store_weights, store_state), array(descriptor), k_cache_weights, k_cache_state,
                array(store_weights), store_weights.data_ptr(), array(store_state), store_state.data_ptr(),
                element.bit_length() - 1, word.bit_length() - 1))
        return result


class _CopyGroup(NamedTuple):
    """``copy_rows_kernel``'s arguments for one group of tables sharing a buffer, as kernel views."""

    tensors: tuple  # (descriptor, store words, store state): the views below do not own memory on the GPU
    descriptor: object  # int64 [G, DESCRIPTOR_COLUMNS] of the group's tables (base/descriptors.py)
    cache_weights: object  # the slot rows as words
    cache_state: object  # the slots' state (or a [1, 1] dummy)
    store_weights: object  # the group's weights buffer as words
    store_weights_address: int  # its byte address
    store_state: object  # the group's state buffer (or a [1] dummy)
    store_state_address: int
    element_shift: int  # log2 of a weight's bytes
    word_shift: int  # log2 of a word's bytes
