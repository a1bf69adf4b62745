"""The GPU slot cache: hot rows of the cached tables, held in HBM slots, managed by Numba kernels.

The policy (which set a row maps to, which way a miss evicts, how locks and use counts move)
is specified in :mod:`tiered_tbe.cache.policy`; the CPU simulator
(:mod:`tiered_tbe.cache.simulator`) follows the same definition and agrees with this cache
hit for hit. The cache decides; a row mover (:mod:`tiered_tbe.cache.mover`: zero-copy or
staged) carries the rows between slots and backing stores.

What the TBE kernels read
    ``weights`` [num_slots, row_width] and ``state`` [num_slots, state_width] (the kernels'
    ``cache_weights`` / ``cache_state``): row ``g`` of a cached table lives, while cached, in
    ``weights[slot, :dim]`` (and its optimizer state in ``state[slot, :table_state_width]``),
    where ``slot = batch.slot_of_index[i]`` for a lookup ``i`` of ``g``; slot -1 means "read
    and update the backing store".

A training step with the cache::

    cache.add_upcoming(rows_of_batch, its_step)  # lookahead only: each queued batch once, as it
                                                 # enters the window (step = cache.step + 1 + d)
    batch = cache.prefetch(global_rows)          # hits locked, misses assigned and locked, rows moving
    cache.wait_filled(batch)                     # the current stream waits for the batch's rows
    ... forward / backward read and update rows through batch.slot_of_index ...
    cache.unlock(batch, mark_dirty=True)         # the slots backward updated are dirty, and the
                                                 # batch no longer needs its rows

With a prefetch pipeline of depth ``k`` the unlock (and mark_dirty) of a batch comes after the
prefetches of the ``k`` batches that follow it: those prefetches cannot evict its rows.

GPU mode runs every step on torch's current stream and never waits for the device: the
number of unique rows stays on the device (arrays are sized by the number of lookups and
padded), and the counters accumulate in a device tensor read by :meth:`SlotCache.stats`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

import torch

from tiered_tbe.base.graphs import PADDED_GRAPHS, GraphLaunches, OutputLoan, StepGraphs, next_int64, padded_size
from tiered_tbe.base.mode import SIMULATION, default_device
from tiered_tbe.base.padded_inputs import padded_input
from tiered_tbe.base.sorting import stable_sort
from tiered_tbe.base.streams import current_stream, current_stream_handle
from tiered_tbe.cache import _kernels, batch_kernels, policy_kernels, slot_layout
from tiered_tbe.cache._kernels import NOT_CACHED
from tiered_tbe.cache.cache_batch import CacheBatch, check_batch
from tiered_tbe.cache.hints import MAX_LOOKAHEAD, LookaheadHints, UpcomingBatches
from tiered_tbe.cache.launch import KernelLauncher
from tiered_tbe.cache.mover import Moves, make_mover
from tiered_tbe.cache.policy import (
    EMPTY,
    NEXT_USE_UNKNOWN,
    check_geometry,
    check_gpu_ways,
    compile_for_simulator,
    policy_code,
    policy_named,
)
from tiered_tbe.cache.releases import SlotReleases
from tiered_tbe.cache.stats import CacheStats
from tiered_tbe.cache.tables import CachedTable, check_tables, in_cached_tables
from tiered_tbe.cache.write_backs import SlotWriteBacks

__all__ = ["MAX_LOOKAHEAD", "CacheBatch", "CachedTable", "SlotCache"]

# Counters kept on the device, in CacheStats order (``batches`` is counted on the host), as a
# prefetch's kernels sum them.
_DEVICE_COUNTERS = [f.name for f in fields(CacheStats) if f.name != "batches"]
assert tuple(_DEVICE_COUNTERS) == batch_kernels.COUNTER_NAMES, "batch_kernels.COUNTER_NAMES must follow CacheStats"
# Tensors SlotCache._assign returns before its moves (slot_of_index .. order).
_ASSIGN_OUTPUTS = 6
# Batches whose prefetch outputs one graph key lends at once without copies (StepGraphs' replicas, captured as
# batches of one size pile up, each with its graph's memory): a pipeline of depth 2 holds three (two prefetched
# ahead, one training), and one more covers a forward's own prefetch. Beyond that a prefetch of that size runs
# eagerly until one is unlocked.
LENT_REPLICAS = 4


class SlotCache(LookaheadHints, SlotReleases, SlotWriteBacks):
    """A set-associative cache of rows in device memory, shared by one module's cached tables.

    Args:
        tables: the cached tables; their global row ranges must not overlap.
        num_slots: slots in all, a multiple of ``associativity``.
        associativity: ways per set, at most ``MAX_WAYS`` (64).
        policy: a name of :data:`~tiered_tbe.cache.policy.POLICIES` (``"lru"``, ``"lfu"``, ``"lookahead"``,
            ``"lfu-admit"``; see :mod:`tiered_tbe.cache.policy`;
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
        mover: ``"zero_copy"`` or ``"staged"`` (:mod:`tiered_tbe.cache.mover`).
        mover_threads, staging_rows: the staged mover's host threads per copy and rows per
            staging buffer (:class:`~tiered_tbe.cache.staged.StagedMover`).
        cuda_graphs: on a GPU, replay each batch shape's prefetch (its device work, with either mover), unlock
            and mark_dirty as CUDA graphs (``base/graphs.py``; bit-identical to their launches one by one).

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
        ``window_bits`` int64 [R], only once a hint was recorded (:mod:`tiered_tbe.cache.hints`).
        ``row_uses`` int16 [R] (one element under a policy that does not count rows): each row's use
        count, by which ``lfu-admit`` admits misses (policy.py, "Per-row use counts").

    Streams: every method enqueues its work on torch's current stream of ``device`` and returns
    without waiting (except ``num_locked``, ``stats``, ``flush``/``write_back`` with the staged
    mover, and ``invalidate``, which read the device or the host's copies). The metadata (tags,
    locks, policy state, dirty bits, hints) is only ever touched from one stream at a time: a
    ``prefetch``, ``unlock``, ``flush``, ``invalidate`` or hint issued on another stream than the
    previous one waits (an event) for it. ``mark_dirty`` may run beside a prefetch: it touches
    only the batch's locked slots, which no prefetch evicts or fills. A caller running prefetch
    on a side stream orders it after the backwards whose rows it may evict (events).

    Example::

        cache = SlotCache([CachedTable(0, 1000, 16, table_weights)], num_slots=64, associativity=8)
        batch = cache.prefetch(torch.tensor([3, 7, 3, 999]))
        cache.wait_filled(batch)
        assert (cache.tags[batch.slot_of_index.long()] == torch.tensor([3, 7, 3, 999])).all()
        cache.unlock(batch)
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
        mover: str = "zero_copy",
        mover_threads: int | None = None,
        staging_rows: int | None = None,
        cuda_graphs: bool = True,
    ):
        self.device = torch.device(device) if device is not None else default_device()
        if self.device.type == "cpu" and not SIMULATION:
            raise ValueError("SlotCache on the CPU needs simulation mode: set TIERED_TBE_SIMULATE=1 "
                             "before importing tiered_tbe, or use device='cuda'")
        if self.device.type == "cuda" and SIMULATION:
            raise ValueError("SlotCache on cuda, but tiered_tbe runs in CPU simulation mode")
        check_geometry(num_slots, associativity, lfu_decay_interval)
        check_gpu_ways(associativity)
        self.policy = policy
        self._policy_code = policy_code(policy)
        self.num_slots = num_slots
        self.associativity = associativity
        self.num_sets = num_slots // associativity
        self.lfu_decay_interval = lfu_decay_interval
        self.tables = check_tables(tables, self.device)
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
        for name, dtype in slot_layout.SLOT_METADATA.items():  # tags, last_use, use_count, dirty, locks, next_use
            fill = slot_layout.SLOT_METADATA_FILL.get(name, 0)
            setattr(self, name, torch.full((num_slots,), fill, dtype=dtype, **on))
        self.weights = torch.zeros(num_slots, self.row_width, dtype=weights_dtype, **on)
        self.state = torch.zeros(num_slots, self.state_width, dtype=torch.float32, **on)
        self._step = 0
        self._batches = 0
        self._counters = torch.zeros(len(_DEVICE_COUNTERS), dtype=torch.int64, **on)

        # Per-table facts as device tensors, for searchsorted and byte counts without host syncs.
        self._rows_end = max(t.global_row_end for t in self.tables)  # bound of the row ids
        self._table_starts = torch.tensor([t.global_row_start for t in self.tables], dtype=torch.int64, **on)
        self._table_ends = torch.tensor([t.global_row_end for t in self.tables], dtype=torch.int64, **on)
        element = self.weights.element_size()
        row_bytes = [t.dim * element + 4 * t.state_width for t in self.tables]
        self._table_row_bytes = torch.tensor(row_bytes, dtype=torch.int64, **on)
        self._uniform_row_bytes = row_bytes[0] if len(set(row_bytes)) == 1 else None
        self._all_slots = torch.arange(num_slots, dtype=torch.int64, **on)
        self.bypass_count = torch.zeros(self._rows_end, dtype=torch.uint8, **on)
        # Per-row use counts, kept only by a policy that counts rows (policy.py, "Per-row use counts").
        self._counts_rows = policy_named(policy).counts_rows
        self._reads_window = policy_named(policy).reads_window  # decodes next uses from the window's bits
        self.row_uses = torch.zeros(self._rows_end if self._counts_rows else 1, dtype=slot_layout.ROW_USES_DTYPE, **on)
        # The policy kernels' scratch: per set, the way of each rank in the order of victims (policy_kernels.py).
        self._way_of_rank = torch.zeros(num_slots, dtype=torch.int8, **on)

        # Kernel views, made once (converting a tensor costs host time at every launch): the
        # per-slot tensors are only ever updated in place.
        self._launcher = KernelLauncher(self.device)
        compile_for_simulator()  # in this thread, not in a simulated kernel's (see there)
        self._upcoming = UpcomingBatches(self._rows_end, self._table_starts, self._table_ends, self._launcher)
        self._k_metadata = policy_kernels.SlotMetadata(*(
            self._launcher.array(t) for t in (self.tags, self.last_use, self.use_count, self.next_use, self.locks,
                                              self.dirty, self.bypass_count, self.row_uses, self._way_of_rank)))
        self.mover = make_mover(mover, self.weights, self.state, self.tables, self.device, self._launcher,
                                self._rows_end, threads=mover_threads, staging_rows=staging_rows)
        # CUDA graphs of the prefetch (assign and move), per batch shape. A replay lends its outputs to the batch
        # until its unlock (no copies of them, ~0.05 ms of the prefetch's stream a ragged step on an H100), except
        # where the mover's threads read its lists later.
        self._lends_outputs = not self.mover.hands_off_device_lists
        self._prefetch_graphs = StepGraphs(PADDED_GRAPHS, enabled=None if cuda_graphs else False,
                                           replicas=LENT_REPLICAS if self._lends_outputs else 1)
        # ... and of the unlock and mark_dirty launches: a Numba launch costs ~0.3 ms of host time on
        # the H200 machine (the cached backward's host time was 1.0 ms against 0.7 without a cache;
        # results/measurements.jsonl), a replay a fraction of that.
        self._release_graphs = StepGraphs(2 * PADDED_GRAPHS, enabled=None if cuda_graphs else False)
        # Prefetches not yet unlocked, by step -> the batch as its prefetch made it, and the loan of its tensors.
        self._unreleased: dict[int, CacheBatch] = {}
        self._loans: dict[int, OutputLoan] = {}
        # The stream of the latest operation on the metadata (its raw handle) and an event after it, on
        # CUDA: an operation on another stream waits for it, since the kernels update the metadata without
        # atomics. One event, recorded again by each operation (a wait enqueued before keeps the record it
        # saw): a new event and Stream objects a prefetch and an unlock cost ~40 us of host time a step.
        self._metadata_event = torch.cuda.Event() if self.device.type == "cuda" else None
        self._last_metadata_stream: int | None = None

    # ------------------------------------------------------------------ sizes

    slot_bytes = staticmethod(slot_layout.slot_bytes)
    row_bytes = staticmethod(slot_layout.row_bytes)

    # ------------------------------------------------------------------ public API

    @property
    def step(self) -> int:
        """Prefetches so far (the policy's clock; see tiered_tbe.cache.policy)."""
        return self._step

    def prefetch(self, global_rows: torch.Tensor, unlock_first: Sequence[CacheBatch] = ()) -> CacheBatch:
        """Bring a batch's rows into the cache, lock them, and say where each lookup's row is.

        Args:
            global_rows: int64 (or int32) [N], the global row of every lookup of the batch
                (repeats allowed).
                Rows outside every cached table are left alone (their slot is -1).
            unlock_first: batches to :meth:`unlock` (without ``mark_dirty``) before this one is
                assigned, in the prefetch's own CUDA graph (a pipeline's deferred unlocks: one replay
                where two cost ~0.1 ms more of host time). ``RuntimeError`` before any change when one
                holds no lock.

        Returns:
            The batch's :class:`CacheBatch`; its ``slot_of_index`` (int32 [N]) is the slot holding
            each lookup's row, or -1 (row not in a cached table, or every way of its set locked:
            ``misses_no_slot``). Its rows are in their slots for work issued after
            :meth:`wait_filled`.

        Hits update policy state and gain a lock; misses evict unlocked victims (the mover writes
        back only dirty ones, weights and optimizer state), are moved in from the backing store
        and gain a lock. Lookahead hints (:meth:`add_upcoming`) of this step and earlier ones are
        forgotten first. Each unique row is locked once; :meth:`unlock` of the batch releases them,
        and the rows it gave no slot, which no prefetch caches until then.
        """
        rows = self._check_rows(global_rows, dtypes=(torch.int64, torch.int32))
        unlocks = [self.unlock_launches(batch) for batch in unlock_first]  # refused before any change
        if len({batch.step for batch in unlock_first}) < len(unlock_first):
            raise RuntimeError("unlock_first names a batch twice: it holds its locks once")
        self._order_metadata()
        # Padded to a size bucket (base/graphs.py) only when its size differs from the batch before it: batches
        # whose size changes every step replay a few graphs, and a model of one batch shape sorts and ranks no
        # padding (7.7% more lookups at B=65536 x 26) and copies no array.
        size = padded_size(rows.numel()) if self._prefetch_graphs.size_changed(rows.numel()) else rows.numel()
        fused = self._join_unlocks(unlock_first, unlocks, size, rows.numel() > 0)
        self._step += 1
        self._batches += 1
        self._upcoming.forget(through=self._step)  # this batch's own hint, if any, leaves the window
        ticket = None
        if rows.numel() > 0:
            try:
                slot_of_index, in_place_rank, locked_slots, bypassed_rows, sorted_rows, order, ticket, loan = \
                    self._assign_and_move(rows, size, [launches for _, launches in fused if launches is not None])
                if loan is not None:
                    self._loans[self._step] = loan
            finally:  # their launches come first in the prefetch's (graph or eager launches)
                for earlier, _ in fused:
                    self.unlock(earlier, launched=True)
        else:
            slot_of_index = in_place_rank = locked_slots = torch.empty(0, dtype=torch.int32, device=self.device)
            bypassed_rows = torch.empty(0, dtype=torch.int64, device=self.device)
            order = torch.empty(0, dtype=torch.int32, device=self.device)
            sorted_rows = torch.empty(0, dtype=batch_kernels.sort_keys_dtype(self._rows_end)[0], device=self.device)
        if self._step % self.lfu_decay_interval == 0:
            self.use_count >>= 1  # LFU aging, after every lfu_decay_interval-th prefetch
            if self._counts_rows:
                self.row_uses >>= 1
        batch = CacheBatch(self._step, slot_of_index, locked_slots, bypassed_rows, sorted_rows, order, ticket,
                           in_place_rank)
        self._unreleased[batch.step] = batch
        self._metadata_done()
        return batch

    def wait_filled(self, batch: CacheBatch) -> None:
        """Order the current stream after the moves that put ``batch``'s rows in place: every
        slot it (or an earlier prefetch) filled, and every write-back a row it reads in place
        needs. Nothing to wait for with the zero-copy mover beyond the prefetch's own stream;
        the staged mover may block the host while its threads catch up (back-pressure)."""
        self.mover.wait_filled(check_batch(batch).ticket)

    def drain(self) -> None:
        """Wait (the host, and the current stream) until every row move started so far has landed:
        fills in their slots, write-backs in their backing stores."""
        self.mover.drain()

    def lookup(self, global_rows: torch.Tensor) -> torch.Tensor:
        """Where each row is now: int32 [N] slots, -1 when not cached. No policy change, no lock."""
        rows = self._check_rows(global_rows)
        slot_of_index = torch.empty(rows.numel(), dtype=torch.int32, device=self.device)
        if rows.numel():
            self._launcher.launch(_kernels.lookup_kernel, rows.numel(), self._mask_uncached(rows), self.num_sets,
                                  self.associativity, self._k_metadata.tags, slot_of_index)
        return slot_of_index

    def invalidate(self) -> None:
        """Drop every cached row without writing it back (e.g. after the backing store was reloaded).

        Raises RuntimeError while any slot is locked: a batch in flight still reads those rows.
        Waits for every row move in flight first (a late write-back would overwrite the reload).
        Recorded lookahead hints stay: they describe batches to come, not what is cached.
        """
        self._order_metadata()
        self.drain()
        if self.num_locked():
            raise RuntimeError(f"invalidate() with {self.num_locked()} locked slots: unlock every "
                               "prefetched batch first")
        self.tags.fill_(EMPTY)
        self.bypass_count.zero_()  # no batch is in flight
        self.next_use.fill_(NEXT_USE_UNKNOWN)
        self.last_use.zero_()
        self.use_count.zero_()
        self.row_uses.zero_()
        self.dirty.zero_()
        self._metadata_done()

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

    def copy_counters(self, target: torch.Tensor) -> None:
        """Copy the counters :meth:`stats` reads (int64, ``batch_kernels.COUNTER_NAMES`` order) into ``target``
        (pinned host memory) on the current stream, without waiting for it: a caller polls an event after it
        (``PrefetchPipeline(fit_cache=True)``, ``tiered_tbe/ahead.py``)."""
        target.copy_(self._counters, non_blocking=target.is_pinned())

    def reset_stats(self) -> None:
        self._counters.zero_()
        self._batches = 0

    def close(self) -> None:
        """Finish every row move and stop the mover's threads (they start again when needed)."""
        self.mover.close()

    def __repr__(self) -> str:
        return (f"SlotCache({self.num_slots} slots = {self.num_sets} sets x {self.associativity} ways, "
                f"policy={self.policy!r}, mover={self.mover.name!r}, {len(self.tables)} tables, "
                f"row_width={self.row_width}, state_width={self.state_width}, device={self.device})")

    # ------------------------------------------------------------------ prefetch

    def _assign_and_move(self, rows: torch.Tensor, size: int, unlocks: Sequence[GraphLaunches] = ()):
        """(slot_of_index, in_place_rank, locked_slots, bypassed_rows, sorted_rows, order, the mover's ticket, the
        loan of those tensors or None) of a batch: ``unlocks`` (earlier batches' :meth:`unlock_launches`),
        :meth:`_assign` and the mover's device work (:meth:`RowMover.enqueue`) replay as one CUDA graph per
        batch shape (``base/graphs.py``; the step reaches the kernels in a tensor), then the mover's host part
        (:meth:`RowMover.hand_off`: the staged mover hands the lists to its threads) runs on the host.
        ``size``: the lookups the batch is laid out at (``rows.numel()``, or its ``padded_size``). A replay's
        tensors are its graph's own, lent until the batch's unlock gives the loan back (:meth:`unlock`)."""
        step = torch.tensor([self._step], dtype=torch.int64)
        # Padded with a row outside every cached table (sorted last as no row, counted nowhere).
        num_lookups = rows.numel()
        rows = padded_input(rows, size, self._rows_end)  # laid out by the replay's copy (base/padded_inputs.py)

        unlock_inputs = [launches.inputs for launches in unlocks]

        def enqueue(tensors):
            rows, step, *released = tensors
            for launches, count in zip(unlocks, map(len, unlock_inputs)):
                launches.enqueue(released[:count])
                released = released[count:]
            *outputs, moves = self._assign(rows, step)
            outputs = (*outputs, *self.mover.enqueue(moves))
            # The next prefetch's step, left in the graph's static input after this one's kernels read it:
            # the next replay finds it there and skips the host-to-device copy (StepGraphs' advance), which
            # cost ~0.1 ms of host time a prefetch on the H200 machine (scratch timers, docs/performance.md).
            step.add_(1)
            return outputs

        window_bits = self._upcoming.window_bits
        key = (self._reads_window and window_bits is not None,
               None if window_bits is None else window_bits.data_ptr(), tuple(launches.key for launches in unlocks))
        inputs = (rows, step, *(tensor for tensors in unlock_inputs for tensor in tensors))
        loan = OutputLoan() if self._lends_outputs else None
        results = self._prefetch_graphs.run(key, inputs, enqueue, self.device, advance=next_int64, loan=loan)
        (slot_of_index, in_place_rank, locked_slots, bypassed_rows, sorted_rows, order), enqueued = \
            results[:_ASSIGN_OUTPUTS], results[_ASSIGN_OUTPUTS:]
        # The padding sorts after every lookup (stable: after the lookups outside the cached tables too),
        # so the first num_lookups sorted positions are the batch's. The padding locks no slot and
        # leaves no row in its store: locked_slots and bypassed_rows stay padded.
        return (slot_of_index[:num_lookups], in_place_rank[:num_lookups], locked_slots, bypassed_rows,
                sorted_rows[:num_lookups], order[:num_lookups], self.mover.hand_off(enqueued), loan)

    def _assign(self, rows: torch.Tensor, step: torch.Tensor) -> tuple:
        """(slot_of_index int32 [N], in_place_rank int32 [N], locked_slots int32 [N], bypassed_rows int64 [N],
        sorted_rows [N], order int32 [N], the moves) of the batch ``rows`` (int64 [N]) at ``step`` (int64 [1], on the
        device): the kernels and sorts of :mod:`tiered_tbe.cache.batch_kernels`, in its order."""
        # 1. Deduplicate by sorting: the unique rows ascending, padded to N with NOT_CACHED, and their sets.
        u = batch_kernels.unique_rows_of_batch(self._launcher, rows, self._table_starts, self._table_ends,
                                               self._rows_end, self.num_sets)
        # 2. The unique rows grouped by set (stable: ascending rows within a set).
        set_of_position, unique_of_position = stable_sort(u.set_of_unique, self.num_sets)
        # 3. Hits, victims, fills: the policy's kernels, in their order.
        window_bits = self._upcoming.kernel_bits if (self._reads_window and self.window_bits is not None) else None
        policy_kernels.assign_slots(self._launcher, u, set_of_position, unique_of_position, self.num_sets,
                                    self.associativity, step, self._policy_code, self._k_metadata,
                                    self._way_of_rank, window_bits)
        # 4. The remap, the rows left in the backing store, the write-back list, the counters (no sync).
        slot_of_index, in_place_rank, bypassed_rows, write_back_keys, counters = batch_kernels.outcomes_of_batch(
            self._launcher, u, self._table_starts, self._table_row_bytes)
        self._counters += counters
        moves = Moves(u.unique_rows, u.slot_of_unique, u.outcome, u.victim_row, u.victim_was_dirty, write_back_keys,
                      u.unique_number[-1:])
        return slot_of_index, in_place_rank, u.slot_of_unique, bypassed_rows, u.sorted_keys, u.order, moves

    # ------------------------------------------------------------------ helpers

    def _order_metadata(self) -> None:
        """Before touching the metadata: wait (on the device) for the last stream that did."""
        if self._last_metadata_stream is not None and current_stream_handle(self.device) != self._last_metadata_stream:
            current_stream(self.device).wait_event(self._metadata_event)

    def _metadata_done(self) -> None:
        if self._metadata_event is not None:
            stream = current_stream(self.device)
            self._metadata_event.record(stream)
            self._last_metadata_stream = stream.cuda_stream

    def _mask_uncached(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` with every row outside the cached tables replaced by NOT_CACHED (int64 [N])."""
        return torch.where(in_cached_tables(rows, self._table_starts, self._table_ends), rows, NOT_CACHED)

    def _check_rows(self, global_rows: torch.Tensor, dtypes=(torch.int64,)) -> torch.Tensor:
        if not isinstance(global_rows, torch.Tensor) or global_rows.dtype not in dtypes or global_rows.dim() != 1:
            names = " or ".join(str(dtype).removeprefix("torch.") for dtype in dtypes)
            raise TypeError(f"global_rows must be a 1-D {names} tensor")
        if global_rows.device.type != self.device.type:
            raise ValueError(f"global_rows on {global_rows.device}, the cache on {self.device}")
        return global_rows.contiguous()

    def _check_slots(self, slot_of_index: torch.Tensor) -> torch.Tensor:
        if not isinstance(slot_of_index, torch.Tensor) or slot_of_index.dtype not in (torch.int32, torch.int64) \
                or slot_of_index.dim() != 1:
            raise TypeError("slots must be a 1-D int32 or int64 tensor")
        if slot_of_index.device.type != self.device.type:
            raise ValueError(f"slots on {slot_of_index.device}, the cache on {self.device}")
        return slot_of_index.contiguous()

