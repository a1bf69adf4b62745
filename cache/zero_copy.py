"""The zero-copy row mover: copy kernels read and write the backing stores in place over the bus.

On the prefetch's stream ``P``, in order: the dirty victims leave their slots for a victim
buffer in HBM (a device-to-device copy, ~0.05 ms for a batch's ~72K rows), then the missed
rows are copied in from the backing stores (the fill: the batch needs it). The victims' way
to their backing stores (ascending rows: the GPU writes host memory ~2.5x faster in row order)
runs **behind the step**, on the mover's stream ``W``, while the forward and backward run: on
the H200 the write-back of a batch took 0.77-1.57 ms of the serial cached step (RESULTS.md,
seventh session), as long as the fill. ``W``'s launch uses few blocks
(``BEHIND_BLOCKS``) so that it leaves the SMs to training.

Ordering (mover.py's guarantees):

- 3 (a victim leaves before its slot is refilled): the victim buffer copy precedes the fill on ``P``.
- 2 (write-backs before re-reads): the next prefetch's stream waits for ``W``'s last write-back
  (:meth:`ZeroCopyMover.wait_for_earlier_moves`, outside its CUDA graph) before its victim copy
  (which reuses the buffer) and its fill. ``flush``/``write_back``/``drain`` wait for it too.
- 1: a batch's fills are ready when its prefetch's stream reaches them; a row it reads in place
  (slot -1) was never a victim still on its way: a victim was cached when its prefetch ran, so
  it is neither a row of that batch nor one an earlier batch in flight left uncached, and every
  later prefetch waits for ``W`` first.

A batch with more dirty victims than the buffer holds (``behind_rows``, default
``DEFAULT_BEHIND_ROWS``) writes the rest back on ``P`` before its fill, as the mover did before.
"""

from __future__ import annotations

import os

import torch

from tiered_tbe.base.mode import SIMULATION
from tiered_tbe.cache import _kernels
from tiered_tbe.cache._kernels import OUTCOME_FILLED
from tiered_tbe.cache.launch import KernelLauncher, flat_view
from tiered_tbe.cache.mover import Moves, RowMover
from tiered_tbe.cache.tables import BITS_OF_SIZE, CachedTable

# Most thread blocks a copy launch (fill, write-back, flush) uses; each block moves 8 rows at a
# time. On the H200 fewer blocks (1056, 264, 132) copied 10-20% more slowly and did not speed a
# pipeline up (benchmarks/RESULTS.md); other platforms can try `bench_cache.py --copy-blocks`.
# Env TIERED_TBE_COPY_BLOCKS overrides it.
DEFAULT_COPY_BLOCKS = int(os.environ.get("TIERED_TBE_COPY_BLOCKS", "16384"))
# Rows a copy block moves at a time (a warp each): 32 x this many threads per block.
DEFAULT_COPY_ROWS_PER_BLOCK = int(os.environ.get("TIERED_TBE_COPY_ROWS_PER_BLOCK", "8"))
# Dirty victims a prefetch writes back behind the step at most (the victim buffer's rows, also
# capped at the slots): 128K rows of 516 bytes are 68 MB of HBM. 0: every write-back on P.
DEFAULT_BEHIND_ROWS = int(os.environ.get("TIERED_TBE_BEHIND_ROWS", str(1 << 17)))
# Thread blocks of the write-back behind the step: two per SM of an H200 (132 SMs) leave most of
# every SM to the forward and backward it overlaps.
BEHIND_BLOCKS = int(os.environ.get("TIERED_TBE_BEHIND_BLOCKS", "264"))


class ZeroCopyMover(RowMover):
    """Moves rows with ``copy_rows_kernel`` (``cache/_kernels.py``): one launch per group of
    tables that share a backing buffer, weights and state together.

    ``copy_blocks`` and ``copy_rows_per_block`` set the launch shape on the GPU; ``behind_rows``
    the victim buffer's rows (module docstring; 0 writes every victim back on the prefetch's stream).
    """

    name = "zero_copy"

    def __init__(self, weights: torch.Tensor, state: torch.Tensor, tables: list[CachedTable],
                 device: torch.device, launcher: KernelLauncher, rows_end: int, behind_rows: int | None = None):
        self.device = device
        self.launcher = launcher
        self.rows_end = rows_end
        self.copy_blocks = DEFAULT_COPY_BLOCKS  # most thread blocks per copy launch (GPU only)
        self.copy_rows_per_block = DEFAULT_COPY_ROWS_PER_BLOCK  # warps per copy block (GPU only)
        self._copy_groups = self._make_copy_groups(weights, state, tables)
        behind_rows = DEFAULT_BEHIND_ROWS if behind_rows is None else behind_rows
        if behind_rows < 0:
            raise ValueError(f"behind_rows must be >= 0, got {behind_rows}")
        self.behind_rows = min(behind_rows, weights.shape[0])
        if self.behind_rows:
            self._make_victim_buffer(weights, state)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # W
        self._written: torch.cuda.Event | None = None  # on W, after the latest write-back behind the step

    def wait_for_earlier_moves(self) -> None:
        if self._written is not None:
            torch.cuda.current_stream(self.device).wait_event(self._written)

    def start(self, moves: Moves, step: int):
        # The dirty victims are distinct rows, written in ascending order (the GPU writes host
        # memory ~2.5x faster in row order); the padding keys sort last and lie outside every
        # table. Both lie among the batch's unique rows, a count the device knows (moves.num_unique).
        sorted_rows, order = torch.sort(moves.write_back_keys)
        sorted_slots = moves.slot_of_unique[order]
        behind = min(sorted_rows.numel(), self.behind_rows)
        ticket = None
        if behind:
            padding = torch.iinfo(sorted_rows.dtype).max
            count = (sorted_rows != padding).sum(dtype=torch.int64).view(1)
            head = count.clamp(max=behind)
            # Victims 0 .. head-1 leave their slots for the buffer (its rows 0 .. head-1).
            self._launch_copy(self._identity, _kernels.COPY_EVERY_ROW, self._identity[:behind], sorted_slots[:behind],
                              head, self._buffer_group, True, self._k_cache_weights, self._k_cache_state)
            ticket = (sorted_rows[:behind], head)
            sorted_rows, sorted_slots, num_entries = sorted_rows[behind:], sorted_slots[behind:], count - head
        else:
            num_entries = moves.num_unique
        if sorted_rows.numel():  # the victims past the buffer: written back now, before the fill
            self.copy_rows(sorted_rows, _kernels.COPY_EVERY_ROW, sorted_rows, sorted_slots, to_backing=True,
                           num_entries=num_entries)
        self.copy_rows(moves.outcome, OUTCOME_FILLED, moves.unique_rows, moves.slot_of_unique, to_backing=False,
                       num_entries=moves.num_unique)
        return ticket

    def start_behind(self, ticket):
        """Write the victims the buffer holds (``ticket``: sorted rows [behind], count int64 [1])
        back to their backing stores, on ``W`` after the current stream's work; returns None."""
        if ticket is None:
            return None
        rows, head = ticket
        if self._stream is None:  # simulation: in order, now
            self._write_buffer_back(rows, head)
            return None
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self._write_buffer_back(rows, head, blocks=BEHIND_BLOCKS)
            self._written = self._stream.record_event()
        rows.record_stream(self._stream)
        head.record_stream(self._stream)
        return None

    def wait_filled(self, ticket) -> None:
        pass  # the fills ran on the prefetch's stream, which the caller already waits for

    def write_back(self, sorted_rows, sorted_slots, selected) -> None:
        self.wait_for_earlier_moves()
        self.copy_rows(selected, 1, sorted_rows, sorted_slots, to_backing=True)

    def drain(self) -> None:
        self.wait_for_earlier_moves()

    def copy_rows(self, selected, wanted, row_of_entry, slot_of_entry, to_backing, num_entries=None) -> None:
        """Copy the rows of the entries where ``selected == wanted`` (every entry with ``wanted ==
        COPY_EVERY_ROW``; all tables, one launch per buffer group; see ``copy_rows_kernel``):
        slot -> backing store if ``to_backing``, else backing store -> slot. ``num_entries``: an
        int32/int64 [1] device tensor, the entries to look at (default all)."""
        if num_entries is None:
            num_entries = torch.full((1,), selected.numel(), dtype=torch.int64, device=selected.device)
        for group in self._copy_groups:
            self._launch_copy(selected, wanted, row_of_entry, slot_of_entry, num_entries, group, to_backing,
                              self._k_cache_weights, self._k_cache_state)

    def _write_buffer_back(self, rows, head, blocks: int | None = None) -> None:
        """Victim buffer row ``i`` -> backing row ``rows[i]``, for ``i < head[0]``, every group."""
        for group in self._copy_groups:
            self._launch_copy(rows, _kernels.COPY_EVERY_ROW, rows, self._identity[: rows.numel()], head, group, True,
                              self._k_buffer_weights, self._k_buffer_state, blocks=blocks)

    def _launch_copy(self, selected, wanted, row_of_entry, slot_of_entry, num_entries, group, to_backing,
                     k_slot_weights, k_slot_state, blocks: int | None = None) -> None:
        """One ``copy_rows_kernel`` launch over ``group`` (a ``_make_copy_groups`` entry), between
        the "slot" rows ``k_slot_*`` (the cache's, or the victim buffer's) and its store."""
        if SIMULATION:
            # Few simulator threads (each is a Python thread); each walks many entries, all columns.
            from tiered_tbe.cache import launch

            grid, block = 1, (1, launch.SIMULATED_THREADS)
        else:
            rows_per_block = self.copy_rows_per_block
            grid = max(1, min(-(-selected.numel() // rows_per_block), blocks or self.copy_blocks))
            block = (32, rows_per_block)
        _tensors, k_info, k_store_weights, k_store_state = group
        self.launcher.launch_configured(
            _kernels.copy_rows_kernel, grid, block, selected, wanted, row_of_entry, slot_of_entry, num_entries,
            k_info, to_backing, k_slot_weights, k_slot_state, k_store_weights, k_store_state)

    def _make_victim_buffer(self, weights, state) -> None:
        """The victim buffer ([behind_rows] rows of the slots' layout, in HBM) and the copy group
        that treats it as a backing store of one table: victim ``i`` at its row ``i``."""
        rows, words = self.behind_rows, self._k_cache_weights.shape[1]
        buffer_weights = torch.empty(rows, words, dtype=self._word_dtype, device=self.device)
        buffer_state = torch.empty(rows, state.shape[1], dtype=torch.float32, device=self.device)
        self._identity = torch.arange(rows, dtype=torch.int32, device=self.device)
        info = torch.zeros(1, _kernels.TABLE_INFO_COLUMNS, dtype=torch.int64)
        info[0, _kernels.INFO_GLOBAL_END] = rows
        info[0, _kernels.INFO_WEIGHTS_STRIDE] = info[0, _kernels.INFO_WORDS] = words
        info[0, _kernels.INFO_STATE_STRIDE] = info[0, _kernels.INFO_STATE_WIDTH] = state.shape[1]
        array = self.launcher.array
        store_state = buffer_state.view(-1) if state.shape[1] else self._dummy_state[0]
        tensors = (info.to(self.device), buffer_weights, buffer_state, store_state)
        self._buffer_group = (tensors, array(tensors[0]), array(buffer_weights.view(-1)), array(store_state))
        self._k_buffer_weights = array(buffer_weights)
        self._k_buffer_state = array(buffer_state) if state.shape[1] else self._k_cache_state

    def _make_copy_groups(self, weights, state, tables) -> list[tuple]:
        """Kernel arguments of ``copy_rows_kernel`` for each group of tables whose weights (and
        state) share one buffer, as a module's tables of one tier do: one launch copies rows of
        every table of a group. Each group: (the tensors its views need alive, table_info, store
        words, store state), converted for the kernels once; the slots' own views are kept as
        ``_k_cache_weights`` / ``_k_cache_state``.

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
        word_dtype = self._word_dtype = BITS_OF_SIZE[word]
        dummy_state = self._dummy_state = torch.zeros(1, 1, dtype=torch.float32, device=self.device)
        self._k_cache_weights = array(weights.view(word_dtype))
        self._k_cache_state = array(state if state.shape[1] else dummy_state)

        result = []
        for group in groups.values():
            store_weights = flat_view(group[0].weights, word_dtype)
            store_state = flat_view(group[0].state, torch.float32) if group[0].state is not None else dummy_state[0]
            info = torch.zeros(len(group), _kernels.TABLE_INFO_COLUMNS, dtype=torch.int64)
            for g, t in enumerate(group):  # tables ascend by global row (see check_tables)
                info[g, _kernels.INFO_GLOBAL_START] = t.global_row_start
                info[g, _kernels.INFO_GLOBAL_END] = t.global_row_end
                info[g, _kernels.INFO_WEIGHTS_OFFSET] = (t.weights.data_ptr() - store_weights.data_ptr()) // word
                info[g, _kernels.INFO_WEIGHTS_STRIDE] = t.weights.stride(0) * element // word
                info[g, _kernels.INFO_WORDS] = t.dim * element // word
                if t.state is not None:
                    info[g, _kernels.INFO_STATE_OFFSET] = (t.state.data_ptr() - store_state.data_ptr()) // 4
                    info[g, _kernels.INFO_STATE_STRIDE] = t.state.stride(0)
                    info[g, _kernels.INFO_STATE_WIDTH] = t.state_width
            # The tensors stay referenced with their kernel views (which do not own memory on the GPU).
            tensors = (info.to(self.device), store_weights, store_state)
            result.append((tensors, array(tensors[0]), array(store_weights), array(store_state)))
        return result
