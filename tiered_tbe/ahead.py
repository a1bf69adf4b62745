"""How many batches a :class:`~tiered_tbe.pipeline.PrefetchPipeline` holds ahead when it fits them to the cache.

Every batch in flight keeps its rows locked in the slot cache from its prefetch to its backward. When the
batches in flight hold more unique rows than their sets have ways, a later prefetch finds sets full of
locked rows and leaves its misses in their backing store (``CacheStats.misses_no_slot``), and the forward
and the backward read and update those rows over the bus. On the H200 at Zipf 0.6 (mixed dims, ~3M unique
rows a batch, 6.4M slots) a depth-2 pipeline took 48.3 ms a step against 39.2 serial
(docs/performance.md, "Where pipelining loses").

:class:`AheadControl` watches for it without a host sync: after each prefetch the caches' counters are
copied to pinned memory, and an event is polled, never waited for. When the newest prefetch seen, made
with the pipeline ``ahead`` batches ahead, left more than ``NO_ROOM`` of its unique rows
without a slot, the pipeline holds one batch fewer ahead, down to none (each batch prefetched after the
step before it, as serial training does). After ``PROBE_STEPS`` steps without such a prefetch it tries
one more, up to its depth. What the pipeline computes does not depend on it: pipelined training equals
serial training bit for bit at every depth (``tiered_tbe/pipeline.py``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from tiered_tbe.cache.batch_kernels import COUNTER_NAMES
from tiered_tbe.cache.slot_cache import SlotCache

# A prefetch that leaves more than this share of its unique rows without a slot found the cache full. A
# first choice, to be measured: a few rows without a slot cost little, and serial training has some too.
NO_ROOM = 0.01
# Steps at a depth below the pipeline's before it tries one batch more (a try that finds the cache full
# costs a step or two with rows read over the bus).
PROBE_STEPS = 64
# Pinned counter copies in flight at most (a prefetch whose slot's copy has not landed records nothing).
_SLOTS = 16
_UNIQUE_ROWS, _MISSES_NO_SLOT = COUNTER_NAMES.index("unique_rows"), COUNTER_NAMES.index("misses_no_slot")


class AheadControl:
    """The batches a pipeline of ``depth`` holds ahead, fitted to ``caches`` (one per tiered module)."""

    def __init__(self, depth: int, caches: Sequence[SlotCache]):
        self.depth = depth
        self.ahead = depth
        self.caches = list(caches)
        pinned = bool(self.caches) and self.caches[0].device.type == "cuda"
        self._copies = torch.zeros(_SLOTS, len(self.caches), len(COUNTER_NAMES), dtype=torch.int64,
                                   pin_memory=pinned)
        self._events: list[torch.cuda.Event | None] = [None] * _SLOTS
        self._next = 0
        self._pending: deque[tuple[int, int]] = deque()  # (ahead at the prefetch, its copy's slot)
        self._previous: torch.Tensor | None = None  # the counters of the last copy read, [caches, counters]
        self._steps_since_full = 0
        self.lowered = 0  # times the pipeline held one batch fewer (read by tests and benchmarks)

    def record(self) -> None:
        """After a prefetch, on its stream: the caches' counters, copied without waiting."""
        if not self.caches:
            return
        slot = self._next
        event = self._events[slot]
        if event is not None and not event.query():
            return  # the copy of _SLOTS prefetches ago has not landed: this prefetch goes unseen
        for index, cache in enumerate(self.caches):
            cache.copy_counters(self._copies[slot, index])
        if self._copies.is_pinned():
            event = torch.cuda.Event()
            event.record()
            self._events[slot] = event
        self._pending.append((self.ahead, slot))
        self._next = (slot + 1) % _SLOTS

    def update(self) -> int:
        """Before a step's prefetches: the batches to hold ahead, from the prefetches whose counters have landed."""
        self._steps_since_full += 1
        while self._pending:
            ahead, slot = self._pending[0]
            event = self._events[slot]
            if event is not None and not event.query():
                break
            self._pending.popleft()
            counters = self._copies[slot].clone()
            previous, self._previous = self._previous, counters
            if previous is None:
                continue
            unique = counters[:, _UNIQUE_ROWS] - previous[:, _UNIQUE_ROWS]
            no_slot = counters[:, _MISSES_NO_SLOT] - previous[:, _MISSES_NO_SLOT]
            if bool((unique < 0).any() | (no_slot < 0).any()):
                continue  # stats were reset between the two copies
            if bool((no_slot > NO_ROOM * unique).any()):
                self._steps_since_full = 0
                if ahead == self.ahead > 0:  # made at this depth (a deeper one's is stale): hold one fewer
                    self.ahead -= 1
                    self.lowered += 1
        if self.ahead < self.depth and self._steps_since_full >= PROBE_STEPS:
            self.ahead += 1
            self._steps_since_full = 0
        return self.ahead
