"""AheadControl (tiered_tbe/ahead.py): the batches a fitted PrefetchPipeline holds ahead. One fewer when a
prefetch made at the current depth left more than NO_ROOM of its unique rows without a slot (never for a
deeper, stale one, never below none), one more after PROBE_STEPS steps without such a prefetch (never past
the depth), nothing read from counters that were reset. Through the pipeline: tests/test_pipeline.py."""

from __future__ import annotations

import torch

from tiered_tbe import ahead as ahead_module
from tiered_tbe.ahead import NO_ROOM, AheadControl
from tiered_tbe.cache.batch_kernels import COUNTER_NAMES


class _Counters:
    """Stands in for a SlotCache: cumulative counters, advanced by ``prefetch(unique, no_slot)``."""

    device = torch.device("cpu")

    def __init__(self):
        self.values = torch.zeros(len(COUNTER_NAMES), dtype=torch.int64)

    def prefetch(self, unique: int, no_slot: int) -> None:
        self.values[COUNTER_NAMES.index("unique_rows")] += unique
        self.values[COUNTER_NAMES.index("misses_no_slot")] += no_slot

    def copy_counters(self, target: torch.Tensor) -> None:
        target.copy_(self.values)


def _step(control: AheadControl, caches, no_slot_shares) -> int:
    """One pipeline step: the ahead count for it, then a prefetch leaving each cache's share without a slot."""
    ahead = control.update()
    for cache, share in zip(caches, no_slot_shares):
        cache.prefetch(1000, int(1000 * share))
    control.record()
    return ahead


def test_one_fewer_while_full_down_to_none_and_one_more_after_probe_steps(monkeypatch):
    monkeypatch.setattr(ahead_module, "PROBE_STEPS", 5)
    cache = _Counters()
    control = AheadControl(2, [cache])
    full = 2 * NO_ROOM
    # The first prefetch sets the baseline; each later full one, made at the current depth, lowers it.
    aheads = [_step(control, [cache], [full]) for _ in range(5)]
    assert aheads == [2, 2, 1, 0, 0]
    assert control.lowered == 2
    # Room again (the last full prefetch is seen at the first of these steps): 5 steps later one more is
    # tried, and 5 later another; never past the depth.
    aheads = [_step(control, [cache], [0.0]) for _ in range(14)]
    assert aheads == [0] * 5 + [1] * 5 + [2] * 4
    # A share at NO_ROOM is room.
    aheads = [_step(control, [cache], [NO_ROOM]) for _ in range(3)]
    assert aheads == [2, 2, 2] and control.lowered == 2


def test_a_full_prefetch_made_deeper_than_now_is_not_held_against_the_current_depth():
    cache = _Counters()
    control = AheadControl(3, [cache])
    control.record()  # the baseline
    cache.prefetch(1000, 500)
    control.record()  # full, at depth 3
    cache.prefetch(1000, 500)
    control.record()  # full, at depth 3 too, still pending when the first lowers the depth
    assert control.update() == 2 and control.lowered == 1


def test_any_cache_full_counts_and_reset_counters_are_skipped():
    roomy, full = _Counters(), _Counters()
    control = AheadControl(2, [roomy, full])
    _step(control, [roomy, full], [0.0, 0.0])
    assert _step(control, [roomy, full], [0.0, 0.5]) == 2
    assert control.update() == 1
    full.values.zero_()  # reset_stats between two copies: a negative difference says nothing
    control.record()
    assert control.update() == 1 and control.lowered == 1


def test_no_cache_records_nothing():
    control = AheadControl(4, [])
    control.record()
    assert control.update() == 4
