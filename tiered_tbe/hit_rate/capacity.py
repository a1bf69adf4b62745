"""Cache sizes and the capacity search: what a size means, and the smallest cache reaching a hit rate.

A size is a percentage of the trace's rows (``'5%'``), a fraction (``'0.05'``), rows
(``'100000'``) or bytes (``'512MiB'``); it is rounded up to whole sets by the one rounding of the
project, :func:`tiered_tbe.cache.policy.round_to_sets` (as ``CacheConfig`` rounds the module's
cache). :func:`find_smallest_cache` bisects the number of sets.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from tqdm import tqdm

from tiered_tbe.cache.policy import round_to_sets
from tiered_tbe.hit_rate.runs import Measurement, SimOptions, measure
from tiered_tbe.specs import parse_bytes
from tiered_tbe.traces import Trace

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


def cache_slots(specs: Sequence[str], num_rows: int, options: SimOptions) -> list[tuple[str, int]]:
    """``(label, slots)`` of each size, whole sets, ascending; sizes that round to the same slots run once."""
    by_slots: dict[int, str] = {}
    for spec in specs:
        by_slots.setdefault(round_to_sets(cache_rows(spec, num_rows, options.row_bytes), options.associativity), spec)
    return sorted(((label, slots) for slots, label in by_slots.items()), key=lambda size: size[1])


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
    max_sets = round_to_sets(trace.num_rows, ways) // ways  # every row fits: only first-touch misses remain
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
