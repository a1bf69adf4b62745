"""A StepTimer that reads step times from a table instead of a clock (tests/test_ahead.py, tests/test_pipeline.py)."""

from __future__ import annotations

from tiered_tbe.ahead import StepTimer


class FakeStepTimer(StepTimer):
    """Steps that take ``cost[ahead]`` ms at the depth ``control.ahead`` they start at (set ``control``
    to the AheadControl before the first mark), landing ``lag`` steps after they start."""

    def __init__(self, cost: dict[int, float], lag: int = 1):
        super().__init__()
        self.cost, self.lag, self.control = cost, lag, None
        self.started: list[tuple[object, int]] = []
        self.reported = 0

    def mark(self, tag):
        self.started.append((tag, self.control.ahead))

    def landed(self):
        # The step before the newest mark has ended; with a lag, the last `lag - 1` of those are still in flight.
        done = max(len(self.started) - self.lag, 0)
        timed = [(tag, self.cost[ahead]) for tag, ahead in self.started[self.reported:done]]
        self.reported = max(self.reported, done)
        return timed
