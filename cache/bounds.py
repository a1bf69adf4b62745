"""Reference points for the slot cache's policies: fully associative LRU and offline Belady.

Both count exactly as the set-associative simulator does (``cache/simulator.py``), batch by
batch, so their :class:`~tiered_tbe.cache.stats.CacheStats` compare field by field:

- each batch is prefetched at once: a row named by a batch is counted once (``unique_rows``),
  and is a hit when it was in the cache *before* the batch; every lookup of it then counts in
  ``lookup_hits``;
- the rows of the batch in flight are locked: a missed row may only evict a row the batch does
  not use; when there is none, the row is read in place (``misses_no_slot``, and for LRU
  ``misses_set_full``: its one set had no unlocked way);
- in training every row a batch names is updated, so every evicted row is dirty and written
  back (``write_backs == evictions``); ``bytes_in`` / ``bytes_out`` are rows times ``row_bytes``.

:func:`fully_associative_lru` is LRU with one set of ``num_slots`` ways: what the set-associative
LRU would reach without set conflicts. :func:`belady` is the offline optimum: after each batch
the cache keeps, of the rows it held and the rows the batch named, those used again soonest
(Belady's MIN, with the whole future known). Once the cache is full, a missed row whose next
use is no sooner than that of every cached row is not copied in but read in place
(``misses_no_slot``): the cache may bypass, and MIN with bypass is the optimum. It maximises
unique hits (an exhaustive search agrees on small traces, see the tests); lookup hits count
repeated lookups too, for which "soonest" is not exactly optimal, but no online policy comes
near it in practice. It minimises hits missed, not bytes moved: its traffic is that of the
hit-optimal schedule.

Both use memory proportional to ``num_rows`` (a few int32 / int64 per row of the id space) and
``num_slots``, and take O(log num_slots) per unique row of a batch.
"""

from __future__ import annotations

import numba
import numpy as np

from .simulator import as_trace_arrays, next_batches
from .stats import CacheStats

# Order of the counters the kernels fill (the CacheStats fields, less the bytes).
_BATCHES, _LOOKUPS, _LOOKUP_HITS, _UNIQUE_ROWS, _UNIQUE_HITS, _UNIQUE_MISSES, _NO_SLOT, _EVICTIONS = range(8)
_NUM_COUNTERS = 8


def _check_trace(rows: np.ndarray, batch_offsets: np.ndarray, num_slots: int, num_rows: int | None):
    rows, batch_offsets = as_trace_arrays(rows, batch_offsets)
    if num_slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    max_row = int(rows.max()) if rows.size else -1
    if num_rows is None:
        num_rows = max_row + 1
    elif max_row >= num_rows:
        raise ValueError(f"row id {max_row} is outside num_rows={num_rows}")
    if num_rows >= 2**31 - 1:
        # int32 per-row state; a sparse id space should be compacted (np.unique) first.
        raise ValueError(f"num_rows={num_rows} too large for the bounds (int32 state): "
                         "compact the row ids first")
    return rows, batch_offsets, max(num_rows, 1)


def _to_stats(counts: np.ndarray, training: bool, row_bytes: int, bypass_by_choice: bool) -> CacheStats:
    """``bypass_by_choice``: the rows read in place were left out by the policy (Belady's bypass), not by a
    set full of locked rows (LRU's), so none counts in ``misses_set_full``."""
    evictions = int(counts[_EVICTIONS])
    write_backs = evictions if training else 0
    copied_in = int(counts[_UNIQUE_MISSES] - counts[_NO_SLOT])
    return CacheStats(
        batches=int(counts[_BATCHES]),
        lookups=int(counts[_LOOKUPS]),
        lookup_hits=int(counts[_LOOKUP_HITS]),
        unique_rows=int(counts[_UNIQUE_ROWS]),
        unique_hits=int(counts[_UNIQUE_HITS]),
        unique_misses=int(counts[_UNIQUE_MISSES]),
        misses_no_slot=int(counts[_NO_SLOT]),
        misses_set_full=0 if bypass_by_choice else int(counts[_NO_SLOT]),
        evictions=evictions,
        write_backs=write_backs,
        bytes_in=copied_in * row_bytes,
        bytes_out=write_backs * row_bytes,
    )


# --------------------------------------------------------------------------------------------
# A max-heap of int64 keys in an array, with lazy deletion by the callers.
# --------------------------------------------------------------------------------------------


@numba.njit(inline="always")
def _sift_down(heap, size, position):
    item = heap[position]
    while True:
        child = 2 * position + 1
        if child >= size:
            break
        if child + 1 < size and heap[child + 1] > heap[child]:
            child += 1
        if heap[child] <= item:
            break
        heap[position] = heap[child]
        position = child
    heap[position] = item


@numba.njit(inline="always")
def _push(heap, size, item):
    """Add ``item``; returns the new size."""
    position = size
    while position > 0:
        parent = (position - 1) // 2
        if heap[parent] >= item:
            break
        heap[position] = heap[parent]
        position = parent
    heap[position] = item
    return size + 1


@numba.njit(inline="always")
def _pop(heap, size):
    """Remove the largest item (``heap[0]``); returns the new size."""
    size -= 1
    heap[0] = heap[size]
    _sift_down(heap, size, 0)
    return size


@numba.njit(inline="always")
def _heapify(heap, size):
    for position in range(size // 2 - 1, -1, -1):
        _sift_down(heap, size, position)


@numba.njit(inline="always")
def _longest_batch(batch_offsets):
    longest = 1
    for b in range(batch_offsets.size - 1):
        longest = max(longest, batch_offsets[b + 1] - batch_offsets[b])
    return longest


# --------------------------------------------------------------------------------------------
# Fully associative LRU.
# --------------------------------------------------------------------------------------------


@numba.njit(cache=True, nogil=True)
def _fully_associative_lru_kernel(rows, batch_offsets, num_rows, capacity, counts):
    """LRU over one set of ``capacity`` ways; fills ``counts`` (int64 [_NUM_COUNTERS]).

    Follows policy.py's rules for one set: hits first, then misses in ascending row order, each
    taking the lowest empty way, else the unlocked way with the smallest ``(last_use, way)``;
    none unlocked: no slot. So it equals ``simulate(..., num_slots=capacity,
    associativity=capacity, policy="lru")`` counter for counter, at O(log capacity) per row
    instead of O(capacity). Every row of a batch gets the same use step: when the least
    recently used way was used by the batch in flight, every way was, and all are locked.

    A max-heap of ``-(last_use << 32 | way)`` gives the least recent way; an entry is stale
    once its way's ``last_use`` changed and is dropped when it reaches the top.
    """
    way_of_row = np.full(num_rows, -1, dtype=np.int32)
    row_of_way = np.empty(capacity, dtype=np.int64)
    last_use = np.empty(capacity, dtype=np.int64)  # batch that last used the way's row
    seen_in = np.full(num_rows, -1, dtype=np.int32)  # batch in which the row was last counted
    longest = _longest_batch(batch_offsets)
    missed = np.empty(longest, dtype=np.int64)
    heap_capacity = 2 * capacity + longest + 1
    heap = np.empty(heap_capacity, dtype=np.int64)
    heap_size = 0
    filled = 0  # ways 0 .. filled-1 hold rows; ways never empty again once filled
    for b in range(batch_offsets.size - 1):
        start, end = batch_offsets[b], batch_offsets[b + 1]
        if heap_size + (end - start) > heap_capacity:  # too many stale entries: rebuild
            for way in range(filled):
                heap[way] = -((last_use[way] << 32) | way)
            heap_size = filled
            _heapify(heap, heap_size)
        num_missed = 0
        # Pass 1: hits against the cache as it was before the batch; they become most recent.
        for i in range(start, end):
            row = rows[i]
            way = way_of_row[row]
            if way >= 0:
                counts[_LOOKUP_HITS] += 1
            if seen_in[row] == b:
                continue
            seen_in[row] = b
            counts[_UNIQUE_ROWS] += 1
            if way >= 0:
                counts[_UNIQUE_HITS] += 1
                last_use[way] = b
                heap_size = _push(heap, heap_size, -((b << 32) | way))
            else:
                missed[num_missed] = row
                num_missed += 1
        counts[_LOOKUPS] += end - start
        counts[_UNIQUE_MISSES] += num_missed
        # Pass 2: misses in ascending row order (it decides which find no slot).
        missed[:num_missed].sort()
        for j in range(num_missed):
            row = missed[j]
            if filled < capacity:
                way = filled
                filled += 1
            else:
                while True:  # drop stale entries
                    top = -heap[0]
                    way = top & 0xFFFFFFFF
                    if last_use[way] == (top >> 32):
                        break
                    heap_size = _pop(heap, heap_size)
                if last_use[way] == b:  # the least recent way is locked, hence all are
                    counts[_NO_SLOT] += 1
                    continue
                heap_size = _pop(heap, heap_size)
                way_of_row[row_of_way[way]] = -1
                counts[_EVICTIONS] += 1
            row_of_way[way] = row
            way_of_row[row] = way
            last_use[way] = b
            heap_size = _push(heap, heap_size, -((b << 32) | way))
        counts[_BATCHES] += 1


def fully_associative_lru(
    rows: np.ndarray,
    batch_offsets: np.ndarray,
    num_slots: int,
    training: bool = True,
    row_bytes: int = 0,
    num_rows: int | None = None,
) -> CacheStats:
    """LRU with a single set of ``num_slots`` ways, counted as the simulator counts.

    Args:
        rows: int64 ``[num_lookups]`` global row ids (>= 0).
        batch_offsets: int64 ``[num_batches + 1]``: batch ``b`` is
            ``rows[batch_offsets[b]:batch_offsets[b + 1]]``.
        num_slots: cache capacity in rows.
        training: rows are updated, so evicted rows are written back.
        row_bytes: bytes moved per row (weights and optimizer state), for ``bytes_in`` / ``bytes_out``.
        num_rows: size of the id space (default ``max(rows) + 1``).

    Returns:
        CacheStats, equal to ``simulate(rows, batch_offsets, num_slots, num_slots, "lru", ...)``.
    """
    rows, batch_offsets, num_rows = _check_trace(rows, batch_offsets, num_slots, num_rows)
    counts = np.zeros(_NUM_COUNTERS, dtype=np.int64)
    _fully_associative_lru_kernel(rows, batch_offsets, num_rows, num_slots, counts)
    return _to_stats(counts, training, row_bytes, bypass_by_choice=False)


# --------------------------------------------------------------------------------------------
# Belady: keep the rows used again soonest.
# --------------------------------------------------------------------------------------------


def next_use(rows: np.ndarray, batch_offsets: np.ndarray, num_rows: int | None = None) -> np.ndarray:
    """int32 ``[num_lookups]``: for each lookup, the next batch that names its row, else
    ``num_batches``. Depends only on the trace: compute it once for all cache sizes."""
    rows, batch_offsets, num_rows = _check_trace(rows, batch_offsets, 1, num_rows)
    out = np.empty(rows.size, dtype=np.int32)
    next_batches(rows, batch_offsets, num_rows, out, np.empty(num_rows, dtype=np.int32))
    return out


@numba.njit(cache=True, nogil=True)
def _belady_kernel(rows, batch_offsets, next_use, num_rows, capacity, counts):
    """Belady's MIN batch by batch; fills ``counts`` (int64 [_NUM_COUNTERS]).

    ``key[row]`` is the next use (batch) of a cached row, -1 when not cached. A max-heap of
    ``key << 32 | row`` finds the cached row used latest; entries go stale when a row's key
    changes or it is evicted and are dropped (compared with ``key``) when they reach the top.
    The heap is rebuilt from the cached rows when stale entries would overflow it.
    """
    key = np.full(num_rows, -1, dtype=np.int64)
    seen_in = np.full(num_rows, -1, dtype=np.int32)
    row_of_slot = np.empty(capacity, dtype=np.int64)
    slot_of_row = np.full(num_rows, -1, dtype=np.int64)
    longest = _longest_batch(batch_offsets)
    heap_capacity = 2 * capacity + longest + 1
    heap = np.empty(heap_capacity, dtype=np.int64)
    heap_size = 0
    missed = np.empty(longest, dtype=np.int64)
    missed_next = np.empty(longest, dtype=np.int64)
    size = 0
    for b in range(batch_offsets.size - 1):
        start, end = batch_offsets[b], batch_offsets[b + 1]
        if heap_size + (end - start) > heap_capacity:  # too many stale entries: rebuild
            for slot in range(size):
                heap[slot] = (key[row_of_slot[slot]] << 32) | row_of_slot[slot]
            heap_size = size
            _heapify(heap, heap_size)
        num_missed = 0
        # Pass 1: hits against the cache before the batch; a hit row's key becomes its next use.
        for i in range(start, end):
            row = rows[i]
            if key[row] >= 0:
                counts[_LOOKUP_HITS] += 1
            if seen_in[row] == b:
                continue
            seen_in[row] = b
            counts[_UNIQUE_ROWS] += 1
            if key[row] >= 0:
                counts[_UNIQUE_HITS] += 1
                key[row] = next_use[i]
                heap_size = _push(heap, heap_size, (key[row] << 32) | row)
            else:
                missed[num_missed] = row
                missed_next[num_missed] = next_use[i]
                num_missed += 1
        counts[_LOOKUPS] += end - start
        counts[_UNIQUE_MISSES] += num_missed
        # Pass 2: a missed row displaces the cached row used latest, if that one is used later.
        for j in range(num_missed):
            row, row_next = missed[j], missed_next[j]
            if size < capacity:
                slot = size
                size += 1
            else:
                while True:  # drop stale entries
                    top = heap[0]
                    top_row = top & 0xFFFFFFFF
                    if key[top_row] == (top >> 32):
                        break
                    heap_size = _pop(heap, heap_size)
                if (top >> 32) <= row_next:  # every cached row is needed no later: read in place
                    counts[_NO_SLOT] += 1
                    continue
                heap_size = _pop(heap, heap_size)
                slot = slot_of_row[top_row]
                key[top_row] = -1
                slot_of_row[top_row] = -1
                counts[_EVICTIONS] += 1
            row_of_slot[slot] = row
            slot_of_row[row] = slot
            key[row] = row_next
            heap_size = _push(heap, heap_size, (row_next << 32) | row)
        counts[_BATCHES] += 1


def belady(
    rows: np.ndarray,
    batch_offsets: np.ndarray,
    num_slots: int,
    training: bool = True,
    row_bytes: int = 0,
    num_rows: int | None = None,
    next_uses: np.ndarray | None = None,
) -> CacheStats:
    """Offline optimum (Belady's MIN over whole batches) with ``num_slots`` rows of cache.

    Args are those of :func:`fully_associative_lru`, plus ``next_uses``: the output of
    :func:`next_use` for this trace, to compute it once for many cache sizes.
    """
    rows, batch_offsets, num_rows = _check_trace(rows, batch_offsets, num_slots, num_rows)
    if next_uses is None:
        next_uses = next_use(rows, batch_offsets, num_rows)
    elif next_uses.shape != rows.shape:
        raise ValueError(f"next_uses has shape {next_uses.shape}, rows {rows.shape}")
    counts = np.zeros(_NUM_COUNTERS, dtype=np.int64)
    _belady_kernel(rows, batch_offsets, next_uses, num_rows, num_slots, counts)
    return _to_stats(counts, training, row_bytes, bypass_by_choice=True)
