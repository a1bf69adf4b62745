"""The queue of batches prefetched ahead of their forwards, and the unlocks a pipeline defers.

A mixin of :class:`~tiered_tbe.module.TieredEmbeddingBags` (it reads the module's ``_prefetched`` deque
of ``(indices, offsets, PreparedBatch)``, its ``_deferred_unlocks``, ``cache`` and ``device``):
:meth:`TieredEmbeddingBags.prefetch` appends to the queue, the forward takes its batch from the head
(:meth:`_take_prefetched`), and what a caller gives up is released here, so no lock outlives its batch.
"""

from __future__ import annotations

import torch

from tiered_tbe.base import streams
from tiered_tbe.batch import DeferredUnlocks, PreparedBatch, same_batch
from tiered_tbe.cache.policy import policy_named
from tiered_tbe.cache.slot_cache import MAX_LOOKAHEAD


class PrefetchQueue:
    """Batches prefetched ahead, in order, and the deferred unlocks of a side-stream pipeline."""

    def run_deferred_unlocks(self) -> None:
        """Unlock, on the current stream, the batches a pipeline's training loop has released
        since the last prefetch, each after the event recorded at its release (its backward)."""
        for batch in self._take_deferred_unlocks():
            batch.unlock()

    def _take_deferred_unlocks(self) -> list[PreparedBatch]:
        """The batches a pipeline's training loop has released since the last prefetch, for the caller
        to unlock (a prefetch: in its own graph, ``SlotCache.prefetch(unlock_first=...)``), the
        current stream ordered after the event recorded at each one's release; the queue emptied."""
        taken = []
        while self._deferred_unlocks.queue:
            done, batch = self._deferred_unlocks.queue.popleft()
            if done is not None:
                streams.current_stream(self.device).wait_event(done)
            taken.append(batch)
        return taken

    def _prefetch_unlocking_deferred(self, global_rows: torch.Tensor):
        """``cache.prefetch(global_rows)``, which first unlocks the batches released since the last
        prefetch (in its graph). If it refuses, they stay queued for the next one."""
        taken = self._take_deferred_unlocks()
        try:
            return self.cache.prefetch(global_rows, unlock_first=[batch.cache_batch for batch in taken])
        except Exception:
            self._deferred_unlocks.queue.extendleft((None, batch) for batch in reversed(taken)
                                                    if self.cache.holds(batch.cache_batch))
            raise

    @property
    def uses_lookahead(self) -> bool:
        return self.cache is not None and policy_named(self.cache.policy).reads_window

    def hint_upcoming(self, upcoming_rows: list[torch.Tensor]) -> None:
        """Tell a lookahead cache the global rows of the batches that follow the next prefetch.

        ``upcoming_rows[d - 1]`` (int64, e.g. from :meth:`rows_for_hint`; repeats allowed, rows
        outside the cached tables ignored) are the rows of the batch ``d`` places after the next
        one, for ``d`` up to ``MAX_LOOKAHEAD`` (64, ``tiered_tbe.cache.MAX_LOOKAHEAD``; more raise
        ``ValueError``): that batch will be prefetched at cache step ``cache.step + 1 + d``, and
        the cache holds hints for the 64 steps after the next one. When a victim is chosen, each
        cached row's next use is the first of these batches naming it; the policy evicts the row
        needed latest first.

        Incremental: a batch whose step the cache has recorded already (passed before a previous
        prefetch) is skipped, so passing the whole window before every prefetch costs one pass
        over the rows of the batch that entered it (``SlotCache.add_upcoming``).
        """
        if len(upcoming_rows) > MAX_LOOKAHEAD:
            raise ValueError(f"hint_upcoming: {len(upcoming_rows)} batches, at most MAX_LOOKAHEAD = {MAX_LOOKAHEAD} "
                             "after the next prefetch (the cache holds hints for that many steps)")
        if self.cache is None:
            return
        recorded = set(self.cache.upcoming_steps)
        for distance, rows in enumerate(upcoming_rows, 1):
            step = self.cache.step + 1 + distance
            if step not in recorded:
                self.cache.add_upcoming(rows, step)

    def cancel_prefetched(self) -> None:
        """Drop every batch prefetched but not yet forwarded, releasing its cache locks, and run
        every deferred unlock (the cache then holds no lock of a batch gone through forward).

        Call it when prefetched batches will not be forwarded (a loop left early, an evaluation
        that replaces them): their slots stay locked until then, and ``load_state_dict`` refuses
        while they are queued. A :class:`~tiered_tbe.PrefetchPipeline` calls it when it closes.
        """
        while self._prefetched:
            self._prefetched.popleft()[2].release()
        self.run_deferred_unlocks()
        # Batches still in flight (forwarded, no backward yet) unlock at their release from now on.
        self._deferred_unlocks.open = False
        self._deferred_unlocks = DeferredUnlocks()

    def drop_prefetched(self, indices: torch.Tensor, offsets: torch.Tensor) -> bool:
        """Drop the batch prefetched next if it is this one (:func:`~tiered_tbe.batch.same_batch`),
        releasing its cache locks, for a caller that will not forward it; returns whether it was queued."""
        if not self._prefetched or not same_batch(self._prefetched[0][0], self._prefetched[0][1], indices, offsets):
            return False
        self._prefetched.popleft()[2].release()
        return True

    def _take_prefetched(self, indices, offsets) -> PreparedBatch | None:
        """The batch prefetched next, if it is this one (the same tensors); None if this batch
        was not prefetched at all (e.g. a held-out batch evaluated inside a pipelined loop): the
        forward then prefetches it itself, serially, on the current stream, beside the batches in
        flight, which keep their locks (the cache orders its metadata across streams)."""
        if not self._prefetched:
            return None
        queued_indices, queued_offsets, batch = self._prefetched[0]
        if not same_batch(queued_indices, queued_offsets, indices, offsets):
            later = [same_batch(i, o, indices, offsets) for i, o, _ in self._prefetched]
            if not any(later):
                return None
            skipped = self._prefetched_for_a_forward_stream(later.index(True))
            if skipped is None:
                raise ValueError(
                    "forward got a batch prefetched after the one prefetched next: call forward with the "
                    "prefetched indices/offsets tensors in the order they were prefetched (cancel_prefetched() "
                    "drops every prefetched batch)"
                )
            for stale in skipped:  # a pipeline left them (TorchRec's, stopped early): never forwarded
                stale.release()
            queued_indices, queued_offsets, batch = self._prefetched[0]
        self._prefetched.popleft()
        if batch.ready is not None:  # prefetched on another stream (PrefetchPipeline)
            training_stream = streams.current_stream(self.device)
            training_stream.wait_event(batch.ready)
            for tensor in batch.tensors():
                tensor.record_stream(training_stream)
        if batch.value_check is not None:
            try:
                batch.value_check.raise_if_bad()
            except ValueError:
                batch.release()
                raise
        return batch

    def _prefetched_for_a_forward_stream(self, count: int) -> list[PreparedBatch] | None:
        """The ``count`` oldest prefetched batches, taken off the queue, if every one was prefetched for a
        forward on another stream (TorchRec's prefetch pipeline, which forwards each batch it prefetched
        in order, unless it was stopped early); else None and the queue stays as it was."""
        if not all(self._prefetched[k][2].for_forward_stream for k in range(count)):
            return None
        return [self._prefetched.popleft()[2] for _ in range(count)]
