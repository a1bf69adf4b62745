"""Bounds against the simulator and against exhaustive search; the hit-rate benchmark's pieces."""

import itertools
from dataclasses import fields

import numpy as np
import pytest

from tiered_tbe.cache.bounds import belady, fully_associative_lru, next_use
from tiered_tbe.cache.simulator import simulate
from tiered_tbe.cache.stats import CacheStats
from tiered_tbe.hit_rate import (
    POLICIES,
    Measurement,
    SimOptions,
    cache_rows,
    check_cache_size,
    find_smallest_cache,
    format_results,
    round_to_sets,
    sweep,
)
from tiered_tbe.traces import criteo_trace, drifting_zipf_trace, zipf_trace


def random_trace(rng: np.random.Generator, max_rows: int, max_lookups: int):
    """Random row ids and random batch boundaries (some batches empty, some with repeats)."""
    num_lookups = int(rng.integers(1, max_lookups))
    rows = rng.integers(0, int(rng.integers(2, max_rows)), num_lookups)
    cuts = rng.integers(0, num_lookups, int(rng.integers(0, num_lookups // 2 + 1)))
    return rows, np.unique(np.concatenate([[0, num_lookups], cuts]))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("training", [True, False])
def test_fully_associative_lru_equals_the_simulator_with_one_set(seed, training):
    """Same policy rules, two implementations: every counter agrees."""
    rng = np.random.default_rng(seed)
    for _ in range(40):
        rows, batch_offsets = random_trace(rng, max_rows=300, max_lookups=2000)
        slots = int(rng.integers(1, 64))
        expected = simulate(rows, batch_offsets, slots, slots, "lru", training=training, row_bytes=12)
        assert fully_associative_lru(rows, batch_offsets, slots, training=training, row_bytes=12) == expected


def test_next_use_matches_a_direct_search():
    rng = np.random.default_rng(0)
    rows, batch_offsets = random_trace(rng, max_rows=30, max_lookups=400)
    batch_of = np.searchsorted(batch_offsets, np.arange(rows.size), side="right") - 1
    num_batches = batch_offsets.size - 1
    for i, got in enumerate(next_use(rows, batch_offsets)):
        later = batch_of[(rows == rows[i]) & (batch_of > batch_of[i])]
        assert got == (later.min() if later.size else num_batches)


def most_unique_hits(rows, batch_offsets, capacity) -> int:
    """Exhaustive optimum: after each batch keep any subset (<= capacity) of cached and used rows."""
    best = {frozenset(): 0}
    for b in range(batch_offsets.size - 1):
        batch = set(rows[batch_offsets[b] : batch_offsets[b + 1]].tolist())
        following: dict[frozenset, int] = {}
        for cached, hits in best.items():
            hits += len(cached & batch)
            available = sorted(cached | batch)
            for keep in range(min(capacity, len(available)) + 1):
                for subset in itertools.combinations(available, keep):
                    key = frozenset(subset)
                    following[key] = max(following.get(key, -1), hits)
        best = following
    return max(best.values())


def test_belady_is_the_optimum_on_small_traces():
    rng = np.random.default_rng(0)
    for _ in range(120):
        rows, batch_offsets = random_trace(rng, max_rows=7, max_lookups=30)
        capacity = int(rng.integers(1, 4))
        optimum = most_unique_hits(rows, batch_offsets, capacity)
        assert belady(rows, batch_offsets, capacity).unique_hits == optimum


TRACES = {
    "zipf-1.05": lambda: zipf_trace(50_000, 1.05, 256, 8, 60, seed=0),
    "zipf-0.6": lambda: zipf_trace(20_000, 0.6, 256, 8, 60, seed=1),
    "drift": lambda: drifting_zipf_trace(50_000, 1.2, 256, 8, 60, drift_period=20, seed=2),
    "criteo": lambda: criteo_trace(1.1, batch_size=64, num_batches=40, row_cap=5_000, seed=3),
}


@pytest.mark.parametrize("trace_name", TRACES)
def test_belady_beats_every_policy(trace_name):
    trace = TRACES[trace_name]()
    options = SimOptions(associativity=8)
    sizes = [(f"{p}%", round_to_sets(cache_rows(f"{p}%", trace.num_rows, 1), 8)) for p in (0.2, 1, 5, 20)]
    results = sweep(trace, list(POLICIES), sizes, options, progress=False)
    for _, slots in sizes:
        at_size = {m.policy: m.stats for m in results if m.num_slots == slots}
        optimum = at_size.pop("belady")
        for policy, stats in at_size.items():
            assert optimum.unique_hits >= stats.unique_hits, (policy, slots)
            assert optimum.hit_rate_by_lookup >= stats.hit_rate_by_lookup, (policy, slots)
    # Every policy saw the same trace the same way.
    for name in ("batches", "lookups", "unique_rows"):
        assert len({getattr(m.stats, name) for m in results}) == 1, name


def test_fully_associative_lru_is_close_to_32_way_lru():
    trace = zipf_trace(200_000, 1.05, 1024, 8, 100, seed=0)
    for percent in (5, 10, 20):
        slots = round_to_sets(cache_rows(f"{percent}%", trace.num_rows, 1), 32)
        set_associative = simulate(trace.rows, trace.batch_offsets, slots, 32, "lru").hit_rate_by_lookup
        fully_associative = fully_associative_lru(trace.rows, trace.batch_offsets, slots).hit_rate_by_lookup
        assert fully_associative == pytest.approx(set_associative, abs=0.02), percent


def test_bounds_count_traffic_like_the_simulator():
    trace = zipf_trace(20_000, 1.1, 128, 4, 50, seed=0)
    for run in (fully_associative_lru, belady):
        stats = run(trace.rows, trace.batch_offsets, 640, row_bytes=100)
        assert stats.write_backs == stats.evictions > 0
        assert stats.bytes_in == 100 * stats.rows_copied_in and stats.bytes_out == 100 * stats.write_backs
        assert stats.unique_rows == stats.unique_hits + stats.unique_misses
        inference = run(trace.rows, trace.batch_offsets, 640, training=False, row_bytes=100)
        assert inference.write_backs == inference.bytes_out == 0
        assert inference.lookup_hits == stats.lookup_hits


@pytest.mark.parametrize("policy", ["fa-lru", "lru", "belady"])
def test_find_smallest_cache(policy):
    trace = zipf_trace(5_000, 1.1, 64, 4, 40, seed=0)
    options = SimOptions(associativity=4)
    target = 0.7

    def assert_smallest(result):
        """Reaches the target, and one set less does not (tolerance ~0: bisection down to one set)."""
        assert result.found.hit_rate >= target
        one_set_less = POLICIES[policy].run(trace, result.found.num_slots - 4, options)
        assert one_set_less.hit_rate_by_lookup < target

    from_scratch = find_smallest_cache(trace, policy, target, options, tolerance=1e-9)
    assert_smallest(from_scratch)
    # Starting from a sweep's bracket takes fewer runs.
    known = sweep(trace, [policy], [("a", 40), ("b", 400), ("c", 2000)], options, progress=False)
    bracketed = find_smallest_cache(trace, policy, target, options, known=known, tolerance=1e-9)
    assert_smallest(bracketed)
    assert len(bracketed.evaluations) < len(from_scratch.evaluations)
    if policy == "belady":  # the optimum only grows with the cache: the answer is unique
        assert bracketed.found.num_slots == from_scratch.found.num_slots
    # A loose tolerance stops early, within it of a size that falls short.
    loose = find_smallest_cache(trace, policy, target, options, known=known, tolerance=0.25)
    assert loose.found.hit_rate >= target and len(loose.evaluations) < len(bracketed.evaluations)
    if policy == "belady":
        assert loose.found.num_slots <= 1.25 * from_scratch.found.num_slots + 4


def test_unreachable_target_is_reported():
    trace = zipf_trace(5_000, 1.1, 64, 4, 10, seed=0)
    result = find_smallest_cache(trace, "lru", 1.0, SimOptions(associativity=4))
    assert result.found is None and result.best.hit_rate < 1.0  # first touches always miss
    assert result.as_row()["reached"] is False


def test_cache_sizes():
    assert cache_rows("5%", 1_000_000, 512) == 50_000
    assert cache_rows("0.05", 1_000_000, 512) == 50_000
    assert cache_rows("100000", 1_000_000, 512) == 100_000
    assert cache_rows("512MiB", 1_000_000, 512) == 2**20
    assert cache_rows("1GB", 1_000_000, 1000) == 10**6
    assert round_to_sets(50_000, 32) == 50_016 and round_to_sets(1, 32) == 32
    for bad in ("5x", "0", "-1%", "150%", "1.5", "MiB", ""):
        with pytest.raises(ValueError, match="cannot read cache size"):
            check_cache_size(bad)


def test_derived_columns():
    stats = CacheStats(batches=10, lookups=1000, lookup_hits=900, unique_rows=400, unique_hits=300,
                       unique_misses=100, misses_no_slot=20, evictions=50, write_backs=50,
                       bytes_in=80 * 516, bytes_out=50 * 516)
    options = SimOptions(associativity=32, weight_bytes=512, row_bytes=516, training=True)
    m = Measurement("lru", False, "1%", 64, 6400, options, stats, seconds=0.5, belady_hit_rate=0.95)
    assert m.rows_moved_per_batch == (80 + 50) / 10
    # In place, a row is read by forward (weights) and read and written by backward (with state).
    assert m.bus_bytes_per_batch == ((80 + 50) * 516 + 20 * (512 + 2 * 516)) / 10
    assert m.ratio_to_belady == pytest.approx(0.9 / 0.95)
    assert m.cache_fraction == 0.01 and m.cache_bytes == 64 * 516 and m.lookups_per_second == 2000
    row = m.as_row()
    assert {f"stats_{f.name}" for f in fields(CacheStats)} <= set(row)
    assert "vs belady" in format_results([m]) and "0.947" in format_results([m])


def test_lookahead_policy_takes_its_window_from_the_flag():
    import io

    from tiered_tbe.hit_rate import build_parser, options_from_args, run

    trace = zipf_trace(5_000, 1.1, 64, 4, 30, seed=0)
    args = build_parser().parse_args(["--lookahead-window", "3"])
    options = options_from_args(args)
    assert options.lookahead_window == 3
    assert build_parser().parse_args([]).lookahead_window == 8
    got = POLICIES["lookahead"].run(trace, 512, options)
    assert got == simulate(trace.rows, trace.batch_offsets, 512, 32, "lookahead", lookahead_window=3,
                           pipeline_depth=0, row_bytes=options.row_bytes)
    assert got != POLICIES["lru"].run(trace, 512, options)  # hinted: not LRU
    out = io.StringIO()
    args = build_parser().parse_args(["--rows", "5000", "--batch-size", "64", "--bag-size", "4", "--batches", "20",
                                      "--cache-sizes", "5%", "--policies", "lru,lookahead", "--lookahead-window",
                                      "4", "--no-progress"])
    assert run(args, out) == 0
    text = out.getvalue()
    assert "lookahead window 4 batches" in text
    assert any(line.startswith("lookahead ") for line in text.splitlines())
