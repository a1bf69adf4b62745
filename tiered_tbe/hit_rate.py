"""``tiered-tbe bench hit-rate``: how large must the slot cache be, and what does it move?

Runs a lookup trace (:mod:`tiered_tbe.traces`) through the exact CPU simulator of the slot
cache (:class:`tiered_tbe.cache.simulator.CacheSimulator`) for every policy and cache size asked for
(LRU, LFU, and lookahead told the rows of the next ``--lookahead-window`` batches; a
comma-separated list of windows gives one ``lookahead(W)`` policy per window),
beside two bounds (:mod:`tiered_tbe.cache.bounds`): fully associative LRU (no set conflicts)
and offline Belady (knows the whole future). Prints a table; writes CSV, JSON and a PNG plot
on request; ``--target-hit-rate`` finds the smallest cache reaching a hit rate, per policy;
``--record`` appends the table to ``benchmarks/HIT_RATES.md``.

Steady state of a prefetch pipeline:

- ``--pipeline-depth D`` (default 0, serial training): the rows of the ``D`` batches prefetched
  before the one being prefetched stay locked, as :class:`~tiered_tbe.PrefetchPipeline` with
  ``depth=D`` holds them until their backward (the simulator's ``pipeline_depth``), for LRU, LFU
  and lookahead alike. The bounds ignore it (they lock only the batch being prefetched).
- ``--warmup N`` (default 0): the first ``N`` batches run but are not counted: every counter
  (hit rates, rows moved and bytes per batch) is over the batches after them, for every policy
  and both bounds. The policies count the two parts in one run of the simulator; a bound runs
  over the whole trace and over its first ``N`` batches and the counts are subtracted, which is
  exact: fully associative LRU after ``N`` batches does not depend on the batches after them,
  and Belady's prefix run is given the next uses of the whole trace, so it makes the same
  choices as the whole run over those batches.
- ``--full-window``: the trace gets ``max(--lookahead-window)`` more batches (zipf, drift,
  criteo; a file's last batches instead) that no policy or bound runs, only lookahead's window
  and Belady's next uses see. It changes Belady's traffic (without a future, Belady reads the
  rows it will "never" use again in place instead of caching them, so its rows moved over the
  last batches are too low), hardly the policies' counters: lookahead evicts rows unused in its
  window first, then the row needed latest, so a shrunk window changes which rows not needed
  before the trace's end go first, not how many rows miss, move or are written back; which
  needed rows stay can differ only where the lowest way breaks a tie between rows of the same
  next and last use (Criteo at Zipf 1.05, W=64: 1 lookup hit of 34M, every other counter equal).

``--real-cache`` also drives the real cache, :class:`tiered_tbe.cache.SlotCache` (its Numba
kernels: on the GPU, or in the Numba CUDA simulator on a CPU, where only small traces finish),
over the same trace for every set-associative policy and size, as training does (per
batch: lookahead's ``add_upcoming`` of the batch that enters the window of the next
``--lookahead-window`` batches, at most ``MAX_LOOKAHEAD`` = 64; ``prefetch``;
then the batch prefetched ``--pipeline-depth`` batches earlier: ``mark_dirty`` when training,
``unlock``), prints both, and exits with status 1 if any counter
differs from the simulator's.

Columns of the table:

- ``hit% lookup``: lookups whose row was cached when their batch was prefetched;
  ``hit% unique``: the same per unique row of a batch (what the prefetch sees).
- ``moved/batch``: rows copied into the cache plus dirty rows written back, per batch;
  ``moved/lru``: the same relative to set-associative LRU's at the same size (when LRU ran).
- ``bus/batch``: bytes over the host bus per batch: rows (and optimizer state) copied in and
  written back, plus the rows of misses that found no slot, read in place by forward and read
  and written in place by backward (training).
- ``vs belady``: lookup hit rate divided by Belady's at the same size.

Example::

    tiered-tbe bench hit-rate --trace zipf --alpha 1.05 --rows 1000000 --cache-sizes 1%,5%,20% \\
        --policies lru,lfu,lookahead,fa-lru,belady --lookahead-window 8 --target-hit-rate 0.9 \\
        --csv out.csv --plot out.png

or from Python::

    trace = zipf_trace(num_rows=1_000_000, alpha=1.05, batch_size=2048, bag_size=20, num_batches=100)
    options = SimOptions(associativity=32)
    results = sweep(trace, ["lru", "belady"], [("5%", 50_016)], options)
    print(format_results(results))
    print(find_smallest_cache(trace, "lru", 0.8, options, known=results).found.num_slots)
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import json
import math
import os
import re
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from tqdm import tqdm

from tiered_tbe.cache.bounds import belady, fully_associative_lru, next_use
from tiered_tbe.cache.simulator import CacheSimulator
from tiered_tbe.cache.stats import CacheStats
from tiered_tbe.optimizers import SGD, Adam, RowwiseAdagrad
from tiered_tbe.specs import parse_bytes
from tiered_tbe.traces import (
    CRITEO_KAGGLE_TABLE_ROWS,
    FILE_FORMATS,
    Trace,
    criteo_trace,
    drifting_zipf_trace,
    load_trace,
    zipf_trace,
)

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}
OPTIMIZERS = {"sgd": SGD(), "rowwise-adagrad": RowwiseAdagrad(), "adam": Adam()}


@dataclass(frozen=True)
class SimOptions:
    """What every policy run shares besides the trace and the cache size."""

    associativity: int = 32  # ways per set (the bounds ignore it, except to round sizes to whole sets)
    weight_bytes: int = 512  # bytes of one row's weights: embedding_dim * dtype size (128 fp32)
    row_bytes: int = 516  # bytes a slot holds per row: weights plus fp32 optimizer state (row-wise Adagrad)
    training: bool = True  # rows are updated, so evicted rows are written back
    lfu_decay_interval: int = 64  # LFU halves every use count every this many batches
    lookahead_window: int = 8  # lookahead knows the rows of this many batches after the one prefetched
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


# --------------------------------------------------------------------------------------------
# Policies and bounds. Each is ``run(trace, num_slots, options) -> CacheStats``.
# --------------------------------------------------------------------------------------------

PolicyRun = Callable[[Trace, int, SimOptions], CacheStats]


@dataclass(frozen=True)
class Policy:
    name: str
    run: PolicyRun
    is_bound: bool
    description: str


def _minus(total: CacheStats, before: CacheStats) -> CacheStats:
    """The counters of the batches between two snapshots of cumulative counters."""
    return CacheStats(**{name: value - getattr(before, name) for name, value in vars(total).items()})


def _simulated(policy: str, **policy_kwargs) -> PolicyRun:
    """A policy of the slot cache, through the exact set-associative simulator, with
    ``options.pipeline_depth`` batches in flight; ``lookahead`` gets ``options.lookahead_window``,
    the others ignore it. The ``options.warmup_batches`` first batches run uncounted (one
    simulator, two runs: the counters before and after them); the last ``options.future_batches``
    are only the future that the window sees."""

    def run(trace: Trace, num_slots: int, options: SimOptions) -> CacheStats:
        options.check(trace)
        simulator = CacheSimulator(
            num_slots, options.associativity, policy=policy, lfu_decay_interval=options.lfu_decay_interval,
            training=options.training, row_bytes=options.row_bytes, lookahead_window=options.lookahead_window,
            pipeline_depth=options.pipeline_depth, **policy_kwargs,
        )
        rows, offsets = trace.rows, trace.batch_offsets
        warmup, batches = options.warmup_batches, options.batches_run(trace)
        before = CacheStats()
        if warmup:
            before = simulator.run(rows, offsets, warmup).stats  # the whole trace: the window sees past it
            start = int(offsets[warmup])
            rows, offsets = rows[start:], offsets[warmup:] - start
        return _minus(simulator.run(rows, offsets, batches - warmup).stats, before)

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
    return _minus(total, count(rows[: offsets[warmup]], offsets[: warmup + 1], int(offsets[warmup])))


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


# One line per policy; `_simulated("name", **kwargs)` passes further keyword arguments to `simulate`.
POLICIES: dict[str, Policy] = {policy.name: policy for policy in (
    Policy("lru", _simulated("lru"), False, "set-associative LRU (exact simulator)"),
    Policy("lfu", _simulated("lfu"), False, "set-associative LFU, counts halved every --lfu-decay-interval"),
    Policy("lookahead", _simulated("lookahead"), False,
           "set-associative lookahead: evicts rows unused in the next --lookahead-window batches first "
           "(least recent first), then the row needed latest"),
    Policy("fa-lru", _fully_associative_lru, True, "reference: fully associative LRU (no set conflicts)"),
    Policy("belady", _belady, True, "bound: offline Belady MIN (knows the whole future)"),
)}

# ``lookahead(W)``: lookahead with a window of W batches (one per value of --lookahead-window).
_WINDOWED = re.compile(r"^lookahead\((\d+)\)$")


def base_policy(name: str) -> str:
    """``'lookahead'`` for ``'lookahead(32)'``; any other name as it is."""
    return "lookahead" if _WINDOWED.match(name) else name


def resolve_policy(name: str, options: SimOptions) -> tuple[Policy, SimOptions]:
    """The :class:`Policy` a name means, and the options it runs with: ``lookahead(W)`` is
    lookahead with ``lookahead_window=W``; any other name is a key of :data:`POLICIES`."""
    match = _WINDOWED.match(name)
    if match:
        return POLICIES["lookahead"], replace(options, lookahead_window=int(match[1]))
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)} or lookahead(W)")
    return POLICIES[name], options


def expand_policies(policies: Sequence[str], windows: Sequence[int]) -> list[str]:
    """``policies`` with ``lookahead`` replaced by ``lookahead(W)`` for every window ``W`` when
    there are several windows (one window: ``lookahead`` stays, with the window of the options)."""
    if len(windows) <= 1:
        return list(policies)
    expanded: list[str] = []
    for name in policies:
        expanded += [f"lookahead({w})" for w in windows] if name == "lookahead" else [name]
    return list(dict.fromkeys(expanded))


# --------------------------------------------------------------------------------------------
# Cache sizes.
# --------------------------------------------------------------------------------------------

_ROWS = re.compile(r"^\d+$")
_FRACTION = re.compile(r"^(\d+(\.\d*)?|\.\d+)(e-?\d+)?$", re.IGNORECASE)


def check_cache_size(text: str) -> str:
    """Accept ``'5%'``, ``'0.05'`` (fraction of rows), ``'100000'`` (rows) or ``'512MiB'`` (bytes)."""
    spec = text.strip()
    try:
        if spec.endswith("%"):
            value = float(spec[:-1])
            if not 0 < value <= 100:
                raise ValueError
        elif _ROWS.match(spec):
            if int(spec) < 1:
                raise ValueError
        elif _FRACTION.match(spec):
            if not 0 < float(spec) <= 1:
                raise ValueError
        elif parse_bytes(spec) < 1:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"cannot read cache size {text!r}: give a percentage of rows ('5%'), a fraction ('0.05'), "
            "rows ('100000') or bytes ('512MiB', '2GB')"
        ) from None
    return spec


def cache_rows(spec: str, num_rows: int, row_bytes: int) -> int:
    """Rows of cache that ``spec`` (see :func:`check_cache_size`) means for a trace of ``num_rows`` rows."""
    spec = check_cache_size(spec)
    if spec.endswith("%"):
        return max(1, round(float(spec[:-1]) / 100 * num_rows))
    if _ROWS.match(spec):
        return int(spec)
    if _FRACTION.match(spec):
        return max(1, round(float(spec) * num_rows))
    return max(1, parse_bytes(spec) // row_bytes)


def round_to_sets(rows: int, associativity: int) -> int:
    """Slots of a cache of at least ``rows`` rows: whole sets, at least one (as ``CacheConfig``)."""
    return max(1, -(-rows // associativity)) * associativity


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
    lru_rows_moved: float | None = None  # rows moved per batch by set-associative LRU at the same size, when run

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
        """Rows moved per batch relative to LRU's at the same size (None: LRU not run, or moved none)."""
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
            lookahead_window=self.options.lookahead_window if base_policy(self.policy) == "lookahead" else None,
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
    """Rows copied into the cache plus dirty rows written back, per batch."""
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
    with tqdm(total=len(policies) * len(sizes), desc="simulating", unit="run", disable=_no_bar(progress),
              file=sys.stderr) as bar:
        for label, num_slots in sizes:
            for policy in policies:
                bar.set_postfix_str(f"{policy} @ {label}")
                results.append(measure(trace, policy, num_slots, options, label))
                bar.update()
    _attach_belady(results)
    return results


def _no_bar(progress: bool | None) -> bool | None:
    return None if progress is None else not progress  # tqdm: disable=None hides the bar off a terminal


def _attach_belady(results: Sequence[Measurement]) -> None:
    """Fill ``belady_hit_rate`` and ``lru_rows_moved`` from the Belady and LRU runs of the same size."""
    best = {m.num_slots: m.hit_rate for m in results if m.policy == "belady"}
    lru = {m.num_slots: m.rows_moved_per_batch for m in results if m.policy == "lru"}
    for m in results:
        m.belady_hit_rate = best.get(m.num_slots)
        m.lru_rows_moved = lru.get(m.num_slots)


@dataclass
class TargetResult:
    """Smallest cache of one policy whose hit rate reaches ``target`` (``found`` is None if none does)."""

    policy: str
    target: float
    metric: str  # "lookup" or "unique"
    found: Measurement | None
    best: Measurement  # the largest cache tried (all rows) when unreachable, else ``found``
    evaluations: list[Measurement] = field(default_factory=list)  # runs made by the search

    def as_row(self) -> dict:
        m = self.found
        return dict(
            policy=self.policy, target=self.target, metric=self.metric, reached=m is not None,
            cache_rows=m.num_slots if m else None, cache_fraction=m.cache_fraction if m else None,
            cache_bytes=m.cache_bytes if m else None, hit_rate=m.metric(self.metric) if m else None,
            best_hit_rate=self.best.metric(self.metric), searched_runs=len(self.evaluations),
        )


def find_smallest_cache(
    trace: Trace,
    policy: str,
    target: float,
    options: SimOptions,
    metric: str = "lookup",
    known: Sequence[Measurement] = (),
    tolerance: float = 0.01,
    bar: tqdm | None = None,
) -> TargetResult:
    """Smallest cache (whole sets) of ``policy`` whose hit rate by ``metric`` reaches ``target``.

    Bisects the number of sets geometrically, starting from the bracket that the ``known``
    measurements of this policy give (the sweep), until the answer is within ``tolerance``
    (relative) of the largest size known to fall short, or within one set. Hit rates grow with
    the cache size (exactly so for the bounds, very nearly for set-associative policies), so
    the answer is the smallest size found that reaches the target.
    """
    ways = options.associativity
    max_sets = -(-trace.num_rows // ways)  # every row fits: only first-touch misses remain
    rate_of: dict[int, Measurement] = {m.num_slots // ways: m for m in known
                                       if m.policy == policy and m.num_slots % ways == 0}
    evaluations: list[Measurement] = []

    def evaluate(sets: int) -> Measurement:
        if sets not in rate_of:
            if bar is not None:
                bar.set_postfix_str(f"{policy} @ {sets * ways:,} rows")
            rate_of[sets] = measure(trace, policy, sets * ways, options, "search")
            evaluations.append(rate_of[sets])
            if bar is not None:
                bar.update()
        return rate_of[sets]

    reaching = [s for s, m in rate_of.items() if m.metric(metric) >= target]
    high = min(reaching) if reaching else max_sets
    if evaluate(high).metric(metric) < target:
        return TargetResult(policy, target, metric, None, rate_of[high], evaluations)
    falling_short = [s for s, m in rate_of.items() if s < high and m.metric(metric) < target]
    low = max(falling_short) if falling_short else 0  # 0 sets: hit rate 0, never evaluated
    while high - low > 1 and (low == 0 or high > low * (1 + tolerance)):
        middle = int(round(math.sqrt(max(low, 1) * high))) if low else high // 2
        middle = min(max(middle, low + 1), high - 1)
        if evaluate(middle).metric(metric) >= target:
            high = middle
        else:
            low = middle
    return TargetResult(policy, target, metric, rate_of[high], rate_of[high], evaluations)


# --------------------------------------------------------------------------------------------
# The real cache: SlotCache over the same trace.
# --------------------------------------------------------------------------------------------

REAL_CACHE_POLICIES = ("lru", "lfu", "lookahead")  # the bounds have no real cache
# In the Numba CUDA simulator the cache moves a few thousand lookups a second: small traces only.
REAL_CACHE_SIMULATION_MAX_LOOKUPS = 200_000


def check_real_cache_trace(trace: Trace) -> None:
    """``ValueError`` when ``--real-cache`` would take too long: a large trace in CPU simulation."""
    from tiered_tbe.base.mode import SIMULATION

    if SIMULATION and trace.num_lookups > REAL_CACHE_SIMULATION_MAX_LOOKUPS:
        raise ValueError(
            f"--real-cache without a GPU runs SlotCache's kernels in the Numba CUDA simulator (a few thousand "
            f"lookups per second): give a trace of at most {REAL_CACHE_SIMULATION_MAX_LOOKUPS:,} lookups "
            f"(this one has {trace.num_lookups:,}; use fewer --batches or a smaller --batch-size), or run on a GPU")


def check_real_cache_windows(policies: Sequence[str], options: SimOptions) -> None:
    """``ValueError`` when a lookahead window of ``policies`` is longer than the real cache's hints
    reach (``MAX_LOOKAHEAD`` batches after the one prefetched); the simulator has no such limit."""
    from tiered_tbe.cache import MAX_LOOKAHEAD

    windows = sorted({resolve_policy(name, options)[1].lookahead_window for name in policies
                      if base_policy(name) == "lookahead"})
    if windows and windows[-1] > MAX_LOOKAHEAD:
        raise ValueError(f"--real-cache: lookahead window {windows[-1]} is longer than the real cache's hints "
                         f"reach (MAX_LOOKAHEAD = {MAX_LOOKAHEAD} batches after the one prefetched)")


@contextlib.contextmanager
def _one_simulated_thread():
    """One CUDA-simulator thread per cache-kernel launch (each is a Python thread); the kernels are
    grid-stride loops, so the result is the same with any count. No effect on a GPU."""
    from tiered_tbe.cache import launch

    threads = launch.SIMULATED_THREADS
    launch.SIMULATED_THREADS = 1
    try:
        yield
    finally:
        launch.SIMULATED_THREADS = threads


def run_slot_cache(trace: Trace, policy: str, num_slots: int, options: SimOptions) -> CacheStats:
    """Drive a real :class:`~tiered_tbe.cache.SlotCache` of ``num_slots`` slots over ``trace`` as training
    with a prefetch pipeline of depth ``options.pipeline_depth`` does (0: serial), and return its
    counters (comparable to ``POLICIES[policy].run``'s, counter for counter).

    Per batch ``j`` (of the batches run, ``options.batches_run(trace)``): (lookahead) ``add_upcoming``
    of each batch of ``j+1 .. j+W`` not told yet (``W = options.lookahead_window``, at most
    ``MAX_LOOKAHEAD``; up to the end of the trace, its future batches included), at the step of its
    batch's prefetch, as :class:`~tiered_tbe.PrefetchPipeline` does; ``prefetch``; then batch
    ``j - depth`` finishes:
    ``mark_dirty`` when training, ``unlock``. The counters of the ``options.warmup_batches`` first
    batches are subtracted.

    The cached table has one fp32 column per row: which rows hit depends on the policy, not on
    the row width, and a narrow row keeps the copies cheap. ``bytes_in`` / ``bytes_out`` are
    rescaled to ``options.row_bytes`` per row.
    """
    import torch

    from tiered_tbe.base.mode import default_device
    from tiered_tbe.cache import CachedTable, SlotCache

    _, options = resolve_policy(policy, options)
    policy = base_policy(policy)
    if policy not in REAL_CACHE_POLICIES:
        raise ValueError(f"no real cache for {policy!r}: only {', '.join(REAL_CACHE_POLICIES)}")
    options.check(trace)
    check_real_cache_windows([policy], options)
    device = default_device()
    weights = torch.zeros(trace.num_rows, 1, dtype=torch.float32, device=device)
    cache = SlotCache([CachedTable(0, trace.num_rows, 1, weights)], num_slots, options.associativity, policy=policy,
                      lfu_decay_interval=options.lfu_decay_interval, device=device)
    rows = torch.from_numpy(trace.rows).to(device)
    offsets = trace.batch_offsets.tolist()
    known_batches = trace.num_batches  # the window sees the future batches too
    window = options.lookahead_window if policy == "lookahead" else 0
    in_flight: list[torch.Tensor] = []  # slot_of_index of the batches prefetched and not finished
    next_to_hint = 1  # the first batch not yet told to the cache (add_upcoming)
    before = CacheStats()
    with _one_simulated_thread():
        for j in range(options.batches_run(trace)):
            if j == options.warmup_batches and j:
                before = cache.stats()
            if window:  # each batch once, as it enters the window j+1 .. j+W, at the step of its prefetch
                for k in range(next_to_hint, min(j + window, known_batches - 1) + 1):
                    cache.add_upcoming(rows[offsets[k]:offsets[k + 1]], cache.step + 1 + (k - j))
                next_to_hint = max(next_to_hint, j + window + 1)
            in_flight.append(cache.prefetch(rows[offsets[j]:offsets[j + 1]]))
            if len(in_flight) > options.pipeline_depth:  # the batch prefetched depth steps ago finishes
                slot_of_index = in_flight.pop(0)
                if options.training:
                    cache.mark_dirty(slot_of_index)
                cache.unlock(slot_of_index)
    stats = _minus(cache.stats(), before)
    stats.bytes_in = stats.bytes_in // 4 * options.row_bytes  # 4 bytes per row in this cache
    stats.bytes_out = stats.bytes_out // 4 * options.row_bytes
    return stats


def run_real_cache(trace: Trace, results: Sequence[Measurement], options: SimOptions,
                   progress: bool | None = None) -> list[Measurement]:
    """Set ``real_stats`` of every set-associative measurement in ``results``; return those."""
    chosen = [m for m in results if base_policy(m.policy) in REAL_CACHE_POLICIES]
    with tqdm(total=len(chosen), desc="real cache", unit="run", disable=_no_bar(progress), file=sys.stderr) as bar:
        for m in chosen:
            bar.set_postfix_str(f"{m.policy} @ {m.size_label}")
            m.real_stats = run_slot_cache(trace, m.policy, m.num_slots, options)
            bar.update()
    return chosen


def real_cache_device() -> str:
    from tiered_tbe.base.mode import SIMULATION

    if SIMULATION:
        return "the Numba CUDA simulator (CPU)"
    import torch

    return torch.cuda.get_device_name()


def disagreements(m: Measurement) -> str:
    """``lookup_hits 120 vs 121, ...``: the counters where the real cache differs (simulator first)."""
    if m.real_stats is None or m.real_cache_agrees:
        return ""
    simulated, real = m.stats.as_dict(), m.real_stats.as_dict()
    return ", ".join(f"{name} {simulated[name]} vs {real[name]}" for name in simulated if simulated[name] != real[name])


REAL_CACHE_COLUMNS = ("policy", "cache", "rows", "hit% lookup sim", "hit% lookup cache", "hit% unique sim",
                      "hit% unique cache", "moved/batch sim", "moved/batch cache", "agree")


def format_real_cache(checked: Sequence[Measurement]) -> str:
    """Simulator beside real cache, one line per policy and size."""
    rows = [
        (m.policy, m.size_label, f"{m.num_slots:,}",
         f"{100 * m.stats.hit_rate_by_lookup:.2f}", f"{100 * m.real_stats.hit_rate_by_lookup:.2f}",
         f"{100 * m.stats.hit_rate_by_unique:.2f}", f"{100 * m.real_stats.hit_rate_by_unique:.2f}",
         f"{m.rows_moved_per_batch:,.1f}", f"{rows_moved_per_batch(m.real_stats):,.1f}",
         "yes" if m.real_cache_agrees else "NO")
        for m in sorted(checked, key=lambda m: m.num_slots)
    ]
    return _table(REAL_CACHE_COLUMNS, rows, left=2)


# --------------------------------------------------------------------------------------------
# Output: table, CSV, JSON, plot.
# --------------------------------------------------------------------------------------------


def format_bytes(count: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count:.0f} B"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """Aligned text table: the first ``left`` columns left-aligned, the rest right-aligned."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]

    def line(cells):
        return "  ".join(str(cell).ljust(width) if i < left else str(cell).rjust(width)
                         for i, (cell, width) in enumerate(zip(cells, widths)))

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


RESULT_COLUMNS = ("policy", "cache", "rows", "size", "hit% lookup", "hit% unique", "moved/batch", "moved/lru",
                  "bus/batch", "vs belady", "Mlookups/s")


def format_results(results: Sequence[Measurement]) -> str:
    """The terminal table: one line per policy and size, sizes ascending, policies in run order."""
    order = {policy: i for i, policy in enumerate(dict.fromkeys(m.policy for m in results))}
    ordered = sorted(results, key=lambda m: (m.num_slots, order[m.policy]))
    rows = [
        (m.policy, m.size_label, f"{m.num_slots:,}", format_bytes(m.cache_bytes),
         f"{100 * m.stats.hit_rate_by_lookup:.2f}", f"{100 * m.stats.hit_rate_by_unique:.2f}",
         f"{m.rows_moved_per_batch:,.1f}", "-" if m.rows_moved_vs_lru is None else f"{m.rows_moved_vs_lru:.3f}",
         format_bytes(m.bus_bytes_per_batch), "-" if m.ratio_to_belady is None else f"{m.ratio_to_belady:.3f}",
         f"{m.lookups_per_second / 1e6:.3g}")
        for m in ordered
    ]
    return _table(RESULT_COLUMNS, rows, left=2)


def format_targets(targets: Sequence[TargetResult], trace_rows: int) -> str:
    rows = []
    for t in targets:
        if t.found is None:
            best = f"{100 * t.best.metric(t.metric):.2f} at all {trace_rows:,} rows"
            rows.append((t.policy, "not reached", "-", "-", best, len(t.evaluations)))
        else:
            m = t.found
            rows.append((t.policy, f"{m.num_slots:,}", f"{100 * m.cache_fraction:.2f}%",
                         format_bytes(m.cache_bytes), f"{100 * m.metric(t.metric):.2f}", len(t.evaluations)))
    metric = targets[0].metric if targets else "lookup"
    return _table(("policy", "rows", "% of rows", "size", f"hit% {metric}", "runs"), rows)


def write_csv(path: str, results: Sequence[Measurement], trace: Trace) -> None:
    rows = [dict(trace=trace.description, **m.as_row()) for m in results]
    columns = list(dict.fromkeys(name for row in rows for name in row))  # real-cache columns: some rows only
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def write_json(path: str, results: Sequence[Measurement], targets: Sequence[TargetResult], trace: Trace,
               options: SimOptions) -> None:
    payload = dict(
        trace=dict(description=trace.description, lookups=trace.num_lookups, batches=trace.num_batches,
                   rows=trace.num_rows, tables=trace.num_tables, generator=trace.params),
        options=dict(associativity=options.associativity, row_bytes=options.row_bytes,
                     weight_bytes=options.weight_bytes, training=options.training,
                     lfu_decay_interval=options.lfu_decay_interval,
                     lookahead_window=options.lookahead_window,
                     lookahead_windows=sorted({m.options.lookahead_window for m in results
                                               if base_policy(m.policy) == "lookahead"}),
                     pipeline_depth=options.pipeline_depth, warmup_batches=options.warmup_batches,
                     future_batches=options.future_batches, batches_run=options.batches_run(trace),
                     bounds_ignore_pipeline_depth=True),
        results=[m.as_row() for m in results],
        targets=[t.as_row() for t in targets],
    )
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=2, default=float)


def default_results_file() -> str:
    """``benchmarks/HIT_RATES.md`` beside ``benchmarks/RESULTS.md`` of the checkout this package runs
    from (an editable install), else ``./HIT_RATES.md`` (an installed package ships no results)."""
    from tiered_tbe.benchmarks import common

    return str(common.RESULTS.with_name("HIT_RATES.md"))


@dataclass
class CountedBatches:
    """Which batches of a trace are run and counted, and the hit-rate ceiling over those counted."""

    trace_batches: int
    run: int  # batches run: all but the future ones
    warmup: int  # the first of them, not counted
    future: int  # batches after them, only lookahead's future
    lookups: int  # lookups of the counted batches
    touched: int  # rows the batches run touch
    first_touches: int  # rows first touched in a counted batch: their first lookup always misses

    @property
    def ceiling(self) -> float:
        """The largest lookup hit rate any cache can reach over the counted batches."""
        return 1 - self.first_touches / self.lookups if self.lookups else 0.0

    def describe(self) -> str:
        future = f"; the {self.future} after them only lookahead's future" if self.future else ""
        return (f"batches {self.warmup}..{self.run - 1} ({self.run - self.warmup} of the {self.run} run, after "
                f"{self.warmup} of warm-up{future}): {self.lookups:,} lookups, {self.first_touches:,} rows first "
                f"touched in them, so at most {100 * self.ceiling:.2f}% of their lookups can hit")


def counted_batches(trace: Trace, options: SimOptions) -> CountedBatches:
    options.check(trace)
    run, warmup = options.batches_run(trace), options.warmup_batches
    start, end = int(trace.batch_offsets[warmup]), int(trace.batch_offsets[run])
    seen = np.zeros(trace.num_rows, dtype=np.bool_)
    seen[trace.rows[:start]] = True
    before = int(seen.sum())
    seen[trace.rows[start:end]] = True
    touched = int(seen.sum())
    return CountedBatches(trace.num_batches, run, warmup, options.future_batches, end - start, touched,
                          touched - before)


def describe_run(options: SimOptions, policies: Sequence[str], always_window: bool = False) -> str:
    """``training, pipeline depth 2 (the bounds ignore it), lookahead window 8 batches``."""
    text = "training" if options.training else "inference"
    if options.pipeline_depth:
        text += f", pipeline depth {options.pipeline_depth} (the bounds ignore it: they lock only the batch prefetched)"
    windows = [resolve_policy(name, options)[1].lookahead_window for name in policies
               if base_policy(name) == "lookahead"]
    if len(windows) > 1:
        text += f", lookahead windows {', '.join(map(str, windows))} batches"
    elif windows or always_window:
        text += f", lookahead window {windows[0] if windows else options.lookahead_window} batches"
    return text


def record_lines(results: Sequence[Measurement], trace: Trace, options: SimOptions, command: str,
                 counted: int | CountedBatches) -> list[str]:
    """A markdown section: the trace, date, machine, commit, the command, and the table.

    ``counted``: :func:`counted_batches` (or, as before warm-ups, the number of rows the trace touches)."""
    from tiered_tbe.benchmarks.common import git_commit

    if isinstance(counted, int):
        counted = CountedBatches(trace.num_batches, trace.num_batches, 0, 0, trace.num_lookups, counted, counted)
    machine = "CPU simulator (exact)"
    if any(m.real_stats is not None for m in results):
        machine += f"; real SlotCache in {real_cache_device()}"
    policies = list(dict.fromkeys(m.policy for m in results))
    lines = [
        f"## {trace.description}",
        "",
        f"{datetime.date.today().isoformat()}, {machine}, commit {git_commit()}",
        "",
        f"`{command}`",
        "",
    ]
    if counted.warmup or counted.future:
        lines += [
            f"{trace.num_lookups:,} lookups in {trace.num_batches:,} batches over {trace.num_rows:,} rows "
            f"({counted.touched:,} touched by the batches run). Counted: {counted.describe()}; "
            f"{options.associativity}-way sets, {options.row_bytes} B per row, "
            f"{describe_run(options, policies, always_window=True)}, LFU halving every "
            f"{options.lfu_decay_interval} batches.",
            "",
        ]
    else:
        lines += [
            f"{trace.num_lookups:,} lookups in {trace.num_batches:,} batches over {trace.num_rows:,} rows "
            f"({counted.touched:,} touched: first touches always miss, so at most {100 * counted.ceiling:.2f}% of "
            f"lookups can hit); {options.associativity}-way sets, {options.row_bytes} B per row, "
            f"{describe_run(options, policies, always_window=True)}, LFU halving every "
            f"{options.lfu_decay_interval} batches.",
            "",
        ]
    header = ["policy", "cache", "rows", "hit % (lookups)", "hit % (unique rows)", "rows moved / batch",
              "bus / batch", "vs Belady"]
    with_lru = any(m.rows_moved_vs_lru is not None and m.policy != "lru" for m in results)
    if with_lru:
        header += ["rows moved / LRU's"]
    real = any(m.real_stats is not None for m in results)
    if real:
        header += ["real cache hit % (lookups)", "real = simulator"]
    lines += ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(header) - 2)) + "|"]
    order = {policy: i for i, policy in enumerate(policies)}
    for m in sorted(results, key=lambda m: (m.num_slots, order[m.policy])):
        cells = [m.policy, m.size_label, f"{m.num_slots:,}", f"{100 * m.stats.hit_rate_by_lookup:.2f}",
                 f"{100 * m.stats.hit_rate_by_unique:.2f}", f"{m.rows_moved_per_batch:,.0f}",
                 format_bytes(m.bus_bytes_per_batch), "-" if m.ratio_to_belady is None else f"{m.ratio_to_belady:.3f}"]
        if with_lru:
            cells += ["-" if m.rows_moved_vs_lru is None else f"{m.rows_moved_vs_lru:.3f}"]
        if real:
            cells += (["-", "-"] if m.real_stats is None else
                      [f"{100 * m.real_stats.hit_rate_by_lookup:.2f}", "yes" if m.real_cache_agrees else "NO"])
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def append_record(path: str, lines: Sequence[str]) -> None:
    """Append ``lines`` as a section of ``path``; a new file gets a title first."""
    header = "" if os.path.exists(path) else "# Cache hit rates\n"
    with open(path, "a") as handle:
        handle.write(header + "\n" + "\n".join(lines) + "\n")


def plot(path: str, results: Sequence[Measurement], trace: Trace,
         targets: Sequence[TargetResult] = (), options: SimOptions | None = None) -> None:
    """PNG: hit rate by lookup (left) and rows moved per batch (right) against cache size, one line
    per policy (bounds dashed), the smallest caches reaching a target as stars.

    Draws on a bare Figure with the Agg canvas: no display needed, pyplot's global backend untouched.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 4.8), layout="constrained")
    FigureCanvasAgg(figure)
    hit_axes, moved_axes = figure.subplots(1, 2)
    color_of = {}
    for policy in dict.fromkeys(m.policy for m in results):
        points = sorted((m for m in results if m.policy == policy), key=lambda m: m.num_slots)
        x = [100 * m.cache_fraction for m in points]
        style = dict(linestyle="--" if points[0].is_bound else "-", marker="o", label=policy)
        (line,) = hit_axes.plot(x, [100 * m.hit_rate for m in points], **style)
        moved_axes.plot(x, [m.rows_moved_per_batch for m in points], color=line.get_color(), **style)
        color_of[policy] = line.get_color()
    if targets:
        hit_axes.axhline(100 * targets[0].target, color="gray", linewidth=0.8, linestyle=":",
                         label=f"target {100 * targets[0].target:g}% ({targets[0].metric})")
        for target in targets:
            if target.found is not None and target.metric == "lookup":
                hit_axes.plot([100 * target.found.cache_fraction], [100 * target.found.hit_rate], marker="*",
                              markersize=12, color=color_of.get(target.policy, "black"), linestyle="none")
    ticks = sorted({100 * m.cache_fraction for m in results})
    for axes, ylabel in ((hit_axes, "hit rate by lookup (%)"),
                         (moved_axes, "rows moved per batch (copied in + written back)")):
        axes.set_xscale("log")
        axes.set_xticks(ticks, [f"{t:.3g}%" for t in ticks])
        axes.minorticks_off()
        axes.set_xlabel("cache size (% of rows)")
        axes.set_ylabel(ylabel)
        axes.grid(True, alpha=0.3)
        axes.legend()
    title = trace.description
    if options is not None and (options.pipeline_depth or options.warmup_batches or options.future_batches):
        title += (f"\npipeline depth {options.pipeline_depth} (not the bounds), counted after "
                  f"{options.warmup_batches} warm-up batches"
                  + (f", last {options.future_batches} batches only lookahead's future" if options.future_batches
                     else ""))
    figure.suptitle(title, fontsize=10)
    figure.savefig(path, dpi=110)


# --------------------------------------------------------------------------------------------
# Command line: build_parser adds the flags to a (sub)parser, run executes parsed arguments.
# --------------------------------------------------------------------------------------------


def _checked(convert: Callable[[str], object], valid: Callable, expected: str) -> Callable[[str], object]:
    """An argparse ``type``: ``convert`` the text and check it is ``valid``, or say what was expected."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not valid(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


def _split(convert: Callable[[str], object]) -> Callable[[str], list]:
    return lambda text: [convert(part) for part in text.split(",")]


def _rate(text: str) -> float:
    return float(text[:-1]) / 100 if text.endswith("%") else float(text)


def _policy_list(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in POLICIES and not _WINDOWED.match(name)]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown policy {', '.join(unknown) or '(none)'}; choose from "
                                         f"{', '.join(POLICIES)}")
    return list(dict.fromkeys(names))


def _windows(text: str) -> list[int]:
    """``--lookahead-window``: one window or comma-separated windows, each >= 1 (repeats dropped)."""
    parts = [part.strip() for part in text.split(",")]
    try:
        windows = [int(part) for part in parts]
    except ValueError:
        windows = []
    if not windows or any(w < 1 for w in windows):
        raise argparse.ArgumentTypeError(f"expected a window >= 1 (batches), or comma-separated windows such as "
                                         f"8,16,32, got {text!r}")
    return list(dict.fromkeys(windows))


def lookahead_windows(args: argparse.Namespace) -> list[int]:
    """The windows of ``--lookahead-window`` (the default is a bare int)."""
    value = args.lookahead_window
    return [value] if isinstance(value, int) else list(value)


def policies_from_args(args: argparse.Namespace) -> list[str]:
    """``--policies``, with ``lookahead`` as ``lookahead(W)`` per window when several are given."""
    return expand_policies(args.policies, lookahead_windows(args))


def _cache_sizes(text: str) -> list[str]:
    try:
        return [check_cache_size(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


_positive_int = _checked(int, lambda v: v >= 1, "a whole number >= 1")
_non_negative_int = _checked(int, lambda v: v >= 0, "a whole number >= 0")
_seed = _checked(int, lambda v: v >= 0, "a whole number >= 0")
_alphas = _checked(_split(float), lambda values: all(0 < v < math.inf for v in values),
                   "an alpha > 0, or comma-separated alphas")
_table_rows = _checked(_split(int), lambda values: all(v >= 1 for v in values),
                       "comma-separated rows per table, each >= 1")
_target = _checked(_rate, lambda v: 0 < v <= 1, "a hit rate in (0, 1] such as 0.95 or 95%")
_tolerance = _checked(float, lambda v: 0 < v < 1, "a fraction in (0, 1) such as 0.01")


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add the flags of ``bench hit-rate`` to ``parser`` (a new one if None) and return it."""
    parser = parser or argparse.ArgumentParser(prog="tiered-tbe bench hit-rate")
    parser.description = ("Cache hit rate of the slot cache's policies (exact CPU simulator) against fully\n"
                          "associative LRU and offline Belady, over synthetic or recorded lookup traces.")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = FILE_FORMATS + "\nPolicies:\n" + "\n".join(f"  {p.name:<8} {p.description}"
                                                             for p in POLICIES.values())

    trace = parser.add_argument_group("trace")
    trace.add_argument("--trace", choices=("zipf", "drift", "criteo", "file"), default="zipf",
                       help="zipf: one table, Zipf(alpha) lookups; drift: Zipf whose hot rows change over "
                            "time; criteo: the 26 Criteo Kaggle tables; file: --file (default: zipf)")
    trace.add_argument("--alpha", type=_alphas,
                       help="Zipf exponent, > 0 (1.0 is Zipf, not uniform); criteo: one value or 26 "
                            "(default 1.05)")
    trace.add_argument("--rows", type=_positive_int,
                       help="rows of the table, zipf and drift (default 1000000)")
    trace.add_argument("--batch-size", type=_positive_int,
                       help="bags per table per batch (default 2048; file: from the file if it says)")
    trace.add_argument("--bag-size", type=_positive_int,
                       help="lookups per bag (default 20 for zipf and drift, 1 for criteo and text files)")
    trace.add_argument("--batches", type=_positive_int, help="batches to generate (default 250)")
    trace.add_argument("--seed", type=_seed, default=0, help="seed of the generators (default 0)")
    trace.add_argument("--drift-period", type=_positive_int,
                       help="drift: batches for the popularity to move fully to a new ranking (default 100)")
    trace.add_argument("--row-cap", type=_positive_int, help="criteo: at most this many rows per table")
    trace.add_argument("--file", help="file: the trace (.pt, .npy, .npz or text; see below)")
    trace.add_argument("--table-rows", type=_table_rows,
                       help="file: comma-separated rows per table when the file's indices are table-local")

    cache = parser.add_argument_group("cache")
    cache.add_argument("--policies", type=_policy_list, default=list(POLICIES),
                       help=f"comma-separated, any of {', '.join(POLICIES)} (default: all)")
    cache.add_argument("--cache-sizes", type=_cache_sizes, default=["1%", "2%", "5%", "10%", "20%"],
                       help="comma-separated: percent of rows (5%%), fraction (0.05), rows (100000) or bytes "
                            "(512MiB); rounded up to whole sets (default 1%%,2%%,5%%,10%%,20%%)")
    cache.add_argument("--associativity", type=_positive_int, default=32, help="ways per set (default 32)")
    cache.add_argument("--lfu-decay-interval", type=_positive_int, default=64,
                       help="LFU halves its use counts every this many batches (default 64)")
    cache.add_argument("--lookahead-window", type=_windows, default=8,
                       help="lookahead knows the rows of this many batches after the one being "
                            "prefetched (default 8); comma-separated windows (8,16,32) run one "
                            "lookahead(W) policy per window")
    cache.add_argument("--full-window", action="store_true",
                       help="add max(--lookahead-window) batches to the trace that no policy runs, only "
                            "lookahead's window and Belady's next uses see (a file's last batches serve "
                            "instead); changes Belady's traffic near the end, the policies' counters hardly")
    cache.add_argument("--pipeline-depth", type=_non_negative_int, default=0,
                       help="batches prefetched ahead of the one training, whose rows stay locked, as "
                            "PrefetchPipeline(depth=D) holds them (default 0: serial training); the bounds "
                            "ignore it")
    cache.add_argument("--warmup", type=_non_negative_int, default=0,
                       help="the first this many batches run but are not counted: every figure is over the "
                            "batches after them, a cache in steady state (default 0)")
    cache.add_argument("--dim", type=_positive_int, default=128,
                       help="embedding dim, for bytes (default 128)")
    cache.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default="fp32",
                       help="weights dtype (default fp32)")
    cache.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="rowwise-adagrad",
                       help="its per-row fp32 state travels with the row (default rowwise-adagrad)")
    cache.add_argument("--inference", action="store_true", help="no updates: nothing is written back")
    cache.add_argument("--real-cache", action="store_true",
                       help="also run the real SlotCache (its Numba kernels; in the CUDA simulator without a GPU: "
                            f"traces of at most {REAL_CACHE_SIMULATION_MAX_LOOKUPS:,} lookups) for lru, lfu and "
                            "lookahead, print both, exit 1 if they disagree")

    target = parser.add_argument_group("capacity")
    target.add_argument("--target-hit-rate", type=_target,
                        help="find the smallest cache reaching this hit rate (0.95 or 95%%), per policy")
    target.add_argument("--target-metric", choices=("lookup", "unique"), default="lookup",
                        help="hit rate the target refers to (default lookup)")
    target.add_argument("--target-tolerance", type=_tolerance, default=0.01,
                        help="stop the search when the answer is within this relative distance "
                             "(default 0.01)")

    output = parser.add_argument_group("output")
    output.add_argument("--csv", help="write every measurement to this CSV file")
    output.add_argument("--json", help="write trace, options, measurements and targets to this JSON file")
    output.add_argument("--plot", help="write a PNG plot of hit rate and rows moved against cache size")
    output.add_argument("--record", action="store_true",
                        help="append the table (with date, machine, commit and command) to --results-file")
    output.add_argument("--results-file",
                        help="where --record appends (default: benchmarks/HIT_RATES.md of a checkout, "
                             "else ./HIT_RATES.md)")
    output.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


# Flags that only some trace kinds take (None when not given), and the kinds that take them.
_TRACE_FLAGS = {
    "alpha": ("zipf", "drift", "criteo"), "rows": ("zipf", "drift"), "batches": ("zipf", "drift", "criteo"),
    "drift_period": ("drift",), "row_cap": ("criteo",), "file": ("file",), "table_rows": ("file",),
}


def trace_from_args(args: argparse.Namespace) -> Trace:
    """The trace the flags describe; ``ValueError`` for flags that do not fit the trace kind."""
    kind = args.trace
    for name, kinds in _TRACE_FLAGS.items():
        if kind not in kinds and getattr(args, name) is not None:
            hint = " (use --row-cap)" if (name, kind) == ("rows", "criteo") else ""
            raise ValueError(f"--{name.replace('_', '-')} does not apply to --trace {kind}{hint}")
    alphas = args.alpha or [1.05]
    batches = (args.batches or 250) + future_batches(args)  # a file's own last batches are its future
    batch_size = args.batch_size or 2048
    if kind in ("zipf", "drift") and len(alphas) != 1:
        raise ValueError(f"--trace {kind} takes one --alpha, got {len(alphas)}")
    if kind == "zipf":
        return zipf_trace(args.rows or 1_000_000, alphas[0], batch_size, args.bag_size or 20, batches,
                          seed=args.seed)
    if kind == "drift":
        return drifting_zipf_trace(args.rows or 1_000_000, alphas[0], batch_size, args.bag_size or 20,
                                   batches, drift_period=args.drift_period or 100, seed=args.seed)
    if kind == "criteo":
        if len(alphas) not in (1, len(CRITEO_KAGGLE_TABLE_ROWS)):
            raise ValueError(f"--trace criteo takes one --alpha or {len(CRITEO_KAGGLE_TABLE_ROWS)}, "
                             f"got {len(alphas)}")
        return criteo_trace(alphas[0] if len(alphas) == 1 else alphas, batch_size, batches,
                            bag_size=args.bag_size or 1, row_cap=args.row_cap, seed=args.seed)
    if args.file is None:
        raise ValueError("--trace file needs --file PATH")
    # For a file, --batch-size only cuts lookups that the file does not cut into batches itself.
    return load_trace(args.file, batch_size=args.batch_size, bag_size=args.bag_size or 1,
                      table_rows=args.table_rows)


def options_from_args(args: argparse.Namespace) -> SimOptions:
    weight_bytes = args.dim * DTYPE_BYTES[args.dtype]
    row_bytes = weight_bytes + 4 * OPTIMIZERS[args.optimizer].state_width(args.dim)
    return SimOptions(associativity=args.associativity, weight_bytes=weight_bytes, row_bytes=row_bytes,
                      training=not args.inference, lfu_decay_interval=args.lfu_decay_interval,
                      lookahead_window=lookahead_windows(args)[0],
                      pipeline_depth=getattr(args, "pipeline_depth", 0), warmup_batches=getattr(args, "warmup", 0),
                      future_batches=future_batches(args))


def future_batches(args: argparse.Namespace) -> int:
    """Batches at the end of the trace that only lookahead's window sees (``--full-window``)."""
    uses_window = any(base_policy(name) == "lookahead" for name in args.policies)
    if not getattr(args, "full_window", False) or not uses_window:
        return 0
    windows = lookahead_windows(args) + [int(_WINDOWED.match(n)[1]) for n in args.policies if _WINDOWED.match(n)]
    return max(windows)


def _check_outputs(args: argparse.Namespace) -> None:
    for flag in ("csv", "json", "plot", "results_file"):
        path = getattr(args, flag)
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise ValueError(f"--{flag.replace('_', '-')} {path}: the folder does not exist")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib: pip install 'tiered-tbe[plot]'") from None


def run(args: argparse.Namespace, out=None) -> int:
    """Execute ``bench hit-rate`` for parsed ``args``; print to ``out`` (stdout). Returns 0.

    Raises ``ValueError`` for arguments that do not fit together (the CLI prints it as a usage error).
    """
    out = out or sys.stdout
    _check_outputs(args)  # before minutes of simulation, not after
    options = options_from_args(args)
    progress = False if args.no_progress else None

    start = time.perf_counter()
    if progress is None and sys.stderr.isatty():  # a large trace takes seconds to build
        print("building the trace ...", file=sys.stderr, flush=True)
    trace = trace_from_args(args)
    options.check(trace)
    policies = policies_from_args(args)
    if args.real_cache:
        check_real_cache_trace(trace)
        check_real_cache_windows(policies, options)
    counted = counted_batches(trace, options)
    print(f"trace: {trace.description}\n"
          f"       {trace.num_lookups:,} lookups, {trace.num_rows:,} rows ({counted.touched:,} touched), "
          f"built in {time.perf_counter() - start:.1f} s", file=out)
    print(f"cache: {options.associativity}-way sets, {options.row_bytes} B per row "
          f"({args.dim} x {args.dtype} + {args.optimizer} state), {describe_run(options, policies)}", file=out)
    if options.warmup_batches or options.future_batches:
        print(f"counted: {counted.describe()}", file=out)

    by_slots: dict[int, str] = {}  # sizes that round to the same slot count run once
    for spec in args.cache_sizes:
        by_slots.setdefault(round_to_sets(cache_rows(spec, trace.num_rows, options.row_bytes),
                                          options.associativity), spec)
    sizes = sorted(((label, slots) for slots, label in by_slots.items()), key=lambda size: size[1])
    results = sweep(trace, policies, sizes, options, progress=progress)
    print("\n" + format_results(results), file=out)
    no_slot = [f"{m.policy} @ {m.size_label} {100 * m.stats.misses_no_slot / m.stats.unique_misses:.0f}%"
               for m in results if m.policy != "belady" and m.stats.misses_no_slot]
    if no_slot:  # a cache smaller than a batch's rows (or the batches in flight): the rest bypasses it
        lockers = "their own batch" + (f" and the {options.pipeline_depth} before it (the bounds: their own only)"
                                       if options.pipeline_depth else "")
        print(f"misses that found every way of their set locked by {lockers}, read in place: "
              + ", ".join(no_slot), file=out)

    mismatches: list[Measurement] = []
    if args.real_cache:
        checked = run_real_cache(trace, results, options, progress=progress)
        if checked:
            print(f"\nthe same trace through the real cache (SlotCache in {real_cache_device()}) beside the "
                  f"simulator:\n" + format_real_cache(checked), file=out)
        mismatches = [m for m in checked if not m.real_cache_agrees]
        if checked and not mismatches:
            print(f"real cache and simulator agree on every counter ({len(checked)} runs)", file=out)
        if not checked:
            print(f"--real-cache: no policy with a real cache among --policies ({', '.join(REAL_CACHE_POLICIES)} "
                  "have one; the bounds do not)", file=out)

    targets: list[TargetResult] = []
    if args.target_hit_rate is not None:
        with tqdm(desc=f"searching for {100 * args.target_hit_rate:g}% hits", unit="run",
                  disable=_no_bar(progress), file=sys.stderr) as bar:
            for policy in policies:
                targets.append(find_smallest_cache(trace, policy, args.target_hit_rate, options,
                                                   metric=args.target_metric, known=results,
                                                   tolerance=args.target_tolerance, bar=bar))
        print(f"\nsmallest cache reaching {100 * args.target_hit_rate:g}% hits by {args.target_metric} "
              f"(within {100 * args.target_tolerance:g}% or one set):", file=out)
        print(format_targets(targets, trace.num_rows), file=out)

    for path, write in ((args.csv, lambda p: write_csv(p, results, trace)),
                        (args.json, lambda p: write_json(p, results, targets, trace, options)),
                        (args.plot, lambda p: plot(p, results, trace, targets, options))):
        if path:
            write(path)
            print(f"wrote {path}", file=out)
    if args.record:
        path = args.results_file or default_results_file()
        command = getattr(args, "command_line", None) or "tiered_tbe.hit_rate.run(...) from Python"
        append_record(path, record_lines(results, trace, options, command, counted))
        print(f"appended to {path}", file=out)
    if mismatches:
        warning = "\n".join(f"  {m.policy} @ {m.size_label} ({m.num_slots:,} slots): {disagreements(m)}"
                             for m in mismatches)
        message = (f"WARNING: the real cache (SlotCache) and the exact simulator DISAGREE in {len(mismatches)} "
                   f"run(s) (counter: simulator vs real cache):\n{warning}")
        print("\n" + message, file=out)
        if out is not sys.stderr:
            print(message, file=sys.stderr)
        return 1
    return 0
