"""Bounds against the simulator and against exhaustive search; the hit-rate benchmark's pieces."""

import itertools
from dataclasses import fields, replace

import numpy as np
import pytest

from tiered_tbe.cache.bounds import belady, fully_associative_lru, next_use
from tiered_tbe.cache.hints import DEFAULT_LOOKAHEAD
from tiered_tbe.cache.policy import POLICIES as CACHE_POLICIES
from tiered_tbe.cache.policy import round_to_sets
from tiered_tbe.cache.simulator import simulate
from tiered_tbe.cache.stats import CacheStats
from tiered_tbe.hit_rate.capacity import cache_rows, check_cache_size, find_smallest_cache
from tiered_tbe.hit_rate.report import format_results
from tiered_tbe.hit_rate.runs import POLICIES, Measurement, SimOptions, expand_policies, measure, sweep
from tiered_tbe.traces import Trace, criteo_trace, drifting_zipf_trace, zipf_trace


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
            if policy in CACHE_POLICIES and CACHE_POLICIES[policy].refuses_misses:
                continue  # Belady's optimum caches every miss; a policy that refuses some may hit more
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

    from tiered_tbe.hit_rate.command import build_parser, options_from_args, run

    trace = zipf_trace(5_000, 1.1, 64, 4, 30, seed=0)
    args = build_parser().parse_args(["--lookahead-window", "3"])
    options = options_from_args(args)
    assert options.lookahead_window == 3
    # By default the window the pipeline gives a lookahead cache: a study models training.
    assert build_parser().parse_args([]).lookahead_window == DEFAULT_LOOKAHEAD == 64
    assert SimOptions().lookahead_window == DEFAULT_LOOKAHEAD
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


def test_rows_read_in_place_are_reported_a_batch_beside_the_default_copy_rows(tmp_path):
    """lfu-admit refuses most misses of a small cache: the report says how many rows a batch reads in
    place (what CacheConfig.in_place_copies should hold) and how many copy rows a module keeps by default."""
    import io
    import json
    import re

    from tiered_tbe.hit_rate.command import build_parser, run
    from tiered_tbe.specs import CacheConfig

    out = io.StringIO()
    args = build_parser().parse_args(["--rows", "5000", "--batch-size", "64", "--bag-size", "4", "--batches", "20",
                                      "--warmup", "4", "--cache-sizes", "2%", "--policies", "lfu-admit",
                                      "--no-progress", "--json", str(tmp_path / "run.json")])
    assert run(args, out) == 0
    found = re.search(r"lfu-admit @ 2% \d+% \(([\d,]+) rows a batch; copy rows by default: ([\d,]+); set full: "
                      r"([\d,]+) a batch\)", out.getvalue())
    assert found, out.getvalue()
    row = json.loads((tmp_path / "run.json").read_text())["results"][0]
    assert row["stats_batches"] == 16 and row["stats_misses_no_slot"] > 16 * 8  # more than the copy rows
    assert int(found.group(1).replace(",", "")) == round(row["stats_misses_no_slot"] / row["stats_batches"])
    assert int(found.group(2).replace(",", "")) == CacheConfig().copy_rows(row["cache_rows"]) == row["cache_rows"] // 16
    assert int(found.group(3).replace(",", "")) == round(row["stats_misses_set_full"] / row["stats_batches"])


# --------------------------------------------------------------------------------------------
# Pipeline depth, warm-up, several lookahead windows.
# --------------------------------------------------------------------------------------------

SIMULATED = tuple(CACHE_POLICIES)  # every policy of the cache


def small_trace():
    """Batches of ~200 unique rows against caches of 256-1024 slots: depth 2 locks ~600 rows."""
    return zipf_trace(20_000, 1.05, 64, 4, 40, seed=1)


def simulator(policy, slots, options, **overrides):
    from tiered_tbe.cache.simulator import CacheSimulator

    settings = dict(lfu_decay_interval=options.lfu_decay_interval, training=options.training,
                    row_bytes=options.row_bytes, lookahead_window=options.lookahead_window,
                    pipeline_depth=options.pipeline_depth)
    settings.update(overrides)
    return CacheSimulator(slots, options.associativity, policy, **settings)


def minus(total: CacheStats, before: CacheStats) -> CacheStats:
    return CacheStats(**{f.name: getattr(total, f.name) - getattr(before, f.name) for f in fields(CacheStats)})


@pytest.mark.parametrize("policy", SIMULATED)
def test_pipeline_depth_counts_as_the_simulator_does(policy):
    trace = small_trace()
    for slots in (256, 1024):
        by_depth = {}
        for depth in (0, 1, 2, 4):
            options = SimOptions(associativity=8, lookahead_window=3, pipeline_depth=depth)
            got = POLICIES[policy].run(trace, slots, options)
            assert got == simulate(trace.rows, trace.batch_offsets, slots, 8, policy, row_bytes=options.row_bytes,
                                   lookahead_window=3, pipeline_depth=depth), (slots, depth)
            by_depth[depth] = got
        # The locks of the batches in flight change the counts (lookahead-admit, which refuses most misses of
        # this trace, only at some depths).
        assert any(by_depth[depth] != by_depth[0] for depth in (1, 2, 4)), slots
        assert by_depth[4].misses_no_slot > by_depth[0].misses_no_slot, slots


@pytest.mark.parametrize("bound", ["fa-lru", "belady"])
def test_bounds_ignore_the_pipeline_depth(bound):
    trace = small_trace()
    serial = POLICIES[bound].run(trace, 512, SimOptions(associativity=8))
    assert POLICIES[bound].run(trace, 512, SimOptions(associativity=8, pipeline_depth=3)) == serial


@pytest.mark.parametrize("policy", SIMULATED)
@pytest.mark.parametrize("depth", [0, 2])
def test_warmup_counts_are_the_whole_run_minus_the_warmup(policy, depth):
    trace = small_trace()
    warmup = 15
    options = SimOptions(associativity=8, lookahead_window=4, pipeline_depth=depth)
    for slots in (256, 1024):
        got = POLICIES[policy].run(trace, slots, replace(options, warmup_batches=warmup))
        whole = simulate(trace.rows, trace.batch_offsets, slots, 8, policy, row_bytes=options.row_bytes,
                         lookahead_window=4, pipeline_depth=depth)
        # The warm-up alone: the same cache over the first batches, its window looking past them.
        prefix = simulator(policy, slots, options).run(trace.rows, trace.batch_offsets, warmup).stats
        assert got == minus(whole, prefix), (slots, depth)
        assert got.batches == trace.num_batches - warmup
        assert got.lookups == trace.batch_offsets[-1] - trace.batch_offsets[warmup]
        if not CACHE_POLICIES[policy].reads_window:  # no window: the prefix alone is a trace of its own
            end = trace.batch_offsets[warmup]
            alone = simulate(trace.rows[:end], trace.batch_offsets[: warmup + 1], slots, 8, policy,
                             row_bytes=options.row_bytes, pipeline_depth=depth)
            assert alone == prefix
    # A measurement's rates and rows per batch are over the counted batches.
    m = measure(trace, policy, 256, replace(options, warmup_batches=warmup), "x")
    assert m.rows_moved_per_batch == (m.stats.rows_copied_in + m.stats.write_backs) / (trace.num_batches - warmup)


def test_warmup_of_the_bounds():
    trace = small_trace()
    warmup, slots = 15, 512
    options = SimOptions(associativity=8, warmup_batches=warmup)
    # Fully associative LRU is the simulator's LRU with one set of every slot.
    fa = POLICIES["fa-lru"].run(trace, slots, options)
    one_set = simulator("lru", slots, replace(options, associativity=slots))
    before = one_set.run(trace.rows, trace.batch_offsets, warmup).stats
    assert fa == minus(one_set.run(trace.rows[trace.batch_offsets[warmup]:],
                                   trace.batch_offsets[warmup:] - trace.batch_offsets[warmup]).stats, before)
    # Belady: counted over the same batches as every policy; warm-up plus the rest is the whole run.
    optimum = POLICIES["belady"].run(trace, slots, options)
    lru = POLICIES["lru"].run(trace, slots, options)
    for name in ("batches", "lookups", "unique_rows"):
        assert getattr(optimum, name) == getattr(lru, name), name
    end = trace.batch_offsets[warmup]
    warm = belady(trace.rows[:end], trace.batch_offsets[: warmup + 1], slots, row_bytes=options.row_bytes,
                  num_rows=trace.num_rows,
                  next_uses=next_use(trace.rows, trace.batch_offsets, trace.num_rows)[:end])
    assert minus(POLICIES["belady"].run(trace, slots, SimOptions(associativity=8)), warm) == optimum
    assert optimum.unique_hits >= lru.unique_hits and 0 < optimum.hit_rate_by_lookup < 1


def test_several_lookahead_windows_give_one_policy_each():
    import io

    from tiered_tbe.hit_rate.command import build_parser, run

    args = build_parser().parse_args(["--rows", "20000", "--batch-size", "64", "--bag-size", "4", "--batches", "30",
                                      "--cache-sizes", "512", "--associativity", "8", "--policies",
                                      "lru,lookahead,belady", "--lookahead-window", "2,4,16,4", "--pipeline-depth",
                                      "1", "--warmup", "5", "--no-progress"])
    assert args.lookahead_window == [2, 4, 16]  # repeats dropped
    out = io.StringIO()
    assert run(args, out) == 0
    text = out.getvalue()
    assert "lookahead windows 2, 4, 16 batches" in text and "pipeline depth 1 (the bounds ignore it" in text
    assert "batches 5..29 (25 of the 30 run, after 5 of warm-up)" in text
    table = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith(("lru ", "lookahead"))}
    assert set(table) == {"lru", "lookahead(2)", "lookahead(4)", "lookahead(16)"}
    trace = zipf_trace(20_000, 1.05, 64, 4, 30, seed=0)
    moved = set()
    for window in (2, 4, 16):
        options = SimOptions(associativity=8, lookahead_window=window, pipeline_depth=1, warmup_batches=5)
        expected = POLICIES["lookahead"].run(trace, 512, options)
        m = measure(trace, f"lookahead({window})", 512, replace(options, lookahead_window=99), "512")
        assert m.stats == expected and m.options.lookahead_window == window
        assert table[f"lookahead({window})"][5] == f"{100 * expected.hit_rate_by_lookup:.2f}"
        moved.add(m.rows_moved_per_batch)
    assert len(moved) == 3  # the windows differ
    # One window: the policy keeps its plain name.
    assert expand_policies(["lru", "lookahead"], [8]) == ["lru", "lookahead"]
    assert expand_policies(["lookahead", "belady"], [8, 32]) == ["lookahead(8)", "lookahead(32)", "belady"]


def test_full_window_keeps_the_last_batches_as_future_only():
    from tiered_tbe.hit_rate.command import build_parser, options_from_args, trace_from_args

    args = build_parser().parse_args(["--rows", "20000", "--batch-size", "64", "--bag-size", "4", "--batches", "30",
                                      "--policies", "lru,lookahead", "--lookahead-window", "3,6", "--full-window",
                                      "--warmup", "4"])
    trace, options = trace_from_args(args), options_from_args(args)
    assert trace.num_batches == 36 and options.future_batches == 6 and options.batches_run(trace) == 30
    for policy in ("lru", "lookahead"):
        got = POLICIES[policy].run(trace, 512, replace(options, lookahead_window=6))
        sim = simulator(policy, 512, replace(options, lookahead_window=6))
        before = sim.run(trace.rows, trace.batch_offsets, 4).stats
        assert got == minus(_continue(sim, trace, 4, 30), before)
        assert got.batches == 26
        # A shrunk window changes which unneeded rows go first, not the counters (here exactly; in
        # general up to ties between needed rows of the same next and last use, broken by way).
        end = trace.batch_offsets[30]
        shrunk = Trace(rows=trace.rows[:end], batch_offsets=trace.batch_offsets[:31], table_rows=trace.table_rows,
                       batch_bag_offsets=trace.batch_bag_offsets[:31], bag_size=trace.bag_size)
        assert POLICIES[policy].run(shrunk, 512, replace(options, lookahead_window=6, future_batches=0)) == got


def _continue(sim, trace, start, stop):
    """Run ``sim`` (which ran batches ``0 .. start-1``) on to batch ``stop - 1``, the rest its future."""
    first = trace.batch_offsets[start]
    return sim.run(trace.rows[first:], trace.batch_offsets[start:] - first, stop - start).stats


@pytest.mark.parametrize(("flags", "message"), [
    (["--pipeline-depth", "-1"], "--pipeline-depth: expected a whole number >= 0, got '-1'"),
    (["--warmup", "-2"], "--warmup: expected a whole number >= 0, got '-2'"),
    (["--lookahead-window", ""], "--lookahead-window: expected a window >= 1"),
    (["--lookahead-window", "8,,16"], "--lookahead-window: expected a window >= 1"),
    (["--lookahead-window", "8,0"], "--lookahead-window: expected a window >= 1"),
    (["--warmup", "20"], "--warmup 20 must be less than the batches run, 20"),
    (["--warmup", "25"], "--warmup 25 must be less than the batches run, 20"),
])
def test_bad_depth_warmup_and_windows_are_usage_errors(capsys, flags, message):
    from tiered_tbe.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "hit-rate", "--rows", "5000", "--batch-size", "64", "--bag-size", "4", "--batches", "20",
              "--cache-sizes", "5%", "--policies", "lru", "--no-progress", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_options_from_python():
    trace = small_trace()
    for bad in (dict(pipeline_depth=-1), dict(warmup_batches=-1), dict(lookahead_window=-3)):
        with pytest.raises(ValueError, match="must be a whole number >= 0"):
            SimOptions(**bad)
    with pytest.raises(ValueError, match="--warmup 40 must be less than the batches run, 40"):
        POLICIES["lru"].run(trace, 256, SimOptions(associativity=8, warmup_batches=40))
    with pytest.raises(ValueError, match="must be less than the batches run, 30 \\(of 40, less 10"):
        measure(trace, "belady", 256, SimOptions(associativity=8, warmup_batches=30, future_batches=10), "x")
    with pytest.raises(ValueError, match="unknown policy"):
        measure(trace, "lookahead(x)", 256, SimOptions(associativity=8), "x")


@pytest.mark.parametrize("depth", [0, 2])
def test_real_cache_with_depth_and_warmup_agrees_with_the_simulator(depth):
    from tiered_tbe.hit_rate.real_cache import run_slot_cache

    trace = zipf_trace(4_000, 1.05, 32, 4, 14, seed=0)
    options = SimOptions(associativity=8, lookahead_window=3, pipeline_depth=depth, warmup_batches=4,
                         future_batches=2)
    for name, entry in CACHE_POLICIES.items():  # every policy of the registry, a windowed one told 3 batches
        policy = f"{name}(3)" if entry.reads_window else name
        expected = measure(trace, policy, 120, options, "3%").stats
        assert run_slot_cache(trace, policy, 120, options) == expected, policy
        assert expected.batches == 8 and expected.evictions > 0
        if entry.refuses_misses:  # refused misses, each barred while its batch is in flight
            assert expected.misses_no_slot > 0, policy
    with pytest.raises(ValueError, match="MAX_LOOKAHEAD = 64"):  # the cache's hints reach 64 batches
        run_slot_cache(trace, "lookahead(65)", 120, options)
