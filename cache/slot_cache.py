"""The GPU slot cache: hot rows of the cached tables, held in HBM slots, managed by Numba kernels.

The policy (which set a row maps to, which way a miss evicts, how locks and use counts move)
is specified in :mod:`tiered_tbe.cache.policy`; the CPU simulator
(:mod:`tiered_tbe.cache.simulator`) follows the same definition and agrees with this cache
hit for hit.

What the TBE kernels read
    ``weights`` [num_slots, row_width] and ``state`` [num_slots, state_width] (the kernels'
    ``cache_weights`` / ``cache_state``): row ``g`` of a cached table lives, while cached, in
    ``weights[slot, :dim]`` (and its optimizer state in ``state[slot, :table_state_width]``),
    where ``slot = slot_of_index[i]`` for a lookup ``i`` of ``g``; slot -1 means "read and update
    the backing store".

A training step with the cache::

    cache.add_upcoming(rows_of_batch, its_step)  # lookahead only: each queued batch once, as it
                                                 # enters the window (step = cache.step + 1 + d)
    slot_of_index = cache.prefetch(global_rows)  # hits locked, misses filled and locked
    ... forward / backward read and update rows through slot_of_index ...
    cache.mark_dirty(slot_of_index)              # the slots that backward updated
    cache.unlock(slot_of_index)                  # the batch no longer needs its rows

With a prefetch pipeline of depth ``k`` the unlock (and mark_dirty) of a batch comes after the
prefetches of the ``k`` batches that follow it: those prefetches cannot evict its rows.

Lookahead hints are incremental: each batch of the window is recorded once, as a bit in a
per-row word (``window_bits``: bit ``s % 64`` for the batch of step ``s``), and forgotten when
its step is prefetched; a prefetch decodes each row's next use from its word, only for the
sets that choose a victim. Telling the cache of a batch costs one pass over that batch's rows,
whatever the window's length. The words cost 8 bytes of device memory per row of the cached
tables (allocated by the first hint only).

GPU mode runs every step on torch's current stream and never waits for the device: the
number of unique rows stays on the device (arrays are sized by the number of lookups and
padded), and the counters accumulate in a device tensor read by :meth:`SlotCache.stats`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import fields
from typing import NamedTuple

import torch

from tiered_tbe.base.mode import SIMULATION, default_device
from tiered_tbe.base.sorting import sort_ids
from tiered_tbe.cache import _kernels
from tiered_tbe.cache._kernels import NOT_CACHED, OUTCOME_FILLED, OUTCOME_HIT, OUTCOME_NO_SLOT, WINDOW_BITS
from tiered_tbe.cache.policy import EMPTY, NEXT_USE_UNKNOWN, NO_SLOT, POLICY_LOOKAHEAD, check_geometry, policy_code
from tiered_tbe.cache.stats import CacheStats

# Threads per launch in the CUDA simulator, where each is a Python thread (~0.2 ms to start).
# The kernels are grid-stride loops, correct for any count; long CPU tests set 1 for speed
# (TIERED_TBE_SIMULATED_THREADS=1), the cache's own tests keep several so threads interleave.
SIMULATED_THREADS = int(os.environ.get("TIERED_TBE_SIMULATED_THREADS", "32"))

# Most thread blocks a copy launch (fill, write-back, flush) uses; each block moves 8 rows at a
# time. On the H200 fewer blocks (1056, 264, 132) copied 10-20% more slowly and did not speed a
# pipeline up (benchmarks/RESULTS.md); other platforms can try `bench_cache.py --copy-blocks`.
# Env TIERED_TBE_COPY_BLOCKS overrides it.
DEFAULT_COPY_BLOCKS = int(os.environ.get("TIERED_TBE_COPY_BLOCKS", "16384"))
# Rows a copy block moves at a time (a warp each): 32 x this many threads per block.
DEFAULT_COPY_ROWS_PER_BLOCK = int(os.environ.get("TIERED_TBE_COPY_ROWS_PER_BLOCK", "8"))

# Most batches after the next prefetch that lookahead hints can name: the batch ``d`` places after
# it is prefetched at step ``step + 1 + d``, and add_upcoming takes steps up to
# ``step + 1 + WINDOW_BITS``, so ``d <= WINDOW_BITS``.
MAX_LOOKAHEAD = WINDOW_BITS

# Counters kept on the device, in CacheStats order (``batches`` is counted on the host).
_DEVICE_COUNTERS = [f.name for f in fields(CacheStats) if f.name != "batches"]

# Integer type of the same size as each element size: copies move bits, not numbers.
_BITS_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class CachedTable(NamedTuple):
    """One table whose rows the slot cache may hold.

    ``weights`` is a 2-D view [num_rows, dim] of the table's rows in its backing store,
    ``state`` a 2-D fp32 view [num_rows, state_width] of their optimizer state (``None`` when
    the optimizer keeps none). Both must be readable and writable in place by the cache's
    device (on the GPU: device, pinned-host or managed memory exposed as CUDA tensors).
    Global rows ``global_row_start .. global_row_start + num_rows - 1`` are this table's.
    """

    global_row_start: int
    num_rows: int
    dim: int
    weights: torch.Tensor
    state: torch.Tensor | None = None

    @property
    def state_width(self) -> int:
        return 0 if self.state is None else self.state.shape[1]


class SlotCache:
    """A set-associative cache of rows in device memory, shared by one module's cached tables.

    Args:
        tables: the cached tables; their global row ranges must not overlap.
        num_slots: slots in all, a multiple of ``associativity``.
        associativity: ways per set.
        policy: ``"lru"``, ``"lfu"`` or ``"lookahead"`` (see :mod:`tiered_tbe.cache.policy`;
            lookahead ranks by :attr:`next_use`, which a prefetch decodes from the batches a
            prefetch pipeline records with :meth:`add_upcoming`; before the first hint it
            ranks by ``next_use`` as it is: all unknown, i.e. LRU, unless set by hand).
        lfu_decay_interval: every this many prefetches every use count is halved.
        row_width: columns of a slot row (default, and at least, the largest table dim).
        state_width: fp32 optimizer-state values per slot (default, and at least, the largest
            table state width).
        weights_dtype: dtype of ``weights``; must be the tables' (checked when given).
        device: where the slots live; default ``tiered_tbe.default_device()``. CPU only in
            simulation mode (the Numba kernels then run in the CUDA simulator).

    Per-slot tensors (``S = num_slots``; slot ``s`` is way ``s % associativity`` of set
    ``s // associativity``):
        ``tags`` int64 [S] (row held, -1 empty), ``last_use`` int64 [S] (step of last use),
        ``use_count`` int32 [S], ``dirty`` uint8 [S], ``locks`` int32 [S],
        ``next_use`` int64 [S] (lookahead hint, ``NEXT_USE_UNKNOWN`` when none; with hints
        recorded, written by each prefetch for the sets that choose a victim, see
        :meth:`next_use_of_slots`),
        ``weights`` [S, row_width] (weights dtype; row_width = largest dim),
        ``state`` fp32 [S, state_width] (largest optimizer-state width; 0 columns when none).
        They are updated in place, never replaced: views of them stay valid.

    Per-row tensors (``R`` = one past the last global row of the cached tables):
        ``bypass_count`` uint8 [R]: the batches prefetched and not yet unlocked that got no slot
        for the row (they read and update it in its backing store); while it is not 0 no
        prefetch caches the row (policy.py, "Rows left in the backing store"). 1 byte of device
        memory per row; at most 255 batches in flight.
        ``window_bits`` int64 [R], only once a hint was recorded (:meth:`add_upcoming`; ``None``
        before): bit ``s % WINDOW_BITS`` set when the recorded batch of step ``s`` names the
        row: 8 bytes of device memory per row of the cached tables.

    Streams: every method enqueues its work on torch's current stream of ``device`` and returns
    without waiting (except ``num_locked``, ``stats`` and ``invalidate``, which read the device).
    A caller running prefetch on a side stream orders it after the backwards whose rows it may
    evict (events), and runs ``unlock`` on that same stream (lock counts have no atomics; an
    ``unlock`` on another stream waits for the latest prefetch). ``mark_dirty`` may run beside a
    prefetch: it touches only the batch's locked slots, which no prefetch evicts or fills.

    Example::

        cache = SlotCache([CachedTable(0, 1000, 16, table_weights)], num_slots=64, associativity=8)
        slot_of_index = cache.prefetch(torch.tensor([3, 7, 3, 999]))
        assert (cache.tags[slot_of_index.long()] == torch.tensor([3, 7, 3, 999])).all()
        cache.unlock(slot_of_index)
    """

    def __init__(
        self,
        tables: Sequence[CachedTable],
        num_slots: int,
        associativity: int,
        policy: str = "lru",
        lfu_decay_interval: int = 64,
        row_width: int | None = None,
        state_width: int | None = None,
        weights_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        self.device = torch.device(device) if device is not None else default_device()
        if self.device.type == "cpu" and not SIMULATION:
            raise ValueError("SlotCache on the CPU needs simulation mode: set TIERED_TBE_SIMULATE=1 "
                             "before importing tiered_tbe, or use device='cuda'")
        if self.device.type == "cuda" and SIMULATION:
            raise ValueError("SlotCache on cuda, but tiered_tbe runs in CPU simulation mode")
        check_geometry(num_slots, associativity, lfu_decay_interval)
        self.policy = policy
        self._policy_code = policy_code(policy)
        self.num_slots = num_slots
        self.associativity = associativity
        self.num_sets = num_slots // associativity
        self.lfu_decay_interval = lfu_decay_interval
        self.tables = self._check_tables(tables)
        self.row_width = max(t.dim for t in self.tables)
        self.state_width = max(t.state_width for t in self.tables)
        if row_width is not None:
            if row_width < self.row_width:
                raise ValueError(f"row_width {row_width} is less than the largest table dim {self.row_width}")
            self.row_width = row_width
        if state_width is not None:
            if state_width < self.state_width:
                raise ValueError(f"state_width {state_width} is less than a table's ({self.state_width})")
            self.state_width = state_width
        if weights_dtype is not None and weights_dtype != self.tables[0].weights.dtype:
            raise ValueError(f"weights_dtype {weights_dtype} differs from the tables' {self.tables[0].weights.dtype}")
        weights_dtype = self.tables[0].weights.dtype

        on = dict(device=self.device)
        self.tags = torch.full((num_slots,), EMPTY, dtype=torch.int64, **on)
        self.last_use = torch.zeros(num_slots, dtype=torch.int64, **on)
        self.use_count = torch.zeros(num_slots, dtype=torch.int32, **on)
        self.dirty = torch.zeros(num_slots, dtype=torch.uint8, **on)
        self.locks = torch.zeros(num_slots, dtype=torch.int32, **on)
        self.next_use = torch.full((num_slots,), NEXT_USE_UNKNOWN, dtype=torch.int64, **on)
        self.weights = torch.zeros(num_slots, self.row_width, dtype=weights_dtype, **on)
        self.state = torch.zeros(num_slots, self.state_width, dtype=torch.float32, **on)
        self._step = 0
        self._batches = 0
        self._counters = torch.zeros(len(_DEVICE_COUNTERS), dtype=torch.int64, **on)

        # Per-table facts as device tensors, for searchsorted and byte counts without host syncs.
        self._rows_end = max(t.global_row_start + t.num_rows for t in self.tables)  # bound of the row ids
        self._table_starts = torch.tensor([t.global_row_start for t in self.tables], dtype=torch.int64, **on)
        self._table_ends = torch.tensor([t.global_row_start + t.num_rows for t in self.tables],
                                        dtype=torch.int64, **on)
        element = self.weights.element_size()
        row_bytes = [t.dim * element + 4 * t.state_width for t in self.tables]
        self._table_row_bytes = torch.tensor(row_bytes, dtype=torch.int64, **on)
        self._uniform_row_bytes = row_bytes[0] if len(set(row_bytes)) == 1 else None
        self._all_slots = torch.arange(num_slots, dtype=torch.int64, **on)

        # Lookahead hints (add_upcoming): the per-row window bits, allocated by the first hint,
        # and the masked rows of each recorded step, kept to clear its bit when it leaves the window.
        self.window_bits: torch.Tensor | None = None
        self._no_window_bits = torch.zeros(1, dtype=torch.int64, **on)  # the kernels' dummy until then
        self._k_window_bits = self._kernel_array(self._no_window_bits)
        self._rows_of_upcoming_step: dict[int, torch.Tensor] = {}
        self.bypass_count = torch.zeros(self._rows_end, dtype=torch.uint8, **on)

        # Kernel views, made once (converting a tensor costs host time at every launch): the
        # per-slot tensors are only ever updated in place.
        self._stream_pointer = None
        self._numba_stream = None
        (self._k_tags, self._k_last_use, self._k_use_count, self._k_dirty, self._k_locks, self._k_next_use,
         self._k_bypass_count) = (self._kernel_array(t) for t in (self.tags, self.last_use, self.use_count, self.dirty,
                                                                   self.locks, self.next_use, self.bypass_count))
        self._copy_groups = self._make_copy_groups()
        self.copy_blocks = DEFAULT_COPY_BLOCKS  # most thread blocks per copy launch (GPU only)
        self.copy_rows_per_block = DEFAULT_COPY_ROWS_PER_BLOCK  # warps per copy block (GPU only)
        # int32 [N] after each prefetch: the distinct slots it locked (one per unique row, NO_SLOT
        # padding); unlock(locked_slots, distinct=True) releases them without a sort.
        self.locked_slots = torch.empty(0, dtype=torch.int32, device=self.device)
        # int64 [N] after each prefetch: the rows it gave no slot (once each, NOT_CACHED padding).
        self.bypassed_rows = torch.empty(0, dtype=torch.int64, device=self.device)
        # Prefetches not yet unlocked: id of the remap they returned, and of their locked_slots ->
        # (remap, locked_slots, bypassed_rows). unlock() of either releases the bypassed rows.
        self._unreleased: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # (stream, event) after the latest prefetch on CUDA: an unlock elsewhere waits for it,
        # since lock counts are updated without atomics.
        self._last_prefetch: tuple[torch.cuda.Stream, torch.cuda.Event] | None = None

    # ------------------------------------------------------------------ public API

    @property
    def step(self) -> int:
        """Prefetches so far (the policy's clock; see tiered_tbe.cache.policy)."""
        return self._step

    def prefetch(self, global_rows: torch.Tensor) -> torch.Tensor:
        """Bring a batch's rows into the cache, lock them, and return where each lookup's row is.

        Args:
            global_rows: int64 [N], the global row of every lookup of the batch (repeats allowed).
                Rows outside every cached table are left alone (their slot is -1).

        Returns:
            slot_of_index: int32 [N], the slot holding each lookup's row, or -1 (row not in a
            cached table, or every way of its set locked: ``misses_no_slot``).

        Hits update policy state and gain a lock; misses evict unlocked victims (writing back
        only dirty ones, weights and optimizer state), are copied in from the backing store and
        gain a lock. Lookahead hints (:meth:`add_upcoming`) of this step and earlier ones are
        forgotten first. Each unique row is locked once; :meth:`unlock` releases the batch (with
        the returned ``slot_of_index``, or faster with :attr:`locked_slots` and
        ``distinct=True``), and with it the rows it gave no slot (:attr:`bypassed_rows`), which
        no prefetch caches until then.
        """
        rows = self._check_rows(global_rows)
        self._step += 1
        self._batches += 1
        self._forget_upcoming(through=self._step)  # this batch's own hint, if any, leaves the window
        n = rows.numel()
        if n > 0:
            slot_of_index, self.locked_slots, self.bypassed_rows = self._prefetch(rows)
        else:
            slot_of_index = self.locked_slots = torch.empty(0, dtype=torch.int32, device=self.device)
            self.bypassed_rows = torch.empty(0, dtype=torch.int64, device=self.device)
        if self._step % self.lfu_decay_interval == 0:
            self.use_count >>= 1  # LFU aging, after every lfu_decay_interval-th prefetch
        entry = (slot_of_index, self.locked_slots, self.bypassed_rows)
        self._unreleased[id(slot_of_index)] = self._unreleased[id(self.locked_slots)] = entry
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            self._last_prefetch = (stream, stream.record_event())
        return slot_of_index

    def lookup(self, global_rows: torch.Tensor) -> torch.Tensor:
        """Where each row is now: int32 [N] slots, -1 when not cached. No policy change, no lock."""
        rows = self._check_rows(global_rows)
        slot_of_index = torch.empty(rows.numel(), dtype=torch.int32, device=self.device)
        if rows.numel():
            self._launch(_kernels.lookup_kernel, rows.numel(),
                         self._mask_uncached(rows), self.num_sets, self.associativity, self._k_tags,
                         slot_of_index)
        return slot_of_index

    @property
    def upcoming_steps(self) -> list[int]:
        """The steps whose batches :meth:`add_upcoming` recorded and no prefetch has reached, ascending."""
        return sorted(self._rows_of_upcoming_step)

    def add_upcoming(self, global_rows: torch.Tensor, step: int) -> None:
        """Tell the lookahead policy the rows of the batch that the prefetch at cache step ``step`` will fetch.

        Args:
            global_rows: int64 [M], that batch's global rows (repeats allowed; rows outside every
                cached table, e.g. ``INT64_MAX`` padding, are ignored).
            step: the step of that batch's prefetch: the batch ``d`` places after the next prefetch
                (whose step is ``self.step + 1``) has step ``self.step + 1 + d``, for ``d`` in
                ``1 .. MAX_LOOKAHEAD``. A step already recorded raises (skip those in
                :attr:`upcoming_steps`).

        Record each batch once, when it enters the window: the prefetch at step ``t`` ranks a
        victim's rows by the soonest recorded step in ``t + 1 .. t + WINDOW_BITS`` naming them
        (policy.py, "Lookahead window"), and forgets its own step and any before it. One kernel
        launch over ``M`` rows; no sort, no host sync. The first call allocates
        :attr:`window_bits`; the masked rows (a copy, int64 [M]) are kept until the step is
        forgotten. Only the lookahead policy reads the hints.

        Raises ``TypeError`` / ``ValueError`` for rows not a 1-D int64 tensor on the cache's
        device, or a step outside ``self.step + 2 .. self.step + 1 + WINDOW_BITS`` or already
        recorded; nothing changes then.
        """
        rows = self._check_rows(global_rows)
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int, got {step!r}")
        if not self._step + 1 < step <= self._step + 1 + WINDOW_BITS:
            raise ValueError(f"step {step} outside the window of hints: steps {self._step + 2} .. "
                             f"{self._step + 1 + WINDOW_BITS} (the next prefetch is step {self._step + 1}; "
                             f"at most MAX_LOOKAHEAD = {MAX_LOOKAHEAD} batches after it)")
        if step in self._rows_of_upcoming_step:
            raise ValueError(f"step {step} is already recorded (upcoming_steps: {self.upcoming_steps})")
        if self.window_bits is None:
            self.window_bits = torch.zeros(self._rows_end, dtype=torch.int64, device=self.device)
            self._k_window_bits = self._kernel_array(self.window_bits)
        # The next prefetch's step shares its bit with step + 1 + WINDOW_BITS: forget it first.
        self._forget_upcoming(through=self._step + 1)
        masked = self._mask_uncached(rows)
        self._rows_of_upcoming_step[step] = masked
        self._update_window_bits(masked, step, set_bit=True)

    def clear_upcoming(self) -> None:
        """Forget every recorded hint (e.g. when the batches they name will not be prefetched)."""
        if self._rows_of_upcoming_step:
            self._forget_upcoming(through=max(self._rows_of_upcoming_step))

    def next_use_of_slots(self) -> torch.Tensor:
        """int64 [S]: the ``next_use`` the prefetch at step ``self.step + 1`` will give each slot's
        row from the recorded hints: the soonest recorded step ``s`` in ``self.step + 2 ..
        self.step + 1 + WINDOW_BITS`` whose bit is set in the row's :attr:`window_bits`, else
        ``NEXT_USE_UNKNOWN`` (also for empty slots and before any hint).

        Plain torch, for tests and inspection: the reference of the prefetch kernel's decode.
        """
        next_use = torch.full((self.num_slots,), NEXT_USE_UNKNOWN, dtype=torch.int64, device=self.device)
        if self.window_bits is None:
            return next_use
        occupied = self.tags != EMPTY
        words = torch.where(occupied, self.window_bits[self.tags.clamp(min=0)], 0)
        next_step = self._step + 1
        for step in sorted(self._rows_of_upcoming_step, reverse=True):  # the soonest step is written last
            if next_step < step <= next_step + WINDOW_BITS:
                named = ((words >> (step % WINDOW_BITS)) & 1).bool()
                next_use = torch.where(named, step, next_use)
        return next_use

    def unlock(self, slot_of_index: torch.Tensor, distinct: bool = False) -> None:
        """Release one batch's locks: one per distinct slot >= 0 of ``slot_of_index`` (int32 [N]).

        ``distinct=True`` says no slot >= 0 appears twice (e.g. :attr:`locked_slots` of the
        batch's prefetch), which saves sorting them. Given the very tensor its prefetch returned
        (or its :attr:`locked_slots`), the rows that prefetch gave no slot may be cached again;
        a copy of it releases the locks only, and those rows then stay in their backing stores
        (lost hits, never lost updates). On CUDA an unlock on another stream than the latest
        prefetch's waits for that prefetch: lock counts are updated without atomics.
        """
        slots = self._check_slots(slot_of_index)
        if self._last_prefetch is not None:
            stream, done = self._last_prefetch
            if stream != torch.cuda.current_stream(self.device):
                torch.cuda.current_stream(self.device).wait_event(done)
        entry = self._unreleased.get(id(slot_of_index))
        if entry is not None and (entry[0] is slot_of_index or entry[1] is slot_of_index):
            self._unreleased.pop(id(entry[0]), None)
            self._unreleased.pop(id(entry[1]), None)  # the same tensor for an empty batch
            if entry[2].numel():
                self._launch(_kernels.release_bypassed_kernel, entry[2].numel(), entry[2], self._k_bypass_count)
        if slots.numel() == 0:
            return
        slots = slots if distinct else torch.sort(slots).values  # repeats side by side: released once
        if self.device.type == "cpu":
            # Cheap here (no device to wait for): catch an unlock without its prefetch.
            held = slots[slots >= 0]
            distinct_held = torch.unique(held)
            if (self.locks[distinct_held] <= 0).any() or (distinct and distinct_held.numel() < held.numel()):
                raise RuntimeError("unlock of a slot that holds no lock: unlock called twice for a batch, "
                                   "or with a remap that is not a prefetch's (or repeats with distinct=True)")
        self._launch(_kernels.unlock_kernel, slots.numel(), slots, self._k_locks)

    def mark_dirty(self, slot_of_index: torch.Tensor) -> None:
        """Mark slots updated in place (by backward): they are written back before being dropped."""
        slots = self._check_slots(slot_of_index)
        if slots.numel():
            self._launch(_kernels.mark_dirty_kernel, slots.numel(), slots, self._k_dirty)

    def write_back(self, slot_of_index: torch.Tensor) -> None:
        """Copy the rows of these slots (int32/int64 [N]; -1 skipped, repeats fine) to their backing
        stores now, weights and state. Dirty bits are left as they are.

        Counted in ``write_backs`` and ``bytes_out``.
        """
        slots = self._check_slots(slot_of_index)
        n = slots.numel()
        if n == 0:
            return
        rows = torch.where(slots >= 0, self.tags[slots.clamp(min=0).long()], EMPTY)
        self._write_rows_back(rows, slots)  # repeats of a slot are repeats of its row: written once

    def flush(self) -> None:
        """Write every dirty slot (weights and state) back to its backing store; clear dirty bits.

        Counts ``write_backs`` and ``bytes_out``. Rows stay cached (and locked ones stay locked).
        """
        self._write_rows_back(torch.where(self.dirty.bool(), self.tags, EMPTY), self._all_slots)
        self.dirty.zero_()

    def invalidate(self) -> None:
        """Drop every cached row without writing it back (e.g. after the backing store was reloaded).

        Raises RuntimeError while any slot is locked: a batch in flight still reads those rows.
        Recorded lookahead hints stay: they describe batches to come, not what is cached.
        """
        if self.num_locked():
            raise RuntimeError(f"invalidate() with {self.num_locked()} locked slots: unlock every "
                               "prefetched batch first")
        self.tags.fill_(EMPTY)
        self.bypass_count.zero_()  # no batch is in flight
        self.next_use.fill_(NEXT_USE_UNKNOWN)
        self.last_use.zero_()
        self.use_count.zero_()
        self.dirty.zero_()

    def num_locked(self) -> int:
        """Slots holding at least one lock (reads the device)."""
        return int((self.locks > 0).sum())

    def stats(self) -> CacheStats:
        """Counters since the last :meth:`reset_stats` (reads the device once).

        ``lookups`` and ``unique_rows`` count only rows of the cached tables; ``write_backs`` /
        ``bytes_out`` include flushes and :meth:`write_back`.
        """
        values = dict(zip(_DEVICE_COUNTERS, self._counters.tolist()))
        return CacheStats(batches=self._batches, **values)

    def reset_stats(self) -> None:
        self._counters.zero_()
        self._batches = 0

    def __repr__(self) -> str:
        return (f"SlotCache({self.num_slots} slots = {self.num_sets} sets x {self.associativity} ways, "
                f"policy={self.policy!r}, {len(self.tables)} tables, row_width={self.row_width}, "
                f"state_width={self.state_width}, device={self.device})")

    # ------------------------------------------------------------------ prefetch

    def _prefetch(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(slot_of_index int32 [N], locked_slots int32 [N], bypassed_rows int64 [N]) of a batch."""
        n = rows.numel()
        on = dict(device=self.device)

        # 1. Deduplicate by sorting: unique rows ascending, padded to N with NOT_CACHED.
        masked = self._mask_uncached(rows)
        sorted_rows, order = sort_ids(masked, self._rows_end)
        cached_sorted = sorted_rows != NOT_CACHED
        is_first = torch.ones(n, dtype=torch.bool, **on)
        is_first[1:] = sorted_rows[1:] != sorted_rows[:-1]
        is_first &= cached_sorted
        unique_index_sorted = torch.cumsum(is_first, 0) - 1  # index among unique rows, per sorted lookup
        unique_rows = torch.full((n,), NOT_CACHED, dtype=torch.int64, **on)
        # Repeats of a row write the same value to the same place; uncached lookups (sorted
        # last) all write NOT_CACHED to position n - 1, which is padding whenever they exist.
        unique_rows.scatter_(0, torch.where(cached_sorted, unique_index_sorted, n - 1), sorted_rows)
        unique_of_lookup = torch.empty(n, dtype=torch.int64, **on)
        unique_of_lookup[order] = torch.where(cached_sorted, unique_index_sorted, -1)

        # 2. Sets, then the unique rows grouped by set (stable: ascending rows within a set).
        set_of_unique = torch.empty(n, dtype=torch.int64, **on)
        self._launch(_kernels.set_of_rows_kernel, n, unique_rows, self.num_sets, set_of_unique)
        set_of_position, unique_of_position = sort_ids(set_of_unique, self.num_sets + 1, stable=True)

        # 3. Hits, victims, fills: the policy, one thread per set.
        slot_of_unique = torch.full((n,), NO_SLOT, dtype=torch.int32, **on)
        outcome = torch.zeros(n, dtype=torch.int8, **on)
        victim_row = torch.full((n,), EMPTY, dtype=torch.int64, **on)
        victim_was_dirty = torch.zeros(n, dtype=torch.uint8, **on)
        read_window_bits = self._policy_code == POLICY_LOOKAHEAD and self.window_bits is not None
        self._launch(_kernels.assign_slots_kernel, n,
                     set_of_position, unique_of_position, unique_rows, self.num_sets, self.associativity,
                     self._step, self._policy_code, self._k_tags, self._k_last_use, self._k_use_count,
                     self._k_next_use, self._k_window_bits, read_window_bits, self._k_locks, self._k_dirty,
                     self._k_bypass_count, slot_of_unique, outcome, victim_row, victim_was_dirty)

        # 4. Write back dirty victims (all tables), then fill (all tables): a slot's old row
        # leaves before its new row arrives.
        num_unique = is_first.sum()
        self._write_rows_back(torch.where(victim_was_dirty.bool(), victim_row, EMPTY), slot_of_unique,
                              count=False)
        self._copy_rows(outcome, OUTCOME_FILLED, unique_rows, slot_of_unique, to_backing=False)

        # 5. The remap, and the counters (device sums: no sync).
        cached_lookup = unique_of_lookup >= 0
        unique_of_lookup_or_0 = unique_of_lookup.clamp(min=0)
        slot_of_index = torch.where(cached_lookup, slot_of_unique[unique_of_lookup_or_0], NO_SLOT)
        hit = outcome == OUTCOME_HIT
        filled = outcome == OUTCOME_FILLED
        unique_hits = hit.sum()
        update = {
            "lookups": cached_lookup.sum(),
            "lookup_hits": (hit[unique_of_lookup_or_0] & cached_lookup).sum(),
            "unique_rows": num_unique,
            "unique_hits": unique_hits,
            "unique_misses": num_unique - unique_hits,
            "misses_no_slot": (outcome == OUTCOME_NO_SLOT).sum(),
            "evictions": (filled & (victim_row != EMPTY)).sum(),
            "write_backs": victim_was_dirty.sum(dtype=torch.int64),
            "bytes_in": self._bytes_of(unique_rows, filled),
            "bytes_out": self._bytes_of(victim_row, victim_was_dirty),
        }
        self._counters += torch.stack([update[name] for name in _DEVICE_COUNTERS])
        bypassed_rows = torch.where(outcome == OUTCOME_NO_SLOT, unique_rows, NOT_CACHED)
        return slot_of_index.to(torch.int32), slot_of_unique, bypassed_rows

    def _forget_upcoming(self, through: int) -> None:
        """Clear the window bits of every recorded step ``<= through`` and drop its rows."""
        for step in [s for s in self._rows_of_upcoming_step if s <= through]:
            rows = self._rows_of_upcoming_step.pop(step)
            if rows.is_cuda:  # the rows may come from another stream: free them after this one's clear
                rows.record_stream(torch.cuda.current_stream(self.device))
            self._update_window_bits(rows, step, set_bit=False)

    def _update_window_bits(self, rows: torch.Tensor, step: int, set_bit: bool) -> None:
        """Set (or clear) bit ``step % WINDOW_BITS`` of the window bits of ``rows`` (int64 [M],
        NOT_CACHED skipped): one launch."""
        if rows.numel() == 0:
            return
        bit = step % WINDOW_BITS
        step_bit = 1 << bit if bit < WINDOW_BITS - 1 else -(1 << bit)  # as an int64: bit 63 is the sign
        self._launch(_kernels.window_bits_kernel, rows.numel(), rows, step_bit, set_bit, self._k_window_bits)

    def _write_rows_back(self, rows: torch.Tensor, slots: torch.Tensor, count: bool = True) -> None:
        """Copy slot ``slots[i]`` to the backing row ``rows[i]`` (int64 [M]; EMPTY skips; a row named
        more than once must name one slot, and is copied once), every table.

        The copies go in ascending row order: the GPU writes host memory at ~52 GB/s in row order
        and ~21 GB/s in random order (512-byte rows, H200). ``count`` adds them to write_backs and
        bytes_out (prefetch counts its own).
        """
        keys = torch.where(rows == EMPTY, NOT_CACHED, rows)  # skipped entries sort last
        sorted_rows, order = sort_ids(keys, self._rows_end)
        selected = sorted_rows != NOT_CACHED
        selected[1:] &= sorted_rows[1:] != sorted_rows[:-1]  # a row named twice is copied once
        selected = selected.to(torch.uint8)
        self._copy_rows(selected, 1, sorted_rows, slots[order], to_backing=True)
        if count:
            update = torch.zeros_like(self._counters)
            update[_DEVICE_COUNTERS.index("write_backs")] = selected.sum(dtype=torch.int64)
            update[_DEVICE_COUNTERS.index("bytes_out")] = self._bytes_of(sorted_rows, selected)
            self._counters += update

    def _make_copy_groups(self) -> list[tuple]:
        """Kernel arguments of ``copy_rows_kernel`` for each group of tables whose weights (and
        state) share one buffer, as a module's tables of one tier do: one launch copies rows of
        every table of a group. Each group: (table_info, cache words, cache state, store words,
        store state), converted for the kernels once.

        Rows travel as the widest integer words (up to 8 bytes) that divide every row, row
        stride and row offset involved: a warp then moves up to 256 bytes per instruction.
        """
        element = self.weights.element_size()
        on = dict(device=self.device)
        if self.weights.stride(1) != 1 or any(t.weights.stride(1) != 1 for t in self.tables):
            raise ValueError("cached tables need rows of contiguous elements (weights.stride(1) == 1)")
        groups: dict[tuple, list[CachedTable]] = {}
        for t in self.tables:
            state_key = None if t.state is None else t.state.untyped_storage().data_ptr()
            groups.setdefault((t.weights.untyped_storage().data_ptr(), state_key), []).append(t)

        byte_quantities = [self.weights.data_ptr(), self.weights.stride(0) * element, self.row_width * element]
        for t in self.tables:
            byte_quantities += [t.weights.data_ptr(), t.weights.stride(0) * element, t.dim * element]
        word = next(size for size in (8, 4, 2, 1) if all(q % size == 0 for q in byte_quantities))
        word_dtype = _BITS_OF_SIZE[word]
        dummy_state = torch.zeros(1, 1, dtype=torch.float32, **on)
        k_cache_weights = self._kernel_array(self.weights.view(word_dtype))
        k_cache_state = self._kernel_array(self.state if self.state_width else dummy_state)

        result = []
        for tables in groups.values():
            store_weights = _flat_view(tables[0].weights, word_dtype)
            store_state = _flat_view(tables[0].state, torch.float32) if tables[0].state is not None else dummy_state[0]
            info = torch.zeros(len(tables), _kernels.TABLE_INFO_COLUMNS, dtype=torch.int64)
            for g, t in enumerate(tables):  # tables ascend by global row (see _check_tables)
                info[g, _kernels.INFO_GLOBAL_START] = t.global_row_start
                info[g, _kernels.INFO_GLOBAL_END] = t.global_row_start + t.num_rows
                info[g, _kernels.INFO_WEIGHTS_OFFSET] = (t.weights.data_ptr() - store_weights.data_ptr()) // word
                info[g, _kernels.INFO_WEIGHTS_STRIDE] = t.weights.stride(0) * element // word
                info[g, _kernels.INFO_WORDS] = t.dim * element // word
                if t.state is not None:
                    if t.state.stride(1) != 1:
                        raise ValueError("cached tables need optimizer state rows of contiguous values")
                    info[g, _kernels.INFO_STATE_OFFSET] = (t.state.data_ptr() - store_state.data_ptr()) // 4
                    info[g, _kernels.INFO_STATE_STRIDE] = t.state.stride(0)
                    info[g, _kernels.INFO_STATE_WIDTH] = t.state_width
            # The tensors stay referenced with their kernel views (which do not own memory on the GPU).
            tensors = (info.to(self.device), store_weights, store_state)
            result.append((tensors, self._kernel_array(tensors[0]), k_cache_weights, k_cache_state,
                           self._kernel_array(store_weights), self._kernel_array(store_state)))
        return result

    def _copy_rows(self, selected, wanted, row_of_entry, slot_of_entry, to_backing) -> None:
        """Copy the rows of the entries where ``selected == wanted`` (all tables, one launch per
        buffer group; see ``copy_rows_kernel``): slot -> backing store if ``to_backing``, else
        backing store -> slot."""
        num_entries = selected.numel()
        if SIMULATION:
            # Few simulator threads (each is a Python thread); each walks many entries, all columns.
            grid, block = 1, (1, SIMULATED_THREADS)
        else:
            rows_per_block = self.copy_rows_per_block
            grid, block = max(1, min(-(-num_entries // rows_per_block), self.copy_blocks)), (32, rows_per_block)
        for _tensors, k_info, k_cache_weights, k_cache_state, k_store_weights, k_store_state in self._copy_groups:
            self._launch_configured(
                _kernels.copy_rows_kernel, grid, block, selected, wanted, row_of_entry, slot_of_entry, k_info,
                to_backing, k_cache_weights, k_cache_state, k_store_weights, k_store_state)

    # ------------------------------------------------------------------ helpers

    def _mask_uncached(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` with every row outside the cached tables replaced by NOT_CACHED (int64 [N])."""
        table = torch.searchsorted(self._table_starts, rows, right=True) - 1
        inside = (table >= 0) & (rows < self._table_ends[table.clamp(min=0)])
        return torch.where(inside, rows, NOT_CACHED)

    def _bytes_of(self, rows: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
        """Bytes (weights and state) of the rows where ``counted`` is set: an int64 device scalar.
        ``rows`` elsewhere may be anything (padding, EMPTY)."""
        if self._uniform_row_bytes is not None:
            return counted.sum(dtype=torch.int64) * self._uniform_row_bytes
        table = (torch.searchsorted(self._table_starts, rows, right=True) - 1).clamp(min=0)
        return (self._table_row_bytes[table] * counted).sum()

    def _check_tables(self, tables: Sequence[CachedTable]) -> list[CachedTable]:
        tables = sorted(tables, key=lambda t: t.global_row_start)
        if not tables:
            raise ValueError("SlotCache needs at least one cached table")
        for i, t in enumerate(tables):
            where = f"cached table {i} (global rows {t.global_row_start}..)"
            if t.global_row_start < 0 or t.num_rows < 1 or t.dim < 1:
                raise ValueError(f"{where}: global_row_start >= 0, num_rows >= 1 and dim >= 1 needed")
            if i and t.global_row_start < tables[i - 1].global_row_start + tables[i - 1].num_rows:
                raise ValueError(f"{where} overlaps the table before it")
            if t.weights.dim() != 2 or tuple(t.weights.shape) != (t.num_rows, t.dim):
                raise ValueError(f"{where}: weights must be [{t.num_rows}, {t.dim}], got {tuple(t.weights.shape)}")
            if t.weights.dtype != tables[0].weights.dtype:
                raise ValueError(f"{where}: weights dtype {t.weights.dtype} differs from "
                                 f"{tables[0].weights.dtype}: one cache holds one dtype")
            if t.weights.element_size() not in _BITS_OF_SIZE:
                raise ValueError(f"{where}: unsupported weights dtype {t.weights.dtype}")
            if t.state is not None and (t.state.dim() != 2 or t.state.shape[0] != t.num_rows
                                        or t.state.dtype != torch.float32):
                raise ValueError(f"{where}: state must be fp32 [{t.num_rows}, width], got "
                                 f"{t.state.dtype} {tuple(t.state.shape)}")
            for name, tensor in (("weights", t.weights), ("state", t.state)):
                if tensor is not None and tensor.device.type != self.device.type:
                    raise ValueError(f"{where}: {name} on {tensor.device}, the cache on {self.device}")
        return tables

    def _check_rows(self, global_rows: torch.Tensor) -> torch.Tensor:
        if not isinstance(global_rows, torch.Tensor) or global_rows.dtype != torch.int64 or global_rows.dim() != 1:
            raise TypeError("global_rows must be a 1-D int64 tensor")
        if global_rows.device.type != self.device.type:
            raise ValueError(f"global_rows on {global_rows.device}, the cache on {self.device}")
        return global_rows.contiguous()

    def _check_slots(self, slot_of_index: torch.Tensor) -> torch.Tensor:
        if not isinstance(slot_of_index, torch.Tensor) or slot_of_index.dtype not in (torch.int32, torch.int64) \
                or slot_of_index.dim() != 1:
            raise TypeError("slot_of_index must be a 1-D int32 or int64 tensor (a prefetch's result)")
        if slot_of_index.device.type != self.device.type:
            raise ValueError(f"slot_of_index on {slot_of_index.device}, the cache on {self.device}")
        return slot_of_index.contiguous()

    def _kernel_array(self, tensor: torch.Tensor):
        """What a Numba kernel takes for ``tensor``: a device array view on the GPU (see
        :func:`_device_array`), a numpy view (same memory) in the CUDA simulator."""
        if SIMULATION:
            return tensor.detach().numpy()
        return _device_array(tensor)

    def _launch(self, kernel, num_items: int, *args):
        """Launch a 1-D grid-stride kernel over ``num_items`` entries."""
        if SIMULATION:
            grid, block = 1, max(1, min(num_items, SIMULATED_THREADS))
        else:
            block = 256
            grid = max(1, min(-(-num_items // block), 65535))
        self._launch_configured(kernel, grid, block, *args)

    def _launch_configured(self, kernel, grid, block, *args):
        args = [self._kernel_array(a) if isinstance(a, torch.Tensor) else a for a in args]
        if SIMULATION:
            kernel[grid, block](*args)
            return
        from numba import cuda

        # torch's current stream, so the kernels are ordered with torch's work on it.
        pointer = torch.cuda.current_stream(self.device).cuda_stream
        if pointer != self._stream_pointer:
            self._stream_pointer, self._numba_stream = pointer, cuda.external_stream(pointer)
        with cuda.gpus[self.device.index if self.device.index is not None else torch.cuda.current_device()]:
            kernel[grid, block, self._numba_stream](*args)


# Numba device-array views of torch tensors, by (address, shape, strides, dtype). Building one
# (``numba.cuda.as_cuda_array``) costs ~14 us of host time on an H200 machine, and a prefetch
# converts a dozen temporaries; torch's caching allocator hands the same addresses out step
# after step, so most are found here. The views do not own their memory: each is used only for
# a launch whose caller holds the tensor.
_DEVICE_ARRAYS: dict[tuple, object] = {}
_DEVICE_ARRAYS_MAX = 1024
_TYPESTR = {torch.int64: "<i8", torch.int32: "<i4", torch.int16: "<i2", torch.int8: "|i1", torch.uint8: "|u1",
            torch.bool: "|b1", torch.float32: "<f4", torch.float64: "<f8", torch.float16: "<f2"}


def _device_array(tensor: torch.Tensor):
    """A Numba device array over ``tensor``'s memory (no copy, no ownership, no sync)."""
    key = (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype, tensor.device.index)
    array = _DEVICE_ARRAYS.get(key)
    if array is None:
        from numba import cuda

        if len(_DEVICE_ARRAYS) >= _DEVICE_ARRAYS_MAX:
            _DEVICE_ARRAYS.clear()
        item = tensor.element_size()
        interface = {"shape": tuple(tensor.shape), "strides": tuple(s * item for s in tensor.stride()),
                     "typestr": _TYPESTR[tensor.dtype], "data": (tensor.data_ptr(), False), "version": 3}
        array = _DEVICE_ARRAYS[key] = cuda.from_cuda_array_interface(interface, owner=None, sync=False)
    return array


def _flat_view(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """1-D ``dtype`` view of the whole buffer (untyped storage) under ``tensor``."""
    storage = tensor.untyped_storage()
    size = torch.empty(0, dtype=dtype).element_size()
    return torch.empty(0, dtype=dtype, device=tensor.device).set_(storage, 0, (storage.nbytes() // size,))
