"""An exact CPU simulator of the slot cache's policies, for hit rates and capacity planning.

It runs the policy of :mod:`tiered_tbe.cache.policy` (the same compiled functions the GPU
kernels use) over a trace of batches of global row ids, as serial training would drive a
:class:`~tiered_tbe.cache.slot_cache.SlotCache`: for each batch ``prefetch``, then (with
``training=True``) ``mark_dirty`` of every slot it returned, then ``unlock``. On the same trace
and configuration its :class:`CacheStats` equal the cache's, counter for counter, and its
final per-slot state equals the cache's, slot for slot.

The whole trace goes through one ``numba.njit`` call. Measured on one core of a development
machine (Zipf 1.05 over 50M rows, batches of 65536, 32 ways): 3.5-7 M lookups/s for 64K-4M
slots, i.e. 100M lookups in 15-30 s; slower under memory contention, since each lookup lands
on a random set (``python -m tiered_tbe.cache.simulator`` measures it).
"""

from __future__ import annotations

from collections.abc import Iterable

import numba
import numpy as np

from tiered_tbe.cache.policy import (
    EMPTY,
    NEXT_USE_UNKNOWN,
    NO_SLOT,
    POLICY_LOOKAHEAD,
    choose_victim_cpu,
    find_way_cpu,
    policy_code,
    set_of_row_cpu,
    touch_on_fill_cpu,
    touch_on_hit_cpu,
)
from tiered_tbe.cache.stats import CacheStats

# Counters of the njit core, in the order it stores them (bytes follow from row_bytes in Python).
_COUNTERS = ("lookups", "lookup_hits", "unique_hits", "unique_misses", "misses_no_slot", "evictions",
             "write_backs")


# Not cache=True: numba's on-disk cache is keyed on this file alone, and would keep running the
# policy of an older policy.py after an edit there. Compiling takes about a second per process.
@numba.njit
def _run_batches(rows, batch_offsets, first_step, num_sets, associativity, policy, lfu_decay_interval,
                 training, tags, last_use, use_count, next_use, locks, dirty, counters):
    """Advance the cache state over ``batch_offsets.size - 1`` batches (see simulate)."""
    longest = 0
    for b in range(batch_offsets.size - 1):
        longest = max(longest, batch_offsets[b + 1] - batch_offsets[b])
    missed = np.empty(longest, dtype=np.int64)  # rows of this batch not found at prefetch
    touched = np.empty(longest, dtype=np.int64)  # slots this batch locked
    # Counted in locals (registers), stored once at the end.
    lookups = lookup_hits = unique_hits = unique_misses = misses_no_slot = evictions = write_backs = 0

    for b in range(batch_offsets.size - 1):
        step = first_step + b + 1
        num_missed = 0
        num_touched = 0
        # Hits of every set first (policy.py, step 2). All locks are released between batches,
        # so a hit slot that is already locked was hit earlier in this batch.
        for i in range(batch_offsets[b], batch_offsets[b + 1]):
            row = rows[i]
            first_slot = set_of_row_cpu(row, num_sets) * associativity
            slot = find_way_cpu(tags, first_slot, associativity, row)
            if slot == NO_SLOT:
                missed[num_missed] = row
                num_missed += 1
                continue
            lookup_hits += 1
            if locks[slot] == 0:
                unique_hits += 1
                touch_on_hit_cpu(slot, step, last_use, use_count)
                locks[slot] = 1
                touched[num_touched] = slot
                num_touched += 1
        lookups += batch_offsets[b + 1] - batch_offsets[b]

        # Then misses in ascending row order (policy.py, step 3). Sets are independent, so one
        # pass in global row order is each set's misses in ascending order.
        missed[:num_missed].sort()
        for k in range(num_missed):
            row = missed[k]
            if k > 0 and row == missed[k - 1]:
                continue
            unique_misses += 1
            first_slot = set_of_row_cpu(row, num_sets) * associativity
            slot = choose_victim_cpu(policy, tags, last_use, use_count, next_use, locks, first_slot,
                                     associativity)
            if slot == NO_SLOT:
                misses_no_slot += 1
                continue
            if tags[slot] != EMPTY:
                evictions += 1
                if dirty[slot]:
                    write_backs += 1
            tags[slot] = row
            touch_on_fill_cpu(slot, step, last_use, use_count)
            dirty[slot] = 0
            locks[slot] = 1
            touched[num_touched] = slot
            num_touched += 1

        # Serial training: backward updates every row the batch used (dirty), then unlocks.
        for k in range(num_touched):
            locks[touched[k]] = 0
            if training:
                dirty[touched[k]] = 1
        if step % lfu_decay_interval == 0:
            for slot in range(use_count.size):
                use_count[slot] >>= 1
    for k, value in enumerate((lookups, lookup_hits, unique_hits, unique_misses, misses_no_slot, evictions,
                               write_backs)):
        counters[k] += value


class CacheSimulator:
    """The state of a simulated slot cache, fed batches in order (possibly in several calls).

    Per-slot state, as in :class:`~tiered_tbe.cache.slot_cache.SlotCache` (numpy, [num_slots]):
    ``tags`` int64, ``last_use`` int64, ``use_count`` int32, ``dirty`` uint8.

    Example::

        sim = CacheSimulator(num_slots=1024, associativity=32, policy="lfu")
        sim.run(rows, batch_offsets)          # some batches
        sim.run(more_rows, more_offsets)      # the batches after them
        print(sim.stats.hit_rate_by_lookup)
    """

    def __init__(self, num_slots: int, associativity: int, policy: str = "lru", lfu_decay_interval: int = 64,
                 training: bool = True, row_bytes: int = 0):
        if associativity < 1 or num_slots < associativity or num_slots % associativity:
            raise ValueError(f"num_slots ({num_slots}) must be a positive multiple of associativity "
                             f"({associativity})")
        if lfu_decay_interval < 1:
            raise ValueError(f"lfu_decay_interval must be >= 1, got {lfu_decay_interval}")
        self.policy = policy
        self._policy_code = policy_code(policy)
        if self._policy_code == POLICY_LOOKAHEAD:
            raise ValueError("the lookahead policy needs the queued batches of a prefetch pipeline; "
                             "this simulator replays serial training (policy 'lru' or 'lfu')")
        self.num_slots = num_slots
        self.associativity = associativity
        self.num_sets = num_slots // associativity
        self.lfu_decay_interval = lfu_decay_interval
        self.training = training
        self.row_bytes = row_bytes
        self.tags = np.full(num_slots, EMPTY, dtype=np.int64)
        self.last_use = np.zeros(num_slots, dtype=np.int64)
        self.use_count = np.zeros(num_slots, dtype=np.int32)
        self.dirty = np.zeros(num_slots, dtype=np.uint8)
        self._locks = np.zeros(num_slots, dtype=np.int32)  # only within a batch: serial training
        self._next_use = np.full(num_slots, NEXT_USE_UNKNOWN, dtype=np.int64)  # read by lookahead only
        self._counters = np.zeros(len(_COUNTERS), dtype=np.int64)
        self.step = 0  # batches simulated so far

    def run(self, rows: np.ndarray, batch_offsets: np.ndarray) -> CacheSimulator:
        """Simulate batches ``rows[batch_offsets[b]:batch_offsets[b+1]]`` after those run so far.

        Args:
            rows: int64 [total] global row ids (>= 0).
            batch_offsets: int64 [num_batches + 1], non-decreasing, from 0 to ``total``.
        """
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        batch_offsets = np.ascontiguousarray(batch_offsets, dtype=np.int64)
        if rows.ndim != 1 or batch_offsets.ndim != 1 or batch_offsets.size < 1:
            raise ValueError("rows and batch_offsets must be 1-D, batch_offsets with at least one entry")
        if batch_offsets[0] != 0 or batch_offsets[-1] != rows.size or np.any(np.diff(batch_offsets) < 0):
            raise ValueError(f"batch_offsets must rise from 0 to len(rows) = {rows.size}")
        if rows.size and rows.min() < 0:
            raise ValueError("row ids must be >= 0")
        _run_batches(rows, batch_offsets, self.step, self.num_sets, self.associativity, self._policy_code,
                     self.lfu_decay_interval, self.training, self.tags, self.last_use, self.use_count,
                     self._next_use, self._locks, self.dirty, self._counters)
        self.step += batch_offsets.size - 1
        return self

    @property
    def stats(self) -> CacheStats:
        """Counters over every batch run so far."""
        c = dict(zip(_COUNTERS, (int(v) for v in self._counters)))
        unique_rows = c["unique_hits"] + c["unique_misses"]
        rows_copied_in = c["unique_misses"] - c["misses_no_slot"]
        return CacheStats(batches=self.step, unique_rows=unique_rows, bytes_in=rows_copied_in * self.row_bytes,
                          bytes_out=c["write_backs"] * self.row_bytes, **c)


def simulate(rows: np.ndarray, batch_offsets: np.ndarray, num_slots: int, associativity: int,
             policy: str = "lru", lfu_decay_interval: int = 64, training: bool = True,
             row_bytes: int = 0) -> CacheStats:
    """Replay a trace through a simulated slot cache and return its counters.

    Args:
        rows: int64 [total], global row ids (>= 0) of every lookup of every batch.
        batch_offsets: int64 [num_batches + 1]: batch ``b`` is ``rows[batch_offsets[b]:batch_offsets[b+1]]``.
        num_slots, associativity, policy, lfu_decay_interval: as in ``CacheConfig`` / ``SlotCache``
            (``num_slots`` a multiple of ``associativity``; policy ``"lru"`` or ``"lfu"``).
        training: every row a batch uses becomes dirty after it (backward updated it), so its
            eviction is a write-back; False replays inference (no write-backs).
        row_bytes: bytes of one row with its optimizer state, for ``bytes_in`` / ``bytes_out``.

    Returns:
        CacheStats equal to a SlotCache's driven by serial training over the same batches.

    Example::

        rows = np.random.default_rng(0).zipf(1.2, 1_000_000) % 10_000_000
        offsets = np.arange(0, rows.size + 1, 10_000)
        print(simulate(rows, offsets, num_slots=65536, associativity=32).hit_rate_by_lookup)
    """
    simulator = CacheSimulator(num_slots, associativity, policy, lfu_decay_interval, training, row_bytes)
    return simulator.run(rows, batch_offsets).stats


def simulate_batches(batches: Iterable, num_slots: int, associativity: int, policy: str = "lru",
                     lfu_decay_interval: int = 64, training: bool = True, row_bytes: int = 0,
                     lookups_per_call: int = 1 << 24) -> CacheStats:
    """:func:`simulate` over an iterable of batches (1-D integer arrays or tensors of row ids).

    Batches are gathered into chunks of about ``lookups_per_call`` lookups, each simulated in one
    compiled call, so a trace longer than memory can stream through.
    """
    simulator = CacheSimulator(num_slots, associativity, policy, lfu_decay_interval, training, row_bytes)
    chunk: list[np.ndarray] = []
    chunk_lookups = 0

    def run_chunk():
        offsets = np.zeros(len(chunk) + 1, dtype=np.int64)
        np.cumsum([b.size for b in chunk], out=offsets[1:])
        rows = np.concatenate(chunk) if chunk else np.zeros(0, dtype=np.int64)
        simulator.run(rows, offsets)

    for batch in batches:
        if hasattr(batch, "detach"):  # a torch tensor
            batch = batch.detach().cpu().numpy()
        batch = np.asarray(batch, dtype=np.int64).reshape(-1)
        chunk.append(batch)
        chunk_lookups += batch.size
        if chunk_lookups >= lookups_per_call:
            run_chunk()
            chunk, chunk_lookups = [], 0
    if chunk:
        run_chunk()
    return simulator.stats


def _benchmark() -> None:
    """Lookups per second of the simulator on a Zipf trace (``python -m tiered_tbe.cache.simulator``)."""
    import time

    rng = np.random.default_rng(0)
    total, batch = 20_000_000, 65_536
    rows = (rng.zipf(1.05, total) - 1) % 50_000_000
    offsets = np.append(np.arange(0, total, batch), total)
    for policy in ("lru", "lfu"):
        simulate(rows[:batch * 2], offsets[:3], 4096, 32, policy)  # compile (cached after the first run)
        start = time.perf_counter()
        stats = simulate(rows, offsets, 1 << 20, 32, policy)
        seconds = time.perf_counter() - start
        print(f"{policy}: {total / seconds / 1e6:.1f} M lookups/s, hit rate {stats.hit_rate_by_lookup:.3f}")


if __name__ == "__main__":
    _benchmark()
