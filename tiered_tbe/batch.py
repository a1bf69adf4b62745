"""A batch on its way through a training step: validated, prefetched, and holding its rows.

:class:`PreparedBatch` is what ``TieredEmbeddingBags`` makes of ``(indices, offsets)`` before
its forward and keeps until its backward has run (the cache's locks live as long as it does);
:class:`DeferredUnlocks` is where a pipeline's released batches wait to be unlocked on the
prefetch stream.
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass, field

import torch

from tiered_tbe import validation
from tiered_tbe.base import streams
from tiered_tbe.base.graphs import GraphLaunches
from tiered_tbe.cache.counter_readings import MISSES_NO_SLOT, CounterReadings
from tiered_tbe.cache.slot_cache import CacheBatch, SlotCache
from tiered_tbe.kernels.in_place_copies import InPlaceCopies
from tiered_tbe.kernels.rows import Lookups

# Readings of the cache's counters in flight at most for CopyRows (the host may run tens of steps ahead of the
# GPU; a forward that finds them all in flight takes none and decides from the last landed).
_COPY_READINGS = 64


class DeferredUnlocks:
    """Batches released by a pipeline's training loop, ``(event after the batch's last kernel,
    batch)``, for the module's next prefetch to unlock on its own stream. Once closed (the
    pipeline is done), a release unlocks at once."""

    def __init__(self):
        self.queue: deque[tuple[torch.cuda.Event | None, PreparedBatch]] = deque()
        self.open = True


@dataclass(eq=False)
class PreparedBatch:
    """A validated batch and the slots its rows were given by its prefetch.

    While it lives, the slots in ``slot_of_index`` stay locked in the cache (its rows cannot
    be evicted), and the rows it got no slot for stay out of the cache (a later prefetch does
    not copy them in while this batch may update them in their backing stores). Both go when
    its backward has run, after its forward under no_grad, or when autograd drops the graph
    without a backward (``release`` is then called from a finalizer), so no path leaks a lock.

    Its rows may still be on their way when it is made (the staged mover copies them behind
    the step): reading :attr:`slot_of_index` orders the current stream after them first, so no
    kernel reads a slot before its row is there.

    A batch prefetched by a :class:`~tiered_tbe.PrefetchPipeline` on its side stream is not
    unlocked on the training stream, where the unlock would race with a prefetch running
    beside it: ``release`` queues it (``deferred``) behind an event, and the module's next
    prefetch, on the side stream, runs it first (:meth:`TieredEmbeddingBags.run_deferred_unlocks`).
    """

    lookups: Lookups
    remap: torch.Tensor | None  # int32 [N]: slot of each lookup's row, -1 = backing store; None: no cache
    cache: SlotCache | None
    cache_batch: CacheBatch | None = None  # the prefetch's hold on the cache (None without a cache)
    ready: torch.cuda.Event | None = None  # recorded after its prefetch, on the stream that ran it
    value_check: validation.ValueCheck | None = None  # verdict still to read (prefetched ahead)
    deferred: DeferredUnlocks | None = None  # where release() queues the unlock, while open
    for_forward_stream: bool = False  # prefetched for a forward on another stream (TorchRec's pipeline)
    _released: bool = field(default=False, repr=False)
    _rows_arrived: bool = field(default=False, repr=False)

    @property
    def slot_of_index(self) -> torch.Tensor | None:
        """int32 [N]: the slot of each lookup's row, -1 = backing store (None without a cache). The
        first read waits, on the current stream, for the batch's rows to reach their slots
        (``SlotCache.wait_filled``)."""
        if not self._rows_arrived and self.cache_batch is not None:
            self.cache.wait_filled(self.cache_batch)
            self._rows_arrived = True
        return self.remap

    @property
    def in_place_rank(self) -> torch.Tensor | None:
        """int32 [N]: the rank of each lookup's row among the batch's rows read in place, -1 for a
        lookup with a slot (``CacheBatch.in_place_rank``); None without a cache."""
        return None if self.cache_batch is None else self.cache_batch.in_place_rank

    def tensors(self) -> list[torch.Tensor]:
        held = [self.remap]
        if self.cache_batch is not None:
            held += [self.cache_batch.locked_slots, self.cache_batch.bypassed_rows, self.cache_batch.sorted_rows,
                     self.cache_batch.order, self.cache_batch.in_place_rank]
        return [t for t in (*self.lookups, *held) if isinstance(t, torch.Tensor)]

    def release(self, updated: bool = False, launched: bool = False) -> None:
        """The batch is done with its rows: unlock them now, or queue the unlock (``deferred``).
        ``updated``: its backward updated them in their slots, which become dirty (in the unlock's
        launch when it unlocks now; else now, on the current stream, before the unlock is queued).
        ``launched``: the backward enqueued :meth:`release_launches` (in its graph) already."""
        if self._released or self.cache is None:
            return
        self._released = True
        if self._unlocks_now():
            self.cache.unlock(self.cache_batch, mark_dirty=updated, launched=launched)
            return
        if updated and not launched:
            self.cache.mark_dirty(self.cache_batch)
        done = None
        if self.remap is not None and self.remap.is_cuda:
            done = streams.record(torch.cuda.Event(), self.remap.device)  # on the stream of the batch's last kernel
        self.deferred.queue.append((done, self))

    def release_launches(self, updated: bool = False) -> GraphLaunches | None:
        """What :meth:`release` would launch now (the unlock, or the dirty marks of a deferred unlock),
        for the backward to enqueue in its own CUDA graph before it calls ``release(updated,
        launched=True)``; ``None``: nothing to launch. Changes nothing of the batch or its locks."""
        if self._released or self.cache is None:
            return None
        if self._unlocks_now():
            return self.cache.unlock_launches(self.cache_batch, mark_dirty=updated)
        return self.cache.mark_dirty_launches(self.cache_batch) if updated else None

    def _unlocks_now(self) -> bool:
        return self.deferred is None or not self.deferred.open

    def unlock(self, mark_dirty: bool = False) -> None:
        """Release the batch's locks, and the rows it left in their backing stores, on the current
        stream (``mark_dirty``: its slots become dirty in the same launch)."""
        self.cache.unlock(self.cache_batch, mark_dirty=mark_dirty)


def same_batch(queued_indices, queued_offsets, indices, offsets) -> bool:
    """Whether a forward's ``(indices, offsets)`` are a prefetched batch's: the same tensors, or (TorchRec
    splits its KeyedJaggedTensor anew between prefetch and forward) ``indices`` in the same memory and
    as many offsets. The queue holds the prefetched tensors, so their memory cannot hold another batch."""
    if queued_indices is indices and queued_offsets is offsets:
        return True
    if not (isinstance(indices, torch.Tensor) and isinstance(offsets, torch.Tensor)):
        return False  # bad input: the forward's checks name it
    return (queued_offsets.numel() == offsets.numel() and queued_indices.numel() == indices.numel()
            and queued_indices.dtype == indices.dtype and queued_indices.device == indices.device
            and queued_indices.data_ptr() == indices.data_ptr())


class CopyRows:
    """A module's copies of the rows a training forward reads in place, which its backward reads
    instead of the backing stores (``kernels/in_place_copies.py``), and the batch they hold.

    The copies are the rows as that forward read them: right for its backward only while no other
    update reached the stores. So they belong to the last training forward until any backward or
    another training forward runs (a loop of forward, backward, forward, ... keeps them every step;
    two forwards before their backwards, or a backward whose forward was not the last, read the
    stores instead, which is always right). Forwards without a backward (evaluation) neither write
    nor revoke them.

    Keeping copies costs a forward registers and time even where every row has a slot (the H100 bisect
    of docs/performance.md: 0.027 ms of a 0.41 ms Criteo forward, ~0.04 of its backward; 168 -> 224
    registers a thread in a Criteo tile). So a forward keeps them only while the cache's recent
    prefetches left rows in their backing stores, as read from its counters without a host sync
    (``cache/counter_readings.py``): the readings lag the GPU, and a batch that reads rows in place
    while they say none had its backward read the stores, the same training.

    A forward that keeps copies and one that does not are two CUDA graphs, so the choice must not flip
    with every batch: copies start at the first reading of rows read in place, and stop only after
    ``QUIET_READINGS`` readings in a row found none. Decided reading by reading, a cache that leaves a row
    in place now and then (all the ways of a set locked) switched graph keys every few steps: captures
    and eager runs in a steady state (the graphed training tests on an H100).
    """

    QUIET_READINGS = 16  # readings in a row without rows read in place before forwards stop keeping copies

    def __init__(self, rows: torch.Tensor, cache: SlotCache):
        self.rows = rows  # [C, row_width] of the weights' dtype, beside the cache
        self._holder: weakref.ref | None = None
        self._readings = CounterReadings([cache], _COPY_READINGS)
        self._quiet_readings = 0  # landed readings in a row that found no row read in place

    def for_forward(self, batch: PreparedBatch) -> InPlaceCopies | None:
        """The copies a training forward of ``batch`` writes (None: it writes none)."""
        self._readings.record()
        for _, change in self._readings.landed():
            # No change to compare (the first reading, or counters reset): unknown, so keep copies.
            read_in_place = change is None or bool(change[0, MISSES_NO_SLOT] > 0)
            self._quiet_readings = 0 if read_in_place else self._quiet_readings + 1
        rank = batch.in_place_rank
        keeps = rank is not None and rank.numel() > 0 and self._quiet_readings < self.QUIET_READINGS
        self._holder = weakref.ref(batch) if keeps else None
        return InPlaceCopies(rank, self.rows) if keeps else None

    def for_backward(self, batch: PreparedBatch) -> InPlaceCopies | None:
        """The copies ``batch``'s backward may read (None: read the stores); they are spent either way."""
        holds = self._holder is not None and self._holder() is batch
        self._holder = None
        return InPlaceCopies(batch.in_place_rank, self.rows) if holds else None

    def forget(self) -> None:
        """The stores changed by other means (a loaded state): no backward reads the copies."""
        self._holder = None
