"""How cached rows reach their backing stores outside a prefetch: :meth:`write_back` of given slots and
:meth:`flush` of every dirty slot (what ``flush()``, ``state_dict()`` and a save of the module rely on).

A mixin of :class:`~tiered_tbe.cache.slot_cache.SlotCache`: the rows go through the cache's mover, in
ascending row order, and count in its ``write_backs`` and ``bytes_out``. Needs of the cache: ``tags``,
``dirty``, ``mover``, ``_all_slots``, ``_rows_end``, ``_counters``, ``_uniform_row_bytes``,
``_table_starts``, ``_table_row_bytes``, ``_check_slots``, ``_order_metadata`` and ``_metadata_done``.
"""

from __future__ import annotations

import torch

from tiered_tbe.cache import batch_kernels
from tiered_tbe.cache.mover import sorted_write_backs
from tiered_tbe.cache.policy import EMPTY

_WRITE_BACKS = batch_kernels.COUNTER_NAMES.index("write_backs")
_BYTES_OUT = batch_kernels.COUNTER_NAMES.index("bytes_out")


class SlotWriteBacks:
    """:meth:`write_back` and :meth:`flush` of a :class:`SlotCache`."""

    def write_back(self, slot_of_index: torch.Tensor) -> None:
        """Copy the rows of these slots (int32/int64 [N]; -1 skipped, repeats fine) to their backing
        stores now, weights and state. Dirty bits are left as they are.

        Counted in ``write_backs`` and ``bytes_out``.
        """
        slots = self._check_slots(slot_of_index)
        if slots.numel() == 0:
            return
        self._order_metadata()
        rows = torch.where(slots >= 0, self.tags[slots.clamp(min=0).long()], EMPTY)
        self._write_rows_back(rows, slots)  # repeats of a slot are repeats of its row: written once
        self._metadata_done()

    def flush(self) -> None:
        """Write every dirty slot (weights and state) back to its backing store; clear dirty bits.

        Counts ``write_backs`` and ``bytes_out``. Rows stay cached (and locked ones stay locked).
        With the staged mover it returns once the rows are in the backing stores (streamed in
        chunks of its staging buffers).
        """
        self._order_metadata()
        self._write_rows_back(torch.where(self.dirty.bool(), self.tags, EMPTY), self._all_slots)
        self.dirty.zero_()
        self._metadata_done()

    def _write_rows_back(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy slot ``slots[i]`` to the backing row ``rows[i]`` (int64 [M]; EMPTY skips; a row named
        more than once must name one slot, and is copied once), every table, in ascending row
        order; counted in write_backs and bytes_out."""
        sorted_rows, sorted_slots, selected = sorted_write_backs(rows, slots, self._rows_end)
        self.mover.write_back(sorted_rows, sorted_slots, selected)
        update = torch.zeros_like(self._counters)
        update[_WRITE_BACKS] = selected.sum(dtype=torch.int64)
        update[_BYTES_OUT] = self._bytes_of(sorted_rows, selected)
        self._counters += update

    def _bytes_of(self, rows: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
        """Bytes (weights and state) of the rows where ``counted`` is set: an int64 device scalar.
        ``rows`` elsewhere may be anything (padding, EMPTY)."""
        if self._uniform_row_bytes is not None:
            return counted.sum(dtype=torch.int64) * self._uniform_row_bytes
        table = (torch.searchsorted(self._table_starts, rows, right=True) - 1).clamp(min=0)
        return (self._table_row_bytes[table] * counted).sum()
