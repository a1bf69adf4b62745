"""Reports of a hit-rate study: the terminal tables, CSV, JSON and the ``--record`` lines.

Records and JSON go through :mod:`tiered_tbe.records`, the reporting path the GPU benchmarks
share: every record carries its date, machine, commit and command. The plot is
:mod:`tiered_tbe.hit_rate.plot`.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tiered_tbe import records
from tiered_tbe.hit_rate.capacity import TargetResult
from tiered_tbe.hit_rate.real_cache import real_cache_device
from tiered_tbe.hit_rate.runs import (
    Measurement,
    SimOptions,
    reads_window,
    resolve_policy,
    rows_moved_per_batch,
)
from tiered_tbe.traces import Trace


def format_bytes(count: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count:.0f} B"


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """Aligned text table: the first ``left`` columns left-aligned, the rest right-aligned."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]

    def line(cells):
        return "  ".join(str(cell).ljust(width) if i < left else str(cell).rjust(width)
                         for i, (cell, width) in enumerate(zip(cells, widths)))

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _in_run_order(results: Sequence[Measurement]) -> list[Measurement]:
    """Sizes ascending, policies in the order they ran."""
    order = {policy: i for i, policy in enumerate(dict.fromkeys(m.policy for m in results))}
    return sorted(results, key=lambda m: (m.num_slots, order[m.policy]))


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


RESULT_COLUMNS = ("policy", "cache", "rows", "size", "hit% lookup", "hit% unique", "moved/batch", "moved/lru",
                  "bus/batch", "vs belady", "Mlookups/s")


def format_results(results: Sequence[Measurement]) -> str:
    """The terminal table: one line per policy and size, sizes ascending, policies in run order."""
    rows = [
        (m.policy, m.size_label, f"{m.num_slots:,}", format_bytes(m.cache_bytes),
         f"{100 * m.stats.hit_rate_by_lookup:.2f}", f"{100 * m.stats.hit_rate_by_unique:.2f}",
         f"{m.rows_moved_per_batch:,.1f}", _ratio(m.rows_moved_vs_lru), format_bytes(m.bus_bytes_per_batch),
         _ratio(m.ratio_to_belady), f"{m.lookups_per_second / 1e6:.3g}")
        for m in _in_run_order(results)
    ]
    return text_table(RESULT_COLUMNS, rows, left=2)


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
    return text_table(("policy", "rows", "% of rows", "size", f"hit% {metric}", "runs"), rows)


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
    return text_table(REAL_CACHE_COLUMNS, rows, left=2)


def write_csv(path: str, results: Sequence[Measurement], trace: Trace) -> None:
    rows = [dict(trace=trace.description, **m.as_row()) for m in results]
    columns = list(dict.fromkeys(name for row in rows for name in row))  # real-cache columns: some rows only
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def write_json(path: str, results: Sequence[Measurement], targets: Sequence[TargetResult], trace: Trace,
               options: SimOptions) -> None:
    """Trace, options, every measurement and target, and the context of :func:`tiered_tbe.records.context`."""
    payload = dict(
        **records.context(device="CPU simulator (exact)"),
        trace=dict(description=trace.description, lookups=trace.num_lookups, batches=trace.num_batches,
                   rows=trace.num_rows, tables=trace.num_tables, generator=trace.params),
        options=dict(associativity=options.associativity, row_bytes=options.row_bytes,
                     weight_bytes=options.weight_bytes, training=options.training,
                     lfu_decay_interval=options.lfu_decay_interval,
                     lookahead_window=options.lookahead_window,
                     lookahead_windows=sorted({m.options.lookahead_window for m in results if reads_window(m.policy)}),
                     pipeline_depth=options.pipeline_depth, warmup_batches=options.warmup_batches,
                     future_batches=options.future_batches, batches_run=options.batches_run(trace),
                     bounds_ignore_pipeline_depth=True),
        results=[m.as_row() for m in results],
        targets=[t.as_row() for t in targets],
    )
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=2, default=float)


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
    windows = [resolve_policy(name, options)[1].lookahead_window for name in policies if reads_window(name)]
    if len(windows) > 1:
        text += f", lookahead windows {', '.join(map(str, windows))} batches"
    elif windows or always_window:
        text += f", lookahead window {windows[0] if windows else options.lookahead_window} batches"
    return text


# Keys of Measurement.as_row() that say what was measured; the others are what came out.
_CONFIGURATION_KEYS = ("policy", "is_bound", "cache_size", "cache_rows", "cache_fraction", "cache_bytes",
                       "associativity", "lookahead_window", "pipeline_depth", "warmup_batches")


def measurement_records(results: Sequence[Measurement], trace: Trace, options: SimOptions, command: str,
                        counted: CountedBatches) -> list[dict]:
    """One record (:func:`tiered_tbe.records.measurement`) per policy and cache size: the trace, the
    simulator's options and the cache in ``configuration``; hit rates, rows and bytes moved per
    batch, the ratios to Belady and to LRU and every counter in ``figures``."""
    machine = "CPU simulator (exact)"
    if any(m.real_stats is not None for m in results):
        machine += f"; real SlotCache in {real_cache_device()}"
    shared = dict(trace=trace.description, trace_lookups=trace.num_lookups, trace_batches=trace.num_batches,
                  trace_rows=trace.num_rows, trace_tables=trace.num_tables, generator=trace.params,
                  row_bytes=options.row_bytes, weight_bytes=options.weight_bytes, training=options.training,
                  lfu_decay_interval=options.lfu_decay_interval, future_batches=options.future_batches,
                  counted_batches=counted.run - counted.warmup, rows_touched=counted.touched)
    found = []
    for m in _in_run_order(results):
        row = m.as_row()
        configuration = {**shared, **{key: row.pop(key) for key in _CONFIGURATION_KEYS}}
        row["hit_rate_ceiling"] = counted.ceiling
        found.append(records.measurement("hit-rate", command, configuration, row, device=machine))
    return found


def append_record(path: str | Path, results: Sequence[Measurement], trace: Trace, options: SimOptions,
                  command: str, counted: CountedBatches) -> int:
    """Append one JSON line per policy and size to ``path`` (:func:`measurement_records`); the lines written."""
    return records.append(path, measurement_records(results, trace, options, command, counted))
