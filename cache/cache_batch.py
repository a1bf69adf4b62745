"""``CacheBatch``: one prefetched batch's hold on a slot cache (what ``SlotCache.prefetch`` returns)."""

from __future__ import annotations

import torch


class CacheBatch:
    """One prefetched batch's hold on the cache: what :meth:`SlotCache.prefetch` returns.

    ``slot_of_index`` int32 [N]: the slot holding each lookup's row, or -1 (read and update
    the backing store); read it only after :meth:`SlotCache.wait_filled`. ``locked_slots``
    int32 [N]: the distinct slots the prefetch locked (one per unique row, NO_SLOT padding).
    ``bypassed_rows`` int64 [N]: the rows it gave no slot (once each, NOT_CACHED padding),
    which no prefetch caches until this batch is unlocked. ``sorted_rows`` (int32 when the
    cached rows fit, else int64) and ``order`` (int32) [N]: the prefetch's stable sort of the
    lookups by row, rows outside every cached table last (as the largest value of the dtype);
    when every table is cached it is the backward's grouping sort too. ``step``: the prefetch's cache step,
    which names the batch: :meth:`SlotCache.unlock` finds it by its step, so a copy of the
    handle (or of its tensors) releases exactly what the prefetch took, once. ``in_place_rank``
    int32 [N]: for each lookup whose row got no slot, the rank of that row among the batch's rows
    given none (0-based, ascending rows), else -1: where the module keeps a copy of the row that the
    forward read for the backward (``kernels/in_place_copies.py``).
    """

    __slots__ = ("step", "slot_of_index", "locked_slots", "bypassed_rows", "sorted_rows", "order", "ticket",
                 "in_place_rank")

    def __init__(self, step: int, slot_of_index: torch.Tensor, locked_slots: torch.Tensor,
                 bypassed_rows: torch.Tensor, sorted_rows: torch.Tensor, order: torch.Tensor, ticket=None,
                 in_place_rank: torch.Tensor | None = None):
        self.step = step
        self.slot_of_index = slot_of_index
        self.locked_slots = locked_slots
        self.bypassed_rows = bypassed_rows
        self.sorted_rows = sorted_rows
        self.order = order
        self.ticket = ticket  # the row mover's, for wait_filled
        self.in_place_rank = in_place_rank

    def __repr__(self) -> str:
        return f"CacheBatch(step={self.step}, {self.slot_of_index.numel()} lookups)"


def check_batch(batch) -> CacheBatch:
    if not isinstance(batch, CacheBatch):
        raise TypeError(f"expected the CacheBatch a prefetch returned, got {type(batch).__name__}: keep what "
                        "SlotCache.prefetch returns and pass it to wait_filled and unlock")
    return batch
