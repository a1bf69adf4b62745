"""How many batches a :class:`~tiered_tbe.pipeline.PrefetchPipeline` holds ahead when it fits them to the cache.

Every batch in flight keeps its rows locked in the slot cache from its prefetch to its backward. When the
batches in flight hold more unique rows than their sets have ways, a later prefetch finds sets full of
locked rows and leaves its misses in their backing store (``CacheStats.misses_set_full``), and the forward
and the backward read and update those rows over the bus. On the H200 at Zipf 0.6 (mixed dims, ~3M unique
rows a batch, 6.4M slots) a depth-2 pipeline took 48.3 ms a step against 39.2 serial
(docs/performance.md, "Where pipelining loses").

:class:`AheadControl` fits the depth by two rules, neither of which waits for the GPU:

- **No room**: after each prefetch the caches' counters are copied to pinned memory, and an event is
  polled, never waited for. When the newest prefetch seen, made with the pipeline ``ahead`` batches
  ahead, found more than ``NO_ROOM`` of its unique rows a set with no unlocked way left
  (``misses_set_full``), the pipeline holds one batch fewer ahead at once, down to none (each batch
  prefetched after the step before it, as serial training does). Rows an admission policy keeps out
  (``lfu-admit``, ``lookahead-admit``), and the rows a batch in flight reads in place, are given no slot
  too, but they say nothing of the room: counting them (as ``misses_no_slot`` did) lowered every
  admitting pipeline to none ahead on the H200 and cost its steps 6-16% (docs/performance.md).
- **Timed** (with a :class:`StepTimer`): a depth can lose where few rows lack a slot too: rows locked by
  the batch in flight cannot be evicted, so the policy evicts worse ones and more rows move, and the
  forward and backward share the bus with the prefetch. So each depth is judged by the median of
  ``SAMPLES`` step times (between the starts of consecutive steps on the training stream, read from
  events once they have completed). After a depth is timed the one below it is tried, and kept when it
  steps faster by ``MARGIN``; otherwise the pipeline goes back and tries again ``PROBE_STEPS`` steps
  later, twice as late after each try in a row that did not pay (at most ``2**MAX_BACKOFF`` times): the
  host may run tens of steps ahead of the GPU, and a try lasts until its steps' times land.

After ``PROBE_STEPS`` steps at a depth below the pipeline's (as late as a try down, when timed) it tries
one more (kept, when timed, only if faster). What the pipeline computes does not depend on either rule:
pipelined training equals serial training bit for bit at every depth (``tiered_tbe/pipeline.py``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

import torch

from tiered_tbe.cache.counter_readings import MISSES_SET_FULL, UNIQUE_ROWS, CounterReadings
from tiered_tbe.cache.slot_cache import SlotCache

# A prefetch that leaves more than this share of its unique rows without a slot found the cache full. A
# first choice, to be measured: a few rows without a slot cost little, and serial training has some too.
NO_ROOM = 0.01
# Steps at a depth below the pipeline's before it tries one batch more (a try that finds the cache full
# costs a step or two with rows read over the bus).
PROBE_STEPS = 64
# Tries in a row that did not pay double the wait before the next, up to 2**MAX_BACKOFF * PROBE_STEPS.
MAX_BACKOFF = 4
# Step times a depth is judged by (their median), and the steps after a change of depth left untimed (their
# batches in flight were prefetched at the depth before).
SAMPLES = 6
SETTLE = 2
# A depth tried is kept when its median step is faster than the one it was tried from by this share.
MARGIN = 0.02
# Pinned counter copies in flight at most (a prefetch that finds them all in flight records nothing).
# Nothing on the training path waits for the GPU, so the host runs as many steps ahead as the launch
# queue lets it: the lookahead pipeline at Zipf 0.6 enqueued ~10 ms of host work a 41.7 ms step, and with
# 16 slots it lowered once, then probably saw no prefetch again (docs/performance.md).
_SLOTS = 256


class StepTimer:
    """Times consecutive steps without waiting: ``mark(tag)`` at each step's start, ``landed()`` the
    ``(tag, ms)`` of each step whose end (the next mark) has been reached since.

    On a CUDA ``stream`` the marks are events recorded on it (polled, never waited for); without one,
    host clock readings (the CPU runs each step to its end before the next mark).
    """

    _LIMIT = 256  # marks kept at most (a GPU far behind the host drops the oldest untimed)

    def __init__(self, stream: torch.cuda.Stream | None = None):
        self.stream = stream
        self._marks: deque[tuple[object, object]] = deque()

    def mark(self, tag: object) -> None:
        if self.stream is None:
            self._marks.append((tag, time.perf_counter()))
        else:
            event = torch.cuda.Event(enable_timing=True)
            event.record(self.stream)
            self._marks.append((tag, event))
        while len(self._marks) > self._LIMIT:
            self._marks.popleft()

    def landed(self) -> list[tuple[object, float]]:
        timed = []
        while len(self._marks) >= 2:
            (tag, start), (_, end) = self._marks[0], self._marks[1]
            if self.stream is None:
                milliseconds = 1e3 * (end - start)
            elif end.query():
                milliseconds = start.elapsed_time(end)
            else:
                break
            self._marks.popleft()
            timed.append((tag, milliseconds))
        return timed


class AheadControl:
    """The batches a pipeline of ``depth`` holds ahead, fitted to ``caches`` (one per tiered module) and,
    given a ``timer``, to the step times it reads."""

    def __init__(self, depth: int, caches: Sequence[SlotCache], timer: StepTimer | None = None):
        self.depth = depth
        self.ahead = depth
        self.caches = list(caches)
        self.timer = timer
        self._readings = CounterReadings(self.caches, _SLOTS)  # tagged with the depth of their prefetch
        self._steps_since_probe = 0  # steps since the depth last went up, or a prefetch found no room
        # Timing: a serial of the depth's changes and the steps since the last (they tag each step), the
        # step times at this depth, the depth being tried from and its median, and steps before a try down.
        self._change = 0
        self._steps_at_depth = 0
        self._samples: list[float] = []
        self._median: float | None = None  # of the last SAMPLES timed at this depth
        self._trial: tuple[int, float] | None = None
        self._hold = 0
        self._failed_tries = 0
        self.lowered = 0  # times the pipeline held one batch fewer (read by tests and benchmarks)
        self.steps_at: dict[int, int] = {}  # steps run at each depth (read by benchmarks)

    def record(self) -> None:
        """After a prefetch, on its stream: the caches' counters, copied without waiting (a prefetch whose
        reading finds every slot in flight goes unseen)."""
        self._readings.record(self.ahead)

    def update(self) -> int:
        """Before a step's prefetches: the batches to hold ahead, from the prefetches whose counters and the
        steps whose times have landed."""
        self._steps_since_probe += 1
        self._hold = max(self._hold - 1, 0)
        if self._no_room():
            self._steps_since_probe = 0
            if self.ahead > 0:
                self._set(self.ahead - 1)
        self._time_steps()
        if self.ahead < self.depth and self._steps_since_probe >= self._patience():
            self._try(self.ahead + 1)
        self.steps_at[self.ahead] = self.steps_at.get(self.ahead, 0) + 1
        if self.timer is not None:
            self.timer.mark((self._change, self._steps_at_depth))
        self._steps_at_depth += 1
        return self.ahead

    def _no_room(self) -> bool:
        """Whether a prefetch made at the current depth, whose counters have landed, found no room."""
        no_room = False
        for ahead, change in self._readings.landed():
            if change is None:
                continue  # the first reading, or stats reset between the two
            if bool((change[:, MISSES_SET_FULL] > NO_ROOM * change[:, UNIQUE_ROWS]).any()):
                self._steps_since_probe = 0
                # Made at this depth (a deeper one's is stale); one fewer per update.
                no_room |= ahead == self.ahead
        return no_room

    def _time_steps(self) -> None:
        """Judge the current depth once ``SAMPLES`` of its steps are timed: keep or undo a depth being
        tried, or try the one below."""
        if self.timer is None:
            return
        for (change, index), milliseconds in self.timer.landed():
            if change == self._change and index >= SETTLE:
                self._samples.append(milliseconds)
        if len(self._samples) < SAMPLES:
            return
        median = self._median = sorted(self._samples)[len(self._samples) // 2]
        self._samples = []  # timed afresh from here: what a try is compared with is recent
        if self._trial is not None:
            tried_from, its_median = self._trial
            self._trial = None
            if median >= (1 - MARGIN) * its_median:  # no faster: back, and no try for a while
                self._failed_tries += 1
                self._set(tried_from)
                self._hold = self._patience()
                return
            self._failed_tries = 0
            if self.ahead > tried_from:  # one more paid: the depth below was just timed slower
                self._hold = self._patience()
        if self.ahead > 0 and self._hold == 0:
            self._try(self.ahead - 1)

    def _patience(self) -> int:
        """Steps to wait before a try: longer after tries that did not pay."""
        return PROBE_STEPS << min(self._failed_tries, MAX_BACKOFF)

    def _try(self, ahead: int) -> None:
        """Move to ``ahead``, kept (when the current depth was timed) only if it steps faster."""
        current, median = self.ahead, self._median
        self._set(ahead)
        self._steps_since_probe = 0
        self._trial = (current, median) if median is not None else None

    def _set(self, ahead: int) -> None:
        if ahead < self.ahead:
            self.lowered += 1
        self.ahead = ahead
        self._change += 1
        self._steps_at_depth = 0
        self._samples = []
        self._median = None
        self._trial = None
