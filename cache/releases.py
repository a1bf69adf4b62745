"""How a prefetched batch gives back what it holds: the unlock (its locks, and the rows it left in their
backing stores) and the dirty marks of the slots its backward updated.

A mixin of :class:`~tiered_tbe.cache.slot_cache.SlotCache`. Each operation also comes as launches
(:class:`~tiered_tbe.base.graphs.GraphLaunches`) that another CUDA graph can take in: the backward's
(the unlock, or a pipeline's dirty marks) and the next prefetch's (a pipeline's deferred unlocks). A
graph replay costs the host ~0.1 ms on the H200 machine in a DMP step, where the GPU waits for the host
(``docs/performance.md``); one replay instead of two is that much off the step. Needs of the cache:
``_unreleased``, ``_loans``, ``_release_graphs``, ``_launcher``, ``_k_metadata``, ``device``, ``_check_slots``,
``_order_metadata`` and ``_metadata_done``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tiered_tbe.base.graphs import GraphLaunches
from tiered_tbe.base.padded_inputs import padded_input
from tiered_tbe.cache import _kernels
from tiered_tbe.cache._kernels import NO_SLOT, NOT_CACHED
from tiered_tbe.cache.cache_batch import CacheBatch, check_batch


class SlotReleases:
    """:meth:`unlock` and :meth:`mark_dirty` of a :class:`SlotCache`, and their launches."""

    def unlock(self, batch: CacheBatch, mark_dirty: bool = False, launched: bool = False) -> None:
        """Release a prefetched batch: its locks (one per unique row) and the rows it gave no slot.

        ``batch`` is the :class:`CacheBatch` its prefetch returned, or a copy: the batch is found
        by its step, so what is released is what the prefetch took. ``mark_dirty``: first mark
        its slots dirty, as :meth:`mark_dirty` of the batch would (in the same launch).
        ``launched``: the caller enqueued :meth:`unlock_launches` of the batch already (in its own
        CUDA graph): only the host's record of the batch is dropped.
        ``RuntimeError`` (nothing changes) when that batch was unlocked already; ``TypeError``
        for anything but a CacheBatch.
        """
        launches = None if launched else self.unlock_launches(batch, mark_dirty)
        if self._unreleased.pop(batch.step, None) is None:
            raise _holds_no_lock(batch)
        if launches is not None:
            self._release_graphs.run(launches.key, launches.inputs, launches.enqueue, self.device)
        self._metadata_done()
        # Every use of the batch's tensors is enqueued now, and the next prefetch waits for the metadata event
        # just recorded: its graph may overwrite them (StepGraphs' loan).
        loan = self._loans.pop(batch.step, None)
        if loan is not None:
            loan.give_back()

    def holds(self, batch: CacheBatch) -> bool:
        """Whether ``batch`` (or a copy) still holds its locks: prefetched by this cache, not unlocked."""
        return check_batch(batch).step in self._unreleased

    def unlock_launches(self, batch: CacheBatch, mark_dirty: bool = False) -> GraphLaunches | None:
        """The launches of :meth:`unlock` of ``batch``, for a caller to enqueue in its own CUDA graph (the
        backward's: one replay where two cost ~0.1 ms more of host time a step), then to call
        ``unlock(batch, mark_dirty, launched=True)``; ``None`` when there is nothing to launch. Nothing
        changes here but the current stream's order after the last operation on the metadata.
        ``RuntimeError`` when that batch holds no lock."""
        entry = self._unreleased.get(check_batch(batch).step)
        if entry is None:
            raise _holds_no_lock(batch)
        self._order_metadata()
        if not entry.locked_slots.numel():  # as long as bypassed_rows
            return None
        mark = bool(mark_dirty)

        def enqueue(tensors):
            locked_slots, bypassed_rows = tensors
            self._launcher.launch(_kernels.release_kernel, locked_slots.numel(), locked_slots, bypassed_rows,
                                  mark, self._k_metadata.locks, self._k_metadata.dirty,
                                  self._k_metadata.bypass_count)

        return GraphLaunches(("unlock", mark, id(self)), (entry.locked_slots, entry.bypassed_rows), enqueue)

    def _join_unlocks(self, unlock_first: Sequence[CacheBatch], unlocks: Sequence[GraphLaunches | None], size: int,
                      has_rows: bool) -> list[tuple[CacheBatch, GraphLaunches | None]]:
        """Which of a prefetch's ``unlock_first`` batches (``unlocks``: their :meth:`unlock_launches`) join its
        graph of ``size`` entries, as ``(batch, launches)``: those whose launches fit it
        (:meth:`_fit_unlock_launches`; pairs of sizes would multiply the graphs of batches whose size changes).
        The others are unlocked here, each by a replay of its own (~0.1-0.2 ms of host time), and so is every
        one when the prefetch has no rows (no graph)."""
        joined = []
        for batch, launches in zip(unlock_first, unlocks):
            if launches is not None:
                launches = self._fit_unlock_launches(batch, launches, size)
            if has_rows and (launches is None or launches.inputs[0].numel() == size):
                joined.append((batch, launches))
            else:
                self.unlock(batch)
        return joined

    def _fit_unlock_launches(self, batch: CacheBatch, launches: GraphLaunches, size: int) -> GraphLaunches:
        """``launches`` (:meth:`unlock_launches` of ``batch``) laid out at ``size`` entries, for a prefetch of
        that size to take into its graph, when the batch's unique rows fit: they come first in its arrays (the
        rest is padding the release kernel skips), and there are at most as many as its lookups. Else
        ``launches`` as they are. A pipeline of batches whose size changes every step then unlocks in the next
        prefetch's replay at least whenever the earlier batch was no larger, instead of in a replay of its own."""
        locked_slots, bypassed_rows = launches.inputs
        held = self._unreleased[check_batch(batch).step]  # what its prefetch returned (batch may be a copy)
        if locked_slots.numel() == size or held.slot_of_index.numel() > size:
            return launches
        if locked_slots.numel() > size:
            inputs = (locked_slots[:size], bypassed_rows[:size])
        else:
            inputs = (padded_input(locked_slots, size, NO_SLOT), padded_input(bypassed_rows, size, NOT_CACHED))
        return launches._replace(inputs=inputs)

    def mark_dirty(self, slots: CacheBatch | torch.Tensor, launched: bool = False) -> None:
        """Mark slots updated in place (by backward): they are written back before being dropped.
        ``slots``: a batch (the slots of its lookups' rows), or int32/int64 [N] slots, -1 skipped.
        ``launched``: the caller enqueued :meth:`mark_dirty_launches` of them already."""
        launches = None if launched else self.mark_dirty_launches(slots)
        if launches is not None:
            self._release_graphs.run(launches.key, launches.inputs, launches.enqueue, self.device)

    def mark_dirty_launches(self, slots: CacheBatch | torch.Tensor) -> GraphLaunches | None:
        """The launches of :meth:`mark_dirty` of ``slots``, for a caller's own CUDA graph (as
        :meth:`unlock_launches`); ``None`` when there are none."""
        # A batch's slots are its locked ones: each slot of its lookups' rows once, in an array of the prefetch's
        # padded size (NO_SLOT past them). Its slot_of_index holds the same slots, repeated, in an array of the
        # batch's own size, which a CUDA graph would be keyed by: a pipeline's backward, which takes these
        # launches in, ran eagerly every step where the batch size changes every step (H100, 5cdfaa5).
        slot_of_index = slots.locked_slots if isinstance(slots, CacheBatch) else self._check_slots(slots)
        if not slot_of_index.numel():
            return None

        def enqueue(tensors):
            self._launcher.launch(_kernels.mark_dirty_kernel, tensors[0].numel(), tensors[0], self._k_metadata.dirty)

        return GraphLaunches(("mark_dirty", id(self)), (slot_of_index,), enqueue)


def _holds_no_lock(batch: CacheBatch) -> RuntimeError:
    return RuntimeError(f"unlock of the batch of step {batch.step}, which holds no lock: unlocked twice, "
                        "or not prefetched by this cache")
