"""AheadControl (tiered_tbe/ahead.py): the batches a fitted PrefetchPipeline holds ahead. One fewer when a
prefetch made at the current depth found more than NO_ROOM of its unique rows a full set (never for a
deeper, stale one, never below none; never for rows an admission policy refused), one more after
PROBE_STEPS steps without such a prefetch (never past the depth), nothing read from counters that were
reset. Timed: a depth below is tried once one is timed and kept only when it steps faster; steps still in
flight or just after a change are not counted. Through the pipeline: tests/test_pipeline.py."""

from __future__ import annotations

import pytest
import torch
from fake_step_timer import FakeStepTimer

from tiered_tbe import ahead as ahead_module
from tiered_tbe.ahead import MARGIN, NO_ROOM, PROBE_STEPS, SAMPLES, SETTLE, AheadControl, StepTimer
from tiered_tbe.cache.batch_kernels import COUNTER_NAMES


class _Counters:
    """Stands in for a SlotCache: cumulative counters, advanced by ``prefetch(unique, set_full, refused)``."""

    device = torch.device("cpu")

    def __init__(self):
        self.values = torch.zeros(len(COUNTER_NAMES), dtype=torch.int64)

    def prefetch(self, unique: int, set_full: int, refused: int = 0) -> None:
        """``set_full`` rows found their set with no unlocked way; ``refused`` more were kept out by
        admission (or by a batch in flight): all of them get no slot."""
        self.values[COUNTER_NAMES.index("unique_rows")] += unique
        self.values[COUNTER_NAMES.index("misses_no_slot")] += set_full + refused
        self.values[COUNTER_NAMES.index("misses_set_full")] += set_full

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


def test_rows_refused_by_admission_are_not_a_full_cache():
    """lfu-admit and lookahead-admit leave many misses in place by choice (lfu-admit ~93K rows a batch on the
    Criteo mixed-dim shape): only rows that found their set full say the batches in flight do not fit."""
    cache = _Counters()
    control = AheadControl(2, [cache])
    control.record()  # the baseline
    for _ in range(10):
        assert control.update() == 2
        cache.prefetch(1000, set_full=0, refused=600)
        control.record()
    assert control.lowered == 0
    cache.prefetch(1000, set_full=int(2 * NO_ROOM * 1000), refused=600)
    control.record()
    assert control.update() == 1 and control.lowered == 1


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


def _timed(cost: dict[int, float], depth: int, steps: int, lag: int = 1) -> tuple[list[int], AheadControl]:
    timer = FakeStepTimer(cost, lag)
    control = AheadControl(depth, [], timer)
    timer.control = control
    return [control.update() for _ in range(steps)], control


def test_timed_depths_go_down_while_each_steps_faster_down_to_none():
    # Each depth is timed over SETTLE + SAMPLES steps (plus one: a step's time lands at the next update).
    aheads, control = _timed({2: 40.0, 1: 35.0, 0: 30.0}, depth=2, steps=60)
    per_depth = SETTLE + SAMPLES + 1
    assert aheads[:per_depth] == [2] * per_depth and aheads[per_depth:2 * per_depth] == [1] * per_depth
    assert aheads[2 * per_depth:] == [0] * (60 - 2 * per_depth)
    assert control.lowered == 2 and control.steps_at[0] == 60 - 2 * per_depth


def test_a_timed_depth_below_that_steps_no_faster_is_undone_then_tried_again_ever_later():
    no_faster = 40.0 * (1 - MARGIN / 2)  # faster by less than MARGIN: not kept
    aheads, control = _timed({2: 40.0, 1: no_faster, 0: 10.0}, depth=2, steps=10 * PROBE_STEPS)
    per_depth = SETTLE + SAMPLES + 1
    assert 0 not in aheads  # depth 0 is never reached through a depth that does not pay
    tries = [i for i in range(1, len(aheads)) if aheads[i] == 1 and aheads[i - 1] == 2]
    assert tries[0] == per_depth and len(tries) >= 3
    gaps = [later - earlier for earlier, later in zip(tries, tries[1:])]
    # Each try that did not pay doubles the wait before the next.
    assert gaps[0] >= PROBE_STEPS and all(after > 1.9 * before for before, after in zip(gaps, gaps[1:])), gaps
    runs = "".join(map(str, aheads)).split("2")
    assert all(len(run) == per_depth for run in runs[:-1] if run)  # each try lasts the steps that time it
    assert control.steps_at[2] > 2 * control.steps_at[1]


def test_timed_pipeline_goes_back_up_when_a_depth_above_steps_faster():
    # A no-room prefetch sends it to none ahead; after PROBE_STEPS one more is tried, timed and kept.
    cost = {2: 20.0, 1: 25.0, 0: 30.0}
    timer = FakeStepTimer(cost)
    cache = _Counters()
    control = AheadControl(2, [cache], timer)
    timer.control = control
    aheads = [_step(control, [cache], [2 * NO_ROOM]) for _ in range(4)]
    assert aheads[-1] == 0
    aheads = [_step(control, [cache], [0.0]) for _ in range(3 * PROBE_STEPS)]
    assert aheads[-1] == 2 and control.ahead == 2


def test_steps_in_flight_or_just_after_a_change_are_not_timed():
    # Times landing 4 steps late: a try waits for SAMPLES timed steps at its own depth, so a depth is never
    # judged by the steps of the one before.
    aheads, _ = _timed({2: 40.0, 1: 50.0, 0: 10.0}, depth=2, steps=40, lag=4)
    first_try = aheads.index(1)
    assert first_try >= SETTLE + SAMPLES + 4
    back = aheads.index(2, first_try)
    assert back - first_try >= SETTLE + SAMPLES + 4 and 0 not in aheads


def test_step_timer_on_the_host_times_consecutive_marks():
    timer = StepTimer()
    timer.mark("a")
    assert timer.landed() == []
    timer.mark("b")
    timer.mark("c")
    landed = timer.landed()
    assert [tag for tag, _ in landed] == ["a", "b"] and all(ms >= 0 for _, ms in landed)


@pytest.mark.gpu
def test_step_timer_on_a_stream_reads_events_once_they_have_completed():
    stream = torch.cuda.Stream()
    timer = StepTimer(stream)
    with torch.cuda.stream(stream):
        timer.mark("long")
        torch.cuda._sleep(50_000_000)  # ~25-50 ms of spinning on the stream
        timer.mark("short")
        timer.mark("end")
    early = timer.landed()  # the host runs ahead of the sleep: at most what has completed
    stream.synchronize()
    landed = early + timer.landed()
    assert [tag for tag, _ in landed] == ["long", "short"]
    assert landed[0][1] > 5 * landed[1][1] and landed[0][1] > 1.0
