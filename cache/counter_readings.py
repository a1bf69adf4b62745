"""The slot caches' counters read on the host without waiting for the GPU.

A decision on the training path that depends on what recent prefetches did (how many rows they left in the
backing stores) must not synchronize with the device. :class:`CounterReadings` copies the counters of one or
more :class:`~tiered_tbe.cache.slot_cache.SlotCache` into pinned host memory on the current stream, records an
event after the copy, and hands each reading over once its event has completed (polled, never waited for), as
the change of every counter since the reading before it. Users: ``PrefetchPipeline(fit_cache=True)``
(``tiered_tbe/ahead.py``) and the copies of rows read in place (``tiered_tbe/batch.py``, ``CopyRows``).
On the CPU a copy lands at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterator, Sequence

import torch

from tiered_tbe.cache.batch_kernels import COUNTER_NAMES
from tiered_tbe.cache.slot_cache import SlotCache

UNIQUE_ROWS = COUNTER_NAMES.index("unique_rows")
MISSES_NO_SLOT = COUNTER_NAMES.index("misses_no_slot")
MISSES_SET_FULL = COUNTER_NAMES.index("misses_set_full")


class CounterReadings:
    """Readings of ``caches``' counters in flight at most ``slots`` at a time.

    :meth:`record` takes a reading (with a ``tag`` of the caller's); :meth:`landed` yields, in order, each
    ``(tag, change)`` whose copy has landed: ``change`` int64 [caches, counters] (``COUNTER_NAMES`` order) since
    the reading before it, or None for the first reading and after the counters were reset between the two."""

    def __init__(self, caches: Sequence[SlotCache], slots: int):
        self.caches = list(caches)
        self._pinned = bool(self.caches) and self.caches[0].device.type == "cuda"
        self._copies = torch.zeros(slots, len(self.caches), len(COUNTER_NAMES), dtype=torch.int64,
                                   pin_memory=self._pinned)
        # One event a slot, recorded again at each reading taken into it (none on the CPU: a copy lands at once).
        self._events = [torch.cuda.Event() for _ in range(slots)] if self._pinned else None
        self._next = 0
        self._pending: deque[tuple[Hashable, int]] = deque()  # (tag, its copy's slot), oldest first
        self._previous: torch.Tensor | None = None  # the counters of the last reading handed over

    def record(self, tag: Hashable = None) -> bool:
        """Copy the counters now, on the current stream, without waiting; False (nothing taken) while ``slots``
        readings are not handed over yet, or while the stream is being captured into a CUDA graph."""
        if (not self.caches or len(self._pending) == len(self._copies)
                or (self._pinned and torch.cuda.is_current_stream_capturing())):
            return False
        slot = self._next
        for index, cache in enumerate(self.caches):
            cache.copy_counters(self._copies[slot, index])
        if self._pinned:
            self._events[slot].record()
        self._pending.append((tag, slot))
        self._next = (slot + 1) % len(self._copies)
        return True

    def landed(self) -> Iterator[tuple[Hashable, torch.Tensor | None]]:
        """``(tag, change)`` of each reading whose copy has landed since the last call, oldest first (none while
        the current stream is being captured: an event query there could break the capture)."""
        if self._pinned and torch.cuda.is_current_stream_capturing():
            return
        while self._pending:
            tag, slot = self._pending[0]
            if self._pinned and not self._events[slot].query():
                return
            self._pending.popleft()
            counters = self._copies[slot].clone()
            previous, self._previous = self._previous, counters
            change = None if previous is None else counters - previous
            yield tag, None if change is None or bool((change < 0).any()) else change
