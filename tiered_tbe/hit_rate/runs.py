"""Policy runs and bounds: every policy of the cache through the exact simulator, and two bounds.

Each entry of :data:`POLICIES` is ``run(trace, num_slots, options) -> CacheStats``: the cache's
policies (the registry :data:`tiered_tbe.cache.policy.POLICIES`, set-associative, through
:class:`~tiered_tbe.cache.simulator.CacheSimulator`), fully associative LRU (no set conflicts)
and offline Belady (knows the whole future). A policy that reads the lookahead window runs
with ``options.lookahead_window``, or with ``W`` under the name ``lookahead(W)``.
:func:`measure` runs one at one size, :func:`sweep` all of them at every size.
"""

from __future__ import annotations

import math
import re
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
from tqdm import tqdm

from tiered_tbe.cache.bounds import belady, fully_associative_lru, next_use
from tiered_tbe.cache.hints import DEFAULT_LOOKAHEAD
from tiered_tbe.cache.policy import POLICIES as CACHE_POLICIES
from tiered_tbe.cache.simulator import CacheSimulator
from tiered_tbe.cache.stats import CacheStats
from tiered_tbe.traces import Trace

BASELINE = "lru"  # rows moved are also reported relative to this policy's, at the same size
OPTIMUM = "belady"  # hit rates are also reported relative to this bound's


@dataclass(frozen=True)
class SimOptions:
    """What every policy run shares besides the trace and the cache size."""

    associativity: int = 32  # ways per set (the bounds ignore it, except to round sizes to whole sets)
    weight_bytes: int = 512  # bytes of one row's weights: embedding_dim * dtype size (128 fp32)
    row_bytes: int = 516  # bytes a slot holds per row: weights plus fp32 optimizer state (row-wise Adagrad)
    training: bool = True  # rows are updated, so evicted rows are written back
    lfu_decay_interval: int = 64  # LFU halves every use count every this many batches
    lookahead_window: int = DEFAULT_LOOKAHEAD  # lookahead knows the rows of this many batches after the one
    # prefetched; by default the window PrefetchPipeline gives a lookahead cache, so a study models training
    pipeline_depth: int = 0  # batches in flight (locked) before the one prefetched; 0: serial (bounds ignore it)
    warmup_batches: int = 0  # the first batches run but are not counted
    future_batches: int = 0  # the last batches of the trace are not run: only lookahead's (and Belady's) future

    def __post_init__(self):
        for name in ("lookahead_window", "pipeline_depth", "warmup_batches", "future_batches"):
            value = getattr(self, name)
            if int(value) != value or value < 0:
                raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")

    def batches_run(self, trace: Trace) -> int:
        """Batches of ``trace`` that are run (warm-up included): all but the ``future_batches``."""
        return trace.num_batches - self.future_batches

    def check(self, trace: Trace) -> None:
        """``ValueError`` unless at least one batch of ``trace`` is counted after the warm-up."""
        run = self.batches_run(trace)
        future = f" (of {trace.num_batches}, less {self.future_batches} of lookahead's future)" \
            if self.future_batches else ""
        if run < 1:
            raise ValueError(f"the trace has {trace.num_batches} batches, no more than the {self.future_batches} "
                             "kept as lookahead's future (--full-window): give more --batches")
        if self.warmup_batches >= run:
            raise ValueError(f"--warmup {self.warmup_batches} must be less than the batches run, {run}{future}: "
                             "at least one batch must be counted")


PolicyRun = Callable[[Trace, int, SimOptions], CacheStats]


@dataclass(frozen=True)
class Policy:
    name: str
    run: PolicyRun
    is_bound: bool
    description: str
    reads_window: bool = False  # told the rows of the next options.lookahead_window batches


def difference(total: CacheStats, before: CacheStats) -> CacheStats:
    """The counters of the batches between two snapshots of cumulative counters (``total`` later)."""
    return CacheStats(**{name: value - getattr(before, name) for name, value in vars(total).items()})


def _simulated(policy: str) -> PolicyRun:
    """A policy of the slot cache, through the exact set-associative simulator, with
    ``options.pipeline_depth`` batches in flight and, if it reads the window,
    ``options.lookahead_window``. The ``options.warmup_batches`` first batches run uncounted (one
    simulator, two runs: the counters before and after them); the last ``options.future_batches``
    are only the future that the window sees."""

    def run(trace: Trace, num_slots: int, options: SimOptions) -> CacheStats:
        options.check(trace)
        simulator = CacheSimulator(
            num_slots, options.associativity, policy=policy, lfu_decay_interval=options.lfu_decay_interval,
            training=options.training, row_bytes=options.row_bytes, lookahead_window=options.lookahead_window,
            pipeline_depth=options.pipeline_depth,
        )
        rows, offsets = trace.rows, trace.batch_offsets
        warmup, batches = options.warmup_batches, options.batches_run(trace)
        before = CacheStats()
        if warmup:
            before = simulator.run(rows, offsets, warmup).stats  # the whole trace: the window sees past it
            start = int(offsets[warmup])
            rows, offsets = rows[start:], offsets[warmup:] - start
        return difference(simulator.run(rows, offsets, batches - warmup).stats, before)

    return run


def _bound(trace: Trace, options: SimOptions, count: Callable[[np.ndarray, np.ndarray, int], CacheStats]) -> CacheStats:
    """A bound's counters over the batches after the warm-up: ``count(rows, batch_offsets, end)``
    over the batches run, minus the same over the warm-up batches (``end``: lookups counted)."""
    options.check(trace)
    rows, offsets = trace.rows, trace.batch_offsets
    batches, warmup = options.batches_run(trace), options.warmup_batches
    total = count(rows[: offsets[batches]], offsets[: batches + 1], int(offsets[batches]))
    if not warmup:
        return total
    return difference(total, count(rows[: offsets[warmup]], offsets[: warmup + 1], int(offsets[warmup])))


def _fully_associative_lru(trace: Trace, num_slots: int, options: SimOptions) -> CacheStats:
    # Online: its state after the warm-up depends only on the warm-up batches, so the
    # difference of the two runs is exactly its count over the batches after them.
    return _bound(trace, options, lambda rows, offsets, _: fully_associative_lru(
        rows, offsets, num_slots, training=options.training, row_bytes=options.row_bytes, num_rows=trace.num_rows))


# Belady's next-use table depends only on the trace: computed once, dropped with the trace.
_NEXT_USES: weakref.WeakKeyDictionary[Trace, np.ndarray] = weakref.WeakKeyDictionary()


def _belady(trace: Trace, num_slots: int, options: SimOptions) -> CacheStats:
    if trace not in _NEXT_USES:
        _NEXT_USES[trace] = next_use(trace.rows, trace.batch_offsets, trace.num_rows)
    next_uses = _NEXT_USES[trace]  # over the whole trace, future batches included
    # Each run, the warm-up's too, is told the next uses in the whole trace, so over the warm-up
    # batches it makes the choices of the whole run: the difference is exactly the batches after.
    return _bound(trace, options, lambda rows, offsets, end: belady(
        rows, offsets, num_slots, training=options.training, row_bytes=options.row_bytes, num_rows=trace.num_rows,
        next_uses=next_uses[:end]))


# Every policy of the cache (read from its registry), then the two bounds.
POLICIES: dict[str, Policy] = {
    **{name: Policy(name, _simulated(name), False, f"set-associative, {p.summary} (exact simulator)",
                    reads_window=p.reads_window) for name, p in CACHE_POLICIES.items()},
    "fa-lru": Policy("fa-lru", _fully_associative_lru, True, "reference: fully associative LRU (no set conflicts)"),
    OPTIMUM: Policy(OPTIMUM, _belady, True, "bound: offline Belady MIN (knows the whole future)"),
}

# ``lookahead(W)``: a policy that reads the window, with a window of W batches (one per value of
# --lookahead-window).
_WINDOWED = re.compile(r"^([a-z_-]+)\((\d+)\)$")


def _windowed(name: str) -> tuple[str, int] | None:
    """``('lookahead', 32)`` for ``'lookahead(32)'`` (a policy that reads the window); else None."""
    match = _WINDOWED.match(name)
    if match and match[1] in POLICIES and POLICIES[match[1]].reads_window:
        return match[1], int(match[2])
    return None


def is_policy_name(name: str) -> bool:
    """A key of :data:`POLICIES`, or ``P(W)`` for a policy ``P`` that reads the window."""
    return name in POLICIES or _windowed(name) is not None


def base_policy(name: str) -> str:
    """``'lookahead'`` for ``'lookahead(32)'``; any other name as it is."""
    windowed = _windowed(name)
    return windowed[0] if windowed else name


def reads_window(name: str) -> bool:
    """Whether the policy ``name`` (``lookahead(W)`` included) ranks by the lookahead window."""
    return base_policy(name) in POLICIES and POLICIES[base_policy(name)].reads_window


def resolve_policy(name: str, options: SimOptions) -> tuple[Policy, SimOptions]:
    """The :class:`Policy` a name means, and the options it runs with: ``lookahead(W)`` is
    lookahead with ``lookahead_window=W``; any other name is a key of :data:`POLICIES`."""
    windowed = _windowed(name)
    if windowed:
        return POLICIES[windowed[0]], replace(options, lookahead_window=windowed[1])
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)} or lookahead(W)")
    return POLICIES[name], options


def expand_policies(policies: Sequence[str], windows: Sequence[int]) -> list[str]:
    """``policies`` with each policy that reads the window replaced by ``P(W)`` for every window
    ``W`` when there are several windows (one window: the name stays, with the window of the options)."""
    if len(windows) <= 1:
        return list(policies)
    expanded: list[str] = []
    for name in policies:
        expanded += [f"{name}({w})" for w in windows] if name in POLICIES and POLICIES[name].reads_window else [name]
    return list(dict.fromkeys(expanded))


# --------------------------------------------------------------------------------------------
# Measurements.
# --------------------------------------------------------------------------------------------


@dataclass
class Measurement:
    """One policy at one cache size over one trace."""

    policy: str
    is_bound: bool
    size_label: str  # as asked for ("5%", "100000", "512MiB"), or "search" for target-search points
    num_slots: int
    trace_rows: int
    options: SimOptions
    stats: CacheStats
    seconds: float
    belady_hit_rate: float | None = None  # Belady's lookup hit rate at the same size, when measured
    real_stats: CacheStats | None = None  # the same run through the real SlotCache (--real-cache)
    lookups_run: int | None = None  # lookups simulated in ``seconds``, warm-up included (None: stats.lookups)
    lru_rows_moved: float | None = None  # rows moved per batch by the BASELINE policy at the same size, when run

    @property
    def cache_fraction(self) -> float:
        return self.num_slots / self.trace_rows

    @property
    def cache_bytes(self) -> int:
        return self.num_slots * self.options.row_bytes

    @property
    def hit_rate(self) -> float:
        return self.stats.hit_rate_by_lookup

    def metric(self, name: str) -> float:
        return self.stats.hit_rate_by_lookup if name == "lookup" else self.stats.hit_rate_by_unique

    @property
    def rows_moved_per_batch(self) -> float:
        return rows_moved_per_batch(self.stats)

    @property
    def real_cache_agrees(self) -> bool | None:
        """Whether the real cache counted exactly what the simulator did (None: not run)."""
        return None if self.real_stats is None else self.real_stats == self.stats

    @property
    def bus_bytes_per_batch(self) -> float:
        in_place = self.options.weight_bytes + (2 * self.options.row_bytes if self.options.training else 0)
        total = self.stats.bytes_in + self.stats.bytes_out + self.stats.misses_no_slot * in_place
        return total / max(1, self.stats.batches)

    @property
    def lookups_per_second(self) -> float:
        lookups = self.stats.lookups if self.lookups_run is None else self.lookups_run
        return lookups / self.seconds if self.seconds > 0 else math.inf

    @property
    def rows_moved_vs_lru(self) -> float | None:
        """Rows moved per batch relative to the BASELINE's at the same size (None: not run, or moved none)."""
        if not self.lru_rows_moved:
            return None
        return self.rows_moved_per_batch / self.lru_rows_moved

    @property
    def ratio_to_belady(self) -> float | None:
        if self.belady_hit_rate is None or self.belady_hit_rate == 0:
            return None
        return self.hit_rate / self.belady_hit_rate

    def as_row(self) -> dict:
        """Flat dict for CSV / JSON: sizes, derived rates, then every CacheStats counter."""
        row = dict(
            policy=self.policy, is_bound=self.is_bound, cache_size=self.size_label,
            cache_rows=self.num_slots, cache_fraction=self.cache_fraction, cache_bytes=self.cache_bytes,
            associativity=self.options.associativity, hit_rate_by_lookup=self.stats.hit_rate_by_lookup,
            hit_rate_by_unique=self.stats.hit_rate_by_unique, rows_moved_per_batch=self.rows_moved_per_batch,
            bus_bytes_per_batch=self.bus_bytes_per_batch, ratio_to_belady=self.ratio_to_belady,
            rows_moved_vs_lru=self.rows_moved_vs_lru,
            seconds=self.seconds, lookups_per_second=self.lookups_per_second,
            lookahead_window=self.options.lookahead_window if reads_window(self.policy) else None,
            pipeline_depth=None if self.is_bound else self.options.pipeline_depth,
            warmup_batches=self.options.warmup_batches,
        )
        row.update({f"stats_{k}": v for k, v in self.stats.as_dict().items()
                    if k not in ("hit_rate_by_lookup", "hit_rate_by_unique")})
        if self.real_stats is not None:
            row.update(real_cache_agrees=self.real_cache_agrees,
                       real_cache_hit_rate_by_lookup=self.real_stats.hit_rate_by_lookup,
                       real_cache_hit_rate_by_unique=self.real_stats.hit_rate_by_unique,
                       real_cache_rows_moved_per_batch=rows_moved_per_batch(self.real_stats))
            row.update({f"real_cache_stats_{k}": v for k, v in self.real_stats.as_dict().items()
                        if k not in ("hit_rate_by_lookup", "hit_rate_by_unique")})
        return row


def rows_moved_per_batch(stats: CacheStats) -> float:
    """Rows copied into the cache plus dirty rows written back, per batch (rows read or written in
    place, ``misses_no_slot``, are not moved: they count in the bus bytes)."""
    return (stats.rows_copied_in + stats.write_backs) / max(1, stats.batches)


def measure(trace: Trace, policy: str, num_slots: int, options: SimOptions, size_label: str) -> Measurement:
    """Run ``policy`` (a key of :data:`POLICIES`, or ``lookahead(W)``) with ``num_slots`` slots over
    ``trace``; its counters are those of the batches after ``options.warmup_batches``."""
    entry, options = resolve_policy(policy, options)
    start = time.perf_counter()
    stats = entry.run(trace, num_slots, options)
    seconds = time.perf_counter() - start
    return Measurement(policy, entry.is_bound, size_label, num_slots, trace.num_rows, options, stats, seconds,
                       lookups_run=int(trace.batch_offsets[options.batches_run(trace)]))


def sweep(
    trace: Trace,
    policies: Sequence[str],
    sizes: Sequence[tuple[str, int]],
    options: SimOptions,
    progress: bool | None = None,
) -> list[Measurement]:
    """Every policy at every ``(label, num_slots)`` size; fills ``belady_hit_rate`` where Belady ran.

    ``progress``: tqdm bar on stderr (None: only on a terminal).
    """
    results: list[Measurement] = []
    with tqdm(total=len(policies) * len(sizes), desc="simulating", unit="run", disable=no_bar(progress),
              file=sys.stderr) as bar:
        for label, num_slots in sizes:
            for policy in policies:
                bar.set_postfix_str(f"{policy} @ {label}")
                results.append(measure(trace, policy, num_slots, options, label))
                bar.update()
    _attach_references(results)
    return results


def no_bar(progress: bool | None) -> bool | None:
    """tqdm's ``disable`` for ``progress`` (None: a bar only on a terminal)."""
    return None if progress is None else not progress


def _attach_references(results: Sequence[Measurement]) -> None:
    """Fill ``belady_hit_rate`` and ``lru_rows_moved`` from the OPTIMUM and BASELINE runs of the same size."""
    best = {m.num_slots: m.hit_rate for m in results if m.policy == OPTIMUM}
    baseline = {m.num_slots: m.rows_moved_per_batch for m in results if m.policy == BASELINE}
    for m in results:
        m.belady_hit_rate = best.get(m.num_slots)
        m.lru_rows_moved = baseline.get(m.num_slots)
