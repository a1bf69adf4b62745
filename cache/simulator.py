"""An exact CPU simulator of the slot cache's policies, for hit rates and capacity planning.

It runs the policy of :mod:`tiered_tbe.cache.policy` (the same compiled functions the GPU
kernels use) over a trace of batches of global row ids, as training drives a
:class:`~tiered_tbe.cache.slot_cache.SlotCache`. With ``pipeline_depth = k`` (0: serial
training), for each batch ``j`` in order:

1. (``lookahead`` only) ``add_upcoming`` of batch ``j+W`` (``W = lookahead_window``; of
   ``j+1 .. j+W`` before the first batch), at the step at which it will be prefetched, so the
   rows of batches ``j+1 .. j+W`` (fewer at the end of the trace) are known (the cache takes
   ``W <= MAX_LOOKAHEAD = 64``; the simulator any ``W``);
2. ``prefetch`` of batch ``j``;
3. batch ``j - k`` finishes: (with ``training=True``) ``mark_dirty`` of every slot its
   prefetch returned, then ``unlock``.

So while batch ``j`` is prefetched the rows of the ``k`` batches before it stay locked, as a
prefetch pipeline of depth ``k`` holds them until their backward; with ``k = 0`` every batch
is unlocked right after its own prefetch. On the same trace and configuration its
:class:`CacheStats` equal the cache's, counter for counter, and its final per-slot state
equals the cache's, slot for slot.

The lookahead hints come from the trace itself: each lookup's next batch naming its row is
computed once, in one backward pass (:func:`next_batches`). A cached row's next use changes
only when a batch uses it, so each slot keeps the step of its row's next use
(``next_step``), and before a miss chooses a victim the ways of its set get
``next_use = next_step`` where that is within the window, else ``NEXT_USE_UNKNOWN``: exactly
what the cache decodes for them from its window bits (policy.py, "Lookahead window").

The whole trace goes through one ``numba.njit`` call. Measured on one core of a development
machine (Zipf 1.05 over 50M rows, batches of 65536, 32 ways): 3.5-7 M lookups/s for 64K-4M
slots, i.e. 100M lookups in 15-30 s; slower under memory contention, since each lookup lands
on a random set (``python -m tiered_tbe.cache.simulator`` measures it, lookahead included).
"""

from __future__ import annotations

from collections.abc import Iterable

import numba
import numpy as np

from tiered_tbe.base.offsets import check_offsets
from tiered_tbe.cache.policy import (
    EMPTY,
    NEXT_USE_UNKNOWN,
    POLICIES,
    check_geometry,
    policy_code,
    policy_named,
)
from tiered_tbe.cache.simulator_loop import COUNTERS, run_batches
from tiered_tbe.cache.stats import CacheStats

# Row ids up to this many times the number of lookups (and at least up to _DIRECT_IDS) index the
# next-use table directly; sparser ids are first renumbered with np.unique.
_DIRECT_IDS = 1 << 22
_DIRECT_IDS_PER_LOOKUP = 4
# A policy that counts rows keeps an int16 per row id: 8 GB at this bound.
_MAX_COUNTED_ROWS = 1 << 32



@numba.njit(cache=True, nogil=True)
def next_batches(ids, batch_offsets, num_ids, next_batch_of_lookup, first_batch_of_id):
    """The "next batch naming this row" pass, the one both the lookahead window here and Belady's
    bound (``cache/bounds.py``) read: one backward pass over the trace (``ids``: int64 [N], row
    ids in ``[0, num_ids)``; ``batch_offsets``: int64 [num_batches + 1]).

    Fills ``next_batch_of_lookup`` (int32 [N]): the first batch after each lookup's own that
    names its row, else ``num_batches``; and ``first_batch_of_id`` (int32 [num_ids]): the first
    batch naming each id, else ``num_batches``.
    """
    num_batches = batch_offsets.size - 1
    first_batch_of_id[:] = num_batches
    for b in range(num_batches - 1, -1, -1):
        for i in range(batch_offsets[b], batch_offsets[b + 1]):
            next_batch_of_lookup[i] = first_batch_of_id[ids[i]]
        for i in range(batch_offsets[b], batch_offsets[b + 1]):  # after the whole batch: repeats agree
            first_batch_of_id[ids[i]] = b


def as_trace_arrays(rows: np.ndarray, batch_offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` and ``batch_offsets`` as contiguous int64 arrays, checked: a ``ValueError`` unless
    ``rows`` is 1-D with ids >= 0 and ``batch_offsets`` rises from 0 to ``len(rows)``
    (:func:`tiered_tbe.base.offsets.check_offsets`)."""
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    batch_offsets = np.ascontiguousarray(batch_offsets, dtype=np.int64)
    if rows.ndim != 1:
        raise ValueError(f"rows must be 1-D, got shape {rows.shape}")
    check_offsets(batch_offsets, rows.size, "batch_offsets", "len(rows)")
    if rows.size and rows.min() < 0:
        raise ValueError(f"row ids must be >= 0, found {rows.min()}")
    return rows, batch_offsets


class CacheSimulator:
    """The state of a simulated slot cache, fed batches in order (possibly in several calls).

    Args:
        num_slots, associativity, policy, lfu_decay_interval: as in ``CacheConfig`` /
            ``SlotCache`` (``num_slots`` a multiple of ``associativity``).
        training: a finished batch marks every slot it used dirty (backward updated its rows),
            so evicting them is a write-back; False replays inference (no write-backs). May be
            changed between :meth:`run` calls; it applies to the batches finishing in the call.
        row_bytes: bytes of one row with its optimizer state, for ``bytes_in`` / ``bytes_out``.
        lookahead_window: batches after the one being prefetched whose rows the ``lookahead``
            policy is told about (``W``; 0 gives LRU). Ignored by the other policies.
        pipeline_depth: batches in flight before the one being prefetched (``k``), whose rows stay
            locked; 0 is serial training. Applies to every policy.

    Per-slot state, as in :class:`~tiered_tbe.cache.slot_cache.SlotCache` (numpy, [num_slots]):
    ``tags`` int64, ``last_use`` int64, ``use_count`` int32, ``dirty`` uint8, ``locks`` int32
    (the batches in flight: at most ``pipeline_depth`` per slot between runs).

    Example::

        sim = CacheSimulator(num_slots=1024, associativity=32, policy="lookahead", lookahead_window=4,
                             pipeline_depth=2)
        sim.run(rows, batch_offsets, num_batches=100)  # batches 0..99; later ones are their future
        sim.run(rows_from_100, offsets_from_100)       # the batches after them, to the end
        sim.finish()                                   # the last 2 batches finish: all unlocked
        print(sim.stats.hit_rate_by_lookup)
    """

    def __init__(self, num_slots: int, associativity: int, policy: str = "lru", lfu_decay_interval: int = 64,
                 training: bool = True, row_bytes: int = 0, lookahead_window: int = 8, pipeline_depth: int = 0):
        check_geometry(num_slots, associativity, lfu_decay_interval)
        if lookahead_window < 0:
            raise ValueError(f"lookahead_window must be >= 0, got {lookahead_window}")
        if pipeline_depth < 0:
            raise ValueError(f"pipeline_depth must be >= 0, got {pipeline_depth}")
        self.policy = policy
        self._policy_code = policy_code(policy)
        self.num_slots = num_slots
        self.associativity = associativity
        self.num_sets = num_slots // associativity
        self.lfu_decay_interval = lfu_decay_interval
        self.training = training
        self.row_bytes = row_bytes
        self.lookahead_window = lookahead_window
        self.pipeline_depth = pipeline_depth
        self.tags = np.full(num_slots, EMPTY, dtype=np.int64)
        self.last_use = np.zeros(num_slots, dtype=np.int64)
        self.use_count = np.zeros(num_slots, dtype=np.int32)
        self.dirty = np.zeros(num_slots, dtype=np.uint8)
        self.locks = np.zeros(num_slots, dtype=np.int32)
        # Lookahead: each slot's row's next use (step, NEXT_USE_UNKNOWN past the known trace), and
        # the windowed copy that the policy reads, refreshed for a set before its victim is chosen.
        self._next_step = np.full(num_slots, NEXT_USE_UNKNOWN, dtype=np.int64)
        self._next_use = np.full(num_slots, NEXT_USE_UNKNOWN, dtype=np.int64)
        # The slots each batch in flight locked: row s % (depth + 1) for the batch of step s.
        self._in_flight_slots = np.zeros((pipeline_depth + 1, 0), dtype=np.int32)
        self._in_flight_counts = np.zeros(pipeline_depth + 1, dtype=np.int64)
        # The rows each batch in flight got no slot for (read from its backing store), same ring.
        self._in_flight_bypassed = np.zeros((pipeline_depth + 1, 0), dtype=np.int64)
        self._in_flight_bypassed_counts = np.zeros(pipeline_depth + 1, dtype=np.int64)
        # Per-row use counts (a policy that counts rows), grown to past the largest row id seen.
        self._counts_rows = policy_named(policy).counts_rows
        self.row_uses = np.zeros(0, dtype=np.int16)
        self._counters = np.zeros(len(COUNTERS), dtype=np.int64)
        self.step = 0  # batches simulated so far

    @property
    def uses_hints(self) -> bool:
        """Whether the policy reads next-use hints (lookahead with a window of at least one batch)."""
        return policy_named(self.policy).reads_window and self.lookahead_window > 0

    def run(self, rows: np.ndarray, batch_offsets: np.ndarray, num_batches: int | None = None) -> CacheSimulator:
        """Simulate batches ``rows[batch_offsets[b]:batch_offsets[b+1]]`` after those run so far.

        Args:
            rows: int64 [total] global row ids (>= 0).
            batch_offsets: int64 [num_known + 1], non-decreasing, from 0 to ``total``.
            num_batches: simulate only the first this many batches (default: all). The batches
                after them are the future the lookahead window sees (the next call must start
                with the first of them); without them the window ends with the trace given.
        """
        rows, batch_offsets = as_trace_arrays(rows, batch_offsets)
        known_batches = batch_offsets.size - 1
        if num_batches is None:
            num_batches = known_batches
        if not 0 <= num_batches <= known_batches:
            raise ValueError(f"num_batches must be in [0, {known_batches}], got {num_batches}")
        if num_batches == 0:
            return self
        self._reserve_in_flight(int(np.diff(batch_offsets[: num_batches + 1]).max()))
        if self._counts_rows:
            self._reserve_row_uses(rows[: batch_offsets[num_batches]])
        next_batch_of_lookup = np.zeros(0, dtype=np.int32)
        if self.uses_hints:
            next_batch_of_lookup = self._prepare_hints(rows, batch_offsets)
        run_batches(rows, batch_offsets, num_batches, self.step, self.num_sets, self.associativity,
                     self._policy_code, self.lfu_decay_interval, self.training, self.lookahead_window,
                     next_batch_of_lookup, self.tags, self.last_use, self.use_count, self._next_use,
                     self._next_step, self.locks, self.dirty, self.row_uses, self._in_flight_slots,
                     self._in_flight_counts,
                     self._in_flight_bypassed, self._in_flight_bypassed_counts, self._counters)
        self.step += num_batches
        return self

    def finish(self) -> CacheSimulator:
        """The batches still in flight finish, oldest first: their slots become dirty (training)
        and unlocked, as when a pipeline ends. A no-op for serial training."""
        ring = self.pipeline_depth + 1
        for step in range(self.step - self.pipeline_depth + 1, self.step + 1):
            row = step % ring
            slots = self._in_flight_slots[row, : self._in_flight_counts[row]]
            self.locks[slots] -= 1  # the slots of one batch are distinct
            if self.training:
                self.dirty[slots] = 1
            self._in_flight_counts[row] = 0
            self._in_flight_bypassed_counts[row] = 0
        return self

    @property
    def stats(self) -> CacheStats:
        """Counters over every batch run so far."""
        c = dict(zip(COUNTERS, (int(v) for v in self._counters)))
        unique_rows = c["unique_hits"] + c["unique_misses"]
        rows_copied_in = c["unique_misses"] - c["misses_no_slot"]
        return CacheStats(batches=self.step, unique_rows=unique_rows, bytes_in=rows_copied_in * self.row_bytes,
                          bytes_out=c["write_backs"] * self.row_bytes, **c)

    def _reserve_row_uses(self, rows: np.ndarray) -> None:
        """Grow :attr:`row_uses` (new rows at 0) to past the largest of ``rows``."""
        needed = int(rows.max()) + 1 if rows.size else 0
        if needed > _MAX_COUNTED_ROWS:
            raise ValueError(f"policy {self.policy!r} keeps a use count per row: row ids up to "
                             f"{_MAX_COUNTED_ROWS - 1:,}, got {needed - 1:,}")
        if needed > self.row_uses.size:
            self.row_uses = np.concatenate([self.row_uses, np.zeros(needed - self.row_uses.size, dtype=np.int16)])

    def _reserve_in_flight(self, longest_batch: int) -> None:
        """Room in the in-flight ring for a batch of ``longest_batch`` lookups (its distinct slots)."""
        needed = min(longest_batch, self.num_slots)
        held = self._in_flight_slots
        if needed > held.shape[1]:
            self._in_flight_slots = np.zeros((held.shape[0], needed), dtype=np.int32)
            self._in_flight_slots[:, : held.shape[1]] = held
        bypassed = self._in_flight_bypassed
        if longest_batch > bypassed.shape[1]:
            self._in_flight_bypassed = np.zeros((bypassed.shape[0], longest_batch), dtype=np.int64)
            self._in_flight_bypassed[:, : bypassed.shape[1]] = bypassed

    def _prepare_hints(self, rows: np.ndarray, batch_offsets: np.ndarray) -> np.ndarray:
        """Each lookup's next batch (int32 [len(rows)]); and every cached row's next use, from the
        first batch of this run naming it (rows cached by earlier runs saw only their own future)."""
        max_row = int(rows.max()) if rows.size else -1
        if max_row < max(_DIRECT_IDS, _DIRECT_IDS_PER_LOOKUP * rows.size):
            ids, num_ids, unique_rows = rows, max_row + 1, None
        else:  # sparse row ids: renumber them densely, in order
            unique_rows, ids = np.unique(rows, return_inverse=True)
            ids, num_ids = ids.astype(np.int64).reshape(-1), unique_rows.size
        known_batches = batch_offsets.size - 1
        next_batch_of_lookup = np.empty(rows.size, dtype=np.int32)
        first_batch_of_id = np.empty(max(num_ids, 1), dtype=np.int32)
        next_batches(ids, batch_offsets, num_ids, next_batch_of_lookup, first_batch_of_id)

        cached = np.flatnonzero(self.tags != EMPTY)
        tags = self.tags[cached]
        if unique_rows is None:
            named = tags < num_ids
            tag_ids = np.where(named, tags, 0)
        else:
            tag_ids = np.minimum(np.searchsorted(unique_rows, tags), max(num_ids - 1, 0))
            named = unique_rows[tag_ids] == tags if num_ids else np.zeros(tags.size, dtype=bool)
        first = np.where(named, first_batch_of_id[tag_ids], known_batches).astype(np.int64)
        self._next_step.fill(NEXT_USE_UNKNOWN)
        self._next_step[cached] = np.where(first < known_batches, self.step + first + 1,
                                           np.int64(NEXT_USE_UNKNOWN))
        return next_batch_of_lookup


def simulate(rows: np.ndarray, batch_offsets: np.ndarray, num_slots: int, associativity: int,
             policy: str = "lru", lfu_decay_interval: int = 64, training: bool = True,
             row_bytes: int = 0, lookahead_window: int = 8, pipeline_depth: int = 0) -> CacheStats:
    """Replay a trace through a simulated slot cache and return its counters.

    Args:
        rows: int64 [total], global row ids (>= 0) of every lookup of every batch.
        batch_offsets: int64 [num_batches + 1]: batch ``b`` is ``rows[batch_offsets[b]:batch_offsets[b+1]]``.
        num_slots, associativity, policy, lfu_decay_interval: as in ``CacheConfig`` / ``SlotCache``
            (``num_slots`` a multiple of ``associativity``; policy ``"lru"``, ``"lfu"`` or
            ``"lookahead"``).
        training: every row a batch uses becomes dirty after it (backward updated it), so its
            eviction is a write-back; False replays inference (no write-backs).
        row_bytes: bytes of one row with its optimizer state, for ``bytes_in`` / ``bytes_out``.
        lookahead_window: ``lookahead`` only: before batch ``j`` is prefetched, the policy knows
            the rows of batches ``j+1 .. j+lookahead_window`` (0: LRU).
        pipeline_depth: the rows of the ``pipeline_depth`` batches before batch ``j`` stay locked
            while it is prefetched (a prefetch pipeline of that depth); 0 is serial training.

    Returns:
        CacheStats equal to a SlotCache's driven over the same batches as the module docstring says.

    Example::

        rows = np.random.default_rng(0).zipf(1.2, 1_000_000) % 10_000_000
        offsets = np.arange(0, rows.size + 1, 10_000)
        print(simulate(rows, offsets, num_slots=65536, associativity=32).hit_rate_by_lookup)
    """
    simulator = CacheSimulator(num_slots, associativity, policy, lfu_decay_interval, training, row_bytes,
                               lookahead_window, pipeline_depth)
    return simulator.run(rows, batch_offsets).stats


def simulate_batches(batches: Iterable, num_slots: int, associativity: int, policy: str = "lru",
                     lfu_decay_interval: int = 64, training: bool = True, row_bytes: int = 0,
                     lookups_per_call: int = 1 << 24, lookahead_window: int = 8,
                     pipeline_depth: int = 0) -> CacheStats:
    """:func:`simulate` over an iterable of batches (1-D integer arrays or tensors of row ids).

    Batches are gathered into chunks of about ``lookups_per_call`` lookups, each simulated in one
    compiled call, so a trace longer than memory can stream through. Under ``lookahead`` each
    chunk also carries the ``lookahead_window`` batches after it, as the future its last batches
    see (they are simulated with the next chunk).
    """
    simulator = CacheSimulator(num_slots, associativity, policy, lfu_decay_interval, training, row_bytes,
                               lookahead_window, pipeline_depth)
    future = simulator.lookahead_window if simulator.uses_hints else 0
    pending: list[np.ndarray] = []  # batches not simulated yet; the last `future` are the window

    def run(num_batches: int) -> None:
        offsets = np.zeros(len(pending) + 1, dtype=np.int64)
        np.cumsum([b.size for b in pending], out=offsets[1:])
        rows = np.concatenate(pending) if pending else np.zeros(0, dtype=np.int64)
        simulator.run(rows, offsets, num_batches)
        del pending[:num_batches]

    ready_lookups = 0  # lookups of the pending batches before the window
    for batch in batches:
        if hasattr(batch, "detach"):  # a torch tensor
            batch = batch.detach().cpu().numpy()
        pending.append(np.asarray(batch, dtype=np.int64).reshape(-1))
        if len(pending) > future:
            ready_lookups += pending[len(pending) - 1 - future].size
        if ready_lookups >= lookups_per_call:
            run(len(pending) - future)
            ready_lookups = 0
    if pending:
        run(len(pending))
    return simulator.stats


def _benchmark() -> None:
    """Lookups per second of the simulator on a Zipf trace (``python -m tiered_tbe.cache.simulator``)."""
    import time

    rng = np.random.default_rng(0)
    total, batch = 20_000_000, 65_536
    rows = (rng.zipf(1.05, total) - 1) % 50_000_000
    offsets = np.append(np.arange(0, total, batch), total)
    for policy in POLICIES:
        simulate(rows[:batch * 2], offsets[:3], 4096, 32, policy)  # compile, outside the timing
        start = time.perf_counter()
        stats = simulate(rows, offsets, 1 << 20, 32, policy, lookahead_window=8)
        seconds = time.perf_counter() - start
        moved = (stats.rows_copied_in + stats.write_backs) / stats.batches
        print(f"{policy}: {total / seconds / 1e6:.1f} M lookups/s, hit rate {stats.hit_rate_by_lookup:.3f}, "
              f"{moved:,.0f} rows moved per batch")


if __name__ == "__main__":
    _benchmark()
